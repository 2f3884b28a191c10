#!/usr/bin/env bash
# One device call: Nsight Compute warp-stall profile of the store kernels (store_stalls.py), or of
# the kernels matching STALLS_KERNEL launched by the script and arguments in STALLS_CMD, e.g.
#   STALLS_KERNEL=gather_pairs STALLS_CMD="tools/profile_sizes.py 4096" bash tools/store_stalls.sh
# Usage (on the lent GPU machine): bash tools/store_stalls.sh   (results under $OUT)
set -uo pipefail
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
repo=$PWD
python3 -m pip install --no-build-isolation --no-deps -q ${NVFP4KV_PIP_ARGS:-} . > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
cd /tmp
cmd=${STALLS_CMD:-"tools/store_stalls.py ${STALLS_ARGS:-}"}
ncu --clock-control none -k regex:"${STALLS_KERNEL:-store_kernel}" --set full --import-source no -f -o "$OUT/stalls" \
  python3 "$repo/"$cmd > "$OUT/ncu.log" 2>&1 || tail -20 "$OUT/ncu.log"
ncu -i "$OUT/stalls.ncu-rep" --page raw --csv > "$OUT/stalls_raw.csv" 2>&1
python3 - "$OUT/stalls_raw.csv" <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
head, units, data = rows[0], rows[1], rows[2:]
want = [i for i, h in enumerate(head) if h in ("Kernel Name", "gpu__time_duration.sum", "launch__registers_per_thread",
        "sm__warps_active.avg.pct_of_peak_sustained_active", "smsp__issue_active.avg.pct_of_peak_sustained_active",
        "dram__throughput.avg.pct_of_peak_sustained_elapsed", "smsp__inst_executed.sum",
        "lts__t_sectors_srcunit_tex_op_write.sum", "dram__bytes_write.sum", "dram__bytes_read.sum",
        "sm__cycles_elapsed.avg.per_second")
        or (h.startswith("smsp__average_warps_issue_stalled_") and h.endswith("_per_issue_active.ratio"))]
for r in data:
    print("----")
    for i in want:
        v = r[i]
        try:
            if float(v) < 0.05 and "stalled" in head[i]:
                continue
        except ValueError:
            pass
        print(f"  {head[i].replace('smsp__average_warps_issue_stalled_', 'stall ')[:70]:70s} {v[:60]}")
PY
