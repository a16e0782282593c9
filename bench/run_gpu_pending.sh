#!/usr/bin/env bash
# GPU runs written in sessions without a device, one stage per device call (each well under the 10-minute call
# limit). Usage, on the H200, from the repo root: bash bench/run_gpu_pending.sh STAGE [OUT_DIR]
#   tests     GPU tests not yet run there: key shares in the one call (test_mla_context_splits), share-run replay
#             (test_mla_context_replay), the token-major -> dim-major transpose and the copies
#             (test_mla_context_nosync -k "dim_major or copy"), quantize_fp8 on the hardware e4m3 conversion
#             (test_quantize_fp8 -m gpu, test_fp8_encoder -m gpu: every byte equal to the integer encoder's), and
#             the fused ops with specialised strides (test_fused_ops, GPU sizes), the latent-row store
#             (test_mla_decode -k store: specialised row stride, hardware e4m3 conversion)
#   probe     bench/probe_repack_copy.py --transpose: v_to_dim_major's kernel against torch's copy_, its tile
#             candidates, quantize_v_dim_major against quantize_fp8 of the same V, and quantize_fp8 with the
#             hardware e4m3 conversion against the integer encoder (the kernel launched with NATIVE off and on)
#   grid S    bench/bench_mla_context.py --random 24 --seed S (every path, the transposed one included)
#   decode S  the decode merge kernel's tests (its partial loads now 16 bytes wide), then
#             bench/bench_mla_decode_grid.py --random 12 --seed S (eager, graph, e4m3 against FlashInfer fa3)
#   engine    the FP8-latent graph and fused-form engine tests, then bench_engine.py's prefill with V dim-major
#             against token-major (needs the .whl folder of bench/device_assets.sh: fla-core, msgspec, pyzmq)
# Before the first call, on the CPU side: bash bench/device_assets.sh; carry [".whl", ".flashinfer", ".gpu_data"].
# Logs go to OUT_DIR (default $OUT, else bench/results/pending) as one .tgz per stage plus a summary.
set -uo pipefail
cd "$(dirname "$0")/.."
STAGE=${1:?stage: tests, probe, grid SEED, decode SEED or engine}
if [ "$STAGE" = grid ] || [ "$STAGE" = decode ]; then
  SEED=${2:?grid needs a seed}
  OUT_DIR=${3:-${OUT:-bench/results/pending}}
else
  OUT_DIR=${2:-${OUT:-bench/results/pending}}
fi
mkdir -p "$OUT_DIR"
LOGS=$(mktemp -d)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export KVFORGE_GIT_REV=${KVFORGE_GIT_REV:-$(git rev-parse --short=7 HEAD 2>/dev/null || echo unknown)}
[ -d .flashinfer ] && export PYTHONPATH="$PWD/.flashinfer:$PYTHONPATH" FLASHINFER_WORKSPACE_BASE=/tmp/fiws
if [ -d .whl ] && [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
[ -d /tmp/site ] && export PYTHONPATH="$PYTHONPATH:/tmp/site"
SUMMARY="$OUT_DIR/summary_$STAGE.txt"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'
  echo "git $KVFORGE_GIT_REV, stage $STAGE"; } 2>&1 | tee "$SUMMARY"
trap 'tar -czf "$OUT_DIR/$STAGE.tgz" -C "$LOGS" . 2>/dev/null' EXIT
status=0

run_pytest() {  # log name, limit in seconds, pytest arguments... (one process per file: a CUDA fault stays in it)
  local name=$1 limit=$2
  shift 2
  timeout "$limit" python3 -m pytest -v -p no:cacheprovider --tb=short -rfE "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  [ $rc -eq 124 ] && echo "!! $name: cut at $limit s" | tee -a "$SUMMARY"
  echo "$name: $(grep -c " PASSED" "$LOGS/$name.log") passed, $(grep -c " FAILED" "$LOGS/$name.log") failed" \
    | tee -a "$SUMMARY"
  grep -E "^(FAILED|ERROR) " "$LOGS/$name.log" | head -20 | tee -a "$SUMMARY"
  [ $rc -eq 0 ] || [ $rc -eq 5 ] || status=1
}

case "$STAGE" in
  tests)
    run_pytest splits 150 tests/test_mla_context_splits.py -m gpu
    run_pytest replay 100 tests/test_mla_context_replay.py -m gpu
    run_pytest nosync 150 tests/test_mla_context_nosync.py -k "dim_major or copy"
    run_pytest quantize 60 tests/test_quantize_fp8.py -m gpu
    run_pytest encoder 60 tests/test_fp8_encoder.py -m gpu
    run_pytest fused 120 tests/test_fused_ops.py
    run_pytest store_latent 100 tests/test_mla_decode.py -k store
    ;;
  probe)
    python3 bench/probe_repack_copy.py --transpose --out "$LOGS" 2>&1 | tee "$LOGS/probe.log" | tail -40 \
      | tee -a "$SUMMARY" || status=1
    ;;
  grid)
    python3 bench/bench_mla_context.py --random 24 --seed "$SEED" --skip-extras --rep-ms 40 --deadline-s 400 \
      --out "$LOGS" > "$LOGS/grid_$SEED.log" 2>&1 || status=1
    tail -45 "$LOGS/grid_$SEED.log" | tee -a "$SUMMARY"
    ;;
  decode)
    run_pytest decode_merge 150 tests/test_mla_decode.py -k merge
    timeout 400 python3 bench/bench_mla_decode_grid.py --random 12 --seed "$SEED" > "$LOGS/decode_$SEED.log" 2>&1 \
      || status=1
    tail -25 "$LOGS/decode_$SEED.log" | tee -a "$SUMMARY"
    cp bench/results/mla_decode_grid.csv bench/results/mla_decode_grid_random12_seed"$SEED"*.png "$LOGS"/ 2>/dev/null
    ;;
  engine)
    run_pytest engine_gpu 330 tests/test_engine_gpu.py -k "fp8_latent_greedy_identity_with_cuda_graphs or fused_forms"
    timeout 200 python3 bench/bench_engine.py --budget-s 150 --out "$LOGS" > "$LOGS/engine.log" 2>&1 \
      || status=1
    grep -E "^prefill" "$LOGS/engine.log" | tee -a "$SUMMARY"
    ;;
  *)
    echo "unknown stage $STAGE (tests, probe, grid SEED, decode SEED, engine)" >&2
    exit 2
    ;;
esac
exit $status
