// The CPU path: loops over the parameter structs, calling the format core for every byte.
// A real, shipped path (engines without a GPU, tests' oracle for the kernels), not a helper.
#include "cpu.h"

#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <atomic>
#include <initializer_list>
#include <thread>
#include <vector>

namespace nvfp4kv {
namespace {

// Threads of a CPU call (cpu_set_threads; 0: auto). Each thread takes a share of the pages
// (store, dequantize) or of the output tokens (gather), so it writes bytes no other thread
// writes, and takes its tokens in order: the bytes are those of one thread, duplicate slots
// included (the last token wins; a slot's page has one thread). A call spawns its threads and
// joins them before it returns; calls of less than kMinWork elements per thread use fewer
// threads (spawning one costs tens of microseconds).
constexpr int64_t kMinWork = int64_t{1} << 17;
constexpr int kMaxAutoThreads = 16;
std::atomic<int> g_threads{-1};  // -1: not set yet (NVFP4KV_CPU_THREADS, else auto)

int configured_threads() {
  // The environment and the hardware are read once per process.
  static const int env = [] {
    const char* v = getenv("NVFP4KV_CPU_THREADS");
    const int n = v && *v ? atoi(v) : 0;
    return n > 0 ? n : 0;
  }();
  static const int hw = [] {
    const unsigned c = std::thread::hardware_concurrency();
    return std::min<int>(c ? static_cast<int>(c) : 1, kMaxAutoThreads);
  }();
  const int n = g_threads.load(std::memory_order_relaxed);
  const int want = n < 0 ? env : n;
  return want > 0 ? want : hw;
}

// fn(k, n) for k in [0, n), share k of n, on n threads: n = configured_threads(), fewer when
// `work` (elements in all) is small.
template <class Fn>
void for_shares(int64_t work, const Fn& fn) {
  const int n = static_cast<int>(std::min<int64_t>(configured_threads(), std::max<int64_t>(1, work / kMinWork)));
  if (n <= 1) return fn(0, 1);
  std::vector<std::thread> pool;
  pool.reserve(n - 1);
  for (int k = 1; k < n; ++k) {
    try {
      pool.emplace_back(fn, k, n);
    } catch (...) {  // no thread could be started (resources): this thread takes that share too
      fn(k, n);
    }
  }
  fn(0, n);
  for (std::thread& t : pool) t.join();
}

// Whether page (store, dequantize) or run of 64 output tokens (gather) i is in share k of n. A
// page listed twice, or an output token that two sequences write, stays with one thread, which
// takes them in the single-threaded order.
inline bool in_share(int64_t i, int k, int n) { return i % n == k; }

template <DType kDType>
inline float load_elem(const void* base, int64_t idx) {
  if constexpr (kDType == DType::kFloat32) {
    return static_cast<const float*>(base)[idx];
  } else if constexpr (kDType == DType::kFloat16) {
    return f16_to_float(static_cast<const uint16_t*>(base)[idx]);
  } else {
    return bf16_to_float(static_cast<const uint16_t*>(base)[idx]);
  }
}

template <DType kDType>
inline void store_elem(void* base, int64_t idx, float v) {
  if constexpr (kDType == DType::kFloat32) {
    static_cast<float*>(base)[idx] = v;
  } else if constexpr (kDType == DType::kFloat16) {
    static_cast<uint16_t*>(base)[idx] = float_to_f16(v);
  } else {
    static_cast<uint16_t*>(base)[idx] = float_to_bf16(v);
  }
}

// out scale of every finite scale byte for one global scale: the per-group division becomes a
// lookup, with the very values out_scale() gives.
struct OutTable {
  float out[kScaleNaN];
  explicit OutTable(float inv_enc) {
    for (uint32_t b = 0; b < kScaleNaN; ++b) out[b] = out_scale(b, inv_enc);
  }
  float operator()(uint32_t sfb) const { return out[sfb]; }
};

template <DType kDType, Recipe kRecipe>
void store_token_side(const StoreParams& p, const StoreSide& s, const GlobalScale& gs,
                      const OutTable& table, int64_t token, int64_t page, int64_t pos) {
  const int64_t D = s.cache.D;
  uint8_t* side = s.cache.base + page * s.cache.page_stride;
  for (int64_t h = 0; h < p.H; ++h) {
    const int64_t row = row_index(p.layout, h, pos, p.H, p.T);
    const int64_t src_row = token * s.token_stride + h * s.head_stride;
    uint8_t* data = side + data_offset(row, D);
    for (int64_t g = 0; g < D / kGroupSize; ++g) {
      float x[kGroupSize];
      for (int i = 0; i < kGroupSize; ++i) x[i] = load_elem<kDType>(s.src, src_row + g * 16 + i);
      uint32_t packed[2];
      const uint32_t sfb = quantize_group<kRecipe>(x, gs, table, packed);
      for (int b = 0; b < 8; ++b) data[8 * g + b] = static_cast<uint8_t>(packed[b / 4] >> (8 * (b % 4)));
      const int64_t soff = s.cache.interleaved
                               ? scale_offset_interleaved(h, pos, g, p.T, p.H, D)
                               : scale_offset_linear(row, g, p.H, p.T, D);
      side[soff] = static_cast<uint8_t>(sfb);
    }
  }
}

template <DType kDType, Recipe kRecipe>
void store_impl(const StoreParams& p) {
  const GlobalScale gk = make_global_scale(p.k.scale.value);
  const GlobalScale gv = make_global_scale(p.v.scale.value);
  const OutTable tk(gk.inv_enc), tv(gv.inv_enc);
  for_shares(p.num_tokens * p.H * (p.k.cache.D + p.v.cache.D), [&](int k, int n) {
    for (int64_t i = 0; i < p.num_tokens; ++i) {
      const int64_t slot = load_index(p.slots, i);
      if (slot < 0 || slot >= p.num_slots) continue;  // padding or out of range: skipped
      const int64_t page = slot / p.T, pos = slot % p.T;
      if (!in_share(page, k, n)) continue;
      store_token_side<kDType, kRecipe>(p, p.k, gk, tk, i, page, pos);
      store_token_side<kDType, kRecipe>(p, p.v, gv, tv, i, page, pos);
    }
  });
}

// One row (token, head) of one side into `out` (D elements); zeros when `side` is null (a
// token whose block is invalid).
template <DType kDType>
void dequant_row(const DequantSide& s, const uint8_t* side, int64_t h, int64_t t, int32_t H, int32_t T, Layout layout, int64_t out_row) {
  const int64_t D = s.cache.D;
  if (!side) {
    for (int64_t e = 0; e < D; ++e) store_elem<kDType>(s.out, out_row + e, 0.0f);
    return;
  }
  const int64_t row = row_index(layout, h, t, H, T);
  const uint8_t* data = side + data_offset(row, D);
  const float g = s.scale.value;
  for (int64_t g16 = 0; g16 < D / kGroupSize; ++g16) {
    const int64_t soff = s.cache.interleaved ? scale_offset_interleaved(h, t, g16, T, H, D)
                                             : scale_offset_linear(row, g16, H, T, D);
    uint32_t w[2] = {0, 0};
    for (int b = 0; b < 8; ++b) w[b / 4] |= static_cast<uint32_t>(data[8 * g16 + b]) << (8 * (b % 4));
    float y[kGroupSize];
    dequantize_group(w, side[soff], g, y);
    for (int i = 0; i < kGroupSize; ++i) store_elem<kDType>(s.out, out_row + g16 * kGroupSize + i, y[i]);
  }
}

template <DType kDType>
void dequant_impl(const DequantParams& p) {
  for_shares(p.num_pages * p.T * p.H * (p.k.cache.D + p.v.cache.D), [&](int k, int n) {
    for (int64_t i = 0; i < p.num_pages; ++i) {
      const int64_t page = p.pages.ptr ? load_index(p.pages, i) : i;
      if (page < 0 || page >= p.N) continue;  // a page id out of range: nothing to read or write
      if (!in_share(page, k, n)) continue;
      for (const DequantSide* s : {&p.k, &p.v}) {
        const uint8_t* side = s->cache.base + page * s->cache.page_stride;
        for (int64_t t = 0; t < p.T; ++t)
          for (int64_t h = 0; h < p.H; ++h)
            dequant_row<kDType>(*s, side, h, t, p.H, p.T, p.layout,
                                page * s->out_stride[0] + t * s->out_stride[1] + h * s->out_stride[2]);
      }
    }
  });
}

template <DType kDType>
void gather_impl(const GatherParams& p) {
  for_shares(p.total_tokens * p.H * (p.k.cache.D + p.v.cache.D), [&](int k, int n) {
    for (int64_t b = 0; b < p.B; ++b) {
      const int64_t len = load_index(p.seq_lens, b), start = load_index(p.cu_seqlens, b);
      const IndexVec row = block_table_row(p, b);
      for (int64_t j = 0; j < len; ++j) {
        const int64_t out_tok = start + j;
        if (out_tok < 0 || out_tok >= p.total_tokens) continue;  // never write outside the output
        if (!in_share(out_tok / 64, k, n)) continue;
        const int64_t blk = j / p.T;
        const int64_t page = blk < p.max_blocks ? load_index(row, blk) : -1;
        const bool valid = page >= 0 && page < p.N;  // a bad block-table entry reads as zeros
        for (const DequantSide* s : {&p.k, &p.v}) {
          const uint8_t* side = valid ? s->cache.base + page * s->cache.page_stride : nullptr;
          for (int64_t h = 0; h < p.H; ++h)
            dequant_row<kDType>(*s, side, h, j % p.T, p.H, p.T, p.layout,
                                out_tok * s->out_stride[0] + h * s->out_stride[1]);
        }
      }
    }
  });
}

}  // namespace

void cpu_set_threads(int threads) { g_threads.store(threads, std::memory_order_relaxed); }
int cpu_threads() { return configured_threads(); }

void cpu_store(const StoreParams& p) {
  // dtype x recipe dispatch, the only place it happens on the CPU.
  switch (p.dtype) {
    case DType::kFloat32:
      return p.recipe == Recipe::kNvfp4 ? store_impl<DType::kFloat32, Recipe::kNvfp4>(p)
                                        : store_impl<DType::kFloat32, Recipe::kNvfp4_4over6>(p);
    case DType::kFloat16:
      return p.recipe == Recipe::kNvfp4 ? store_impl<DType::kFloat16, Recipe::kNvfp4>(p)
                                        : store_impl<DType::kFloat16, Recipe::kNvfp4_4over6>(p);
    case DType::kBFloat16:
      return p.recipe == Recipe::kNvfp4 ? store_impl<DType::kBFloat16, Recipe::kNvfp4>(p)
                                        : store_impl<DType::kBFloat16, Recipe::kNvfp4_4over6>(p);
  }
}

void cpu_dequantize(const DequantParams& p) {
  switch (p.dtype) {
    case DType::kFloat32: return dequant_impl<DType::kFloat32>(p);
    case DType::kFloat16: return dequant_impl<DType::kFloat16>(p);
    case DType::kBFloat16: return dequant_impl<DType::kBFloat16>(p);
  }
}

void cpu_gather(const GatherParams& p) {
  switch (p.dtype) {
    case DType::kFloat32: return gather_impl<DType::kFloat32>(p);
    case DType::kFloat16: return gather_impl<DType::kFloat16>(p);
    case DType::kBFloat16: return gather_impl<DType::kBFloat16>(p);
  }
}

}  // namespace nvfp4kv
