"""The torch custom ops (nvfp4kv.ops): schemas, fake implementations, torch.compile and CUDA graphs.

Every compiled result is compared byte for byte with the same call made eagerly (whose bytes the
rest of the suite holds to the NumPy reference).
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import nvfp4kv  # noqa: E402
import nvfp4kv.ops  # noqa: E402,F401  (the tests call torch.ops.nvfp4kv.* directly)
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.library import opcheck  # noqa: E402

N, T, H, D, B = 5, 16, 2, 64, 3


def case(device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    F = nvfp4kv.nvfp4_kv_cache_full_dim(D)  # an HND cache (N, 2, T, H, F) over [N][2][H][T][F] bytes
    kv = torch.randint(0, 256, (N, 2, H, T, F), generator=g, dtype=torch.uint8).permute(0, 1, 3, 2, 4)
    n = 11
    key = torch.randn(n, H, D, generator=g).to(torch.bfloat16)
    value = torch.randn(n, H, D, generator=g).to(torch.bfloat16)
    slots = torch.randperm(N * T, generator=g)[:n]
    slots[3] = -1
    bt = torch.randint(-1, N + 1, (B, 2), generator=g, dtype=torch.int32)  # bad entries too
    seq_lens = torch.tensor([20, 0, 32], dtype=torch.int32)
    cu = torch.tensor([0, 20, 20, 52], dtype=torch.int32)
    ks, vs = torch.tensor([0.03]), torch.tensor([0.05])
    out = dict(kv=kv, key=key, value=value, slots=slots, bt=bt, seq_lens=seq_lens, cu=cu, ks=ks, vs=vs)
    return {k: v.to(device) for k, v in out.items()}


def store_and_read(kv, key, value, slots, bt, seq_lens, cu, ks, vs):
    """store, dequantize and gather_dequant once; returns what the reads wrote."""
    nvfp4kv.store(key, value, kv, slots, ks, vs)
    k1, v1 = nvfp4kv.dequantize(kv, ks, vs, dtype=torch.bfloat16,
                                key_out=torch.empty(N, T, H, D, dtype=torch.bfloat16, device=kv.device),
                                value_out=torch.empty(N, T, H, D, dtype=torch.bfloat16, device=kv.device))
    kg = torch.empty(52, H, D, dtype=torch.bfloat16, device=kv.device)
    vg = torch.empty(52, H, D, dtype=torch.bfloat16, device=kv.device)
    nvfp4kv.gather_dequant(kv, bt, seq_lens, ks, vs, cu_seqlens=cu, key_out=kg, value_out=vg)
    return k1, v1, kg, vg


def run_all(kv, key, value, slots, bt, seq_lens, cu, ks, vs):
    """Every entry point of the Python API once; returns what they wrote."""
    reads = store_and_read(kv, key, value, slots, bt, seq_lens, cu, ks, vs)
    sides = kv.unbind(1)
    nvfp4kv.reshape_and_cache_flash(value, key, sides[0], sides[1], slots[:5], "nvfp4", ks, vs)
    return (kv, *reads)


def same(a, b):
    return all(torch.equal(x.view(torch.uint8) if x.dtype != torch.uint8 else x,
                           y.view(torch.uint8) if y.dtype != torch.uint8 else y) for x, y in zip(a, b))


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_compile_fullgraph_equals_eager(backend):
    """torch.compile(fullgraph=True) of code calling every entry point: the same bytes as eager."""
    want = run_all(**case())
    torch._dynamo.reset()
    got = torch.compile(run_all, fullgraph=True, backend=backend)(**case())
    assert same(got, want)


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_compile_with_tensors_made_under_inference_mode(backend):
    """A cache and inputs made under torch.inference_mode() (as engines allocate): compiled calls
    under inference mode write eager's bytes on every backend, and outside it on eager and
    inductor; aot_eager outside inference mode raises torch's error for an in-place update of an
    inference tensor, as any in-place torch op would there (integration.md §5)."""
    with torch.inference_mode():
        want = run_all(**case())
        c = case()
        torch._dynamo.reset()
        assert same(torch.compile(run_all, fullgraph=True, backend=backend)(**c), want)
        c = case()
    torch._dynamo.reset()
    if backend == "aot_eager":  # torch 2.13's rule; a torch that lifts it makes integration.md §5 stale
        with pytest.raises(RuntimeError, match="inference tensor"):
            torch.compile(run_all, fullgraph=True, backend=backend)(**c)
    else:
        assert same(torch.compile(run_all, fullgraph=True, backend=backend)(**c), want)


def test_compiled_sides_of_the_library_cache_do_not_warn():
    """Inductor hands the ops views rebuilt from storage, without the origin that tells the
    library's own NHD sides from a packed cache's halves: the ops take the origin rule without the
    binding's warning about sides whose origin cannot tell (ext.cpp, orient_sides), which would
    flag every compiled call on these sides. The result is eager's."""
    import warnings

    kv = nvfp4kv.allocate_kv_cache(nvfp4kv.KVCacheSpec(block_size=16, num_kv_heads=4, head_size=64), 2,
                                   layout="NHD")
    key = torch.randn(20, 4, 64).to(torch.bfloat16)
    nvfp4kv.store(key, key, kv, torch.arange(20), 0.03, 0.05, scale_layout="linear")
    q = torch.randn(1, 16, 64).to(torch.bfloat16)
    bt, sl = torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([20], dtype=torch.int32)

    def f(q, kv):
        k, v = kv.unbind(1)
        return nvfp4kv.decode_attention(q, k, bt, sl, 0.03, 0.05, value_cache=v, scale_layout="linear")

    want = f(q, kv)
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = torch.compile(f, fullgraph=True)(q, kv)
    assert not [w for w in seen if "kv_layout" in str(w.message)], [str(w.message) for w in seen]
    assert torch.equal(got, want)


