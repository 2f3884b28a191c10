// Decode attention on the CPU (nvfp4kv_decode_attention): fp32 math in a fixed order, the
// reference the CUDA kernel is tested against. Each (sequence, KV head) is one unit of work, done
// whole by one thread: the bytes do not depend on the thread count.
//
// Per unit, the rows r = i * group + g (query row i, query head h * group + g) share every K and
// V row read. One pass over the tokens, in increasing position, a chunk at a time: each chunk's K
// and V rows are decoded once, each row's logits computed, and the row's running maximum m raised
// to the chunk's largest logit where that exceeds m by more than kSlack, its sums rescaled by
// exp(m_old - m) (design notes: "Decode attention on the CPU: one pass"); then p_j = exp(l_j - m)
// and p_j * v_j are summed. Each query row is scaled by a power of two as the CUDA reader scales
// it, so that its dot products cannot overflow where its logits do not (same note).
// Memory stays bounded by a chunk of tokens whatever the sequence lengths. The sums run in three
// levels (design notes: "Decode attention on the CPU: sums in three levels").
#include <math.h>

#include <algorithm>
#include <vector>

#include "backend.h"
#include "cpu/shares.h"

namespace nvfp4kv {
namespace {

constexpr int64_t kChunk = 64;  // positions dequantized at a time, across pages
constexpr int kMaxRows = 8 * 16;
// The sums' levels: each row's terms of a chunk (kChunk positions), then up to kFold such partials,
// then the sequence; a sum of n terms in one fp32 accumulator drifts by up to n units in its
// last place (2^20 positions: lse 1.4e-3 off the fp64 reference), in levels by about
// kChunk + kFold + n / (kChunk * kFold).
constexpr int kFold = 64;
// A row's maximum moves only where a chunk's largest logit exceeds it by more than this (natural
// log of params.h's slack): each move rounds every sum it rescales, and a maximum rising a little
// in every chunk compounded those roundings in lse (1.8e-4 over 2^20 positions; review).
constexpr float kSlack = kDecodeSlackLog2 * 0.6931471805599453f;

template <DType kDType>
inline float load_q(const void* base, int64_t idx) {
  const uint16_t h = static_cast<const uint16_t*>(base)[idx];
  return kDType == DType::kFloat16 ? f16_to_float(h) : bf16_to_float(h);
}

template <DType kDType>
inline void store_o(void* base, int64_t idx, float v) {
  static_cast<uint16_t*>(base)[idx] = kDType == DType::kFloat16 ? float_to_f16(v) : float_to_bf16(v);
}

// The two e2m1 values of each code byte (low nibble first): one load per byte instead of the
// decoder's bit operations per nibble, which were most of this reader's time.
struct CodePair {
  float lo, hi;
};
struct CodePairs {
  CodePair v[256];
  CodePairs() {
    for (uint32_t b = 0; b < 256; ++b) v[b] = CodePair{e2m1_decode(b & 0xFu), e2m1_decode(b >> 4)};
  }
};
const CodePairs kCodePairs;

// Raw values e2m1 * e4m3 of row (h, t) of one side of one page (NaN for a NaN group), element d
// at y[d * stride]: dequantize_group's values with a global scale of 1 (its last product is then
// exact), from the format core's two decoders, a byte at a time (the NaN bits may differ from
// nan_group's: only the math reads them).
void raw_row(const CacheSide& s, const uint8_t* side, int64_t h, int64_t t, int32_t H, int32_t T, Layout layout,
             float* y, int64_t stride) {
  const int64_t D = s.D;
  const int64_t row = row_index(layout, h, t, H, T);
  const uint8_t* data = side + data_offset(row, D);
  for (int64_t g16 = 0; g16 < D / kGroupSize; ++g16) {
    const int64_t soff = s.interleaved ? scale_offset_interleaved(h, t, g16, T, H, D)
                                       : scale_offset_linear(row, g16, H, T, D);
    float* out = y + g16 * kGroupSize * stride;
    const float sf = e4m3_decode(side[soff]);  // NaN for a NaN group's byte: its 16 products are NaN
    const uint8_t* codes = data + 8 * g16;  // element 2b in byte b's low nibble, 2b + 1 in its high
    for (int b = 0; b < 8; ++b) {
      const CodePair& c = kCodePairs.v[codes[b]];
      out[(2 * b) * stride] = mul_rn(c.lo, sf);
      out[(2 * b + 1) * stride] = mul_rn(c.hi, sf);
    }
  }
}

// The positions [lo, hi] (inclusive; empty when lo > hi) that query row i of a sequence of `len`
// tokens sees, before masking by the block table; `cap` = max_blocks * T bounds them (positions
// past the block table have no page).
struct Range {
  int64_t lo, hi;
};

Range row_range(const DecodeParams& p, int64_t len, int64_t i, int64_t cap) {
  if (len <= 0) return Range{0, -1};
  const int64_t pos = len - p.q_len + i;  // len > 0, q_len <= 8: no overflow
  if (pos < 0) return Range{0, -1};
  const int64_t lo = p.window_left >= 0 && pos > p.window_left ? pos - p.window_left : 0;
  const int64_t hi = pos < cap - 1 ? pos : cap - 1;
  return Range{lo, hi};
}

// One thread's buffers.
struct Scratch {
  std::vector<float> q;         // [rows][D]
  std::vector<float> kt, v;     // [D][kChunk]: the chunk's K transposed, [kChunk][Dv]
  std::vector<float> logits;    // [rows][kChunk]
  std::vector<int64_t> pos;     // [kChunk]: the chunk's positions, increasing
  std::vector<float> acc[3];    // [rows][Dv]: the sums of p_j * v_j, by level
  Scratch(const DecodeParams& p, int rows)
      : q(static_cast<size_t>(rows) * p.k.D),
        kt(static_cast<size_t>(kChunk) * p.k.D), v(static_cast<size_t>(kChunk) * p.v.D),
        logits(static_cast<size_t>(rows) * kChunk), pos(kChunk) {
    for (auto& a : acc) a.resize(static_cast<size_t>(rows) * p.v.D);
  }
};

template <DType kDType>
void decode_unit(const DecodeParams& p, int64_t b, int64_t h, float logit_scale, float v_scale, int64_t cap,
                 Scratch& s) {
  const int64_t D = p.k.D, Dv = p.v.D, G = p.group, R = p.q_len * G;
  const int64_t len = load_index(p.seq_lens, b);
  const IndexVec bt_row = block_table_row(p, b);
  Range range[kMaxRows];
  float m[kMaxRows], sum[3][kMaxRows];  // the sums of p_j, by level, as acc
  double factor[kMaxRows];              // logit_scale times the row's 2^-k, exact (params.h)
  for (int64_t i = 0; i < p.q_len; ++i) {
    const Range ri = row_range(p, len, i, cap);
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = i * G + g;
      range[r] = ri;
      m[r] = -INFINITY;
      const int64_t qrow = (b * p.q_len + i) * p.q_stride[0] + (h * G + g) * p.q_stride[1];
      float* q = &s.q[r * D];
      float mx = 0.0f;
      for (int64_t d = 0; d < D; ++d) {
        q[d] = load_q<kDType>(p.query, qrow + d);
        mx = fmaxf(mx, fabsf(q[d]));  // a NaN element leaves it (it reaches the logits anyway)
      }
      const int k = decode_query_exp(mx);  // as every CUDA reader scales its query rows
      const float up = pow2f(k);
      for (int64_t d = 0; d < D; ++d) q[d] = mul_rn(q[d], up);
      factor[r] = static_cast<double>(logit_scale) * static_cast<double>(pow2f(-k));
      for (int level = 0; level < 3; ++level) {
        sum[level][r] = 0.0f;
        for (int64_t d = 0; d < Dv; ++d) s.acc[level][r * Dv + d] = 0.0f;
      }
    }
  }
  // Positions any row sees: rows' ranges move forward with i.
  int64_t lo = INT64_MAX, hi = -1;
  for (int64_t r = 0; r < R; ++r)
    if (range[r].lo <= range[r].hi) {
      lo = std::min(lo, range[r].lo);
      hi = std::max(hi, range[r].hi);
    }

