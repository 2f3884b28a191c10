"""GPU benchmark of the store and the gather (``nvfp4kv bench``, ``benchmarks/bench_store.py``).

One run measures the ceilings and the library side by side, so ratios are taken against the same
GPU in the same state:

- device-to-device copy bandwidth on a >= 1 GiB buffer, counting bytes read + written;
- the time of an empty kernel launch, back to back on a stream and per node inside a CUDA graph;
- the store at several token counts and configurations, and the gather: median µs (CUDA events)
  two ways, GB/s under the byte model (store: read 2*H*D*elem + write 2*H*(D/2 + D/16) + slot
  bytes per token) and the fraction of the measured copy bandwidth.

The two times: "us" is back-to-back calls from Python, so for small calls it is the host's cost
per call (the "x launch" ratio compares it with the empty kernel launched back to back, its samples
alternating with the case's so both see the same state of the host); "gpu us" is
the same calls queued while the GPU is kept busy, so the host is ahead and the events time the
device alone (what a CUDA graph or an engine whose CPU runs ahead sees). "graph us" is per store
inside a CUDA graph of GRAPH_NODES stores, timed the same way as the empty kernel's graph node.
"%sized" sets "gpu us" against a copy of the case's own byte count timed the same way, over as
many buffer pairs as the case has input sets (the copy ceiling at that size, start-up and tail
included).

Needs torch with CUDA. Results are printed as a table and optionally written as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Callable, Dict, List, Optional

from .progress import Progress

TOKENS = (1, 16, 64, 256, 1024, 4096, 16384, 65536)
GRAPH_NODES = 100  # captures per CUDA graph, the same for the empty kernel and the store


def _who() -> str:
    """The program to name in messages: the benchmark script, or the CLI (nvfp4kv)."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return name if name.endswith(".py") and name != "__main__.py" else "nvfp4kv bench"  # python -m nvfp4kv


def _torch():
    import torch

    if not torch.cuda.is_available():
        raise SystemExit(f"{_who()}: no CUDA device visible to torch; the benchmark needs a GPU")
    return torch


def check_json_path(path: str, *, new: bool) -> str:
    """``path`` if the results can be written there after the run, else ``ValueError`` saying
    why (checked before a long run, so a bad path costs nothing). ``new``: an existing file is
    refused (nothing is overwritten). The directory is probed by creating a file in it:
    ``os.access`` says yes to root and on read-only mounts."""
    if not path.strip():
        raise ValueError("empty path")
    if os.path.isdir(path):
        raise ValueError(f"{path!r} is a directory")
    if path.endswith(os.sep) or (os.altsep and path.endswith(os.altsep)):  # abspath would drop it
        raise ValueError(f"{path!r} names a directory, not a file")
    if new and os.path.lexists(path):
        raise ValueError(f"{path!r} exists; choose a new path (nothing is overwritten)")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        why = "is not a directory" if os.path.exists(parent) else "does not exist"
        raise ValueError(f"{path!r}: directory {parent!r} {why}")
    try:  # the probe below has a short name of its own: a name too long for the file system fails here
        name_max = os.pathconf(parent, "PC_NAME_MAX")
    except (AttributeError, ValueError, OSError):
        name_max = None
    if name_max and len(os.fsencode(os.path.basename(path))) > name_max:
        raise ValueError(f"{path!r}: the file name is longer than {parent!r} allows ({name_max} bytes)")
    try:
        fd, probe = tempfile.mkstemp(prefix=".nvfp4kv-", suffix=".probe", dir=parent)
    except OSError as e:
        raise ValueError(f"{path!r}: cannot create a file in {parent!r} ({e.strerror or e})") from None
    os.close(fd)
    os.unlink(probe)
    return path