def test_compile_calls_the_ops_directly():
    c = case()
    want = c["kv"].clone()
    nvfp4kv.store(c["key"], c["value"], want, c["slots"], 0.03, 0.05)

    def f(kv, key, value, slots):
        torch.ops.nvfp4kv.store(key, value, kv, slots, torch.tensor(0.03), torch.tensor(0.05))
        return kv

    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(c["kv"], c["key"], c["value"], c["slots"])
    assert torch.equal(got, want)


def test_compile_with_float_scales():
    """Python floats as global scales inside a compiled region (0-d tensors in the ops)."""
    c = case(seed=1)
    want = c["kv"].clone()
    nvfp4kv.store(c["key"], c["value"], want, c["slots"], 0.03, 0.05)

    def f(kv, key, value, slots):
        nvfp4kv.store(key, value, kv, slots, 0.03, 0.05)
        return kv

    torch._dynamo.reset()
    assert torch.equal(torch.compile(f, fullgraph=True, backend="eager")(c["kv"], c["key"], c["value"],
                                                                         c["slots"]), want)


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_float_scale_values_compile_twice_at_most(backend):
    """docs/integration.md §5: a float scale's second value compiles once more, then it is
    symbolic; ten values stay within torch's recompile limit under fullgraph, each stored with
    its own scale. (Found by review: aot_eager and inductor compiled every value, up to the limit,
    while the scale was made with torch.tensor.)"""
    from torch._dynamo.utils import counters

    c = case(seed=5)

    def f(kv, key, slots, scale):
        nvfp4kv.store(key, key, kv, slots, scale, scale)
        return kv

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(f, fullgraph=True, backend=backend)
    for i in range(10):
        scale = 0.01 * (i + 1)
        want = c["kv"].clone()
        nvfp4kv.store(c["key"], c["key"], want, c["slots"], scale, scale)
        assert torch.equal(compiled(c["kv"].clone(), c["key"], c["slots"], scale), want)
    assert counters["stats"]["unique_graphs"] <= 2


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_bad_input_raises_the_ops_own_errors(backend):
    """Found by review: the Python layer's checks before allocating (a query of the wrong rows, a
    cache that is not uint8) ran while tracing, so compiled code raised Dynamo's Unsupported; they
    are eager-only, and the op raises the documented ValueError / TypeError at run time."""
    c = case(seed=6)
    q = torch.randn(5, 4, D).to(torch.bfloat16)  # 5 rows for 3 sequences of q_len 2

    def dec(q, kv, bt, sl):
        return nvfp4kv.decode_attention(q, kv, bt, sl, q_len=2)

    def deq(kv):
        return nvfp4kv.dequantize(kv, scale_layout="linear")

    torch._dynamo.reset()
    with pytest.raises(ValueError, match="query: 5 rows"):
        torch.compile(dec, fullgraph=True, backend=backend)(q, c["kv"], c["bt"], c["seq_lens"])
    # A last dimension that is no 9 D / 16 too (review: a bf16 cache of D 128 was called a wrong
    # last dimension while tracing).
    for f in (36, 128):
        with pytest.raises(TypeError, match="kv_cache: dtype"):
            torch.compile(deq, fullgraph=True, backend=backend)(torch.zeros(2, 2, 16, 2, f, dtype=torch.bfloat16))
    bf16 = torch.zeros(2, 2, 16, 2, 128, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="kv_cache: dtype"):
        torch.compile(dec, fullgraph=True, backend=backend)(q[:2], bf16, c["bt"][:1], c["seq_lens"][:1])


@pytest.mark.parametrize("arg,values", [("sm_scale", [0.1, 0.2, 0.3]), ("logits_soft_cap", [5.0, 10.0, 20.0]),
                                        ("window_left", [3, 5, 7])])
