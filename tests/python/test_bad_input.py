"""Every rejected call: the right exception type, a message naming the argument, and the cache
byte-for-byte unchanged afterwards (docs/python-api.md: errors)."""
import math

import numpy as np
import pytest
from conftest import make_cache, make_kv, make_slots, mixed_tokens

torch = pytest.importorskip("torch")

N, T, H, D = 2, 4, 2, 64
F = 9 * D // 16


class Setup:
    """A valid store() call whose pieces the cases below break one at a time."""

    def __init__(self, backend, view="5d", layout="HND", T_=T, D_=D, n=3):
        rng = np.random.default_rng(50)
        self.backend = backend
        self.cache = make_cache(N, T_, H, D_, view, layout, backend, seed=51)
        k, v = mixed_tokens(rng, n, H, D_), mixed_tokens(rng, n, H, D_)
        self.key, self.value, _, _ = make_kv(k, v, "float32", backend)
        self.slots = make_slots([1, -1, 6][:n] + list(range(7, 7 + max(0, n - 3))), "int64",
                                backend)
        self.kw = {"k_scale": 1.0, "v_scale": 1.0, "recipe": "nvfp4", "scale_layout": "linear"}

    def store(self, **override):
        args = dict(key=self.key, value=self.value, slot_mapping=self.slots, **self.kw,
                    **self.cache.kwargs())
        args.update(override)
        return lambda nv: nv.store(**args)

    def arr(self, a):
        """numpy array or torch tensor in this setup's framework."""
        return a if self.backend == "numpy" else torch.from_numpy(np.ascontiguousarray(a))


def assert_rejected(nv, setup, call, exc, match):
    before = setup.cache.snapshot()
    with pytest.raises(exc, match=match):
        call(nv)
    assert np.array_equal(setup.cache.snapshot(), before), "a rejected call wrote to the cache"


BACKENDS = ("numpy", "torch")


# ----------------------------------------------------------------------------------- the cache
def test_read_only_numpy_cache(nv):
    s = Setup("numpy")
    s.cache.kv_cache.flags.writeable = False
    assert_rejected(nv, s, s.store(), ValueError, "kv_cache")


def test_read_only_numpy_value_cache(nv):
    s = Setup("numpy", view="sides")
    s.cache.value_cache.flags.writeable = False
    assert_rejected(nv, s, s.store(), ValueError, "value_cache")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", ["int8", "float16"])
def test_cache_not_uint8(nv, backend, bad):
    s = Setup(backend)
    kv = s.cache.kv_cache
    if bad == "int8":  # same bytes, wrong dtype
        wrong = kv.view(np.int8) if backend == "numpy" else kv.view(torch.int8)
    else:  # a float cache of the same logical shape
        wrong = s.arr(np.zeros(tuple(kv.shape), np.float16))
    assert_rejected(nv, s, s.store(kv_cache=wrong), TypeError, "kv_cache")


def test_cache_as_float8_names_the_dtype(nv):
    # The same bytes viewed as float8 (an engine's fp8 cache habit): the message names the
    # dtype, not DLPack's code 10.
    s = Setup("torch")
    wrong = s.cache.kv_cache.view(torch.float8_e4m3fn)
    assert_rejected(nv, s, s.store(kv_cache=wrong), TypeError,
                    "kv_cache: dtype float8_e4m3fn received; expected uint8")


@pytest.mark.parametrize("backend", BACKENDS)
def test_value_cache_not_uint8(nv, backend):
    s = Setup(backend, view="sides")
    vc = s.cache.value_cache
    wrong = vc.view(np.int8) if backend == "numpy" else vc.view(torch.int8)
    assert_rejected(nv, s, s.store(value_cache=wrong), TypeError, "value_cache")


def _padded_rows(backend, shape):
    """A uint8 array of `shape` whose last dim is a slice of wider rows: not a contiguous run."""
    wide = np.zeros(shape[:-1] + (shape[-1] + 16,), np.uint8)
    sliced = wide[..., : shape[-1]]
    return sliced if backend == "numpy" else torch.from_numpy(wide)[..., : shape[-1]]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("which", ["key_cache", "value_cache"])