def _medians_per_call(torch, fns: List[Callable[[], None]], calls: int, repeats: int) -> List[float]:
    """For each fn, the median over `repeats` of (event time of `calls` back-to-back calls) / calls,
    in µs. The functions' samples alternate, so host-bound calls timed together see the same host
    state (on the lent machines the host's time per call drifts by up to 50 % within seconds)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples: List[List[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, out in zip(fns, samples):
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) * 1000.0 / calls)
    return [statistics.median(s) for s in samples]


def _median_per_call(torch, fn: Callable[[], None], calls: int, repeats: int) -> float:
    """Median over `repeats` of (event time of `calls` back-to-back calls) / calls, in µs."""
    return _medians_per_call(torch, [fn], calls, repeats)[0]


def _empty_kernel(torch) -> None:
    torch.cuda._sleep(0)  # a kernel that does nothing


def _queued_per_call(torch, fn: Callable[[], None], calls: int, repeats: int) -> float:
    """Median µs per call of `calls` back-to-back calls queued while the GPU spins: device time
    with the host ahead of the GPU, as in an engine whose CPU runs ahead (or a CUDA graph).

    A spin kernel (torch.cuda._sleep) keeps the GPU busy while the host queues the calls between
    two events; a sample counts only if the GPU had not reached the start event when the last
    call was queued, else the spin doubles and the sample is taken again."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    spin = 1 << 20  # cycles, about 0.5 ms at 2 GHz
    samples = []
    while len(samples) < repeats:
        torch.cuda._sleep(spin)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        host_ahead = not start.query()
        end.synchronize()
        if host_ahead:
            samples.append(start.elapsed_time(end) * 1000.0 / calls)
        elif spin < 1 << 34:
            spin *= 2
        else:
            raise RuntimeError(f"{_who()}: the host cannot queue the calls ahead of the GPU")
    return statistics.median(samples)