def test_compiled_decode_takes_new_values_of_its_numbers(arg, values):
    """Each new value of a number argument compiles again (integration guide §5), with eager's
    bits. Found by review: a float's second value reaches the Python layer as a symbolic float,
    and an attribute lookup on it (a numpy float32 test) made Dynamo raise Unsupported."""
    c = case(seed=8)
    q = torch.randn(B, 4, D).to(torch.bfloat16)

    def f(q, value):
        return nvfp4kv.decode_attention(q, c["kv"], c["bt"], c["seq_lens"], c["ks"], c["vs"], **{arg: value})

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, backend="eager")
    for value in values:
        assert torch.equal(compiled(q, value).view(torch.int16), f(q, value).view(torch.int16)), value


def test_compiled_refusals_carry_the_librarys_message():
    """Found by review: an unsupported torch dtype, or a string numpy cannot read, reached numpy
    while tracing, whose refusal became Dynamo's internal error without the library's message; a
    numpy scalar q_len (traced as an array) was called an 'ndarray'; an int scale past the double
    range raised OverflowError inside Dynamo. Each now arrives as Unsupported with the library's
    message (integration guide §5)."""
    c = case(seed=6)
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported, match="k_scale/v_scale: a number past the float range"):
        torch.compile(lambda kv: nvfp4kv.store(c["key"], c["key"], kv, c["slots"], 10**400, 1.0),
                      fullgraph=True, backend="eager")(c["kv"].clone())

    def deq(kv, dtype):
        return nvfp4kv.dequantize(kv, scale_layout="linear", dtype=dtype)

    for dtype in (torch.float64, "bogus"):
        torch._dynamo.reset()
        with pytest.raises(torch._dynamo.exc.Unsupported, match="dtype: .* is not supported"):
            torch.compile(lambda kv: deq(kv, dtype), fullgraph=True, backend="eager")(c["kv"])
    q = torch.randn(6, 4, D).to(torch.bfloat16)
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported, match="q_len: a 0-d numpy array .*pass a Python number"):
        torch.compile(lambda q, n: nvfp4kv.decode_attention(q, c["kv"], c["bt"], c["seq_lens"], q_len=n),
                      fullgraph=True, backend="eager")(q, np.int64(2))


def run_whole(kv, key, value, slots, bt, seq_lens, cu, ks, vs):
    """store_and_read and a decode, on whole tensors only (no views at symbolic offsets,
    docs/integration.md §5)."""
    reads = store_and_read(kv, key, value, slots, bt, seq_lens, cu, ks, vs)
    out = nvfp4kv.decode_attention(key[:B].contiguous(), kv, bt, seq_lens, ks, vs)
    return (kv, *reads, out)


def test_compile_dynamic_shapes_on_whole_tensors():
    """torch.compile(dynamic=True) on inductor: the same bytes as eager where no written view lies
    at a symbolic offset (integration guide §5 has the limit)."""
    want = run_whole(**case())
    torch._dynamo.reset()
    got = torch.compile(run_whole, fullgraph=True, backend="inductor", dynamic=True)(**case())
    assert same(got, want)


def _layered_decode():
    c = case(seed=7)
    kv, bt, seq_lens, ks, vs = c["kv"], c["bt"], c["seq_lens"], c["ks"], c["vs"]

    def decode(q, out, lse=None):
        nvfp4kv.decode_attention(q, kv, bt[: q.shape[0]], seq_lens[: q.shape[0]], ks, vs, out=out, lse=lse)

    return decode


