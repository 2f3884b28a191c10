"""The ``nvfp4kv`` command (also ``python -m nvfp4kv``).

Subcommands:

- ``demo``  (the default): quantize a realistic K/V batch of Llama-3.1-8B geometry into a paged
  NVFP4 cache, read it back, print sizes, errors and store speed.
- ``plan``: how many tokens / sequences fit in a GPU memory budget, bf16 vs fp8 vs nvfp4.
- ``bench``: the GPU store benchmark (:mod:`nvfp4kv.bench`).
- ``info``: version, build details, devices.

Every subcommand has ``--help`` and ``--json`` (machine-readable output on stdout). Bad
arguments exit with status 2, runtime errors with status 1, each with one line on stderr.
Progress goes to stderr, so stdout stays clean for tables and JSON. Set ``NVFP4KV_DEBUG=1`` to
get the Python traceback of a runtime error.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import sys
import time
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

from .models import DEFAULT_MODEL, MODELS, ModelGeometry, custom_geometry, get_model

__all__ = ["main", "parse_size", "plan_capacity", "run_demo"]

PROG = "nvfp4kv"

# The formats compared by demo and plan: display name -> vLLM kv_cache_dtype string.
_SIZE_FORMATS = (("bf16", "bfloat16"), ("fp8", "fp8"), ("nvfp4", "nvfp4"))
_DEMO_FORMATS = _SIZE_FORMATS + (("nvfp4_4over6", "nvfp4_4over6"),)
_RECIPES = ("nvfp4", "nvfp4_4over6")


class CLIError(Exception):
    """A runtime error that is the user's to fix: printed as one line, exit status 1."""


# ------------------------------------------------------------------------------ argument parsing
class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr (and exit status 2)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


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


