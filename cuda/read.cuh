// Pieces shared by the read-path kernels (dequantize.cu, gather.cu): the output conversion and
// stores of one group, the load of one group's codes and scale byte.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common.cuh"
#include "format_device.cuh"

namespace nvfp4kv {

template <DType kDType>
__device__ __forceinline__ uint32_t pack_words(float lo, float hi) {
  if constexpr (kDType == DType::kFloat16) {
    const __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  } else {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
}

// The 8 output words (16 bf16/fp16 values) of one group.
template <DType kDType>
__device__ __forceinline__ void group_words(const float (&y)[16], bool nan_group, uint32_t (&w)[8]) {
  if (nan_group) {
    const uint32_t h = kDType == DType::kFloat16 ? float_to_f16(quiet_nan()) : float_to_bf16(quiet_nan());
#pragma unroll
    for (int i = 0; i < 8; ++i) w[i] = h | (h << 16);
    return;
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) w[i] = pack_words<kDType>(y[2 * i], y[2 * i + 1]);
}

// 16 outputs of one group. Values of a normal group convert with the hardware RNE conversions
// (two values per instruction); a NaN group writes the one NaN pattern the format core gives on
// the host too, since hardware NaN conversion uses another payload. Vector stores are streaming
// (evict-first): the output is written once and read by another kernel, and keeping it out of
// L2's way took the 1M-token gather from 69.7 % to 74.0 % of copy (docs/design-notes.md, "Read
// path: streaming output stores").
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
    group_words<kDType>(y, nan_group, w);
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

// Whether both sides' outputs take 16-byte stores (their pointers and the first `nstrides`
// output strides) and their cache sides 8-byte loads.
template <class Side>
inline bool sides_vec(const Side& k, const Side& v, int64_t esize, int nstrides) {
  bool vec = true;
  for (const Side* s : {&k, &v}) {
    int64_t st[3] = {0, 0, 0};
    for (int i = 0; i < nstrides; ++i) st[i] = s->out_stride[i];
    vec = vec && aligned(16, s->out, {st[0], st[1], st[2]}, esize) &&
          aligned(8, s->cache.base, {s->cache.page_stride});
  }
  return vec;
}

}  // namespace nvfp4kv
