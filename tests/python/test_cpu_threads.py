"""The CPU path on several threads (nvfp4kv.set_cpu_threads): the same bytes as the reference and
as one thread, duplicate slots, padding, bad block-table entries and pages listed twice included.

The calls are large enough (about 2M elements) that every thread count tested gets its threads
(a call takes one thread per 131072 elements at most)."""
import os
import subprocess
import sys

import numpy as np
import pytest
import reference as ref
from conftest import assert_bytes_equal, make_cache, make_kv, make_slots, run_store

torch = pytest.importorskip("torch")

THREADS = (1, 2, 3, 8)
N, T, H, D = 160, 16, 4, 128
n = 2048


@pytest.fixture(autouse=True)
def _restore_threads(nv):
    yield
    nv.set_cpu_threads(int(os.environ.get("NVFP4KV_CPU_THREADS") or 0))


def _slots(rng):
    """Random slots with about one in five a duplicate of an earlier one, padding and out of range."""
    slots = rng.permutation(N * T)[:n].astype(np.int64)
    dup = rng.random(n) < 0.2
    slots[dup] = slots[rng.integers(0, n, dup.sum())]
    slots[::37] = -1
    slots[5::101] = N * T + 3
    return slots


@pytest.mark.parametrize("recipe", ref.RECIPES)
@pytest.mark.parametrize("threads", THREADS)
def test_store_equals_reference_on_threads(nv, recipe, threads):
    rng = np.random.default_rng(threads)
    nv.set_cpu_threads(threads)
    assert nv.cpu_threads() == threads
    cache = make_cache(N, T, H, D, "5d", "HND", "torch", seed=threads)
    k = rng.standard_normal((n, H, D)).astype(np.float32)
    v = rng.standard_normal((n, H, D)).astype(np.float32)
    key, value, k32, v32 = make_kv(k, v, "bfloat16", "torch")
    run_store(nv, cache, key, value, k32, v32, make_slots(_slots(rng), backend="torch"), 0.3, 0.7, recipe)


def test_dequantize_and_gather_same_bytes_on_threads(nv):
    rng = np.random.default_rng(5)
    cache = make_cache(N, T, H, D, "5d", "HND", "torch", seed=5)
    k = rng.standard_normal((N * T, H, D)).astype(np.float32)
    key, value, _, _ = make_kv(k, k[::-1].copy(), "bfloat16", "torch")
    nv.store(key, value, slot_mapping=make_slots(rng.permutation(N * T), backend="torch"), k_scale=0.3,
             v_scale=0.7, **cache.kwargs())
    kv = cache.kwargs()["kv_cache"]
    # Pages 3 and 0 listed twice, bad ids; every page listed, so every output row is written.
    pages = torch.tensor([3, 7, -1, 3, N, 0] + list(rng.permutation(N)), dtype=torch.int64)
    table = torch.from_numpy(rng.integers(-2, N + 2, (6, 40))).to(torch.int32)  # bad entries give zeros
    seq_lens = torch.tensor([600, 0, 17, 640, 300, 500], dtype=torch.int32)
    got = []
    for threads in THREADS:
        nv.set_cpu_threads(threads)
        deq = nv.dequantize(kv, 0.3, 0.7, pages=pages)
        gat = nv.gather_dequant(kv, table, seq_lens, 0.3, 0.7)
        got.append([t.contiguous().view(torch.uint8).numpy().copy() for t in (*deq, *gat[:2])])
    for other in got[1:]:
        for a, b in zip(got[0], other):
            assert_bytes_equal(b, a)


def test_thread_setting_and_environment(nv):
    with pytest.raises(ValueError, match="threads"):
        nv.set_cpu_threads(-1)
    nv.set_cpu_threads(0)
    assert 1 <= nv.cpu_threads() <= 16
    code = "import nvfp4kv; print(nvfp4kv.cpu_threads())"
    env = dict(os.environ, NVFP4KV_CPU_THREADS="3")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "3"