def test_side_not_contiguous(nv, backend, which):
    s = Setup(backend, view="sides")
    bad = _padded_rows(backend, (N, T, H, F))
    if which == "key_cache":
        call = s.store(kv_cache=bad)
        match = "key_cache|kv_cache"  # store() calls the K side kv_cache; the vLLM op key_cache
    else:
        call = s.store(value_cache=bad)
        match = "value_cache"
    assert_rejected(nv, s, call, ValueError, match)


@pytest.mark.parametrize("backend", BACKENDS)
def test_5d_cache_with_non_contiguous_sides(nv, backend):
    s = Setup(backend)
    bad = _padded_rows(backend, (N, 2, H, T, F))
    bad = bad.transpose(2, 3) if backend == "torch" else bad.swapaxes(2, 3)
    assert_rejected(nv, s, s.store(kv_cache=bad), ValueError, "kv_cache")


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_4d_not_contiguous(nv, backend):
    s = Setup(backend, view="packed4d")
    bad = _padded_rows(backend, (N, 2 * H, T, F))
    assert_rejected(nv, s, s.store(kv_cache=bad), ValueError, "kv_cache")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(N, 2 * H * T * F), (N, 2, H * T * F),
                                   (1, N, 2, T, H, F), (N, 3, T, H, F)],
                         ids=["2d", "3d", "6d", "5d_not_2_sides"])
def test_cache_wrong_rank_or_shape(nv, backend, shape):
    s = Setup(backend)
    bad = s.arr(np.zeros(shape, np.uint8))
    assert_rejected(nv, s, s.store(kv_cache=bad), ValueError, "kv_cache")


@pytest.mark.parametrize("backend", BACKENDS)
def test_5d_cache_with_value_cache_says_to_drop_it(nv, backend):
    # Both sides in one 5-D cache, and value_cache given as well: the message says the 5-D cache
    # goes alone (review: it named only the K side's expected shape).
    s = Setup(backend, view="sides")
    both = s.arr(np.zeros((N, 2, T, H, F), np.uint8))
    assert_rejected(nv, s, s.store(kv_cache=both), ValueError, r"key_cache: rank 5 .*pass it without value_cache")


