#!/usr/bin/env python3
"""Benchmark of nvfp4kv.decode_attention on the GPU, against its ceilings and the bf16 baseline.

Measured in the same run: the device copy bandwidth (bytes read + written), an empty kernel's
launch, and PyTorch SDPA over K/V of the same geometry in the query's dtype (what a user would
run instead). Pages are in random order through the block table, global scales are
device-resident, outputs and the workspace are preallocated; "gpu µs" is device time with the
host ahead (nvfp4kv.bench). "% copy" counts the NVFP4 bytes read (K and V rows with their scales:
B * L * Hkv * 2 * (D/2 + D/16); the query's geometry and q_len do not change it) at the copy
bandwidth; "a copy of them" is a device copy moving that many bytes (half read, half
written), timed the same way, with our time as a % of it: the copy ceiling at the case's own size, its ramp-up and tail
included (nvfp4kv.bench.copy_gpu_us); "× SDPA" is SDPA's time over ours.

Each case rotates input sets (its own pages and block table for ours, its own K/V for SDPA, and
buffer pairs for the sized copy) over at least 3 times the GPU's L2, so that no call finds the
bytes an earlier one left in L2: an engine's call per layer reads pages that every other layer's
traffic went through L2 since (input_sets). At most GRAPH_CALLS sets, one per capture of a graph:
1x1024's 100 sets of 1.2 MB cover 2.25 times a 50 MiB L2. Unused columns of a wide table share
one set's pages.

Two tables (issue #23, point 4):
- main cases: Hq 32, Hkv 8, D 128, T 16, bf16, q_len 1, HND at each B×L of CASES; the small ones
  also inside a CUDA graph (µs per call, ours and SDPA's);
- variants (VARIANTS): one thing changed from 16×4096 each (q_len, GQA group, head size, fp16,
  NHD, block sizes 8, 12 and 1, one KV head at T 16 and T 1: a rank of an 8-KV-head model at
  tensor parallelism 8, whose T 1 page sides of 72 bytes are not 16-byte aligned), 1×1024 timed
  inside a CUDA graph, a window of 4096 tokens at 16×32768 (its bytes and SDPA's K/V: the window's), 1×1024 (graph) and 16×4096 in a block
  table 131072 tokens wide (an engine's table of its longest context), and in that table 16
  lengths from 256 to 7936 (a served batch: its mean and bytes those of 16×4096; SDPA's K/V are
  16×4096's, its best case), and 1×1024 (graph) given a view of that table's first 64 columns (an
  engine that cuts its table to the batch's longest sequence).

The SDPA baseline: K/V [B, Hkv, L, D] contiguous per sequence (its best case), enable_gqa. For
q_len 1 no mask. For q_len > 1 the q_len queries of a sequence are its last q_len positions,
causal among themselves: a lower-right causal mask (torch.nn.attention.bias.causal_lower_right),
as decode_attention does; the same SDPA without a mask is reported beside it, and stands in
(said so on the row) if the masked call fails.

Usage: python benchmarks/bench_decode.py [--quick] [--json PATH] [--cases B×L,...]
                                         [--variants [NAME,...]] [--variants-only]
"""
import argparse
import dataclasses
import sys

CASES = ["16x4096", "64x4096", "16x32768", "64x16384", "128x2048", "1x131072", "4x32768", "1x1024"]
GRAPH_MAX_TOKENS = 4096  # main cases of at most B*L tokens are also timed inside a CUDA graph
GRAPH_CALLS = 100  # captures per graph, as nvfp4kv.bench.GRAPH_NODES (20 timed part of the submission)
ROTATE_L2 = 3  # input sets cover at least this many times the L2 (input_sets)