@pytest.mark.parametrize("form", ["stacked", "separate", "input_views", "views_of_an_input_view", "slices"])
def test_compile_writes_at_dynamic_offsets(form, request):
    """Found by review: inductor handed the op a per-layer output view out_all[1] at offset 0 once
    the batch size had changed (torch's automatic dynamic shapes, pytorch#198068), so layer 1's
    output overwrote layer 0's with no error. The ops' fake implementation refuses a view whose
    offset is computed from a dynamic size (out_all[l], o[1] of an input o, and slices o[b:],
    which inductor places right but which the fake cannot tell from a select); tensors of their
    own, and views passed in as inputs (an offset of their own), compile and equal eager at every
    batch size (measured: inductor places those right)."""
    if form == "views_of_an_input_view" and torch.__version__.startswith("2.11."):
        # Measured on torch 2.11.0 (the lent GPU machine, CPU tensors): inductor wrote o[l] of the
        # argument o = outs[1] into outs[2], static shapes too (integration guide §5); 2.13 is right.
        reason = "torch 2.11's inductor misplaces a view of an input view"
        request.applymarker(pytest.mark.xfail(strict=True, reason=reason))
    decode = _layered_decode()

    def stacked(q, outs, lses):  # outs [2, B, H, D], lses [2, B, H]: views made in the graph
        for layer in range(2):
            decode(q[layer], outs[layer], lses[layer])

    def separate(q, o0, o1, l0, l1):  # whole tensors, or views made outside the graph
        decode(q[0], o0, l0)
        decode(q[1], o1, l1)

    def nested(q, o):  # o [2, B, H, D], a view passed in; o[1] made in the graph
        decode(q[0], o[0])
        decode(q[1], o[1])

    def slices(q, o):  # o [2B, H, D]: o[B:] at a dynamic offset (inductor places slices right, but the
        b = q.shape[1]  # fake implementation cannot tell a slice from a select: refused as well)
        decode(q[0], o[:b])
        decode(q[1], o[b:])

    fn = {"stacked": stacked, "separate": separate, "input_views": separate, "views_of_an_input_view": nested,
          "slices": slices}[form]
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="inductor")
    for b, k in ((2, 1), (3, 2), (3, 1)):  # the batch size and the input views' offsets change
        q = torch.randn(2, b, H, D).to(torch.bfloat16)

        def buffers():
            outs, lses = torch.zeros(3, 2, b, H, D, dtype=torch.bfloat16), torch.zeros(3, 2, b, H)
            if form == "stacked":
                return outs, (outs[0], lses[0])
            if form == "separate":
                return outs, (outs[0, 0].clone(), outs[0, 1].clone(), lses[0, 0].clone(), lses[0, 1].clone())
            if form == "input_views":
                return outs, (outs[k, 0], outs[k, 1], lses[k, 0], lses[k, 1])
            if form == "slices":
                return outs, (outs[0].reshape(2 * b, H, D),)
            return outs, (outs[k],)

        (got_all, got), (want_all, want) = buffers(), buffers()
        if b == 3 and form in ("stacked", "views_of_an_input_view", "slices"):
            with pytest.raises(Exception, match=r"out is a view at storage offset .* depends on a dynamic size"):
                compiled(q, *got)
            return
        compiled(q, *got)
        fn(q, *want)
        assert same(got, want) and same(got_all, want_all)  # bytes: the random cache has NaN groups


def test_ops_mutation_review():
    """What mutants of ops.py passed (mutation testing): accumulate through the amax op and the
    compiled API, the recipe of reshape_and_cache_flash's op, stream= refused under compile, a
    given cu_seqlens returned as given, a float scale as a 0-d tensor, and the op's message for a
    bad kv_cache_dtype naming that argument."""
    x = torch.tensor([1.0, -2.0])
    out = torch.tensor([5.0])
    torch.ops.nvfp4kv.amax(x, out, True)
    assert out.item() == 5.0
    torch._dynamo.reset()
    out = torch.tensor([5.0])
    torch.compile(lambda x, o: nvfp4kv.amax(x, o, accumulate=True), fullgraph=True, backend="aot_eager")(x, out)
    assert out.item() == 5.0
    c = case(seed=8)
    kv_op, kv_api = c["kv"].clone(), c["kv"].clone()
    args = (c["key"], c["value"])
    torch.ops.nvfp4kv.reshape_and_cache_flash(*args, kv_op[:, 0], kv_op[:, 1], c["slots"], "nvfp4_4over6", c["ks"],
                                              c["vs"])
    nvfp4kv.reshape_and_cache_flash(*args, kv_api[:, 0], kv_api[:, 1], c["slots"], "nvfp4_4over6", c["ks"], c["vs"])
    plain = c["kv"].clone()
    nvfp4kv.reshape_and_cache_flash(*args, plain[:, 0], plain[:, 1], c["slots"], "nvfp4", c["ks"], c["vs"])
    assert torch.equal(kv_op, kv_api) and not torch.equal(kv_op, plain)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        torch.ops.nvfp4kv.reshape_and_cache_flash(*args, kv_op[:, 0], kv_op[:, 1], c["slots"], "fp4", c["ks"], c["vs"])
    torch._dynamo.reset()
    with pytest.raises(Exception, match="stream"):
        torch.compile(lambda *a: nvfp4kv.store(*a, stream=7), fullgraph=True, backend="eager")(
            c["key"], c["value"], c["kv"].clone(), c["slots"], c["ks"], c["vs"])
    cu = torch.tensor([0, 20, 20, 52], dtype=torch.int32)  # given: returned as given, not recomputed
    seq_lens = torch.tensor([3, 0, 2], dtype=torch.int32)
    kg, vg = torch.empty(52, H, D, dtype=torch.bfloat16), torch.empty(52, H, D, dtype=torch.bfloat16)
    torch._dynamo.reset()
    got = torch.compile(lambda *a: nvfp4kv.gather_dequant(*a, cu_seqlens=cu, key_out=kg, value_out=vg)[2],
                        fullgraph=True, backend="eager")(c["kv"], c["bt"], seq_lens, c["ks"], c["vs"])
    assert torch.equal(got, cu)
    assert nvfp4kv.ops.scale_tensor(0.5).shape == () and nvfp4kv.ops.scale_tensor(0.5).dtype == torch.float32
    for b in (True, False):  # refused as the eager API refuses it (mutation testing)
        with pytest.raises(TypeError, match="bool"):
            nvfp4kv.ops.scale_tensor(b)
    with pytest.raises(ValueError, match="past the float range"):  # float(2^1024) overflows (mutation testing)
        nvfp4kv.ops.scale_tensor(2**1024)


