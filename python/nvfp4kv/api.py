"""Quantize-and-store and dequantize: thin wrappers over the C ABI (``nvfp4kv._C``).

Validation lives in the C ABI. The binding resolves the common arguments itself (option strings,
Python floats, torch tensors, torch's current stream: a decode step's store is bound by this host
work) and calls the helpers below for everything else (numpy scalars, stream objects, unknown
options, whose error messages they produce). This module also allocates outputs.
"""

from __future__ import annotations

import numbers
import sys
from typing import Any, Optional, Tuple

from . import _C

_RECIPES = {name: i for i, name in enumerate(_C.RECIPES)}
_SCALE_LAYOUTS = {name: i for i, name in enumerate(_C.SCALE_LAYOUTS)}
_FLOAT_DTYPES = ("float32", "float16", "bfloat16")

__all__ = ["store", "prepare_store", "store_workspace", "store_workspace_bytes", "reshape_and_cache_flash", "dequantize",
           "gather_dequant", "build_info"]


def _choice(value: Any, table: dict, arg: str) -> int:
    if isinstance(value, str) and value in table:
        return table[value]
    raise ValueError(f"{arg}: {value!r} is not supported; expected one of {', '.join(map(repr, table))}")


def _framework(x: Any) -> str:
    mod = type(x).__module__
    for name in ("torch", "cupy", "numpy"):
        if mod == name or mod.startswith(name + "."):
            return name
    return "other"


def _stream_handle(stream: Any, like: Any) -> int:
    """The cudaStream_t to run on, as an integer.

    ``None`` means the caller's current stream: torch's current stream of the tensor's device,
    or cupy's current stream; 0 (the legacy default stream) for anything else. Also accepts an
    int, a ``torch.cuda.Stream`` (``.cuda_stream``), a ``cupy.cuda.Stream`` (``.ptr``) or any
    object with ``__cuda_stream__``.
    """
    if stream is None:
        fw = _framework(like)
        if fw == "torch" and like.is_cuda:
            import torch

            try:  # the raw handle without building a torch.cuda.Stream object (~10x cheaper)
                return torch._C._cuda_getCurrentRawStream(like.get_device())
            except AttributeError:
                return torch.cuda.current_stream(like.device).cuda_stream
        if fw == "cupy":
            import cupy

            return cupy.cuda.get_current_stream().ptr
        return 0
    if isinstance(stream, int):
        return stream
    if hasattr(stream, "__cuda_stream__"):
        return int(stream.__cuda_stream__()[1])
    for attr in ("cuda_stream", "ptr"):
        if hasattr(stream, attr):
            return int(getattr(stream, attr))
    raise TypeError(f"stream: {type(stream).__name__} is not a CUDA stream (int, torch/cupy stream)")


def _scale(x: Any) -> Any:
    # Python and numpy scalars go to the ABI as host floats; tensors (CPU or GPU) pass through so a
    # device scale is read by the kernel, never on the host.
    if isinstance(x, numbers.Real) and not hasattr(x, "__dlpack_device__"):
        return float(x)
    if _framework(x) == "numpy" and getattr(x, "ndim", 1) == 0:
        return float(x)
    return x


