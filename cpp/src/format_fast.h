// Fast versions of the format core's primitives, for the library's own build only (private: not
// installed). format.h includes this file where NVFP4KV_FAST_PRIMITIVES is defined (the library
// target's compile definition) and calls these through fast::. Each function returns exactly what
// its portable:: definition in format.h returns, for every input: the device versions use PTX
// (one instruction where the portable code needs several, or no branch where it has one), the
// x86 host version of sat01 two SSE instructions. Tests: tests/cpp/test_format.cpp runs its
// exhaustive checks against this header (ctest format_fast) and without it (format_core); every
// GPU test compares the kernels' bytes with the CPU path's.
#pragma once

#if !defined(NVFP4KV_FAST_PRIMITIVES)
#error "format_fast.h is included by nvfp4kv/format.h in the library's own build"
#endif

namespace nvfp4kv {
namespace fast {

// max that returns NaN when either operand is NaN: one instruction on sm_80+.
NVFP4KV_HD float max_nan(float a, float b) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return portable::max_nan(a, b);
#endif
}

NVFP4KV_HD float f16_to_float(uint16_t h) {
#if defined(__CUDA_ARCH__)
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#else
  return portable::f16_to_float(h);
#endif
}

NVFP4KV_HD uint16_t float_to_f16(float f) {
#if defined(__CUDA_ARCH__)
  if (is_nan(f)) return static_cast<uint16_t>(((float_bits(f) >> 16) & 0x8000u) | 0x7E00u);
  uint16_t h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
#else
  return portable::float_to_f16(f);
#endif
}

// Clamp to [0, 1]; NaN gives 0.
NVFP4KV_HD float sat01(float x) {
#if defined(__CUDA_ARCH__)
  return __saturatef(x);  // the .sat modifier, folded into the consuming instruction
#elif defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__)) && defined(__SSE__)
  // max returns its second source (0) when either is NaN, and +0 for -0; min then clamps to 1:
  // two instructions (the CPU store ran 23 % faster than with the portable bit version). In asm:
  // GCC folds the _mm_max_ss intrinsic on constants without that NaN rule. Equal to the portable
  // version for every input in the default floating-point mode (the CPU backend runs its calls in
  // that mode whatever the caller set).
  float r;
#if defined(__AVX__)
  __asm__("vmaxss %2, %1, %0" : "=x"(r) : "x"(x), "x"(0.0f));
  __asm__("vminss %2, %1, %0" : "=x"(r) : "x"(r), "x"(1.0f));
#else
  r = x;
  __asm__("maxss %1, %0" : "+x"(r) : "x"(0.0f));
  __asm__("minss %1, %0" : "+x"(r) : "x"(1.0f));
#endif
  return r;
#else
  return portable::sat01(x);
#endif
}

// On the GPU: six byte permutes that replicate each sign through a byte, and a select that the
// caller's OR absorbs, instead of two instructions per element.
NVFP4KV_HD uint32_t sign_word(const float* x) {
#if defined(__CUDA_ARCH__)
  uint32_t q[4], ev, od;
#pragma unroll
  for (int j = 0; j < 4; ++j)  // bytes 0, 1: 0xFF/0x00 from the signs of x[j] and x[j + 2]
    asm("prmt.b32 %0, %1, %2, 0xFFFB;" : "=r"(q[j])
        : "r"(__float_as_uint(x[(j & 1) + 4 * (j >> 1)])), "r"(__float_as_uint(x[(j & 1) + 4 * (j >> 1) + 2])));
  asm("prmt.b32 %0, %1, %2, 0x5410;" : "=r"(ev) : "r"(q[0]), "r"(q[2]));  // x0 x2 x4 x6
  asm("prmt.b32 %0, %1, %2, 0x5410;" : "=r"(od) : "r"(q[1]), "r"(q[3]));  // x1 x3 x5 x7
  // Byte j of the word takes x[2j] at bit 3 and x[2j+1] at bit 7.
  return ((od & 0x80808080u) | (ev & 0x7F7F7F7Fu)) & 0x88888888u;
#else
  return portable::sign_word(x);
#endif
}

#if defined(__CUDACC__)
// The E2M1 value of a code times 2^-126: its bits placed at bit 22 read as an fp32 subnormal or
// normal (E2M1 is fp32's bottom end with one mantissa bit). Device only (subnormal arithmetic).
__device__ __forceinline__ float e2m1_times_2m126(uint32_t code) {
  return bits_float(((code & 7u) << 22) | ((code & 8u) << 28));
}
#endif

NVFP4KV_HD float e2m1_decode(uint32_t code) {
#if defined(__CUDA_ARCH__)
  // One exact multiply restores the scale: two integer ops and one multiply instead of a table
  // or a select chain on the read path.
  return e2m1_times_2m126(code) * bits_float(0x7E800000u);  // 2^126
#else
  return portable::e2m1_decode(code);
#endif
}

NVFP4KV_HD float group_amax(const float (&x)[kGroupSize]) {
#if defined(__CUDA_ARCH__)
  // A pairwise tree: the 15 max operations are 4 dependent steps instead of 15.
  float m[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) m[i] = max_nan(abs_f(x[i]), abs_f(x[i + 8]));
#pragma unroll
  for (int i = 0; i < 4; ++i) m[i] = max_nan(m[i], m[i + 4]);
  return max_nan(max_nan(m[0], m[2]), max_nan(m[1], m[3]));
#else
  return portable::group_amax(x);
#endif
}

}  // namespace fast
}  // namespace nvfp4kv
