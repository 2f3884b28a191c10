"""nvfp4kv.amax, the scale conversions and ScaleTracker (nvfp4kv/scales.py, nvfp4kv_amax).

The amax is checked against numpy's max |x| bit for bit over dtypes, shapes and strides; the GPU
cases (skipped without CUDA) against the CPU path bit for bit, and inside a CUDA graph.
"""

import math
import sys
import warnings

import numpy as np
import pytest

nvfp4kv = pytest.importorskip("nvfp4kv")
from nvfp4kv import scales  # noqa: E402

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="needs torch")
needs_cuda = pytest.mark.skipif(
    torch is None or not torch.cuda.is_available() or not nvfp4kv.build_info()["cuda_available"],
    reason="needs a CUDA device and a CUDA build of nvfp4kv")


def bits(x):
    return np.asarray(x, dtype=np.float32).view(np.uint32)


def np_amax(x):
    """max |x| in float32 (NaN if any NaN; 0 for an empty x)."""
    a = np.abs(np.asarray(x, dtype=np.float32))
    if a.size == 0:
        return np.float32(0)
    return np.float32(np.nan) if np.isnan(a).any() else a.max()


# ---- amax: values ----------------------------------------------------------------------------------

SHAPES = [(), (1,), (7,), (1000,), (3, 5), (4, 8, 128), (2, 3, 4, 5), (2, 1, 3, 1, 2, 1, 2, 3)]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_amax_numpy(shape, dtype):
    rng = np.random.default_rng(hash(shape) % 1000)
    x = (rng.standard_normal(shape) * 10).astype(dtype)
    out = nvfp4kv.amax(x)
    assert out.shape == (1,) and out.dtype == np.float32 and isinstance(out, np.ndarray)
    assert bits(out[0]) == bits(np_amax(x))


@needs_torch
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("view", ["contiguous", "transposed", "columns", "negative", "broadcast", "fused_qkv",
                                  "every_other"])
def test_amax_torch_views(dtype, view):
    g = torch.Generator().manual_seed(3)
    base = torch.randn(6, 40, 3, 16, generator=g).mul_(100).to(getattr(torch, dtype))
    if view == "contiguous":
        x = base
    elif view == "transposed":
        x = base.transpose(0, 2)
    elif view == "columns":
        x = base[:, :, 1, 3:11]
    elif view == "negative":  # numpy: negative strides
        x = None
    elif view == "broadcast":
        x = base[:, :1].expand(6, 50, 3, 16)
    elif view == "fused_qkv":
        x = base.reshape(6 * 40, 48)[:, 16:32].reshape(6, 40, 1, 16)
    else:
        x = base.reshape(-1)[::2]
    if x is None:
        xn = base.float().numpy()[::-1, ::-2]
        assert bits(nvfp4kv.amax(xn)[0]) == bits(np_amax(xn))
        return
    out = nvfp4kv.amax(x)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32 and out.shape == (1,)
    want = x.float().abs().max()
    assert out[0].view(torch.int32).item() == want.view(torch.int32).item()


def test_amax_nan_inf_and_signs():
    x = np.array([1.0, -5.0, 2.0], np.float32)
    assert nvfp4kv.amax(x)[0] == 5.0
    x[1] = -np.inf
    assert nvfp4kv.amax(x)[0] == np.inf
    x[2] = np.nan
    assert bits(nvfp4kv.amax(x)[0]) == 0x7FC00000
    neg_nan = np.array([0x7FFFFFFF | 0x80000000, 0x7F800001], np.uint32).view(np.float32)  # NaN payloads
    assert bits(nvfp4kv.amax(neg_nan)[0]) == 0x7FC00000
    h = np.array([-0.0, 0.0], np.float16)
    assert bits(nvfp4kv.amax(h)[0]) == 0  # +0, never -0
    sub = np.array([np.float16(2 ** -24), -np.float16(2 ** -20)], np.float16)  # float16 subnormals, exact
    assert nvfp4kv.amax(sub)[0] == np.float32(2 ** -20)


def test_amax_empty_and_accumulate():
    out = np.array([3.0], np.float32)
    empty = np.zeros((0, 8), np.float32)
    nvfp4kv.amax(empty, out, accumulate=True)
    assert out[0] == 3.0  # unchanged
    nvfp4kv.amax(empty, out)
    assert out[0] == 0.0 and bits(out[0]) == 0
    nvfp4kv.amax(np.array([2.0, -1.0], np.float32), out, accumulate=True)
    assert out[0] == 2.0
    nvfp4kv.amax(np.array([-7.0], np.float32), out, accumulate=True)
    assert out[0] == 7.0
    nvfp4kv.amax(np.array([1.0], np.float32), out, accumulate=True)
    assert out[0] == 7.0  # a smaller batch does not lower it
    nvfp4kv.amax(np.array([1.0], np.float32), out)
    assert out[0] == 1.0  # without accumulate: overwritten
    nvfp4kv.amax(np.array([np.nan], np.float32), out, accumulate=True)
    nvfp4kv.amax(np.array([1e30], np.float32), out, accumulate=True)
    assert np.isnan(out[0])  # NaN is sticky
    out[0] = -4.0  # a negative stored amax counts as below every |x|
    nvfp4kv.amax(np.array([0.0], np.float32), out, accumulate=True)
    assert bits(out[0]) == 0
    out[:] = np.array([0xFFC00000], np.uint32).view(np.float32)  # so does a negative NaN (x86's inf - inf)
    nvfp4kv.amax(np.array([1.0], np.float32), out, accumulate=True)
    assert out[0] == 1.0
    with pytest.raises(ValueError, match="accumulate"):
        nvfp4kv.amax(np.ones(3, np.float32), accumulate=True)


