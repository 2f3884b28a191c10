"""``nvfp4kv info``: version, the library file it carries, build details (CUDA or not,
architectures), numpy/torch versions and the CUDA devices."""

from __future__ import annotations

import platform
from typing import Any

from ._common import _human_bytes, _print_json, _table


def collect_info() -> dict[str, Any]:
    """Version, library file, build, Python, numpy/torch versions and CUDA devices."""
    import nvfp4kv

    try:  # the library file the package carries, named after its SONAME (the ABI version)
        library = nvfp4kv.get_library()
    except OSError:  # an installation without its C/C++ files (paths.py says which)
        library = None
    result: dict[str, Any] = {
        "command": "info",
        "nvfp4kv": nvfp4kv.__version__,
        "library": library,
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
        ["library", none(r["library"])],
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


def add_parser(sub, common) -> None:
    """Register the ``info`` subcommand on ``sub`` (the subparsers of build_parser)."""
    p = sub.add_parser(
        "info",
        parents=[common],
        help="version, library, build and devices",
        description="Show the nvfp4kv version, its library file, how it was built (CUDA or "
        "not, architectures), numpy/torch versions and the CUDA devices.",
    )
    p.set_defaults(func=_cmd_info)
