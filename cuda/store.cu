// CUDA quantize-and-store: the format core's recipe, one thread per 16-element group.
//
// Thread mapping: work item u = (token, side, head, group) with the group fastest, so a warp
// reads consecutive 32-byte (bf16/fp16) or 64-byte (fp32) chunks of the token's heads and
// writes whole 8-byte code words of consecutive groups of a row. A grid-stride loop over a grid
// sized to fill the GPU amortises the per-block table of out scales (out depends only on the
// scale byte for a given global scale, so 127 divisions per block replace one per group).
#include "common.cuh"
#include "launch.h"

namespace nvfp4kv {
namespace {

struct StoreLaunch {
  StoreParams p;
  RowItems items;       // per token, kG groups per item
  FastDiv block_size;   // T, for slot -> (page, position) when slots < 2^31
  uint32_t total;       // items of this launch (< 2^31)
  int32_t fast_slots;   // num_slots < 2^31: divide slots with block_size
  int64_t token0;       // first token of this launch (large calls are split)
};

// Raw input words of one group, loaded ahead of use: 16-byte vectors when aligned (two for 16-bit
// types, four for fp32), else 16 scalars widened to fp32 at load time.
template <DType kDType, bool kVec>
struct Raw {
  static constexpr int kWords = kVec ? (kDType == DType::kFloat32 ? 4 : 2) : 0;
  uint4 v[kVec ? kWords : 1];
  float f[kVec ? 1 : kGroupSize];

  __device__ __forceinline__ void load(const void* src, int64_t idx) {
    if constexpr (kVec) {
      const uint4* p = reinterpret_cast<const uint4*>(static_cast<const char*>(src) +
                                                      idx * (kDType == DType::kFloat32 ? 4 : 2));
#pragma unroll
      for (int i = 0; i < kWords; ++i) v[i] = __ldg(p + i);
    } else if constexpr (kDType == DType::kFloat32) {
#pragma unroll
      for (int i = 0; i < kGroupSize; ++i) f[i] = static_cast<const float*>(src)[idx + i];
    } else {
#pragma unroll
      for (int i = 0; i < kGroupSize; ++i) {
        const uint16_t h = static_cast<const uint16_t*>(src)[idx + i];
        f[i] = kDType == DType::kFloat16 ? f16_to_float(h) : bf16_to_float(h);
      }
    }
  }

  __device__ __forceinline__ void to_float(float (&x)[kGroupSize]) const {
    if constexpr (!kVec) {
#pragma unroll
      for (int i = 0; i < kGroupSize; ++i) x[i] = f[i];
    } else if constexpr (kDType == DType::kFloat32) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        x[4 * i] = __uint_as_float(v[i].x);
        x[4 * i + 1] = __uint_as_float(v[i].y);
        x[4 * i + 2] = __uint_as_float(v[i].z);
        x[4 * i + 3] = __uint_as_float(v[i].w);
      }
    } else {
      const uint32_t w[8] = {v[0].x, v[0].y, v[0].z, v[0].w, v[1].x, v[1].y, v[1].z, v[1].w};
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        if constexpr (kDType == DType::kBFloat16) {
          x[2 * i] = __uint_as_float(w[i] << 16);  // bf16 is the top half of an fp32
          x[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
        } else {
          x[2 * i] = f16_to_float(static_cast<uint16_t>(w[i]));
          x[2 * i + 1] = f16_to_float(static_cast<uint16_t>(w[i] >> 16));
        }
      }
    }
  }
};

__device__ __forceinline__ float read_scale(const ScaleArg& s) {
  return s.device_ptr ? *s.device_ptr : s.value;
}

// One work item: kG consecutive groups of one (token, side, head) row, with its slot and input
// words already loaded.
template <DType kDType, bool kVec, int kG>
struct Item {
  int64_t slot;
  uint32_t side, h, g0;
  Raw<kDType, kVec> raw[kG];

  __device__ __forceinline__ void load(const StoreLaunch& L, uint32_t u) {
    const StoreParams& p = L.p;
    const uint32_t tok = L.items.per_row.div(u);
    const int64_t token = L.token0 + tok;
    slot = p.slots_int64 ? static_cast<const int64_t*>(p.slots)[token * p.slot_stride]
                         : static_cast<const int32_t*>(p.slots)[token * p.slot_stride];
    int sd;
    uint32_t unit;
    L.items.decode(u - tok * L.items.per_row.d, sd, h, unit);
    side = sd;
    g0 = unit * kG;
    const StoreSide& s = side ? p.v : p.k;
    const int64_t src = token * s.token_stride + h * s.head_stride + g0 * kGroupSize;
#pragma unroll
    for (int k = 0; k < kG; ++k) raw[k].load(s.src, src + k * kGroupSize);
  }
};

