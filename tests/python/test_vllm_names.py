"""The names nvfp4kv shares with vLLM carry vLLM's values (issue #22, points 4-6).

Each expected value below is copied from vLLM's source (repository vllm-project/vllm); the
comment above it names the file and the commit it was read at. When vLLM changes one, this is
the file to update, together with python/nvfp4kv/spec.py / views.py and docs/integration.md.

- KV_CACHE_INTERFACE: vllm/v1/kv_cache_interface.py @ 001cabc1
- TORCH_UTILS: vllm/utils/torch_utils.py @ 0024350b
- the packed NVFP4 cache (N, 2*num_kv_heads, block_size, full_dim) and its stride orders: vLLM's
  FlashInfer/TRT-LLM NVFP4 path since PR #44455 (merged; HND on SM10x), first read in
  vllm/v1/attention/backends/flashinfer_trtllm_utils.py of a fork branch, and torch_utils @
  0024350b's nvfp4_split_data_scale docstring ("callers split K and V with
  kv_cache.split(num_kv_heads, dim=1)").
"""

import numpy as np
import pytest
from conftest import load_package_module

S = load_package_module("spec")
V = load_package_module("views")

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch not installed")

KV_CACHE_INTERFACE = "vllm/v1/kv_cache_interface.py @ 001cabc1"
TORCH_UTILS = "vllm/utils/torch_utils.py @ 0024350b"


# ---------------------------------------------------------------------------------------------
# vllm/v1/kv_cache_interface.py @ 001cabc1


def test_kv_quant_mode_members_and_values():
    # vllm/v1/kv_cache_interface.py @ 001cabc1: class KVQuantMode(IntEnum). (A newer, unattributed
    # copy inserts INT4_PER_TOKEN_HEAD = 4 and moves NVFP4 to 5; this pins the attributed file.)
    assert {m.name: m.value for m in S.KVQuantMode} == {
        "NONE": 0,
        "FP8_PER_TENSOR": 1,
        "INT8_PER_TOKEN_HEAD": 2,
        "FP8_PER_TOKEN_HEAD": 3,
        "NVFP4": 4,
    }
    assert issubclass(S.KVQuantMode, int)


def test_kv_quant_mode_properties():
    # vllm/v1/kv_cache_interface.py @ 001cabc1: KVQuantMode.is_per_token_head, .is_nvfp4
    per_token_head = {m.name for m in S.KVQuantMode if m.is_per_token_head}
    assert per_token_head == {"INT8_PER_TOKEN_HEAD", "FP8_PER_TOKEN_HEAD"}
    assert {m.name for m in S.KVQuantMode if m.is_nvfp4} == {"NVFP4"}


@pytest.mark.parametrize("dtype, mode", [
    # vllm/v1/kv_cache_interface.py @ 001cabc1: get_kv_quant_mode
    ("int8_per_token_head", "INT8_PER_TOKEN_HEAD"),
    ("fp8_per_token_head", "FP8_PER_TOKEN_HEAD"),
    ("nvfp4", "NVFP4"),
    ("fp8", "FP8_PER_TENSOR"),  # any str starting with "fp8"
    ("fp8_e4m3", "FP8_PER_TENSOR"),
    ("fp8_e5m2", "FP8_PER_TENSOR"),
    ("fp8_inc", "FP8_PER_TENSOR"),
    ("fp8_ds_mla", "FP8_PER_TENSOR"),
    ("fp8anything", "FP8_PER_TENSOR"),
    ("auto", "NONE"),
    ("bfloat16", "NONE"),
    ("int8", "NONE"),
    ("int4_per_token_head", "NONE"),
    ("turboquant_k8v4", "NONE"),
    ("nvfp4_4over6", "NONE"),  # vLLM's get_kv_quant_mode knows only "nvfp4"
    ("NVFP4", "NONE"),
    ("", "NONE"),
])
def test_get_kv_quant_mode(dtype, mode):
    assert S.get_kv_quant_mode(dtype) is S.KVQuantMode[mode]


# ---------------------------------------------------------------------------------------------
# vllm/utils/torch_utils.py @ 0024350b


@pytest.mark.parametrize("dtype, quantized", [
    # vllm/utils/torch_utils.py @ 0024350b: is_quantized_kv_cache =
    # startswith("fp8") or endswith("per_token_head") or startswith("nvfp4")
    ("fp8", True), ("fp8_e4m3", True), ("fp8_e5m2", True), ("fp8_inc", True), ("fp8_ds_mla", True),
    ("int8_per_token_head", True), ("fp8_per_token_head", True), ("int4_per_token_head", True),
    ("nvfp4", True), ("nvfp4_4over6", True),
    ("auto", False), ("bfloat16", False), ("float16", False), ("half", False), ("float", False),
    ("float32", False), ("int8", False), ("turboquant_k8v4", False), ("NVFP4", False), ("", False),
])
def test_is_quantized_kv_cache(dtype, quantized):
    assert S.is_quantized_kv_cache(dtype) is quantized


