"""Tests of nvfp4kv.views: the views address exactly the bytes docs/FORMAT.md §4 names.

Each test builds a cache as a strided view of a flat random byte buffer, writes fresh random
bytes through the views, and compares the whole buffer with what an independent offset
formula (written here from FORMAT.md, not taken from the module) says should have changed.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from conftest import load_package_module

V = load_package_module("views")
SP = load_package_module("spec")

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None

BACKENDS = ["numpy"] + (["torch"] if torch is not None else [])


# ---------------------------------------------------------------------------------------------
# independent reference: FORMAT.md §4 offsets from the start of a side


def ref_data_offset(layout, T, H, D, t, h, j):
    r = h * T + t if layout == "HND" else t * H + h
    return r * (D // 2) + j


def ref_linear_scale_offset(layout, T, H, D, t, h, g):
    S = D // 16
    r = h * T + t if layout == "HND" else t * H + h
    return H * T * (D // 2) + r * S + g


def ref_interleaved_scale_offset(T, H, D, t, h, g):
    S = D // 16
    return H * T * (D // 2) + h * T * S + (t // 4) * 4 * S + 4 * g + (t % 4)


# ---------------------------------------------------------------------------------------------
# helpers


def to_numpy(x):
    if torch is not None and isinstance(x, torch.Tensor):
        if x.dtype != torch.uint8:
            x = x.view(torch.uint8)
        return x.numpy()
    return np.asarray(x)


def assign(view, values):
    """view[...] = values (uint8 numpy array), for torch (scales seen as uint8) or numpy."""
    if torch is not None and isinstance(view, torch.Tensor):
        view.view(torch.uint8).copy_(torch.from_numpy(values))
    else:
        view[...] = values


def set_byte(view, idx, value):
    """view[idx] = value, for torch (scales seen as uint8) or numpy."""
    if torch is not None and isinstance(view, torch.Tensor):
        view.view(torch.uint8)[idx] = value
    else:
        view[idx] = value


def make_buffer(backend, nbytes, rng):
    raw = rng.integers(0, 256, size=nbytes, dtype=np.uint8)
    if backend == "torch":
        return torch.from_numpy(raw.copy())
    return raw.copy()


def strided(buf, backend, offset, shape, strides):
    if backend == "torch":
        return buf.as_strided(shape, strides, offset)
    return np.lib.stride_tricks.as_strided(buf[offset:], shape, strides)


def cache_5d(buf, backend, base, N, T, H, F, layout, page_stride, side_stride):
    if layout == "HND":
        strides = (page_stride, side_stride, F, T * F, 1)
    else:
        strides = (page_stride, side_stride, H * F, F, 1)
    return strided(buf, backend, base, (N, 2, T, H, F), strides)


def index_grid(shape):
    return [a.ravel() for a in np.indices(shape)]


def expected_after_writes(before, writes):
    """Apply (offsets, values) pairs to a copy of the buffer; offsets must not collide."""
    exp = before.copy()
    all_offsets = np.concatenate([o for o, _ in writes]) if writes else np.zeros(0, np.int64)
    assert len(np.unique(all_offsets)) == len(all_offsets), "reference offsets collide"
    for off, val in writes:
        exp[off] = val
    return exp


def side_writes(view_data, view_scale, rng, base_side, page_stride, N, T, H, D, layout,
                interleaved):
    """Write random bytes through (data, scale) of one side; return the reference writes."""
    half, S = D // 2, D // 16
    vals = rng.integers(0, 256, size=(N, T, H, half), dtype=np.uint8)
    assign(view_data, vals)
    n, t, h, j = index_grid((N, T, H, half))
    off = base_side + n * page_stride + ref_data_offset(layout, T, H, D, t, h, j)
    writes = [(off, vals.ravel())]
    if interleaved:
        svals = rng.integers(0, 256, size=(N, T // 4, 4, H, S), dtype=np.uint8)
        assign(view_scale, svals)
        n, b, i, h, g = index_grid((N, T // 4, 4, H, S))
        off = base_side + n * page_stride + ref_interleaved_scale_offset(T, H, D, 4 * b + i, h, g)
    else:
        svals = rng.integers(0, 256, size=(N, T, H, S), dtype=np.uint8)
        assign(view_scale, svals)
        n, t, h, g = index_grid((N, T, H, S))
        off = base_side + n * page_stride + ref_linear_scale_offset(layout, T, H, D, t, h, g)
    writes.append((off, svals.ravel()))
    return writes


def check_views_types(backend, views, N, T, H, D, interleaved_v):
    k_data, k_scale, v_data, v_scale = views
    S = D // 16
    for d in (k_data, v_data):
        assert tuple(d.shape) == (N, T, H, D // 2)
    assert tuple(k_scale.shape) == (N, T, H, S)
    assert tuple(v_scale.shape) == ((N, T // 4, 4, H, S) if interleaved_v else (N, T, H, S))
    if backend == "torch":
        assert k_data.dtype == torch.uint8 and v_data.dtype == torch.uint8
        assert k_scale.dtype == torch.float8_e4m3fn and v_scale.dtype == torch.float8_e4m3fn
    else:
        for x in views:
            assert x.dtype == np.uint8


def run_5d_case(backend, N, T, H, D, layout, scale_layout, pad, base, seed, tag_layout=None):
    """Build a 5-D cache with page stride 2HTF + pad inside a random buffer, write through
    the views, compare the whole buffer with the reference."""
    rng = np.random.default_rng(seed)
    F = 9 * D // 16
    side_stride = H * T * F
    page_stride = 2 * side_stride + pad
    nbytes = base + N * page_stride + 64
    buf = make_buffer(backend, nbytes, rng)
    before = to_numpy(buf).copy()
    cache = cache_5d(buf, backend, base, N, T, H, F, layout, page_stride, side_stride)
    views = V.nvfp4_kv_cache_split_views(cache, scale_layout=scale_layout)
    interleaved_v = scale_layout == "vllm"
    check_views_types(backend, views, N, T, H, D, interleaved_v)
    # the reference layout: HND and NHD are the same bytes when H == 1 or T == 1
    ref_layout = tag_layout or layout
    writes = side_writes(views[0], views[1], rng, base, page_stride, N, T, H, D, ref_layout,
                         False)
    writes += side_writes(views[2], views[3], rng, base + side_stride, page_stride, N, T, H,
                          D, ref_layout, interleaved_v)
    exp = expected_after_writes(before, writes)
    np.testing.assert_array_equal(to_numpy(buf), exp)
    # every byte of every page is covered exactly once by the four views
    assert sum(len(o) for o, _ in writes) == N * 2 * side_stride
    return views, cache


# ---------------------------------------------------------------------------------------------
# 5-D caches


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("D", [16, 64, 128])
def test_5d_linear(backend, layout, D):
    run_5d_case(backend, N=3, T=8, H=3, D=D, layout=layout, scale_layout="linear", pad=0,
                base=0, seed=D)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("D, T, H", [(64, 4, 1), (64, 16, 2), (128, 16, 8), (256, 12, 3)])
def test_5d_vllm_interleaved(backend, D, T, H):
    run_5d_case(backend, N=2, T=T, H=H, D=D, layout="HND", scale_layout="vllm", pad=0, base=0,
                seed=T * H)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_5d_page_padding_and_offset(backend, layout):
    # free page stride and a cache that does not start at the buffer's first byte
    run_5d_case(backend, N=4, T=8, H=2, D=64, layout=layout, scale_layout="linear", pad=37,
                base=11, seed=5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_5d_vllm_with_padding(backend):
    run_5d_case(backend, N=3, T=16, H=4, D=128, layout="HND", scale_layout="vllm", pad=100,
                base=3, seed=6)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("H, T", [(1, 8), (3, 1), (1, 1)])
def test_ambiguous_layout_same_bytes(backend, H, T):
    # With H == 1 or T == 1, an NHD-strided cache is byte-identical to HND.
    run_5d_case(backend, N=2, T=T, H=H, D=64, layout="NHD", scale_layout="linear", pad=0,
                base=0, seed=7, tag_layout="HND")
    run_5d_case(backend, N=2, T=T, H=H, D=64, layout="NHD", scale_layout="linear", pad=0,
                base=0, seed=8, tag_layout="NHD")


@pytest.mark.parametrize("backend", BACKENDS)
def test_nhd_single_head_accepts_vllm(backend):
    # H == 1: NHD strides are also HND, so the interleaved V scales are usable.
    run_5d_case(backend, N=2, T=8, H=1, D=64, layout="NHD", scale_layout="vllm", pad=0,
                base=0, seed=9, tag_layout="HND")


@pytest.mark.skipif(torch is None, reason="torch not installed")
def test_size_one_dim_with_odd_stride():
    # Frameworks leave the stride of a size-1 dimension free; it must not matter.
    N, T, H, D = 2, 8, 1, 64
    F = 36
    buf = torch.zeros(N * 2 * T * F, dtype=torch.uint8)
    cache = buf.as_strided((N, 2, T, H, F), (2 * T * F, T * F, F, 12345, 1))
    k_data, k_scale, v_data, v_scale = V.nvfp4_kv_cache_split_views(cache)
    v_scale.view(torch.uint8)[1, 1, 2, 0, 3] = 0x5A  # token 6, group 3
    off = 1 * 2 * T * F + T * F + ref_interleaved_scale_offset(T, H, D, 6, 0, 3)
    assert buf[off].item() == 0x5A
    assert int(buf.sum()) == 0x5A


# ---------------------------------------------------------------------------------------------
# allocated caches, zero copy


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_allocated_cache_zero_copy(backend, layout):
    N, T, H, D = 2, 16, 4, 128
    F = 72
    cache = SP.allocate_kv_cache(SP.KVCacheSpec(T, H, D), N, layout=layout, backend=backend)
    sl = "vllm" if layout == "HND" else "linear"
    k_data, k_scale, v_data, v_scale = V.nvfp4_kv_cache_split_views(cache, scale_layout=sl)
    k_data[1, 5, 2, 7] = 0x11
    set_byte(k_scale, (1, 5, 2, 3), 0x22)
    v_data[0, 9, 3, 0] = 0x33
    if sl == "vllm":
        set_byte(v_scale, (0, 3, 1, 1, 6), 0x44)  # token 13
        v_scale_off = ref_interleaved_scale_offset(T, H, D, 13, 1, 6)
    else:
        set_byte(v_scale, (0, 13, 1, 6), 0x44)
        v_scale_off = ref_linear_scale_offset(layout, T, H, D, 13, 1, 6)
    c = to_numpy(cache)
    # the bytes of each page as stored: physical [2][H][T][F] (HND) or [2][T][H][F] (NHD)
    pages = c.transpose(SP.get_kv_cache_stride_order(layout)).reshape(N, -1)
    assert pages[1, ref_data_offset(layout, T, H, D, 5, 2, 7)] == 0x11
    assert pages[1, ref_linear_scale_offset(layout, T, H, D, 5, 2, 3)] == 0x22
    assert pages[0, H * T * F + ref_data_offset(layout, T, H, D, 9, 3, 0)] == 0x33
    assert pages[0, H * T * F + v_scale_off] == 0x44
    assert int(pages.astype(np.int64).sum()) == 0x11 + 0x22 + 0x33 + 0x44
    # and the views read what the cache holds
    assert to_numpy(k_data)[1, 5, 2, 7] == 0x11
    if backend == "torch":
        assert k_data.data_ptr() == cache.data_ptr()
        assert k_data.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()
    else:
        assert np.shares_memory(k_data, cache) and np.shares_memory(v_scale, cache)


def test_numpy_readonly_cache_gives_readonly_views():
    cache = SP.allocate_kv_cache(SP.KVCacheSpec(16, 2, 64), 1, backend="numpy")
    cache.flags.writeable = False
    for v in V.nvfp4_kv_cache_split_views(cache):
        assert not v.flags.writeable
        with pytest.raises(ValueError):
            v[...] = 1


# ---------------------------------------------------------------------------------------------
# packed 4-D (N, 2H, T, F)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale_layout", ["vllm", "linear"])
@pytest.mark.parametrize("pad", [0, 19])
def test_packed_4d(backend, scale_layout, pad):
    N, T, H, D = 3, 8, 2, 64
    F = 36
    rng = np.random.default_rng(pad + len(scale_layout))
    page_stride = 2 * H * T * F + pad
    buf = make_buffer(backend, N * page_stride + 5, rng)
    before = to_numpy(buf).copy()
    cache = strided(buf, backend, 5, (N, 2 * H, T, F), (page_stride, T * F, F, 1))
    views = V.nvfp4_kv_cache_split_views(cache, scale_layout=scale_layout)
    inter = scale_layout == "vllm"
    check_views_types(backend, views, N, T, H, D, inter)
    writes = side_writes(views[0], views[1], rng, 5, page_stride, N, T, H, D, "HND", False)
    writes += side_writes(views[2], views[3], rng, 5 + H * T * F, page_stride, N, T, H, D,
                          "HND", inter)
    np.testing.assert_array_equal(to_numpy(buf), expected_after_writes(before, writes))


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_4d_matches_5d_hnd(backend):
    # The packed 4-D cache and the 5-D HND cache are the same bytes: same views.
    cache5 = SP.allocate_kv_cache(SP.KVCacheSpec(8, 2, 64), 2, layout="HND", backend=backend)
    if backend == "torch":
        cache4 = cache5.permute(0, 1, 3, 2, 4).reshape(2, 4, 8, 36)
        assert cache4.data_ptr() == cache5.data_ptr()
    else:
        cache4 = cache5.transpose(0, 1, 3, 2, 4).reshape(2, 4, 8, 36)
        assert np.shares_memory(cache4, cache5)
    v4 = V.nvfp4_kv_cache_split_views(cache4)
    v5 = V.nvfp4_kv_cache_split_views(cache5)
    for a, b in zip(v4, v5):
        assert tuple(a.shape) == tuple(b.shape)
    assign(v4[3], np.arange(v4[3].numel() if backend == "torch" else v4[3].size,
                            dtype=np.uint8).reshape(tuple(v4[3].shape)))
    np.testing.assert_array_equal(to_numpy(v4[3]), to_numpy(v5[3]))
    assert to_numpy(v5[3]).any()


# ---------------------------------------------------------------------------------------------
# one side


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_split_data_scale_side(backend, layout):
    N, T, H, D = 3, 8, 2, 128
    F = 72
    rng = np.random.default_rng(11)
    side_stride = H * T * F
    page_stride = 2 * side_stride + 13
    buf = make_buffer(backend, 2 + N * page_stride, rng)
    before = to_numpy(buf).copy()
    cache = cache_5d(buf, backend, 2, N, T, H, F, layout, page_stride, side_stride)
    writes = []
    for s in (0, 1):
        sl = "interleaved" if (s == 1 and layout == "HND") else "linear"
        data, scale = V.nvfp4_split_data_scale(cache[:, s], scale_layout=sl)
        assert tuple(data.shape) == (N, T, H, D // 2)
        writes += side_writes(data, scale, rng, 2 + s * side_stride, page_stride, N, T, H, D,
                              layout, sl == "interleaved")
    np.testing.assert_array_equal(to_numpy(buf), expected_after_writes(before, writes))


@pytest.mark.parametrize("backend", BACKENDS)
def test_split_data_scale_equals_full_split(backend):
    cache = SP.allocate_kv_cache(SP.KVCacheSpec(16, 3, 64), 2, backend=backend)
    k_data, k_scale, v_data, v_scale = V.nvfp4_kv_cache_split_views(cache)
    rng = np.random.default_rng(12)
    for v in (k_data, k_scale, v_data, v_scale):
        assign(v, rng.integers(1, 256, size=tuple(v.shape), dtype=np.uint8))
    d, s = V.nvfp4_split_data_scale(cache[:, 0])
    np.testing.assert_array_equal(to_numpy(d), to_numpy(k_data))
    np.testing.assert_array_equal(to_numpy(s), to_numpy(k_scale))
    d, s = V.nvfp4_split_data_scale(cache[:, 1], scale_layout="interleaved")
    np.testing.assert_array_equal(to_numpy(d), to_numpy(v_data))
    np.testing.assert_array_equal(to_numpy(s), to_numpy(v_scale))


# ---------------------------------------------------------------------------------------------
# property test over geometries, layouts, paddings


@settings(max_examples=60, deadline=None)
@given(
    backend=st.sampled_from(BACKENDS),
    N=st.integers(0, 3),
    T=st.integers(1, 9),
    H=st.integers(1, 4),
    D=st.sampled_from([16, 32, 48, 64, 128, 192]),
    layout=st.sampled_from(["HND", "NHD"]),
    pad=st.integers(0, 40),
    base=st.integers(0, 9),
    seed=st.integers(0, 2**32 - 1),
)
def test_property_linear(backend, N, T, H, D, layout, pad, base, seed):
    run_5d_case(backend, N, T, H, D, layout, "linear", pad, base, seed)


@settings(max_examples=40, deadline=None)
@given(
    backend=st.sampled_from(BACKENDS),
    N=st.integers(1, 3),
    T4=st.integers(1, 5),
    H=st.integers(1, 4),
    D=st.sampled_from([64, 128, 192, 256]),
    pad=st.integers(0, 40),
    seed=st.integers(0, 2**32 - 1),
)
def test_property_vllm(backend, N, T4, H, D, pad, seed):
    run_5d_case(backend, N, 4 * T4, H, D, "HND", "vllm", pad, 0, seed)


# ---------------------------------------------------------------------------------------------
# errors


def _np_cache(N=2, T=16, H=2, D=64, layout="HND"):
    return SP.allocate_kv_cache(SP.KVCacheSpec(T, H, D), N, layout=layout, backend="numpy")


def test_rejects_wrong_rank():
    with pytest.raises(ValueError, match="kv_cache.*3-D"):
        V.nvfp4_kv_cache_split_views(np.zeros((2, 4, 36), np.uint8))
    with pytest.raises(ValueError, match="side.*5-D"):
        V.nvfp4_split_data_scale(_np_cache())


def test_rejects_wrong_dtype():
    with pytest.raises(TypeError, match="kv_cache.*uint8"):
        V.nvfp4_kv_cache_split_views(np.zeros((2, 2, 16, 2, 36), np.int8))
    with pytest.raises(TypeError, match="side.*uint8"):
        V.nvfp4_split_data_scale(np.zeros((2, 16, 2, 36), np.float32))
    with pytest.raises(TypeError, match="kv_cache"):
        V.nvfp4_kv_cache_split_views([[1, 2]])
    if torch is not None:
        with pytest.raises(TypeError, match="uint8"):
            V.nvfp4_kv_cache_split_views(torch.zeros((2, 2, 16, 2, 72), dtype=torch.bfloat16))


@pytest.mark.skipif(torch is None, reason="needs torch")
def test_rejects_a_negated_torch_view():
    # Found by review: torch's RuntimeError from .view(float8), naming no argument.
    cache = torch.zeros((2, 2, 16, 2, 36), dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"kv_cache: a lazily negated.*resolve_neg"):
        V.nvfp4_kv_cache_split_views(torch._neg_view(cache))
    with pytest.raises(ValueError, match=r"side: a lazily negated.*resolve_neg"):
        V.nvfp4_split_data_scale(torch._neg_view(cache[:, 0]))
    assert len(V.nvfp4_split_data_scale(torch._neg_view(cache[:, 0]).resolve_neg())) == 2


def test_rejects_bad_shape():
    with pytest.raises(ValueError, match="must be 2"):
        V.nvfp4_kv_cache_split_views(np.zeros((2, 3, 16, 2, 36), np.uint8), "linear")
    with pytest.raises(ValueError, match="even"):
        V.nvfp4_kv_cache_split_views(np.zeros((2, 3, 16, 36), np.uint8), "linear")
    with pytest.raises(ValueError, match="full dim"):
        V.nvfp4_kv_cache_split_views(np.zeros((2, 2, 16, 2, 40), np.uint8), "linear")
    with pytest.raises(ValueError, match="full dim"):
        V.nvfp4_split_data_scale(np.zeros((2, 16, 2, 64), np.uint8))
    # A last dimension of 0 (strides that pass every layout check): no D, not empty views
    # (mutation testing).
    zero = np.zeros(1, np.uint8)
    with pytest.raises(ValueError, match="last dimension 0 is not an NVFP4 full dim"):
        V.nvfp4_kv_cache_split_views(np.lib.stride_tricks.as_strided(zero, (2, 2, 16, 2, 0), (0, 0, 0, 0, 1)),
                                     "linear")
    with pytest.raises(ValueError, match="last dimension 0 is not an NVFP4 full dim"):
        V.nvfp4_split_data_scale(np.lib.stride_tricks.as_strided(zero, (2, 16, 2, 0), (0, 0, 0, 1)))


def test_rejects_bad_strides():
    c = _np_cache()
    with pytest.raises(ValueError, match="stride 1"):  # bytes of a row not consecutive
        V.nvfp4_kv_cache_split_views(c[..., ::-1], "linear")
    # a side whose heads are not one contiguous run (every other byte)
    wide = np.zeros((2, 2, 16, 2, 72), np.uint8)[..., ::2]
    with pytest.raises(ValueError, match="stride"):
        V.nvfp4_kv_cache_split_views(wide, "linear")
    # T and H strides swapped with a gap: neither HND nor NHD
    gap = np.zeros((2, 2, 2, 17, 36), np.uint8)[:, :, :, :16].transpose(0, 1, 3, 2, 4)
    with pytest.raises(ValueError, match="neither HND .* nor NHD"):
        V.nvfp4_kv_cache_split_views(gap, "linear")
    with pytest.raises(ValueError, match="packed 4-D"):
        V.nvfp4_kv_cache_split_views(np.zeros((2, 16, 4, 36), np.uint8).transpose(0, 2, 1, 3))
    with pytest.raises(ValueError, match="page stride -.*at least one page"):
        V.nvfp4_kv_cache_split_views(c[::-1], "vllm")


def test_packed_head_stride_is_checked_over_both_sides():
    """Mutation testing: with H 1 the packed cache's head stride was checked over H heads, not 2H,
    so a V head lying over the K head was accepted."""
    buf = np.zeros(4096, np.uint8)
    x = np.lib.stride_tricks.as_strided(buf, (1, 2, 4, 36), (1000, 36, 36, 1))
    with pytest.raises(ValueError, match="HND strides"):
        V.nvfp4_kv_cache_split_views(x, "linear")


# What the views accept is what the store (the C ABI's side_layout / check_page_stride and its
# 5-D / packed checks) accepts: (name, which entry point, shape, strides, accepted).
_T, _H, _D = 4, 2, 64
_F = 9 * _D // 16
_SIDE = _H * _T * _F
_HND5 = (_F, _T * _F, 1)  # the (T, H, F) strides of an HND side
_AGREE = [
    ("5d canonical", "5d", (3, 2, _T, _H, _F), (2 * _SIDE, _SIDE) + _HND5, True),
    ("5d padded pages", "5d", (3, 2, _T, _H, _F), (2 * _SIDE + 7, _SIDE) + _HND5, True),
    # (2, N, ...) storage seen as (N, 2, ...): the sides are not adjacent
    ("5d sides apart", "5d", (3, 2, _T, _H, _F), (_SIDE, 3 * _SIDE) + _HND5, False),
    ("5d side gap", "5d", (3, 2, _T, _H, _F), (3 * _SIDE, _SIDE + 5) + _HND5, False),
    ("5d pages overlap", "5d", (3, 2, _T, _H, _F), (_SIDE, _SIDE) + _HND5, False),
    ("5d one page, negative stride", "5d", (1, 2, _T, _H, _F), (-9, _SIDE) + _HND5, True),
    ("packed pages overlap", "4d", (3, 2 * _H, _T, _F), (2 * _SIDE - 1, _T * _F, _F, 1), False),
    ("packed padded pages", "4d", (3, 2 * _H, _T, _F), (2 * _SIDE + 1, _T * _F, _F, 1), True),
    # mutation testing: the head stride checked over all 2H heads, and the byte stride of a packed cache
    ("packed heads overlap", "4d", (3, 2 * _H, _T, _F), (2 * _SIDE, _F, _F, 1), False),
    ("packed bytes apart", "4d", (3, 2 * _H, _T, _F), (2 * _SIDE, _T * _F, _F, 2), False),
    ("side canonical", "side", (3, _T, _H, _F), (_SIDE,) + _HND5, True),
    ("side pages overlap", "side", (3, _T, _H, _F), (_SIDE - _F,) + _HND5, False),
    ("side page stride 0", "side", (2, _T, _H, _F), (0,) + _HND5, False),
    ("side one page, stride 0", "side", (1, _T, _H, _F), (0,) + _HND5, True),
    ("side one page, negative stride", "side", (1, _T, _H, _F), (-_SIDE,) + _HND5, True),
    ("side NHD", "side", (2, _T, _H, _F), (_SIDE, _H * _F, _F, 1), True),
]


@pytest.mark.parametrize("case", _AGREE, ids=[c[0] for c in _AGREE])
def test_views_accept_what_the_store_accepts(case):
    try:
        import nvfp4kv
    except ImportError:
        pytest.skip("needs the nvfp4kv extension (the store) to compare with")
    _, kind, shape, strides, accepted = case
    # numpy: strides in bytes, negative ones allowed; a buffer large enough for every case
    buf = np.zeros(16 * _SIDE, np.uint8)
    base = 4 * _SIDE
    x = np.lib.stride_tricks.as_strided(buf[base:], shape, strides)
    key = np.ones((1, _H, _D), np.float32)
    slots = np.array([0], np.int64)

    def store():
        if kind == "side":  # the other side: a contiguous one of the same geometry and layout
            N, T, H, F = shape
            nhd = strides[2] == F
            value_cache = (np.zeros((N, T, H, F), np.uint8) if nhd
                           else np.zeros((N, H, T, F), np.uint8).transpose(0, 2, 1, 3))
            nvfp4kv.store(key, key, x, slots, value_cache=value_cache, scale_layout="linear")
        else:
            nvfp4kv.store(key, key, x, slots, scale_layout="linear")

    def views():
        if kind == "side":
            V.nvfp4_split_data_scale(x)
        else:
            V.nvfp4_kv_cache_split_views(x, "linear")

    for what, fn in (("store", store), ("views", views)):
        if accepted:
            fn()
        else:
            with pytest.raises(ValueError, match="stride"):
                fn()


def test_rejects_scale_layout():
    c = _np_cache()
    with pytest.raises(ValueError, match="scale_layout"):
        V.nvfp4_kv_cache_split_views(c, "interleaved")
    with pytest.raises(ValueError, match="scale_layout"):
        V.nvfp4_split_data_scale(c[:, 0], "vllm")
    # interleaved scales need HND, T % 4 == 0 and D % 64 == 0
    with pytest.raises(ValueError, match="scale_layout.*HND"):
        V.nvfp4_kv_cache_split_views(_np_cache(layout="NHD"), "vllm")
    with pytest.raises(ValueError, match="scale_layout.*T % 4"):
        V.nvfp4_kv_cache_split_views(_np_cache(T=6), "vllm")
    with pytest.raises(ValueError, match="scale_layout.*D % 64"):
        V.nvfp4_kv_cache_split_views(_np_cache(D=32), "vllm")
    with pytest.raises(ValueError, match="scale_layout.*T % 4"):
        V.nvfp4_split_data_scale(_np_cache(T=6)[:, 1], "interleaved")
    # and the same caches are fine with linear scales
    V.nvfp4_kv_cache_split_views(_np_cache(layout="NHD"), "linear")
    V.nvfp4_kv_cache_split_views(_np_cache(T=6), "linear")


@pytest.mark.parametrize("cut", ["T", "H"])
def test_empty_sides_are_named_as_such(cut):
    """Found by review: a 5-D cache with T or H 0 got a message about its strides."""
    kv = SP.allocate_kv_cache(SP.KVCacheSpec(16, 8, 128), 2, backend="numpy")
    empty = kv[:, :, :0] if cut == "T" else kv[:, :, :, :0]
    with pytest.raises(ValueError, match="must be positive"):
        V.nvfp4_kv_cache_split_views(empty, "linear")



def test_numpy_calls_while_another_thread_imports_torch(monkeypatch):
    """While one thread runs `import torch`, sys.modules holds the partly loaded module, without
    `Tensor`: calls on numpy arrays in other threads must not touch it (review: they raised
    AttributeError instead of succeeding, or in place of the library's ValueError)."""
    import importlib.machinery
    import sys
    import types

    import nvfp4kv

    partial = types.ModuleType("torch")
    partial.__spec__ = importlib.machinery.ModuleSpec("torch", None)
    partial.__spec__._initializing = True  # what the import system sets until the module is loaded
    monkeypatch.setitem(sys.modules, "torch", partial)
    kv = np.zeros((8, 2, 16, 2, 36), np.uint8)  # a 5-D NHD cache
    k = np.zeros((128, 2, 64), np.float32)
    nvfp4kv.store(k, k, kv, np.arange(128), 0.01, 0.01, scale_layout="linear", kv_layout="NHD")
    nvfp4kv.nvfp4_split_data_scale(kv[:, 0])
    with pytest.raises(ValueError, match="k_scale"):
        nvfp4kv.store(k, k, kv, np.arange(128), -1.0, 0.01, scale_layout="linear")