  // Row r's logits of the chunk's n positions. Each is the sum over d in increasing order, as
  // one position at a time would add it; the positions are independent chains, so the inner loop
  // runs across them (vectorized) instead of waiting on one chain's adds.
  const auto logits = [&](int64_t r, int64_t n) {
    float* l = &s.logits[r * kChunk];
    const float* q = &s.q[r * D];
    for (int64_t i = 0; i < n; ++i) l[i] = 0.0f;
    for (int64_t d = 0; d < D; ++d) {
      const float qd = q[d];
      const float* k = &s.kt[d * kChunk];
      for (int64_t i = 0; i < n; ++i) l[i] = add_rn(l[i], mul_rn(qd, k[i]));
    }
    for (int64_t i = 0; i < n; ++i) {
      l[i] = static_cast<float>(static_cast<double>(l[i]) * factor[r]);  // rounded once
      if (p.soft_cap > 0.0f) l[i] = mul_rn(p.soft_cap, tanhf(l[i] / p.soft_cap));
    }
  };
  // Adds level `from`'s partials into the next level and clears them, every row alike.
  const auto fold = [&](int from) {
    for (int64_t r = 0; r < R; ++r) {
      sum[from + 1][r] = add_rn(sum[from + 1][r], sum[from][r]);
      sum[from][r] = 0.0f;
      float* a = &s.acc[from][r * Dv];
      float* z = &s.acc[from + 1][r * Dv];
      for (int64_t d = 0; d < Dv; ++d) {
        z[d] = add_rn(z[d], a[d]);
        a[d] = 0.0f;
      }
    }
  };
  // Multiplies every level of row r's sums by a (its maximum rose).
  const auto rescale = [&](int64_t r, float a) {
    for (int level = 0; level < 3; ++level) {
      sum[level][r] = mul_rn(sum[level][r], a);
      float* acc = &s.acc[level][r * Dv];
      for (int64_t d = 0; d < Dv; ++d) acc[d] = mul_rn(acc[d], a);
    }
  };
  int folds = 0;  // level-0 partials in level 1

