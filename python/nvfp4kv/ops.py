"""nvfp4kv's operations as torch custom ops: ``torch.ops.nvfp4kv.*``.

Registered when this module is imported, which ``import nvfp4kv`` does by itself where torch is
already imported, and otherwise when torch is imported (:mod:`nvfp4kv._torch_hook`; torch stays
optional). Each op declares the tensors it writes (``Tensor(a!)``) and bumps their version counters,
has a fake implementation (shapes only, no data: under ``FakeTensorMode`` and while
``torch.compile`` traces, no pointer is ever read), and runs the
same C ABI call as the Python API on the current torch stream. ``nvfp4kv.store``,
``reshape_and_cache_flash``, ``dequantize``, ``gather_dequant``, ``decode_attention`` and ``amax`` route through these ops when
they are traced or given tensors without data (``nvfp4kv.api._without_data``); eager calls on real
tensors go straight to the extension, so the ops cost the decode-time store nothing.

Global scales are tensors in the schemas (a float given to the Python API inside a compiled
region becomes a 0-d float32 CPU tensor, read on the host at each call).
"""

from __future__ import annotations

import numbers
import sys
from typing import Optional

import torch

from . import _C, _torch_hook

__all__ = ["store", "reshape_and_cache_flash", "dequantize", "gather_dequant", "decode_attention", "amax",
           "scale_tensor"]

_NS = "nvfp4kv"

_SCHEMAS = {
    "store": (
        "(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping, Tensor k_scale, "
        "Tensor v_scale, Tensor(b!)? value_cache=None, str recipe='nvfp4', str scale_layout='vllm', "
        "Tensor(c!)? workspace=None) -> ()"
    ),
    "reshape_and_cache_flash": (
        "(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slot_mapping, str kv_cache_dtype, Tensor k_scale, Tensor v_scale, "
        "str scale_layout='vllm', Tensor(c!)? workspace=None) -> ()"
    ),
    "dequantize": (
        "(Tensor kv_cache, Tensor k_scale, Tensor v_scale, Tensor(a!) key_out, Tensor(b!) value_out, "
        "Tensor? value_cache=None, Tensor? pages=None, str scale_layout='vllm') -> ()"
    ),
    "gather_dequant": (
        "(Tensor kv_cache, Tensor block_table, Tensor seq_lens, Tensor cu_seqlens, "
        "Tensor k_scale, Tensor v_scale, Tensor(a!) key_out, Tensor(b!) value_out, Tensor? value_cache=None, "
        "str scale_layout='vllm') -> ()"
    ),
    "decode_attention": (
        "(Tensor query, Tensor kv_cache, Tensor block_table, Tensor seq_lens, Tensor k_scale, Tensor v_scale, "
        "Tensor(a!) out, float sm_scale, Tensor(b!)? lse=None, Tensor? value_cache=None, str scale_layout='vllm', "
        "float logits_soft_cap=0.0, int window_left=-1, int q_len=1, Tensor(c!)? workspace=None) -> ()"
    ),
    "amax": "(Tensor x, Tensor(a!) out, bool accumulate=False) -> ()",
}


def _not_a_scale(what: str) -> TypeError:
    return TypeError(f"k_scale/v_scale: {what} received; expected a float or a 1-element float32 tensor")