@pytest.mark.parametrize("scale, ok", [(np.True_, False), (np.array(True), False), ("0.01", False), (None, False),
                                       (np.float32(0.03), True), (np.array(0.03), True), (0.03, True)])
def test_compiled_scales_refused_as_eager(scale, ok):
    """Found by review: under torch.compile a numpy bool or a string was taken as a scale (np.True_
    stored with scale 1.0) where the eager API raises TypeError."""
    c = case(seed=9)

    def f(kv, s):
        nvfp4kv.store(c["key"], c["value"], kv, c["slots"], s, c["vs"])

    torch._dynamo.reset()
    kv_c, kv_e = c["kv"].clone(), c["kv"].clone()
    if not ok:
        with pytest.raises(TypeError):
            f(kv_e, scale)
        with pytest.raises(Exception, match=r"k_scale/v_scale: None received.*pass 1\.0" if scale is None
                           else "k_scale/v_scale"):
            torch.compile(f, fullgraph=True, backend="eager")(kv_c, scale)
        assert torch.equal(kv_c, c["kv"])
        return
    torch.compile(f, fullgraph=True, backend="eager")(kv_c, scale)
    f(kv_e, scale)
    assert torch.equal(kv_c, kv_e)


@pytest.mark.parametrize("given", ["none", "key_out", "value_out"])  # one alone too (mutation testing)
def test_compile_gather_needs_its_outputs(given):
    c = case()
    rows = int(c["seq_lens"].sum())
    outs = {name: torch.empty(rows, H, D, dtype=torch.bfloat16) for name in ("key_out", "value_out") if name == given}

    def f(kv, bt, seq_lens, ks, vs):
        return nvfp4kv.gather_dequant(kv, bt, seq_lens, ks, vs, dtype=torch.bfloat16, **outs)

    torch._dynamo.reset()
    with pytest.raises(Exception, match="key_out, value_out: under torch.compile"):
        torch.compile(f, fullgraph=True, backend="aot_eager")(c["kv"], c["bt"], c["seq_lens"], c["ks"], c["vs"])


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_compile_scale_tracker_and_amax(backend):
    """Found by review: nvfp4kv.amax and ScaleTracker.update, which an engine may call in its
    forward pass, were no ops, and fullgraph compilation failed on the extension's function.
    Compiled, they fold exactly what eager calls fold."""
    tracker = nvfp4kv.ScaleTracker(2, device="cpu")

    def forward(k, v):
        tracker.update(1, k, v)
        return k * 2

    f = torch.compile(forward, fullgraph=True, backend=backend)
    g = torch.Generator().manual_seed(5)
    k, v, k2 = (torch.randn(16, 8, 128, generator=g) * s for s in (1.0, 3.0, 5.0))
    f(k, v)
    f(k2, v)
    assert float(tracker.k_amax()[1]) == float(torch.maximum(k.abs().max(), k2.abs().max()))
    assert float(tracker.v_amax()[1]) == float(v.abs().max()) and float(tracker.k_amax()[0]) == 0.0
    amax = torch.compile(lambda x: nvfp4kv.amax(x), fullgraph=True, backend=backend)
    assert float(amax(k)) == float(k.abs().max())


@pytest.mark.parametrize("dynamic", [None, True])
def test_compiled_tracker_takes_the_layer_as_an_argument(dynamic):
    """Found by review: a layer index passed to the compiled function becomes a symbolic int (at
    its second value by default, at once with dynamic=True), on which the tracker's hasattr() made
    Dynamo raise Unsupported. Each value now compiles once, as a constant's would."""
    tracker = nvfp4kv.ScaleTracker(4, device="cpu")

    def forward(k, v, layer):
        tracker.update(layer, k, v)
        return k * 2

    torch._dynamo.reset()
    f = torch.compile(forward, fullgraph=True, backend="eager", dynamic=dynamic)
    for layer in range(4):
        f(torch.full((8,), layer + 1.0), torch.full((8,), -(layer + 10.0)), layer)
    assert tracker.k_amax().tolist() == [1.0, 2.0, 3.0, 4.0]
    assert tracker.v_amax().tolist() == [10.0, 11.0, 12.0, 13.0]


def test_amax_of_meta_tensors_goes_through_the_op():
    out = nvfp4kv.amax(torch.empty(4, 4, device="meta"))
    assert out.device.type == "meta" and tuple(out.shape) == (1,)


