#!/usr/bin/env bash
# Builds the store kernel with compile-time variants (CMAKE_CUDA_FLAGS) and times each on the
# same cases, for A/B decisions on the lent GPU. Usage: bash tools/store_variants.sh "FLAGS1" "FLAGS2" ...
set -uo pipefail
OUT=${OUT:-$PWD/device-out}
mkdir -p "$OUT"
i=0
for flags in "$@"; do
  i=$((i + 1))
  echo "== variant $i: $flags"
  python3 -m pip install --no-build-isolation --no-deps -q -C cmake.define.NVFP4KV_CUDA_ARCHS=90-real \
    -C "cmake.define.CMAKE_CUDA_FLAGS=$flags" -C build-dir=/tmp/variant$i . > "$OUT/variant$i.log" 2>&1 || { tail -20 "$OUT/variant$i.log"; continue; }
  (cd /tmp && python3 - "$flags" <<'PY' | tee -a "$OUT/variants.txt"
import sys, torch, nvfp4kv
from nvfp4kv import bench as B
c = B.measure_ceilings(torch, quick=True)
print(f"variant {sys.argv[1]!r}: copy {c['copy_GBps']:.0f} GB/s, empty {c['empty_launch_us']:.2f} us, node {c['empty_graph_node_us']:.2f} us")
cases = [dict(n=65536), dict(n=65536, slots="sequential"), dict(n=65536, slots="skip"), dict(n=16384), dict(n=65536, layout="NHD", scale_layout="linear"), dict(n=65536, D=256),
         dict(n=65536, dtype="float16"), dict(n=65536, recipe="nvfp4_4over6"), dict(n=4096), dict(n=1, graph=True), dict(n=64, graph=True)]
import os
if os.environ.get("CASES") == "large":
    cases = [dict(n=65536), dict(n=65536, layout="NHD", scale_layout="linear"), dict(n=65536, D=256), dict(n=16384), dict(n=4096)]
gathers = (65536, 262144, 1 << 20)
if os.environ.get("CASES") == "none":  # gathers only, each case twice
    cases, gathers = [], (4096, 16384, 65536, 1 << 20) * 2
if os.environ.get("CASES") == "small":  # small stores in graphs, gathers from 4K (device times)
    cases = [dict(n=1, graph=True), dict(n=16, graph=True), dict(n=64, graph=True), dict(n=128, graph=True), dict(n=256, graph=True), dict(n=4096), dict(n=65536)]
    if os.environ.get("CASES_N"):
        cases = [dict(n=int(n), graph=True, recipe=os.environ.get("CASES_RECIPE", "nvfp4"))
                 for n in os.environ["CASES_N"].split(",")]
    gathers = (4096, 16384, 65536, 1 << 20) if os.environ.get("GATHERS") != "none" else ()
if os.environ.get("CASES") == "wide":  # large stores in both orders (page order forced where it applies)
    cases = [dict(n=4096), dict(n=16384), dict(n=65536), dict(n=65536, slots="sequential"), dict(n=65536, D=64),
             dict(n=65536, D=256), dict(n=65536, workspace=True), dict(n=65536, H=32, workspace=True),
             dict(n=262144, workspace=True), dict(n=65536, recipe="nvfp4_4over6")]
    nvfp4kv._C._set_store_order("page")
    gathers = ()
if os.environ.get("CASES") == "sorted":  # the page-order rows of "wide" alone
    cases = [dict(n=65536, workspace=True), dict(n=65536, H=32, workspace=True), dict(n=262144, workspace=True)]
    nvfp4kv._C._set_store_order("page")
    gathers = ()
for cs in cases:
    r = B.bench_store_case(torch, nvfp4kv, quick=True, **cs)
    g = f" graph {r['graph_us']:.2f}" if "graph_us" in r else ""
    print(f"  {cs}: {r['us']:.2f} us, gpu {r['gpu_us']:.2f} us {100 * r['bytes'] / r['gpu_us'] / 1e3 / c['copy_GBps']:.1f}%{g}")
for n in gathers:
    r = B.bench_gather_case(torch, nvfp4kv, n, dtype=os.environ.get("GATHER_DTYPE", "bfloat16"))
    print(f"  gather {n}: {r['us']:.2f} us, gpu {r['gpu_us']:.2f} us {100 * r['bytes'] / r['gpu_us'] / 1e3 / c['copy_GBps']:.1f}%")
PY
  )
done
