"""KV-cache geometry: dtype strings, cache shapes, page sizes and allocation.

Pure Python. Nothing here imports the compiled extension, and torch is only imported when a
caller asks for a torch object (a ``torch.dtype`` from :data:`STR_DTYPE_TO_TORCH_DTYPE`, or a
torch-backed :func:`allocate_kv_cache`), so ``import nvfp4kv.spec`` works without torch.

The byte contract is ``docs/FORMAT.md``; the numbers used here are its §4:

- ``F(D) = D/2 + D/16`` bytes per (token, head) row of an NVFP4 cache ("full dim");
- one page holds both sides, ``[K side | V side]``, each ``H*T*F`` bytes;
- page size for one layer and one block: ``T*H*(F(D) + F(Dv))`` bytes.

Names that mirror vLLM carry vLLM's values (pinned, with the vLLM file and commit each mirrors,
in ``tests/python/test_vllm_names.py``): :class:`KVQuantMode`, :func:`get_kv_quant_mode`
(``vllm/v1/kv_cache_interface.py``), :func:`is_quantized_kv_cache`,
:data:`STR_DTYPE_TO_TORCH_DTYPE`, :data:`MODELOPT_TO_VLLM_KV_CACHE_DTYPE_MAP`,
:func:`nvfp4_kv_cache_full_dim` (``vllm/utils/torch_utils.py``), and the packed
``(N, 2H, T, F)`` cache of vLLM's FlashInfer/TRT-LLM NVFP4 path (:func:`get_kv_cache_shape`,
:func:`get_kv_cache_stride_order`). nvfp4kv's own view of a dtype string (which strings are
NVFP4 for nvfp4kv, "nvfp4_4over6" included) is :func:`is_nvfp4_kv_cache`.
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Optional

__all__ = [
    "KVCacheSpec",
    "KVQuantMode",
    "MODELOPT_TO_VLLM_KV_CACHE_DTYPE_MAP",
    "NVFP4_KV_CACHE_DTYPES",
    "FP8_KV_CACHE_DTYPES",
    "UNQUANTIZED_KV_CACHE_DTYPES",
    "KV_CACHE_DTYPES",
    "KV_CACHE_LAYOUTS",
    "NVFP4_MAX_HEAD_SIZE",
    "STR_DTYPE_TO_TORCH_DTYPE",
    "allocate_kv_cache",
    "get_kv_cache_shape",
    "get_kv_cache_stride_order",
    "get_kv_quant_mode",
    "is_nvfp4_kv_cache",
    "is_quantized_kv_cache",
    "nvfp4_kv_cache_full_dim",
]

#: kv_cache_dtype strings that select the NVFP4 format (same bytes, different scale recipe).
NVFP4_KV_CACHE_DTYPES = ("nvfp4", "nvfp4_4over6")
#: kv_cache_dtype strings that select a per-tensor-scaled FP8 cache (1 byte per element).
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")
#: kv_cache_dtype strings that store the model's values unquantized. "auto" means the model
#: dtype, which nvfp4kv takes to be a 16-bit type when it needs a size.
UNQUANTIZED_KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "half", "float", "float32")
#: Every accepted kv_cache_dtype string.
KV_CACHE_DTYPES = UNQUANTIZED_KV_CACHE_DTYPES + FP8_KV_CACHE_DTYPES + NVFP4_KV_CACHE_DTYPES
#: Largest head size D of an nvfp4 cache that the operations take (a multiple of 16 from 16 to
#: this). The C ABI's limit, kMaxHeadSize in cpp/include/nvfp4kv/format.h (exported by the
#: extension as ``nvfp4kv._C.MAX_HEAD_SIZE``); repeated here because this module must not import
#: the extension, and a test checks that the two agree.
NVFP4_MAX_HEAD_SIZE = 512
#: Accepted cache layouts (FORMAT.md §4): HND is the canonical one.
KV_CACHE_LAYOUTS = ("HND", "NHD")

# Bytes per stored element for the non-NVFP4 dtypes.
_ELEMENT_BYTES = {
    "auto": 2,
    "bfloat16": 2,
    "float16": 2,
    "half": 2,
    "float": 4,
    "float32": 4,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
}

#: ModelOpt ``kv_cache_quant_algo`` (lower-cased) -> vLLM ``kv_cache_dtype``, as in vLLM's
#: ``vllm/utils/torch_utils.py``; vLLM looks up ``kv_algo.lower()``, so "NVFP4" -> "nvfp4".
MODELOPT_TO_VLLM_KV_CACHE_DTYPE_MAP = {
    "fp8": "fp8_e4m3",
    "mixed_precision": "auto",
    "nvfp4": "nvfp4",
}


def _check_kv_cache_dtype(kv_cache_dtype: Any, name: str = "kv_cache_dtype") -> str:
    if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"{name}: unknown value {kv_cache_dtype!r}; "
            f"expected one of {', '.join(repr(s) for s in KV_CACHE_DTYPES)}"
        )
    return kv_cache_dtype


def _check_layout(layout: Any) -> str:
    if not isinstance(layout, str) or layout not in KV_CACHE_LAYOUTS:
        raise ValueError(f"layout: unknown value {layout!r}; expected 'HND' or 'NHD'")
    return layout


def _check_nvfp4_head_size(name: str, value: int) -> None:
    # What every operation rejects (the C ABI: a multiple of 16 up to NVFP4_MAX_HEAD_SIZE).
    if value % 16 != 0 or value > NVFP4_MAX_HEAD_SIZE:
        raise ValueError(
            f"{name} must be a positive multiple of 16 up to {NVFP4_MAX_HEAD_SIZE} for an nvfp4 "
            f"cache (the most the operations take), got {value!r}"
        )


def _integer(value: Any) -> Optional[int]:
    """value as a Python int where it is an integer (a NumPy one too), else None. bool is an int
    subclass, but True as a block size is always a mistake; so are NumPy's bool (named "bool_"
    before NumPy 2, "bool" since, and an integer to NumPy 2.0/2.1's operator.index) and 0-d bool
    arrays and tensors (torch's take operator.index)."""
    if isinstance(value, bool) or type(value).__name__ in ("bool_", "bool"):
        return None
    if str(getattr(value, "dtype", "")).rsplit(".", 1)[-1] == "bool":  # numpy "bool", torch "torch.bool"
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def _check_positive_int(name: str, value: Any) -> int:
    n = _integer(value)
    if n is None or n <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return n


def _check_nonnegative_int(name: str, value: Any) -> int:
    n = _integer(value)
    if n is None or n < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return n


def nvfp4_kv_cache_full_dim(head_size: int) -> int:
    """Bytes per (token, head) row of an NVFP4 KV cache: ``D/2`` packed + ``D/16`` scales.

    vLLM's ``nvfp4_kv_cache_full_dim`` (``vllm/utils/torch_utils.py``) computes
    ``head_size // 2 + head_size // 16`` without checking anything; this one gives the same value
    for every head size the format has and raises for the others (a head size that is not a
    multiple of 16 has no NVFP4 row).

    Parameters
    ----------
    head_size : int
        Head size ``D``; a positive multiple of 16 (one E4M3 scale per 16 elements).

    Returns
    -------
    int
        ``F = D//2 + D//16 = 9*D/16`` (72 for ``D = 128``).

    Raises
    ------
    ValueError
        If ``head_size`` is not a positive multiple of 16.
    """
    d = _integer(head_size)
    if d is None or d <= 0 or d % 16 != 0:
        raise ValueError(f"head_size must be a positive multiple of 16, got {head_size!r}")
    return d // 2 + d // 16


class KVQuantMode(enum.IntEnum):
    """How a KV cache is quantized: vLLM's ``KVQuantMode`` (``vllm/v1/kv_cache_interface.py``).

    Same members and values as vLLM's enum at the commit ``tests/python/test_vllm_names.py``
    pins. Later vLLM versions insert members and renumber (NVFP4 becomes 5): pass a mode to vLLM
    by name, ``vllm.v1.kv_cache_interface.KVQuantMode[mode.name]``, never by its integer.

    Attributes
    ----------
    NONE
        Unquantized (16- or 32-bit values).
    FP8_PER_TENSOR
        FP8 (E4M3 or E5M2) with one fp32 scale per tensor and side.
    INT8_PER_TOKEN_HEAD
        int8 with a scale per token and head (vLLM's "int8_per_token_head"; not an nvfp4kv format).
    FP8_PER_TOKEN_HEAD
        FP8 with a scale per token and head (vLLM's "fp8_per_token_head"; not an nvfp4kv format).
    NVFP4
        NVFP4: E2M1 codes, one E4M3 scale per 16 elements, one fp32 global scale per side.
    """

    NONE = 0
    FP8_PER_TENSOR = 1
    INT8_PER_TOKEN_HEAD = 2
    FP8_PER_TOKEN_HEAD = 3
    NVFP4 = 4

    @property
    def is_per_token_head(self) -> bool:
        """bool: INT8_PER_TOKEN_HEAD or FP8_PER_TOKEN_HEAD (as vLLM's property)."""
        return self in (KVQuantMode.INT8_PER_TOKEN_HEAD, KVQuantMode.FP8_PER_TOKEN_HEAD)

    @property
    def is_nvfp4(self) -> bool:
        """bool: NVFP4 (as vLLM's property)."""
        return self == KVQuantMode.NVFP4


def _check_str(kv_cache_dtype: Any) -> str:
    # vLLM's functions take a str and would fail with an AttributeError on anything else.
    if not isinstance(kv_cache_dtype, str):
        raise TypeError(f"kv_cache_dtype must be a str, got {type(kv_cache_dtype).__name__}")
    return kv_cache_dtype


def get_kv_quant_mode(kv_cache_dtype: str) -> KVQuantMode:
    """vLLM's ``get_kv_quant_mode`` (``vllm/v1/kv_cache_interface.py``), exactly.

    Never raises for a str: "int8_per_token_head" -> INT8_PER_TOKEN_HEAD,
    "fp8_per_token_head" -> FP8_PER_TOKEN_HEAD, "nvfp4" -> NVFP4, any other string starting with
    "fp8" -> FP8_PER_TENSOR, anything else -> NONE. Note that "nvfp4_4over6" is NONE here, as in
    vLLM: nvfp4kv's own test for its NVFP4 strings is :func:`is_nvfp4_kv_cache`.

    Parameters
    ----------
    kv_cache_dtype : str
        A vLLM ``kv_cache_dtype`` string (any string).

    Returns
    -------
    KVQuantMode

    Raises
    ------
    TypeError
        If ``kv_cache_dtype`` is not a str.
    """
    _check_str(kv_cache_dtype)
    if kv_cache_dtype == "int8_per_token_head":
        return KVQuantMode.INT8_PER_TOKEN_HEAD
    if kv_cache_dtype == "fp8_per_token_head":
        return KVQuantMode.FP8_PER_TOKEN_HEAD
    if kv_cache_dtype == "nvfp4":
        return KVQuantMode.NVFP4
    if kv_cache_dtype.startswith("fp8"):
        return KVQuantMode.FP8_PER_TENSOR
    return KVQuantMode.NONE


def is_quantized_kv_cache(kv_cache_dtype: str) -> bool:
    """vLLM's ``is_quantized_kv_cache`` of ``vllm/utils/torch_utils.py``, exactly.

    ``kv_cache_dtype.startswith("fp8") or kv_cache_dtype.endswith("per_token_head") or
    kv_cache_dtype.startswith("nvfp4")``; never raises for a str. True for "nvfp4_4over6".

    vLLM has a second function of this name in ``vllm/v1/kv_cache_interface.py``,
    ``get_kv_quant_mode(s) != KVQuantMode.NONE``, which differs for strings that
    :func:`get_kv_quant_mode` does not know: it is False for "nvfp4_4over6" and
    "int4_per_token_head", where this one is True. Use
    ``get_kv_quant_mode(s) != KVQuantMode.NONE`` where that one is meant.

    Parameters
    ----------
    kv_cache_dtype : str
        A vLLM ``kv_cache_dtype`` string (any string).

    Returns
    -------
    bool

    Raises
    ------
    TypeError
        If ``kv_cache_dtype`` is not a str.
    """
    _check_str(kv_cache_dtype)
    return (kv_cache_dtype.startswith("fp8") or kv_cache_dtype.endswith("per_token_head")
            or kv_cache_dtype.startswith("nvfp4"))


def is_nvfp4_kv_cache(kv_cache_dtype: Any) -> bool:
    """Whether nvfp4kv stores ``kv_cache_dtype`` in the NVFP4 format (nvfp4kv's own helper).

    True for "nvfp4" and "nvfp4_4over6" (the same bytes, two scale recipes: the strings
    ``recipe=`` / ``kv_cache_dtype`` take), False for every other value (never raises). Unlike
    vLLM's :func:`get_kv_quant_mode`, which gives NONE for "nvfp4_4over6".
    """
    return isinstance(kv_cache_dtype, str) and kv_cache_dtype in NVFP4_KV_CACHE_DTYPES


class _LazyTorchDtypeMap(Mapping):
    """A read-only ``str -> torch.dtype`` mapping that imports torch on first value access.

    Keys, ``len`` and ``in`` work without torch; reading a value imports it (ImportError if
    torch is missing).
    """

    def __init__(self, names: dict):
        self._names = dict(names)  # str -> attribute name in the torch module

    def __getitem__(self, key: str):
        attr = self._names[key]  # KeyError for unknown keys, as a dict would
        import torch  # noqa: PLC0415 - deliberately lazy

        return getattr(torch, attr)

    def __contains__(self, key: object) -> bool:
        # Mapping's default __contains__ calls __getitem__, which would import torch.
        return key in self._names

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __repr__(self) -> str:
        return f"STR_DTYPE_TO_TORCH_DTYPE({', '.join(self._names)})"


#: vLLM's ``STR_DTYPE_TO_TORCH_DTYPE`` (``vllm/utils/torch_utils.py``): the same keys and
#: values, resolved lazily (torch is imported when a value is read). Every quantized cache is
#: stored as ``torch.uint8`` (fp8 included), except "int8" / "int8_per_token_head" (int8) and
#: "fp8_inc" (float8_e4m3fn). Not every key is a cache nvfp4kv sizes (:class:`KVCacheSpec`
#: takes :data:`KV_CACHE_DTYPES`).
STR_DTYPE_TO_TORCH_DTYPE: Mapping = _LazyTorchDtypeMap(
    {
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
)


def _resolve_packed(packed: Any, cache_dtype_str: str, layout: str) -> bool:
    """The cache's rank: packed 4-D or 5-D. None: packed for nvfp4 (vLLM's form), else 5-D."""
    if packed is None:
        packed = cache_dtype_str in NVFP4_KV_CACHE_DTYPES
    elif not isinstance(packed, bool):
        raise ValueError(f"packed must be True, False or None, got {packed!r}")
    if packed and layout == "NHD":
        raise ValueError(
            "layout 'NHD' with a packed (N, 2H, T, F) cache: its NHD stride order (0, 2, 1, 3) "
            "interleaves K and V heads at every position, which is not a page of the format "
            "([K data | K scale | V data | V scale], each side one contiguous run); use "
            "layout='HND' (vLLM's NVFP4 path) or the 5-D form, packed=False"
        )
    return packed


def get_kv_cache_shape(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    cache_dtype_str: str = "auto",
    layout: str = "HND",
    *,
    packed: Optional[bool] = None,
) -> tuple:
    """Logical shape of a paged KV cache for one layer, as a vLLM attention backend gives it.

    Parameters
    ----------
    num_blocks : int
        Number of pages ``N`` (>= 0).
    block_size : int
        Tokens per page ``T``.
    num_kv_heads : int
        KV heads ``H``.
    head_size : int
        Head size ``D`` (a multiple of 16 up to :data:`NVFP4_MAX_HEAD_SIZE` for nvfp4).
    cache_dtype_str : str, optional
        One of :data:`KV_CACHE_DTYPES` (default "auto").
    layout : {"HND", "NHD"}, optional
        The layout the cache will be allocated in (see :func:`get_kv_cache_stride_order`); the
        shape is the same for both, but a packed cache must be HND.
    packed : bool or None, optional
        None (default): packed for the nvfp4 dtypes (vLLM's FlashInfer/TRT-LLM NVFP4 cache),
        5-D for the others (FlashInfer's form; newer vLLM versions view bf16/fp8 pages with K
        and V side by side in each head's row). True: packed. False: 5-D.

    Returns
    -------
    tuple of int
        Packed: ``(N, 2H, T, last)``, K heads ``0..H-1``, V heads ``H..2H-1``. 5-D:
        ``(N, 2, T, H, last)``. ``last = F(D) = 9*D/16`` bytes (uint8) for the nvfp4 dtypes,
        else ``D`` elements. The bytes of a page are the same in both forms (FORMAT.md §4).

    Raises
    ------
    ValueError
        For a non-positive size, an unknown dtype or layout, an nvfp4 ``D`` that is not a
        multiple of 16 up to :data:`NVFP4_MAX_HEAD_SIZE`, or a packed cache with layout "NHD"
        (whose K and V would interleave; see :func:`get_kv_cache_stride_order`).
    """
    # Python ints from here on: a NumPy or torch integer kept as given would make the tuple hold
    # it, and 2 * num_kv_heads overflow in int32 (found by review).
    num_blocks = _check_nonnegative_int("num_blocks", num_blocks)
    block_size = _check_positive_int("block_size", block_size)
    num_kv_heads = _check_positive_int("num_kv_heads", num_kv_heads)
    head_size = _check_positive_int("head_size", head_size)
    _check_kv_cache_dtype(cache_dtype_str, "cache_dtype_str")
    _check_layout(layout)
    packed = _resolve_packed(packed, cache_dtype_str, layout)
    if cache_dtype_str in NVFP4_KV_CACHE_DTYPES:
        _check_nvfp4_head_size("head_size", head_size)
        last = nvfp4_kv_cache_full_dim(head_size)
    else:
        last = head_size
    if packed:
        return (num_blocks, 2 * num_kv_heads, block_size, last)
    return (num_blocks, 2, block_size, num_kv_heads, last)


def get_kv_cache_stride_order(
    layout: str = "HND",
    cache_dtype_str: str = "auto",
    *,
    packed: Optional[bool] = None,
) -> tuple:
    """Physical order of the dimensions of the cache :func:`get_kv_cache_shape` describes.

    Parameters
    ----------
    layout : {"HND", "NHD"}
        Cache layout.
    cache_dtype_str : str, optional
        As for :func:`get_kv_cache_shape` (default "auto"): with ``packed=None`` it picks the
        rank, so pass the same ``cache_dtype_str`` and ``packed`` to both.
    packed : bool or None, optional
        As for :func:`get_kv_cache_shape`.

    Returns
    -------
    tuple of int
        Packed ``(N, 2H, T, F)``: ``(0, 1, 2, 3)`` for HND (physical = logical, vLLM's order).
        5-D ``(N, 2, T, H, F)``: ``(0, 1, 3, 2, 4)`` for HND (physical ``[N][2][H][T][F]``),
        ``(0, 1, 2, 3, 4)`` for NHD. Allocating ``shape[order]`` contiguously and permuting by
        the inverse order gives the logical tensor; each order is its own inverse.

    Raises
    ------
    ValueError
        For an unknown layout or dtype, or a packed cache with layout "NHD": vLLM's NHD order
        for it, ``(0, 2, 1, 3)``, stores ``[N][T][2H][F]``, which interleaves K and V heads at
        each position instead of the format's ``[K side | V side]`` page, and the library does
        not take it. Use HND, or the 5-D form (``packed=False``) for an NHD cache.
    """
    _check_layout(layout)
    _check_kv_cache_dtype(cache_dtype_str, "cache_dtype_str")
    if _resolve_packed(packed, cache_dtype_str, layout):
        return (0, 1, 2, 3)
    return (0, 1, 3, 2, 4) if layout == "HND" else (0, 1, 2, 3, 4)


@dataclass(frozen=True)
class KVCacheSpec:
    """Geometry and dtype of one layer's paged KV cache.

    Parameters
    ----------
    block_size : int
        Tokens per page ``T``.
    num_kv_heads : int
        KV heads ``H``.
    head_size : int
        Key head size ``D`` (a multiple of 16 for nvfp4).
    head_size_v : int, optional
        Value head size ``Dv``; defaults to ``head_size``, filled in at construction as vLLM's
        specs do, so ``dataclasses.replace(spec, head_size=...)`` keeps the old ``head_size_v``:
        pass it too.
    cache_dtype : str, optional
        A vLLM ``kv_cache_dtype`` string (default "nvfp4"); "auto" means a 16-bit model dtype.

    Raises
    ------
    ValueError
        For non-positive sizes, an unknown ``cache_dtype``, or an nvfp4 head size that is not
        a multiple of 16 from 16 to :data:`NVFP4_MAX_HEAD_SIZE` (512; what the operations take).
    """

    block_size: int
    num_kv_heads: int
    head_size: int
    head_size_v: Optional[int] = None
    cache_dtype: str = "nvfp4"

    def __post_init__(self):
        # frozen dataclass: normalized values (a NumPy integer becomes a Python int, whose
        # products cannot overflow) and the default are set through object.__setattr__.
        for name in ("block_size", "num_kv_heads", "head_size"):
            object.__setattr__(self, name, _check_positive_int(name, getattr(self, name)))
        if self.head_size_v is None:
            object.__setattr__(self, "head_size_v", self.head_size)
        object.__setattr__(self, "head_size_v", _check_positive_int("head_size_v", self.head_size_v))
        _check_kv_cache_dtype(self.cache_dtype, "cache_dtype")
        if self.cache_dtype in NVFP4_KV_CACHE_DTYPES:
            _check_nvfp4_head_size("head_size", self.head_size)
            _check_nvfp4_head_size("head_size_v", self.head_size_v)

    @property
    def quant_mode(self) -> KVQuantMode:
        """KVQuantMode: quantization selected by ``cache_dtype``; NVFP4 for "nvfp4_4over6" too
        (where vLLM's :func:`get_kv_quant_mode` says NONE: it does not know that string)."""
        if self.is_nvfp4:
            return KVQuantMode.NVFP4
        return get_kv_quant_mode(self.cache_dtype)

    @property
    def is_nvfp4(self) -> bool:
        """bool: whether ``cache_dtype`` is an NVFP4 format."""
        return self.cache_dtype in NVFP4_KV_CACHE_DTYPES

    @property
    def bytes_per_token(self) -> int:
        """int: bytes of one token (K and V, all heads) in one layer.

        nvfp4: ``H*(F(D) + F(Dv))``; fp8: ``H*(D + Dv)``; 16-bit: ``2*H*(D + Dv)``;
        float32: ``4*H*(D + Dv)``.
        """
        h, d, dv = self.num_kv_heads, self.head_size, self.head_size_v
        if self.is_nvfp4:
            return h * (nvfp4_kv_cache_full_dim(d) + nvfp4_kv_cache_full_dim(dv))
        return _ELEMENT_BYTES[self.cache_dtype] * h * (d + dv)

    @property
    def page_size_bytes(self) -> int:
        """int: bytes of one page (block) of one layer, ``block_size * bytes_per_token``.

        18432 for nvfp4 with ``D = 128, H = 8, T = 16`` (bf16: 65536, fp8: 32768).
        """
        return self.block_size * self.bytes_per_token

    def num_blocks_for(self, memory_bytes: int, num_layers: int = 1) -> int:
        """Pages that fit in a memory budget when every layer has its own cache.

        Parameters
        ----------
        memory_bytes : int
            Memory available for the KV cache, in bytes (>= 0).
        num_layers : int, optional
            Layers sharing the budget (default 1).

        Returns
        -------
        int
            ``memory_bytes // (page_size_bytes * num_layers)``.
        """
        # Python ints, as get_kv_cache_shape: no NumPy int32 product to overflow.
        memory_bytes = _check_nonnegative_int("memory_bytes", memory_bytes)
        num_layers = _check_positive_int("num_layers", num_layers)
        return memory_bytes // (self.page_size_bytes * num_layers)

    def max_tokens_for(self, memory_bytes: int, num_layers: int = 1) -> int:
        """Tokens that fit in whole pages of a memory budget.

        Parameters
        ----------
        memory_bytes : int
            Memory available for the KV cache, in bytes (>= 0).
        num_layers : int, optional
            Layers sharing the budget (default 1).

        Returns
        -------
        int
            ``num_blocks_for(memory_bytes, num_layers) * block_size``.
        """
        return self.num_blocks_for(memory_bytes, num_layers) * self.block_size

    def kv_cache_shape(self, num_blocks: int, layout: str = "HND", *,
                       packed: Optional[bool] = None) -> tuple:
        """Logical shape of this cache: :func:`get_kv_cache_shape` with this spec's sizes.

        Packed ``(N, 2H, T, last)`` for nvfp4 by default (``packed=None``), else
        ``(N, 2, T, H, last)``; ``packed=False`` gives the 5-D form for every dtype.

        Raises
        ------
        ValueError
            If ``head_size_v != head_size`` (one tensor has one last dimension), and as
            :func:`get_kv_cache_shape`.
        """
        self._check_single_head_size()
        return get_kv_cache_shape(
            num_blocks, self.block_size, self.num_kv_heads, self.head_size, self.cache_dtype,
            layout, packed=packed,
        )

    def _check_single_head_size(self):
        if self.head_size_v != self.head_size:
            raise ValueError(
                f"head_size_v ({self.head_size_v}) != head_size ({self.head_size}): a single "
                "cache tensor needs one last dimension; allocate the two sides separately"
            )


_BACKENDS = ("auto", "torch", "numpy")


def _check_page_side(spec: KVCacheSpec) -> None:
    """Refuses an NVFP4 geometry whose page side (``block_size * num_kv_heads * F``) is 2 GiB or
    more, which no operation takes (the C ABI's limit: docs/c-api.md); other dtypes pass."""
    if spec.is_nvfp4:
        side = spec.block_size * spec.num_kv_heads * nvfp4_kv_cache_full_dim(max(spec.head_size, spec.head_size_v))
        if side >= 2**31:
            raise ValueError(f"block size {spec.block_size} with {spec.num_kv_heads} KV heads: one side of a page "
                             f"would hold {side} bytes; the kernels address at most 2 GiB - 1")


def allocate_kv_cache(
    spec: KVCacheSpec,
    num_blocks: int,
    *,
    layout: str = "HND",
    device: Any = "cpu",
    backend: str = "auto",
    packed: bool = False,
):
    """Allocate a zero-filled KV cache for one layer: 5-D, or vLLM's packed form.

    Parameters
    ----------
    spec : KVCacheSpec
        Geometry and dtype; ``head_size_v`` must equal ``head_size``.
    num_blocks : int
        Number of pages ``N`` (>= 0).
    layout : {"HND", "NHD"}, optional
        Physical order: HND stores ``[N][2][H][T][F]`` (default), NHD ``[N][2][T][H][F]``.
        A packed cache is HND only (:func:`get_kv_cache_stride_order`).
    device : str or torch.device, optional
        torch device (default "cpu"); the numpy backend accepts only "cpu".
    backend : {"auto", "torch", "numpy"}, optional
        "auto" uses torch when it can be imported, else numpy.
    packed : bool, optional
        False (default): the 5-D ``(N, 2, T, H, last)`` tensor, whose ``[:, 0]`` / ``[:, 1]``
        (or ``unbind(1)``) are the K and V sides. True: vLLM's packed ``(N, 2H, T, last)``
        tensor, contiguous (what vLLM allocates for its NVFP4 path from
        :func:`get_kv_cache_shape` and :func:`get_kv_cache_stride_order` with "HND"); its
        sides for the store are ``kv.transpose(1, 2).split(H, dim=-2)``. Both forms hold the
        same bytes per page, and every operation takes both. The default stays 5-D for the
        callers that index ``[:, 0]``; it is not :func:`get_kv_cache_shape`'s default for nvfp4.

    Returns
    -------
    torch.Tensor or numpy.ndarray
        Shape ``spec.kv_cache_shape(num_blocks, layout, packed=packed)``, strides in the
        requested layout (5-D HND: a permuted view of a contiguous ``(N, 2, H, T, last)``
        buffer; packed: contiguous). dtype: ``uint8`` for nvfp4; for the others the torch
        dtype of :data:`STR_DTYPE_TO_TORCH_DTYPE` ("auto" -> bfloat16; fp8 strings -> uint8, as
        vLLM allocates them). numpy stores fp8 as ``uint8``, float16/half as ``float16``,
        float/float32 as ``float32``, and has no bfloat16.

    Raises
    ------
    ValueError
        For ``head_size_v != head_size``, a bad ``num_blocks``, layout, backend or device, a
        torch backend without torch, bfloat16/"auto" with numpy, ``packed=True`` with
        layout "NHD", or an NVFP4 page side (``block_size * num_kv_heads * F``) of 2 GiB or more,
        which no operation takes.
    """
    if not isinstance(spec, KVCacheSpec):
        raise TypeError(f"spec must be a KVCacheSpec, got {type(spec).__name__}")
    if backend not in _BACKENDS:
        raise ValueError(f"backend: unknown value {backend!r}; expected one of {_BACKENDS}")
    if not isinstance(packed, bool):
        raise ValueError(f"packed must be True or False, got {packed!r}")
    _check_page_side(spec)  # before gigabytes are allocated
    shape = spec.kv_cache_shape(num_blocks, layout, packed=packed)
    if shape[0] * spec.page_size_bytes >= 2**63:
        raise ValueError(f"num_blocks: {num_blocks} pages of {spec.page_size_bytes} bytes received; more bytes "
                         "than a tensor can address")
    order = get_kv_cache_stride_order(layout, spec.cache_dtype, packed=packed)
    physical = tuple(shape[i] for i in order)

    if backend == "auto":
        try:
            import torch  # noqa: F401,PLC0415

            backend = "torch"
        except ImportError:
            backend = "numpy"

    if backend == "torch":
        try:
            import torch  # noqa: PLC0415
        except ImportError as e:
            raise ValueError("backend='torch' needs torch, which is not installed") from e
        key = "bfloat16" if spec.cache_dtype == "auto" else spec.cache_dtype
        dtype = STR_DTYPE_TO_TORCH_DTYPE[key]
        try:  # an unknown device, or CUDA not built or present: probed with an empty tensor
            torch.empty(0, dtype=dtype, device=device)
        except (RuntimeError, AssertionError, TypeError) as e:  # TypeError: no device at all (object())
            raise ValueError(f"device: {device!r}: {e}") from None
        # Out of memory stays torch's error (torch.OutOfMemoryError on a GPU), which an engine
        # sizing its cache catches.
        return torch.zeros(physical, dtype=dtype, device=device).permute(order)

    import numpy as np  # noqa: PLC0415

    if str(device) != "cpu":
        raise ValueError(f"device: the numpy backend only allocates on 'cpu', got {device!r}")
    if spec.cache_dtype in ("auto", "bfloat16"):
        raise ValueError(
            f"cache_dtype {spec.cache_dtype!r}: numpy has no bfloat16; use backend='torch' "
            "or a float16/float32 cache"
        )
    if spec.is_nvfp4 or spec.quant_mode == KVQuantMode.FP8_PER_TENSOR:
        dtype = np.uint8
    elif _ELEMENT_BYTES[spec.cache_dtype] == 2:
        dtype = np.float16
    else:
        dtype = np.float32
    # A zero-page array is cut from a one-page one: NumPy 2 gives a new empty array strides of 0,
    # which would hide the layout; a slice keeps its parent's.
    n = physical[0]
    return np.zeros((max(n, 1),) + tuple(physical[1:]), dtype=dtype)[:n].transpose(order)
