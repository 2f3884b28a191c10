"""nvfp4kv: NVFP4 paged KV cache (4-bit E2M1 values, E4M3 scale per 16, fp32 scale per tensor).

Byte-compatible with vLLM's ``kv_cache_dtype="nvfp4"`` layout; CPU path and CUDA kernels
(Ampere, Hopper, Blackwell) that write identical bytes. Torch is optional.
"""

import sys as _sys

from ._C import __version__
from .api import (build_info, cpu_threads, decode_attention, decode_workspace, decode_workspace_bytes, dequantize,
                  gather_dequant, prepare_store, reshape_and_cache_flash, set_cpu_threads, store, store_workspace,
                  store_workspace_bytes)
from .paths import cmake_dir, get_include, get_library, get_library_dir
from .scales import (ScaleTracker, amax, decode_from_encode, decode_from_x6, decode_scale, encode_from_decode,
                     x6_from_decode)
from .spec import (
    MODELOPT_TO_VLLM_KV_CACHE_DTYPE_MAP,
    STR_DTYPE_TO_TORCH_DTYPE,
    KVCacheSpec,
    KVQuantMode,
    allocate_kv_cache,
    get_kv_cache_shape,
    get_kv_cache_stride_order,
    get_kv_quant_mode,
    is_nvfp4_kv_cache,
    is_quantized_kv_cache,
    nvfp4_kv_cache_full_dim,
)
from .views import nvfp4_kv_cache_split_views, nvfp4_split_data_scale

# torch is optional: the custom ops now, or when torch is imported (an entry of None in
# sys.modules blocks torch's import: review, 2026-12-07)
if _sys.modules.get("torch") is not None:
    from . import ops  # noqa: F401  (registers torch.ops.nvfp4kv.*)
else:
    from . import _torch_hook

    def _import_ops() -> None:
        from . import ops  # noqa: F401

    _torch_hook.after_import("torch", _import_ops, "the torch custom ops were not registered when torch was "
                             "imported; torch.compile will not trace nvfp4kv's calls until `import nvfp4kv.ops` "
                             "succeeds")

__all__ = [
    "__version__",
    "build_info",
    "cmake_dir",
    "get_include",
    "get_library",
    "get_library_dir",
    "store",
    "prepare_store",
    "store_workspace",
    "store_workspace_bytes",
    "dequantize",
    "gather_dequant",
    "decode_attention",
    "decode_workspace",
    "decode_workspace_bytes",
    "set_cpu_threads",
    "cpu_threads",
    "reshape_and_cache_flash",
    "amax",
    "ScaleTracker",
    "decode_scale",
    "x6_from_decode",
    "decode_from_x6",
    "encode_from_decode",
    "decode_from_encode",
    "KVCacheSpec",
    "KVQuantMode",
    "MODELOPT_TO_VLLM_KV_CACHE_DTYPE_MAP",
    "STR_DTYPE_TO_TORCH_DTYPE",
    "allocate_kv_cache",
    "get_kv_cache_shape",
    "get_kv_cache_stride_order",
    "get_kv_quant_mode",
    "is_nvfp4_kv_cache",
    "is_quantized_kv_cache",
    "nvfp4_kv_cache_full_dim",
    "nvfp4_kv_cache_split_views",
    "nvfp4_split_data_scale",
]
