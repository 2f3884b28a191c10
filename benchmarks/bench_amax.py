"""Throughput of nvfp4kv.amax (the kernel behind ScaleTracker.update) against the copy ceiling.

    python benchmarks/bench_amax.py [--quick] [--json out.json]

Needs torch with CUDA and a CUDA build of nvfp4kv (nvfp4kv.bench.bench_amax does the work).
"""
import argparse

from nvfp4kv import bench


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer sizes and samples")
    ap.add_argument("--json", metavar="PATH", type=bench.json_path_arg, help="also write the results as JSON")
    args = ap.parse_args()
    result = bench.bench_amax(quick=args.quick)
    print(bench.format_amax_table(result), flush=True)  # before the file: a failed write loses nothing
    if args.json:
        bench.write_json(args.json, result)


if __name__ == "__main__":
    main()
