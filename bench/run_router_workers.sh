#!/usr/bin/env bash
# `kvforge router --workers N` scaling on the 16-core H200 host (issue 31), in one command, <= 5 minutes: the
# router (1, 2, 4 workers), 5 fake backends and 6 load generators each on cores of their own
# (bench/bench_router_workers.py), error-free max rate, p50/p99 added latency, CPU per request and stickiness
# across workers. No GPU is used; the host's cores are the point.
#
# Usage: bash bench/run_router_workers.sh [OUT]
#   OUT (default $OUT, else bench/results/router_workers): router_workers.csv / .png / .log,
#   router_workers_summary.json, machine.txt.
#   The device lacks httptools and uvloop (and msgspec, pyzmq): run bench/device_assets.sh here first and carry
#   [".whl"]; their wheels are installed to /tmp/site. Knobs (environment): WORKERS (1,2,4), RATES (the ladder,
#   requests/s), WINDOW_S (3), BACKENDS (5), LOADGENS (6), LIMIT_S (285, the bench's timeout), ARGS (more flags,
#   e.g. --share-cores on a machine with fewer than max(WORKERS) + BACKENDS + LOADGENS + 1 cores).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-bench/results/router_workers}}
mkdir -p "$OUT"
wheels=()
for w in httptools uvloop msgspec pyzmq xxhash; do
  for f in .whl/"$w"-*.whl; do [ -f "$f" ] && wheels+=("$f"); done
done
if [ ${#wheels[@]} -gt 0 ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "${wheels[@]}" || { echo "!! wheel install failed"; exit 1; }
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export KVFORGE_GIT_REV=${KVFORGE_GIT_REV:-$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}
{ date -u; uptime; echo "cores $(nproc)"; lscpu 2>/dev/null | grep -E "Model name|^CPU\(s\)|Thread|NUMA node"
  python3 -c 'import sys, aiohttp, httptools, uvloop, msgspec, zmq
print("python", sys.version.split()[0], "aiohttp", aiohttp.__version__, "httptools", httptools.__version__,
      "uvloop", uvloop.__version__, "msgspec", msgspec.__version__, "pyzmq", zmq.__version__)'; } 2>&1 \
  | tee "$OUT/machine.txt"
missing=$(python3 -c 'import importlib.util as u
print(" ".join(m for m in ("httptools", "uvloop", "msgspec", "zmq", "xxhash", "numpy", "aiohttp", "prometheus_client")
               if u.find_spec(m) is None))')
[ -z "$missing" ] || { echo "!! missing: $missing (bash bench/device_assets.sh here, then carry .whl)"; exit 1; }
timeout "${LIMIT_S:-285}" python3 bench/bench_router_workers.py --out "$OUT" --workers "${WORKERS:-1,2,4}" \
  --rates "${RATES:-500,1000,1500,2000,2500,3000,4000,5000,6000,8000}" --window-s "${WINDOW_S:-3}" \
  --backends "${BACKENDS:-5}" --loadgens "${LOADGENS:-6}" ${ARGS:-} 2>&1 | tee -a "$OUT/bench.log"
status=${PIPESTATUS[0]}
[ "$status" -eq 0 ] || echo "!! bench failed or timed out (status $status); router_workers.csv keeps the windows done"
{ date -u; uptime; } | tee -a "$OUT/machine.txt"
exit "$status"
