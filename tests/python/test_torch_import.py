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


def test_exchange_table_is_used_where_torch_has_one(nv):
    # The exchange path is the default only where torch publishes the table; say which one ran.
    has = hasattr(torch.Tensor, "__dlpack_c_exchange_api__")
    print(f"torch {torch.__version__}: C exchange table {'present' if has else 'absent'}")
    assert nv._C._set_torch_paths("exchange") == "exchange"


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


@pytest.mark.parametrize("which", ["key", "k_scale"])
def test_negated_view_is_refused(nv, path, which):
    # torch's lazy negation bit: a view whose memory holds -values. The public way to get one is
    # torch.conj(z).imag (last stride 2, so only a scale can be one); torch._neg_view makes any.
    # torch's __dlpack__, data_ptr and C exchange table all export the memory as it is (torch
    # 2.13), which would store the wrong signs or an invalid (negative) scale: refused instead.
    rng = np.random.default_rng(9)
    N, T, H, D, n = 2, 16, 2, 64, 5
    vals = torch.from_numpy(rng.standard_normal((n, H, D)).astype(np.float32))
    key, ks = vals.clone(), torch.tensor(0.05)
    if which == "key":
        key = torch._neg_view(-vals)
    else:
        ks = torch.conj(torch.complex(torch.tensor(0.0), torch.tensor(-0.05))).imag
    assert (key if which == "key" else ks).is_neg()
    slots = make_slots(scatter_slots(rng, n, N, T), backend="torch")
    cache = make_cache(N, T, H, D, "5d", "HND", "torch", seed=5)
    snap = cache.snapshot()
    with pytest.raises(ValueError, match=f"{which}: a lazily negated torch view.*resolve_neg"):
        nv.store(key, vals, cache.kv_cache, slots, ks, 1.0)
    assert_bytes_equal(cache.snapshot(), snap, cache)
    nv.store(key.resolve_neg(), vals, cache.kv_cache, slots, ks.resolve_neg(), 1.0)  # the remedy


def test_meta_tensor_is_a_clear_error(nv, path):
    N, T, H, D = 2, 16, 2, 64
    cache = make_cache(N, T, H, D, "5d", "HND", "torch", seed=6)
    key = torch.empty(1, H, D, device="meta")
    snap = cache.snapshot()
    with pytest.raises((TypeError, ValueError, BufferError, RuntimeError)):
        nv.store(key, key, cache.kv_cache, torch.zeros(1, dtype=torch.int64))
    assert_bytes_equal(cache.snapshot(), snap, cache)
