#!/usr/bin/env bash
# The whole GPU job in one command (H200): the test suite at GPU sizes, then every benchmark.
# Usage: bash bench/run_gpu_suite.sh [OUT_DIR] [--quick]
# Logs go to OUT_DIR (default bench/results/gpu_run); CSV/PNG results to OUT_DIR too, and then into
# bench/results/ when OUT_DIR is elsewhere. Works without installing the package (PYTHONPATH=repo root).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-bench/results/gpu_run}
QUICK=${2:-}
mkdir -p "$OUT_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export KVFORGE_GIT_REV=${KVFORGE_GIT_REV:-$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}
[ -d .flashinfer ] && export PYTHONPATH="$PWD/.flashinfer:$PYTHONPATH" FLASHINFER_WORKSPACE_BASE=/tmp/fiws

status=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT_DIR/gpu.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.version.cuda)' \
  | tee -a "$OUT_DIR/gpu.txt"

echo "== self-check"; python3 -m kvforge selfcheck 2>&1 | tee "$OUT_DIR/selfcheck.log" || status=1
echo "== tests"; python3 -m pytest -q -n 4 -p no:cacheprovider tests 2>&1 | tee "$OUT_DIR/tests.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

# Kernel benchmarks only: the host-side ones (router, cache replay) need the trace, which stays on the CPU side.
for name in bench_small_copies bench_kv_pack bench_mla_context; do
  b=bench/$name.py
  [ -f "$b" ] || { echo "!! $b missing"; status=1; continue; }
  echo "== $name"
  # shellcheck disable=SC2086
  python3 "$b" --out "$OUT_DIR" $QUICK 2>&1 | tee "$OUT_DIR/$name.log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "!! $name failed"; status=1; }
done
exit $status