  for (int64_t j = lo; j <= hi;) {
    // The next chunk: up to kChunk positions, in increasing order, of pages that the block
    // table names (a masked page is skipped, never read).
    int64_t n = 0;
    while (n < kChunk && j <= hi) {
      const int64_t blk = j / p.T, page = load_index(bt_row, blk);
      if (page < 0 || page >= p.N) {
        // The next block's first position, or past hi: hi lies within T of INT64_MAX where the
        // block table's positions pass it (a broadcast table; review: (blk + 1) * T wrapped and
        // the loop walked ~2^62 masked blocks).
        j = blk < hi / p.T ? (blk + 1) * p.T : hi + 1;
        continue;
      }
      const uint8_t* kside = p.k.base + page * p.k.page_stride;
      const uint8_t* vside = p.v.base + page * p.v.page_stride;
      const int64_t t_end = std::min<int64_t>(p.T, hi - blk * p.T + 1);
      for (int64_t t = j - blk * p.T; t < t_end && n < kChunk; ++t, ++j, ++n) {
        s.pos[n] = j;
        raw_row(p.k, kside, h, t, p.H, p.T, p.layout, &s.kt[n], kChunk);  // column n of kt
        raw_row(p.v, vside, h, t, p.H, p.T, p.layout, &s.v[n * Dv], 1);
      }
    }
    if (n == 0) break;
    for (int64_t r = 0; r < R; ++r) {
      if (range[r].lo > s.pos[n - 1] || range[r].hi < s.pos[0]) continue;
      logits(r, n);
      const float* l = &s.logits[r * kChunk];
      const bool whole = range[r].lo <= s.pos[0] && s.pos[n - 1] <= range[r].hi;
      const auto sees = [&](int64_t i) { return whole || (s.pos[i] >= range[r].lo && s.pos[i] <= range[r].hi); };
      float cm = -INFINITY;
      for (int64_t i = 0; i < n; ++i)
        if (sees(i)) cm = max_nan(cm, l[i]);
      if (!(cm <= m[r] + kSlack)) {  // the maximum rises (or turns NaN, which then reaches every sum)
        const float m_new = max_nan(m[r], cm);
        if (m[r] != -INFINITY) rescale(r, expf(sub_rn(m[r], m_new)));
        m[r] = m_new;
      }
      // A logit of -inf (an fp32 overflow) weighs 0, also while the maximum is -inf: subtracting
      // 0 then, not -inf (whose difference is NaN), as the CUDA reader does; 0 x a NaN V group
      // still reaches the row.
      const float mu = m[r] == -INFINITY ? 0.0f : m[r];
      float* acc = &s.acc[0][r * Dv];
      for (int64_t i = 0; i < n; ++i) {
        if (!sees(i)) continue;
        const float e = expf(sub_rn(l[i], mu));
        sum[0][r] = add_rn(sum[0][r], e);
        const float* v = &s.v[i * Dv];
        for (int64_t d = 0; d < Dv; ++d) acc[d] = add_rn(acc[d], mul_rn(e, v[d]));
      }
    }
    // A chunk is kChunk positions but at the end of the range or the table.
    fold(0);
    if (++folds == kFold) {
      fold(1);
      folds = 0;
    }
  }
  fold(0);
  fold(1);

