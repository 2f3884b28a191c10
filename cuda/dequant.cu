// CUDA dequantize of whole pages (FORMAT.md §6): one thread per 16-element group of the output,
// groups fastest so a warp reads consecutive code words and writes consecutive output chunks.
#include <algorithm>
#include <initializer_list>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common.cuh"
#include "launch.h"

namespace nvfp4kv {
namespace {

struct DequantLaunch {
  DequantParams p;
  RowItems items;   // per (page, position), one group per item
  uint32_t total;
  int64_t row0;     // first (page-list index, position) of this launch
};

// 16 outputs of one group. Values of a normal group convert with the hardware RNE conversions
// (two values per instruction); a NaN group writes the one NaN pattern the format core gives on
// the host too, since hardware NaN conversion uses another payload. Vector stores are streaming
// (evict-first): the output is written once and read by another kernel, and keeping it out of
// L2's way took the 1M-token gather from 69.7 % to 74.0 % of copy (RESULTS.md run 24).
template <DType kDType, bool kVec>
__device__ __forceinline__ void store_group(void* out, int64_t idx, const float (&y)[16], bool nan_group) {
  if constexpr (kDType == DType::kFloat32) {
    float* o = static_cast<float*>(out) + idx;
    if (kVec) {
#pragma unroll
      for (int i = 0; i < 4; ++i)
        __stcs(reinterpret_cast<float4*>(o) + i, make_float4(y[4 * i], y[4 * i + 1], y[4 * i + 2], y[4 * i + 3]));
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i) o[i] = y[i];
    }
  } else {
    uint32_t w[8];
    if (nan_group) {
      const uint32_t h = kDType == DType::kFloat16 ? float_to_f16(quiet_nan()) : float_to_bf16(quiet_nan());
#pragma unroll
      for (int i = 0; i < 8; ++i) w[i] = h | (h << 16);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        if constexpr (kDType == DType::kFloat16) {
          const __half2 v = __floats2half2_rn(y[2 * i], y[2 * i + 1]);
          w[i] = *reinterpret_cast<const uint32_t*>(&v);
        } else {
          const __nv_bfloat162 v = __floats2bfloat162_rn(y[2 * i], y[2 * i + 1]);
          w[i] = *reinterpret_cast<const uint32_t*>(&v);
        }
      }
    }
    uint16_t* o = static_cast<uint16_t*>(out) + idx;
    if (kVec) {
      __stcs(reinterpret_cast<uint4*>(o), make_uint4(w[0], w[1], w[2], w[3]));
      __stcs(reinterpret_cast<uint4*>(o) + 1, make_uint4(w[4], w[5], w[6], w[7]));
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i) o[i] = static_cast<uint16_t>(w[i >> 1] >> (16 * (i & 1)));
    }
  }
}

// Code words and scale byte of group g of row (h, t) of one side of one page.
template <bool kVec>
__device__ __forceinline__ uint32_t load_group(const uint8_t* base, const CacheSide& c, Layout layout,
                                               uint32_t h, int64_t t, uint32_t g, int32_t H,
                                               int32_t T, uint32_t (&w)[2]) {
  const int64_t row = row_index(layout, h, t, H, T);
  const uint8_t* data = base + data_offset(row, c.D) + 8 * g;
  if (kVec) {
    const uint2 v = __ldg(reinterpret_cast<const uint2*>(data));
    w[0] = v.x;
    w[1] = v.y;
  } else {
    w[0] = w[1] = 0;
#pragma unroll
    for (int b = 0; b < 8; ++b) w[b >> 2] |= static_cast<uint32_t>(data[b]) << (8 * (b & 3));
  }
  const int64_t soff = c.interleaved ? scale_offset_interleaved(h, t, g, T, H, c.D)
                                     : scale_offset_linear(row, g, H, T, c.D);
  return base[soff];
}

__device__ __forceinline__ float read_scale(const ScaleArg& s) {
  return s.device_ptr ? *s.device_ptr : s.value;
}

