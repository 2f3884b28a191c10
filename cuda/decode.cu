// CUDA decode attention over the NVFP4 cache (issue #23): a first, correct reader.
//
// Grid: x = split of the block table's columns (decode_splits), y = KV head x chunk of query rows,
// z = sequence. A block of kDecodeWarps warps walks the split's tokens 32 at a time per warp:
// for the logits each lane takes one token (its K row's codes and scales, decoded as e2m1 x e4m3
// in fp32, dotted with the chunk's query rows held in shared memory); for the output each lane
// takes Dv/32 consecutive elements of every token of the step. Softmax is online per warp
// (running max and denominator per query row); the warps merge in shared memory, in warp order,
// and a split either writes the output or its partial (max, denominator, unnormalized output) to
// the workspace, which decode_combine_kernel merges in split order: the same inputs give the same
// bits on every run. The global scales are applied to the logits (k_scale * sm_scale) and to the
// output (v_scale), so K and V are read as e2m1 x e4m3, exact in fp32.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>

#include "backend.h"
#include "common.cuh"

namespace nvfp4kv {
namespace {

constexpr int kDecodeWarps = 4;
constexpr int kDecodeThreads = 32 * kDecodeWarps;
constexpr int kMaxRows = 8;  // query rows (group x q_len) of one block; more rows: more chunks

struct DecodeLaunch {
  DecodeParams p;
  SideOffsets off[2];      // K, V: the format core's offsets, affine in (head, position, group)
  FastDiv block_size;      // T
  int64_t cols_per_split;  // block-table columns of one split
  int32_t splits;
  int32_t chunks;          // chunks of kRowsPerBlock query rows per KV head
  int64_t b0;              // first sequence of this launch
};

__device__ __forceinline__ int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }
__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

template <DType kDType>
__device__ __forceinline__ float load_q(const void* base, int64_t idx) {
  const uint16_t h = static_cast<const uint16_t*>(base)[idx];
  return kDType == DType::kFloat16 ? f16_to_float(h) : bf16_to_float(h);
}

template <DType kDType>
__device__ __forceinline__ void store_out(void* base, int64_t idx, float v) {
  static_cast<uint16_t*>(base)[idx] = kDType == DType::kFloat16 ? float_to_f16(v) : float_to_bf16(v);
}

// kRowsPerBlock: 1, 2, 4 or 8 query rows per block (the smallest power of two that holds the
// group's rows, at most kMaxRows): the logits cost one FMA per row and element.
template <DType kDType, int kD, int kRowsPerBlock>
__global__ void __launch_bounds__(kDecodeThreads) decode_kernel(const __grid_constant__ DecodeLaunch L) {
  constexpr int kE = kD / 32;  // output elements per lane
  const DecodeParams& p = L.p;
  const int64_t b = L.b0 + blockIdx.z;
  const int32_t h = static_cast<int32_t>(blockIdx.y) / L.chunks;
  const int32_t chunk = static_cast<int32_t>(blockIdx.y) % L.chunks;
  const int32_t split = static_cast<int32_t>(blockIdx.x);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int32_t rows_total = p.group * p.q_len;
  const int32_t r0 = chunk * kRowsPerBlock;
  const int32_t R = min(kRowsPerBlock, rows_total - r0);

  __shared__ float q_s[kRowsPerBlock][kD];
  __shared__ float p_s[kDecodeWarps][kRowsPerBlock][32];
  __shared__ float m_s[kDecodeWarps][kRowsPerBlock], l_s[kDecodeWarps][kRowsPerBlock];
  __shared__ float acc_s[kDecodeWarps][kRowsPerBlock][kD];

  wait_for_prior_grids();
  allow_next_grids();
  const int64_t len = load_index(p.seq_lens, b);
  const float kq = read_scale(p.k_scale) * p.sm_scale;

  // Query rows of this chunk: row r = g * q_len + i (query head h * group + g, token i).
  for (int idx = threadIdx.x; idx < kRowsPerBlock * kD; idx += kDecodeThreads) {
    const int r = idx / kD, d = idx % kD;
    float v = 0.0f;
    if (r < R) {
      const int32_t rr = r0 + r, g = rr / p.q_len, i = rr % p.q_len;
      v = load_q<kDType>(p.query, (b * p.q_len + i) * p.q_stride[0] + (int64_t{h} * p.group + g) * p.q_stride[1] + d);
    }
    q_s[r][d] = v;
  }
  __syncthreads();

  // Each row's token range: [first, last] with last = len - q_len + i, first from the window.
  int64_t first[kRowsPerBlock], last[kRowsPerBlock];
#pragma unroll
  for (int r = 0; r < kRowsPerBlock; ++r) {
    const int32_t i = (r0 + r) % p.q_len;
    last[r] = r < R && len > 0 ? len - p.q_len + i : -1;
    first[r] = p.window_left >= 0 ? max64(0, last[r] - p.window_left) : 0;
  }
  const int64_t lo = split * L.cols_per_split * p.T;
  const int64_t hi = min64(min64((split + 1) * L.cols_per_split, p.max_blocks) * p.T, len);
  const IndexVec bt_row = block_table_row(p, b);
  PageOffsets kat, vat;  // this KV head's rows: 32-bit offsets per position and group
  kat.init(L.off[0], h, 0);
  vat.init(L.off[1], h, lane * kE / kGroupSize);

  float m[kRowsPerBlock], l[kRowsPerBlock], acc[kRowsPerBlock][kE];
#pragma unroll
  for (int r = 0; r < kRowsPerBlock; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.0f;
#pragma unroll
    for (int e = 0; e < kE; ++e) acc[r][e] = 0.0f;
  }

  for (int64_t t0 = lo + warp * 32; t0 < hi; t0 += kDecodeWarps * 32) {
    // Logits: lane = token.
    const int64_t j = t0 + lane;
    int64_t page = -1;
    const int64_t blk = L.block_size.div_any(j);
    const uint32_t pos = static_cast<uint32_t>(j - blk * p.T);
    if (j < hi) {
      page = load_index(bt_row, blk);
      if (page < 0 || page >= p.N) page = -1;  // masked out, never read
    }
    float s[kRowsPerBlock];
#pragma unroll
    for (int r = 0; r < kRowsPerBlock; ++r) s[r] = 0.0f;
    if (page >= 0) {
      const uint8_t* side = p.k.base + page * p.k.page_stride;
      const uint8_t* codes = side + kat.data(pos);
#pragma unroll
      for (int g = 0; g < kD / kGroupSize; ++g) {
        const uint32_t* cw = reinterpret_cast<const uint32_t*>(codes + 8 * g);  // 4-byte aligned
        const uint32_t sfb = side[kat.scale(pos, g)];
        float k[kGroupSize];
        const uint32_t words[2] = {__ldg(cw), __ldg(cw + 1)};
#pragma unroll
        for (int i = 0; i < kGroupSize; ++i) k[i] = e2m1_decode(words[i >> 3] >> (4 * (i & 7)));
        const float sfq = (sfb & 0x7Fu) == kScaleNaN ? quiet_nan() : e4m3_decode(sfb);
#pragma unroll
        for (int r = 0; r < kRowsPerBlock; ++r) {
          float dot = 0.0f;
#pragma unroll
          for (int i = 0; i < kGroupSize; ++i) dot = fmaf(q_s[r][kGroupSize * g + i], k[i], dot);
          s[r] = fmaf(dot, sfq, s[r]);
        }
      }
    }
    // Scale, soft cap, mask; online softmax per row over the warp's 32 tokens.
#pragma unroll
    for (int r = 0; r < kRowsPerBlock; ++r) {
      float x = s[r] * kq;
      if (p.soft_cap > 0.0f) x = p.soft_cap * tanhf(x / p.soft_cap);
      const bool ok = page >= 0 && j >= first[r] && j <= last[r];
      x = ok ? x : -INFINITY;
      float mx = x;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      const float m_new = fmaxf(m[r], mx);
      const float pr = ok ? __expf(x - m_new) : 0.0f;
      float sum = pr;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      const float corr = m_new == -INFINITY ? 1.0f : __expf(m[r] - m_new);
      l[r] = l[r] * corr + sum;
#pragma unroll
      for (int e = 0; e < kE; ++e) acc[r][e] *= corr;
      m[r] = m_new;
      p_s[warp][r][lane] = pr;
    }
    __syncwarp();
    // Output: lane = kE consecutive elements of each of the step's tokens, kVBatch tokens' loads
    // in flight at once (one token at a time left every warp waiting on one load's latency).
    constexpr int kVBatch = 8;
    const int step = static_cast<int>(min64(32, hi - t0));
    for (int t8 = 0; t8 < step; t8 += kVBatch) {
      uint32_t cw[kVBatch], sb[kVBatch];
#pragma unroll
      for (int u = 0; u < kVBatch; ++u) {
        const int t = t8 + u;
        const int64_t pg = __shfl_sync(0xffffffffu, page, t & 31);
        const uint32_t pt = __shfl_sync(0xffffffffu, pos, t & 31);
        cw[u] = 0u;
        sb[u] = 0u;  // a masked token: codes and scale 0, so its values are 0 (and its p is 0)
        if (t < step && pg >= 0) {
          const uint8_t* side = p.v.base + pg * p.v.page_stride;
          const uint8_t* codes = side + vat.data(pt) + (lane * kE / 2) % 8;
          if constexpr (kE == 2) cw[u] = __ldg(codes);
          else if constexpr (kE == 4) cw[u] = __ldg(reinterpret_cast<const uint16_t*>(codes));
          else cw[u] = __ldg(reinterpret_cast<const uint32_t*>(codes));
          sb[u] = __ldg(side + vat.scale(pt, 0));
        }
      }
#pragma unroll
      for (int u = 0; u < kVBatch; ++u) {
        const int t = t8 + u;
        if (t >= step) break;  // warp-uniform
        const float sfq = (sb[u] & 0x7Fu) == kScaleNaN ? quiet_nan() : e4m3_decode(sb[u]);
        float v[kE];
#pragma unroll
        for (int e = 0; e < kE; ++e) v[e] = e2m1_decode(cw[u] >> (4 * e)) * sfq;
#pragma unroll
        for (int r = 0; r < kRowsPerBlock; ++r) {
          const float pr = p_s[warp][r][t];
#pragma unroll
          for (int e = 0; e < kE; ++e) acc[r][e] = fmaf(pr, v[e], acc[r][e]);
        }
      }
    }
    __syncwarp();
  }

  // Merge the warps in warp order.
#pragma unroll
  for (int r = 0; r < kRowsPerBlock; ++r) {
    if (lane == 0) {
      m_s[warp][r] = m[r];
      l_s[warp][r] = l[r];
    }
#pragma unroll
    for (int e = 0; e < kE; ++e) acc_s[warp][r][lane * kE + e] = acc[r][e];
  }
  __syncthreads();
  const float vscale = read_scale(p.v_scale);
  for (int idx = threadIdx.x; idx < R * kD; idx += kDecodeThreads) {
    const int r = idx / kD, d = idx % kD;
    float M = -INFINITY;
    for (int w = 0; w < kDecodeWarps; ++w) M = fmaxf(M, m_s[w][r]);
    float lsum = 0.0f, o = 0.0f;
    for (int w = 0; w < kDecodeWarps; ++w) {
      const float c = m_s[w][r] == -INFINITY ? 0.0f : __expf(m_s[w][r] - M);
      lsum += l_s[w][r] * c;
      o += acc_s[w][r][d] * c;
    }
    const int32_t rr = r0 + r, g = rr / p.q_len, i = rr % p.q_len;
    const int64_t row = b * p.q_len + i, hq = int64_t{h} * p.group + g;
    if (L.splits == 1) {
      const float out = lsum > 0.0f ? o / lsum * vscale : 0.0f;
      store_out<kDType>(p.out, row * p.out_stride[0] + hq * p.out_stride[1] + d, out);
      if (p.lse && d == 0)
        p.lse[row * p.lse_stride[0] + hq * p.lse_stride[1]] = lsum > 0.0f ? M + logf(lsum) : -INFINITY;
    } else {
      // Partial of this split: [row][hq][split] -> (M, l, Dv outputs).
      const int64_t Hq = int64_t{p.H} * p.group;
      float* part = p.workspace + ((row * Hq + hq) * L.splits + split) * (kD + 2);
      if (d == 0) {
        part[0] = M;
        part[1] = lsum;
      }
      part[2 + d] = o;
    }
  }
}

// Merges the splits of one (row, query head), in split order.
template <DType kDType, int kD>
__global__ void __launch_bounds__(kD) decode_combine_kernel(const __grid_constant__ DecodeLaunch L) {
  const DecodeParams& p = L.p;
  wait_for_prior_grids();
  allow_next_grids();
  const int64_t Hq = int64_t{p.H} * p.group;
  const int64_t unit = blockIdx.x;  // row * Hq + hq
  const int64_t row = unit / Hq, hq = unit % Hq;
  const float* part = p.workspace + unit * L.splits * (kD + 2);
  float M = -INFINITY;
  for (int s = 0; s < L.splits; ++s) M = fmaxf(M, part[s * (kD + 2)]);
  float lsum = 0.0f, o = 0.0f;
  const int d = threadIdx.x;
  for (int s = 0; s < L.splits; ++s) {
    const float* ps = part + s * (kD + 2);
    const float c = ps[0] == -INFINITY ? 0.0f : __expf(ps[0] - M);
    lsum += ps[1] * c;
    o += ps[2 + d] * c;
  }
  const float out = lsum > 0.0f ? o / lsum * read_scale(p.v_scale) : 0.0f;
  store_out<kDType>(p.out, row * p.out_stride[0] + hq * p.out_stride[1] + d, out);
  if (p.lse && d == 0) p.lse[row * p.lse_stride[0] + hq * p.lse_stride[1]] = lsum > 0.0f ? M + logf(lsum) : -INFINITY;
}

template <DType kDType, int kD>
cudaError_t launch_decode(DecodeLaunch& L, int device, cudaStream_t stream) {
  const DecodeParams& p = L.p;
  for (int64_t b0 = 0; b0 < p.B; b0 += 65535) {
    L.b0 = b0;
    const dim3 grid(static_cast<unsigned>(L.splits), static_cast<unsigned>(p.H * L.chunks),
                    static_cast<unsigned>(std::min<int64_t>(65535, p.B - b0)));
    const int rows = p.group * p.q_len;
    const auto kernel = rows <= 1 ? decode_kernel<kDType, kD, 1>
                        : rows <= 2 ? decode_kernel<kDType, kD, 2>
                        : rows <= 4 ? decode_kernel<kDType, kD, 4>
                                    : decode_kernel<kDType, kD, kMaxRows>;
    cudaError_t err = launch_pdl(kernel, grid, dim3(kDecodeThreads), device, stream, L);
    if (err != cudaSuccess) return err;
  }
  if (L.splits > 1) {
    const int64_t units = p.B * p.q_len * int64_t{p.H} * p.group;
    // One block per (row, query head): splits > 1 only where B * H is small (decode_splits).
    const cudaError_t err =
        launch_pdl(decode_combine_kernel<kDType, kD>, dim3(static_cast<unsigned>(units)), dim3(kD), device, stream, L);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

template <DType kDType>
cudaError_t decode_dtype(DecodeLaunch& L, int device, cudaStream_t stream) {
  switch (L.p.k.D) {
    case 64: return launch_decode<kDType, 64>(L, device, stream);
    case 128: return launch_decode<kDType, 128>(L, device, stream);
    default: return launch_decode<kDType, 256>(L, device, stream);
  }
}

}  // namespace

int cuda_decode(const DecodeParams& p, int device, void* stream_ptr, const char** message) {
  *message = nullptr;
  if (p.B == 0) return 0;
  if (p.k.D != p.v.D || (p.k.D != 64 && p.k.D != 128 && p.k.D != 256)) {
    *message = "decode_attention on the GPU needs equal K and V head sizes of 64, 128 or 256";
    return cudaErrorInvalidValue;
  }
  if (!aligned(4, p.k.base, {p.k.page_stride}) || !aligned(4, p.v.base, {p.v.page_stride})) {
    *message = "decode_attention on the GPU needs cache sides whose start and page stride are multiples of 4 bytes";
    return cudaErrorInvalidValue;
  }
  DeviceGuard guard(device);
  if (guard.error() != cudaSuccess) return guard.error();
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  DecodeLaunch L;
  L.p = p;
  L.splits = static_cast<int32_t>(decode_splits(p.B, p.H, p.max_blocks));
  if (L.splits > 1 && (p.workspace == nullptr ||
                       p.workspace_floats < decode_workspace_floats(p.B * p.q_len, int64_t{p.H} * p.group, p.v.D, L.splits))) {
    *message = "decode_attention: this geometry splits each sequence and needs a workspace (nvfp4kv.decode_workspace)";
    return cudaErrorInvalidValue;
  }
  L.cols_per_split = std::max<int64_t>(1, (p.max_blocks + L.splits - 1) / L.splits);
  L.off[0] = SideOffsets::make(p.k, p.layout, p.H, p.T);
  L.off[1] = SideOffsets::make(p.v, p.layout, p.H, p.T);
  L.block_size = FastDiv(static_cast<uint32_t>(p.T));
  const int rows = p.group * p.q_len;
  const int per_block = rows <= 1 ? 1 : rows <= 2 ? 2 : rows <= 4 ? 4 : kMaxRows;  // as launch_decode
  L.chunks = (rows + per_block - 1) / per_block;
  const cudaError_t err = p.dtype == DType::kFloat16 ? decode_dtype<DType::kFloat16>(L, device, stream)
                                                     : decode_dtype<DType::kBFloat16>(L, device, stream);
  if (err != cudaSuccess) *message = check_kernel_image(err);
  return err;
}

}  // namespace nvfp4kv