def scale_tensor(x) -> torch.Tensor:
    """A global scale as the ops take it: tensors as they are, numbers as 0-d float32 CPU tensors.
    What the eager API refuses is refused here too (api._scale): a bool of any type, and what is
    not a real number (a string, a numpy bool or string scalar: found by review, where a compiled
    call stored with np.True_ as 1.0). api._scale itself does not trace (numpy dtypes)."""
    if isinstance(x, torch.Tensor):
        return x
    if x is None:
        raise _api._none_scale("k_scale/v_scale")
    if isinstance(x, bool):
        raise _not_a_scale("a bool")
    if isinstance(x, (str, bytes)):
        raise _not_a_scale(f"a {type(x).__name__}")
    if not isinstance(x, numbers.Real):
        # numpy scalars and 0-d arrays (which Dynamo traces as arrays: their dtype only through torch)
        t = torch.as_tensor(x)
        if t.dtype == torch.bool:
            raise _not_a_scale("a bool")
        if t.dim() != 0 or t.is_complex():
            raise _not_a_scale(f"a {type(x).__name__} of dtype {t.dtype} and {t.dim()} dimensions")
        return torch.zeros((), dtype=torch.float32) + t.to(torch.float32)
    if isinstance(x, int) and abs(x) >= 2**1024:  # float(x) would raise OverflowError, traced an internal error
        raise ValueError("k_scale/v_scale: a number past the float range received; a global scale must be a "
                         "finite float32 > 0")
    # Not torch.tensor(x): under aot_eager and inductor its value is specialised back to a
    # constant, a recompile per value; a sum with x stays symbolic after the second value.
    return torch.zeros((), dtype=torch.float32) + float(x)


# The binding's origin rule without its warning about sides whose origin cannot tell (ext.cpp,
# orient_sides): inductor hands the ops views rebuilt from storage, without their origin, after
# the traced Python call has oriented the sides (ops._sides, kv_layout included).
_QUIET_ORIGIN = -2


def _store_impl(key, value, kv_cache, slot_mapping, k_scale, v_scale, value_cache=None, recipe="nvfp4",
                scale_layout="vllm", workspace=None):
    _C.store(key, value, kv_cache, slot_mapping, k_scale, v_scale, value_cache, recipe, scale_layout, None,
             workspace, _QUIET_ORIGIN)


def _reshape_and_cache_flash_impl(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale,
                                  v_scale, scale_layout="vllm", workspace=None):
    from .api import _check_flash_args

    _check_flash_args(kv_cache_dtype, value_cache)
    _C.store(key, value, key_cache, slot_mapping, k_scale, v_scale, value_cache, kv_cache_dtype, scale_layout, None,
             workspace, _QUIET_ORIGIN)


def _dequantize_impl(kv_cache, k_scale, v_scale, key_out, value_out, value_cache=None, pages=None,
                     scale_layout="vllm"):
    _C.dequantize(kv_cache, value_cache, pages, k_scale, v_scale, scale_layout, key_out, value_out, None,
                  _QUIET_ORIGIN)


def _gather_dequant_impl(kv_cache, block_table, seq_lens, cu_seqlens, k_scale, v_scale, key_out, value_out,
                         value_cache=None, scale_layout="vllm"):
    _C.gather_dequant(kv_cache, value_cache, block_table, seq_lens, cu_seqlens, k_scale, v_scale, scale_layout,
                      key_out, value_out, None, _QUIET_ORIGIN)


def _decode_attention_impl(query, kv_cache, block_table, seq_lens, k_scale, v_scale, out, sm_scale, lse=None,
                           value_cache=None, scale_layout="vllm", logits_soft_cap=0.0, window_left=-1, q_len=1,
                           workspace=None):
    _C.decode_attention(query, kv_cache, value_cache, block_table, seq_lens, k_scale, v_scale, scale_layout, q_len,
                        sm_scale, logits_soft_cap, window_left, out, lse, workspace, None, _QUIET_ORIGIN)


def _amax_impl(x, out, accumulate=False):
    _C.amax(x, out, 1 if accumulate else 0, None)


def _written(op):
    """(position, name) of each tensor argument the op writes (``Tensor(a!)`` in its schema)."""
    args = op._schema.arguments
    return [(i, a.name) for i, a in enumerate(args) if a.alias_info is not None and a.alias_info.is_write]


