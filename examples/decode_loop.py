#!/usr/bin/env python3
"""A toy decode loop over an NVFP4 paged KV cache, against the same loop over a bf16 cache.

One attention layer of a batch of sequences being decoded. At every step each sequence gets one
new token:

1. its K/V are appended to the cache with ``nvfp4kv.reshape_and_cache_flash`` (vLLM's op: the two
   sides ``kv_cache[:, 0]`` / ``kv_cache[:, 1]`` of a 5-D HND cache, the slot taken from the
   sequence's block table, whose pages are assigned in random order as an allocator gives them);
2. its query attends to the sequence so far with ``nvfp4kv.decode_attention``, which reads the
   NVFP4 pages directly through the block table and the sequence lengths.

The same loop runs over a bf16 cache: one contiguous ``[B, H, longest, D]`` buffer per side
(``longest``: the longest final sequence), the new token written at its position, PyTorch SDPA
with a length mask (no gather). SDPA attends every sequence's ``longest`` positions, masked ones
included, where ``decode_attention`` reads each sequence's own length: with the prompt lengths
drawn here (from half of ``--prompt-len`` up to it) the bf16 loop does about 1.2-1.3 times the
attention work; ``--same-lengths`` gives every sequence the same length, and both loops the same
work. On CUDA each loop's
step is captured once in a CUDA graph and replayed at every step, after the step's inputs (query,
key, value, slot mapping, sequence lengths) have been copied into the captured tensors; on the CPU
the steps run eagerly. The example prints each loop's tokens/s and the relative L2 error of the
NVFP4 loop's attention output against the bf16 loop's, over all steps.

There is no model: queries and K/V are synthetic (heavy-tailed, per-channel means, outlier
channels in K) and drawn in advance, so both loops see the same inputs at every step.

    python examples/decode_loop.py                      # CPU (or CUDA if available), small sizes
    python examples/decode_loop.py --device cuda --batch 64 --prompt-len 4096 --steps 256 \\
        --heads 32 --kv-heads 8

``main(argv)`` returns the numbers as a dict (used by tests/python/test_example_decode_loop.py).
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

import nvfp4kv

HEAD_SIZES = (64, 128, 256)  # what decode_attention reads


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default=None,
                   help="cpu or cuda[:i] (default: cuda if a CUDA build and a GPU are present)")
    p.add_argument("--steps", type=int, default=16,
                   help="decode steps: new tokens per sequence (default: %(default)s)")
    p.add_argument("--batch", type=int, default=4,
                   help="sequences decoded together (default: %(default)s)")
    p.add_argument("--prompt-len", type=int, default=200,
                   help="longest prompt; each sequence's prompt length is drawn from "
                        "[prompt-len / 2, prompt-len] (default: %(default)s)")
    p.add_argument("--same-lengths", action="store_true",
                   help="every prompt prompt-len tokens long: the bf16 loop then attends no "
                        "masked positions, and both loops do the same attention work")
    p.add_argument("--heads", type=int, default=8, help="query heads (default: %(default)s)")
    p.add_argument("--kv-heads", type=int, default=2,
                   help="KV heads; heads must be 1 to 16 times as many (GQA) "
                        "(default: %(default)s)")
    p.add_argument("--head-size", type=int, default=128, choices=HEAD_SIZES,
                   help="head size; decode_attention reads 64, 128 and 256 (default: %(default)s)")
    p.add_argument("--block-size", type=int, default=16,
                   help="tokens per page (default: %(default)s)")
    p.add_argument("--recipe", choices=("nvfp4", "nvfp4_4over6"), default="nvfp4",
                   help="kv_cache_dtype of the store (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed passes over the steps per loop; the fastest counts "
                        "(default: %(default)s)")
    p.add_argument("--no-graph", action="store_true",
                   help="on CUDA, run the steps eagerly instead of replaying CUDA graphs")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for name in ("steps", "batch", "prompt_len", "heads", "kv_heads", "block_size", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.heads % args.kv_heads or args.heads // args.kv_heads > 16:
        p.error(f"--heads ({args.heads}) must be 1 to 16 times --kv-heads ({args.kv_heads})")
    if not 0 <= args.seed < 2**63:
        p.error(f"--seed must be 0 to 2**63 - 1, got {args.seed}")
    cuda_build = nvfp4kv.build_info()["cuda_available"]
    if args.device is not None:
        try:
            kind = torch.device(args.device).type
        except RuntimeError as e:
            p.error(f"--device {args.device}: {e}")
        if kind not in ("cpu", "cuda"):
            p.error(f"--device {args.device}: expected cpu or cuda")
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() and cuda_build else "cpu"
    elif kind == "cuda" and not (
            torch.cuda.is_available() and cuda_build):
        p.error(f"--device {args.device}: no usable GPU here (torch sees one: "
                f"{torch.cuda.is_available()}; this nvfp4kv build can use CUDA: {cuda_build})")
    return args


def make_data(batch: int, tokens: int, steps: int, heads: int, kv_heads: int, d: int,
              gen: torch.Generator, device: torch.device, logit_std: float = 1.5):
    """Synthetic K/V for `tokens` positions of every sequence and the queries of the decode steps.

    What matters to a 4-bit cache is shaped like a trained layer's: per-channel means, a per-token
    magnitude that varies log-normally (heavy tails), and a few outlier channels per head in K
    (4-10x, as the RoPE'd channels of trained models). The queries are scaled so that the logits
    q.k/sqrt(d) vary across keys with a standard deviation of about `logit_std` (a softmax neither
    flat nor one-hot). Returns bf16 key, value ``[B, tokens, H, D]`` and query
    ``[steps, B, Hq, D]``.
    """
    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    def rand(*shape):
        return torch.rand(*shape, generator=gen, device=device)

    k_gain = torch.exp(0.5 * randn(kv_heads, d))
    outliers = rand(kv_heads, d).argsort(-1)[:, :max(1, d // 32)]
    k_gain.scatter_(1, outliers, k_gain.gather(1, outliers) * (4 + 6 * rand(*outliers.shape)))
    k = (randn(kv_heads, d) + randn(batch, tokens, kv_heads, d)
         * torch.exp(0.5 * randn(batch, tokens, kv_heads, 1))) * k_gain
    v_gain = torch.exp(0.3 * randn(kv_heads, d)) * 0.5
    v = (0.8 * randn(kv_heads, d) + randn(batch, tokens, kv_heads, d)
         * torch.exp(0.3 * randn(batch, tokens, kv_heads, 1))) * v_gain
    q = randn(steps, batch, heads, d) * torch.exp(0.3 * randn(heads, d))

    n = min(tokens, 256)
    if n > 1:
        group = heads // kv_heads
        keys = k[0, :n] - k[0, :n].mean(0)  # a key mean shifts a row's logits equally: no effect
        logits = torch.einsum("shgd,nhd->shgn", q[:, 0].reshape(steps, kv_heads, group, d), keys)
        q = q * (logit_std / max(float((logits / math.sqrt(d)).std(-1).mean()), 1e-6))
    return k.to(torch.bfloat16), v.to(torch.bfloat16), q.to(torch.bfloat16)


def relative_l2(approx: torch.Tensor, exact: torch.Tensor) -> float:
    a, x = approx.double().flatten(), exact.double().flatten()
    return float(torch.linalg.vector_norm(a - x) / torch.linalg.vector_norm(x))


def captured(step, device: torch.device):
    """`step` captured in a CUDA graph; returns the graph's replay."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm up outside the capture, on a side stream (torch's advice):
        for _ in range(3):         # lazy initialisation must not happen during the capture
            step()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def main(argv: Optional[Sequence[str]] = None, *, keep_tensors: bool = False) -> dict:
    """Run the example; returns {"config", "tokens_per_s", "seconds", "rel_l2", "rel_l2_per_step"}.

    keep_tensors: also return, under "tensors", the final NVFP4 cache, the block table, the
    per-step sequence lengths, the scales, the inputs and both loops' outputs of every step."""
    args = parse_args(argv)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    graphs = cuda and not args.no_graph
    B, steps, T = args.batch, args.steps, args.block_size
    Hq, H, D = args.heads, args.kv_heads, args.head_size
    G = Hq // H

    # Host-side choices (lengths, pages) from a CPU generator, the data from one on the device.
    host_gen = torch.Generator().manual_seed(args.seed)
    data_gen = torch.Generator(device=dev).manual_seed(args.seed)
    low = args.prompt_len if args.same_lengths else (args.prompt_len + 1) // 2
    prompt_lens = torch.randint(low, args.prompt_len + 1, (B,), generator=host_gen)
    final_lens = prompt_lens + steps
    keys, values, queries = make_data(B, int(final_lens.max()), steps, Hq, H, D, data_gen, dev)

    # Pages and block table. An engine's allocator hands out a page when a sequence reaches it and
    # writes the block-table entry in place (between graph replays as well); here every sequence
    # gets the pages of its final length up front, in random order.
    blocks = [-(-int(n) // T) for n in final_lens]
    max_blocks, N = max(blocks), sum(blocks)
    max_len = max_blocks * T
    perm = torch.randperm(N, generator=host_gen).to(torch.int32)
    block_table = torch.full((B, max_blocks), -1, dtype=torch.int32)  # -1: no page, never read
    used = 0
    for b, n in enumerate(blocks):
        block_table[b, :n] = perm[used:used + n]
        used += n
    pos = torch.arange(max_len)
    slot_of = block_table[:, pos // T].long() * T + pos % T  # [B, max_len]: slot of each position
    rows = torch.arange(B)

    # The decode steps' inputs, as an engine's input preparation would produce them: step s
    # appends position prompt_len + s of each sequence, which then has prompt_len + s + 1 tokens.
    step_pos = prompt_lens[None, :] + torch.arange(steps)[:, None]  # [steps, B]
    step_slots = slot_of[rows[None, :], step_pos].to(dev)
    step_lens = (step_pos + 1).to(torch.int32).to(dev)
    step_keys = keys[rows.to(dev)[None, :], step_pos.to(dev)]  # [steps, B, H, D]
    step_values = values[rows.to(dev)[None, :], step_pos.to(dev)]
    block_table = block_table.to(dev)

    # The prompts (the prefill): every token before the first decode step.
    pb, pj = (pos[None, :] < prompt_lens[:, None]).nonzero(as_tuple=True)  # (sequence, position)
    prompt_slots = slot_of[pb, pj].to(dev)
    pb, pj = pb.to(dev), pj.to(dev)
    prompt_keys, prompt_values = keys[pb, pj], values[pb, pj]

    # Global scales: calibrated (amax / 448 of K and V), not 1.0. Engines fall back to 1.0 when a
    # checkpoint has no KV scales, which keeps full precision only for groups whose amax lies in
    # about [0.094, 2688]: smaller groups lose bits or read back as zeros, larger ones are clipped
    # (docs/scales.md). An engine takes the scales from a calibrated checkpoint or from a
    # ScaleTracker run over calibration batches; here the prompts are the calibration batch.
    # amax / 448 leaves 6x headroom for decode tokens larger than the prompts' amax. The scales
    # stay 1-element float32 tensors on the device: the kernels read them there at every call (a
    # replayed graph sees an in-place update), with no host sync.
    tracker = nvfp4kv.ScaleTracker(1, device=dev)
    tracker.update(0, prompt_keys, prompt_values)
    k_scale, v_scale = tracker.k_scales()[0:1], tracker.v_scales()[0:1]

    # The vllm scale profile (V scales token-4 interleaved) needs T % 4 == 0 and D % 64 == 0
    # (FORMAT.md); every head size decode_attention reads is a multiple of 64.
    scale_layout = "vllm" if T % 4 == 0 else "linear"
    spec = nvfp4kv.KVCacheSpec(T, H, D)
    kv_cache = nvfp4kv.allocate_kv_cache(spec, N, layout="HND", device=dev, backend="torch")
    key_cache, value_cache = kv_cache[:, 0], kv_cache[:, 1]
    nvfp4kv.reshape_and_cache_flash(prompt_keys, prompt_values, key_cache, value_cache,
                                    prompt_slots, args.recipe, k_scale, v_scale,
                                    scale_layout=scale_layout)

    # The bf16 cache: SDPA's own layout [B, H, longest, D], so attention needs no gather.
    longest = int(final_lens.max())
    k_bf16 = torch.zeros(B, H, longest, D, dtype=torch.bfloat16, device=dev)
    v_bf16 = torch.zeros_like(k_bf16)
    k_bf16[pb, :, pj] = prompt_keys
    v_bf16[pb, :, pj] = prompt_values

    # The tensors a step reads and writes, at fixed addresses (what a CUDA graph captures).
    query = torch.empty(B, Hq, D, dtype=torch.bfloat16, device=dev)
    key = torch.empty(B, H, D, dtype=torch.bfloat16, device=dev)
    value = torch.empty_like(key)
    slot_mapping = torch.empty(B, dtype=torch.int64, device=dev)
    seq_lens = torch.empty(B, dtype=torch.int32, device=dev)
    out_nvfp4 = torch.empty_like(query)
    out_bf16 = torch.empty_like(query)
    # One workspace per geometry (batch, heads, block-table width), allocated once: its size does
    # not depend on the sequence lengths, so it serves every step and every replay (CPU: unused).
    workspace = nvfp4kv.decode_workspace(kv_cache, query, block_table)
    batch_rows = torch.arange(B, device=dev)
    positions = torch.arange(longest, device=dev)

    def set_inputs(s: int) -> None:
        # In place: a replayed graph reads whatever these tensors hold.
        query.copy_(queries[s])
        key.copy_(step_keys[s])
        value.copy_(step_values[s])
        slot_mapping.copy_(step_slots[s])
        seq_lens.copy_(step_lens[s])

    def nvfp4_step() -> None:
        nvfp4kv.reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping,
                                        args.recipe, k_scale, v_scale, scale_layout=scale_layout)
        nvfp4kv.decode_attention(query, kv_cache, block_table, seq_lens, k_scale, v_scale,
                                 scale_layout=scale_layout, out=out_nvfp4, workspace=workspace)

    def bf16_step() -> None:
        new = (seq_lens - 1).long()  # the new token's position in each sequence
        k_bf16[batch_rows, :, new] = key
        v_bf16[batch_rows, :, new] = value
        mask = (positions[None, :] < seq_lens[:, None]).view(B, 1, 1, longest)
        # GQA without repeating K/V: a KV head's G query heads are G query rows of that head.
        o = F.scaled_dot_product_attention(query.view(B, H, G, D), k_bf16, v_bf16, attn_mask=mask)
        out_bf16.copy_(o.view(B, Hq, D))

    set_inputs(0)
    run_nvfp4 = captured(nvfp4_step, dev) if graphs else nvfp4_step
    run_bf16 = captured(bf16_step, dev) if graphs else bf16_step

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    # Checked pass: both loops step by step on the same inputs, outputs kept for the error.
    outs_nvfp4 = torch.empty(steps, B, Hq, D, dtype=torch.bfloat16, device=dev)
    outs_bf16 = torch.empty_like(outs_nvfp4)
    for s in range(steps):
        set_inputs(s)
        run_nvfp4()
        run_bf16()
        outs_nvfp4[s].copy_(out_nvfp4)
        outs_bf16[s].copy_(out_bf16)

    # Timed passes, each loop on its own, timing whole steps as a decode loop runs them (the input
    # copies, then the replay or the eager calls). They append the same tokens at the same slots
    # again, which rewrites the same bytes; positions past a step's length are masked, never read.
    def seconds(run_step) -> float:
        best = math.inf
        for _ in range(args.repeats):
            sync()
            t0 = time.perf_counter()
            for s in range(steps):
                set_inputs(s)
                run_step()
            sync()
            best = min(best, time.perf_counter() - t0)
        return best

    t_bf16 = seconds(run_bf16)
    t_nvfp4 = seconds(run_nvfp4)

    per_step = [relative_l2(outs_nvfp4[s], outs_bf16[s]) for s in range(steps)]
    result = {
        "config": {"device": str(dev), "cuda_graph": graphs, "batch": B, "steps": steps,
                   "prompt_lens": prompt_lens.tolist(), "heads": Hq, "kv_heads": H, "head_size": D,
                   "block_size": T, "num_blocks": N, "recipe": args.recipe,
                   "scale_layout": scale_layout,
                   "k_scale": float(k_scale), "v_scale": float(v_scale)},
        "tokens_per_s": {"bf16": B * steps / t_bf16, "nvfp4": B * steps / t_nvfp4},
        "seconds": {"bf16": t_bf16, "nvfp4": t_nvfp4},  # each loop's fastest pass of all steps
        "rel_l2": relative_l2(outs_nvfp4, outs_bf16),
        "rel_l2_per_step": per_step,
    }
    if keep_tensors:
        result["tensors"] = dict(kv_cache=kv_cache, block_table=block_table, step_lens=step_lens,
                                 k_scale=k_scale, v_scale=v_scale, scale_layout=scale_layout,
                                 queries=queries, keys=keys, values=values,
                                 outs_nvfp4=outs_nvfp4, outs_bf16=outs_bf16)

    c, tps = result["config"], result["tokens_per_s"]
    print(f"device={c['device']} cuda_graph={'yes' if graphs else 'no'} batch={B} steps={steps} "
          f"prompt_lens={c['prompt_lens']}")
    print(f"heads={Hq} kv_heads={H} head_size={D} block_size={T} pages={N} recipe={args.recipe} "
          f"scale_layout={scale_layout}")
    print(f"global scales (amax/448 of the prompts, ScaleTracker): k_scale={c['k_scale']:.6g} "
          f"v_scale={c['v_scale']:.6g}")
    print(f"{'loop':<26}{'tokens/s':>12}{'ms/step':>10}")
    for name, label, t in (("bf16", "bf16 cache + SDPA", t_bf16),
                           ("nvfp4", "nvfp4 cache", t_nvfp4)):
        print(f"{label:<26}{tps[name]:>12.1f}{1e3 * t / steps:>10.3f}")
    print(f"attention output, nvfp4 loop vs bf16 loop: rel L2 {result['rel_l2']:.5f} over all "
          f"steps (largest step {max(per_step):.5f})")
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
        sys.exit(f"decode_loop.py: error: out of memory ({(str(e).splitlines() or [type(e).__name__])[0]}); "
                 "try smaller sizes (--batch, --prompt-len, --steps)")
