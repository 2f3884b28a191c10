"""``nvfp4kv demo`` (the default subcommand): quantize a realistic K/V batch of Llama-3.1-8B
geometry into a paged NVFP4 cache, read it back, print sizes, errors and store speed."""

from __future__ import annotations

import argparse
import time
from typing import Any

from ..models import DEFAULT_MODEL, get_model
from ._common import (
    _SIZE_FORMATS,
    CLIError,
    UsageError,
    _count,
    _fmt_ratio,
    _format_sizes,
    _geometry_json,
    _human_bytes,
    _memory_limit,
    _nonnegative_int,
    _positive_int,
    _print_json,
    _Progress,
    _strip_private,
    _table,
)

_DEMO_FORMATS = _SIZE_FORMATS + (("nvfp4_4over6", "nvfp4_4over6"),)
_RECIPES = ("nvfp4", "nvfp4_4over6")

# Peak host memory of the demo per element of K or V (float64 while generating, float32 and bf16
# copies, the float32 dequantized cache and the float64 error statistics): measured at about 27
# bytes (torch backend, CPU), rounded up.
_BYTES_PER_ELEMENT = 32


def _check_tokens(n: int) -> None:
    """Raise UsageError if n tokens are not a positive count whose demo fits in this machine's
    memory (estimated before anything is allocated)."""
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise UsageError(f"argument --tokens: {n!r} is not a positive integer")
    geo = get_model(DEFAULT_MODEL)
    per_token = 2 * geo.kv_heads * geo.head_size * _BYTES_PER_ELEMENT
    limit = _memory_limit()
    if n * per_token > limit:
        raise UsageError(
            f"argument --tokens: {n} tokens need about {_human_bytes(n * per_token)} of "
            f"memory, more than this machine's {_human_bytes(limit)} "
            f"(at most {limit // per_token} tokens)"
        )


def _tokens_arg(text: str) -> int:
    n = _positive_int(text)
    try:
        _check_tokens(n)
    except UsageError as e:
        raise argparse.ArgumentTypeError(str(e).replace("argument --tokens: ", "", 1)) from None
    return n


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
        if backend == "numpy":
            raise UsageError("--backend numpy only works with --device cpu")
        if torch is None:
            raise CLIError("--device cuda needs torch with CUDA (pip install torch)")
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


# E4M3 limits that decide what a global scale does to a group of 16 (docs/FORMAT.md §1, §2): the
# group's scale amax/(6 g) keeps full precision from 2^-6 (smallest normal) to 448, has fewer bits
# below 2^-6, rounds to 0 at 2^-10 or less (the group reads back as zeros) and saturates above 448.
_E4M3_MAX = 448.0
_E4M3_MIN_NORMAL = 2.0**-6
_E4M3_ZERO = 2.0**-10
_DEFAULT_SCALE = 1.0  # what vLLM uses when a checkpoint has no k_scale / v_scale


def _decode_scale(amax: float) -> float:
    """The calibrated decode scale amax / 448 (nvfp4kv.scales.decode_scale with margin 1)."""
    return amax / _E4M3_MAX


def _full_precision_window(g: float) -> tuple[float, float]:
    """(lo, hi): group amaxes whose E4M3 scale amax/(6 g) is a normal number, for global scale g."""
    return 6.0 * g * _E4M3_MIN_NORMAL, 6.0 * g * _E4M3_MAX