def store(
    key: Any,
    value: Any,
    kv_cache: Any,
    slot_mapping: Any,
    k_scale: Any = 1.0,
    v_scale: Any = 1.0,
    *,
    value_cache: Any = None,
    recipe: str = "nvfp4",
    scale_layout: str = "vllm",
    stream: Any = None,
    workspace: Any = None,
) -> None:
    """Quantize ``key``/``value`` to NVFP4 and write them into the paged cache, in place.

    Parameters
    ----------
    key, value : array ``[num_tokens, H, D]`` (and ``[num_tokens, H, Dv]``)
        bfloat16, float16 or float32 (the same for both); last stride 1, other strides free
        (views of a fused QKV tensor work). torch (CPU or CUDA), numpy, cupy.
    kv_cache : uint8 array
        ``(N, 2, T, H, F)`` with HND or NHD strides, packed ``(N, 2H, T, F)`` (HND), or the K side
        ``(N, T, H, F)`` when ``value_cache`` is given. ``F = D/2 + D/16``.
    slot_mapping : int64 or int32 array ``[num_tokens]``
        Token ``i`` goes to page ``slot // T``, position ``slot % T``; slots < 0 or >= N*T skip
        the token. Slots must be distinct.
    k_scale, v_scale : float or 1-element float32 tensor
        Decode global scales (usually ``amax / 448``). A GPU tensor is read by the kernel.
    value_cache : uint8 array ``(N, T, H, F)``, optional
        The V side when the cache is given as two sides (vLLM's ``kv_cache.unbind(1)``).
    recipe : {"nvfp4", "nvfp4_4over6"}
    scale_layout : {"vllm", "linear"}
        "vllm": K scales linear, V scales token-4 interleaved (HND, T % 4 == 0, D % 64 == 0);
        "linear": both linear.
    stream : optional
        CUDA stream; default: the current stream of the tensors' framework. Never synchronized.
    workspace : uint8 array, optional
        From :func:`store_workspace`. With it, a CUDA store whose rows overflow the GPU's L2
        three times (recipe nvfp4, HND, head size 32-128) sorts its tokens by page first and
        writes each page whole (24-31 % faster for scattered slots on an H200; the same bytes,
        and such a call keeps the last token of duplicate slots, as on the CPU); other calls
        ignore it. Reuse one workspace for every layer and step; stores sharing it must not run
        concurrently (one stream).

    Raises
    ------
    TypeError, ValueError, RuntimeError
        Bad dtype; bad shape/value/device; CUDA failure. The cache is untouched on error.
    """
    try:
        _C.store(key, value, kv_cache, slot_mapping, k_scale, v_scale, value_cache, recipe, scale_layout, stream,
                 workspace)
    except ValueError:
        if not _without_data(key, value, kv_cache, value_cache, slot_mapping, workspace):
            raise
        _ops().store(key, value, kv_cache, slot_mapping, _ops().scale_tensor(k_scale), _ops().scale_tensor(v_scale),
                     value_cache, recipe, scale_layout, workspace)


def _ops():
    """nvfp4kv.ops (the torch custom ops), imported on first use."""
    from . import ops

    return ops