// kVec: input rows and cache sides are aligned (checked by the launcher), so groups load as
// 16-byte vectors and code words store as 8-byte (kG == 1) or 16-byte (kG == 2) words.
// kG: consecutive groups per work item; 2 halves the index arithmetic per element.
// Each thread loads its next item before quantizing the current one, so input loads stay in
// flight while it computes (the loop is otherwise a load-then-compute chain per item), and the
// first item's loads overlap the read of the global scales and the out-scale table.
template <DType kDType, Recipe kRecipe, bool kVec, int kG>
__global__ void __launch_bounds__(kThreads) store_kernel(const __grid_constant__ StoreLaunch L) {
  __shared__ float out_table[2][128];
  const StoreParams& p = L.p;
  const uint32_t stride = gridDim.x * kThreads;
  uint32_t u = blockIdx.x * kThreads + threadIdx.x;
  Item<kDType, kVec, kG> next;
  if (u < L.total) next.load(L, u);

  const GlobalScale gsk = make_global_scale(read_scale(p.k.scale));
  const GlobalScale gsv = make_global_scale(read_scale(p.v.scale));
  {
    const int side = threadIdx.x >> 7, b = threadIdx.x & 127;  // kThreads == 256: one entry each
    const float inv_enc = side ? gsv.inv_enc : gsk.inv_enc;
    out_table[side][b] = b < static_cast<int>(kScaleNaN) ? out_scale(b, inv_enc) : 0.0f;
  }
  __syncthreads();

  for (; u < L.total; u += stride) {
    const Item<kDType, kVec, kG> cur = next;
    if (u + stride < L.total) next.load(L, u + stride);
    const int64_t slot = cur.slot;
    if (slot < 0 || slot >= p.num_slots) continue;  // padding or out of range: never written
    const bool side = cur.side;
    const uint32_t h = cur.h, g0 = cur.g0;
    const StoreSide& s = side ? p.v : p.k;

    int64_t page, pos;
    if (L.fast_slots) {
      const uint32_t q = L.block_size.div(static_cast<uint32_t>(slot));
      page = q;
      pos = static_cast<uint32_t>(slot) - q * L.block_size.d;
    } else {
      page = slot / p.T;
      pos = slot - page * p.T;
    }
    GlobalScale gs;
    gs.enc = side ? gsv.enc : gsk.enc;
    gs.inv_enc = side ? gsv.inv_enc : gsk.inv_enc;
    gs.valid = side ? gsv.valid : gsk.valid;
    const float* table = out_table[side];
    uint32_t packed[kG][2], sfb[kG];
#pragma unroll
    for (int k = 0; k < kG; ++k) {
      float x[kGroupSize];
      cur.raw[k].to_float(x);
      sfb[k] = quantize_group<kRecipe>(x, gs, [table](uint32_t b) { return table[b]; }, packed[k]);
    }

    uint8_t* base = s.cache.base + page * s.cache.page_stride;
    const int32_t D = s.cache.D;
    const uint32_t row = static_cast<uint32_t>(row_index(p.layout, h, pos, p.H, p.T));
    uint8_t* data = base + row * static_cast<uint32_t>(D / 2) + 8 * g0;
    if (kVec && kG == 2) {
      *reinterpret_cast<uint4*>(data) = make_uint4(packed[0][0], packed[0][1], packed[kG - 1][0], packed[kG - 1][1]);
    } else if (kVec) {
      *reinterpret_cast<uint2*>(data) = make_uint2(packed[0][0], packed[0][1]);
    } else {
#pragma unroll
      for (int k = 0; k < kG; ++k)
#pragma unroll
        for (int b = 0; b < 8; ++b) data[8 * k + b] = static_cast<uint8_t>(packed[k][b >> 2] >> (8 * (b & 3)));
    }
#pragma unroll
    for (int k = 0; k < kG; ++k) {
      const int64_t soff = s.cache.interleaved
                               ? scale_offset_interleaved(h, pos, g0 + k, p.T, p.H, D)
                               : scale_offset_linear(row, g0 + k, p.H, p.T, D);
      base[soff] = static_cast<uint8_t>(sfb[k]);
    }
  }
}

