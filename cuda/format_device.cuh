// Device-only fast paths of the format core for the kernels: several steps of the recipe fused
// (a candidate's codes and error in one pass) and the read path's decode through fp16x2
// arithmetic. Each equals the format core's definition (nvfp4kv/format.h) bit for bit, as the
// comments argue; every GPU test compares the kernels' bytes with the CPU path's.
#pragma once

#include "nvfp4kv/format.h"

namespace nvfp4kv {

// encode_group and candidate_error in one pass, given r = candidate_rcp(out). Equal bit for bit
// to ScoreCandidate:
// - each element's error is taken on magnitudes, |q|·r − |x|: q carries the sign of x and
//   rounding is symmetric, so this is ±(q·r − x) exactly and its square is the same;
// - |q| comes from the encoder's float 2^23 + code (e2m1_code_plus) still in a register: its bits
//   shifted left by 22 are the code's bits at 22, i.e. e2m1_times_2m126 of the magnitude code,
//   and one exact multiply by 2^126 gives |q|. That replaces unpacking each nibble again and the
//   per-group IEEE reciprocal: about a quarter of nvfp4_4over6's instructions.
__device__ __forceinline__ float encode_group_scored(const float (&x)[kGroupSize], float out,
                                                     float r, uint32_t (&packed)[2]) {
  float sum[2];
#pragma unroll
  for (int w = 0; w < 2; ++w) {
    float s = 0.0f;
    packed[w] = encode_word(x + 8 * w, out, [&s, r](float ax, uint32_t f) {
      const float q = mul_rn(bits_float(f << 22), bits_float(0x7E800000u));  // |q|, 2^126
      const float e = sub_rn(mul_rn(q, r), ax);
      s = add_rn(s, mul_rn(e, e));
    });
    sum[w] = s;
  }
  return add_rn(sum[0], sum[1]);
}

// dequantize_group for kernels, with fp16 pairs doing the exact part. E2M1's bits placed at bits
// 9..11 and 15 of an fp16 read as e * 2^-14 (E2M1 is fp16's bottom end with one mantissa bit,
// subnormals included), so one integer shift and mask per element and one fp16x2 multiply per
// two elements give e * sfq * 2^-14 exactly: e * sfq is a multiple of 2^-10, at most 2688, with
// at most 6 significant bits, so the product is a multiple of 2^-24 (fp16's subnormal step)
// below 0.17. Converted to fp32 (exact) and times g * 2^14 it rounds once, to the recipe's
// (e * sfq) * g. `g14` is g * 2^14, exact and finite for |g| < 2^113 (use dequantize_group
// otherwise); infinite or NaN g give Inf / NaN where the recipe does (a device-resident scale
// only: the host rejects such scales). Returns false for a NaN group, like dequantize_group.
// The fp16x2 pair (sfq, sfq) of a scale byte that is not NaN: exact (E4M3 values are fp16
// values). sm_89 and later convert E4M3 in one instruction.
__device__ __forceinline__ uint32_t scale_f16x2(uint32_t sfb) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  uint32_t s2;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(s2) : "h"(static_cast<uint16_t>(sfb * 0x101u)));
  return s2;
#else
  uint16_t s16;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(s16) : "f"(e4m3_decode(sfb)));
  return s16 | (static_cast<uint32_t>(s16) << 16);
#endif
}

// Half kHi of a word as a 16-bit register: an instruction that reads it takes the half in place
// (no shift).
template <int kHi>
__device__ __forceinline__ uint16_t half_of(uint32_t x) {
  uint16_t h;
  if constexpr (kHi)
    asm("{ .reg .b16 l; mov.b32 {l, %0}, %1; }" : "=h"(h) : "r"(x));
  else
    asm("{ .reg .b16 u; mov.b32 {%0, u}, %1; }" : "=h"(h) : "r"(x));
  return h;
}

// The two E4M3 bytes of half kHalf of x (bytes 2 kHalf, 2 kHalf + 1) as an fp16x2 (low byte in
// the low half), exact, NaN bytes as NaN: scale bytes of two tokens or groups for the decode
// attention, and its E2M1 codes moved into E4M3 fields. sm_89 and later: one conversion.
template <int kHalf = 0>
__device__ __forceinline__ uint32_t e4m3x2_f16x2(uint32_t x) {
  uint32_t r;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(half_of<kHalf>(x)));
#else
  const uint32_t two = x >> (16 * kHalf);
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(e4m3_decode((two >> 8) & 0xFFu)), "f"(e4m3_decode(two & 0xFFu)));
#endif
  return r;
}

// Codes j and j + 4 of a code word (j < 4) as an fp16x2 of their values times 2^-14 (see
// dequantize_group_h): magnitudes to bits 9..11 and 25..27, signs to bits 15 and 31.
__device__ __forceinline__ uint32_t e2m1_pair_h(uint32_t w, int j) {
  const uint32_t mag = (j < 3 ? w << (9 - 4 * j) : w >> 3) & 0x0E000E00u;
  return mag | ((w << (12 - 4 * j)) & 0x80008000u);
}

// a * b of two fp16x2, rounded once per half, subnormals kept (exact for the products above).
__device__ __forceinline__ uint32_t mul_f16x2(uint32_t a, uint32_t b) {
  uint32_t p;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(p) : "r"(a), "r"(b));
  return p;
}

// The 8 outputs of one code word, y_i = (e2m1_i * sfq) * g, from s2 = scale_f16x2(sfb) and
// g14 = g * 2^14 (see dequantize_group_h). Elements j and j + 4 share one fp16x2 (both sit at
// the same shift).
__device__ __forceinline__ void dequantize_word_h(uint32_t w, uint32_t s2, float g14, float (&y)[8]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t p = mul_f16x2(e2m1_pair_h(w, j), s2);  // exact: no rounding, no flush
    float lo, hi;
    asm("{ .reg .b16 l, u; mov.b32 {l, u}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, u; }"
        : "=f"(lo), "=f"(hi) : "r"(p));
    y[j] = mul_rn(lo, g14);
    y[j + 4] = mul_rn(hi, g14);
  }
}

__device__ __forceinline__ bool dequantize_group_h(const uint32_t (&w)[2], uint32_t sfb, float g14,
                                                   float (&y)[kGroupSize]) {
  if ((sfb & 0x7Fu) == kScaleNaN) return nan_group(y);
  const uint32_t s2 = scale_f16x2(sfb);
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    float yk[8];
    dequantize_word_h(w[k], s2, g14, yk);
#pragma unroll
    for (int i = 0; i < 8; ++i) y[8 * k + i] = yk[i];
  }
  return true;
}

}  // namespace nvfp4kv
