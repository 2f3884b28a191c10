#!/usr/bin/env python3
"""Benchmark of nvfp4kv.decode_attention on the GPU, against its ceilings and the bf16 baseline.

Measured in the same run: the device copy bandwidth (bytes read + written), an empty kernel's
launch, and PyTorch SDPA decode over bf16 K/V of the same geometry (what a user would run
instead). Each case: Hq 32, Hkv 8, D 128, T 16 by default, pages in random order through the
block table, device-resident global scales, outputs preallocated; "gpu µs" is device time with
the host ahead (nvfp4kv.bench). "% copy" counts the NVFP4 bytes read (K and V rows with their
scales) at the copy bandwidth; "x SDPA" is SDPA's time over ours.

Usage: python benchmarks/bench_decode.py [--quick] [--json PATH] [--cases B×L,...]
"""
import argparse
import json
import math
import sys

import torch
import torch.nn.functional as F

import nvfp4kv
from nvfp4kv import bench

CASES = ["16x4096", "64x4096", "16x32768", "64x16384", "128x2048", "1x131072", "4x32768", "1x1024"]


def make_case(B, L, Hq=32, H=8, D=128, T=16, q_len=1, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    blocks = (L + T - 1) // T
    N = B * blocks
    Fd = nvfp4kv.nvfp4_kv_cache_full_dim(D)
    raw = torch.empty(N, 2, H * T * Fd, dtype=torch.uint8, device="cuda").random_(0, 256, generator=g)
    # A page side is [codes of every row | scale bytes of every row]; random scale bytes would
    # hold NaN groups (0x7F): keep them at or below 0x3F (1.875).
    raw[:, :, H * T * (D // 2):] &= 0x3F
    kv = raw.view(N, 2, H, T, Fd).permute(0, 1, 3, 2, 4)  # (N, 2, T, H, F), HND
    bt = torch.randperm(N, device="cuda", generator=g).reshape(B, blocks).to(torch.int32)
    seq_lens = torch.full((B,), L, dtype=torch.int32, device="cuda")
    q = torch.randn(B * q_len, Hq, D, device="cuda", dtype=dtype, generator=g)
    out = torch.empty_like(q)
    ks = torch.tensor([0.02], device="cuda")
    vs = torch.tensor([0.03], device="cuda")
    ws = nvfp4kv.decode_workspace(kv, q, bt, q_len=q_len)
    return dict(kv=kv, bt=bt, seq_lens=seq_lens, q=q, out=out, ks=ks, vs=vs, ws=ws, q_len=q_len)


def nvfp4_bytes(B, L, H=8, D=128):
    return B * L * H * 2 * (D // 2 + D // 16)


def run(cases, quick=False):
    ceil = bench.measure_ceilings(torch, quick=quick)
    rows = []
    for name in cases:
        B, L = (int(x) for x in name.lower().split("x"))
        c = make_case(B, L)

        def ours():
            nvfp4kv.decode_attention(c["q"], c["kv"], c["bt"], c["seq_lens"], c["ks"], c["vs"], out=c["out"],
                                     workspace=c["ws"], q_len=c["q_len"])

        nbytes = nvfp4_bytes(B, L)
        calls = bench._calls(nbytes)
        reps = 5 if quick else 15
        gpu_us = bench._queued_per_call(torch, ours, calls, reps)
        # bf16 SDPA decode over K/V of the same geometry (contiguous per sequence: its best case).
        k = torch.randn(B, 8, L, 128, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        qs = c["q"].view(B, 1, 32, 128).transpose(1, 2)

        def sdpa():
            F.scaled_dot_product_attention(qs, k, v, enable_gqa=True)

        sdpa_us = bench._queued_per_call(torch, sdpa, bench._calls(k.numel() * 4), reps)
        row = {"B": B, "L": L, "gpu_us": gpu_us, "sdpa_us": sdpa_us, "bytes": nbytes,
               "frac_copy": nbytes / (gpu_us * 1e-6) / (ceil["copy_GBps"] * 1e9),
               "x_sdpa": sdpa_us / gpu_us,
               "copy_us": nbytes / (ceil["copy_GBps"] * 1e9) * 1e6}
        if B * L <= 4096:
            row["graph_us"] = bench._graph_per_call(torch, ours, 20, reps)
            row["sdpa_graph_us"] = bench._graph_per_call(torch, sdpa, 20, reps)
        rows.append(row)
        print(format_row(row), flush=True)
        del k, v, c
        torch.cuda.empty_cache()
    return {"gpu": torch.cuda.get_device_name(), "ceilings": ceil, "decode": rows}


def format_row(r):
    g = f"  graph {r['graph_us']:.2f} us (SDPA {r['sdpa_graph_us']:.2f})" if "graph_us" in r else ""
    return (f"{r['B']:>4} x {r['L']:<7} nvfp4 {r['gpu_us']:9.2f} us  {100 * r['frac_copy']:5.1f}% of copy "
            f"(copy of its bytes {r['copy_us']:.1f} us)  bf16 SDPA {r['sdpa_us']:9.2f} us  x{r['x_sdpa']:.2f}{g}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("--cases", default=",".join(CASES))
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_decode: needs a CUDA GPU", file=sys.stderr)
        return 1
    res = run(a.cases.split(","), quick=a.quick)
    c = res["ceilings"]
    print(f"ceilings: copy {c['copy_GBps']:.0f} GB/s, empty kernel {c['empty_launch_us']:.2f} us back to back, "
          f"{c['empty_graph_node_us']:.2f} us per graph node")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
