"""Tests of nvfp4kv.spec: dtype strings, shapes, page sizes, allocation, lazy torch import.

The expected numbers are computed by hand from docs/FORMAT.md §4 (F(D) = D/2 + D/16, page =
T*H*(F(D) + F(Dv))), not by calling the module.
"""

import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from conftest import load_package_module, package_source

SPEC_PY = package_source("spec")
S = load_package_module("spec")

try:
    import torch
except ImportError:  # pragma: no cover - the torch-specific tests skip
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch not installed")

QUANTIZED = ["fp8", "fp8_e4m3", "fp8_e5m2", "nvfp4", "nvfp4_4over6"]
UNQUANTIZED = ["auto", "bfloat16", "float16", "half", "float", "float32"]


# ---------------------------------------------------------------------------------------------
# full dim


@pytest.mark.parametrize("d, f", [(16, 9), (32, 18), (64, 36), (128, 72), (256, 144), (576, 324)])
def test_full_dim(d, f):
    assert S.nvfp4_kv_cache_full_dim(d) == f
    assert f == 9 * d // 16


@pytest.mark.parametrize("d", [0, -16, 8, 100, 127, 1.5, 128.0, "128", None, True])
def test_full_dim_rejects(d):
    with pytest.raises(ValueError, match="head_size"):
        S.nvfp4_kv_cache_full_dim(d)


# ---------------------------------------------------------------------------------------------
# dtype strings


def test_quant_mode_enum():
    # Members and values are vLLM's: pinned in test_vllm_names.py.
    assert issubclass(S.KVQuantMode, int)
    assert S.KVQuantMode.NVFP4.is_nvfp4 and not S.KVQuantMode.NONE.is_nvfp4


@pytest.mark.parametrize(
    "dtype, mode",
    [("auto", "NONE"), ("bfloat16", "NONE"), ("float16", "NONE"), ("half", "NONE"),
     ("float", "NONE"), ("float32", "NONE"), ("fp8", "FP8_PER_TENSOR"),
     ("fp8_e4m3", "FP8_PER_TENSOR"), ("fp8_e5m2", "FP8_PER_TENSOR"), ("nvfp4", "NVFP4"),
     # vLLM's get_kv_quant_mode does not know "nvfp4_4over6": NONE there, so NONE here
     # (nvfp4kv's own answer is is_nvfp4_kv_cache / KVCacheSpec.quant_mode)
     ("nvfp4_4over6", "NONE")],
)
def test_get_kv_quant_mode(dtype, mode):
    assert S.get_kv_quant_mode(dtype) is S.KVQuantMode[mode]


@pytest.mark.parametrize("dtype, nvfp4", [("nvfp4", True), ("nvfp4_4over6", True), ("NVFP4", False),
                                          ("nvfp4 ", False), ("fp8", False), ("auto", False),
                                          (None, False), (4, False),
                                          (np.array("nvfp4"), False)])  # an array is no dtype string
def test_is_nvfp4_kv_cache(dtype, nvfp4):
    assert S.is_nvfp4_kv_cache(dtype) is nvfp4


def test_spec_quant_mode_is_nvfp4_for_both_recipes():
    for dt in ("nvfp4", "nvfp4_4over6"):
        assert S.KVCacheSpec(16, 8, 128, cache_dtype=dt).quant_mode is S.KVQuantMode.NVFP4


@pytest.mark.parametrize("dtype", QUANTIZED)
def test_is_quantized_true(dtype):
    assert S.is_quantized_kv_cache(dtype) is True


@pytest.mark.parametrize("dtype", UNQUANTIZED)
def test_is_quantized_false(dtype):
    assert S.is_quantized_kv_cache(dtype) is False


# vLLM's two functions never raise for a string (the old ValueError for unknown strings is gone
# with the move to vLLM's definitions); anything but a str is a TypeError naming the argument.
@pytest.mark.parametrize("bad", ["fp4", "NVFP4", "FP8", "", "int8", "uint8", " nvfp4"])
def test_unknown_dtype_string_is_not_quantized(bad):
    assert S.get_kv_quant_mode(bad) is S.KVQuantMode.NONE
    assert S.is_quantized_kv_cache(bad) is False