def _offset_is_safe(t: torch.Tensor) -> bool:
    """Whether inductor hands the op `t` where it lies: its storage offset is a number, or the
    offset of a graph input as that input came (one symbol whose source is the input's
    storage_offset(); measured correct). An offset computed from a dynamic size (`out_all[l]`,
    or a view taken inside the graph of an input at a dynamic offset) is not: torch 2.13's
    inductor passes such a view at offset 0 of its base (pytorch#198068). Where torch's
    internals do not answer, not safe."""
    from torch.fx.experimental.symbolic_shapes import is_concrete_int  # loaded by then (fake tensors)

    off = t.storage_offset()
    if is_concrete_int(off):
        return True
    try:
        expr = off.node.expr
        sources = off.node.shape_env.var_to_sources.get(expr, []) if expr.is_Symbol else []
        names = [s.name() if callable(s.name) else s.name for s in sources]  # a property in torch 2.13
        return any(n.endswith(".storage_offset()") for n in names)
    except Exception:  # noqa: BLE001  (torch internals of another version)
        return False


def _fake(op):
    """The op's fake implementation: the ops only write into tensors they were given, so it returns
    nothing, but it refuses a tensor to write that inductor would hand the op at another place
    (_offset_is_safe): the op would write over the start of the view's base, silently. That
    happens under dynamic=True and also under torch's default automatic dynamic shapes once a
    size has changed between calls (a per-layer output `out_all[l]` of a batch that grew: found
    by review)."""
    written = _written(op)
    op_name = op._schema.name.split("::")[-1]

    def fake(*given, **named) -> None:
        for i, name in written:
            t = given[i] if i < len(given) else named.get(name)
            if isinstance(t, torch.Tensor) and not _offset_is_safe(t):
                raise ValueError(
                    f"nvfp4kv.{op_name}: {name} is a view at storage offset {t.storage_offset()}, which depends "
                    "on a dynamic size; torch.compile's inductor passes such a view to a custom op at offset 0 "
                    "(pytorch#198068), so the op would write over the start of its base. Pass a whole tensor, "
                    "or a view whose offset does not depend on a dynamic size (one output tensor per layer, "
                    "or torch._dynamo.mark_static on that dimension)")
        return None

    return fake


_IMPLS = {
    "store": _store_impl,
    "reshape_and_cache_flash": _reshape_and_cache_flash_impl,
    "dequantize": _dequantize_impl,
    "gather_dequant": _gather_dequant_impl,
    "decode_attention": _decode_attention_impl,
    "amax": _amax_impl,
}


def _register() -> None:
    if hasattr(torch.ops, _NS) and hasattr(getattr(torch.ops, _NS), "store"):
        try:  # registered already (this module imported twice under another name)
            getattr(torch.ops, _NS).store.default
            return
        except AttributeError:
            pass
    for name, schema in _SCHEMAS.items():
        qualname = f"{_NS}::{name}"
        torch.library.define(qualname, schema)
        # One Python implementation for every device: the C ABI dispatches on the tensors' device.
        torch.library.impl(qualname, "CompositeExplicitAutograd")(_IMPLS[name])
        op = getattr(getattr(torch.ops, _NS), name).default
        torch.library.register_fake(qualname)(_fake(op))
        _LIB.impl(name, _version_bump(op), "ADInplaceOrView", with_keyset=True)


def _version_bump(op):
    """The op's ADInplaceOrView kernel: bumps the version counter of every tensor it writes once
    the call has succeeded, as torch's in-place ops do, so autograd refuses a backward through a
    tensor the op overwrote after it was saved (the C ABI writes through pointers torch does not
    see). The ops have no gradient, so with grad mode on a tensor to be written that requires grad
    is refused before anything is written: autograd would keep its old history (a wrong gradient,
    found by review); under torch.no_grad() it is written, as torch's in-place ops allow. Not
    reached under inference_mode, whose tensors have no version counter."""
    written = _written(op)
    below = torch._C._after_ADInplaceOrView_keyset
    op_name = op._schema.name

    def kernel(keyset, *given, **named):
        tensors = []
        for i, name in written:
            t = given[i] if i < len(given) else named.get(name)
            if isinstance(t, torch.Tensor):
                if t.requires_grad and torch.is_grad_enabled():
                    raise RuntimeError(
                        f"{op_name}: {name} requires grad; the op has no gradient, so autograd would not "
                        "see it overwritten: write into a tensor that does not require grad, or call the "
                        "op under torch.no_grad()")
                tensors.append(t)
        result = op.redispatch(keyset & below, *given, **named)
        for t in tensors:
            torch.autograd.graph.increment_version(t)
        return result

    return kernel


