// CUDA dequantize of whole pages (FORMAT.md §6): one thread per 16-element group of the output,
// groups fastest so a warp reads consecutive code words and writes consecutive output chunks.
#include "common.cuh"
#include "launch.h"

namespace nvfp4kv {
namespace {

struct DequantLaunch {
  DequantParams p;
  FastDiv per_row;  // items per (page, position): H * (Gk + Gv)
  FastDiv gk, gv;
  uint32_t k_items;
  uint32_t total;
  int64_t row0;     // first (page, position) of this launch
};

template <DType kDType>
__device__ __forceinline__ void store_out(void* out, int64_t idx, const float (&y)[16], bool vec) {
  if constexpr (kDType == DType::kFloat32) {
    float* o = static_cast<float*>(out) + idx;
    if (vec) {
#pragma unroll
      for (int i = 0; i < 4; ++i)
        reinterpret_cast<float4*>(o)[i] = make_float4(y[4 * i], y[4 * i + 1], y[4 * i + 2], y[4 * i + 3]);
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i) o[i] = y[i];
    }
  } else {
    uint16_t h[16];
#pragma unroll
    for (int i = 0; i < 16; ++i)
      h[i] = kDType == DType::kFloat16 ? float_to_f16(y[i]) : float_to_bf16(y[i]);
    uint16_t* o = static_cast<uint16_t*>(out) + idx;
    if (vec) {
      uint32_t w[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) w[i] = h[2 * i] | (static_cast<uint32_t>(h[2 * i + 1]) << 16);
      reinterpret_cast<uint4*>(o)[0] = make_uint4(w[0], w[1], w[2], w[3]);
      reinterpret_cast<uint4*>(o)[1] = make_uint4(w[4], w[5], w[6], w[7]);
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i) o[i] = h[i];
    }
  }
}

template <DType kDType, bool kVec>
__global__ void __launch_bounds__(kThreads) dequant_kernel(const __grid_constant__ DequantLaunch L) {
  const DequantParams& p = L.p;
  const float g_k = p.k.scale.device_ptr ? *p.k.scale.device_ptr : p.k.scale.value;
  const float g_v = p.v.scale.device_ptr ? *p.v.scale.device_ptr : p.v.scale.value;
  for (uint32_t u = blockIdx.x * kThreads + threadIdx.x; u < L.total; u += gridDim.x * kThreads) {
    const uint32_t rr = L.per_row.div(u);
    uint32_t r = u - rr * L.per_row.d;
    const int64_t flat = L.row0 + rr;  // page * T + position
    const int64_t page = flat / p.T, t = flat - page * p.T;
    const int side = r >= L.k_items;
    if (side) r -= L.k_items;
    const FastDiv& groups = side ? L.gv : L.gk;
    const uint32_t h = groups.div(r);
    const uint32_t g = r - h * groups.d;
    const DequantSide& s = side ? p.v : p.k;
    const float gscale = side ? g_v : g_k;

    const uint8_t* base = s.cache.base + page * s.cache.page_stride;
    const int64_t row = row_index(p.layout, h, t, p.H, p.T);
    const uint8_t* data = base + data_offset(row, s.cache.D) + 8 * g;
    uint32_t w[2];
    if (kVec) {
      const uint2 v = *reinterpret_cast<const uint2*>(data);
      w[0] = v.x;
      w[1] = v.y;
    } else {
      w[0] = w[1] = 0;
#pragma unroll
      for (int b = 0; b < 8; ++b) w[b >> 2] |= static_cast<uint32_t>(data[b]) << (8 * (b & 3));
    }
    const int64_t soff = s.cache.interleaved ? scale_offset_interleaved(h, t, g, p.T, p.H, s.cache.D)
                                             : scale_offset_linear(row, g, p.H, p.T, s.cache.D);
    const uint32_t sfb = base[soff];
    float y[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) y[i] = dequantize_value(w[i >> 3] >> (4 * (i & 7)), sfb, gscale);
    const int64_t out = page * s.out_stride[0] + t * s.out_stride[1] + h * s.out_stride[2] + g * 16;
    store_out<kDType>(s.out, out, y, kVec);
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

int cuda_dequantize(const DequantParams& p, int device, void* stream_ptr, const char** message) {
  *message = nullptr;
  if (p.N == 0) return 0;
  DeviceGuard guard(device);
  if (guard.error() != cudaSuccess) return guard.error();
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const int64_t esize = p.dtype == DType::kFloat32 ? 4 : 2;
  const DequantSide* sides[2] = {&p.k, &p.v};
  bool vec = true;
  for (const DequantSide* s : sides) {
    vec = vec && aligned(s->out, s->out_stride[0] * esize, s->out_stride[1] * esize,
                         s->out_stride[2] * esize, 16) &&
          aligned(s->cache.base, s->cache.page_stride, 0, 0, 8);
  }
  DequantLaunch L;
  L.p = p;
  const uint32_t gk = p.k.cache.D / kGroupSize, gv = p.v.cache.D / kGroupSize;
  const uint32_t per_row = static_cast<uint32_t>(p.H) * (gk + gv);
  L.per_row = FastDiv(per_row);
  L.gk = FastDiv(gk);
  L.gv = FastDiv(gv);
  L.k_items = static_cast<uint32_t>(p.H) * gk;
  const int64_t rows = p.N * p.T;
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

}  // namespace nvfp4kv
