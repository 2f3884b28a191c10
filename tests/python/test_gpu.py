"""GPU tests: the CUDA kernels against the CPU path, byte for byte, on the whole cache.

Every case fills one byte buffer with a random poison pattern, hands the library a view of it
(5-D HND/NHD, packed 4-D, or two sides), runs the same store on the CPU and on the GPU, and
compares every byte of the buffer. Skipped when no CUDA device (or no CUDA build) is present.
"""

import itertools
import os
import random
import subprocess
import sys
import zlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")
nvfp4kv = pytest.importorskip("nvfp4kv")

pytestmark = pytest.mark.skipif(
    not (torch.cuda.is_available() and nvfp4kv.build_info()["cuda_available"]),
    reason="needs a CUDA device and a CUDA build of nvfp4kv",
)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def full_dim(d):
    return d // 2 + d // 16


def make_raw(n_pages, side_bytes, pad, gen):
    """(N, page_stride) poisoned bytes on the CPU: 2 sides per page plus `pad` bytes."""
    raw = torch.randint(0, 256, (n_pages, 2 * side_bytes + pad), dtype=torch.uint8, generator=gen)
    return raw


def cache_views(raw, N, T, H, D, view, layout):
    """(kwargs for store/dequantize) viewing `raw` (CPU or CUDA) as the requested cache."""
    F = full_dim(D)
    side = H * T * F
    ps = raw.stride(0)
    if view == "5d":
        if layout == "HND":  # physical [N][2][H][T][F]
            kv = raw.as_strided((N, 2, T, H, F), (ps, side, F, T * F, 1))
        else:
            kv = raw.as_strided((N, 2, T, H, F), (ps, side, H * F, F, 1))
        return {"kv_cache": kv}
    if view == "packed4d":
        return {"kv_cache": raw.as_strided((N, 2 * H, T, F), (ps, T * F, F, 1))}
    strides = (ps, F, T * F, 1) if layout == "HND" else (ps, H * F, F, 1)
    k = raw.as_strided((N, T, H, F), strides)
    v = raw.as_strided((N, T, H, F), strides, raw.storage_offset() + side)
    return {"kv_cache": k, "value_cache": v}


