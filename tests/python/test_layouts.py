"""Every view of one HND cache reads and writes the same bytes, with H != T and H == T.

One allocation holds an HND cache, [N][K data | K scale | V data | V scale]; vLLM keeps it packed
as (N, 2H, T, F) and hands out its sides in two orientations: (N, T, H, F) to the store
(kv_cache.transpose(1, 2).split(H, dim=2)) and (N, H, T, F) to attention
(kv_cache.split(H, dim=1)). The oracle is the packed cache itself (held to the NumPy reference
in test_store_cpu.py); every other view must give the same bytes or a clear error. Where H == T
an (N, H, T, F) half has the strides of an NHD (N, T, H, F) side, so only its origin (a torch
view of the packed cache) tells them apart: torch halves work in both orientations, whatever H
and T; a numpy or C caller's (N, H, T, F) halves are named by the C ABI where H != T and a head
count is given (the store's key, or outputs the caller passes to the reads); outputs allocated
from the cache's shape and decode_attention read them transposed (docs/integration.md §1).
With kv_layout (the memory order) the strides decide, whatever the origin: the last tests.
"""

import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import nvfp4kv as nv  # noqa: E402

D = 64
F = nv.nvfp4_kv_cache_full_dim(D)


def packed(N, H, T, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (N, 2 * H, T, F), generator=g, dtype=torch.uint8)


def views(kv, H, T):
    """name -> (kv_cache, value_cache) over the bytes of the packed HND cache `kv`."""
    N = kv.shape[0]
    five = kv.view(N, 2, H, T, F).permute(0, 1, 3, 2, 4)  # (N, 2, T, H, F), HND strides
    store_k, store_v = kv.transpose(1, 2).split(H, dim=2)   # (N, T, H, F) halves, as vLLM's store
    return {
        "packed": (kv, None),
        "5d": (five, None),
        "5d sides": (five[:, 0], five[:, 1]),
        "store halves (N,T,H,F)": (store_k, store_v),
        "split halves (N,H,T,F)": tuple(kv.split(H, dim=1)),
    }


def inputs(n, H, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, H, D, generator=g).to(torch.bfloat16),
            torch.randn(n, H, D, generator=g).to(torch.bfloat16))


GEOMETRIES = [(3, 4, 16), (3, 16, 16), (2, 8, 8), (2, 16, 4)]  # N, H, T


def stored_in_packed(N, H, T, scale_layout):
    """N*T - 3 tokens stored into random slots of packed(N, H, T, seed=5): the oracle the views'
    stores are compared with."""
    n = N * T - 3
    key, value = inputs(n, H, seed=N * H * T)
    slots = torch.randperm(N * T, generator=torch.Generator().manual_seed(1))[:n]
    want = packed(N, H, T, seed=5)
    nv.store(key, value, want, slots, 0.04, 0.06, scale_layout=scale_layout)
    return n, key, value, slots, want


@pytest.mark.parametrize("N,H,T", GEOMETRIES, ids=lambda v: str(v))
@pytest.mark.parametrize("scale_layout", ["vllm", "linear"])
@pytest.mark.parametrize("name", ["5d", "5d sides", "store halves (N,T,H,F)", "split halves (N,H,T,F)"])
def test_store_through_every_view(N, H, T, scale_layout, name):
    n, key, value, slots, want = stored_in_packed(N, H, T, scale_layout)
    got = packed(N, H, T, seed=5)
    kv_cache, value_cache = views(got, H, T)[name]
    nv.store(key, value, kv_cache, slots, 0.04, 0.06, value_cache=value_cache, scale_layout=scale_layout)
    assert torch.equal(got, want)


@pytest.mark.parametrize("N,H,T", GEOMETRIES, ids=lambda v: str(v))
@pytest.mark.parametrize("name", ["5d", "5d sides", "store halves (N,T,H,F)", "split halves (N,H,T,F)"])
def test_dequantize_and_gather_through_every_view(N, H, T, name):
    kv = packed(N, H, T, seed=7)
    kv_cache, value_cache = views(kv, H, T)[name]
    want_k, want_v = nv.dequantize(kv, 0.04, 0.06, scale_layout="linear")
    bt = torch.arange(N, dtype=torch.int32).flip(0).reshape(1, N)
    want_gk, want_gv, _ = nv.gather_dequant(kv, bt, torch.tensor([N * T - 1]), 0.04, 0.06, scale_layout="linear")
    k, v = nv.dequantize(kv_cache, 0.04, 0.06, value_cache=value_cache, scale_layout="linear")
    assert torch.equal(k.view(torch.int32), want_k.view(torch.int32))  # bits: -0 and NaN payloads too
    assert torch.equal(v.view(torch.int32), want_v.view(torch.int32))
    gk, gv, _ = nv.gather_dequant(kv_cache, bt, torch.tensor([N * T - 1]), 0.04, 0.06, value_cache=value_cache,
                                  scale_layout="linear")
    assert torch.equal(gk.view(torch.int16), want_gk.view(torch.int16))
    assert torch.equal(gv.view(torch.int16), want_gv.view(torch.int16))


def test_numpy_halves_with_heads_and_positions_swapped_are_named():
    """A C or numpy caller's (N, H, T, F) halves (H != T): the C ABI compares them with the heads
    of key and names the orientation, writing nothing."""
    N, H, T = 2, 4, 16
    kv = packed(N, H, T, seed=9).numpy()
    k, v = np.split(kv, 2, axis=1)
    key = np.random.default_rng(0).standard_normal((3, H, D)).astype(np.float32)
    before = kv.copy()
    with pytest.raises(ValueError, match=r"key_cache: shape \(2, 4, 16, 36\) has a KV head count of 16 \(dimension 2\), but key has 4 heads"):
        nv.store(key, key, k, np.arange(3), 0.1, 0.1, value_cache=v, scale_layout="linear")
    assert np.array_equal(kv, before)


