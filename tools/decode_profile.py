#!/usr/bin/env python3
"""One decode_attention call of the benchmark's geometry, for a profiler (ncu -k regex:decode).

Usage: python tools/decode_profile.py [B] [L] [--reps N]
"""
import sys

import torch

sys.path.insert(0, __file__.rsplit("/tools/", 1)[0] + "/benchmarks")
import bench_decode  # noqa: E402

B = int(sys.argv[1]) if len(sys.argv) > 1 else 64
L = int(sys.argv[2]) if len(sys.argv) > 2 else 16384
spec = bench_decode.Spec(B=B, L=L) if hasattr(bench_decode, "Spec") else None
c = bench_decode.make_case(spec) if spec is not None else bench_decode.make_case(B, L)
import nvfp4kv  # noqa: E402

for _ in range(3):
    nvfp4kv.decode_attention(c["q"], c["kv"], c["bt"], c["seq_lens"], c["ks"], c["vs"], out=c["out"],
                             workspace=c["ws"], q_len=c["q_len"])
torch.cuda.synchronize()