template <DType kDType, bool kVec>
__global__ void __launch_bounds__(kThreads) dequant_kernel(const __grid_constant__ DequantLaunch L) {
  const DequantParams& p = L.p;
  const float g_k = read_scale(p.k.scale), g_v = read_scale(p.v.scale);
  for (uint32_t u = blockIdx.x * kThreads + threadIdx.x; u < L.total; u += gridDim.x * kThreads) {
    const uint32_t rr = L.items.per_row.div(u);
    const int64_t flat = L.row0 + rr;  // page-list index * T + position
    const int64_t i = flat / p.T, t = flat - i * p.T;
    const int64_t page = p.pages.ptr ? load_index(p.pages, i) : i;
    if (page < 0 || page >= p.N) continue;
    int side;
    uint32_t h, g;
    L.items.decode(u - rr * L.items.per_row.d, side, h, g);
    const DequantSide& s = side ? p.v : p.k;
    uint32_t w[2];
    const uint32_t sfb = load_group<kVec>(s.cache.base + page * s.cache.page_stride, s.cache,
                                          p.layout, h, t, g, p.H, p.T, w);
    float y[16];
    const bool ok = dequantize_group(w, sfb, side ? g_v : g_k, y);
    store_group<kDType, kVec>(s.out, page * s.out_stride[0] + t * s.out_stride[1] + h * s.out_stride[2] + g * 16, y, !ok);
  }
}

struct GatherLaunch {
  GatherParams p;
  RowItems items;     // per token, one group per item
  FastDiv block_size;
  int64_t b0;         // first sequence of this launch (gridDim.y is capped)
};

// blockIdx.y: sequence; x: a grid-stride share of its tokens' items, one group per item.
template <DType kDType, bool kVec>
__global__ void __launch_bounds__(kThreads) gather_kernel(const __grid_constant__ GatherLaunch L) {
  const GatherParams& p = L.p;
  const int64_t b = L.b0 + blockIdx.y;
  const int64_t len = load_index(p.seq_lens, b), start = load_index(p.cu_seqlens, b);
  if (len <= 0) return;
  const float g_k = read_scale(p.k.scale), g_v = read_scale(p.v.scale);
  const uint32_t per_token = L.items.per_row.d;
  const uint64_t items = static_cast<uint64_t>(len) * per_token;
  for (uint64_t u = blockIdx.x * kThreads + threadIdx.x; u < items; u += gridDim.x * kThreads) {
    // Tokens per sequence fit in 2^31 / items-per-token for FastDiv; longer ones use `/`.
    const uint32_t j = u < (1u << 31) ? L.items.per_row.div(static_cast<uint32_t>(u))
                                      : static_cast<uint32_t>(u / per_token);
    const uint32_t r = static_cast<uint32_t>(u - static_cast<uint64_t>(j) * per_token);
    const int64_t out_tok = start + j;
    if (out_tok < 0 || out_tok >= p.total_tokens) continue;  // never write outside the output
    const uint32_t blk = L.block_size.div(j);
    const uint32_t t = j - blk * L.block_size.d;
    int64_t page = -1;
    if (blk < p.max_blocks)
      page = p.bt_int64 ? static_cast<const int64_t*>(p.block_table)[b * p.bt_stride[0] + blk * p.bt_stride[1]]
                        : static_cast<const int32_t*>(p.block_table)[b * p.bt_stride[0] + blk * p.bt_stride[1]];
    int side;
    uint32_t h, g;
    L.items.decode(r, side, h, g);
    const DequantSide& s = side ? p.v : p.k;
    float y[16];
    bool ok = true;
    if (page >= 0 && page < p.N) {
      uint32_t w[2];
      const uint32_t sfb = load_group<kVec>(s.cache.base + page * s.cache.page_stride, s.cache,
                                            p.layout, h, t, g, p.H, p.T, w);
      ok = dequantize_group(w, sfb, side ? g_v : g_k, y);
    } else {  // a bad block-table entry reads as zeros, and nothing outside the cache is read
#pragma unroll
      for (int i = 0; i < 16; ++i) y[i] = 0.0f;
    }
    store_group<kDType, kVec>(s.out, out_tok * s.out_stride[0] + h * s.out_stride[1] + g * 16, y, !ok);
  }
}

bool aligned(const void* ptr, int64_t a, int64_t b, int64_t c, int64_t to) {
  return reinterpret_cast<uintptr_t>(ptr) % to == 0 && a % to == 0 && b % to == 0 && c % to == 0;
}

template <DType kDType>
cudaError_t launch(const DequantLaunch& L, bool vec, int blocks, cudaStream_t stream) {
  if (vec)
    dequant_kernel<kDType, true><<<blocks, kThreads, 0, stream>>>(L);
  else
    dequant_kernel<kDType, false><<<blocks, kThreads, 0, stream>>>(L);
  return cudaGetLastError();
}

}  // namespace