def make_inputs(n, H, D, dtype, gen, special=True, fused=False):
    """Random heavy-tailed K/V, optionally with NaN/Inf/zero groups, optionally strided."""
    def one():
        x = torch.randn(n, H, D, generator=gen) * torch.exp(torch.randn(n, H, 1, generator=gen))
        if special and n > 0:
            flat = x.view(-1, 16)
            idx = torch.randint(0, flat.shape[0], (max(1, flat.shape[0] // 50),), generator=gen)
            kinds = torch.randint(0, 5, idx.shape, generator=gen)
            for i, k in zip(idx.tolist(), kinds.tolist()):
                if k == 0:
                    flat[i, random.randrange(16)] = float("nan")
                elif k == 1:
                    flat[i, random.randrange(16)] = float("inf") * random.choice((1, -1))
                elif k == 2:
                    flat[i] = 0.0
                elif k == 3:
                    flat[i] *= 1e-30  # tiny: scale underflows
                else:
                    flat[i] *= 1e6  # huge: scale saturates
        return x.to(dtype)

    if fused:  # views into a fused [n, (Hq + 2H) * D] QKV tensor
        qkv = torch.randn(n, (2 * H + 2 * H) * D, generator=gen).to(dtype)
        k = qkv[:, 2 * H * D:3 * H * D].view(n, H, D)
        v = qkv[:, 3 * H * D:].view(n, H, D)
        k.copy_(one())
        v.copy_(one())
        return k, v
    return one(), one()


def make_slots(n, N, T, gen, slot_dtype):
    perm = torch.randperm(N * T, generator=gen)
    slots = perm[:n].clone() if n <= N * T else torch.cat([perm, torch.full((n - N * T,), -1)])
    if n:
        pad = torch.rand(n, generator=gen) < 0.1
        slots[pad] = -1
        oob = torch.rand(n, generator=gen) < 0.05
        slots[oob] = N * T + torch.randint(0, 1000, (int(oob.sum()),), generator=gen)
    return slots.to(slot_dtype)


def garbage_workspace(N, T, gen):
    """A store workspace for (N, T) on the GPU holding random bytes, but for its zero header."""
    ws = torch.randint(0, 256, (nvfp4kv.store_workspace_bytes(N, T),), dtype=torch.uint8, generator=gen)
    ws[:8] = 0
    return ws.cuda()


def run_both(N, T, H, D, view, layout, dtype, recipe, scale_layout, slot_dtype, n, seed,
             fused=False, pad=0, device_scales=False, scales=None, workspace=None, slots=None,
             prepared=False):
    """workspace (GPU call only): None, or a store workspace, or "garbage" for a fresh one of
    random bytes. slots: given, or random distinct ones with padding and out-of-range entries.
    prepared: the GPU call through prepare_store."""
    gen = torch.Generator().manual_seed(seed)
    random.seed(seed)
    F = full_dim(D)
    raw = make_raw(N, H * T * F, pad, gen)
    key, value = make_inputs(n, H, D, DTYPES[dtype], gen, fused=fused)
    if slots is None:
        slots = make_slots(n, N, T, gen, slot_dtype)
    if isinstance(workspace, str):
        workspace = garbage_workspace(N, T, gen)
    ks, vs = scales if scales is not None else (0.5 + random.random(), 0.01 + random.random() / 10)

    raw_cpu = raw.clone()
    nvfp4kv.store(key, value, slot_mapping=slots, k_scale=ks, v_scale=vs, recipe=recipe,
                  scale_layout=scale_layout, **cache_views(raw_cpu, N, T, H, D, view, layout))

    raw_gpu = raw.cuda()
    kd, vd, sd = key.cuda(), value.cuda(), slots.cuda()
    if fused:  # keep the token stride of the fused tensor on the GPU too
        kd = torch.empty_strided(key.size(), key.stride(), dtype=key.dtype, device="cuda")
        vd = torch.empty_strided(value.size(), value.stride(), dtype=value.dtype, device="cuda")
        kd.copy_(key)
        vd.copy_(value)
    gk = torch.tensor([ks], dtype=torch.float32, device="cuda") if device_scales else ks
    gv = torch.tensor([vs], dtype=torch.float32, device="cuda") if device_scales else vs
    views = cache_views(raw_gpu, N, T, H, D, view, layout)
    if prepared:
        nvfp4kv.prepare_store(views.pop("kv_cache"), gk, gv, recipe=recipe, scale_layout=scale_layout,
                              workspace=workspace, **views)(kd, vd, sd)
    else:
        nvfp4kv.store(kd, vd, slot_mapping=sd, k_scale=gk, v_scale=gv, recipe=recipe,
                      scale_layout=scale_layout, workspace=workspace, **views)
    torch.cuda.synchronize()
    got = raw_gpu.cpu()
    if not torch.equal(got, raw_cpu):
        diff = (got != raw_cpu).nonzero()
        pytest.fail(f"{diff.shape[0]} bytes differ, first at {diff[:5].tolist()}")
    if workspace is not None:  # left ready for the next call
        assert torch.all(workspace[:8].cpu() == 0)
    # Sanity: the call did write something where valid slots exist.
    valid = ((slots >= 0) & (slots < N * T)).sum().item()
    if valid:
        assert not torch.equal(raw_cpu, raw)
    return raw_cpu, (key, value, slots, ks, vs)


def stable_seed(case):
    """The same seed in every process (hash() of strings is randomized per process)."""
    return zlib.crc32(repr(case).encode()) & 0xFFFF


# A matrix over every option, thinned so that each value of each option appears many times.
def _matrix():
    rng = random.Random(1234)
    cases = []
    for dtype, recipe, view, slot_dtype in itertools.product(
        DTYPES, ("nvfp4", "nvfp4_4over6"), ("5d", "packed4d", "sides"), (torch.int64, torch.int32)
    ):
        for _ in range(3):
            layout = "HND" if view == "packed4d" else rng.choice(("HND", "NHD"))
            D = rng.choice((16, 32, 48, 64, 128, 192, 256, 512))
            T = rng.choice((1, 4, 16, 32, 5))
            scale_layout = "vllm" if (layout == "HND" and T % 4 == 0 and D % 64 == 0 and rng.random() < 0.7) else "linear"
            H = rng.choice((1, 2, 8))
            N = rng.choice((1, 3, 9))
            n = rng.choice((0, 1, 7, 64, N * T))
            cases.append((N, T, H, D, view, layout, dtype, recipe, scale_layout, slot_dtype, n))
    return cases


@pytest.mark.parametrize("case", _matrix(), ids=lambda c: "-".join(map(str, c[:10])).replace("torch.", ""))
def test_gpu_equals_cpu(case):
    run_both(*case, seed=stable_seed(case))


@pytest.mark.parametrize("case", _matrix()[::3], ids=lambda c: "-".join(map(str, c[:10])).replace("torch.", ""))
@pytest.mark.parametrize("device_scales", (False, True))
def test_prepared_store_equals_cpu(case, device_scales):
    run_both(*case, seed=stable_seed(case), prepared=True, device_scales=device_scales)


# Calls of a few tokens per SM with aligned inputs (up to 8 per SM for nvfp4, 2 for
# nvfp4_4over6) take their own kernel: one token per block, out scales computed per group. Most
# of the matrix above is that small. The same options again with more tokens than that on this
# GPU, through the kernels that step blocks over tokens with a per-block out-scale table.
def many_tokens():
    return 8 * torch.cuda.get_device_properties(0).multi_processor_count + 37


@pytest.mark.parametrize("case", _matrix(), ids=lambda c: "-".join(map(str, c[:10])).replace("torch.", ""))
def test_gpu_equals_cpu_many_tokens(case):
    N, T = case[0], case[1]
    n = many_tokens()
    N = max(N, -(-(n + 20) // T))  # room for every token, plus free slots
    run_both(N, *case[1:10], n, seed=stable_seed(case))


@pytest.mark.parametrize("view", ("5d", "sides"))
@pytest.mark.parametrize("dtype", ("bfloat16", "float32"))
def test_strided_inputs_and_padded_pages(view, dtype):
    run_both(6, 16, 4, 128, view, "HND", dtype, "nvfp4", "vllm", torch.int64, 80, seed=7, fused=True,
             pad=48)


def test_unaligned_page_stride_uses_scalar_path():
    run_both(5, 4, 2, 32, "5d", "NHD", "bfloat16", "nvfp4", "linear", torch.int32, 20, seed=3, pad=3)


@pytest.mark.parametrize("recipe", ("nvfp4", "nvfp4_4over6"))
def test_device_scales(recipe):
    run_both(8, 16, 8, 128, "5d", "HND", "bfloat16", recipe, "vllm", torch.int64, 100, seed=11,
             device_scales=True)


@pytest.mark.parametrize("many", (False, True))  # both store kernels (see many_tokens)
@pytest.mark.parametrize("H,D,layout,scale_layout", [(128, 128, "HND", "vllm"), (40, 144, "NHD", "linear")])
def test_long_rows_split_over_blocks(H, D, layout, scale_layout, many):
    """Token rows of more than 512 work items are split over gridDim.y (the small kernel has one
    group per item, the other two where the row allows); every slice must write its part and
    nothing else."""
    n = many_tokens() if many else 40
    run_both(-(-n // 16) + 2, 16, H, D, "5d", layout, "bfloat16", "nvfp4", scale_layout, torch.int64, n,
             seed=13)


@pytest.mark.parametrize("recipe,per_sm,extra", [("nvfp4", 3, 1), ("nvfp4", 8, 0), ("nvfp4", 8, 1),
                                                  ("nvfp4", 9, 5), ("nvfp4_4over6", 2, 0),
                                                  ("nvfp4_4over6", 2, 1)])
def test_token_counts_around_the_kernel_choice(recipe, per_sm, extra):
    """Up to 8 tokens per SM (2 for nvfp4_4over6) take the one-token-per-block kernel; above,
    blocks of several tokens (here rows of 8 items: 32 tokens per block at most, ceil(n / SMs)
    when fewer) step over the tokens and idle the lanes past a block's share. Counts at and just
    past the switch, and with a remainder per block, must write every token once."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    n = per_sm * sms + extra
    run_both(-(-(n + 40) // 16), 16, 2, 64, "5d", "HND", "bfloat16", recipe, "vllm", torch.int64, n, seed=n)


def test_large_batch():
    run_both(4096, 16, 8, 128, "5d", "HND", "bfloat16", "nvfp4", "vllm", torch.int64, 65536, seed=5)


# Global scales far from 1 drive out = 1/(sfq/g) to 0, subnormals, huge values and Inf, and the
# 4over6 error's r = 1/out with them: the kernel's one-pass scoring (encode_group_scored) must
# still pick the candidates the CPU picks.
@pytest.mark.parametrize("recipe", ("nvfp4", "nvfp4_4over6"))
@pytest.mark.parametrize("g", (3e-38, 2.0 ** -100, 1e-10, 1e10, 2.0 ** 100, 3e38))
@pytest.mark.parametrize("device_scales", (False, True))
@pytest.mark.parametrize("many", (False, True))  # both store kernels (see many_tokens)
def test_extreme_global_scales(recipe, g, device_scales, many):
    n = many_tokens() if many else 40
    run_both(-(-n // 16) + 1, 16, 2, 128, "5d", "HND", "float32", recipe, "vllm", torch.int64, n,
             seed=31, device_scales=device_scales, scales=(g, g * 0.75))


@pytest.mark.parametrize("many", (False, True))  # both store kernels (see many_tokens)
@pytest.mark.parametrize("bad", (0.0, float("nan"), float("inf"), -1.0))
def test_invalid_device_scale_writes_nan_groups(bad, many):
    """A GPU scale the host cannot inspect: every group written with it gets 0x7F, codes 0."""
    T, H, D = 16, 2, 64
    F = full_dim(D)
    n = many_tokens() if many else 3
    N = -(-n // T) + 1
    raw = torch.full((N, 2 * H * T * F), 0xA5, dtype=torch.uint8, device="cuda")
    kv = cache_views(raw, N, T, H, D, "5d", "HND")["kv_cache"]
    key = torch.randn(n, H, D, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(N * T, device="cuda")[:n]
    nvfp4kv.store(key, key, kv, slots, torch.tensor([bad], device="cuda"), 1.0, scale_layout="linear")
    sides = raw.view(N, 2, H * T * F).cpu()
    page, pos = (slots // T).cpu(), (slots % T).cpu()
    r = torch.arange(H)[None, :] * T + pos[:, None]  # [n, H] rows (HND)
    data = r[..., None] * (D // 2) + torch.arange(D // 2)  # byte offsets in a side (docs/FORMAT.md §4)
    scale = H * T * D // 2 + r[..., None] * (D // 16) + torch.arange(D // 16)
    k_side, v_side = sides[:, 0], sides[:, 1]
    assert torch.all(k_side[page[:, None, None], data] == 0)
    assert torch.all(k_side[page[:, None, None], scale] == 0x7F)
    assert not torch.all(v_side[page[:, None, None], scale] == 0x7F)  # V, with a valid scale


# With a workspace, large stores into HND pages list the pages they target and write them in
# page order (cuda/store.cu: claim_pages_kernel, order_tokens_kernel, the kSorted store_kernel).
# By default only batches writing 3 times the L2 do; the tests below make every eligible call do
# so, at sizes the CPU path checks quickly.
SORTED_MIN = 8192


@pytest.fixture(autouse=True)
def _store_order(request):
    if "sorted" in request.node.name:
        nvfp4kv._C._set_store_order("page")
        yield
        nvfp4kv._C._set_store_order("auto")
    else:
        yield


def _sorted_matrix():
    rng = random.Random(4321)
    cases = []
    for dtype, recipe, view in itertools.product(DTYPES, ("nvfp4", "nvfp4_4over6"), ("5d", "packed4d", "sides")):
        D = rng.choice((32, 64, 128, 256))
        H = rng.choice([h for h in (1, 2, 3, 8, 12) if h * D <= 1024])
        T = rng.choice((8, 16, 32))
        scale_layout = "vllm" if D % 64 == 0 and rng.random() < 0.7 else "linear"
        slot_dtype = rng.choice((torch.int64, torch.int32))
        n = SORTED_MIN + rng.randrange(0, 2000)
        N = -(-(n * 4 // 3) // T)  # about a quarter of the slots stay free: partly filled pages
        cases.append((N, T, H, D, view, "HND", dtype, recipe, scale_layout, slot_dtype, n))
    # Several block slices (2H > 16 warps), unevenly (H 9), and 16 items per head row (D 512).
    cases.append((900, 16, 12, 64, "5d", "HND", "bfloat16", "nvfp4", "vllm", torch.int64, SORTED_MIN + 5))
    cases.append((900, 16, 9, 32, "packed4d", "HND", "float16", "nvfp4_4over6", "linear", torch.int32, SORTED_MIN))
    cases.append((700, 16, 1, 512, "sides", "HND", "bfloat16", "nvfp4", "vllm", torch.int64, SORTED_MIN + 1))
    # Where the page order does not apply, the workspace is ignored: NHD, 3 items per head row.
    cases.append((700, 16, 4, 128, "5d", "NHD", "bfloat16", "nvfp4", "linear", torch.int64, SORTED_MIN))
    cases.append((700, 16, 4, 96, "5d", "HND", "bfloat16", "nvfp4", "linear", torch.int64, SORTED_MIN))
    return cases


@pytest.mark.parametrize("case", _sorted_matrix(), ids=lambda c: "-".join(map(str, c[:11])).replace("torch.", ""))
def test_sorted_store_equals_cpu(case):
    """A workspace of random bytes (but its header): stale entries must not be taken."""
    run_both(*case, seed=stable_seed(case), workspace="garbage")


@pytest.mark.parametrize("recipe", ("nvfp4", "nvfp4_4over6"))
def test_sorted_store_duplicate_slots_keep_the_last_token(recipe):
    N, T, H, D = 400, 16, 2, 64
    n = SORTED_MIN + 100
    gen = torch.Generator().manual_seed(7)
    slots = torch.randint(0, N * T, (n,), generator=gen)  # about 1 in 1.4 collides
    slots[::97] = -1
    run_both(N, T, H, D, "5d", "HND", "bfloat16", recipe, "vllm", torch.int64, n, seed=8,
             workspace="garbage", slots=slots)


@pytest.mark.parametrize("N", (0, 40))
def test_sorted_store_without_valid_slots(N):
    """Every slot padding or out of range (or no pages at all): nothing written, header reset."""
    n = SORTED_MIN
    slots = torch.where(torch.arange(n) % 2 == 0, torch.tensor(-1), torch.tensor(N * 16 + 3))
    gen = torch.Generator().manual_seed(9)
    ws = garbage_workspace(N, 16, gen)
    run_both(N, 16, 2, 64, "5d", "HND", "bfloat16", "nvfp4", "vllm", torch.int64, n, seed=10,
             workspace=ws, slots=slots)


def test_sorted_store_reuses_one_workspace():
    """One workspace for calls on caches of several sizes; each call leaves entries behind
    that the next one must not take, including slots a token index of the next call maps to."""
    gen = torch.Generator().manual_seed(11)
    ws = garbage_workspace(1200, 16, gen)
    n = SORTED_MIN + 50
    for step, (N, T, H) in enumerate([(1200, 16, 1), (1200, 16, 2), (1100, 16, 1), (700, 16, 1), (1600, 8, 1)]):
        # Step 1: the same cache size, so every entry of step 0 sits where step 1 looks.
        run_both(N, T, H, 64, "5d", "HND", "bfloat16", "nvfp4", "vllm", torch.int64, n, seed=20 + step,
                 workspace=ws)


def _took_page_order(n, T=16, H=1, D=32):
    """Stores n tokens with a workspace whose claim entries are all -1: whether the call wrote one
    (page order ran; token order leaves them)."""
    N = -(-n // T)
    kv = nvfp4kv.allocate_kv_cache(nvfp4kv.KVCacheSpec(block_size=T, num_kv_heads=H, head_size=D), N, device="cuda")
    ws = nvfp4kv.store_workspace(kv)
    ws.fill_(0xFF)
    ws[:8] = 0
    key = torch.randn(n, H, D, device="cuda", dtype=torch.bfloat16)
    nvfp4kv.store(key, key, kv, torch.randperm(N * T, device="cuda")[:n], 0.1, 0.1, workspace=ws,
                  scale_layout="linear")
    torch.cuda.synchronize()
    return not torch.all(ws[16:].view(torch.int32)[:N] == -1)


def test_store_order_default_takes_page_order_only_for_large_batches():
    """Auto: the same bytes either way; page order (visible as the workspace's page count being
    reset, a claim entry written) only where the rows add up to 3 times the L2."""
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    row = 2 * 1 * full_dim(32)  # 36 bytes of rows per token (_took_page_order's H 1, D 32)
    for n, expect_sorted in ((SORTED_MIN, False), (-(-3 * l2 // row) + 16, True)):
        assert _took_page_order(n) == expect_sorted, n


def test_sorted_order_is_forced_at_the_tests_sizes():
    """The tests named *sorted* run with page order forced (the _store_order fixture): at
    SORTED_MIN tokens, below the automatic threshold, the claim entries show that it ran (review:
    nothing checked that the switch took)."""
    assert _took_page_order(SORTED_MIN)


def test_sorted_store_bad_workspace_rejected_and_cache_untouched():
    N, T, H, D = 600, 16, 1, 64
    n = SORTED_MIN
    kv = nvfp4kv.allocate_kv_cache(nvfp4kv.KVCacheSpec(block_size=T, num_kv_heads=H, head_size=D), N,
                                   device="cuda")
    kv.fill_(0xA5)
    key = torch.randn(n, H, D, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(N * T, device="cuda")[:n]
    good = nvfp4kv.store_workspace(kv)
    assert good.numel() == nvfp4kv.store_workspace_bytes(N, T) == 16 + 4 * N * (2 * T + 3)
    bad = [
        (good[:-1], ValueError, "needs"),
        (good.view(torch.int32), TypeError, "uint8"),
        (good.cpu(), ValueError, "one device"),
        (torch.zeros(2 * good.numel(), dtype=torch.uint8, device="cuda")[::2], ValueError, "stride"),
        (torch.zeros(good.numel() + 1, dtype=torch.uint8, device="cuda")[1:], ValueError, "multiple of 4"),
        (good.view(-1, 4), ValueError, "rank"),
    ]
    for ws, err, text in bad:
        with pytest.raises(err, match=text):
            nvfp4kv.store(key, key, kv, slots, 0.1, 0.1, workspace=ws)
    torch.cuda.synchronize()
    assert torch.all(kv == 0xA5)


@pytest.mark.parametrize("kernel", ("small", "many", "sorted"))  # the store kernels (see many_tokens, SORTED_MIN)
@pytest.mark.parametrize("prepared", (False, True))
def test_cuda_graph_capture_and_replay(kernel, prepared):
    """Capture once, then change inputs, slots and the device scales in place and replay."""
    T, H, D = 16, 8, 128
    n = {"small": 40, "many": many_tokens(), "sorted": SORTED_MIN + 300}[kernel]
    N = max(16, -(-(n + 20) // T))
    gen = torch.Generator().manual_seed(0)
    raw = make_raw(N, H * T * full_dim(D), 0, gen).cuda()
    kv = cache_views(raw, N, T, H, D, "5d", "HND")["kv_cache"]
    key = torch.randn(n, H, D, device="cuda", dtype=torch.bfloat16)
    value = torch.randn(n, H, D, device="cuda", dtype=torch.bfloat16)
    slots = torch.randperm(N * T, device="cuda")[:n]
    ks = torch.tensor([0.1], device="cuda")
    vs = torch.tensor([0.2], device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    ws = nvfp4kv.store_workspace(kv) if kernel == "sorted" else None
    ps = nvfp4kv.prepare_store(kv, ks, vs, workspace=ws)
    store = ((lambda: ps(key, value, slots)) if prepared
             else (lambda: nvfp4kv.store(key, value, kv, slots, ks, vs, workspace=ws)))
    with torch.cuda.stream(stream):
        store()  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        store()
    for step in range(3):
        key.copy_(torch.randn(n, H, D, generator=gen).to(torch.bfloat16))
        value.copy_(torch.randn(n, H, D, generator=gen).to(torch.bfloat16))
        slots.copy_(torch.randperm(N * T, generator=gen)[:n])
        ks.fill_(0.05 * (step + 1))
        vs.fill_(0.07 * (step + 1))
        expect = raw.cpu()
        nvfp4kv.store(key.cpu(), value.cpu(), cache_views(expect, N, T, H, D, "5d", "HND")["kv_cache"],
                      slots.cpu(), ks.item(), vs.item())
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(raw.cpu(), expect), f"replay {step} differs from the CPU path"
        if ws is not None:
            assert torch.all(ws[:8].cpu() == 0)


def _chain(key, value, kv, slots, ks, vs, key_out, value_out, bt, sl, cu, src_k, src_v):
    """One step of dependent work on one stream: torch writes the inputs and the scales, the store
    reads them and writes the cache, the gather reads the cache, torch reads the gather's output.
    With programmatic dependent launch each of the library's kernels may start before the one
    before it has finished; none may touch memory before it has."""
    key.copy_(src_k)
    value.copy_(src_v)
    ks.mul_(1.5)
    nvfp4kv.store(key, value, kv, slots, ks, vs)
    nvfp4kv.gather_dequant(kv, bt, sl, ks, vs, cu_seqlens=cu, key_out=key_out, value_out=value_out)
    return key_out.float().abs().sum() + value_out.float().abs().sum()  # torch, right after the gather


@pytest.mark.parametrize("many", (False, True))  # both store kernels (see many_tokens)
@pytest.mark.parametrize("graph", (False, True))
def test_dependent_kernels_back_to_back(graph, many):
    T, H, D = 16, 8, 128
    N = many_tokens() // T + 1 if many else 8
    n = N * T
    gen = torch.Generator().manual_seed(5)
    raw = make_raw(N, H * T * full_dim(D), 0, gen).cuda()
    kv = cache_views(raw, N, T, H, D, "5d", "HND")["kv_cache"]
    key = torch.zeros(n, H, D, device="cuda", dtype=torch.bfloat16)
    value = torch.zeros_like(key)
    slots = torch.arange(n, device="cuda")  # every page, in order: the gather reads them all
    ks = torch.tensor([0.01], device="cuda")
    vs = torch.tensor([0.02], device="cuda")
    key_out = torch.empty(n, H, D, device="cuda", dtype=torch.bfloat16)
    value_out = torch.empty_like(key_out)
    bt = torch.arange(N, device="cuda", dtype=torch.int32).view(1, N)
    sl = torch.tensor([n], device="cuda", dtype=torch.int32)
    cu = torch.tensor([0, n], device="cuda", dtype=torch.int32)
    src_k = torch.randn(n, H, D, generator=gen).to(torch.bfloat16).cuda()
    src_v = torch.randn(n, H, D, generator=gen).to(torch.bfloat16).cuda()
    args = (key, value, kv, slots, ks, vs, key_out, value_out, bt, sl, cu, src_k, src_v)
    if graph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            _chain(*args)  # warm-up outside capture
        torch.cuda.current_stream().wait_stream(stream)
        ks.fill_(0.01)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            total = _chain(*args)
    for step in range(4):
        src_k.copy_(torch.randn(n, H, D, generator=gen).to(torch.bfloat16))
        src_v.copy_(torch.randn(n, H, D, generator=gen).to(torch.bfloat16))
        scale_before = ks.item()
        if graph:
            g.replay()
        else:
            total = _chain(*args)
        torch.cuda.synchronize()
        g_k = scale_before * 1.5
        expect = raw.cpu().clone()
        exp_kv = cache_views(expect, N, T, H, D, "5d", "HND")["kv_cache"]
        nvfp4kv.store(src_k.cpu(), src_v.cpu(), exp_kv, slots.cpu(), g_k, vs.item())
        assert torch.equal(raw.cpu(), expect), f"step {step}: the cache differs from the CPU path"
        ek, ev, _ = nvfp4kv.gather_dequant(exp_kv, bt.cpu(), sl.cpu(), g_k, vs.item(),
                                           cu_seqlens=cu.cpu(), dtype="bfloat16")
        assert torch.equal(key_out.cpu().view(torch.int16), ek.view(torch.int16)), f"step {step}: keys"
        assert torch.equal(value_out.cpu().view(torch.int16), ev.view(torch.int16)), f"step {step}: values"
        want = ek.float().abs().sum() + ev.float().abs().sum()
        assert torch.isclose(total.cpu(), want, rtol=1e-4, equal_nan=True), f"step {step}: sum"


def test_dependent_launch_can_be_turned_off():
    # NVFP4KV_PDL=0 (read once per process): ordinary launches, the same bytes.
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]); import test_gpu as t; "
        "t.test_dependent_kernels_back_to_back(False, False); t.test_dependent_kernels_back_to_back(True, False); "
        "t.test_dependent_kernels_back_to_back(True, True); "
        "t.run_both(3, 16, 2, 128, '5d', 'HND', 'bfloat16', 'nvfp4_4over6', 'vllm', t.torch.int64, 40, 7); "
        "print('ok')"
    )
    env = dict(os.environ, NVFP4KV_PDL="0")
    out = subprocess.run([sys.executable, "-c", code, os.path.dirname(os.path.abspath(__file__))],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_runs_on_the_given_stream():
    N, T, H, D, n = 64, 16, 8, 128, 1000
    gen = torch.Generator().manual_seed(1)
    raw = make_raw(N, H * T * full_dim(D), 0, gen)
    key, value = make_inputs(n, H, D, torch.bfloat16, gen, special=False)
    slots = torch.randperm(N * T, generator=gen)[:n]
    expect = raw.clone()
    nvfp4kv.store(key, value, cache_views(expect, N, T, H, D, "5d", "HND")["kv_cache"], slots, 0.1, 0.1)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        raw_gpu = raw.cuda(non_blocking=False)
        kd, vd, sd = key.cuda(), value.cuda(), slots.cuda()
        torch.cuda._sleep(20_000_000)  # keep the side stream busy: a wrong stream would race ahead
        nvfp4kv.store(kd, vd, cache_views(raw_gpu, N, T, H, D, "5d", "HND")["kv_cache"], sd, 0.1, 0.1)
    side.synchronize()
    assert torch.equal(raw_gpu.cpu(), expect)
    # explicit stream argument, from the default stream's point of view
    raw2 = raw.cuda()
    s2 = torch.cuda.Stream()
    with torch.cuda.stream(s2):
        kd2, vd2, sd2 = key.cuda(), value.cuda(), slots.cuda()
    s2.synchronize()
    nvfp4kv.store(kd2, vd2, cache_views(raw2, N, T, H, D, "5d", "HND")["kv_cache"], sd2, 0.1, 0.1, stream=s2)
    s2.synchronize()
    assert torch.equal(raw2.cpu(), expect)


def test_mixed_devices_rejected_and_cache_untouched():
    raw = torch.zeros(2, 2 * 8 * 16 * 72, dtype=torch.uint8, device="cuda")
    kv = cache_views(raw, 2, 16, 8, 128, "5d", "HND")["kv_cache"]
    key = torch.randn(4, 8, 128, dtype=torch.bfloat16)
    slots = torch.arange(4, device="cuda")
    with pytest.raises(ValueError, match="key"):
        nvfp4kv.store(key, key.cuda(), kv, slots, 1.0, 1.0)
    with pytest.raises(ValueError, match="slot_mapping"):
        nvfp4kv.store(key.cuda(), key.cuda(), kv, slots.cpu(), 1.0, 1.0)
    with pytest.raises(ValueError, match="k_scale"):
        nvfp4kv.store(key, key, kv.cpu(), slots.cpu(), torch.tensor([1.0], device="cuda"), 1.0)
    assert int(raw.sum()) == 0


def test_device_guard_other_current_device():
    """Tensors on the last device while another one is current (a no-op switch on 1 GPU)."""
    dev = torch.cuda.device_count() - 1
    other = 0
    N, T, H, D, n = 4, 16, 2, 64, 20
    gen = torch.Generator().manual_seed(2)
    raw = make_raw(N, H * T * full_dim(D), 0, gen)
    key, value = make_inputs(n, H, D, torch.float16, gen)
    slots = torch.randperm(N * T, generator=gen)[:n]
    expect = raw.clone()
    nvfp4kv.store(key, value, cache_views(expect, N, T, H, D, "5d", "HND")["kv_cache"], slots, 1.0, 1.0)
    with torch.cuda.device(other):
        raw_gpu = raw.to(f"cuda:{dev}")
        nvfp4kv.store(key.to(f"cuda:{dev}"), value.to(f"cuda:{dev}"),
                      cache_views(raw_gpu, N, T, H, D, "5d", "HND")["kv_cache"], slots.to(f"cuda:{dev}"),
                      1.0, 1.0)
        assert torch.cuda.current_device() == other
    torch.cuda.synchronize(dev)
    assert torch.equal(raw_gpu.cpu(), expect)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tensors_split_across_gpus_rejected():
    raw = torch.zeros(2, 2 * 8 * 16 * 72, dtype=torch.uint8, device="cuda:1")
    kv = cache_views(raw, 2, 16, 8, 128, "5d", "HND")["kv_cache"]
    key = torch.randn(4, 8, 128, dtype=torch.bfloat16, device="cuda:0")
    with pytest.raises(ValueError, match="cuda:0"):
        nvfp4kv.store(key, key, kv, torch.arange(4, device="cuda:1"), 1.0, 1.0)


@pytest.mark.parametrize("dtype", ("float32", "float16", "bfloat16"))
@pytest.mark.parametrize("view,layout,scale_layout", [("5d", "HND", "vllm"), ("5d", "NHD", "linear"),
                                                       ("packed4d", "HND", "linear"), ("sides", "NHD", "linear")])
def test_dequantize_gpu_equals_cpu(dtype, view, layout, scale_layout):
    N, T, H, D = 5, 16, 4, 128
    raw, _ = run_both(N, T, H, D, view, layout, "bfloat16", "nvfp4", scale_layout, torch.int64, 50, seed=9)
    kc, vc = nvfp4kv.dequantize(k_scale=0.3, v_scale=0.7, dtype=dtype, scale_layout=scale_layout,
                                **cache_views(raw, N, T, H, D, view, layout))
    kg, vg = nvfp4kv.dequantize(k_scale=0.3, v_scale=0.7, dtype=dtype, scale_layout=scale_layout,
                                **cache_views(raw.cuda(), N, T, H, D, view, layout))
    # Bitwise equality (NaN included): compare the raw bits.
    idt = torch.int32 if dtype == "float32" else torch.int16
    assert torch.equal(kg.cpu().view(idt), kc.view(idt))
    assert torch.equal(vg.cpu().view(idt), vc.view(idt))


# The script of test_threads_on_one_gpu_own_streams: run in a fresh process, so that the threads'
# calls are each kernel's first in the process (the launchers' per-device answers: cluster room,
# code version, device attributes, are asked then, by the threads at once).
_ONE_GPU_THREADS = r"""
import threading, traceback, torch, nvfp4kv
from nvfp4kv import KVCacheSpec, allocate_kv_cache
T, H, D, HQ, N, THREADS, ROUNDS = 16, 8, 128, 32, 1024, 4, 3
# (sequences, length, table columns): one split; 8 splits merged in their cluster (sm_90+); the
# plan's 64 splits of a wide table, 8 of them read, merged by the second kernel
CASES = [(64, 256, 16), (1, 1024, 64), (1, 1024, 512)]
spec = KVCacheSpec(T, H, D)

def job_inputs(t):
    g = torch.Generator().manual_seed(1000 + t)
    n = N * T  # every slot: each page the calls read holds stored tokens
    key = torch.randn(n, H, D, generator=g).to(torch.bfloat16).cuda()
    value = torch.randn(n, H, D, generator=g).to(torch.bfloat16).cuda()
    slots = torch.randperm(n, generator=g).cuda()
    calls = []
    for b, length, cols in CASES:
        q = torch.randn(b, HQ, D, generator=g).to(torch.bfloat16).cuda()
        bt = torch.randint(0, N, (b, cols), generator=g, dtype=torch.int32).cuda()
        sl = torch.full((b,), length, dtype=torch.int32).cuda()
        calls.append((q, bt, sl))
    return key, value, slots, calls

def run(t, cache, stream, inputs, barrier=None):
    key, value, slots, calls = inputs
    outs = []
    with torch.cuda.stream(stream):
        ws = [nvfp4kv.decode_workspace(cache, q, bt) for q, bt, _ in calls]
        kt = torch.empty(len(calls[0][1]) * 256, H, D, dtype=torch.bfloat16, device="cuda")
        vt = torch.empty_like(kt)
        stream.synchronize()
        if barrier is not None:
            barrier.wait()  # every thread's first launches at once
        for _ in range(ROUNDS):
            nvfp4kv.store(key, value, cache, slots, 0.02, 0.03, stream=stream)
            got = []
            for (q, bt, sl), w in zip(calls, ws):
                out = torch.empty_like(q)
                lse = torch.empty(q.shape[0], HQ, device="cuda")
                nvfp4kv.decode_attention(q, cache, bt, sl, 0.02, 0.03, out=out, lse=lse, workspace=w, stream=stream)
                got += [out, lse]
            q, bt, sl = calls[0]
            cu = torch.arange(0, (len(sl) + 1) * 256, 256, dtype=torch.int32, device="cuda")
            nvfp4kv.gather_dequant(cache, bt, sl, 0.02, 0.03, cu_seqlens=cu, key_out=kt, value_out=vt, stream=stream)
            got += [kt.clone(), vt.clone(), cache.clone()]
            outs.append(got)
    stream.synchronize()
    return outs

inputs = [job_inputs(t) for t in range(THREADS)]
caches = [allocate_kv_cache(spec, N, device="cuda") for _ in range(THREADS)]
streams = [torch.cuda.Stream() for _ in range(THREADS)]
barrier = threading.Barrier(THREADS)
results, errors = [None] * THREADS, []
torch.cuda.synchronize()  # the caches' zeros and the inputs' copies, made on the default stream

def work(t):
    try:
        results[t] = run(t, caches[t], streams[t], inputs[t], barrier)
    except Exception:
        errors.append(traceback.format_exc())
        barrier.abort()  # the others, waiting at the barrier, raise BrokenBarrierError: no hang

threads = [threading.Thread(target=work, args=(t,)) for t in range(THREADS)]
for th in threads:
    th.start()
for th in threads:
    th.join()
assert not errors, "\n".join(errors)
def bits(x):
    return x.view({torch.bfloat16: torch.int16, torch.float32: torch.int32}.get(x.dtype, x.dtype))

for t in range(THREADS):  # each thread's calls again, alone, on the current stream
    alone = run(t, allocate_kv_cache(spec, N, device="cuda"), torch.cuda.current_stream(), inputs[t])[0]
    assert len(alone) == 2 * len(CASES) + 3 and all(float(x.float().abs().sum()) > 0 for x in alone)
    for r in range(ROUNDS):
        for i, (a, b) in enumerate(zip(results[t][r], alone)):
            assert torch.equal(bits(a), bits(b)), f"thread {t} round {r} output {i} differs from the same call alone"
print("OK", torch.cuda.get_device_name())
"""


def test_threads_on_one_gpu_own_streams():
    """c-api.md: every entry point may be called from several threads at once. Four threads, each
    on its own stream with its own cache, store, decode (one split; 8 splits merged in a cluster;
    a wide table's 64 splits merged by the second kernel) and gather, 3 rounds, starting together
    in a fresh process; each round gives the bits of the same calls made alone."""
    out = subprocess.run([sys.executable, "-c", _ONE_GPU_THREADS], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "OK" in out.stdout, out.stdout + out.stderr[-3000:]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus_two_threads_own_streams():
    """Tensor parallelism: each GPU holds its own cache; two threads store (then gather) at once,
    each on its own stream of its own device, with the current device left at 0 in both threads."""
    import threading

    N, T, H, D, n = 512, 16, 8, 128, 4096
    jobs = []
    for dev in (0, 1):
        gen = torch.Generator().manual_seed(100 + dev)
        raw = make_raw(N, H * T * full_dim(D), 0, gen)
        key, value = make_inputs(n, H, D, torch.bfloat16, gen)
        slots = torch.randperm(N * T, generator=gen)[:n]
        expect = raw.clone()
        nvfp4kv.store(key, value, cache_views(expect, N, T, H, D, "5d", "HND")["kv_cache"], slots, 0.3, 0.4)
        d = f"cuda:{dev}"
        jobs.append(dict(dev=dev, raw=raw.to(d), key=key.to(d), value=value.to(d), slots=slots.to(d),
                         expect=expect, stream=torch.cuda.Stream(device=d)))
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(1)
    errors = []

    # The read side too: each thread gathers its cache back through a block table.
    blocks = N // 4
    block_table = torch.stack([torch.arange(blocks), torch.arange(blocks, 2 * blocks)]).to(torch.int32)
    seq_lens = torch.tensor([blocks * T, blocks * T - 5], dtype=torch.int32)
    cu = torch.tensor([0, blocks * T, 2 * blocks * T - 5], dtype=torch.int32)

    def work(job):
        try:
            kv = cache_views(job["raw"], N, T, H, D, "5d", "HND")["kv_cache"]
            for _ in range(20):  # repeated, so the two devices' launches overlap in time
                nvfp4kv.store(job["key"], job["value"], kv, job["slots"], 0.3, 0.4, stream=job["stream"])
            d = job["raw"].device
            outs = [torch.full((int(cu[-1]), H, D), 7.0, dtype=torch.bfloat16, device=d) for _ in range(2)]
            bt_d, sl_d, cu_d = block_table.to(d), seq_lens.to(d), cu.to(d)
            job["stream"].wait_stream(torch.cuda.current_stream(d))  # the fills and copies above
            job["gathered"] = nvfp4kv.gather_dequant(
                kv, bt_d, sl_d, 0.3, 0.4, cu_seqlens=cu_d,
                key_out=outs[0], value_out=outs[1], stream=job["stream"])
            assert torch.cuda.current_device() == 0
        except Exception as e:  # reported from the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(j,)) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for job in jobs:
        job["stream"].synchronize()
        assert torch.equal(job["raw"].cpu(), job["expect"]), f"cuda:{job['dev']} differs from the CPU path"
        kc, vc, _ = nvfp4kv.gather_dequant(cache_views(job["expect"], N, T, H, D, "5d", "HND")["kv_cache"],
                                           block_table, seq_lens, 0.3, 0.4, cu_seqlens=cu)
        kg, vg, _ = job["gathered"]
        assert torch.equal(kg.cpu().view(torch.int16), kc.view(torch.int16)), f"gather on cuda:{job['dev']}"
        assert torch.equal(vg.cpu().view(torch.int16), vc.view(torch.int16)), f"gather on cuda:{job['dev']}"
