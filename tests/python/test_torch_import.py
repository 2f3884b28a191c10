"""The binding's three ways of reading a torch tensor give the same call.

torch tensors reach the C ABI through torch's DLPack C exchange table (torch >= 2.10), through
the tensor's attributes (older torch), or through __dlpack__ (anything else). Each path must
describe the same memory, refuse what DLPack refuses, and leave the cache untouched when it
refuses. `_C._set_torch_paths` selects the paths a test runs with.
"""
import numpy as np
import pytest
from conftest import (assert_bytes_equal, make_cache, make_kv, make_scale, make_slots,
                      mixed_tokens, run_store, scatter_slots)

torch = pytest.importorskip("torch")

PATHS = ["exchange", "attributes", "dlpack"]


@pytest.fixture(params=PATHS)
def path(request, nv):
    prev = nv._C._set_torch_paths(request.param)
    yield request.param
    nv._C._set_torch_paths(prev)


def test_exchange_table_is_found_where_torch_has_one(nv):
    # The "exchange" cases below run the attribute path when the table is not found: the binding
    # must find it wherever torch publishes one (torch >= 2.10).
    has = hasattr(torch.Tensor, "__dlpack_c_exchange_api__")
    assert nv._C._torch_exchange_found() == has, f"torch {torch.__version__}"


def test_each_setting_runs_its_own_path(nv, path):
    # The tests below run under each setting: here, that the setting is the path that imports the
    # tensors (_C._torch_path_counts: exchange, attributes, dlpack).
    has = nv._C._torch_exchange_found()
    ran = {"exchange": "exchange" if has else "attributes", "attributes": "attributes", "dlpack": "dlpack"}[path]
    key = torch.randn(3, 2, 64, dtype=torch.bfloat16)
    kv = torch.zeros(2, 2, 16, 2, 36, dtype=torch.uint8)
    before = nv._C._torch_path_counts()
    nv.store(key, key, kv, torch.arange(3), 1.0, 1.0, scale_layout="linear")
    delta = dict(zip(PATHS, (a - b for a, b in zip(nv._C._torch_path_counts(), before))))
    assert delta[ran] >= 4 and all(n == 0 for p, n in delta.items() if p != ran), delta  # key, value, cache, slots
    assert kv.any()


def test_failing_isinstance_keeps_its_exception(nv, path):
    # An object whose __class__ raises: the binding must pass that exception on, not bury it under
    # "expected an array".
    class Broken:
        @property
        def __class__(self):
            raise RuntimeError("broken __class__")

    with pytest.raises(RuntimeError, match="broken __class__"):
        nv.store(Broken(), Broken(), Broken(), Broken())


def test_bad_path_name(nv):
    with pytest.raises(ValueError, match="expected"):
        nv._C._set_torch_paths("fast")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("scale_kind", ["tensor", "scalar", "float"])
def test_strided_views_and_scale_tensors(nv, path, dtype, scale_kind):
    rng = np.random.default_rng(7)
    N, T, H, D, n = 3, 16, 2, 64, 21
    k, v = mixed_tokens(rng, n, H, D), mixed_tokens(rng, n, H, D)
    cache = make_cache(N, T, H, D, "sides", "HND", "torch", seed=3)
    key, value, k32, v32 = make_kv(k, v, dtype, "torch", strided="qkv")
    slots = make_slots(scatter_slots(rng, n, N, T), "int32", backend="torch")
    run_store(nv, cache, key, value, k32, v32, slots, make_scale(0.03, scale_kind),
              make_scale(0.07, scale_kind))


def test_requires_grad_input(nv, path):
    rng = np.random.default_rng(8)
    N, T, H, D, n = 2, 16, 2, 64, 9
    cache = make_cache(N, T, H, D, "5d", "HND", "torch", seed=4)
    key, value, k32, v32 = make_kv(rng.standard_normal((n, H, D)), rng.standard_normal((n, H, D)),
                                   "float32", "torch")
    key.requires_grad_(True)
    run_store(nv, cache, key, value, k32, v32, make_slots(scatter_slots(rng, n, N, T), backend="torch"))


def _negated(values):
    """A view with torch's lazy negation bit holding `values`: the public way to get one is the
    imaginary part of a conjugated complex tensor (its memory holds -values, 2 floats apart)."""
    v = torch.as_tensor(values, dtype=torch.float32)
    out = torch.conj(torch.complex(torch.zeros_like(v), -v)).imag
    assert out.is_neg() and torch.equal(out, v)
    return out


