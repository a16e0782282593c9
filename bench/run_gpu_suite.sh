#!/usr/bin/env bash
# The whole GPU job in one command (H200): the self-check, the test suite at GPU sizes, then the kernel
# benchmarks. Usage: bash bench/run_gpu_suite.sh [OUT_DIR] [--quick]
#   BENCHES="bench_small_copies bench_kv_pack bench_mla_context"  which benchmarks to run (default: all three)
#   PYTEST_ARGS="tests"                                             what pytest runs (default: the whole suite)
# Logs, CSV and PNG files go to OUT_DIR (default bench/results/gpu_run). Needs no install: the repo root is put
# on PYTHONPATH, and a git-ignored .flashinfer/ folder (see bench/bench_mla_context.py) joins it when present.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-bench/results/gpu_run}
QUICK=${2:-}
BENCHES=${BENCHES:-bench_small_copies bench_kv_pack bench_mla_context}
PYTEST_ARGS=${PYTEST_ARGS:-tests}
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export KVFORGE_GIT_REV=${KVFORGE_GIT_REV:-$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}
[ -d .flashinfer ] && export PYTHONPATH="$PWD/.flashinfer:$PYTHONPATH" FLASHINFER_WORKSPACE_BASE=/tmp/fiws

status=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT_DIR/gpu.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.version.cuda)' \
  | tee -a "$OUT_DIR/gpu.txt"

echo "== self-check"
python3 -m kvforge selfcheck 2>&1 | tee "$OUT_DIR/selfcheck.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
if [ "$PYTEST_ARGS" != "none" ]; then
  echo "== tests"
  # Small-size tests in parallel; the full-size GPU tests one at a time (in parallel they run out of memory).
  # shellcheck disable=SC2086
  python3 -m pytest -q -n 8 -p no:cacheprovider --timeout 300 -m "not gpu" $PYTEST_ARGS 2>&1 | tee "$OUT_DIR/tests.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
  # shellcheck disable=SC2086
  python3 -m pytest -q -p no:cacheprovider --timeout 300 -m gpu $PYTEST_ARGS 2>&1 | tee "$OUT_DIR/tests_gpu.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

# Kernel benchmarks only: the host-side ones (router, cache replay) need the trace, which stays on the CPU side.
for name in $BENCHES; do
  b=bench/$name.py
  [ -f "$b" ] || { echo "!! $b missing"; status=1; continue; }
  echo "== $name"
  # shellcheck disable=SC2086
  python3 "$b" --out "$OUT_DIR" $QUICK 2>&1 | tee "$OUT_DIR/$name.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "!! $name failed"; status=1; }
done
exit $status