def test_amax_multithreaded_matches():
    x = np.random.default_rng(0).standard_normal((3, 1 << 18)).astype(np.float32)
    x[2, 12345] = 77.0
    try:
        for threads in (1, 2, 5):
            nvfp4kv.set_cpu_threads(threads)
            assert nvfp4kv.amax(x)[0] == 77.0
            assert nvfp4kv.amax(x[:, ::3])[0] == np_amax(x[:, ::3])
    finally:
        nvfp4kv.set_cpu_threads(0)


@pytest.mark.parametrize("threads", [2, 3])
def test_amax_sees_the_elements_past_the_last_whole_share(threads):
    """Mutation testing: shares that dropped the remainder of numel / threads passed, as every
    size tested divided evenly. The largest magnitude sits in the remainder and elsewhere."""
    n = threads * (1 << 17) + threads - 1  # a share per 2^17 elements, threads - 1 left over
    try:
        nvfp4kv.set_cpu_threads(threads)
        for where in (n - 1, n - threads + 1, 0, n // 2):
            x = np.zeros(n, np.float32)
            x[where] = -7.5
            assert nvfp4kv.amax(x)[0] == 7.5, where
    finally:
        nvfp4kv.set_cpu_threads(0)


def test_amax_rejects():
    x = np.ones(4, np.float32)
    with pytest.raises(TypeError, match="x: dtype int32"):
        nvfp4kv.amax(np.ones(4, np.int32))
    with pytest.raises(TypeError, match="out: dtype float64"):
        nvfp4kv.amax(x, np.zeros(1, np.float64))
    with pytest.raises(ValueError, match="out: shape"):
        nvfp4kv.amax(x, np.zeros(2, np.float32))
    with pytest.raises(ValueError, match="shares memory"):
        nvfp4kv.amax(x, x[1:2])
    ro = np.zeros(1, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        nvfp4kv.amax(x, ro)
    with pytest.raises(ValueError, match="accumulate"):
        nvfp4kv._C.amax(x, np.zeros(1, np.float32), 3)
    with pytest.raises(TypeError):
        nvfp4kv.amax([1.0, 2.0])


# ---- conversions -----------------------------------------------------------------------------------

def test_conversions_known_values():
    assert nvfp4kv.decode_scale(448.0) == 1.0
    assert nvfp4kv.decode_scale(448.0, margin=2.0) == 2.0
    assert nvfp4kv.x6_from_decode(1.0) == pytest.approx(1 / 6)
    assert nvfp4kv.x6_from_decode(nvfp4kv.decode_scale(2688.0)) == 1.0
    assert nvfp4kv.encode_from_decode(1.0) == 6.0
    assert nvfp4kv.decode_from_encode(6.0) == 1.0
    assert nvfp4kv.decode_from_x6(1 / 6) == pytest.approx(1.0)
    # encode = 448 * 6 / amax, decode = amax / 448
    amax = 17.5
    assert nvfp4kv.encode_from_decode(nvfp4kv.decode_scale(amax)) == pytest.approx(448 * 6 / amax)
    assert nvfp4kv.x6_from_decode(nvfp4kv.decode_scale(amax)) == pytest.approx(amax / 2688)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_conversions_keep_a_numpy_scalars_dtype(dtype):
    """Found by review under NumPy 1.26 (which pyproject.toml allows): a float32 scalar or 0-d
    array times a Python float became float64 there, a scale the store refuses as an array. Each
    conversion keeps the input's dtype under either NumPy (CI runs the suite under both)."""
    for x in (dtype(3), np.array(3, dtype), np.array([3], dtype)):
        for f in (nvfp4kv.x6_from_decode, nvfp4kv.decode_from_x6, nvfp4kv.encode_from_decode,
                  nvfp4kv.decode_from_encode, nvfp4kv.decode_scale,
                  lambda a: nvfp4kv.decode_scale(a, margin=0.5)):
            assert np.asarray(f(x)).dtype == dtype, (f, x)
    k = np.ones((1, 1, 64), np.float32)
    cache = np.zeros((1, 2, 16, 1, 36), np.uint8)
    nvfp4kv.store(k, k, cache, np.array([0]), nvfp4kv.decode_scale(np.float32(6)),
                  nvfp4kv.decode_scale(np.array(6, np.float32)), scale_layout="linear")
    assert cache.any()


@pytest.mark.parametrize("kind", ["float", "numpy", "torch"])
def test_conversions_round_trip(kind):
    vals = [1e-3, 0.5, 1.0, 3.0, 448.0, 1e4]
    if kind == "float":
        xs = vals
    elif kind == "numpy":
        xs = [np.array(vals, np.float32)]
    else:
        if torch is None:
            pytest.skip("needs torch")
        xs = [torch.tensor(vals, dtype=torch.float32)]
    for x in xs:
        d = nvfp4kv.decode_scale(x)
        for there, back in ((nvfp4kv.x6_from_decode, nvfp4kv.decode_from_x6),
                            (nvfp4kv.encode_from_decode, nvfp4kv.decode_from_encode)):
            y = back(there(d))
            assert type(y) is type(d)
            np.testing.assert_allclose(np.asarray(y, dtype=np.float64), np.asarray(d, dtype=np.float64), rtol=1e-6)
        if kind != "float":
            assert d.dtype == x.dtype  # float32 stays float32


# ---- ScaleTracker ----------------------------------------------------------------------------------

def batches(seed, n, shape=(5, 2, 32), dtype=np.float32):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(shape) * rng.uniform(0.1, 20)).astype(dtype) for _ in range(n)]


