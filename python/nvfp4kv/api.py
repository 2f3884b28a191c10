"""Quantize-and-store and dequantize: thin wrappers over the C ABI (``nvfp4kv._C``).

Validation lives in the C ABI. The binding resolves the common arguments itself (option strings,
Python floats, torch tensors, torch's current stream: a decode step's store is bound by this host
work) and calls the helpers below for everything else (numpy scalars, stream objects, unknown
options, whose error messages they produce). This module also allocates outputs.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, List, Optional, Tuple

from . import _C
from .spec import KV_CACHE_LAYOUTS  # within a page side, heads outer (HND) or tokens outer (NHD)
from .views import _torch_module_of, imported

_RECIPES = {name: i for i, name in enumerate(_C.RECIPES)}
_SCALE_LAYOUTS = {name: i for i, name in enumerate(_C.SCALE_LAYOUTS)}
_FLOAT_DTYPES = ("float32", "float16", "bfloat16")

__all__ = ["store", "prepare_store", "store_workspace", "store_workspace_bytes", "reshape_and_cache_flash", "dequantize",
           "gather_dequant", "decode_attention", "decode_workspace", "decode_workspace_bytes", "build_info"]


def _choice(value: Any, table: dict, arg: str) -> int:
    if isinstance(value, str) and value in table:
        return table[value]
    raise ValueError(f"{arg}: {value!r} is not supported; expected one of {', '.join(map(repr, table))}")


def _framework(x: Any) -> str:
    for cls in type(x).__mro__:  # a subclass (of torch.Tensor, say) is its base's framework
        mod = cls.__module__
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
        return stream  # the binding refuses a bool and a handle outside [0, 2**64)
    handle, where = None, None
    if hasattr(stream, "__cuda_stream__"):
        where = ".__cuda_stream__()"
        pair = stream.__cuda_stream__()  # the protocol's (version, handle)
        handle = pair[1] if isinstance(pair, tuple) and len(pair) == 2 else pair
    else:
        for attr in ("cuda_stream", "ptr"):
            if hasattr(stream, attr):
                where, handle = f".{attr}", getattr(stream, attr)
                break
    if where is None:
        raise TypeError(f"stream: {type(stream).__name__} is not a CUDA stream (int, torch/cupy stream)")
    if isinstance(handle, bool) or not isinstance(handle, numbers.Integral):
        shape = " in a (version, handle) pair" if where.startswith(".__") else ""
        raise TypeError(f"stream: {type(stream).__name__}{where} gave {handle!r}; expected an int handle{shape}")
    return int(handle)


def _float32_value(x: Any) -> float:
    """A numpy float32 scalar's value, from its bits: float() converts it in the caller's FP mode,
    and with denormals-are-zero on (torch.set_flush_denormal(True)) a subnormal scale read as 0
    (found by fuzzing). Exact: every float32 is a normal double."""
    if not x.dtype.isnative:  # a big-endian 0-d array: its bytes swapped (no arithmetic), then read
        x = x.byteswap().view(x.dtype.newbyteorder("="))
    bits = int(x.view("uint32"))
    sign, exp, man = -1.0 if bits >> 31 else 1.0, (bits >> 23) & 0xFF, bits & 0x7FFFFF
    if exp == 0xFF:
        return sign * math.inf if man == 0 else math.nan
    return sign * (math.ldexp(man, -149) if exp == 0 else math.ldexp(man | 0x800000, exp - 150))


def _none_scale(arg: str) -> TypeError:
    """A None global scale, refused here and by the ops (ops.scale_tensor). Other libraries read None
    as 1.0 (SGLang leaves unset scales None): the message says what to pass."""
    return TypeError(f"{arg}: None received; expected a float (the decode scale) or a 1-element float32 "
                     "tensor (pass 1.0 for no global scale)")


def _scale(x: Any, arg: str = "k_scale") -> Any:
    # Python and numpy scalars go to the ABI as host floats; tensors (CPU or GPU) pass through so a
    # device scale is read by the kernel, never on the host. A bool is no scale (True would read
    # as 1.0), whatever its type, nor is None; a number past the float range is a ValueError
    # naming `arg`.
    if x is None:
        raise _none_scale(arg)
    if isinstance(x, bool) or getattr(getattr(x, "dtype", None), "kind", None) == "b":
        raise TypeError(f"{arg}: a bool received ({x!r}); expected a float (the decode scale) or a "
                        "1-element float32 tensor")
    scalar = isinstance(x, numbers.Real) and not hasattr(x, "__dlpack_device__")
    if not scalar and _framework(x) == "numpy" and getattr(x, "ndim", 1) == 0:
        if getattr(x.dtype, "kind", "") not in "fiu":  # float() would read '0.01' or drop an imaginary part
            raise TypeError(f"{arg}: a numpy {x.dtype} scalar received; expected a float (the decode scale) "
                            "or a 1-element float32 tensor")
        scalar = True
    if scalar:
        if getattr(getattr(x, "dtype", None), "name", "") == "float32":
            return _float32_value(x)
        return _float(x, arg, "a global scale must be a finite float32 > 0")  # the binding checks the range
    return x


def _float(x: Any, arg: str, expected: str) -> float:
    """float(x) for a real number outside numpy's float32 (whose bits _float32_value reads), with a
    ValueError naming `arg` where no double holds it: past the double range, or a nonzero number
    below it (a numpy longdouble 1e-4000 would read as 0, and its error would say 0: review)."""
    try:
        v = float(x)
    except OverflowError:  # an int or Fraction past the double range
        raise ValueError(f"{arg}: a number past the float range received; {expected}") from None
    if v == 0 and x != 0:
        raise ValueError(f"{arg}: {x!r} received, nonzero but below the float range; {expected}")
    return v


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
    kv_layout: Optional[str] = None,
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
    kv_layout : {"HND", "NHD"}, optional
        The cache's memory order within a page side (heads outer, or tokens outer: vLLM's
        ``get_kv_cache_layout()``). Two 4-D sides are then read by their strides in either
        dimension order: ``(N, T, H, F)``, or ``(N, H, T, F)`` such as the halves
        ``kv_cache.split(H, dim=1)`` of a packed cache, which nothing else tells from NHD sides
        when the packed cache is itself a view. A packed or 5-D cache must agree with it.
        Default: sides are ``(N, T, H, F)``, except torch halves of a packed cache recognised by
        their origin (docs/integration.md §1).
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
    TypeError, ValueError, RuntimeError, MemoryError
        Bad dtype; bad shape/value/device; CUDA failure; host memory. The cache is untouched on
        error.
    """
    orient = _orientation(kv_cache, value_cache, kv_layout)
    try:
        _C.store(key, value, kv_cache, slot_mapping, k_scale, v_scale, value_cache, recipe, scale_layout, stream,
                 workspace, orient)
    except ValueError as e:
        if not _without_data(key, value, kv_cache, value_cache, slot_mapping, workspace):
            raise _refused(e, kv_cache, value_cache, orient) from None
        ops = _ops()
        kv_cache, value_cache = ops._sides(kv_cache, value_cache, kv_layout)  # the ops take no orientation
        ops.store(key, value, kv_cache, slot_mapping, ops.scale_tensor(k_scale), ops.scale_tensor(v_scale),
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
    torch = imported("torch")
    if torch is None:
        return False
    given = [a for a in args if a is not None]
    return bool(given) and all(isinstance(a, torch.Tensor) and (a.is_meta or hasattr(a, "fake_mode"))
                               for a in given)


def _refused(error: ValueError, kv_cache: Any, value_cache: Any, orient: int) -> ValueError:
    """The extension's refusal of a call, with a hint where the caller may have meant the cache
    otherwise: two 4-D sides read by the library's own rule (no kv_layout, not recognised as
    halves by their origin), which the message names. (N, H, T, F) halves of a packed cache
    made as a view of another buffer read as (N, T, H, F) sides, and the ABI's refusal then
    speaks of heads or of an NHD side (review, 2026-12-06). Asked only after a refusal."""
    msg = str(error)
    if (orient != -1 or value_cache is None or ("key_cache" not in msg and "value_cache" not in msg)
            or "a view of part of the pages" in msg  # the binding's refusal of cut views: no reading helps
            or len(getattr(kv_cache, "shape", ())) != 4 or len(getattr(value_cache, "shape", ())) != 4
            or _split_halves(kv_cache, value_cache) is not None):
        return error
    return ValueError(f"{msg} (two 4-D sides without kv_layout are read as (N, T, H, F); for (N, H, T, F) "
                      "halves of a packed (N, 2H, T, F) cache pass kv_layout='HND': integration.md section 1)")


def prepare_store(
    kv_cache: Any,
    k_scale: Any = 1.0,
    v_scale: Any = 1.0,
    *,
    value_cache: Any = None,
    recipe: str = "nvfp4",
    scale_layout: str = "vllm",
    kv_layout: Optional[str] = None,
    workspace: Any = None,
) -> Any:
    """A store for one layer's cache: ``prepared(key, value, slot_mapping, stream=None)``.

    The same operation and checks as :func:`store` with these arguments, but the cache, the two
    global scales and the workspace are imported once, here, instead of at every call: a
    decode step's store of a few tokens costs mostly this host work. The object keeps the tensors
    and their memory alive and reads that memory at each call (so in-place updates of a scale
    tensor are seen; scales given as Python or numpy numbers are taken by value, and checked,
    here). A tensor given new memory afterwards (torch's ``set_``, ``.data = ...``) is not
    followed: prepare again after that; never ``resize_`` one (a growing resize frees its memory in
    place). The other arguments are validated at each call, as by :func:`store`.
    """
    orient = _orientation(kv_cache, value_cache, kv_layout)
    # The torch storages too: a tensor given new memory (set_, .data =) would otherwise free the
    # memory imported here while this object still writes or reads it (found by review: fuzzing).
    memory = tuple(_storage(x) for x in (kv_cache, value_cache, k_scale, v_scale, workspace)
                   if _framework(x) == "torch")
    return _C.PreparedStore(kv_cache, k_scale, v_scale, value_cache, recipe, scale_layout, workspace, orient, memory)


def _storage(tensor: Any) -> Any:
    """A torch tensor's storage, or None where it has none to give (sparse layouts: the
    extension refuses them with its own error)."""
    try:
        return tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


def store_workspace_bytes(num_blocks: int, block_size: int) -> int:
    """Bytes of a :func:`store` workspace for caches of up to ``num_blocks`` blocks of ``block_size`` tokens."""
    return _C.store_workspace_bytes(*_int64s(num_blocks=num_blocks, block_size=block_size))


def store_workspace(kv_cache: Any, value_cache: Any = None, *, kv_layout: Optional[str] = None) -> Any:
    """A zeroed :func:`store` workspace on the cache's device, for caches up to this one's size.

    Same framework as the cache (torch, cupy or numpy). Its size is
    ``store_workspace_bytes(N, T)``: 8 bytes per slot and 12 per block (14 MB for 100 000 blocks
    of 16 tokens), against 18 KB per block of an H 8, D 128 cache layer. For a cache given as
    two sides pass both (one 4-D side alone reads as a packed cache), and ``kv_layout`` as to
    :func:`store`.
    """
    n, t = _cache_geometry(kv_cache, value_cache, _orientation(kv_cache, value_cache, kv_layout))[:2]
    nbytes = store_workspace_bytes(n, t)
    return _zeros(kv_cache, nbytes, "uint8")


def _zeros(like: Any, shape: Any, dtype: str) -> Any:
    """Zeros of `shape` and `dtype` ("uint8", "float32", ...) in the framework and on the device of
    `like` (workspaces, the scale tracker's amax)."""
    fw = _framework(like)
    if fw == "torch":
        import torch

        return torch.zeros(shape, dtype=getattr(torch, dtype), device=like.device)
    if fw == "cupy":
        import cupy

        with cupy.cuda.Device(like.device.id):
            return cupy.zeros(shape, dtype=dtype)
    import numpy as np

    return np.zeros(shape, dtype=dtype)


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
    kv_layout: Optional[str] = None,
    stream: Any = None,
    workspace: Any = None,
) -> None:
    """vLLM's ``reshape_and_cache_flash`` for ``kv_cache_dtype`` "nvfp4" / "nvfp4_4over6".

    Same arguments and semantics as vLLM's op (``key_cache``/``value_cache`` are the two sides
    ``kv_cache[:, 0]``, ``kv_cache[:, 1]``), except that out-of-range slots are skipped instead
    of written out of bounds. See :func:`store` for shapes, dtypes, ``kv_layout`` and
    ``workspace``.
    """
    _check_flash_args(kv_cache_dtype, value_cache)
    orient = _orientation(key_cache, value_cache, kv_layout)
    # Straight to the binding, as store() does (one Python call less per layer and step).
    try:
        _C.store(key, value, key_cache, slot_mapping, k_scale, v_scale, value_cache, kv_cache_dtype,
                 scale_layout, stream, workspace, orient)
    except ValueError as e:
        if not _without_data(key, value, key_cache, value_cache, slot_mapping, workspace):
            raise _refused(e, key_cache, value_cache, orient) from None
        ops = _ops()
        key_cache, value_cache = ops._sides(key_cache, value_cache, kv_layout)
        ops.reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                                    ops.scale_tensor(k_scale), ops.scale_tensor(v_scale), scale_layout, workspace)


