// The C ABI as a C++ engine would call it: DLTensor views over host buffers. Checks statuses,
// messages, that rejected calls leave the cache untouched, and that a store touches exactly the
// targeted rows with the bytes of a known group.
#include <fenv.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "nvfp4kv/nvfp4kv.h"
#include "testing.h"

static int g_failures = 0;
#define CHECK(cond, ...)                                                   \
  do {                                                                     \
    if (!(cond)) {                                                         \
      ++g_failures;                                                        \
      fprintf(stderr, "%s:%d: CHECK(%s) ", __FILE__, __LINE__, #cond);     \
      fprintf(stderr, __VA_ARGS__);                                        \
      fprintf(stderr, "\n");                                               \
    }                                                                      \
  } while (0)

struct View {
  std::vector<int64_t> shape;
  DLTensor t{};
  View(void* data, DLDataType dt, std::vector<int64_t> s) : shape(std::move(s)) {
    t.data = data;
    t.device = DLDevice{kDLCPU, 0};
    t.ndim = static_cast<int32_t>(shape.size());
    t.dtype = dt;
    t.shape = shape.data();
    t.strides = nullptr;
  }
};

static const DLDataType kF32{kDLFloat, 32, 1}, kU8{kDLUInt, 8, 1}, kI64{kDLInt, 64, 1},
    kF64{kDLFloat, 64, 1};

// Concurrent callers: several application threads (an engine's workers) call the ABI at once,
// each on its own buffers, while another thread changes the process-wide CPU thread count. Every
// call must give the bytes that the same call gives alone, and each thread's nvfp4kv_last_error()
// must be its own refused call's message. CI runs this under ThreadSanitizer too.
namespace caller_shape {  // a store of n tokens large enough for 8 CPU threads; B sequences
constexpr int64_t N = 256, T = 16, H = 2, D = 64, F = 36, n = 4096, B = 2, Hq = 8, cols = 8;
}

struct CallerWork {
  std::vector<float> key, value;
  std::vector<int64_t> slots;
  std::vector<int32_t> table, lens;
  std::vector<uint16_t> query, out;  // bf16
  std::vector<uint8_t> cache;
  std::vector<float> lse;
};

static CallerWork caller_work(int id) {
  using namespace caller_shape;
  CallerWork w;
  uint32_t state = 2654435761u * static_cast<uint32_t>(id + 1);
  const auto next = [&state] {
    state = state * 1664525u + 1013904223u;
    return static_cast<float>(static_cast<int32_t>(state)) * 4.6566e-10f;  // [-1, 1)
  };
  w.key.resize(n * H * D);
  w.value.resize(n * H * D);
  for (size_t i = 0; i < w.key.size(); ++i) {
    w.key[i] = 3.0f * next();
    w.value[i] = next();
  }
  w.slots.resize(n);
  for (int64_t i = 0; i < n; ++i) w.slots[i] = (i * 389 + 17 * id) % (N * T);  // a permutation of the slots
  w.cache.assign(N * 2 * T * H * F, 0);
  w.table.resize(B * cols);
  for (int64_t i = 0; i < B * cols; ++i) w.table[i] = static_cast<int32_t>((i * 7 + id) % N);
  w.lens = {100 + id, 128};
  w.query.resize(B * Hq * D);
  for (uint16_t& q : w.query) {
    const float f = next();
    uint32_t bits;
    memcpy(&bits, &f, 4);
    q = static_cast<uint16_t>(bits >> 16);  // bf16 by truncation: any bf16 will do
  }
  w.out.assign(B * Hq * D, 0xFFFF);
  w.lse.assign(B * Hq, 7.0f);
  return w;
}

// The caller's calls: a store, a decode over the stored pages, and a store refused for a scale
// of -(id + 1), whose message must name that scale. Returns what went wrong, or "".
static std::string caller_calls(CallerWork& w, int id) {
  using namespace caller_shape;
  const DLDataType kBF16{kDLBfloat, 16, 1}, kI32{kDLInt, 32, 1};
  float ks = 0.02f, vs = 0.01f, bad = -static_cast<float>(id + 1);
  View k(w.key.data(), kF32, {n, H, D}), v(w.value.data(), kF32, {n, H, D}), c(w.cache.data(), kU8, {N, 2, T, H, F}),
      s(w.slots.data(), kI64, {n}), kscale(&ks, kF32, {1}), vscale(&vs, kF32, {1}), bscale(&bad, kF32, {1}),
      bt(w.table.data(), kI32, {B, cols}), sl(w.lens.data(), kI32, {B}), q(w.query.data(), kBF16, {B, Hq, D}),
      o(w.out.data(), kBF16, {B, Hq, D}), l(w.lse.data(), kF32, {B, Hq});
  if (nvfp4kv_store(&k.t, &v.t, &c.t, nullptr, &s.t, &kscale.t, &vscale.t, NVFP4KV_RECIPE_NVFP4, NVFP4KV_SCALES_LINEAR,
                    nullptr) != NVFP4KV_SUCCESS)
    return std::string("store: ") + nvfp4kv_last_error();
  if (nvfp4kv_decode_attention(&q.t, &c.t, nullptr, &bt.t, &sl.t, &kscale.t, &vscale.t, NVFP4KV_SCALES_LINEAR, 1, 0.125f,
                               0.0f, -1, &o.t, &l.t, nullptr, nullptr) != NVFP4KV_SUCCESS)
    return std::string("decode: ") + nvfp4kv_last_error();
  if (nvfp4kv_store(&k.t, &v.t, &c.t, nullptr, &s.t, &bscale.t, &vscale.t, NVFP4KV_RECIPE_NVFP4, NVFP4KV_SCALES_LINEAR,
                    nullptr) != NVFP4KV_ERROR_INVALID_VALUE)
    return "a negative k_scale was taken";
  const std::string want = "k_scale: " + std::to_string(-(id + 1)) + " received";
  if (!strstr(nvfp4kv_last_error(), want.c_str()))
    return "last_error is another call's: " + std::string(nvfp4kv_last_error()) + " (expected " + want + ")";
  return "";
}

static void concurrent_callers() {
  constexpr int kCallers = 4, kRounds = 3;
  std::vector<CallerWork> alone;
  for (int id = 0; id < kCallers; ++id) {  // each caller's calls on this thread, one at a time
    alone.push_back(caller_work(id));
    const std::string e = caller_calls(alone.back(), id);
    CHECK(e.empty(), "caller %d alone: %s", id, e.c_str());
  }
  std::atomic<bool> stop{false};
  // The CPU thread count never changes a byte (main's "CPU threads" block; test_decode.py's
  // test_same_bytes_for_every_thread_count), so the calls may meet any count.
  std::thread toggler([&stop] {
    for (int i = 0; !stop.load(); ++i) {
      nvfp4kv_set_cpu_threads(i % 3 == 0 ? 1 : i % 3 == 1 ? 8 : 0);
      std::this_thread::yield();
    }
  });
  std::vector<std::string> errors(kCallers);
  std::vector<std::thread> callers;
  for (int id = 0; id < kCallers; ++id)
    callers.emplace_back([&, id] {
      for (int r = 0; r < kRounds && errors[id].empty(); ++r) {
        CallerWork w = caller_work(id);
        errors[id] = caller_calls(w, id);
        if (errors[id].empty() && (w.cache != alone[id].cache || w.out != alone[id].out || w.lse != alone[id].lse))
          errors[id] = "round " + std::to_string(r) + ": other bytes than the same calls alone";
      }
    });
  for (std::thread& t : callers) t.join();
  stop = true;
  toggler.join();
  for (int id = 0; id < kCallers; ++id) CHECK(errors[id].empty(), "concurrent caller %d: %s", id, errors[id].c_str());
  CHECK(nvfp4kv_set_cpu_threads(0) == NVFP4KV_SUCCESS, "threads auto");
}

int main() {
  CHECK(nvfp4kv_version() == NVFP4KV_VERSION, "header and library versions differ");
  CHECK(NVFP4KV_VERSION_COMPATIBLE(NVFP4KV_VERSION) && NVFP4KV_VERSION_COMPATIBLE(NVFP4KV_VERSION + 1) &&
            !NVFP4KV_VERSION_COMPATIBLE(NVFP4KV_VERSION - 1) && !NVFP4KV_VERSION_COMPATIBLE(NVFP4KV_VERSION + 100),
        "NVFP4KV_VERSION_COMPATIBLE: a later patch serves, an earlier one or another minor does not");
  CHECK(std::string(nvfp4kv_status_string(NVFP4KV_ERROR_INVALID_DTYPE)) == "invalid dtype", "status string");
  CHECK(std::string(nvfp4kv_status_string(NVFP4KV_ERROR_OUT_OF_MEMORY)) == "out of memory" &&
            std::string(nvfp4kv_status_string(static_cast<nvfp4kv_status>(8))) == "unknown status",
        "status string of the last status and past it");

  // N=2 pages, T=4, H=2, D=32 (F=18): 5-D NHD (contiguous) cache.
  const int64_t N = 2, T = 4, H = 2, D = 32, F = 18, n = 3;
  std::vector<uint8_t> cache(N * 2 * T * H * F, 0xA5), before;
  std::vector<float> key(n * H * D), value(n * H * D);
  for (size_t i = 0; i < key.size(); ++i) {
    key[i] = (i % 16 == 7) ? 6.0f : 0.5f * static_cast<float>(i % 4);  // amax 6 per group
    value[i] = -key[i];
  }
  std::vector<int64_t> slots = {5, -1, 100};  // page 1 position 1; padding; out of range
  float ks = 1.0f, vs = 1.0f;
  View k(key.data(), kF32, {n, H, D}), v(value.data(), kF32, {n, H, D}),
      c(cache.data(), kU8, {N, 2, T, H, F}), s(slots.data(), kI64, {n}), kscale(&ks, kF32, {1}),
      vscale(&vs, kF32, {1});

  nvfp4kv_status st = nvfp4kv_store(&k.t, &v.t, &c.t, nullptr, &s.t, &kscale.t, &vscale.t,
                                    NVFP4KV_RECIPE_NVFP4, NVFP4KV_SCALES_LINEAR, nullptr);
  CHECK(st == NVFP4KV_SUCCESS, "store failed: %s", nvfp4kv_last_error());
  // Row (t=1, h) of page 1 in NHD is t*H + h. Only those rows' bytes may change.
  size_t changed = 0, expected_changed = 0;
  for (size_t i = 0; i < cache.size(); ++i) changed += cache[i] != 0xA5;
  for (int64_t side = 0; side < 2; ++side) {
    uint8_t* base = cache.data() + (1 * 2 + side) * T * H * F;
    for (int64_t h = 0; h < H; ++h) {
      const int64_t row = 1 * H + h;
      const uint8_t* data = base + row * D / 2;
      const uint8_t* scale = base + T * H * D / 2 + row * D / 16;
      // Group = 0, 0.5, 1, 1.5, 0, .. with 6 at element 7: scale byte 0x38 (1.0), codes = e2m1.
      CHECK(scale[0] == 0x38 && scale[1] == 0x38, "scale bytes %02x %02x", scale[0], scale[1]);
      const uint8_t want_k[8] = {0x10, 0x32, 0x10, 0x72, 0x10, 0x32, 0x10, 0x32};
      for (int b = 0; b < 8; ++b) {
        const uint8_t want = side == 0 ? want_k[b] : static_cast<uint8_t>(want_k[b] | 0x88);
        CHECK(data[b] == want, "side %lld head %lld byte %d: %02x want %02x", (long long)side,
              (long long)h, b, data[b], want);
      }
      expected_changed += D / 2 + D / 16;
    }
  }
  CHECK(changed <= expected_changed && changed > expected_changed / 2, "changed %zu bytes", changed);

  // Dequantize reads the same values back.
  std::vector<float> kout(N * T * H * D), vout(N * T * H * D);
  View ko(kout.data(), kF32, {N, T, H, D}), vo(vout.data(), kF32, {N, T, H, D});
  st = nvfp4kv_dequantize(&c.t, nullptr, &kscale.t, &vscale.t, NVFP4KV_SCALES_LINEAR, &ko.t, &vo.t, nullptr);
  CHECK(st == NVFP4KV_SUCCESS, "dequantize failed: %s", nvfp4kv_last_error());
  const int64_t row0 = ((1 * T + 1) * H + 0) * D;  // page 1, t=1, h=0
  for (int64_t e = 0; e < D; ++e) CHECK(kout[row0 + e] == key[e] && vout[row0 + e] == value[e], "dequant %lld", (long long)e);

  // A cache in pinned host memory (kDLCUDAHost, as a C runtime's cudaHostAlloc buffer reports
  // it) runs the CPU path and gets the same bytes; the other arguments may be pageable.
  {
    std::vector<uint8_t> pinned(cache.size(), 0xA5);
    View pc(pinned.data(), kU8, {N, 2, T, H, F});
    pc.t.device = DLDevice{kDLCUDAHost, 0};
    st = nvfp4kv_store(&k.t, &v.t, &pc.t, nullptr, &s.t, &kscale.t, &vscale.t, NVFP4KV_RECIPE_NVFP4,
                       NVFP4KV_SCALES_LINEAR, nullptr);
    CHECK(st == NVFP4KV_SUCCESS && pinned == cache, "store into a kDLCUDAHost cache: %s", nvfp4kv_last_error());
  }

  // A dimension of one element may have any stride (it addresses nothing): one token of key with
  // a token stride of 2^62 stores what a compact one does (found by fuzzing: the CPU path's
  // threading arithmetic overflowed on it, undefined behaviour though the bytes were right).
  {
    std::vector<uint8_t> one_tok(cache.size(), 0xA5), compact(cache.size(), 0xA5);
    std::vector<int64_t> slot = {6};
    View ck(one_tok.data(), kU8, {N, 2, T, H, F}), cc(compact.data(), kU8, {N, 2, T, H, F}),
        k1(key.data(), kF32, {1, H, D}), v1(value.data(), kF32, {1, H, D}), s1(slot.data(), kI64, {1});
    const int64_t huge[3] = {int64_t{1} << 62, D, 1}, huge1[1] = {int64_t{1} << 62};
    CHECK(nvfp4kv_store(&k1.t, &v1.t, &cc.t, nullptr, &s1.t, &kscale.t, &vscale.t, NVFP4KV_RECIPE_NVFP4,
                        NVFP4KV_SCALES_LINEAR, nullptr) == NVFP4KV_SUCCESS, "%s", nvfp4kv_last_error());
    k1.t.strides = const_cast<int64_t*>(huge);
    s1.t.strides = const_cast<int64_t*>(huge1);
    CHECK(nvfp4kv_store(&k1.t, &v1.t, &ck.t, nullptr, &s1.t, &kscale.t, &vscale.t, NVFP4KV_RECIPE_NVFP4,
                        NVFP4KV_SCALES_LINEAR, nullptr) == NVFP4KV_SUCCESS && one_tok == compact,
          "store of one token with a huge token stride: %s", nvfp4kv_last_error());
  }

  // Rejected calls: status, message naming the argument, cache untouched.
  before = cache;
  ks = 0.0f;
  st = nvfp4kv_store(&k.t, &v.t, &c.t, nullptr, &s.t, &kscale.t, &vscale.t, NVFP4KV_RECIPE_NVFP4,
                     NVFP4KV_SCALES_LINEAR, nullptr);
  CHECK(st == NVFP4KV_ERROR_INVALID_VALUE && strstr(nvfp4kv_last_error(), "k_scale"), "%s", nvfp4kv_last_error());
  ks = 1.0f;
  View kbad(key.data(), kF64, {n, H, D / 2});
  st = nvfp4kv_store(&kbad.t, &v.t, &c.t, nullptr, &s.t, &kscale.t, &vscale.t, NVFP4KV_RECIPE_NVFP4,
                     NVFP4KV_SCALES_LINEAR, nullptr);
  CHECK(st == NVFP4KV_ERROR_INVALID_DTYPE && strstr(nvfp4kv_last_error(), "key"), "%s", nvfp4kv_last_error());
  // The vllm profile interleaves V scales: needs HND, and this cache is NHD.
  st = nvfp4kv_store(&k.t, &v.t, &c.t, nullptr, &s.t, &kscale.t, &vscale.t, NVFP4KV_RECIPE_NVFP4,
                     NVFP4KV_SCALES_VLLM, nullptr);
  CHECK(st == NVFP4KV_ERROR_INVALID_VALUE && strstr(nvfp4kv_last_error(), "scale_layout"), "%s", nvfp4kv_last_error());
  st = nvfp4kv_store(&k.t, &v.t, nullptr, nullptr, &s.t, &kscale.t, &vscale.t, NVFP4KV_RECIPE_NVFP4,
                     NVFP4KV_SCALES_LINEAR, nullptr);
  CHECK(st == NVFP4KV_ERROR_INVALID_VALUE && strstr(nvfp4kv_last_error(), "kv_cache"), "%s", nvfp4kv_last_error());
  st = nvfp4kv_store(&k.t, &v.t, &c.t, nullptr, &s.t, &kscale.t, &vscale.t, (nvfp4kv_recipe)7,
                     NVFP4KV_SCALES_LINEAR, nullptr);
  CHECK(st == NVFP4KV_ERROR_INVALID_VALUE && strstr(nvfp4kv_last_error(), "recipe"), "%s", nvfp4kv_last_error());
  CHECK(cache == before, "a rejected call changed the cache");

  // The store workspace: its size, a call with one (the CPU path checks it and needs none), and
  // rejected workspaces.
  size_t ws_bytes = 0;
  st = nvfp4kv_store_workspace_size(N, T, &ws_bytes);
  CHECK(st == NVFP4KV_SUCCESS && ws_bytes == static_cast<size_t>(16 + 4 * N * (2 * T + 3)), "size %zu", ws_bytes);
  CHECK(nvfp4kv_store_workspace_size(N, T, nullptr) == NVFP4KV_ERROR_INVALID_VALUE &&
            strstr(nvfp4kv_last_error(), "bytes"), "%s", nvfp4kv_last_error());
  CHECK(nvfp4kv_store_workspace_size(-1, T, &ws_bytes) == NVFP4KV_ERROR_INVALID_VALUE, "negative num_blocks");
  // Page bytes: this test's cache is N of them; vLLM's D 128, H 8, T 16 page is 18432 bytes.
  {
    size_t page = 0, row = 0;
    CHECK(nvfp4kv_page_bytes(T, H, D, D, &page, &row) == NVFP4KV_SUCCESS && page * N == cache.size() &&
              row == static_cast<size_t>(F), "page %zu row %zu: %s", page, row, nvfp4kv_last_error());
    CHECK(nvfp4kv_page_bytes(16, 8, 128, 128, &page, nullptr) == NVFP4KV_SUCCESS && page == 18432, "page %zu", page);
    CHECK(nvfp4kv_page_bytes(16, 8, 128, 64, &page, &row) == NVFP4KV_SUCCESS && page == 16 * 8 * (72 + 36) &&
              row == 72, "page %zu row %zu", page, row);
    page = 7;
    CHECK(nvfp4kv_page_bytes(16, 8, 120, 128, &page, nullptr) == NVFP4KV_ERROR_INVALID_VALUE &&
              strstr(nvfp4kv_last_error(), "head_size: head size 120") && page == 7, "%s", nvfp4kv_last_error());
    CHECK(nvfp4kv_page_bytes(16, 8, 128, 528, &page, nullptr) == NVFP4KV_ERROR_INVALID_VALUE &&
              strstr(nvfp4kv_last_error(), "head_size_v"), "%s", nvfp4kv_last_error());
    CHECK(nvfp4kv_page_bytes(0, 8, 128, 128, &page, nullptr) == NVFP4KV_ERROR_INVALID_VALUE &&
              strstr(nvfp4kv_last_error(), "block_size 0"), "%s", nvfp4kv_last_error());
    CHECK(nvfp4kv_page_bytes(16, -1, 128, 128, &page, nullptr) == NVFP4KV_ERROR_INVALID_VALUE &&
              strstr(nvfp4kv_last_error(), "num_kv_heads -1"), "%s", nvfp4kv_last_error());
    CHECK(nvfp4kv_page_bytes(16, 8, 128, 128, nullptr, &row) == NVFP4KV_ERROR_INVALID_VALUE, "NULL page_bytes");
    // One side of 2^31 - 1 bytes is the most: T 2^31 - 1, H 1, F 1 is not a head size, so take F 9
    // (D 16) and T H = floor((2^31 - 1) / 9) = 238609294 = 2 * 119304647; one token more fails.
    CHECK(nvfp4kv_page_bytes(119304647, 2, 16, 16, &page, nullptr) == NVFP4KV_SUCCESS &&
              page == static_cast<size_t>(2) * 238609294 * 9, "page %zu: %s", page, nvfp4kv_last_error());
    CHECK(nvfp4kv_page_bytes(119304648, 2, 16, 16, &page, nullptr) == NVFP4KV_ERROR_INVALID_VALUE &&
              strstr(nvfp4kv_last_error(), "2 GiB"), "%s", nvfp4kv_last_error());
    // The message names the side that is too large (found by review: it said "head_size").
    CHECK(nvfp4kv_page_bytes(7456541, 1, 512, 16, &page, nullptr) == NVFP4KV_ERROR_INVALID_VALUE &&
              strstr(nvfp4kv_last_error(), "key side (head_size): block size 7456541"), "%s", nvfp4kv_last_error());
    CHECK(nvfp4kv_page_bytes(7456541, 1, 16, 512, &page, nullptr) == NVFP4KV_ERROR_INVALID_VALUE &&
              strstr(nvfp4kv_last_error(), "value side (head_size_v)"), "%s", nvfp4kv_last_error());
    CHECK(nvfp4kv_page_bytes(INT64_MAX, INT64_MAX, 16, 16, &page, nullptr) == NVFP4KV_ERROR_INVALID_VALUE,
          "overflow");
  }
  // Malformed DLTensors from a C caller: rejected with the argument named, the cache untouched.
  {
    before = cache;
    DLTensor bad = k.t;
    bad.shape = nullptr;
    st = nvfp4kv_store(&bad, &v.t, &c.t, nullptr, &s.t, &kscale.t, &vscale.t, NVFP4KV_RECIPE_NVFP4,
                       NVFP4KV_SCALES_LINEAR, nullptr);
    CHECK(st == NVFP4KV_ERROR_INVALID_VALUE && strstr(nvfp4kv_last_error(), "key: rank 3 with a NULL shape"),
          "%s", nvfp4kv_last_error());
    std::vector<int64_t> neg = {-1, H, D};
    bad.shape = neg.data();
    st = nvfp4kv_store(&bad, &v.t, &c.t, nullptr, &s.t, &kscale.t, &vscale.t, NVFP4KV_RECIPE_NVFP4,
                       NVFP4KV_SCALES_LINEAR, nullptr);
    CHECK(st == NVFP4KV_ERROR_INVALID_VALUE && strstr(nvfp4kv_last_error(), "key: extent -1 along dimension 0"),
          "%s", nvfp4kv_last_error());
    bad = v.t;
    bad.data = nullptr;
    st = nvfp4kv_store(&k.t, &bad, &c.t, nullptr, &s.t, &kscale.t, &vscale.t, NVFP4KV_RECIPE_NVFP4,
                       NVFP4KV_SCALES_LINEAR, nullptr);
    CHECK(st == NVFP4KV_ERROR_INVALID_VALUE && strstr(nvfp4kv_last_error(), "value: NULL data pointer"),
          "%s", nvfp4kv_last_error());
    // A NULL K side beside a value_cache is named as the messages name that side (C ABI fuzzing).
    st = nvfp4kv_store(&k.t, &v.t, nullptr, &c.t, &s.t, &kscale.t, &vscale.t, NVFP4KV_RECIPE_NVFP4,
                       NVFP4KV_SCALES_LINEAR, nullptr);
    CHECK(st == NVFP4KV_ERROR_INVALID_VALUE && strstr(nvfp4kv_last_error(), "key_cache: NULL tensor"), "%s",
          nvfp4kv_last_error());
    for (int r : {-1, 2}) {  // a C caller's out-of-range enum: well defined (the enums are int in C++)
      st = nvfp4kv_store(&k.t, &v.t, &c.t, nullptr, &s.t, &kscale.t, &vscale.t, static_cast<nvfp4kv_recipe>(r),
                         NVFP4KV_SCALES_LINEAR, nullptr);
      CHECK(st == NVFP4KV_ERROR_INVALID_VALUE && strstr(nvfp4kv_last_error(), "recipe"), "recipe %d: %s", r,
            nvfp4kv_last_error());
    }
    CHECK(nvfp4kv_version() > 0 && strstr(nvfp4kv_last_error(), "recipe"), "a call without a status kept it");
    CHECK(nvfp4kv_store_workspace_size(N, T, &ws_bytes) == NVFP4KV_SUCCESS && nvfp4kv_last_error()[0] == '\0',
          "a success clears the last error: %s", nvfp4kv_last_error());
    bad = v.t;
    bad.ndim = 9;
    st = nvfp4kv_store(&k.t, &bad, &c.t, nullptr, &s.t, &kscale.t, &vscale.t, NVFP4KV_RECIPE_NVFP4,
                       NVFP4KV_SCALES_LINEAR, nullptr);
    CHECK(st == NVFP4KV_ERROR_INVALID_VALUE && strstr(nvfp4kv_last_error(), "value: rank 9; expected 0 to 8"), "%s",
          nvfp4kv_last_error());
    bad = v.t;
    bad.byte_offset = 1;  // an element at an odd byte: rejected before anything is read
    st = nvfp4kv_store(&k.t, &bad, &c.t, nullptr, &s.t, &kscale.t, &vscale.t, NVFP4KV_RECIPE_NVFP4,
                       NVFP4KV_SCALES_LINEAR, nullptr);
    CHECK(st == NVFP4KV_ERROR_INVALID_VALUE &&
              strstr(nvfp4kv_last_error(), "value: address not a multiple of its element size (4 bytes)"),
          "%s", nvfp4kv_last_error());
    DLTensor badc = c.t;
    std::vector<int64_t> huge = {int64_t{1} << 40, 2, int64_t{1} << 20, 1, F};
    badc.shape = huge.data();
    st = nvfp4kv_store(&k.t, &v.t, &badc, nullptr, &s.t, &kscale.t, &vscale.t, NVFP4KV_RECIPE_NVFP4,
                       NVFP4KV_SCALES_LINEAR, nullptr);
    CHECK(st == NVFP4KV_ERROR_INVALID_VALUE && strstr(nvfp4kv_last_error(), "more than 2^62 elements"),
          "%s", nvfp4kv_last_error());
    CHECK(cache == before, "a rejected call changed the cache");
  }
  CHECK(nvfp4kv_testing_set_store_order(static_cast<nvfp4kv_testing_store_order>(3)) == NVFP4KV_ERROR_INVALID_VALUE,
        "store order 3");
  CHECK(nvfp4kv_testing_set_store_order(NVFP4KV_TESTING_STORE_AUTO) == NVFP4KV_SUCCESS, "store order auto");
  CHECK(nvfp4kv_testing_set_gather_kernel(static_cast<nvfp4kv_testing_gather_kernel>(-1)) ==
            NVFP4KV_ERROR_INVALID_VALUE, "gather kernel -1");
  CHECK(nvfp4kv_testing_set_gather_kernel(static_cast<nvfp4kv_testing_gather_kernel>(3)) ==
            NVFP4KV_ERROR_INVALID_VALUE, "gather kernel 3");
  CHECK(nvfp4kv_testing_set_gather_kernel(NVFP4KV_TESTING_GATHER_AUTO) == NVFP4KV_SUCCESS, "gather kernel auto");
  CHECK(nvfp4kv_set_cpu_threads(-1) == NVFP4KV_ERROR_INVALID_VALUE && strstr(nvfp4kv_last_error(), "threads"),
        "%s", nvfp4kv_last_error());
  CHECK(nvfp4kv_set_cpu_threads(257) == NVFP4KV_ERROR_INVALID_VALUE, "cpu threads 257");
  CHECK(nvfp4kv_set_cpu_threads(3) == NVFP4KV_SUCCESS && nvfp4kv_cpu_threads() == 3, "cpu threads 3");
  CHECK(nvfp4kv_set_cpu_threads(0) == NVFP4KV_SUCCESS && nvfp4kv_cpu_threads() >= 1, "cpu threads auto");
  std::vector<uint32_t> ws_words(ws_bytes / 4 + 1, 0);  // 4-byte aligned storage
  View ws(ws_words.data(), kU8, {static_cast<int64_t>(ws_bytes)}),
      ws_small(ws_words.data(), kU8, {static_cast<int64_t>(ws_bytes) - 1}),
      ws_odd(reinterpret_cast<uint8_t*>(ws_words.data()) + 1, kU8, {static_cast<int64_t>(ws_bytes)}),
      ws_f32(ws_words.data(), kF32, {static_cast<int64_t>(ws_bytes / 4)}),
      ws_in_cache(cache.data(), kU8, {static_cast<int64_t>(ws_bytes)});
  const struct {
    const View* w;
    const char* text;
  } bad_ws[] = {{&ws_small, "needs"}, {&ws_odd, "multiple of 4"}, {&ws_f32, "uint8"}, {&ws_in_cache, "overlaps kv_cache"}};
  for (const auto& b : bad_ws) {
    st = nvfp4kv_store_with_workspace(&k.t, &v.t, &c.t, nullptr, &s.t, &kscale.t, &vscale.t, NVFP4KV_RECIPE_NVFP4,
                                      NVFP4KV_SCALES_LINEAR, &b.w->t, nullptr);
    CHECK(st != NVFP4KV_SUCCESS && strstr(nvfp4kv_last_error(), b.text) &&
              strstr(nvfp4kv_last_error(), "nvfp4kv_store_with_workspace: workspace"),
          "%s", nvfp4kv_last_error());
  }
  CHECK(cache == before, "a rejected workspace changed the cache");
#if UINTPTR_MAX > 0xFFFFFFFFu
  {
    // A cache of 2^41 slots takes no workspace: the message names the workspace, not the size
    // query's arguments (found by review). Its memory is never touched: every slot is padding,
    // and the address (2^47) lies above any user-space mapping of x86-64 or AArch64 (48 bits).
    std::vector<int64_t> pad = {-1, -1, -1};
    View huge(reinterpret_cast<void*>(uintptr_t{1} << 47), kU8, {int64_t{1} << 39, 2, T, H, F}),
        sp(pad.data(), kI64, {n});
    st = nvfp4kv_store_with_workspace(&k.t, &v.t, &huge.t, nullptr, &sp.t, &kscale.t, &vscale.t,
                                      NVFP4KV_RECIPE_NVFP4, NVFP4KV_SCALES_LINEAR, &ws.t, nullptr);
    CHECK(st == NVFP4KV_ERROR_INVALID_VALUE && strstr(nvfp4kv_last_error(), "workspace: a cache of") &&
              strstr(nvfp4kv_last_error(), "2^40"),
          "%s", nvfp4kv_last_error());
  }
#endif
  std::vector<uint8_t> plain = cache;
  st = nvfp4kv_store_with_workspace(&k.t, &v.t, &c.t, nullptr, &s.t, &kscale.t, &vscale.t, NVFP4KV_RECIPE_NVFP4,
                                    NVFP4KV_SCALES_LINEAR, &ws.t, nullptr);
  CHECK(st == NVFP4KV_SUCCESS, "store with workspace failed: %s", nvfp4kv_last_error());
  View cp(plain.data(), kU8, {N, 2, T, H, F});
  st = nvfp4kv_store_with_workspace(&k.t, &v.t, &cp.t, nullptr, &s.t, &kscale.t, &vscale.t, NVFP4KV_RECIPE_NVFP4,
                                    NVFP4KV_SCALES_LINEAR, nullptr, nullptr);
  CHECK(st == NVFP4KV_SUCCESS && cache == plain, "a workspace changed the CPU path's bytes");

  // CPU threads: a store, a page dequantize and a gather large enough for 8 threads write the
  // bytes of one thread (CI also runs this test under ThreadSanitizer).
  {
    const int64_t N2 = 64, T2 = 16, H2 = 4, D2 = 128, F2 = 72, n2 = 1024, B = 4;
    std::vector<float> k2(n2 * H2 * D2), v2(n2 * H2 * D2);
    uint32_t state = 12345;
    for (size_t i = 0; i < k2.size(); ++i) {
      state = state * 1664525u + 1013904223u;
      k2[i] = static_cast<float>(static_cast<int32_t>(state)) * 1e-9f;
      v2[i] = -0.5f * k2[i];
    }
    std::vector<int64_t> s2(n2), table(B * 16), lens(B, 256), cu(B + 1);
    for (int64_t i = 0; i < n2; ++i) s2[i] = i % 50 == 49 ? s2[i - 1] : (i * 37) % (N2 * T2);  // duplicates
    for (int64_t i = 0; i < B * 16; ++i) table[i] = (i * 5) % N2;
    for (int64_t b = 0; b <= B; ++b) cu[b] = b * 256;
    std::vector<uint8_t> cache_by[2];
    std::vector<float> pages_by[2], seqs_by[2];
    for (int run = 0; run < 2; ++run) {
      CHECK(nvfp4kv_set_cpu_threads(run ? 8 : 1) == NVFP4KV_SUCCESS, "threads");
      std::vector<uint8_t>& c2 = cache_by[run];
      c2.assign(N2 * 2 * T2 * H2 * F2, 0);
      std::vector<float>& po = pages_by[run];
      std::vector<float>& so = seqs_by[run];
      po.assign(2 * N2 * T2 * H2 * D2, 0.0f);
      so.assign(2 * n2 * H2 * D2, 0.0f);
      View kk(k2.data(), kF32, {n2, H2, D2}), vv(v2.data(), kF32, {n2, H2, D2}), cc(c2.data(), kU8, {N2, 2, T2, H2, F2}),
          ss(s2.data(), kI64, {n2}), pk(po.data(), kF32, {N2, T2, H2, D2}),
          pv(po.data() + N2 * T2 * H2 * D2, kF32, {N2, T2, H2, D2}), bt(table.data(), kI64, {B, 16}),
          sl(lens.data(), kI64, {B}), cs(cu.data(), kI64, {B + 1}), ok(so.data(), kF32, {n2, H2, D2}),
          ov(so.data() + n2 * H2 * D2, kF32, {n2, H2, D2});
      CHECK(nvfp4kv_store(&kk.t, &vv.t, &cc.t, nullptr, &ss.t, &kscale.t, &vscale.t, NVFP4KV_RECIPE_NVFP4,
                          NVFP4KV_SCALES_LINEAR, nullptr) == NVFP4KV_SUCCESS,
            "threaded store: %s", nvfp4kv_last_error());
      CHECK(nvfp4kv_dequantize(&cc.t, nullptr, &kscale.t, &vscale.t, NVFP4KV_SCALES_LINEAR, &pk.t, &pv.t, nullptr) ==
                NVFP4KV_SUCCESS,
            "threaded dequantize: %s", nvfp4kv_last_error());
      CHECK(nvfp4kv_gather_dequant(&cc.t, nullptr, &bt.t, &sl.t, &cs.t, &kscale.t, &vscale.t, NVFP4KV_SCALES_LINEAR,
                                   &ok.t, &ov.t, nullptr) == NVFP4KV_SUCCESS,
            "threaded gather: %s", nvfp4kv_last_error());
    }
    CHECK(cache_by[0] == cache_by[1], "store: 8 threads wrote other bytes than 1");
    CHECK(memcmp(pages_by[0].data(), pages_by[1].data(), pages_by[0].size() * 4) == 0,
          "dequantize: 8 threads wrote other bytes than 1");
    CHECK(memcmp(seqs_by[0].data(), seqs_by[1].data(), seqs_by[0].size() * 4) == 0,
          "gather: 8 threads wrote other bytes than 1");
    CHECK(nvfp4kv_set_cpu_threads(0) == NVFP4KV_SUCCESS, "threads auto");
  }

  // Decode attention: an all-zero cache (every K and V value 0) gives logits 0, so out = 0 and
  // lse = log(number of positions seen); the workspace size is params.h's formula.
  {
    const int64_t dN = 4, dT = 16, dH = 2, dD = 64, dF = 36, B = 2, ql = 2, Hq = 8;
    std::vector<uint8_t> zc(dN * 2 * dT * dH * dF, 0);
    std::vector<int32_t> table = {0, 1, 3, -1}, lens = {20, 1};
    std::vector<uint16_t> q(B * ql * Hq * dD, 0x3F80), o(B * ql * Hq * dD, 0xFFFF);  // bf16 1.0, NaN
    std::vector<float> lse(B * ql * Hq, 7.0f);
    const DLDataType kBF16{kDLBfloat, 16, 1}, kI32{kDLInt, 32, 1};
    View zv(zc.data(), kU8, {dN, 2, dT, dH, dF}), tv(table.data(), kI32, {B, 2}), lv(lens.data(), kI32, {B}),
        qv(q.data(), kBF16, {B * ql, Hq, dD}), ov(o.data(), kBF16, {B * ql, Hq, dD}), sv(lse.data(), kF32, {B * ql, Hq});
    CHECK(nvfp4kv_decode_attention(&qv.t, &zv.t, nullptr, &tv.t, &lv.t, &kscale.t, &vscale.t, NVFP4KV_SCALES_LINEAR,
                                   static_cast<int32_t>(ql), 0.125f, 0.0f, -1, &ov.t, &sv.t, nullptr,
                                   nullptr) == NVFP4KV_SUCCESS,
          "decode: %s", nvfp4kv_last_error());
    bool zeros = true;
    for (uint16_t x : o) zeros = zeros && x == 0;
    CHECK(zeros, "decode: out of an all-zero cache is 0");
    // Rows: sequence 0 at positions 18, 19 (19, 20 positions), sequence 1 at -1 (none), 0 (one).
    const float want[4] = {logf(19.0f), logf(20.0f), -INFINITY, 0.0f};
    for (int r = 0; r < 4; ++r)
      for (int h = 0; h < Hq; ++h)
        CHECK(lse[r * Hq + h] == want[r], "decode: lse row %d head %d = %g, expected %g", r, h, lse[r * Hq + h],
              want[r]);
    // Rejected calls leave the outputs alone and name the argument.
    o.assign(o.size(), 0xFFFF);
    CHECK(nvfp4kv_decode_attention(&qv.t, &zv.t, nullptr, &tv.t, &lv.t, &kscale.t, &vscale.t, NVFP4KV_SCALES_LINEAR,
                                   9, 0.125f, 0.0f, -1, &ov.t, &sv.t, nullptr, nullptr) == NVFP4KV_ERROR_INVALID_VALUE &&
              std::string(nvfp4kv_last_error()).find("q_len") != std::string::npos,
          "decode: q_len 9: %s", nvfp4kv_last_error());
    CHECK(nvfp4kv_decode_attention(&qv.t, &zv.t, nullptr, &tv.t, &lv.t, &kscale.t, &vscale.t, NVFP4KV_SCALES_LINEAR,
                                   static_cast<int32_t>(ql), NAN, 0.0f, -1, &ov.t, &sv.t, nullptr, nullptr) ==
                  NVFP4KV_ERROR_INVALID_VALUE &&
              std::string(nvfp4kv_last_error()).find("sm_scale") != std::string::npos,
          "decode: sm_scale NaN: %s", nvfp4kv_last_error());
    // A workspace is checked on the CPU path too, though unused there (all but its size): a
    // CPU-tested engine meets the errors of its GPU runs. Found by review: nothing was checked.
    {
      std::vector<uint16_t> half_ws(64);
      View wv(half_ws.data(), kBF16, {64});
      DLTensor no_shape = wv.t;
      no_shape.shape = nullptr;
      View gw(zc.data(), kU8, {0});
      gw.t.device = DLDevice{kDLCUDA, 0};
      const struct {
        const DLTensor* ws;
        nvfp4kv_status want;
        const char* says;
      } cases[] = {{&wv.t, NVFP4KV_ERROR_INVALID_DTYPE, "workspace: dtype bfloat16"},
                   {&no_shape, NVFP4KV_ERROR_INVALID_VALUE, "workspace: rank 1 with a NULL shape"},
                   {&gw.t, NVFP4KV_ERROR_DEVICE_MISMATCH, "workspace: on cuda:0"}};
      for (const auto& w : cases)
        CHECK(nvfp4kv_decode_attention(&qv.t, &zv.t, nullptr, &tv.t, &lv.t, &kscale.t, &vscale.t,
                                       NVFP4KV_SCALES_LINEAR, static_cast<int32_t>(ql), 0.125f, 0.0f, -1, &ov.t,
                                       &sv.t, w.ws, nullptr) == w.want &&
                  std::string(nvfp4kv_last_error()).find(w.says) != std::string::npos,
              "decode: CPU workspace (%s): %s", w.says, nvfp4kv_last_error());
    }
    bool untouched = true;
    for (uint16_t x : o) untouched = untouched && x == 0xFFFF;
    CHECK(untouched, "decode: a rejected call wrote out");
#if defined(__GLIBC__) && (defined(__x86_64__) || defined(__aarch64__))
    // A caller with floating-point traps enabled: a subnormal scale (whose reciprocal overflows
    // on the way to its refusal) is refused, not a SIGFPE, and the caller's traps are kept. Found
    // by review. feenableexcept fails where the CPU cannot trap (many AArch64 cores): skipped.
    const int traps = FE_DIVBYZERO | FE_INVALID | FE_OVERFLOW;
    if (feenableexcept(traps) != -1) {
      ks = 1e-45f;
      CHECK(nvfp4kv_decode_attention(&qv.t, &zv.t, nullptr, &tv.t, &lv.t, &kscale.t, &vscale.t,
                                     NVFP4KV_SCALES_LINEAR, static_cast<int32_t>(ql), 0.125f, 0.0f, -1, &ov.t, &sv.t,
                                     nullptr, nullptr) == NVFP4KV_ERROR_INVALID_VALUE &&
                std::string(nvfp4kv_last_error()).find("k_scale") != std::string::npos,
            "decode with traps: subnormal k_scale: %s", nvfp4kv_last_error());
      CHECK(nvfp4kv_store(&k.t, &v.t, &c.t, nullptr, &s.t, &kscale.t, &vscale.t, NVFP4KV_RECIPE_NVFP4,
                          NVFP4KV_SCALES_LINEAR, nullptr) == NVFP4KV_ERROR_INVALID_VALUE,
            "store with traps: subnormal k_scale: %s", nvfp4kv_last_error());
      ks = 1.0f;
      CHECK(nvfp4kv_decode_attention(&qv.t, &zv.t, nullptr, &tv.t, &lv.t, &kscale.t, &vscale.t,
                                     NVFP4KV_SCALES_LINEAR, static_cast<int32_t>(ql), 0.125f, 0.0f, -1, &ov.t, &sv.t,
                                     nullptr, nullptr) == NVFP4KV_SUCCESS,
            "decode with traps: %s", nvfp4kv_last_error());
      CHECK(fegetexcept() == traps, "the caller's traps: %x, expected %x", fegetexcept(), traps);
      fedisableexcept(traps);
    }
#endif
    // A CUDA cache in a build without CUDA: NOT_SUPPORTED (before any workspace requirement).
    if (!nvfp4kv_cuda_built()) {
      View cz = zv, cq = qv, co = ov, ct = tv, cl = lv;
      for (View* x : {&cz, &cq, &co, &ct, &cl}) x->t.device = DLDevice{kDLCUDA, 0};
      CHECK(nvfp4kv_decode_attention(&cq.t, &cz.t, nullptr, &ct.t, &cl.t, &kscale.t, &vscale.t,
                                     NVFP4KV_SCALES_LINEAR, static_cast<int32_t>(ql), 0.125f, 0.0f, -1, &co.t,
                                     nullptr, nullptr, nullptr) == NVFP4KV_ERROR_NOT_SUPPORTED,
            "decode: CUDA tensors in a CPU build: %s", nvfp4kv_last_error());
    }
    size_t bytes = 1;
    CHECK(nvfp4kv_decode_workspace_size(B, static_cast<int32_t>(ql), Hq, dH, dD, 16, &bytes) == NVFP4KV_SUCCESS &&
              bytes == static_cast<size_t>(4 * B * ql * Hq * 2 * (dD + 2)),
          "decode workspace: %zu bytes", bytes);  // splits = min(ceil(512 / 4), 64, 16 / 8) = 2
    CHECK(nvfp4kv_decode_workspace_size(B, static_cast<int32_t>(ql), Hq, dH, dD, 15, &bytes) == NVFP4KV_SUCCESS &&
              bytes == 0,
          "decode workspace with 15 columns: %zu bytes", bytes);  // fewer than 8 per split: one split
    CHECK(nvfp4kv_decode_workspace_size(512, 1, 8, 1, 128, 100, &bytes) == NVFP4KV_SUCCESS && bytes == 0,
          "decode workspace of one split: %zu bytes", bytes);
    CHECK(nvfp4kv_decode_workspace_size(0, 1, int64_t{1} << 60, int64_t{1} << 60, 128, 64, &bytes) ==
                  NVFP4KV_SUCCESS && bytes == 0,
          "decode workspace of an empty batch with 2^60 heads: %s", nvfp4kv_last_error());  // found by fuzzing
    CHECK(nvfp4kv_decode_workspace_size(1, 1, 8, 2, 128, 3, nullptr) == NVFP4KV_ERROR_INVALID_VALUE,
          "decode workspace: NULL bytes");
    CHECK(nvfp4kv_decode_workspace_size(1, 1, 8, 2, 96, 3, &bytes) == NVFP4KV_ERROR_INVALID_VALUE,
          "decode workspace: head size 96");
  }

  // A byte_offset or strides that put elements past the address space describe no memory: refused
  // before anything is read or written (found by review: a byte_offset of 2^64 - 4 wrapped to the
  // bytes before the buffer and the store wrote there; strides of 2^61 overflowed the overlap
  // check's arithmetic and crashed amax).
  {
    std::vector<uint8_t> guard(cache.size(), 0xA5);
    View gc(guard.data(), kU8, {N, 2, T, H, F});
    gc.t.byte_offset = ~uint64_t{0} - 3;
    CHECK(nvfp4kv_store(&k.t, &v.t, &gc.t, nullptr, &s.t, &kscale.t, &vscale.t, NVFP4KV_RECIPE_NVFP4,
                        NVFP4KV_SCALES_LINEAR, nullptr) == NVFP4KV_ERROR_INVALID_VALUE &&
              std::string(nvfp4kv_last_error()).find("past the address space") != std::string::npos,
          "byte_offset 2^64 - 4: %s", nvfp4kv_last_error());
    gc.t.byte_offset = 0;
    int64_t huge[3] = {int64_t{1} << 61, D, 1};
    View hk(key.data(), kF32, {n, H, D});
    hk.t.strides = huge;
    CHECK(nvfp4kv_store(&hk.t, &v.t, &gc.t, nullptr, &s.t, &kscale.t, &vscale.t, NVFP4KV_RECIPE_NVFP4,
                        NVFP4KV_SCALES_LINEAR, nullptr) == NVFP4KV_ERROR_INVALID_VALUE &&
              std::string(nvfp4kv_last_error()).find("key: shape (3, 2, 32) with strides") != std::string::npos,
          "key strides 2^61: %s", nvfp4kv_last_error());
    int64_t neg[3] = {-(int64_t{1} << 50), D, 1};  // token 2 would lie 2^53 bytes below: under address 0
    hk.t.strides = neg;
    CHECK(nvfp4kv_store(&hk.t, &v.t, &gc.t, nullptr, &s.t, &kscale.t, &vscale.t, NVFP4KV_RECIPE_NVFP4,
                        NVFP4KV_SCALES_LINEAR, nullptr) == NVFP4KV_ERROR_INVALID_VALUE,
          "key strides -2^50: %s", nvfp4kv_last_error());
    bool untouched = true;
    for (uint8_t x : guard) untouched = untouched && x == 0xA5;
    CHECK(untouched, "a refused layout wrote the cache");
    float a = 0.0f;
    int64_t amax_huge[1] = {int64_t{1} << 61};
    View xh(key.data(), kF32, {2}), ah(&a, kF32, {1});
    xh.t.strides = amax_huge;
    CHECK(nvfp4kv_amax(&xh.t, &ah.t, 0, nullptr) == NVFP4KV_ERROR_INVALID_VALUE, "amax, stride 2^61: %s",
          nvfp4kv_last_error());
  }

  // amax: max |x| over any strides, NaN sticky, accumulate, empty inputs, rejected arguments.
  {
    std::vector<float> xs = {0.5f, -3.0f, 2.0f, 7.0f, -1.0f, 0.25f};  // (2, 3)
    float a = -1.0f;
    View xv(xs.data(), kF32, {2, 3}), av(&a, kF32, {1});
    CHECK(nvfp4kv_amax(&xv.t, &av.t, 0, nullptr) == NVFP4KV_SUCCESS && a == 7.0f, "amax %g: %s", a, nvfp4kv_last_error());
    // Column 1 only, through strides (3,) with shape (2,): |-3|, |-1|.
    int64_t col_stride[1] = {3};
    View cv(xs.data() + 1, kF32, {2});
    cv.t.strides = col_stride;
    CHECK(nvfp4kv_amax(&cv.t, &av.t, 0, nullptr) == NVFP4KV_SUCCESS && a == 3.0f, "column amax %g", a);
    CHECK(nvfp4kv_amax(&xv.t, &av.t, 1, nullptr) == NVFP4KV_SUCCESS && a == 7.0f, "accumulated amax %g", a);
    a = 9.0f;
    CHECK(nvfp4kv_amax(&xv.t, &av.t, 1, nullptr) == NVFP4KV_SUCCESS && a == 9.0f, "accumulate keeps %g", a);
    View ev(xs.data(), kF32, {0, 3});
    CHECK(nvfp4kv_amax(&ev.t, &av.t, 1, nullptr) == NVFP4KV_SUCCESS && a == 9.0f, "empty, accumulate: %g", a);
    CHECK(nvfp4kv_amax(&ev.t, &av.t, 0, nullptr) == NVFP4KV_SUCCESS && a == 0.0f, "empty: %g", a);
    // An empty tensor's byte_offset addresses nothing and is not checked; its address is formed in
    // integers (a C ABI fuzzer's UBSan report: a pointer overflow at 2^63; CI runs this file under
    // UBSan without recovery).
    ev.t.byte_offset = uint64_t{1} << 63;
    CHECK(nvfp4kv_amax(&ev.t, &av.t, 0, nullptr) == NVFP4KV_SUCCESS && a == 0.0f, "empty at 2^63: %s",
          nvfp4kv_last_error());
    ev.t.byte_offset = 0;
    xs[4] = NAN;
    uint32_t bits = 0;
    CHECK(nvfp4kv_amax(&xv.t, &av.t, 0, nullptr) == NVFP4KV_SUCCESS && (memcpy(&bits, &a, 4), bits == 0x7FC00000u),
          "NaN amax bits %08x", bits);
    xs[4] = -1.0f;
    CHECK(nvfp4kv_amax(&xv.t, &av.t, 1, nullptr) == NVFP4KV_SUCCESS && isnan(a), "NaN is sticky: %g", a);
    // float16 input: 0x4A00 = 12, 0xFC00 = -inf.
    std::vector<uint16_t> hs = {0x3C00, 0xCA00, 0x0001};
    View hv(hs.data(), DLDataType{kDLFloat, 16, 1}, {3});
    CHECK(nvfp4kv_amax(&hv.t, &av.t, 0, nullptr) == NVFP4KV_SUCCESS && a == 12.0f, "f16 amax %g", a);
    hs[2] = 0xFC00;
    CHECK(nvfp4kv_amax(&hv.t, &av.t, 0, nullptr) == NVFP4KV_SUCCESS && isinf(a) && a > 0, "f16 inf amax %g", a);
    // Two threads accumulating into one out: every update lands (found by review: the CPU path
    // read, then wrote, out, and lost updates; ThreadSanitizer, which CI runs this under, reports
    // that race at once). Thread t feeds the values 2i + t, i < 2000: out ends at 3999.
    {
      float shared = 0.0f;
      std::vector<std::thread> feeders;
      for (int t = 0; t < 2; ++t)
        feeders.emplace_back([&shared, t] {
          float v = 0.0f;
          View vv(&v, kF32, {1}), sv(&shared, kF32, {1});
          for (int i = 0; i < 2000; ++i) {
            v = static_cast<float>(2 * i + t);
            if (nvfp4kv_amax(&vv.t, &sv.t, 1, nullptr) != NVFP4KV_SUCCESS) return;
          }
        });
      for (std::thread& f : feeders) f.join();
      CHECK(shared == 3999.0f, "two threads accumulating: %g, expected 3999", shared);
    }
    // Rejected: names the argument.
    View a64(xs.data(), kF64, {1});
    CHECK(nvfp4kv_amax(&xv.t, &a64.t, 0, nullptr) == NVFP4KV_ERROR_INVALID_DTYPE && strstr(nvfp4kv_last_error(), "out: dtype float64"),
          "%s", nvfp4kv_last_error());
    View a2(xs.data(), kF32, {2});
    CHECK(nvfp4kv_amax(&xv.t, &a2.t, 0, nullptr) == NVFP4KV_ERROR_INVALID_VALUE && strstr(nvfp4kv_last_error(), "out: shape"),
          "%s", nvfp4kv_last_error());
    View xi(slots.data(), kI64, {3});
    CHECK(nvfp4kv_amax(&xi.t, &av.t, 0, nullptr) == NVFP4KV_ERROR_INVALID_DTYPE && strstr(nvfp4kv_last_error(), "x:"),
          "%s", nvfp4kv_last_error());
    // The narrow floats are named, not given as a bare DLPack code.
    View x8(xs.data(), DLDataType{kDLFloat8_e4m3fn, 8, 1}, {4});
    CHECK(nvfp4kv_amax(&x8.t, &av.t, 0, nullptr) == NVFP4KV_ERROR_INVALID_DTYPE &&
              strstr(nvfp4kv_last_error(), "x: dtype float8_e4m3fn received"), "%s", nvfp4kv_last_error());
    CHECK(nvfp4kv_amax(&xv.t, &av.t, 2, nullptr) == NVFP4KV_ERROR_INVALID_VALUE &&
              strstr(nvfp4kv_last_error(), "accumulate"), "%s", nvfp4kv_last_error());
    View inside(xs.data() + 2, kF32, {1});
    CHECK(nvfp4kv_amax(&xv.t, &inside.t, 0, nullptr) == NVFP4KV_ERROR_INVALID_VALUE &&
              strstr(nvfp4kv_last_error(), "shares memory"), "%s", nvfp4kv_last_error());
    CHECK(nvfp4kv_amax(nullptr, &av.t, 0, nullptr) == NVFP4KV_ERROR_INVALID_VALUE, "NULL x");
    // Pinned host memory (kDLCUDAHost) runs the CPU path, x and amax alike.
    View px = xv, pa = av;
    px.t.device = pa.t.device = DLDevice{kDLCUDAHost, 0};
    CHECK(nvfp4kv_amax(&px.t, &pa.t, 0, nullptr) == NVFP4KV_SUCCESS && a == 7.0f, "pinned amax %g: %s", a,
          nvfp4kv_last_error());
    if (!nvfp4kv_cuda_built()) {
      View gx = xv, ga = av;
      gx.t.device = ga.t.device = DLDevice{kDLCUDA, 0};
      CHECK(nvfp4kv_amax(&gx.t, &ga.t, 0, nullptr) == NVFP4KV_ERROR_NOT_SUPPORTED, "%s", nvfp4kv_last_error());
    }
    // Managed memory is neither host nor device memory to the ABI (docs/c-api.md): refused in
    // every build, nothing written.
    View mx = xv, ma = av;
    mx.t.device = ma.t.device = DLDevice{kDLCUDAManaged, 0};
    a = -1.0f;
    CHECK(nvfp4kv_amax(&mx.t, &ma.t, 0, nullptr) == NVFP4KV_ERROR_NOT_SUPPORTED &&
              strstr(nvfp4kv_last_error(), "cuda_managed") && a == -1.0f,
          "managed amax %g: %s", a, nvfp4kv_last_error());
  }

  concurrent_callers();

  if (g_failures) {
    fprintf(stderr, "test_capi: %d failures\n", g_failures);
    return 1;
  }
  printf("test_capi: all checks passed\n");
  return 0;
}
