#!/usr/bin/env bash
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD:$PWD/.flashinfer:/tmp/site FLASHINFER_WORKSPACE_BASE=/tmp/fiws PYTHONUNBUFFERED=1 KVFORGE_GIT_REV=$(cat .gpu/rev)
mkdir -p $OUT/logs
t0=$(date +%s)
timeout 150 python3 bench/bench_engine_speed.py --phases prefill_syncs > $OUT/logs/syncs.log 2>&1; echo "syncs rc=$? $(( $(date +%s)-t0 ))s"
timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_mla_context.py tests/test_fused_ops.py -k "narrow or real_sizes" > $OUT/logs/t1.log 2>&1; echo "t1 rc=$? $(( $(date +%s)-t0 ))s"
timeout $(( 570 - ($(date +%s)-t0) )) python3 -m pytest -v -p no:cacheprovider -m gpu tests/test_engine_gpu.py -k "not (fp8_latent or chunked or component or fused)" > $OUT/logs/t2.log 2>&1; echo "t2 rc=$? $(( $(date +%s)-t0 ))s"
tail -n 3 $OUT/logs/t1.log; grep -E "PASS|FAIL|ERROR|passed|failed" $OUT/logs/t2.log | tail -20
grep -v Warn $OUT/logs/syncs.log | tail -32
cd $OUT && tar czf logs.tgz logs && rm -rf logs