def _check_flash_args(kv_cache_dtype: Any, value_cache: Any) -> None:
    """reshape_and_cache_flash's own checks: its kv_cache_dtype, and two sides, as vLLM's op takes
    (review: with value_cache None, an NHD side of T = 2H tokens passed for a packed cache, and
    both K and V were written into it)."""
    if not isinstance(kv_cache_dtype, str):
        raise TypeError(f"kv_cache_dtype: a {type(kv_cache_dtype).__name__} received; expected a str ('nvfp4')")
    if kv_cache_dtype not in _RECIPES:
        raise ValueError(
            f"kv_cache_dtype: {kv_cache_dtype!r} is not supported by nvfp4kv; expected one of "
            f"{', '.join(map(repr, _RECIPES))} (use vLLM's own op for other cache dtypes)"
        )
    if value_cache is None:
        raise TypeError("value_cache: None received; reshape_and_cache_flash takes the cache's two sides, as "
                        "vLLM's op does (a packed or 5-D cache goes to store())")


def _shape(x: Any, arg: str) -> Tuple[int, ...]:
    """x's shape, for the arrays Python reads itself (to allocate outputs, to sum lengths); a
    TypeError naming `arg` for anything that is no array (the ABI's message for the others)."""
    shape = getattr(x, "shape", None)
    if x is None or isinstance(x, (list, tuple)) or not isinstance(shape, tuple):
        raise TypeError(f"{arg}: expected an array supporting DLPack (torch, numpy, cupy, ...), got "
                        f"{type(x).__name__}")
    return tuple(int(s) for s in shape)