// Vector path when outputs (16 elements per group) and cache sides (8-byte code words) align.
template <class Side>
bool sides_vec(const Side& k, const Side& v, int64_t esize, int nstrides) {
  bool vec = true;
  for (const Side* s : {&k, &v}) {
    int64_t st[3] = {0, 0, 0};
    for (int i = 0; i < nstrides; ++i) st[i] = s->out_stride[i] * esize;
    vec = vec && aligned(s->out, st[0], st[1], st[2], 16) &&
          aligned(s->cache.base, s->cache.page_stride, 0, 0, 8);
  }
  return vec;
}

int cuda_dequantize(const DequantParams& p, int device, void* stream_ptr, const char** message) {
  *message = nullptr;
  if (p.num_pages == 0) return 0;
  DeviceGuard guard(device);
  if (guard.error() != cudaSuccess) return guard.error();
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const int64_t esize = p.dtype == DType::kFloat32 ? 4 : 2;
  const bool vec = sides_vec(p.k, p.v, esize, 3);
  DequantLaunch L;
  L.p = p;
  L.items = RowItems(p.H, p.k.cache.D, p.v.cache.D, 1);
  const uint32_t per_row = L.items.per_row.d;
  const int64_t rows = p.num_pages * p.T;
  const int64_t max_rows = ((int64_t{1} << 31) - 1) / per_row - kThreads;
  for (int64_t r0 = 0; r0 < rows; r0 += max_rows) {
    const int64_t n = rows - r0 < max_rows ? rows - r0 : max_rows;
    L.row0 = r0;
    L.total = static_cast<uint32_t>(n * per_row);
    const int blocks = grid_blocks(device, L.total, 8);
    cudaError_t err;
    switch (p.dtype) {
      case DType::kFloat32: err = launch<DType::kFloat32>(L, vec, blocks, stream); break;
      case DType::kFloat16: err = launch<DType::kFloat16>(L, vec, blocks, stream); break;
      default: err = launch<DType::kBFloat16>(L, vec, blocks, stream); break;
    }
    if (err != cudaSuccess) {
      *message = check_kernel_image(err);
      return err;
    }
  }
  return 0;
}

template <DType kDType>
cudaError_t launch_gather(const GatherLaunch& L, bool vec, dim3 grid, cudaStream_t stream) {
  if (vec)
    gather_kernel<kDType, true><<<grid, kThreads, 0, stream>>>(L);
  else
    gather_kernel<kDType, false><<<grid, kThreads, 0, stream>>>(L);
  return cudaGetLastError();
}

int cuda_gather(const GatherParams& p, int device, void* stream_ptr, const char** message) {
  *message = nullptr;
  if (p.B == 0 || p.total_tokens == 0) return 0;
  DeviceGuard guard(device);
  if (guard.error() != cudaSuccess) return guard.error();
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const int64_t esize = p.dtype == DType::kFloat32 ? 4 : 2;
  const bool vec = sides_vec(p.k, p.v, esize, 2);
  GatherLaunch L;
  L.p = p;
  L.items = RowItems(p.H, p.k.cache.D, p.v.cache.D, 1);
  const uint32_t per_token = L.items.per_row.d;
  L.block_size = FastDiv(static_cast<uint32_t>(p.T));
  // Sequence lengths live on the device (no host sync), so the grid is sized from what a
  // sequence can hold at most (its block-table row) and from the output size, and each CTA
  // strides over its sequence's items.
  const int64_t max_len = std::min<int64_t>(p.max_blocks * p.T, p.total_tokens);
  const int64_t total_blocks = grid_blocks(device, int64_t{1} << 40, 16);  // SMs * 16
  const int64_t per_seq = (max_len * per_token + kThreads - 1) / kThreads;
  const int64_t share = std::max<int64_t>(1, total_blocks / std::max<int64_t>(1, p.B));
  const unsigned gx = static_cast<unsigned>(std::max<int64_t>(1, std::min(per_seq, share)));
  for (int64_t b0 = 0; b0 < p.B; b0 += 65535) {
    L.b0 = b0;
    const dim3 grid(gx, static_cast<unsigned>(std::min<int64_t>(65535, p.B - b0)));
    cudaError_t err;
    switch (p.dtype) {
      case DType::kFloat32: err = launch_gather<DType::kFloat32>(L, vec, grid, stream); break;
      case DType::kFloat16: err = launch_gather<DType::kFloat16>(L, vec, grid, stream); break;
      default: err = launch_gather<DType::kBFloat16>(L, vec, grid, stream); break;
    }
    if (err != cudaSuccess) {
      *message = check_kernel_image(err);
      return err;
    }
  }
  return 0;
}

}  // namespace nvfp4kv
