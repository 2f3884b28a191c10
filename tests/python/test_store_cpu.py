"""nvfp4kv.store / reshape_and_cache_flash on CPU, byte-for-byte against the reference.

Every test poisons the whole cache buffer first and compares the WHOLE buffer afterwards."""
import numpy as np
import pytest
import reference as ref
from conftest import (
    assert_bytes_equal,
    count_exact_scale_ties,
    EXTREME_GLOBAL_SCALES,
    draw_slots,
    expected_store,
    groups_4over6_order_sensitive,
    groups_every_code_and_tie,
    groups_every_scale_byte,
    groups_extreme_scale,
    groups_random,
    groups_scale_ties,
    groups_special,
    make_cache,
    make_kv,
    make_scale,
    make_slots,
    mixed_tokens,
    run_store,
    scatter_slots,
    to_numpy,
    tokens_from_groups,
    view_combos,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

BACKENDS = ("numpy", "torch")


# ----------------------------------------------------------------------------- exhaustive tables
def _store_groups(nv, backend, rng, k_groups, v_groups, geometry, seed, recipe, scale_layout,
                  g=1.0):
    """K and V tokens made of the given groups, stored at scattered slots of a poisoned HND cache
    (seeded `seed`) and compared whole with the reference."""
    H, D, T, N = geometry
    k = tokens_from_groups(k_groups, H, D, rng)
    v = tokens_from_groups(v_groups, H, D, rng, len(k))
    cache = make_cache(N, T, H, D, "5d", "HND", backend, seed=seed)
    key, value, k32, v32 = make_kv(k, v, "float32", backend)
    slots = make_slots(scatter_slots(rng, len(k), N, T), backend=backend)
    run_store(nv, cache, key, value, k32, v32, slots, g, g, recipe, scale_layout)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("recipe", ref.RECIPES)
@pytest.mark.parametrize("g", [1.0, 0.37])
@pytest.mark.parametrize("scale_layout", ["vllm", "linear"])
def test_every_scale_byte(nv, backend, recipe, g, scale_layout):
    rng = np.random.default_rng(10)
    H, D, T, N = 2, 128, 16, 6
    groups = groups_every_scale_byte(rng, g)
    if recipe == "nvfp4":  # coverage of the crafted input (4over6 may pick other bytes)
        sfb = ref.quantize_groups(groups, g)[1]
        assert set(range(0x7F)) <= set(sfb.tolist())
    _store_groups(nv, backend, rng, groups, groups[::-1].copy(), (H, D, T, N), 1, recipe,
                  scale_layout, g)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("recipe", ref.RECIPES)
@pytest.mark.parametrize("g", EXTREME_GLOBAL_SCALES)
def test_every_scale_byte_with_zeros_and_infinities_at_extreme_global_scales(nv, backend, recipe, g):
    # out = +Inf (tiny g) or 0 (huge g) makes x*out = 0*Inf or Inf*0 = NaN for zero or infinite
    # elements; FORMAT.md §2 encodes those from x (zero -> 0x0/0x8, Inf -> 0x7/0xF). Was: the
    # library wrote +-0 for +-Inf at g > ~7.6e35, the reference 0xF for either (x86's NaN sign).
    rng = np.random.default_rng(16)
    groups = groups_extreme_scale(g)
    _store_groups(nv, backend, rng, groups, -groups, (2, 128, 16, 2), 16, recipe, "linear", g)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("recipe", ref.RECIPES)
@pytest.mark.parametrize("scale_layout", ["vllm", "linear"])
def test_every_code_and_every_e2m1_tie(nv, backend, recipe, scale_layout):
    rng = np.random.default_rng(11)
    H, D, T, N = 2, 64, 4, 4
    groups = groups_every_code_and_tie(rng)
    codes = ref.quantize_groups(groups, 1.0, recipe)[0]
    assert set(codes.reshape(-1).tolist()) == set(range(16))
    _store_groups(nv, backend, rng, groups, -groups, (H, D, T, N), 2, recipe, scale_layout)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("recipe", ref.RECIPES)
@pytest.mark.parametrize("scale_layout", ["vllm", "linear"])
def test_every_e4m3_scale_tie(nv, backend, recipe, scale_layout):
    rng = np.random.default_rng(12)
    H, D, T, N = 4, 128, 16, 8
    groups = groups_scale_ties(rng)
    assert count_exact_scale_ties(groups) == 126
    _store_groups(nv, backend, rng, groups, groups, (H, D, T, N), 3, recipe, scale_layout)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("recipe", ref.RECIPES)
@pytest.mark.parametrize("scale_layout", ["vllm", "linear"])
def test_nan_inf_zero_tiny_groups(nv, backend, recipe, scale_layout):
    rng = np.random.default_rng(13)
    H, D, T, N = 1, 64, 4, 4
    groups = groups_special(rng)
    sfb = ref.quantize_groups(groups, 1.0, recipe)[1]
    assert {0x00, 0x01, 0x7E, 0x7F} <= set(sfb.tolist())
    _store_groups(nv, backend, rng, groups, groups[::-1].copy(), (H, D, T, N), 4, recipe,
                  scale_layout)


@pytest.mark.parametrize("backend", BACKENDS)
def test_denormal_amax_with_tiny_global_scale(nv, backend):
    # g = 1e-38 (valid: 1/g is finite).  A group of nonzero fp32 denormals gets a nonzero scale
    # byte, and `out` overflows to +Inf, so every element saturates to +-6.  A flush-to-zero
    # build would see amax = 0 and write a zero group instead.  (Zero elements next to out = +Inf:
    # test_every_scale_byte_with_zeros_and_infinities_at_extreme_global_scales.)
    rng = np.random.default_rng(14)
    H, D, T, N = 1, 16, 4, 1
    mags = rng.uniform(1e-40, 1.1e-38, (4, 1, 16)).astype(np.float32)
    k = mags * np.where(rng.random(mags.shape) < 0.5, 1, -1).astype(np.float32)
    codes, sfb = ref.quantize_groups(k.reshape(-1, 16), 1e-38)
    assert (sfb != 0).all() and ((codes & 7) == 7).all()
    cache = make_cache(N, T, H, D, "5d", "HND", backend, seed=5)
    key, value, k32, v32 = make_kv(k, -k, "float32", backend)
    run_store(nv, cache, key, value, k32, v32, make_slots([0, 1, 2, 3], backend=backend),
              1e-38, 1e-38, "nvfp4", "linear")


@pytest.mark.parametrize("backend", BACKENDS)
def test_4over6_picks_both_candidates(nv, backend):
    rng = np.random.default_rng(15)
    H, D, T, N = 4, 128, 16, 2
    # Random groups plus the ones whose choice depends on the error summation order.
    k = tokens_from_groups(np.concatenate([groups_random(rng, 600, 6),
                                           groups_4over6_order_sensitive()]), H, D, rng)
    plain = ref.quantize_groups(k.reshape(-1, 16), 1.0, "nvfp4")[1]
    four6 = ref.quantize_groups(k.reshape(-1, 16), 1.0, "nvfp4_4over6")[1]
    assert (plain == four6).any() and (plain != four6).any()
    cache = make_cache(N, T, H, D, "5d", "HND", backend, seed=6)
    key, value, k32, v32 = make_kv(k, k[::-1].copy(), "float32", backend)
    slots = make_slots(scatter_slots(rng, len(k), N, T), backend=backend)
    run_store(nv, cache, key, value, k32, v32, slots, 1.0, 1.0, "nvfp4_4over6", "vllm")


# ------------------------------------------------------------------------------- cache views
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("view,layout,scale_layout", view_combos())
@pytest.mark.parametrize("pad", [0, 40])
def test_cache_views(nv, backend, view, layout, scale_layout, pad):
    if view == "packed4d" and pad:
        pytest.skip("packed 4-D is contiguous: no free page stride")
    rng = np.random.default_rng(20)
    N, T, H, D = 3, 8, 3, 64
    k, v = mixed_tokens(rng, 14, H, D), mixed_tokens(rng, 14, H, D)
    cache = make_cache(N, T, H, D, view, layout, backend, pad=pad, seed=7)
    key, value, k32, v32 = make_kv(k, v, "float32", backend)
    slots = make_slots(scatter_slots(rng, 14, N, T), backend=backend)
    run_store(nv, cache, key, value, k32, v32, slots, 0.5, 2.0, "nvfp4", scale_layout)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout,scale_layout", [("HND", "vllm"), ("NHD", "linear")])
def test_sides_not_adjacent(nv, backend, layout, scale_layout):
    # key_cache and value_cache from different places of a page (poison in between).
    rng = np.random.default_rng(21)
    N, T, H, D = 3, 8, 2, 128
    k, v = mixed_tokens(rng, 10, H, D), mixed_tokens(rng, 10, H, D)
    cache = make_cache(N, T, H, D, "sides", layout, backend, pad=8, v_gap=72, seed=17)
    key, value, k32, v32 = make_kv(k, v, "float32", backend)
    slots = make_slots(scatter_slots(rng, 10, N, T), backend=backend)
    run_store(nv, cache, key, value, k32, v32, slots, 1.0, 0.5, "nvfp4", scale_layout)


@pytest.mark.parametrize("D", [16, 48, 64, 128, 256, 512])
@pytest.mark.parametrize("T", [1, 4, 16, 32])
@pytest.mark.parametrize("scale_layout", ["vllm", "linear"])
def test_head_and_block_sizes(nv, D, T, scale_layout):
    if scale_layout == "vllm" and (T % 4 or D % 64):
        pytest.skip("interleaved V scales need T % 4 == 0 and D % 64 == 0")
    rng = np.random.default_rng(D * 100 + T)
    N, H = 2, 2
    n = max(1, N * T // 2)
    k, v = mixed_tokens(rng, n, H, D), mixed_tokens(rng, n, H, D)
    for layout in (("HND",) if scale_layout == "vllm" else ("HND", "NHD")):
        cache = make_cache(N, T, H, D, "5d", layout, "torch", seed=T)
        key, value, k32, v32 = make_kv(k, v, "float32", "torch")
        slots = make_slots(scatter_slots(rng, n, N, T), backend="torch")
        run_store(nv, cache, key, value, k32, v32, slots, 1.0, 1.0, "nvfp4", scale_layout)


# -------------------------------------------------------------------------- inputs and slots
@pytest.mark.parametrize("backend,dtype", [("torch", "bfloat16"), ("torch", "float16"),
                                           ("torch", "float32"), ("numpy", "float16"),
                                           ("numpy", "float32")])
@pytest.mark.parametrize("strided", ["contiguous", "qkv", "heads"])
@pytest.mark.parametrize("recipe", ref.RECIPES)
def test_input_dtypes_and_strides(nv, backend, dtype, strided, recipe):
    rng = np.random.default_rng(30)
    N, T, H, D = 2, 16, 2, 128
    # Magnitudes kept inside fp16 range so that fp16 does not just produce Infs everywhere.
    k = tokens_from_groups(np.concatenate([groups_random(rng, 20, 8), groups_special(rng)]),
                           H, D, rng, 12)
    v = tokens_from_groups(groups_random(rng, 30, 8), H, D, rng, 12)
    cache = make_cache(N, T, H, D, "5d", "HND", backend, seed=8)
    key, value, k32, v32 = make_kv(k, v, dtype, backend, strided=strided)
    if strided != "contiguous":
        assert not (key.flags["C_CONTIGUOUS"] if backend == "numpy" else key.is_contiguous())
    slots = make_slots(scatter_slots(rng, 12, N, T), backend=backend)
    run_store(nv, cache, key, value, k32, v32, slots, 0.25, 3.0, recipe, "vllm")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("slot_dtype", ["int32", "int64"])
def test_padding_and_out_of_range_slots(nv, backend, slot_dtype):
    rng = np.random.default_rng(31)
    N, T, H, D = 2, 4, 2, 64
    big = 2**31 - 1 if slot_dtype == "int32" else 2**40
    low = -(2**31) if slot_dtype == "int32" else -(2**40)
    slots = np.array([-1, 3, N * T, 0, -1, N * T + 5, 7, big, low, 4, -2], slot_dtype)
    n = len(slots)
    k, v = mixed_tokens(rng, n, H, D), mixed_tokens(rng, n, H, D)
    cache = make_cache(N, T, H, D, "5d", "HND", backend, seed=9)
    key, value, k32, v32 = make_kv(k, v, "float32", backend)
    run_store(nv, cache, key, value, k32, v32, make_slots(slots, slot_dtype, backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_slot_given_twice_keeps_the_last_token(nv, backend):
    """Duplicate slots: the batch's last token for a slot is what the page holds, as if the others
    were never given (mutation testing: tokens taken last to first passed on one thread)."""
    rng = np.random.default_rng(34)
    N, T, H, D = 2, 4, 2, 64
    k, v = mixed_tokens(rng, 5, H, D), mixed_tokens(rng, 5, H, D)
    slots = np.array([3, 5, 3, 3, 5])
    both = make_cache(N, T, H, D, "5d", "HND", backend, seed=12)
    last = make_cache(N, T, H, D, "5d", "HND", backend, seed=12)
    key, value, k32, v32 = make_kv(k, v, "float32", backend)
    run_store(nv, both, key, value, k32, v32, make_slots(slots, "int64", backend))
    key, value, _, _ = make_kv(k[3:], v[3:], "float32", backend)  # slot 3's last token, then slot 5's
    nv.store(key, value, slot_mapping=make_slots(slots[3:], "int64", backend), k_scale=1.0, v_scale=1.0,
             **last.kwargs())
    assert_bytes_equal(both.snapshot(), last.snapshot())


@pytest.mark.parametrize("backend", BACKENDS)
def test_padded_rows_store_the_first_slot_mapping_rows(nv, backend):
    """key/value with more rows than slot_mapping (an engine's CUDA-graph padding, as in vLLM):
    the first slot_mapping.size(0) tokens are stored, the padding rows are never read."""
    rng = np.random.default_rng(32)
    N, T, H, D, n, pad = 3, 16, 2, 64, 9, 7
    k, v = mixed_tokens(rng, n + pad, H, D), mixed_tokens(rng, n + pad, H, D)
    k[n:] = np.nan  # a padding row that were stored would leave NaN scale bytes
    cache = make_cache(N, T, H, D, "5d", "HND", backend, seed=10)
    key, value, _, _ = make_kv(k, v, "float32", backend)
    _, _, k32, v32 = make_kv(k[:n], v[:n], "float32", backend)
    run_store(nv, cache, key, value, k32, v32, make_slots(scatter_slots(rng, n, N, T), "int64", backend))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("view", ["5d", "sides"])
def test_workspace_on_the_cpu_is_checked_and_changes_nothing(nv, backend, view):
    """The CPU path needs no workspace; one given is validated like on the GPU, then unused."""
    rng = np.random.default_rng(33)
    N, T, H, D = 3, 4, 2, 64
    cache = make_cache(N, T, H, D, view, "HND", backend, seed=11)
    ws = nv.store_workspace(cache.kv_cache, cache.value_cache)
    assert type(ws) is type(cache.kv_cache) and ws.shape == (nv.store_workspace_bytes(N, T),)
    assert nv.store_workspace_bytes(N, T) == 16 + 4 * N * (2 * T + 3)
    k, v = mixed_tokens(rng, 5, H, D), mixed_tokens(rng, 5, H, D)
    key, value, k32, v32 = make_kv(k, v, "float32", backend)
    slots = make_slots(scatter_slots(rng, 5, N, T), backend=backend)
    before = cache.snapshot()
    with pytest.raises(ValueError, match="needs"):
        nv.store(key, value, slot_mapping=slots, workspace=ws[:-1], **cache.kwargs())
    assert_bytes_equal(cache.snapshot(), before, cache)
    run_store(nv, cache, key, value, k32, v32, slots, workspace=ws)
    assert not ws.any()


def test_workspace_overlapping_the_cache_or_inputs_rejected(nv):
    N, T, H, D = 3, 4, 2, 64
    F = D // 2 + D // 16
    side, nbytes = H * T * F, nv.store_workspace_bytes(N, T)
    raw = torch.zeros(N * 2 * side + nbytes, dtype=torch.uint8)
    kv = raw[:N * 2 * side].view(N, 2, H, T, F).transpose(2, 3)  # HND 5-D, the workspace's room after it
    big = torch.zeros(nbytes + 4 * H * D * 4, dtype=torch.uint8)
    key = big[nbytes:].view(torch.float32).view(4, H, D)  # right after a workspace's room
    key.copy_(torch.randn(4, H, D))
    slots = make_slots([0, 1, 2, 3], backend="torch")
    before = raw.clone()
    with pytest.raises(ValueError, match="workspace: overlaps key"):
        nv.store(key, key.clone(), kv, slots, workspace=big[:nbytes + 4])
    with pytest.raises(ValueError, match="workspace: overlaps kv_cache"):
        nv.store(key.clone(), key.clone(), kv, slots, workspace=raw[-nbytes - 4:-4])
    # a device scale inside the workspace would be overwritten by the kernels' claim words
    ws = torch.zeros(nbytes + 8, dtype=torch.uint8)
    for name, at in (("k_scale", 0), ("v_scale", nbytes - 4)):
        scale = ws[at:at + 4].view(torch.float32)
        scale.fill_(1.0)
        scales = {"k_scale": 1.0, "v_scale": 1.0, name: scale}
        with pytest.raises(ValueError, match=f"workspace: overlaps {name}"):
            nv.store(key.clone(), key.clone(), kv, slots, workspace=ws[:nbytes], **scales)
    assert torch.equal(raw, before)
    nv.store(key.clone(), key.clone(), kv, slots, workspace=raw[-nbytes:])  # adjacent is fine
    assert not torch.equal(raw, before)


def test_error_names_the_entry_point(nv):
    N, T, H, D = 2, 4, 2, 64
    cache = make_cache(N, T, H, D, "5d", "HND", "torch", seed=16)
    key = torch.zeros(2, H, D, dtype=torch.float64)
    slots = make_slots([0, 1], backend="torch")
    with pytest.raises(TypeError, match="^nvfp4kv_store: key"):
        nv.store(key, key, slot_mapping=slots, **cache.kwargs())
    ws = nv.store_workspace(cache.kv_cache)
    with pytest.raises(TypeError, match="^nvfp4kv_store_with_workspace: key"):
        nv.store(key, key, slot_mapping=slots, workspace=ws, **cache.kwargs())
    with pytest.raises(ValueError, match="auto"):
        nv._C._set_store_order("fastest")


def test_workspace_bytes_rejects_bad_sizes(nv):
    for args in [(-1, 16), (4, 0), (2**40, 16)]:
        with pytest.raises(ValueError, match="num_blocks"):
            nv.store_workspace_bytes(*args)
    assert nv.store_workspace_bytes(0, 16) == 16
    # Found by review: a bool was taken as 1, and a float or an int past int64 got nanobind's
    # TypeError, which names no argument.
    for args, err, arg in [((True, 16), TypeError, "num_blocks: bool"), ((4, 16.0), TypeError, "block_size: float"),
                           ((2**70, 16), ValueError, "num_blocks: an int past the int64 range")]:
        with pytest.raises(err, match=f"^{arg}"):
            nv.store_workspace_bytes(*args)
    assert nv.store_workspace_bytes(np.int64(4), np.int32(16)) == nv.store_workspace_bytes(4, 16)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("view,layout,scale_layout", view_combos())
@pytest.mark.parametrize("recipe", ref.RECIPES)
def test_prepared_store_equals_the_reference(nv, backend, view, layout, scale_layout, recipe):
    """prepare_store(...)(key, value, slots): the bytes of store(), call after call."""
    rng = np.random.default_rng(34)
    N, T, H, D = 3, 4, 2, 64
    cache = make_cache(N, T, H, D, view, layout, backend, seed=12)
    ks = make_scale(0.37, "tensor") if backend == "torch" else 0.37
    kw = cache.kwargs()
    prepared = nv.prepare_store(kw.pop("kv_cache"), ks, 0.5, value_cache=kw.get("value_cache"), recipe=recipe,
                                scale_layout=scale_layout)
    for step in range(2):
        k, v = mixed_tokens(rng, 5, H, D), mixed_tokens(rng, 5, H, D)
        key, value, k32, v32 = make_kv(k, v, "float32", backend)
        slots = make_slots(scatter_slots(rng, 5, N, T), backend=backend)
        snap = cache.snapshot()
        want = expected_store(cache, snap, k32, v32, slots, ks, 0.5, recipe, scale_layout)
        prepared(key, value, slots)
        assert_bytes_equal(cache.snapshot(), want, cache)


def test_prepared_store_keeps_its_tensors_and_sees_scale_updates(nv):
    import gc

    rng = np.random.default_rng(35)
    N, T, H, D = 2, 4, 2, 64
    cache = make_cache(N, T, H, D, "5d", "HND", "torch", seed=13)
    ks = torch.tensor([0.25])
    prepared = nv.prepare_store(cache.kv_cache, ks, torch.tensor([0.5]))  # v_scale: only the object holds it
    gc.collect()
    k = mixed_tokens(rng, 3, H, D)
    key, value, k32, v32 = make_kv(k, k, "float32", "torch")
    slots = make_slots([0, 5, 7], backend="torch")
    for g in (0.25, 2.0):
        ks.fill_(g)  # read at each call, like store()'s scale arguments
        snap = cache.snapshot()
        want = expected_store(cache, snap, k32, v32, slots, g, 0.5)
        prepared(key, value, slots)
        assert_bytes_equal(cache.snapshot(), want, cache)


def test_prepared_store_keeps_its_memory_when_a_tensor_gets_new_memory(nv):
    # Found by review (fuzzing): a scale tensor given new memory after preparation (set_, .data =)
    # freed the memory the prepared store had imported, and it then read freed memory. The object
    # keeps that memory alive and goes on with it (documented: prepare again after such a change).
    import gc

    rng = np.random.default_rng(36)
    N, T, H, D = 2, 4, 2, 64
    cache = make_cache(N, T, H, D, "5d", "HND", "torch", seed=14)
    ks, vs = torch.tensor([0.25]), torch.tensor([0.5])
    prepared = nv.prepare_store(cache.kv_cache, ks, vs)
    ks.set_(torch.tensor([-1.0]))
    vs.data = torch.tensor([float("nan")])
    gc.collect()
    torch.full((1 << 16,), -3.0)  # memory the allocator may hand out again
    k = mixed_tokens(rng, 3, H, D)
    key, value, k32, v32 = make_kv(k, k, "float32", "torch")
    slots = make_slots([0, 5, 7], backend="torch")
    want = expected_store(cache, cache.snapshot(), k32, v32, slots, 0.25, 0.5)
    prepared(key, value, slots)
    assert_bytes_equal(cache.snapshot(), want, cache)


def test_prepared_store_errors(nv):
    N, T, H, D = 2, 4, 2, 64
    cache = make_cache(N, T, H, D, "5d", "HND", "torch", seed=14)
    with pytest.raises(ValueError, match="recipe"):
        nv.prepare_store(cache.kv_cache, 1.0, 1.0, recipe="fp8")
    with pytest.raises(TypeError, match="kv_cache"):
        nv.prepare_store([1, 2, 3], 1.0, 1.0)
    # A scale given as a number is taken by value, so an invalid one is refused at preparation
    # (it used to be taken, then refused by every call).
    for bad in (-1.0, 0.0, float("nan"), float("inf"), 1e-44, np.float32(-2.0), np.array(0.0)):
        for which in ("k_scale", "v_scale"):
            with pytest.raises(ValueError, match=f"{which}: .*finite reciprocal"):
                nv.prepare_store(cache.kv_cache, **{"k_scale": 1.0, "v_scale": 1.0, which: bad})
    # In the words of store()'s refusal (the C ABI's): one statement of the rule.
    k, slots = torch.zeros(1, H, D), torch.tensor([0])
    with pytest.raises(ValueError) as by_store:
        nv.store(k, k, cache.kv_cache, slots, -1.0, 1.0)
    with pytest.raises(ValueError) as by_prepare:
        nv.prepare_store(cache.kv_cache, -1.0, 1.0)
    assert str(by_store.value) == "nvfp4kv_store: " + str(by_prepare.value).replace("-1.0", "-1", 1)
    prepared = nv.prepare_store(cache.kv_cache, 1.0, 1.0)
    before = cache.snapshot()
    key = torch.zeros(2, H, D, dtype=torch.float64)
    with pytest.raises(TypeError, match="key: dtype float64"):
        prepared(key, key, torch.tensor([0, 1]))
    key = torch.zeros(2, H + 1, D)
    with pytest.raises(ValueError, match="heads"):
        prepared(key, key, torch.tensor([0, 1]))
    assert_bytes_equal(cache.snapshot(), before, cache)


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_slots_skipped(nv, backend):
    rng = np.random.default_rng(32)
    N, T, H, D = 2, 4, 2, 64
    cache = make_cache(N, T, H, D, "5d", "HND", backend, seed=10)
    before = cache.snapshot()
    k = mixed_tokens(rng, 3, H, D)
    key, value, _, _ = make_kv(k, k, "float32", backend)
    slots = make_slots([-1, N * T, -5], backend=backend)
    nv.store(key, value, cache.kv_cache, slots, 1.0, 1.0)
    assert_bytes_equal(cache.snapshot(), before, cache)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("slot_dtype", ["int32", "int64"])
def test_zero_tokens(nv, backend, slot_dtype):
    N, T, H, D = 2, 4, 2, 64
    cache = make_cache(N, T, H, D, "5d", "HND", backend, seed=10)
    before = cache.snapshot()
    if backend == "numpy":
        key = np.zeros((0, H, D), np.float32)
    else:
        key = torch.zeros((0, H, D), dtype=torch.bfloat16)
    nv.store(key, key, cache.kv_cache, make_slots([], slot_dtype, backend), 1.0, 1.0)
    assert_bytes_equal(cache.snapshot(), before, cache)


def test_zero_tokens_with_degenerate_strides(nv):
    # NumPy gives zero-size views all-zero strides (np.stack of empty arrays, slicing); with no
    # element there is nothing to address, so an empty batch is still a valid no-op.
    N, T, H, D = 2, 4, 2, 64
    cache = make_cache(N, T, H, D, "5d", "HND", "numpy", seed=10)
    before = cache.snapshot()
    kv = np.stack([np.zeros((0, H, D), np.float32)] * 2)
    assert kv[0].strides == (0, 0, 0)
    nv.store(kv[0], kv[1], cache.kv_cache, np.zeros(0, np.int64), 1.0, 1.0)
    assert_bytes_equal(cache.snapshot(), before, cache)


def test_cache_of_no_pages_with_degenerate_strides(nv):
    # Found by review: an HND view of an empty NumPy cache has all-zero strides, whose compact
    # stand-ins read as NHD, and the default 'vllm' profile (HND only) refused it. A cache of no
    # pages keeps no layout: every token is padding, nothing is written, nothing is refused.
    T, H, D = 16, 2, 64
    c = np.zeros((0, 2, H, T, 36), np.uint8).transpose(0, 1, 3, 2, 4)
    assert c.shape == (0, 2, T, H, 36) and c.strides == (0,) * 5
    k = np.ones((3, H, D), np.float32)
    nv.store(k, k, c, np.full(3, -1), 0.01, 0.01)
    nv.store(k, k, c, np.arange(3), 0.01, 0.01)  # slots past N * T = 0: skipped


@pytest.mark.parametrize("backend", BACKENDS)
def test_inputs_not_modified_and_later_stores_overwrite(nv, backend):
    rng = np.random.default_rng(33)
    N, T, H, D = 2, 4, 2, 64
    cache = make_cache(N, T, H, D, "sides", "HND", backend, seed=11)
    for rnd in range(3):  # overlapping slot sets: earlier bytes must be replaced exactly
        k, v = mixed_tokens(rng, 5, H, D), mixed_tokens(rng, 5, H, D)
        key, value, k32, v32 = make_kv(k, v, "float32", backend)
        slots = make_slots(scatter_slots(rng, 5, N, T), backend=backend)
        keep = [to_numpy(a).copy() for a in (key, value, slots)]
        run_store(nv, cache, key, value, k32, v32, slots, 1.0, 1.0, ref.RECIPES[rnd % 2])
        for a, b in zip(keep, (key, value, slots)):
            assert np.array_equal(a, to_numpy(b), equal_nan=True)


@pytest.mark.parametrize("kind", ["float", "tensor", "scalar_tensor"])
@pytest.mark.parametrize("g", [1.0, 0.37, 3.0e-3, 1.0e-30, 448.0, 7.7e4])
def test_global_scale_kinds_and_values(nv, kind, g):
    rng = np.random.default_rng(34)
    N, T, H, D = 1, 16, 2, 64
    # Values scaled with g so that sf = amax / (6 g) stays inside the E4M3 range.
    k = tokens_from_groups(groups_random(rng, 40, 10), H, D, rng, 10) * np.float32(g)
    cache = make_cache(N, T, H, D, "5d", "HND", "torch", seed=12)
    key, value, k32, v32 = make_kv(k, -k, "float32", "torch")
    slots = make_slots(scatter_slots(rng, 10, N, T), backend="torch")
    ks, vs = make_scale(g, kind), make_scale(g * 3, kind)
    run_store(nv, cache, key, value, k32, v32, slots, ks, vs)


# ------------------------------------------------------------------------- vLLM entry point
@pytest.mark.parametrize("kv_cache_dtype", ref.RECIPES)
@pytest.mark.parametrize("layout,scale_layout", [("HND", "vllm"), ("HND", "linear"),
                                                 ("NHD", "linear")])
@pytest.mark.parametrize("scale_kind", ["tensor", "float"])
def test_reshape_and_cache_flash(nv, kv_cache_dtype, layout, scale_layout, scale_kind):
    rng = np.random.default_rng(40)
    N, T, H, D = 4, 16, 2, 128
    n = 37
    k, v = mixed_tokens(rng, n, H, D), mixed_tokens(rng, n, H, D)
    cache = make_cache(N, T, H, D, "sides", layout, "torch", seed=13)
    key, value, k32, v32 = make_kv(k, v, "bfloat16", "torch", strided="qkv")
    slot_list = scatter_slots(rng, n, N, T)
    slot_list[::9] = -1
    slots = make_slots(slot_list, backend="torch")
    ks, vs = make_scale(0.02, scale_kind), make_scale(0.05, scale_kind)
    snap = cache.snapshot()
    want = expected_store(cache, snap, k32, v32, slots, ks, vs, kv_cache_dtype, scale_layout)
    key_cache, value_cache = cache.sides_pair()
    nv.reshape_and_cache_flash(key, value, key_cache, value_cache, slots, kv_cache_dtype, ks, vs,
                               scale_layout=scale_layout)
    assert_bytes_equal(cache.snapshot(), want, cache)


# ------------------------------------------------------------------------- property testing
@st.composite
def store_cases(draw):
    backend = draw(st.sampled_from(BACKENDS))
    view, layout, scale_layout = draw(st.sampled_from(view_combos()))
    T = draw(st.sampled_from([1, 4, 16, 32] if scale_layout == "linear" else [4, 16, 32]))
    D = draw(st.sampled_from([16, 48, 64, 128, 256, 512] if scale_layout == "linear"
                             else [64, 128, 256, 512]))
    H = draw(st.integers(1, 4))
    N = draw(st.integers(1, 4))
    n = draw(st.integers(1, min(48, 2 * N * T)))  # n = 0 has its own tests (test_zero_tokens*)
    dtypes = ["bfloat16", "float16", "float32"] if backend == "torch" else ["float16", "float32"]
    return {
        "backend": backend, "view": view, "layout": layout, "scale_layout": scale_layout,
        "T": T, "D": D, "H": H, "N": N, "n": n, "dtype": draw(st.sampled_from(dtypes)),
        "strided": draw(st.sampled_from(["contiguous", "qkv", "heads"])),
        "slot_dtype": draw(st.sampled_from(["int32", "int64"])),
        "slot_pattern": draw(st.sampled_from(["perm", "padded", "out_of_range", "sequential"])),
        "recipe": draw(st.sampled_from(ref.RECIPES)),
        "pad": 0 if view == "packed4d" else draw(st.sampled_from([0, 16, 1000])),
        "v_gap": draw(st.sampled_from([0, 0, 24])) if view == "sides" else 0,
        "k_scale": draw(st.sampled_from([1.0, 0.5, 0.013, 6.5])),
        "v_scale": draw(st.sampled_from([1.0, 0.25, 0.07, 11.0])),
        "special": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**32 - 1)),
    }


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=store_cases())
def test_store_property(nv, case):
    c = case
    rng = np.random.default_rng(c["seed"])
    k = mixed_tokens(rng, c["n"], c["H"], c["D"], c["special"])
    v = mixed_tokens(rng, c["n"], c["H"], c["D"], c["special"])
    cache = make_cache(c["N"], c["T"], c["H"], c["D"], c["view"], c["layout"], c["backend"],
                       pad=c["pad"], seed=c["seed"], v_gap=c["v_gap"])
    key, value, k32, v32 = make_kv(k, v, c["dtype"], c["backend"], strided=c["strided"])
    slots = make_slots(draw_slots(rng, c["slot_pattern"], c["n"], c["N"], c["T"]),
                       c["slot_dtype"], c["backend"])
    run_store(nv, cache, key, value, k32, v32, slots, c["k_scale"], c["v_scale"], c["recipe"],
              c["scale_layout"])


def test_empty_numpy_cache_reads_like_an_empty_torch_one(nv):
    """NumPy 2 gives an empty array strides of 0; the C ABI takes them as its shape's compact ones."""
    for view in (np.zeros((0, 2, 16, 2, 72), np.uint8), np.zeros((0, 4, 16, 72), np.uint8)):
        k, v = nv.dequantize(view, scale_layout="linear")
        want = nv.dequantize(torch.from_numpy(view.copy()), scale_layout="linear")
        assert k.shape == tuple(want[0].shape) and v.shape == tuple(want[1].shape)
        nv.store(np.zeros((0, 2, 128), np.float32), np.zeros((0, 2, 128), np.float32), view,
                 np.zeros(0, np.int64), scale_layout="linear")