def filled(N, H, T, scale_layout):
    """A packed cache holding stored keys and values (random bytes would hold NaN scales)."""
    kv = torch.zeros(N, 2 * H, T, F, dtype=torch.uint8)
    key, value = inputs(N * T, H, seed=N * H * T + 1)
    nv.store(key, value, kv, torch.arange(N * T), 0.04, 0.06, scale_layout=scale_layout)
    return kv


def decode_inputs(N, H, T):
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 2 * H, D, generator=g).to(torch.bfloat16)  # q_len 2, GQA group 2
    return q, torch.arange(N, dtype=torch.int32).flip(0).reshape(1, N), torch.tensor([N * T - 1])


# (2, 4, 8): split halves read as sides would be H 8, T 4, whose GQA group 1 the call accepts.
@pytest.mark.parametrize("N,H,T", GEOMETRIES + [(2, 4, 8)], ids=lambda v: str(v))
@pytest.mark.parametrize("scale_layout", ["vllm", "linear"])
@pytest.mark.parametrize("name", ["5d", "5d sides", "store halves (N,T,H,F)", "split halves (N,H,T,F)"])
def test_decode_through_every_view(N, H, T, scale_layout, name):
    """decode_attention has no head count to check sides against (the query holds group x H
    heads): split halves with H != T were read as sides with H and T exchanged under "linear"."""
    kv = filled(N, H, T, scale_layout)
    q, bt, sl = decode_inputs(N, H, T)
    want = nv.decode_attention(q, kv, bt, sl, 0.04, 0.06, scale_layout=scale_layout, q_len=2)
    kv_cache, value_cache = views(kv, H, T)[name]
    got = nv.decode_attention(q, kv_cache, bt, sl, 0.04, 0.06, value_cache=value_cache, scale_layout=scale_layout,
                              q_len=2)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("backend", ["eager", "inductor"])
@pytest.mark.parametrize("scale_layout", ["vllm", "linear"])
def test_decode_op_reads_split_halves(scale_layout, backend):
    """The torch op (what torch.compile calls) reads split halves as eager does, on inductor too,
    whose views of the packed cache reach the op without their _base."""
    N, H, T = 2, 16, 4
    kv = filled(N, H, T, scale_layout)
    q, bt, sl = decode_inputs(N, H, T)
    want = nv.decode_attention(q, kv, bt, sl, 0.04, 0.06, scale_layout=scale_layout, q_len=2)

    def f(q, kv):
        k, v = kv.split(H, dim=1)
        return nv.decode_attention(q, k, bt, sl, 0.04, 0.06, value_cache=v, scale_layout=scale_layout, q_len=2)

    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend=backend)(q, kv)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("N,H,T", GEOMETRIES, ids=lambda v: str(v))
@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_torch_ops_take_split_halves(N, H, T, backend):
    """torch.compile runs the torch ops: split halves work there as in the eager calls (oriented
    while tracing, since inductor's views reach the ops without their _base)."""
    n = N * T - 3
    key, value = inputs(n, H, seed=N * H * T)
    slots = torch.randperm(N * T, generator=torch.Generator().manual_seed(1))[:n]
    bt = torch.arange(N, dtype=torch.int32).flip(0).reshape(1, N)
    sl, cu = torch.tensor([N * T - 1]), torch.tensor([0, N * T - 1], dtype=torch.int32)

    def run(kv, halves):
        k, v = kv.split(H, dim=1) if halves else (kv, None)
        nv.store(key, value, k, slots, 0.04, 0.06, value_cache=v, scale_layout="linear")
        kd, vd = nv.dequantize(k, 0.04, 0.06, value_cache=v, scale_layout="linear", dtype=torch.bfloat16,
                               key_out=torch.empty(N, T, H, D, dtype=torch.bfloat16),
                               value_out=torch.empty(N, T, H, D, dtype=torch.bfloat16))
        kg, vg = torch.empty(N * T - 1, H, D, dtype=torch.bfloat16), torch.empty(N * T - 1, H, D, dtype=torch.bfloat16)
        nv.gather_dequant(k, bt, sl, 0.04, 0.06, value_cache=v, scale_layout="linear", cu_seqlens=cu, key_out=kg,
                          value_out=vg)
        return kd, vd, kg, vg

    want_kv = packed(N, H, T, seed=5)
    want = run(want_kv, False)
    got_kv = packed(N, H, T, seed=5)
    torch._dynamo.reset()
    got = torch.compile(lambda kv: run(kv, True), fullgraph=True, backend=backend)(got_kv)
    assert torch.equal(got_kv, want_kv)
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(got, want))


@pytest.mark.parametrize("N,H,T", GEOMETRIES, ids=lambda v: str(v))
def test_prepare_store_takes_split_halves(N, H, T):
    """prepare_store imports the sides once, before any key shows the head count: halves with
    H != T are oriented at the first call, and stay so."""
    want = packed(N, H, T, seed=5)
    got = packed(N, H, T, seed=5)
    k, v = got.split(H, dim=1)
    store = nv.prepare_store(k, 0.04, 0.06, value_cache=v, scale_layout="linear")
    prepared_steps(store, got, want, H, T)


def prepared_steps(store, got, want, H, T):
    """Two steps of T tokens through the prepared store, each equal to a store into `want`."""
    for step in range(2):
        key, value = inputs(T, H, seed=step)
        slots = torch.arange(step * T, (step + 1) * T)
        nv.store(key, value, want, slots, 0.04, 0.06, scale_layout="linear")
        store(key, value, slots)
        assert torch.equal(got, want)


