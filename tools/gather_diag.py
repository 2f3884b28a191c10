"""Where the time of a gather goes: the gather against its own output written alone.

Run on a GPU machine (torch and cupy): python3 tools/gather_diag.py. For 4K, 16K and 64K
tokens (H 8, D 128, bf16, 8 sequences) it times, queued behind a spin like the benchmark's
"gpu us": the gather; the gather with every block-table entry bad (it writes zeros and reads no
pages: the kernel's write side alone); a plain write-only kernel (16-byte streaming stores,
grid-stride, 512 contiguous bytes per warp store; SMs x 8 and x 32 blocks of 256 threads) over
the same output bytes; the same writer in the gather's store pattern before commit 3343219 (lane
pairs, one sector of each of 16 lines per warp store); writers through bulk copies from shared
memory (2-16 KB per copy); torch's zero_ (a memset); and copies of the case's bytes.
"""
import cupy as cp
import torch

import nvfp4kv
from nvfp4kv import bench as B

WRITE = cp.RawKernel(r"""
extern "C" __global__ void write_only(uint4* out, long long n16) {
  const uint4 z = make_uint4(0u, 0u, 0u, 0u);
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n16; i += (long long)gridDim.x * blockDim.x)
    __stcs(out + i, z);
}""", "write_only")
# The gather's store pattern before commit 3343219: lanes 2p, 2p+1 own one 128-byte line and write
# it in 4 instructions, one 32-byte sector each (each instruction of a warp touches 16 lines).
WRITE_PAIRS = cp.RawKernel(r"""
extern "C" __global__ void write_pairs(uint4* out, long long lines) {
  const uint4 z = make_uint4(0u, 0u, 0u, 0u);
  const int odd = threadIdx.x & 1;
  for (long long p = (blockIdx.x * (long long)blockDim.x + threadIdx.x) / 2; p < lines; p += (long long)gridDim.x * blockDim.x / 2) {
    uint4* o = out + 8 * p + odd;
    __stcs(o, z); __stcs(o + 2, z); __stcs(o + 4, z); __stcs(o + 6, z);
  }
}""", "write_pairs")

# A writer through bulk copies (cp.async.bulk, sm_90+): each warp's lane 0 copies a `chunk`-byte
# buffer of shared memory to consecutive chunks of the output, grid-stride; optionally with an
# evict-first L2 hint, as the gather's stores are evict-first.
WRITE_BULK = cp.RawKernel(r"""
extern "C" __global__ void write_bulk(char* out, long long nbytes, int chunk, int hint) {
  extern __shared__ __align__(128) unsigned char buf[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, warps = blockDim.x / 32;
  unsigned char* mine = buf + warp * chunk;
  for (int i = 16 * lane; i < chunk; i += 512) *reinterpret_cast<uint4*>(mine + i) = make_uint4(0u, 0u, 0u, 0u);
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  __syncwarp();
  if (lane != 0) return;
  unsigned long long policy;
  asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
  const unsigned src = static_cast<unsigned>(__cvta_generic_to_shared(mine));
  for (long long c = blockIdx.x * (long long)warps + warp; c < nbytes / chunk; c += (long long)gridDim.x * warps) {
    if (hint)
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group.L2::cache_hint [%0], [%1], %2, %3;"
                   :: "l"(out + c * chunk), "r"(src), "r"(chunk), "l"(policy) : "memory");
    else
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" :: "l"(out + c * chunk), "r"(src), "r"(chunk) : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
  }
  asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
}""", "write_bulk")


def write_bulk(buf: torch.Tensor, blocks: int, chunk: int, hint: bool):
    stream = cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    nbytes = buf.numel() * buf.element_size()
    WRITE_BULK.max_dynamic_shared_size_bytes = 8 * chunk
    with stream:
        WRITE_BULK((blocks,), (256,), (buf.data_ptr(), cp.int64(nbytes), cp.int32(chunk), cp.int32(int(hint))),
                   shared_mem=8 * chunk)


def write_only(buf: torch.Tensor, blocks: int, pairs: bool = False):
    stream = cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    n16 = buf.numel() * buf.element_size() // 16
    with stream:
        if pairs:
            WRITE_PAIRS((blocks,), (256,), (buf.data_ptr(), cp.int64(n16 // 8)))
        else:
            WRITE((blocks,), (256,), (buf.data_ptr(), cp.int64(n16)))


c = B.measure_ceilings(torch, quick=True)
sms = torch.cuda.get_device_properties(0).multi_processor_count
print(f"copy {c['copy_GBps']:.0f} GB/s, empty launch {c['empty_launch_us']:.2f} us, {sms} SMs")
H, D, T, seqs = 8, 128, 16, 8
for n in (4096, 16384, 65536):
    case = B.gather_case(torch, nvfp4kv, n, H, D, T, seqs)
    ko = case["key_out"]
    bad = torch.full_like(case["block_table"], -1)
    both = torch.empty(2 * ko.numel(), dtype=torch.bfloat16, device="cuda")  # the outputs' bytes
    total = n * (2 * H * (D // 2 + D // 16) + 2 * H * D * 2)
    writes = 2 * ko.numel() * 2

    def gather(table):
        return lambda: case["call"](table)

    for name, fn, nbytes in (("gather", gather(case["block_table"]), total),
                             ("gather, bad table (writes only)", gather(bad), writes),
                             ("write-only kernel, SMs x 8 blocks", lambda: write_only(both, sms * 8), writes),
                             ("write-only kernel, SMs x 32 blocks", lambda: write_only(both, sms * 32), writes),
                             ("write-only, the gather's old lane-pair pattern, SMs x 8", lambda: write_only(both, sms * 8, True), writes),
                             ("write-only, the gather's old lane-pair pattern, SMs x 4", lambda: write_only(both, sms * 4, True), writes),
                             ("bulk-copy writer, 2 KB per copy, SMs x 4", lambda: write_bulk(both, sms * 4, 2048, False), writes),
                             ("bulk-copy writer, 2 KB per copy, evict-first, SMs x 4", lambda: write_bulk(both, sms * 4, 2048, True), writes),
                             ("bulk-copy writer, 8 KB per copy, evict-first, SMs x 4", lambda: write_bulk(both, sms * 4, 8192, True), writes),
                             ("bulk-copy writer, 16 KB per copy, evict-first, SMs x 1", lambda: write_bulk(both, sms, 16384, True), writes),
                             ("cudaMemsetAsync", lambda: both.zero_(), writes)):
        for _ in range(3):
            fn()
        us = B._queued_per_call(torch, fn, 100, 7)
        print(f"  {n:>6} {name}: {us:.2f} us, {nbytes / us / 1e3:.0f} GB/s")
    for name, nbytes in (("copy of the case's bytes", total), ("copy of the outputs' bytes", writes)):
        us = B.copy_gpu_us(torch, nbytes, 1, quick=True)
        print(f"  {n:>6} {name} (half read, half written): {us:.2f} us")
