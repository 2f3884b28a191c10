// The CPU path: loops over the parameter structs, calling the format core for every byte.
// A real, shipped path (engines without a GPU, tests' oracle for the kernels), not a helper.
#include "backend.h"
#include "cpu/shares.h"
#include "float_mode.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <initializer_list>
#include <thread>
#include <vector>

namespace nvfp4kv {
namespace {

// Threads of a CPU call (cpu_set_threads; 0: auto). Each thread takes a share of the pages
// (store, dequantize) or of the output tokens (gather), so it writes bytes no other thread
// writes, and takes its tokens in order: the bytes are those of one thread, duplicate slots
// included (the last token wins; a slot's page has one thread). That holds while the tensors a
// call writes share no bytes with the others or across shares (separable() below); a call whose
// tensors overlap otherwise runs on one thread, as before threads. A call spawns its threads and
// joins them before it returns; calls of less than kMinWork elements per thread use fewer
// threads (spawning one costs tens of microseconds).
constexpr int64_t kMinWork = int64_t{1} << 17;
constexpr int kMaxAutoThreads = 16;
std::atomic<int> g_threads{-1};  // -1: not set yet (NVFP4KV_CPU_THREADS, else auto)

// CPUs the calling thread may run on (its affinity mask: taskset, numactl, a container's cpuset,
// or an engine pinning its workers), which the threads it starts inherit. Read at every call
// that could use more than one thread: read once, the first caller's mask held for every thread
// of the process (a pinned worker first left all later calls on one thread; review).
int usable_cpus() {
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
#endif
  const unsigned c = std::thread::hardware_concurrency();
  return c ? static_cast<int>(c) : 1;
}

// A value of NVFP4KV_CPU_THREADS that is not a whole number in [0, kMaxCpuThreads] is ignored (auto).
// White space around the number is read with it: `NVFP4KV_CPU_THREADS="4 "` means 4 (it was
// ignored: review).
int env_threads() {
  const char* v = getenv("NVFP4KV_CPU_THREADS");
  if (!v || !*v) return 0;
  char* end = nullptr;
  errno = 0;
  const long n = strtol(v, &end, 10);
  while (isspace(static_cast<unsigned char>(*end))) ++end;
  return errno == 0 && *end == '\0' && n >= 0 && n <= kMaxCpuThreads ? static_cast<int>(n) : 0;
}

// The environment, read at the first call: kept in an atomic, not a function-local static, whose
// initialization guard, held by a thread reading it when another forks the process, would block
// the child's first call for ever (review). Threads that both read first store the same value.
std::atomic<int> g_env_threads{-1};

int configured_threads() {
  int env = g_env_threads.load(std::memory_order_relaxed);
  if (env < 0) g_env_threads.store(env = env_threads(), std::memory_order_relaxed);
  const int n = g_threads.load(std::memory_order_relaxed);
  const int want = n < 0 ? env : n;
  return want > 0 ? want : std::min(usable_cpus(), kMaxAutoThreads);
}

// The shares of a call: configured_threads(), fewer when `work` (elements in all) is small, one
// when the call's tensors are not `separate` (separable(), apart() below).
int share_count(double work, bool separate) {
  const double by_work = std::max(1.0, std::floor(work / static_cast<double>(kMinWork)));
  if (!separate || by_work < 2) return 1;  // no affinity read for a call that takes one thread
  return static_cast<int>(std::min<double>(configured_threads(), by_work));
}

// fn(k, n) for k in [0, n), share k of n, on n threads.
template <class Fn>
void run_shares(int n, const Fn& fn) {
  if (n <= 1) return fn(0, 1);
  // A share that throws (std::bad_alloc of its buffers) hands the exception to this thread, which
  // rethrows the first after every share has ended: thrown on a worker it would end the process.
  std::vector<std::exception_ptr> thrown(static_cast<size_t>(n));
  const auto run = [&fn, &thrown, n](int k) {
    try {
      fn(k, n);
    } catch (...) {
      thrown[static_cast<size_t>(k)] = std::current_exception();
    }
  };
  std::vector<std::thread> pool;
  for (int k = 1; k < n; ++k) {
    try {
      pool.emplace_back([&run, k] {
        const FloatModeGuard ieee;  // whatever mode a new thread starts in
        run(k);
      });
    } catch (...) {  // no thread could be started (resources): this thread takes that share too
      run(k);
    }
  }
  run(0);
  for (std::thread& t : pool) t.join();
  for (const std::exception_ptr& e : thrown)
    if (e) std::rethrow_exception(e);
}

template <class Fn>
void for_shares(double work, bool separate, const Fn& fn) {
  run_shares(share_count(work, separate), fn);
}

// Whether page (store, dequantize) or run of 64 output tokens (gather) i (>= 0) is in share k of
// n. A page listed twice, or an output token that two sequences write, stays with one thread,
// which takes them in the single-threaded order. Hashed, so that page ids with a common stride
// still spread over all shares.
inline bool in_share(int64_t i, int k, int n) {
  return static_cast<int>(((static_cast<uint64_t>(i) * 0x9E3779B97F4A7C15ull) >> 32) % static_cast<uint64_t>(n)) == k;
}

// a * b wrapping around (no signed overflow): the strides below may be anything where their
// dimension has one element (it addresses nothing), and a product with such a stride is then
// multiplied by 0 or never used. Memory that exists never makes these products wrap.
int64_t wrap_mul(int64_t a, int64_t b) {
  return static_cast<int64_t>(static_cast<uint64_t>(a) * static_cast<uint64_t>(b));
}

// Bytes [lo, hi) that `count` blocks of `bytes` bytes, `stride` bytes apart from `base`, cover
// (stride >= 0; an empty span for count 0).
struct Span {
  uintptr_t lo = 0, hi = 0;
};
Span span_of(const void* base, int64_t count, int64_t stride, int64_t bytes) {
  const uintptr_t lo = reinterpret_cast<uintptr_t>(base);
  return count <= 0 ? Span{}
                    : Span{lo, lo + static_cast<uintptr_t>(count - 1) * static_cast<uintptr_t>(stride) +
                                   static_cast<uintptr_t>(bytes)};
}
bool apart(Span a, Span b) { return a.hi <= a.lo || b.hi <= b.lo || a.hi <= b.lo || b.hi <= a.lo; }

// Whether threads that own whole units (pages, or output tokens) can write two tensors laid out as
// `count` units of a and b bytes, a_stride and b_stride bytes apart: no unit overlaps another
// unit of its own tensor, and the two tensors either do not overlap at all or interleave unit by
// unit (one allocation split in K and V: the same stride, unit u of b within reach of unit u of a
// only).
bool separable(const void* a, int64_t a_stride, int64_t a_bytes, const void* b, int64_t b_stride, int64_t b_bytes,
               int64_t count) {
  if (count <= 1) return true;
  if (a_stride < a_bytes || b_stride < b_bytes) return false;
  if (apart(span_of(a, count, a_stride, a_bytes), span_of(b, count, b_stride, b_bytes))) return true;
  const int64_t d = static_cast<int64_t>(reinterpret_cast<uintptr_t>(b) - reinterpret_cast<uintptr_t>(a));
  return a_stride == b_stride && a_bytes - a_stride <= d && d <= a_stride - b_bytes;
}

// Bytes of an index vector's entries.
Span span_of(const IndexVec& v, int64_t count) {
  const int64_t e = v.is_int64 ? 8 : 4;
  return v.ptr && v.stride >= 0 ? span_of(v.ptr, count, wrap_mul(v.stride, e), e) : Span{};
}

int64_t side_bytes(const CacheSide& c, int64_t H, int64_t T) { return H * T * full_dim(c.D); }

// Bytes that the N pages of one cache side cover.
Span cache_span(const CacheSide& c, int64_t N, int64_t H, int64_t T) {
  return span_of(c.base, N, c.page_stride, side_bytes(c, H, T));
}

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
  // Threads only where the pages of K and V are separable and no input shares bytes with them.
  const int64_t N = p.num_slots / p.T, e = dtype_bytes(p.dtype);
  const int64_t kb = side_bytes(p.k.cache, p.H, p.T), vb = side_bytes(p.v.cache, p.H, p.T);
  const Span ck = cache_span(p.k.cache, N, p.H, p.T), cv = cache_span(p.v.cache, N, p.H, p.T);
  bool separate = separable(p.k.cache.base, p.k.cache.page_stride, kb, p.v.cache.base, p.v.cache.page_stride, vb, N);
  for (const StoreSide* in : {&p.k, &p.v}) {
    const bool forward = in->token_stride >= 0 && in->head_stride >= 0;
    const Span x = span_of(in->src, p.num_tokens, wrap_mul(in->token_stride, e),
                           wrap_mul(wrap_mul(p.H - 1, in->head_stride) + in->cache.D, e));
    separate = separate && forward && apart(x, ck) && apart(x, cv);
  }
  const Span sl = span_of(p.slots, p.num_tokens);
  separate = separate && p.slots.stride >= 0 && apart(sl, ck) && apart(sl, cv);
  const double work = static_cast<double>(p.num_tokens) * p.H * (p.k.cache.D + p.v.cache.D);
  for_shares(work, separate, [&](int k, int n) {
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

// Whether threads may write the outputs of dequantize (units: pages of (T, H, D)) or gather
// (units: tokens of (H, D), T = 0): strides that keep units apart, K and V outputs separable,
// and no byte shared with what the call reads (`reads`: the cache sides, the index vectors).
bool outputs_separate(const DequantSide& k, const DequantSide& v, int64_t units, int64_t T, int64_t H, int64_t e,
                      std::initializer_list<Span> reads) {
  const DequantSide* sides[2] = {&k, &v};
  int64_t stride[2], bytes[2];
  for (int i = 0; i < 2; ++i) {
    const int64_t* st = sides[i]->out_stride;
    // Strides of T and H: out_stride[1], [2] for dequantize; gather (T = 0 here) has H at [1].
    const int64_t s1 = T > 0 ? st[1] : 0, s2 = T > 0 ? st[2] : st[1];
    if (st[0] < 0 || s1 < 0 || s2 < 0) return false;
    stride[i] = wrap_mul(st[0], e);
    bytes[i] = wrap_mul(wrap_mul(T > 0 ? T - 1 : 0, s1) + wrap_mul(H - 1, s2) + sides[i]->cache.D, e);
  }
  if (!separable(k.out, stride[0], bytes[0], v.out, stride[1], bytes[1], units)) return false;
  for (int i = 0; i < 2; ++i) {
    const Span o = span_of(sides[i]->out, units, stride[i], bytes[i]);
    for (const Span r : reads)
      if (!apart(o, r)) return false;
  }
  return true;
}

template <DType kDType>
void dequant_impl(const DequantParams& p) {
  const double work = static_cast<double>(p.num_pages) * p.T * p.H * (p.k.cache.D + p.v.cache.D);
  const Span ck = cache_span(p.k.cache, p.N, p.H, p.T), cv = cache_span(p.v.cache, p.N, p.H, p.T);
  const bool separate = outputs_separate(p.k, p.v, p.N, p.T, p.H, dtype_bytes(p.dtype),
                                         {ck, cv, span_of(p.pages, p.num_pages)});
  for_shares(work, separate, [&](int k, int n) {
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
  const double work = static_cast<double>(p.total_tokens) * p.H * (p.k.cache.D + p.v.cache.D);
  const Span bt = p.bt_stride[0] >= 0 && p.bt_stride[1] >= 0
                      ? span_of(p.block_table, p.B, wrap_mul(p.bt_stride[0], p.bt_int64 ? 8 : 4),
                                wrap_mul(wrap_mul(p.max_blocks - 1, p.bt_stride[1]) + 1, p.bt_int64 ? 8 : 4))
                      : Span{0, ~uintptr_t{0}};
  const Span ck = cache_span(p.k.cache, p.N, p.H, p.T), cv = cache_span(p.v.cache, p.N, p.H, p.T);
  const bool separate = outputs_separate(p.k, p.v, p.total_tokens, 0, p.H, dtype_bytes(p.dtype),
                                         {ck, cv, bt, span_of(p.seq_lens, p.B), span_of(p.cu_seqlens, p.B + 1)});
  for_shares(work, separate, [&](int k, int n) {
    for (int64_t b = 0; b < p.B; ++b) {
      const int64_t len = load_index(p.seq_lens, b), start = load_index(p.cu_seqlens, b);
      const IndexVec row = block_table_row(p, b);
      const SeqRows rows = gather_rows(len, start, p.total_tokens);  // never outside the output
      for (int64_t j = rows.lo; j < rows.hi; ++j) {
        const int64_t out_tok = start + j;
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

void cpu_for_shares(double work, bool separate, const std::function<void(int, int)>& fn) {
  for_shares(work, separate, fn);
}
int cpu_share_count(double work, bool separate) { return share_count(work, separate); }
void cpu_run_shares(int n, const std::function<void(int, int)>& fn) { run_shares(n, fn); }
bool cpu_in_share(int64_t i, int k, int n) { return in_share(i, k, n); }

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
