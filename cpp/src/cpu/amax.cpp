// The CPU path of nvfp4kv_amax: max(|x|) on the elements' bits (params.h, amax_bits), over shares
// of the elements on the CPU backend's threads, combined at the end (the maximum does not depend
// on the split, so the result is the same for every thread count).
#include <string.h>

#include <algorithm>
#include <atomic>

#include "backend.h"
#include "cpu/shares.h"

namespace nvfp4kv {
namespace {

template <class Word>
uint32_t load_abs(const uint8_t* p) {
  Word w;
  memcpy(&w, p, sizeof w);
  return static_cast<uint32_t>(w) & (sizeof(Word) == 4 ? 0x7FFFFFFFu : 0x7FFFu);
}

// The largest |x| bits of elements [lo, hi) in row-major order of p's (collapsed) shape.
template <class Word>
uint32_t scan(const AmaxParams& p, int64_t lo, int64_t hi) {
  const int last = p.ndim - 1;
  constexpr int64_t kSize = static_cast<int64_t>(sizeof(Word));
  const int64_t inner = p.shape[last], step = p.stride[last] * kSize;
  int64_t idx[8] = {};
  int64_t rest = lo;
  for (int d = last; d >= 0; --d) {
    idx[d] = rest % p.shape[d];
    rest /= p.shape[d];
  }
  uint32_t m = 0;
  for (int64_t i = lo; i < hi;) {
    int64_t off = 0;
    for (int d = 0; d < last; ++d) off += idx[d] * p.stride[d];
    const uint8_t* row = static_cast<const uint8_t*>(p.x) + (off + idx[last] * p.stride[last]) * kSize;
    const int64_t run = std::min(hi - i, inner - idx[last]);
    if (step == kSize) {  // contiguous: a loop the compiler vectorizes
      for (int64_t j = 0; j < run; ++j) m = std::max(m, load_abs<Word>(row + j * kSize));
    } else {
      for (int64_t j = 0; j < run; ++j) m = std::max(m, load_abs<Word>(row + j * step));
    }
    i += run;
    idx[last] += run;
    for (int d = last; d > 0 && idx[d] == p.shape[d]; --d) {  // odometer
      idx[d] = 0;
      ++idx[d - 1];
    }
  }
  return m;
}

}  // namespace

void cpu_amax(const AmaxParams& p) {
  uint32_t raw = 0;
  if (p.ndim > 0 && p.numel > 0) {
    std::atomic<uint32_t> best{0};
    cpu_for_shares(static_cast<double>(p.numel), /*separate=*/true, [&](int k, int n) {
      const int64_t lo = p.numel / n * k + std::min<int64_t>(k, p.numel % n);
      const int64_t hi = lo + p.numel / n + (k < p.numel % n ? 1 : 0);
      const uint32_t m = p.dtype == DType::kFloat32 ? scan<uint32_t>(p, lo, hi) : scan<uint16_t>(p, lo, hi);
      uint32_t cur = best.load(std::memory_order_relaxed);
      while (m > cur && !best.compare_exchange_weak(cur, m, std::memory_order_relaxed)) {
      }
    });
    raw = best.load();
  }
  const int32_t r = amax_bits(raw, p.dtype);
  if (p.accumulate) {
    // Atomic, as the CUDA path's atomicMax: calls from several threads may accumulate into one
    // out (a read then a write lost updates there; found by review). amax_combine is a max of
    // the int32 bits, so a compare-and-swap loop that stops once out is no smaller computes it.
    if (p.ndim > 0 && p.numel > 0) {
      int32_t cur = __atomic_load_n(p.amax, __ATOMIC_RELAXED);
      while (amax_combine(cur, r) != cur &&
             !__atomic_compare_exchange_n(p.amax, &cur, r, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
      }
    }
  } else {
    *p.amax = r;
  }
}

}  // namespace nvfp4kv