@pytest.mark.parametrize("backend", BACKENDS)
def test_cache_head_dim_mismatch(nv, backend):
    s = Setup(backend)
    bad = s.arr(np.zeros((N, 2, T, H, 9 * 128 // 16), np.uint8))  # F of D=128, key has D=64
    assert_rejected(nv, s, s.store(kv_cache=bad), ValueError, "kv_cache|key")


@pytest.mark.parametrize("backend", BACKENDS)
def test_cache_num_heads_mismatch(nv, backend):
    s = Setup(backend)
    bad = s.arr(np.zeros((N, 2, T, H + 1, F), np.uint8))
    assert_rejected(nv, s, s.store(kv_cache=bad), ValueError, "kv_cache|key")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad_F", [F + 1, F + 8])
def test_cache_last_dim_not_9d_over_16(nv, backend, bad_F):
    # 37 and 44 bytes hold 4 whole 9-byte units, as 36 does: no head size at all, not D 64
    # (mutation testing: without the F % 9 test the store wrote 36-byte rows into them).
    s = Setup(backend)
    bad = s.arr(np.zeros((N, 2, T, H, bad_F), np.uint8))
    assert_rejected(nv, s, s.store(kv_cache=bad), ValueError, f"last dimension {bad_F}")
    assert not np.asarray(bad).any()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", ["5d", "sides"])
def test_pages_one_byte_closer_than_a_page(nv, backend, form):
    # Pages must lie at least a page apart; one byte less makes neighbours share a byte (mutation
    # testing: only a stride of 0 was tried). Slot 6 is in page 1.
    s = Setup(backend)
    side = T * H * F
    buf = np.zeros(4 * 2 * side, np.uint8) if backend == "numpy" else torch.zeros(4 * 2 * side, dtype=torch.uint8)

    def strided(shape, strides, offset=0):
        if backend == "numpy":
            return np.lib.stride_tricks.as_strided(buf[offset:], shape, strides, writeable=True)
        return torch.as_strided(buf, shape, strides, offset)

    if form == "5d":
        call = s.store(kv_cache=strided((N, 2, T, H, F), (2 * side - 1, side, F, T * F, 1)))
    else:
        call = s.store(kv_cache=strided((N, T, H, F), (side - 1, F, T * F, 1)),
                       value_cache=strided((N, T, H, F), (side, F, T * F, 1), 2 * side))
    with pytest.raises(ValueError, match="page stride"):
        call(nv)
    assert not buf.any()


# ------------------------------------------------------------------------------- key / value
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("Dk", [24, 40])
def test_head_size_not_multiple_of_16(nv, backend, Dk):
    s = Setup(backend)
    k = s.arr(np.ones((3, H, Dk), np.float32))
    assert_rejected(nv, s, s.store(key=k, value=k), ValueError, "key")


@pytest.mark.parametrize("backend", BACKENDS)
def test_head_size_above_512(nv, backend):
    s = Setup(backend)
    k = s.arr(np.ones((3, H, 528), np.float32))
    big = make_cache(N, T, H, 528, "5d", "HND", backend, seed=52)
    s.cache = big  # compare the cache actually passed
    # D is read off both key and the cache F, so either may be named.
    assert_rejected(nv, s, s.store(key=k, value=k, **big.kwargs()), ValueError, "key|kv_cache")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("what", ["tokens", "heads"])
def test_key_value_shape_mismatch(nv, backend, what):
    s = Setup(backend)
    shape = (2, H, D) if what == "tokens" else (3, H + 1, D)
    v = s.arr(np.ones(shape, np.float32))
    assert_rejected(nv, s, s.store(value=v), ValueError, "value|key")


@pytest.mark.parametrize("backend", BACKENDS)
def test_key_value_dtype_mismatch(nv, backend):
    s = Setup(backend)
    v = s.arr(np.ones((3, H, D), np.float16))
    assert_rejected(nv, s, s.store(value=v), TypeError, "value|key")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [np.float64, np.int32, np.uint8])
def test_key_unsupported_dtype(nv, backend, dtype):
    s = Setup(backend)
    k = s.arr(np.ones((3, H, D), dtype))
    assert_rejected(nv, s, s.store(key=k, value=k), TypeError, "key")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(3, H * D), (1, 3, H, D)], ids=["2d", "4d"])
def test_key_wrong_rank(nv, backend, shape):
    s = Setup(backend)
    k = s.arr(np.ones(shape, np.float32))
    assert_rejected(nv, s, s.store(key=k), ValueError, "key")


@pytest.mark.parametrize("backend", BACKENDS)
def test_key_last_dim_not_unit_stride(nv, backend):
    s = Setup(backend)
    wide = np.ones((3, H, 2 * D), np.float32)
    k = wide[..., ::2] if backend == "numpy" else torch.from_numpy(wide)[..., ::2]
    assert_rejected(nv, s, s.store(key=k), ValueError, "key")


# -------------------------------------------------------------------------------- slot_mapping
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int16, np.uint8])
def test_slot_mapping_wrong_dtype(nv, backend, dtype):
    s = Setup(backend)
    slots = s.arr(np.array([1, 0, 6], dtype))
    assert_rejected(nv, s, s.store(slot_mapping=slots), TypeError, "slot_mapping")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("slots", [[1, 2, 3, 4], [[1, 2, 3]]], ids=["long", "2d"])
def test_slot_mapping_wrong_shape(nv, backend, slots):
    # More slots than key rows, or not a vector. (Fewer slots than rows is CUDA-graph padding:
    # test_store_cpu.py::test_padded_rows_store_the_first_slot_mapping_rows.)
    s = Setup(backend)
    assert_rejected(nv, s, s.store(slot_mapping=s.arr(np.array(slots, np.int64))), ValueError,
                    "slot_mapping")


# ---------------------------------------------------------------------------- global scales
# 1e-45 and 1e-39 are fp32 denormals whose reciprocal overflows; 1e39 overflows fp32 itself.
BAD_SCALES = [0.0, -0.0, -1.0, math.nan, math.inf, -math.inf, 1e-45, 1e-39, 1e39]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("which", ["k_scale", "v_scale"])
@pytest.mark.parametrize("g", BAD_SCALES, ids=str)
def test_invalid_global_scale_float(nv, backend, which, g):
    s = Setup(backend)
    assert_rejected(nv, s, s.store(**{which: g}), ValueError, which)