  for (int64_t r = 0; r < R; ++r) {
    const int64_t i = r / G, g = r % G, row = b * p.q_len + i, hq = h * G + g;
    const int64_t orow = row * p.out_stride[0] + hq * p.out_stride[1];
    const float* acc = &s.acc[2][r * Dv];
    // Total 0: the row saw no position, or only logits of -inf (output 0, lse -inf, as the CUDA
    // reader gives); NaN: a NaN logit (or +inf), which then reaches everything.
    const float total = sum[2][r];
    const bool some = !(total <= 0.0f);
    for (int64_t d = 0; d < Dv; ++d) store_o<kDType>(p.out, orow + d, some ? mul_rn(acc[d] / total, v_scale) : 0.0f);
    if (p.lse) p.lse[row * p.lse_stride[0] + hq * p.lse_stride[1]] = some ? add_rn(m[r], logf(total)) : -INFINITY;
  }
}

template <DType kDType>
void decode_impl(const DecodeParams& p) {
  const float logit_scale = mul_rn(p.k_scale.value, p.sm_scale);
  const float v_scale = p.v_scale.value;
  const int64_t cap = mul_sat(p.max_blocks, p.T);
  const int rows = p.q_len * p.group;
  // Work: the positions each unit reads (bounded by the block table), times the rows' elements.
  double work = 0.0;
  for (int64_t b = 0; b < p.B; ++b) {
    const int64_t len = load_index(p.seq_lens, b);
    work += static_cast<double>(std::max<int64_t>(0, std::min(len, cap)));
  }
  work *= static_cast<double>(p.H) * rows * (p.k.D + p.v.D);
  // Units write disjoint elements of out and lse (the C ABI checked that neither addresses an
  // element twice, that they do not overlap each other or any input). Every share's buffers are
  // allocated before any share starts: a share whose allocation failed after another had written
  // its rows would fail the call with out partly written (found by review).
  const int n = cpu_share_count(work, true);
  std::vector<Scratch> scratch;
  scratch.reserve(static_cast<size_t>(n));
  for (int k = 0; k < n; ++k) scratch.emplace_back(p, rows);
  cpu_run_shares(n, [&](int k, int shares) {
    for (int64_t b = 0; b < p.B; ++b)
      for (int64_t h = 0; h < p.H; ++h)
        if (cpu_in_share(b * p.H + h, k, shares))
          decode_unit<kDType>(p, b, h, logit_scale, v_scale, cap, scratch[static_cast<size_t>(k)]);
  });
}

}  // namespace

void cpu_decode(const DecodeParams& p) {
  if (p.dtype == DType::kFloat16) return decode_impl<DType::kFloat16>(p);
  return decode_impl<DType::kBFloat16>(p);
}

}  // namespace nvfp4kv
