#!/usr/bin/env python3
"""Benchmark of the NVFP4 store on the GPU: ceilings (copy bandwidth, empty launch) and the store.

Same as `nvfp4kv bench`; see nvfp4kv/bench.py. Usage: python benchmarks/bench_store.py [--quick] [--json PATH]
"""
import sys

from nvfp4kv.bench import main

if __name__ == "__main__":
    sys.exit(main())
