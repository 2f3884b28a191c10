#!/usr/bin/env python3
"""Prefill attention over an NVFP4 paged KV cache, with PyTorch SDPA.

The path an engine without FP4 attention kernels takes:

1. K/V of a batch of prompts (bf16) are written into a paged cache with
   ``nvfp4kv.reshape_and_cache_flash`` (vLLM's op and argument order: the two sides
   ``kv_cache[:, 0]`` / ``kv_cache[:, 1]`` of a 5-D HND cache, a slot mapping derived from a block
   table whose pages are assigned at random);
2. they are read back with ``nvfp4kv.gather_dequant`` (block table -> contiguous varlen bf16 K/V);
3. causal ``torch.nn.functional.scaled_dot_product_attention`` runs per sequence (KV heads expanded
   for GQA) on the original K/V and on the dequantized K/V.

It prints the relative L2 error and the cosine similarity of the attention output (and of K and V
themselves) for the recipes ``nvfp4`` and ``nvfp4_4over6``.

    python examples/sdpa_prefill.py                      # CPU (or CUDA if available), defaults
    python examples/sdpa_prefill.py --device cuda --seq-lens 4096,1000,17 --heads 32 --kv-heads 8

``main(argv)`` returns the numbers as a dict (used by tests/python/test_example.py).
"""
from __future__ import annotations

import argparse
import math
import sys
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

import nvfp4kv