@pytest.mark.parametrize("bad", [None, 1, b"nvfp4"])
@pytest.mark.parametrize("fn", ["is_quantized_kv_cache", "get_kv_quant_mode"])
def test_non_string_dtype_rejected(fn, bad):
    with pytest.raises(TypeError, match="kv_cache_dtype must be a str"):
        getattr(S, fn)(bad)


def test_cache_shape_still_rejects_unknown_dtypes():
    # The geometry functions size only the dtypes nvfp4kv knows, and list them.
    with pytest.raises(ValueError) as e:
        S.get_kv_cache_shape(1, 16, 8, 128, "int8_per_token_head")
    for allowed in QUANTIZED + UNQUANTIZED:
        assert repr(allowed) in str(e.value)


def test_modelopt_map():
    # vLLM's map (values pinned in test_vllm_names.py): lower-case keys, vLLM looks up .lower()
    m = S.MODELOPT_TO_VLLM_KV_CACHE_DTYPE_MAP
    assert m["fp8"] == "fp8_e4m3" and m["nvfp4"] == "nvfp4" and m["mixed_precision"] == "auto"
    assert m["NVFP4".lower()] == "nvfp4"
    for v in m.values():
        assert v in S.KV_CACHE_DTYPES


@needs_torch
def test_str_dtype_to_torch_dtype_values():
    # The mapping behaves as a dict (values pinned against vLLM in test_vllm_names.py); fp8 is
    # uint8 now, as in vLLM, and the "uint8" key nvfp4kv had is gone (vLLM has none).
    m = S.STR_DTYPE_TO_TORCH_DTYPE
    expected = {k: m[k] for k in m}
    assert expected["fp8"] is torch.uint8 and expected["nvfp4"] is torch.uint8
    assert "uint8" not in m
    for k, v in expected.items():
        assert k in m
        assert m[k] is v
        assert m.get(k) is v
    assert set(m) == set(expected)
    assert len(m) == len(expected)
    assert dict(m.items()) == expected
    assert "auto" not in m and m.get("auto") is None
    with pytest.raises(KeyError):
        m["nope"]


# ---------------------------------------------------------------------------------------------
# shapes


# nvfp4 caches are vLLM's packed (N, 2H, T, F) by default now (vLLM's FlashInfer/TRT-LLM NVFP4
# path); the 5-D (N, 2, T, H, F) form these tests asserted before is packed=False.
def test_kv_cache_shape_nvfp4_packed_by_default():
    assert S.get_kv_cache_shape(10, 16, 8, 128, "nvfp4") == (10, 16, 16, 72)
    assert S.get_kv_cache_shape(10, 16, 8, 128, "nvfp4_4over6", "HND") == (10, 16, 16, 72)
    assert S.get_kv_cache_shape(3, 32, 4, 64, "nvfp4", packed=True) == (3, 8, 32, 36)
    # packed for other dtypes on request
    assert S.get_kv_cache_shape(3, 32, 4, 64, "bfloat16", packed=True) == (3, 8, 32, 64)


def test_kv_cache_shape_of_numpy_ints_is_python_ints():
    """Found by review: NumPy integers went into the tuple as given, and 2 * num_kv_heads of an
    int32 2^30 wrapped to -2^31."""
    shape = S.get_kv_cache_shape(np.int64(4), np.int32(16), np.int32(2**30), np.int16(64), "nvfp4")
    assert shape == (4, 2**31, 16, 36) and all(type(x) is int for x in shape)
    spec = S.KVCacheSpec(16, 8, 128)
    assert type(spec.num_blocks_for(np.int32(10**9), np.int32(2**20))) is int
    assert spec.num_blocks_for(np.int64(10**15), np.int32(2**20)) == 10**15 // (spec.page_size_bytes * 2**20)


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_kv_cache_shape(layout):
    assert S.get_kv_cache_shape(10, 16, 8, 128, "nvfp4", layout, packed=False) == (10, 2, 16, 8, 72)
    assert S.get_kv_cache_shape(10, 16, 8, 128, "nvfp4_4over6", layout, packed=False) == \
        (10, 2, 16, 8, 72)
    assert S.get_kv_cache_shape(3, 32, 4, 64, "nvfp4", layout=layout, packed=False) == (3, 2, 32, 4, 36)
    for d in UNQUANTIZED + ["fp8", "fp8_e4m3", "fp8_e5m2"]:
        assert S.get_kv_cache_shape(10, 16, 8, 128, d, layout) == (10, 2, 16, 8, 128)
    # 100 is fine unquantized, not for nvfp4
    assert S.get_kv_cache_shape(0, 1, 1, 100) == (0, 2, 1, 1, 100)
    with pytest.raises(ValueError, match="head_size"):
        S.get_kv_cache_shape(1, 16, 8, 100, "nvfp4", layout, packed=False)


