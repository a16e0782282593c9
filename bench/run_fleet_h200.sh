#!/usr/bin/env bash
# The fleet on one H200 (issue 30), in one command: the step-time profile of the real-size engine with the
# contention of two engines on the GPU, then two `kvforge serve` engines on that GPU behind `kvforge router` for
# conversation (KV events), cache-aware and round-robin, each compared with `kvforge simulate` on the profile.
# Sized for <= 8 minutes of wall time (each stage has its own timeout, and every stage writes as it goes).
#
# Usage: KVFORGE_TRACE=/path/to/mooncake_conversation_trace.jsonl bash bench/run_fleet_h200.sh [OUT]
#   OUT (default $OUT, else bench/results/gpu_fleet): profile JSON, fleet.csv, fleet_gpu_real.png,
#   fleet_raw_gpu_real.json, engine/router logs and one log per stage.
#   The trace does not travel with the repository: copy it into a carried, git-ignored folder (e.g. .gpu_data/)
#   and point KVFORGE_TRACE at it. Wheels in .whl/ (msgspec, pyzmq, fla-core) are installed to /tmp/site first.
#   Knobs (environment): CONVERSATIONS (30), TURNS (4), RATE (2.5 req/s), MAX_PROMPT (4096), BLOCK_TOKENS (128),
#   MAX_OUTPUT (32), PROFILE_S (180), FLEET_S (290): the two stages' timeouts in seconds; SIZE (real; tiny with
#   kvforge serve's default budgets checks the plumbing on a CPU), PROFILE_ARGS (extra profile_step_time flags,
#   e.g. "--max-len 64" for that check).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-bench/results/gpu_fleet}}
: "${KVFORGE_TRACE:?set KVFORGE_TRACE to the conversation trace (copied into a carried folder such as .gpu_data/)}"
[ -f "$KVFORGE_TRACE" ] || { echo "KVFORGE_TRACE=$KVFORGE_TRACE: no such file"; exit 2; }
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "!! wheel install failed"; exit 1; }
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 KVFORGE_TRACE
export KVFORGE_GIT_REV=${KVFORGE_GIT_REV:-$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}
CONVERSATIONS=${CONVERSATIONS:-30} TURNS=${TURNS:-4} RATE=${RATE:-2.5} MAX_PROMPT=${MAX_PROMPT:-4096}
BLOCK_TOKENS=${BLOCK_TOKENS:-128} MAX_OUTPUT=${MAX_OUTPUT:-32} PROFILE_S=${PROFILE_S:-180} FLEET_S=${FLEET_S:-290}
SIZE=${SIZE:-real}
# The engine's budgets: the profile and both fleet engines use the same (bench_fleet reads them from the profile).
ENGINE=(--attention-pages 16384 --state-pages 256 --max-num-tokens 8192 --max-num-requests 64
        --max-blocks-per-request 512)
[ "$SIZE" = real ] || ENGINE=()
PROFILE="$OUT/step_profile_h200_$SIZE.json"
status=0
{ date -u; uptime; nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } 2>&1 \
  | tee "$OUT/machine.txt"

echo "== profile (grid on one engine, then k = 1, 2 engines stepping at once on the GPU)"
timeout "$PROFILE_S" python3 bench/profile_step_time.py --size "$SIZE" "${ENGINE[@]}" --contention 2 \
  --contention-seconds 10 ${PROFILE_ARGS:-} --out "$PROFILE" 2>&1 | tee "$OUT/profile.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "!! profile failed or timed out"; exit 1; }

echo "== fleet: 2 engines on the GPU + router, three policies, then the simulator on the same slice"
timeout "$FLEET_S" python3 bench/bench_fleet.py --size "$SIZE" --engines 2 --profile "$PROFILE" \
  --conversations "$CONVERSATIONS" --turns "$TURNS" --block-tokens "$BLOCK_TOKENS" --max-prompt "$MAX_PROMPT" \
  --max-output "$MAX_OUTPUT" --rate "$RATE" --probe 20 --out "$OUT" --log-dir "$OUT/logs" 2>&1 \
  | tee "$OUT/fleet.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "!! fleet bench failed or timed out (fleet_raw_*.json keeps the policies that finished)"; status=1; }
{ date -u; uptime; } | tee -a "$OUT/machine.txt"
exit $status
