#!/usr/bin/env python3
"""When does each warp of the decode reader start, finish its setup, its first step and its
loop, and end; and do the blocks sharing an SM finish together? Needs a build of a source tree
hooked by tools/decode_hooks.py with -DNVFP4KV_DECODE_TIMELINE (the shipped kernels have no hook).

Usage: python tools/decode_timeline.py PKG_DIR [BxL,...]   (PKG_DIR: its pip install --target)
Prints, per case of benchmarks/bench_decode.py's geometry, percentiles over warps (µs: from the
first warp's start by %globaltimer, durations by clock64 at 1.98 GHz), and per SM the blocks'
loop times by their start order; writes the raw records to $OUT (or /tmp) as tl_BxL.npy.
"""
import ctypes
import glob
import os
import pathlib
import sys

import numpy as np

pkg = sys.argv[1]
cases = (sys.argv[2] if len(sys.argv) > 2 else "64x16384,64x4096,16x4096,4x32768,1x1024").split(",")
sys.path.insert(0, pkg)
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "benchmarks"))
import torch  # noqa: E402

import bench_decode as bd  # noqa: E402

lib = ctypes.CDLL(glob.glob(pkg + "/nvfp4kv/lib/libnvfp4kv.so*")[0])
timeline = lib.nvfp4kv_diag_timeline
timeline.argtypes = [ctypes.c_void_p, ctypes.c_int]
GHZ = 1.98  # SM clock under load on the H200 (clock64 -> µs)


def pct(a, qs=(10, 50, 90, 100)):
    return " ".join(f"{np.percentile(a, q):8.2f}" for q in qs)


for c in cases:
    B, L = (int(x) for x in c.split("x"))
    case = bd.make_case(bd.Spec(B=B, L=L))
    for _ in range(5):
        case["ours"]()
    torch.cuda.synchronize()
    timeline(None, 2)
    case["ours"]()
    torch.cuda.synchronize()
    tl = np.zeros((16384, 12), np.uint64)
    cb = np.zeros((8192, 4), np.uint64)
    assert timeline(tl.ctypes.data, 0) == 0 and timeline(cb.ctypes.data, 1) == 0
    w = tl[tl[:, 0] != 0].astype(np.int64)
    np.save(os.path.join(os.environ.get("OUT", "/tmp"), f"tl_{c}.npy"), w)
    t0 = w[:, 0].min()
    at = lambda i: (w[:, 2 * i] - t0) / 1000.0  # noqa: E731
    span = lambda i, j: (w[:, 2 * j + 1] - w[:, 2 * i + 1]) / (GHZ * 1000.0)  # noqa: E731
    steps = w[:, 11]
    print(f"== {c}: {len(w)} warps on {len(set(w[:, 10]))} SMs, {int(np.median(steps))} steps per warp")
    print(f"  (p10 p50 p90 max, µs)      start {pct(at(0))}")
    print(f"  setup (to the query fragment) {pct(span(0, 1))}")
    print(f"                     first step {pct(span(1, 2))}")
    print(f"                  per loop step {pct(span(1, 3) / np.maximum(steps, 1))}")
    print(f"                       epilogue {pct(span(3, 4))}")
    print(f"                            end {pct(at(4))}")
    nb = len(w) // 4  # blocks of 4 warps, in launch order
    wb = w[: nb * 4].reshape(nb, 4, 12)
    loop = ((wb[:, :, 7] - wb[:, :, 3]) / (GHZ * 1000.0)).max(1)
    start = wb[:, :, 0].min(1)
    per_sm = {}
    for i in range(nb):
        per_sm.setdefault(int(wb[i, 0, 10]), []).append(i)
    full = [v for v in per_sm.values() if len(v) == max(len(x) for x in per_sm.values())]
    ranks = np.array([[loop[i] for i in sorted(v, key=lambda i: (start[i], i))] for v in full])
    print(f"  {len(full)} SMs with {ranks.shape[1]} blocks: mean loop µs by start order on the SM:",
          " ".join(f"{x:.1f}" for x in ranks.mean(0)))
    k = cb[cb[:, 0] != 0].astype(np.int64)
    if len(k):
        print(f"  split merge ({len(k)} blocks): entry {pct((k[:, 0] - t0) / 1000)}; "
              f"waited until {pct((k[:, 1] - t0) / 1000)}; end {pct((k[:, 2] - t0) / 1000)}")
    del case
    torch.cuda.empty_cache()
