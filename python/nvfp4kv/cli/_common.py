"""What the subcommands of the ``nvfp4kv`` command share: the runtime error, argument types
(sizes, fractions, positive integers, model presets), progress lines on stderr, tables, byte
and ratio formatting, JSON output, and the per-format page sizes that demo and plan print."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

from ..models import ModelGeometry, get_model
from ..progress import Progress

PROG = "nvfp4kv"

# The formats compared by demo and plan: display name -> vLLM kv_cache_dtype string.
_SIZE_FORMATS = (("bf16", "bfloat16"), ("fp8", "fp8"), ("nvfp4", "nvfp4"))


class CLIError(Exception):
    """A runtime error that is the user's to fix: printed as one line, exit status 1."""


class UsageError(CLIError):
    """A bad argument that only shows after parsing (weights larger than the memory, a geometry
    the library cannot store, a demo larger than the machine's memory): printed as one line in
    argparse's style, exit status 2."""


# ------------------------------------------------------------------------------ argument types
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


# Bounds checked before any arithmetic, so that no argument can make the command compute for long
# (Fraction("1e100000000") builds a 100-million-digit integer) or overflow a float later on.
_TEXT_MAX = 100  # characters of a size, fraction or integer argument
_EXPONENT_MAX = 100  # |e| of a number written as ...e<e>
_SIZE_MAX = 2**60  # bytes (1 EiB): more than any machine has
_INT_MAX = 2**63 - 1  # counts (layers, heads, block size, context, tokens)


def _check_text(text: str, what: str) -> None:
    """Reject a number that is too long, or whose exponent is absurd, before it is computed."""
    if len(text) > _TEXT_MAX:
        raise ValueError(f"{text[:20]!r}... is too long for {what} ({len(text)} characters)")
    m = re.search(r"[eE]([+-]?[\d_]+)", text)  # \d: int() and Fraction read any script's digits
    if m:
        try:
            exponent = int(m.group(1).replace("_", ""))
        except ValueError:
            return  # not a number at all: the caller's parser says so
        if abs(exponent) > _EXPONENT_MAX:
            raise ValueError(f"{text.strip()!r}: exponent out of range (at most {_EXPONENT_MAX})")


def parse_size(text: str) -> int:
    """Bytes in a size such as ``80GiB``, ``80 GB``, ``512MiB``, ``1.5e9`` or ``85899345920``.

    Units (case-insensitive): B, KB/MB/GB/TB (powers of 10), KiB/MiB/GiB/TiB (powers of 2).
    A bare ``G``/``M``/``K``/``T`` is rejected as ambiguous. Fractions of a byte are dropped.
    At most 2**60 bytes; at most 100 characters and an exponent of at most 100, checked before
    any arithmetic.

    Raises
    ------
    ValueError
        For anything else, a negative size, or one beyond the limits above.
    """
    text = str(text)
    _check_text(text, "a size")
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if not m:
        if re.fullmatch(r"\s*-\s*[0-9.].*", text):
            raise ValueError(f"{text.strip()!r}: a size cannot be negative")
        raise ValueError(f"{text!r} is not a size (examples: 80GiB, 80GB, 512MiB, 1e9)")
    number, unit = m.group(1), m.group(2).lower()
    if unit not in _SIZE_UNITS:
        if unit in ("k", "m", "g", "t"):
            raise ValueError(
                f"{text!r}: unit {m.group(2)!r} is ambiguous; "
                f"write {m.group(2).upper()}iB (binary) or {m.group(2).upper()}B (decimal)"
            )
        raise ValueError(
            f"{text!r}: unknown unit {m.group(2)!r}; use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB"
        )
    size = int(Fraction(number) * _SIZE_UNITS[unit])
    if size > _SIZE_MAX:
        raise ValueError(f"{text.strip()!r} is too large (at most 2**60 bytes = 1048576 TiB)")
    return size


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _plain(text: str) -> str:
    """text, if written as sizes are (ASCII digits, no underscores), else a ValueError: int() and
    Fraction() also read other scripts' digits and Python's 1_000, which sizes refuse (review: one
    command took --layers 1_0 and refused --memory 1_000)."""
    if not text.isascii() or "_" in text:
        raise ValueError(text)
    return text


def _fraction_arg(text: str) -> Fraction:
    try:
        _check_text(text, "a number")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    # "90%" reads as 0.9 (a percentage is how memory utilization is often said).
    number, percent = (text.strip()[:-1], True) if text.strip().endswith("%") else (text, False)
    try:
        value = Fraction(_plain(number)) / (100 if percent else 1)
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text.strip()} is not in (0, 1]")
    return value


