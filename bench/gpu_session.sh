#!/bin/bash
# Issue 26's measurements on a lent GPU machine, in the order they matter, each group in a
# process of its own (a CUDA error in one cannot spoil the next), logs under $OUT.
#
#   bash bench/gpu_session.sh            # from the repository root, on the GPU machine
#
# The machine has Python, torch with CUDA and numpy, no apt and no network
# (../shared/notes/gpu-machine.md).  It builds the native modules without liburing.  The node
# imports google-crc32c: put a wheel of it for that Python in $WHEELS (default gpu_wheels/,
# untracked), made here with
#   pip download google-crc32c --python-version 3.12 --platform manylinux2014_x86_64 \
#       --only-binary=:all: --no-deps -d gpu_wheels
# Both directories are git-ignored: the device tool's run takes the wheels along with
# carry=["gpu_wheels"].  About 4 minutes of device time after the build (25-35 s); the 128k
# row is last.
set -u
cd "$(dirname "$0")/.."
O=${OUT:-gpu-out}
W=${WHEELS:-gpu_wheels}
mkdir -p "$O"
T0=$(date +%s)
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda)"; nproc; } \
  > "$O/env.txt" 2>&1
cat "$O/env.txt"
QUILLCACHE_NO_URING=1 timeout 150 python3 setup.py -q build_ext --inplace -j "$(nproc)" > "$O/build.log" 2>&1 \
  || { echo "build failed:"; tail -30 "$O/build.log"; exit 1; }
DEP=""
if ! python3 -c "import google_crc32c" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target "$O/.dep" "$W"/google_crc32c-*.whl > "$O/dep.log" 2>&1 \
    || { echo "no google-crc32c for this Python: see the top of this script"; cat "$O/dep.log"; exit 1; }
  DEP=":$O/.dep"
fi
export PYTHONPATH="src$DEP"
echo "built in $(( $(date +%s) - T0 )) s"

run() {
  local name=$1 limit=$2; shift 2
  local t; t=$(date +%s)
  timeout "$limit" python3 bench/gpu_reload.py "$@" > "$O/$name.log" 2>&1
  echo "== $name: exit $? in $(( $(date +%s) - t )) s (at $(( $(date +%s) - T0 )) s)"
  grep -E "^\| |suffix attention|note|FAILED|Error" "$O/$name.log" | grep -v -e "^|---" -e "^| shape" | tail -14
}
# the copy engines against the gather kernel first: the 8k targets are the ones missed
run c8k-dma 120 --connector --rounds 5 --shape llama-3-8b --prefix 8192 --kv-dtype auto,fp8_e4m3 \
  --load-path layered-dma,layered,staged
run c32k-dma 150 --connector --rounds 3 --shape llama-3-8b --prefix 32768 --kv-dtype auto,fp8_e4m3 \
  --load-path layered-dma,layered
run c70b 150 --connector --rounds 3 --shape llama-3-70b --layers 8 --prefix 8192,32768 --kv-dtype auto,fp8_e4m3 \
  --load-path layered-dma,layered
run direct 100 --prefix 8192,32768 --eager --no-tcp --rounds 3
run c128k 180 --connector --rounds 2 --shape llama-3-8b --prefix 131072 --kv-dtype auto --load-path layered-dma,layered
echo "total $(( $(date +%s) - T0 )) s"
