"""Global scales: the amax of a tensor, the conversions between scale conventions, and a tracker
that gathers per-layer K and V amax over calibration batches.

Conventions (one number per tensor, three ways to write it; ``amax = max |x|``):

=====================  =====================  ============================================
name                   value                  who uses it
=====================  =====================  ============================================
decode scale           ``amax / 448``         nvfp4kv's ``k_scale`` / ``v_scale``, vLLM's
                                              ``layer._k_scale``, vLLM checkpoints' and recent
                                              ModelOpt ones' ``k_scale`` / ``v_scale`` (older
                                              ModelOpt NVFP4-KV exports: the x6 form)
the x6 form            ``amax / 2688``        NVFP4 weight checkpoints' ``weight_scale_2``
                       ``= decode / 6``       (decode scale with the E2M1 max folded in)
encode scale           ``2688 / amax``        the reciprocal of the x6 form: what a quantizer
                       ``= 6 / decode``       multiplies by (TensorRT-LLM's activation
                                              ``input_scale``)
=====================  =====================  ============================================

448 is the largest E4M3 value (the per-group scale byte), 6 the largest E2M1 value (the 4-bit
code), 2688 = 448 * 6. The conversions below work elementwise on Python floats, numpy arrays and
torch or cupy tensors (the result has the input's type, device and dtype; tensors are never read
on the host), and validate nothing: a zero gives inf or a ZeroDivisionError, as the arithmetic
does. A global scale passed to :func:`nvfp4kv.store` must be finite and > 0.
"""

from __future__ import annotations

import contextlib
import numbers
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

from . import _C
from .api import _framework, _without_data, _zeros
from .views import imported

__all__ = ["E2M1_MAX", "E4M3_MAX", "amax", "decode_scale", "x6_from_decode", "decode_from_x6", "encode_from_decode",
           "decode_from_encode", "ScaleTracker"]

E2M1_MAX = 6.0    # the largest E2M1 (FP4) magnitude
E4M3_MAX = 448.0  # the largest E4M3 (scale byte) magnitude
# The least double that float32 rounds to inf: FLT_MAX (2^128 - 2^104) plus half its ulp (a tie
# rounds to even, away from FLT_MAX's odd mantissa). Below it a double rounds to at most FLT_MAX
# (review: "3.4028235e38", FLT_MAX as printed, was refused).
_FLOAT32_TO_INF = 2.0**128 - 2.0**103


# ---- amax ---------------------------------------------------------------------------------------

def _amax_out(x: Any, out: Any, accumulate: Any) -> Any:
    """amax's arguments checked, and its output: the one given, else a new (1,) float32 array in
    x's framework and device (also what the traced amax allocates: nvfp4kv.ops)."""
    if not isinstance(accumulate, bool):
        kind = type(accumulate)
        raise TypeError(f"accumulate: {accumulate!r} ({kind.__module__}.{kind.__name__}) received; expected "
                        "True or False (a Python bool)")
    if x is None:
        raise TypeError("x: None received; expected an array supporting DLPack (torch, numpy, cupy, ...)")
    if out is None:
        if accumulate:
            raise ValueError("out: None with accumulate=True; pass the amax to accumulate into")
        out = _zeros(x, (1,), "float32")
    return out


def amax(x: Any, out: Any = None, *, accumulate: bool = False, stream: Any = None) -> Any:
    """``max |x|`` into a 1-element float32 array on x's device, without a host synchronization.

    Parameters
    ----------
    x : array, float32, float16 or bfloat16, any shape and strides (torch, numpy, cupy).
    out : 1-element float32 array on x's device, optional
        Written in place and returned; allocated (shape ``(1,)``, x's framework) when None.
    accumulate : bool
        False: ``out = max |x|`` (0 for an empty x). True: ``out = max(out, max |x|)`` (an empty
        x leaves it unchanged).
    stream : optional
        CUDA stream; default: the current stream of x's framework.

    The result is exact and the same on the CPU and the GPU bit for bit. NaN is sticky: any NaN
    element makes it NaN (a scale computed from it is then rejected by :func:`nvfp4kv.store` on the
    CPU; check it if the data may hold NaN). With accumulate, an ``out`` whose sign bit is set (a
    negative value, or a negative NaN such as x86's ``inf - inf``) counts as below every ``|x|``.
    On CUDA this is one kernel (two without accumulate) on the stream, safe to capture in a CUDA
    graph.
    """
    out = _amax_out(x, out, accumulate)
    try:
        _C.amax(x, out, 1 if accumulate else 0, stream)
    except ValueError:
        if not _without_data(x, out):  # meta or fake tensors: the op's fake implementation
            raise
        from . import ops

        ops.amax(x, out, accumulate)
    return out