@pytest.mark.parametrize("op", ["store", "reshape_and_cache_flash", "dequantize", "gather_dequant", "decode_attention",
                                "amax"])
def test_opcheck(op):
    c = case(seed=2)
    kv = c["kv"]
    # Outputs of defined bytes: opcheck compares its arguments before and after (valgrind review).
    args = {
        "store": (c["key"], c["value"], kv, c["slots"], c["ks"], c["vs"]),
        "reshape_and_cache_flash": (c["key"], c["value"], kv[:, 0], kv[:, 1], c["slots"], "nvfp4", c["ks"], c["vs"]),
        "dequantize": (kv, c["ks"], c["vs"], torch.zeros(N, T, H, D), torch.zeros(N, T, H, D)),
        "gather_dequant": (kv, c["bt"], c["seq_lens"], c["cu"], c["ks"], c["vs"],
                           torch.zeros(52, H, D, dtype=torch.bfloat16), torch.zeros(52, H, D, dtype=torch.bfloat16)),
        "decode_attention": (c["key"][:B].contiguous(), kv, c["bt"], c["seq_lens"], c["ks"], c["vs"],
                             torch.zeros(B, H, D, dtype=torch.bfloat16), 0.125, torch.zeros(B, H)),
        "amax": (c["key"], torch.zeros(1), True),
    }[op]
    result = opcheck(getattr(torch.ops.nvfp4kv, op).default, args)
    assert all(v == "SUCCESS" for v in result.values()), result


def test_ops_bump_the_version_of_what_they_write():
    """Found by review: the ops wrote through pointers torch did not see, so autograd ran a backward
    through a tensor an op had overwritten. Now each written tensor's version moves, as with
    torch's in-place ops, and that backward is refused; what an op only reads keeps its version."""
    c = case(seed=4)
    kv = c["kv"]
    ko, vo = torch.empty(N, T, H, D), torch.empty(N, T, H, D)
    before = kv._version, ko._version, vo._version, c["key"]._version
    torch.ops.nvfp4kv.store(c["key"], c["value"], kv, c["slots"], c["ks"], c["vs"])
    torch.ops.nvfp4kv.dequantize(kv, c["ks"], c["vs"], key_out=ko, value_out=vo)  # outputs by keyword
    assert kv._version > before[0] and ko._version > before[1] and vo._version > before[2]
    assert c["key"]._version == before[3]
    w = torch.ones(N, T, H, D, requires_grad=True)
    loss = (w * ko).sum()  # saves ko for the backward
    torch.ops.nvfp4kv.dequantize(kv, c["ks"], c["vs"], ko, vo)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    with torch.inference_mode():  # no version counters there: the op runs all the same
        ki, vi = torch.empty(N, T, H, D), torch.empty(N, T, H, D)
        torch.ops.nvfp4kv.dequantize(kv, c["ks"], c["vs"], ki, vi)
    assert same((ki, vi), (ko, vo))  # bitwise (random scale bytes include NaN)


def test_ops_refuse_to_overwrite_what_requires_grad():
    """Found by review: an op wrote into a tensor autograd tracked (a non-leaf keeps its old
    history: a wrong gradient, no error; a leaf was written where torch's in-place ops raise).
    With grad mode on such an output is refused before anything is written; under no_grad it is
    written, as torch allows."""
    c = case(seed=5)
    w = torch.ones(N, T, H, D, requires_grad=True)
    for ko in (w * 2, torch.zeros(N, T, H, D, requires_grad=True)):
        before = ko.detach().clone()
        with pytest.raises(RuntimeError, match="key_out requires grad; the op has no gradient"):
            torch.ops.nvfp4kv.dequantize(c["kv"], c["ks"], c["vs"], ko, torch.empty(N, T, H, D))
        assert torch.equal(ko.detach(), before)
    ko = w * 2
    with torch.no_grad():
        version = ko._version
        torch.ops.nvfp4kv.dequantize(c["kv"], c["ks"], c["vs"], ko, torch.empty(N, T, H, D))
    assert ko._version > version


def test_a_failing_op_bumps_no_version():
    """Found by review: the version moved before the op ran, so a call that raised and wrote
    nothing still made a later backward fail."""
    w = torch.ones(1, requires_grad=True)
    out = torch.zeros(1)
    loss = (w * out).sum()  # saves out
    with pytest.raises(TypeError, match="x: dtype int32"):
        torch.ops.nvfp4kv.amax(torch.ones(3, dtype=torch.int32), out)
    loss.backward()
    assert w.grad is not None