@dataclasses.dataclass(frozen=True)
class Spec:
    """One benchmark case; the defaults are the issue's geometry at 16×4096."""
    B: int = 16
    L: int = 4096
    Hq: int = 32
    H: int = 8
    D: int = 128
    T: int = 16
    q_len: int = 1
    dtype: str = "bfloat16"
    layout: str = "HND"
    graph: bool = False  # gpu µs (ours and SDPA's) per call inside a CUDA graph, not queued launches
    window: int = -1  # window_left (q_len 1): each sequence attends its last window + 1 tokens
    width: int = 0  # tokens the block table holds per sequence (0: L), as an engine's table of its longest context
    ragged: bool = False  # lengths spread evenly over [L/16, 2L - L/16] (mean L), as a served batch's
    cut: bool = False  # pass a view of the table's first columns, up to the longest sequence (an engine that knows it)

    @property
    def scale_layout(self):
        # "vllm" interleaves the V scales by 4 tokens within a head, which needs HND rows and T % 4 == 0.
        return "vllm" if self.layout == "HND" and self.T % 4 == 0 else "linear"


# name (for --variants) -> (label, what changes from Spec()).
VARIANTS = {
    "q2": ("q_len 2", dict(q_len=2)),
    "q4": ("q_len 4", dict(q_len=4)),
    "q8": ("q_len 8", dict(q_len=8)),
    "group1": ("GQA group 1 (Hq 8)", dict(Hq=8)),
    "group8": ("GQA group 8 (Hq 64)", dict(Hq=64)),
    "d64": ("D 64", dict(D=64)),
    "d256": ("D 256", dict(D=256)),
    "fp16": ("fp16", dict(dtype="float16")),
    "nhd": ("NHD (linear scales)", dict(layout="NHD")),
    "t8": ("T 8", dict(T=8)),
    "t12": ("T 12", dict(T=12)),
    "t1": ("T 1 (linear scales)", dict(T=1)),
    "h1": ("one KV head (Hq 8: 8 KV heads at TP 8)", dict(Hq=8, H=1)),
    "h1t1": ("one KV head (Hq 8), T 1 (linear scales)", dict(Hq=8, H=1, T=1)),
    "graph": ("1x1024 in a CUDA graph", dict(B=1, L=1024, graph=True)),
    "w4096": ("window 4096 at 16x32768", dict(L=32768, window=4095)),
    "wide": ("1x1024 in a 131072-token table, graph", dict(B=1, L=1024, width=131072, graph=True)),
    "wide16": ("16x4096 in a 131072-token table", dict(width=131072)),
    "ragged": ("16 lengths 256..7936 (mean 4096) in a 131072-token table", dict(width=131072, ragged=True)),
    "wide_cut": ("1x1024 in a 131072-token table, its first 64 columns passed, graph",
                 dict(B=1, L=1024, width=131072, cut=True, graph=True)),
}


def parse_case(name):
    """"16x4096" (or "16×4096") -> Spec(B=16, L=4096)."""
    parts = name.lower().replace("×", "x").split("x")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"case {name!r}: expected BxL with positive integers, e.g. 16x4096")
    return Spec(B=int(parts[0]), L=int(parts[1]))


