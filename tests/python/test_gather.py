"""The read path: gather_dequant (block tables -> varlen K/V) and paged-to-paged dequantize.

CPU: every output byte against the independent NumPy reference (reference.dequantize_reference
of the cache bytes, indexed by each sequence's slots, rounded RNE to the output dtype; NaN == NaN).
The outputs are poisoned views of larger buffers, and the whole buffers are compared, so a row
written that should not be (or left unwritten) shows up.  GPU (skipped without CUDA): the CUDA path
against the CPU path byte for byte, on the same poison.
"""
import zlib

import numpy as np
import pytest
import reference as ref
from conftest import (
    assert_bytes_equal,
    expected_store,
    float_bits,
    make_cache,
    make_kv,
    mixed_tokens,
    round_f32_to,
    view_combos,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
nvfp4kv = pytest.importorskip("nvfp4kv")

HAS_CUDA = bool(torch.cuda.is_available() and nvfp4kv.build_info()["cuda_available"])
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device and a CUDA build of nvfp4kv")

BACKENDS = ("numpy", "torch")
_BITS = {"float32": np.uint32, "float16": np.uint16, "bfloat16": np.uint16}


def dtypes_for(backend):
    return ("float32", "float16", "bfloat16") if backend == "torch" else ("float32", "float16")


# ------------------------------------------------------------------------------------ helpers
def as_backend(x, backend, device="cpu"):
    """A numpy array as the backend's object (a copy for torch)."""
    if x is None:
        return None
    x = np.ascontiguousarray(x)
    return x if backend == "numpy" else torch.from_numpy(x.copy()).to(device)


def poisoned_out(rows, H, D, dtype, backend, device="cpu", strided=False, seed=0):
    """(buffer, view): random-bit floats (NaN/Inf patterns included), the view [rows, H, D] with
    last stride 1; strided: a window of a larger buffer (row and head strides bigger)."""
    shape = (rows + 3, H + 1, D + 16) if strided else (rows, H, D)
    bits = np.random.default_rng(seed).integers(0, 2**32, shape, dtype=np.uint64).astype(_BITS[dtype])
    if backend == "numpy":
        buf = bits.view(dtype)
    else:
        t = torch.from_numpy(bits.view(np.int16 if dtype != "float32" else np.int32).copy())
        buf = t.view(getattr(torch, dtype)).to(device)
    view = buf[2:2 + rows, 1:1 + H, 8:8 + D] if strided else buf
    return buf, view


def window(a, rows, H, D, strided):
    return a[2:2 + rows, 1:1 + H, 8:8 + D] if strided else a


def reference_rows(cache, snap, k_scale, v_scale, scale_layout, bt, seq_lens, cu, total):
    """[(out_rows, k fp32 [n,H,D], v fp32 [n,H,D])]: what gather must write, from the reference."""
    kref, vref = ref.dequantize_reference(cache.canonical(snap), np.float32(k_scale),
                                          np.float32(v_scale), cache.T, cache.H, cache.D,
                                          cache.layout, scale_layout)
    bt = np.asarray(bt, np.int64)
    B, max_blocks = bt.shape
    out = []
    for b in range(B):
        j = np.arange(max(int(seq_lens[b]), 0))
        rows = int(cu[b]) + j
        keep = (rows >= 0) & (rows < total)
        j, rows = j[keep], rows[keep]
        blk = j // cache.T
        page = np.where(blk < max_blocks, bt[b, np.minimum(blk, max(max_blocks - 1, 0))]
                        if max_blocks else -1, -1)
        valid = (page >= 0) & (page < cache.N)
        p, t = np.where(valid, page, 0), j % cache.T
        z = np.zeros((1, cache.H, cache.D), np.float32)
        k = np.where(valid[:, None, None], kref[p, t] if cache.N else z, np.float32(0))
        v = np.where(valid[:, None, None], vref[p, t] if cache.N else z, np.float32(0))
        out.append((rows, k.astype(np.float32), v.astype(np.float32)))
    return out


def expected_buffer(buf, rows_vals, which, dtype, rows, H, D, strided):
    """(bits, nan_mask) of the whole output buffer after the gather."""
    bits = float_bits(buf)[0].copy()
    nan = np.zeros(bits.shape, bool)
    wb, wn = window(bits, rows, H, D, strided), window(nan, rows, H, D, strided)
    for out_rows, k, v in rows_vals:
        if len(out_rows) == 0:
            continue
        b, n = float_bits(round_f32_to(k if which == 0 else v, dtype))
        wb[out_rows], wn[out_rows] = b, n
    return bits, nan


def assert_buffer(got_buf, want_bits, want_nan, what):
    """Bit equality; NaN == NaN only where a NaN is expected (untouched poison: exact bits)."""
    got_bits, got_nan = float_bits(got_buf)
    assert got_bits.shape == want_bits.shape
    assert np.array_equal(got_nan[want_nan], np.ones(int(want_nan.sum()), bool)), \
        f"{what}: expected NaN missing at {np.argwhere(want_nan & ~got_nan)[:5].tolist()}"
    bad = (got_bits != want_bits) & ~want_nan
    assert not bad.any(), (f"{what}: {int(bad.sum())} elements differ; first at "
                           f"{np.argwhere(bad)[:6].tolist()}: {got_bits[bad][:6]} vs {want_bits[bad][:6]}")


def prefix(seq_lens, dtype=np.int32):
    cu = np.zeros(len(seq_lens) + 1, np.int64)
    cu[1:] = np.cumsum(np.asarray(seq_lens, np.int64))
    return cu.astype(dtype)


def check_gather(nv, cache, bt, seq_lens, k_scale=1.0, v_scale=1.0, scale_layout="linear",
                 dtype="float32", cu_seqlens=None, pass_cu=True, total=None, strided=False,
                 seed=0):
    """Run gather_dequant into poisoned outputs and compare the whole buffers with the reference.

    bt, seq_lens, cu_seqlens: numpy arrays (their dtypes are kept), converted to the cache's
    backend.  Returns (kbuf, vbuf) as written."""
    backend, device = cache.backend, cache.device
    cu = prefix(seq_lens) if cu_seqlens is None else np.asarray(cu_seqlens)
    total = int(cu[-1]) if total is None else total
    H, D = cache.H, cache.D
    kbuf, kview = poisoned_out(total, H, D, dtype, backend, device, strided, seed)
    vbuf, vview = poisoned_out(total, H, D, dtype, backend, device, strided, seed + 1)
    snap = cache.snapshot()
    rows_vals = reference_rows(cache, snap, k_scale, v_scale, scale_layout, bt, seq_lens, cu, total)
    want = [expected_buffer(buf, rows_vals, i, dtype, total, H, D, strided)
            for i, buf in enumerate((kbuf, vbuf))]

    k, v, cu_out = nv.gather_dequant(
        block_table=as_backend(bt, backend, device), seq_lens=as_backend(seq_lens, backend, device),
        k_scale=k_scale, v_scale=v_scale, scale_layout=scale_layout,
        cu_seqlens=as_backend(cu, backend, device) if pass_cu else None,
        key_out=kview, value_out=vview, **cache.kwargs())
    assert k is kview and v is vview
    if not pass_cu:
        np.testing.assert_array_equal(np.asarray(cu_out.cpu() if backend == "torch" else cu_out), cu)
    assert_buffer(kbuf, *want[0], "key")
    assert_buffer(vbuf, *want[1], "value")
    assert_bytes_equal(cache.snapshot(), snap, cache)  # reading never writes
    return kbuf, vbuf


def random_table(rng, B, max_blocks, N, bad=True, idx_dtype=np.int64):
    """A block table with duplicate pages and (optionally) bad entries: -1, N, 10**6."""
    bt = rng.integers(0, N, (B, max_blocks))
    if bad and bt.size:
        choices = np.array([-1, N, 10**6, -(10**6)])
        mask = rng.random(bt.shape) < 0.2
        bt[mask] = rng.choice(choices, int(mask.sum()))
    return bt.astype(idx_dtype)


# --------------------------------------------------------------------------- CPU vs reference
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("view,layout,scale_layout", view_combos())
def test_gather_every_view_matches_reference(nv, backend, view, layout, scale_layout):
    # Random cache bytes: every code and scale byte (0x7F NaN and negative bytes too).
    N, T, H, D = 5, 8, 2, 64
    cache = make_cache(N, T, H, D, view, layout, backend, pad=0 if view == "packed4d" else 24,
                       seed=3)
    rng = np.random.default_rng(zlib.crc32(repr((view, layout, scale_layout, backend)).encode()))
    for i, dtype in enumerate(dtypes_for(backend)):
        idx = (np.int32, np.int64)[i % 2]
        # seq_len 0, a sequence longer than its table (blocks past max_blocks read as zeros)
        seq_lens = np.array([13, 0, 24, 40, 1], idx)
        bt = random_table(rng, 5, 4, N, idx_dtype=(np.int64, np.int32)[i % 2])
        check_gather(nv, cache, bt, seq_lens, 0.75, 1.5, scale_layout, dtype,
                     pass_cu=bool(i % 2), strided=(i == 1), seed=i)


@pytest.mark.parametrize("T", (5, 12))
@pytest.mark.parametrize("layout", ("HND", "NHD"))
def test_gather_pages_of_a_block_size_not_a_power_of_two(nv, T, layout):
    # Found by mutation testing: finding a position's page by a shift instead of a division
    # passed every CPU test, whose block sizes were all powers of two.
    N, H, D = 6, 2, 32
    cache = make_cache(N, T, H, D, "5d", layout, "numpy", seed=T)
    rng = np.random.default_rng(T)
    bt = random_table(rng, 3, 4, N, bad=False)
    seq_lens = np.array([4 * T, 2 * T + 3, T - 1], np.int64)  # sequences that cross pages
    check_gather(nv, cache, bt, seq_lens, 0.5, 2.0, "linear", "float32")


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_block_table_entries_give_zeros(nv, backend):
    N, T, H, D = 3, 4, 2, 32
    cache = make_cache(N, T, H, D, "5d", "NHD", backend, seed=5)
    for idx in (np.int32, np.int64):
        big = np.iinfo(idx).max
        bt = np.array([[-1, N, 10**6, big, np.iinfo(idx).min], [0, 1, 2, 1, 0]], idx)
        seq_lens = np.array([5 * T, 5 * T + 3], idx)  # the second runs past max_blocks
        kbuf, vbuf = check_gather(nv, cache, bt, seq_lens, 2.0, 0.5, "linear", "float32")
        # The first sequence is all zeros (+0.0), the tail of the second too.
        assert np.all(float_bits(kbuf)[0][:5 * T] == 0)
        assert np.all(float_bits(vbuf)[0][-3:] == 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_explicit_cu_seqlens_with_gaps_keeps_poison(nv, backend):
    N, T, H, D = 6, 4, 2, 64
    cache = make_cache(N, T, H, D, "5d", "HND", backend, seed=7)
    bt = np.array([[5, 0, 3], [2, 2, 1], [4, 1, 0]], np.int64)
    seq_lens = np.array([5, 10, 3], np.int32)
    cu = np.array([2, 10, 25, 31], np.int32)  # gaps [0,2), [7,10), [20,25), [28,31)
    for dtype in dtypes_for(backend):
        check_gather(nv, cache, bt, seq_lens, 0.1, 3.0, "vllm", dtype, cu_seqlens=cu, total=31)


@pytest.mark.parametrize("backend", BACKENDS)
def test_allocated_outputs_are_zeros_where_no_sequence_writes(nv, backend):
    """Outputs allocated by the call are zeros in the rows no sequence writes (the gaps of a
    cu_seqlens passed in; the padding rows of the output that takes a given one's row count),
    never memory of whatever was there: CPU and GPU then agree whatever their allocators hold
    (found while looking into a GPU-only failure of test_cuda_gather_dequant_property, whose
    cause turned out to be another: its draws let two sequences write one row)."""
    N, T, H, D = 6, 4, 2, 64
    cache = make_cache(N, T, H, D, "5d", "HND", backend, seed=7)
    bt = as_backend(np.array([[5, 0, 3], [2, 2, 1]], np.int64), backend)
    sl = as_backend(np.array([5, 10], np.int32), backend)
    cu = as_backend(np.array([2, 10, 25], np.int32), backend)  # gaps [0, 2), [7, 10), [20, 25)
    gaps = np.r_[0:2, 7:10, 20:25]
    lib = torch if backend == "torch" else np
    for _ in range(3):  # leave used memory of the outputs' size for the allocator to hand back
        del_me = [lib.full((25, H, D), float("nan"), dtype=lib.float32) for _ in range(4)]
        del del_me
        k, v, _ = nv.gather_dequant(cache.kv_cache, bt, sl, 0.5, 2.0, cu_seqlens=cu, dtype="float32")
        for out in (k, v):
            assert np.all(float_bits(out)[0][gaps] == 0)  # +0.0, where NaN was left
        # One output given with 5 padding rows: the new one's padding is zeros too.
        ko = lib.full((30, H, D), 7.0, dtype=lib.float32)
        del_me = [lib.full((30, H, D), float("nan"), dtype=lib.float32) for _ in range(4)]
        del del_me
        ko, v, _ = nv.gather_dequant(cache.kv_cache, bt, sl, 0.5, 2.0, key_out=ko)
        assert np.all(float_bits(v)[0][15:] == 0) and np.all(np.asarray(ko)[15:] == 7.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_total_tokens_smaller_than_cu_seqlens(nv, backend):
    """Rows past the end of the outputs are not written (and nothing crashes)."""
    N, T, H, D = 4, 8, 1, 16
    cache = make_cache(N, T, H, D, "sides", "HND", backend, seed=8)
    bt = np.array([[0, 1, 2], [3, 2, 1]], np.int32)
    seq_lens = np.array([20, 24], np.int32)
    for total in (0, 1, 19, 20, 33):
        check_gather(nv, cache, bt, seq_lens, 1.0, 1.0, "linear", "float32", total=total,
                     strided=True)
    # A cu_seqlens starting below zero: the negative rows are skipped too.
    check_gather(nv, cache, bt, seq_lens, 1.0, 1.0, "linear", "float32",
                 cu_seqlens=np.array([-5, 15, 39], np.int64), total=30)


def test_default_allocation_and_dtypes(nv):
    N, T, H, D = 4, 16, 2, 64
    cache = make_cache(N, T, H, D, "5d", "HND", "torch", seed=9)
    bt = torch.tensor([[3, 1], [0, 2]], dtype=torch.int32)
    sl = torch.tensor([20, 7], dtype=torch.int32)
    k, v, cu = nv.gather_dequant(cache.kv_cache, bt, sl, 0.5, 0.25)
    assert k.dtype == v.dtype == torch.bfloat16 and tuple(k.shape) == (27, H, D)
    assert cu.tolist() == [0, 20, 27]
    kref, vref = ref.dequantize_reference(cache.canonical(cache.snapshot()), 0.5, 0.25, T, H, D)
    want_k = np.concatenate([kref[3], kref[1, :4], kref[0, :7]])
    want_v = np.concatenate([vref[3], vref[1, :4], vref[0, :7]])
    for dtype in ("float32", "float16", torch.float16, "bfloat16"):
        k, v, _ = nv.gather_dequant(cache.kv_cache, bt, sl, 0.5, 0.25, dtype=dtype)
        name = str(dtype).replace("torch.", "")
        for got, want in ((k, want_k), (v, want_v)):
            b, n = float_bits(got)
            wb, wn = float_bits(round_f32_to(want, name))
            assert np.array_equal(n, wn) and np.array_equal(b[~n], wb[~wn])
    # numpy cache: float32 by default
    npc = make_cache(N, T, H, D, "5d", "HND", "numpy", seed=9)
    k, _, cu = nv.gather_dequant(npc.kv_cache, bt.numpy(), sl.numpy(), 0.5, 0.25)
    assert k.dtype == np.float32 and cu.tolist() == [0, 20, 27]


# ------------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("recipe", ("nvfp4", "nvfp4_4over6"))
@pytest.mark.parametrize("view,layout,scale_layout",
                         [("5d", "HND", "vllm"), ("5d", "NHD", "linear"), ("packed4d", "HND", "vllm"),
                          ("sides", "HND", "linear")])
def test_store_then_gather_round_trip(nv, recipe, view, layout, scale_layout):
    N, T, H, D = 12, 16, 2, 64
    rng = np.random.default_rng(11)
    cache = make_cache(N, T, H, D, view, layout, "torch", seed=12)
    seq_lens = np.array([37, 16, 0, 50], np.int64)
    pages = rng.permutation(N)  # distinct pages: the sequences' slots never collide
    bt = np.full((4, 4), -1, np.int64)
    used = 0
    for b, n in enumerate(seq_lens):
        nb = -(-int(n) // T)
        bt[b, :nb] = pages[used:used + nb]
        used += nb
    slots = np.concatenate([bt[b, np.arange(n) // T] * T + np.arange(n) % T
                            for b, n in enumerate(seq_lens)])
    total = int(seq_lens.sum())
    vals_k, vals_v = mixed_tokens(rng, total, H, D), mixed_tokens(rng, total, H, D)
    key, value, k32, v32 = make_kv(vals_k, vals_v, "bfloat16", "torch")
    ks, vs = 0.37, 0.011
    snap = cache.snapshot()
    want = expected_store(cache, snap, k32, v32, slots, ks, vs, recipe, scale_layout)
    nv.store(key, value, slot_mapping=torch.from_numpy(slots), k_scale=ks, v_scale=vs,
             recipe=recipe, scale_layout=scale_layout, **cache.kwargs())
    assert_bytes_equal(cache.snapshot(), want, cache)
    for dtype in ("bfloat16", "float32"):
        check_gather(nv, cache, bt, seq_lens, ks, vs, scale_layout, dtype)
    # ... and gathered rows equal dequantize() of the cache at the sequences' slots.
    k, v, _ = nv.gather_dequant(
        block_table=torch.from_numpy(bt), seq_lens=torch.from_numpy(seq_lens), k_scale=ks,
        v_scale=vs, dtype="float32", scale_layout=scale_layout, **cache.kwargs())
    kd, vd = nv.dequantize(k_scale=ks, v_scale=vs, dtype="float32", scale_layout=scale_layout,
                           **cache.kwargs())
    sl = torch.from_numpy(slots)
    want_k = kd.reshape(N * T, H, D)[sl]
    want_v = vd.reshape(N * T, H, D)[sl]
    assert torch.equal(k.view(torch.int32), want_k.view(torch.int32))
    assert torch.equal(v.view(torch.int32), want_v.view(torch.int32))
    # Round-trip sanity: NVFP4 keeps ~2 significant bits, so finite inputs come back close.
    fin = np.isfinite(k32).all(axis=-1)
    err = np.abs(k.numpy() - k32)[fin]
    assert np.nanmax(err / (np.abs(k32[fin]).max() + 1e-30)) < 1.0


# ---------------------------------------------------------------------------- paged to paged
@pytest.mark.parametrize("view,layout,scale_layout", view_combos(views=("5d", "sides", "packed4d")))
def test_dequantize_pages_into_bf16_paged_cache(nv, view, layout, scale_layout):
    N, T, H, D = 6, 8, 2, 64
    cache = make_cache(N, T, H, D, view, layout, "torch", pad=0 if view == "packed4d" else 8, seed=13)
    bits = np.random.default_rng(14).integers(0, 2**16, (N, 2, T, H, D), dtype=np.uint64)
    bf = torch.from_numpy(bits.astype(np.uint16).view(np.int16)).view(torch.bfloat16)
    before = bf.clone()
    pages = [4, -1, 0, 4, N, 10**6, 2]  # duplicates and out-of-range ids (skipped)
    for idx in (torch.int32, torch.int64):
        ko, vo = nv.dequantize(k_scale=0.3, v_scale=2.0, pages=torch.tensor(pages, dtype=idx),
                               scale_layout=scale_layout, key_out=bf[:, 0], value_out=bf[:, 1],
                               **cache.kwargs())
        assert ko.data_ptr() == bf[:, 0].data_ptr()
        kref, vref = ref.dequantize_reference(cache.canonical(cache.snapshot()), 0.3, 2.0, T, H, D,
                                              layout, scale_layout)
        got_bits, got_nan = float_bits(bf)
        want_bits, _ = float_bits(before)
        want_bits = want_bits.copy()
        want_nan = np.zeros(want_bits.shape, bool)
        for p in (0, 2, 4):
            for side, r in ((0, kref), (1, vref)):
                b, n = float_bits(round_f32_to(r[p], "bfloat16"))
                want_bits[p, side], want_nan[p, side] = b, n
        assert_buffer(bf, want_bits, want_nan, "paged")
        untouched = [p for p in range(N) if p not in (0, 2, 4)]
        assert torch.equal(bf[untouched].view(torch.int16), before[untouched].view(torch.int16))


def test_dequantize_pages_numpy_and_empty(nv):
    N, T, H, D = 3, 4, 1, 32
    cache = make_cache(N, T, H, D, "5d", "NHD", "numpy", seed=15)
    out_k = np.full((N, T, H, D), 7.0, np.float16)
    out_v = np.full((N, T, H, D), 7.0, np.float16)
    nv.dequantize(k_scale=1.0, v_scale=1.0, pages=np.array([], np.int64), scale_layout="linear",
                  key_out=out_k, value_out=out_v, **cache.kwargs())
    assert np.all(out_k == 7) and np.all(out_v == 7)
    nv.dequantize(k_scale=1.0, v_scale=1.0, pages=np.array([1], np.int32), scale_layout="linear",
                  key_out=out_k, value_out=out_v, **cache.kwargs())
    kref, vref = ref.dequantize_reference(cache.canonical(cache.snapshot()), 1.0, 1.0, T, H, D,
                                          "NHD", "linear")
    b, n = float_bits(out_k[1])
    wb, wn = float_bits(round_f32_to(kref[1], "float16"))
    assert np.array_equal(n, wn) and np.array_equal(b[~n], wb[~wn])
    assert np.all(out_k[[0, 2]] == 7) and np.all(out_v[[0, 2]] == 7)


# ------------------------------------------------------------------------------- property test
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          derandomize=True)
@given(data=st.data())
def test_gather_property(nv, data):
    N = data.draw(st.integers(0, 4), label="N")
    T = data.draw(st.sampled_from((1, 4, 8)), label="T")
    H = data.draw(st.integers(1, 3), label="H")
    D = data.draw(st.sampled_from((16, 64)), label="D")
    layout = data.draw(st.sampled_from(("HND", "NHD")), label="layout")
    view = data.draw(st.sampled_from(("5d", "sides") + (("packed4d",) if layout == "HND" else ())))
    vllm_ok = layout == "HND" and T % 4 == 0 and D % 64 == 0
    scale_layout = data.draw(st.sampled_from(("linear", "vllm") if vllm_ok else ("linear",)))
    B = data.draw(st.integers(0, 4), label="B")
    max_blocks = data.draw(st.integers(0, 3), label="max_blocks")
    idx = data.draw(st.sampled_from((np.int32, np.int64)), label="idx")
    bt = np.array(data.draw(st.lists(st.lists(st.integers(-2, N + 1), min_size=max_blocks,
                                               max_size=max_blocks), min_size=B, max_size=B)),
                  np.int64).reshape(B, max_blocks).astype(idx)
    seq_lens = np.array(data.draw(st.lists(st.integers(0, (max_blocks + 1) * T), min_size=B,
                                           max_size=B)), np.int64).astype(idx)
    backend = data.draw(st.sampled_from(BACKENDS), label="backend")
    dtype = data.draw(st.sampled_from(dtypes_for(backend)), label="dtype")
    strided = data.draw(st.booleans(), label="strided")
    cache = make_cache(N, T, H, D, view, layout, backend, seed=data.draw(st.integers(0, 99)))
    check_gather(nv, cache, bt, seq_lens, 0.5, 4.0, scale_layout, dtype,
                 pass_cu=data.draw(st.booleans()), strided=strided)


# ------------------------------------------------------------------------------- bad inputs
def _bad_cases():
    """(name, mutate(kwargs) -> None, exception, argument named in the message)."""
    def setk(k, v):
        return lambda kw: kw.__setitem__(k, v(kw) if callable(v) else v)

    f32 = np.float32
    return [
        ("bt_float", setk("block_table", lambda kw: kw["block_table"].astype(f32)), TypeError, "block_table"),
        ("bt_rank1", setk("block_table", lambda kw: kw["block_table"][0]), ValueError, "block_table"),
        ("bt_rank3", setk("block_table", lambda kw: kw["block_table"][None]), ValueError, "block_table"),
        ("bt_int16", setk("block_table", lambda kw: kw["block_table"].astype(np.int16)), TypeError, "block_table"),
        ("sl_len", setk("seq_lens", np.array([3, 4, 5], np.int32)), ValueError, "seq_lens"),
        ("sl_float", setk("seq_lens", np.array([3, 4], f32)), TypeError, "seq_lens"),
        ("sl_rank2", setk("seq_lens", np.array([[3, 4]], np.int32)), ValueError, "seq_lens"),
        ("cu_len", setk("cu_seqlens", np.array([0, 3], np.int32)), ValueError, "cu_seqlens"),
        ("cu_float", setk("cu_seqlens", np.array([0, 3, 7], f32)), TypeError, "cu_seqlens"),
        ("ko_heads", setk("key_out", np.zeros((7, 3, 64), f32)), ValueError, "key_out"),
        ("ko_headsize", setk("key_out", np.zeros((7, 2, 32), f32)), ValueError, "key_out"),
        ("vo_rows", setk("value_out", np.zeros((6, 2, 64), f32)), ValueError, "value_out"),
        ("ko_rank", setk("key_out", np.zeros((7, 128), f32)), ValueError, "key_out"),
        ("ko_dtype", setk("key_out", np.zeros((7, 2, 64), np.int32)), TypeError, "key_out"),
        ("vo_dtype_mismatch", setk("value_out", np.zeros((7, 2, 64), np.float16)), TypeError, "value_out"),
        ("ko_stride", setk("key_out", np.zeros((7, 2, 128), f32)[:, :, ::2]), ValueError, "key_out"),
        ("ko_readonly", lambda kw: kw["key_out"].setflags(write=False), ValueError, "key_out"),
        ("scale_layout", setk("scale_layout", "bogus"), ValueError, "scale_layout"),
        ("k_scale_zero", setk("k_scale", 0.0), ValueError, "k_scale"),
        ("v_scale_nan", setk("v_scale", float("nan")), ValueError, "v_scale"),
        ("vllm_on_nhd", lambda kw: (kw.__setitem__("kv_cache", kw["kv_cache"].transpose(0, 1, 3, 2, 4)
                                                   .reshape(kw["kv_cache"].shape)),
                                    kw.__setitem__("scale_layout", "vllm")), ValueError, "scale_layout"),
    ]


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_bad_inputs_rejected_outputs_untouched(nv, case):
    _, mutate, exc, arg = case
    cache = make_cache(3, 4, 2, 64, "5d", "HND", "numpy", seed=16)
    kw = dict(kv_cache=cache.kv_cache, block_table=np.array([[0, 1], [2, 0]], np.int32),
              seq_lens=np.array([3, 4], np.int32), cu_seqlens=np.array([0, 3, 7], np.int32),
              key_out=np.full((7, 2, 64), 9.0, np.float32),
              value_out=np.full((7, 2, 64), 9.0, np.float32), scale_layout="linear")
    mutate(kw)
    outs = [(o, o.copy()) for o in (kw["key_out"], kw["value_out"])]
    snap = cache.snapshot()
    with pytest.raises(exc, match=arg):
        nv.gather_dequant(**kw)
    for o, before in outs:
        assert np.array_equal(float_bits(o)[0], float_bits(before)[0]), "output changed on error"
    assert_bytes_equal(cache.snapshot(), snap, cache)


@pytest.mark.parametrize("seq_lens,exc", [(np.array([3.0, 4.0], np.float32), TypeError),
                                         (np.array([[3, 4]], np.int32), ValueError)])
def test_seq_lens_without_cu_seqlens_errors_like_with_them(nv, seq_lens, exc):
    """Found by review: without cu_seqlens a float seq_lens raised ValueError (TypeError with them,
    and for every other wrong element type)."""
    cache = make_cache(3, 4, 2, 64, "5d", "HND", "numpy", seed=16)
    with pytest.raises(exc, match="^seq_lens: "):
        nv.gather_dequant(cache.kv_cache, np.array([[0, 1], [2, 0]], np.int32), seq_lens, scale_layout="linear")


def test_bad_dtype_argument_and_paged_outputs(nv):
    cache = make_cache(3, 4, 2, 64, "5d", "HND", "numpy", seed=17)
    bt, sl = np.array([[0]], np.int32), np.array([2], np.int32)
    with pytest.raises((TypeError, ValueError), match="dtype"):
        nv.gather_dequant(cache.kv_cache, bt, sl, dtype="int8", scale_layout="linear")
    with pytest.raises(ValueError, match="bfloat16"):  # numpy has no bfloat16
        nv.gather_dequant(cache.kv_cache, bt, sl, dtype="bfloat16", scale_layout="linear")
    ko = np.full((3, 4, 2, 64), 9.0, np.float32)
    for bad_pages, exc in ((np.array([0.0], np.float32), TypeError), (np.zeros((1, 1), np.int32), ValueError)):
        with pytest.raises(exc, match="pages"):
            nv.dequantize(cache.kv_cache, pages=bad_pages, key_out=ko, value_out=ko.copy(),
                          scale_layout="linear")
    with pytest.raises(ValueError, match="key_out"):  # paged outputs must match the geometry
        nv.dequantize(cache.kv_cache, pages=np.array([0]), key_out=ko[:, :2],
                      value_out=ko[:, :2].copy(), scale_layout="linear")
    assert np.all(ko == 9.0)


def test_third_review_outputs(nv):
    """Found by review: dequantize(pages=...) allocated its outputs uninitialised, so the pages it
    did not read held old memory (zeros under torch.compile); a dtype given with both outputs was
    ignored, even an invalid one; gather_dequant with one padded output allocated the other with
    cu_seqlens[-1] rows and then blamed it for not matching."""
    N, T, H, D = 3, 4, 2, 64
    for backend in BACKENDS:
        cache = make_cache(N, T, H, D, "5d", "HND", backend, seed=18)
        k, v = nv.dequantize(cache.kv_cache, 0.5, 0.25, pages=as_backend(np.array([1]), backend),
                             scale_layout="linear")
        k, v = np.asarray(k), np.asarray(v)
        assert not k[[0, 2]].any() and not v[[0, 2]].any()  # zeros, not whatever memory held
        kref, _ = ref.dequantize_reference(cache.canonical(cache.snapshot()), 0.5, 0.25, T, H, D, "HND",
                                           "linear")
        b, n = float_bits(k[1])
        wb, wn = float_bits(kref[1])
        assert np.array_equal(n, wn) and np.array_equal(b[~n], wb[~wn])
    cache = make_cache(N, T, H, D, "5d", "HND", "torch", seed=19)
    ko, vo = torch.full((N, T, H, D), 9.0), torch.full((N, T, H, D), 9.0)
    for bad in ("int8", torch.float64, "float16"):  # invalid, or not the outputs' float32
        with pytest.raises(ValueError, match="dtype"):
            nv.dequantize(cache.kv_cache, key_out=ko, value_out=vo, dtype=bad, scale_layout="linear")
    assert torch.all(ko == 9.0) and torch.all(vo == 9.0)
    nv.dequantize(cache.kv_cache, key_out=ko, value_out=vo, dtype=torch.float32, scale_layout="linear")
    bt, sl = torch.tensor([[2, 0]], dtype=torch.int32), torch.tensor([6], dtype=torch.int32)
    kg, vg = torch.full((9, H, D), 9.0), torch.full((9, H, D), 9.0)
    with pytest.raises(ValueError, match="dtype"):
        nv.gather_dequant(cache.kv_cache, bt, sl, key_out=kg, value_out=vg, dtype="bfloat16",
                          scale_layout="linear")
    padded = torch.full((9, H, D), 9.0)  # 6 rows of data and 3 of padding
    k, v, cu = nv.gather_dequant(cache.kv_cache, bt, sl, key_out=padded, scale_layout="linear")
    assert k is padded and tuple(v.shape) == (9, H, D) and v.dtype == torch.float32 and cu.tolist() == [0, 6]
    assert torch.all(padded[6:] == 9.0)
    k2, v2, _ = nv.gather_dequant(cache.kv_cache, bt, sl, dtype=torch.float32, scale_layout="linear")
    assert torch.equal(k[:6].view(torch.int32), k2.view(torch.int32))  # bitwise: random bytes hold NaN
    assert torch.equal(v[:6].view(torch.int32), v2.view(torch.int32))


# ======================================================================================= GPU
@pytest.fixture(params=["pages", "rows"])
def gather_kernel(request, nv):
    """Runs a CUDA gather test through each kernel (nvfp4kv_set_gather_kernel): the page-side
    kernel wherever it applies (compute capability 9.0 and later; the rows kernels elsewhere),
    then the rows kernels. The automatic choice picks between them by size alone."""
    nv._C._set_gather_kernel(request.param)
    yield request.param
    nv._C._set_gather_kernel("auto")


def _cpu_and_cuda_caches(N, T, H, D, view, layout, pad, seed):
    return (make_cache(N, T, H, D, view, layout, "torch", "cpu", pad=pad, seed=seed),
            make_cache(N, T, H, D, view, layout, "torch", "cuda", pad=pad, seed=seed))


def _gather_pair(nv, caches, bt, sl, cu, total, ks, vs, scale_layout, dtype, strided, seed):
    """The same gather on the CPU and on CUDA into identical poison; returns both buffer pairs."""
    results = []
    for cache in caches:
        dev = cache.device
        kbuf, kv_ = poisoned_out(total, cache.H, cache.D, dtype, "torch", dev, strided, seed)
        vbuf, vv_ = poisoned_out(total, cache.H, cache.D, dtype, "torch", dev, strided, seed + 1)
        g = (lambda x: torch.tensor([x], dtype=torch.float32, device=dev)) if dev != "cpu" and seed % 2 else float
        nv.gather_dequant(block_table=as_backend(bt, "torch", dev), seq_lens=as_backend(sl, "torch", dev),
                          cu_seqlens=as_backend(cu, "torch", dev), k_scale=g(ks), v_scale=g(vs),
                          scale_layout=scale_layout, key_out=kv_, value_out=vv_, **cache.kwargs())
        results.append((kbuf, vbuf))
    torch.cuda.synchronize()
    return results


def _assert_same_bits(a, b, what):
    ab, bb = float_bits(a)[0], float_bits(b)[0]
    if not np.array_equal(ab, bb):
        bad = np.argwhere(ab != bb)
        pytest.fail(f"{what}: {len(bad)} elements differ CPU vs CUDA; first {bad[:5].tolist()}: "
                    f"{ab[tuple(bad[0])]:#x} vs {bb[tuple(bad[0])]:#x}")


def _gpu_matrix():
    rng = np.random.default_rng(4321)
    cases = []
    for view, layout, scale_layout in view_combos():
        for dtype in ("bfloat16", "float16", "float32"):
            T = int(rng.choice((4, 16) if scale_layout == "vllm" else (1, 5, 16, 32)))
            D = int(rng.choice((64, 128, 256) if scale_layout == "vllm" else (16, 48, 128, 512)))
            cases.append((view, layout, scale_layout, dtype, T, int(rng.choice((1, 2, 8))), D,
                          int(rng.choice((1, 7, 33))), bool(rng.random() < 0.3)))
    return cases


@needs_cuda
@pytest.mark.parametrize("case", _gpu_matrix(), ids=lambda c: "-".join(map(str, c)))
def test_cuda_gather_equals_cpu(nv, gather_kernel, case):
    view, layout, scale_layout, dtype, T, H, D, N, strided = case
    seed = zlib.crc32(repr(case).encode()) & 0xFFFF  # the same in every process
    rng = np.random.default_rng(seed)
    caches = _cpu_and_cuda_caches(N, T, H, D, view, layout, 0 if view == "packed4d" else 40, seed)
    B, mb = 6, 5
    bt = random_table(rng, B, mb, N, idx_dtype=(np.int32, np.int64)[seed % 2])
    sl = rng.integers(0, (mb + 1) * T + 1, B).astype((np.int64, np.int32)[seed % 2])
    sl[0] = 0
    cu = prefix(sl)
    (kc, vc), (kg, vg) = _gather_pair(nv, caches, bt, sl, cu, int(cu[-1]), 0.3, 1.7,
                                      scale_layout, dtype, strided, seed)
    _assert_same_bits(kg, kc, "key")
    _assert_same_bits(vg, vc, "value")
    # and the CPU side against the reference (same poison)
    check_gather(nvfp4kv, caches[0], bt, sl, 0.3, 1.7, scale_layout, dtype, cu_seqlens=cu,
                 strided=strided, seed=seed)


@needs_cuda
@pytest.mark.parametrize("H,D,lens", [
    (42, 256, (20, 600)),  # 672 items a token row: blocks of 21 warps, the largest stage not asked for
    (43, 256, (20, 600)),  # 688: 22 warps (16 lanes idle), the first stage above 48 KB
    (64, 256, (20, 600)),  # 1024: 32 warps, the largest stage (72 KB)
    (66, 256, (20, 60)),   # 1056: past the fast gather's limit, the general gather
    (3, 128, (6000,)),     # 24: 10 tokens per block of 256 threads (16 lanes idle)
], ids=lambda x: str(x))
def test_cuda_gather_row_sizes(nv, gather_kernel, H, D, lens):
    """The fast gather's shared-memory stage at the edges of its block shapes: wide rows below and
    above the 48 KB a block gets without asking, blocks with idle lanes, and blocks that make
    more than one step (several hundred tokens per sequence), against the CPU."""
    T = 16
    seed = 100 + H
    rng = np.random.default_rng(seed)
    mb = (max(lens) + T - 1) // T
    N = mb + 3
    caches = _cpu_and_cuda_caches(N, T, H, D, "5d", "HND", 0, seed)
    bt = random_table(rng, len(lens), mb, N, idx_dtype=np.int32)
    sl = np.array(lens, np.int32)
    cu = prefix(sl)
    for dtype in ("bfloat16", "float16"):
        (kc, vc), (kg, vg) = _gather_pair(nv, caches, bt, sl, cu, int(cu[-1]), 0.3, 1.7, "vllm", dtype, False, seed)
        _assert_same_bits(kg, kc, "key")
        _assert_same_bits(vg, vc, "value")


@needs_cuda
@pytest.mark.parametrize("dtype", ("bfloat16", "float32"))
def test_cuda_gather_gaps_short_output_and_bad_entries(nv, gather_kernel, dtype):
    N, T, H, D = 8, 16, 4, 128
    caches = _cpu_and_cuda_caches(N, T, H, D, "5d", "HND", 0, 21)
    for idx in (np.int32, np.int64):
        bt = np.array([[-1, N, 10**6, np.iinfo(idx).max], [0, 7, 7, -5], [3, 2, 1, 0]], idx)
        sl = np.array([60, 70, 64], idx)
        for cu, total in ((np.array([3, 70, 150, 230], np.int64), 230),  # gaps
                          (np.array([0, 60, 130, 194], np.int32), 100)):  # short output
            (kc, vc), (kg, vg) = _gather_pair(nv, caches, bt, sl, cu, total, 0.5, 0.25, "vllm",
                                              dtype, True, 3)
            _assert_same_bits(kg, kc, "key")
            _assert_same_bits(vg, vc, "value")


@needs_cuda
@pytest.mark.parametrize("g", (1e-38, 3e-30, 0.75, 2.0**100, 2.0**112, 2.0**113, 1e35, 1e38))
@pytest.mark.parametrize("device_scale", (False, True))
def test_cuda_gather_extreme_global_scales(nv, gather_kernel, g, device_scale):
    """The fast kernel multiplies by g * 2^14 when that is exact (|g| < 2^113) and falls back
    otherwise: both sides of the boundary equal the CPU path, bit for bit (v gets g / 3)."""
    N, T, H, D = 6, 16, 2, 128
    caches = _cpu_and_cuda_caches(N, T, H, D, "5d", "HND", 0, 31)
    bt = np.array([[0, 1, 2], [5, 4, 3]], np.int32)
    sl = np.array([40, 33], np.int32)
    cu = prefix(sl)
    seed = 1 if device_scale else 2  # _gather_pair passes device tensors for odd seeds
    (kc, vc), (kg, vg) = _gather_pair(nv, caches, bt, sl, cu, int(cu[-1]), g, g / 3, "vllm",
                                      "bfloat16", False, seed)
    _assert_same_bits(kg, kc, "key")
    _assert_same_bits(vg, vc, "value")


@needs_cuda
@pytest.mark.parametrize("g", (-0.5, float("inf"), float("nan")))
def test_cuda_bad_entries_read_as_plus_zero_whatever_the_device_scale(nv, gather_kernel, g):
    """Tokens behind a bad block-table entry read as +0.0 even under a device scale the host
    cannot check (negative, Inf, NaN), whose product with zero would be -0 or NaN: the kernel
    must not multiply its way to those zeros. Only the CUDA path can see such a scale (the CPU
    path rejects it), so the zeros are checked directly."""
    N, T, H, D = 4, 16, 2, 128
    cache = make_cache(N, T, H, D, "5d", "HND", "torch", "cuda", seed=41)
    bt = np.array([[-1, 0], [N, 1]], np.int32)  # the first block of each sequence is bad
    sl = np.array([20, 20], np.int32)
    outs = [poisoned_out(40, H, D, "bfloat16", "torch", "cuda", False, s)[1] for s in (5, 6)]
    scale = torch.tensor([g], dtype=torch.float32, device="cuda")
    nv.gather_dequant(block_table=as_backend(bt, "torch", "cuda"), seq_lens=as_backend(sl, "torch", "cuda"),
                      cu_seqlens=as_backend(prefix(sl), "torch", "cuda"), k_scale=scale, v_scale=scale,
                      scale_layout="vllm", key_out=outs[0], value_out=outs[1], **cache.kwargs())
    torch.cuda.synchronize()
    for out in outs:
        bits = out.view(torch.int16).cpu()
        assert torch.equal(bits[0:16], torch.zeros_like(bits[0:16]))    # sequence 0, block 0
        assert torch.equal(bits[20:36], torch.zeros_like(bits[20:36]))  # sequence 1, block 0


@needs_cuda
def test_cuda_gather_large(nv, gather_kernel):
    N, T, H, D = 4096, 16, 8, 128
    rng = np.random.default_rng(22)
    caches = _cpu_and_cuda_caches(N, T, H, D, "5d", "HND", 0, 22)
    B = 64
    sl = rng.integers(1000, 3001, B).astype(np.int32)
    mb = int(sl.max()) // T + 1
    bt = rng.integers(0, N, (B, mb)).astype(np.int32)
    bt[rng.random(bt.shape) < 0.01] = -1
    cu = prefix(sl)
    (kc, vc), (kg, vg) = _gather_pair(nv, caches, bt, sl, cu, int(cu[-1]), 0.02, 0.03, "vllm",
                                      "bfloat16", False, 4)
    assert torch.equal(kg.cpu().view(torch.int16), kc.view(torch.int16))
    assert torch.equal(vg.cpu().view(torch.int16), vc.view(torch.int16))


@needs_cuda
@pytest.mark.parametrize("H,D,layout,scale_layout", [(8, 128, "HND", "vllm"), (16, 128, "HND", "linear"),
                                                    (4, 64, "NHD", "linear"), (2, 256, "HND", "vllm")])
def test_cuda_gather_past_the_block_table(nv, gather_kernel, H, D, layout, scale_layout):
    """Sequences longer than their block-table row read zeros past it. The page-side kernel sizes
    its grid from the row, so such a block takes its units in several rounds of stages, every
    round of bad entries and the first of real pages; with H 16 a page side is two head groups.
    Against the CPU path, bit for bit."""
    N, T = 12, 16
    seed = 50 + H
    rng = np.random.default_rng(seed)
    caches = _cpu_and_cuda_caches(N, T, H, D, "5d", layout, 0, seed)
    bt = random_table(rng, 3, 2, N, idx_dtype=np.int32)
    sl = np.array([1900, 31, 700], np.int32)  # 119, 2 and 44 blocks against a row of 2
    cu = prefix(sl)
    (kc, vc), (kg, vg) = _gather_pair(nv, caches, bt, sl, cu, int(cu[-1]), 0.3, 1.7, scale_layout,
                                      "bfloat16", False, seed)
    _assert_same_bits(kg, kc, "key")
    _assert_same_bits(vg, vc, "value")


@needs_cuda
@pytest.mark.parametrize("H,start,total", [
    (8, -(2**63 - 2), 2),  # writes row 0 only: position 2^63 - 2 (column 2^59 - 1, position 14)
    (128, -(2**62), 40),   # positions from 2^62: column 2^58 on
    (8, -(2**62) - 5, 40),  # from position 5 of column 2^58
], ids=lambda x: str(x))
def test_cuda_gather_starts_near_the_int64_limits(nv, gather_kernel, H, start, total):
    """cu_seqlens is read on the device and never trusted: a start near -2^63 with a length near
    2^63 puts a sequence's written positions near INT64_MAX. Found by review: the row kernel's
    position wrapped past INT64_MAX and never ended (2^63 - 2: 4.6e18 steps), and the page-side
    kernel's unit number (position / T * 32 units a column at H 128) overflowed and wrote nothing.
    A broadcast block table of 2^60 columns (stride 0) of page 1; against the CPU, bit for bit."""
    N, T, D = 2, 16, 128
    caches = _cpu_and_cuda_caches(N, T, H, D, "5d", "HND", 0, 31)
    results = []
    for cache in caches:
        dev = cache.device
        bt = torch.ones(1, 1, dtype=torch.int64, device=dev).expand(1, 2**60)
        sl = torch.tensor([2**63 - 1], dtype=torch.int64, device=dev)
        cu = torch.tensor([start, 0], dtype=torch.int64, device=dev)
        kbuf, kv_ = poisoned_out(total, H, D, "bfloat16", "torch", dev, False, 5)
        vbuf, vv_ = poisoned_out(total, H, D, "bfloat16", "torch", dev, False, 6)
        nv.gather_dequant(block_table=bt, seq_lens=sl, cu_seqlens=cu, k_scale=0.5, v_scale=2.0,
                          key_out=kv_, value_out=vv_, **cache.kwargs())
        results.append((kbuf, vbuf))
    torch.cuda.synchronize()
    (kc, vc), (kg, vg) = results
    assert bool((kc[0] != 0).any())  # page 1 was read (the table's every column)
    _assert_same_bits(kg, kc, "key")
    _assert_same_bits(vg, vc, "value")


@needs_cuda
@pytest.mark.parametrize("view,layout,scale_layout", [("5d", "HND", "vllm"), ("sides", "NHD", "linear"),
                                                      ("packed4d", "HND", "linear")])
def test_cuda_paged_to_paged_equals_cpu(nv, view, layout, scale_layout):
    N, T, H, D = 9, 16, 4, 128
    caches = _cpu_and_cuda_caches(N, T, H, D, view, layout, 0, 23)
    bits = np.random.default_rng(24).integers(0, 2**16, (N, 2, T, H, D), dtype=np.uint64)
    bf = torch.from_numpy(bits.astype(np.uint16).view(np.int16)).view(torch.bfloat16)
    outs = []
    for cache in caches:
        o = bf.clone().to(cache.device)
        pages = torch.tensor([7, -1, 0, 7, N, 3, 10**6], device=cache.device)
        nv.dequantize(k_scale=0.3, v_scale=2.0, pages=pages, scale_layout=scale_layout,
                      key_out=o[:, 0], value_out=o[:, 1], **cache.kwargs())
        outs.append(o)
    torch.cuda.synchronize()
    assert torch.equal(outs[1].cpu().view(torch.int16), outs[0].view(torch.int16))
    untouched = [p for p in range(N) if p not in (0, 3, 7)]
    assert torch.equal(outs[1][untouched].cpu().view(torch.int16), bf[untouched].view(torch.int16))


@needs_cuda
def test_cuda_graph_capture_and_replay_gather(nv, gather_kernel):
    """Captured with outputs and cu_seqlens given; block table, seq_lens, cu_seqlens, scales and
    cache bytes changed in place between replays; each replay equals the CPU path."""
    N, T, H, D, B, mb, total = 32, 16, 4, 128, 4, 6, 300
    rng = np.random.default_rng(25)
    cache = make_cache(N, T, H, D, "5d", "HND", "torch", "cuda", seed=25)
    bt = torch.from_numpy(random_table(rng, B, mb, N, idx_dtype=np.int32)).cuda()
    sl = torch.tensor([50, 0, 96, 10], dtype=torch.int32, device="cuda")
    cu = torch.from_numpy(prefix(sl.cpu().numpy())).cuda()
    ks = torch.tensor([0.1], device="cuda")
    vs = torch.tensor([0.2], device="cuda")
    ko = torch.zeros(total, H, D, dtype=torch.bfloat16, device="cuda")
    vo = torch.zeros_like(ko)
    args = dict(kv_cache=cache.kv_cache, block_table=bt, seq_lens=sl, k_scale=ks, v_scale=vs,
                cu_seqlens=cu, key_out=ko, value_out=vo, scale_layout="vllm")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        nv.gather_dequant(**args)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        nv.gather_dequant(**args)
    for step in range(3):
        bt.copy_(torch.from_numpy(random_table(rng, B, mb, N, idx_dtype=np.int32)))
        new_sl = rng.integers(0, mb * T + 1, B).astype(np.int32)
        new_cu = prefix(new_sl)
        new_cu = np.minimum(new_cu, total)  # keep every row within the outputs
        sl.copy_(torch.from_numpy(new_sl))
        cu.copy_(torch.from_numpy(new_cu))
        ks.fill_(0.05 * (step + 1))
        vs.fill_(0.07 * (step + 1))
        cache.raw.random_(0, 256)
        ko.fill_(float(step + 3))
        vo.fill_(float(step + 3))
        ek = torch.full((total, H, D), float(step + 3), dtype=torch.bfloat16)
        ev = ek.clone()
        cpu_cache = cache.kv_cache.cpu()
        nv.gather_dequant(cpu_cache, bt.cpu(), sl.cpu(), ks.item(), vs.item(), cu_seqlens=cu.cpu(),
                          key_out=ek, value_out=ev, scale_layout="vllm")
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(ko.cpu().view(torch.int16), ek.view(torch.int16)), f"replay {step}: key"
        assert torch.equal(vo.cpu().view(torch.int16), ev.view(torch.int16)), f"replay {step}: value"


@needs_cuda
def test_cuda_gather_on_last_device_while_device0_current(nv, gather_kernel):
    dev = torch.cuda.device_count() - 1
    N, T, H, D = 5, 16, 2, 64
    rng = np.random.default_rng(26)
    cpu = make_cache(N, T, H, D, "5d", "HND", "torch", "cpu", seed=26)
    bt = random_table(rng, 3, 3, N)
    sl = np.array([40, 5, 17], np.int64)
    ek, ev, cu = nv.gather_dequant(cpu.kv_cache, torch.from_numpy(bt), torch.from_numpy(sl), 0.5, 0.5,
                                   dtype="float16")
    with torch.cuda.device(0):
        g = make_cache(N, T, H, D, "5d", "HND", "torch", f"cuda:{dev}", seed=26)
        ko = torch.zeros(tuple(ek.shape), dtype=torch.float16, device=f"cuda:{dev}")
        vo = torch.zeros_like(ko)
        nv.gather_dequant(g.kv_cache, torch.from_numpy(bt).to(ko.device), torch.from_numpy(sl).to(ko.device),
                          0.5, 0.5, cu_seqlens=cu.to(ko.device), key_out=ko, value_out=vo)
        pages = torch.tensor([1, 3], device=ko.device)
        pk = torch.zeros(N, T, H, D, dtype=torch.float16, device=ko.device)
        pv = torch.zeros_like(pk)
        nv.dequantize(g.kv_cache, 0.5, 0.5, pages=pages, key_out=pk, value_out=pv)
        assert torch.cuda.current_device() == 0
    torch.cuda.synchronize(dev)
    assert torch.equal(ko.cpu().view(torch.int16), ek.view(torch.int16))
    assert torch.equal(vo.cpu().view(torch.int16), ev.view(torch.int16))
    ck, cv = nv.dequantize(cpu.kv_cache, 0.5, 0.5, dtype="float16")
    assert torch.equal(pk[[1, 3]].cpu().view(torch.int16), ck[[1, 3]].view(torch.int16))
    assert torch.all(pk[[0, 2, 4]] == 0)


@needs_cuda
def test_cuda_gather_mixed_devices_rejected(nv):
    cache = make_cache(3, 16, 2, 64, "5d", "HND", "torch", "cuda", seed=27)
    bt = torch.tensor([[0, 1]], dtype=torch.int32)
    sl = torch.tensor([20], dtype=torch.int32)
    ko = torch.full((20, 2, 64), 9.0, device="cuda")
    vo = ko.clone()
    with pytest.raises(ValueError, match="block_table"):
        nv.gather_dequant(cache.kv_cache, bt, sl.cuda(), key_out=ko, value_out=vo,
                          cu_seqlens=torch.tensor([0, 20], device="cuda"))
    with pytest.raises(ValueError, match="seq_lens"):
        nv.gather_dequant(cache.kv_cache, bt.cuda(), sl, key_out=ko, value_out=vo,
                          cu_seqlens=torch.tensor([0, 20], device="cuda"))
    with pytest.raises(ValueError, match="key_out"):
        nv.gather_dequant(cache.kv_cache, bt.cuda(), sl.cuda(), key_out=ko.cpu(), value_out=vo,
                          cu_seqlens=torch.tensor([0, 20], device="cuda"))
    assert torch.all(ko == 9.0) and torch.all(vo == 9.0)
