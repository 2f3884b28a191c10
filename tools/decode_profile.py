#!/usr/bin/env python3
"""A few decode_attention calls of the benchmark's geometry (benchmarks/bench_decode.py), for a
profiler: ncu -k regex:decode_mma --launch-count 1 python tools/decode_profile.py [B] [L] [T].
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_decode  # noqa: E402

B = int(sys.argv[1]) if len(sys.argv) > 1 else 64
L = int(sys.argv[2]) if len(sys.argv) > 2 else 16384
T = int(sys.argv[3]) if len(sys.argv) > 3 else 16
c = bench_decode.make_case(bench_decode.Spec(B=B, L=L, T=T))
for _ in range(3):
    c["ours"]()
torch.cuda.synchronize()
