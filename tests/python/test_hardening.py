"""Issue #21, hardening: the bad inputs that used to get through, each now rejected with the right
exception and a message naming the argument, with nothing written (the cache, the outputs and the
guard bytes around them are compared byte for byte); and the legitimate neighbours of each case,
which must still be accepted."""
import contextlib
import faulthandler
import re
import time

import numpy as np
import pytest
import reference as ref
from conftest import assert_floats_identical, expected_store, make_cache, make_kv, mixed_tokens

torch = pytest.importorskip("torch")
nv = pytest.importorskip("nvfp4kv")

LINEAR = {"scale_layout": "linear"}
GUARD = 64  # poison bytes before and after the memory a view may address


@contextlib.contextmanager
def watchdog(seconds=120):
    """Abort the whole run (with tracebacks) rather than hang if a call never returns: an
    unbounded loop over 2**62 positions is the failure some tests below look for."""
    faulthandler.dump_traceback_later(seconds, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


def poison(nbytes, seed=0):
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8))


def unchanged(*buffers):
    """A check that the buffers' bytes are what they were when this was called."""
    before = [b.clone() for b in buffers]

    def check():
        for b, was in zip(buffers, before):
            assert torch.equal(b, was), "a rejected call wrote"
    return check


def empty_tokens(H, D=16):
    """key/value/slot_mapping of zero tokens (nothing to allocate, whatever H is)."""
    return torch.empty(0, H, D), torch.empty(0, H, D), torch.empty(0, dtype=torch.int64)


def filled_cache(N=2, T=4, H=2, D=64, view="5d", seed=0):
    """A poisoned HND cache with a few tokens stored (scale_layout linear)."""
    rng = np.random.default_rng(seed)
    cache = make_cache(N, T, H, D, view, "HND", "torch", seed=seed)
    n = N * T
    key, value, _, _ = make_kv(mixed_tokens(rng, n, H, D), mixed_tokens(rng, n, H, D), "float32", "torch")
    nv.store(key, value, slot_mapping=torch.arange(n), **cache.kwargs(), **LINEAR)
    return cache