def parse_size(text: str) -> int:
    """Bytes in a size such as ``80GiB``, ``80 GB``, ``512MiB``, ``1.5e9`` or ``85899345920``.

    Units (case-insensitive): B, KB/MB/GB/TB (powers of 10), KiB/MiB/GiB/TiB (powers of 2).
    A bare ``G``/``M``/``K``/``T`` is rejected as ambiguous. Fractions of a byte are dropped.

    Raises
    ------
    ValueError
        For anything else, or a negative size.
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m:
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
    return int(Fraction(number) * _SIZE_UNITS[unit])


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _fraction_arg(text: str) -> Fraction:
    try:
        value = Fraction(text)
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text} is not in (0, 1]")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} is not a positive integer")
    return value


def _model_arg(text: str) -> ModelGeometry:
    try:
        return get_model(text)
    except KeyError as e:
        raise argparse.ArgumentTypeError(e.args[0]) from None


# ------------------------------------------------------------------------------------- output
class _Progress:
    """Status lines on stderr: rewritten in place on a terminal, one line each otherwise."""

    def __init__(self, command: str, enabled: bool = True):
        self.prefix = f"[{PROG} {command}] "
        self.enabled = enabled
        self.tty = enabled and sys.stderr.isatty()

    def __call__(self, message: str):
        if not self.enabled:
            return
        if self.tty:
            sys.stderr.write("\r\033[K" + self.prefix + message)
        else:
            sys.stderr.write(self.prefix + message + "\n")
        sys.stderr.flush()

    def done(self):
        if self.tty:
            sys.stderr.write("\r\033[K")
            sys.stderr.flush()


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
    """Page sizes of each format for the whole model, from KVCacheSpec (the library's logic)."""
    from .spec import KVCacheSpec

    rows = []
    for name, dtype in formats:
        spec = KVCacheSpec(
            block_size=block_size,
            num_kv_heads=geo.kv_heads,
            head_size=geo.head_size,
            cache_dtype=dtype,
        )
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


# --------------------------------------------------------------------------------------- plan
def plan_capacity(
    geo: ModelGeometry,
    memory_bytes: int,
    utilization: Fraction = Fraction(9, 10),
    weights_bytes: int = 0,
    block_size: int = 16,
    context: int = 8192,
) -> dict[str, Any]:
    """How many pages, tokens and sequences fit, per format (see ``nvfp4kv plan --help``).

    The KV budget is ``floor(memory * utilization) - weights`` bytes; every layer has its own
    cache, so a page of the model is ``KVCacheSpec.page_size_bytes * layers`` and the page count
    is ``KVCacheSpec.num_blocks_for(budget, layers)``.

    Raises
    ------
    CLIError
        If the weights do not leave any memory for the cache.
    ValueError
        From KVCacheSpec, for a geometry the format cannot store.
    """
    usable = int(Fraction(memory_bytes) * Fraction(utilization))
    budget = usable - weights_bytes
    if budget < 0:
        raise CLIError(
            f"the weights ({_human_bytes(weights_bytes)}) exceed the usable memory "
            f"({_human_bytes(memory_bytes)} x {float(utilization):g} = "
            f"{_human_bytes(usable)})"
        )
    pages_per_seq = -(-context // block_size)
    rows = _format_sizes(geo, block_size)
    for r in rows:
        spec = r["spec"]
        r["pages"] = spec.num_blocks_for(budget, geo.layers)
        r["max_tokens"] = spec.max_tokens_for(budget, geo.layers)
        r["max_sequences"] = r["pages"] // pages_per_seq
    bf16_tokens = rows[0]["max_tokens"]
    for r in rows:
        r["gain_vs_bf16"] = _ratio(r["max_tokens"], bf16_tokens)
        del r["gain_vs_fp8"]
    return {
        "command": "plan",
        "model": _geometry_json(geo),
        "memory_bytes": memory_bytes,
        "utilization": float(utilization),
        "weights_bytes": weights_bytes,
        "kv_budget_bytes": budget,
        "block_size": block_size,
        "context": context,
        "pages_per_sequence": pages_per_seq,
        "formats": _strip_private(rows),
    }


def _cmd_plan(args) -> int:
    if args.list_models:
        models = [_geometry_json(m) for m in MODELS.values()]
        if args.json:
            _print_json({"command": "plan", "models": models})
        else:
            print(
                _table(
                    ["model", "layers", "kv heads", "head size", "source (config.json)"],
                    [
                        [m["name"], m["layers"], m["kv_heads"], m["head_size"], m["hf_id"]]
                        for m in models
                    ],
                    align="lrrrl",
                )
            )
            notes = [m for m in models if m["note"]]
            for m in notes:
                print(f"note: {m['name']}: {m['note']}")
        return 0

    explicit = (args.layers, args.kv_heads, args.head_size)
    if args.model is None and all(v is not None for v in explicit):
        geo = custom_geometry(None, *explicit)
    else:
        geo = custom_geometry(args.model or get_model(DEFAULT_MODEL), *explicit)
    result = plan_capacity(
        geo, args.memory, args.utilization, args.weights, args.block_size, args.context
    )
    if args.json:
        _print_json(result)
        return 0

    src = f" ({geo.hf_id})" if geo.hf_id else ""
    print(
        f"model:   {geo.name}{src}: {geo.layers} layers, {geo.kv_heads} KV heads, "
        f"head size {geo.head_size}"
    )
    print(
        f"memory:  {_human_bytes(result['memory_bytes'])} x {result['utilization']:g} - "
        f"{_human_bytes(result['weights_bytes'])} weights = "
        f"{_human_bytes(result['kv_budget_bytes'])} for the KV cache "
        f"({result['kv_budget_bytes']:,} B)"
    )
    print(
        f"paging:  block size {result['block_size']}, context {result['context']:,} tokens = "
        f"{result['pages_per_sequence']:,} pages per sequence"
    )
    print()
    rows = [
        [
            r["name"],
            f"{r['page_bytes']:,}",
            f"{r['bytes_per_token']:,}",
            f"{r['pages']:,}",
            f"{r['max_tokens']:,}",
            f"{r['max_sequences']:,}",
            _fmt_ratio(r["gain_vs_bf16"]),
        ]
        for r in result["formats"]
    ]
    print(
        _table(
            [
                "format",
                f"page B ({geo.layers} layers)",
                "B/token",
                "pages",
                "max tokens",
                f"seqs @ {result['context']:,}",
                "vs bf16",
            ],
            rows,
        )
    )
    if geo.note:
        print(f"\nnote: {geo.note}")
    return 0


# --------------------------------------------------------------------------------------- demo
def _pick_device(device: str, backend: str):
    """(device, backend, torch module or None) for the demo."""
    import nvfp4kv

    try:
        import torch
    except ImportError:
        torch = None
    info = nvfp4kv.build_info()
    gpu_ok = torch is not None and torch.cuda.is_available() and info["cuda_available"]
    if device == "cuda":
        if torch is None:
            raise CLIError("--device cuda needs torch with CUDA (pip install torch)")
        if backend == "numpy":
            raise CLIError("--backend numpy only works with --device cpu")
        if not torch.cuda.is_available():
            raise CLIError("--device cuda: torch sees no CUDA device")
        if not info["cuda_available"]:
            raise CLIError(f"--device cuda: {info['cuda_unavailable_reason']}")
    elif device == "auto":
        device = "cuda" if gpu_ok and backend != "numpy" else "cpu"
    if backend == "torch" and torch is None:
        raise CLIError("--backend torch: torch is not installed")
    if backend == "auto":
        backend = "torch" if torch is not None else "numpy"
    return device, backend, (torch if backend == "torch" else None)


def _demo_data(np, rng, n: int, H: int, D: int):
    """Heavy-tailed K/V: Student-t(4) x per-token log-normal magnitude x per-channel spread;
    K also has 8 outlier channels (of H*D) at 10-50x, as real K projections do."""

    def side(outliers: int):
        x = rng.standard_t(4.0, size=(n, H, D))
        x *= np.exp(rng.normal(0.0, 0.5, size=(n, H, 1)))  # per-token magnitude
        x *= np.exp(rng.normal(0.0, 0.3, size=(1, H, D)))  # per-channel spread
        if outliers:
            flat = x.reshape(n, H * D)
            channels = rng.choice(H * D, size=outliers, replace=False)
            flat[:, channels] *= rng.uniform(10.0, 50.0, size=outliers)
        return x.astype(np.float32)

    return side(8), side(0)


def _error_stats(x, y, torch) -> dict[str, float]:
    """Relative L2 error over the batch and cosine similarity per (token, head) vector."""
    if torch is not None:
        x, y = x.double(), y.double()
        rel = (torch.linalg.vector_norm(y - x) / torch.linalg.vector_norm(x)).item()
        den = torch.linalg.vector_norm(x, dim=-1) * torch.linalg.vector_norm(y, dim=-1)
        cos = (x * y).sum(-1) / den.clamp_min(1e-300)
        return {"rel_l2": rel, "cosine_mean": cos.mean().item(), "cosine_min": cos.min().item()}
    import numpy as np

    x, y = x.astype(np.float64), y.astype(np.float64)
    rel = float(np.linalg.norm(y - x) / np.linalg.norm(x))
    den = np.linalg.norm(x, axis=-1) * np.linalg.norm(y, axis=-1)
    cos = (x * y).sum(-1) / np.maximum(den, 1e-300)
    return {"rel_l2": rel, "cosine_mean": float(cos.mean()), "cosine_min": float(cos.min())}


def _time_store(fn, sync, min_seconds: float, max_calls: int = 1000) -> tuple[float, int]:
    """Seconds per call of fn (already warmed up), over at least min_seconds or max_calls."""
    calls, start = 0, time.perf_counter()
    elapsed = 0.0
    while calls < 3 or (elapsed < min_seconds and calls < max_calls):
        fn()
        calls += 1
        if sync is not None and (calls < 3 or calls % 8 == 0):
            sync()
        elapsed = time.perf_counter() - start
    if sync is not None:
        sync()
        elapsed = time.perf_counter() - start
    return elapsed / calls, calls


def run_demo(
    tokens: int | None = None,
    device: str = "auto",
    seed: int = 0,
    backend: str = "auto",
    progress: _Progress | None = None,
) -> dict[str, Any]:
    """Run the demo and return its results (the ``--json`` object)."""
    import numpy as np

    import nvfp4kv

    progress = progress or _Progress("demo", enabled=False)
    geo = get_model(DEFAULT_MODEL)
    T, H, D = 16, geo.kv_heads, geo.head_size
    progress("checking devices ...")
    device, backend, torch = _pick_device(device, backend)
    n = tokens if tokens is not None else (16384 if device == "cuda" else 2048)

    progress(f"generating {n} tokens of K and V (seed {seed}) ...")
    rng = np.random.default_rng(seed)
    key_np, value_np = _demo_data(np, rng, n, H, D)
    pages = -(-n // T) + max(1, -(-n // T) // 4)  # 25% more pages than needed: slots scatter
    slots_np = rng.permutation(pages * T)[:n].astype(np.int64)

    if torch is not None:
        key = torch.from_numpy(key_np).to(device=device, dtype=torch.bfloat16)
        value = torch.from_numpy(value_np).to(device=device, dtype=torch.bfloat16)
        slots = torch.from_numpy(slots_np).to(device)
        key_ref, value_ref = key.float(), value.float()  # what the library is given
        k_scale = key_ref.abs().max().item() / 448.0
        v_scale = value_ref.abs().max().item() / 448.0
        sync = torch.cuda.synchronize if device == "cuda" else None
        in_dtype, elem = "bfloat16", 2
        page_idx, pos_idx = slots // T, slots % T
    else:
        key, value, slots = key_np, value_np, slots_np
        key_ref, value_ref = key_np, value_np
        k_scale = float(np.abs(key_np).max()) / 448.0
        v_scale = float(np.abs(value_np).max()) / 448.0
        sync = None
        in_dtype, elem = "float32", 4
        page_idx, pos_idx = slots_np // T, slots_np % T

    sizes = _format_sizes(geo, T, _DEMO_FORMATS)
    recipes = []
    for recipe in _RECIPES:
        spec = nvfp4kv.KVCacheSpec(block_size=T, num_kv_heads=H, head_size=D, cache_dtype=recipe)
        cache = nvfp4kv.allocate_kv_cache(spec, pages, device=device, backend=backend)
        progress(f"{recipe}: store {n} tokens into {pages} pages ...")

        def store(cache=cache, recipe=recipe):
            nvfp4kv.store(key, value, cache, slots, k_scale, v_scale, recipe=recipe)

        store()  # warm-up; it also fills the cache that is checked below
        if sync is not None:
            sync()
        progress(f"{recipe}: timing the store ...")
        seconds, calls = _time_store(store, sync, 0.5 if device == "cuda" else 0.3)
        progress(f"{recipe}: dequantize and compare ...")
        k_out, v_out = nvfp4kv.dequantize(cache, k_scale, v_scale)
        k_err = _error_stats(key_ref, k_out[page_idx, pos_idx], torch)
        v_err = _error_stats(value_ref, v_out[page_idx, pos_idx], torch)
        # Bytes moved per token under the benchmark's model: read K and V, write the NVFP4 rows
        # of both sides (KVCacheSpec.bytes_per_token), read the int64 slot.
        moved = n * (2 * H * D * elem + spec.bytes_per_token + 8)
        recipes.append(
            {
                "recipe": recipe,
                "k": k_err,
                "v": v_err,
                "store": {
                    "seconds_per_call": seconds,
                    "calls": calls,
                    "tokens_per_s": n / seconds,
                    "GBps": moved / seconds / 1e9,
                    "bytes_per_call": moved,
                },
            }
        )
    progress.done()

    return {
        "command": "demo",
        "nvfp4kv": nvfp4kv.__version__,
        "model": _geometry_json(geo),
        "block_size": T,
        "device": device,
        "backend": backend,
        "framework_version": torch.__version__ if torch is not None else np.__version__,
        "input_dtype": in_dtype,
        "tokens": n,
        "pages": pages,
        "seed": seed,
        "data": (
            "K = Student-t(4) x per-token log-normal x per-channel spread, 8 outlier "
            "channels at 10-50x; V = the same without outlier channels"
        ),
        "k_scale": k_scale,
        "v_scale": v_scale,
        "formats": _strip_private(sizes),
        "recipes": recipes,
    }


def _print_demo(r: dict[str, Any]):
    m = r["model"]
    fw = "torch" if r["backend"] == "torch" else "numpy"
    print(
        f"nvfp4kv {r['nvfp4kv']} demo: {m['name']} geometry ({m['layers']} layers, "
        f"{m['kv_heads']} KV heads, head size {m['head_size']}, block size {r['block_size']})"
    )
    print(f"device:  {r['device']} ({fw} {r['framework_version']}, {r['input_dtype']} input)")
    print(
        f"batch:   {r['tokens']:,} tokens of one layer at random slots in {r['pages']:,} pages, "
        f"seed {r['seed']}"
    )
    for part in r["data"].split("; "):
        print(f"data:    {part}")
    print(f"scales:  k_scale = amax/448 = {r['k_scale']:.6g}, v_scale = {r['v_scale']:.6g}")
    print()
    print(f"KV cache size, whole model ({m['layers']} layers):")
    print(
        _table(
            ["format", "page B/layer", "page B", "B/token", "vs bf16", "vs fp8"],
            [
                [
                    f["name"],
                    f"{f['page_bytes_per_layer']:,}",
                    f"{f['page_bytes']:,}",
                    f"{f['bytes_per_token']:,}",
                    _fmt_ratio(f["gain_vs_bf16"]),
                    _fmt_ratio(f["gain_vs_fp8"]),
                ]
                for f in r["formats"]
            ],
        )
    )
    print()
    print(f"Accuracy (dequantized vs input) and store speed, one layer, {r['tokens']:,} tokens:")
    rows = []
    for x in r["recipes"]:
        s = x["store"]
        rows.append(
            [
                x["recipe"],
                f"{x['k']['rel_l2']:.4f}",
                f"{x['k']['cosine_mean']:.5f}",
                f"{x['v']['rel_l2']:.4f}",
                f"{x['v']['cosine_mean']:.5f}",
                f"{s['seconds_per_call'] * 1e6:,.0f}",
                f"{s['tokens_per_s']:,.0f}",
                f"{s['GBps']:.2f}",
            ]
        )
    print(
        _table(
            [
                "recipe",
                "K rel L2",
                "K cosine",
                "V rel L2",
                "V cosine",
                "store us",
                "tokens/s",
                "GB/s",
            ],
            rows,
        )
    )
    print()
    print(
        "rel L2 = ||x_hat - x|| / ||x|| over the batch; cosine = mean over (token, head) vectors;"
    )
    print(
        "GB/s counts K/V read + NVFP4 bytes written + slot read per token; "
        "'nvfp4kv bench' measures the GPU."
    )


def _cmd_demo(args) -> int:
    progress = _Progress("demo", enabled=not args.quiet)
    try:
        result = run_demo(args.tokens, args.device, args.seed, args.backend, progress)
    finally:
        progress.done()
    if args.json:
        _print_json(result)
    else:
        _print_demo(result)
    return 0


# -------------------------------------------------------------------------------------- bench
def _cmd_bench(args) -> int:
    try:
        import torch
    except ImportError:
        raise CLIError("needs torch with CUDA (pip install torch) and a GPU") from None
    if not torch.cuda.is_available():
        raise CLIError("no CUDA device visible to torch; the benchmark needs a GPU")
    import nvfp4kv

    info = nvfp4kv.build_info()
    if not info["cuda_available"]:
        raise CLIError(f"CUDA unavailable in nvfp4kv: {info['cuda_unavailable_reason']}")
    from . import bench

    try:
        if args.json:
            result = bench.run(quick=args.quick, json_path=args.output, progress=not args.quiet)
            _print_json(result)
            return 0
        argv = (["--quick"] if args.quick else []) + (
            ["--json", args.output] if args.output else []
        )
        return bench.main(argv) or 0
    except SystemExit as e:  # bench reports a missing GPU as SystemExit("message")
        if isinstance(e.code, str):
            raise CLIError(e.code.replace("nvfp4kv bench: ", "", 1)) from None
        return e.code or 0


# --------------------------------------------------------------------------------------- info
def collect_info() -> dict[str, Any]:
    """Version, build, Python, numpy/torch versions and CUDA devices."""
    import nvfp4kv

    result: dict[str, Any] = {
        "command": "info",
        "nvfp4kv": nvfp4kv.__version__,
        "build": nvfp4kv.build_info(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "numpy": None,
        "torch": None,
        "torch_cuda": None,
        "devices": [],
    }
    try:
        import numpy

        result["numpy"] = numpy.__version__
    except ImportError:
        pass
    try:
        import torch
    except ImportError:
        return result
    result["torch"] = torch.__version__
    result["torch_cuda"] = torch.version.cuda
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            result["devices"].append(
                {
                    "index": i,
                    "name": p.name,
                    "capability": f"sm_{p.major}{p.minor}",
                    "memory_bytes": int(p.total_memory),
                }
            )
    return result


def _cmd_info(args) -> int:
    r = collect_info()
    if args.json:
        _print_json(r)
        return 0
    b = r["build"]
    none = lambda v: "-" if v in (None, "") else v
    rows = [
        ["nvfp4kv", r["nvfp4kv"]],
        ["CUDA kernels built", "yes" if b.get("cuda_built") else "no"],
        ["CUDA version (build)", none(b.get("cuda_version"))],
        ["CUDA archs (build)", none(b.get("cuda_archs"))],
        ["CUDA devices (nvfp4kv)", b.get("cuda_device_count", "-")],
        ["CUDA usable", "yes" if b.get("cuda_available") else "no"],
    ]
    if not b.get("cuda_available"):
        rows.append(["why not", none(b.get("cuda_unavailable_reason"))])
    rows += [
        ["python", f"{r['python']} ({r['platform']})"],
        ["numpy", none(r["numpy"])],
        [
            "torch",
            "not installed (optional)"
            if r["torch"] is None
            else f"{r['torch']} ("
            + (f"CUDA {r['torch_cuda']}" if r["torch_cuda"] else "CPU only")
            + ")",
        ],
    ]
    print(_table(["item", "value"], rows, align="ll"))
    print()
    if r["devices"]:
        print(
            _table(
                ["#", "device", "arch", "memory"],
                [
                    [d["index"], d["name"], d["capability"], _human_bytes(d["memory_bytes"])]
                    for d in r["devices"]
                ],
                align="rllr",
            )
        )
    elif r["torch"] is None:
        print("devices: unknown (torch is not installed); the CPU path is always available")
    else:
        print("devices: no CUDA device visible to torch; the CPU path is always available")
    return 0


# --------------------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``nvfp4kv`` command."""
    try:
        from . import __version__ as version
    except ImportError:  # the extension is missing: still show --help
        version = "unknown"
    ap = _Parser(
        prog=PROG,
        description="NVFP4 paged KV cache: demo, capacity planner, benchmark, "
        "build info. Without a subcommand, runs 'demo'.",
    )
    ap.add_argument("--version", action="version", version=f"{PROG} {version}")
    sub = ap.add_subparsers(dest="command", metavar="{demo,plan,bench,info}")

    common = _Parser(add_help=False)
    common.add_argument("--json", action="store_true", help="print machine-readable JSON on stdout")
    common.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")

    p = sub.add_parser(
        "demo",
        parents=[common],
        help="quantize a realistic K/V batch and report size, accuracy and speed (default)",
        description="Quantize a heavy-tailed K/V batch with Llama-3.1-8B geometry "
        "(8 KV heads, head size 128, block size 16) into a paged NVFP4 cache at "
        "random slots, read it back, and report cache sizes (bf16, fp8, nvfp4), "
        "errors of both recipes and store throughput.",
    )
    p.add_argument(
        "--tokens",
        type=_positive_int,
        default=None,
        help="tokens to store (default: 2048 on CPU, 16384 on GPU)",
    )
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: CUDA when torch sees a GPU and nvfp4kv has CUDA kernels (default)",
    )
    p.add_argument(
        "--backend",
        choices=("auto", "torch", "numpy"),
        default="auto",
        help="array library (auto: torch if installed, bf16 input; numpy: float32)",
    )
    p.add_argument("--seed", type=int, default=0, help="numpy RNG seed (default 0)")
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser(
        "plan",
        parents=[common],
        help="KV-cache capacity planner",
        description="How many KV-cache pages, tokens and sequences fit in a memory "
        "budget, for bf16, fp8 and nvfp4. The budget is memory x utilization - "
        "weights; every layer has its own cache (KVCacheSpec.page_size_bytes x "
        "layers per page).",
    )
    p.add_argument(
        "--model",
        type=_model_arg,
        default=None,
        help=f"model preset (default {DEFAULT_MODEL}); see --list-models",
    )
    p.add_argument("--list-models", action="store_true", help="list the model presets and exit")
    p.add_argument("--layers", type=_positive_int, help="override: layers with a KV cache")
    p.add_argument("--kv-heads", type=_positive_int, help="override: KV heads per layer")
    p.add_argument("--head-size", type=_positive_int, help="override: head size D")
    p.add_argument(
        "--memory",
        type=_size_arg,
        default=parse_size("80GiB"),
        help="GPU memory, e.g. 80GiB, 141GB, 24576MiB, bytes (default 80GiB)",
    )
    p.add_argument(
        "--utilization",
        type=_fraction_arg,
        default=Fraction(9, 10),
        help="fraction of --memory the engine may use, in (0, 1] (default 0.9)",
    )
    p.add_argument(
        "--weights",
        type=_size_arg,
        default=0,
        help="memory taken by weights and activations, subtracted (default 0)",
    )
    p.add_argument(
        "--block-size", type=_positive_int, default=16, help="tokens per page (default 16)"
    )
    p.add_argument(
        "--context",
        type=_positive_int,
        default=8192,
        help="tokens per sequence for the concurrency column (default 8192)",
    )
    p.set_defaults(func=_cmd_plan)

    p = sub.add_parser(
        "bench",
        parents=[common],
        help="GPU store benchmark (needs a GPU)",
        description="Run the GPU store benchmark of nvfp4kv.bench: copy-bandwidth "
        "and launch ceilings, then the store at several sizes. Needs torch with "
        "CUDA and a CUDA build of nvfp4kv.",
    )
    p.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    p.add_argument("--output", metavar="PATH", help="also write the results as JSON to PATH")
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser(
        "info",
        parents=[common],
        help="version, build and devices",
        description="Show the nvfp4kv version, how it was built (CUDA or not, "
        "architectures), numpy/torch versions and the CUDA devices.",
    )
    p.set_defaults(func=_cmd_info)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``nvfp4kv`` console script; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        argv = ["demo"]
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help, --version (0) and usage errors (2)
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    if args.command is None:  # only top-level options were given
        args = build_parser().parse_args(argv + ["demo"])
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(f"{PROG} {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # e.g. `nvfp4kv plan | head -1`: stop quietly
        # Python flushes stdout at exit, which would raise again; point fd 1 at /dev/null.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 0
    except (CLIError, ValueError, TypeError, RuntimeError, OSError, ImportError, KeyError) as e:
        if os.environ.get("NVFP4KV_DEBUG"):
            raise
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        msg = " ".join(str(msg).split())  # one line
        print(f"{PROG} {args.command}: error: {msg}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
