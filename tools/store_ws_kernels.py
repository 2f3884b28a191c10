"""One sorted and one token-order store per size, for a per-kernel profile under Nsight Compute:
ncu --metrics gpu__time_duration.sum python3 tools/store_ws_kernels.py"""
import torch

import nvfp4kv

for n in (16384, 65536):
    T, H, D = 16, 8, 128
    pages = n // T
    spec = nvfp4kv.KVCacheSpec(block_size=T, num_kv_heads=H, head_size=D)
    kv = nvfp4kv.allocate_kv_cache(spec, pages, device="cuda")
    ws = nvfp4kv.store_workspace(kv)
    key = torch.randn(n, H, D, dtype=torch.bfloat16, device="cuda")
    slots = torch.randperm(pages * T, device="cuda")[:n]
    ks = torch.tensor([0.02], device="cuda")
    for _ in range(2):
        nvfp4kv.store(key, key, kv, slots, ks, ks, workspace=ws)
        nvfp4kv.store(key, key, kv, slots, ks, ks)
    torch.cuda.synchronize()
