// nvfp4kv format core: the one definition of the NVFP4 KV-cache byte contract (FORMAT.md).
//
// Every path (the CPU store/dequantize loops and every CUDA kernel) calls these functions, so
// the paths cannot drift apart. Plain C++17 on the host; `__host__ __device__` under nvcc.
//
// Floating-point rules (FORMAT.md §2): IEEE fp32, round-to-nearest-even, no FMA contraction, no
// fast-math. Products and sums that could be contracted go through mul_rn/add_rn, which on the
// device are the never-contracted __fmul_rn/__fadd_rn. On the host the library is compiled with
// -ffp-contract=off; code that includes this header may not be (GCC fuses wherever FMA
// instructions are enabled), so there the results pass through an empty asm that the compiler
// cannot fuse across (opaque_rn; tests/cpp/test_format_contract.cpp).
#pragma once

#if !defined(__cplusplus)
#error "nvfp4kv/format.h is C++ (the format core); a C program includes nvfp4kv/nvfp4kv.h only"
#endif

#include <stdint.h>
#if !defined(__CUDACC__)
#include <string.h>
#endif

#if defined(__CUDACC__)
#define NVFP4KV_HD __host__ __device__ __forceinline__
#else
#define NVFP4KV_HD inline
#endif

namespace nvfp4kv {

// ---- Constants ---------------------------------------------------------------------------------
constexpr int kGroupSize = 16;          // elements per E4M3 scale
constexpr int kMaxHeadSize = 512;       // largest supported head size D
constexpr int kInterleave = 4;          // tokens per interleaved scale block
constexpr uint32_t kE4M3MaxByte = 0x7E; // 448
constexpr uint32_t kScaleNaN = 0x7F;    // scale byte of a group that held a NaN
constexpr float kE2M1Max = 6.0f;
constexpr float kE4M3Max = 448.0f;
constexpr float kR6 = 1.0f / 6.0f;      // fp32(1/6) = 0x3E2AAAAB, the `nvfp4` divisor
constexpr float kR4 = 0.25f;            // the second candidate of `nvfp4_4over6`

// Bytes of one row (one token of one head) inside a side: packed codes, then scales.
NVFP4KV_HD constexpr int data_bytes(int D) { return D / 2; }
NVFP4KV_HD constexpr int scale_bytes(int D) { return D / kGroupSize; }
NVFP4KV_HD constexpr int full_dim(int D) { return data_bytes(D) + scale_bytes(D); }  // F = 9D/16

static_assert(full_dim(128) == 72, "F(128) must be 72 bytes");
static_assert(2 * 16 * 8 * full_dim(128) == 18432, "page of D=128, H=8, T=16 must be 18432 B");
static_assert(sizeof(float) == 4, "fp32 required");

enum class Layout : int32_t { kHND = 0, kNHD = 1 };
enum class Recipe : int32_t { kNvfp4 = 0, kNvfp4_4over6 = 1 };
enum class DType : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };
NVFP4KV_HD constexpr int dtype_bytes(DType t) { return t == DType::kFloat32 ? 4 : 2; }

// ---- Bit casts and never-contracted arithmetic ---------------------------------------------------
NVFP4KV_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
#endif
}

NVFP4KV_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  memcpy(&f, &u, 4);
  return f;
#endif
}

// x as computed, opaque to the optimizer outside the library's own build (NVFP4KV_FAST_PRIMITIVES,
// compiled with -ffp-contract=off, where it would only cost vectorization): a product or sum
// behind it cannot become part of an FMA.
NVFP4KV_HD float opaque_rn(float x) {
#if !defined(__CUDA_ARCH__) && !defined(NVFP4KV_FAST_PRIMITIVES) && defined(__GNUC__)
#if defined(__x86_64__) || (defined(__i386__) && defined(__SSE__))
  __asm__("" : "+x"(x));
#elif defined(__aarch64__)
  __asm__("" : "+w"(x));
#else
  __asm__("" : "+g"(x));
#endif
#endif
  return x;
}

NVFP4KV_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return opaque_rn(a * b);
#endif
}