def test_the_two_vllm_is_quantized_kv_cache_differ_where_documented():
    # kv_cache_interface.py @ 001cabc1's is_quantized_kv_cache is get_kv_quant_mode(s) != NONE;
    # torch_utils.py @ 0024350b's (nvfp4kv.is_quantized_kv_cache) differs on these strings only.
    def interface_version(s):
        return S.get_kv_quant_mode(s) != S.KVQuantMode.NONE
    strings = ["auto", "bfloat16", "float16", "half", "float", "float32", "fp8", "fp8_e4m3",
               "fp8_e5m2", "fp8_inc", "fp8_ds_mla", "int8", "int4_per_token_head",
               "int8_per_token_head", "fp8_per_token_head", "turboquant_k8v4", "nvfp4",
               "nvfp4_4over6"]
    differ = {s for s in strings if interface_version(s) != S.is_quantized_kv_cache(s)}
    assert differ == {"int4_per_token_head", "nvfp4_4over6"}


# vllm/utils/torch_utils.py @ 0024350b: STR_DTYPE_TO_TORCH_DTYPE (torch attribute names)
VLLM_STR_DTYPE_TO_TORCH_DTYPE = {
    "float32": "float32",
    "half": "half",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float": "float",
    "fp8": "uint8",
    "fp8_e4m3": "uint8",
    "fp8_e5m2": "uint8",
    "int8": "int8",
    "int4_per_token_head": "uint8",
    "int8_per_token_head": "int8",
    "fp8_per_token_head": "uint8",
    "fp8_inc": "float8_e4m3fn",
    "fp8_ds_mla": "uint8",
    "turboquant_k8v4": "uint8",
    "turboquant_4bit_nc": "uint8",
    "turboquant_k3v4_nc": "uint8",
    "turboquant_3bit_nc": "uint8",
    "nvfp4": "uint8",
    "nvfp4_4over6": "uint8",
}


def test_str_dtype_to_torch_dtype_keys():
    # keys and their order, without torch
    assert list(S.STR_DTYPE_TO_TORCH_DTYPE) == list(VLLM_STR_DTYPE_TO_TORCH_DTYPE)


@needs_torch
def test_str_dtype_to_torch_dtype_values():
    m = S.STR_DTYPE_TO_TORCH_DTYPE
    assert {k: m[k] for k in m} == {k: getattr(torch, v) for k, v in VLLM_STR_DTYPE_TO_TORCH_DTYPE.items()}


def test_modelopt_to_vllm_kv_cache_dtype_map():
    # vllm/utils/torch_utils.py @ 0024350b: MODELOPT_TO_VLLM_KV_CACHE_DTYPE_MAP (looked up with
    # kv_algo.lower())
    assert S.MODELOPT_TO_VLLM_KV_CACHE_DTYPE_MAP == {
        "fp8": "fp8_e4m3",
        "mixed_precision": "auto",
        "nvfp4": "nvfp4",
    }


@pytest.mark.parametrize("head_size", [16, 32, 64, 80, 96, 112, 128, 192, 256, 512])
def test_nvfp4_kv_cache_full_dim(head_size):
    # vllm/utils/torch_utils.py @ 0024350b: head_size // 2 + head_size // 16 (vLLM validates
    # nothing; nvfp4kv raises ValueError for a head size that is not a multiple of 16)
    assert S.nvfp4_kv_cache_full_dim(head_size) == head_size // 2 + head_size // 16


@pytest.mark.parametrize("block_size, num_kv_heads, head_size, head_size_v", [
    (16, 8, 128, 128), (16, 8, 128, 64), (32, 1, 64, 64), (64, 4, 256, 256), (16, 2, 512, 512),
])
def test_page_size_is_vllm_real_page_size_bytes(block_size, num_kv_heads, head_size, head_size_v):
    # vllm/v1/kv_cache_interface.py @ 001cabc1: FullAttentionSpec.real_page_size_bytes =
    # block_size * num_kv_heads * (full_dim(head_size) + full_dim(head_size_v)) * dtype_size,
    # dtype_size 1 (uint8) for nvfp4
    full_dim = lambda d: d // 2 + d // 16  # noqa: E731
    vllm = block_size * num_kv_heads * (full_dim(head_size) + full_dim(head_size_v)) * 1
    spec = S.KVCacheSpec(block_size, num_kv_heads, head_size, head_size_v)
    assert spec.page_size_bytes == vllm


# ---------------------------------------------------------------------------------------------
# the packed cache of vLLM's FlashInfer/TRT-LLM NVFP4 path


def test_packed_cache_shape_and_stride_order():
    # (num_blocks, 2 * num_kv_heads, block_size, nvfp4_kv_cache_full_dim(head_size)), stride order
    # HND (0, 1, 2, 3); vLLM's NHD order (0, 2, 1, 3) is refused (K and V would interleave)
    assert S.get_kv_cache_shape(7, 16, 8, 128, "nvfp4") == (7, 16, 16, 72)
    assert S.get_kv_cache_stride_order("HND", "nvfp4") == (0, 1, 2, 3)
    with pytest.raises(ValueError, match="interleaves K and V"):
        S.get_kv_cache_stride_order("NHD", "nvfp4")


