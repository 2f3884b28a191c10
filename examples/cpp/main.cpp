// Quantize a small batch of K/V into an NVFP4 paged cache on the CPU through the C ABI, check
// the bytes against values worked out by hand from FORMAT.md, and read the cache back. Then what
// an engine's decode step does: attention of one query token over a sequence's pages
// (nvfp4kv_decode_attention), checked against attention computed here from the cache's values.
//
// Geometry: 2 pages of 4 tokens, 2 KV heads, head size 16 (one group of 16 per row, so a row is
// F = 16/2 + 16/16 = 9 bytes), cache (N, 2, T, H, F) contiguous = NHD, linear scales. The decode
// step uses head size 64 (the reader takes 64, 128 and 256).
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "nvfp4kv/nvfp4kv.h"

namespace {

constexpr int64_t N = 2, T = 4, H = 2, D = 16, F = D / 2 + D / 16;
constexpr int64_t kSide = T * H * F;  // bytes of one side (K or V) of a page

// The E2M1 grid: code c (0..7) has value kGrid[c]. Element 2k of a group goes to the low nibble.
constexpr float kGrid[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

int g_failures = 0;

void check(bool ok, const char* what) {
  std::fflush(stdout);
  if (!ok) {
    std::fprintf(stderr, "FAILED: %s\n", what);
    ++g_failures;
  }
}

DLTensor view(void* data, DLDataTypeCode code, int bits, int ndim, int64_t* shape) {
  DLTensor t;
  std::memset(&t, 0, sizeof t);
  t.data = data;
  t.device.device_type = kDLCPU;
  t.ndim = ndim;
  t.shape = shape;
  t.strides = nullptr;  // contiguous
  t.dtype.code = static_cast<uint8_t>(code);
  t.dtype.bits = static_cast<uint8_t>(bits);
  t.dtype.lanes = 1;
  return t;
}

// bfloat16 from float, rounded to nearest even (finite values), and back.
uint16_t to_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

float from_bf16(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

// One decode step: a sequence of L = 6 tokens in pages {1, 0} of a 2-page cache (block table
// order, not page order), 4 query heads over 2 KV heads (GQA group 2), head size 64.
bool decode_step() {
  constexpr int64_t Nd = 2, Td = 4, Hd = 2, Dd = 64, Hq = 4, L = 6;
  size_t page_bytes = 0, row_bytes = 0;
  if (nvfp4kv_page_bytes(Td, Hd, Dd, Dd, &page_bytes, &row_bytes) != NVFP4KV_SUCCESS) return false;
  std::vector<uint8_t> cache(Nd * page_bytes, 0);
  int64_t cache_shape[5] = {Nd, 2, Td, Hd, static_cast<int64_t>(row_bytes)};

  // Store the sequence's keys and values: token t goes to block t / Td of the table, position
  // t % Td, so its slot is table[t / Td] * Td + t % Td.
  int32_t table[2] = {1, 0};
  std::vector<float> key(L * Hd * Dd), value(L * Hd * Dd);
  for (size_t i = 0; i < key.size(); ++i) {
    key[i] = std::sin(0.37f * static_cast<float>(i));
    value[i] = std::cos(0.11f * static_cast<float>(i));
  }
  std::vector<int64_t> slots(L);
  for (int64_t t = 0; t < L; ++t) slots[t] = table[t / Td] * Td + t % Td;
  float one = 1.0f;
  int64_t kv_shape[3] = {L, Hd, Dd}, slot_shape[1] = {L}, scale_shape[1] = {1};
  DLTensor k = view(key.data(), kDLFloat, 32, 3, kv_shape), v = view(value.data(), kDLFloat, 32, 3, kv_shape);
  DLTensor c = view(cache.data(), kDLUInt, 8, 5, cache_shape), s = view(slots.data(), kDLInt, 64, 1, slot_shape);
  DLTensor g = view(&one, kDLFloat, 32, 1, scale_shape);
  nvfp4kv_status st = nvfp4kv_store(&k, &v, &c, nullptr, &s, &g, &g, NVFP4KV_RECIPE_NVFP4,
                                    NVFP4KV_SCALES_LINEAR, nullptr);
  if (st != NVFP4KV_SUCCESS) {
    std::fprintf(stderr, "decode step, nvfp4kv_store: %s\n", nvfp4kv_last_error());
    return false;
  }

  // The query (bf16, the last token's), the lengths and the output.
  std::vector<uint16_t> query(Hq * Dd), out(Hq * Dd);
  for (int64_t i = 0; i < Hq * Dd; ++i) query[i] = to_bf16(std::sin(0.05f * static_cast<float>(i) + 1.0f));
  int32_t seq_lens[1] = {L};
  int64_t q_shape[3] = {1, Hq, Dd}, table_shape[2] = {1, 2}, lens_shape[1] = {1};
  DLTensor q = view(query.data(), kDLBfloat, 16, 3, q_shape), o = view(out.data(), kDLBfloat, 16, 3, q_shape);
  DLTensor bt = view(table, kDLInt, 32, 2, table_shape), sl = view(seq_lens, kDLInt, 32, 1, lens_shape);
  const float sm_scale = 1.0f / std::sqrt(static_cast<float>(Dd));
  // On the CPU no workspace is needed; on a GPU, nvfp4kv_decode_workspace_size says how much.
  st = nvfp4kv_decode_attention(&q, &c, nullptr, &bt, &sl, &g, &g, NVFP4KV_SCALES_LINEAR, 1, sm_scale,
                                0.0f, -1, &o, nullptr, nullptr, nullptr);
  if (st != NVFP4KV_SUCCESS) {
    std::fprintf(stderr, "nvfp4kv_decode_attention: %s\n", nvfp4kv_last_error());
    return false;
  }

  // The same attention in double over the cache's values (nvfp4kv_dequantize, page by page).
  std::vector<float> kd(Nd * Td * Hd * Dd), vd(Nd * Td * Hd * Dd);
  int64_t deq_shape[4] = {Nd, Td, Hd, Dd};
  DLTensor ko = view(kd.data(), kDLFloat, 32, 4, deq_shape), vo = view(vd.data(), kDLFloat, 32, 4, deq_shape);
  if (nvfp4kv_dequantize(&c, nullptr, &g, &g, NVFP4KV_SCALES_LINEAR, &ko, &vo, nullptr) != NVFP4KV_SUCCESS) return false;
  double err = 0.0, norm = 0.0;
  for (int64_t hq = 0; hq < Hq; ++hq) {
    const int64_t h = hq / (Hq / Hd);
    std::vector<double> w(L);
    double wmax = -1e300, wsum = 0.0;
    for (int64_t t = 0; t < L; ++t) {
      const float* kr = kd.data() + (slots[t] * Hd + h) * Dd;  // (page, position) flattened = slot
      double dot = 0.0;
      for (int64_t e = 0; e < Dd; ++e) dot += from_bf16(query[hq * Dd + e]) * static_cast<double>(kr[e]);
      w[t] = dot * sm_scale;
      wmax = std::fmax(wmax, w[t]);
    }
    for (int64_t t = 0; t < L; ++t) wsum += (w[t] = std::exp(w[t] - wmax));
    for (int64_t e = 0; e < Dd; ++e) {
      double ref = 0.0;
      for (int64_t t = 0; t < L; ++t) ref += w[t] / wsum * vd[(slots[t] * Hd + h) * Dd + e];
      const double d = from_bf16(out[hq * Dd + e]) - ref;
      err += d * d;
      norm += ref * ref;
    }
  }
  const double rel = std::sqrt(err / norm);
  std::printf("decode step: %lld tokens in pages {1, 0}, %lld query heads: relative L2 error %.2e "
              "against double attention over the cache (bf16 output)\n",
              static_cast<long long>(L), static_cast<long long>(Hq), rel);
  return rel < 4e-3;
}

}  // namespace

int main() {
  std::printf("nvfp4kv %s (header %d.%d.%d), CUDA kernels %s\n", nvfp4kv_version_string(),
              NVFP4KV_VERSION_MAJOR, NVFP4KV_VERSION_MINOR, NVFP4KV_VERSION_PATCH,
              nvfp4kv_cuda_built() ? "built" : "not built");
  check(NVFP4KV_VERSION_COMPATIBLE(nvfp4kv_version()), "the loaded library serves this header (same MAJOR.MINOR, no older patch)");

  // Three tokens; token 1 is padding (slot -1). Token 0 -> page 1, position 1; token 2 -> page 0,
  // position 2. Every group is the grid {0, .5, 1, 1.5, 2, 3, 4, 6, 0, -.5, -1, ..., -6} times m:
  // amax = 6m, so with global scale 1 the group scale is m and the codes are the grid's.
  const int64_t n = 3;
  int64_t slots[n] = {N * T - 3, -1, 2};
  const float k_mult[n][H] = {{1.0f, 2.0f}, {5.0f, 5.0f}, {3.0f, 4.0f}};
  const float v_mult[n][H] = {{0.5f, 1.0f}, {5.0f, 5.0f}, {1.5f, 2.0f}};
  std::vector<float> key(n * H * D), value(n * H * D);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < D; ++i) {
        const float g = i <= 8 ? kGrid[i % 8] : -kGrid[i % 8];  // +0 at i = 8, not -0
        key[(t * H + h) * D + i] = g * k_mult[t][h];
        value[(t * H + h) * D + i] = g * v_mult[t][h];
      }
  // The library sizes the pages (an engine allocating its own cache asks the same way).
  size_t page_bytes = 0;
  if (nvfp4kv_page_bytes(T, H, D, D, &page_bytes, nullptr) != NVFP4KV_SUCCESS || page_bytes != 2 * kSide) {
    std::fprintf(stderr, "nvfp4kv_page_bytes: %zu bytes (%s)\n", page_bytes, nvfp4kv_last_error());
    return 1;
  }
  std::vector<uint8_t> cache(N * page_bytes, 0xA5);  // poison: bytes not written stay 0xA5
  float k_scale = 1.0f, v_scale = 1.0f;

  int64_t kv_shape[3] = {n, H, D}, cache_shape[5] = {N, 2, T, H, F}, slot_shape[1] = {n},
          scale_shape[1] = {1};
  DLTensor k = view(key.data(), kDLFloat, 32, 3, kv_shape);
  DLTensor v = view(value.data(), kDLFloat, 32, 3, kv_shape);
  DLTensor c = view(cache.data(), kDLUInt, 8, 5, cache_shape);
  DLTensor s = view(slots, kDLInt, 64, 1, slot_shape);
  DLTensor ks = view(&k_scale, kDLFloat, 32, 1, scale_shape);
  DLTensor vs = view(&v_scale, kDLFloat, 32, 1, scale_shape);

  nvfp4kv_status st = nvfp4kv_store(&k, &v, &c, nullptr, &s, &ks, &vs, NVFP4KV_RECIPE_NVFP4,
                                    NVFP4KV_SCALES_LINEAR, nullptr);
  if (st != NVFP4KV_SUCCESS) {
    std::fprintf(stderr, "nvfp4kv_store: %s: %s\n", nvfp4kv_status_string(st),
                 nvfp4kv_last_error());
    return 1;
  }

  // Expected bytes, by hand. Codes: 0->0, .5->1, 1->2, 1.5->3, 2->4, 3->5, 4->6, 6->7, sign bit 8.
  const uint8_t codes[8] = {0x10, 0x32, 0x54, 0x76, 0x90, 0xBA, 0xDC, 0xFE};
  // E4M3 scale bytes (bias 7): 0.5 = 0x30, 1 = 0x38, 1.5 = 0x3C, 2 = 0x40, 3 = 0x44, 4 = 0x48.
  const uint8_t k_sf[n][H] = {{0x38, 0x40}, {0, 0}, {0x44, 0x48}};
  const uint8_t v_sf[n][H] = {{0x30, 0x38}, {0, 0}, {0x3C, 0x40}};
  std::vector<uint8_t> want(cache.size(), 0xA5);
  for (int64_t t = 0; t < n; ++t) {
    if (slots[t] < 0) continue;
    const int64_t page = slots[t] / T, pos = slots[t] % T;
    for (int64_t side = 0; side < 2; ++side) {
      uint8_t* base = want.data() + (page * 2 + side) * kSide;
      for (int64_t h = 0; h < H; ++h) {
        const int64_t row = pos * H + h;  // NHD: rows in (token, head) order
        std::memcpy(base + row * D / 2, codes, 8);               // packed data first,
        base[T * H * D / 2 + row] = side ? v_sf[t][h] : k_sf[t][h];  // then one scale per row
      }
    }
  }
  check(cache == want, "cache bytes equal the hand-computed bytes (and nothing else was written)");
  if (cache != want) {
    for (size_t i = 0; i < cache.size(); ++i)
      if (cache[i] != want[i])
        std::fprintf(stderr, "  byte %zu: got 0x%02X, want 0x%02X\n", i, cache[i], want[i]);
  }
  const size_t page1_k = (1 * 2 + 0) * kSide + 1 * H * D / 2;
  std::printf("token 0, head 0 -> page 1 row 2: data %02X %02X %02X %02X %02X %02X %02X %02X, "
              "scale %02X\n",
              cache[page1_k], cache[page1_k + 1], cache[page1_k + 2], cache[page1_k + 3],
              cache[page1_k + 4], cache[page1_k + 5], cache[page1_k + 6], cache[page1_k + 7],
              cache[(1 * 2 + 0) * kSide + T * H * D / 2 + 1 * H]);

  // Read every page back: the stored rows must come back exactly (all values are on the grid).
  std::vector<float> k_out(N * T * H * D, -1.0f), v_out(N * T * H * D, -1.0f);
  int64_t out_shape[4] = {N, T, H, D};
  DLTensor ko = view(k_out.data(), kDLFloat, 32, 4, out_shape);
  DLTensor vo = view(v_out.data(), kDLFloat, 32, 4, out_shape);
  st = nvfp4kv_dequantize(&c, nullptr, &ks, &vs, NVFP4KV_SCALES_LINEAR, &ko, &vo, nullptr);
  if (st != NVFP4KV_SUCCESS) {
    std::fprintf(stderr, "nvfp4kv_dequantize: %s: %s\n", nvfp4kv_status_string(st),
                 nvfp4kv_last_error());
    return 1;
  }
  bool exact = true;
  for (int64_t t = 0; t < n; ++t) {
    if (slots[t] < 0) continue;
    const float* got_k = k_out.data() + slots[t] * H * D;  // (page, pos) flattened = slot
    const float* got_v = v_out.data() + slots[t] * H * D;
    exact &= std::memcmp(got_k, key.data() + t * H * D, H * D * sizeof(float)) == 0;
    exact &= std::memcmp(got_v, value.data() + t * H * D, H * D * sizeof(float)) == 0;
  }
  check(exact, "dequantized rows equal the stored K/V exactly");

  // A rejected call names the problem and leaves the cache untouched.
  float bad_scale = 0.0f;
  DLTensor bad = view(&bad_scale, kDLFloat, 32, 1, scale_shape);
  const std::vector<uint8_t> before = cache;
  st = nvfp4kv_store(&k, &v, &c, nullptr, &s, &bad, &vs, NVFP4KV_RECIPE_NVFP4,
                     NVFP4KV_SCALES_LINEAR, nullptr);
  check(st == NVFP4KV_ERROR_INVALID_VALUE && cache == before, "k_scale = 0 rejected, cache intact");
  std::printf("k_scale = 0 -> %s: %s\n", nvfp4kv_status_string(st), nvfp4kv_last_error());

  check(decode_step(), "decode attention over the cache agrees with attention in double");

  if (g_failures) {
    std::fprintf(stderr, "%d check(s) failed\n", g_failures);
    return 1;
  }
  std::printf("OK: %zu cache bytes as computed by hand; round trip exact; decode step agrees\n", cache.size());
  return 0;
}