NVFP4KV_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return opaque_rn(a + b);
#endif
}

NVFP4KV_HD float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return opaque_rn(a - b);
#endif
}

// Exactly rounded 1/x (IEEE division) on both sides.
NVFP4KV_HD float recip_rn(float x) {
#if defined(__CUDA_ARCH__)
  return __frcp_rn(x);
#else
  return 1.0f / x;
#endif
}

NVFP4KV_HD bool is_nan(float x) { return (float_bits(x) & 0x7FFFFFFFu) > 0x7F800000u; }
NVFP4KV_HD bool is_finite(float x) { return (float_bits(x) & 0x7F800000u) != 0x7F800000u; }
// |x| as a float operation, so the GPU folds it into the consuming FMUL/FMNMX as a modifier.
NVFP4KV_HD float abs_f(float x) {
#if defined(__CUDA_ARCH__)
  return fabsf(x);
#else
  return bits_float(float_bits(x) & 0x7FFFFFFFu);
#endif
}
NVFP4KV_HD float quiet_nan() { return bits_float(0x7FC00000u); }

// ---- Primitives: the portable definitions ------------------------------------------------------
// Plain C++ for any compiler. Inside the library, the private header format_fast.h supplies faster
// versions of the same functions (PTX on the GPU, SSE on x86 hosts), equal to these for every
// input (tests/cpp/test_format.cpp runs against both); elsewhere fast:: is this namespace.
namespace portable {

NVFP4KV_HD float max_nan(float a, float b) {
  if (is_nan(a) || is_nan(b)) return quiet_nan();
  return a > b ? a : b;
}

NVFP4KV_HD float f16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t man = h & 0x3FFu;
  if (exp == 0x1F) return bits_float(sign | 0x7F800000u | (man << 13));  // Inf / NaN
  if (exp != 0) return bits_float(sign | ((exp + 112u) << 23) | (man << 13));
  // Subnormal (or zero): man * 2^-24, exact in fp32 (and normal there).
  const float mag = static_cast<float>(man) * 5.9604644775390625e-8f;
  return bits_float(sign | float_bits(mag));
}

NVFP4KV_HD uint16_t float_to_f16(float f) {
  const uint32_t u = float_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u);  // NaN
  if (a >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // rounds to >= 65536: Inf
  if (a < 0x38800000u) {
    // Below the smallest normal half (2^-14): multiples of 2^-24. Adding 0.5 (ulp 2^-24) makes the
    // fp32 adder round to that grid with RNE.
    const uint32_t m = float_bits(bits_float(a) + 0.5f) - 0x3F000000u;
    return static_cast<uint16_t>(sign | m);
  }
  const uint32_t r = a + 0xFFFu + ((a >> 13) & 1u);
  return static_cast<uint16_t>(sign | ((r - (112u << 23)) >> 13));
}

NVFP4KV_HD float sat01(float x) {
  // On the bits, without branches (float compares and selects compile to branches, which random
  // data mispredicts: the CPU store ran 2-3x slower). Positive floats order like their bits, so
  // the clamp to 1 is an unsigned min; bits in [1, 0x7F800000] are the positive numbers and +Inf,
  // and everything else (+0, negatives, NaN) gives +0.
  const uint32_t b = float_bits(x);
  const uint32_t clamped = b < 0x3F800000u ? b : 0x3F800000u;
  const uint32_t keep = 0u - static_cast<uint32_t>(b - 1u < 0x7F800000u);
  return bits_float(clamped & keep);
}

NVFP4KV_HD uint32_t sign_word(const float* x) {
  uint32_t r = 0;
  for (int i = 0; i < 8; ++i) r |= (float_bits(x[i]) >> 31) << (4 * i + 3);
  return r;
}

NVFP4KV_HD float e2m1_decode(uint32_t code) {
  // The 8 magnitudes' fp32 bits from a table (a branch per code would mispredict on random data).
  constexpr uint32_t kBits[8] = {0u, 0x3F000000u, 0x3F800000u, 0x3FC00000u,
                                 0x40000000u, 0x40400000u, 0x40800000u, 0x40C00000u};
  return bits_float(kBits[code & 7u] | ((code & 8u) << 28));
}