def test_fake_tensors_never_dereferenced():
    """Under FakeTensorMode every entry point runs on shapes alone (the ops' fake implementations)
    for every cache form, HND and NHD, where a store once read the fake pointer and crashed."""
    c = case(seed=3)
    nhd_real = c["kv"].contiguous()  # (N, 2, T, H, F) row-major: NHD
    with FakeTensorMode() as mode:
        f = {k: mode.from_tensor(v) for k, v in c.items()}
        run_all(**f)
        nhd = mode.from_tensor(nhd_real)
        nvfp4kv.store(f["key"], f["value"], nhd, f["slots"], 0.03, 0.05, scale_layout="linear")
        key, value = nvfp4kv.dequantize(f["kv"], 0.03, 0.05)
        assert tuple(key.shape) == (N, T, H, D) and tuple(value.shape) == (N, T, H, D)


def test_meta_tensors_go_through_the_ops():
    kv = torch.empty(N, 2, T, H, nvfp4kv.nvfp4_kv_cache_full_dim(D), dtype=torch.uint8, device="meta")
    key = torch.empty(3, H, D, dtype=torch.bfloat16, device="meta")
    nvfp4kv.store(key, key, kv, torch.empty(3, dtype=torch.int64, device="meta"), 1.0, 1.0)
    k, v = nvfp4kv.dequantize(kv, 1.0, 1.0)
    assert k.device.type == "meta" and tuple(v.shape) == (N, T, H, D)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_ops_in_a_cuda_graph():
    """The ops captured in a CUDA graph: replays write the CPU path's bytes, with new inputs and
    new sequence lengths copied into the captured tensors between replays."""
    if not nvfp4kv.build_info()["cuda_available"]:
        pytest.skip("no CUDA build of nvfp4kv")
    c = case("cuda", seed=4)
    static = {k: v.clone() for k, v in c.items()}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run_all(**static)  # warm up (occupancy queries, module load) outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    static = {k: v.clone() for k, v in c.items()}
    with torch.cuda.graph(graph):
        outs = run_all(**static)
    for seed in (5, 6):
        new = case("cuda", seed=seed)
        for k in static:
            static[k].copy_(new[k])
        graph.replay()
        torch.cuda.synchronize()
        want = run_all(**{k: v.cpu() for k, v in new.items()})  # the CPU path: the same bytes
        assert same([o.cpu() for o in outs], want)


def test_padded_rows_through_the_op():
    c = case(seed=7)
    want = c["kv"].clone()
    nvfp4kv.store(c["key"][:6], c["value"][:6], want, c["slots"][:6], c["ks"], c["vs"])
    got = c["kv"].clone()
    torch.ops.nvfp4kv.store(c["key"], c["value"], got, c["slots"][:6], c["ks"], c["vs"])
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="slot_mapping: 12 entries but key has 11 tokens"):
        torch.ops.nvfp4kv.store(c["key"], c["value"], got, torch.arange(12), c["ks"], c["vs"])
    assert np.array_equal(got.numpy(), want.numpy())


