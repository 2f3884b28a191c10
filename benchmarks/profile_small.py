#!/usr/bin/env python3
"""Small launches to run under `ncu`: a 4 KB torch add (a reference small kernel that reads and
writes), then five stores of 1 token (random slot) and five of 1 padded token (slot -1: no
quantization, no stores). For example:
  ncu --clock-control none -k regex:'store_kernel|elementwise' --set full python3 profile_small.py
"""
import torch

import nvfp4kv

a = torch.zeros(4096, dtype=torch.uint8, device="cuda")
b = torch.ones_like(a)
for _ in range(5):
    a.add_(b)
spec = nvfp4kv.KVCacheSpec(block_size=16, num_kv_heads=8, head_size=128, cache_dtype="nvfp4")
kv = nvfp4kv.allocate_kv_cache(spec, 64, layout="HND", device="cuda", backend="torch")
key = torch.randn(1, 8, 128, dtype=torch.bfloat16, device="cuda")
scale = torch.tensor([0.02], device="cuda")
for slot in (37, -1):
    slots = torch.tensor([slot], device="cuda")
    for _ in range(5):
        nvfp4kv.store(key, key, kv, slots, scale, scale)
torch.cuda.synchronize()