NVFP4KV_HD float group_amax(const float (&x)[kGroupSize]) {
  // Without branches: non-negative floats order like their bits, and NaN bits (above
  // 0x7F800000) exceed every other magnitude, so the integer max is the amax, or a NaN bit
  // pattern when the group holds one (returned as quiet_nan()).
  uint32_t b = 0;
  for (int i = 0; i < kGroupSize; ++i) {
    const uint32_t a = float_bits(x[i]) & 0x7FFFFFFFu;
    b = a > b ? a : b;
  }
  return b > 0x7F800000u ? quiet_nan() : bits_float(b);
}

}  // namespace portable

}  // namespace nvfp4kv

#if defined(NVFP4KV_FAST_PRIMITIVES)
#include "format_fast.h"  // the library's own build (a private header): namespace nvfp4kv::fast
#else
namespace nvfp4kv {
namespace fast = portable;
}  // namespace nvfp4kv
#endif

namespace nvfp4kv {

// ---- The primitives the recipe uses ----------------------------------------------------------------
// max that returns NaN when either operand is NaN, so the group amax also tells whether the
// group held a NaN.
NVFP4KV_HD float max_nan(float a, float b) { return fast::max_nan(a, b); }

// ---- Input element conversion (exact) ---------------------------------------------------------
NVFP4KV_HD float bf16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

NVFP4KV_HD float f16_to_float(uint16_t h) { return fast::f16_to_float(h); }

// Output conversion with round-to-nearest-even (dequantize, FORMAT.md §6). NaN stays NaN.
NVFP4KV_HD uint16_t float_to_bf16(float f) {
  const uint32_t u = float_bits(f);
  if (is_nan(f)) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

NVFP4KV_HD uint16_t float_to_f16(float f) { return fast::float_to_f16(f); }

// ---- E2M1 (4-bit element) ---------------------------------------------------------------------
// a*b + c where a*b is exact (b a power of two): one FFMA on the GPU, and the same value as the
// separately rounded product and sum of the recipe, so it changes no byte.
NVFP4KV_HD float fma_exact(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return a * b + c;
#endif
}

// Clamp to [0, 1]; NaN gives 0 (the .sat modifier of GPU float instructions).
NVFP4KV_HD float sat01(float x) { return fast::sat01(x); }

constexpr float kMagic = 8388608.0f;  // 2^23: floats in [2^23, 2^24) hold integers in their low bits

// Bit 4i+3 = the sign bit of x[i] for i < 8: the sign bits of one packed code word, placed where
// E2M1 keeps its sign.
NVFP4KV_HD uint32_t sign_word(const float* x) { return fast::sign_word(x); }

// base + (E2M1 magnitude code of m), for m >= 0, as a float: round-to-nearest-even onto
// 0, 0.5, 1, 1.5, 2, 3, 4, 6 with saturation (the ladder of FORMAT.md §2), in six float
// operations and no comparison. On Hopper the float pipe runs twice the rate of the integer and
// compare pipe, and this is the per-element cost that bounds nvfp4_4over6 and the store's
// instruction budget (docs/design-notes.md, "Format core: the float E2M1 encoder").
// With base an even integer in [2^23, 2^24), where a float's ulp is 1:
//   acc = base + rint(4 * min(m/2, 1))      = base + min(rint(2m), 4)   codes 0..4, spacing 0.5
//   acc = acc + 2 * clamp(m/2 - 1, 0, 1)    adds rint(m - 2) once m > 2 codes 4..6, spacing 1
//   acc = acc + clamp(m/2 - 2, 0, 1)        adds 1 once m > 5           code 7
// Each step rounds once (FMA), and every sum it rounds has an even integer part (base; base+4
// when the second step is active; base+6 when the third is), so ties go where E2M1's RNE sends
// them (in values): 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4. The operands are
// exact: m/2 is a power-of-two scaling and m/2 - 1, m/2 - 2 are exact (Sterbenz) wherever they
// are not clamped. A NaN m gives code 0: that is FORMAT.md's code for x * out = 0 * Inf (a zero
// element with out = +Inf, global scales below ~1.5e-36); for Inf * 0 quantize_group sets 7.
NVFP4KV_HD float e2m1_code_plus(float m, float base) {
  const float acc = fma_exact(sat01(mul_rn(m, 0.5f)), 4.0f, base);
  const float acc2 = fma_exact(sat01(fma_exact(m, 0.5f, -1.0f)), 2.0f, acc);
  return add_rn(acc2, sat01(fma_exact(m, 0.5f, -2.0f)));
}

// Magnitude code 0..7 of m >= 0.
NVFP4KV_HD uint32_t e2m1_magnitude(float m) {
  return float_bits(e2m1_code_plus(m, kMagic)) - 0x4B000000u;
}

// Full code of v: magnitude code plus the sign bit of v (-0 and small negatives give 0x8).
NVFP4KV_HD uint32_t e2m1_encode(float v) {
  return ((float_bits(v) >> 28) & 8u) | e2m1_magnitude(abs_f(v));
}

NVFP4KV_HD float e2m1_decode(uint32_t code) { return fast::e2m1_decode(code); }

// ---- E4M3 (scale byte) ------------------------------------------------------------------------
// Scale byte of v >= 0 with RNE, subnormals, saturation to 448 (0x7E); NaN gives 0x7F.
NVFP4KV_HD uint32_t e4m3_encode(float v) {
  if (is_nan(v)) return kScaleNaN;
  const uint32_t a = float_bits(v) & 0x7FFFFFFFu;
  // Below 2^-6 the bytes are the multiples of 2^-9; the ulp of 2^14 is 2^-9 (see e2m1_magnitude).
  const uint32_t small = float_bits(add_rn(bits_float(a), 16384.0f)) - 0x46800000u;
  // Normal: round the mantissa to 3 bits, re-bias exponent 127 -> 7 (960 = 120 << 3).
  uint32_t big = ((a + 0x7FFFFu + ((a >> 20) & 1u)) >> 20) - 960u;
  big = big < kE4M3MaxByte ? big : kE4M3MaxByte;
  return bits_float(a) < 0.015625f ? small : big;
}

NVFP4KV_HD float e4m3_decode(uint32_t byte) {
  const uint32_t b = byte & 0x7Fu;
  if (b == 0x7Fu) return quiet_nan();
  const uint32_t e = b >> 3, m = b & 7u;
  const float mag = e == 0 ? static_cast<float>(m) * 0.001953125f  // m * 2^-9, exact
                           : bits_float(((e + 120u) << 23) | (m << 20));
  return bits_float(float_bits(mag) | ((byte & 0x80u) << 24));
}

// ---- The recipe (FORMAT.md §2) ----------------------------------------------------------------
// What a global scale g turns into, computed once per call (or once per thread for a scale that
// lives on the device): enc = 1/g and its reciprocal, which is not always exactly g.
struct GlobalScale {
  float enc;      // 1 / g
  float inv_enc;  // 1 / enc
  bool valid;     // g finite, > 0, 1/g finite
};

NVFP4KV_HD GlobalScale make_global_scale(float g) {
  GlobalScale s;
  s.enc = recip_rn(g);
  s.inv_enc = recip_rn(s.enc);
  s.valid = is_finite(g) && g > 0.0f && is_finite(s.enc) && s.enc > 0.0f;
  return s;
}

NVFP4KV_HD bool global_scale_valid(float g) { return make_global_scale(g).valid; }

// out = 1 / (sfq * (1/enc)); a function of the scale byte alone for a given global scale, so a
// kernel may tabulate it.
NVFP4KV_HD float out_scale(uint32_t sfb, float inv_enc) {
  const float sfq = e4m3_decode(sfb);
  return sfq == 0.0f ? 0.0f : recip_rn(mul_rn(sfq, inv_enc));
}

NVFP4KV_HD uint32_t scale_byte(float amax, float enc, float divisor) {
  return e4m3_encode(mul_rn(enc, mul_rn(amax, divisor)));
}

// One code word: the codes of x[0..7] for a given out scale, element i in nibble i. Each
// element's code is the low bits of the float 2^23 + code (e2m1_code_plus); adding the 8 float bit
// patterns shifted by 4i packs the nibbles (codes are < 8: no carry) plus the bias of 0x4B000000
// at every nibble position, which the start value cancels. The sign bits go in last. The sign
// comes from x (equal to the sign of x*out, since out >= 0, whenever that is not NaN), which keeps
// the bytes identical across platforms whose default NaN differs. `visit(|x_i|, f)` sees each
// element with f, the bits of its float 2^23 + magnitude code (for callers that also score it).
template <class Visit>
NVFP4KV_HD uint32_t encode_word(const float* x, float out, Visit visit) {
  constexpr uint32_t kBias = 0x4B000000u * 0x11111111u;  // sum of 0x4B000000 << 4i (mod 2^32)
  uint32_t word = 0u - kBias;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int i = 0; i < 8; ++i) {
    const float ax = abs_f(x[i]);
    const uint32_t f = float_bits(e2m1_code_plus(mul_rn(ax, out), kMagic));
    word += f << (4 * i);
    visit(ax, f);
  }
  return word | sign_word(x);
}

// Codes of one group for a given out scale: 8 bytes, element 2k in the low nibble of byte k.
NVFP4KV_HD void encode_group(const float (&x)[kGroupSize], float out, uint32_t (&packed)[2]) {
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int w = 0; w < 2; ++w) packed[w] = encode_word(x + 8 * w, out, [](float, uint32_t) {});
}