@pytest.mark.parametrize("which", ["k_scale", "v_scale"])
def test_scale_messages_name_the_number(nv, which):
    """Found by review: 1e39 (finite, but no float32) was reported as "inf received" (and 1e-50 as
    "0 received"), a huge int was echoed whole; numpy strings and complex numbers were read as
    floats."""
    s = Setup("numpy")
    assert_rejected(nv, s, s.store(**{which: 1e39}), ValueError, f"{which}: 1e\\+39 received.*float32")
    for tiny in (1e-50, np.float64(1e-50), -1e-50):  # 0 in float32: was reported as "0 received"
        assert_rejected(nv, s, s.store(**{which: tiny}), ValueError,
                        f"{which}: (np.float64\\()?-?1e-50\\)? received.*float32")
    assert_rejected(nv, s, s.store(**{which: 2**1100}), ValueError, f"{which}: 1358298529.*332 digits")
    for g in (np.str_("0.01"), np.array("0.01"), np.complex64(0.01 + 5j), np.array(0.01 + 5j)):
        assert_rejected(nv, s, s.store(**{which: g}), TypeError, f"{which}: a numpy")
    # The range stated is the one taken: a scale whose reciprocal is not finite (below about
    # 2.9388e-39) is refused too, whether float32 can hold it or not (an integrator's review: the
    # message said "float32 holds 1.4e-45 to 3.4028235e+38" for 1e-46, and 1e-44 was then refused).
    for g in (1e-46, 1e-44, np.float32(1e-40), np.array([1e-40], np.float32)):
        assert_rejected(nv, s, s.store(**{which: g}), ValueError, r"finite reciprocal \(about 2\.9388e-39 to")
    s.store(**{which: 2.9388e-39})(nv)  # the bound as printed is taken


@pytest.mark.parametrize("which", ["k_scale", "v_scale"])
@pytest.mark.parametrize("g", BAD_SCALES, ids=str)
def test_invalid_global_scale_cpu_tensor(nv, which, g):
    s = Setup("torch")
    t = torch.tensor([g], dtype=torch.float32)
    assert_rejected(nv, s, s.store(**{which: t}), ValueError, which)


@pytest.mark.parametrize("which", ["k_scale", "v_scale"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16, torch.int32])
def test_global_scale_tensor_wrong_dtype(nv, which, dtype):
    s = Setup("torch")
    t = torch.ones(1, dtype=dtype)
    assert_rejected(nv, s, s.store(**{which: t}), TypeError, which)


# ------------------------------------------------------------------------- names and layouts
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("recipe", ["nvfp4x", "fp8", "", "NVFP4", None])
def test_unknown_recipe(nv, backend, recipe):
    s = Setup(backend)
    assert_rejected(nv, s, s.store(recipe=recipe), ValueError, "recipe")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale_layout", ["interleaved", "", "VLLM", None])
def test_unknown_scale_layout(nv, backend, scale_layout):
    s = Setup(backend)
    assert_rejected(nv, s, s.store(scale_layout=scale_layout), ValueError, "scale_layout")


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "auto", "fp8_e4m3", "nvfp4 ", "bfloat16"])
def test_reshape_and_cache_flash_unknown_kv_cache_dtype(nv, kv_cache_dtype):
    s = Setup("torch", view="sides")
    kc, vc = s.cache.sides_pair()
    one = torch.ones(1, dtype=torch.float32)
    call = lambda nv: nv.reshape_and_cache_flash(s.key, s.value, kc, vc, s.slots,
                                                 kv_cache_dtype, one, one, scale_layout="linear")
    assert_rejected(nv, s, call, ValueError, "kv_cache_dtype")


def test_reshape_and_cache_flash_bad_key_cache_dtype(nv):
    s = Setup("torch", view="sides")
    kc, vc = s.cache.sides_pair()
    call = lambda nv: nv.reshape_and_cache_flash(s.key, s.value, kc.view(torch.int8), vc,
                                                 s.slots, "nvfp4", 1.0, 1.0,
                                                 scale_layout="linear")
    assert_rejected(nv, s, call, TypeError, "key_cache|kv_cache")