# ----------------------------------------------------------- 1. a page side of 2 GiB or more
@pytest.mark.parametrize("T,H", [(2**31 + 4, 1), (1, 2**32 + 1)], ids=["block_size", "num_kv_heads"])
def test_page_side_of_2GiB_or_more_is_rejected_not_narrowed(T, H):
    # 0 pages over a small poisoned buffer: the view addresses nothing, yet its T or H would
    # have been narrowed to 32 bits (H = 2**32 + 1 read as 1).
    F = 9
    buf = poison(2 * GUARD)
    kv = torch.as_strided(buf, (0, 2, T, H, F), (2 * H * T * F, H * T * F, F, T * F, 1), GUARD)
    check = unchanged(buf)
    key, value, slots = empty_tokens(H)
    with pytest.raises(ValueError, match=r"kv_cache: .*2 GiB"):
        nv.store(key, value, kv, slots, **LINEAR)
    with pytest.raises(ValueError, match=r"kv_cache: .*2 GiB"):
        nv.dequantize(kv, **LINEAR)
    with pytest.raises(ValueError, match=r"kv_cache: .*2 GiB"):
        nv.gather_dequant(kv, torch.zeros(1, 1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
                          cu_seqlens=torch.zeros(2, dtype=torch.int64), key_out=torch.empty(0, H, 16),
                          value_out=torch.empty(0, H, 16), **LINEAR)
    check()


def test_page_side_of_2GiB_or_more_is_rejected_one_page_numpy():
    # One page of T = 2**31 + 4 over a 200-byte buffer (numpy does not bound strides): the store
    # of a skipped token must be refused before anything could address the page.
    T, F = 2**31 + 4, 9
    buf = np.random.default_rng(1).integers(0, 256, 2 * GUARD + 72, dtype=np.uint8)
    before = buf.copy()
    kv = np.lib.stride_tricks.as_strided(buf[GUARD:], (1, 2, T, 1, F), (2 * T * F, T * F, F, T * F, 1))
    key = np.zeros((1, 1, 16), np.float32)
    with pytest.raises(ValueError, match=r"kv_cache: .*2 GiB"):
        nv.store(key, key, kv, np.array([-1]), **LINEAR)
    assert np.array_equal(buf, before)


# ------------------------------------------------------------- 2. gathers bounded by the output
def gather_setup(seed=3):
    cache = filled_cache(N=2, T=4, H=2, D=64, seed=seed)
    kref, vref = ref.dequantize_reference(cache.canonical(cache.snapshot()), np.float32(1), np.float32(1),
                                          cache.T, cache.H, cache.D, "HND", "linear")
    return cache, kref, vref


def expected_rows(kref, bt_row, T, rows):
    j = np.arange(rows)
    return kref[np.asarray(bt_row)[j // T], j % T]


@pytest.mark.parametrize("length", [2**34, 2**62])
def test_gather_of_a_huge_sequence_length_is_bounded_by_the_output_rows(length):
    cache, kref, vref = gather_setup()
    bt = torch.tensor([[0, 1, 1, 0]])
    ko, vo = torch.full((16, 2, 64), 7.0), torch.full((16, 2, 64), 7.0)
    start = time.perf_counter()
    with watchdog():
        nv.gather_dequant(cache.kv_cache, bt, torch.tensor([length]), cu_seqlens=torch.tensor([0, length]),
                          key_out=ko, value_out=vo, **LINEAR)
    assert time.perf_counter() - start < 1.0
    assert_floats_identical(ko.numpy(), expected_rows(kref, bt[0], 4, 16))
    assert_floats_identical(vo.numpy(), expected_rows(vref, bt[0], 4, 16))


@pytest.mark.parametrize("seq_len", [16, 2**62])
def test_gather_from_a_huge_negative_start_returns_at_once_writing_nothing(seq_len):
    cache, _, _ = gather_setup()
    ko, vo = torch.full((16, 2, 64), 7.0), torch.full((16, 2, 64), 7.0)
    check = unchanged(ko, vo)
    start = time.perf_counter()
    with watchdog():
        nv.gather_dequant(cache.kv_cache, torch.tensor([[0, 1, 1, 0]]), torch.tensor([seq_len]),
                          cu_seqlens=torch.tensor([-2**62, 16]), key_out=ko, value_out=vo, **LINEAR)
    assert time.perf_counter() - start < 1.0
    check()  # rows -2**62 .. -2**62 + len - 1: none of them in [0, 16)


@pytest.mark.parametrize("T,P", [(4, 2**62), (5, 3689348814741910324)])
def test_dequantize_of_a_page_list_past_2_63_positions_is_refused(T, P):
    """A broadcast page list of P entries with P * T past 2^63 (2^64 and 2^64 + 4): the GPU's
    (entry, position) numbering wrapped to 0 or 4 and it wrote nothing or part of a page while
    the CPU ran for ever (review). Refused at once, before the scales are read, outputs
    untouched. The longest list accepted passes this check (and is refused for its scale instead:
    run, it would take for ever)."""
    cache = filled_cache(N=2, T=T, H=2, D=64)
    ko, vo = torch.full((2, T, 2, 64), 7.0), torch.full((2, T, 2, 64), 7.0)
    check = unchanged(ko, vo)
    for k_scale in (1.0, 0.0):
        with watchdog(), pytest.raises(ValueError, match=rf"pages: {P} entries of block size {T}: more than 2\^63"):
            nv.dequantize(cache.kv_cache, k_scale, pages=torch.tensor([1]).expand(P), key_out=ko, value_out=vo,
                          **LINEAR)
    with watchdog(), pytest.raises(ValueError, match="k_scale"):
        nv.dequantize(cache.kv_cache, 0.0, pages=torch.tensor([1]).expand((2**63 - 1) // T), key_out=ko,
                      value_out=vo, **LINEAR)
    check()


# ------------------------------------------------------------ 3. the default cu_seqlens, exact
def test_default_cu_seqlens_does_not_wrap_past_int32():
    cache, kref, vref = gather_setup()
    bt = torch.tensor([[0, 1, 1, 0], [1, 1, 0, 0]])
    ko, vo = torch.full((16, 2, 64), 7.0), torch.full((16, 2, 64), 7.0)
    with watchdog():
        _, _, cu = nv.gather_dequant(cache.kv_cache, bt, torch.tensor([2**32, 16]), key_out=ko, value_out=vo,
                                     **LINEAR)
    assert cu.tolist() == [0, 2**32, 2**32 + 16]  # int32 sums gave [0, 0, 16]
    assert cu.dtype == torch.int64
    # Rows 0..15 are sequence 0's first tokens; sequence 1 starts at row 2**32, outside.
    assert_floats_identical(ko.numpy(), expected_rows(kref, bt[0], 4, 16))
    assert_floats_identical(vo.numpy(), expected_rows(vref, bt[0], 4, 16))


def test_default_cu_seqlens_numpy_does_not_wrap_past_int32():
    cache, kref, _ = gather_setup()
    kv = cache.kv_cache.numpy()
    bt = np.array([[0, 1, 1, 0], [1, 1, 0, 0]])
    ko, vo = np.full((16, 2, 64), 7.0, np.float32), np.full((16, 2, 64), 7.0, np.float32)
    with watchdog():
        _, _, cu = nv.gather_dequant(kv, bt, np.array([2**32, 16]), key_out=ko, value_out=vo, **LINEAR)
    assert cu.tolist() == [0, 2**32, 2**32 + 16]
    assert_floats_identical(ko, expected_rows(kref, bt[0], 4, 16))


@pytest.mark.parametrize("backend", ["torch", "numpy"])  # each computes its own sums
def test_default_cu_seqlens_does_not_wrap_past_int64(backend):
    # Found by review (fuzzing): lengths of 2**62 wrapped the int64 sums to negative totals, so an
    # allocation met torch's or numpy's error (naming no argument) instead of the size check, and
    # given outputs came back with a cu_seqlens of negative entries. A length counts as at most
    # (2**63 - 1) // B: the sums stay monotone and the size check names seq_lens.
    cache, kref, _ = gather_setup()
    bt = torch.tensor([[0, 1, 1, 0], [1, 1, 0, 0], [0, 1, 0, 1]])
    lens = torch.tensor([2**62, 2**62, 2**62])
    ko, vo = torch.full((16, 2, 64), 7.0), torch.full((16, 2, 64), 7.0)
    args = (cache.kv_cache, bt, lens)
    if backend == "numpy":
        args, ko, vo = tuple(x.numpy() for x in args), ko.numpy(), vo.numpy()
    with pytest.raises(ValueError, match="seq_lens: .* rows in all received"):
        nv.gather_dequant(*args, **LINEAR)
    with watchdog():
        _, _, cu = nv.gather_dequant(*args, key_out=ko, value_out=vo, **LINEAR)
    cap = (2**63 - 1) // 3
    assert [int(x) for x in cu] == [0, cap, 2 * cap, 3 * cap]
    assert_floats_identical(np.asarray(ko), expected_rows(kref, bt[0], 4, 16))  # sequence 0's first tokens


@pytest.mark.parametrize("backend", ["torch", "numpy"])  # each computes its own sums (mutation testing)
def test_default_cu_seqlens_counts_a_negative_length_as_zero(backend):
    # The gather reads a length < 0 as an empty sequence; the default prefix sums agree, so the
    # next sequence starts at row 0 (not at row -3, with its first three tokens lost).
    cache, kref, _ = gather_setup()
    bt = torch.tensor([[0, 1], [1, 0]])
    ko, vo = torch.full((5, 2, 64), 7.0), torch.full((5, 2, 64), 7.0)
    args = (cache.kv_cache, bt, torch.tensor([-3, 5]))
    if backend == "numpy":
        args, ko, vo = tuple(x.numpy() for x in args), ko.numpy(), vo.numpy()
    _, _, cu = nv.gather_dequant(*args, key_out=ko, value_out=vo, **LINEAR)
    assert cu.tolist() == [0, 0, 5]
    assert_floats_identical(np.asarray(ko), expected_rows(kref, bt[1], 4, 5))


def test_default_cu_seqlens_allocated_outputs_keep_int32():
    cache, kref, _ = gather_setup()
    bt = torch.tensor([[0, 1], [1, 0]], dtype=torch.int32)
    k, _, cu = nv.gather_dequant(cache.kv_cache, bt, torch.tensor([5, 3], dtype=torch.int32), dtype="float32",
                                 **LINEAR)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 5, 8]  # FlashAttention's dtype
    assert_floats_identical(k[:5].numpy(), expected_rows(kref, bt[0], 4, 5))


# ---------------------------------------------------------------------- 4. the overlap rule
N, T, H, D = 2, 4, 2, 64
F = 9 * D // 16
SIDE = H * T * F


def cache_in(buf, offset=GUARD):
    """A 5-D HND cache (N, 2, T, H, F) inside `buf` at `offset`."""
    return torch.as_strided(buf, (N, 2, T, H, F), (2 * SIDE, SIDE, F, T * F, 1), offset)


def inputs(n=3, seed=5):
    rng = np.random.default_rng(seed)
    key, value, _, _ = make_kv(mixed_tokens(rng, n, H, D), mixed_tokens(rng, n, H, D), "bfloat16", "torch")
    return key, value, torch.tensor([1, 6, 3][:n])


def shares(a, b):
    """The message of an overlap naming both arguments, in either order."""
    return rf"({a}: shares memory with {b}|{b}: shares memory with {a})"


def view_as(buf, offset, dtype, shape):
    n = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
    return buf[offset:offset + n].view(dtype).view(shape)


STORES = {
    "store": lambda kv, k, v, s: nv.store(k, v, kv, s, **LINEAR),
    "prepare_store": lambda kv, k, v, s: nv.prepare_store(kv, **LINEAR)(k, v, s),
    "reshape_and_cache_flash": lambda kv, k, v, s: nv.reshape_and_cache_flash(
        k, v, kv[:, 0], kv[:, 1], s, "nvfp4", 1.0, 1.0, **LINEAR),
}


@pytest.mark.parametrize("entry", sorted(STORES))
def test_store_key_inside_the_cache_is_rejected(entry):
    buf = poison(2 * N * SIDE + 2 * GUARD)
    kv = cache_in(buf)
    _, value, slots = inputs()
    key = view_as(buf, GUARD + SIDE, torch.bfloat16, (3, H, D))  # from page 0's V side on
    check = unchanged(buf)
    with pytest.raises(ValueError, match=shares("key", "(kv|key)_cache")):
        STORES[entry](kv, key, value.clone(), slots)
    check()


@pytest.mark.parametrize("entry", sorted(STORES))
def test_store_slot_mapping_inside_the_cache_is_rejected(entry):
    buf = poison(2 * N * SIDE + 2 * GUARD)
    kv = cache_in(buf)
    key, value, _ = inputs()
    slots = view_as(buf, GUARD + SIDE, torch.int64, (3,))
    check = unchanged(buf)
    with pytest.raises(ValueError, match=shares("slot_mapping", "(kv|key|value)_cache")):
        STORES[entry](kv, key, value, slots)
    check()


def test_store_value_cache_that_is_key_cache_is_rejected():
    buf = poison(2 * N * SIDE + 2 * GUARD)
    side = cache_in(buf)[:, 0]
    key, value, slots = inputs()
    check = unchanged(buf)
    with pytest.raises(ValueError, match=shares("value_cache", "key_cache")):
        nv.store(key, value, side, slots, value_cache=side, **LINEAR)
    with pytest.raises(ValueError, match=shares("value_cache", "key_cache")):
        nv.reshape_and_cache_flash(key, value, side, side, slots, "nvfp4", 1.0, 1.0, **LINEAR)
    check()


def test_dequantize_key_out_overlapping_the_cache_is_rejected():
    out_bytes = N * T * H * D * 4
    buf = poison(2 * N * SIDE + out_bytes + 2 * GUARD)
    kv = cache_in(buf)
    key_out = view_as(buf, GUARD + 2 * SIDE, torch.float32, (N, T, H, D))  # from page 1 on
    value_out = torch.zeros(N, T, H, D)
    check = unchanged(buf, value_out)
    with pytest.raises(ValueError, match=shares("key_out", "kv_cache")):
        nv.dequantize(kv, key_out=key_out, value_out=value_out, **LINEAR)
    check()


def test_dequantize_key_out_that_is_value_out_is_rejected():
    cache = filled_cache()
    out = torch.full((N, T, H, D), 7.0)
    check = unchanged(out, cache.raw)
    with pytest.raises(ValueError, match=shares("value_out", "key_out")):
        nv.dequantize(cache.kv_cache, key_out=out, value_out=out, **LINEAR)
    check()


def test_dequantize_output_addressing_an_element_twice_is_rejected():
    cache = filled_cache()
    key_out = torch.full((1, T, H, D), 7.0).expand(N, T, H, D)
    value_out = torch.full((N, T, H, D), 7.0)
    check = unchanged(key_out, value_out)
    with pytest.raises(ValueError, match=r"key_out: .*more than once"):
        nv.dequantize(cache.kv_cache, key_out=key_out, value_out=value_out, **LINEAR)
    check()


def test_gather_outputs_overlapping_an_input_or_each_other_are_rejected():
    cache = filled_cache()
    bt_seq = (torch.tensor([[0, 1]]), torch.tensor([6]), torch.tensor([0, 6]))
    # key_out over the block table's memory (the block table a view of the output buffer)
    out_buf = torch.zeros(6 * H * D * 4 + 64, dtype=torch.uint8)
    key_out = view_as(out_buf, 0, torch.float32, (6, H, D))
    bt = view_as(out_buf, 16, torch.int64, (1, 2))
    bt.copy_(torch.tensor([[0, 1]]))
    value_out = torch.full((6, H, D), 7.0)
    check = unchanged(out_buf, value_out, cache.raw)
    with pytest.raises(ValueError, match=shares("block_table", "key_out")):
        nv.gather_dequant(cache.kv_cache, bt, bt_seq[1], cu_seqlens=bt_seq[2], key_out=key_out,
                          value_out=value_out, **LINEAR)
    with pytest.raises(ValueError, match=shares("value_out", "key_out")):
        nv.gather_dequant(cache.kv_cache, *bt_seq[:2], cu_seqlens=bt_seq[2], key_out=value_out,
                          value_out=value_out, **LINEAR)
    with pytest.raises(ValueError, match=r"key_out: .*more than once"):
        nv.gather_dequant(cache.kv_cache, *bt_seq[:2], cu_seqlens=bt_seq[2],
                          key_out=torch.zeros(1, H, D).expand(6, H, D), value_out=value_out, **LINEAR)
    check()


def test_dequantize_into_the_two_halves_of_one_paged_output_is_accepted():
    cache = filled_cache()
    want_k, want_v = nv.dequantize(cache.kv_cache, dtype="bfloat16", **LINEAR)
    out = torch.full((N, 2, T, H, D), 7.0, dtype=torch.bfloat16)
    nv.dequantize(cache.kv_cache, key_out=out[:, 0], value_out=out[:, 1], **LINEAR)
    assert torch.equal(out[:, 0].view(torch.int16), want_k.view(torch.int16))
    assert torch.equal(out[:, 1].view(torch.int16), want_v.view(torch.int16))


def test_reversed_halves_of_one_output_are_accepted_and_reversed_overlaps_rejected():
    # numpy's [::-1] gives negative strides; the two halves still share no element (review: they
    # were refused as overlapping), while a reversed view of the same elements still overlaps.
    cache = filled_cache()
    want_k, want_v = nv.dequantize(cache.kv_cache, **LINEAR)
    big = np.full((N, 2, T, H, D), 7.0, np.float32)
    nv.dequantize(cache.kv_cache, key_out=big[::-1, 0], value_out=big[::-1, 1], **LINEAR)
    assert_floats_identical(big[::-1, 0], want_k.numpy())
    assert_floats_identical(big[::-1, 1], want_v.numpy())
    kout = np.full((N, T, H, D), 7.0, np.float32)
    with pytest.raises(ValueError, match=shares("value_out", "key_out")):
        nv.dequantize(cache.kv_cache, key_out=kout[::-1], value_out=kout[::-1, ::-1], **LINEAR)
    assert (kout == 7.0).all()
    # gather: the halves of one output buffer along the heads, reversed
    bt, sl = torch.tensor([[0, 1]]), torch.tensor([6])
    gk, gv, _ = nv.gather_dequant(cache.kv_cache, bt, sl, dtype="float32", **LINEAR)
    kv = np.full((6, 2, H, D), 7.0, np.float32)
    nv.gather_dequant(cache.kv_cache, bt.numpy(), sl.numpy(), key_out=kv[:, 0, ::-1], value_out=kv[:, 1, ::-1],
                      **LINEAR)
    assert_floats_identical(kv[:, 0, ::-1], gk.numpy())
    assert_floats_identical(kv[:, 1, ::-1], gv.numpy())
    # decode: query and out as the two halves of one buffer, heads reversed
    rng = np.random.default_rng(3)
    qo = np.zeros((2, 2 * H, 2, D), np.float32)
    qo[:, :, 0] = rng.standard_normal((2, 2 * H, D))
    q16 = qo.astype(np.float16)
    bt2 = np.array([[0], [1]], np.int32)
    sl2 = np.array([4, 3], np.int32)
    want = nv.decode_attention(np.ascontiguousarray(q16[:, ::-1, 0]), cache.kv_cache.numpy(), bt2, sl2, 1.0, 1.0,
                               **LINEAR)
    nv.decode_attention(q16[:, ::-1, 0], cache.kv_cache.numpy(), bt2, sl2, 1.0, 1.0, out=q16[:, ::-1, 1], **LINEAR)
    assert_floats_identical(q16[:, ::-1, 1], np.asarray(want))
    with pytest.raises(ValueError, match=shares("query", "out")):
        nv.decode_attention(q16[:, ::-1, 0], cache.kv_cache.numpy(), bt2, sl2, 1.0, 1.0, out=q16[:, :, 0], **LINEAR)


@pytest.mark.parametrize("seed", range(12))
def test_same_stride_outputs_with_flipped_dimensions_are_judged_by_their_elements(seed):
    # Two (N, T, H, D) slices of one buffer along its first axis, after random flips of its axes
    # (not the last: outputs take last stride 1): the verdict must be numpy's exact one
    # (np.shares_memory), not the byte ranges'.
    rng = np.random.default_rng(seed)
    cache = filled_cache()
    want_k, want_v = nv.dequantize(cache.kv_cache, **LINEAR)
    lead = int(rng.integers(N, 3 * N + 1))
    start = int(rng.integers(0, lead - N + 1))
    buf = np.full((lead, T, H, D), 7.0, np.float32)
    flips = tuple(slice(None, None, -1) if f else slice(None) for f in rng.integers(0, 2, 3))
    y = buf[flips]
    ko, vo = y[:N], y[start:start + N]
    if np.shares_memory(ko, vo, max_work=None):
        before = buf.copy()
        with pytest.raises(ValueError, match=shares("value_out", "key_out")):
            nv.dequantize(cache.kv_cache, key_out=ko, value_out=vo, **LINEAR)
        assert np.array_equal(buf, before)
    else:
        nv.dequantize(cache.kv_cache, key_out=ko, value_out=vo, **LINEAR)
        assert_floats_identical(ko, want_k.numpy())
        assert_floats_identical(vo, want_v.numpy())


def test_split_cache_sides_of_one_allocation_are_accepted():
    # vLLM's kv_cache.unbind(1): two views whose bytes interleave page by page.
    rng = np.random.default_rng(8)
    cache = make_cache(N, T, H, D, "sides", "HND", "torch", seed=8)
    key, value, k32, v32 = make_kv(mixed_tokens(rng, 3, H, D), mixed_tokens(rng, 3, H, D), "float32", "torch")
    slots = torch.tensor([1, 6, 3])
    want = expected_store(cache, cache.snapshot(), k32, v32, slots, 1.0, 1.0, scale_layout="linear")
    kc, vc = cache.sides_pair()
    nv.reshape_and_cache_flash(key, value, kc, vc, slots, "nvfp4", 1.0, 1.0, **LINEAR)
    assert np.array_equal(cache.snapshot(), want)
    k, v = nv.dequantize(kc, value_cache=vc, **LINEAR)
    k2, v2, _ = nv.gather_dequant(kc, torch.tensor([[0, 1]]), torch.tensor([8]), value_cache=vc,
                                  dtype="float32", **LINEAR)
    assert_floats_identical(k2, k.reshape(8, H, D))
    assert_floats_identical(v2, v.reshape(8, H, D))


# ------------------------------------------------------- 5. F checked before it is converted
def test_last_dimension_that_overflows_the_head_size_is_rejected():
    Fbig = 9 * (2**59 + 1)  # Fbig / 9 * 16 wraps to 16 in 64 bits
    buf = poison(2 * GUARD)
    kv = torch.as_strided(buf, (0, 2, 1, 1, Fbig), (Fbig, Fbig, Fbig, Fbig, 1), GUARD)
    check = unchanged(buf)
    with pytest.raises(ValueError, match=rf"kv_cache: last dimension {Fbig}"):
        key, value, slots = empty_tokens(1)
        nv.store(key, value, kv, slots, **LINEAR)
    check()


# -------------------------------------------------------------- 6. option strings and scales
def small_store():
    cache = make_cache(N, T, H, D, "5d", "HND", "torch", seed=9)
    key, value, slots = inputs()
    return cache, (lambda **kw: nv.store(key, value, slot_mapping=slots, **cache.kwargs(), **{**LINEAR, **kw}))


@pytest.mark.parametrize("arg,value", [("recipe", "nvfp4\x00junk"), ("recipe", "nvfp4_4over6\x00"),
                                       ("scale_layout", "linear\x00x"), ("scale_layout", "vllm\x00")])
def test_option_string_with_a_nul_is_rejected(arg, value):
    cache, call = small_store()
    before = cache.snapshot()
    with pytest.raises(ValueError, match=arg):
        call(**{arg: value})
    assert np.array_equal(cache.snapshot(), before)


BOOL = (TypeError, "a bool")
NONE = (TypeError, r"None received; .*pass 1\.0")  # SGLang leaves unset scales None
ONE_ELEMENT = (ValueError, "shape .* expected exactly one element")  # untested until mutation testing


@pytest.mark.parametrize("scale,error", [
    (None, NONE), (True, BOOL), (False, BOOL), (np.bool_(True), BOOL), (np.array(True), BOOL),
    (np.array([1.0, 2.0], np.float32), ONE_ELEMENT), (np.ones(3, np.float32), ONE_ELEMENT),
    (np.zeros(0, np.float32), ONE_ELEMENT), (torch.ones(2), ONE_ELEMENT), (torch.ones(1, 2), ONE_ELEMENT)],
    ids=["None", "True", "False", "np.bool_", "0-d bool array", "2 floats", "3 floats", "empty", "torch 2", "torch 1x2"])
@pytest.mark.parametrize("arg", ["k_scale", "v_scale"])
def test_none_bool_or_not_one_element_scale_is_rejected(arg, scale, error):
    cache, call = small_store()
    before = cache.snapshot()
    exc, text = error
    with pytest.raises(exc, match=rf"{arg}: {text}"):
        call(**{arg: scale})
    with pytest.raises(exc, match=rf"{arg}: {text}"):  # when prepared (a bool) or when called
        nv.prepare_store(cache.kv_cache, **{arg: scale}, **LINEAR)(*inputs())
    with pytest.raises(exc, match=rf"{arg}: {text}"):
        nv.dequantize(cache.kv_cache, **{arg: scale}, **LINEAR)
    assert np.array_equal(cache.snapshot(), before)


# -------------------------------------------- 7. the right exception, naming the argument
@pytest.mark.parametrize("arg", ["k_scale", "v_scale"])
@pytest.mark.parametrize("value", [10**400, -10**400], ids=["10**400", "-10**400"])
def test_scale_past_the_float_range_is_a_value_error(arg, value):
    cache, call = small_store()
    before = cache.snapshot()
    with pytest.raises(ValueError, match=rf"{arg}: "):
        call(**{arg: value})
    from fractions import Fraction
    with pytest.raises(ValueError, match=rf"{arg}: "):
        call(**{arg: Fraction(value)})
    assert np.array_equal(cache.snapshot(), before)


@pytest.mark.parametrize("stream", [-1, 2**64, 2**70])
def test_stream_handle_out_of_range_is_a_value_error(stream):
    cache, call = small_store()
    before = cache.snapshot()
    with pytest.raises(ValueError, match=r"stream: "):
        call(stream=stream)
    with pytest.raises(ValueError, match=r"stream: "):
        nv.dequantize(cache.kv_cache, stream=stream, **LINEAR)
    assert np.array_equal(cache.snapshot(), before)


class _Proto:
    def __init__(self, value):
        self.value = value

    def __cuda_stream__(self):
        return self.value


class _Attr:
    def __init__(self, name, value):
        setattr(self, name, value)


@pytest.mark.parametrize("stream", [_Proto(None), _Proto((0,)), _Attr("cuda_stream", "abc"), _Attr("ptr", 1.5)],
                         ids=["protocol None", "protocol (0,)", "cuda_stream str", "ptr float"])
def test_stream_object_without_an_int_handle_is_a_type_error(stream):
    """Found by review: such objects raised TypeError/IndexError/ValueError from inside the
    conversion, naming nothing, and a float handle was truncated."""
    cache, call = small_store()
    before = cache.snapshot()
    with pytest.raises(TypeError, match=r"stream: "):
        call(stream=stream)
    assert np.array_equal(cache.snapshot(), before)


@pytest.mark.parametrize("arg", ["k_scale", "sm_scale"])
def test_a_longdouble_below_the_double_range_is_named_as_given(arg):
    """Found by review: np.longdouble('1e-4000') read as 0 on its way to the binding, whose error
    then said 0 received."""
    tiny = np.longdouble("1e-4000")
    if tiny == 0:
        pytest.skip("this platform's long double is a double")
    cache = make_cache(2, 16, 2, 128, backend="numpy", seed=0)
    q, bt, sl = np.zeros((1, 2, 128), np.float16), np.zeros((1, 1), np.int32), np.ones(1, np.int32)
    kw = {"k_scale": tiny} if arg == "k_scale" else {"sm_scale": tiny}
    # repr: np.longdouble('1e-4000') under NumPy 2, 1e-4000 under NumPy 1.x
    with pytest.raises(ValueError, match=rf"{arg}: {re.escape(repr(tiny))} received, nonzero"):
        nv.decode_attention(q, cache.kv_cache, bt, sl, **kw, **LINEAR)


@pytest.mark.parametrize("cache_arg", [None, [[1, 2]], "kv"], ids=["None", "list", "str"])
def test_cache_that_is_no_array_is_a_type_error(cache_arg):
    with pytest.raises(TypeError, match=r"kv_cache: .*got (NoneType|list|str)"):
        nv.dequantize(cache_arg)
    with pytest.raises(TypeError, match=r"kv_cache: .*got (NoneType|list|str)"):
        nv.store_workspace(cache_arg)
    with pytest.raises(TypeError, match=r"kv_cache: .*got (NoneType|list|str)"):
        nv.gather_dequant(cache_arg, torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, dtype=torch.int64))
    key, value, slots = inputs()
    with pytest.raises(TypeError, match=r"kv_cache: "):
        nv.store(key, value, cache_arg, slots)


def test_value_cache_that_is_no_array_is_a_type_error():
    cache = make_cache(N, T, H, D, "sides", "HND", "torch", seed=10)
    with pytest.raises(TypeError, match=r"value_cache: .*got list"):
        nv.dequantize(cache.kv_cache, value_cache=[[0]], **LINEAR)
    with pytest.raises(TypeError, match=r"value_cache: .*got list"):
        nv.store_workspace(cache.kv_cache, [[0]])


def test_workspace_helpers_refuse_what_their_operations_refuse():
    """Found by review: store_workspace and decode_workspace sized a workspace for a bf16 "cache",
    which the store and decode refuse. (A uint8 array of a shape they refuse still gets one: its
    shape errors are the C ABI's, at the operation.)"""
    q, bt = torch.zeros(1, 4, 128, dtype=torch.bfloat16), torch.zeros(1, 4, dtype=torch.int32)
    for dtype in (torch.bfloat16, torch.int64):
        bad = torch.zeros(4, 2, 16, 2, 72, dtype=dtype)
        with pytest.raises(TypeError, match=r"kv_cache: dtype .* expected uint8"):
            nv.store_workspace(bad)
        with pytest.raises(TypeError, match=r"kv_cache: dtype .* expected uint8"):
            nv.decode_workspace(bad, q, bt)
    assert nv.store_workspace(torch.zeros(4, 2, 16, 2, 72, dtype=torch.uint8)).numel() == nv.store_workspace_bytes(4, 16)


def test_seq_lens_that_is_no_array_is_a_type_error():
    cache = filled_cache()
    bt = torch.tensor([[0, 1]])
    with pytest.raises(TypeError, match=r"seq_lens: .*list"):
        nv.gather_dequant(cache.kv_cache, bt, [8], **LINEAR)
    with pytest.raises(TypeError, match=r"seq_lens: .*list"):
        nv.gather_dequant(cache.kv_cache, bt, [8], cu_seqlens=torch.tensor([0, 8]), **LINEAR)


def test_seq_lens_of_a_float_dtype_is_rejected_naming_it():
    cache = filled_cache()  # TypeError, as for every wrong element type (was ValueError here)
    with pytest.raises(TypeError, match=r"seq_lens: .*float32"):
        nv.gather_dequant(cache.kv_cache, torch.tensor([[0, 1]]), torch.tensor([8.0]), **LINEAR)


@pytest.mark.parametrize("cu", [torch.zeros(0, dtype=torch.int64), torch.tensor(3), []],
                         ids=["empty", "0-d", "empty list"])
def test_cu_seqlens_without_entries_is_a_value_error(cu):
    cache = filled_cache()
    with pytest.raises(ValueError, match=r"cu_seqlens: "):
        nv.gather_dequant(cache.kv_cache, torch.zeros(0, 2, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
                          cu_seqlens=cu, **LINEAR)


def test_cu_seqlens_with_a_negative_total_is_a_value_error():
    cache = filled_cache()
    with pytest.raises(ValueError, match=r"cu_seqlens: last entry -4"):
        nv.gather_dequant(cache.kv_cache, torch.tensor([[0, 1]]), torch.tensor([4]),
                          cu_seqlens=torch.tensor([0, -4]), **LINEAR)


@pytest.mark.parametrize("backend", ["torch", "numpy"])
def test_negative_seq_lens_when_allocating_is_a_value_error(backend):
    cache = filled_cache()
    kv = cache.kv_cache if backend == "torch" else cache.kv_cache.numpy()
    conv = (lambda x: torch.tensor(x)) if backend == "torch" else np.array
    with pytest.raises(ValueError, match=r"seq_lens: a negative length \(-9\)"):
        nv.gather_dequant(kv, conv([[0, 1], [1, 0]]), conv([3, -9]), **LINEAR)


@pytest.mark.parametrize("arg", ["key", "value"])
def test_sparse_torch_input_is_a_type_error_naming_it(arg):
    cache, _ = small_store()
    key, value, slots = inputs()
    args = {"key": key.float(), "value": value.float()}
    args[arg] = args[arg].to_sparse()
    before = cache.snapshot()
    with pytest.raises(TypeError, match=rf"{arg}: .*sparse"):
        nv.store(args["key"], args["value"], slot_mapping=slots, **cache.kwargs(), **LINEAR)
    assert np.array_equal(cache.snapshot(), before)


def test_only_key_out_given_allocates_value_out_of_its_dtype():
    cache = filled_cache()
    want_k, want_v = nv.dequantize(cache.kv_cache, dtype="float16", **LINEAR)
    key_out = torch.full((N, T, H, D), 7.0, dtype=torch.float16)
    k, v = nv.dequantize(cache.kv_cache, key_out=key_out, **LINEAR)
    assert k is key_out and v.dtype == torch.float16
    assert_floats_identical(k, want_k)
    assert_floats_identical(v, want_v)
    _, v, _ = nv.gather_dequant(cache.kv_cache, torch.tensor([[0, 1]]), torch.tensor([8]),
                                key_out=torch.empty(8, H, D, dtype=torch.float16), **LINEAR)
    assert v.dtype == torch.float16


def test_only_key_out_given_with_another_dtype_blames_dtype_and_key_out():
    cache = filled_cache()
    key_out = torch.full((N, T, H, D), 7.0, dtype=torch.float16)
    check = unchanged(key_out)
    with pytest.raises(ValueError, match=r"dtype: 'float32' received but key_out is float16"):
        nv.dequantize(cache.kv_cache, key_out=key_out, dtype="float32", **LINEAR)
    with pytest.raises(ValueError, match=r"dtype: .* received but value_out is float16"):
        nv.gather_dequant(cache.kv_cache, torch.tensor([[0, 1]]), torch.tensor([8]), dtype=torch.bfloat16,
                          value_out=torch.empty(8, H, D, dtype=torch.float16), **LINEAR)
    check()


def test_only_key_out_given_of_a_wrong_dtype_is_blamed_on_key_out():
    cache = filled_cache()
    with pytest.raises(TypeError, match=r"key_out"):
        nv.dequantize(cache.kv_cache, key_out=torch.zeros(N, T, H, D, dtype=torch.int32), **LINEAR)


# ------------------------------------------- 7b. checks that mutation testing found untested
def test_sides_of_different_page_counts_are_rejected():
    # Nothing else guards N: with this check removed, slot 15 of a 4-page key side went to page 3
    # of a 1-page value side, 144 bytes past its end (review).
    buf = poison(5 * T * H * F + 2 * GUARD)
    kc = view_as(buf, GUARD, torch.uint8, (4, T, H, F))
    vc = view_as(buf, GUARD + 4 * T * H * F, torch.uint8, (1, T, H, F))
    key, value, _ = inputs()
    check = unchanged(buf)
    with pytest.raises(ValueError, match=r"value_cache: shape .* does not match key_cache"):
        nv.reshape_and_cache_flash(key, value, kc, vc, torch.tensor([15, 0, 1]), "nvfp4", 1.0, 1.0, **LINEAR)
    with pytest.raises(ValueError, match=r"value_cache: shape .* does not match key_cache"):
        nv.dequantize(kc, value_cache=vc, **LINEAR)
    check()


def test_strided_or_misaligned_workspaces_are_rejected():
    cache, call = small_store()
    before = cache.snapshot()
    need = nv.store_workspace_bytes(N, T)
    with pytest.raises(ValueError, match="workspace: address not a multiple of 4 bytes"):
        call(workspace=torch.zeros(need + 4, dtype=torch.uint8)[1:need + 1])
    assert np.array_equal(cache.snapshot(), before)
    # decode: any workspace given is checked on the CPU too (the C ABI's promise)
    q = torch.randn(2, 2 * H, D).to(torch.bfloat16)
    out = torch.full((2, 2 * H, D), 7.0, dtype=torch.bfloat16)
    args = (q, cache.kv_cache, torch.tensor([[0], [1]]), torch.tensor([3, 4]), 1.0, 1.0)
    for ws in (torch.zeros(64)[::2], torch.zeros(8, 8, dtype=torch.uint8).t()):
        with pytest.raises(ValueError, match="workspace: shape .* is not contiguous"):
            nv.decode_attention(*args, out=out, workspace=ws, **LINEAR)
    assert bool((out == 7.0).all())


# -------------------------------------------------- 8. tensors without memory (meta tensors)
def test_meta_tensor_as_key_or_cache_is_a_value_error():
    cache, _ = small_store()
    key, value, slots = inputs()
    before = cache.snapshot()
    with pytest.raises(ValueError, match=r"key: .*meta"):
        nv.store(torch.empty(3, H, D, device="meta"), value, slot_mapping=slots, **cache.kwargs(), **LINEAR)
    with pytest.raises(ValueError, match=r"kv_cache: .*meta"):
        nv.store(key, value, torch.empty(N, 2, T, H, F, dtype=torch.uint8, device="meta"), slots, **LINEAR)
    with pytest.raises(ValueError, match=r"kv_cache: .*meta"):
        nv.dequantize(torch.empty(N, 2, T, H, F, dtype=torch.uint8, device="meta"),
                      key_out=torch.empty(N, T, H, D), value_out=torch.empty(N, T, H, D), **LINEAR)
    assert np.array_equal(cache.snapshot(), before)


def test_gather_without_outputs_and_lengths_without_data_is_a_value_error():
    # The outputs' row count is read on the host from seq_lens (or cu_seqlens): a meta one gave
    # torch's RuntimeError or NotImplementedError, naming no argument (review).
    cache = filled_cache()
    bt, meta = torch.tensor([[0, 1]]), lambda x: x.to("meta")
    with pytest.raises(ValueError, match=r"seq_lens: .*without data.*key_out and value_out"):
        nv.gather_dequant(cache.kv_cache, bt, meta(torch.tensor([6])), **LINEAR)
    with pytest.raises(ValueError, match=r"cu_seqlens: .*without data.*key_out and value_out"):
        nv.gather_dequant(cache.kv_cache, bt, torch.tensor([6]), cu_seqlens=meta(torch.tensor([0, 6])), **LINEAR)
    with pytest.raises(ValueError, match=r"seq_lens: .*without data"):  # every argument meta
        nv.gather_dequant(meta(cache.kv_cache), meta(bt), meta(torch.tensor([6])), **LINEAR)


# -------------------------------------------------------------- 10. floating-point mode
@contextlib.contextmanager
def flush_denormal():
    if not torch.set_flush_denormal(True):
        pytest.skip("torch.set_flush_denormal is not supported on this CPU")
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


def test_flush_denormal_mode_keeps_a_subnormal_sm_scale():
    # The binding compared the float32 it made outside its IEEE-mode guard: under DAZ a subnormal
    # sm_scale read as 0 and was refused as "outside float32's range" (found rereading the change).
    cache = filled_cache()
    args = (torch.randn(2, 2 * H, D, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16),
            cache.kv_cache, torch.tensor([[0], [1]]), torch.tensor([3, 4]), 1.0, 1.0)
    want = nv.decode_attention(*args, sm_scale=1e-40, **LINEAR)
    with flush_denormal():
        got = nv.decode_attention(*args, sm_scale=1e-40, **LINEAR)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("arg", ["sm_scale", "logits_soft_cap"])
def test_flush_denormal_mode_keeps_a_subnormal_numpy_float32(arg):
    """Found by review: decode's float arguments went through float(), which converts a numpy
    float32 in the caller's mode: under denormals-are-zero a subnormal sm_scale was refused as 0,
    a subnormal soft cap meant none, and a negative one passed as -0. They are read from their
    bits now, as the global scales are."""
    cache = filled_cache()
    args = (torch.randn(2, 2 * H, D, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16),
            cache.kv_cache, torch.tensor([[0], [1]]), torch.tensor([3, 4]), 1.0, 1.0)
    tiny = np.float32(1e-40)  # made before the mode is set, which would flush it
    want = nv.decode_attention(*args, **{arg: float(tiny)}, **LINEAR)
    with flush_denormal():
        got = nv.decode_attention(*args, **{arg: tiny}, **LINEAR)
        if arg == "logits_soft_cap":
            with pytest.raises(ValueError, match="logits_soft_cap: -9.99"):
                nv.decode_attention(*args, logits_soft_cap=-tiny, **LINEAR)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("g", [1.0, 1e-38], ids=["g=1", "g=1e-38 (subnormal)"])
def test_flush_denormal_mode_changes_no_byte(g):
    rng = np.random.default_rng(11)
    k = mixed_tokens(rng, 8, H, D)
    k[:2] = (rng.standard_normal((2, H, D)) * 1e-39).astype(np.float32)  # subnormal inputs
    k[2, 0, :16] = np.float32(1e-45)
    k = k * np.float32(g) if g != 1.0 else k
    v = mixed_tokens(rng, 8, H, D) * np.float32(g)
    key, value, k32, v32 = make_kv(k, v, "float32", "torch")
    slots = torch.arange(8)
    results = []
    for flush in (False, True):
        cache = make_cache(N, T, H, D, "5d", "HND", "torch", seed=12)
        want = expected_store(cache, cache.snapshot(), k32, v32, slots, g, g, scale_layout="linear")
        with flush_denormal() if flush else contextlib.nullcontext():
            nv.store(key, value, slot_mapping=slots, k_scale=g, v_scale=g, **cache.kwargs(), **LINEAR)
            out = nv.dequantize(cache.kv_cache, k_scale=g, v_scale=g, **LINEAR)
        # (g = 1e-38 puts zeros next to out = +Inf: 0 * Inf, decided by FORMAT.md §2)
        assert np.array_equal(cache.snapshot(), want), f"flush_denormal={flush}"
        results.append((cache.snapshot(), out))
    assert np.array_equal(results[0][0], results[1][0])
    for a, b in zip(results[0][1], results[1][1]):
        assert_floats_identical(b.numpy(), a.numpy())
    if g != 1.0:  # the outputs are subnormal: a flushed mode would have zeroed them
        assert (np.abs(results[1][1][0].numpy()) < np.float32(1.1754944e-38)).any()


@pytest.mark.parametrize("kind", ["numpy float32", "0-d float32 array", "big-endian 0-d array", "numpy float64",
                                  "float"])
def test_flush_denormal_keeps_a_subnormal_numpy_scale(kind):
    """Found by fuzzing: a numpy float32 scale went through float(), which converts in the
    caller's mode: with denormals-are-zero a subnormal scale (valid: its reciprocal is finite)
    read as 0 and was refused. Every kind of scalar now stores what the float does."""
    g = 2.94e-39
    scale = {"numpy float32": np.float32(g), "0-d float32 array": np.array(g, dtype=np.float32),
             "big-endian 0-d array": np.array(g, dtype=">f4"),  # its bytes read in order (review)
             "numpy float64": np.float64(np.float32(g)), "float": float(np.float32(g))}[kind]
    key = torch.from_numpy(mixed_tokens(np.random.default_rng(3), 2, H, D) * np.float32(1e-36))
    slots = torch.arange(2)
    caches = []
    for flush in (False, True):
        cache = make_cache(N, T, H, D, "5d", "HND", "torch", seed=13)
        with flush_denormal() if flush else contextlib.nullcontext():
            nv.store(key, key, slot_mapping=slots, k_scale=scale, v_scale=scale, **cache.kwargs(), **LINEAR)
        caches.append(cache.snapshot())
    assert np.array_equal(caches[0], caches[1])
    reference = make_cache(N, T, H, D, "5d", "HND", "torch", seed=13)  # the same scale as a float
    nv.store(key, key, slot_mapping=slots, k_scale=float(np.float32(g)), v_scale=float(np.float32(g)),
             **reference.kwargs(), **LINEAR)
    assert np.array_equal(caches[0], reference.snapshot())
    # prepare_store checks a number at preparation, in the same mode (2026-12-07).
    prepared = make_cache(N, T, H, D, "5d", "HND", "torch", seed=13)
    with flush_denormal():
        nv.prepare_store(prepared.kv_cache, scale, scale, **LINEAR)(key, key, slots)
    assert np.array_equal(prepared.snapshot(), reference.snapshot())


# ------------------------------------------------- 11. the spec takes what the operations take
def test_spec_max_head_size_is_the_extensions():
    from nvfp4kv import _C, spec
    assert spec.NVFP4_MAX_HEAD_SIZE == _C.MAX_HEAD_SIZE == 512


@pytest.mark.parametrize("D", [528, 1024, 4096])
def test_spec_rejects_nvfp4_head_sizes_the_operations_reject(D):
    with pytest.raises(ValueError, match=rf"head_size must be .* up to 512 .*got {D}"):
        nv.KVCacheSpec(16, 8, D)
    with pytest.raises(ValueError, match=rf"head_size_v must be .* up to 512 .*got {D}"):
        nv.KVCacheSpec(16, 8, 128, head_size_v=D)
    with pytest.raises(ValueError, match=rf"head_size must be .* up to 512 .*got {D}"):
        nv.get_kv_cache_shape(4, 16, 8, D, "nvfp4")
    with pytest.raises(ValueError, match=rf"head_size .*got {D}"):
        nv.allocate_kv_cache(nv.KVCacheSpec(16, 8, D, cache_dtype="nvfp4_4over6"), 1)
    # the operations agree: such a cache (F = 9 * D / 16) is refused
    kv = torch.zeros(1, 2, 1, 1, 9 * D // 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"kv_cache: last dimension"):
        nv.dequantize(kv, key_out=torch.empty(1, 1, 1, 16), value_out=torch.empty(1, 1, 1, 16), **LINEAR)


def test_spec_accepts_the_largest_head_size_and_other_dtypes_any_size():
    spec = nv.KVCacheSpec(4, 1, 512)
    kv = nv.allocate_kv_cache(spec, 1)
    rng = np.random.default_rng(13)
    key, value, _, _ = make_kv(mixed_tokens(rng, 2, 1, 512), mixed_tokens(rng, 2, 1, 512), "bfloat16", "torch")
    nv.store(key, value, kv, torch.tensor([0, 3]))
    assert nv.KVCacheSpec(16, 8, 1024, cache_dtype="bfloat16").head_size == 1024  # not nvfp4: no limit


def test_reshape_and_cache_flash_needs_two_sides_and_a_str_dtype():
    """Found by review: value_cache=None was taken, and an NHD side of T = 2H tokens (T 16, H 8)
    then passed for a packed cache, into which K and V were both written; a list for
    kv_cache_dtype raised "unhashable type". Both are refused, naming the argument, before
    anything is written."""
    kv = nv.allocate_kv_cache(nv.KVCacheSpec(16, 8, 128), 4, layout="NHD")
    before = kv.clone()
    k_side, v_side = kv.unbind(1)
    key = torch.randn(3, 8, 128)
    with pytest.raises(TypeError, match="^value_cache: None received"):
        nv.reshape_and_cache_flash(key, key, k_side, None, torch.arange(3), "nvfp4", 0.01, 0.01,
                                   scale_layout="linear")
    with pytest.raises(TypeError, match="^kv_cache_dtype: a list received"):
        nv.reshape_and_cache_flash(key, key, k_side, v_side, torch.arange(3), ["nvfp4"], 0.01, 0.01,
                                   scale_layout="linear")
    with pytest.raises(TypeError, match="value_cache: None received"):  # the torch op, as compiled code calls it
        torch.ops.nvfp4kv.reshape_and_cache_flash(key, key, k_side, None, torch.arange(3), "nvfp4",
                                                  torch.tensor(0.01), torch.tensor(0.01), "linear")
    assert torch.equal(kv, before)


def test_a_cache_of_no_head_size_is_refused_before_outputs_are_allocated():
    """Found by review: dequantize allocated its outputs from an fp8 cache's last dimension (128:
    no NVFP4 head size) before the C ABI refused the cache: 5 GiB and 15 s for 20,000 pages. The
    Python layer now refuses it first (its message has no ABI function's prefix)."""
    fp8 = torch.zeros(200, 2, 16, 8, 128, dtype=torch.uint8)  # an fp8 cache's bytes
    for call in (lambda: nv.dequantize(fp8, pages=torch.tensor([0]), scale_layout="linear"),
                 lambda: nv.gather_dequant(fp8, torch.zeros(1, 1, dtype=torch.int32), torch.tensor([3]),
                                           scale_layout="linear")):
        with pytest.raises(ValueError, match="^kv_cache: last dimension 128 received"):
            call()
