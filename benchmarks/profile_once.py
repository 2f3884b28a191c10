#!/usr/bin/env python3
"""One store (65536 tokens, H8 D128 bf16 HND, random slots) and one gather (262144 tokens): the
launches to run under `ncu` (e.g. ncu -k regex:'store_kernel|gather_kernel' -c 2 ...)."""
import torch

import nvfp4kv
from nvfp4kv import bench

bench.bench_store_case(torch, nvfp4kv, 65536, quick=True)
bench.bench_gather_case(torch, nvfp4kv, 262144, quick=True)
