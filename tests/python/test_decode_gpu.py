"""decode_attention on the GPU against the CPU path (itself held to an fp64 attention in
test_decode.py): the same calls on CUDA tensors, outputs within the stated tolerance of the CPU
path's, lse within 1e-4; determinism (the same bits on every run), CUDA graphs with the sequence
lengths changing between replays, and the workspace requirement of split-KV."""

import math
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import nvfp4kv as nv  # noqa: E402

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
if not nv.build_info()["cuda_available"]:
    pytest.skip("no CUDA build of nvfp4kv", allow_module_level=True)

# The GPU and the CPU path round differently (order of sums, exp), both against the same fp64
# attention; their outputs agree far inside the 4e-3 the fp64 comparison allows (H100, a19b264:
# at most 9.4e-4 over 186 comparisons, median 1.6e-5).
REL_L2 = 2e-3
REL_L2_FP16 = 5e-4  # fp16 outputs, where the output's own rounding is 8 times finer than bf16's


def gpu_tol(dtype):
    """The GPU-against-CPU bound for outputs of this dtype (an output rounded through bf16 on its
    way to fp16 differs by about 1.7e-3: review)."""
    return REL_L2_FP16 if dtype == torch.float16 else REL_L2


def make(B, L, H, group, D, T, q_len=1, form="5d", scale_layout="vllm", dtype=torch.bfloat16, seed=0,
         bad_entries=False, lens=None):
    g = torch.Generator().manual_seed(seed)
    blocks = max(1, (L + T - 1) // T)
    N = B * blocks + 2
    F = nv.nvfp4_kv_cache_full_dim(D)
    raw = torch.randint(0, 256, (N, 2, H * T * F), generator=g, dtype=torch.uint8)
    raw[:, :, H * T * (D // 2):] &= 0x3F  # scale bytes of real data (no NaN groups)
    if form == "packed":
        kv = raw.view(N, 2 * H, T, F)
    else:
        kv = raw.view(N, 2, H, T, F).permute(0, 1, 3, 2, 4)
    bt = torch.randperm(N, generator=g)[: B * blocks].reshape(B, blocks).to(torch.int32)
    if bad_entries:
        bt[:, ::3] = -1
        bt[:, 1::5] = N + 7
    seq_lens = torch.tensor(lens if lens is not None else [L] * B, dtype=torch.int32)
    q = torch.randn(B * q_len, H * group, D, generator=g).to(dtype)
    return kv, bt, seq_lens, q


def run(kv, bt, seq_lens, q, device, shift=0, k_scale=0.03, **kw):
    """decode_attention on `device`; shift > 0 puts the cache that many bytes past a 16-byte
    boundary (on_cuda)."""
    args = [x.to(device) for x in (q, kv, bt, seq_lens)]
    if shift:
        args[1] = on_cuda(kv, shift=shift)
        assert args[1].data_ptr() % 16 == shift
    ks, vs = torch.tensor([k_scale], device=device), torch.tensor([0.05], device=device)
    lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=device)
    ws = nv.decode_workspace(args[1], args[0], args[2], q_len=kw.get("q_len", 1)) if device == "cuda" else None
    out = nv.decode_attention(args[0], args[1], args[2], args[3], ks, vs, lse=lse, workspace=ws, **kw)
    assert out.dtype == q.dtype
    return out.float().cpu(), lse.cpu()  # exact: the tolerances follow q's dtype (gpu_tol)


def close(a, b, rel=REL_L2):
    a, b = a.double(), b.double()
    num = torch.linalg.norm((a - b).flatten())
    den = torch.linalg.norm(b.flatten())
    return float(num / max(den, 1e-30))


def check_against_cpu(kv, bt, sl, q, shift=0, **kw):
    """The GPU's output and lse against the CPU path's (the same -inf rows); returns both outputs."""
    want, want_lse = run(kv, bt, sl, q, "cpu", **kw)
    got, got_lse = run(kv, bt, sl, q, "cuda", shift=shift, **kw)
    print(f"\ndecode GPU vs CPU ({q.dtype}): rel L2 {close(got, want):.2e}")
    assert close(got, want) <= gpu_tol(q.dtype)
    assert torch.equal(got_lse.isinf(), want_lse.isinf())
    fin = ~want_lse.isinf()
    assert torch.allclose(got_lse[fin], want_lse[fin], atol=1e-4, rtol=0)
    return got, want


@pytest.mark.parametrize("shift", [0, 4])  # the tensor-core reader; the lane-per-token reader
def test_huge_queries_against_small_key_scales(shift):
    """Queries near bf16's top (2^124) against a key scale of 2^-124: ordinary logits. The CPU
    path and the lane-per-token reader summed q . k before applying the scales and overflowed
    there (review); every reader now scales each query row by a power of two first."""
    kv, bt, sl, q = make(3, 300, 2, 4, 128, 16, seed=21)
    q = (q.float() * 2.0**124).to(torch.bfloat16)
    got, want = check_against_cpu(kv, bt, sl, q, shift=shift, k_scale=2.0**-124)
    assert torch.isfinite(want).all() and torch.isfinite(got).all()


@pytest.mark.parametrize("B,L,H,group,D,T,q_len", [
    (3, 100, 2, 4, 128, 16, 1),
    (2, 37, 1, 1, 64, 16, 1),
    (2, 300, 2, 8, 256, 16, 1),
    (1, 5000, 2, 16, 128, 32, 1),
    (4, 64, 2, 4, 128, 16, 2),
    (2, 129, 2, 4, 64, 16, 4),
    (2, 70, 1, 2, 128, 16, 8),
    (2, 77, 2, 4, 128, 12, 1),  # T not a multiple of 16: tiles across their tokens' pages
    (2, 100, 2, 4, 128, 24, 1),
    (2, 50, 1, 4, 64, 3, 2),    # pages of 216 bytes (H T odd at D 64: not 16-byte strides): narrow copies
    (3, 90, 2, 4, 64, 8, 2),    # T 8, 4, 2, 1: 16 / T pages per tile
    (2, 300, 2, 4, 128, 4, 1),
    (2, 45, 1, 8, 256, 2, 2),
    (2, 1000, 2, 4, 128, 1, 1),
    (3, 24, 2, 16, 64, 1, 8),
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_cuda_equals_cpu(B, L, H, group, D, T, q_len, dtype):
    kv, bt, sl, q = make(B, L, H, group, D, T, q_len=q_len, dtype=dtype, seed=B * L + D)
    layout = "vllm" if T % 4 == 0 else "linear"  # interleaved V scales need T % 4 == 0
    want, want_lse = run(kv, bt, sl, q, "cpu", q_len=q_len, scale_layout=layout)
    got, got_lse = run(kv, bt, sl, q, "cuda", q_len=q_len, scale_layout=layout)
    assert close(got, want) <= gpu_tol(dtype)
    assert torch.allclose(got_lse, want_lse, atol=1e-4, rtol=0)


@pytest.mark.parametrize("form,scale_layout", [("5d", "vllm"), ("5d", "linear"), ("packed", "vllm")])
def test_cuda_masks_windows_caps(form, scale_layout):
    kv, bt, sl, q = make(3, 200, 2, 4, 128, 16, form=form, scale_layout=scale_layout, seed=3, bad_entries=True,
                         lens=[200, 0, 17])
    for kw in ({}, {"window_left": 31}, {"logits_soft_cap": 30.0}, {"sm_scale": 0.3}):
        want, want_lse = run(kv, bt, sl, q, "cpu", scale_layout=scale_layout, **kw)
        got, got_lse = run(kv, bt, sl, q, "cuda", scale_layout=scale_layout, **kw)
        assert close(got, want) <= REL_L2, kw
        assert torch.equal(got_lse.isinf(), want_lse.isinf()), kw
        assert torch.allclose(got_lse[~want_lse.isinf()], want_lse[~want_lse.isinf()], atol=1e-4, rtol=0), kw
        # Sequence 1 is empty (q_len 1: output row 1): zeros, lse -inf.
        assert got.shape[0] == 3 and bool((got[1] == 0).all()) and bool(got_lse[1].isneginf().all()), kw


@pytest.mark.parametrize("T", [1, 2, 4, 8, 3, 12, 24])
@pytest.mark.parametrize("form,scale_layout", [("5d", "vllm"), ("5d", "linear"), ("packed", "vllm")])
def test_cuda_short_pages_masks_windows_caps(T, form, scale_layout):
    """Block sizes that are not a multiple of 16: each 16-token tile of the tensor-core reader
    holds tokens of several pages (16 / T whole ones where T divides 16), found token by token;
    masked entries (every third, every fifth) mask single pages inside a tile. int64 entries at
    odd T, a sequence ending inside a tile and an empty one."""
    if scale_layout == "vllm" and T % 4:
        pytest.skip("interleaved V scales need T % 4 == 0")
    kv, bt, sl, q = make(3, 200, 2, 4, 128, T, form=form, scale_layout=scale_layout, seed=T, bad_entries=True,
                         lens=[200, 0, 37])
    bt = bt.to(torch.int64) if T % 2 else bt
    for kw in ({}, {"window_left": 29}, {"logits_soft_cap": 30.0}, {"q_len": 4}):
        qq = q.repeat(kw.get("q_len", 1), 1, 1)  # 3 sequences of q_len query rows
        want, want_lse = run(kv, bt, sl, qq, "cpu", scale_layout=scale_layout, **kw)
        got, got_lse = run(kv, bt, sl, qq, "cuda", scale_layout=scale_layout, **kw)
        assert close(got, want) <= REL_L2, kw
        assert torch.equal(got_lse.isinf(), want_lse.isinf()), kw
        assert torch.allclose(got_lse[~want_lse.isinf()], want_lse[~want_lse.isinf()], atol=1e-4, rtol=0), kw


@pytest.mark.parametrize("T,L,B", [(1, 5000, 1), (4, 3000, 2), (1, 1024, 1), (12, 4000, 1), (3, 2000, 2)])
def test_cuda_short_pages_split_kv(T, L, B):
    """Splits of whole runs of pages that are multiples of 16 tokens (T 1 at 5000 tokens: 39
    splits merged from the workspace; at 1024 tokens 8 splits, merged in their cluster on sm_90;
    T 12 in runs of 48 tokens, T 3 of 48): equal to the CPU path, the same bits on every run,
    within the workspace sized by decode_workspace."""
    kv, bt, sl, q = make(B, L, 2, 4, 128, T, scale_layout="linear", seed=L + T, lens=[L - 7 * i for i in range(B)])
    a, la = run(kv, bt, sl, q, "cuda", scale_layout="linear")
    b, lb = run(kv, bt, sl, q, "cuda", scale_layout="linear")
    assert torch.equal(a, b) and torch.equal(la, lb)
    want, want_lse = run(kv, bt, sl, q, "cpu", scale_layout="linear")
    assert close(a, want) <= REL_L2
    assert torch.allclose(la, want_lse, atol=1e-4, rtol=0)


@pytest.mark.parametrize("T,L,B,off", [(64, 3000, 2, 0), (128, 5000, 2, 1), (256, 9000, 1, 0), (528, 4000, 2, 1),
                                       (100, 3000, 3, 1)])
def test_cuda_large_pages_and_fused_qkv_views(T, L, B, off):
    """Pages of 64 to 528 tokens (528: vLLM's attention pages of hybrid models, 33 tiles) and 100
    (neither a multiple nor a divisor of 16), split-KV where B is small; the query a view of a
    fused QKV row buffer (row stride (Hq + 2 H) D + 8), at an odd element (off 1: not 16-byte
    aligned) or not, and out a view of a wider buffer: equal to the CPU path on the same views."""
    H, group, D, q_len = 2, 4, 128, 2
    kv, bt, sl, _ = make(B, L, H, group, D, T, q_len=q_len, seed=T + L, lens=[L - 5 * i for i in range(B)])
    rows, Hq = B * q_len, H * group
    qkv = torch.randn(rows, (Hq + 2 * H) * D + 8, generator=torch.Generator().manual_seed(T)).to(torch.bfloat16)
    layout = "vllm"  # every T here is a multiple of 4
    res = {}
    for dev in ("cpu", "cuda"):
        buf = qkv.to(dev)
        q = buf[:, off:off + Hq * D].view(rows, Hq, D)  # strides ((Hq + 2H) D + 8, D, 1)
        wide = torch.full((rows, Hq, 2 * D), 7.0, dtype=torch.bfloat16, device=dev)
        out = wide[:, :, D:]  # strides (2 Hq D, 2 D, 1)
        lse = torch.empty(rows, Hq, device=dev)
        kvd, btd, sld = kv.to(dev), bt.to(dev), sl.to(dev)
        ws = nv.decode_workspace(kvd, q, btd, q_len=q_len) if dev == "cuda" else None
        got = nv.decode_attention(q, kvd, btd, sld, 0.03, 0.05, q_len=q_len, scale_layout=layout, out=out, lse=lse,
                                  workspace=ws)
        assert got is out and bool((wide[:, :, :D] == 7.0).all()), "only out's elements are written"
        res[dev] = (out.float().cpu(), lse.cpu())
    assert close(res["cuda"][0], res["cpu"][0]) <= REL_L2
    assert torch.allclose(res["cuda"][1], res["cpu"][1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("shift", [0, 4], ids=["tensor-core cache", "lane cache"])
def test_cuda_more_sequences_than_a_grid_dimension(shift):
    """65,635 sequences: the grid's sequence dimension holds 65,535, so the launch goes in two
    parts (b0 0 and 65,535); lengths 0 to 40 over 1,000 shared pages; equal to the CPU path, on
    both readers (a cache 4 bytes past a 16-byte boundary takes the lane reader)."""
    B, H, group, D, T, N = 65_535 + 100, 1, 2, 64, 16, 1000
    g = torch.Generator().manual_seed(77)
    kv, _, _, _ = make(1, N * T - 2 * T, H, group, D, T, seed=77)  # N pages
    bt = torch.randint(0, kv.shape[0], (B, 3), generator=g, dtype=torch.int32)
    sl = torch.randint(0, 41, (B,), generator=g, dtype=torch.int32)
    q = torch.randn(B, H * group, D, generator=g).to(torch.bfloat16)
    got, want = check_against_cpu(kv, bt, sl, q, shift=shift, scale_layout="vllm")
    assert close(got[-100:], want[-100:]) <= REL_L2  # the second launch's sequences on their own


def test_cuda_cache_past_4_gib():
    """An engine's cache fills the GPU, so page offsets pass 4 GiB: the store, the gather and
    decode on the last pages of a 5.4 GB cache (5-D HND), against the CPU path on a small copy of
    those pages renumbered from 0."""
    H, group, D, T, B, L = 8, 4, 128, 16, 4, 1000
    F = nv.nvfp4_kv_cache_full_dim(D)
    page = 2 * H * T * F
    N = (5 << 30) // page + 4096
    if torch.cuda.mem_get_info()[0] < N * page + (2 << 30):
        pytest.skip("needs about 7.5 GB of free GPU memory")
    blocks = -(-L // T)
    used = B * blocks
    g = torch.Generator().manual_seed(4)
    small = torch.randint(0, 256, (used, 2, H * T * F), generator=g, dtype=torch.uint8)
    small[:, :, H * T * (D // 2):] &= 0x3F  # real scale bytes
    big = torch.empty(N, 2, H * T * F, dtype=torch.uint8, device="cuda")
    big[N - used:] = small.cuda()
    five_d = lambda raw: raw.view(raw.shape[0], 2, H, T, F).permute(0, 1, 3, 2, 4)  # noqa: E731
    bt = torch.randperm(used, generator=g).reshape(B, blocks).to(torch.int32)
    sl = torch.tensor([L, L - 1, 17, 0], dtype=torch.int32)
    # The store: 300 tokens into random slots of the used pages, then the bytes of those pages.
    key = torch.randn(300, H, D, generator=g).to(torch.bfloat16)
    value = torch.randn(300, H, D, generator=g).to(torch.bfloat16)
    slots = torch.randperm(used * T, generator=g)[:300]
    nv.store(key, value, five_d(small), slots, 0.03, 0.05)
    nv.store(key.cuda(), value.cuda(), five_d(big), (slots + (N - used) * T).cuda(), 0.03, 0.05)
    assert torch.equal(big[N - used:].cpu(), small)
    # The gather and decode through the block table.
    kw = dict(k_scale=0.03, v_scale=0.05)
    kc, vc, _ = nv.gather_dequant(five_d(small), bt, sl, **kw)
    kg, vg, _ = nv.gather_dequant(five_d(big), (bt + (N - used)).cuda(), sl.cuda(), **kw)
    assert torch.equal(kg.cpu(), kc) and torch.equal(vg.cpu(), vc)
    q = torch.randn(B, H * group, D, generator=g).to(torch.bfloat16)
    want_lse = torch.empty(B, H * group)
    want = nv.decode_attention(q, five_d(small), bt, sl, lse=want_lse, **kw)
    btg = (bt + (N - used)).cuda()
    ws = nv.decode_workspace(five_d(big), q.cuda(), btg)
    got_lse = torch.empty(B, H * group, device="cuda")
    got = nv.decode_attention(q.cuda(), five_d(big), btg, sl.cuda(), lse=got_lse, workspace=ws, **kw)
    assert close(got.float().cpu(), want.float()) <= REL_L2
    assert torch.equal(got_lse.isinf().cpu(), want_lse.isinf()) and bool(want_lse[-1].isinf().all())
    fin = ~want_lse.isinf()
    assert torch.allclose(got_lse.cpu()[fin], want_lse[fin], atol=1e-4, rtol=0)


def test_cuda_kv_layout_reads_the_halves_of_a_packed_view():
    """vLLM allocates its packed cache as a view of a raw buffer, so only kv_layout="HND" tells
    its split(H, dim=1) halves from NHD sides (H == T here): the store and decode on CUDA give
    the packed cache's bytes and the CPU path's output."""
    H, group, D, T, B, L = 16, 2, 128, 16, 3, 700
    blocks = -(-L // T)
    N = B * blocks
    F = nv.nvfp4_kv_cache_full_dim(D)
    g = torch.Generator().manual_seed(16)
    key = torch.randn(B * L, H, D, generator=g).to(torch.bfloat16)
    value = torch.randn(B * L, H, D, generator=g).to(torch.bfloat16)
    bt = torch.randperm(N, generator=g).reshape(B, blocks).to(torch.int32)
    pos = torch.arange(L)
    slots = torch.cat([bt[b, pos // T].long() * T + pos % T for b in range(B)])
    want = torch.zeros(N, 2 * H, T, F, dtype=torch.uint8)
    nv.store(key, value, want, slots, 0.03, 0.05)
    raw = torch.zeros(want.numel(), dtype=torch.int8, device="cuda")
    k, v = raw.view(torch.uint8).view(want.shape).split(H, dim=1)
    nv.store(key.cuda(), value.cuda(), k, slots.cuda(), 0.03, 0.05, value_cache=v, kv_layout="HND")
    assert torch.equal(raw.view(torch.uint8).view(want.shape).cpu(), want)
    q = torch.randn(B, H * group, D, generator=g).to(torch.bfloat16)
    sl = torch.tensor([L, L - 5, 17], dtype=torch.int32)
    ref = nv.decode_attention(q, want, bt, sl, 0.03, 0.05)
    ws = nv.decode_workspace(k, q.cuda(), bt.cuda(), value_cache=v, kv_layout="HND")
    got = nv.decode_attention(q.cuda(), k, bt.cuda(), sl.cuda(), 0.03, 0.05, value_cache=v, kv_layout="HND",
                              workspace=ws)
    assert close(got.float().cpu(), ref.float()) <= REL_L2


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_cuda_decode_on_the_second_gpu_with_the_first_current():
    """The device guard: every tensor on cuda:1 while cuda:0 is current, split-KV included (its
    workspace and merge on cuda:1 too); equal to the CPU path, and the current device is left
    as it was."""
    kv, bt, sl, q = make(2, 20000, 2, 4, 128, 16, seed=21)
    want, want_lse = run(kv, bt, sl, q, "cpu")
    torch.cuda.set_device(0)
    args = [x.to("cuda:1") for x in (q, kv, bt, sl)]
    ks, vs = torch.tensor([0.03], device="cuda:1"), torch.tensor([0.05], device="cuda:1")
    lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device="cuda:1")
    ws = nv.decode_workspace(args[1], args[0], args[2])
    assert ws.numel() > 0 and ws.device == torch.device("cuda:1")
    got = nv.decode_attention(args[0], args[1], args[2], args[3], ks, vs, lse=lse, workspace=ws)
    assert got.device == torch.device("cuda:1") and torch.cuda.current_device() == 0
    assert close(got.float().cpu(), want) <= REL_L2
    assert torch.allclose(lse.cpu(), want_lse, atol=1e-4, rtol=0)


@pytest.mark.parametrize("T, cols", [(16, 2**60), (3, 2**62)])
def test_cuda_one_split_of_a_huge_broadcast_table(T, cols):
    """Found by review: the lane-per-token reader (taken for a split of 2^31 positions or more)
    computed a split's end as columns x T without saturating, so the one split of a broadcast
    table of 2^60 columns of 16 (2^64 positions) ended at 0, and one of 2^62 columns of 3 below
    0: the sequence read as empty (H100: the first failed before the fix). The CPU path
    saturates. 512 KV heads: one split, no workspace."""
    kv, bt, sl, q = make(1, 1000, 512, 1, 64, T)
    got = {}
    for dev in ("cpu", "cuda"):
        table = bt[:, :1].to(dev).expand(1, cols)  # expanded where it lives: never materialised
        lse = torch.empty(q.shape[:2], device=dev)
        out = nv.decode_attention(q.to(dev), kv.to(dev), table, sl.to(dev), 0.03, 0.05, lse=lse,
                                  scale_layout="linear")
        got[dev] = out.float().cpu(), lse.cpu()
    assert torch.isfinite(got["cpu"][1]).all()  # the CPU read the 1000 positions
    assert close(got["cuda"][0], got["cpu"][0]) <= REL_L2
    assert torch.allclose(got["cuda"][1], got["cpu"][1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("L", [40, 20000])  # one split (the reader writes lse), many (the merge does)
def test_cuda_lse_into_a_transposed_buffer(L):
    """lse takes any strides on the GPU too: a [Hq, rows] buffer's transpose receives the bits a
    contiguous lse does."""
    kv, bt, sl, q = (x.cuda() for x in make(2, L, 2, 4, 128, 16, q_len=2))
    ws = nv.decode_workspace(kv, q, bt, q_len=2)
    want_lse = torch.empty(q.shape[:2], device="cuda")
    want = nv.decode_attention(q, kv, bt, sl, 0.03, 0.05, q_len=2, lse=want_lse, workspace=ws)
    buf = torch.full(q.shape[:2][::-1], float("nan"), device="cuda")
    got = nv.decode_attention(q, kv, bt, sl, 0.03, 0.05, q_len=2, lse=buf.T, workspace=ws)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert torch.equal(buf.T.view(torch.int32), want_lse.view(torch.int32))


def test_cuda_split_kv_is_deterministic_and_needs_its_workspace():
    kv, bt, sl, q = make(1, 20000, 2, 4, 128, 16, seed=5)
    a, la = run(kv, bt, sl, q, "cuda")
    b, lb = run(kv, bt, sl, q, "cuda")
    assert torch.equal(a, b) and torch.equal(la, lb)
    want, _ = run(kv, bt, sl, q, "cpu")
    assert close(a, want) <= REL_L2
    with pytest.raises((ValueError, RuntimeError), match="workspace"):
        nv.decode_attention(q.cuda(), kv.cuda(), bt.cuda(), sl.cuda(), 0.03, 0.05)


@pytest.mark.parametrize("B, L", [(1, 1024), (2, 2048), (16, 4096), (64, 1024)])
def test_cuda_writes_every_output(B, L):
    """Into NaN-filled out and lse, every element written and equal to the CPU path's, at the
    benchmark's geometry (plan_decode_split): 1 x 1024 merges its 8 splits in a cluster on sm_90
    code, 2 x 2048 (16 splits) and 16 x 4096 (4) in the second kernel, 64 x 1024 has one split.
    A build of compute_80 PTX alone on a Hopper GPU once planned the cluster merge, whose body it
    compiles out, and left 1 x 1024's outputs unwritten (design notes: "Programmatic dependent
    launch"); device_run.sh sm80 runs this file on such a build."""
    kv, bt, sl, q = make(B, L, 8, 4, 128, 16, seed=11)
    want, want_lse = run(kv, bt, sl, q, "cpu")
    kv, bt, sl, q = kv.cuda(), bt.cuda(), sl.cuda(), q.cuda()
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), device="cuda")
    ws = nv.decode_workspace(kv, q, bt)
    nv.decode_attention(q, kv, bt, sl, torch.tensor([0.03], device="cuda"), torch.tensor([0.05], device="cuda"),
                        out=out, lse=lse, workspace=ws)
    assert not out.isnan().any() and not lse.isnan().any()
    assert close(out.float().cpu(), want) <= REL_L2
    assert torch.allclose(lse.cpu(), want_lse, atol=1e-4, rtol=0)


def test_cuda_empty_batch_needs_no_workspace():
    # A block table of 64 columns would split each sequence, but with no sequences the
    # workspace's size is 0 bytes, so the call takes None (or that empty workspace) as well.
    kv, bt, sl, q = make(1, 1024, 2, 4, 128, 16, seed=6)
    kv, bt, sl, q = kv.cuda(), bt[:0].cuda(), sl[:0].cuda(), q[:0].cuda()
    assert bt.shape == (0, 64) and nv.decode_workspace_bytes(0, 1, 8, 2, 128, 64) == 0
    ws = nv.decode_workspace(kv, q, bt)
    assert ws.numel() == 0
    for workspace in (None, ws):
        out = torch.empty_like(q)
        lse = torch.empty(0, 8, device="cuda")
        nv.decode_attention(q, kv, bt, sl, 0.03, 0.05, out=out, lse=lse, workspace=workspace)
    torch.cuda.synchronize()


@pytest.mark.parametrize("B,L,H,D", [
    (1, 1024, 1, 128),  # 8 splits in 8 blocks: merged inside their thread-block cluster (sm_90+)
    (1, 300, 2, 256),   # 2 splits, 4 blocks: a cluster of 2
    (40, 256, 4, 64),   # 2 splits in 320 blocks: merged by the second kernel from the workspace
])
def test_cuda_split_merges_equal_cpu_and_are_deterministic(B, L, H, D):
    kv, bt, sl, q = make(B, L, H, 4, D, 16, seed=B + L, lens=[L - 3 * i for i in range(B)])
    # A window of 200 is one split; of 900 (at 1 x 1024) 7 splits over its span, merged as above.
    for kw in ({}, {"window_left": 200}, {"window_left": 900}, {"logits_soft_cap": 30.0}):
        want, want_lse = run(kv, bt, sl, q, "cpu", **kw)
        got, got_lse = run(kv, bt, sl, q, "cuda", **kw)
        again, again_lse = run(kv, bt, sl, q, "cuda", **kw)
        assert torch.equal(got, again) and torch.equal(got_lse, again_lse), kw
        assert close(got, want) <= REL_L2, kw
        assert torch.allclose(got_lse, want_lse, atol=1e-4, rtol=0), kw


def test_cuda_graph_with_changing_lengths():
    kv, bt, sl, q = make(4, 512, 2, 4, 128, 16, seed=6)
    kv, bt, q = kv.cuda(), bt.cuda(), q.cuda()
    lens = torch.tensor([512, 100, 1, 300], dtype=torch.int32, device="cuda")
    ks, vs = torch.tensor([0.03], device="cuda"), torch.tensor([0.05], device="cuda")
    out = torch.empty_like(q)
    ws = nv.decode_workspace(kv, q, bt)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        nv.decode_attention(q, kv, bt, lens, ks, vs, out=out, workspace=ws)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        nv.decode_attention(q, kv, bt, lens, ks, vs, out=out, workspace=ws)
    for new in ([512, 100, 1, 300], [7, 511, 0, 64]):
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        want = nv.decode_attention(q.cpu(), kv.cpu(), bt.cpu(), lens.cpu(), 0.03, 0.05)
        assert close(out.float().cpu(), want.float()) <= REL_L2


@pytest.mark.parametrize("T", [16, 64, 1, 8, 12])
@pytest.mark.parametrize("window", [0, 1, 15, 16, 17, 100, 777, 2047])
@pytest.mark.parametrize("q_len", [1, 3])
@pytest.mark.parametrize("shift", [0, 4], ids=["mma", "lanes"])
def test_cuda_window_of_long_sequences(T, window, q_len, shift):
    """With a window the splits cover the window's columns, from the run of whole pages of 16k
    tokens that holds its first token, not the whole table (design notes: "Decode attention:
    splits from the lengths"): sequences far longer than their window whose first attended token
    is the first and the last of such a run (where the columns needed are the most the plan
    allows), one shorter than its window; masked entries inside and before the window; both readers (a cache
    4 bytes past a 16-byte boundary takes the lane reader); against the CPU path, which walks
    each row's own range."""
    unit_tokens = 16 // math.gcd(16, T) * T
    first_at = lambda r: q_len + window + 5000 + (r - 5000) % unit_tokens  # noqa: E731 (first attended: 5000 + ...)
    lens = [first_at(unit_tokens - 1), first_at(0), 700 + window // 3]
    kv, bt, sl, q = make(3, max(lens), 2, 4, 128, T, q_len=q_len, seed=T * 7 + window, bad_entries=window % 2 == 1,
                         lens=lens)
    layout = "vllm" if T % 4 == 0 else "linear"
    kw = {"q_len": q_len, "window_left": window, "scale_layout": layout}
    check_against_cpu(kv, bt, sl, q, shift=shift, **kw)


@pytest.mark.parametrize("T", [16, 1, 12])
@pytest.mark.parametrize("q_len", [1, 4])
@pytest.mark.parametrize("window", [-1, 50])
@pytest.mark.parametrize("shift", [0, 4], ids=["mma", "lanes"])
def test_cuda_short_sequences_in_a_wide_table(T, q_len, window, shift):
    """The splits share the columns a sequence's length reaches, not the table's width (design
    notes: "Decode attention: splits from the lengths"): sequences of 1 to 700 tokens in a table
    of 8000, where the plan counts up to 64 splits, on both readers, against the CPU path."""
    lens = [37, 700, 1, 129, 0, 300]
    kv, bt, sl, q = make(6, 8000, 2, 4, 128, T, q_len=q_len, seed=T + q_len, lens=lens)
    layout = "vllm" if T % 4 == 0 else "linear"
    kw = {"q_len": q_len, "window_left": window, "scale_layout": layout}
    check_against_cpu(kv, bt, sl, q, shift=shift, **kw)


def test_cuda_a_view_of_the_tables_first_columns():
    """An engine that knows its batch's longest sequence may pass a view of its table's first
    columns (integration guide): the call plans for that width, with that width's workspace, and
    gives the bits of a table of those columns alone; the columns past the view hold pages that
    nothing reads."""
    kv, bt, sl, q = make(2, 1024, 2, 4, 128, 16, seed=31)  # 64 columns
    g = torch.Generator(device="cuda").manual_seed(3)
    wide = torch.randint(0, kv.shape[0], (2, 8192), dtype=torch.int32, device="cuda", generator=g)
    wide[:, :64] = bt.cuda()
    view = wide[:, :64]
    assert view.stride() == (8192, 1)
    got, got_lse = run(kv, view, sl, q, "cuda")
    want, want_lse = run(kv, bt, sl, q, "cuda")
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse)
    kvc, qc = kv.cuda(), q.cuda()
    sizes = [nv.decode_workspace(kvc, qc, t).numel() for t in (view, bt.cuda(), wide)]
    assert sizes[0] == sizes[1] < sizes[2], sizes


def test_cuda_graph_of_a_window_with_changing_lengths():
    """The window's first columns come from each sequence's length on the device: replays with
    other lengths (longer and shorter than the window, empty) move them."""
    kv, bt, sl, q = make(3, 4000, 2, 4, 128, 16, seed=21)
    kv, bt, q = kv.cuda(), bt.cuda(), q.cuda()
    lens = torch.tensor([4000, 1000, 50], dtype=torch.int32, device="cuda")
    ks, vs = torch.tensor([0.03], device="cuda"), torch.tensor([0.05], device="cuda")
    out, lse = torch.empty_like(q), torch.empty(q.shape[:2], device="cuda")
    ws = nv.decode_workspace(kv, q, bt)
    call = lambda: nv.decode_attention(q, kv, bt, lens, ks, vs, window_left=300, out=out, lse=lse,  # noqa: E731
                                       workspace=ws)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    # 3004 and 3005: the first attended token (len - 301) is the last and the first of a page.
    for new in ([4000, 1000, 50], [301, 3999, 0], [17, 3004, 3005]):
        lens.copy_(torch.tensor(new, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        want_lse = torch.empty(q.shape[:2])
        want = nv.decode_attention(q.cpu(), kv.cpu(), bt.cpu(), lens.cpu(), 0.03, 0.05, window_left=300, lse=want_lse)
        assert close(out.float().cpu(), want.float()) <= REL_L2, new
        got_lse = lse.cpu()
        assert torch.equal(got_lse.isinf(), want_lse.isinf()), new
        assert torch.allclose(got_lse[~want_lse.isinf()], want_lse[~want_lse.isinf()], atol=1e-4, rtol=0), new


def test_cuda_call_allocates_nothing_and_never_syncs():
    """With out, lse and the workspace given, a call makes no device allocation through torch (the
    allocator's count of allocations made, so one freed within the call counts too) and
    makes torch synchronize nothing (set_sync_debug_mode raises on a synchronizing torch call);
    the graph test above shows that the library itself does not synchronize (a capture fails on
    a synchronization)."""
    kv, bt, sl, q = make(2, 3000, 2, 4, 128, 16, seed=12)
    kv, bt, sl, q = kv.cuda(), bt.cuda(), sl.cuda(), q.cuda()
    ks, vs = torch.tensor([0.03], device="cuda"), torch.tensor([0.05], device="cuda")
    out, lse = torch.empty_like(q), torch.empty(q.shape[:2], device="cuda")
    ws = nv.decode_workspace(kv, q, bt)
    nv.decode_attention(q, kv, bt, sl, ks, vs, out=out, lse=lse, workspace=ws)  # warm-up
    torch.cuda.synchronize()
    made = lambda: torch.cuda.memory_stats()["allocation.all.allocated"]  # noqa: E731
    before = made()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            nv.decode_attention(q, kv, bt, sl, ks, vs, out=out, lse=lse, workspace=ws)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert made() == before
    torch.cuda.synchronize()
    want = nv.decode_attention(q.cpu(), kv.cpu(), bt.cpu(), sl.cpu(), 0.03, 0.05)
    assert close(out.float().cpu(), want.float()) <= REL_L2


# ---------------------------------------------------------------- against float64 attention
# The GPU reader held directly to the reference (float64 attention over dequantize() of
# the cache), with the CPU tests' tolerances, for every geometry the CPU path is tested on.
from conftest import minus_inf_logits_case, view_combos  # noqa: E402
from test_decode import (LSE_TOL, ODD_GROUPS_Q_LEN, million_token_setup, one_head_case, reference,  # noqa: E402
                         rel_l2_tol, setup)

GPU_MEASURED = {"rel_l2": 0.0, "lse": 0.0}


def on_cuda(t, shift=0):
    """The same view of the same bytes on the GPU (strides and offset kept), `shift` bytes past
    the start of its allocation (uint8 caches; shift 4: sides 4 bytes past a 16-byte boundary,
    which the lane-per-token reader takes)."""
    if t is None:
        return None
    raw = t.untyped_storage()
    if shift:
        flat = torch.empty(0, dtype=torch.uint8, device=raw.device).set_(raw)
        buf = torch.zeros(flat.numel() + shift, dtype=torch.uint8, device="cuda")
        buf[shift:].copy_(flat)
        return buf.as_strided(t.shape, t.stride(), t.storage_offset() + shift)
    base = torch.empty(0, dtype=t.dtype, device="cuda").set_(raw.cuda() if raw.device.type == "cpu" else raw)
    return base.as_strided(t.shape, t.stride(), t.storage_offset())


@pytest.mark.parametrize("T,D,q_len,bad", [(16, 128, 1, False), (12, 128, 2, True), (48, 64, 1, True), (32, 256, 1, False)])
def test_cuda_lane_reader_equals_cpu(T, D, q_len, bad):
    """Sides 4 bytes past a 16-byte boundary take the lane-per-token reader where the narrow
    copies do not (D 128, block sizes that are multiples of 16, D 256), with masked entries and a
    split sequence: equal to the CPU path."""
    kv, bt, sl, q = make(2, 700, 2, 4, D, T, q_len=q_len, seed=T + D, bad_entries=bad, lens=[700, 333])
    layout = "vllm" if T % 4 == 0 else "linear"
    want, want_lse = run(kv, bt, sl, q, "cpu", q_len=q_len, scale_layout=layout)
    got, got_lse = run(kv, bt, sl, q, "cuda", shift=4, q_len=q_len, scale_layout=layout)
    assert close(got, want) <= REL_L2
    assert torch.allclose(got_lse, want_lse, atol=1e-4, rtol=0)


def side_alignment(kv):
    """The largest power of two up to 16 that divides both sides' start and the page stride of a
    5-D cache view (N, 2, ...)."""
    bits = kv.data_ptr() | (kv.data_ptr() + kv.stride(1)) | kv.stride(0) | 16
    return bits & -bits


@pytest.mark.parametrize("T,D,H,shift", [
    (1, 128, 1, 0),   # sides of 72 bytes: one KV head (8 at tensor parallelism 8), pages of one token
    (3, 128, 1, 8),   # sides 8 bytes past a 16-byte boundary
    (12, 128, 2, 8),
    (1, 64, 1, 0),    # sides of 36 bytes
    (3, 64, 1, 4),
    (8, 64, 2, 4),
])
@pytest.mark.parametrize("q_len", [1, 3])
def test_cuda_narrow_copies_equal_cpu(T, D, H, shift, q_len):
    """Block sizes that are not a multiple of 16 can leave the page sides on 8 bytes (D 128) or 4
    (D 64), not 16: the tensor-core reader then copies 8 or 4 bytes at a time (design notes:
    "Decode attention: narrow copies"). Masked entries, a sequence that splits, a short and an
    empty one; a window, a soft cap and an sm_scale: against the CPU path."""
    kv, bt, sl, q = make(4, 1500, H, 4, D, T, q_len=q_len, seed=T * D + H + q_len, bad_entries=True,
                         lens=[1500, 0, 37, 900])
    assert side_alignment(on_cuda(kv, shift=shift)) == (8 if D == 128 else 4)
    layout = "vllm" if T % 4 == 0 else "linear"
    for kw in ({}, {"window_left": 40}, {"logits_soft_cap": 30.0}, {"sm_scale": 0.3}):
        check_against_cpu(kv, bt, sl, q, shift=shift, q_len=q_len, scale_layout=layout, **kw)


def decode_kernels(call):
    """The names of the decode kernels one call launches (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    if not names:  # every call launches a kernel: the profiler sees none (CUPTI taken, as under compute-sanitizer)
        pytest.skip("torch.profiler records no CUDA kernels here")
    return [n for n in names if "decode" in n]


@pytest.mark.parametrize("D", [128, 64])
def test_cuda_token_pool_sides_take_the_narrow_copies(D):
    """A token pool's sides (SGLang's form: separate K and V buffers of one-token pages, one KV head,
    page strides of 72 or 36 bytes on 16-byte aligned bases): equal to the CPU path, and read by
    the tensor-core reader with 8- or 4-byte copies (its kernel's last template argument), where
    the same sides 4 bytes past 16 at D 128 go to the lane reader (review: the 5-D caches of the
    test above leave only their V side off 16 bytes, never the page stride)."""
    F = nv.nvfp4_kv_cache_full_dim(D)
    g = torch.Generator().manual_seed(D)
    S, B, L = 3000, 3, 900
    bufs = [torch.randint(0, 256, (S, 1, 1, F), generator=g, dtype=torch.uint8) for _ in range(2)]
    for b in bufs:
        b[..., D // 2:] &= 0x3F  # scale bytes of real data (no NaN groups)
    bt = torch.randperm(S, generator=g)[: B * L].reshape(B, L).to(torch.int32)
    bt[1, 5::7] = -1  # masked tokens
    sl = torch.tensor([L, 1, 400], dtype=torch.int32)
    q = torch.randn(B, 8, D, generator=g).to(torch.bfloat16)
    kw = {"scale_layout": "linear"}
    want, want_lse = run(bufs[0], bt, sl, q, "cpu", value_cache=bufs[1], **kw)
    kc, vc = bufs[0].cuda(), bufs[1].cuda()
    assert kc.stride(0) % 16 != 0 and kc.data_ptr() % 16 == 0 and vc.data_ptr() % 16 == 0
    args = (q.cuda(), kc, bt.cuda(), sl.cuda(), torch.tensor([0.03], device="cuda"), torch.tensor([0.05], device="cuda"))
    lse = torch.empty(B, 8, device="cuda")
    ws = nv.decode_workspace(kc, args[0], args[2], value_cache=vc)
    out = nv.decode_attention(*args, value_cache=vc, lse=lse, workspace=ws, **kw)
    assert close(out.float().cpu(), want) <= REL_L2
    assert torch.allclose(lse.cpu(), want_lse, atol=1e-4, rtol=0)
    names = decode_kernels(lambda: nv.decode_attention(*args, value_cache=vc, workspace=ws, **kw))
    copies = [m.group(1).split(",")[-1].strip() for n in names for m in [re.search(r"decode_mma_kernel<([^>]*)>", n)] if m]
    assert copies == [{128: "8", 64: "4"}[D]] and not any("decode_kernel<" in n for n in names), names
    if D == 128:  # 4 bytes past 16: the lane reader
        kc4, vc4 = on_cuda(bufs[0], shift=4), on_cuda(bufs[1], shift=4)
        names = decode_kernels(lambda: nv.decode_attention(args[0], kc4, *args[2:], value_cache=vc4, workspace=ws, **kw))
        assert any("decode_kernel<" in n for n in names) and not any("decode_mma_kernel" in n for n in names), names


@pytest.mark.parametrize("shift", [0, 4], ids=["tensor-core cache", "lane cache"])
def test_cuda_block_table_with_a_negative_column_stride(shift):
    """A block table read backwards (a CuPy view [:, ::-1]; torch has no negative strides): the
    tensor-core reader steps through a row with 32-bit unsigned byte offsets, so such a table goes
    to the lane reader (select_decode_kernel), which equals the CPU path."""
    cp = pytest.importorskip("cupy")
    kv, bt, sl, q = make(2, 300, 2, 4, 128, 16, seed=11, bad_entries=True)
    want, want_lse = run(kv, bt, sl, q, "cpu")
    btr = cp.asarray(bt.flip(1).numpy())[:, ::-1]
    assert btr.strides[1] < 0 and bool((cp.asnumpy(btr) == bt.numpy()).all())
    kvc, qc, slc = on_cuda(kv, shift=shift), q.cuda(), sl.cuda()
    lse = torch.empty(q.shape[0], q.shape[1], device="cuda")
    ws = nv.decode_workspace(kvc, qc, bt.cuda())
    got = nv.decode_attention(qc, kvc, btr, slc, torch.tensor([0.03], device="cuda"),
                              torch.tensor([0.05], device="cuda"), lse=lse, workspace=ws)
    assert close(got.float().cpu(), want) <= REL_L2
    assert torch.allclose(lse.cpu(), want_lse, atol=1e-4, rtol=0)


def test_cuda_refuses_what_only_the_cpu_takes():
    """K and V of different head sizes, and cache sides 2 bytes past a 4-byte boundary: the CPU
    path reads both (test_decode.py), the GPU raises a RuntimeError that names the limit and
    writes nothing."""
    F128, F64 = nv.nvfp4_kv_cache_full_dim(128), nv.nvfp4_kv_cache_full_dim(64)
    kc = torch.zeros(6, 16, 2, F128, dtype=torch.uint8, device="cuda")
    vc = torch.zeros(6, 16, 2, F64, dtype=torch.uint8, device="cuda")
    q = torch.randn(2, 8, 128, device="cuda").to(torch.bfloat16)
    bt = torch.arange(6, dtype=torch.int32, device="cuda").reshape(2, 3)
    sl = torch.tensor([40, 48], dtype=torch.int32, device="cuda")
    out_d = torch.full((2, 8, 64), 7.0, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(RuntimeError, match="equal K and V head sizes"):
        nv.decode_attention(q, kc, bt, sl, 1.0, 1.0, value_cache=vc, scale_layout="linear", out=out_d)
    # Found by review: an empty batch returned success, and a geometry that splits asked for its
    # workspace (ValueError) before refusing the head sizes.
    with pytest.raises(RuntimeError, match="equal K and V head sizes"):
        nv.decode_attention(q[:0], kc, bt[:0], sl[:0], 1.0, 1.0, value_cache=vc, scale_layout="linear",
                            out=out_d[:0])
    wide = torch.zeros(2, 64, dtype=torch.int32, device="cuda")  # 64 columns: 2 sequences split
    assert nv.decode_workspace_bytes(2, 1, 8, 2, 64, 64) > 0
    with pytest.raises(RuntimeError, match="equal K and V head sizes"):
        nv.decode_attention(q, kc, wide, sl, 1.0, 1.0, value_cache=vc, scale_layout="linear", out=out_d)
    kv, bt, sl, q = make(2, 40, 2, 4, 64, 16)
    out_a = torch.full(q.shape, 7.0, dtype=q.dtype, device="cuda")
    with pytest.raises(RuntimeError, match="multiples of 4 bytes"):
        nv.decode_attention(q.cuda(), on_cuda(kv, shift=2), bt.cuda(), sl.cuda(), 1.0, 1.0, scale_layout="linear",
                            out=out_a)
    torch.cuda.synchronize()
    assert bool((out_d == 7.0).all()) and bool((out_a == 7.0).all())


def check_gpu(cache, q, bt, sl, q_len=1, k_scale=0.02, v_scale=0.03, scale_layout="vllm", cap=0.0, window=-1,
              sm_scale=None, shift=0):
    kv, vc = on_cuda(cache.kv_cache, shift), on_cuda(cache.value_cache, shift)
    qc, btc, slc = q.cuda(), bt.cuda(), sl.cuda()
    lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device="cuda")
    ws = nv.decode_workspace(kv, qc, btc, q_len=q_len, value_cache=vc)
    out = nv.decode_attention(qc, kv, btc, slc, k_scale, v_scale, value_cache=vc, scale_layout=scale_layout,
                              sm_scale=sm_scale, logits_soft_cap=cap, window_left=window, q_len=q_len, lse=lse,
                              workspace=ws)
    kd, vd = nv.dequantize(cache.kv_cache, k_scale, v_scale, value_cache=cache.value_cache,
                           scale_layout=scale_layout, dtype="float32")
    sm = 1.0 / math.sqrt(q.shape[2]) if sm_scale is None else sm_scale
    want, want_lse = reference(q.float().numpy(), kd.numpy(), vd.numpy(), bt.numpy(), sl.numpy(), q_len, sm, cap,
                               window, cache.N, cache.T)
    o = out.float().cpu().numpy().astype(np.float64)
    l64 = lse.cpu().numpy().astype(np.float64)
    empty = np.isneginf(want_lse)
    assert np.array_equal(np.isneginf(l64), empty) and not o[empty].any()
    den = np.linalg.norm(want)
    err = np.linalg.norm(o - want) / den if den > 0 else np.linalg.norm(o)
    lse_err = np.abs(l64[~empty] - want_lse[~empty]).max() if (~empty).any() else 0.0
    GPU_MEASURED["rel_l2"], GPU_MEASURED["lse"] = max(GPU_MEASURED["rel_l2"], err), max(GPU_MEASURED["lse"], lse_err)
    print(f"\ndecode GPU vs float64 ({q.dtype}): rel L2 {err:.2e}, lse {lse_err:.1e}")
    assert err <= rel_l2_tol(q.dtype) and lse_err <= LSE_TOL, (err, lse_err)


@pytest.mark.parametrize("name", ["jump", "tiny", "nan_at_zero"])
@pytest.mark.parametrize("shift", [0, 4], ids=["mma", "lanes"])
def test_cuda_edge_logits_equal_cpu(name, shift):
    """test_decode.py's edge cases of the logits (a maximum that jumps past fp32's exp range, a
    query row below 2^-113 at a large sm_scale, a NaN V group at weight 0) on both readers, against
    the CPU path: the same NaN elements, the rest within the tolerance, lse within 1e-4."""
    cache, q, bt, sl, sm_scale = one_head_case(name)
    got = []
    for dev in ("cpu", "cuda"):
        c = cache if dev == "cpu" else on_cuda(cache, shift=shift)
        lse = torch.empty(1, 1, device=dev)
        out = nv.decode_attention(q.to(dev), c, bt.to(dev), sl.to(dev), 1.0, 1.0, sm_scale=sm_scale, lse=lse)
        got.append((out.float().cpu(), lse.cpu()))
    (want, want_lse), (out, lse) = got
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(out), nan) and nan.any() == (name == "nan_at_zero")
    assert close(out[~nan], want[~nan]) <= REL_L2
    assert abs(float(lse) - float(want_lse)) <= LSE_TOL, (float(lse), float(want_lse))


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("group", [1, 4, 8, 16])
@pytest.mark.parametrize("q_len", [1, 2, 4, 8])
def test_fp64_head_sizes_groups_q_len(D, group, q_len):
    k = (D // 64) * 16 + group * 4 + q_len
    dtype = ("bfloat16", "float16")[k % 2]
    T = (16, 32)[(k // 3) % 2]
    cache, q, bt, sl = setup(N=24, T=T, H=2 if group < 16 else 1, D=D, B=2, q_len=q_len, group=group, dtype=dtype,
                             seed=k)
    check_gpu(cache, q, bt, sl, q_len=q_len)


@pytest.mark.parametrize("group,q_len", ODD_GROUPS_Q_LEN)
@pytest.mark.parametrize("D,T", [(128, 16), (64, 8)])
def test_fp64_odd_groups_and_q_len(group, q_len, D, T):
    """test_decode.py's odd groups and query lengths on the GPU, also with pages of 8 tokens (the
    per-token reader) and in split-KV (one sequence of 3000 positions)."""
    cache, q, bt, sl = setup(N=12 * 16 // T, T=T, H=2, D=D, B=3, q_len=q_len, group=group, seed=group * 10 + q_len)
    check_gpu(cache, q, bt, sl, q_len=q_len, window=(-1, 20)[q_len % 2])
    cache, q, bt, sl = setup(N=3000 // T + 2, T=T, H=1, D=D, B=1, q_len=q_len, group=group, seed=group + q_len,
                             seq_lens=[3000])
    check_gpu(cache, q, bt, sl, q_len=q_len)


@pytest.mark.parametrize("view,layout,scale_layout", view_combos())
def test_fp64_cache_forms(view, layout, scale_layout):
    cache, q, bt, sl = setup(N=40, view=view, layout=layout, scale_layout=scale_layout, q_len=2, group=4,
                             seed=len(view) + len(layout))
    check_gpu(cache, q, bt, sl, q_len=2, scale_layout=scale_layout)


@pytest.mark.parametrize("view,layout,scale_layout", view_combos())
def test_fp64_short_pages_cache_forms(view, layout, scale_layout):
    """Every cache form with pages of 4 tokens (interleaved V scales) or of 1 (linear)."""
    T = 4 if scale_layout == "vllm" else 1
    cache, q, bt, sl = setup(N=400 // T, T=T, view=view, layout=layout, scale_layout=scale_layout, q_len=2, group=4,
                             seed=len(view) + len(layout) + T)
    check_gpu(cache, q, bt, sl, q_len=2, scale_layout=scale_layout)


@pytest.mark.parametrize("cap,window", [(0.0, 0), (0.0, 17), (30.0, -1), (5.0, 40)])
def test_fp64_soft_cap_and_window(cap, window):
    cache, q, bt, sl = setup(N=40, B=2, q_len=4, group=4, seed=int(cap * 10) + window)
    check_gpu(cache, q, bt, sl, q_len=4, cap=cap, window=window)


@pytest.mark.parametrize("D,T", [(128, 16), (256, 32), (64, 16)])
def test_fp64_long_sequences(D, T):
    """Thousands of tokens: split-KV and the pipeline's full steps."""
    cache, q, bt, sl = setup(N=600, T=T, H=1, D=D, B=2, q_len=1, group=8, seed=D, seq_lens=[4000 + D, 4333])
    check_gpu(cache, q, bt, sl)


@pytest.mark.parametrize("window", [-1, 300_000])
def test_fp64_a_million_positions(window):
    """Sequence lengths to at least 1M tokens (test_decode.py's a_million_positions on the GPU):
    2^20 + 77 positions in split-KV, q_len 2, GQA 2, the whole sequence or a window."""
    cache, q, bt, sl = million_token_setup(window, seed=5 + window % 7, index="int64" if window > 0 else "int32")
    check_gpu(cache, q, bt, sl, q_len=2, window=window)


def test_fp64_long_unsplit_sequences():
    """512 sequences of 65,536 positions: enough (sequence, head) pairs that a sequence is not
    split, so each warp sums 16,384 positions' terms on its own."""
    rng = np.random.default_rng(41)
    N, T, B, L = 64, 16, 512, 1 << 16
    cache, q, _, _ = setup(N=N, T=T, H=1, D=64, B=B, q_len=1, group=2, seed=41)
    bt = torch.from_numpy(rng.integers(0, N, (B, L // T)).astype(np.int32))
    check_gpu(cache, q, bt, torch.full((B,), L, dtype=torch.int32))


@pytest.mark.parametrize("shift", [0, 4])  # the tensor-core reader; the lane-per-token reader
@pytest.mark.parametrize("sm_scale", [None, 1.5])
def test_fp64_rising_logits(sm_scale, shift):
    """Each warp walks 8 steps (one split per sequence) over pages ordered by query head 0's
    largest logit, so that its running maximum keeps rising: at the default scale by about 11.5
    (log2) over its steps, mostly by less than the tensor-core reader's slack of 8 per step
    (probabilities up to 2^8 against a stale maximum); at sm_scale 1.5 by more than 8 on almost
    every step. The lane-per-token reader (shift 4) rescales at every rise instead: the same
    pages check that path of its online softmax."""
    B, L, T = 64, 1024, 16
    cache, q, bt, sl = setup(N=B * L // T, T=T, H=8, D=64, B=B, group=2, seq_lens=[L] * B, seed=31)
    kd, _ = nv.dequantize(cache.kv_cache, 0.02, 0.03, value_cache=cache.value_cache, dtype="float32")
    k0 = kd.numpy()[:, :, 0].astype(np.float64)  # (N, T, D) of KV head 0
    bt = bt.numpy().copy()
    for b in range(B):
        pages = bt[b, : L // T]
        top = np.einsum("ptd,d->pt", k0[pages], q[b, 0].double().numpy()).max(axis=1)
        bt[b, : L // T] = pages[np.argsort(top)]
    check_gpu(cache, q, torch.from_numpy(bt), sl, sm_scale=sm_scale, shift=shift)


def test_fp64_short_empty_and_masked():
    lens = [0, 1, 3, 16, 17, 37, -5]
    cache, q, bt, sl = setup(B=len(lens), N=40, q_len=2, group=4, seq_lens=lens, seed=11)
    bt[0, 0], bt[2, 0], bt[5, 1] = -1, cache.N, -(2**31)
    check_gpu(cache, q, bt, sl, q_len=2)


def test_fp64_tiny_queries():
    """Queries of size 1e-36 (bf16 subnormal range is near): the reader's power-of-two query scale
    stays finite and the softmax is the near-uniform one of the reference."""
    cache, q, bt, sl = setup(N=40, B=2, q_len=1, group=4, seed=21)
    check_gpu(cache, (q.float() * 1e-36).to(torch.bfloat16), bt, sl)


def test_cuda_nan_k_group_reaches_only_the_rows_that_see_it():
    """The GPU twin of test_decode.py's NaN test: a K group with a NaN scale byte makes NaN the
    rows whose window contains it (output and lse), and only those."""
    from conftest import make_cache
    from test_decode import as_index, fill

    rng = np.random.default_rng(3)
    N, T, H, D = 4, 16, 1, 64
    cache = make_cache(N, T, H, D, backend="torch", seed=3)
    fill(cache, rng, 1.0, 1.0, "vllm", nan_slot=5)  # page 0, position 5
    q = torch.randn(4, 2, D, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).cuda()
    lse = torch.empty(4, 2, device="cuda")
    out = nv.decode_attention(q, on_cuda(cache.kv_cache), as_index([[0, 1]], "int32").cuda(),
                              as_index([24], "int32").cuda(), 1.0, 1.0, q_len=4, window_left=16, lse=lse)
    # rows at positions 20..23 see [4..20] .. [7..23]: position 5 only for rows 0, 1.
    assert torch.isnan(out[:2].float()).all() and torch.isnan(lse[:2]).all()
    assert torch.isfinite(out[2:].float()).all() and torch.isfinite(lse[2:]).all()


@pytest.mark.parametrize("T,D,elem,shift", [(16, 64, 5, 0), (16, 128, 40, 0), (16, 256, 20, 0), (8, 128, 5, 0),
                                           (12, 128, 5, 0), (12, 128, 5, 4), (16, 128, 40, 4)])
@pytest.mark.parametrize("slot,window", [(5, 16), (23, -1), (21, -1)])
def test_cuda_v_nan_group_reaches_only_the_rows_that_attend_it(T, D, elem, shift, slot, window):
    """A NaN V group of a token that some rows mask (window, causal end of the queries) reaches
    only the rows that attend it, in that group's elements, in both readers (aligned sides:
    tensor cores; shift 4: lane per token), as on the CPU; everything else equals the CPU path."""
    from test_decode import check_v_nan, v_nan_case

    cache, q, bt, sl, seeing = v_nan_case(T, D, slot, elem, window)
    lse = torch.empty(4, 2, device="cuda")
    out = nv.decode_attention(q.cuda(), on_cuda(cache.kv_cache, shift), bt.cuda(), sl.cuda(), 1.0, 1.0, q_len=4,
                              window_left=window, lse=lse)
    check_v_nan(out, lse, seeing, elem)
    want_lse = torch.empty(4, 2)
    want = nv.decode_attention(q, cache.kv_cache, bt, sl, 1.0, 1.0, q_len=4, window_left=window, lse=want_lse)
    ok = ~torch.isnan(want.float())
    assert close(out.float().cpu()[ok], want.float()[ok]) <= REL_L2
    assert torch.allclose(lse.cpu(), want_lse, atol=1e-4, rtol=0)


@pytest.mark.parametrize("T,D,scale_layout,q_len", [(16, 128, "vllm", 1), (16, 64, "vllm", 3), (4, 128, "linear", 2),
                                                     (1, 64, "linear", 1), (12, 256, "linear", 4)])
def test_cuda_random_scale_bytes_equal_cpu(T, D, scale_layout, q_len):
    """Scale bytes the store never writes: the sign bit set, and NaN groups of both encodings (0x7F,
    0xFF) in K and V, long enough for split-KV. The NaN pattern of out and lse is the CPU path's
    exactly (held to the fp64 reference by test_decode.py), the rest within the tolerances.
    Added on 2026-12-05 without a device: first run in the next device session."""
    g = torch.Generator().manual_seed(T * D + q_len)
    B, H, group, L = 3, 2, 4, 40 * T
    blocks = -(-L // T)
    N = B * blocks + 2
    F = nv.nvfp4_kv_cache_full_dim(D)
    raw = torch.randint(0, 256, (N, 2, H * T * F), generator=g, dtype=torch.uint8)
    sc = raw[:, :, H * T * (D // 2):]
    sc &= 0xBB  # magnitudes below 0x3C (1.5), sign bit kept as drawn
    nan = torch.rand(sc.shape, generator=g) < 0.0005
    sc[nan] = torch.where(torch.rand(sc.shape, generator=g) < 0.5, 0x7F, 0xFF).to(torch.uint8)[nan]
    kv = raw.view(N, 2, H, T, F).permute(0, 1, 3, 2, 4)
    bt = torch.randperm(N, generator=g)[: B * blocks].reshape(B, blocks).to(torch.int32)
    seq_lens = torch.tensor([L, L - T // 2 - 1, 7], dtype=torch.int32)
    q = torch.randn(B * q_len, H * group, D, generator=g).to(torch.bfloat16)
    want, want_lse = run(kv, bt, seq_lens, q, "cpu", q_len=q_len, scale_layout=scale_layout, window_left=25 * T)
    got, got_lse = run(kv, bt, seq_lens, q, "cuda", q_len=q_len, scale_layout=scale_layout, window_left=25 * T)
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got_lse.isnan(), want_lse.isnan())
    assert bool(want.isnan().any()) and bool((~want.isnan()).any())
    fin = ~want.isnan()
    assert close(got[fin], want[fin]) <= REL_L2
    lf = want_lse.isfinite()
    assert torch.allclose(got_lse[lf], want_lse[lf], atol=1e-4, rtol=0)


@pytest.mark.parametrize("L", [64, 65, 200])
@pytest.mark.parametrize("shift", [0, 4], ids=["tensor-core cache", "lane cache"])
@pytest.mark.parametrize("cap", [0.0, 10.0])
@pytest.mark.parametrize("q0", [2.0, 1024.0])
def test_cuda_logits_of_minus_inf_weigh_zero(L, shift, cap, q0):
    """Found by review (static, 2026-12-05): the lane reader summed exp(-inf - -inf) = NaN for a
    row whose logits so far were all -inf, and the tensor-core reader's logit factor
    k_scale * sm_scale * 2^6 overflowed to inf at sm_scale 3e38 (a zero K row then gave
    0 * inf = NaN). Its factor with the row's power of two, k_scale * sm_scale * 2^6 * 2^-k, still
    overflowed with max|q| 2 on sm_80 (2^14 there: the sm_80 paths' run, 2026-12-05), and by
    the same arithmetic would with max|q| 1024 on sm_90; now held at FLT_MAX. CPU semantics
    (test_decode.py): -inf weighs 0 wherever it falls."""
    cache, q, bt = minus_inf_logits_case(nv, L, q0=q0)
    for n in (L, L - 1):
        lens = torch.tensor([n], dtype=torch.int32)
        got = []
        for dev in ("cpu", "cuda"):
            c = cache if dev == "cpu" else on_cuda(cache, shift=shift)
            lse = torch.empty(1, 1, device=dev)
            out = nv.decode_attention(q.to(dev), c, bt.to(dev), lens.to(dev), 1.0, 1.0, scale_layout="linear",
                                      sm_scale=3e38, logits_soft_cap=cap, lse=lse)
            got.append((out.float().cpu(), lse.cpu()))
        (want, want_lse), (out, lse) = got
        assert not torch.isnan(out).any() and not torch.isnan(lse).any(), (n, out, lse)
        assert close(out, want) <= REL_L2 if want.any() else not out.any()
        assert float(lse) == float(want_lse) or abs(float(lse) - float(want_lse)) <= 1e-4


@pytest.mark.parametrize("shift", [0, 4], ids=["tensor-core cache", "lane cache"])
def test_cuda_window_past_the_table_of_a_huge_length(shift):
    """Found by review (static): with an int64 length of 2^39 + 1 and window_left 0 the row sees
    only position 2^39, past the table's 1024 positions: nothing (out 0, lse -inf). The
    tensor-core reader's first full step, past 2^31 steps, wrapped in int32 and made every step
    of the table full (unmasked)."""
    kv, bt, _, q = make(1, 1024, 1, 1, 128, 16, seed=3)
    sl = torch.tensor([2**39 + 1], dtype=torch.int64)
    for dev in ("cpu", "cuda"):
        c = kv if dev == "cpu" else on_cuda(kv, shift=shift)
        lse = torch.empty(1, 1, device=dev)
        ws = nv.decode_workspace(c, q.to(dev), bt.to(dev)) if dev == "cuda" else None
        out = nv.decode_attention(q.to(dev), c, bt.to(dev), sl.to(dev), 0.03, 0.05, window_left=0, lse=lse,
                                  workspace=ws)
        assert not out.float().any() and float(lse) == -math.inf, dev


def test_cuda_more_head_blocks_than_a_grid_dimension_is_a_clear_error():
    """Found by review (static): KV heads x query-row blocks past 65535 (8192 heads, 128 rows of
    16 a block) failed the launch with "invalid configuration argument"; now refused by name."""
    H, group, q_len, D, T = 8192, 16, 8, 128, 1
    F = nv.nvfp4_kv_cache_full_dim(D)
    kv = torch.zeros(2, 2, T, H, F, dtype=torch.uint8, device="cuda")
    q = torch.zeros(q_len, H * group, D, dtype=torch.bfloat16, device="cuda")
    bt = torch.zeros(1, 2, dtype=torch.int32, device="cuda")
    sl = torch.tensor([2], dtype=torch.int32, device="cuda")
    with pytest.raises(RuntimeError, match="65535"):
        nv.decode_attention(q, kv, bt, sl, q_len=q_len, scale_layout="linear")
