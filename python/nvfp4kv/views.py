"""Zero-copy views of the packed data and the scale bytes inside an NVFP4 KV cache.

Python over the arrays' own strides (the extension only judges a view's origin, as the calls
do): works on torch tensors (any device, through ``as_strided`` on the same storage) and numpy
arrays, never copies, and imports neither torch nor numpy itself: a torch tensor can only exist
once its caller has imported torch.

Byte contract (``docs/FORMAT.md`` §4). ``D`` head size, ``H`` KV heads, ``T`` block size,
``S = D/16``, ``F = D/2 + S``. Each page holds ``[K side | V side]``; inside a side all packed
data comes first, then all scale bytes. Rows are ``r = h*T + t`` (HND) or ``r = t*H + h`` (NHD).
Offsets from the start of a side:

- data of (row r, byte j): ``r*D/2 + j``
- linear scale of (row r, group g): ``H*T*D/2 + r*S + g``
- token-4 interleaved scale of (head h, token t, group g), HND only:
  ``H*T*D/2 + h*T*S + (t//4)*4S + 4g + t%4``
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["nvfp4_kv_cache_split_views", "nvfp4_split_data_scale"]

_CACHE_SCALE_LAYOUTS = ("vllm", "linear")
_SIDE_SCALE_LAYOUTS = ("linear", "interleaved")


def imported(name: str) -> Any:
    """The module `name` (torch, numpy) where the caller has imported it (otherwise nothing given
    can be its array), else None. While another thread runs its import, sys.modules holds the
    partly loaded module: that counts as not imported (review: ``torch.Tensor`` missing there
    failed calls on numpy arrays)."""
    module = sys.modules.get(name)
    if module is None or getattr(getattr(module, "__spec__", None), "_initializing", False):
        return None
    return module


def _torch_module_of(x: Any):
    torch = imported("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return torch
    return None


def _numpy_module_of(x: Any):
    np = imported("numpy")
    if np is not None and isinstance(x, np.ndarray):
        return np
    return None


class _ArrayInterface:
    """Holds a hand-made ``__array_interface__`` and keeps the source array alive."""

    def __init__(self, interface: dict, base: Any):
        self.__array_interface__ = interface
        self.base = base


def _strided(x: Any, offset: int, shape: tuple, strides: tuple):
    """uint8 view of ``x``'s memory starting ``offset`` bytes after ``x``'s first element."""
    torch = _torch_module_of(x)
    if torch is not None:
        return x.as_strided(shape, strides, x.storage_offset() + offset)
    np = _numpy_module_of(x)
    # numpy's as_strided cannot move the start pointer, so build the interface directly (the
    # same thing numpy.lib.stride_tricks.as_strided does internally).
    ptr = x.__array_interface__["data"][0]
    interface = {
        "version": 3,
        "shape": tuple(shape),
        "typestr": "|u1",
        "data": (ptr + offset, not x.flags.writeable),
        "strides": tuple(strides),
    }
    return np.asarray(_ArrayInterface(interface, x))


def _as_scale_dtype(x: Any):
    torch = _torch_module_of(x)
    if torch is not None and hasattr(torch, "float8_e4m3fn"):
        return x.view(torch.float8_e4m3fn)  # same itemsize: allowed on any strides
    return x


def _shape_and_strides(x: Any, name: str):
    """Shape and element strides of a uint8 torch tensor or numpy array."""
    torch = _torch_module_of(x)
    if torch is not None:
        if x.dtype != torch.uint8:
            raise TypeError(f"{name} must have dtype uint8, got {x.dtype}")
        if x.is_neg():  # as the extension: views of it would carry the bit over the raw bytes
            raise ValueError(f"{name}: a lazily negated torch view (is_neg() is True) exports its un-negated "
                             "memory; pass x.resolve_neg()")
        return tuple(x.shape), tuple(x.stride())
    np = _numpy_module_of(x)
    if np is not None:
        if x.dtype != np.uint8:
            raise TypeError(f"{name} must have dtype uint8, got {x.dtype}")
        return tuple(x.shape), tuple(x.strides)  # bytes == elements for uint8
    raise TypeError(f"{name} must be a torch.Tensor or numpy.ndarray, got {type(x).__name__}")


def _head_size_from_full_dim(full_dim: int, name: str) -> int:
    # F = 9*D/16 with D a multiple of 16  <=>  F a multiple of 9, D = 16*F/9.
    if full_dim <= 0 or full_dim % 9 != 0:
        raise ValueError(
            f"{name}: last dimension {full_dim} is not an NVFP4 full dim 9*D/16 "
            "(D a multiple of 16)"
        )
    return full_dim // 9 * 16


def _stride_ok(stride: int, expected: int, size: int) -> bool:
    # The stride of a size-1 dimension is never used to address memory, and frameworks set
    # it freely, so it cannot tell anything about the layout.
    return size == 1 or stride == expected


def _side_layout(T: int, H: int, F: int, st: int, sh: int, sf: int, name: str) -> str:
    """HND or NHD from the (T, H, F) strides of one side; HND when both fit (H==1 or T==1)."""
    if sf != 1:
        raise ValueError(f"{name}: the last (byte) dimension must have stride 1, got {sf}")
    if _stride_ok(st, F, T) and _stride_ok(sh, T * F, H):
        return "HND"
    if _stride_ok(sh, F, H) and _stride_ok(st, H * F, T):
        return "NHD"
    raise ValueError(
        f"{name}: strides (T: {st}, H: {sh}, F: {sf}) are neither HND (T: {F}, H: {T * F}) "
        f"nor NHD (T: {H * F}, H: {F}); each side of a page must be one contiguous run of "
        f"H*T*F = {H * T * F} bytes"
    )


def _check_nonempty(T: int, H: int, name: str):
    if T <= 0 or H <= 0:
        raise ValueError(
            f"{name}: block size T and head count H must be positive, got T={T}, H={H}"
        )


def _check_page_stride(N: int, stride: int, page_bytes: int, name: str):
    # As the C ABI's check_page_stride: with N > 1 the stride is at least one page; with N <= 1
    # the page stride never addresses memory (any value, negative included, is accepted).
    if N > 1 and stride < page_bytes:
        raise ValueError(
            f"{name}: page stride {stride} bytes; it must be at least one page ({page_bytes} "
            f"bytes): pages may not overlap or run backwards"
        )


def _side_views(x, offset, N, T, H, D, page_stride, layout, scale_layout, name):
    """(data, scale) views of one side starting ``offset`` bytes after ``x``'s first element."""
    half, S = D // 2, D // 16
    if layout == "HND":
        data_strides = (page_stride, half, T * half, 1)
        scale_strides = (page_stride, S, T * S, 1)
    else:
        data_strides = (page_stride, H * half, half, 1)
        scale_strides = (page_stride, H * S, S, 1)
    data = _strided(x, offset, (N, T, H, half), data_strides)
    scale_offset = offset + H * T * half
    if scale_layout == "linear":
        scale = _strided(x, scale_offset, (N, T, H, S), scale_strides)
    else:
        # Token-4 interleave: (t//4)*4S + 4g + t%4 inside head h's run of T*S bytes.
        scale = _strided(
            x, scale_offset, (N, T // 4, 4, H, S), (page_stride, 4 * S, 1, T * S, 4)
        )
    return data, _as_scale_dtype(scale)


def _refuse_part_of_pages(x: Any, shape, page_stride: int, side: bool, name: str):
    """What every call refuses, refused here too: a 4-D view cut from part of the pages of a 5-D
    cache (one head of several, the first tokens of each page), whose "scales" are other rows'
    codes (the binding's rule, python/src/ext.cpp refuse_part_of_pages; found by review)."""
    try:
        from . import _C
    except ImportError:  # this file loaded alone, without the package (the views tests can)
        return
    _C._refuse_part_of_pages(x, tuple(shape), page_stride, side, name)


def _check_interleaved(layout: str, T: int, D: int, name: str, side: bool = False):
    if layout != "HND":
        # An (N, H, T, F) half of a packed cache has the strides of an NHD side with H and T
        # exchanged, and a side is named (N, T, H, F): say both readings (review).
        half = (" as an (N, T, H, F) side (an (N, H, T, F) half of a packed cache reads so: "
                "split the packed cache itself with nvfp4_kv_cache_split_views)") if side else ""
        raise ValueError(
            f"scale_layout: token-4 interleaved scales need an HND cache, but {name} is NHD{half}"
        )
    if T % 4 != 0:
        raise ValueError(f"scale_layout: token-4 interleaved scales need T % 4 == 0, got T={T}")
    if D % 64 != 0:
        raise ValueError(
            f"scale_layout: token-4 interleaved scales need D % 64 == 0, got D={D}"
        )


def nvfp4_kv_cache_split_views(kv_cache: Any, scale_layout: str = "vllm"):
    """Split an NVFP4 KV cache into zero-copy data and scale views of both sides.

    nvfp4kv's own whole-cache helper, kept (not deprecated): vLLM's current code splits a cache
    side by side with :func:`nvfp4_split_data_scale`. (An older vLLM had a function of this name
    returning ``(k_data, v_data), (k_scale, v_scale)`` and reading a 4-D input as one side; this
    one returns four views and reads a 4-D input as the packed cache.)

    Parameters
    ----------
    kv_cache : torch.Tensor or numpy.ndarray, uint8
        Either 5-D ``(N, 2, T, H, F)`` with HND strides (physical ``[N][2][H][T][F]``,
        ``T`` stride ``F``, ``H`` stride ``T*F``) or NHD strides (``H`` stride ``F``, ``T``
        stride ``H*F``); the side stride is ``H*T*F`` (V right after K). Or packed 4-D
        ``(N, 2H, T, F)`` (HND, K = head slots ``0..H-1``, V = ``H..2H-1``; strides
        ``(page, T*F, F, 1)``). The page stride is free as long as pages do not overlap
        (at least ``2*H*T*F`` when ``N > 1``). These are the strides the store accepts.
        ``F = 9*D/16``. When ``H == 1`` or ``T == 1`` HND and NHD are the same bytes; the
        cache is then treated as HND.
    scale_layout : {"vllm", "linear"}, optional
        "vllm" (default): K scales linear, V scales token-4 interleaved (needs HND,
        ``T % 4 == 0`` and ``D % 64 == 0``). "linear": both linear.

    Returns
    -------
    k_data, k_scale, v_data, v_scale
        Views sharing ``kv_cache``'s memory (writing through them writes the cache):

        - ``k_data``, ``v_data``: uint8, shape ``(N, T, H, D/2)``; ``[n, t, h, j]`` is packed
          byte ``j`` (elements ``2j`` low nibble, ``2j+1`` high nibble) of token ``t``, head
          ``h`` of page ``n``.
        - linear scales: shape ``(N, T, H, D/16)``; ``[n, t, h, g]`` is the scale of group
          ``g`` (elements ``16g..16g+15``).
        - token-4 interleaved scales (``v_scale`` under "vllm"): shape
          ``(N, T/4, 4, H, D/16)``, strides ``(page, 4S, 1, T*S, 4)`` with ``S = D/16``;
          ``[n, b, i, h, g]`` is the scale of token ``t = 4b + i``, head ``h``, group ``g``,
          at side offset ``H*T*D/2 + h*T*S + b*4S + 4g + i``. ``v_scale.reshape(N, T, H, S)``
          (a copy for torch/numpy) gives the same indexing as a linear scale view.

        Scale dtype: ``torch.float8_e4m3fn`` for torch tensors, ``uint8`` for numpy arrays.

    Raises
    ------
    TypeError
        If ``kv_cache`` is not a torch tensor / numpy array, or not uint8.
    ValueError
        For a wrong rank, a dimension that is not 2 / even where the layout needs it, a last
        dimension that is not ``9*D/16``, strides that are neither HND nor NHD, a side stride
        other than ``H*T*F``, overlapping pages, or an unknown or unusable ``scale_layout``.
    """
    name = "kv_cache"
    if scale_layout not in _CACHE_SCALE_LAYOUTS:
        raise ValueError(
            f"scale_layout: unknown value {scale_layout!r}; expected 'vllm' or 'linear'"
        )
    shape, strides = _shape_and_strides(kv_cache, name)
    if len(shape) == 5:
        N, two, T, H, F = shape
        sn, s2, st, sh, sf = strides
        if two != 2:
            raise ValueError(f"{name}: dimension 1 of a 5-D cache must be 2 (K, V), got {two}")
        _check_nonempty(T, H, name)  # before the strides, whose checks an empty side confuses
        layout = _side_layout(T, H, F, st, sh, sf, name)
        if s2 != H * T * F:
            # The C ABI takes a 5-D cache only with V right after K (stride H*T*F).
            raise ValueError(
                f"{name}: side (dimension 1) stride {s2}; a 5-D cache must have its V side "
                f"right after its K side (stride H*T*F = {H * T * F}); for sides elsewhere "
                f"use nvfp4_split_data_scale on {name}[:, 0] and {name}[:, 1]"
            )
        _check_page_stride(N, sn, 2 * H * T * F, name)
        k_offset, v_offset = 0, s2
    elif len(shape) == 4:
        N, H2, T, F = shape
        sn, sh, st, sf = strides
        if H2 % 2 != 0:
            raise ValueError(
                f"{name}: dimension 1 of a packed 4-D cache (2H) must be even, got {H2}"
            )
        H = H2 // 2
        _check_nonempty(T, H, name)
        if sf != 1 or not _stride_ok(st, F, T) or not _stride_ok(sh, T * F, H2):
            raise ValueError(
                f"{name}: a packed 4-D cache (N, 2H, T, F) must have HND strides "
                f"(page, {T * F}, {F}, 1), got {strides} (an NHD-ordered packed cache "
                "interleaves K and V at each position: not a page of the format)"
            )
        _check_page_stride(N, sn, 2 * H * T * F, name)
        _refuse_part_of_pages(kv_cache, shape, sn, False, name)
        layout = "HND"
        k_offset, v_offset = 0, H * T * F
    else:
        raise ValueError(
            f"{name}: expected a 5-D (N, 2, T, H, F) or packed 4-D (N, 2H, T, F) cache, "
            f"got {len(shape)}-D shape {shape}"
        )
    D = _head_size_from_full_dim(F, name)
    v_scale_layout = "linear"
    if scale_layout == "vllm":
        _check_interleaved(layout, T, D, name)
        v_scale_layout = "interleaved"
    k_data, k_scale = _side_views(kv_cache, k_offset, N, T, H, D, sn, layout, "linear", name)
    v_data, v_scale = _side_views(
        kv_cache, v_offset, N, T, H, D, sn, layout, v_scale_layout, name
    )
    return k_data, k_scale, v_data, v_scale


def nvfp4_split_data_scale(kv_side: Any, scale_layout: str = "linear"):
    """Split one side (K or V) of an NVFP4 cache into zero-copy data and scale views.

    vLLM's ``nvfp4_split_data_scale(kv_side) -> (data, scale)`` (``vllm/utils/torch_utils.py``):
    same name, argument, shapes and dtypes. Inside a side all packed data comes first, then all
    scale bytes (FORMAT.md §4); the views keep the input's dimension order, so an
    ``(N, T, H, F)`` side gives ``(N, T, H, ...)`` views and an ``(N, H, T, F)`` side (vLLM's
    attention read, ``kv_cache.split(num_kv_heads, dim=1)`` of a packed cache) gives
    ``(N, H, T, ...)`` views. Unlike vLLM's, which checks nothing, this one rejects a side whose
    bytes are not one contiguous run per page (e.g. a side of an NHD-ordered packed cache, whose
    K and V interleave), and it also takes numpy arrays and the token-4 interleaved scales.

    Parameters
    ----------
    kv_side : torch.Tensor or numpy.ndarray, uint8
        Shape ``(N, d1, d2, F)``, ``F = 9*D/16``: ``(N, T, H, F)`` (``kv_cache[:, 0]`` /
        ``kv_cache[:, 1]`` of a 5-D cache, the store's ``key_cache`` / ``value_cache``,
        ``kv_cache.transpose(1, 2).split(H, dim=-2)`` of a packed one) or ``(N, H, T, F)``
        (``kv_cache.split(H, dim=1)`` of a packed cache). The two inner dimensions with the
        last one must cover one contiguous run of ``d1*d2*F`` bytes per page, in either order
        (HND or NHD); the page stride is free as long as pages do not overlap (at least
        ``d1*d2*F`` when ``N > 1``).
    scale_layout : {"linear", "interleaved"}, optional
        How this side's scales are laid out: "linear" (default, vLLM's function), or
        "interleaved" for token-4 interleaved (an ``(N, T, H, F)`` HND side, ``T % 4 == 0``,
        ``D % 64 == 0``: V under ``scale_layout="vllm"``); nvfp4kv's addition.

    Returns
    -------
    data : uint8, shape ``(N, d1, d2, D/2)``
        E.g. for an ``(N, T, H, F)`` side, ``[n, t, h, j]`` is packed byte ``j`` (elements
        ``2j`` low nibble, ``2j+1`` high nibble) of token ``t``, head ``h`` of page ``n``.
    scale : float8_e4m3fn (torch) or uint8 (numpy)
        "linear": shape ``(N, d1, d2, D/16)``, starting ``d1*d2*D/2`` bytes into the side;
        ``[..., g]`` is the scale of group ``g`` (elements ``16g..16g+15``). "interleaved":
        shape ``(N, T/4, 4, H, D/16)``, ``[n, b, i, h, g]`` the scale of token ``4b + i``; see
        :func:`nvfp4_kv_cache_split_views`.

    Raises
    ------
    TypeError
        If ``kv_side`` is not a torch tensor / numpy array, or not uint8.
    ValueError
        For a wrong rank, a last dimension that is not ``9*D/16``, strides that are neither
        HND nor NHD, overlapping pages, or an unknown or unusable ``scale_layout``.
    """
    name = "kv_side"
    if scale_layout not in _SIDE_SCALE_LAYOUTS:
        raise ValueError(
            f"scale_layout: unknown value {scale_layout!r}; expected 'linear' or 'interleaved'"
        )
    shape, strides = _shape_and_strides(kv_side, name)
    if len(shape) != 4:
        raise ValueError(
            f"{name}: expected a 4-D (N, T, H, F) or (N, H, T, F) side, got {len(shape)}-D {shape}"
        )
    # Named (N, T, H, F); for an (N, H, T, F) side the two inner names swap, which changes
    # nothing but which layout name (HND/NHD) the strides get: the views follow the dimensions.
    N, T, H, F = shape
    sn, st, sh, sf = strides
    _check_nonempty(T, H, name)
    layout = _side_layout(T, H, F, st, sh, sf, name)
    _check_page_stride(N, sn, H * T * F, name)
    _refuse_part_of_pages(kv_side, shape, sn, True, name)
    D = _head_size_from_full_dim(F, name)
    if scale_layout == "interleaved":
        _check_interleaved(layout, T, D, name, side=True)
    return _side_views(kv_side, 0, N, T, H, D, sn, layout, scale_layout, name)
