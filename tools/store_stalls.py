"""Stores of 65536 tokens (H 8, D 128, bf16, HND) for an Nsight Compute stall profile: token order
with random slots, token order with sequential slots, and page order (forced) with random slots.
Each configuration runs twice (both launches are profiled).
Usage: ncu -k regex:store_kernel ... python3 tools/store_stalls.py [page]   (page: only the page order)"""
import torch

import nvfp4kv

n, T, H, D = 65536, 16, 8, 128
pages = n // T
spec = nvfp4kv.KVCacheSpec(block_size=T, num_kv_heads=H, head_size=D)
kv = nvfp4kv.allocate_kv_cache(spec, pages, device="cuda")
ws = nvfp4kv.store_workspace(kv)
key = torch.randn(n, H, D, dtype=torch.bfloat16, device="cuda")
value = torch.randn(n, H, D, dtype=torch.bfloat16, device="cuda")
rand = torch.randperm(pages * T, device="cuda")
seq = torch.arange(n, device="cuda")
ks = torch.tensor([0.02], device="cuda")
import sys
configs = (("token", rand), ("token", seq), ("page", rand))
for order, slots in configs if sys.argv[1:] != ["page"] else configs[2:]:
    nvfp4kv._C._set_store_order(order)
    for _ in range(2):
        nvfp4kv.store(key, value, kv, slots, ks, ks, workspace=ws)
    torch.cuda.synchronize()