def test_tracker_numpy_equals_max_over_batches():
    L = 3
    tr = nvfp4kv.ScaleTracker(L)
    ks = {i: batches(10 + i, 4) for i in range(L)}
    vs = {i: batches(20 + i, 4) for i in range(L)}
    for b in range(4):
        for i in range(L):
            tr.update(i, ks[i][b], vs[i][b][:, :, ::2])  # a strided view too
    for i in range(L):
        k_want = max(np_amax(x) for x in ks[i])
        v_want = max(np_amax(x[:, :, ::2]) for x in vs[i])
        assert tr.k_amax()[i] == k_want and tr.v_amax()[i] == v_want
    assert isinstance(tr.k_scales(), np.ndarray) and tr.k_scales().dtype == np.float32
    np.testing.assert_array_equal(tr.k_scales(), tr.k_amax() / np.float32(448))
    np.testing.assert_array_equal(tr.v_scales(margin=1.25), tr.v_amax() * 1.25 / np.float32(448))
    addr = tr.k_amax().__array_interface__["data"][0]
    tr.reset()
    assert (tr.k_amax() == 0).all() and (tr.v_amax() == 0).all()
    assert tr.k_amax().__array_interface__["data"][0] == addr  # fixed storage


@needs_torch
def test_tracker_torch_names_state_dict_and_errors():
    tr = nvfp4kv.ScaleTracker(["layers.0.attn", "layers.1.attn"], device="cpu")
    k = torch.randn(4, 2, 16, dtype=torch.bfloat16) * 3
    v = torch.randn(4, 2, 16, dtype=torch.bfloat16)
    tr.update("layers.1.attn", k, v)
    tr.update(0, v, None)
    assert tr.k_amax()[1].item() == k.float().abs().max().item()
    assert tr.k_amax()[0].item() == v.float().abs().max().item() and tr.v_amax()[0].item() == 0
    assert isinstance(tr.k_scales(), torch.Tensor)
    sd = tr.state_dict()
    tr2 = nvfp4kv.ScaleTracker(["layers.0.attn", "layers.1.attn"])
    tr2.load_state_dict(sd)
    assert torch.equal(tr2.k_amax(), tr.k_amax()) and torch.equal(tr2.v_amax(), tr.v_amax())
    with pytest.raises(ValueError, match="layers"):
        nvfp4kv.ScaleTracker(3).load_state_dict(sd)
    with pytest.raises(IndexError, match="out of range"):
        tr.update(2, k, v)
    with pytest.raises(IndexError, match="out of range"):
        nvfp4kv.ScaleTracker(2).update(-1, k, v)
    with pytest.raises(KeyError, match="layers.7"):
        tr.update("layers.7", k, v)
    with pytest.raises(TypeError, match="layer"):
        tr.update(1.0, k, v)
    for b in (True, np.True_, np.array(True), torch.tensor(True)):  # review: the 0-d bool tensor updated layer 1
        with pytest.raises(TypeError, match="layer: .* received; expected a layer index or name"):
            tr.update(b, k, v)
    tr.update(torch.tensor(1), k * 2, None)  # 0-d integer tensors and NumPy ints are indices
    tr.update(np.int64(1), k * 2, None)
    assert tr.k_amax()[1].item() == 2 * k.float().abs().max().item()
    tr.update(1, k, v)
    with pytest.raises(TypeError, match="value: .*dtype int32"):
        tr.update(0, k, torch.ones(3, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="no amax yet"):
        nvfp4kv.ScaleTracker(2).k_scales()
    with pytest.raises(ValueError):
        nvfp4kv.ScaleTracker(0)
    for layers in (True, False):  # not a count of 1 or 0 (mutation testing)
        with pytest.raises(TypeError, match="layers: bool"):
            nvfp4kv.ScaleTracker(layers)
    with pytest.raises(ValueError, match="distinct"):
        nvfp4kv.ScaleTracker(["a", "a"])


@needs_torch
def test_tracker_load_state_dict_names_what_is_wrong():
    """Found by review: a missing entry was a bare KeyError, a list "of shape None", numpy integer
    layers were refused though the constructor takes them, and a float64 amax past the float32
    range became inf silently. A refused state changes nothing."""
    tr = nvfp4kv.ScaleTracker(2, device="cpu")
    tr.update(0, torch.full((3,), 2.0), torch.full((3,), 5.0))
    before = tr.state_dict()
    z = torch.zeros(2)
    for state, error, says in [
            ({"layers": 2, "k_amax": z}, KeyError, "no 'v_amax' entry"),
            ([2, z, z], TypeError, "expected the dict state_dict"),
            ({"layers": 2, "k_amax": [1.0, 2.0], "v_amax": z}, TypeError, "k_amax is a list; expected an array"),
            ({"layers": 2, "k_amax": np.array([1e39, 1.0]), "v_amax": np.zeros(2)}, ValueError, "past the float32"),
    ]:
        with pytest.raises(error, match=says):
            tr.load_state_dict(state)
        assert torch.equal(tr.k_amax(), before["k_amax"]) and torch.equal(tr.v_amax(), before["v_amax"])
    tr.load_state_dict({"layers": np.int64(2), "k_amax": np.array([np.inf, 1.0]), "v_amax": np.zeros(2)})
    assert tr.k_amax().tolist() == [float("inf"), 1.0]  # an inf amax is one (data held an inf)


def test_tracker_state_dict_survives_numpy_savez_and_meta_is_named():
    """An integrator's review: np.savez / np.load give `layers` back as a 0-d integer array (a
    count) or a string array (names), and the tracker refused its own state with "layers array(2)
    do not match this tracker's 2"; a state loaded onto meta gave torch's RuntimeError from
    Tensor.item(). Now the first loads and the second is a ValueError naming the entry."""
    import io

    for layers in (2, ["q0", "q1"]):
        tr = nvfp4kv.ScaleTracker(layers)  # NumPy storage: its first update's framework
        tr.update(1, np.array([3.0], np.float32), np.array([-5.0], np.float32))
        buf = io.BytesIO()
        np.savez(buf, **{k: np.asarray(v) for k, v in tr.state_dict().items()})
        buf.seek(0)
        with np.load(buf) as z:
            state = {k: z[k] for k in z.files}
        back = nvfp4kv.ScaleTracker(layers)
        back.load_state_dict(state)
        assert np.asarray(back.k_amax()).tolist() == [0.0, 3.0] and np.asarray(back.v_amax()).tolist() == [0.0, 5.0]
        with pytest.raises(ValueError, match="do not match"):  # other names, or another count, still refused
            nvfp4kv.ScaleTracker(3 if layers == 2 else ["q0", "x"]).load_state_dict(state)
    if torch is None:
        return
    tr = nvfp4kv.ScaleTracker(2, device="cpu")
    tr.update(0, torch.tensor([2.0]))
    meta = torch.zeros(2, device="meta")
    with pytest.raises(ValueError, match="^state_dict: k_amax is a meta tensor"):
        tr.load_state_dict({"layers": 2, "k_amax": meta, "v_amax": torch.zeros(2)})
    assert tr.k_amax().tolist() == [2.0, 0.0]


@needs_torch
def test_tracker_load_state_dict_of_narrow_or_grad_arrays():
    """Found by review: a float16 NumPy state warned of an overflow (NumPy cast the float32 bound
    to float16 for the check), and a state that requires grad made the tracker's storage require
    grad, so a compiled update then refused to write it."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tr = nvfp4kv.ScaleTracker(1)
        tr.load_state_dict({"layers": 1, "k_amax": np.ones(1, np.float16), "v_amax": np.full(1, 2, np.float16)})
    assert tr.k_amax().tolist() == [1.0] and tr.v_amax().tolist() == [2.0]
    for tr in (nvfp4kv.ScaleTracker(1), nvfp4kv.ScaleTracker(1, device="cpu")):  # allocated by the load, before it
        tr.load_state_dict({"layers": 1, "k_amax": torch.nn.Parameter(torch.tensor([2.0])), "v_amax": torch.ones(1)})
        assert not tr.k_amax().requires_grad
        torch.compile(lambda k: tr.update(0, k), fullgraph=True, backend="eager")(torch.tensor([5.0]))
        assert tr.k_amax().tolist() == [5.0]


def test_tracker_made_in_inference_mode_resets_and_loads_outside_it():
    """Found by review: storage allocated by a first update under torch.inference_mode() (an
    engine's forward pass) is an inference tensor; outside the mode reset() zeroed it and then
    raised, and load_state_dict loaded K, raised, and left V as it was."""
    torch = pytest.importorskip("torch")
    tr = nvfp4kv.ScaleTracker(2)
    with torch.inference_mode():
        tr.update(0, torch.tensor([3.0]), torch.tensor([4.0]))
    tr.load_state_dict({"layers": 2, "k_amax": torch.tensor([1.0, 2.0]), "v_amax": torch.tensor([7.0, 8.0])})
    assert tr.k_amax().tolist() == [1.0, 2.0] and tr.v_amax().tolist() == [7.0, 8.0]
    tr.reset()
    assert not tr.k_amax().any() and not tr.v_amax().any()
    tr.update(1, torch.tensor([-5.0]))
    assert tr.k_amax().tolist() == [0.0, 5.0]


def test_tracker_refuses_a_meta_or_non_device_and_loads_flt_max_as_printed():
    """Found by review: device="meta" was taken (every update then refused), device=1.5 gave
    torch's TypeError naming no argument, and a float64 state of 3.4028235e38 (FLT_MAX as
    printed, which float32 rounds to FLT_MAX) was refused as past the float32 range."""
    pytest.importorskip("torch")
    for device in ("meta", 1.5):
        with pytest.raises(ValueError, match=f"^ScaleTracker: device {device!r}: "):
            nvfp4kv.ScaleTracker(2, device=device)
    tr = nvfp4kv.ScaleTracker(2)
    tr.load_state_dict({"layers": 2, "k_amax": np.array([3.4028235e38, 1.0]), "v_amax": np.ones(2)})
    assert tr.k_amax()[0] == np.finfo(np.float32).max
    with pytest.raises(ValueError, match="past the float32 range"):  # the least double that rounds to inf
        tr.load_state_dict({"layers": 2, "k_amax": np.array([2.0**128 - 2.0**103, 1.0]), "v_amax": np.ones(2)})


def test_decode_scale_of_an_integer_amax_keeps_an_array_margin():
    """Found by review: an array margin was cast to an integer amax's dtype (1.5 -> 1); the docs
    give an integer amax its framework's default float."""
    assert nvfp4kv.decode_scale(np.array([448], np.int32), np.array(1.5)).tolist() == [1.5]
    torch = pytest.importorskip("torch")
    got = nvfp4kv.decode_scale(torch.tensor([448]), torch.tensor(1.5))
    assert got.dtype == torch.get_default_dtype() and got.tolist() == [1.5]
    assert nvfp4kv.decode_scale(torch.tensor([448.0]), torch.tensor(1.5, dtype=torch.float64)).dtype == torch.float32
    # A numpy amax with a torch margin: named (review: numpy's bare TypeError for the product);
    # the other way round the margin is converted, and a 0-d numpy margin with a float amax works.
    with pytest.raises(TypeError, match="margin: a torch array with a numpy amax"):
        nvfp4kv.decode_scale(np.array([448.0], np.float32), torch.tensor(1.5))
    assert nvfp4kv.decode_scale(torch.tensor([448.0]), np.array(1.5)).tolist() == [1.5]
    assert float(nvfp4kv.decode_scale(448.0, np.array(1.5))) == 1.5


@needs_torch
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_store_with_tracker_scales_round_trips(dtype):
    """Calibrate on batches, store the last one with the tracker's scales: dequantized values are
    within NVFP4's error (a group's scale is within 1/8 of its amax/6, codes within half a step of
    at most 2: 0.1875 of the group's amax)."""
    tdtype = getattr(torch, dtype)
    N, T, H, D, n = 4, 16, 2, 64, 24
    tr = nvfp4kv.ScaleTracker(1)
    g = torch.Generator().manual_seed(5)
    amax = [0.0, 0.0]
    for _ in range(3):
        k = (torch.randn(n, H, D, generator=g) * 4).to(tdtype)
        v = (torch.randn(n, H, D, generator=g) * 0.5).to(tdtype)
        tr.update(0, k, v)
        amax = [max(a, float(x.float().abs().max())) for a, x in zip(amax, (k, v))]
    spec = nvfp4kv.KVCacheSpec(block_size=T, num_kv_heads=H, head_size=D)
    cache = nvfp4kv.allocate_kv_cache(spec, N).zero_()
    ks, vs = tr.k_scales()[0:1], tr.v_scales()[0:1]
    # The scales are what they must be (the round trip below hardly depends on them: the group
    # scales absorb a global scale that is off by a power of ten).
    assert [ks.item(), vs.item()] == pytest.approx([a / 448 for a in amax], rel=1e-6)
    nvfp4kv.store(k, v, cache, torch.arange(n), ks, vs)
    ko, vo = nvfp4kv.dequantize(cache, k_scale=ks, v_scale=vs, dtype="float32")
    for x, out in ((k, ko), (v, vo)):
        got = out.reshape(-1, H, D)[:n]
        xf = x.float()
        group_amax = xf.reshape(n, H, D // 16, 16).abs().amax(-1, keepdim=True)
        err = (got - xf).reshape(n, H, D // 16, 16).abs()
        assert (err <= group_amax * 0.19 + 1e-6).all(), float((err / group_amax).max())


# ---- GPU ---------------------------------------------------------------------------------------------

@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_amax_cuda_equals_cpu(dtype):
    tdtype = getattr(torch, dtype)
    g = torch.Generator().manual_seed(9)
    base = (torch.randn(3 * 1000 * 48 + 11, generator=g) * 50).to(tdtype)
    views = {
        "flat": lambda b: b,
        "misaligned": lambda b: b[3:],
        "tiny": lambda b: b[1:4],
        "one": lambda b: b[5:6],
        "rows": lambda b: b[: 3000 * 48].reshape(3000, 48)[:, 16:32],
        "rows_odd": lambda b: b[: 3000 * 48].reshape(3000, 48)[:, 5:30],
        "transposed": lambda b: b[: 3000 * 48].reshape(30, 100, 48).transpose(0, 2),
        "every_third": lambda b: b[::3],
        "broadcast": lambda b: b[:48].reshape(1, 48).expand(1000, 48),
        "empty": lambda b: b[:0],
    }
    for name, f in views.items():
        xc = f(base)
        xg = f(base.cuda())
        for poison in (True, False):
            xc2, xg2 = xc.clone(), xg.clone()
            if poison and xc2.numel() > 2:
                idx = tuple(min(1, n - 1) for n in xc2.shape)
                xc2[idx] = float("nan")
                xg2[idx] = float("nan")
            oc = nvfp4kv.amax(xc2 if poison else xc)
            og = nvfp4kv.amax(xg2 if poison else xg)
            assert og.is_cuda
            assert og.cpu().view(torch.int32).item() == oc.view(torch.int32).item(), (name, poison)
        # accumulate
        oc = torch.tensor([0.5]).mul_(1e-3)
        og = oc.cuda()
        nvfp4kv.amax(xc, oc, accumulate=True)
        nvfp4kv.amax(xg, og, accumulate=True)
        assert og.cpu().view(torch.int32).item() == oc.view(torch.int32).item(), name


@needs_cuda
def test_amax_cuda_large_and_graph():
    x = torch.randn(1 << 22, device="cuda", dtype=torch.bfloat16)
    x[123457] = -1000.0
    assert nvfp4kv.amax(x).item() == 1000.0
    tr = nvfp4kv.ScaleTracker(2, device="cuda")
    k = torch.zeros(64, 8, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.zeros(64, 8, 128, device="cuda", dtype=torch.bfloat16)
    k_scale_out = torch.zeros(2, device="cuda")
    tr.update(1, k, v)  # warm-up outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        tr.update(1, k, v)
        k_scale_out.copy_(tr.k_scales())
    seen_k, seen_v = [], []
    for step in range(4):
        k.normal_().mul_(step + 1)
        v.normal_()
        seen_k.append(k.float().abs().max().item())
        seen_v.append(v.float().abs().max().item())
        graph.replay()
    torch.cuda.synchronize()
    assert tr.k_amax()[1].item() == max(seen_k) and tr.v_amax()[1].item() == max(seen_v)
    assert tr.k_amax()[0].item() == 0
    assert k_scale_out[1].item() == pytest.approx(max(seen_k) / 448, rel=1e-6)
    # Without accumulate, each replay recomputes from 0.
    out = torch.full((1,), 1e9, device="cuda")
    g2 = torch.cuda.CUDAGraph()
    nvfp4kv.amax(k, out)
    with torch.cuda.graph(g2, stream=stream):
        nvfp4kv.amax(k, out)
    k.fill_(0.25)
    g2.replay()
    torch.cuda.synchronize()
    assert out.item() == 0.25
    tr.reset()
    assert tr.k_amax().abs().sum().item() == 0


@needs_cuda
def test_tracker_device_mismatch():
    tr = nvfp4kv.ScaleTracker(1, device="cuda")
    with pytest.raises(ValueError, match="ScaleTracker.update.*key.*cuda"):
        tr.update(0, torch.ones(4), None)


def test_tracker_bad_device_is_a_value_error():
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="ScaleTracker: device 'nonsense'"):
        nvfp4kv.ScaleTracker(1, device="nonsense")
    if not torch.cuda.is_available():  # torch's own error is an AssertionError on a CPU build
        with pytest.raises(ValueError, match="ScaleTracker: device 'cuda'"):
            nvfp4kv.ScaleTracker(1, device="cuda")


def test_tracker_device_without_torch_says_what_to_do(monkeypatch):
    """device= needs torch; without it the error says so and names the way out (review: a bare
    "No module named 'torch'")."""
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    with pytest.raises(ModuleNotFoundError, match="device= .*needs torch.*leave device None"):
        nvfp4kv.ScaleTracker(2, device="cpu")
    tr = nvfp4kv.ScaleTracker(2)  # the way out: numpy from the first update
    tr.update(1, np.full((3, 4), -2.5, np.float32), np.ones((3, 4), np.float32))
    assert tr.k_amax().tolist() == [0.0, 2.5]


def test_tracker_mismatched_device_message_cpu_build():
    tr = nvfp4kv.ScaleTracker(1)
    tr.update(0, np.ones(4, np.float32))
    assert tr.device == "cpu"
    assert math.isclose(float(tr.k_scales()[0]), 1 / 448, rel_tol=1e-6)


def _cupy_on_gpu():
    try:
        import cupy
        return cupy if cupy.cuda.runtime.getDeviceCount() > 0 and nvfp4kv.build_info()["cuda_available"] else None
    except Exception:  # no cupy, or no driver
        return None


@pytest.mark.skipif(_cupy_on_gpu() is None, reason="needs CuPy and a CUDA device")
def test_amax_and_tracker_cupy():
    """CuPy arrays: amax on the device equals NumPy's, and the tracker keeps CuPy state."""
    cp = _cupy_on_gpu()
    rng = np.random.default_rng(4)
    host = rng.standard_normal((300, 8, 128)).astype(np.float32)
    host[7, 3, 5] = -77.5
    x = cp.asarray(host)
    got = nvfp4kv.amax(x[:, ::2])  # a strided view
    assert isinstance(got, cp.ndarray) and float(got[0]) == float(np.abs(host[:, ::2]).max())
    tr = nvfp4kv.ScaleTracker(2)
    v = cp.asarray(host * 0.5)
    tr.update(0, x, v)
    tr.update(0, x * 0.1, v * 3.0)
    k_amax, v_amax = tr.k_amax(), tr.v_amax()
    assert isinstance(k_amax, cp.ndarray)
    assert float(k_amax[0]) == 77.5 and float(v_amax[0]) == float(np.abs(host * 1.5).max())
    assert float(k_amax[1]) == 0.0
    assert float(tr.k_scales()[0]) == pytest.approx(77.5 / 448, rel=1e-6)


def test_tracker_refusals_change_nothing():
    """Found by review: int layer names sent updates to positions, a bad state loaded half, a
    refused first update fixed the tracker's framework, and a np.float64 margin widened float32."""
    with pytest.raises(TypeError, match="layer names"):
        nvfp4kv.ScaleTracker([0, 2, 4])
    tr = nvfp4kv.ScaleTracker(2)
    with pytest.raises(TypeError):
        tr.update(0, [1.0, 2.0])
    assert tr.device is None  # no storage fixed by a refused call
    with pytest.raises(TypeError, match=r"float64 .*\(the tracker has no storage yet"):  # said "is on None"
        tr.update(0, np.ones(3))
    good = np.array([1.0, 2.0], np.float32)
    tr.update(0, good, good)
    before = tr.state_dict()
    for bad, exc in (({"k_amax": np.array([100.0, 100.0], np.float32), "v_amax": np.array([-1.0, 0.0], np.float32)},
                      ValueError),
                     ({"k_amax": np.array([3.0, 3.0], np.float32), "v_amax": np.array(["1", "2"])}, TypeError),
                     ({"k_amax": good, "v_amax": good, "layers": 2.0}, ValueError)):
        with pytest.raises(exc):
            tr.load_state_dict({"layers": 2, **bad})
        assert np.array_equal(tr.k_amax(), before["k_amax"]) and np.array_equal(tr.v_amax(), before["v_amax"])
    tr.load_state_dict({"layers": 2, "k_amax": np.array([np.nan, 1.0], np.float32), "v_amax": good})  # NaN: sticky, kept
    assert np.isnan(tr.k_amax()[0])
    assert nvfp4kv.decode_scale(np.float32([448.0]), np.float64(2.0)).dtype == np.float32
    with pytest.raises(TypeError, match="accumulate"):
        nvfp4kv.amax(good, np.zeros(1, np.float32), accumulate="no")


@needs_torch
def test_tensor_subclass_is_torch():
    class Sub(torch.Tensor):
        pass

    x = torch.tensor([1.0, -3.0]).as_subclass(Sub)
    assert isinstance(nvfp4kv.amax(x), torch.Tensor)
    tr = nvfp4kv.ScaleTracker(1)
    tr.update(0, None, torch.tensor([2.0]))
    assert isinstance(tr.v_amax(), torch.Tensor)


def test_tracker_second_review():
    """Found by the second review: a state whose v_amax passed the checks but not the conversion
    had already overwritten k_amax; a negative NaN loaded was not sticky (the amax's max read it
    as below everything); an update with neither key nor value fixed numpy storage; an array
    margin widened a float32 amax; numpy integer layer counts and None as x were refused by
    messages that did not say why."""
    tr = nvfp4kv.ScaleTracker(np.int64(2))  # a numpy integer is a layer count
    assert tr.num_layers == 2
    tr.update(0, None, None)  # nothing to fold: no storage fixed
    assert tr.device is None
    good = np.array([5.0, 0.0], np.float32)
    tr.update(0, good, good)
    before = tr.state_dict()
    for odd in (np.array([1.0, 2.0], np.longdouble), np.array([1.0, 2.0], ">f4")):
        if torch is None:
            break
        tt = nvfp4kv.ScaleTracker(2, device="cpu")  # torch storage: torch.as_tensor refuses these
        tt.update(0, torch.tensor([5.0]), torch.tensor([5.0]))
        k_before = tt.k_amax().clone()
        with pytest.raises(TypeError, match="v_amax"):
            tt.load_state_dict({"layers": 2, "k_amax": np.array([100.0, 200.0], np.float32), "v_amax": odd})
        assert torch.equal(tt.k_amax(), k_before)
    neg_nan = np.array([np.nan, 1.0], np.float32)
    neg_nan.view(np.uint32)[0] |= 0x80000000
    tr.load_state_dict({"layers": 2, "k_amax": neg_nan, "v_amax": good})
    tr.update(0, np.array([2.0], np.float32))
    assert np.isnan(tr.k_amax()[0])  # sticky, as documented
    assert np.array_equal(tr.v_amax(), before["v_amax"])
    assert nvfp4kv.decode_scale(np.float32([448.0]), np.array(1.5)).dtype == np.float32
    if torch is not None:
        assert nvfp4kv.decode_scale(torch.tensor([448.0]), np.array(1.5)).dtype == torch.float32
        assert nvfp4kv.decode_scale(torch.tensor([448.0]), torch.tensor([1.5], dtype=torch.float64)).dtype \
            == torch.float32
    with pytest.raises(TypeError, match="^x: None"):
        nvfp4kv.amax(None)
    with pytest.raises(TypeError, match="numpy.bool"):
        nvfp4kv.amax(good, np.zeros(1, np.float32), accumulate=np.bool_(True))


def test_tracker_mutation_review():
    """Behaviours that mutants of scales.py passed: a layer past the end (the tracker's message,
    and no storage fixed by the refused call), a bool is not a layer, a first update whose key
    folded before its value was refused keeps the key (python-api.md), layer names as a tuple in a
    state, an amax of shape (n, 1) or of a non-float dtype refused by name."""
    tr = nvfp4kv.ScaleTracker(2)
    with pytest.raises(IndexError, match="layer: 2 is out of range; this tracker has 2 layers"):
        tr.update(2, np.ones(2, np.float32))
    assert tr.device is None
    with pytest.raises(TypeError, match="layer: bool"):
        tr.update(True, np.ones(2, np.float32))
    with pytest.raises(TypeError, match="value"):
        tr.update(0, np.full(2, 3.0, np.float32), np.ones(2))  # float64 value
    assert tr.device == "cpu" and tr.k_amax()[0] == 3.0  # the key was folded: kept
    with pytest.raises(IndexError, match="layer: 2 is out of range"):
        tr.update(2, np.ones(2, np.float32))  # with storage too
    named = nvfp4kv.ScaleTracker(["a", "b"])
    named.update("b", np.full(2, 5.0, np.float32))
    state = named.state_dict()
    state["layers"] = ("a", "b")
    named.load_state_dict(state)
    assert named.k_amax()[1] == 5.0
    good = np.zeros(2, np.float32)
    for bad, exc, needle in ((np.zeros((2, 1), np.float32), ValueError, r"k_amax of shape \(2, 1\)"),
                             (np.zeros(2, np.int32), TypeError, "k_amax of dtype int32"),
                             (np.zeros(2, np.complex64), TypeError, "k_amax of dtype complex64")):
        with pytest.raises(exc, match=needle):
            tr.load_state_dict({"layers": 2, "k_amax": bad, "v_amax": good})
    assert tr.k_amax()[0] == 3.0


@needs_torch
def test_tracker_torch_state_is_a_copy_and_device_a_torch_device():
    tr = nvfp4kv.ScaleTracker(2, device="cpu")
    tr.update(0, torch.tensor([1.0]))
    state = tr.state_dict()
    tr.update(0, torch.tensor([9.0]))
    assert state["k_amax"][0].item() == 1.0  # a copy, as documented
    assert isinstance(tr.device, torch.device) and tr.device.type == "cpu"