def variant_specs(names):
    """[(label, Spec)] for the given VARIANTS names, in the table's order."""
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise ValueError(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    return [(VARIANTS[n][0], Spec(**VARIANTS[n][1])) for n in VARIANTS if n in names]


def lengths(s):
    """Each sequence's length: L, or (ragged) evenly spaced from L/16 to 2L - L/16, whose mean is L."""
    if not s.ragged or s.B == 1:
        return [s.L] * s.B
    lo, hi = s.L // 16, 2 * s.L - s.L // 16
    return [lo + (hi - lo) * i // (s.B - 1) for i in range(s.B)]


def attended(s, length=None):
    """Tokens that the queries of a sequence of `length` (default L) attend: all, or with a window
    its last window + 1."""
    n = s.L if length is None else length
    return n if s.window < 0 else min(n, s.window + 1)


def nvfp4_bytes(s):
    """NVFP4 bytes one call needs: every attended K and V row of every sequence, codes (D/2) and
    scales (D/16). The query's heads and q_len add no cache bytes (the query and output are < 1 %)."""
    return sum(attended(s, n) for n in lengths(s)) * s.H * 2 * (s.D // 2 + s.D // 16)


def input_sets(nbytes, l2_bytes, cap=GRAPH_CALLS):
    """Input sets a case of `nbytes` per call rotates through: enough to cover ROTATE_L2 times the
    L2, at most `cap` (a graph's captures, each of which takes the next set)."""
    return max(1, min(cap, -(-ROTATE_L2 * l2_bytes // max(1, nbytes))))


def make_case(s, seed=0):
    """Builds the tensors of one spec and returns the calls to time: "ours" (decode_attention),
    "sdpa" (the baseline, "sdpa_mask" saying which mask it applies) and "sdpa_nomask" (the same
    SDPA without a mask), with "out" (ours), "sdpa_bytes" (the K/V bytes SDPA reads per call) and
    "sets" (how many input sets ours rotates through, "tables" their block tables; SDPA's
    "sdpa_sets"). Each call takes the
    next set; the first calls of both are made here, so that no timing sample holds a first call."""
    import torch
    import torch.nn.functional as F
    import nvfp4kv

    dtype = getattr(torch, s.dtype)
    g = torch.Generator(device="cuda").manual_seed(seed)
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    longest = max(lengths(s))
    blocks = (max(longest, s.width) + s.T - 1) // s.T
    used = (longest + s.T - 1) // s.T  # the columns a call can read; the rest of a wide table is never read
    sets = input_sets(nvfp4_bytes(s), l2)
    N = s.B * blocks + (sets - 1) * s.B * used  # set 0's pages, and each further set's used columns
    Fd = nvfp4kv.nvfp4_kv_cache_full_dim(s.D)
    raw = torch.empty(N, 2, s.H * s.T * Fd, dtype=torch.uint8, device="cuda").random_(0, 256, generator=g)
    # A page side is [codes of every row | scale bytes of every row] in both layouts; random
    # scale bytes would hold NaN groups (0x7F): keep them at or below 0x3F (1.875).
    raw[:, :, s.H * s.T * (s.D // 2):] &= 0x3F
    if s.layout == "HND":
        kv = raw.view(N, 2, s.H, s.T, Fd).permute(0, 1, 3, 2, 4)  # (N, 2, T, H, F) over [N][2][H][T][F]
    else:
        kv = raw.view(N, 2, s.T, s.H, Fd)  # NHD: the buffer's own order
    perm = torch.randperm(N, device="cuda", generator=g).to(torch.int32)
    bt0 = perm[: s.B * blocks].reshape(s.B, blocks)
    bts = [bt0]
    for i in range(1, sets):  # the used columns on pages of their own, the rest as in set 0
        bt = bt0.clone()
        start = s.B * blocks + (i - 1) * s.B * used
        bt[:, :used] = perm[start: start + s.B * used].reshape(s.B, used)
        bts.append(bt)
    if s.cut:  # a view: the rows keep the whole table's stride
        bts = [bt[:, :used] for bt in bts]
    seq_lens = torch.tensor(lengths(s), dtype=torch.int32, device="cuda")
    q = torch.randn(s.B * s.q_len, s.Hq, s.D, device="cuda", dtype=dtype, generator=g)
    out = torch.empty_like(q)
    ks = torch.tensor([0.02], device="cuda")
    vs = torch.tensor([0.03], device="cuda")
    ws = nvfp4kv.decode_workspace(kv, q, bts[0], q_len=s.q_len)
    turn = {"ours": 0, "sdpa": 0}

    def ours():
        bt = bts[turn["ours"] % sets]
        turn["ours"] += 1
        nvfp4kv.decode_attention(q, kv, bt, seq_lens, ks, vs, out=out, workspace=ws, q_len=s.q_len,
                                 scale_layout=s.scale_layout, window_left=s.window)

    # SDPA over K/V contiguous per sequence (its best case: with a window, only the window's
    # tokens); query row b * q_len + i is query i of sequence b, so the view puts the q_len
    # queries of a sequence on its own axis.
    if s.window >= 0 and s.q_len > 1:
        raise ValueError("the SDPA baseline of a window is for q_len 1")
    sdpa_bytes = 2 * s.B * s.H * attended(s) * s.D * q.element_size()
    sdpa_sets = input_sets(sdpa_bytes, l2)
    kvs = [(torch.randn(s.B, s.H, attended(s), s.D, device="cuda", dtype=dtype, generator=g),
            torch.randn(s.B, s.H, attended(s), s.D, device="cuda", dtype=dtype, generator=g)) for _ in range(sdpa_sets)]
    qs = q.view(s.B, s.q_len, s.Hq, s.D).transpose(1, 2)

    def sdpa_kv():
        k, v = kvs[turn["sdpa"] % sdpa_sets]
        turn["sdpa"] += 1
        return k, v

    def sdpa_nomask():
        F.scaled_dot_product_attention(qs, *sdpa_kv(), enable_gqa=True)

    sdpa, mask = sdpa_nomask, "none (q_len 1)"
    if s.q_len > 1:
        try:
            from torch.nn.attention.bias import causal_lower_right

            # is_causal=True would align the triangle top-left (query i sees keys 0..i); decode's
            # queries are the sequence's last q_len positions, so the triangle sits bottom-right.
            bias = causal_lower_right(s.q_len, s.L)

            def sdpa_causal():
                F.scaled_dot_product_attention(qs, *sdpa_kv(), attn_mask=bias, enable_gqa=True)

            sdpa_causal()
            torch.cuda.synchronize()
            sdpa, mask = sdpa_causal, "causal lower-right"
        except Exception as e:  # a torch without it (for GQA): the unmasked call, said so on the row
            mask = f"none (causal lower-right failed: {type(e).__name__}: {e})"
    ours()
    sdpa_nomask()
    torch.cuda.synchronize()
    return dict(ours=ours, out=out, sdpa=sdpa, sdpa_nomask=sdpa_nomask, sdpa_mask=mask, sdpa_bytes=sdpa_bytes,
                sets=sets, sdpa_sets=sdpa_sets, tables=bts)


def measure(s, ceil, label, quick=False, graph_columns=False):
    """One row: the spec, ours and SDPA's µs, and the ratios against the copy ceiling and SDPA.
    graph_columns: also time both inside a CUDA graph (the main table's small cases)."""
    import torch

    from nvfp4kv import bench

    c = make_case(s)
    reps = 5 if quick else 15
    nbytes = nvfp4_bytes(s)
    row = dict(dataclasses.asdict(s), label=label, scale_layout=s.scale_layout, bytes=nbytes, sdpa_mask=c["sdpa_mask"],
               timing="graph" if s.graph else "queued", sets=c["sets"], sdpa_sets=c["sdpa_sets"])
    if s.graph:
        row["gpu_us"] = bench._graph_per_call(torch, c["ours"], GRAPH_CALLS, reps)
        row["sdpa_us"] = bench._graph_per_call(torch, c["sdpa"], GRAPH_CALLS, reps)
    else:
        row["gpu_us"] = bench._queued_per_call(torch, c["ours"], bench._calls(nbytes), reps)
        sdpa_calls = bench._calls(c["sdpa_bytes"])
        row["sdpa_us"] = bench._queued_per_call(torch, c["sdpa"], sdpa_calls, reps)
        if c["sdpa"] is not c["sdpa_nomask"]:
            row["sdpa_nomask_us"] = bench._queued_per_call(torch, c["sdpa_nomask"], sdpa_calls, reps)
        row["sized_copy_us"] = bench.copy_gpu_us(torch, nbytes, sets=c["sets"], quick=quick)
        row["frac_sized_copy"] = row["sized_copy_us"] / row["gpu_us"]
        if graph_columns:
            row["graph_us"] = bench._graph_per_call(torch, c["ours"], GRAPH_CALLS, reps)
            row["sdpa_graph_us"] = bench._graph_per_call(torch, c["sdpa"], GRAPH_CALLS, reps)
    row["copy_us"] = nbytes / (ceil["copy_GBps"] * 1e9) * 1e6
    row["frac_copy"] = row["copy_us"] / row["gpu_us"]
    row["x_sdpa"] = row["sdpa_us"] / row["gpu_us"]
    return row


def run_rows(items, ceil, quick, fmt, graph_columns=lambda s: False):
    """measure() each (label, spec), printing each row as it comes; a case that fails is
    reported as a row with its error, and the others still run."""
    import torch

    rows = []
    for label, s in items:
        try:
            row = measure(s, ceil, label, quick=quick, graph_columns=graph_columns(s))
        except Exception as e:
            row = dict(dataclasses.asdict(s), label=label, error=f"{type(e).__name__}: {e}")
        torch.cuda.empty_cache()  # the next case's cache and K/V may be GBs
        rows.append(row)
        print(fmt(row), flush=True)
    return rows


def format_row(r):
    if "error" in r:
        return f"{r['B']:>4} x {r['L']:<7} FAILED: {r['error']}"
    g = f"  graph {r['graph_us']:.2f} us (SDPA {r['sdpa_graph_us']:.2f})" if "graph_us" in r else ""
    return (f"{r['B']:>4} x {r['L']:<7} nvfp4 {r['gpu_us']:9.2f} us  {100 * r['frac_copy']:5.1f}% of copy "
            f"(its bytes at the copy rate {r['copy_us']:.1f} us; a copy of them {r['sized_copy_us']:.1f} us: "
            f"{100 * r['frac_sized_copy']:.1f}%)  bf16 SDPA {r['sdpa_us']:9.2f} us  x{r['x_sdpa']:.2f}{g}")


VARIANT_HEADER = (f"{'variant (16x4096 unless said)':<30} {'gpu us':>9} {'% copy':>7} {'SDPA us':>9} {'x SDPA':>7}"
                  "  SDPA mask")


def format_variant(r):
    if "error" in r:
        return f"{r['label']:<30} FAILED: {r['error']}"
    note = r["sdpa_mask"]
    if "sdpa_nomask_us" in r:
        note += f" (no mask {r['sdpa_nomask_us']:.2f} us)"
    if r["timing"] == "graph":
        note += "; both per call in a graph"
    return (f"{r['label']:<30} {r['gpu_us']:9.2f} {100 * r['frac_copy']:6.1f}% {r['sdpa_us']:9.2f} "
            f"{r['x_sdpa']:6.2f}x  {note}")


def parse_args(argv=None):
    from nvfp4kv.bench import json_path_arg

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer samples; no variants unless --variants is given")
    ap.add_argument("--json", metavar="PATH", type=json_path_arg,
                    help="also write every row and the ceilings as JSON (checked before the run)")
    ap.add_argument("--cases", default=",".join(CASES), metavar="BxL,...",
                    help=f"main cases (default {','.join(CASES)})")
    ap.add_argument("--variants", nargs="?", const="all", metavar="NAME,...",
                    help=f"run the variants table: all (no value), none, or these of {','.join(VARIANTS)}; "
                         "default all, none with --quick")
    ap.add_argument("--variants-only", action="store_true", help="skip the main cases")
    a = ap.parse_args(argv)
    try:
        a.main_specs = [] if a.variants_only else [parse_case(n) for n in a.cases.split(",") if n.strip()]
        wanted = a.variants or ("none" if a.quick and not a.variants_only else "all")
        if wanted == "all":
            names = list(VARIANTS)
        elif wanted == "none":
            names = []
        else:
            names = [n.strip() for n in wanted.split(",") if n.strip()]
        a.variant_items = variant_specs(names)
    except ValueError as e:
        ap.error(str(e))
    return a


def main(argv=None):
    a = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench_decode: needs a CUDA GPU", file=sys.stderr)
        return 1
    import nvfp4kv
    from nvfp4kv import bench

    ceil = bench.measure_ceilings(torch, quick=a.quick)
    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "nvfp4kv": nvfp4kv.__version__,
           "ceilings": ceil, "decode": [], "variants": []}
    if a.main_specs:
        res["decode"] = run_rows([(f"{s.B}x{s.L}", s) for s in a.main_specs], ceil, a.quick, format_row,
                                 graph_columns=lambda s: s.B * s.L <= GRAPH_MAX_TOKENS)
    if a.variant_items:
        print(VARIANT_HEADER, flush=True)
        res["variants"] = run_rows(a.variant_items, ceil, a.quick, format_variant)
    print(f"ceilings: copy {ceil['copy_GBps']:.0f} GB/s, empty kernel {ceil['empty_launch_us']:.2f} us back to back, "
          f"{ceil['empty_graph_node_us']:.2f} us per graph node")
    if a.json:
        bench.write_json(a.json, res)
    return 1 if any("error" in r for r in res["decode"] + res["variants"]) else 0


if __name__ == "__main__":
    sys.exit(main())