@pytest.mark.parametrize("dtype, packed", [("nvfp4", None), ("nvfp4_4over6", None), ("nvfp4", True),
                                           ("bfloat16", True)])
def test_packed_nhd_rejected(dtype, packed):
    # NHD order (0, 2, 1, 3) of a packed cache interleaves K and V heads at each position.
    with pytest.raises(ValueError, match="NHD.*interleaves K and V.*packed=False"):
        S.get_kv_cache_shape(4, 16, 8, 128, dtype, "NHD", packed=packed)
    with pytest.raises(ValueError, match="NHD.*interleaves K and V"):
        S.get_kv_cache_stride_order("NHD", dtype, packed=packed)
    with pytest.raises(ValueError, match="NHD.*interleaves K and V"):
        S.allocate_kv_cache(S.KVCacheSpec(16, 8, 128, cache_dtype=dtype), 2, layout="NHD", packed=True,
                            backend="numpy")


def test_packed_argument_checked():
    with pytest.raises(ValueError, match="packed"):
        S.get_kv_cache_shape(1, 16, 8, 128, "nvfp4", packed=1)
    with pytest.raises(ValueError, match="packed"):
        S.allocate_kv_cache(S.KVCacheSpec(16, 8, 128), 1, packed=None, backend="numpy")


def test_kv_cache_shape_rejects():
    with pytest.raises(ValueError, match="layout"):
        S.get_kv_cache_shape(1, 16, 8, 128, "nvfp4", "HDN")
    with pytest.raises(ValueError, match="cache_dtype_str"):
        S.get_kv_cache_shape(1, 16, 8, 128, "fp4")
    with pytest.raises(ValueError, match="num_blocks"):
        S.get_kv_cache_shape(-1, 16, 8, 128)
    with pytest.raises(ValueError, match="block_size"):
        S.get_kv_cache_shape(1, 0, 8, 128)
    with pytest.raises(ValueError, match="num_kv_heads"):
        S.get_kv_cache_shape(1, 16, 0, 128)


def test_stride_order():
    # 5-D: what the default dtype ("auto") and packed=False give, as before
    assert S.get_kv_cache_stride_order("HND") == (0, 1, 3, 2, 4)
    assert S.get_kv_cache_stride_order("NHD") == (0, 1, 2, 3, 4)
    assert S.get_kv_cache_stride_order("HND", "nvfp4", packed=False) == (0, 1, 3, 2, 4)
    assert S.get_kv_cache_stride_order("NHD", "nvfp4", packed=False) == (0, 1, 2, 3, 4)
    # packed (nvfp4's default): physical = logical
    assert S.get_kv_cache_stride_order("HND", "nvfp4") == (0, 1, 2, 3)
    assert S.get_kv_cache_stride_order(cache_dtype_str="nvfp4_4over6") == (0, 1, 2, 3)
    with pytest.raises(ValueError, match="layout"):
        S.get_kv_cache_stride_order("hnd")
    with pytest.raises(ValueError, match="cache_dtype_str"):
        S.get_kv_cache_stride_order("HND", "fp4")


