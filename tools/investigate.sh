#!/usr/bin/env bash
# One device call for looking into the kernels: the access-pattern ceilings (patterns.cu), then a
# full Nsight Compute profile of one store and one gather launch of 65536 tokens
# (tools/profile_sizes.py).
# Usage (on the lent GPU machine): bash tools/investigate.sh   (results under $OUT)
set -uo pipefail
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
repo=$PWD
echo "== $(date +%T) patterns"
nvcc -O3 -arch=sm_90 -o /tmp/patterns tools/patterns.cu && /tmp/patterns | tee "$OUT/patterns.txt"
echo "== $(date +%T) build"
python3 -m pip install --no-build-isolation --no-deps -q ${NVFP4KV_PIP_ARGS:-} . > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
echo "== $(date +%T) ncu"
cd /tmp
ncu --clock-control none -k regex:'store_kernel|gather' --launch-skip 2 --launch-count 2 --set full \
  --import-source no -f -o "$OUT/kernels" python3 "$repo/tools/profile_sizes.py" 65536 \
  > "$OUT/ncu.log" 2>&1 || tail -20 "$OUT/ncu.log"
ncu -i "$OUT/kernels.ncu-rep" --page details > "$OUT/ncu_details.txt" 2>&1
ncu -i "$OUT/kernels.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_source.csv" 2>&1
grep -E "Duration|DRAM Throughput|L2 Cache Throughput|L1/TEX Hit|L2 Hit|Registers Per|Achieved Occupancy|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Mem Busy|Max Bandwidth" "$OUT/ncu_details.txt"
echo "== $(date +%T) done"
