#!/usr/bin/env python3
"""How fast does decode_attention read page sides that are not on 16 bytes? One KV head (8 query
heads) at pages of 1, 3 and 16 tokens, each geometry read three ways in one process:
- natural: the 5-D cache as allocated, sides of H·T·(D/2 + D/16) bytes (72·T at D 128), which the
  tensor-core reader takes with narrow copies where T % 16 != 0 (design notes: "Decode attention:
  narrow copies");
- shift4: the same bytes 4 past a 16-byte boundary, which the lane-per-token reader takes (at D
  64 the 4-byte copies take them too);
- padded: the same pages with each side padded to a multiple of 16 bytes (two sides), which the
  16-byte copies take.
Prints µs per call queued behind a GPU spin (nvfp4kv.bench), whether each way gives the natural
one's bits, and which kernels ran. Inputs are not rotated out of the L2 (16 × 4096 fits in it).
Needs a GPU and torch; run from anywhere against the installed package."""
import re

import torch
from torch.profiler import ProfilerActivity, profile

import nvfp4kv as nv
from nvfp4kv import bench

CASES = [(128, 1, 64, 16384), (128, 1, 16, 4096), (64, 1, 64, 16384), (128, 3, 64, 16384), (128, 16, 64, 16384)]


def kernels(f):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        f()
        torch.cuda.synchronize()
    return sorted({m.group(0)[:70] for e in prof.events() if e.device_type.name == "CUDA"
                   for m in [re.search(r"decode_\w+<[^>]*>", e.name)] if m})


def forms(raw, N, H, T, F):
    """name -> (kv_cache, value_cache) over the page bytes `raw` (N, 2, side)."""
    side = raw.shape[2]
    out = {"natural": (raw.view(N, 2, H, T, F).permute(0, 1, 3, 2, 4), None)}
    buf = torch.zeros(raw.numel() + 16, dtype=torch.uint8, device="cuda")
    buf[4:4 + raw.numel()].copy_(raw.flatten())
    out["shift4"] = (buf[4:4 + raw.numel()].view(N, 2, H, T, F).permute(0, 1, 3, 2, 4), None)
    pad = torch.zeros(N, 2, (side + 15) // 16 * 16, dtype=torch.uint8, device="cuda")
    pad[:, :, :side].copy_(raw)
    out["padded"] = tuple(pad[:, i, :side].view(N, H, T, F).permute(0, 2, 1, 3) for i in (0, 1))
    return out


def main():
    torch.manual_seed(0)
    H, Hq = 1, 8
    for D, T, B, L in CASES:
        F = nv.nvfp4_kv_cache_full_dim(D)
        cols = (L + T - 1) // T
        N = B * cols + 1
        raw = torch.randint(0, 256, (N, 2, H * T * F), dtype=torch.uint8, device="cuda")
        raw[:, :, H * T * (D // 2):] &= 0x3F  # scale bytes of real data (no NaN groups)
        bt = torch.randperm(N, device="cuda")[: B * cols].reshape(B, cols).int()
        sl = torch.full((B,), L, dtype=torch.int32, device="cuda")
        q = torch.randn(B, Hq, D, device="cuda").to(torch.bfloat16)
        ks = torch.tensor([0.03], device="cuda")
        nbytes = B * L * H * 2 * (D // 2 + D // 16)
        ref = None
        for name, (kv, vc) in forms(raw, N, H, T, F).items():
            ws = nv.decode_workspace(kv, q, bt, value_cache=vc)
            out = torch.empty_like(q)

            def call():
                nv.decode_attention(q, kv, bt, sl, ks, ks, value_cache=vc, scale_layout="linear", out=out,
                                    workspace=ws)

            call()
            torch.cuda.synchronize()
            ref = out.clone() if ref is None else ref
            us = bench._queued_per_call(torch, call, 50, 7)
            print(f"D {D} T {T} {B}x{L} H {H} Hq {Hq} {name:8s}: {us:8.2f} us {nbytes / us / 1e3:7.0f} GB/s "
                  f"same bits as natural: {torch.equal(out, ref)}  {kernels(call)}")


if __name__ == "__main__":
    main()