@pytest.mark.parametrize("dtype", ["nvfp4", "nvfp4_4over6", "auto", "fp8_e4m3"])
@pytest.mark.parametrize("packed", [None, True, False])
def test_stride_order_rank_matches_shape_rank(dtype, packed):
    shape = S.get_kv_cache_shape(4, 16, 8, 128, dtype, "HND", packed=packed)
    order = S.get_kv_cache_stride_order("HND", dtype, packed=packed)
    assert sorted(order) == list(range(len(shape)))


# ---------------------------------------------------------------------------------------------
# KVCacheSpec


@pytest.mark.parametrize(
    "kw, page",
    [
        # the FORMAT.md numbers
        (dict(block_size=16, num_kv_heads=8, head_size=128), 18432),
        (dict(block_size=16, num_kv_heads=8, head_size=128, cache_dtype="nvfp4_4over6"), 18432),
        (dict(block_size=16, num_kv_heads=8, head_size=128, cache_dtype="bfloat16"), 65536),
        (dict(block_size=16, num_kv_heads=8, head_size=128, cache_dtype="auto"), 65536),
        (dict(block_size=16, num_kv_heads=8, head_size=128, cache_dtype="half"), 65536),
        (dict(block_size=16, num_kv_heads=8, head_size=128, cache_dtype="float16"), 65536),
        (dict(block_size=16, num_kv_heads=8, head_size=128, cache_dtype="fp8"), 32768),
        (dict(block_size=16, num_kv_heads=8, head_size=128, cache_dtype="fp8_e4m3"), 32768),
        (dict(block_size=16, num_kv_heads=8, head_size=128, cache_dtype="fp8_e5m2"), 32768),
        (dict(block_size=16, num_kv_heads=8, head_size=128, cache_dtype="float32"), 131072),
        (dict(block_size=16, num_kv_heads=8, head_size=128, cache_dtype="float"), 131072),
        # by hand: F(64) = 32 + 4 = 36 -> 32 * 4 * 72
        (dict(block_size=32, num_kv_heads=4, head_size=64), 9216),
        # F(128) + F(64) = 72 + 36 = 108 -> 16 * 2 * 108
        (dict(block_size=16, num_kv_heads=2, head_size=128, head_size_v=64), 3456),
        # F(512) = 256 + 32 = 288 -> 64 * 1 * 576 (512: the largest head size the operations take)
        (dict(block_size=64, num_kv_heads=1, head_size=512), 36864),
        # F(16) = 9 -> 1 * 1 * 18
        (dict(block_size=1, num_kv_heads=1, head_size=16), 18),
        # bf16 with D != Dv: 2 * 16 * 2 * (128 + 64)
        (dict(block_size=16, num_kv_heads=2, head_size=128, head_size_v=64,
              cache_dtype="bfloat16"), 12288),
        # fp8, odd head size: 8 * 3 * (80 + 80)
        (dict(block_size=8, num_kv_heads=3, head_size=80, cache_dtype="fp8"), 3840),
    ],
)
def test_page_size(kw, page):
    s = S.KVCacheSpec(**kw)
    assert s.page_size_bytes == page
    assert s.bytes_per_token * s.block_size == page
    assert s.bytes_per_token == page // kw["block_size"]


def test_spec_defaults_and_frozen():
    s = S.KVCacheSpec(16, 8, 128)
    assert s.cache_dtype == "nvfp4"
    assert s.head_size_v == 128
    assert s.quant_mode is S.KVQuantMode.NVFP4
    assert S.KVCacheSpec(16, 8, 128, cache_dtype="auto").quant_mode is S.KVQuantMode.NONE
    assert s == S.KVCacheSpec(16, 8, 128, 128, "nvfp4")
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.block_size = 32


def test_num_blocks_for():
    s = S.KVCacheSpec(16, 8, 128)  # 18432 B per page
    assert s.num_blocks_for(18432 * 10) == 10
    assert s.num_blocks_for(18432 * 10 + 18431) == 10
    assert s.num_blocks_for(18432 * 10 - 1) == 9
    assert s.num_blocks_for(18432 * 10, num_layers=2) == 5
    assert s.num_blocks_for(18432 * 10, num_layers=3) == 3
    assert s.num_blocks_for(0) == 0
    assert s.max_tokens_for(18432 * 10 + 5) == 160
    assert s.max_tokens_for(18432 * 10, num_layers=4) == 32
    assert S.KVCacheSpec(16, 8, 128, cache_dtype="bfloat16").num_blocks_for(2**30, 32) == 512
    with pytest.raises(ValueError, match="num_layers"):
        s.num_blocks_for(100, num_layers=0)
    with pytest.raises(ValueError, match="memory_bytes"):
        s.num_blocks_for(-1)