# ---- the ops in either import order (nvfp4kv._torch_hook) ----------------------------------------
def _fresh_interpreter(code, tmp_path, *flags):
    """Runs `code` in a new interpreter (with `flags`), outside the source tree (the installed
    package), and returns its stdout; the process must exit 0."""
    import subprocess
    import sys
    import textwrap

    r = subprocess.run([sys.executable, *flags, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                       timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


_DECODE_FULLGRAPH = """
    spec = nvfp4kv.KVCacheSpec(block_size=16, num_kv_heads=2, head_size=64)
    g = torch.Generator().manual_seed(0)
    kv = torch.randint(0, 256, nvfp4kv.get_kv_cache_shape(3, 16, 2, 64, "nvfp4"), generator=g, dtype=torch.uint8)
    q = torch.randn(2, 4, 64, generator=g).to(torch.bfloat16)
    bt = torch.tensor([[0, 1], [2, 0]], dtype=torch.int32)
    sl = torch.tensor([20, 9], dtype=torch.int32)
    f = lambda q: nvfp4kv.decode_attention(q, kv, bt, sl, 0.5, 0.25)
    got = torch.compile(f, fullgraph=True, backend="eager")(q)  # without the ops, Dynamo refuses the call
    print(torch.equal(got.view(torch.uint8), f(q).view(torch.uint8)))
"""


_WAITING = "[f.name for f in sys.meta_path if type(f).__module__ == 'nvfp4kv._torch_hook']"


def test_ops_registered_when_torch_comes_after_nvfp4kv(tmp_path):
    """`import nvfp4kv` then `import torch`: the ops are registered at torch's import, and Dynamo's
    substitutions at torch._dynamo's, so a compiled call traces as the op (fullgraph), with the
    eager call's bytes."""
    out = _fresh_interpreter(f"""
    import sys
    import nvfp4kv
    print("torch" in sys.modules)
    import torch
    print(hasattr(torch.ops.nvfp4kv, "decode_attention"), "nvfp4kv.ops" in sys.modules, "torch._dynamo" in sys.modules)
    print({_WAITING})  # the hook for torch is gone after its one use; Dynamo's waits
    print(type(torch.__loader__).__name__, type(torch.__spec__.loader).__name__)  # torch's own loader back
    """ + _DECODE_FULLGRAPH + f"""
    print({_WAITING})
    """, tmp_path)
    assert out.splitlines() == ["False", "True True False", "['torch._dynamo']", "SourceFileLoader SourceFileLoader",
                                "True", "[]"]


@pytest.mark.parametrize("first", ["torch", "torch._dynamo"])
def test_ops_registered_without_dynamo_when_torch_comes_first(tmp_path, first):
    """`import torch` then `import nvfp4kv`: the ops at once, without importing torch._dynamo
    (about a second), which the first torch.compile imports; where Dynamo is already imported
    (an engine that compiles), its substitutions at once too."""
    out = _fresh_interpreter(f"""
    import sys
    import {first}
    import torch
    import nvfp4kv
    print(hasattr(torch.ops.nvfp4kv, "decode_attention"), "torch._dynamo" in sys.modules, {_WAITING})
    """ + _DECODE_FULLGRAPH, tmp_path)
    dynamo = first == "torch._dynamo"
    assert out.splitlines() == [f"True {dynamo} {[] if dynamo else ['torch._dynamo']}", "True"]


def test_substitutions_wait_for_another_threads_import_of_dynamo(tmp_path):
    """nvfp4kv imported while a thread imports torch._dynamo (in sys.modules, not yet run): the
    substitutions were skipped without a word (review); now they wait for that import."""
    out = _fresh_interpreter("""
    import sys, threading, time
    import torch
    t = threading.Thread(target=lambda: __import__("torch._dynamo"))
    t.start()
    while "torch._dynamo" not in sys.modules:
        time.sleep(0.001)
    print(not hasattr(sys.modules["torch._dynamo"], "substitute_in_graph"))  # still being imported
    import nvfp4kv
    t.join()
    """ + _DECODE_FULLGRAPH, tmp_path)
    assert out.split() == ["True", "True"]


def test_substitutions_when_two_threads_import_torch_and_dynamo_at_once(tmp_path):
    """After `import nvfp4kv`, one thread imports torch while another imports torch._dynamo: the
    ops' registration runs inside torch's import, and waiting there for torch._dynamo (whose
    import waits for torch) closed a cycle, so the substitutions were lost with a warning (3 of 3
    runs). Now a thread of its own waits and registers them; either way, no warning and a
    fullgraph compile."""
    out = _fresh_interpreter("""
    import sys, threading, warnings
    import nvfp4kv
    caught = []
    def imp(name):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            __import__(name)
        caught.extend(str(x.message) for x in w if "nvfp4kv" in str(x.message))
    threads = [threading.Thread(target=imp, args=(m,)) for m in ("torch", "torch._dynamo")]
    [t.start() for t in threads]
    [t.join() for t in threads]
    [t.join() for t in threading.enumerate() if t.name == nvfp4kv._torch_hook.WAITER]
    import torch
    print(caught)
    """ + _DECODE_FULLGRAPH, tmp_path)
    assert out.splitlines() == ["[]", "True"]


def test_ops_registered_after_a_spec_lookup_of_torch(tmp_path):
    """A lookup without an import (importlib.util.find_spec, as availability checks do) leaves the
    hook waiting for the import itself."""
    out = _fresh_interpreter("""
    import importlib.util, sys
    import nvfp4kv
    assert importlib.util.find_spec("torch") is not None and "torch" not in sys.modules
    import torch
    print(hasattr(torch.ops.nvfp4kv, "store"))
    """, tmp_path)
    assert out.split() == ["True"]


def test_a_failed_registration_warns_and_torch_still_imports(tmp_path):
    out = _fresh_interpreter("""
    import sys, warnings
    import nvfp4kv
    sys.modules["nvfp4kv.ops"] = None  # its import now raises ImportError
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import torch
    print(float(torch.ones(2).sum()), hasattr(torch.ops.nvfp4kv, "store"))
    print([str(w.message)[:60] for w in caught if "nvfp4kv" in str(w.message)])
    """, tmp_path)
    lines = out.splitlines()
    assert lines[0] == "2.0 False"
    assert "nvfp4kv: the torch custom ops were not registered when torch" in lines[1]


def test_a_failed_registration_under_warnings_as_errors_still_imports_torch(tmp_path):
    """With -W error the warning would have escaped torch's import, after its __init__ had run,
    and torch could not be imported again in that process (review)."""
    out = _fresh_interpreter("""
    import sys
    import nvfp4kv
    sys.modules["nvfp4kv.ops"] = None
    import torch
    print(float(torch.ones(2).sum()), hasattr(torch.ops.nvfp4kv, "store"))
    """, tmp_path, "-W", "error")
    assert out.split() == ["2.0", "False"]
