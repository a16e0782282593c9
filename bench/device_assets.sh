#!/usr/bin/env bash
# Build what a GPU run needs but the H200 machine lacks (it has no network), into git-ignored folders that the
# device tool carries: .whl/ (cp312 manylinux wheels of fla-core, msgspec, pyzmq, and httptools and uvloop for
# `kvforge router`'s HTTP layer and event loop, which the device lacks) and .flashinfer/ (FlashInfer
# 0.2.14.post1 from its source distribution, JIT-compiled there on first use, about 36 MB), and .gpu_data/
# (the serving trace, for the fleet run). Usage: bash bench/device_assets.sh [TRACE_JSONL]
# On the device: python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade
#   --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site, then carry [".whl", ".flashinfer", ".gpu_data"].
set -euo pipefail
cd "$(dirname "$0")/.."
TRACE=${1:-../shared/data/mooncake_conversation_trace.jsonl}
plat=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  plat+=(--platform "$p")
done
mkdir -p .whl
for w in fla-core==0.6.0 msgspec==0.23.0 pyzmq==27.3.0 httptools==0.9.0 uvloop==0.23.0; do
  ls .whl | grep -qi "^$(echo "${w%%==*}" | tr - _)-${w##*==}-" && continue
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
    -d .whl "$w"
done
if [ ! -d .flashinfer/flashinfer ]; then
  tmp=$(mktemp -d)
  python3 -m pip download -q --no-deps -d "$tmp" flashinfer-python==0.2.14.post1
  tar -xzf "$tmp"/flashinfer_python-0.2.14.post1.tar.gz -C "$tmp"
  src="$tmp/flashinfer_python-0.2.14.post1"
  mkdir -p .flashinfer/flashinfer/data/cutlass .flashinfer/flashinfer/data/spdlog
  cp -r "$src"/flashinfer/. .flashinfer/flashinfer/
  cp -r "$src"/csrc "$src"/include .flashinfer/flashinfer/data/
  [ -d "$src"/tvm_binding ] && cp -r "$src"/tvm_binding .flashinfer/flashinfer/data/
  cp -r "$src"/3rdparty/cutlass/include "$src"/3rdparty/cutlass/tools .flashinfer/flashinfer/data/cutlass/
  cp -r "$src"/3rdparty/spdlog/include .flashinfer/flashinfer/data/spdlog/
  rm -rf "$tmp"
fi
mkdir -p .gpu_data
[ -f "$TRACE" ] && cp "$TRACE" .gpu_data/
du -sh .whl .flashinfer .gpu_data