@pytest.mark.parametrize(
    "kw, word",
    [
        (dict(block_size=0, num_kv_heads=8, head_size=128), "block_size"),
        (dict(block_size=-16, num_kv_heads=8, head_size=128), "block_size"),
        (dict(block_size=16.0, num_kv_heads=8, head_size=128), "block_size"),
        (dict(block_size=True, num_kv_heads=8, head_size=128), "block_size"),
        (dict(block_size=16, num_kv_heads=0, head_size=128), "num_kv_heads"),
        (dict(block_size=16, num_kv_heads=8, head_size=0), "head_size"),
        (dict(block_size=16, num_kv_heads=8, head_size=100), "head_size"),
        (dict(block_size=16, num_kv_heads=8, head_size=128, head_size_v=40), "head_size_v"),
        (dict(block_size=16, num_kv_heads=8, head_size=128, head_size_v=0,
              cache_dtype="bfloat16"), "head_size_v"),
        (dict(block_size=16, num_kv_heads=8, head_size=128, cache_dtype="int4"), "cache_dtype"),
    ],
)
def test_spec_rejects(kw, word):
    with pytest.raises(ValueError, match=word):
        S.KVCacheSpec(**kw)


def test_spec_unquantized_any_head_size():
    assert S.KVCacheSpec(16, 8, 100, cache_dtype="bfloat16").page_size_bytes == 2 * 16 * 8 * 200


# ---------------------------------------------------------------------------------------------
# allocation


def _phys_strides(N, T, H, F, layout):
    if layout == "HND":
        return (2 * H * T * F, H * T * F, F, T * F, 1)
    return (2 * H * T * F, H * T * F, H * F, F, 1)


@needs_torch
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_allocate_torch(layout):
    N, T, H, D = 3, 16, 4, 64
    F = 36
    c = S.allocate_kv_cache(S.KVCacheSpec(T, H, D), N, layout=layout, backend="torch")
    assert isinstance(c, torch.Tensor)
    assert c.dtype == torch.uint8 and c.device.type == "cpu"
    assert tuple(c.shape) == (N, 2, T, H, F)
    assert c.stride() == _phys_strides(N, T, H, F, layout)
    assert c.untyped_storage().nbytes() == N * 2 * T * H * F
    assert not c.any()
    order = S.get_kv_cache_stride_order(layout)
    assert c.permute(order).is_contiguous()


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_allocate_numpy(layout):
    N, T, H, D = 2, 8, 3, 128
    F = 72
    c = S.allocate_kv_cache(S.KVCacheSpec(T, H, D), N, layout=layout, backend="numpy")
    assert isinstance(c, np.ndarray)
    assert c.dtype == np.uint8
    assert c.shape == (N, 2, T, H, F)
    assert c.strides == _phys_strides(N, T, H, F, layout)
    assert not c.any()
    assert c.transpose(S.get_kv_cache_stride_order(layout)).flags.c_contiguous


@needs_torch
def test_allocate_auto_backend_and_dtypes():
    c = S.allocate_kv_cache(S.KVCacheSpec(16, 2, 64), 1)
    assert isinstance(c, torch.Tensor) and c.dtype == torch.uint8
    # fp8 caches are uint8, as STR_DTYPE_TO_TORCH_DTYPE (vLLM's) says (float8 types before)
    for dt, tdt in [("auto", torch.bfloat16), ("bfloat16", torch.bfloat16),
                    ("half", torch.float16), ("float32", torch.float32),
                    ("fp8", torch.uint8), ("fp8_e5m2", torch.uint8),
                    ("nvfp4_4over6", torch.uint8)]:
        c = S.allocate_kv_cache(S.KVCacheSpec(16, 2, 64, cache_dtype=dt), 2, backend="torch")
        assert c.dtype == tdt, dt
        assert c.shape == S.get_kv_cache_shape(2, 16, 2, 64, dt, packed=False)
        page = S.KVCacheSpec(16, 2, 64, cache_dtype=dt).page_size_bytes
        assert c.element_size() * c.numel() == 2 * page