@pytest.mark.parametrize("shape", [(), (1,)])
def test_negated_scale_is_refused(nv, path, shape):
    # torch's __dlpack__, data_ptr and C exchange table all export such a view's memory as it is
    # (torch 2.13): read that way, the scale would be -0.05. Refused instead, cache untouched.
    rng = np.random.default_rng(9)
    N, T, H, D, n = 2, 16, 2, 64, 5
    vals = torch.from_numpy(rng.standard_normal((n, H, D)).astype(np.float32))
    ks = _negated(np.full(shape, 0.05))
    slots = make_slots(scatter_slots(rng, n, N, T), backend="torch")
    cache = make_cache(N, T, H, D, "5d", "HND", "torch", seed=5)
    snap = cache.snapshot()
    with pytest.raises(ValueError, match="k_scale: a lazily negated torch view.*resolve_neg"):
        nv.store(vals, vals, cache.kv_cache, slots, ks, 1.0)
    assert_bytes_equal(cache.snapshot(), snap, cache)
    nv.store(vals, vals, cache.kv_cache, slots, ks.resolve_neg(), 1.0)  # the remedy


def test_negated_input_cannot_pass(nv, path):
    # A negated key is refused before any byte is written.
    rng = np.random.default_rng(10)
    N, T, H, D, n = 2, 16, 2, 64, 5
    vals = rng.standard_normal((n, H, D)).astype(np.float32)
    key = _negated(vals)
    slots = make_slots(scatter_slots(rng, n, N, T), backend="torch")
    cache = make_cache(N, T, H, D, "5d", "HND", "torch", seed=5)
    snap = cache.snapshot()
    with pytest.raises(ValueError, match="key"):
        nv.store(key, torch.from_numpy(vals), cache.kv_cache, slots)
    assert_bytes_equal(cache.snapshot(), snap, cache)


def test_negated_views_with_unit_strides_are_refused(nv, path):
    """Found by fuzzing: as_strided gives an imaginary part stride 1, and torch._neg_view makes a
    negated view of any tensor; the binding asked is_neg() only of tensors without a unit stride,
    so such a key was stored with its signs flipped and such an out received -attention."""
    N, T, H, D = 2, 4, 2, 64
    z = torch.randn(3, H, D, dtype=torch.complex64)
    key = torch.conj(z).imag.as_strided((3, H, D), (2 * H * D, 2 * D, 1))
    assert key.is_neg() and key.stride()[-1] == 1
    cache = make_cache(N, T, H, D, "5d", "HND", "torch", seed=9)
    snap = cache.snapshot()
    with pytest.raises(ValueError, match="key: a lazily negated torch view"):
        nv.store(key, key.resolve_neg(), cache.kv_cache, torch.arange(3), scale_layout="linear")
    assert_bytes_equal(cache.snapshot(), snap, cache)
    q = torch.randn(1, 4, D).to(torch.bfloat16)
    buf = torch.full((1, 4, D), 7.0, dtype=torch.bfloat16)
    out = torch._neg_view(buf)
    with pytest.raises(ValueError, match="out: a lazily negated torch view"):
        nv.decode_attention(q, cache.kv_cache, torch.tensor([[0, 1]], dtype=torch.int32),
                            torch.tensor([5], dtype=torch.int32), out=out, scale_layout="linear")
    assert bool((buf == 7.0).all())


def test_negated_integer_views_are_refused(nv, path):
    """Found by review: only floating tensors were asked is_neg() on the fast paths, so
    torch._neg_view of slots [-3, -4, -5] (logically [3, 4, 5]) was read as its memory, padding,
    and the store wrote nothing; a negated block table was misread the same way."""
    N, T, H, D = 2, 4, 2, 64
    cache = make_cache(N, T, H, D, "5d", "HND", "torch", seed=9)
    snap = cache.snapshot()
    key = torch.randn(3, H, D)
    slots = torch._neg_view(torch.tensor([-3, -4, -5]))
    assert slots.is_neg() and slots.tolist() == [3, 4, 5]
    with pytest.raises(ValueError, match="slot_mapping: a lazily negated torch view"):
        nv.store(key, key, cache.kv_cache, slots, scale_layout="linear")
    assert_bytes_equal(cache.snapshot(), snap, cache)
    q = torch.randn(1, 4, D).to(torch.bfloat16)
    table = torch._neg_view(torch.tensor([[0, -1]], dtype=torch.int32))
    with pytest.raises(ValueError, match="block_table: a lazily negated torch view"):
        nv.decode_attention(q, cache.kv_cache, table, torch.tensor([5], dtype=torch.int32), scale_layout="linear")


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support")
def test_tensors_without_strides_or_storage_name_the_argument(nv, path):
    """Found by review: on the fast paths a sparse CSR block table (no strides) or a functorch
    wrapper (no storage) raised torch's bare RuntimeError; the DLPack path a TypeError naming the
    argument, which is what every path now raises."""
    N, T, H, D = 2, 16, 2, 64
    cache = make_cache(N, T, H, D, "5d", "HND", "torch", seed=6)
    q = torch.randn(1, 4, D).to(torch.bfloat16)
    lens = torch.tensor([5], dtype=torch.int32)
    csr = torch.tensor([[0, 1]], dtype=torch.int32).to_sparse_csr()
    with pytest.raises(TypeError, match="block_table: a torch tensor of layout torch.sparse_csr"):
        nv.decode_attention(q, cache.kv_cache, csr, lens)
    table = torch.tensor([[0, 1]], dtype=torch.int32)

    def call(query):
        return nv.decode_attention(query, cache.kv_cache, table, lens)

    with pytest.raises(TypeError, match="query: "):
        torch.func.vmap(call)(q.unsqueeze(0))