def _packed(backend, N, T, H, D):
    return S.allocate_kv_cache(S.KVCacheSpec(T, H, D), N, packed=True, backend=backend)


BACKENDS = ["numpy"] + (["torch"] if torch is not None else [])


def _split(x, H, dim):
    if isinstance(x, np.ndarray):
        return np.split(x, 2, axis=dim)
    return x.split(H, dim=dim)


def _transpose12(x):
    return x.swapaxes(1, 2) if isinstance(x, np.ndarray) else x.transpose(1, 2)


def _np(x):
    if torch is not None and isinstance(x, torch.Tensor):
        return (x.view(torch.uint8) if x.dtype != torch.uint8 else x).numpy()
    return np.asarray(x)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("H, T", [(2, 8), (4, 4), (1, 16)])
def test_nvfp4_split_data_scale_on_vllm_sides(backend, H, T):
    # vllm/utils/torch_utils.py @ 0024350b: nvfp4_split_data_scale(kv_side) -> (data, scale):
    # data uint8 (B, d1, d2, D/2); scale at offset d1*d2*data_dim (data_dim = full_dim*8//9),
    # float8_e4m3fn (B, d1, d2, D/16); inner strides scaled from the input's (order preserved)
    N, D = 3, 64
    F = 9 * D // 16
    kv = _packed(backend, N, T, H, D)
    rng = np.random.default_rng(H * 100 + T)
    flat = rng.integers(0, 256, size=N * 2 * H * T * F, dtype=np.uint8)
    if backend == "torch":
        kv.copy_(torch.from_numpy(flat.reshape(tuple(kv.shape))))
    else:
        kv[...] = flat.reshape(kv.shape)
    pages = flat.reshape(N, 2, H * T * F)  # [K side | V side] of each page
    data_dim = F * 8 // 9
    assert data_dim == D // 2
    # the attention read: kv_cache.split(num_kv_heads, dim=1) -> (N, H, T, F) sides
    # the store: kv_cache.transpose(1, 2).split(num_kv_heads, dim=-2) -> (N, T, H, F) sides
    for sides, order in ((_split(kv, H, 1), "HT"), (_split(_transpose12(kv), H, -2), "TH")):
        for s, side in enumerate(sides):
            data, scale = V.nvfp4_split_data_scale(side)
            d1, d2 = (H, T) if order == "HT" else (T, H)
            assert tuple(data.shape) == (N, d1, d2, D // 2)
            assert tuple(scale.shape) == (N, d1, d2, D // 16)
            if backend == "torch":
                assert data.dtype == torch.uint8 and scale.dtype == torch.float8_e4m3fn
            side_bytes = pages[:, s]
            want_data = side_bytes[:, : H * T * data_dim].reshape(N, H, T, data_dim)
            want_scale = side_bytes[:, H * T * data_dim:].reshape(N, H, T, D // 16)
            if order == "TH":
                want_data, want_scale = want_data.swapaxes(1, 2), want_scale.swapaxes(1, 2)
            np.testing.assert_array_equal(_np(data), want_data)
            np.testing.assert_array_equal(_np(scale), want_scale)


@needs_torch
def test_nvfp4_split_data_scale_strides_scaled_like_vllm():
    # vLLM scales each inner stride by data_dim / full_dim (data) and scale_dim / full_dim (scale)
    N, T, H, D = 2, 16, 4, 128
    F, half, S_ = 72, 64, 8
    kv = _packed("torch", N, T, H, D)
    for side in kv.split(H, dim=1) + kv.transpose(1, 2).split(H, dim=-2):
        data, scale = V.nvfp4_split_data_scale(side)
        s0, s1, s2, _ = side.stride()
        assert data.stride() == (s0, s1 // F * half, s2 // F * half, 1)
        assert scale.stride() == (s0, s1 // F * S_, s2 // F * S_, 1)
        assert scale.storage_offset() - side.storage_offset() == H * T * half
        assert data.storage_offset() == side.storage_offset()


@needs_torch
def test_nvfp4_split_data_scale_keyword_is_kv_side():
    kv = _packed("torch", 1, 16, 2, 64)
    data, _ = V.nvfp4_split_data_scale(kv_side=kv.split(2, dim=1)[0])
    assert tuple(data.shape) == (1, 2, 16, 32)


@needs_torch
def test_nhd_packed_side_rejected():
    # vLLM's split would return overlapping views for a side of an NHD-ordered packed cache (its
    # K and V interleave per position); nvfp4kv refuses it
    N, T, H, D = 2, 16, 2, 64
    F = 36
    nhd = torch.zeros(N, T, 2 * H, F, dtype=torch.uint8).transpose(1, 2)  # order (0, 2, 1, 3)
    with pytest.raises(ValueError, match="neither HND"):
        V.nvfp4_split_data_scale(nhd.split(H, dim=1)[0])
    with pytest.raises(ValueError, match="NHD-ordered packed cache"):
        V.nvfp4_kv_cache_split_views(nhd)