def test_allocate_numpy_dtypes():
    for dt, ndt in [("fp8", np.uint8), ("half", np.float16), ("float", np.float32)]:
        spec = S.KVCacheSpec(4, 2, 32, cache_dtype=dt)
        c = S.allocate_kv_cache(spec, 3, backend="numpy")
        assert c.dtype == ndt
        assert c.nbytes == 3 * spec.page_size_bytes
    for dt in ["auto", "bfloat16"]:
        with pytest.raises(ValueError, match="bfloat16"):
            S.allocate_kv_cache(S.KVCacheSpec(4, 2, 32, cache_dtype=dt), 1, backend="numpy")


@pytest.mark.parametrize("backend", ["numpy"] + (["torch"] if torch is not None else []))
def test_allocate_packed(backend):
    # packed=True: vLLM's (N, 2H, T, F), contiguous, the same bytes per page as the 5-D HND cache
    N, T, H, D, F = 3, 16, 4, 64, 36
    spec = S.KVCacheSpec(T, H, D)
    c = S.allocate_kv_cache(spec, N, packed=True, backend=backend)
    assert tuple(c.shape) == (N, 2 * H, T, F) == spec.kv_cache_shape(N)
    strides = c.stride() if backend == "torch" else c.strides
    assert tuple(strides) == (2 * H * T * F, T * F, F, 1)
    assert (c.numel() if backend == "torch" else c.size) == N * spec.page_size_bytes
    c5 = S.allocate_kv_cache(spec, N, backend=backend)  # default: 5-D (N, 2, T, H, F) HND
    assert tuple(c5.shape) == (N, 2, T, H, F) == spec.kv_cache_shape(N, packed=False)
    # The 5-D HND cache's physical [N][2][H][T][F] is the packed tensor's memory order.
    if backend == "torch":
        same = c5.permute(0, 1, 3, 2, 4).reshape(N, 2 * H, T, F)
        assert same.data_ptr() == c5.data_ptr() and same.stride() == c.stride()
    else:
        same = c5.transpose(0, 1, 3, 2, 4).reshape(N, 2 * H, T, F)
        assert np.shares_memory(same, c5) and same.strides == c.strides


def test_allocate_rejects():
    spec = S.KVCacheSpec(16, 2, 128)
    with pytest.raises(ValueError, match="head_size_v"):
        S.allocate_kv_cache(S.KVCacheSpec(16, 2, 128, head_size_v=64), 1, backend="numpy")
    with pytest.raises(ValueError, match="backend"):
        S.allocate_kv_cache(spec, 1, backend="cupy")
    with pytest.raises(ValueError, match="layout"):
        S.allocate_kv_cache(spec, 1, layout="THD", backend="numpy")
    with pytest.raises(ValueError, match="device"):
        S.allocate_kv_cache(spec, 1, device="cuda", backend="numpy")
    with pytest.raises(ValueError, match="num_blocks"):
        S.allocate_kv_cache(spec, -1, backend="numpy")
    with pytest.raises(TypeError, match="spec"):
        S.allocate_kv_cache((16, 2, 128), 1, backend="numpy")
    # A page side (T * H * F) of 2 GiB or more, which no operation takes: refused before a page is
    # allocated. One token fewer is the largest side (29826161 * 72 = 2^31 - 56); zero pages of it
    # allocate nothing. fp8 has no such limit.
    with pytest.raises(ValueError, match="2147483664 bytes; the kernels address at most 2 GiB - 1"):
        S.allocate_kv_cache(S.KVCacheSpec(29826162, 1, 128), 1, backend="numpy")
    assert S.allocate_kv_cache(S.KVCacheSpec(29826161, 1, 128), 0, backend="numpy").shape == (0, 2, 29826161, 1, 72)
    assert S.allocate_kv_cache(S.KVCacheSpec(29826162, 1, 128, cache_dtype="fp8"), 0, backend="numpy").size == 0
    # More bytes than a tensor addresses: the named error, not the framework's overflow (review).
    for backend in ("numpy", "torch"):
        with pytest.raises(ValueError, match="num_blocks: 4611686018427387904 pages"):
            S.allocate_kv_cache(spec, 2**62, backend=backend)
        # exactly 2^63 bytes (32-byte fp8 pages) is one too many (mutation testing)
        with pytest.raises(ValueError, match="more bytes than a tensor can address"):
            S.allocate_kv_cache(S.KVCacheSpec(1, 1, 16, cache_dtype="fp8"), 2**58, backend=backend)
    # The page side counts the larger head: V's 2^26 x 288 bytes pass 2 GiB where K's do not
    # (mutation testing: a check of K's side alone passed).
    with pytest.raises(ValueError, match="the kernels address at most 2 GiB"):
        S.allocate_kv_cache(S.KVCacheSpec(2**20, 64, 16, head_size_v=512), 0, backend="numpy")


