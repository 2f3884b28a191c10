"""Decode attention over the NVFP4 pages (nvfp4kv.decode_attention, issue #23), CPU path.

The reference is the issue's definition: attention in float64 (NumPy) over what
nvfp4kv.dequantize() gives for the cache (float32, the global scales applied), with the query's
bf16/fp16 values, the soft cap, the window, causal query rows and masked block-table entries.
The CPU path computes in fp32 and rounds the output to the query's dtype, so it is held to a
relative L2 error (REL_L2_TOL for bf16, REL_L2_TOL_FP16 for fp16, over the whole output) and lse
to an absolute error (LSE_TOL).
Rows that see no position must be exactly 0 with lse -inf. Rejected calls must leave out and lse
bit for bit as they were.
"""
import math
import os

import numpy as np
import pytest
from conftest import make_cache, minus_inf_logits_case, view_combos

torch = pytest.importorskip("torch")
nvfp4kv = pytest.importorskip("nvfp4kv")
import nvfp4kv.ops  # noqa: E402,F401  (the tests call torch.ops.nvfp4kv.* directly)

# The tolerances of the CPU path against the float64 reference (stated once).
REL_L2_TOL = 4e-3       # relative L2 error of a bf16 out (the bound; bf16 rounding alone gives 1.6-1.7e-3)
REL_L2_TOL_FP16 = 1e-3  # of an fp16 out (measured on the CPU path: at most 2.1e-4; review)
LSE_TOL = 1e-4          # absolute error of lse
ROW_TOL_FACTOR = 2      # one (row, head)'s error against the bound of the whole (measured: at most 2.3e-3 bf16, 2.8e-4 fp16)


def rel_l2_tol(dtype):
    """The bound for an output of this torch dtype."""
    return REL_L2_TOL_FP16 if dtype == torch.float16 else REL_L2_TOL

MEASURED = {"rel_l2": 0.0, "lse": 0.0}  # the largest errors seen in this run (for reports)

TORCH_DTYPE = {"bfloat16": torch.bfloat16, "float16": torch.float16}