def test_negated_lse_is_refused(nv, path):
    # lse [rows, Hq] takes any strides, so a negated view (its floats 2 apart) fits it: refused,
    # out and the view's memory untouched (accepted, every lse came back with its sign flipped).
    N, T, H, D, Hq = 2, 16, 2, 64, 4
    cache = make_cache(N, T, H, D, "5d", "HND", "torch", seed=8)
    q = torch.from_numpy(np.random.default_rng(12).standard_normal((1, Hq, D)).astype(np.float32))
    q = q.to(torch.bfloat16)
    bt = torch.tensor([[0, 1]], dtype=torch.int32)
    sl = torch.tensor([20], dtype=torch.int32)
    z = torch.zeros(1, Hq, dtype=torch.complex64)
    lse = torch.conj(z).imag
    assert lse.is_neg()
    out = torch.full((1, Hq, D), 7.0, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="lse: a lazily negated torch view.*resolve_neg"):
        nv.decode_attention(q, cache.kv_cache, bt, sl, out=out, lse=lse)
    assert torch.equal(z, torch.zeros_like(z)) and bool((out == 7.0).all())
    good = torch.empty(1, Hq)
    nv.decode_attention(q, cache.kv_cache, bt, sl, lse=good)
    nv.decode_attention(q, cache.kv_cache, bt, sl, lse=lse.resolve_neg())  # the remedy (a copy)


def test_meta_tensor_is_a_clear_error(nv, path):
    N, T, H, D = 2, 16, 2, 64
    cache = make_cache(N, T, H, D, "5d", "HND", "torch", seed=6)
    key = torch.empty(1, H, D, device="meta")
    snap = cache.snapshot()
    with pytest.raises((TypeError, ValueError, BufferError, RuntimeError)):
        nv.store(key, key, cache.kv_cache, torch.zeros(1, dtype=torch.int64))
    assert_bytes_equal(cache.snapshot(), snap, cache)


@pytest.mark.skipif(not (torch.cuda.is_available()), reason="needs a CUDA device")
@pytest.mark.parametrize("scale_kind", ["tensor", "float"])
def test_cuda_store_and_stream_through_each_path(nv, path, scale_kind):
    # CUDA tensors through each path, on a side stream picked up as torch's current stream:
    # the bytes equal the CPU store's.
    if not nv.build_info()["cuda_available"]:
        pytest.skip("no CUDA build of nvfp4kv")
    rng = np.random.default_rng(11)
    N, T, H, D, n = 3, 16, 2, 64, 21
    k, v = mixed_tokens(rng, n, H, D), mixed_tokens(rng, n, H, D)
    cpu = make_cache(N, T, H, D, "sides", "HND", "torch", seed=7)
    gpu = make_cache(N, T, H, D, "sides", "HND", "torch", device="cuda", seed=7)
    key, value, k32, v32 = make_kv(k, v, "bfloat16", "torch", strided="qkv")
    slots = make_slots(scatter_slots(rng, n, N, T), backend="torch")
    nv.store(key, value, cpu.kv_cache, slots, make_scale(0.03, scale_kind), make_scale(0.07, scale_kind),
             value_cache=cpu.value_cache)
    torch.cuda.synchronize()  # the poisoned cache is written on the default stream
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        nv.store(key.cuda(), value.cuda(), gpu.kv_cache, slots.cuda(),
                 make_scale(0.03, scale_kind, device="cuda"), make_scale(0.07, scale_kind, device="cuda"),
                 value_cache=gpu.value_cache)
    side.synchronize()
    assert_bytes_equal(gpu.snapshot(), cpu.snapshot(), cpu)