def test_allocate_on_a_device_torch_cannot_use_is_a_value_error():
    """Mutation testing: torch without CUDA raises AssertionError for a CUDA device (its lazy
    init), which must reach the caller as the documented ValueError."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("needs a torch that cannot use CUDA")
    with pytest.raises(ValueError, match="device: 'cuda'"):
        S.allocate_kv_cache(S.KVCacheSpec(16, 2, 128), 1, device="cuda")


def test_allocate_on_something_that_is_no_device_is_a_value_error():
    """Found by review: torch's TypeError for an object that is no device came through raw."""
    pytest.importorskip("torch")
    with pytest.raises(ValueError, match="device: <object"):
        S.allocate_kv_cache(S.KVCacheSpec(16, 2, 128), 1, device=object())


# ---------------------------------------------------------------------------------------------
# torch is not imported at module load


def _run(code, prefix="", cwd=None):
    r = subprocess.run([sys.executable, "-c", prefix + textwrap.dedent(code)], capture_output=True,
                       text=True, timeout=120, cwd=cwd)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


_LOAD_FROM_FILE = f"""
import importlib.util, sys
def load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod
spec_mod = load("spec_under_test", {str(SPEC_PY)!r})
views_mod = load("views_under_test", {str(SPEC_PY.with_name("views.py"))!r})
"""


def test_import_does_not_import_torch():
    out = _run("""
    m = spec_mod.STR_DTYPE_TO_TORCH_DTYPE
    assert "nvfp4" in m and len(m) == 20 and "auto" not in m and "nvfp4" in list(m)
    spec_mod.KVCacheSpec(16, 8, 128).page_size_bytes
    spec_mod.is_quantized_kv_cache("nvfp4")
    print("torch" in sys.modules)
    """, prefix=_LOAD_FROM_FILE)
    assert out.strip() == "False"


def test_works_without_torch():
    # sys.modules["torch"] = None makes "import torch" raise ImportError, as if not installed.
    out = _run("""
    import numpy as np
    s = spec_mod.KVCacheSpec(16, 8, 128)
    assert s.page_size_bytes == 18432
    c = spec_mod.allocate_kv_cache(s, 2)  # backend auto -> numpy
    assert isinstance(c, np.ndarray) and c.shape == (2, 2, 16, 8, 72)
    kd, ks, vd, vs = views_mod.nvfp4_kv_cache_split_views(c)
    assert kd.shape == (2, 16, 8, 64) and vs.shape == (2, 4, 4, 8, 8)
    try:
        spec_mod.STR_DTYPE_TO_TORCH_DTYPE["nvfp4"]
    except ImportError:
        print("ok")
    """, prefix="import sys; sys.modules['torch'] = None\n" + _LOAD_FROM_FILE)
    assert out.strip() == "ok"


