"""``nvfp4kv plan``: how many KV-cache pages, tokens and sequences fit in a memory budget."""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction
from typing import Any

from ..models import DEFAULT_MODEL, MODELS, ModelGeometry, custom_geometry, get_model
from ._common import (
    UsageError,
    _count,
    _fmt_ratio,
    _format_sizes,
    _fraction_arg,
    _geometry_json,
    _head_size_arg,
    _human_bytes,
    _model_arg,
    _positive_int,
    _print_json,
    _ratio,
    _size_arg,
    _strip_private,
    _table,
    parse_size,
)


def plan_capacity(
    geo: ModelGeometry,
    memory_bytes: int,
    utilization: Fraction = Fraction(9, 10),
    weights_bytes: int = 0,
    block_size: int = 16,
    context: int = 8192,
    tensor_parallel_size: int = 1,
) -> dict[str, Any]:
    """How many pages, tokens and sequences fit, per format (see ``nvfp4kv plan --help``).

    The KV budget is ``floor(memory * utilization) - weights`` bytes; every layer has its own
    cache, so a page of the model is ``KVCacheSpec.page_size_bytes * layers`` and the page count
    is ``KVCacheSpec.num_blocks_for(budget, layers)``. With tensor parallelism, memory and
    weights are one GPU's, and each GPU caches ``max(1, kv_heads // tensor_parallel_size)`` KV
    heads of every token (vLLM's rule; fewer heads than GPUs are replicated), so the tokens that
    fit one GPU are the engine's.

    Raises
    ------
    UsageError
        (a CLIError) if the weights do not leave any memory for the cache, or the KV heads cannot
        be shared over ``tensor_parallel_size`` GPUs.
    ValueError
        From KVCacheSpec, for a geometry the format cannot store.
    """
    heads, tp = geo.kv_heads, tensor_parallel_size
    if tp < 1 or (heads % tp if heads >= tp else tp % heads):
        raise UsageError(f"--tensor-parallel-size {tp}: {_count(heads, 'KV head')} cannot be shared over {tp} GPUs "
                         "(it must divide the KV heads, or be a multiple of them: each GPU then keeps a copy of one)")
    per_gpu = replace(geo, kv_heads=max(1, heads // tp))
    usable = int(Fraction(memory_bytes) * Fraction(utilization))
    budget = usable - weights_bytes
    if budget < 0:
        raise UsageError(
            f"the weights ({_human_bytes(weights_bytes)}) exceed the usable memory "
            f"({_human_bytes(memory_bytes)} x {float(utilization):g} = "
            f"{_human_bytes(usable)})"
        )
    if budget == 0:
        raise UsageError(
            f"no memory is left for the cache: the usable memory ({_human_bytes(memory_bytes)} x "
            f"{float(utilization):g} = {_human_bytes(usable)}) minus the weights is 0"
        )
    pages_per_seq = -(-context // block_size)
    rows = _format_sizes(per_gpu, block_size)
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
        "tensor_parallel_size": tp,
        "kv_heads_per_gpu": per_gpu.kv_heads,
        "pages_per_sequence": pages_per_seq,
        "formats": _strip_private(rows),
    }


def _cmd_plan(args) -> int:
    if args.list_models:
        # Nothing else shapes the list: an option given with it would be silently ignored (review).
        ignored = [flag for dest, unchanged, flag in args.shapes_the_plan if getattr(args, dest) not in unchanged]
        if ignored:
            raise UsageError(f"--list-models takes no other options than --json and -q ({', '.join(ignored)} given)")
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
    try:
        result = plan_capacity(
            geo, args.memory, args.utilization, args.weights, args.block_size, args.context,
            args.tensor_parallel_size,
        )
    except (ValueError, OverflowError) as e:  # KVCacheSpec or _check_page_side refuses: a bad argument
        raise UsageError(str(e)) from None
    if args.json:
        _print_json(result)
        return 0

    src = f" ({geo.hf_id})" if geo.hf_id else ""
    tp = result["tensor_parallel_size"]
    shared = f" ({result['kv_heads_per_gpu']} per GPU at tensor parallel size {tp})" if tp > 1 else ""
    print(
        f"model:   {geo.name}{src}: {_count(geo.layers, 'layer')}, "
        f"{_count(geo.kv_heads, 'KV head')}{shared}, head size {geo.head_size}"
    )
    print(
        f"memory:  {'each GPU: ' if tp > 1 else ''}{_human_bytes(result['memory_bytes'])} x {result['utilization']:g} - "
        f"{_human_bytes(result['weights_bytes'])} weights = "
        f"{_human_bytes(result['kv_budget_bytes'])} for the KV cache "
        f"({result['kv_budget_bytes']:,} B)"
    )
    if result["weights_bytes"] == 0:  # the default: a budget that large leaves no room for a model
        per_gpu = f" / {tp} per GPU" if tp > 1 else ""
        print(f"         (no weights subtracted: pass --weights, e.g. 2 bytes per parameter{per_gpu} for bf16 weights)")
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
                f"page B ({_count(geo.layers, 'layer')})",
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
    if result["formats"][0]["max_tokens"] == 0:
        print("\nnote: not one bf16 page fits in the budget, so 'vs bf16' has no value (n/a)")
    if result["block_size"] % 4:
        print(f"\nnote: block size {result['block_size']}: vLLM's scale layout (the default, "
              "scale_layout='vllm') needs a block size divisible by 4; store these pages with "
              "scale_layout='linear'")
    return 0


def add_parser(sub, common) -> None:
    """Register the ``plan`` subcommand on ``sub`` (the subparsers of build_parser)."""
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
    p.add_argument("--head-size", type=_head_size_arg, help="override: head size D")
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
        help="fraction of --memory the engine may use, in (0, 1], or a percentage: 0.9 or 90%% (default 0.9)",
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
    p.add_argument(
        "--tensor-parallel-size",
        type=_positive_int,
        default=1,
        metavar="N",
        help="GPUs sharing each layer's KV heads, as vLLM's option: each caches max(1, kv heads / N) "
        "of them; --memory and --weights are then one GPU's. Checked: N divides the KV heads or is a "
        "multiple of them; not checked (the presets have no query heads): vLLM's rule that N divides "
        "the query heads too (default 1)",
    )
    # The options --list-models ignores, with the values that leave them as if not given: (dest,
    # values, flag). --model's default is None, which reads as the default preset.
    shapes = tuple((a.dest, (a.default, get_model(DEFAULT_MODEL)) if a.dest == "model" else (a.default,),
                    a.option_strings[-1]) for a in p._actions
                   if a.option_strings and a.dest not in ("help", "list_models", "json", "quiet"))
    p.set_defaults(func=_cmd_plan, shapes_the_plan=shapes)