bool aligned(const void* ptr, int64_t stride_bytes_a, int64_t stride_bytes_b, int64_t to) {
  return (reinterpret_cast<uintptr_t>(ptr) % to == 0) && (stride_bytes_a % to == 0) &&
         (stride_bytes_b % to == 0);
}

template <DType kDType, Recipe kRecipe>
cudaError_t launch(const StoreLaunch& L, bool vec, int g, int blocks, cudaStream_t stream) {
  if (vec && g == 2)
    store_kernel<kDType, kRecipe, true, 2><<<blocks, kThreads, 0, stream>>>(L);
  else if (vec)
    store_kernel<kDType, kRecipe, true, 1><<<blocks, kThreads, 0, stream>>>(L);
  else
    store_kernel<kDType, kRecipe, false, 1><<<blocks, kThreads, 0, stream>>>(L);
  return cudaGetLastError();
}

template <DType kDType>
cudaError_t launch_recipe(const StoreLaunch& L, bool vec, int g, int blocks, cudaStream_t stream) {
  return L.p.recipe == Recipe::kNvfp4
             ? launch<kDType, Recipe::kNvfp4>(L, vec, g, blocks, stream)
             : launch<kDType, Recipe::kNvfp4_4over6>(L, vec, g, blocks, stream);
}

}  // namespace

int cuda_store(const StoreParams& p, int device, void* stream_ptr, const char** message) {
  *message = nullptr;
  if (p.num_tokens == 0) return 0;
  DeviceGuard guard(device);
  if (guard.error() != cudaSuccess) return guard.error();
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);

  const int64_t esize = p.dtype == DType::kFloat32 ? 4 : 2;
  // Vector path: 16-byte loads of every group, 8-byte stores of every code word (D/2 is a
  // multiple of 8, so row starts keep the alignment of the side).
  const bool vec = aligned(p.k.src, p.k.token_stride * esize, p.k.head_stride * esize, 16) &&
                   aligned(p.v.src, p.v.token_stride * esize, p.v.head_stride * esize, 16) &&
                   aligned(p.k.cache.base, p.k.cache.page_stride, 0, 8) &&
                   aligned(p.v.cache.base, p.v.cache.page_stride, 0, 8);

  const uint32_t gk = p.k.cache.D / kGroupSize, gv = p.v.cache.D / kGroupSize;
  // Two groups per item when both sides have an even number of groups and the 16-byte code
  // stores stay aligned (D/2 is then a multiple of 16).
  const int g = vec && gk % 2 == 0 && gv % 2 == 0 &&
                        aligned(p.k.cache.base, p.k.cache.page_stride, 0, 16) &&
                        aligned(p.v.cache.base, p.v.cache.page_stride, 0, 16)
                    ? 2
                    : 1;
  StoreLaunch L;
  L.p = p;
  L.items = RowItems(p.H, p.k.cache.D, p.v.cache.D, g);
  const uint32_t per_token = L.items.per_row.d;
  L.block_size = FastDiv(static_cast<uint32_t>(p.T));
  L.fast_slots = p.num_slots < (int64_t{1} << 31);
  // Split so that work-item indices stay below 2^31 (FastDiv's range).
  const int64_t max_tokens = ((int64_t{1} << 31) - 1) / per_token - kThreads;
  for (int64_t t0 = 0; t0 < p.num_tokens; t0 += max_tokens) {
    const int64_t n = p.num_tokens - t0 < max_tokens ? p.num_tokens - t0 : max_tokens;
    L.token0 = t0;
    L.total = static_cast<uint32_t>(n * per_token);
    const int blocks = grid_blocks(device, L.total, 8);
    cudaError_t err;
    switch (p.dtype) {
      case DType::kFloat32: err = launch_recipe<DType::kFloat32>(L, vec, g, blocks, stream); break;
      case DType::kFloat16: err = launch_recipe<DType::kFloat16>(L, vec, g, blocks, stream); break;
      default: err = launch_recipe<DType::kBFloat16>(L, vec, g, blocks, stream); break;
    }
    if (err != cudaSuccess) {
      *message = check_kernel_image(err);
      return err;
    }
  }
  return 0;
}

}  // namespace nvfp4kv
