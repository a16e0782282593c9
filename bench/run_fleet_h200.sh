#!/usr/bin/env bash
# The fleet on one H200 (issue 30), in two device calls, each well under one call's 10 minutes (start included):
#
#   STAGE=profile bash bench/run_fleet_h200.sh $OUT
#       the real-size engine's step profile with the contention of two engines on the GPU
#       (bench/profile_step_time.py --budget-s): $OUT/step_profile_h200_real.json, to commit under bench/results/.
#   STAGE=fleet PROFILE=bench/results/step_profile_h200_real.json \
#     KVFORGE_TRACE=.gpu_data/mooncake_conversation_trace.jsonl bash bench/run_fleet_h200.sh $OUT
#       two `kvforge serve` engines on the GPU behind `kvforge router` for conversation (KV events), round-robin and
#       cache-aware, one after the other on fresh fleets, each set against the simulator (`kvforge simulate`'s
#       engine with the profile, same slice, same arrivals): bench/bench_fleet.py --budget-s.
#
# Estimated script time on the H200 (basis in docs/serve.md, "On the H200"): profile ~1.5 min, fleet ~4-4.5 min.
# Each stage runs under a budget (PROFILE_BUDGET, FLEET_BUDGET: the bench trims its own work to fit and says what
# it skipped) inside a hard timeout (PROFILE_S, FLEET_S); each writes as it goes (the profile as soon as its fit
# exists, then with the contention curve; fleet.csv, the PNG and fleet_raw_gpu_real.json after every policy), so a
# timeout still leaves the log and what finished.
# OUT (default $OUT, else bench/results/gpu_fleet): the profile (+ profile.log), or fleet.csv, fleet_gpu_real.png,
#   fleet_raw_gpu_real.json, fleet.log and fleet_logs.tar.gz (every policy's engine, router and step logs, packed
#   at the end, timeout or not: a device call brings back at most 8 files from $OUT); machine.txt.
# The trace does not travel with the repository: copy it into a carried, git-ignored folder (e.g. .gpu_data/)
#   and point KVFORGE_TRACE at it. Wheels in .whl/ (msgspec, pyzmq, fla-core) are installed to /tmp/site first.
# Knobs (environment): CONVERSATIONS (30), TURNS (4), RATE (2.5 req/s), MAX_PROMPT (4096), BLOCK_TOKENS (128),
#   MAX_OUTPUT (32), POLICIES (conversation,round-robin,cache-aware: the two the issue compares first),
#   CONTENTION_S (8: seconds per contention phase, 3 phases), PROFILE_BUDGET (150) / PROFILE_S (220),
#   FLEET_BUDGET (320) / FLEET_S (380), PROFILE_ARGS / FLEET_ARGS (extra flags).
# The same on a CPU, to check the plumbing (tiny model, kvforge serve's default budgets, a smaller slice):
#   SIZE=tiny STAGE=profile bash bench/run_fleet_h200.sh /tmp/fleet
#   SIZE=tiny STAGE=fleet PROFILE=/tmp/fleet/step_profile_cpu_tiny.json bash bench/run_fleet_h200.sh /tmp/fleet
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-bench/results/gpu_fleet}}
STAGE=${STAGE:-}
SIZE=${SIZE:-real}
case "$STAGE" in
  profile|fleet) ;;
  *) echo "STAGE=profile or STAGE=fleet (two device calls; see the header of $0)"; exit 2 ;;
esac
[ "$SIZE" = real ] || [ "$SIZE" = tiny ] || { echo "SIZE=$SIZE: expected real or tiny"; exit 2; }
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "!! wheel install failed"; exit 1; }
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export KVFORGE_GIT_REV=${KVFORGE_GIT_REV:-$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}
if [ "$SIZE" = real ]; then
  # The engine's budgets: the profile and both fleet engines use the same (bench_fleet reads them from the profile).
  ENGINE=(--attention-pages 16384 --state-pages 256 --max-num-tokens 8192 --max-num-requests 64
          --max-blocks-per-request 512)
  CONVERSATIONS=${CONVERSATIONS:-30} TURNS=${TURNS:-4} RATE=${RATE:-2.5} MAX_PROMPT=${MAX_PROMPT:-4096}
  BLOCK_TOKENS=${BLOCK_TOKENS:-128} MAX_OUTPUT=${MAX_OUTPUT:-32} CONTENTION_S=${CONTENTION_S:-8}
  PROFILE_BUDGET=${PROFILE_BUDGET:-150} PROFILE_S=${PROFILE_S:-220} FLEET_BUDGET=${FLEET_BUDGET:-320}
  FLEET_S=${FLEET_S:-380} PROBE=${PROBE:-20} TAG=h200_real