@pytest.mark.parametrize("prepared", [False, True])
def test_split_halves_check_the_key_against_their_own_heads(prepared):
    """Halves with H != T read as NHD sides would take a key of T heads; oriented at every shape,
    the C ABI refuses it and nothing is written (before, the store wrote it where the cache's
    readers look for other tokens)."""
    N, H, T = 2, 4, 16
    kv = packed(N, H, T, seed=5)
    before = kv.clone()
    k, v = kv.split(H, dim=1)
    key, value = inputs(3, T, seed=1)  # T heads, not H
    with pytest.raises(ValueError, match="key"):
        if prepared:
            nv.prepare_store(k, 0.04, 0.06, value_cache=v, scale_layout="linear")(key, value, torch.arange(3))
        else:
            nv.store(key, value, k, torch.arange(3), 0.04, 0.06, value_cache=v, scale_layout="linear")
    assert torch.equal(kv, before)


def test_halves_of_a_packed_view_are_not_recognised_and_vllm_scales_refuse_them():
    """The documented limit: vLLM views its packed cache over a raw int8 buffer, so the halves'
    _base is that buffer and nothing tells them from NHD sides with H and T exchanged; the
    default "vllm" scale layout (interleaved V scales, HND only) then refuses every call, and
    nothing is written."""
    N, H, T = 2, 4, 16
    raw = torch.zeros(N * 2 * H * T * F, dtype=torch.int8)
    kv = raw.view(torch.uint8).view(N, 2 * H, T, F)
    k, v = kv.split(H, dim=1)
    key, value = inputs(5, H, seed=1)
    q = torch.randn(1, 2 * H, D).to(torch.bfloat16)
    calls = [
        lambda: nv.store(key, value, k, torch.arange(5), 0.04, 0.06, value_cache=v),
        lambda: nv.dequantize(k, 0.04, 0.06, value_cache=v),
        lambda: nv.decode_attention(q, k, torch.tensor([[0, 1]]), torch.tensor([20]), 0.04, 0.06, value_cache=v),
    ]
    hint = r"kv_layout='HND'"
    for call in calls:
        with pytest.raises(ValueError, match=r"NHD|split\(H, dim=1\)") as e:  # the store's heads check comes first
            call()
        assert re.search(hint, str(e.value))  # the refusal says how to name such halves
    # Without the V scales' profile to refuse them, decode reads them as (N, T, H, F) sides of T
    # heads, which the query's heads do not divide: the refusal names kv_layout too.
    q6 = torch.randn(1, 6, D).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"query heads.*" + hint):
        nv.decode_attention(q6, k, torch.tensor([[0, 1]]), torch.tensor([20]), 0.04, 0.06, value_cache=v,
                            scale_layout="linear")
    with pytest.raises(ValueError, match=r"NHD.*" + hint):
        nv.gather_dequant(k, torch.tensor([[0, 1]]), torch.tensor([20]), 0.04, 0.06, value_cache=v)
    with pytest.raises(ValueError, match=r"transpose\(1, 2\)"):  # the C ABI's own advice, at the call
        nv.prepare_store(k, 0.04, 0.06, value_cache=v)(key, value, torch.arange(5))
    assert not raw.any()
    # Named, they work; refusals that are not about the sides' reading carry no hint.
    nv.store(key, value, k, torch.arange(5), 0.04, 0.06, value_cache=v, kv_layout="HND")
    assert raw.any()
    with pytest.raises(ValueError) as e:
        nv.decode_attention(q, k, torch.tensor([[0, 1]]), torch.tensor([20]), -1.0, 0.06, value_cache=v,
                            kv_layout="HND")
    assert "kv_layout" not in str(e.value)
    with pytest.raises(ValueError) as e:
        nv.decode_attention(q, kv, torch.tensor([[0, 1]]), torch.tensor([20]), 0.04, 0.06, q_len=9)
    assert "kv_layout" not in str(e.value)


def test_sides_whose_origin_cannot_tell_are_warned_about_where_the_heads_cannot_either():
    """vLLM's halves of its packed cache viewed over a raw buffer, (N, H, T, F) bytes that are
    also NHD sides with H and T exchanged: decode with a query whose head count both readings
    take read them transposed, silently (an integrator's review: relative error 1.45). Now a
    UserWarning names kv_layout; with it the result is right. No warning where the call's head
    count tells (the store's key where H != T, a query only one reading divides), where the
    sides' origin tells (the library's own 5-D cache), or with kv_layout."""
    import warnings

    N, H, T, Hq = 2, 4, 16, 16  # 16 query heads: a group of 4 over H, of 1 over T
    raw = torch.zeros(N * 2 * H * T * F, dtype=torch.int8)
    kv = raw.view(torch.uint8).view(N, 2 * H, T, F)  # vLLM: a view of a raw buffer
    key, value = inputs(20, H, seed=3)
    nv.store(key, value, kv, torch.arange(20), 0.04, 0.06, scale_layout="linear")
    k, v = kv.split(H, dim=1)
    q = torch.randn(1, Hq, D).to(torch.bfloat16)
    args = (torch.tensor([[0, 1]]), torch.tensor([20]), 0.04, 0.06)
    want = nv.decode_attention(q, kv, *args, scale_layout="linear")
    with pytest.warns(UserWarning, match=r"key_cache, value_cache: .*split\(4, dim=1\).*kv_layout='NHD' or 'HND'"):
        nv.decode_attention(q, k, *args, value_cache=v, scale_layout="linear")
    with pytest.warns(UserWarning, match="kv_layout"):
        nv.dequantize(k, 0.04, 0.06, value_cache=v, scale_layout="linear")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = nv.decode_attention(q, k, *args, value_cache=v, scale_layout="linear", kv_layout="HND")
        assert torch.equal(got, want)
        # A query of 8 heads: a multiple of H (4), not of T (16); the C ABI reads T heads and refuses.
        with pytest.raises(ValueError, match="query heads"):
            nv.decode_attention(q[:, :8], k, *args, value_cache=v, scale_layout="linear")
        # The store's key has H heads, not T: the heads check refuses, nothing to warn about.
        with pytest.raises(ValueError):
            nv.store(key, value, k, torch.arange(20), 0.04, 0.06, value_cache=v, scale_layout="linear")
        # The library's own NHD cache: its sides' origin is the 5-D cache.
        own = nv.allocate_kv_cache(nv.KVCacheSpec(block_size=T, num_kv_heads=H, head_size=D), N, layout="NHD")
        nv.store(key, value, own, torch.arange(20), 0.04, 0.06, scale_layout="linear")
        ko, vo = own.unbind(1)
        nv.decode_attention(q, ko, *args, value_cache=vo, scale_layout="linear")
        nv.dequantize(ko, 0.04, 0.06, value_cache=vo, scale_layout="linear")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # The default "vllm" scales are HND only: the C ABI refuses the NHD reading, no warning first.
        with pytest.raises(ValueError, match="HND"):
            nv.decode_attention(q, k, *args, value_cache=v)
        # One head and one-token pages: both readings are one geometry.
        k1, v1 = torch.zeros(N * 2 * F, dtype=torch.int8).view(torch.uint8).view(N, 2, 1, F).split(1, dim=1)
        nv.dequantize(k1, 0.04, 0.06, value_cache=v1, scale_layout="linear")
    # Where H == T the store's key fits both readings too.
    raw2 = torch.zeros(N * 2 * T * T * F, dtype=torch.int8)
    k2, v2 = raw2.view(torch.uint8).view(N, 2 * T, T, F).split(T, dim=1)
    key2, value2 = inputs(3, T, seed=4)
    with pytest.warns(UserWarning, match="kv_layout"):
        nv.store(key2, value2, k2, torch.arange(3), 0.04, 0.06, value_cache=v2, scale_layout="linear")