# ---- conversions ----------------------------------------------------------------------------------

def decode_scale(amax: Any, margin: float = 1.0) -> Any:
    """The decode global scale ``amax * margin / 448`` (nvfp4kv's ``k_scale`` / ``v_scale``, and the
    ``k_scale`` / ``v_scale`` of vLLM and ModelOpt checkpoints).

    ``margin`` matters little: margin 1 already keeps values up to ``6 * 448 * scale`` (6 times the
    calibrated amax), a margin from 1/6 to 1 clips nothing of the calibration data (1/6 leaves no
    headroom for served data beyond it), and a power of two reads back the same
    values as 1 unless a group's scale leaves E4M3's normal range (docs/scales.md). Give a float32 amax: the
    result has amax's dtype, and the store takes float32 scales.
    """
    return amax * _in_dtype_of(margin, amax) / _like(E4M3_MAX, amax)


def _like(c: float, x: Any) -> Any:
    """The constant `c` as a scalar of a floating numpy `x`'s dtype, else as given. NumPy 1.x
    widens a float32 scalar or 0-d array times a Python float to float64 (NumPy 2 and torch keep
    float32), which the store then refuses as a scale array (review: numpy 1.26)."""
    dtype = getattr(x, "dtype", None)
    if _framework(x) == "numpy" and getattr(dtype, "kind", "") == "f":
        return dtype.type(c)
    return c


def _in_dtype_of(margin: Any, amax: Any) -> Any:
    """margin as a Python float, or an array margin in the dtype of an array amax of its framework:
    the result keeps amax's dtype (a float64 margin would widen a float32 amax, which the store
    then refuses as a scale)."""
    if isinstance(margin, numbers.Real):
        return _like(float(margin), amax)
    dtype, fw = getattr(amax, "dtype", None), _framework(amax)
    if fw == "torch":
        import torch

        if not dtype.is_floating_point:  # an integer amax: the product takes the default float (review:
            dtype = None                 # a margin of 1.5 cast to int64 read as 1)
        return margin.to(dtype) if isinstance(margin, torch.Tensor) else torch.as_tensor(
            margin, dtype=dtype, device=amax.device)
    mfw = _framework(margin)
    if "other" not in (fw, mfw) and mfw != fw:  # numpy * torch: a bare TypeError (review)
        raise TypeError(f"margin: a {mfw} array with a {fw} amax; give a float, or both in one framework")
    if dtype is not None and getattr(dtype, "kind", "") == "f":
        return margin.astype(dtype)
    return margin


def x6_from_decode(s: Any) -> Any:
    """The x6 form ``s / 6`` of a decode scale ``s`` (``amax / 2688``: a decode scale with the E2M1
    max 6 folded in, as NVFP4 weight checkpoints' ``weight_scale_2``)."""
    return s / _like(E2M1_MAX, s)


def decode_from_x6(s: Any) -> Any:
    """The decode scale ``6 s`` of a scale ``s`` in the x6 form (``amax / 2688`` -> ``amax / 448``)."""
    return s * _like(E2M1_MAX, s)


def encode_from_decode(s: Any) -> Any:
    """The encode scale ``6 / s`` of a decode scale ``s`` (``448 * 6 / amax``: what a quantizer
    multiplies values by, the reciprocal of the x6 form)."""
    return _like(E2M1_MAX, s) / s


def decode_from_encode(e: Any) -> Any:
    """The decode scale ``6 / e`` of an encode scale ``e`` (``448 * 6 / amax`` -> ``amax / 448``)."""
    return _like(E2M1_MAX, e) / e


# ---- the tracker ----------------------------------------------------------------------------------

def _capturing(like: Any) -> bool:
    torch = imported("torch")
    if torch is None or _framework(like) != "torch" or not like.is_cuda:
        return False
    return bool(torch.cuda.is_current_stream_capturing())


