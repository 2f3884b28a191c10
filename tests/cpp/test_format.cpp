// Unit tests of the format core (format.h) against brute-force definitions: nearest representable
// value, ties to the even code. No dependency on the library's own code paths beyond format.h.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

#include "nvfp4kv/format.h"

using namespace nvfp4kv;

static int g_failures = 0;
#define CHECK(cond, ...)                                   \
  do {                                                     \
    if (!(cond)) {                                         \
      if (++g_failures <= 20) {                            \
        fprintf(stderr, "%s:%d: CHECK(%s) ", __FILE__, __LINE__, #cond); \
        fprintf(stderr, __VA_ARGS__);                      \
        fprintf(stderr, "\n");                             \
      }                                                    \
    }                                                      \
  } while (0)

static float bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static uint32_t ubits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

// Nearest of `values` (ascending, index = code); ties to the even index; above the last: last.
static uint32_t nearest_even(double m, const std::vector<double>& values) {
  if (m >= values.back()) return static_cast<uint32_t>(values.size() - 1);
  for (size_t i = 0; i + 1 < values.size(); ++i) {
    const double lo = values[i], hi = values[i + 1];
    if (m > hi) continue;
    const double mid = (lo + hi) / 2;
    if (m < mid) return static_cast<uint32_t>(i);
    if (m > mid) return static_cast<uint32_t>(i + 1);
    return static_cast<uint32_t>(i % 2 == 0 ? i : i + 1);
  }
  return static_cast<uint32_t>(values.size() - 1);
}

static std::vector<double> e2m1_values() { return {0, 0.5, 1, 1.5, 2, 3, 4, 6}; }
static std::vector<double> e4m3_values() {
  std::vector<double> v;
  for (uint32_t b = 0; b < 0x7F; ++b) {
    const uint32_t e = b >> 3, m = b & 7;
    v.push_back(e == 0 ? m * ldexp(1.0, -9) : (1 + m / 8.0) * ldexp(1.0, static_cast<int>(e) - 7));
  }
  return v;
}

static void test_e2m1() {
  const auto vals = e2m1_values();
  for (uint32_t c = 0; c < 16; ++c) {
    const float d = e2m1_decode(c);
    const double want = (c & 8 ? -1 : 1) * vals[c & 7];
    CHECK(d == want && (signbit(d) != 0) == ((c & 8) != 0), "decode(%u)=%g", c, d);
  }
  // Every tie and the 4096 floats on each side of it (the float encoder rounds in three steps,
  // each exact only by an argument about its operands), and a sweep over [0, 8) in steps of 2^-12.
  // (All 2^31 non-negative floats were checked once against the ladder: 0 mismatches.)
  std::vector<float> probes;
  for (double t : {0.25, 0.75, 1.25, 1.75, 2.0, 2.5, 3.5, 4.0, 5.0, 6.0})
    for (int k = -4096; k <= 4096; ++k) probes.push_back(bits(ubits(static_cast<float>(t)) + k));
  for (int i = 0; i < 8 * 4096; ++i) probes.push_back(i / 4096.0f);
  for (float big : {7.0f, 100.0f, 3.4e38f, INFINITY, 1e-30f, 1.4e-45f}) probes.push_back(big);
  for (float m : probes) {
    for (float s : {1.0f, -1.0f}) {
      const float v = s * m;
      const uint32_t want = (s < 0 ? 8u : 0u) | nearest_even(m, vals);
      CHECK(e2m1_encode(v) == want, "e2m1_encode(%.9g)=%u want %u", v, e2m1_encode(v), want);
    }
  }
  CHECK(e2m1_encode(-0.0f) == 8u, "-0 must keep its sign");
  CHECK(e2m1_magnitude(NAN) == 0u, "NaN magnitude (x*out = 0*Inf: a zero element, FORMAT.md §2) is 0");
}

static void test_sign_word() {
  const float x[8] = {1.0f, -1.0f, -0.0f, 0.0f, -INFINITY, bits(0xFFC00000u), 3.0f, -1e-40f};
  uint32_t want = 0;
  for (int i = 0; i < 8; ++i)
    if (ubits(x[i]) >> 31) want |= 8u << (4 * i);
  CHECK(sign_word(x) == want, "sign_word=%08x want %08x", sign_word(x), want);
}

static void test_e4m3() {
  const auto vals = e4m3_values();
  for (uint32_t b = 0; b < 256; ++b) {
    const float d = e4m3_decode(b);
    if ((b & 0x7F) == 0x7F) {
      CHECK(isnan(d), "decode(0x%02x) must be NaN", b);
      continue;
    }
    const double want = (b & 0x80 ? -1 : 1) * vals[b & 0x7F];
    CHECK(d == want, "e4m3_decode(0x%02x)=%g want %g", b, d, want);
    if (!(b & 0x80)) CHECK(e4m3_encode(d) == b, "round trip of 0x%02x", b);
  }
  // Midpoints between neighbours (ties), one ulp either side, and a log sweep.
  std::vector<float> probes;
  for (size_t i = 0; i + 1 < vals.size(); ++i) {
    const float mid = static_cast<float>((vals[i] + vals[i + 1]) / 2);
    for (int k = -2; k <= 2; ++k) probes.push_back(bits(ubits(mid) + k));
  }
  for (double x = 1e-5; x < 1e4; x *= 1.001) probes.push_back(static_cast<float>(x));
  for (float big : {448.0f, 464.0f, 464.0001f, 480.0f, 1e6f, INFINITY, 0.0f, 1e-40f}) probes.push_back(big);
  for (float v : probes) {
    const uint32_t want = nearest_even(v, vals);
    CHECK(e4m3_encode(v) == want, "e4m3_encode(%.9g)=0x%02x want 0x%02x", v, e4m3_encode(v), want);
  }
  CHECK(e4m3_encode(NAN) == kScaleNaN, "NaN scale byte");
}

static void test_half_conversions() {
  // Every half and bfloat16 bit pattern: float conversion is exact, and converting back
  // round-trips (NaN stays NaN).
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = f16_to_float(static_cast<uint16_t>(h));
    const uint32_t e = (h >> 10) & 0x1F, m = h & 0x3FF;
    double want = e == 0 ? m * ldexp(1.0, -24) : e == 31 ? (m ? NAN : INFINITY)
                                                         : (1 + m / 1024.0) * ldexp(1.0, e - 15);
    if (h & 0x8000) want = -want;
    if (isnan(want)) {
      CHECK(isnan(f), "f16 0x%04x", h);
      CHECK((float_to_f16(f) & 0x7C00) == 0x7C00 && (float_to_f16(f) & 0x3FF), "f16 NaN back");
    } else {
      CHECK(f == want, "f16_to_float(0x%04x)=%g want %g", h, f, want);
      CHECK(float_to_f16(f) == h, "float_to_f16 round trip 0x%04x", h);
    }
    const float b = bf16_to_float(static_cast<uint16_t>(h));
    if (!isnan(b)) CHECK(float_to_bf16(b) == h, "bf16 round trip 0x%04x", h);
  }
  // RNE ties: halfway between two halves goes to the even one.
  CHECK(float_to_f16(1.0f + ldexpf(1.0f, -11)) == 0x3C00, "f16 tie to even (down)");
  CHECK(float_to_f16(1.0f + 3 * ldexpf(1.0f, -11)) == 0x3C02, "f16 tie to even (up)");
  CHECK(float_to_f16(65520.0f) == 0x7C00, "f16 overflow");
  CHECK(float_to_f16(ldexpf(1.0f, -25)) == 0x0000, "f16 subnormal tie to 0");
  CHECK(float_to_f16(ldexpf(3.0f, -25)) == 0x0002, "f16 subnormal tie to even");
  CHECK(float_to_bf16(bits(0x3F808000)) == 0x3F80, "bf16 tie to even (down)");
  CHECK(float_to_bf16(bits(0x3F818000)) == 0x3F82, "bf16 tie to even (up)");
}

