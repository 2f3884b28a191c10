#!/usr/bin/env python3
"""Stores and gathers of the benchmark's geometry (H 8, D 128, bf16, HND, random slots / pages)
at a few sizes, three launches each, to run under `ncu`. For example:
  ncu --clock-control none -k regex:'store_kernel|gather_pairs' --launch-skip 1 --launch-count 40 \\
      --set full python3 profile_sizes.py 64 4096 16384
--padded also stores every size with all slots padded (-1: no quantization, no stores: the fixed
costs); --reference first runs five 4 KB torch adds (a small kernel that reads and writes).
"""
import argparse

import torch

import nvfp4kv

ap = argparse.ArgumentParser()
ap.add_argument("sizes", nargs="*", type=int, default=[64, 4096, 16384])
ap.add_argument("--padded", action="store_true")
ap.add_argument("--reference", action="store_true")
args = ap.parse_args()

if args.reference:
    a = torch.zeros(4096, dtype=torch.uint8, device="cuda")
    b = torch.ones_like(a)
    for _ in range(5):
        a.add_(b)
spec = nvfp4kv.KVCacheSpec(block_size=16, num_kv_heads=8, head_size=128, cache_dtype="nvfp4")
scale = torch.tensor([0.02], device="cuda")
for n in args.sizes:
    pages = (n + 15) // 16
    kv = nvfp4kv.allocate_kv_cache(spec, pages, layout="HND", device="cuda", backend="torch")
    key = torch.randn(n, 8, 128, dtype=torch.bfloat16, device="cuda")
    slot_lists = [torch.randperm(pages * 16, device="cuda")[:n]]
    if args.padded:
        slot_lists.append(torch.full((n,), -1, device="cuda"))
    for slots in slot_lists:
        for _ in range(3):
            nvfp4kv.store(key, key, kv, slots, scale, scale)
    seqs = 8 if n >= 8 else 1
    per_seq = n // seqs
    blocks = (per_seq + 15) // 16
    table = torch.randint(0, pages, (seqs, blocks), dtype=torch.int32, device="cuda")
    lens = torch.full((seqs,), per_seq, dtype=torch.int32, device="cuda")
    cu = torch.arange(seqs + 1, dtype=torch.int32, device="cuda") * per_seq
    out_k = torch.empty(seqs * per_seq, 8, 128, dtype=torch.bfloat16, device="cuda")
    out_v = torch.empty_like(out_k)
    for _ in range(3):
        nvfp4kv.gather_dequant(kv, table, lens, scale, scale, cu_seqlens=cu, key_out=out_k, value_out=out_v)
torch.cuda.synchronize()