# ---- kv_layout: the caller names the memory order ----------------------------------------------
def packed_view(N, H, T, seed):
    """A packed cache that is itself a view, as vLLM allocates it (of a raw int8 buffer): its
    halves' _base is the buffer, so only kv_layout tells them from NHD sides."""
    raw = packed(N, H, T, seed).view(torch.int8).flatten()
    return raw.view(torch.uint8).view(N, 2 * H, T, F)


def named_views(kv, H, T):
    """views() with the halves of a packed view added (each over kv's own bytes)."""
    out = views(kv, H, T)
    over_raw = kv.view(torch.int8).flatten().view(torch.uint8).view(kv.shape)
    out["halves of a packed view"] = tuple(over_raw.split(H, dim=1))
    return out


# (3, 1, 16): one KV head (8 heads at tensor parallelism 8); the size-1 dimension counts by its stride.
@pytest.mark.parametrize("N,H,T", GEOMETRIES + [(3, 1, 16), (3, 1, 4)], ids=lambda v: str(v))
@pytest.mark.parametrize("scale_layout", ["vllm", "linear"])
@pytest.mark.parametrize("name", ["packed", "5d", "5d sides", "store halves (N,T,H,F)", "split halves (N,H,T,F)",
                                  "halves of a packed view"])
def test_kv_layout_hnd_reads_every_view_by_its_strides(N, H, T, scale_layout, name):
    """With kv_layout="HND" every view of an HND cache, in either dimension order, stores,
    dequantizes, gathers and decodes the packed cache's bytes, the halves of a packed view too
    (which without it are read as NHD sides: the last test above)."""
    n, key, value, slots, want = stored_in_packed(N, H, T, scale_layout)
    got = packed(N, H, T, seed=5)
    kv_cache, value_cache = named_views(got, H, T)[name]
    kw = dict(value_cache=value_cache, scale_layout=scale_layout, kv_layout="HND")
    nv.store(key, value, kv_cache, slots, 0.04, 0.06, **kw)
    if name == "halves of a packed view":
        assert not torch.equal(got, packed(N, H, T, seed=5)), "the halves write the view's bytes"
        got = kv_cache._base.view(torch.uint8).view(want.shape)
    assert torch.equal(got, want)
    want_k, want_v = nv.dequantize(want, 0.04, 0.06, scale_layout=scale_layout)
    k, v = nv.dequantize(kv_cache, 0.04, 0.06, **kw)
    assert torch.equal(k.view(torch.int32), want_k.view(torch.int32))  # bits: -0 and NaN payloads too
    assert torch.equal(v.view(torch.int32), want_v.view(torch.int32))
    bt, sl = torch.arange(N, dtype=torch.int32).flip(0).reshape(1, N), torch.tensor([N * T - 1])
    want_g = nv.gather_dequant(want, bt, sl, 0.04, 0.06, scale_layout=scale_layout)
    got_g = nv.gather_dequant(kv_cache, bt, sl, 0.04, 0.06, **kw)
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(got_g[:2], want_g[:2]))
    q, bt, sl = decode_inputs(N, H, T)
    sl = torch.tensor([n])  # the stored tokens only (the rest of the pages is random bytes)
    want_o = nv.decode_attention(q, want, bt, sl, 0.04, 0.06, scale_layout=scale_layout, q_len=2)
    ws = nv.decode_workspace(kv_cache, q, bt, q_len=2, value_cache=value_cache, kv_layout="HND")
    got_o = nv.decode_attention(q, kv_cache, bt, sl, 0.04, 0.06, q_len=2, workspace=ws, **kw)
    assert torch.equal(got_o.view(torch.int16), want_o.view(torch.int16))


