#!/usr/bin/env bash
# The whole GPU job in one command (H200): the self-check, the test suite at GPU sizes, then the kernel
# benchmarks. Usage: bash bench/run_gpu_suite.sh [OUT_DIR] [--quick]
#   BENCHES="bench_small_copies bench_kv_pack bench_mla_context"  which benchmarks to run (default: all three;
#                                                                  "none": no benchmark)
#   PYTEST_ARGS="tests"                                             what pytest runs (default: the whole suite;
#                                                                  "none": no tests)
#   SMALL=1                                                         also the small-size (not gpu-marked) tests
#   TESTS_S=400                                                     wall-clock limit of the GPU-marked tests
# pytest runs verbose (one line per test as it ends), so a run cut by a limit still says which tests passed and
# failed; every failure's short traceback is printed at the end. Logs, CSV and PNG files are packed into
# OUT_DIR/gpu_suite.tar.gz beside a summary (the device tool brings back at most 8 files). Needs no install: the
# repo root is put on PYTHONPATH, and a git-ignored .flashinfer/ folder (see bench/bench_mla_context.py) joins it.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT_DIR=${1:-bench/results/gpu_run}
QUICK=${2:-}
BENCHES=${BENCHES:-bench_small_copies bench_kv_pack bench_mla_context}
PYTEST_ARGS=${PYTEST_ARGS:-tests}
TESTS_S=${TESTS_S:-400}
mkdir -p "$OUT_DIR"
LOGS=$(mktemp -d)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export KVFORGE_GIT_REV=${KVFORGE_GIT_REV:-$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}
[ -d .flashinfer ] && export PYTHONPATH="$PWD/.flashinfer:$PYTHONPATH" FLASHINFER_WORKSPACE_BASE=/tmp/fiws
SUMMARY="$OUT_DIR/summary.txt"

status=0
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.version.cuda)'
  echo "git $KVFORGE_GIT_REV"; } 2>&1 | tee "$SUMMARY"

pack() {  # everything but the summary into one archive, whatever happened before
  tar -czf "$OUT_DIR/gpu_suite.tar.gz" -C "$LOGS" . 2>/dev/null
}
trap pack EXIT

echo "== self-check" | tee -a "$SUMMARY"
python3 -m kvforge selfcheck > "$LOGS/selfcheck.log" 2>&1 || status=1
tail -20 "$LOGS/selfcheck.log" | tee -a "$SUMMARY"

run_pytest() {  # name, limit in seconds, pytest arguments...
  local name=$1 limit=$2
  shift 2
  echo "== $name" | tee -a "$SUMMARY"
  timeout "$limit" python3 -m pytest -v -p no:cacheprovider --timeout 300 --tb=short -rfE "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  [ $rc -eq 124 ] && echo "!! $name: cut at ${limit} s (the lines below are what finished)" | tee -a "$SUMMARY"
  grep -E " (PASSED|FAILED|ERROR|SKIPPED)|^(FAILED|ERROR) |^=+ .*(passed|failed|error)" "$LOGS/$name.log" \
    | grep -vE " (PASSED|SKIPPED)" | tail -40 | tee -a "$SUMMARY"
  echo "$name: $(grep -c " PASSED" "$LOGS/$name.log") passed, $(grep -c " FAILED" "$LOGS/$name.log") failed" \
    | tee -a "$SUMMARY"
  [ $rc -eq 0 ] || status=1
}

if [ "$PYTEST_ARGS" != "none" ]; then
  # shellcheck disable=SC2086
  [ -n "${SMALL:-}" ] && run_pytest tests_small 600 -n 8 -m "not gpu" $PYTEST_ARGS
  # The full-size GPU tests one at a time (in parallel they run out of memory).
  # shellcheck disable=SC2086
  run_pytest tests_gpu "$TESTS_S" -m gpu $PYTEST_ARGS
fi

# Kernel benchmarks only: the host-side ones (router, cache replay) need the trace, which stays on the CPU side.
if [ "$BENCHES" != "none" ]; then
  for name in $BENCHES; do
    b=bench/$name.py
    [ -f "$b" ] || { echo "!! $b missing" | tee -a "$SUMMARY"; status=1; continue; }
    echo "== $name" | tee -a "$SUMMARY"
    # shellcheck disable=SC2086
    python3 "$b" --out "$LOGS" $QUICK > "$LOGS/$name.log" 2>&1 || { echo "!! $name failed" | tee -a "$SUMMARY"; status=1; }
    tail -15 "$LOGS/$name.log" | tee -a "$SUMMARY"
  done
fi
exit $status