class ScaleTracker:
    """Per-layer amax of K and V over many batches, kept on the tensors' device.

    ``layers``: the number of layers (layers are then 0 .. n-1), or a sequence of layer names
    (layers are then those names or their positions). ``device``: where to keep the amax, as a
    torch device (``"cuda:0"``, ``torch.device("cpu")``; needs torch); None: on the device and in
    the framework (torch, cupy, numpy) of the first :meth:`update`'s key.

    :meth:`update` folds ``max |key|`` and ``max |value|`` into the layer's running maxima through
    ``nvfp4kv_amax`` (accumulating, on the caller's stream): no host synchronization, no
    allocation after the first use, fixed addresses, so it can be captured in a CUDA graph (allocate
    first: pass ``device`` or run one update before the capture; allocate first as well before
    updating from several threads at once, since two first updates would each allocate).
    :meth:`k_scales` and :meth:`v_scales` give the decode scales ``amax * margin / 448``,
    computed on the device. A NaN in the data makes that layer's amax NaN (sticky until
    :meth:`reset`).
    """

    def __init__(self, layers: Union[int, Sequence[str]], device: Any = None):
        if isinstance(layers, numbers.Integral) and not isinstance(layers, bool):
            layers = int(layers)  # a NumPy integer counts too
        if isinstance(layers, bool) or not isinstance(layers, (int, list, tuple)):
            raise TypeError(f"layers: {type(layers).__name__} received; expected a number of layers or a "
                            "list of layer names")
        if isinstance(layers, int):
            if layers <= 0:
                raise ValueError(f"layers: {layers} received; expected at least one layer")
            self._names: Optional[List[str]] = None
            self._n = layers
        else:
            # Names are strings: an int stays a position, so [0, 2, 4] as names would send layer
            # 2's update to position 2 (name "4").
            if not all(isinstance(n, str) for n in layers):
                raise TypeError("layers: expected a number of layers or a list of layer names (str); "
                                f"received {[type(n).__name__ for n in layers]}")
            names = list(layers)
            if not names or len(set(names)) != len(names):
                raise ValueError("layers: expected a non-empty list of distinct layer names")
            self._names = names
            self._n = len(names)
        self._index = {n: i for i, n in enumerate(self._names or [])}
        self._amax: Any = None  # (num_layers, 2) float32: K amax, V amax
        self._k: List[Any] = []  # 1-element views, one per layer (fixed addresses)
        self._v: List[Any] = []
        if device is not None:
            try:
                import torch
            except ImportError:
                raise ModuleNotFoundError("ScaleTracker: device= allocates torch tensors and needs torch "
                                          "(pip install torch); without it leave device None: the first "
                                          "update allocates on its input's framework") from None
            try:
                like = torch.empty(0, device=torch.device(device))
            except (RuntimeError, AssertionError, TypeError) as e:  # unknown, no CUDA, not a device
                raise ValueError(f"ScaleTracker: device {device!r}: {' '.join(str(e).split())}") from None
            if like.device.type == "meta":  # no memory: every update would be refused (review)
                raise ValueError(f"ScaleTracker: device {device!r}: a meta tensor holds no amax; give the "
                                 "device the K/V tensors are on")
            self._allocate(like)

    def _allocate(self, like: Any) -> None:
        if _capturing(like):
            raise RuntimeError("ScaleTracker: first update inside a CUDA graph capture; allocate the tracker "
                               "before capturing (pass device=..., or run one update outside the graph)")
        self._amax = _zeros(like, (self._n, 2), "float32")
        self._k = [self._amax[i, 0:1] for i in range(self._n)]
        self._v = [self._amax[i, 1:2] for i in range(self._n)]

    @property
    def num_layers(self) -> int:
        return self._n

    @property
    def layer_names(self) -> Optional[List[str]]:
        return None if self._names is None else list(self._names)

    def _layer(self, layer: Any) -> int:
        if isinstance(layer, str):
            if layer in self._index:
                return self._index[layer]
            known = "layers are numbered" if self._names is None else f"known layers: {self._names}"
            raise KeyError(f"layer: {layer!r} is not a layer of this tracker ({known})")
        if isinstance(layer, numbers.Integral) and not isinstance(layer, bool):
            # A Python or NumPy int, or torch.compile's symbolic int, on which hasattr() is refused
            # (review, 2026-12-07): each layer's value then compiles once, as a constant would.
            i = int(layer)
        elif (isinstance(layer, bool) or str(getattr(layer, "dtype", "")).rsplit(".", 1)[-1] == "bool"
              or not hasattr(layer, "__index__")):  # a 0-d bool array or tensor is a mistake too
            raise TypeError(f"layer: {type(layer).__name__} received; expected a layer index or name")
        else:
            i = layer.__index__()  # a 0-d integer array or tensor
        if not 0 <= i < self._n:
            raise IndexError(f"layer: {i} is out of range; this tracker has {self._n} layers (0 to {self._n - 1})")
        return i

    def update(self, layer: Any, key: Any, value: Any = None, *, stream: Any = None) -> None:
        """Fold ``max |key|`` and ``max |value|`` (any shapes and strides; float32, float16 or bfloat16;
        value may be None) into layer ``layer``'s running K and V amax, on the tensors' device and the
        current stream of their framework (or ``stream``). No host synchronization. The key is folded
        before the value is checked: a call whose value is refused has folded its key (a maximum,
        so repeating the call once the value is fixed gives the same state)."""
        i = self._layer(layer)
        if key is None and value is None:  # nothing to fold, nor to allocate storage like
            return
        fresh = self._amax is None
        if fresh:  # like the first array given; given back if the call is refused before a fold
            self._allocate(key if key is not None else value)
        folded = False
        for side, x, store in (("key", key, self._k), ("value", value, self._v)):
            if x is None:
                continue
            try:
                amax(x, store[i], accumulate=True, stream=stream)  # the torch op when traced
                folded = True
            except (ValueError, TypeError) as e:
                where = f"the tracker's amax is on {self.device}"
                if fresh and not folded:
                    self._amax, self._k, self._v = None, [], []
                    where = "the tracker has no storage yet: the first update allocates it like its array"
                raise type(e)(f"ScaleTracker.update(layer {layer!r}) {side}: {e} ({where})") from None

    def _need(self) -> Any:
        if self._amax is None:
            raise RuntimeError("ScaleTracker: no amax yet (no update, and no device given at construction)")
        return self._amax

    @property
    def device(self) -> Any:
        """The device of the amax (a torch.device, a cupy Device, or "cpu" for numpy); None before
        the first use."""
        if self._amax is None:
            return None
        return getattr(self._amax, "device", "cpu")

    def k_amax(self) -> Any:
        """The per-layer K amax, shape ``(num_layers,)`` float32: a view of the tracker's storage."""
        return self._need()[:, 0]

    def v_amax(self) -> Any:
        """The per-layer V amax, shape ``(num_layers,)`` float32: a view of the tracker's storage."""
        return self._need()[:, 1]

    def k_scales(self, margin: float = 1.0) -> Any:
        """Per-layer K decode scales ``amax * margin / 448``, shape ``(num_layers,)`` float32, a new
        array on the tracker's device (no host synchronization). ``k_scales()[i:i+1]`` is layer i's
        ``k_scale`` for :func:`nvfp4kv.store`. A layer never updated has amax 0 and scale 0, which
        the store rejects."""
        return decode_scale(self.k_amax(), margin)

    def v_scales(self, margin: float = 1.0) -> Any:
        """Per-layer V decode scales ``amax * margin / 448``; see :meth:`k_scales`."""
        return decode_scale(self.v_amax(), margin)

    def _writing(self) -> Any:
        """The context of a write into the storage by a torch op: inference mode where the storage
        was made in it (the first update of an engine's forward pass), since torch refuses such an
        in-place update outside the mode, and only after it has written (review: reset() zeroed
        and raised; load_state_dict loaded K, raised, and left V)."""
        if _framework(self._amax) == "torch" and self._amax.is_inference():
            import torch

            return torch.inference_mode()
        return contextlib.nullcontext()

    def reset(self) -> None:
        """Zero every amax in place (the addresses stay: a captured graph keeps working)."""
        if self._amax is None:
            return
        if _framework(self._amax) == "torch":
            with self._writing():
                self._amax.zero_()
        else:
            self._amax[...] = 0

    def state_dict(self) -> Dict[str, Any]:
        """``{"layers": names or count, "k_amax": ..., "v_amax": ...}`` (copies, on the tracker's device)."""
        a = self._need()
        return {"layers": self.layer_names if self._names is not None else self._n,
                "k_amax": a[:, 0].copy() if _framework(a) != "torch" else a[:, 0].clone(),
                "v_amax": a[:, 1].copy() if _framework(a) != "torch" else a[:, 1].clone()}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Copy amax from :meth:`state_dict` into the tracker's storage (allocated like ``state["k_amax"]``
        if the tracker has none yet). The layers must match."""
        if not isinstance(state, Mapping):
            raise TypeError(f"state_dict: a {type(state).__name__} received; expected the dict state_dict() gives")
        for key in ("layers", "k_amax", "v_amax"):
            if key not in state:
                raise KeyError(f"state_dict: no {key!r} entry; expected the dict state_dict() gives "
                               "({'layers', 'k_amax', 'v_amax'})")
        layers = state["layers"]
        if type(layers).__module__ == "numpy" and getattr(layers, "dtype", None) is not None:
            # np.savez / np.load give the count back as a 0-d integer array and the names as a
            # string array (an integrator's review: its own state_dict was refused)
            kind = layers.dtype.kind
            if layers.ndim == 0 and kind in "iu":
                layers = int(layers)
            elif layers.ndim == 1 and kind == "U":
                layers = [str(x) for x in layers]
        if isinstance(layers, tuple):
            layers = list(layers)
        elif isinstance(layers, numbers.Integral) and not isinstance(layers, bool):
            layers = int(layers)  # numpy integers too, as the constructor takes them
        mine = self.layer_names if self._names is not None else self._n
        if type(layers) is not type(mine) or layers != mine:
            raise ValueError(f"state_dict: layers {layers!r} do not match this tracker's {mine!r}")
        k, v = state["k_amax"], state["v_amax"]
        # Both checked before anything is copied: float arrays of one amax per layer, none negative
        # (a NaN is an amax: sticky, as update leaves it).
        for name, x in (("k_amax", k), ("v_amax", v)):
            if not hasattr(x, "shape") or not hasattr(x, "dtype"):
                raise TypeError(f"state_dict: {name} is a {type(x).__name__}; expected an array (torch, numpy "
                                "or cupy) of one amax per layer")
            if tuple(x.shape) != (self._n,):
                raise ValueError(f"state_dict: {name} of shape {getattr(x, 'shape', None)}; expected ({self._n},)")
            dtype = getattr(x, "dtype", None)
            floating = getattr(dtype, "is_floating_point", None)
            if floating is None:
                floating = getattr(dtype, "kind", "") == "f"
            if not floating:
                raise TypeError(f"state_dict: {name} of dtype {dtype}; expected a float array")
            if getattr(getattr(x, "device", None), "type", None) == "meta":  # no values to read
                raise ValueError(f"state_dict: {name} is a meta tensor, which holds no amax; load the state "
                                 "onto a real device (torch.load's map_location)")
            if bool((x < 0).any()):
                raise ValueError(f"state_dict: {name} has a negative amax; an amax is max |x| >= 0")
            # float64: would become inf. Narrower floats cannot hold such a value, and NumPy would
            # cast the bound to float16 for the comparison (an overflow warning; found by review).
            wide = getattr(dtype, "itemsize", 8) > 4
            if wide and bool(((x >= _FLOAT32_TO_INF) & (x != float("inf"))).any()):
                raise ValueError(f"state_dict: {name} has a finite amax past the float32 range; the tracker "
                                 "keeps float32")
        # Both converted (float32, the storage's framework and device) before either is copied, so a
        # refused conversion changes nothing; abs() clears a NaN's sign, which the amax's max would
        # read as below every value (x86's default NaN is negative): NaN stays sticky.
        like = self._amax if self._amax is not None else k
        k, v = (abs(self._converted(name, x, like)) for name, x in (("k_amax", k), ("v_amax", v)))
        if _framework(k) == "torch":  # a state that requires grad must not pull the tracker into
            k, v = k.detach(), v.detach()  # autograd (its amax op refuses such a tensor; review)
        if self._amax is None:
            self._allocate(k)
        a = self._amax
        if _framework(a) == "torch":
            with self._writing():
                a[:, 0].copy_(k)
                a[:, 1].copy_(v)
        else:
            a[:, 0] = k
            a[:, 1] = v

    @staticmethod
    def _converted(name: str, x: Any, like: Any) -> Any:
        """x as a float32 array of like's framework and device."""
        try:
            fw = _framework(like)
            if fw == "torch":
                import torch

                return torch.as_tensor(x).to(device=like.device, dtype=torch.float32)
            if fw == "cupy":
                import cupy

                return cupy.asarray(x, dtype=cupy.float32)
            import numpy

            return numpy.asarray(x, dtype=numpy.float32)
        except (TypeError, ValueError, RuntimeError) as e:
            raise TypeError(f"state_dict: {name} cannot be read as float32 here ({e})") from None

    def __repr__(self) -> str:
        layers = self._names if self._names is not None else self._n
        return f"ScaleTracker(layers={layers!r}, device={self.device!r})"
