"""Per-call time of small stores and gathers through each of the binding's torch import paths.

Run on a GPU machine: python3 tools/host_overhead.py. Small calls back to back are bound by
the host's work per call (reading the tensors, the launch), which is what the paths differ in.
"""
import torch

import nvfp4kv
from nvfp4kv import _C, bench

print(f"torch {torch.__version__}, C exchange table: {hasattr(torch.Tensor, '__dlpack_c_exchange_api__')}")
ceil = bench.measure_ceilings(torch, quick=True)
print(f"empty kernel launch {ceil['empty_launch_us']:.2f} us, graph node {ceil['empty_graph_node_us']:.2f} us")
for path in ("exchange", "attributes", "dlpack"):
    prev = _C._set_torch_paths(path)
    try:
        rows = [bench.bench_store_case(torch, nvfp4kv, n) for n in (1, 64)]
        rows += [bench.bench_store_case(torch, nvfp4kv, 1, scales="host")]
        rows += [bench.bench_store_case(torch, nvfp4kv, n, prepared=True) for n in (1, 64)]
        g = bench.bench_gather_case(torch, nvfp4kv, 4096)
    finally:
        _C._set_torch_paths(prev)
    cells = [f"{'prepared' if r['prepared'] else 'store'} {r['tokens']} ({r['scales']} scales) {r['us']:.2f} us "
             f"({r['us'] / r['launch_us']:.2f}x launch)" for r in rows]
    print(f"{path:>10}: " + "; ".join(cells) + f"; gather 4096 {g['us']:.2f} us")

# Inside a CUDA graph the host is out of the picture: what is left is the kernel's own latency.
# Variants tell its parts apart: host scales skip the scale loads, "skip" slots (all -1) skip
# the quantization and the stores; a 4 KB torch copy is a reference small kernel that reads and
# writes memory.
src = torch.empty(4096, dtype=torch.uint8, device="cuda")
dst = torch.empty_like(src)
copy_us = bench._graph_per_call(torch, lambda: dst.copy_(src), bench.GRAPH_NODES, 10)
print(f"graph: torch 4 KB copy {copy_us:.2f} us per node")
for n, scales, slots in ((1, "device", "random"), (1, "host", "random"), (1, "device", "skip"),
                         (64, "device", "random"), (64, "host", "random")):
    r = bench.bench_store_case(torch, nvfp4kv, n, scales=scales, slots=slots, graph=True)
    print(f"graph: store {n} tokens, {scales} scales, {slots} slots: {r['graph_us']:.2f} us per node")
