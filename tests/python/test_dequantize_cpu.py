"""nvfp4kv.dequantize on CPU against reference.dequantize_reference, bit for bit (NaN == NaN)."""
import numpy as np
import pytest
import reference as ref
from conftest import (
    assert_bytes_equal,
    assert_floats_identical,
    draw_slots,
    expected_store,
    make_cache,
    make_kv,
    make_scale,
    make_slots,
    mixed_tokens,
    round_f32_to,
    scale_value,
    view_combos,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

BACKENDS = ("numpy", "torch")


def dtypes_for(backend):
    return ("float32", "float16", "bfloat16") if backend == "torch" else ("float32", "float16")


def check_dequantize(nv, cache, k_scale, v_scale, scale_layout, dtype="float32", dtype_arg=None):
    """dequantize() the whole cache and compare with the reference on the current bytes."""
    snap = cache.snapshot()
    k_want, v_want = ref.dequantize_reference(cache.canonical(snap), scale_value(k_scale),
                                              scale_value(v_scale), cache.T, cache.H, cache.D,
                                              cache.layout, scale_layout)
    k, v = nv.dequantize(k_scale=k_scale, v_scale=v_scale, dtype=dtype_arg or dtype,
                         scale_layout=scale_layout, **cache.kwargs())
    want_type = np.ndarray if cache.backend == "numpy" else torch.Tensor
    for got, want in ((k, k_want), (v, v_want)):
        assert isinstance(got, want_type)
        assert tuple(got.shape) == (cache.N, cache.T, cache.H, cache.D)
        assert_floats_identical(got, round_f32_to(want, dtype))
    # Reading must not write.
    assert_bytes_equal(cache.snapshot(), snap, cache)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("view,layout,scale_layout", view_combos())
def test_dequantize_poisoned_cache_every_view(nv, backend, view, layout, scale_layout):
    # Random bytes: every code, every scale byte including 0x7F/0xFF (NaN) and the negative
    # ones (0x80..0xFE), and never-written pages; all must decode per docs/FORMAT.md §6.
    cache = make_cache(3, 8, 3, 64, view, layout, backend, pad=0 if view == "packed4d" else 24,
                       seed=21)
    for dtype in dtypes_for(backend):
        check_dequantize(nv, cache, 0.75, 1.5, scale_layout, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dequantize_sides_not_adjacent(nv, backend):
    cache = make_cache(2, 8, 2, 64, "sides", "HND", backend, pad=5, v_gap=40, seed=25)
    check_dequantize(nv, cache, 1.0, 2.0, "vllm")


@pytest.mark.parametrize("D", [16, 48, 64, 128, 256, 512])
@pytest.mark.parametrize("T", [1, 4, 16, 32])
def test_dequantize_head_and_block_sizes(nv, D, T):
    for layout, scale_layout in (("HND", "vllm"), ("HND", "linear"), ("NHD", "linear")):
        if scale_layout == "vllm" and (T % 4 or D % 64):
            continue
        cache = make_cache(2, T, 2, D, "5d", layout, "numpy", seed=D + T)
        check_dequantize(nv, cache, 1.0, 0.5, scale_layout)


@pytest.mark.parametrize("scale_kind", ["float", "tensor", "scalar_tensor"])
@pytest.mark.parametrize("g", [1.0, 0.37, 1.0e-3, 3.5e3, 1.0e30])
def test_dequantize_global_scales_and_overflow(nv, scale_kind, g):
    # Large g makes fp16/bf16 outputs overflow: the RNE rounding of FORMAT.md §6 gives +-Inf.
    cache = make_cache(2, 4, 2, 64, "5d", "HND", "torch", seed=22)
    for dtype in ("float32", "float16", "bfloat16"):
        check_dequantize(nv, cache, make_scale(g, scale_kind), make_scale(g / 3, scale_kind),
                         "vllm", dtype)


def test_dequantize_dtype_objects(nv):
    cache_t = make_cache(1, 4, 2, 64, "5d", "HND", "torch", seed=23)
    check_dequantize(nv, cache_t, 2.0, 0.5, "vllm", "float16", torch.float16)
    check_dequantize(nv, cache_t, 2.0, 0.5, "vllm", "bfloat16", torch.bfloat16)
    check_dequantize(nv, cache_t, 2.0, 0.5, "vllm", "float32", torch.float32)
    cache_n = make_cache(1, 4, 2, 64, "5d", "HND", "numpy", seed=23)
    check_dequantize(nv, cache_n, 2.0, 0.5, "vllm", "float16", np.float16)
    check_dequantize(nv, cache_n, 2.0, 0.5, "vllm", "float32", np.float32)


def test_dequantize_default_dtype_is_float32(nv):
    cache = make_cache(1, 4, 1, 64, "5d", "HND", "numpy", seed=24)
    k, v = nv.dequantize(cache.kv_cache, 1.0, 1.0)
    assert k.dtype == np.float32 and v.dtype == np.float32


# ------------------------------------------------------------------------------- round trip
@st.composite
def roundtrip_cases(draw):
    backend = draw(st.sampled_from(BACKENDS))
    view, layout, scale_layout = draw(st.sampled_from(view_combos()))
    T = draw(st.sampled_from([1, 4, 16] if scale_layout == "linear" else [4, 16]))
    D = draw(st.sampled_from([16, 48, 64, 128] if scale_layout == "linear" else [64, 128, 256]))
    N, H = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    return {"backend": backend, "view": view, "layout": layout, "scale_layout": scale_layout,
                "T": T, "D": D, "N": N, "H": H, "n": draw(st.integers(1, 2 * N * T)),
                "in_dtype": draw(st.sampled_from(["float16", "float32"] +
                                              (["bfloat16"] if backend == "torch" else []))),
                "out_dtype": draw(st.sampled_from(dtypes_for(backend))),
                "recipe": draw(st.sampled_from(ref.RECIPES)),
                "k_scale": draw(st.sampled_from([1.0, 0.3, 0.02])),
                "v_scale": draw(st.sampled_from([1.0, 2.5, 0.004])),
                "slot_pattern": draw(st.sampled_from(["perm", "padded", "out_of_range"])),
                "seed": draw(st.integers(0, 2**32 - 1))}


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(c=roundtrip_cases())
def test_store_then_dequantize_roundtrip(nv, c):
    rng = np.random.default_rng(c["seed"])
    cache = make_cache(c["N"], c["T"], c["H"], c["D"], c["view"], c["layout"], c["backend"],
                       seed=c["seed"])
    k = mixed_tokens(rng, c["n"], c["H"], c["D"])
    v = mixed_tokens(rng, c["n"], c["H"], c["D"])
    key, value, k32, v32 = make_kv(k, v, c["in_dtype"], c["backend"])
    slots = make_slots(draw_slots(rng, c["slot_pattern"], c["n"], c["N"], c["T"]),
                       backend=c["backend"])
    snap = cache.snapshot()
    want = expected_store(cache, snap, k32, v32, slots, c["k_scale"], c["v_scale"], c["recipe"],
                          c["scale_layout"])
    nv.store(key, value, slot_mapping=slots, k_scale=c["k_scale"], v_scale=c["v_scale"],
             recipe=c["recipe"], scale_layout=c["scale_layout"], **cache.kwargs())
    assert_bytes_equal(cache.snapshot(), want, cache)
    check_dequantize(nv, cache, c["k_scale"], c["v_scale"], c["scale_layout"], c["out_dtype"])