@pytest.mark.parametrize("N,H,T", GEOMETRIES + [(3, 1, 16)], ids=lambda v: str(v))
@pytest.mark.parametrize("order", ["(N,T,H,F)", "(N,H,T,F)"])
def test_kv_layout_nhd_reads_nhd_sides_in_either_order(N, H, T, order):
    """An NHD cache (N, 2, T, H, F): its sides, or the same sides with dimensions 1 and 2
    exchanged, read as the 5-D cache with kv_layout="NHD" (one head exchanged has equal strides:
    test_kv_layout_where_the_strides_cannot_tell)."""
    if H == 1 and order == "(N,H,T,F)":
        pytest.skip("equal strides in dimensions 1 and 2: the strides cannot tell")
    g = torch.Generator().manual_seed(N * H * T)
    nhd = torch.zeros(N, 2, T, H, F, dtype=torch.uint8)
    key, value = inputs(N * T, H, seed=3)
    nv.store(key, value, nhd, torch.arange(N * T), 0.04, 0.06, scale_layout="linear")
    want_k, want_v = nv.dequantize(nhd, 0.04, 0.06, scale_layout="linear", kv_layout="NHD")
    k, v = nhd[:, 0], nhd[:, 1]
    if order == "(N,H,T,F)":
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    got_k, got_v = nv.dequantize(k, 0.04, 0.06, value_cache=v, scale_layout="linear", kv_layout="NHD")
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    fresh = torch.zeros_like(nhd)
    k, v = fresh[:, 0], fresh[:, 1]
    if order == "(N,H,T,F)":
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    slots = torch.randperm(N * T, generator=g)
    nv.store(key, value, k, slots, 0.04, 0.06, value_cache=v, scale_layout="linear", kv_layout="NHD")
    again = torch.zeros_like(nhd)
    nv.store(key, value, again, slots, 0.04, 0.06, scale_layout="linear")
    assert torch.equal(fresh, again)


def test_kv_layout_hnd_takes_numpy_halves():
    """A numpy (or C) caller's (N, H, T, F) halves: with kv_layout="HND" they store and read as
    the packed cache (without it, the C ABI names them: the numpy test above)."""
    N, H, T = 2, 4, 16
    kv = packed(N, H, T, seed=9).numpy()
    want = kv.copy()
    k, v = np.split(kv, 2, axis=1)
    rng = np.random.default_rng(0)
    key, value = rng.standard_normal((5, H, D)).astype(np.float32), rng.standard_normal((5, H, D)).astype(np.float32)
    nv.store(key, value, k, np.arange(5), 0.1, 0.1, value_cache=v, scale_layout="linear", kv_layout="HND")
    nv.store(key, value, want, np.arange(5), 0.1, 0.1, scale_layout="linear")
    assert np.array_equal(kv, want)
    got = nv.dequantize(k, 0.1, 0.1, value_cache=v, scale_layout="linear", kv_layout="HND")
    ref = nv.dequantize(want, 0.1, 0.1, scale_layout="linear")
    assert all(np.array_equal(a, b, equal_nan=True) for a, b in zip(got, ref))
    q = rng.standard_normal((1, 2 * H, D)).astype(np.float16)
    bt, sl = np.array([[1, 0]], dtype=np.int32), np.array([5], dtype=np.int32)
    got = nv.decode_attention(q, k, bt, sl, 0.1, 0.1, value_cache=v, scale_layout="linear", kv_layout="HND")
    ref = nv.decode_attention(q, want, bt, sl, 0.1, 0.1, scale_layout="linear")
    assert np.array_equal(got, ref)


@pytest.mark.parametrize("kv_layout", [None, "HND"])
def test_permuted_sides_of_one_token_pages_are_not_halves(kv_layout):
    """Sides allocated apart as (N, H, 1, F) and permuted to the side form (N, 1, H, F): with H 2
    their base's dimension 1 is twice theirs and its strides are theirs (both inner strides F),
    as for the halves of a packed cache, but its shape is not a half's. They are read as given,
    as numpy views of the same bytes are (they were read with heads and tokens exchanged)."""
    N, H, T = 6, 2, 1
    sides = [torch.zeros(N, H, T, F, dtype=torch.uint8).permute(0, 2, 1, 3) for _ in range(2)]
    assert sides[0]._base.shape[1] == 2 * sides[0].shape[1] and sides[0]._base.stride() == sides[0].stride()
    arrays = [x.numpy() for x in sides]  # the same bytes, without an origin
    rng = np.random.default_rng(3)
    key, value = rng.standard_normal((2, N, H, D)).astype(np.float32)
    want = [np.zeros_like(a) for a in arrays]
    nv.store(key, value, want[0], np.arange(N), 0.05, 0.05, value_cache=want[1], scale_layout="linear")
    nv.store(torch.from_numpy(key), torch.from_numpy(value), sides[0], torch.arange(N), 0.05, 0.05,
             value_cache=sides[1], scale_layout="linear", kv_layout=kv_layout)
    assert all(np.array_equal(a, w) for a, w in zip(arrays, want))
    q = rng.standard_normal((1, 2 * H, D)).astype(np.float16)
    bt, sl = np.arange(N, dtype=np.int32)[None], np.array([N], dtype=np.int32)
    ref = nv.decode_attention(q, want[0], bt, sl, 0.05, 0.05, value_cache=want[1], scale_layout="linear")
    got = nv.decode_attention(torch.from_numpy(q), sides[0], torch.from_numpy(bt), torch.from_numpy(sl), 0.05, 0.05,
                              value_cache=sides[1], scale_layout="linear", kv_layout=kv_layout)
    assert np.array_equal(got.numpy(), ref)
    got = nv.dequantize(sides[0], 0.05, 0.05, value_cache=sides[1], scale_layout="linear", kv_layout=kv_layout)
    assert all(tuple(g.shape) == (N, T, H, D) for g in got)


