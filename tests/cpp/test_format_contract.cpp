// nvfp4kv/format.h in a consumer's build that lets the compiler fuse products into FMAs (GCC's
// default wherever FMA instructions are enabled): its quantization must give the library's bytes.
// The library itself is built with -ffp-contract=off; this file is built with -ffp-contract=fast
// and its loop with FMA enabled (x86-64: target("fma"), run only where the CPU has FMA).
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "nvfp4kv/format.h"
#include "nvfp4kv/nvfp4kv.h"
#include "host_view.h"

using namespace nvfp4kv;

#if defined(__x86_64__) && defined(__GNUC__)
#define NVFP4KV_TEST_FMA __attribute__((target("fma")))
#else
#define NVFP4KV_TEST_FMA
#endif

namespace {

constexpr int kF = 9;  // a row of 16 elements: 8 code bytes and 1 scale byte

// Groups of the format.h quantization (recipe nvfp4_4over6, whose choice between two scale
// candidates sums squared errors) that differ from the library's store of the same values.
NVFP4KV_TEST_FMA int count_differences(const std::vector<float>& x, const std::vector<uint8_t>& cache, float g) {
  const GlobalScale gs = make_global_scale(g);
  auto out_of = [&](uint32_t sfb) { return out_scale(sfb, gs.inv_enc); };
  const size_t n = x.size() / kGroupSize;
  int differ = 0;
  for (size_t i = 0; i < n; ++i) {
    float group[kGroupSize];
    std::memcpy(group, &x[i * kGroupSize], sizeof group);
    uint32_t packed[2];
    const uint32_t sfb = quantize_group<Recipe::kNvfp4_4over6>(group, gs, out_of, packed);
    const uint8_t* row = &cache[i * 2 * kF];  // K row of slot i
    if (std::memcmp(row, packed, 8) != 0 || row[8] != sfb) {
      if (++differ <= 3) std::printf("group %zu: library scale byte 0x%02x, format.h 0x%02x\n", i, row[8], sfb);
    }
  }
  return differ;
}

}  // namespace

int main() {
#if defined(__x86_64__) && defined(__GNUC__)
  if (!__builtin_cpu_supports("fma")) {
    std::printf("skipped: this CPU has no FMA instructions\n");
    return 77;
  }
#endif
  // Values on a grid of small integers times a scale (ties and near-ties between the two
  // candidates' errors are common): 7 of these 2M groups differed with contraction (review).
  const int n = 2000000;
  std::mt19937 rng(7);
  std::uniform_int_distribution<int> level(-12, 12), pick(0, 3);
  std::vector<float> x(size_t(n) * kGroupSize);
  for (size_t i = 0; i < size_t(n); ++i) {
    const float s = std::ldexp(1.0f + 0.001f * float(i % 997), int(i % 7) - 3);
    for (int j = 0; j < kGroupSize; ++j) x[i * kGroupSize + j] = float(level(rng)) * s * (pick(rng) == 0 ? 1.0f : 0.37f);
  }
  std::vector<uint8_t> cache(size_t(n) * 2 * kF);
  std::vector<int64_t> slots(n);
  for (int i = 0; i < n; ++i) slots[i] = i;
  float g = 5.3f / 448.f;
  int64_t kshape[3] = {n, 1, kGroupSize}, cshape[5] = {n, 2, 1, 1, kF}, sshape[1] = {n}, one[1] = {1};
  DLTensor kt = view(x.data(), kDLFloat, 32, 3, kshape), ct = view(cache.data(), kDLUInt, 8, 5, cshape);
  DLTensor st = view(slots.data(), kDLInt, 64, 1, sshape), gt = view(&g, kDLFloat, 32, 1, one);
  if (nvfp4kv_store(&kt, &kt, &ct, nullptr, &st, &gt, &gt, NVFP4KV_RECIPE_NVFP4_4OVER6, NVFP4KV_SCALES_LINEAR,
                    nullptr) != NVFP4KV_SUCCESS) {
    std::printf("store failed: %s\n", nvfp4kv_last_error());
    return 1;
  }
  const int differ = count_differences(x, cache, g);
  std::printf("%d of %d groups differ from the library\n", differ, n);
  return differ != 0;
}