_LIB = torch.library.Library(_NS, "FRAGMENT")  # holds the ADInplaceOrView kernels (alive with the module)
_register()

store = torch.ops.nvfp4kv.store.default
reshape_and_cache_flash = torch.ops.nvfp4kv.reshape_and_cache_flash.default
dequantize = torch.ops.nvfp4kv.dequantize.default
gather_dequant = torch.ops.nvfp4kv.gather_dequant.default
decode_attention = torch.ops.nvfp4kv.decode_attention.default
amax = torch.ops.nvfp4kv.amax.default


# ---- The Python API under torch.compile ----------------------------------------------------------
# Dynamo traces these in place of nvfp4kv.store / reshape_and_cache_flash / dequantize /
# gather_dequant / decode_attention / amax (same signatures), so compiled code can call the API as
# eager code does; eager calls never see them. Inside a compiled region the ops run on torch's
# current stream. The substitutions are made once torch._dynamo is imported (_substitute, at the
# end of this module).
from . import api as _api  # noqa: E402
from . import scales as _scales  # noqa: E402


_SUBSTITUTES = []  # (the API's function, what Dynamo traces in its place)


def _traced_as(original):
    def keep(traced):
        _SUBSTITUTES.append((original, traced))
        return traced

    return keep


def _substitute() -> None:
    """Dynamo's substitutions, made when torch._dynamo is imported (at the latest by the first
    torch.compile), not here: that import takes about a second (design notes: "torch.compile:
    the API traced as custom ops"). Each on its own; those that fail are named in one error."""
    substitute = getattr(sys.modules["torch._dynamo"], "substitute_in_graph", None)
    if substitute is None:
        raise RuntimeError("torch._dynamo has no substitute_in_graph")
    failed = []
    for original, traced in _SUBSTITUTES:
        try:
            substitute(original)(traced)
        except Exception as e:  # noqa: BLE001  (reported below, with the others)
            failed.append(f"{original.__name__}: {type(e).__name__}: {e}")
    if failed:
        raise RuntimeError("; ".join(failed))


def _no_stream(stream) -> None:
    if stream is not None:
        raise ValueError("stream: under torch.compile the ops run on torch's current stream; pass stream=None")


def _sides(kv_cache, value_cache, kv_layout):
    """The sides as the C ABI reads them (kv_layout: api._oriented), and split halves of a packed
    cache as the transposed sides, decided while tracing: inductor hands the ops views rebuilt
    from storage, whose _base no longer names the packed cache (the extension's orient_sides would
    then read them as NHD sides)."""
    kv_cache, value_cache = _api._oriented(kv_cache, value_cache, kv_layout)
    halves = _api._split_halves(kv_cache, value_cache)
    return halves if halves is not None else (kv_cache, value_cache)


@_traced_as(_api.store)
def _store_traced(key, value, kv_cache, slot_mapping, k_scale=1.0, v_scale=1.0, *, value_cache=None,
                  recipe="nvfp4", scale_layout="vllm", kv_layout=None, stream=None, workspace=None):
    _no_stream(stream)
    kv_cache, value_cache = _sides(kv_cache, value_cache, kv_layout)
    store(key, value, kv_cache, slot_mapping, scale_tensor(k_scale), scale_tensor(v_scale), value_cache, recipe,
          scale_layout, workspace)