def test_kv_layout_contradictions_are_named_and_write_nothing():
    N, H, T = 2, 4, 16
    kv = packed(N, H, T, seed=11)
    before = kv.clone()
    key, value = inputs(3, H, seed=1)
    five = kv.view(N, 2, H, T, F).permute(0, 1, 3, 2, 4)  # HND strides
    k, v = kv.split(H, dim=1)
    cases = [
        (dict(kv_cache=kv, kv_layout="hnd"), "kv_layout: unknown value 'hnd'"),
        (dict(kv_cache=kv, kv_layout="NHD"), r"packed \(N, 2H, T, F\) cache .* the packed form is HND"),
        (dict(kv_cache=five, kv_layout="NHD"), r"is HND, but kv_layout 'NHD'"),
        (dict(kv_cache=k, value_cache=v, kv_layout="NHD"), r"halves of a packed .* but kv_layout 'NHD'"),
        (dict(kv_cache=k, value_cache=v.transpose(1, 2), kv_layout="HND"), "heads in different dimensions"),
    ]
    for kw, match in cases:
        kw = dict(kw)
        cache = kw.pop("kv_cache")
        with pytest.raises(ValueError, match=match):
            nv.store(key, value, cache, torch.arange(3), 0.04, 0.06, scale_layout="linear", **kw)
        with pytest.raises(ValueError, match=match):
            nv.prepare_store(cache, 0.04, 0.06, scale_layout="linear", **kw)
        with pytest.raises(ValueError, match=match):
            nv.decode_attention(torch.randn(1, H, D).to(torch.bfloat16), cache, torch.tensor([[0]]),
                                torch.tensor([3]), scale_layout="linear", **kw)
    assert torch.equal(kv, before)


def test_prepare_store_takes_kv_layout():
    N, H, T = 3, 16, 16  # H == T: only kv_layout tells the halves of a packed view apart
    want = packed(N, H, T, seed=5)
    view = packed_view(N, H, T, seed=5)
    k, v = view.split(H, dim=1)
    store = nv.prepare_store(k, 0.04, 0.06, value_cache=v, scale_layout="linear", kv_layout="HND")
    prepared_steps(store, view, want, H, T)


@pytest.mark.parametrize("backend,dynamic", [("eager", False), ("aot_eager", False), ("inductor", False),
                                             ("eager", True)])
def test_kv_layout_under_torch_compile(backend, dynamic):
    """The traced API orients by kv_layout as eager does: halves of a packed view (H == T),
    stored and decoded in one compiled function. Under dynamic=True the V half made in the graph
    lies at an offset computed from dynamic sizes, which inductor would hand the op at offset 0
    (pytorch#198068): refused on every backend (the ops' fake implementation cannot tell them)."""
    N, H, T = 2, 16, 16
    n = N * T - 3
    key, value = inputs(n, H, seed=4)
    slots = torch.randperm(N * T, generator=torch.Generator().manual_seed(2))[:n]
    want = packed(N, H, T, seed=5)
    nv.store(key, value, want, slots, 0.04, 0.06, scale_layout="linear")
    q, bt, sl = decode_inputs(N, H, T)
    sl = torch.tensor([n])
    want_o = nv.decode_attention(q, want, bt, sl, 0.04, 0.06, scale_layout="linear", q_len=2)

    def f(kv):
        k, v = kv.split(H, dim=1)
        nv.store(key, value, k, slots, 0.04, 0.06, value_cache=v, scale_layout="linear", kv_layout="HND")
        return nv.decode_attention(q, k, bt, sl, 0.04, 0.06, value_cache=v, scale_layout="linear", kv_layout="HND",
                                   q_len=2)

    view = packed_view(N, H, T, seed=5)
    torch._dynamo.reset()
    if dynamic:
        with pytest.raises(Exception, match="value_cache is a view at storage offset .* depends on a dynamic size"):
            torch.compile(f, fullgraph=True, backend=backend, dynamic=dynamic)(view)
        return
    got_o = torch.compile(f, fullgraph=True, backend=backend, dynamic=dynamic)(view)
    assert torch.equal(view, want)
    assert torch.equal(got_o.view(torch.int16), want_o.view(torch.int16))


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_kv_layout_tells_graph_inputs_apart_under_torch_compile(backend):
    """Halves passed into a compiled function, and NHD sides with H and T exchanged, have the same
    shapes and strides, so one graph serves both unless kv_layout tells them apart (the guards do
    not look at _base: integration guide §1). Named, each is stored as eagerly, in either order."""
    N, H, T = 2, 4, 8  # halves (N, 4, 8, F) and NHD sides of T 4, H 8: the same shapes and strides
    n = 5
    slots = torch.tensor([3, 12, 0, 9, 7])

    def f(k, v, key, value, layout):
        nv.store(key, value, k, slots, 0.04, 0.06, value_cache=v, scale_layout="linear", kv_layout=layout)

    def cases():
        halves = packed(N, H, T, seed=5)
        sides = packed(N, H, T, seed=5).view(N, 2, H, T, F).clone()  # NHD, T' = H tokens, H' = T heads
        return [(halves, tuple(halves.split(H, dim=1)), inputs(n, H, seed=1), "HND"),
                (sides, tuple(sides.unbind(1)), inputs(n, T, seed=2), "NHD")]

    for order in (0, 1), (1, 0):
        torch._dynamo.reset()
        compiled = torch.compile(f, fullgraph=True, backend=backend)
        got, want = cases(), cases()
        assert got[0][1][0].shape == got[1][1][0].shape and got[0][1][0].stride() == got[1][1][0].stride()
        for i in order:
            root, (k, v), (key, value), layout = got[i]
            compiled(k, v, key, value, layout)
            root_w, (k_w, v_w), _, _ = want[i]
            f(k_w, v_w, key, value, layout)
            assert torch.equal(root, root_w), (order, layout)


def test_workspaces_follow_kv_layout():
    """The workspaces are sized by the geometry that kv_layout gives the halves of a packed view
    (T 16 and H 4, not T 4 and H 16 as without it)."""
    N, H, T = 3, 4, 16
    k, v = packed_view(N, H, T, seed=1).split(H, dim=1)
    assert nv.store_workspace(k, v, kv_layout="HND").numel() == nv.store_workspace_bytes(N, T)
    assert nv.store_workspace(k, v).numel() == nv.store_workspace_bytes(N, H)
    q, bt = torch.randn(2, 2 * H, D).to(torch.bfloat16), torch.zeros(2, 4000, dtype=torch.int32)
    got = nv.decode_workspace(k, q, bt, value_cache=v, kv_layout="HND").numel()
    assert got == nv.decode_workspace_bytes(2, 1, 2 * H, H, D, 4000)