// A candidate's r of FORMAT.md §2: 1 / out, and 0 for out == 0 (a kernel may tabulate it per
// scale byte, as it does out).
NVFP4KV_HD float candidate_rcp(float out) { return out == 0.0f ? 0.0f : recip_rn(out); }

// Squared error of a candidate, two partial sums of 8 accumulated left to right (FORMAT.md §2).
NVFP4KV_HD float candidate_error(const float (&x)[kGroupSize], const uint32_t (&packed)[2],
                                 float out) {
  const float r = candidate_rcp(out);
  float sum[2];
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int w = 0; w < 2; ++w) {
    float s = 0.0f;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int i = 0; i < 8; ++i) {
      const float e = sub_rn(mul_rn(e2m1_decode(packed[w] >> (4 * i)), r), x[8 * w + i]);
      s = add_rn(s, mul_rn(e, e));
    }
    sum[w] = s;
  }
  return add_rn(sum[0], sum[1]);
}

// FORMAT.md §2: an infinite element is +-6 whatever `out` is. Needed only where out = 0 with a
// nonzero scale byte (g above ~7.6e35: sfq * (1/enc) overflows), where Inf * out = Inf * 0 is NaN,
// which the encoder gives code 0; everywhere else Inf * out = Inf already gave code 7, so OR-ing 7
// in changes nothing. (The mirror case 0 * Inf, a zero element with out = +Inf at g below
// ~1.5e-36, already gives the spec's code 0 from the encoder.) Called for groups with amax = Inf
// only; the sign bits are in place already.
NVFP4KV_HD void saturate_infinities(const float (&x)[kGroupSize], uint32_t (&packed)[2]) {
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int i = 0; i < kGroupSize; ++i)
    if (!is_finite(x[i])) packed[i >> 3] |= 7u << (4 * (i & 7));
}