def _int_arg(text: str, minimum: int, maximum: int = _INT_MAX) -> int:
    if len(text) > _TEXT_MAX:
        raise argparse.ArgumentTypeError(f"{text[:20]!r}... is too long ({len(text)} characters)")
    try:
        value = int(_plain(text), 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < minimum:
        kind = "positive" if minimum == 1 else "non-negative"
        raise argparse.ArgumentTypeError(f"{value} is not a {kind} integer")
    if value > maximum:
        raise argparse.ArgumentTypeError(f"{value} is too large (at most {maximum})")
    return value


def _positive_int(text: str) -> int:
    return _int_arg(text, 1)


def _nonnegative_int(text: str) -> int:
    return _int_arg(text, 0)


# The head sizes every operation of the library accepts (see docs/FORMAT.md): KVCacheSpec may
# accept more, so the CLI checks this itself.
_HEAD_SIZE_MIN, _HEAD_SIZE_MAX, _HEAD_SIZE_STEP = 16, 512, 16


def _head_size_arg(text: str) -> int:
    value = _positive_int(text)
    if value % _HEAD_SIZE_STEP or not _HEAD_SIZE_MIN <= value <= _HEAD_SIZE_MAX:
        raise argparse.ArgumentTypeError(
            f"{value} is not a supported head size "
            f"(a multiple of {_HEAD_SIZE_STEP} from {_HEAD_SIZE_MIN} to {_HEAD_SIZE_MAX})"
        )
    return value


def _memory_limit() -> int:
    """Bytes of memory this process may use: the machine's RAM, or less under a cgroup limit;
    at most 2**40 (2**40 where nothing says)."""
    limit = 2**40
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        if total > 0:
            limit = min(limit, total)
    except (AttributeError, ValueError, OSError):
        pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read(64).strip()
        except OSError:
            continue
        if text.isdigit() and int(text) > 0:
            limit = min(limit, int(text))
    return limit


def _model_arg(text: str) -> ModelGeometry:
    try:
        return get_model(text)
    except KeyError as e:
        raise argparse.ArgumentTypeError(e.args[0]) from None


# ------------------------------------------------------------------------------------- output
class _Progress(Progress):
    """The command's status lines on stderr (nvfp4kv.progress.Progress), prefixed with its name."""

    def __init__(self, command: str, enabled: bool = True):
        super().__init__(f"[{PROG} {command}] ", enabled)


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: str = "") -> str:
    """Aligned text table. ``align`` has one letter per column, "l" or "r"; by default the
    first column is left-aligned and the others (numbers) right-aligned."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    align = align or "l" + "r" * (len(headers) - 1)

    def line(row):
        return "  ".join(
            c.ljust(w) if a == "l" else c.rjust(w) for a, c, w in zip(align, row, widths)
        ).rstrip()

    return "\n".join(
        [line(cells[0]), line(["-" * w for w in widths])] + [line(r) for r in cells[1:]]
    )


def _count(n: int, noun: str) -> str:
    """'1 layer', '32 layers', '4,096 tokens'."""
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


def _human_bytes(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def _fmt_ratio(r: float | None) -> str:
    return "n/a" if r is None else f"{r:.2f}x"


def _print_json(obj: Any):
    print(json.dumps(obj, indent=2))


def _geometry_json(geo: ModelGeometry) -> dict[str, Any]:
    return {
        "name": geo.name,
        "hf_id": geo.hf_id,
        "layers": geo.layers,
        "kv_heads": geo.kv_heads,
        "head_size": geo.head_size,
        "note": geo.note,
    }


def _format_sizes(
    geo: ModelGeometry, block_size: int, formats=_SIZE_FORMATS
) -> list[dict[str, Any]]:
    """Page sizes of each format for the whole model, from KVCacheSpec (the library's logic); a
    ValueError for an NVFP4 page side no operation takes (_check_page_side)."""
    from ..spec import KVCacheSpec, _check_page_side

    rows = []
    for name, dtype in formats:
        spec = KVCacheSpec(
            block_size=block_size,
            num_kv_heads=geo.kv_heads,
            head_size=geo.head_size,
            cache_dtype=dtype,
        )
        _check_page_side(spec)
        rows.append(
            {
                "name": name,
                "cache_dtype": dtype,
                "page_bytes_per_layer": spec.page_size_bytes,
                "page_bytes": spec.page_size_bytes * geo.layers,
                "bytes_per_token": spec.page_size_bytes * geo.layers // block_size,
                "spec": spec,
            }
        )
    by_name = {r["name"]: r for r in rows}
    for r in rows:
        r["gain_vs_bf16"] = _ratio(by_name["bf16"]["page_bytes"], r["page_bytes"])
        r["gain_vs_fp8"] = _ratio(by_name["fp8"]["page_bytes"], r["page_bytes"])
    return rows


def _strip_private(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k != "spec"} for r in rows]