# Combination errors name either the layout choice or the cache it does not fit (the contract
# does not say which), hence the alternatives in `match`.
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("T_", [1, 2, 6])
def test_interleaved_scales_need_T_multiple_of_4(nv, backend, T_):
    s = Setup(backend, T_=T_, n=2)
    assert_rejected(nv, s, s.store(scale_layout="vllm"), ValueError,
                    "scale_layout|kv_cache")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("D_", [16, 32, 48, 80])
def test_interleaved_scales_need_D_multiple_of_64(nv, backend, D_):
    s = Setup(backend, D_=D_)
    assert_rejected(nv, s, s.store(scale_layout="vllm"), ValueError,
                    "scale_layout|kv_cache|key")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("view", ["5d", "sides"])
def test_interleaved_scales_need_HND(nv, backend, view):
    s = Setup(backend, view=view, layout="NHD")
    assert_rejected(nv, s, s.store(scale_layout="vllm"), ValueError,
                    "scale_layout|kv_cache|key_cache|value_cache")


@pytest.mark.parametrize("backend", BACKENDS)
def test_sides_with_different_layouts(nv, backend):
    s = Setup(backend, view="sides")
    other = make_cache(N, T, H, D, "sides", "NHD", backend, seed=53)
    assert_rejected(nv, s, s.store(value_cache=other.value_cache), ValueError,
                    "value_cache|key_cache|kv_cache")


# ------------------------------------------------------------------------------- dequantize
@pytest.mark.parametrize("backend", BACKENDS)
def test_dequantize_rejects(nv, backend):
    s = Setup(backend)
    kv = s.cache.kv_cache
    wrong = kv.view(np.int8) if backend == "numpy" else kv.view(torch.int8)
    cases = [
        (lambda nv: nv.dequantize(wrong, 1.0, 1.0), TypeError, "kv_cache"),
        (lambda nv: nv.dequantize(kv, 1.0, 1.0, scale_layout="bogus"), ValueError, "scale_layout"),
        (lambda nv: nv.dequantize(s.arr(np.zeros((N, 2, 8), np.uint8)), 1.0, 1.0), ValueError,
         "kv_cache"),
        (lambda nv: nv.dequantize(kv, 1.0, 1.0, dtype="int8"), (TypeError, ValueError), "dtype"),
    ]
    for call, exc, match in cases:
        assert_rejected(nv, s, call, exc, match)


