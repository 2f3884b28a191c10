#!/usr/bin/env python3
"""A/B of installed builds on one GPU: the store and gather benchmark cases of nvfp4kv.bench
(or, with --decode, decode_attention cases of benchmarks/bench_decode.py), each build in its own
subprocess, builds alternated round after round and each round started by the next build (so
clock and thermal drift and the order fall on all of them alike); prints each case's median over
the rounds per build.

Usage: python tools/ab_builds.py NAME=PKG_DIR [NAME=PKG_DIR ...] [--rounds 3] [--decode BxL,...]
(PKG_DIR: a `pip install --target` directory; "installed" for the environment's own nvfp4kv;
a decode case ending in "g" is timed per call inside a CUDA graph, one ending in "r" is
bench_decode.py's variant ragged (its lengths, mean L, and its table) at that B and L; a bench_decode.py variant
name, such as d256 or q4, is that variant of 16x4096).
"""
import argparse
import json
import pathlib
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys
pkg = sys.argv[1]
if pkg != "installed":
    sys.path.insert(0, pkg)
import torch, nvfp4kv
from nvfp4kv import bench
out = {}
for n in (1, 64, 1024):
    out[f"store {n}"] = bench.bench_store_case(torch, nvfp4kv, n)["gpu_us"]
out["store 65536"] = bench.bench_store_case(torch, nvfp4kv, 65536)["gpu_us"]
for n in (4096, 16384, 65536, 262144, 1048576):
    out[f"gather {n}"] = bench.bench_gather_case(torch, nvfp4kv, n)["gpu_us"]
out["_file"] = nvfp4kv.__file__
print(json.dumps(out))
"""

DECODE_CHILD = r"""
import json, sys
pkg, cases, bench_dir = sys.argv[1], sys.argv[2].split(","), sys.argv[3]
if pkg != "installed":
    sys.path.insert(0, pkg)
sys.path.insert(0, bench_dir)
import torch, nvfp4kv
from nvfp4kv import bench
import bench_decode as bd
out = {}
for c in cases:
    if c in bd.VARIANTS:  # a variant of 16x4096 (bench_decode.py --variants names)
        spec = bd.Spec(**bd.VARIANTS[c][1])
        graph = spec.graph
    else:
        graph, ragged = c.endswith("g"), c.endswith("r")
        B, L = (int(x) for x in c.rstrip("gr").split("x"))
        spec = bd.Spec(**{**(bd.VARIANTS["ragged"][1] if ragged else {}), "B": B, "L": L})
    case = bd.make_case(spec)
    if graph:
        out[f"decode {c}"] = bench._graph_per_call(torch, case["ours"], bd.GRAPH_CALLS, 5)
    else:
        out[f"decode {c}"] = bench._queued_per_call(torch, case["ours"], bench._calls(bd.nvfp4_bytes(spec)), 5)
    del case
    torch.cuda.empty_cache()
out["_file"] = nvfp4kv.__file__
print(json.dumps(out))
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("builds", nargs="+")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--decode", metavar="BxL,...", help="decode_attention cases instead of store/gather")
    a = ap.parse_args()
    bench_dir = str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks")
    child = [DECODE_CHILD, "PKG", a.decode, bench_dir] if a.decode else [CHILD, "PKG"]
    builds = [b.split("=", 1) for b in a.builds]
    # A missing directory would put nothing on sys.path, and that build would time the installed
    # package under another name (a failed base build did, 2026-12-05).
    missing = [f"{name}={pkg}" for name, pkg in builds if pkg != "installed" and not pathlib.Path(pkg).is_dir()]
    if missing:
        sys.exit(f"ab_builds: no such package directory: {', '.join(missing)}")
    runs = {name: [] for name, _ in builds}
    for r in range(a.rounds):
        # Each round starts with the next build: no build always runs first (one build measured
        # q_len 4 at 76.3 us as a round's first and 73.0 us as its second, H200).
        for name, pkg in builds[r % len(builds):] + builds[:r % len(builds)]:
            args = [pkg if x == "PKG" else x for x in child]
            res = subprocess.run([sys.executable, "-c", *args], capture_output=True, text=True, cwd="/tmp")
            if res.returncode != 0:
                print(res.stderr[-2000:], file=sys.stderr)
                sys.exit(1)
            row = json.loads(res.stdout.strip().splitlines()[-1])
            # Each round's row as it comes: a run cut off by a time limit still leaves its rounds.
            print(f"round {r} {name}: {row.pop('_file')} {json.dumps(row)}", file=sys.stderr, flush=True)
            runs[name].append(row)
    cases = list(runs[builds[0][0]][0])
    print("case".ljust(16) + "".join(name.rjust(12) for name, _ in builds) + "   (gpu us, median of rounds)")
    for c in cases:
        print(c.ljust(16) + "".join(f"{statistics.median(r[c] for r in runs[name]):12.2f}" for name, _ in builds))


if __name__ == "__main__":
    main()
