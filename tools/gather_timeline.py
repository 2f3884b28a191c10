"""Per-warp timeline of the page-side gather (gather_pages_kernel), from %globaltimer stamps.

Needs a build with -DNVFP4KV_GATHER_TIMELINE. The shipped kernels no longer have that hook:
re-add it locally from git history (the NVFP4KV_GATHER_TIMELINE blocks of cuda/dequant.cu at
commit 2cec24c, where this script was added, or at ee557e6, the last commit that has them), then
(benchmarks/device_run.sh does not make such a build):
  pip install --no-build-isolation --no-deps -C cmake.define.NVFP4KV_CUDA_ARCHS=90-real \
      -C "cmake.define.CMAKE_CUDA_FLAGS=-DNVFP4KV_GATHER_TIMELINE" .
  python3 tools/gather_timeline.py [tokens ...]
The kernel then reads a device buffer's address from $NVFP4KV_TIMELINE (set per call here) and lane 0 of every warp
writes, in ns: 0 entry (before the wait on the previous grid), 1 wait released, 2 sequence
length known, 3 first unit in shared memory, 4 first unit's stores issued, 5 exit (NAMES).
Back-to-back calls as in the benchmark; the last three complete launches are printed as
percentiles over warps, relative to the launch's first wait release, with the previous launch's
last exit.
"""
import os
import sys

import numpy as np
import torch

import nvfp4kv
from nvfp4kv import bench as B

NAMES = ["entry", "wait released", "length known", "unit 1 arrived", "unit 1 stored", "exit"]


for n in [int(a) for a in sys.argv[1:]] or [4096]:
    call = B.gather_case(torch, nvfp4kv, n)["call"]
    os.environ.pop("NVFP4KV_TIMELINE", None)
    for _ in range(3):
        call()
    plain = B._queued_per_call(torch, call, 100, 7)
    slots = 16 + 8 * 200000  # int32 words per launch
    buf = torch.zeros(4 * slots, dtype=torch.int32, device="cuda")
    count = {"i": 0}

    def stamped_call():  # each launch writes the buffer of its number mod 4
        os.environ["NVFP4KV_TIMELINE"] = str(buf.data_ptr() + 4 * slots * (count["i"] % 4))
        count["i"] += 1
        call()

    stamped = B._queued_per_call(torch, stamped_call, 40, 1)
    torch.cuda.synchronize()
    os.environ.pop("NVFP4KV_TIMELINE")
    a = buf.cpu().numpy().view(np.uint32).reshape(4, slots)
    last = count["i"] - 1
    W = int(a[last % 4, 0])  # warps per launch
    print(f"{n} tokens: {W} warps per launch; gpu us {plain:.2f} plain, {stamped:.2f} with stamps")
    for launch in (last - 2, last - 1, last):
        s = a[launch % 4, 16: 16 + 8 * W].reshape(W, 8).astype(np.int64)
        p = a[(launch - 1) % 4, 16: 16 + 8 * W].reshape(W, 8).astype(np.int64)
        ref = s[:, 1].min()
        rel = lambda x: ((x - ref + (1 << 31)) % (1 << 32)) - (1 << 31)  # uint32 wrap
        print(f"  launch {launch}: previous launch's last exit {rel(p[:, 5].max()) / 1e3:+.2f} us, "
              f"its last first-unit store {rel(p[:, 4].max()) / 1e3:+.2f} us")
        for k, name in enumerate(NAMES):
            col = s[:, k]
            used = col != 0
            used = used & (np.abs(rel(col)) < 10**6)  # blocks with nothing to do leave stale stamps
            q = np.percentile(rel(col[used]) / 1e3, [0, 10, 50, 90, 100])
            print(f"    {name:>15}: " + " ".join(f"{v:+6.2f}" for v in q) + f"   ({used.sum()} warps)")