def _group_stats(x, g: float, torch) -> dict[str, float]:
    """Fractions of the 16-element groups of x whose E4M3 scale amax/(6 g) is subnormal (fewer
    significant bits), rounds to zero (the group reads back as zeros) or saturates at 448."""
    if torch is not None:
        sf = x.abs().reshape(-1, 16).amax(-1).double() / (6.0 * g)

        def frac(mask):
            return mask.double().mean().item()
    else:
        import numpy as np

        sf = np.abs(x).reshape(-1, 16).max(-1).astype(np.float64) / (6.0 * g)

        def frac(mask):
            return float(mask.mean())

    return {
        "subnormal": frac((sf < _E4M3_MIN_NORMAL) & (sf > _E4M3_ZERO)),
        "zero": frac(sf <= _E4M3_ZERO),
        "saturated": frac(sf > _E4M3_MAX),
    }


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
    """Run the demo and return its results (the ``--json`` object).

    Raises
    ------
    UsageError
        (a CLIError) for a token count that is not positive or whose buffers would not fit in
        this machine's memory, or ``--backend numpy`` with ``--device cuda``.
    CLIError
        If the device or backend asked for is not available.
    """
    import numpy as np

    import nvfp4kv

    progress = progress or _Progress("demo", enabled=False)
    geo = get_model(DEFAULT_MODEL)
    T, H, D = 16, geo.kv_heads, geo.head_size
    if tokens is not None:
        _check_tokens(tokens)
    if device == "cuda" and backend == "numpy":  # before any progress line: one line on stderr
        raise UsageError("--backend numpy only works with --device cpu")
    progress("checking devices ...")
    device, backend, torch = _pick_device(device, backend)
    n = tokens if tokens is not None else (16384 if device == "cuda" else 2048)
    _check_tokens(n)

    progress(f"generating {_count(n, 'token')} of K and V (seed {seed}) ...")
    rng = np.random.default_rng(seed)
    key_np, value_np = _demo_data(np, rng, n, H, D)
    pages = -(-n // T) + max(1, -(-n // T) // 4)  # 25% more pages than needed: slots scatter
    slots_np = rng.permutation(pages * T)[:n].astype(np.int64)

    if torch is not None:
        key = torch.from_numpy(key_np).to(device=device, dtype=torch.bfloat16)
        value = torch.from_numpy(value_np).to(device=device, dtype=torch.bfloat16)
        slots = torch.from_numpy(slots_np).to(device)
        key_ref, value_ref = key.float(), value.float()  # what the library is given
        k_scale = _decode_scale(key_ref.abs().max().item())
        v_scale = _decode_scale(value_ref.abs().max().item())
        sync = torch.cuda.synchronize if device == "cuda" else None
        in_dtype, elem = "bfloat16", 2
        page_idx, pos_idx = slots // T, slots % T
    else:
        key, value, slots = key_np, value_np, slots_np
        key_ref, value_ref = key_np, value_np
        k_scale = _decode_scale(float(np.abs(key_np).max()))
        v_scale = _decode_scale(float(np.abs(value_np).max()))
        sync = None
        in_dtype, elem = "float32", 4
        page_idx, pos_idx = slots_np // T, slots_np % T

    sizes = _format_sizes(geo, T, _DEMO_FORMATS)
    recipes = []
    for recipe in _RECIPES:
        spec = nvfp4kv.KVCacheSpec(block_size=T, num_kv_heads=H, head_size=D, cache_dtype=recipe)
        cache = nvfp4kv.allocate_kv_cache(spec, pages, device=device, backend=backend)
        progress(f"{recipe}: store {_count(n, 'token')} into {_count(pages, 'page')} ...")

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
        # The same batch with the engines' fallback k_scale = v_scale = 1.0 (same cache, no timing).
        progress(f"{recipe}: store and compare with k_scale = v_scale = {_DEFAULT_SCALE:.1f} ...")
        d = _DEFAULT_SCALE
        nvfp4kv.store(key, value, cache, slots, d, d, recipe=recipe)
        k_out, v_out = nvfp4kv.dequantize(cache, d, d)
        k_err_default = _error_stats(key_ref, k_out[page_idx, pos_idx], torch)
        v_err_default = _error_stats(value_ref, v_out[page_idx, pos_idx], torch)
        del k_out, v_out
        # Bytes moved per token under the benchmark's model: read K and V, write the NVFP4 rows
        # of both sides (KVCacheSpec.bytes_per_token), read the int64 slot.
        moved = n * (2 * H * D * elem + spec.bytes_per_token + 8)
        recipes.append(
            {
                "recipe": recipe,
                "k": k_err,
                "v": v_err,
                "default_scales": {"k": k_err_default, "v": v_err_default},
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

    lo, hi = _full_precision_window(_DEFAULT_SCALE)
    scale_comparison = {
        "used": "calibrated",
        "calibrated": {"k_scale": k_scale, "v_scale": v_scale},
        "default": {"k_scale": _DEFAULT_SCALE, "v_scale": _DEFAULT_SCALE},
        "default_window": [lo, hi],
        "groups": {
            side: {
                "calibrated": _group_stats(x, g, torch),
                "default": _group_stats(x, _DEFAULT_SCALE, torch),
            }
            for side, x, g in (("k", key_ref, k_scale), ("v", value_ref, v_scale))
        },
        "note": (
            f"the store uses the calibrated decode scales amax/448; engines fall back to "
            f"{_DEFAULT_SCALE:.1f} without checkpoint KV scales, which keeps full precision only "
            f"for groups whose amax lies in [{lo:.4g}, {hi:.4g}]"
        ),
    }

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
        "scale_comparison": scale_comparison,
    }


def _print_demo(r: dict[str, Any]):
    m = r["model"]
    fw = "torch" if r["backend"] == "torch" else "numpy"
    print(
        f"nvfp4kv {r['nvfp4kv']} demo: {m['name']} geometry ({_count(m['layers'], 'layer')}, "
        f"{_count(m['kv_heads'], 'KV head')}, head size {m['head_size']}, "
        f"block size {r['block_size']})"
    )
    print(f"device:  {r['device']} ({fw} {r['framework_version']}, {r['input_dtype']} input)")
    print(
        f"batch:   {_count(r['tokens'], 'token')} of one layer at random slots in {_count(r['pages'], 'page')}, "
        f"seed {r['seed']}"
    )
    for part in r["data"].split("; "):
        print(f"data:    {part}")
    print(f"scales:  k_scale = amax/448 = {r['k_scale']:.6g}, v_scale = {r['v_scale']:.6g}")
    print()
    print(f"KV cache size, whole model ({_count(m['layers'], 'layer')}):")
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
    print(f"Accuracy (dequantized vs input) and store speed, one layer, {_count(r['tokens'], 'token')}:")
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
    c = r["scale_comparison"]
    lo, hi = c["default_window"]
    cal, dft = c["calibrated"], c["default"]
    print("Global scales, rel L2 of K and V per recipe (the table above uses the calibrated ones):")
    names = [x["recipe"] for x in r["recipes"]]
    header = ["scales", "k_scale", "v_scale"]
    for name in names:
        header += [f"{name} K", f"{name} V"]
    row_cal = ["calibrated amax/448 (used)", f"{cal['k_scale']:.6g}", f"{cal['v_scale']:.6g}"]
    row_dft = ["default (no KV scales)", f"{dft['k_scale']:.1f}", f"{dft['v_scale']:.1f}"]
    for x in r["recipes"]:
        row_cal += [f"{x['k']['rel_l2']:.4f}", f"{x['v']['rel_l2']:.4f}"]
        row_dft += [
            f"{x['default_scales']['k']['rel_l2']:.4f}",
            f"{x['default_scales']['v']['rel_l2']:.4f}",
        ]
    print(_table(header, [row_cal, row_dft]))
    print(
        f"used: calibrated, amax/448. Engines use {dft['k_scale']:.1f} when a checkpoint has no KV "
        f"scales: full precision only for group amax in [{lo:.3g}, {hi:.4g}]"
    )

    def outside(side):
        s = c["groups"][side]["default"]
        below = 100 * (s["subnormal"] + s["zero"])
        return f"{below:.2f} % below, {100 * s['saturated']:.2f} % above"

    print(f"groups of this batch outside it: K {outside('k')}; V {outside('v')}")
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


def add_parser(sub, common) -> None:
    """Register the ``demo`` subcommand on ``sub`` (the subparsers of build_parser)."""
    p = sub.add_parser(
        "demo",
        parents=[common],
        help="quantize a realistic K/V batch and report size, accuracy and speed (default)",
        description="Quantize a heavy-tailed K/V batch with Llama-3.1-8B geometry "
        "(8 KV heads, head size 128, block size 16) into a paged NVFP4 cache at "
        "random slots, read it back, and report cache sizes (bf16, fp8, nvfp4, nvfp4_4over6), "
        "errors of both recipes (with the calibrated decode scales amax/448 and with the "
        "engines' default 1.0) and store throughput.",
    )
    p.add_argument(
        "--tokens",
        type=_tokens_arg,
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
    p.add_argument("--seed", type=_nonnegative_int, default=0, help="numpy RNG seed (default 0)")
    p.set_defaults(func=_cmd_demo)