@_traced_as(_api.reshape_and_cache_flash)
def _reshape_and_cache_flash_traced(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale,
                                    v_scale, *, scale_layout="vllm", kv_layout=None, stream=None, workspace=None):
    _no_stream(stream)
    key_cache, value_cache = _sides(key_cache, value_cache, kv_layout)
    reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, scale_tensor(k_scale),
                            scale_tensor(v_scale), scale_layout, workspace)


@_traced_as(_api.dequantize)
def _dequantize_traced(kv_cache, k_scale=1.0, v_scale=1.0, *, value_cache=None, pages=None, dtype=None,
                       scale_layout="vllm", kv_layout=None, key_out=None, value_out=None, stream=None):
    _no_stream(stream)
    kv_cache, value_cache = _sides(kv_cache, value_cache, kv_layout)
    key_out, value_out = _api._dequantize_outputs(kv_cache, value_cache, dtype, key_out, value_out, pages=pages,
                                                  checked=False)  # the op's own check raises at run time
    dequantize(kv_cache, scale_tensor(k_scale), scale_tensor(v_scale), key_out, value_out, value_cache, pages,
               scale_layout)
    return key_out, value_out


@_traced_as(_api.gather_dequant)
def _gather_dequant_traced(kv_cache, block_table, seq_lens, k_scale=1.0, v_scale=1.0, *, value_cache=None,
                           cu_seqlens=None, dtype=None, scale_layout="vllm", kv_layout=None, key_out=None,
                           value_out=None, stream=None):
    _no_stream(stream)
    if key_out is None or value_out is None:
        raise ValueError("key_out, value_out: under torch.compile gather_dequant needs both outputs; their "
                         "row count is data (cu_seqlens[-1]), which a traced call cannot read")
    kv_cache, value_cache = _sides(kv_cache, value_cache, kv_layout)
    computed = cu_seqlens is None
    if computed:
        cu_seqlens = _api._prefix_sums(seq_lens)
    key_out, value_out, cu_seqlens = _api._gather_outputs(kv_cache, value_cache, seq_lens, cu_seqlens, computed,
                                                          dtype, key_out, value_out, block_table=block_table)
    gather_dequant(kv_cache, block_table, seq_lens, cu_seqlens, scale_tensor(k_scale), scale_tensor(v_scale),
                   key_out, value_out, value_cache, scale_layout)
    return key_out, value_out, cu_seqlens


@_traced_as(_api.decode_attention)
def _decode_attention_traced(query, kv_cache, block_table, seq_lens, k_scale=1.0, v_scale=1.0, *, value_cache=None,
                             scale_layout="vllm", kv_layout=None, sm_scale=None, logits_soft_cap=0.0,
                             window_left=-1, q_len=1, out=None, lse=None, workspace=None, stream=None):
    _no_stream(stream)
    kv_cache, value_cache = _sides(kv_cache, value_cache, kv_layout)
    sm, cap, window, rows = _api._decode_scalars(query, sm_scale, logits_soft_cap, window_left, q_len)
    out = _api._decode_out(query, kv_cache, value_cache, out, block_table, rows, checked=False)
    decode_attention(query, kv_cache, block_table, seq_lens, scale_tensor(k_scale), scale_tensor(v_scale), out, sm,
                     lse, value_cache, scale_layout, cap, window, rows, workspace)
    return out


@_traced_as(_scales.amax)
def _amax_traced(x, out=None, *, accumulate=False, stream=None):
    _no_stream(stream)
    out = _scales._amax_out(x, out, accumulate)
    amax(x, out, accumulate)
    return out


_torch_hook.after_import("torch._dynamo", _substitute, "Dynamo's substitute_in_graph failed for nvfp4kv's "
                         "Python API, so a compiled call of it breaks the graph (an error under "
                         "fullgraph=True; the torch.ops.nvfp4kv ops still trace)")
