set -uo pipefail
OUT=${OUT:-/tmp/out}; repo=$PWD
python3 -m pip install --no-build-isolation --no-deps -q -C cmake.define.NVFP4KV_CUDA_ARCHS=90-real -C build-dir=/tmp/bdef . > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
cd /tmp
ncu --clock-control none -k regex:'store_kernel|elementwise' --set full --import-source no -f -o "$OUT/small" python3 "$repo/benchmarks/profile_sizes.py" --reference --padded 1 > "$OUT/ncu.log" 2>&1 || tail -20 "$OUT/ncu.log"
ncu -i "$OUT/small.ncu-rep" --page details > "$OUT/small_details.txt" 2>&1
ncu -i "$OUT/small.ncu-rep" --page raw --csv > "$OUT/small_raw.csv" 2>&1
grep -E "^  [a-z_:<>A-Z]|Duration|Elapsed Cycles|SM Active Cycles|Warp Cycles Per Issued|Registers Per|Block Size|Grid Size" "$OUT/small_details.txt" | head -150
