"""``nvfp4kv bench``: the command-line wrapper of the GPU store benchmark, which itself lives in
:mod:`nvfp4kv.bench`."""

from __future__ import annotations

from ._common import CLIError, _print_json


def _output_path_arg(text: str) -> str:
    """A new file the JSON can be written to later (checked now, not after the benchmark ran):
    an existing file is not replaced."""
    from ..bench import json_path_arg

    return json_path_arg(text, new=True)


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
    from .. import bench

    try:
        result = bench.run(quick=args.quick, progress=not args.quiet)
    except SystemExit as e:  # bench reports a missing GPU as SystemExit("message")
        if isinstance(e.code, str):
            raise CLIError(e.code.split(": ", 1)[-1]) from None
        return e.code or 0
    # The results reach stdout before the file is written, so a failed write loses nothing.
    if args.json:
        _print_json(result)
    else:
        print(bench.format_table(result))
    if args.output:
        try:
            bench.write_json(args.output, result, replace=False)  # a file made meanwhile stays
        except OSError as e:
            raise CLIError(f"--output {args.output!r}: {e.strerror or e}; the results are on stdout") from None
    return 0


def add_parser(sub, common) -> None:
    """Register the ``bench`` subcommand on ``sub`` (the subparsers of build_parser)."""
    p = sub.add_parser(
        "bench",
        parents=[common],
        help="GPU benchmark of the store and the gather (needs a GPU)",
        description="Run the GPU store benchmark of nvfp4kv.bench: copy-bandwidth "
        "and launch ceilings, then the store and gather_dequant at several sizes. Needs torch with "
        "CUDA and a CUDA build of nvfp4kv.",
    )
    p.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    p.add_argument(
        "--output",
        metavar="PATH",
        type=_output_path_arg,
        help="also write the results as JSON to PATH, a new file",
    )
    p.set_defaults(func=_cmd_bench)