# ------------------------------------------------------------------------------------ helpers
def fill(cache, rng, k_scale, v_scale, scale_layout, nan_slot=None, v_nan=None):
    """Store random K/V into every slot of the cache (so every byte a read may touch is
    defined); nan_slot: a slot whose K holds a NaN (its groups' scale byte becomes 0x7F);
    v_nan: (slot, element) of a NaN in V (that element's group becomes a NaN group)."""
    n = cache.N * cache.T
    k = torch.from_numpy(rng.standard_normal((n, cache.H, cache.D)).astype(np.float32))
    v = torch.from_numpy(rng.standard_normal((n, cache.H, cache.D)).astype(np.float32))
    k[:, :, : cache.D // 2] *= 3.0  # uneven magnitudes: group scales differ
    if nan_slot is not None:
        k[nan_slot, :, 5] = float("nan")
    if v_nan is not None:
        v[v_nan[0], :, v_nan[1]] = float("nan")
    slots = torch.randperm(n, generator=torch.Generator().manual_seed(int(rng.integers(1 << 30))))
    nvfp4kv.store(k[slots], v[slots], slot_mapping=slots, k_scale=k_scale, v_scale=v_scale,
                  scale_layout=scale_layout, **cache.kwargs())


def reference(q, kd, vd, bt, seq_lens, q_len, sm_scale, cap, window, N, T):
    """(out, lse) in float64: q [B*q_len, Hq, D] (values), kd/vd (N, T, H, D) dequantize()d.

    A slot that several positions reach (a page repeated in the block table) is one term
    weighted by its count, which is the same sum: so a sequence of a million positions over a
    small cache costs the reference its distinct slots, not a million gathered rows."""
    rows, Hq, _ = q.shape
    H, Dv = kd.shape[2], vd.shape[3]
    G = Hq // H
    bt = np.asarray(bt, np.int64)
    B, max_blocks = bt.shape
    out = np.zeros((rows, Hq, Dv))
    lse = np.full((rows, Hq), -np.inf)
    for b in range(B):
        length = int(seq_lens[b])
        for i in range(q_len):
            p = length - q_len + i
            if length <= 0 or p < 0:
                continue
            lo = max(0, p - window) if window >= 0 else 0
            j = np.arange(lo, min(p, max_blocks * T - 1) + 1)
            pages = bt[b, j // T]
            keep = (pages >= 0) & (pages < N)
            j, pages = j[keep], pages[keep]
            if len(j) == 0:
                continue
            slots, count = np.unique(pages * T + j % T, return_counts=True)
            K = kd[slots // T, slots % T].astype(np.float64)  # [n, H, D], n distinct slots
            V = vd[slots // T, slots % T].astype(np.float64)
            row = b * q_len + i
            qr = q[row].astype(np.float64).reshape(H, G, -1)
            with np.errstate(invalid="ignore"):
                logits = np.einsum("nhd,hgd->hgn", K, qr) * sm_scale
                if cap > 0:
                    logits = cap * np.tanh(logits / cap)
                m = logits.max(axis=-1, keepdims=True)
                e = np.exp(logits - m) * count
                s = e.sum(axis=-1)
                o = np.einsum("hgn,nhd->hgd", e, V) / s[..., None]
            out[row] = o.reshape(Hq, Dv)
            lse[row] = (m[..., 0] + np.log(s)).reshape(Hq)
    return out, lse


def poisoned(shape, dtype, seed):
    """A tensor of random bits (NaN/Inf patterns included)."""
    bits = np.random.default_rng(seed).integers(0, 2**16, shape, dtype=np.uint64).astype(np.uint16)
    if dtype == torch.float32:
        bits = np.random.default_rng(seed).integers(0, 2**32, shape, dtype=np.uint64).astype(np.uint32)
        return torch.from_numpy(bits.view(np.int32).copy()).view(torch.float32)
    return torch.from_numpy(bits.view(np.int16).copy()).view(dtype)


def bits(x):
    return x.view(torch.int16 if x.element_size() == 2 else torch.int32).clone()


def as_index(x, dtype):
    return torch.tensor(np.asarray(x), dtype=getattr(torch, dtype))


def check(cache, q, bt, seq_lens, q_len=1, k_scale=0.02, v_scale=0.03, scale_layout="vllm", cap=0.0,
          window=-1, sm_scale=None, seed=0):
    """decode_attention against the reference; returns (rel L2 error, max |lse error|)."""
    out = poisoned((q.shape[0], q.shape[1], cache.D), q.dtype, seed)
    lse = poisoned((q.shape[0], q.shape[1]), torch.float32, seed + 1)
    got = nvfp4kv.decode_attention(q, cache.kv_cache, bt, seq_lens, k_scale, v_scale,
                                   value_cache=cache.value_cache, scale_layout=scale_layout, sm_scale=sm_scale,
                                   logits_soft_cap=cap, window_left=window, q_len=q_len, out=out, lse=lse)
    assert got is out
    kd, vd = nvfp4kv.dequantize(cache.kv_cache, k_scale, v_scale, value_cache=cache.value_cache,
                                scale_layout=scale_layout, dtype="float32")
    sm = 1.0 / math.sqrt(q.shape[2]) if sm_scale is None else sm_scale
    want, want_lse = reference(q.float().numpy(), kd.numpy(), vd.numpy(), bt.numpy(), seq_lens.numpy(), q_len,
                               sm, cap, window, cache.N, cache.T)
    o = out.float().numpy().astype(np.float64)
    l64 = lse.numpy().astype(np.float64)
    empty = np.isneginf(want_lse)
    assert np.array_equal(np.isneginf(l64), empty), "lse -inf exactly for the rows that see no position"
    assert not o[empty].any(), "rows that see no position are 0"
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(l64[~empty]))
    den = np.linalg.norm(want)
    err = np.linalg.norm(o - want) / den if den > 0 else np.linalg.norm(o)
    # Each (row, head) on its own too: the whole output's error spreads a defect confined to one
    # row's values over all of them (by sqrt(rows * heads)).
    rden = np.linalg.norm(want, axis=-1)
    rerr = np.linalg.norm(o - want, axis=-1)
    row_err = (rerr[rden > 0] / rden[rden > 0]).max() if (rden > 0).any() else 0.0
    lse_err = np.abs(l64[~empty] - want_lse[~empty]).max() if (~empty).any() else 0.0
    MEASURED["rel_l2"], MEASURED["lse"] = max(MEASURED["rel_l2"], err), max(MEASURED["lse"], lse_err)
    tol = rel_l2_tol(q.dtype)
    assert err <= tol, f"relative L2 error {err:.3g} > {tol}"
    assert row_err <= ROW_TOL_FACTOR * tol, f"one row's relative L2 error {row_err:.3g} > {ROW_TOL_FACTOR * tol}"
    assert lse_err <= LSE_TOL, f"lse error {lse_err:.3g} > {LSE_TOL}"
    return err, lse_err


def setup(N=12, T=16, H=2, D=128, view="5d", layout="HND", scale_layout="vllm", B=3, q_len=1, group=4,
          dtype="bfloat16", index="int32", seq_lens=None, seed=0, k_scale=0.02, v_scale=0.03):
    rng = np.random.default_rng(seed)
    cache = make_cache(N, T, H, D, view=view, layout=layout, backend="torch", seed=seed)
    fill(cache, rng, k_scale, v_scale, scale_layout)
    max_blocks = N // B + 2
    bt = rng.permutation(N)[: B * (max_blocks - 2)].reshape(B, max_blocks - 2)
    bt = np.concatenate([bt, rng.integers(0, N, (B, 2))], axis=1)  # pages may repeat: allowed
    if seq_lens is None:
        seq_lens = rng.integers(q_len, max_blocks * T + 1, B)
    q = torch.from_numpy(rng.standard_normal((B * q_len, H * group, D)).astype(np.float32) * 2).to(TORCH_DTYPE[dtype])
    return cache, q, as_index(bt, index), as_index(seq_lens, index)


# ------------------------------------------------------------------------------------ accuracy
@pytest.mark.parametrize("window", [-1, 20])
def test_a_shared_prefix_merged_by_lse(window):
    """The cascade recipe of the integration guide (§2, "A shared prefix"): the prefix's partial
    over the prefix's pages with the sequences' full lengths, the suffix's over its own pages and
    lengths, merged by lse, equals attention over the whole sequence (against float64). Passing
    the prefix's length instead puts the rows at the prefix's end: wrong with a window (review)."""
    cache, q, bt, _ = setup(B=3, q_len=2, seed=11)
    P = 2  # prefix pages (32 positions)
    seq_lens = torch.tensor([40, 70, 45], dtype=torch.int32)
    kd, vd = nvfp4kv.dequantize(cache.kv_cache, 0.02, 0.03, value_cache=cache.value_cache, dtype="float32")
    want, _ = reference(q.float().numpy(), kd.numpy(), vd.numpy(), bt.numpy(), seq_lens.numpy(), 2,
                        1.0 / math.sqrt(q.shape[2]), 0.0, window, cache.N, cache.T)

    def part(table, lens):
        out, lse = torch.empty(q.shape, dtype=q.dtype), torch.empty(q.shape[:2])
        nvfp4kv.decode_attention(q, cache.kv_cache, table, lens, 0.02, 0.03, value_cache=cache.value_cache,
                                 window_left=window, q_len=2, out=out, lse=lse)
        return out.double(), lse.double()

    def merged(prefix_lens):
        (oa, la), (ob, lb) = part(bt[:, :P].contiguous(), prefix_lens), part(bt[:, P:].contiguous(),
                                                                             seq_lens - P * cache.T)
        m = torch.maximum(la, lb)  # the suffix holds each row's own position: finite
        wa, wb = torch.exp(la - m), torch.exp(lb - m)
        return ((wa[..., None] * oa + wb[..., None] * ob) / (wa + wb)[..., None]).numpy()

    err = np.linalg.norm(merged(seq_lens) - want) / np.linalg.norm(want)
    assert err <= REL_L2_TOL, err
    if window >= 0:
        wrong = np.linalg.norm(merged(torch.full_like(seq_lens, P * cache.T)) - want) / np.linalg.norm(want)
        assert wrong > 0.05, wrong


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("group", [1, 4, 8, 16])
@pytest.mark.parametrize("q_len", [1, 2, 4, 8])
def test_head_sizes_groups_q_len(D, group, q_len):
    k = (D // 64) * 16 + group * 4 + q_len  # the other dimensions vary with the case
    dtype = ("bfloat16", "float16")[k % 2]
    index = ("int32", "int64")[(k // 2) % 2]
    T = (16, 32)[(k // 3) % 2]
    cache, q, bt, sl = setup(N=8, T=T, H=2 if group < 16 else 1, D=D, B=2, q_len=q_len, group=group, dtype=dtype,
                             index=index, seed=k)
    check(cache, q, bt, sl, q_len=q_len, seed=k)


# Groups and query lengths that are not powers of two: Qwen2.5-7B's GQA group is 7 (28 query
# heads over 4), speculative decoding often verifies 3 or 5 tokens. Rows = group x q_len fill
# chunks of 8 rows partly (7, 9 = 3 x 3, 30 = 6 x 5) or split a group across chunks.
ODD_GROUPS_Q_LEN = [(3, 3), (5, 1), (6, 5), (7, 1), (7, 3), (12, 2), (7, 7)]


@pytest.mark.parametrize("group,q_len", ODD_GROUPS_Q_LEN)
def test_odd_groups_and_q_len(group, q_len):
    cache, q, bt, sl = setup(N=12, T=16, H=2, D=128, B=3, q_len=q_len, group=group, seed=group * 10 + q_len)
    check(cache, q, bt, sl, q_len=q_len, window=(-1, 20)[q_len % 2])


@pytest.mark.parametrize("view,layout,scale_layout", view_combos())
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("index", ["int32", "int64"])
def test_cache_forms(view, layout, scale_layout, dtype, index):
    cache, q, bt, sl = setup(view=view, layout=layout, scale_layout=scale_layout, dtype=dtype, index=index,
                             q_len=2, group=4, seed=len(view) + len(layout) + len(dtype))
    check(cache, q, bt, sl, q_len=2, scale_layout=scale_layout)


@pytest.mark.parametrize("T,layout", [(1, "HND"), (3, "NHD"), (3, "HND"), (32, "NHD")])
def test_block_sizes_linear(T, layout):
    cache, q, bt, sl = setup(N=24, T=T, layout=layout, scale_layout="linear", q_len=4, group=8, B=3, seed=T)
    check(cache, q, bt, sl, q_len=4, scale_layout="linear")


def test_two_sides_different_head_sizes():
    """K of head size 128, V of head size 64 (two sides of their own)."""
    rng = np.random.default_rng(5)
    N, T, H = 6, 16, 2
    kc = make_cache(N, T, H, 128, view="sides", backend="torch", seed=1)
    vc = make_cache(N, T, H, 64, view="sides", backend="torch", seed=2)
    key_cache, value_cache = kc.kv_cache, vc.value_cache
    n = N * T
    k = torch.randn(n, H, 128, generator=torch.Generator().manual_seed(0))
    v = torch.randn(n, H, 64, generator=torch.Generator().manual_seed(1))
    nvfp4kv.store(k, v, key_cache, torch.arange(n), 0.02, 0.03, value_cache=value_cache)
    bt = as_index(rng.permutation(N).reshape(2, 3), "int64")
    sl = as_index([40, 48], "int64")
    q = torch.randn(4, 8, 128).to(torch.bfloat16)
    out = nvfp4kv.decode_attention(q, key_cache, bt, sl, 0.02, 0.03, value_cache=value_cache, q_len=2)
    assert tuple(out.shape) == (4, 8, 64) and out.dtype == torch.bfloat16
    kd, vd = nvfp4kv.dequantize(key_cache, 0.02, 0.03, value_cache=value_cache, dtype="float32")
    want, _ = reference(q.float().numpy(), kd.numpy(), vd.numpy(), bt.numpy(), sl.numpy(), 2, 1 / math.sqrt(128),
                        0.0, -1, N, T)
    assert np.linalg.norm(out.float().numpy() - want) / np.linalg.norm(want) <= REL_L2_TOL


@pytest.mark.parametrize("q_len", [1, 4, 8])
def test_short_and_empty_sequences(q_len):
    """Lengths 0, 1, < q_len (some rows at p < 0 see nothing), q_len, and negative: rows that see
    no position are 0 with lse -inf."""
    lens = [0, 1, max(q_len - 1, 1), q_len, -5, 37]
    cache, q, bt, sl = setup(B=len(lens), N=18, q_len=q_len, group=2, seq_lens=lens, seed=q_len)
    check(cache, q, bt, sl, q_len=q_len)


@pytest.mark.parametrize("index", ["int32", "int64"])
def test_bad_block_table_entries_are_masked(index):
    """Entries < 0 or >= N mask their positions (the output equals attention without them), as
    do positions past the block table's columns (seq_lens beyond max_blocks * T)."""
    cache, q, bt, sl = setup(N=10, B=3, q_len=2, group=4, index=index, seed=7)
    big = 2**31 - 1 if index == "int32" else 2**62
    bt[0, 0], bt[0, 2], bt[1, 1] = -1, cache.N, -(2**31)
    bt[2] = torch.tensor([big, -7, 10**6, cache.N + 1, 3])  # only block 4 valid
    sl[1] = bt.shape[1] * cache.T + 100  # past the table
    check(cache, q, bt, sl, q_len=2)
    # With a window, sequence 2's rows see its last block only, or nothing.
    check(cache, q, bt, sl, q_len=2, window=5)


@pytest.mark.parametrize("cap,window", [(0.0, 0), (0.0, 1), (0.0, 17), (30.0, -1), (5.0, 40), (0.5, -1)])
def test_soft_cap_and_window(cap, window):
    cache, q, bt, sl = setup(N=16, B=2, q_len=4, group=4, seed=int(cap * 10) + window)
    check(cache, q, bt, sl, q_len=4, cap=cap, window=window)
    check(cache, q, bt, sl, q_len=4, cap=cap, window=window, sm_scale=0.3, k_scale=0.05, v_scale=0.5)


@pytest.mark.parametrize("D,window", [(128, -1), (256, 1000), (64, -1)])
def test_long_sequences(D, window):
    """A few thousand tokens per sequence."""
    T = 32
    cache, q, bt, sl = setup(N=220, T=T, H=1, D=D, B=2, q_len=2, group=8, seed=D, seq_lens=[3000 + D, 3333])
    check(cache, q, bt, sl, q_len=2, window=window)


def test_a_maximum_that_rises_late_in_a_long_sequence():
    # The CPU path sums positions in levels, the top one holding sums from the 4096th position on;
    # a row's maximum that rises there must rescale every level (mutation testing: skipping the
    # top level passed every test, whose maxima settled early). The last page's K is the first
    # query head's row, twice: a logit of about 64 against about 15 before it.
    T, D = 16, 64
    cache, q, bt, sl = setup(N=600, T=T, H=1, D=D, B=1, group=4, seed=3, seq_lens=[9000])
    page = int(bt[0, 8999 // T])
    k = (2 * q[0, 0].float()).expand(T, 1, D).contiguous()
    nvfp4kv.store(k, torch.randn(T, 1, D), slot_mapping=torch.arange(page * T, (page + 1) * T), k_scale=0.02,
                  v_scale=0.03, **cache.kwargs())
    check(cache, q, bt, sl)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_one_position_gives_its_value_rounded_once(dtype):
    # Weight 1: out is the dequantized V row times v_scale, rounded once to the query's dtype,
    # exactly, a zero's sign aside (the sums start at +0) (mutation testing: a truncating bf16
    # output stayed inside the 4e-3 bound).
    cache, q, bt, sl = setup(N=8, T=16, H=2, D=128, B=8, group=4, dtype=dtype, seed=5, seq_lens=[1] * 8)
    out = nvfp4kv.decode_attention(q, cache.kv_cache, bt, sl, 0.02, 0.03)
    _, vd = nvfp4kv.dequantize(cache.kv_cache, 0.02, 0.03, dtype="float32")
    want = vd[bt[:, 0].long(), 0].repeat_interleave(4, dim=1).to(TORCH_DTYPE[dtype])  # [B, Hq, D]
    assert torch.equal(out.float(), want.float())


def test_huge_queries_against_small_key_scales():
    """Found by review: the CPU path summed q . k over the raw values (e2m1 x e4m3, up to 2688)
    in fp32 before applying k_scale * sm_scale, so queries near bf16's top overflowed the sums to
    inf and NaN where the logits themselves are ordinary (here up to about 10). Each query row is
    now scaled by a power of two first, as the CUDA reader does."""
    T, D, H = 16, 128, 2
    rng = np.random.default_rng(11)
    cache = make_cache(6, T, H, D, backend="torch", seed=11)
    n = 6 * T
    k = torch.from_numpy(rng.standard_normal((n, H, D)).astype(np.float32)) * 3e-37  # raw values about 3
    v = torch.from_numpy(rng.standard_normal((n, H, D)).astype(np.float32))
    nvfp4kv.store(k, v, slot_mapping=torch.arange(n), k_scale=1e-37, v_scale=0.03, **cache.kwargs())
    bt = as_index(rng.permutation(6)[:4].reshape(2, 2), "int32")
    sl = as_index([2 * T, T + 5], "int32")
    q = torch.from_numpy(rng.standard_normal((2, 4 * H, D)).astype(np.float32) * 2.0**124).to(torch.bfloat16)
    check(cache, q, bt, sl, k_scale=1e-37, v_scale=0.03)
    # One element of 2^120 against a saturated K group (raw 2688 at k_scale 2^-126): a logit of
    # 2^120 * 2688 * 2^-126 = 42; with -2^120 beside it, 0. One position: out is V, lse the logit.
    nvfp4kv.store(torch.full((1, H, D), 2688 * 2.0**-126), v[:1], slot_mapping=torch.tensor([0]),
                  k_scale=2.0**-126, v_scale=1.0, **cache.kwargs())
    one = as_index([[0]], "int32")
    # (mutation testing: a row scaled by its largest element, not its largest magnitude, passed
    # while the largest was positive; -2^120 alone gives -42.)
    for pair, logit in (((2.0**120, 0.0), 42.0), ((2.0**120, -(2.0**120)), 0.0), ((-(2.0**120), 0.0), -42.0)):
        q1 = torch.zeros(1, H, D, dtype=torch.bfloat16)
        q1[0, :, :2] = torch.tensor(pair)
        lse = torch.empty(1, H)
        out = nvfp4kv.decode_attention(q1, cache.kv_cache, one, as_index([1], "int32"), 2.0**-126, 1.0,
                                       sm_scale=1.0, lse=lse)
        _, vd = nvfp4kv.dequantize(cache.kv_cache, 2.0**-126, 1.0, dtype="float32")
        assert torch.equal(out[0].float(), vd[0, 0].to(torch.bfloat16).float()) and lse.eq(logit).all(), lse


@pytest.mark.parametrize("sm_scale", [2.0**15, 2.0**10])
def test_a_query_near_the_top_beside_small_elements(sm_scale):
    """Found by review of the fix above, before it shipped: with a row's 2^-k folded into a float
    factor, k_scale * sm_scale * 2^-k passed FLT_MAX for a row whose largest element is 2^127 and
    was held there, which scaled every logit of the row. Here that element meets K's zeros, and
    the logits are small: 2^-15 * K[:, 1] * sm_scale."""
    T, D = 16, 64
    cache = nvfp4kv.allocate_kv_cache(nvfp4kv.KVCacheSpec(block_size=T, num_kv_heads=1, head_size=D), 1)
    k = torch.zeros(2, 1, D)
    k[:, 0, 1] = torch.tensor([1.0, 2.0])
    v = torch.from_numpy(np.random.default_rng(4).standard_normal((2, 1, D)).astype(np.float32))
    nvfp4kv.store(k, v, cache, torch.arange(2), 1.0, 1.0)
    q = torch.zeros(1, 1, D, dtype=torch.bfloat16)
    q[0, 0, 0], q[0, 0, 1] = 2.0**127, 2.0**-15
    bt, sl = as_index([[0]], "int32"), as_index([2], "int32")
    lse = torch.empty(1, 1)
    out = nvfp4kv.decode_attention(q, cache, bt, sl, 1.0, 1.0, sm_scale=sm_scale, lse=lse)
    kd, vd = nvfp4kv.dequantize(cache, 1.0, 1.0, dtype="float32")
    want, want_lse = reference(q.float().numpy(), kd.numpy(), vd.numpy(), bt.numpy(), sl.numpy(), 1, sm_scale, 0.0,
                               -1, 1, T)
    o = out.float().numpy().astype(np.float64)
    assert np.linalg.norm(o - want) <= REL_L2_TOL * np.linalg.norm(want)
    assert abs(float(lse) - want_lse[0, 0]) <= LSE_TOL, (float(lse), want_lse[0, 0])


def test_lse_when_the_maximum_rises_in_every_chunk():
    """Found by review: the CPU path moved a row's maximum at every rise and rescaled its sums,
    each time rounding them; a maximum rising a little in each of 2^14 chunks of 64 positions
    left lse 1.8e-4 off (the output, a ratio, kept its accuracy). The maximum now moves only by
    more than a slack, as on the GPU. Position j's K holds its chunk's index j // 64 in binary
    (elements 0 or 6, exact at k_scale 1), and query element d is 2^(d - 28): logits rise from
    0 to 4e-4 in steps of 6 * 2^-28."""
    L, T, D = 1 << 20, 64, 64
    cache = nvfp4kv.allocate_kv_cache(nvfp4kv.KVCacheSpec(block_size=T, num_kv_heads=1, head_size=D), L // T)
    chunk = torch.arange(L) // 64
    key = torch.zeros(L, 1, D)
    key[:, 0, :14] = 6.0 * ((chunk[:, None] >> torch.arange(14)) & 1)
    nvfp4kv.store(key, torch.randn(L, 1, D, generator=torch.Generator().manual_seed(0)), cache,
                  torch.arange(L), 1.0, 1.0)
    q = torch.zeros(1, 1, D, dtype=torch.bfloat16)
    q[0, 0, :14] = 2.0 ** (torch.arange(14, dtype=torch.float32) - 28)
    lse = torch.empty(1, 1)
    nvfp4kv.decode_attention(q, cache, torch.arange(L // T, dtype=torch.int32)[None],
                             torch.tensor([L], dtype=torch.int32), 1.0, 1.0, sm_scale=1.0, lse=lse)
    logits = key[:, 0, :14].double() @ q[0, 0, :14].double()
    want = float(torch.logsumexp(logits, 0))
    assert abs(float(lse) - want) <= LSE_TOL, (float(lse), want)


def one_head_case(name):
    """Edge cases of the logits on a one-head cache (D 64, T 16, k_scale = v_scale = 1), for the
    CPU tests below and the GPU's (test_decode_gpu.py): the cache, query, block table, lengths
    and sm_scale.
    - "jump": positions 0..63 (the CPU path's first chunk) have logit 0, position 64 has
      25 x 4 = 100, past fp32's exp range above the running maximum;
    - "tiny": query element 0 is 2^-120 (a row maximum below 2^-113) at sm_scale 2^118: logits
      K[:, 0] / 4, from 0 to about 3.4;
    - "nan_at_zero": position 1's logit is -200 against 0 (weight 0 in fp32) and its V group 0
      is NaN."""
    D, T = 64, 16
    g = torch.Generator().manual_seed(2)
    n, q0, sm_scale = {"jump": (65, 25.0, 1.0), "tiny": (8, 2.0**-120, 2.0**118), "nan_at_zero": (2, 50.0, 1.0)}[name]
    k = torch.zeros(n, 1, D)
    v = torch.randn(n, 1, D, generator=g)
    if name == "jump":
        k[64, 0, 0] = 4.0
    elif name == "tiny":
        k[:, 0, 0] = 2 * torch.arange(8.0)
    else:
        k[1, 0, 0] = -4.0
        v[1, 0, 3] = float("nan")
    pages = -(-n // T)
    cache = nvfp4kv.allocate_kv_cache(nvfp4kv.KVCacheSpec(block_size=T, num_kv_heads=1, head_size=D), pages)
    nvfp4kv.store(k, v, cache, torch.arange(n), 1.0, 1.0)
    q = torch.zeros(1, 1, D, dtype=torch.bfloat16)
    q[0, 0, 0] = q0
    return cache, q, as_index([list(range(pages))], "int32"), as_index([n], "int32"), sm_scale


def test_a_maximum_that_jumps_past_exp_range_in_a_later_chunk():
    """Mutation testing: a slack that let the maximum lag by more than fp32's exp range (about 88)
    passed every test, whose late rises were smaller."""
    cache, q, bt, sl, sm_scale = one_head_case("jump")
    lse = torch.empty(1, 1)
    out = nvfp4kv.decode_attention(q, cache, bt, sl, 1.0, 1.0, sm_scale=sm_scale, lse=lse)
    kd, vd = nvfp4kv.dequantize(cache, 1.0, 1.0, dtype="float32")
    want, want_lse = reference(q.float().numpy(), kd.numpy(), vd.numpy(), bt.numpy(), sl.numpy(), 1, sm_scale,
                               0.0, -1, kd.shape[0], 16)
    o = out.float().numpy().astype(np.float64)
    assert np.linalg.norm(o - want) <= REL_L2_TOL * np.linalg.norm(want)
    assert want_lse[0, 0] > 99 and abs(float(lse) - want_lse[0, 0]) <= LSE_TOL, (float(lse), want_lse[0, 0])


def test_a_tiny_query_row_with_a_large_sm_scale():
    """Mutation testing: a row whose largest element is below 2^-113 takes the largest power of
    two the factor allows (2^126), which dropping that clamp did not change in any test."""
    cache, q, bt, sl, sm_scale = one_head_case("tiny")
    lse = torch.empty(1, 1)
    nvfp4kv.decode_attention(q, cache, bt, sl, 1.0, 1.0, sm_scale=sm_scale, lse=lse)
    kd, _ = nvfp4kv.dequantize(cache, 1.0, 1.0, dtype="float32")
    want = float(torch.logsumexp(kd[0, :8, 0, 0].double() / 4, 0))  # the stored K, rounded to NVFP4
    assert abs(float(lse) - want) <= LSE_TOL, (float(lse), want)


def test_a_nan_v_group_reaches_the_row_at_weight_zero():
    """A row attends every position in its range, however small its weight: a NaN V group of a
    position whose weight is 0 in fp32 still reaches that row's group, as 0 x NaN does in the
    reference (mutation testing: skipping weights of 0 passed)."""
    cache, q, bt, sl, sm_scale = one_head_case("nan_at_zero")
    out = nvfp4kv.decode_attention(q, cache, bt, sl, 1.0, 1.0, sm_scale=sm_scale)
    assert torch.isnan(out[0, 0, :16].float()).all() and torch.isfinite(out[0, 0, 16:].float()).all()


def million_token_setup(window, seed, D=64, N=48, T=16, index="int32"):
    """Two sequences, of 2^20 + 77 positions (the issue asks for at least 1M) and of 1000, whose
    block tables repeat N pages in random order, with masked entries (-1 and N) among them: every
    position's page and slot is still its own, so position arithmetic, splits and masking run at
    a million, while the cache stays small."""
    rng = np.random.default_rng(seed)
    cache = make_cache(N, T, 1, D, backend="torch", seed=seed)
    fill(cache, rng, 0.02, 0.03, "vllm")
    lens = [(1 << 20) + 77, 1000]
    cols = -(-lens[0] // T)
    bt = rng.integers(0, N, (2, cols))
    bt[0, rng.integers(0, cols, cols // 50)] = -1
    bt[0, rng.integers(0, cols, cols // 50)] = N
    q = torch.from_numpy(rng.standard_normal((4, 2, D)).astype(np.float32) * 2).to(torch.bfloat16)
    return cache, q, as_index(bt, index), as_index(lens, index)


@pytest.mark.parametrize("window", [-1, 300_000])
def test_a_million_positions(window):
    """Sequence lengths to at least 1M tokens: the CPU path over 2^20 + 77 positions, q_len 2,
    GQA 2, the whole sequence or a window that starts 300,000 positions back."""
    cache, q, bt, sl = million_token_setup(window, seed=5 + window % 7, index="int64" if window > 0 else "int32")
    check(cache, q, bt, sl, q_len=2, window=window)


def test_nan_groups_reach_only_the_rows_that_see_them():
    rng = np.random.default_rng(3)
    N, T, H, D = 4, 16, 1, 64
    cache = make_cache(N, T, H, D, backend="torch", seed=3)
    fill(cache, rng, 1.0, 1.0, "vllm", nan_slot=5)  # page 0, position 5
    bt = as_index([[0, 1]], "int32")
    q = torch.randn(4, 2, D).to(torch.bfloat16)
    lse = torch.empty(4, 2)
    out = nvfp4kv.decode_attention(q, cache.kv_cache, bt, as_index([24], "int32"), q_len=4, window_left=16, lse=lse)
    # rows at positions 20..23 see [4..7].. [7..23]: position 5 only for rows 0, 1 (p = 20, 21).
    assert torch.isnan(out[:2].float()).all() and torch.isnan(lse[:2]).all()
    assert torch.isfinite(out[2:].float()).all() and torch.isfinite(lse[2:]).all()


def v_nan_case(T, D, slot, elem, window):
    """q_len 4 at the end of a 24-token sequence (rows at positions 20..23), a NaN V group at
    `slot` (page slot // T, identity block table). Returns (cache, q, bt, seq_lens, rows that
    attend the slot)."""
    rng = np.random.default_rng(5)
    N, H = 4, 1
    cache = make_cache(N, T, H, D, backend="torch", seed=5)
    fill(cache, rng, 1.0, 1.0, "vllm", v_nan=(slot, elem))
    bt = as_index([list(range(24 // T + (24 % T > 0)))], "int32")
    q = torch.randn(4, 2, D, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    first = [max(0, 20 + i - window) if window >= 0 else 0 for i in range(4)]
    seeing = [i for i in range(4) if first[i] <= slot <= 20 + i]
    return cache, q, bt, as_index([24], "int32"), seeing


def check_v_nan(out, lse, seeing, elem):
    """NaN exactly in the V group of `elem` of the rows in `seeing`; lse finite everywhere."""
    g = elem // 16
    want = torch.zeros(out.shape, dtype=torch.bool)
    want[seeing, :, 16 * g: 16 * g + 16] = True
    assert torch.equal(torch.isnan(out.float()).cpu(), want)
    assert torch.isfinite(lse).all()


@pytest.mark.parametrize("slot,window", [(5, 16), (23, -1), (21, -1)])
def test_v_nan_group_reaches_only_the_rows_that_attend_it(slot, window):
    """A NaN V group reaches only the rows whose range holds its token, and only that group's
    elements: masked out (by the window or the causal end of the queries) it changes nothing."""
    cache, q, bt, sl, seeing = v_nan_case(16, 64, slot, 5, window)
    assert 0 < len(seeing) < 4
    lse = torch.empty(4, 2)
    out = nvfp4kv.decode_attention(q, cache.kv_cache, bt, sl, q_len=4, window_left=window, lse=lse)
    check_v_nan(out, lse, seeing, 5)


def test_same_bytes_for_every_thread_count():
    cache, q, bt, sl = setup(N=64, B=8, q_len=2, group=8, seed=11, seq_lens=[200] * 8)
    outs = []
    try:
        for threads in (1, 2, 5):
            nvfp4kv.set_cpu_threads(threads)
            lse = torch.empty(q.shape[0], q.shape[1])
            outs.append((bits(nvfp4kv.decode_attention(q, cache.kv_cache, bt, sl, q_len=2, lse=lse)), bits(lse)))
    finally:
        env = os.environ.get("NVFP4KV_CPU_THREADS", "")
        nvfp4kv.set_cpu_threads(int(env) if env.isdigit() and int(env) <= 256 else 0)  # as test_cpu_threads
    for o, lse in outs[1:]:
        assert torch.equal(o, outs[0][0]) and torch.equal(lse, outs[0][1])


@pytest.mark.parametrize("shift", [1, 2, 4])
def test_cache_past_an_alignment_boundary(shift):
    """The CPU path reads cache sides that start `shift` bytes past an aligned address (which the
    GPU refuses below 4 bytes: test_decode_gpu.py): the same output and lse bits as the aligned
    cache."""
    cache, q, bt, sl = setup(N=16, B=2, q_len=2, group=2, seed=13, seq_lens=[90, 41])
    kv = cache.kv_cache
    flat = torch.empty(0, dtype=torch.uint8).set_(kv.untyped_storage())
    buf = torch.zeros(flat.numel() + shift, dtype=torch.uint8)
    buf[shift:].copy_(flat)
    moved = buf.as_strided(kv.shape, kv.stride(), kv.storage_offset() + shift)
    assert moved.data_ptr() % 4 != 0 or shift == 4
    outs = []
    for c in (kv, moved):
        lse = torch.empty(q.shape[0], q.shape[1])
        outs.append((bits(nvfp4kv.decode_attention(q, c, bt, sl, 0.02, 0.03, q_len=2, lse=lse)), bits(lse)))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_defaults_allocate_out_like_the_query():
    cache, q, bt, sl = setup(dtype="float16", seed=2)
    out = nvfp4kv.decode_attention(q, cache.kv_cache, bt, sl, 0.02, 0.03)
    assert out.dtype == torch.float16 and tuple(out.shape) == tuple(q.shape)
    again = nvfp4kv.decode_attention(q, cache.kv_cache, bt, sl, 0.02, 0.03, sm_scale=1 / math.sqrt(128))
    assert torch.equal(bits(out), bits(again))


# ------------------------------------------------------------------------------------ workspace
def splits(B, H, max_blocks):  # params.h's decode_splits
    units = max(B * H, 1)
    return max(1, min(-(-512 // units), 64, max_blocks // 8))


@pytest.mark.parametrize("B,q_len,Hq,H,Dv,mb", [(1, 1, 8, 2, 128, 3), (1, 1, 8, 2, 128, 40), (4, 2, 32, 8, 64, 100), (256, 1, 8, 8, 128, 64),
                                                (0, 1, 4, 4, 256, 5), (7, 8, 16, 1, 256, 1), (1, 1, 8, 1, 128, 4096),  # 64 splits: the cap
                                                (2**62, 1, 16, 16, 128, 1000)])  # B * H past int64: one split
def test_workspace_bytes(B, q_len, Hq, H, Dv, mb):
    s = splits(B, H, mb)
    want = 4 * B * q_len * Hq * s * (Dv + 2) if s > 1 else 0
    assert nvfp4kv.decode_workspace_bytes(B, q_len, Hq, H, Dv, mb) == want


def test_a_view_of_the_tables_first_columns():
    """An engine that knows its batch's longest sequence may pass a view of its table's first
    columns (integration guide): the bits of a table of those columns alone, and that width's
    workspace; the columns past the view hold pages that nothing reads."""
    cache, q, bt, _ = setup(N=60, B=3, seed=5)  # 22 columns
    wide = torch.randint(0, cache.N, (3, 400), dtype=bt.dtype, generator=torch.Generator().manual_seed(2))
    wide[:, :22] = bt
    view = wide[:, :22]
    assert not view.is_contiguous()
    sl = torch.tensor([352, 17, 200], dtype=torch.int32)
    got = nvfp4kv.decode_attention(q, cache.kv_cache, view, sl, 0.02, 0.03, value_cache=cache.value_cache)
    want = nvfp4kv.decode_attention(q, cache.kv_cache, bt, sl, 0.02, 0.03, value_cache=cache.value_cache)
    assert torch.equal(bits(got), bits(want))
    sizes = [nvfp4kv.decode_workspace(cache.kv_cache, q, t).numel() for t in (view, bt, wide)]
    assert sizes[0] == sizes[1] < sizes[2], sizes


def test_decode_workspace_allocates():
    cache, q, bt, sl = setup(N=60, seed=1)  # 22 block-table columns: 2 splits of at least 8
    ws = nvfp4kv.decode_workspace(cache.kv_cache, q, bt)
    assert ws.dtype == torch.uint8 and ws.device == q.device and not ws.any()
    assert ws.numel() == nvfp4kv.decode_workspace_bytes(bt.shape[0], 1, q.shape[1], 2, 128, bt.shape[1])
    assert ws.numel() > 0
    big = torch.zeros(1024, 1, dtype=torch.int32)  # many sequences: one split, no workspace
    qbig = torch.zeros(1024, 8, 128)
    assert nvfp4kv.decode_workspace(cache.kv_cache, qbig, big).numel() == 0
    # On the CPU the workspace is ignored.
    out = nvfp4kv.decode_attention(q, cache.kv_cache, bt, sl, 0.02, 0.03, workspace=ws)
    assert torch.equal(bits(out), bits(nvfp4kv.decode_attention(q, cache.kv_cache, bt, sl, 0.02, 0.03)))


def test_decode_workspace_says_where_a_bad_size_came_from():
    """decode_workspace_bytes' errors name its own parameters (num_qo_heads, head_size_v), which a
    caller of decode_workspace did not pass: the message says which shapes gave them (review)."""
    cache, q, bt, sl = setup(N=60, seed=1)
    with pytest.raises(ValueError, match=r"query of shape \(3, 7, 128\).*num_qo_heads: 7 received with 2 KV heads"):
        nvfp4kv.decode_workspace(cache.kv_cache, q[:, :7], bt)
    odd = torch.zeros(4, 2, 16, 2, 54, dtype=torch.uint8)  # F 54: head size 96, which decode does not take
    with pytest.raises(ValueError, match=r"cache of 2 KV heads of head size 96.*head_size_v: head size 96"):
        nvfp4kv.decode_workspace(odd, q, bt)
    with pytest.raises(ValueError, match=r"^kv_cache: last dimension 70 received"):  # no head size at all
        nvfp4kv.decode_workspace(torch.zeros(4, 2, 16, 2, 70, dtype=torch.uint8), q, bt)
    for shape in ((3, 128), (3, 1, 8, 128)):  # a query of [tokens, heads, D] only (mutation testing)
        with pytest.raises(ValueError, match=r"^query: shape"):
            nvfp4kv.decode_workspace(cache.kv_cache, q.new_zeros(shape), bt)


def test_wrong_query_heads_or_cache_dtype_before_allocating(monkeypatch):
    """Found by review: the output was allocated before the query's head count was checked (a
    query broadcast to 2^36 heads asked for 16 TiB), and a bf16 cache of D 128 was called a wrong
    last dimension instead of a wrong dtype; with too many heads too, its output was allocated."""
    import nvfp4kv.api as api

    cache, q, bt, sl = setup(N=60, seed=1)  # 2 KV heads

    def no_allocation(*args):
        raise AssertionError(f"an output was allocated: {args[1:]}")

    monkeypatch.setattr(api, "_empty", no_allocation)
    bf16 = torch.zeros(4, 2, 16, 2, 128, dtype=torch.bfloat16)
    for hq in (33, 2**20, 2**36):
        wide = q[:, :1].expand(q.shape[0], hq, q.shape[2])
        with pytest.raises(ValueError, match=f"^query: {hq} query heads .* 2 KV heads of kv_cache; .* at most 16"):
            nvfp4kv.decode_attention(wide, cache.kv_cache, bt, sl, 0.02, 0.03)
        with pytest.raises(ValueError, match=f"^query: {hq} query heads .* 2 KV heads of key_cache"):
            nvfp4kv.decode_attention(wide, cache.kv_cache[:, 0], bt, sl, 0.02, 0.03, value_cache=cache.kv_cache[:, 1])
        with pytest.raises(TypeError, match=r"kv_cache: dtype (torch\.)?bfloat16 received; expected uint8"):
            nvfp4kv.decode_attention(wide, bf16, bt[:, :4] % 4, sl.clamp(max=64), 0.02, 0.03)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="query: 7 query heads .* expected a multiple of the KV heads"):  # the C ABI's
        nvfp4kv.decode_attention(q[:, :1].expand(q.shape[0], 7, q.shape[2]), cache.kv_cache, bt, sl, 0.02, 0.03)


def test_empty_workspace_of_any_shape():
    """Found by review: a workspace with a zero extent and another above 1 was called not
    contiguous (an empty array is). A call whose geometry never splits (one block-table column)
    takes any empty workspace; one whose geometry may split on the GPU refuses it as too small,
    on the CPU as on the GPU (test_cpu_workspace_is_held_to_the_gpu_rules)."""
    cache, q, bt, sl = setup(N=60, seed=1)
    one, sl1 = bt[:, :1], sl.clamp(max=16)
    assert nvfp4kv.decode_workspace_bytes(3, 1, 8, 2, 128, 1) == 0
    want = nvfp4kv.decode_attention(q, cache.kv_cache, one, sl1, 0.02, 0.03)
    for ws in (torch.empty(0, dtype=torch.uint8), torch.empty(2, 0, dtype=torch.uint8),
               torch.empty(0, 4, dtype=torch.float32), torch.empty(3, 0, 5, dtype=torch.uint8)):
        got = nvfp4kv.decode_attention(q, cache.kv_cache, one, sl1, 0.02, 0.03, workspace=ws)
        assert torch.equal(bits(got), bits(want)), tuple(ws.shape)
        with pytest.raises(ValueError, match="workspace: 0 bytes, but this call needs"):
            nvfp4kv.decode_attention(q, cache.kv_cache, bt, sl, 0.02, 0.03, workspace=ws)


def test_cpu_workspace_is_held_to_the_gpu_rules():
    """Carried from a C ABI review: a workspace given to a CPU call, which does not use it, was
    checked for dtype, contiguity, device and overlap but not for size or alignment, so an engine
    tested on the CPU with an undersized workspace met the error only on the GPU. Now the same
    rules hold on both: too small or not 16-byte aligned is a ValueError that writes nothing; the
    size decode_workspace gives passes, and no workspace at all is still fine on the CPU."""
    cache, q, bt, sl = setup(N=60, seed=1)
    need = nvfp4kv.decode_workspace_bytes(3, 1, 8, 2, 128, bt.shape[1])
    assert need > 0 and nvfp4kv.decode_workspace(cache.kv_cache, q, bt).numel() == need
    out = torch.full(q.shape, 7.0, dtype=q.dtype)
    buf = torch.zeros(need + 32, dtype=torch.uint8)
    at = (-buf.data_ptr()) % 16  # a 16-byte aligned start inside buf
    for ws, msg in ((buf[at:at + need - 4], f"workspace: {need - 4} bytes, but this call needs {need}"),
                    (buf[at + 4:at + 4 + need], "workspace: address not a multiple of 16 bytes")):
        with pytest.raises(ValueError, match=msg):
            nvfp4kv.decode_attention(q, cache.kv_cache, bt, sl, 0.02, 0.03, out=out, workspace=ws)
        assert bool((out == 7.0).all())
    want = nvfp4kv.decode_attention(q, cache.kv_cache, bt, sl, 0.02, 0.03)
    got = nvfp4kv.decode_attention(q, cache.kv_cache, bt, sl, 0.02, 0.03, workspace=buf[at:at + need])
    assert torch.equal(bits(got), bits(want))


def test_cpu_workspace_sharing_memory_is_refused():
    """A workspace given to a CPU call, which does not use it, must still be memory of its own, as
    on the GPU: an engine tested on the CPU meets the GPU's refusal there (C ABI review). Nothing
    is written. One block-table column: a geometry that never splits, so that the size rule
    (test_cpu_workspace_is_held_to_the_gpu_rules) does not answer first."""
    cache, q, bt, sl = setup(N=60, seed=1)
    bt, sl = bt[:, :1], sl.clamp(max=16)
    out = torch.full(q.shape, 7.0, dtype=q.dtype)
    before = cache.kv_cache.clone()
    for ws, name in ((out.view(torch.uint8).view(-1), "out"), (cache.kv_cache.as_strided((64,), (1,)), "kv_cache")):
        with pytest.raises(ValueError, match="shares memory with workspace|workspace: shares memory"):
            nvfp4kv.decode_attention(q, cache.kv_cache, bt, sl, 0.02, 0.03, out=out, workspace=ws)
        assert torch.equal(cache.kv_cache, before) and bool((out == 7.0).all()), name
    apart = torch.zeros(64, dtype=torch.uint8)
    nvfp4kv.decode_attention(q, cache.kv_cache, bt, sl, 0.02, 0.03, out=out, workspace=apart)
    assert not bool((out == 7.0).all())


def test_query_without_a_dtype_needs_out():
    """A query the binding reads but that has no dtype (a memoryview) cannot shape an output
    allocated here: a TypeError naming the query, not an AttributeError (review)."""
    cache, q, bt, sl = setup(N=60, seed=1)
    qv = memoryview(q.to(torch.float16).numpy())
    with pytest.raises(TypeError, match="query: a memoryview received, which has no dtype"):
        nvfp4kv.decode_attention(qv, cache.kv_cache, bt, sl, 0.02, 0.03)
    out = np.zeros(q.shape, np.float16)
    nvfp4kv.decode_attention(qv, cache.kv_cache, bt, sl, 0.02, 0.03, out=out)
    want = nvfp4kv.decode_attention(q.to(torch.float16), cache.kv_cache, bt, sl, 0.02, 0.03)
    assert np.array_equal(out.view(np.int16), want.numpy().view(np.int16))


@pytest.mark.parametrize("args,arg", [((-1, 1, 8, 2, 128, 3), "num_seqs"), ((1, 0, 8, 2, 128, 3), "q_len"),
                                      ((1, 9, 8, 2, 128, 3), "q_len"), ((1, 1, 7, 2, 128, 3), "num_qo_heads"),
                                      ((1, 1, 64, 2, 128, 3), "num_qo_heads"), ((1, 1, 8, 0, 128, 3), "num_kv_heads"),
                                      ((1, 1, 8, 2, 96, 3), "head_size_v"), ((1, 1, 8, 2, 128, -1), "max_blocks")])
def test_workspace_bytes_rejects(args, arg):
    with pytest.raises(ValueError, match=arg):
        nvfp4kv.decode_workspace_bytes(*args)


@pytest.mark.parametrize("i,arg", [(0, "num_seqs"), (1, "q_len"), (5, "max_blocks_per_seq")])
@pytest.mark.parametrize("value", [2**63, -2**63 - 1, 2**70])
def test_workspace_bytes_names_ints_past_int64(i, arg, value):
    """Found by review: nanobind refused them with a message that names no argument."""
    args = [1, 1, 8, 2, 128, 3]
    args[i] = value
    with pytest.raises(ValueError, match=f"^{arg}: an int past the int64 range"):
        nvfp4kv.decode_workspace_bytes(*args)
    cache, q, bt, _ = setup(N=60, seed=1)
    if arg == "q_len":
        with pytest.raises(ValueError, match="^q_len: "):
            nvfp4kv.decode_workspace(cache.kv_cache, q, bt, q_len=value)


@pytest.mark.parametrize("args,arg", [((1, True, 8, 2, 128, 3), "q_len"), ((1.0, 1, 8, 2, 128, 3), "num_seqs"),
                                      ((1, 1, 8, 2, 128, np.int64(3).astype(float)), "max_blocks_per_seq")])
def test_workspace_bytes_takes_ints_only(args, arg):
    """Found by review: a bool q_len was read as 1 (decode_attention refuses it), a float count
    got the binding's message that names no argument."""
    with pytest.raises(TypeError, match=f"^{arg}: "):
        nvfp4kv.decode_workspace_bytes(*args)
    assert nvfp4kv.decode_workspace_bytes(np.int64(1), 1, 8, 2, 128, np.int32(3)) >= 0  # numpy ints are ints


# ------------------------------------------------------------------------------------ bad input
def bad_cases():
    """(name, change, error, match): change(kw) edits the keyword arguments of a valid call."""
    def q_as(dtype):
        return lambda kw: kw.update(query=kw["query"].to(dtype))

    def set_(**values):
        return lambda kw: kw.update(values)

    def small_cache(kw):
        c = make_cache(12, 16, 2, 32, backend="torch")
        kw.update(kv_cache=c.kv_cache, query=torch.zeros(3, 8, 32, dtype=torch.bfloat16), scale_layout="linear")

    def vllm_cache_96(kw):  # the 'vllm' profile refuses V head size 96 too, but the head size is the error
        c = make_cache(12, 16, 2, 96, backend="torch")
        kw.update(kv_cache=c.kv_cache, query=torch.zeros(3, 8, 96, dtype=torch.bfloat16), scale_layout="vllm")

    def v_side_32(kw):
        c = make_cache(12, 16, 2, 128, view="sides", backend="torch")
        v = make_cache(12, 16, 2, 32, view="sides", backend="torch")
        kw.update(kv_cache=c.kv_cache, value_cache=v.value_cache, scale_layout="linear")

    def strided_query(kw):
        kw.update(query=torch.zeros(3, 8, 256, dtype=torch.bfloat16)[:, :, ::2])

    def out_is_query(kw):
        kw.update(query=kw["out"])

    def rows_overflow(kw):  # 8 * (2^61 + 1) wraps to 8 rows in int64
        n = 2**61 + 1
        kw.update(block_table=torch.empty(n, 0, dtype=torch.int32),
                  seq_lens=torch.ones(1, dtype=torch.int32).expand(n), q_len=8, lse=None,
                  query=torch.zeros(8, 8, 128, dtype=torch.bfloat16),
                  out=torch.zeros(8, 8, 128, dtype=torch.bfloat16))

    return [
        ("query float32", q_as(torch.float32), TypeError, "query: dtype float32 received; expected bf"),
        ("query int16", q_as(torch.int16), TypeError, "query: dtype int16 received; expected bfloat16 or"),
        ("query head size 32", small_cache, ValueError, "query: head size 32.*64, 128 and 256"),
        ("V head size 32", v_side_32, ValueError, "value_cache: head size 32.*64, 128 and 256"),
        ("head size 96, 'vllm' profile", vllm_cache_96, ValueError, "query: head size 96.*64, 128 and 256"),
        ("query head size != cache", set_(query=torch.zeros(3, 8, 64, dtype=torch.bfloat16)), ValueError, "query"),
        ("query last stride", strided_query, ValueError, "query"),
        ("query 2-D", set_(query=torch.zeros(3, 8 * 128, dtype=torch.bfloat16)), ValueError, "query"),
        ("Hq not a multiple", set_(query=torch.zeros(3, 3, 128, dtype=torch.bfloat16)), ValueError, "query"),
        ("group 32", set_(query=torch.zeros(3, 64, 128, dtype=torch.bfloat16)), ValueError, "query"),
        ("q_len 0", set_(q_len=0), ValueError, "q_len"),
        ("q_len 9", set_(q_len=9), ValueError, "q_len"),
        ("q_len huge", set_(q_len=2**40), ValueError, "q_len"),
        ("q_len float", set_(q_len=1.0), TypeError, "q_len"),
        ("q_len past int64", set_(q_len=2**64), ValueError, "q_len: 18446744073709551616"),
        ("B * q_len past int64", rows_overflow, ValueError, "block_table: 2305843009213693953 sequences"),
        ("rows != B*q_len", set_(q_len=2), ValueError, "query"),
        ("seq_lens length", set_(seq_lens=torch.zeros(2, dtype=torch.int32)), ValueError, "seq_lens"),
        ("seq_lens float", set_(seq_lens=torch.zeros(3)), TypeError, "seq_lens"),
        ("block_table 1-D", set_(block_table=torch.zeros(3, dtype=torch.int32)), ValueError, "block_table"),
        ("block_table float", set_(block_table=torch.zeros(3, 4)), TypeError, "block_table"),
        ("out shape", set_(out=torch.zeros(3, 8, 64, dtype=torch.bfloat16)), ValueError, "out"),
        ("out dtype", set_(out=torch.zeros(3, 8, 128, dtype=torch.float16)), TypeError, "out"),
        ("out last stride", set_(out=torch.zeros(3, 8, 256, dtype=torch.bfloat16)[:, :, ::2]), ValueError, "out"),
        ("lse shape", set_(lse=torch.zeros(3, 4)), ValueError, "lse"),
        ("lse dtype", set_(lse=torch.zeros(3, 8, dtype=torch.bfloat16)), TypeError, "lse"),
        ("lse expanded", set_(lse=torch.zeros(1, 8).expand(3, 8)), ValueError, "lse"),
        ("out overlaps query", out_is_query, ValueError, "shares memory"),
        ("sm_scale 0", set_(sm_scale=0.0), ValueError, "sm_scale"),
        ("sm_scale -1", set_(sm_scale=-1.0), ValueError, "sm_scale"),
        ("sm_scale inf", set_(sm_scale=float("inf")), ValueError, "sm_scale"),
        ("sm_scale nan", set_(sm_scale=float("nan")), ValueError, "sm_scale"),
        ("sm_scale str", set_(sm_scale="1"), TypeError, "sm_scale"),
        ("sm_scale 0 in float", set_(sm_scale=1e-50), ValueError, "sm_scale: 1e-50 .*float32"),
        ("sm_scale inf in float", set_(sm_scale=1e39), ValueError, "sm_scale: 1e\\+39 .*float32"),
        ("sm_scale int past float", set_(sm_scale=10**400), ValueError, "^sm_scale: .*past the float range"),
        ("soft cap int past float", set_(logits_soft_cap=-10**400), ValueError, "^logits_soft_cap: .*past the float"),
        ("soft cap 0 in float", set_(logits_soft_cap=1e-50), ValueError, "logits_soft_cap: 1e-50 .*float32"),
        ("soft cap -0 in float", set_(logits_soft_cap=-1e-50), ValueError, "logits_soft_cap"),
        ("soft cap -1", set_(logits_soft_cap=-1.0), ValueError, "logits_soft_cap"),
        ("soft cap inf", set_(logits_soft_cap=float("inf")), ValueError, "logits_soft_cap"),
        ("soft cap nan", set_(logits_soft_cap=float("nan")), ValueError, "logits_soft_cap"),
        ("window -2", set_(window_left=-2), ValueError, "window_left"),
        ("window past int64", set_(window_left=-2**64), ValueError, "window_left: -18446744073709551616"),
        ("k_scale 0", set_(k_scale=0.0), ValueError, "k_scale"),
        ("v_scale nan", set_(v_scale=float("nan")), ValueError, "v_scale"),
        ("scale_layout", set_(scale_layout="nope"), ValueError, "scale_layout"),
        ("kv_cache float", set_(kv_cache=torch.zeros(12, 2, 16, 2, 72)), TypeError, "kv_cache"),
    ]


@pytest.mark.parametrize("name,change,error,match", bad_cases(), ids=[c[0] for c in bad_cases()])
def test_bad_input_raises_and_writes_nothing(name, change, error, match):
    cache, q, bt, sl = setup(B=3, q_len=1, group=4, seed=4)
    out = poisoned((3, 8, 128), torch.bfloat16, 1)
    lse = poisoned((3, 8), torch.float32, 2)
    kw = dict(query=q, kv_cache=cache.kv_cache, block_table=bt, seq_lens=sl, k_scale=0.02, v_scale=0.03,
              out=out, lse=lse)
    change(kw)
    outs = [x for x in (kw["out"], kw["lse"]) if x is not None]
    before = [bits(x) for x in outs]
    with pytest.raises(error, match=match):
        nvfp4kv.decode_attention(**kw)
    for x, b in zip(outs, before):
        assert torch.equal(bits(x), b), f"{name}: an output was written"


def test_window_past_int64_is_no_window():
    cache, q, bt, sl = setup(B=3, q_len=1, group=4, seed=5)
    want = nvfp4kv.decode_attention(q, cache.kv_cache, bt, sl, 0.02, 0.03)
    got = nvfp4kv.decode_attention(q, cache.kv_cache, bt, sl, 0.02, 0.03, window_left=2**64)
    assert torch.equal(bits(got), bits(want))


def test_pages_running_backwards_are_refused():
    """Found by review: reversed pages (a negative page stride) were refused as overlapping."""
    kv = make_cache(4, 16, 2, 128).kv_cache[::-1]
    with pytest.raises(ValueError, match="page stride -.*at least one page"):
        nvfp4kv.decode_attention(np.zeros((1, 2, 128), np.float16), kv, np.zeros((1, 1), np.int32),
                                 np.ones(1, np.int32), scale_layout="linear")


def test_lse_into_a_transposed_buffer():
    """lse takes any strides: a [Hq, rows] buffer (vLLM's merge_attn_states layout) receives it
    through its transpose, the same bits as a contiguous lse (integration guide §2, Outputs)."""
    cache, q, bt, sl = setup(B=3, q_len=2, seed=12)
    want_lse = torch.empty(6, 8)
    want = nvfp4kv.decode_attention(q, cache.kv_cache, bt, sl, 0.02, 0.03, q_len=2, lse=want_lse)
    buf = torch.full((8, 6), float("nan"))
    got = nvfp4kv.decode_attention(q, cache.kv_cache, bt, sl, 0.02, 0.03, q_len=2, lse=buf.T)
    assert torch.equal(bits(got), bits(want)) and torch.equal(bits(buf.T), bits(want_lse))


def test_vllm_profile_needs_hnd():
    cache, q, bt, sl = setup(layout="NHD", scale_layout="linear", seed=6)
    with pytest.raises(ValueError, match="scale_layout"):
        nvfp4kv.decode_attention(q, cache.kv_cache, bt, sl, scale_layout="vllm")


# ------------------------------------------------------------------------------------ torch op
def test_custom_op_equals_api():
    cache, q, bt, sl = setup(B=3, q_len=2, group=4, seed=9)
    lse1, lse2 = torch.empty(6, 8), torch.empty(6, 8)
    want = nvfp4kv.decode_attention(q, cache.kv_cache, bt, sl, 0.02, 0.03, q_len=2, lse=lse1, logits_soft_cap=20.0,
                                    window_left=30)
    out = torch.empty_like(want)
    torch.ops.nvfp4kv.decode_attention(q, cache.kv_cache, bt, sl, torch.tensor(0.02), torch.tensor(0.03), out,
                                       1 / math.sqrt(128), lse2, None, "vllm", 20.0, 30, 2)
    assert torch.equal(bits(out), bits(want)) and torch.equal(bits(lse1), bits(lse2))


def test_opcheck():
    from torch.library import opcheck

    cache, q, bt, sl = setup(B=2, q_len=1, group=2, seed=10, N=6)
    kv = cache.kv_cache.clone()  # a tensor of its own (opcheck clones its arguments)
    # Outputs of defined bytes: opcheck compares its arguments before and after (valgrind review).
    args = (q, kv, bt, sl, torch.tensor(0.02), torch.tensor(0.03), torch.zeros(2, 4, 128, dtype=torch.bfloat16),
            0.1, torch.zeros(2, 4))
    result = opcheck(torch.ops.nvfp4kv.decode_attention.default, args)
    assert all(v == "SUCCESS" for v in result.values()), result


def test_meta_and_fake_tensors_go_through_the_op():
    from torch._subclasses.fake_tensor import FakeTensorMode

    F = nvfp4kv.nvfp4_kv_cache_full_dim(128)
    kv = torch.empty(6, 2, 16, 2, F, dtype=torch.uint8, device="meta")
    q = torch.empty(4, 8, 128, dtype=torch.bfloat16, device="meta")
    bt = torch.empty(2, 3, dtype=torch.int32, device="meta")
    sl = torch.empty(2, dtype=torch.int32, device="meta")
    out = nvfp4kv.decode_attention(q, kv, bt, sl, q_len=2)
    assert out.device.type == "meta" and tuple(out.shape) == (4, 8, 128)
    cache, qr, btr, slr = setup(B=2, q_len=2, group=4, seed=12)
    with FakeTensorMode() as mode:
        f = [mode.from_tensor(x) for x in (qr, cache.kv_cache, btr, slr)]
        out = nvfp4kv.decode_attention(*f, 0.02, 0.03, q_len=2, lse=mode.from_tensor(torch.empty(4, 8)))
        assert tuple(out.shape) == (4, 8, 128)


def test_compiled_equals_eager():
    cache, q, bt, sl = setup(B=2, q_len=2, group=4, seed=13)

    def f(q, kv, bt, sl):
        return nvfp4kv.decode_attention(q, kv, bt, sl, 0.02, 0.03, q_len=2, window_left=20)

    want = f(q, cache.kv_cache, bt, sl)
    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="eager")(q, cache.kv_cache, bt, sl)
    assert torch.equal(bits(got), bits(want))


@pytest.mark.parametrize("L", [64, 65, 200])
def test_logits_of_minus_inf_weigh_zero_wherever_they_fall(L):
    """Found by review of the one-pass reader: logits that overflow to -inf in a chunk before the
    row's first finite one were summed as exp(-inf - -inf) = NaN (at L 65: 64 such positions
    fill the first chunk). They weigh 0, as on the GPU: the row attends its one finite logit."""
    D = 64
    cache, q, bt = minus_inf_logits_case(nvfp4kv, L, D=D)
    lse = torch.empty(1, 1)
    out = nvfp4kv.decode_attention(q, cache, bt, torch.tensor([L], dtype=torch.int32), 1.0, 1.0,
                                   scale_layout="linear", sm_scale=3e38, lse=lse)
    _, vd = nvfp4kv.dequantize(cache, 1.0, 1.0, scale_layout="linear")  # [N, T, 1, D]
    want = vd.reshape(-1, 1, D)[L - 1].to(torch.bfloat16)
    assert torch.equal(out[0], want) and float(lse) == 0.0
    # Every logit -inf: no weight anywhere, the result of a row that sees no position.
    out = nvfp4kv.decode_attention(q, cache, bt, torch.tensor([L - 1], dtype=torch.int32), 1.0, 1.0,
                                   scale_layout="linear", sm_scale=3e38, lse=lse)
    assert not out.float().any() and float(lse) == -math.inf


@pytest.mark.parametrize("T,D,scale_layout,seed", [(16, 128, "vllm", 0), (4, 64, "linear", 1), (3, 256, "linear", 2),
                                                   (16, 64, "vllm", 3)])
def test_cache_of_random_bytes_against_the_reference(T, D, scale_layout, seed):
    """Every byte a reader may meet, not only what the store writes: codes of every value, scale
    bytes with the sign bit, and NaN groups (0x7F, 0xFF), in an HND cache. The NaN pattern of out
    and lse is the reference's exactly (a NaN K group: the rows that see it; a NaN V group: those
    rows' 16 elements of it), and the finite rows agree within the usual tolerances."""
    rng = np.random.default_rng(seed)
    N, H, G, q_len, B = 6, 2, 4, 2, 3
    F = D // 2 + D // 16
    side = H * T * F
    raw = rng.integers(0, 256, (N, 2, side), dtype=np.uint8)
    scales = rng.integers(0, 0x3C, (N, 2, side - H * T * D // 2)).astype(np.uint8)  # up to 1.5
    scales |= (rng.random(scales.shape) < 0.3).astype(np.uint8) << 7  # negative scales
    nan = rng.random(scales.shape) < 0.005
    scales[nan] = rng.choice(np.array([0x7F, 0xFF], np.uint8), int(nan.sum()))
    raw[:, :, H * T * D // 2:] = scales
    buf = torch.from_numpy(raw.reshape(-1))
    kv = torch.as_strided(buf, (N, 2, T, H, F), (2 * side, side, F, T * F, 1))  # HND
    bt = torch.from_numpy(rng.integers(-1, N + 1, (B, 4)).astype(np.int32))
    sl = torch.tensor([4 * T, 3 * T - 1, T + 1], dtype=torch.int32)
    q = torch.from_numpy(rng.standard_normal((B * q_len, H * G, D)).astype(np.float32)).to(torch.bfloat16)
    lse = torch.empty(B * q_len, H * G)
    out = nvfp4kv.decode_attention(q, kv, bt, sl, 0.05, 0.3, scale_layout=scale_layout, q_len=q_len,
                                   window_left=2 * T, lse=lse)
    kd, vd = nvfp4kv.dequantize(kv, 0.05, 0.3, scale_layout=scale_layout)
    want, want_lse = reference(q.float().numpy(), kd.numpy(), vd.numpy(), bt.numpy(), sl.numpy(), q_len,
                               1 / math.sqrt(D), 0.0, 2 * T, N, T)
    o, lo = out.float().numpy().astype(np.float64), lse.numpy().astype(np.float64)
    assert np.array_equal(np.isnan(o), np.isnan(want)) and np.array_equal(np.isnan(lo), np.isnan(want_lse))
    assert np.array_equal(np.isneginf(lo), np.isneginf(want_lse))
    assert np.isnan(want).any() and (~np.isnan(want)).any()  # both kinds of rows are exercised
    fin = ~np.isnan(want)
    assert np.linalg.norm(o[fin] - want[fin]) <= REL_L2_TOL * np.linalg.norm(want[fin])
    lf = np.isfinite(want_lse)
    assert np.abs(lo[lf] - want_lse[lf]).max() <= LSE_TOL


def test_window_past_the_table_of_a_huge_length():
    """An int64 length of 2^39 + 1 with window_left 0: the row sees only position 2^39, past the
    table's positions, so nothing (out 0, lse -inf); the GPU test of the same call found an
    int32 wrap in the tensor-core reader (test_decode_gpu.py)."""
    T, D = 16, 128
    cache = nvfp4kv.allocate_kv_cache(nvfp4kv.KVCacheSpec(T, 1, D), 64)
    k = torch.randn(1024, 1, D)
    nvfp4kv.store(k, k, cache, torch.arange(1024), 1.0, 1.0)
    q = torch.randn(1, 1, D).to(torch.bfloat16)
    bt = torch.arange(64, dtype=torch.int32)[None]
    lse = torch.empty(1, 1)
    out = nvfp4kv.decode_attention(q, cache, bt, torch.tensor([2**39 + 1]), 1.0, 1.0, window_left=0, lse=lse)
    assert not out.float().any() and float(lse) == -math.inf
    out = nvfp4kv.decode_attention(q, cache, bt, torch.tensor([2**39 + 1]), 1.0, 1.0, window_left=2**39 - 1000,
                                   lse=lse)
    assert out.float().any() and math.isfinite(float(lse))  # positions 1000..1023 are in the table


def test_masked_blocks_near_the_end_of_int64():
    """Found by review (UBSan): a block table broadcast to 2^62 columns of T 2 puts its last
    positions within T of INT64_MAX; a masked block there advanced the position by (blk + 1) * T,
    which wrapped, and the call then walked about 2^62 masked blocks (it never returned). Run in
    a child so that a regression fails by the timeout instead of hanging the suite."""
    import subprocess
    import sys

    code = """if True:
        import torch, nvfp4kv
        cache = torch.zeros((2, 2, 2, 1, 36), dtype=torch.uint8)  # T 2, H 1, D 64
        bt = torch.full((1, 1), -1, dtype=torch.int64).expand(1, 2**62)  # every entry masked
        q = torch.ones((1, 1, 64), dtype=torch.bfloat16)
        lse = torch.empty(1, 1)
        out = nvfp4kv.decode_attention(q, cache, bt, torch.tensor([2**63 - 1]), scale_layout="linear",
                                       window_left=0, lse=lse)
        print(int(out.float().abs().sum()), float(lse))
    """
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["0", "-inf"]


def test_a_table_whose_positions_pass_2_64():
    """Mutation testing: a table of 2^62 columns at T 4 spans 2^64 positions, which wraps to 0 in
    a plain int64 product (the 2^62 x 2 test above, whose product wraps to -2^63, did not
    notice). The sequence reads its first 3 columns, as from a table of 3."""
    T, D = 4, 64
    g = torch.Generator().manual_seed(5)
    cache = nvfp4kv.allocate_kv_cache(nvfp4kv.KVCacheSpec(block_size=T, num_kv_heads=1, head_size=D), 1)
    nvfp4kv.store(torch.randn(T, 1, D, generator=g), torch.randn(T, 1, D, generator=g), cache, torch.arange(T),
                  1.0, 1.0)
    q = torch.randn(1, 1, D, generator=g).to(torch.bfloat16)
    wide = torch.zeros(1, 1, dtype=torch.int64).expand(1, 2**62)
    lse, lse3 = torch.empty(1, 1), torch.empty(1, 1)
    out = nvfp4kv.decode_attention(q, cache, wide, torch.tensor([10]), 1.0, 1.0, lse=lse)
    out3 = nvfp4kv.decode_attention(q, cache, torch.zeros(1, 3, dtype=torch.int64), torch.tensor([10]), 1.0, 1.0,
                                    lse=lse3)
    assert torch.equal(bits(out), bits(out3)) and torch.equal(lse, lse3) and math.isfinite(float(lse))