static void test_recipe() {
  // A group with a known answer: amax 6 at g = 1 gives sf = 1 (byte 0x38), codes = e2m1(x).
  float x[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};
  const GlobalScale gs = make_global_scale(1.0f);
  uint32_t packed[2];
  auto out = [&](uint32_t b) { return out_scale(b, gs.inv_enc); };
  const uint32_t sfb = quantize_group<Recipe::kNvfp4>(x, gs, out, packed);
  CHECK(sfb == 0x38, "sfb=0x%02x", sfb);
  CHECK(packed[0] == 0x76543210u && packed[1] == 0xFEDCBA98u, "packed %08x %08x", packed[0], packed[1]);
  // NaN anywhere: 0x7F and zero codes. Invalid global scale likewise.
  x[3] = NAN;
  CHECK(quantize_group<Recipe::kNvfp4>(x, gs, out, packed) == kScaleNaN && packed[0] == 0 && packed[1] == 0, "NaN group");
  const GlobalScale bad = make_global_scale(0.0f);
  x[3] = 1.5f;
  CHECK(!bad.valid && quantize_group<Recipe::kNvfp4_4over6>(x, bad, out, packed) == kScaleNaN, "invalid g");
  CHECK(!global_scale_valid(-1.0f) && !global_scale_valid(INFINITY) && !global_scale_valid(NAN) &&
            !global_scale_valid(1e-45f) && global_scale_valid(1e-30f), "global scale validity");
  // Page offsets of FORMAT.md §4 for D=128, H=8, T=16.
  CHECK(scale_offset_linear(row_index(Layout::kHND, 1, 2, 8, 16), 3, 8, 16, 128) == 8 * 16 * 64 + 18 * 8 + 3, "linear");
  CHECK(scale_offset_interleaved(1, 6, 3, 16, 8, 128) == 8 * 16 * 64 + 1 * 16 * 8 + 1 * 32 + 12 + 2, "interleaved");
  CHECK(row_index(Layout::kNHD, 1, 2, 8, 16) == 17, "NHD row");
}