// Amax of a group; NaN when the group holds a NaN (max is exact: any order gives the same value).
NVFP4KV_HD float group_amax(const float (&x)[kGroupSize]) { return fast::group_amax(x); }

// One candidate of nvfp4_4over6 as FORMAT.md §2 states it: the codes at `out`, then their error.
struct ScoreCandidate {
  NVFP4KV_HD float operator()(const float (&x)[kGroupSize], uint32_t /*sfb*/, float out,
                              uint32_t (&packed)[2]) const {
    encode_group(x, out, packed);
    return candidate_error(x, packed, out);
  }
};


// Quantizes one group with either recipe. `out_of(sfb)` returns out_scale(sfb, inv_enc): a table
// lookup (the CPU path's per-call table, a kernel's per-block one) or the function itself. `score`
// encodes one candidate of nvfp4_4over6 and returns its error (ScoreCandidate, or an exact
// equivalent). Both are taken by reference: a table is not copied per group. Returns the scale
// byte.
template <Recipe kRecipe, class OutOf, class Score = ScoreCandidate>
NVFP4KV_HD uint32_t quantize_group(const float (&x)[kGroupSize], const GlobalScale& gs,
                                   const OutOf& out_of, uint32_t (&packed)[2],
                                   const Score& score = Score{}) {
  const float amax = group_amax(x);
  if (is_nan(amax) || !gs.valid) {
    packed[0] = packed[1] = 0u;
    return kScaleNaN;
  }
  const uint32_t sfb6 = scale_byte(amax, gs.enc, kR6);
  uint32_t sfb = sfb6;
  if (kRecipe == Recipe::kNvfp4) {
    encode_group(x, out_of(sfb6), packed);
  } else {
    const uint32_t sfb4 = scale_byte(amax, gs.enc, kR4);
    uint32_t packed4[2];
    const float err6 = score(x, sfb6, out_of(sfb6), packed);
    const float err4 = score(x, sfb4, out_of(sfb4), packed4);
    if (err4 < err6) {  // ties keep 6
      packed[0] = packed4[0];
      packed[1] = packed4[1];
      sfb = sfb4;
    }
  }
  if (!is_finite(amax)) saturate_infinities(x, packed);  // amax is not NaN here: +Inf
  return sfb;
}