def test_package_imports_where_torch_is_blocked(tmp_path):
    """Found by review: with sys.modules["torch"] = None (a machine without torch, as tests
    simulate it), `import nvfp4kv` imported its torch ops and failed."""
    try:
        import nvfp4kv
    except ImportError as e:
        pytest.skip(f"package nvfp4kv not importable here (not installed?): {e}")
    pkg_dir = Path(nvfp4kv.__file__).resolve().parent
    code = f"""
    import sys
    sys.modules["torch"] = None
    sys.path.insert(0, {str(pkg_dir.parent)!r})
    import numpy as np
    import nvfp4kv
    spec = nvfp4kv.KVCacheSpec(16, 2, 64)
    kv = nvfp4kv.allocate_kv_cache(spec, 2)
    nvfp4kv.store(np.ones((3, 2, 64), np.float32), np.ones((3, 2, 64), np.float32), kv, np.arange(3), 1.0, 1.0)
    print(type(kv).__module__, int(kv.any()), "nvfp4kv.ops" in sys.modules)
    """
    assert _run(code, cwd=tmp_path).split() == ["numpy", "1", "False"]


def test_package_import_does_not_import_torch(tmp_path):
    # The package under test is the one this process imports: the installed one (the source
    # tree's python/nvfp4kv has no compiled extension, and in CI it is only links to the
    # installed modules, without __init__.py). A fresh interpreter, started outside the source
    # tree with that package first on its path, imports it; nothing there may import torch.
    try:
        import nvfp4kv
    except ImportError as e:
        pytest.skip(f"package nvfp4kv not importable here (not installed?): {e}")
    pkg_dir = Path(nvfp4kv.__file__).resolve().parent
    code = f"""
    import sys
    sys.path.insert(0, {str(pkg_dir.parent)!r})
    import nvfp4kv.spec
    print(nvfp4kv.__file__)
    print("torch" in sys.modules)
    """
    imported, torch_imported = _run(code, cwd=tmp_path).splitlines()
    assert Path(imported).resolve().parent == pkg_dir
    assert torch_imported == "False"


def test_numpy_integers_and_argument_names():
    """Found by review: NumPy integers were refused with a message that read as false, and the
    dtype errors named an argument the call does not have."""
    spec = S.KVCacheSpec(np.int64(16), np.int32(8), np.int64(128))
    assert spec == S.KVCacheSpec(16, 8, 128) and type(spec.block_size) is int
    assert S.nvfp4_kv_cache_full_dim(np.int64(128)) == 72
    bools = [np.bool_(True), np.array(True)] + ([torch.tensor(True)] if torch is not None else [])
    for b in bools:  # torch's 0-d bool tensor is an index (1) to operator.index; so was NumPy 2.0's bool
        with pytest.raises(ValueError, match="block_size"):
            S.KVCacheSpec(b, 8, 128)
    with pytest.raises(ValueError, match="^cache_dtype: unknown"):
        S.KVCacheSpec(16, 8, 128, cache_dtype="nvfp5")
    with pytest.raises(ValueError, match="^cache_dtype_str: unknown"):
        S.get_kv_cache_shape(4, 16, 8, 128, cache_dtype_str=None)


def test_empty_numpy_cache_keeps_its_layout():
    spec = S.KVCacheSpec(16, 2, 64)
    kv = S.allocate_kv_cache(spec, 0, backend="numpy")
    want = S.allocate_kv_cache(spec, 1, backend="numpy")
    assert kv.shape[0] == 0 and kv.strides == want.strides  # HND, as with pages (not NumPy's 0s)


def test_allocation_errors_keep_their_kind():
    """Found by review: out of memory became ValueError("device: ..."), which an engine sizing its
    cache by catching torch.OutOfMemoryError (a RuntimeError) would miss. A bad device is still
    ValueError."""
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="^device: 'tpu'"):
        S.allocate_kv_cache(S.KVCacheSpec(16, 2, 64), 1, device="tpu")
    with pytest.raises(RuntimeError) as e:  # 2^40 pages of 4.5 KB: no machine has that
        S.allocate_kv_cache(S.KVCacheSpec(16, 2, 64), 2**40, backend="torch")
    assert not isinstance(e.value, ValueError) and torch is not None