// The primitives format.h calls through fast:: equal their portable definitions. In the plain
// build fast:: is portable:: (trivially equal); in the format_fast build (NVFP4KV_FAST_PRIMITIVES,
// the library's own) this checks the platform versions of format_fast.h on this host.
static void test_fast_primitives() {
  uint32_t x = 12345;
  const auto next = [&x] { x ^= x << 13; x ^= x >> 17; x ^= x << 5; return x; };
  // sat01 on a stride through every bit pattern, plus the edges.
  for (uint64_t u = 0; u <= 0xFFFFFFFFull; u += 4093) {
    const float f = bits(static_cast<uint32_t>(u));
    CHECK(ubits(fast::sat01(f)) == ubits(portable::sat01(f)), "sat01(0x%08x)", static_cast<uint32_t>(u));
  }
  for (const uint32_t u : {0u, 0x80000000u, 1u, 0x3F800000u, 0x3F800001u, 0x3F7FFFFFu, 0x7F800000u,
                           0xFF800000u, 0x7FC00000u, 0xFFC00000u, 0x7F800001u})
    CHECK(ubits(fast::sat01(bits(u))) == ubits(portable::sat01(bits(u))), "sat01(0x%08x)", u);
  for (uint32_t h = 0; h < 65536; ++h)
    CHECK(ubits(fast::f16_to_float(static_cast<uint16_t>(h))) ==
              ubits(portable::f16_to_float(static_cast<uint16_t>(h))), "f16_to_float(0x%04x)", h);
  for (int i = 0; i < 1000000; ++i) {
    const float a = bits(next()), b = bits(next());
    CHECK(fast::float_to_f16(a) == portable::float_to_f16(a), "float_to_f16(%a)", a);
    const float m = fast::max_nan(a, b), pm = portable::max_nan(a, b);
    CHECK(ubits(m) == ubits(pm) || (isnan(m) && isnan(pm)), "max_nan(%a, %a)", a, b);
  }
  for (uint32_t c = 0; c < 16; ++c)
    CHECK(ubits(fast::e2m1_decode(c)) == ubits(portable::e2m1_decode(c)), "e2m1_decode(%u)", c);
  for (int i = 0; i < 100000; ++i) {
    float g[kGroupSize];
    for (float& v : g) v = bits(next() % 16 == 0 ? next() : (next() & 0x8FFFFFFFu));
    CHECK(ubits(fast::sign_word(g)) == ubits(portable::sign_word(g)), "sign_word");
    const float a = fast::group_amax(g), pa = portable::group_amax(g);
    CHECK(ubits(a) == ubits(pa), "group_amax %a %a", a, pa);
  }
}

int main() {
  test_fast_primitives();
  test_e2m1();
  test_sign_word();
  test_e4m3();
  test_half_conversions();
  test_recipe();
  if (g_failures) {
    fprintf(stderr, "test_format: %d failures\n", g_failures);
    return 1;
  }
  printf("test_format: all checks passed\n");
  return 0;
}