// ---- Page offsets (FORMAT.md §4), in bytes from the start of one side of one page -----------------
NVFP4KV_HD int64_t row_index(Layout layout, int64_t h, int64_t t, int64_t H, int64_t T) {
  return layout == Layout::kHND ? h * T + t : t * H + h;
}

NVFP4KV_HD int64_t data_offset(int64_t row, int64_t D) { return row * (D / 2); }

NVFP4KV_HD int64_t scale_offset_linear(int64_t row, int64_t g, int64_t H, int64_t T, int64_t D) {
  return H * T * (D / 2) + row * (D / kGroupSize) + g;
}

// Token-4 interleaved scales (HND only; T % 4 == 0): the 4 tokens of a block sit side by side for
// each group, the layout trtllm-gen reads for V on Blackwell.
NVFP4KV_HD int64_t scale_offset_interleaved(int64_t h, int64_t t, int64_t g, int64_t T,
                                            int64_t H, int64_t D) {
  const int64_t S = D / kGroupSize;
  return H * T * (D / 2) + h * T * S + (t / kInterleave) * (kInterleave * S) + kInterleave * g +
         (t % kInterleave);
}

// ---- Dequantization (FORMAT.md §6) --------------------------------------------------------------
// The 16 outputs of a NaN group (scale byte 0x7F): one NaN bit pattern on every platform
// (hardware NaN propagation differs); false, for the callers below to return.
NVFP4KV_HD bool nan_group(float (&y)[kGroupSize]) {
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int i = 0; i < kGroupSize; ++i) y[i] = quiet_nan();
  return false;
}

// A whole group from its two code words and scale byte: y_i = (e2m1_i * sfq) * g in fp32.
// Returns false for a NaN group (scale byte 0x7F), whose y are all NaN.
NVFP4KV_HD bool dequantize_group(const uint32_t (&w)[2], uint32_t sfb, float g,
                                 float (&y)[kGroupSize]) {
  if ((sfb & 0x7Fu) == kScaleNaN) return nan_group(y);
  const float sfq = e4m3_decode(sfb);
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int i = 0; i < kGroupSize; ++i)
    y[i] = mul_rn(mul_rn(e2m1_decode(w[i >> 3] >> (4 * (i & 7))), sfq), g);
  return true;
}


}  // namespace nvfp4kv