def test_kv_layout_in_a_graph_traced_with_fake_tensors():
    """make_fx with fake tensors: the calls go to the torch ops (no data to read), which take the
    sides as kv_layout orients them."""
    from torch.fx.experimental.proxy_tensor import make_fx

    N, H, T = 2, 16, 16
    key, value = inputs(5, H, seed=2)
    want = packed(N, H, T, seed=0).zero_()
    nv.store(key, value, want, torch.arange(5), 0.04, 0.06, scale_layout="linear")

    def f(raw, key, value, slots):
        k, v = raw.view(N, 2 * H, T, F).split(H, dim=1)
        nv.store(key, value, k, slots, 0.04, 0.06, value_cache=v, scale_layout="linear", kv_layout="HND")
        return raw

    raw = torch.zeros(want.numel(), dtype=torch.uint8)
    gm = make_fx(f, tracing_mode="fake")(raw.clone(), key, value, torch.arange(5))
    gm(raw, key, value, torch.arange(5))
    assert torch.equal(raw.view(want.shape), want)


def test_kv_layout_where_the_strides_cannot_tell():
    """Equal strides in dimensions 1 and 2: NHD sides of one head (N, T, 1, F), and the halves of
    a packed cache of one-token pages (N, H, 1, F). The library's own rule decides, as without
    kv_layout: sides as (N, T, H, F), torch halves by their origin; the halves of a packed view
    are then taken as sides with H and T exchanged, which the store's heads check refuses."""
    N, H = 3, 4
    nhd = torch.zeros(N, 2, 16, 1, F, dtype=torch.uint8)
    key, value = inputs(5, 1, seed=1)
    nv.store(key, value, nhd[:, 0], torch.arange(5), 0.04, 0.06, value_cache=nhd[:, 1], scale_layout="linear",
             kv_layout="NHD")
    want = torch.zeros_like(nhd)
    nv.store(key, value, want, torch.arange(5), 0.04, 0.06, scale_layout="linear")
    assert torch.equal(nhd, want)
    key, value = inputs(5, H, seed=2)
    want = packed(N, H, 1, seed=3)
    got = want.clone()
    nv.store(key, value, want, torch.arange(3), 0.04, 0.06, scale_layout="linear")
    k, v = got.split(H, dim=1)  # strides (2HF, F, F, 1): by their origin
    nv.store(key[:3], value[:3], k, torch.arange(3), 0.04, 0.06, value_cache=v, scale_layout="linear",
             kv_layout="HND")
    assert torch.equal(got, want)
    one = torch.zeros(N, 2, 1, F, dtype=torch.uint8)  # one head, one token: nothing to decide
    k, v = one.split(1, dim=1)
    nv.store(key[:2, :1], value[:2, :1], k, torch.arange(2), 0.04, 0.06, value_cache=v, scale_layout="linear",
             kv_layout="HND")
    want_one = torch.zeros_like(one)
    nv.store(key[:2, :1], value[:2, :1], want_one, torch.arange(2), 0.04, 0.06, scale_layout="linear")
    assert torch.equal(one, want_one)
    view = packed_view(N, H, 1, seed=3)
    before = view.clone()
    k, v = view.split(H, dim=1)
    with pytest.raises(ValueError, match="but key has 4 heads, the size of dimension 1"):
        nv.store(key[:3], value[:3], k, torch.arange(3), 0.04, 0.06, value_cache=v, scale_layout="linear",
                 kv_layout="HND")
    assert torch.equal(view, before)


def test_views_of_part_of_the_pages_are_refused():
    """Found by review (fuzzing): head 0 of a 2-head 5-D cache taken as two sides, or the first 8
    tokens of NHD pages, passed as a cache of fewer heads or a smaller block size, and a store
    through them wrote its scale bytes into the other head's codes. Their origin (the 5-D cache
    they were cut from, pages along its first dimension) shows them: every call refuses them with
    a ValueError that says so and writes nothing. Whole sides, sides of the first pages, and caches
    carved from buffers that hold several layers (a later review found those refused) still pass."""
    kv = torch.randint(0, 64, (4, 2, 2, 16, F), dtype=torch.uint8).permute(0, 1, 3, 2, 4)  # HND, (N, 2, T, H, F)
    before = kv.clone()
    x = torch.randn(1, 1, D)
    bt, sl, q = torch.tensor([[0, 1]]), torch.tensor([20]), torch.randn(1, 4, D).to(torch.bfloat16)
    nhd = torch.zeros(2, 2, 16, 2, F, dtype=torch.uint8)
    cut = {
        "one head of two (HND)": kv[:, :, :, :1].unbind(1),
        "the first 8 tokens of NHD pages": nhd[:, :, :8].unbind(1),
        "numpy: one head of two (HND)": tuple(np.zeros((4, 2, 2, 16, F), np.uint8)[:, i, :1].transpose(0, 2, 1, 3)
                                              for i in (0, 1)),
    }
    for name, (kc, vc) in cut.items():
        calls = [
            lambda: nv.store(x, x, kc, torch.tensor([0]), 1.0, 1.0, value_cache=vc, scale_layout="linear"),
            lambda: nv.prepare_store(kc, 1.0, 1.0, value_cache=vc, scale_layout="linear"),
            lambda: nv.dequantize(kc, value_cache=vc, scale_layout="linear"),
            lambda: nv.gather_dequant(kc, bt, sl, value_cache=vc, scale_layout="linear"),
            lambda: nv.decode_attention(q, kc, bt, sl, 1.0, 1.0, value_cache=vc, scale_layout="linear"),
        ]
        for call in calls:
            with pytest.raises(ValueError, match=r"a view of part of the pages of the cache it was taken from"):
                call()
    assert torch.equal(kv, before) and not nhd.any()
    # Whole sides, sides of the first pages, packed halves, and caches carved from buffers of
    # several layers: a pool (L, S, H, F) of one-token pages, a page of every layer's packed
    # cache (N, L 2H, T, F), per-layer sides (L, 2, S, H, F).
    flat = torch.zeros(4, 4, 16, F, dtype=torch.uint8)
    pool, pages, per_layer = (torch.zeros(3, 8, 2, F, dtype=torch.uint8), torch.zeros(4, 3 * 4, 16, F, dtype=torch.uint8),
                              torch.zeros(3, 2, 8, 2, F, dtype=torch.uint8))
    for kc, vc in (kv.unbind(1), kv[:2].unbind(1), flat.split(2, dim=1), (kv[:, 0].numpy(), kv[:, 1].numpy()),
                   (pool[1].unsqueeze(1), pool[2].unsqueeze(1)), (per_layer[1, 0].unsqueeze(1), per_layer[1, 1].unsqueeze(1))):
        nv.dequantize(kc, value_cache=vc, scale_layout="linear", kv_layout="HND")
    nv.dequantize(pages[:, 4:8], scale_layout="linear")
    nv.store(x.expand(1, 2, D), x.expand(1, 2, D), pool[0].unsqueeze(1), torch.tensor([3]), 1.0, 1.0,
             value_cache=pool[1].unsqueeze(1), scale_layout="linear")


