#!/usr/bin/env bash
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD:$PWD/.flashinfer:/tmp/site FLASHINFER_WORKSPACE_BASE=/tmp/fiws PYTHONUNBUFFERED=1 KVFORGE_GIT_REV=$(cat .gpu/rev)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
mkdir -p $OUT/logs
t0=$(date +%s)
timeout 330 python3 bench/bench_engine_speed.py --phases prefill prefill_profile engine --out $OUT/logs/speed > $OUT/logs/speed.log 2>&1; echo "speed rc=$? $(( $(date +%s)-t0 ))s"
timeout 120 python3 -m pytest -x -q -p no:cacheprovider tests/test_serve_warmup.py tests/test_mla_context.py tests/test_state_select.py tests/test_fused_ops.py -k "warmup or narrow or short or real_sizes" > $OUT/logs/t1.log 2>&1; echo "t1 rc=$? $(( $(date +%s)-t0 ))s"
timeout $(( 560 - ($(date +%s)-t0) )) python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_engine_gpu.py -k "fp8_latent or chunked or component or fused" > $OUT/logs/t2.log 2>&1; echo "t2 rc=$? $(( $(date +%s)-t0 ))s"
tail -3 $OUT/logs/t1.log $OUT/logs/t2.log
grep -E "prefill|engine batch|profiler" $OUT/logs/speed.log | head -30
cd $OUT && tar czf logs.tgz logs && rm -rf logs