def _split_halves(kv_cache: Any, value_cache: Any) -> Optional[Tuple[Any, Any]]:
    """The (N, T, H, F) views of torch sides that are the (N, H, T, F) halves of a packed
    (N, 2H, T, F) cache (vLLM's kv_cache.split(H, dim=1)), else None. Sides are (N, T, H, F) in
    the C ABI; such halves are recognised by their origin (same strides as their packed base), so
    they work too. Asked where outputs are allocated from the cache's shape and by the traced
    calls under torch.compile (ops.py); the extension orients the sides of eager calls itself
    (orient_sides in ext.cpp, the same test)."""
    if value_cache is None:
        return None
    torch = imported("torch")
    if torch is None:
        return None
    for x in (kv_cache, value_cache):
        base = getattr(x, "_base", None) if isinstance(x, torch.Tensor) else None
        # A half keeps its base's token and byte dimensions: a permuted side of one token per page,
        # (N, H, 1, F) viewed as (N, 1, H, F), has its base's strides too, but not that shape.
        if (base is None or x.dim() != 4 or base.dim() != 4 or base.shape[1] != 2 * x.shape[1]
                or base.shape[2:] != x.shape[2:] or base.stride() != x.stride()):
            return None
    return kv_cache.transpose(1, 2), value_cache.transpose(1, 2)