def _without_data(*args: Any) -> bool:
    """Whether every tensor argument is a torch tensor without memory (meta, or fake under
    FakeTensorMode): such calls go to the torch custom ops, whose fake implementations need no
    data. A call mixing them with real tensors keeps the extension's error. Asked only after the
    extension refused a call, so it costs nothing on the eager path."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    given = [a for a in args if a is not None]
    return bool(given) and all(isinstance(a, torch.Tensor) and (a.is_meta or hasattr(a, "fake_mode"))
                               for a in given)


def prepare_store(
    kv_cache: Any,
    k_scale: Any = 1.0,
    v_scale: Any = 1.0,
    *,
    value_cache: Any = None,
    recipe: str = "nvfp4",
    scale_layout: str = "vllm",
    workspace: Any = None,
) -> Any:
    """A store for one layer's cache: ``prepared(key, value, slot_mapping, stream=None)``.

    The same operation and checks as :func:`store` with these arguments, but the cache, the two
    global scales and the workspace are imported once, here, instead of at every call: a
    decode step's store of a few tokens costs mostly this host work. The object keeps the tensors
    alive and reads them at each call (so in-place updates of a scale tensor are seen; scales
    given as Python or numpy numbers are taken by value, here); do not resize or reallocate
    them. Arguments are validated at each call, as by :func:`store`.
    """
    return _C.PreparedStore(kv_cache, k_scale, v_scale, value_cache, recipe, scale_layout, workspace)


def store_workspace_bytes(num_blocks: int, block_size: int) -> int:
    """Bytes of a :func:`store` workspace for caches of up to ``num_blocks`` blocks of ``block_size`` tokens."""
    return _C.store_workspace_bytes(num_blocks, block_size)


def store_workspace(kv_cache: Any, value_cache: Any = None) -> Any:
    """A zeroed :func:`store` workspace on the cache's device, for caches up to this one's size.

    Same framework as the cache (torch, cupy or numpy). Its size is
    ``store_workspace_bytes(N, T)``: 8 bytes per slot and 12 per block (14 MB for 100 000 blocks
    of 16 tokens), against 18 KB per block of an H 8, D 128 cache layer. For a cache given as
    two sides pass both (one 4-D side alone reads as a packed cache).
    """
    n, t = _cache_geometry(kv_cache, value_cache)[:2]
    nbytes = store_workspace_bytes(n, t)
    fw = _framework(kv_cache)
    if fw == "torch":
        import torch

        return torch.zeros(nbytes, dtype=torch.uint8, device=kv_cache.device)
    if fw == "cupy":
        import cupy

        with cupy.cuda.Device(kv_cache.device.id):
            return cupy.zeros(nbytes, dtype=cupy.uint8)
    import numpy as np

    return np.zeros(nbytes, dtype=np.uint8)


def reshape_and_cache_flash(
    key: Any,
    value: Any,
    key_cache: Any,
    value_cache: Any,
    slot_mapping: Any,
    kv_cache_dtype: str,
    k_scale: Any,
    v_scale: Any,
    *,
    scale_layout: str = "vllm",
    stream: Any = None,
    workspace: Any = None,
) -> None:
    """vLLM's ``reshape_and_cache_flash`` for ``kv_cache_dtype`` "nvfp4" / "nvfp4_4over6".

    Same arguments and semantics as vLLM's op (``key_cache``/``value_cache`` are the two sides
    ``kv_cache[:, 0]``, ``kv_cache[:, 1]``), except that out-of-range slots are skipped instead
    of written out of bounds. See :func:`store` for shapes, dtypes and ``workspace``.
    """
    _check_kv_cache_dtype(kv_cache_dtype)
    # Straight to the binding, as store() does (one Python call less per layer and step).
    try:
        _C.store(key, value, key_cache, slot_mapping, k_scale, v_scale, value_cache, kv_cache_dtype,
                 scale_layout, stream, workspace)
    except ValueError:
        if not _without_data(key, value, key_cache, value_cache, slot_mapping, workspace):
            raise
        ops = _ops()
        ops.reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                                    ops.scale_tensor(k_scale), ops.scale_tensor(v_scale), scale_layout, workspace)


def _check_kv_cache_dtype(kv_cache_dtype: Any) -> None:
    if kv_cache_dtype not in _RECIPES:
        raise ValueError(
            f"kv_cache_dtype: {kv_cache_dtype!r} is not supported by nvfp4kv; expected one of "
            f"{', '.join(map(repr, _RECIPES))} (use vLLM's own op for other cache dtypes)"
        )


def _cache_geometry(kv_cache: Any, value_cache: Any) -> Tuple[int, int, int, int, int]:
    """(N, T, H, D, Dv) read off the shapes; the ABI validates the rest."""
    shape = tuple(int(s) for s in kv_cache.shape)
    if value_cache is not None and len(shape) == 4:
        n, t, h, f = shape
        fv = int(value_cache.shape[-1])
    elif len(shape) == 5:
        n, _, t, h, f = shape
        fv = f
    elif len(shape) == 4:
        n, h2, t, f = shape
        h, fv = h2 // 2, f
    else:
        raise ValueError(f"kv_cache: rank {len(shape)} (shape {shape}); expected a 5-D, packed 4-D or two-sided cache")
    return n, t, h, f * 16 // 9, fv * 16 // 9


def _empty(like: Any, shape: Tuple[int, ...], dtype: Any) -> Any:
    fw = _framework(like)
    if fw == "torch":
        import torch

        tdtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        return torch.empty(shape, dtype=tdtype, device=like.device)
    if fw == "cupy":
        import cupy

        if dtype == "bfloat16":
            raise ValueError("dtype: cupy has no bfloat16; use float32 or float16")
        return cupy.empty(shape, dtype=dtype)
    import numpy as np

    if isinstance(dtype, str) and dtype == "bfloat16":
        raise ValueError("dtype: numpy has no bfloat16; use float32 or float16, or torch tensors")
    return np.empty(shape, dtype=dtype)


def _dtype_name(dtype: Any) -> str:
    name = dtype if isinstance(dtype, str) else str(dtype).replace("torch.", "")
    name = {"float": "float32", "half": "float16"}.get(name, name)
    if name not in _FLOAT_DTYPES:
        try:
            import numpy as np

            name = np.dtype(dtype).name
        except TypeError:
            pass
    if name not in _FLOAT_DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not supported; expected one of {_FLOAT_DTYPES}")
    return name


def _dequantize_outputs(kv_cache: Any, value_cache: Any, dtype: Any, key_out: Any, value_out: Any) -> Tuple[Any, Any]:
    """dequantize()'s outputs: the ones given, else new arrays of the cache's geometry."""
    if key_out is None or value_out is None:
        n, t, h, d, dv = _cache_geometry(kv_cache, value_cache)
        name = _dtype_name(dtype)
        key_out = _empty(kv_cache, (n, t, h, d), name) if key_out is None else key_out
        value_out = _empty(kv_cache, (n, t, h, dv), name) if value_out is None else value_out
    return key_out, value_out


def _gather_outputs(kv_cache: Any, value_cache: Any, cu_seqlens: Any, dtype: Any, key_out: Any,
                    value_out: Any) -> Tuple[Any, Any]:
    """gather_dequant()'s outputs: the ones given, else new arrays of cu_seqlens[-1] rows (read on
    the host: a synchronization with the GPU)."""
    if key_out is None or value_out is None:
        _, _, h, d, dv = _cache_geometry(kv_cache, value_cache)  # only to allocate (~1 µs)
        total = int(cu_seqlens[-1])
        if dtype is None:
            dtype = "bfloat16" if _framework(kv_cache) == "torch" else "float32"
        name = _dtype_name(dtype)
        key_out = _empty(kv_cache, (total, h, d), name) if key_out is None else key_out
        value_out = _empty(kv_cache, (total, h, dv), name) if value_out is None else value_out
    return key_out, value_out


def dequantize(
    kv_cache: Any,
    k_scale: Any = 1.0,
    v_scale: Any = 1.0,
    *,
    value_cache: Any = None,
    pages: Any = None,
    dtype: Any = "float32",
    scale_layout: str = "vllm",
    key_out: Any = None,
    value_out: Any = None,
    stream: Any = None,
) -> Tuple[Any, Any]:
    """Dequantize pages of an NVFP4 cache (docs/FORMAT.md §6).

    Parameters
    ----------
    kv_cache, value_cache, k_scale, v_scale, scale_layout, stream
        As for :func:`store`.
    pages : int32/int64 array ``[P]``, optional
        Pages to dequantize; page ``p`` is written at index ``p`` of the outputs (paged to
        paged). Default: every page. Ids < 0 or >= N are skipped.
    dtype : {"float32", "float16", "bfloat16"} or a torch/numpy dtype
        Output dtype when the outputs are allocated here (bfloat16: torch only).
    key_out, value_out : arrays ``(N, T, H, D)`` / ``(N, T, H, Dv)``, optional
        Where to write, e.g. ``bf16_cache[:, 0]`` and ``bf16_cache[:, 1]`` of a bf16 paged cache
        ``(N, 2, T, H, D)`` of the same geometry; any strides with the last one 1.

    Returns
    -------
    key, value : arrays ``(N, T, H, D)`` and ``(N, T, H, Dv)``
        In the cache's framework and device. Values are ``e2m1 * scale * global_scale`` in fp32,
        rounded to nearest even; NaN for groups stored from NaN input.
    """
    key_out, value_out = _dequantize_outputs(kv_cache, value_cache, dtype, key_out, value_out)
    try:
        _C.dequantize(kv_cache, value_cache, pages, k_scale, v_scale, scale_layout, key_out, value_out, stream)
    except ValueError:
        if not _without_data(kv_cache, value_cache, pages, key_out, value_out):
            raise
        ops = _ops()
        ops.dequantize(kv_cache, ops.scale_tensor(k_scale), ops.scale_tensor(v_scale), key_out, value_out,
                       value_cache, pages, scale_layout)
    return key_out, value_out


def _prefix_sums(seq_lens: Any) -> Any:
    """int32 ``[B + 1]`` prefix sums of ``seq_lens`` in its framework and device (no host sync)."""
    fw = _framework(seq_lens)
    if fw == "torch":
        import torch

        cu = torch.zeros(seq_lens.shape[0] + 1, dtype=torch.int32, device=seq_lens.device)
        cu[1:].copy_(torch.cumsum(seq_lens, 0))
        return cu
    xp = __import__("cupy") if fw == "cupy" else __import__("numpy")
    cu = xp.zeros(int(seq_lens.shape[0]) + 1, dtype=xp.int32)
    cu[1:] = xp.cumsum(seq_lens)
    return cu


def gather_dequant(
    kv_cache: Any,
    block_table: Any,
    seq_lens: Any,
    k_scale: Any = 1.0,
    v_scale: Any = 1.0,
    *,
    value_cache: Any = None,
    cu_seqlens: Any = None,
    dtype: Any = None,
    scale_layout: str = "vllm",
    key_out: Any = None,
    value_out: Any = None,
    stream: Any = None,
) -> Tuple[Any, Any, Any]:
    """Gather each sequence's tokens through its block table and dequantize them, varlen order.

    The read side for attention kernels that take bf16/fp16 K/V (FlashAttention varlen, SDPA):
    token ``j`` of sequence ``b`` is read from page ``block_table[b, j // T]``, position
    ``j % T``, and written to row ``cu_seqlens[b] + j`` of ``key``/``value``.

    Parameters
    ----------
    kv_cache, value_cache, k_scale, v_scale, scale_layout, stream
        As for :func:`store`.
    block_table : int32/int64 array ``[B, max_blocks]``
        Entries < 0 or >= N (and blocks past ``max_blocks``) read as zeros.
    seq_lens : int32/int64 array ``[B]``
    cu_seqlens : int32/int64 array ``[B + 1]``, optional
        Output row of each sequence's first token. Default: the prefix sums of ``seq_lens``
        (int32, computed on the device).
    dtype : {"bfloat16", "float16", "float32"}, optional
        Output dtype when allocated here; default bfloat16 for torch, float32 otherwise.
    key_out, value_out : arrays ``[total_tokens, H, D]`` / ``[total_tokens, H, Dv]``, optional
        Where to write. When not given, ``total_tokens = cu_seqlens[-1]`` is read on the host,
        which synchronizes with the GPU: pass outputs to stay asynchronous (and CUDA-graph safe).

    Returns
    -------
    key, value, cu_seqlens
        Rows outside ``[0, total_tokens)`` are never written.
    """
    if cu_seqlens is None:
        cu_seqlens = _prefix_sums(seq_lens)
    key_out, value_out = _gather_outputs(kv_cache, value_cache, cu_seqlens, dtype, key_out, value_out)
    try:
        _C.gather_dequant(kv_cache, value_cache, block_table, seq_lens, cu_seqlens, k_scale, v_scale,
                          scale_layout, key_out, value_out, stream)
    except ValueError:
        if not _without_data(kv_cache, value_cache, block_table, seq_lens, cu_seqlens, key_out, value_out):
            raise
        ops = _ops()
        ops.gather_dequant(kv_cache, block_table, seq_lens, cu_seqlens, ops.scale_tensor(k_scale),
                           ops.scale_tensor(v_scale), key_out, value_out, value_cache, scale_layout)
    return key_out, value_out, cu_seqlens


def set_cpu_threads(threads: int) -> None:
    """Most threads one call on CPU tensors uses, for the whole process.

    1 to 256, or 0 (the default) for one per CPU the process may run on, at most 16. Until this
    is called, the environment variable ``NVFP4KV_CPU_THREADS`` sets it (read once). Small calls
    use fewer threads; the bytes are the same for every count. CUDA calls are not affected.
    See docs/python-api.md.
    """
    _C.set_cpu_threads(threads)


def cpu_threads() -> int:
    """The thread count in force for CPU calls (:func:`set_cpu_threads`; 0 resolved)."""
    return _C.cpu_threads()


def build_info() -> dict:
    """Version, CUDA build details and whether CUDA can be used here (and if not, why)."""
    info = {"version": _C.__version__}
    info.update(_C.cuda_info())
    return info
