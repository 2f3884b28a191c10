"""Throughput of nvfp4kv.amax (the kernel behind ScaleTracker.update) against the copy ceiling.

    python benchmarks/bench_amax.py [--quick] [--json out.json]

Needs torch with CUDA and a CUDA build of nvfp4kv (nvfp4kv.bench.bench_amax does the work).
"""
import argparse

from nvfp4kv import bench


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer sizes and samples")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    print(bench.format_amax_table(bench.bench_amax(quick=args.quick, json_path=args.json)))


if __name__ == "__main__":
    main()
