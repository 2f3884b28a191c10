"""Stores in token order and in page order (with a workspace; nvfp4kv_set_store_order forces
each), in one process: device µs and % of copy.
Usage: python3 tools/store_ws.py [tokens:key=value,... ...]
e.g. 65536 65536:H=32 262144:slots=sequential (default: the bench's H 8, D 128, bf16, HND)."""
import sys

import torch

import nvfp4kv
from nvfp4kv import bench

ceil = bench.measure_ceilings(torch)
print(f"copy {ceil['copy_GBps']:.0f} GB/s")
for arg in sys.argv[1:] or ["4096", "16384", "65536"]:
    n, _, opts = arg.partition(":")
    extra = {}
    for kv in filter(None, opts.split(",")):
        k, v = kv.split("=")
        extra[k] = int(v) if v.isdigit() else v
    F = extra.get("D", 128) // 2 + extra.get("D", 128) // 16
    written = int(n) * 2 * extra.get("H", 8) * F / 1e6
    line = []
    for order in ("token", "page"):
        nvfp4kv._C._set_store_order(order)
        r = bench.bench_store_case(torch, nvfp4kv, int(n), workspace=True, **extra)
        line.append(f"{r['gpu_us']:8.2f} us {100 * r['bytes'] / r['gpu_us'] / 1e3 / ceil['copy_GBps']:5.1f} %")
        torch.cuda.empty_cache()
    nvfp4kv._C._set_store_order("auto")
    print(f"{arg:28s} rows {written:6.0f} MB   token order {line[0]}   page order {line[1]}", flush=True)