def test_one_page_numpy_views_are_judged_by_their_own_page_stride():
    """Found by review: NumPy 1.x exports no strides for an array it flags C-contiguous, which it
    decides ignoring size-1 dimensions, so a one-page view's page stride arrived compact. One head
    of a one-page 5-D cache was then accepted (and a store wrote into the other head's codes), and
    the halves of a one-page packed cache were read as NHD sides without the warning. The binding
    reads the page stride from the array (this test fails on the old binding under NumPy 1.x:
    CI's second pass)."""
    H, T = 2, 16
    kv = np.zeros((1, 2, H, T, F), np.uint8).transpose(0, 1, 3, 2, 4)  # HND (N, 2, T, H, F), one page
    key = np.ones((1, 1, D), np.float32)
    with pytest.raises(ValueError, match=r"key_cache: a view of part of the pages"):
        nv.store(key, key, kv[:, 0, :, :1], np.array([0]), 1.0, 1.0, value_cache=kv[:, 1, :, :1],
                 scale_layout="linear")
    assert not kv.any()
    halves = np.zeros((1, 2 * H, T, F), np.uint8)
    with pytest.warns(UserWarning, match="kv_layout"):
        nv.dequantize(halves[:, :H], 1.0, 1.0, value_cache=halves[:, H:], scale_layout="linear")


def test_view_helpers_refuse_views_of_part_of_the_pages():
    """Found by review (a new user's walk through the docs): nvfp4_split_data_scale of one head of
    a 5-D cache's side, or of the first tokens of NHD pages, returned "scales" that were other
    heads' codes (4096 bytes into a page whose K scales start at 8192). The view helpers refuse
    what every call refuses, with the calls' message; whole sides and caches still split."""
    H, T = 2, 16
    kv = torch.randint(0, 64, (4, 2, H, T, F), dtype=torch.uint8).permute(0, 1, 3, 2, 4)  # HND (N, 2, T, H, F)
    nhd = torch.zeros(4, 2, T, H, F, dtype=torch.uint8)
    sides = {
        "one head of two (HND)": kv[:, 0, :, :1],
        "numpy: one head of two (HND)": kv.numpy()[:, 1, :, :1],
        "the first 8 tokens of NHD pages": nhd[:, 0, :8],
    }
    for name, side in sides.items():
        with pytest.raises(ValueError, match=r"kv_side: a view of part of the pages of the cache it was taken from"):
            nv.nvfp4_split_data_scale(side)
    # A whole NHD side has the strides of a packed cache of T/2 "heads": named as one side.
    with pytest.raises(ValueError, match=r"kv_cache: a view of part of the pages.*It is one whole side"):
        nv.nvfp4_kv_cache_split_views(nhd[:, 0], "linear")
    # The calls name a whole side given as the cache the same way (value_cache forgotten).
    with pytest.raises(ValueError, match=r"kv_cache: a view of part of the pages.*It is one whole side.*value_cache"):
        nv.store(torch.randn(1, H, D), torch.randn(1, H, D), nhd[:, 0], torch.tensor([0]), 1.0, 1.0,
                 scale_layout="linear")
    assert not nhd.any()
    # Whole sides, and both sides of the whole cache, split as before: their scales follow all codes.
    for side in (kv[:, 0], kv[:, 1], kv.numpy()[:, 0], nhd[:, 1]):
        data, scale = nv.nvfp4_split_data_scale(side)
        assert data.shape[1:3] == side.shape[1:3]
    k_data, k_scale, _, _ = nv.nvfp4_kv_cache_split_views(kv, "linear")
    assert k_scale.data_ptr() - kv.data_ptr() == H * T * D // 2


def test_interleaved_split_of_a_packed_half_names_the_half():
    """Found by review: a V half of a packed cache (N, H, T, F) split with token-4 interleaved
    scales was refused as "NHD", which it reads as; the message now says why and what to do."""
    kp = nv.allocate_kv_cache(nv.KVCacheSpec(16, 2, 64), 2, packed=True)
    with pytest.raises(ValueError, match=r"is NHD as an \(N, T, H, F\) side.*half of a packed cache.*"
                                         r"nvfp4_kv_cache_split_views"):
        nv.nvfp4_split_data_scale(kp.split(2, dim=1)[1], scale_layout="interleaved")
    *_, v_scale = nv.nvfp4_kv_cache_split_views(kp)  # the packed cache itself: interleaved V scales
    assert tuple(v_scale.shape) == (2, 4, 4, 2, D // 16)