RECIPES = ("nvfp4", "nvfp4_4over6")


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None,
                   help="cpu or cuda[:i] (default: cuda if a CUDA build and a GPU are present)")
    p.add_argument("--seq-lens", default="257,64,1,130",
                   help="comma-separated prompt lengths (default: %(default)s)")
    p.add_argument("--heads", type=int, default=8, help="query heads (default: %(default)s)")
    p.add_argument("--kv-heads", type=int, default=2,
                   help="KV heads; heads must be a multiple (GQA) (default: %(default)s)")
    p.add_argument("--head-size", type=int, default=128,
                   help=f"multiple of 16 up to {nvfp4kv.spec.NVFP4_MAX_HEAD_SIZE} (default: %(default)s)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per page (default: %(default)s)")
    p.add_argument("--extra-blocks", type=int, default=7,
                   help="unused pages in the cache besides the prompts' (default: %(default)s)")
    p.add_argument("--attn-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="dtype SDPA computes in; float32 isolates the KV quantization error "
                        "from bf16 attention rounding (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        args.seq_lens = [int(s) for s in args.seq_lens.split(",") if s.strip()]
    except ValueError:
        p.error(f"--seq-lens {args.seq_lens!r}: give comma-separated integers, e.g. 128,7")
    if not args.seq_lens or min(args.seq_lens) < 0 or max(args.seq_lens) == 0:
        p.error("--seq-lens: give non-negative lengths, at least one above 0, e.g. 128,7")
    for name in ("heads", "kv_heads", "head_size", "block_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.extra_blocks < 0:
        p.error("--extra-blocks must be 0 or more")
    if args.heads % args.kv_heads:
        p.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    if args.head_size % 16 or args.head_size > nvfp4kv.spec.NVFP4_MAX_HEAD_SIZE:
        p.error(f"--head-size must be a multiple of 16 up to {nvfp4kv.spec.NVFP4_MAX_HEAD_SIZE}, "
                f"got {args.head_size}")
    if not 0 <= args.seed < 2**63:
        p.error(f"--seed must be 0 to 2**63 - 1, got {args.seed}")
    cuda = torch.cuda.is_available() and nvfp4kv.build_info()["cuda_available"]
    if args.device is None:
        args.device = "cuda" if cuda else "cpu"
    else:
        try:
            kind = torch.device(args.device).type
        except RuntimeError as e:
            p.error(f"--device {args.device}: {e}")
        if kind not in ("cpu", "cuda"):
            p.error(f"--device {args.device}: expected cpu or cuda")
        if kind == "cuda" and not cuda:
            p.error(f"--device {args.device}: no usable GPU here (torch sees one: {torch.cuda.is_available()}; "
                    f"this nvfp4kv build can use CUDA: {nvfp4kv.build_info()['cuda_available']})")
    return args


def realistic_qkv(total: int, heads: int, kv_heads: int, d: int, gen: torch.Generator,
                  logit_std: float = 1.5):
    """Heavy-tailed Q/K/V resembling a transformer layer's (bf16, [total, heads, d]).

    Keys: a per-channel mean plus Student-t (df=4) token variation, times a lognormal channel gain
    with a few outlier channels per head (4-10x, as the RoPE'd channels of trained models).
    Values: a per-channel mean plus milder t (df=6) variation. Queries: Gaussian with lognormal
    channel gains, scaled so that the attention logits q.k/sqrt(d) vary across keys with a
    standard deviation of about ``logit_std``."""
    def student_t(shape, df):
        z = torch.randn(shape, generator=gen)
        # chi-square with df degrees of freedom as a sum of squared normals (uses `gen` only)
        chi2 = torch.randn(shape[:-1] + (1, df), generator=gen).square().sum(-1)
        return z / torch.sqrt(chi2 / df)

    def channel_gain(h, sigma, outliers):
        g = torch.exp(sigma * torch.randn(h, d, generator=gen))
        for i in range(h):
            idx = torch.randperm(d, generator=gen)[:outliers]
            g[i, idx] *= 4 + 6 * torch.rand(outliers, generator=gen)
        return g

    # Per-channel means (trained models' K and V have them: the "smoothing" in SageAttention),
    # heavy-tailed token-to-token variation around them, outlier channels in K.
    k_gain = channel_gain(kv_heads, 0.5, max(1, d // 32))
    k = (torch.randn(kv_heads, d, generator=gen) + student_t((total, kv_heads, d), 4)) * k_gain
    v_mean = 0.8 * torch.randn(kv_heads, d, generator=gen)
    v = (v_mean + student_t((total, kv_heads, d), 6)) * channel_gain(kv_heads, 0.3, 0) * 0.5
    q = torch.randn(total, heads, d, generator=gen) * channel_gain(heads, 0.3, 0)
    # Temperature: measure the logits' spread on a sample of (query, key) pairs and rescale q.
    groups = heads // kv_heads
    n = min(total, 256)
    if n:
        kk = (k[:n] - k[:n].mean(0)).repeat_interleave(groups, dim=1)  # the mean shifts nothing
        logits = torch.einsum("thd,shd->hts", q[:n], kk) / math.sqrt(d)
        q = q * (logit_std / max(float(logits.std()), 1e-6)) if n > 1 else q
    return q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16)


def causal_sdpa(q, k, v, cu_seqlens, groups, dtype):
    """Causal SDPA per sequence of varlen [total, H, D] tensors; KV heads repeated for GQA."""
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    cu = cu_seqlens.tolist()
    for b in range(len(cu) - 1):
        s, e = cu[b], cu[b + 1]
        if e == s:
            continue
        qs = q[s:e].to(dtype).transpose(0, 1).unsqueeze(0)  # [1, Hq, L, D]
        ks = k[s:e].to(dtype).repeat_interleave(groups, dim=1).transpose(0, 1).unsqueeze(0)
        vs = v[s:e].to(dtype).repeat_interleave(groups, dim=1).transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
        out[s:e] = o.squeeze(0).transpose(0, 1)
    return out


def errors(approx: torch.Tensor, exact: torch.Tensor) -> dict:
    a, x = approx.double().flatten(), exact.double().flatten()
    rel = float(torch.linalg.vector_norm(a - x) / torch.linalg.vector_norm(x))
    cos = float(torch.dot(a, x) / (torch.linalg.vector_norm(a) * torch.linalg.vector_norm(x)))
    return {"rel_l2": rel, "cosine": cos}


def main(argv: Optional[Sequence[str]] = None, *, keep_tensors: bool = False) -> dict:
    """Run the example; returns {"config": ..., recipe: {"attn": {...}, "k": {...}, "v": {...}}}.

    keep_tensors: also return, under "tensors", each recipe's cache, block table, slot mapping,
    scales and gathered K/V (for tests)."""
    args = parse_args(argv)
    dev = torch.device(args.device)
    gen = torch.Generator().manual_seed(args.seed)
    T, Hq, Hkv, D = args.block_size, args.heads, args.kv_heads, args.head_size
    seq_lens = args.seq_lens
    total = sum(seq_lens)

    q, k, v = realistic_qkv(total, Hq, Hkv, D, gen)
    q, k, v = q.to(dev), k.to(dev), v.to(dev)

    # Calibration as in vLLM's tests: decode global scale = amax / 448 (E4M3 max).
    k_scale = (k.abs().float().amax() / 448.0).reshape(1)
    v_scale = (v.abs().float().amax() / 448.0).reshape(1)

    # Paged cache: random page assignment through a block table (as an allocator would give).
    blocks = [-(-n // T) for n in seq_lens]
    N = sum(blocks) + args.extra_blocks
    max_blocks = max(blocks) if blocks else 0
    perm = torch.randperm(N, generator=gen)
    block_table = torch.full((len(seq_lens), max(max_blocks, 1)), -1, dtype=torch.int32)
    slot_parts, used = [], 0
    for b, n in enumerate(seq_lens):
        block_table[b, :blocks[b]] = perm[used:used + blocks[b]].to(torch.int32)
        used += blocks[b]
        j = torch.arange(n)
        slot_parts.append(block_table[b, j // T].long() * T + j % T)
    slot_mapping = torch.cat(slot_parts).to(dev) if slot_parts else torch.zeros(0, dtype=torch.long, device=dev)
    block_table = block_table.to(dev)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=dev)

    # FORMAT.md: the vllm scale profile (V scales token-4 interleaved) needs HND, T % 4, D % 64.
    scale_layout = "vllm" if (T % 4 == 0 and D % 64 == 0) else "linear"
    spec = nvfp4kv.KVCacheSpec(T, Hkv, D)
    attn_dtype = getattr(torch, args.attn_dtype)
    groups = Hq // Hkv

    # Reference: attention on the original bf16 K/V (varlen, prefix sums of the lengths).
    cu_ref = torch.zeros(len(seq_lens) + 1, dtype=torch.int64)
    cu_ref[1:] = torch.cumsum(torch.tensor(seq_lens), 0)
    out_ref = causal_sdpa(q, k, v, cu_ref, groups, attn_dtype)

    result = {"config": {"device": str(dev), "seq_lens": seq_lens, "heads": Hq, "kv_heads": Hkv,
                         "head_size": D, "block_size": T, "num_blocks": N,
                         "scale_layout": scale_layout, "attn_dtype": args.attn_dtype,
                         "k_scale": float(k_scale), "v_scale": float(v_scale)}}
    tensors = {}
    for recipe in RECIPES:
        kv_cache = nvfp4kv.allocate_kv_cache(spec, N, layout="HND", device=dev, backend="torch")
        nvfp4kv.reshape_and_cache_flash(k, v, kv_cache[:, 0], kv_cache[:, 1], slot_mapping, recipe,
                                        k_scale, v_scale, scale_layout=scale_layout)
        k_hat, v_hat, cu = nvfp4kv.gather_dequant(kv_cache, block_table, seq_lens_t, k_scale,
                                                  v_scale, dtype=torch.bfloat16,
                                                  scale_layout=scale_layout)
        out = causal_sdpa(q, k_hat, v_hat, cu.cpu(), groups, attn_dtype)
        result[recipe] = {"attn": errors(out, out_ref), "k": errors(k_hat, k), "v": errors(v_hat, v)}
        if keep_tensors:
            tensors[recipe] = dict(kv_cache=kv_cache, block_table=block_table, seq_lens=seq_lens_t,
                                   slot_mapping=slot_mapping, k_scale=k_scale, v_scale=v_scale,
                                   key=k, value=v, k_hat=k_hat, v_hat=v_hat, cu_seqlens=cu,
                                   scale_layout=scale_layout)
    if keep_tensors:
        result["tensors"] = tensors

    c = result["config"]
    print(f"device={c['device']} seq_lens={c['seq_lens']} heads={Hq} kv_heads={Hkv} head_size={D} "
          f"block_size={T} pages={N} scale_layout={scale_layout} attn_dtype={args.attn_dtype}")
    print(f"k_scale={c['k_scale']:.6g} v_scale={c['v_scale']:.6g}")
    print(f"{'recipe':<14}{'attn rel L2':>13}{'attn cosine':>13}{'K rel L2':>11}{'V rel L2':>11}")
    for recipe in RECIPES:
        r = result[recipe]
        print(f"{recipe:<14}{r['attn']['rel_l2']:>13.5f}{r['attn']['cosine']:>13.6f}"
              f"{r['k']['rel_l2']:>11.5f}{r['v']['rel_l2']:>11.5f}")
    return result


def out_of_memory(e: BaseException) -> bool:
    """A failed allocation: torch's on CUDA (torch.cuda's name where an older torch has no top-level one), its CPU
    allocator's RuntimeError or a size past int64 (no message type of their own), Python's."""
    oom = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
    return isinstance(e, (oom, MemoryError)) or (isinstance(e, RuntimeError) and any(
        text in str(e) for text in ("DefaultCPUAllocator", "Storage size calculation overflowed")))


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except Exception as e:  # one line for a size too large for the device, not a traceback
        if not out_of_memory(e):
            raise
        sys.exit(f"sdpa_prefill.py: error: out of memory ({(str(e).splitlines() or [type(e).__name__])[0]}); "
                 "try smaller sizes (--seq-lens, --heads)")