def _dims(x: Any, arg: str) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """x's shape and strides in elements (torch, numpy, cupy and arrays like them)."""
    if _torch_module_of(x) is not None:
        return x.shape, x.stride()  # no per-dimension conversion: this runs per call
    shape, strides, itemsize = _shape(x, arg), getattr(x, "strides", None), getattr(x, "itemsize", None)
    if not isinstance(strides, tuple) or not itemsize:
        raise TypeError(f"{arg}: a {type(x).__name__} received; kv_layout needs torch, numpy or cupy arrays "
                        "(their strides say which dimension holds the heads)")
    return shape, tuple(int(s) // int(itemsize) for s in strides)


def _heads_first(shape: Tuple[int, ...], strides: Tuple[int, ...], kv_layout: str) -> Optional[bool]:
    """Whether dimension 1 of a 4-D side (N, A, B, F) holds the heads, by its strides and the
    memory order kv_layout names (HND: the heads' stride is the larger one). A dimension of size 1
    counts by its stride too (split and view keep it: the halves of a packed cache of one head
    have strides (2TF, TF, F, 1)); None where the two strides are equal (they cannot tell)."""
    if strides[1] == strides[2]:
        return None
    if strides[1] > strides[2]:  # branches, not a comparison of truth values (symbolic under dynamo)
        return kv_layout == "HND"
    return kv_layout == "NHD"


def _orientation(kv_cache: Any, value_cache: Any, kv_layout: Optional[str]) -> int:
    """How the binding reads two 4-D sides, given the memory order the caller names (design
    notes: "Split halves of a packed cache: oriented in the binding"): 1, dimensions 1 and 2
    exchanged (sides whose dimension 1 holds the heads, such as the (N, H, T, F) halves of a
    packed cache: the C ABI reads (N, T, H, F)); 0, as given; -1, the library's own rule (the
    halves' origin), for kv_layout None, every other form, and sides whose strides cannot tell. A
    packed or 5-D cache carries its order in its shape and strides, which must agree with
    kv_layout."""
    if kv_layout is None:
        return -1
    if kv_layout not in KV_CACHE_LAYOUTS:
        raise ValueError(f"kv_layout: unknown value {kv_layout!r}; expected 'HND', 'NHD' or None")
    shape, strides = _dims(kv_cache, "kv_cache" if value_cache is None else "key_cache")
    if value_cache is None:
        if len(shape) == 4 and kv_layout == "NHD":
            raise ValueError(f"kv_cache: a packed (N, 2H, T, F) cache {tuple(shape)} with kv_layout 'NHD'; the "
                             "packed form is HND (give NHD caches as 5-D (N, 2, T, H, F) or as two sides)")
        if len(shape) == 5 and shape[2] > 1 and shape[3] > 1 and (
                kv_layout == ("NHD" if strides[3] > strides[2] else "HND")):
            raise ValueError(f"kv_cache: shape {tuple(shape)} with strides {tuple(strides)} is "
                             f"{'NHD' if kv_layout == 'HND' else 'HND'}, but kv_layout {kv_layout!r} received")
        return -1
    vshape, vstrides = _dims(value_cache, "value_cache")
    if len(shape) != 4 or len(vshape) != 4:
        return -1  # the C ABI names the shapes it takes
    if shape[1] == 1 and shape[2] == 1:
        return 0  # one head and one token: both readings are the same geometry
    first, second = _heads_first(shape, strides, kv_layout), _heads_first(vshape, vstrides, kv_layout)
    if first is not None and second is not None and first != second:
        raise ValueError(f"key_cache, value_cache: their strides put the heads in different dimensions "
                         f"({1 if first else 2} and {1 if second else 2}) under kv_layout {kv_layout!r}")
    first = first if first is not None else second
    if first is None:
        # Equal strides: a dimension of size 1 whose stride is the other's (NHD sides of one head,
        # (N, T, 1, F), or pages of one token). The library's own rule then, as without kv_layout:
        # torch halves of a packed cache by their origin, anything else as (N, T, H, F).
        return -1
    if not first and _split_halves(kv_cache, value_cache) is not None:
        # The library's own rule would read them transposed: say what contradicts, write nothing.
        raise ValueError(f"key_cache, value_cache: (N, H, T, F) halves of a packed (N, 2H, T, F) cache (HND), "
                         f"but kv_layout {kv_layout!r} received; NHD sides split out of an (N, 2T, H, F) "
                         "buffer are not supported: give them as 5-D (N, 2, T, H, F)")
    return int(first)


def _oriented(kv_cache: Any, value_cache: Any, kv_layout: Optional[str]) -> Tuple[Any, Any]:
    """The sides as views in the orientation the C ABI reads (_orientation 1: transposed), for
    the traced calls, whose ops take no orientation."""
    if _orientation(kv_cache, value_cache, kv_layout) != 1:
        return kv_cache, value_cache
    if _framework(kv_cache) == "torch":
        return kv_cache.transpose(1, 2), value_cache.transpose(1, 2)
    return kv_cache.swapaxes(1, 2), value_cache.swapaxes(1, 2)


def _cache_geometry(kv_cache: Any, value_cache: Any, orient: int = -1,
                    uint8: bool = True) -> Tuple[int, int, int, int, int]:
    """(N, T, H, D, Dv) read off the shapes (orient: _orientation's); the ABI validates the rest.
    `uint8`: first refuse, as the ABI would, a cache that holds no NVFP4 bytes (_uint8_cache), whose
    shape is no geometry to size anything from; otherwise such a cache's sizes are returned
    unchecked, for the ABI to refuse it by its dtype."""
    if uint8:
        _uint8_cache(kv_cache, value_cache)
    if orient < 0:
        halves = _split_halves(kv_cache, value_cache)
        if halves is not None:
            kv_cache, value_cache = halves
    shape = _shape(kv_cache, "kv_cache")
    if value_cache is not None and len(shape) == 4:
        n, t, h, f = shape
        if orient == 1:
            t, h = h, t
        fv = (_shape(value_cache, "value_cache") or (f,))[-1]
    elif len(shape) == 5:
        n, _, t, h, f = shape
        fv = f
    elif len(shape) == 4:
        n, h2, t, f = shape
        h, fv = h2 // 2, f
    else:
        raise ValueError(f"kv_cache: rank {len(shape)} (shape {shape}); expected a 5-D, packed 4-D or two-sided cache")
    sides = (("kv_cache", kv_cache, f), ("value_cache", value_cache, fv) if value_cache is not None
             else ("kv_cache", kv_cache, fv))
    for arg, side, last in sides:
        # F = 9 D / 16 with D a multiple of 16, refused here before outputs are allocated from it
        # (review: an fp8 cache's outputs, gigabytes, were allocated before the ABI refused it).
        # A side that is not uint8 (here only where `uint8` is False) is left for the ABI to
        # refuse by its dtype (review, 2026-12-07: a bf16 cache of D 128 was called a wrong last
        # dimension).
        if last % 9 and not _not_uint8(side):
            raise ValueError(f"{arg}: last dimension {last} received; expected F = D/2 + D/16 = 9*D/16 for a "
                             "head size D that is a multiple of 16")
    return n, t, h, f * 16 // 9, fv * 16 // 9


def _pages_apart(kv_cache: Any, value_cache: Any, t: int, h: int, d: int, dv: int) -> None:
    """Pages at least one page apart, as the ABI requires, refused here before outputs are
    allocated from N (review: one page expand()ed to 10^7 pages asked the allocator for 655 GB).
    Only shapes the ABI takes are checked here (its shape errors say more); a cache without
    byte strides (a sparse torch tensor, say) is left to the ABI too."""
    k_side, v_side = t * h * (9 * d // 16), t * h * (9 * dv // 16)
    shape = _shape(kv_cache, "kv_cache")
    if 0 in shape:  # nothing to allocate; an empty array's strides may be anything
        return
    if value_cache is None:  # a 5-D or packed cache: K and V sides in each page
        if len(shape) == 5 and shape[1] != 2 or len(shape) == 4 and shape[1] % 2:
            return
        pages = ((kv_cache, "kv_cache", k_side + v_side),)
    else:
        if len(shape) != 4 or tuple(_shape(value_cache, "value_cache")[:3]) != tuple(shape[:3]):
            return
        pages = ((kv_cache, "key_cache", k_side), (value_cache, "value_cache", v_side))  # the ABI's names
    for cache, arg, side in pages:
        torch = _torch_module_of(cache)
        if torch is not None and cache.layout != torch.strided:
            return
        strides = cache.stride() if torch is not None else getattr(cache, "strides", None)
        if isinstance(strides, tuple) and strides and strides[0] < side:  # uint8: elements are bytes
            raise ValueError(f"{arg}: page stride {strides[0]} bytes received; it must be at least one page "
                             f"({side} bytes): pages may not overlap or run backwards")


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
    torch = imported("torch")
    # numpy names the rest (np.float16, "f2"), but not a torch dtype, and under torch.compile not a
    # string: traced, its refusal of either is an internal error in place of the message below.
    if name not in _FLOAT_DTYPES and not (torch is not None and (
            isinstance(dtype, torch.dtype) or isinstance(dtype, str) and torch.compiler.is_compiling())):
        try:
            import numpy as np

            name = np.dtype(dtype).name
        except TypeError:
            pass
    if name not in _FLOAT_DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not supported; expected one of {_FLOAT_DTYPES}")
    return name


def _out_dtype(dtype: Any, key_out: Any, value_out: Any, default: str) -> str:
    """The dtype of an output allocated here: `dtype`, else that of the output passed (the two
    must match), else `default`. An output of a dtype the library does not take is left to the
    ABI, whose error names it."""
    given = key_out if key_out is not None else value_out
    arg = "key_out" if key_out is not None else "value_out"
    try:
        given_name = None if given is None else _dtype_name(given.dtype)
    except (AttributeError, ValueError):
        given_name = None
    if dtype is None:
        return given_name or default
    name = _dtype_name(dtype)
    if given_name is not None and name != given_name:
        raise ValueError(f"dtype: {dtype!r} received but {arg} is {given_name}; the outputs of a call "
                         f"share one dtype (leave dtype out to follow {arg})")
    return name


def _both_given(dtype: Any, key_out: Any, value_out: Any) -> bool:
    """Whether both outputs are given; a `dtype` given with them must be theirs (it is not ignored)."""
    if key_out is None or value_out is None:
        return False
    if dtype is not None:
        _out_dtype(dtype, key_out, None, "")
        _out_dtype(dtype, None, value_out, "")
    return True


def _new(like: Any, shape: Tuple[int, ...], name: str, zero: bool) -> Any:
    out = _empty(like, shape, name)
    if zero:
        if _framework(out) == "torch":
            out.zero_()
        else:
            out[...] = 0
    return out


def _dequantize_outputs(kv_cache: Any, value_cache: Any, dtype: Any, key_out: Any, value_out: Any,
                        orient: int = -1, pages: Any = None, checked: bool = True) -> Tuple[Any, Any]:
    """dequantize()'s outputs: the ones given, else new arrays of the cache's geometry (zeros where
    `pages` leaves pages unread: never memory of whatever was there). `checked`: refuse first what
    the C ABI would (eager calls; a traced call allocates nothing real, and an error raised while
    tracing would reach the caller as Dynamo's Unsupported, not as the op's own error)."""
    if not _both_given(dtype, key_out, value_out):
        n, t, h, d, dv = _cache_geometry(kv_cache, value_cache, orient, uint8=checked)
        if checked and n > 1:
            _pages_apart(kv_cache, value_cache, t, h, d, dv)
        name = _out_dtype(dtype, key_out, value_out, "float32")
        zero = pages is not None
        key_out = _new(kv_cache, (n, t, h, d), name, zero) if key_out is None else key_out
        value_out = _new(kv_cache, (n, t, h, dv), name, zero) if value_out is None else value_out
    return key_out, value_out


def _gather_outputs(kv_cache: Any, value_cache: Any, seq_lens: Any, cu_seqlens: Any, computed: bool, dtype: Any,
                    key_out: Any, value_out: Any, orient: int = -1, block_table: Any = None) -> Tuple[Any, Any, Any]:
    """gather_dequant()'s outputs (the ones given, else new arrays of cu_seqlens[-1] rows, read on
    the host: a synchronization with the GPU; zeros where no sequence may write) and its
    cu_seqlens (int32 where computed here and the outputs are allocated here, if the total fits)."""
    if not _both_given(dtype, key_out, value_out):
        _, _, h, d, dv = _cache_geometry(kv_cache, value_cache, orient)  # only to allocate (~1 µs)
        total = _total_rows(seq_lens, cu_seqlens, computed, block_table)
        if total * h * max(d, dv) >= 2**62:
            raise ValueError(f"{'seq_lens' if computed else 'cu_seqlens'}: {total} rows in all received; "
                             "outputs of that size cannot be allocated")
        if computed and total <= _INT32_MAX:  # every entry fits: FlashAttention's dtype
            cu_seqlens = _as_int32(cu_seqlens)
        default = "bfloat16" if _framework(kv_cache) == "torch" else "float32"
        name = _out_dtype(dtype, key_out, value_out, default)
        # One output given: the other gets its row count (a padded output's padding too), as its dtype.
        given = key_out if key_out is not None else value_out
        gshape = () if given is None else _shape(given, "key_out" if key_out is not None else "value_out")
        rows = gshape[0] if gshape else total
        # Prefix sums computed here write every row below the total; a caller's cu_seqlens may leave
        # rows between sequences, and a given output's padding may pass the total: those rows of a
        # new output are zeros, never memory of whatever was there (CPU and CUDA bytes then agree).
        zero = not computed or rows != total
        key_out = _new(kv_cache, (rows, h, d), name, zero) if key_out is None else key_out
        value_out = _new(kv_cache, (rows, h, dv), name, zero) if value_out is None else value_out
    return key_out, value_out, cu_seqlens


def dequantize(
    kv_cache: Any,
    k_scale: Any = 1.0,
    v_scale: Any = 1.0,
    *,
    value_cache: Any = None,
    pages: Any = None,
    dtype: Any = None,
    scale_layout: str = "vllm",
    kv_layout: Optional[str] = None,
    key_out: Any = None,
    value_out: Any = None,
    stream: Any = None,
) -> Tuple[Any, Any]:
    """Dequantize pages of an NVFP4 cache (docs/FORMAT.md §6).

    Parameters
    ----------
    kv_cache, value_cache, k_scale, v_scale, scale_layout, kv_layout, stream
        As for :func:`store`.
    pages : int32/int64 array ``[P]``, optional
        Pages to dequantize; page ``p`` is written at index ``p`` of the outputs (paged to
        paged). Default: every page. Ids < 0 or >= N are skipped. ``P * T`` below 2^63 (a
        broadcast list can pass it): else a ValueError.
    dtype : {"float32", "float16", "bfloat16"} or a torch/numpy dtype, optional
        Output dtype when the outputs are allocated here (bfloat16: torch only). Default: that
        of the output passed when only one is, else float32.
    key_out, value_out : arrays ``(N, T, H, D)`` / ``(N, T, H, Dv)``, optional
        Where to write, e.g. ``bf16_cache[:, 0]`` and ``bf16_cache[:, 1]`` of a bf16 paged cache
        ``(N, 2, T, H, D)`` of the same geometry; any strides with the last one 1.

    Returns
    -------
    key, value : arrays ``(N, T, H, D)`` and ``(N, T, H, Dv)``
        In the cache's framework and device. Values are ``e2m1 * scale * global_scale`` in fp32,
        rounded to nearest even; NaN for groups stored from NaN input.
    """
    orient = _orientation(kv_cache, value_cache, kv_layout)
    key_out, value_out = _dequantize_outputs(kv_cache, value_cache, dtype, key_out, value_out, orient, pages)
    try:
        _C.dequantize(kv_cache, value_cache, pages, k_scale, v_scale, scale_layout, key_out, value_out, stream,
                      orient)
    except ValueError as e:
        if not _without_data(kv_cache, value_cache, pages, key_out, value_out):
            raise _refused(e, kv_cache, value_cache, orient) from None
        ops = _ops()
        kv_cache, value_cache = ops._sides(kv_cache, value_cache, kv_layout)
        ops.dequantize(kv_cache, ops.scale_tensor(k_scale), ops.scale_tensor(v_scale), key_out, value_out,
                       value_cache, pages, scale_layout)
    return key_out, value_out


_INT32_MAX = 2**31 - 1


def _prefix_sums(seq_lens: Any) -> Any:
    """int64 ``[B + 1]`` prefix sums of ``seq_lens`` in its framework and device (no host sync).

    Summed in int64 (int32 sums of [2**32, 16] would give [0, 0, 16]); a length < 0 counts as 0,
    as the gather reads it (such a sequence gathers nothing), and one above (2**63 - 1) // B as
    that, so that the sums never wrap (lengths of 2**62 wrapped the int64 sums to negative
    totals: review), with no host read. No output holds that many rows: an allocation is
    refused by the total (_gather_outputs), and a given output bounds the rows written.
    """
    shape = _shape(seq_lens, "seq_lens")
    fw = _framework(seq_lens)
    if fw not in ("torch", "numpy", "cupy"):
        raise TypeError(f"seq_lens: a {type(seq_lens).__name__} received; without cu_seqlens, expected "
                        "a torch, numpy or cupy array (its prefix sums are computed here)")
    _host_readable_index(seq_lens, "seq_lens")  # as the C ABI: type, then shape
    if len(shape) != 1:
        raise ValueError(f"seq_lens: shape {shape} received; expected an int32 or int64 array [B]")
    cap = (2**63 - 1) // max(int(shape[0]), 1)
    if fw == "torch":
        import torch

        cu = torch.zeros(shape[0] + 1, dtype=torch.int64, device=seq_lens.device)
        torch.cumsum(seq_lens.to(torch.int64).clamp(0, cap), 0, out=cu[1:])
        return cu
    xp = __import__("cupy") if fw == "cupy" else __import__("numpy")
    cu = xp.zeros(shape[0] + 1, dtype=xp.int64)
    xp.cumsum(xp.clip(seq_lens.astype(xp.int64), 0, cap), out=cu[1:])
    return cu


def _host_readable_index(x: Any, arg: str) -> None:
    """Refuses, as the C ABI would, an index array this module is about to read or sum on the
    host (its error would otherwise be the framework's, naming no argument): not int32/int64, or
    a torch tensor that is not strided."""
    layout = getattr(x, "layout", None)
    if layout is not None and str(layout) != "torch.strided":
        raise TypeError(f"{arg}: a torch tensor of layout {layout} received; expected a dense (torch.strided) "
                        "tensor (x.to_dense())")
    if str(getattr(x, "dtype", "")).replace("torch.", "") not in ("int32", "int64"):
        raise TypeError(f"{arg}: dtype {getattr(x, 'dtype', type(x).__name__)} received; expected int64 or int32")


def _has_data(x: Any, arg: str) -> None:
    """Refuses a torch tensor without memory (meta or fake) that this module must read on the host
    (its error would otherwise be torch's, naming no argument)."""
    if _without_data(x):
        raise ValueError(f"{arg}: a tensor without data (meta or fake) received; the outputs' row count is "
                         "read from it on the host: pass key_out and value_out")


def _not_uint8(c: Any) -> bool:
    """Whether `c` has a dtype and it is not uint8 (the NVFP4 page bytes)."""
    dt = getattr(c, "dtype", None)
    return dt is not None and str(dt).replace("torch.", "") != "uint8"


def _uint8_cache(kv_cache: Any, value_cache: Any) -> None:
    """Refuses, as the C ABI would, a cache whose shape this module is about to allocate from but
    that holds no NVFP4 bytes (a bf16 cache's last dimension is no F = D/2 + D/16)."""
    for arg, c in (("kv_cache", kv_cache), ("value_cache", value_cache)):
        if _not_uint8(c):
            raise TypeError(f"{arg}: dtype {c.dtype} received; expected uint8 (the NVFP4 page bytes)")


def _as_int32(x: Any) -> Any:
    if _framework(x) == "torch":
        import torch

        return x.to(torch.int32)
    return x.astype("int32")


def _total_rows(seq_lens: Any, cu_seqlens: Any, computed: bool, block_table: Any = None) -> int:
    """``cu_seqlens[-1]``, read on the host (a sync), to allocate the outputs; checked here since
    this module does the reading. `computed`: cu_seqlens came from :func:`_prefix_sums`, whose
    input is then the argument to blame."""
    _has_data(seq_lens if computed else cu_seqlens, "seq_lens" if computed else "cu_seqlens")
    if computed:
        lo = seq_lens.min() if int(seq_lens.shape[0]) else 0
        if int(lo) < 0:
            raise ValueError(f"seq_lens: a negative length ({int(lo)}) received; lengths must be >= 0")
        return int(cu_seqlens[-1])
    shape = _shape(cu_seqlens, "cu_seqlens") if not isinstance(cu_seqlens, (list, tuple)) else (len(cu_seqlens),)
    if not isinstance(cu_seqlens, (list, tuple)):
        _host_readable_index(cu_seqlens, "cu_seqlens")
    if len(shape) != 1 or shape[0] == 0:
        raise ValueError(f"cu_seqlens: shape {shape} received; expected [B + 1] (B + 1 >= 1 entries: its "
                         "last entry is the output's row count)")
    # The counts the C ABI checks, before the last entry sizes the outputs.
    bshape, lens_shape = tuple(getattr(block_table, "shape", ())), tuple(getattr(seq_lens, "shape", ()))
    if len(bshape) == 2 and len(lens_shape) == 1:
        if lens_shape[0] != bshape[0]:
            raise ValueError(f"seq_lens: {lens_shape[0]} entries received; expected {bshape[0]}")
        if shape[0] != bshape[0] + 1:
            raise ValueError(f"cu_seqlens: {shape[0]} entries received; expected {bshape[0] + 1}")
    total = int(cu_seqlens[-1])
    if total < 0:
        raise ValueError(f"cu_seqlens: last entry {total} received; it is the output's row count, so >= 0")
    return total


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
    kv_layout: Optional[str] = None,
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
    kv_cache, value_cache, k_scale, v_scale, scale_layout, kv_layout, stream
        As for :func:`store`.
    block_table : int32/int64 array ``[B, max_blocks]``
        Entries < 0 or >= N (and blocks past ``max_blocks``) read as zeros.
    seq_lens : int32/int64 array ``[B]``
    cu_seqlens : int32/int64 array ``[B + 1]``, optional
        Output row of each sequence's first token. Default: the prefix sums of ``seq_lens``,
        computed on its device in int64 (lengths < 0 count as 0; where the outputs are allocated
        here, which reads the lengths on the host, a negative length is a ValueError); returned as int32
        (FlashAttention's dtype) when the outputs are allocated here and the total fits in
        int32, else as int64. Sequences' rows must not overlap (not checked): a row two write
        gets the later one's values on the CPU, on the GPU either one's, element by element.
    dtype : {"bfloat16", "float16", "float32"}, optional
        Output dtype when allocated here; default: that of the output passed when only one is,
        else bfloat16 for torch, float32 otherwise.
    key_out, value_out : arrays ``[total_tokens, H, D]`` / ``[total_tokens, H, Dv]``, optional
        Where to write. When not given, ``total_tokens = cu_seqlens[-1]`` is read on the host,
        which synchronizes with the GPU: pass outputs to stay asynchronous (and CUDA-graph safe).

    Returns
    -------
    key, value, cu_seqlens
        Rows outside ``[0, total_tokens)`` are never written; outputs allocated here are zeros
        in the rows no sequence writes (gaps a ``cu_seqlens`` passed in leaves).
    """
    orient = _orientation(kv_cache, value_cache, kv_layout)
    computed = cu_seqlens is None
    if computed:
        cu_seqlens = _prefix_sums(seq_lens)
    key_out, value_out, cu_seqlens = _gather_outputs(kv_cache, value_cache, seq_lens, cu_seqlens, computed, dtype,
                                                     key_out, value_out, orient, block_table)
    try:
        _C.gather_dequant(kv_cache, value_cache, block_table, seq_lens, cu_seqlens, k_scale, v_scale,
                          scale_layout, key_out, value_out, stream, orient)
    except ValueError as e:
        if not _without_data(kv_cache, value_cache, block_table, seq_lens, cu_seqlens, key_out, value_out):
            raise _refused(e, kv_cache, value_cache, orient) from None
        ops = _ops()
        kv_cache, value_cache = ops._sides(kv_cache, value_cache, kv_layout)
        ops.gather_dequant(kv_cache, block_table, seq_lens, cu_seqlens, ops.scale_tensor(k_scale),
                           ops.scale_tensor(v_scale), key_out, value_out, value_cache, scale_layout)
    return key_out, value_out, cu_seqlens


def decode_workspace_bytes(num_seqs: int, q_len: int, num_qo_heads: int, num_kv_heads: int, head_size_v: int,
                           max_blocks_per_seq: int) -> int:
    """Bytes of the :func:`decode_attention` workspace for that geometry (0: none needed).

    The CUDA path splits each sequence's tokens over several blocks when few (sequence, KV head)
    pairs would occupy the GPU. The split count depends on ``num_seqs``, ``num_kv_heads`` and
    ``max_blocks_per_seq`` alone, and each split's partial on the query rows and ``head_size_v``,
    so the size follows from these six arguments, never from the sequence lengths: one workspace
    serves every call of that geometry, and a larger one does too.
    """
    return _C.decode_workspace_bytes(*_int64s(num_seqs=num_seqs, q_len=q_len, num_qo_heads=num_qo_heads,
                                             num_kv_heads=num_kv_heads, head_size_v=head_size_v,
                                             max_blocks_per_seq=max_blocks_per_seq))


def decode_workspace(kv_cache: Any, query: Any, block_table: Any, q_len: int = 1, value_cache: Any = None, *,
                     kv_layout: Optional[str] = None) -> Any:
    """A zeroed uint8 :func:`decode_attention` workspace on the cache's device, sized for this
    call's geometry (an empty array when it needs none). Same framework as the cache;
    ``kv_layout`` as to :func:`store`."""
    _, _, h, _, dv = _cache_geometry(kv_cache, value_cache, _orientation(kv_cache, value_cache, kv_layout))
    qshape, bshape = _shape(query, "query"), _shape(block_table, "block_table")
    if len(qshape) != 3:
        raise ValueError(f"query: shape {qshape} received; expected (num_seqs * q_len, num_qo_heads, head_size)")
    if len(bshape) != 2:
        raise ValueError(f"block_table: shape {bshape} received; expected (num_seqs, max_blocks_per_seq)")
    (rows,) = _int64s(q_len=q_len)  # the one number given here: its errors name it
    try:
        nbytes = _C.decode_workspace_bytes(int(bshape[0]), rows, int(qshape[1]), h, dv, int(bshape[1]))
    except ValueError as e:
        # The C ABI names decode_workspace_bytes' parameters (num_qo_heads, head_size_v), which
        # come from the shapes here: say which.
        raise ValueError(f"query of shape {tuple(qshape)}, block_table of shape {tuple(bshape)}, q_len {q_len} and "
                         f"a cache of {h} KV heads of head size {dv}: {e}") from None
    return _zeros(kv_cache, nbytes, "uint8")


def _decode_out(query: Any, kv_cache: Any, value_cache: Any, out: Any, block_table: Any, q_len: int,
                checked: bool = True, orient: int = -1) -> Any:
    """decode_attention()'s output: the one given, else a new array [rows, Hq, Dv] in the query's
    dtype, framework and device (after the row count and the heads' upper bound are checked, as
    the C ABI would: a query of wrong rows or heads must not cost an allocation of its size, review
    2026-12-07). `checked` as for _dequantize_outputs; `orient`: _orientation's."""
    if out is not None:
        return out
    qshape = _shape(query, "query")
    if len(qshape) != 3:
        raise ValueError(f"query: shape {qshape} received; expected (num_seqs * q_len, num_qo_heads, head_size)")
    bshape = _shape(block_table, "block_table")
    if checked and len(bshape) == 2 and 1 <= q_len <= 8 and qshape[0] != bshape[0] * q_len:  # else the C ABI
        raise ValueError(f"query: {qshape[0]} rows (shape {tuple(qshape)}) but block_table has {bshape[0]} "
                         f"sequences of q_len {q_len}; expected {bshape[0] * q_len} rows")
    dtype = getattr(query, "dtype", None)
    if dtype is None:  # e.g. a memoryview: the binding reads it, but nothing here can allocate its like
        raise TypeError(f"query: a {type(query).__name__} received, which has no dtype to allocate the output in; "
                        "pass out= or a torch, numpy or cupy array")
    # A cache that is not uint8 first, as the C ABI checks it before the query (traced: the op's).
    _, _, h, _, dv = _cache_geometry(kv_cache, value_cache, orient, uint8=checked)
    hq = qshape[1]
    # More query heads per KV head than decode takes, refused before an output of their count is
    # allocated; the C ABI refuses the rest (its messages say more: _refused).
    if checked and hq > _C.DECODE_MAX_GROUP * h > 0:
        raise ValueError(f"query: {hq} query heads (shape {tuple(qshape)}) with the {h} KV heads of "
                         f"{'kv_cache' if value_cache is None else 'key_cache'}; expected a multiple of the KV "
                         f"heads, at most {_C.DECODE_MAX_GROUP} query heads per KV head")
    return _empty(query, (qshape[0], hq, dv), dtype)


def _real(x: Any, arg: str) -> float:
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        raise TypeError(f"{arg}: {_received(x)} received; expected a float")
    np = imported("numpy")
    # float() would read a numpy float32 subnormal as 0 under denormals-are-zero. An isinstance,
    # not an attribute lookup, which Dynamo refuses on the symbolic float a second value becomes
    # (review: a compiled call's second sm_scale raised Unsupported).
    if np is not None and isinstance(x, np.float32):
        return _float32_value(x)
    return _float(x, arg, "expected a finite float32")  # the binding checks the float32 range


def _received(x: Any) -> str:
    """What a scalar argument's error says was received: its type's name, and for an ndarray that
    torch.compile made of a numpy scalar (Dynamo traces numpy scalars as arrays), what to pass."""
    name = type(x).__name__
    if name == "ndarray" and getattr(x, "ndim", None) == 0:
        return "a 0-d numpy array (as torch.compile traces a numpy scalar: pass a Python number)"
    return name


def _int(x: Any, arg: str) -> int:
    if isinstance(x, bool) or not isinstance(x, numbers.Integral):
        raise TypeError(f"{arg}: {_received(x)} received; expected an int")
    return int(x)


def _int64s(**args: Any) -> List[int]:
    """Counts the binding takes as int64, in order: a bool or a non-integer is a TypeError, an int
    past int64 a ValueError naming the argument (the C ABI checks the values within it)."""
    ints = [_int(v, k) for k, v in args.items()]
    for k, v in zip(args, ints):
        if not -2**63 <= v < 2**63:
            raise ValueError(f"{k}: an int past the int64 range received ({len(str(abs(v)))} digits)")
    return ints


def _decode_scalars(query: Any, sm_scale: Any, logits_soft_cap: Any, window_left: Any,
                    q_len: Any) -> Tuple[float, float, int, int]:
    """The scalar arguments of decode_attention() as the binding takes them (sm_scale defaults
    to 1/sqrt(D)); their values are checked by the C ABI."""
    if sm_scale is None:
        shape = _shape(query, "query")
        if len(shape) != 3 or shape[2] <= 0:
            raise ValueError(f"query: shape {shape} received; expected (num_seqs * q_len, num_qo_heads, head_size)")
        sm = 1.0 / float(shape[2]) ** 0.5
    else:
        sm = _real(sm_scale, "sm_scale")
    # The binding takes int64 (the C ABI checks the values within it): a larger window is the
    # same as the largest; what lies below, or a q_len outside, is named here.
    window, rows = _int(window_left, "window_left"), _int(q_len, "q_len")
    if window < -2**63:
        raise ValueError(f"window_left: {window} received; expected -1 (no window) or >= 0")
    if not -2**63 <= rows < 2**63:
        raise ValueError(f"q_len: {rows} received; expected 1 to 8 query rows per sequence")
    return sm, _real(logits_soft_cap, "logits_soft_cap"), min(window, 2**63 - 1), rows


def decode_attention(
    query: Any,
    kv_cache: Any,
    block_table: Any,
    seq_lens: Any,
    k_scale: Any = 1.0,
    v_scale: Any = 1.0,
    *,
    value_cache: Any = None,
    scale_layout: str = "vllm",
    kv_layout: Optional[str] = None,
    sm_scale: Optional[float] = None,
    logits_soft_cap: float = 0.0,
    window_left: int = -1,
    q_len: int = 1,
    out: Any = None,
    lse: Any = None,
    workspace: Any = None,
    stream: Any = None,
) -> Any:
    """Decode attention that reads the NVFP4 pages directly (no bf16 copy of K/V).

    Query row ``i`` of sequence ``b`` (row ``b * q_len + i`` of ``query``, at token position
    ``p = seq_lens[b] - q_len + i``) attends to the positions ``j <= p`` of its sequence (and
    ``j >= p - window_left`` when ``window_left >= 0``), read through ``block_table`` as
    :func:`gather_dequant` reads them; positions whose block-table entry is < 0 or >= N are masked
    out and never read.

    Parameters
    ----------
    query : bfloat16/float16 array ``[B * q_len, Hq, D]``
        Last stride 1. ``Hq = group * H`` (group 1..16); D = the cache's head size, 64, 128 or 256.
    kv_cache, value_cache, k_scale, v_scale, scale_layout, kv_layout, stream
        As for :func:`store`. V's head size ``Dv`` is 64, 128 or 256 too.
    block_table : int32/int64 array ``[B, max_blocks]``
    seq_lens : int32/int64 array ``[B]``
        Tokens of each sequence, the query rows' own tokens included.
    sm_scale : float, optional
        Softmax scale; default ``1 / sqrt(D)``. Logits are ``(q . k) * k_scale * sm_scale``.
    logits_soft_cap : float
        > 0: logits become ``cap * tanh(logit / cap)``; 0: none.
    window_left : int
        -1: no window; >= 0: position ``p`` sees ``[p - window_left, p]``.
    q_len : int
        Query rows per sequence, 1..8 (causal among them).
    out : array ``[B * q_len, Hq, Dv]``, optional
        The query's dtype; allocated here (like the query) when not given.
    lse : float32 array ``[B * q_len, Hq]``, optional
        Receives the natural log of each row's softmax denominator (-inf for a row that sees no
        position).
    workspace : optional
        From :func:`decode_workspace`: needed by CUDA calls whose geometry splits the sequences
        (:func:`decode_workspace_bytes` > 0), which use it; other calls, the CPU's among them,
        only check a workspace given, as a CUDA call would (dtype, contiguity, device, overlap,
        and where the geometry may split, alignment and size).

    Returns
    -------
    out
        A row that sees no position is 0. Nothing is written when an argument is rejected.
    """
    orient = _orientation(kv_cache, value_cache, kv_layout)
    sm, cap, window, rows = _decode_scalars(query, sm_scale, logits_soft_cap, window_left, q_len)
    out = _decode_out(query, kv_cache, value_cache, out, block_table, rows, orient=orient)
    try:
        _C.decode_attention(query, kv_cache, value_cache, block_table, seq_lens, k_scale, v_scale, scale_layout,
                            rows, sm, cap, window, out, lse, workspace, stream, orient)
    except ValueError as e:
        if not _without_data(query, kv_cache, value_cache, block_table, seq_lens, out, lse, workspace):
            raise _refused(e, kv_cache, value_cache, orient) from None
        ops = _ops()
        kv_cache, value_cache = ops._sides(kv_cache, value_cache, kv_layout)
        ops.decode_attention(query, kv_cache, block_table, seq_lens, ops.scale_tensor(k_scale),
                             ops.scale_tensor(v_scale), out, sm, lse, value_cache, scale_layout, cap, window, rows,
                             workspace)
    return out


def set_cpu_threads(threads: int) -> None:
    """Most threads one call on CPU tensors uses, for the whole process.

    1 to 256, or 0 (the default) for one per CPU the calling thread may run on, at most 16. Until this
    is called, the environment variable ``NVFP4KV_CPU_THREADS`` sets it (read once). Small calls
    use fewer threads; the bytes are the same for every count. CUDA calls are not affected.
    See docs/python-api.md.
    """
    # An integer, not a bool, as the rest of the API takes a count. The C ABI checks the range;
    # a value past its int is named here (the binding's own refusal was a TypeError; review).
    if isinstance(threads, bool) or not isinstance(threads, numbers.Integral):
        raise TypeError(f"set_cpu_threads: threads must be an int, got {type(threads).__name__}")
    threads = int(threads)
    if not -2**31 <= threads < 2**31:
        raise ValueError(f"set_cpu_threads: threads {threads} received; past the range of a C int")
    _C.set_cpu_threads(threads)


def cpu_threads() -> int:
    """The thread count in force for CPU calls (:func:`set_cpu_threads`; 0 resolved to the calling
    thread's CPUs)."""
    return _C.cpu_threads()


def build_info() -> dict:
    """Version, CUDA build details and whether CUDA can be used here (and if not, why)."""
    info = {"version": _C.__version__}
    info.update(_C.cuda_info())
    return info