else
  # The Triton interpreter: a prompt of 160 tokens takes seconds, so longer phases, a tiny slice, looser budgets.
  ENGINE=()
  CONVERSATIONS=${CONVERSATIONS:-4} TURNS=${TURNS:-2} RATE=${RATE:-0.5} MAX_PROMPT=${MAX_PROMPT:-64}
  BLOCK_TOKENS=${BLOCK_TOKENS:-4} MAX_OUTPUT=${MAX_OUTPUT:-4} CONTENTION_S=${CONTENTION_S:-30}
  PROFILE_BUDGET=${PROFILE_BUDGET:-600} PROFILE_S=${PROFILE_S:-720} FLEET_BUDGET=${FLEET_BUDGET:-500}
  FLEET_S=${FLEET_S:-600} PROBE=${PROBE:-5} TAG=cpu_tiny
  PROFILE_ARGS=${PROFILE_ARGS:---max-len 64}
fi
POLICIES=${POLICIES:-conversation,round-robin,cache-aware}
{ echo "stage $STAGE, size $SIZE, rev $KVFORGE_GIT_REV"; date -u; uptime
  nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv 2>/dev/null || echo "no GPU"
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } 2>&1 \
  | tee -a "$OUT/machine.txt"
status=0

if [ "$STAGE" = profile ]; then
  PROFILE="$OUT/step_profile_$TAG.json"
  echo "== profile: the grid on one engine, then k = 1, 2, 1 engines stepping at once (budget ${PROFILE_BUDGET} s)"
  # shellcheck disable=SC2086  # PROFILE_ARGS is a list of flags
  timeout -k 10 "$PROFILE_S" python3 bench/profile_step_time.py --size "$SIZE" "${ENGINE[@]}" --contention 2 \
    --contention-seconds "$CONTENTION_S" --budget-s "$PROFILE_BUDGET" ${PROFILE_ARGS:-} --out "$PROFILE" 2>&1 \
    | tee "$OUT/profile.log"
  rc=${PIPESTATUS[0]}
  if [ "$rc" -eq 3 ] && [ -f "$PROFILE" ]; then
    echo "!! profile written without the contention curve (see above); the fleet's shared-device simulation needs it"
    status=3
  elif [ "$rc" -ne 0 ]; then
    if [ -f "$PROFILE" ]; then
      echo "!! profile stage failed or timed out (rc $rc); $PROFILE holds the fit (without contention unless it says so)"
    else
      echo "!! profile stage failed or timed out (rc $rc); no profile written"
    fi
    status=1
  else
    echo "profile: $PROFILE (commit it under bench/results/, then run STAGE=fleet PROFILE=...)"
  fi
else
  : "${PROFILE:?set PROFILE to the step profile STAGE=profile wrote (e.g. bench/results/step_profile_h200_real.json)}"
  [ -f "$PROFILE" ] || { echo "PROFILE=$PROFILE: no such file"; exit 2; }
  if [ -n "${KVFORGE_TRACE:-}" ]; then
    [ -f "$KVFORGE_TRACE" ] || { echo "KVFORGE_TRACE=$KVFORGE_TRACE: no such file"; exit 2; }
    export KVFORGE_TRACE
  elif [ "$SIZE" = real ]; then
    echo "set KVFORGE_TRACE to the conversation trace (copied into a carried folder such as .gpu_data/)"; exit 2
  fi
  LOGS=$(mktemp -d "${TMPDIR:-/tmp}/kvforge-fleet-logs.XXXXXX")
  echo "== fleet: 2 engines on one device + router, policies $POLICIES, each then simulated (budget ${FLEET_BUDGET} s)"
  # shellcheck disable=SC2086  # FLEET_ARGS is a list of flags
  timeout -k 20 "$FLEET_S" python3 bench/bench_fleet.py --size "$SIZE" --engines 2 --profile "$PROFILE" \
    --policies "$POLICIES" --conversations "$CONVERSATIONS" --turns "$TURNS" --block-tokens "$BLOCK_TOKENS" \
    --max-prompt "$MAX_PROMPT" --max-output "$MAX_OUTPUT" --rate "$RATE" --probe "$PROBE" \
    --budget-s "$FLEET_BUDGET" --out "$OUT" --log-dir "$LOGS" ${FLEET_ARGS:-} 2>&1 | tee "$OUT/fleet.log"
  rc=${PIPESTATUS[0]}
  tar -czf "$OUT/fleet_logs.tar.gz" -C "$LOGS" . && echo "engine, router and step logs: $OUT/fleet_logs.tar.gz"
  if [ "$rc" -ne 0 ]; then
    echo "!! fleet stage failed or timed out (rc $rc): fleet.csv, the PNG and fleet_raw_*.json keep the policies that finished"
    status=1
  fi
fi
{ date -u; uptime; } | tee -a "$OUT/machine.txt"
exit $status