# ----------------------------------------------------------------------- misaligned addresses
def at_odd_byte(a):
    """A copy of numpy array `a` whose address is one byte past an element boundary."""
    buf = np.zeros(a.nbytes + a.itemsize, np.uint8)
    out = buf[1:1 + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    assert out.ctypes.data % a.itemsize != 0
    return out


def test_misaligned_arrays_rejected(nv):
    """Every path reads elements at their type (docs/c-api.md: checked by every entry point), so
    an element at an odd byte is a ValueError before anything is read or written, on every
    device: on a GPU the load would fault and end the CUDA context."""
    s = Setup("numpy")
    kv = s.cache.kv_cache
    q = np.zeros((1, 2 * H, D), np.float16)
    bt, lens = np.zeros((1, 1), np.int32), np.ones(1, np.int32)
    deq_out = np.zeros((N, T, H, D), np.float32)
    cases = [
        (s.store(key=at_odd_byte(s.key)), "key"),
        (s.store(value=at_odd_byte(s.value)), "value"),
        (s.store(slot_mapping=at_odd_byte(s.slots)), "slot_mapping"),
        (s.store(k_scale=at_odd_byte(np.ones(1, np.float32))), "k_scale"),
        (lambda nv: nv.dequantize(kv, 1.0, 1.0, scale_layout="linear",
                                  key_out=at_odd_byte(deq_out), value_out=deq_out), "key_out"),
        (lambda nv: nv.decode_attention(at_odd_byte(q), kv, bt, lens, 1.0, 1.0,
                                        scale_layout="linear"), "query"),
        (lambda nv: nv.decode_attention(q, kv, at_odd_byte(bt), lens, 1.0, 1.0,
                                        scale_layout="linear"), "block_table"),
        (lambda nv: nv.amax(at_odd_byte(s.key)), "x"),
        (lambda nv: nv.amax(s.key, at_odd_byte(np.zeros(1, np.float32))), "out"),
    ]
    for call, name in cases:
        assert_rejected(nv, s, call, ValueError, f"{name}: address not a multiple of its element size")
    # A type no path reads stays a dtype error wherever it lies.
    assert_rejected(nv, s, s.store(key=at_odd_byte(s.key.astype(np.float64))), TypeError, "key: dtype float64")
    # The same arrays at aligned addresses are taken (the cases test the address, nothing else).
    s.store()(nv)
    nv.decode_attention(q, kv, bt, lens, 1.0, 1.0, scale_layout="linear")
    nv.amax(s.key)


def test_array_its_exporter_refuses_says_why(nv):
    s = Setup("numpy")
    assert_rejected(nv, s, s.store(key=s.key.astype(">f4")), TypeError, "key: expected an array supporting "
                    "DLPack.*got ndarray: .*byte order")


# ------------------------------------------------------------- checks before an output is allocated
def test_bad_arguments_are_named_before_outputs_are_allocated():
    """Found by fuzzing: the Python layer allocated outputs from arguments the C ABI would refuse
    (a query of 2^36 rows, a bf16 cache, cu_seqlens of the wrong length ending at 2^40), so the
    call ended in the allocator's MemoryError naming no argument; and it read index arrays of any
    dtype or layout on the host (complex, sparse) with the framework's errors."""
    torch = pytest.importorskip("torch")
    import nvfp4kv

    kv = nvfp4kv.allocate_kv_cache(nvfp4kv.KVCacheSpec(16, 2, 64), 2)
    bt = torch.zeros(1, 2, dtype=torch.int32)
    sl = torch.ones(1, dtype=torch.int32)
    q = torch.zeros(1, 4, 64, dtype=torch.bfloat16).expand(2**36, 4, 64)  # no memory behind it
    with pytest.raises(ValueError, match="^query: 68719476736 rows .* expected 1 rows"):
        nvfp4kv.decode_attention(q, kv, bt, sl)
    bf16 = torch.zeros(1, 2, 16, 2, 64, dtype=torch.bfloat16).expand(2**24, 2, 16, 2, 64)
    with pytest.raises(TypeError, match="^kv_cache: dtype torch.bfloat16"):
        nvfp4kv.dequantize(bf16, scale_layout="linear")
    with pytest.raises(TypeError, match="^kv_cache: dtype torch.bfloat16"):
        nvfp4kv.gather_dequant(bf16, bt, sl, scale_layout="linear")
    for cu, exc, needle in [(torch.tensor([0, 1, 2**40]), ValueError, "^cu_seqlens: 3 entries received; expected 2"),
                            (torch.tensor([0, 1], dtype=torch.complex64), TypeError, "^cu_seqlens: dtype"),
                            (torch.tensor([0, 1]).to_sparse(), TypeError, "^cu_seqlens: a torch tensor of layout"),
                            (np.array([0.0, np.nan]), TypeError, "^cu_seqlens: dtype"),
                            (np.array([0, 2**64 - 1], np.uint64), TypeError, "^cu_seqlens: dtype"),
                            (torch.tensor([0, 2**63 - 1]), ValueError, "^cu_seqlens: .* cannot be allocated")]:
        with pytest.raises(exc, match=needle):
            nvfp4kv.gather_dequant(kv, bt, sl, cu_seqlens=cu)
    with pytest.raises(TypeError, match="^seq_lens: a torch tensor of layout"):
        nvfp4kv.gather_dequant(kv, bt, torch.tensor([1]).to_sparse())


def test_overlapping_pages_named_before_outputs_are_allocated():
    """Review: one page expand()ed (or broadcast) to 10^7 pages went to the allocator for 655 GB of
    outputs before the C ABI refused its overlapping pages; now refused first, in the ABI's words
    (without its "nvfp4kv_dequantize_pages: "), for each cache form. A cache whose pages are one page apart still reads."""
    torch = pytest.importorskip("torch")
    import nvfp4kv

    one = torch.zeros(1, 2, 16, 8, 72, dtype=torch.uint8)
    cases = [(one.expand(10**7, 2, 16, 8, 72), None, "^kv_cache: page stride 0 bytes .* one page \\(18432 bytes\\)"),
             (one.view(1, 16, 16, 72).expand(10**7, 16, 16, 72), None, "^kv_cache: page stride 0 bytes"),
             (one[:, 0].expand(10**7, 16, 8, 72), one[:, 1].expand(10**7, 16, 8, 72),
              "^key_cache: page stride 0 bytes .* \\(9216 bytes\\)"),
             (one[:, 0].expand(3, 16, 8, 72).contiguous(), one[:, 1].expand(3, 16, 8, 72),
              "^value_cache: page stride 0 bytes"),
             (np.broadcast_to(one.numpy(), (10**7, 2, 16, 8, 72)), None, "^kv_cache: page stride 0 bytes"),
             # one byte short of a page (mutation testing: the bound checked one byte too low)
             (torch.zeros(3 * 18432, dtype=torch.uint8).as_strided((3, 2, 16, 8, 72), (18431, 9216, 72, 1152, 1)),
              None, "^kv_cache: page stride 18431 bytes")]
    for kv, vc, needle in cases:
        with pytest.raises(ValueError, match=needle):
            nvfp4kv.dequantize(kv, 1.0, 1.0, value_cache=vc, scale_layout="linear")
    # Shapes the ABI refuses keep its messages (review: they were called page-stride errors).
    side = torch.zeros(3, 16, 8, 72, dtype=torch.uint8)
    for kv, vc, exc, needle in [(torch.zeros(3, 1, 16, 8, 72, dtype=torch.uint8), None, ValueError, "expected \\(num_blocks, 2"),
                                (np.zeros((3, 0, 16, 8, 72), np.uint8), None, ValueError, "expected \\(num_blocks, 2"),
                                (side, torch.zeros(3, 16, 4, 72, dtype=torch.uint8), ValueError, "does not match"),
                                (torch.zeros(3, 2, 16, 8, 72, dtype=torch.uint8).to_sparse(), None, TypeError, "layout")]:
        with pytest.raises(exc, match=needle):
            nvfp4kv.dequantize(kv, 1.0, 1.0, value_cache=vc, scale_layout="linear")
    k, v = nvfp4kv.dequantize(one.expand(3, 2, 16, 8, 72).contiguous(), 1.0, 1.0, scale_layout="linear")
    assert tuple(k.shape) == (3, 16, 8, 128) and not k.any()


@pytest.mark.parametrize("sides", [False, True])
def test_head_count_equal_to_the_block_size_names_both_causes(nv, sides):
    """Found by review: a key of T heads (T the block size) for a cache of fewer heads was called a
    cache with exchanged dimensions. Both causes are named now, and nothing is written."""
    kv = torch.zeros(2, 2, 16, 2, 36, dtype=torch.uint8)  # (N, 2, T, H, F): T 16, H 2, D 64
    key = torch.randn(3, 16, 64)  # 16 heads
    kw = dict(value_cache=kv[:, 1]) if sides else {}
    cache = kv[:, 0] if sides else kv
    name, dims = ("key_cache", "1 and 2") if sides else ("kv_cache", "2 and 3")
    with pytest.raises(ValueError, match=f"{name}: shape .* has a KV head count of 2 .* but key has 16 heads, .* either key "
                                         f"has the wrong head count, or the cache's dimensions {dims} are exchanged"):
        nv.store(key, key, cache, torch.arange(3), 1.0, 1.0, scale_layout="linear", **kw)
    assert not kv.any()


def test_dequantize_errors_name_the_entry_point_called(nv):
    """Found by review: a dequantize without pages was refused as "nvfp4kv_dequantize_pages"; the
    binding now calls the plain entry point there, whose name its errors carry (as the store's)."""
    kv = torch.zeros(4, 2, 16, 2, 36, dtype=torch.uint8)
    small = torch.zeros(3, 16, 2, 64)
    with pytest.raises(ValueError, match="^nvfp4kv_dequantize: key_out: shape"):
        nv.dequantize(kv, key_out=small, value_out=small, scale_layout="linear")
    with pytest.raises(ValueError, match="^nvfp4kv_dequantize_pages: key_out: shape"):
        nv.dequantize(kv, pages=torch.arange(2), key_out=small, value_out=small, scale_layout="linear")