def _graph_per_call(torch, fn: Callable[[], None], calls: int, repeats: int) -> float:
    """Median µs per call of `calls` captures of fn replayed as one CUDA graph, five replays
    queued behind a GPU spin (so the host's submission of a replay is not timed)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()  # warm up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return _queued_per_call(torch, graph.replay, 5, repeats) / calls


def measure_ceilings(torch, copy_bytes: int = 1 << 30, quick: bool = False) -> Dict[str, float]:
    src = torch.empty(copy_bytes, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    dst.copy_(src)
    t_us = _median_per_call(torch, lambda: dst.copy_(src), 5 if quick else 10, 5 if quick else 10)
    copy_gbs = 2 * copy_bytes / (t_us * 1e-6) / 1e9
    del src, dst
    empty = lambda: _empty_kernel(torch)
    launch_us = _median_per_call(torch, empty, 200, 10)
    graph_us = _graph_per_call(torch, empty, GRAPH_NODES, 10)
    return {"copy_GBps": copy_gbs, "empty_launch_us": launch_us,
            "empty_graph_node_us": graph_us}


def copy_gpu_us(torch, nbytes: int, sets: int = 1, quick: bool = False) -> float:
    """Device time of a device-to-device copy moving `nbytes` in all (nbytes / 2 read, nbytes / 2
    written), queued like the cases' "gpu us": the copy ceiling at a case's own size, where launch
    ramp-up and tail weigh as they do on the case (the 1 GiB copy hides them). `sets` buffer pairs
    take turns, as the case's input sets do, so L2 holds what it holds for the case."""
    half = max(16, nbytes // 2)
    pairs = [(torch.empty(half, dtype=torch.uint8, device="cuda"), torch.empty(half, dtype=torch.uint8, device="cuda"))
             for _ in range(max(1, sets))]
    state = {"i": 0}

    def call():
        src, dst = pairs[state["i"] % len(pairs)]
        state["i"] += 1
        dst.copy_(src)

    us = _queued_per_call(torch, call, _calls(nbytes), 5 if quick else 15)
    del pairs
    return us


def _calls(nbytes: int) -> int:
    """Calls per timing sample for a case or copy of `nbytes`: about 200 MB per sample, 10 to 200
    calls. At least 10: with a single call the events also bracket the host's preparation of that
    call while the GPU idles (7-14 us on a 100 us kernel; docs/design-notes.md, "Benchmark: what is
    timed"); back to back, later calls are prepared while earlier ones run, as in an engine."""
    return max(10, min(200, int(2e8 // max(nbytes, 1))))


def _time_case(torch, call: Callable[[], None], nbytes: int, quick: bool):
    """A case's (us, launch_us, gpu_us): back to back from Python, an empty kernel's launch timed
    alternately with it (the "x launch" reference), and queued with the host ahead."""
    calls = _calls(nbytes)
    repeats = 5 if quick else 15
    us, launch_us = _medians_per_call(torch, [call, lambda: _empty_kernel(torch)], calls, repeats)
    return us, launch_us, _queued_per_call(torch, call, calls, repeats)


def _case_bytes(n: int, H: int, D: int, elem: int, slot_bytes: int = 8) -> int:
    return n * (2 * H * D * elem + 2 * H * (D // 2 + D // 16) + slot_bytes)


def bench_store_case(torch, nvfp4kv, n: int, H: int = 8, D: int = 128, T: int = 16,
                     dtype: str = "bfloat16", layout: str = "HND", recipe: str = "nvfp4",
                     scale_layout: str = "vllm", quick: bool = False, graph: bool = False,
                     slots: str = "random", scales: str = "device", workspace: bool = False,
                     prepared: bool = False) -> Dict:
    tdtype = getattr(torch, dtype)
    pages = (n + T - 1) // T
    spec = nvfp4kv.KVCacheSpec(block_size=T, num_kv_heads=H, head_size=D, cache_dtype="nvfp4")
    # Several input sets so that small cases do not time a warm L2 on the same bytes.
    sets = max(1, min(8, (256 << 20) // max(1, _case_bytes(n, H, D, tdtype.itemsize))))
    inputs = []
    for _ in range(sets):
        kv = nvfp4kv.allocate_kv_cache(spec, pages, layout=layout, device="cuda", backend="torch")
        key = torch.randn(n, H, D, dtype=tdtype, device="cuda")
        value = torch.randn(n, H, D, dtype=tdtype, device="cuda")
        if slots == "random":  # random unique slots (the case)
            slot_mapping = torch.randperm(pages * T, device="cuda")[:n]
        elif slots == "sequential":  # a prefill into fresh pages: whole rows, in order
            slot_mapping = torch.arange(n, device="cuda")
        else:  # "skip": every token padded (-1): nothing is written (a diagnostic of the fixed costs)
            slot_mapping = torch.full((n,), -1, device="cuda")
        inputs.append((key, value, kv, slot_mapping))
    # "device": 1-element GPU tensors, read by the kernel (vLLM's layer scales; graph-safe);
    # "host": Python floats, passed by value.
    k_scale = torch.tensor([0.02], device="cuda") if scales == "device" else 0.02
    v_scale = torch.tensor([0.02], device="cuda") if scales == "device" else 0.02
    # One workspace for every input set, as an engine keeps one for all layers.
    ws = nvfp4kv.store_workspace(inputs[0][2]) if workspace else None
    # prepared: one prepare_store per cache (an engine keeps one per layer), called per step.
    stores = [nvfp4kv.prepare_store(kv, k_scale, v_scale, recipe=recipe, scale_layout=scale_layout, workspace=ws)
              for _, _, kv, _ in inputs] if prepared else None
    state = {"i": 0}

    def call():
        key, value, kv, slot_mapping = inputs[state["i"] % sets]
        if stores:
            stores[state["i"] % sets](key, value, slot_mapping)
        else:
            nvfp4kv.store(key, value, kv, slot_mapping, k_scale, v_scale, recipe=recipe, scale_layout=scale_layout,
                          workspace=ws)
        state["i"] += 1

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    total = _case_bytes(n, H, D, tdtype.itemsize)
    us, launch_us, gpu_us = _time_case(torch, call, total, quick)
    row = {"tokens": n, "launch_us": launch_us, "H": H, "D": D, "T": T, "dtype": dtype, "layout": layout, "recipe": recipe,
           "scale_layout": scale_layout, "slots": slots, "scales": scales, "us": us, "gpu_us": gpu_us, "bytes": total,
           "sets": sets, "workspace": workspace, "prepared": prepared}
    if graph:
        row["graph_us"] = _graph_per_call(torch, call, GRAPH_NODES, 5 if quick else 10)
    return row


def gather_case(torch, nvfp4kv, n: int, H: int = 8, D: int = 128, T: int = 16, seqs: int = 8,
                dtype: str = "bfloat16") -> Dict:
    """The benchmark's gather of n tokens in `seqs` equal sequences, pages in random order (also
    used by tools/gather_diag.py and gather_timeline.py): its tensors, and "call", which
    runs it (outputs and cu_seqlens given: no host sync)."""
    pages = (n + T - 1) // T
    spec = nvfp4kv.KVCacheSpec(block_size=T, num_kv_heads=H, head_size=D, cache_dtype="nvfp4")
    kv = nvfp4kv.allocate_kv_cache(spec, pages, layout="HND", device="cuda", backend="torch")
    kv.random_(0, 127)  # arbitrary bytes; scale bytes < 0x7F so no NaN groups
    per_seq = n // seqs
    blocks = (per_seq + T - 1) // T
    order = torch.randperm(pages, device="cuda")
    c = {"kv_cache": kv, "block_table": order[: seqs * blocks].view(seqs, blocks).to(torch.int32),
         "seq_lens": torch.full((seqs,), per_seq, dtype=torch.int32, device="cuda"),
         "cu_seqlens": torch.arange(seqs + 1, dtype=torch.int32, device="cuda") * per_seq,
         "key_out": torch.empty(seqs * per_seq, H, D, dtype=getattr(torch, dtype), device="cuda"),
         "k_scale": torch.tensor([0.02], device="cuda")}
    c["value_out"] = torch.empty_like(c["key_out"])
    c["call"] = lambda block_table=c["block_table"]: nvfp4kv.gather_dequant(
        c["kv_cache"], block_table, c["seq_lens"], c["k_scale"], c["k_scale"], cu_seqlens=c["cu_seqlens"],
        key_out=c["key_out"], value_out=c["value_out"])
    return c


def bench_gather_case(torch, nvfp4kv, n: int, H: int = 8, D: int = 128, T: int = 16,
                      seqs: int = 8, dtype: str = "bfloat16", quick: bool = False) -> Dict:
    """gather_dequant of n tokens in `seqs` equal sequences, pages in random order."""
    call = gather_case(torch, nvfp4kv, n, H, D, T, seqs, dtype)["call"]
    per_seq = n // seqs
    tdtype = getattr(torch, dtype)

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    tokens = seqs * per_seq
    total = tokens * (2 * H * (D // 2 + D // 16) + 2 * H * D * tdtype.itemsize)
    us, launch_us, gpu_us = _time_case(torch, call, total, quick)
    return {"tokens": tokens, "launch_us": launch_us, "H": H, "D": D, "T": T, "dtype": dtype, "seqs": seqs, "us": us,
            "gpu_us": gpu_us, "bytes": total, "sets": 1}


def run(quick: bool = False, json_path: Optional[str] = None, progress: bool = True) -> Dict:
    torch = _torch()
    import nvfp4kv

    info = nvfp4kv.build_info()
    if not info["cuda_available"]:
        raise SystemExit(f"{_who()}: CUDA unavailable in nvfp4kv: {info['cuda_unavailable_reason']}")
    cases: List[Dict] = []
    tokens = (1, 64, 4096, 65536) if quick else TOKENS
    for n in tokens:
        cases.append(dict(n=n, graph=n <= 1024))
    # Small stores through prepare_store (cache, scales imported once): the host's share of a call.
    cases += [dict(n=n, prepared=True) for n in ((1,) if quick else (1, 16, 64))]
    if not quick:
        for extra in (dict(D=64), dict(D=256), dict(H=32), dict(H=32, workspace=True), dict(dtype="float16"),
                      dict(layout="NHD", scale_layout="linear"), dict(recipe="nvfp4_4over6")):
            for n in (16384, 65536):
                cases.append(dict(n=n, **extra))
    # Batches whose rows overflow L2 several times, without and with a store workspace (which
    # takes them in page order from 3 times the L2: here 65536 tokens of H 32, 262144 of H 8).
    cases += [dict(n=1 << 18), dict(n=1 << 18, workspace=True)]
    ceil = measure_ceilings(torch, quick=quick)
    rows = []
    t0 = time.time()
    status = Progress(enabled=progress)
    for i, case in enumerate(cases):
        status(f"[{i + 1}/{len(cases)}] tokens={case['n']} {case}")
        rows.append(bench_store_case(torch, nvfp4kv, quick=quick, **case))
    gather_tokens = (4096, 65536, 1 << 20) if quick else (4096, 16384, 65536, 262144, 1 << 20)
    gather_rows = []
    for i, n in enumerate(gather_tokens):
        status(f"[gather {i + 1}/{len(gather_tokens)}] tokens={n}")
        gather_rows.append(bench_gather_case(torch, nvfp4kv, n, quick=quick))
    copies: Dict = {}  # the copy ceiling at each case's size and number of input sets
    sizes = sorted({(r["bytes"], r["sets"]) for r in rows + gather_rows})
    torch.cuda.empty_cache()  # the cases' buffers, before the largest copies allocate theirs
    for i, (nbytes, sets) in enumerate(sizes):
        status(f"[copy {i + 1}/{len(sizes)}] {nbytes} bytes")
        copies[nbytes, sets] = copy_gpu_us(torch, nbytes, sets, quick=quick)
    status.done(f"{len(cases) + len(gather_tokens)} cases in {time.time() - t0:.1f} s")
    for r in rows + gather_rows:
        for key, t in (("", r["us"]), ("_gpu", r["gpu_us"])):
            r["GBps" + key] = r["bytes"] / (t * 1e-6) / 1e9
            r["frac_copy" + key] = r["GBps" + key] / ceil["copy_GBps"]
        r["x_launch"] = r["us"] / r["launch_us"]
        r["copy_gpu_us"] = copies[r["bytes"], r["sets"]]
        r["frac_size_copy"] = r["copy_gpu_us"] / r["gpu_us"]
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "nvfp4kv": nvfp4kv.__version__, "ceilings": ceil, "store": rows,
              "gather": gather_rows}
    if json_path:
        write_json(json_path, result)
    return result


def write_json(path: str, result: Dict, *, replace: bool = True) -> None:
    """Writes ``result`` as JSON to ``path`` whole or not at all: into a temporary file beside it,
    then renamed over it (a failed write leaves what was there). ``replace=False``: ``path`` must
    be a new file, checked when it appears (a hard link, which fails if anything took the name
    meanwhile: ``FileExistsError``), so nothing is ever overwritten."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".nvfp4kv-", suffix=".json", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(result, f, indent=1)
        os.chmod(tmp, 0o666 & ~_umask())  # as open() would create it (mkstemp's file is 0600)
        if replace:
            os.replace(tmp, path)
            return
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise
        except OSError:  # a file system without hard links: an exclusive create instead
            with open(tmp) as src:
                data = src.read()
            dst = open(path, "x")  # FileExistsError if the name was taken meanwhile
            try:
                with dst:
                    dst.write(data)
            except BaseException:  # a short write (a full disk): the file made here goes (review)
                os.unlink(path)
                raise
        os.unlink(tmp)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise


def _umask() -> int:
    """The process's umask, read without changing it (Linux), else the common 022."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


def _pct(row: Dict, key: str) -> str:
    return f"{100 * row[key]:.1f}%" if key in row else ""


def _api(row: Dict) -> str:
    return "prep" if row.get("prepared") else "ws" if row.get("workspace") else ""


def format_table(result: Dict) -> str:
    c = result["ceilings"]
    lines = [
        f"GPU: {result['gpu']}   nvfp4kv {result['nvfp4kv']}   torch {result['torch']}",
        f"ceilings: copy {c['copy_GBps']:.0f} GB/s (read+write); empty kernel "
        f"{c['empty_launch_us']:.2f} us back to back, {c['empty_graph_node_us']:.2f} us per graph node",
        "us: back-to-back calls from Python; xlaunch: us / an empty kernel's launch timed alternately "
        "with it (launch us); gpu us: the same calls queued with the host ahead (device time); %sized: a copy of "
        "the case's bytes (same device timing) over gpu us; api: ws with a store workspace, prep through "
        "prepare_store",
        "",
        f"{'tokens':>7} {'H':>3} {'D':>4} {'dtype':>9} {'layout':>6} {'recipe':>13} {'api':>4} {'us':>8} "
        f"{'%copy':>6} {'xlaunch':>7} {'launch us':>9} {'gpu us':>8} {'GB/s':>6} {'%copy':>6} {'%sized':>6} "
        f"{'graph us':>8}",
    ]
    for r in result["store"]:
        g = f"{r['graph_us']:.2f}" if "graph_us" in r else ""
        lines.append(
            f"{r['tokens']:>7} {r['H']:>3} {r['D']:>4} {r['dtype']:>9} {r['layout']:>6} "
            f"{r['recipe']:>13} {_api(r):>4} {r['us']:>8.2f} {100 * r['frac_copy']:>5.1f}% {r['x_launch']:>7.2f} "
            f"{r['launch_us']:>9.2f} {r['gpu_us']:>8.2f} {r['GBps_gpu']:>6.0f} {100 * r['frac_copy_gpu']:>5.1f}% "
            f"{_pct(r, 'frac_size_copy'):>6} {g:>8}"
        )
    if result.get("gather"):
        lines += ["", "gather_dequant (bf16 out; bytes: read 2*H*F + write 2*H*D*2 per token)",
                  f"{'tokens':>8} {'seqs':>5} {'H':>3} {'D':>4} {'us':>8} {'%copy':>6} "
                  f"{'gpu us':>8} {'GB/s':>6} {'%copy':>6} {'%sized':>6}"]
        for r in result["gather"]:
            lines.append(f"{r['tokens']:>8} {r['seqs']:>5} {r['H']:>3} {r['D']:>4} {r['us']:>8.2f} "
                         f"{100 * r['frac_copy']:>5.1f}% {r['gpu_us']:>8.2f} {r['GBps_gpu']:>6.0f} "
                         f"{100 * r['frac_copy_gpu']:>5.1f}% {_pct(r, 'frac_size_copy'):>6}")
    return "\n".join(lines)



# ---- amax (nvfp4kv.amax, ScaleTracker.update) -----------------------------------------------------

AMAX_ELEMENTS = (1 << 12, 1 << 16, 1 << 20, 1 << 24, 1 << 28)


def bench_amax_case(torch, nvfp4kv, numel: int, dtype: str = "bfloat16", layout: str = "contiguous",
                    accumulate: bool = True, quick: bool = False) -> Dict:
    """One amax case: ``numel`` elements of ``dtype`` read once (the byte model: numel * elem bytes).

    layout "contiguous": a flat tensor; "rows": the K part of a fused QKV projection,
    ``qkv[:, :H*D]`` of rows of 3*H*D (a strided view with contiguous rows of 1024 elements);
    "misaligned": a flat view starting 2 elements past a 16-byte boundary (scalar ends, vector
    body). Returns us (back to back), gpu_us (host ahead) and the bytes read.
    """
    tdtype = getattr(torch, dtype)
    elem = torch.empty(0, dtype=tdtype).element_size()
    if layout == "rows":
        inner = 1024
        rows = max(1, numel // inner)
        x = torch.randn(rows, 3 * inner, dtype=tdtype, device="cuda")[:, :inner]
    elif layout == "misaligned":
        x = torch.randn(numel + 2, dtype=tdtype, device="cuda")[2:]
    else:
        x = torch.randn(numel, dtype=tdtype, device="cuda")
    out = torch.zeros(1, dtype=torch.float32, device="cuda")
    acc = 1 if accumulate else 0
    stream = torch.cuda.current_stream().cuda_stream
    call = lambda: nvfp4kv._C.amax(x, out, acc, stream)  # noqa: E731
    call()
    torch.cuda.synchronize()
    want = x.abs().max().float()
    if not torch.equal(out[0], want):
        raise RuntimeError(f"{_who()}: amax {out.item()} != torch's {want.item()} ({dtype}, {layout})")
    nbytes = x.numel() * elem
    us, launch_us, gpu_us = _time_case(torch, call, nbytes, quick)
    return {"numel": x.numel(), "dtype": dtype, "layout": layout, "accumulate": accumulate, "bytes": nbytes,
            "us": us, "launch_us": launch_us, "gpu_us": gpu_us}


def bench_amax(quick: bool = False, json_path: Optional[str] = None, progress: bool = True) -> Dict:
    """The amax kernel's throughput: GB/s read, against the device-to-device copy ceiling
    (measure_ceilings: bytes read + written per second) and against a copy of the same bytes
    (copy_gpu_us of 2 * bytes: as many bytes read as the amax reads). Needs torch with CUDA."""
    torch = _torch()
    import nvfp4kv

    cases: List[Dict] = []
    sizes = (1 << 16, 1 << 24, 1 << 28) if quick else AMAX_ELEMENTS
    for numel in sizes:
        for dtype in ("bfloat16", "float32"):
            cases.append(dict(numel=numel, dtype=dtype))
    for numel in ((1 << 24,) if quick else (1 << 20, 1 << 24)):
        cases += [dict(numel=numel, layout="rows"), dict(numel=numel, layout="misaligned"),
                  dict(numel=numel, accumulate=False)]
    ceil = measure_ceilings(torch, quick=quick)
    rows = []
    status = Progress(enabled=progress)
    for i, case in enumerate(cases):
        status(f"[amax {i + 1}/{len(cases)}] {case}")
        row = bench_amax_case(torch, nvfp4kv, quick=quick, **case)
        torch.cuda.empty_cache()
        row["copy_gpu_us"] = copy_gpu_us(torch, 2 * row["bytes"], quick=quick)
        for key, t in (("", row["us"]), ("_gpu", row["gpu_us"])):
            row["GBps" + key] = row["bytes"] / (t * 1e-6) / 1e9
            row["frac_copy" + key] = row["GBps" + key] / ceil["copy_GBps"]
        row["frac_size_copy"] = row["copy_gpu_us"] / row["gpu_us"]
        rows.append(row)
    status.done()
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "nvfp4kv": nvfp4kv.__version__,
              "ceilings": ceil, "amax": rows}
    if json_path:
        write_json(json_path, result)
    return result


def format_amax_table(result: Dict) -> str:
    ceil = result["ceilings"]
    lines = [f"amax on {result['gpu']} (copy ceiling {ceil['copy_GBps']:.0f} GB/s read + written)",
             f"{'elements':>10} {'dtype':>8} {'layout':>10} {'acc':>3} {'us':>9} {'gpu us':>9} {'GB/s':>7} "
             f"{'%copy':>6} {'%sized':>6}"]
    for r in result["amax"]:
        lines.append(f"{r['numel']:>10} {r['dtype']:>8} {r['layout']:>10} {int(r['accumulate']):>3} {r['us']:>9.2f} "
                     f"{r['gpu_us']:>9.2f} {r['GBps_gpu']:>7.0f} {_pct(r, 'frac_copy_gpu'):>6} "
                     f"{_pct(r, 'frac_size_copy'):>6}")
    return "\n".join(lines)


def json_path_arg(text: str, *, new: bool = False) -> str:
    """argparse ``type`` of a results file: :func:`check_json_path` with argparse's error (the
    benchmark scripts may replace a file; ``nvfp4kv bench --output`` passes ``new=True``)."""
    try:
        return check_json_path(text, new=new)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv: Optional[List[str]] = None) -> int:
    """``benchmarks/bench_store.py``: the table on stdout, then the JSON (replaced if it exists;
    ``nvfp4kv bench --output`` writes only new files)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    ap.add_argument("--json", metavar="PATH", type=json_path_arg, help="also write the results as JSON")
    args = ap.parse_args(argv)
    result = run(quick=args.quick)
    print(format_table(result), flush=True)  # before the file: a failed write loses nothing
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
