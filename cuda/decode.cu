// CUDA decode attention over the NVFP4 cache (issue #23): two readers and the split merge.
//
// Grid of both readers: x = split of the block table's columns (decode_splits), y = KV head x
// chunk of query rows, z = sequence. A block of kDecodeWarps warps walks its split's tokens; the
// softmax is online per warp (running max and denominator per query row); the warps merge in
// shared memory, in warp order, and a split either writes the output or its partial (max,
// denominator, unnormalized output), merged in split order: by decode_combine_kernel from the
// workspace, or, for short calls on sm_90+, inside the thread-block cluster of the sequence's
// splits (merge_cluster). The same inputs give the same bits on every run. The global scales
// are applied to the logits (k_scale * sm_scale) and to the output (v_scale), so K and V are
// read as e2m1 x e4m3.
// - decode_mma_kernel, the tensor-core reader, for every block size (below), with 16-byte copies,
//   or 8- and 4-byte ones where block sizes that are not multiples of 16 leave the sides so.
// - decode_kernel, the lane-per-token reader in fp32, for the other cache sides whose start or
//   page stride is not a multiple of 16 bytes and caches beyond 32-bit offsets
//   (select_decode_kernel): for the logits each lane takes one token, for the output each lane
//   takes Dv/32 elements of every token.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <type_traits>

#include "backend.h"
#include "common.cuh"
#include "format_device.cuh"

namespace nvfp4kv {
namespace {

constexpr int kDecodeWarps = 4;
constexpr int kDecodeThreads = 32 * kDecodeWarps;
constexpr int kMaxRows = 8;  // query rows (group x q_len) of one block; more rows: more chunks

struct DecodeLaunch {
  DecodeParams p;
  SideOffsets off[2];      // K, V: the format core's offsets, affine in (head, position, group)
  FastDiv block_size;      // T
  int64_t cols_per_split;  // block-table columns of one split
  bool window;             // a window moves the splits to its first columns (split_cols)
  bool by_length;          // the splits follow the lengths and window (split_cols)
  int32_t unit_shift;      // decode_unit_shift(T)
  int32_t splits;
  FastDiv chunks;          // chunks of kRowsPerBlock query rows per KV head (block_head)
  int64_t b0;              // first sequence of this launch
  bool q_vec;              // query rows 16-byte aligned (vector loads)
  bool cluster;            // the splits of a sequence are one thread-block cluster and merge there
  FastDiv q_len;           // row_pos: query rows by q_len
};

__device__ __forceinline__ int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }
__device__ __forceinline__ int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

// Query row rr of a KV head is query position i of its group member g: rr = g * q_len + i. The
// merges decompose it per element, on the chain of instructions that ends a short call: a
// multiply-high, not a division (design notes: "the fixed cost of a block").
struct RowPos {
  int32_t g, i;
};
__device__ __forceinline__ RowPos row_pos(const DecodeLaunch& L, int32_t rr) {
  const int32_t g = static_cast<int32_t>(L.q_len.div(static_cast<uint32_t>(rr)));
  return {g, rr - g * static_cast<int32_t>(L.q_len.d)};
}

// The token range [first, last] that a query row at position i of a sequence of length len
// attends: causal at the end of the sequence (last = len - q_len + i), window_left tokens back at
// most; last is -1 (nothing) for an empty sequence. Both grow with i.
__device__ __forceinline__ int64_t pos_last(const DecodeParams& p, int64_t len, int32_t i) {
  return len > 0 ? len - p.q_len + i : -1;
}
__device__ __forceinline__ int64_t pos_first(const DecodeParams& p, int64_t last) {
  return p.window_left >= 0 ? max64(0, last - p.window_left) : 0;
}
__device__ __forceinline__ void row_range(const DecodeLaunch& L, int64_t len, int32_t rr, int64_t& first,
                                          int64_t& last) {
  last = pos_last(L.p, len, row_pos(L, rr).i);
  first = pos_first(L.p, last);
}

// The block-table columns of this split of a sequence of length len where the launch's splits
// follow the lengths (DecodeLaunch::by_length; decode_split_cols).
__device__ __forceinline__ SplitCols length_split_cols(const DecodeLaunch& L, int32_t split, int64_t len) {
  return decode_split_cols(len, split, L.splits, L.p.max_blocks, L.unit_shift, L.window, L.p.window_left, L.p.q_len,
                           [&](int64_t x) { return L.block_size.div_any(x); });
}
// The same, or the plan's columns where the launch does not follow the lengths.
__device__ __forceinline__ SplitCols split_cols(const DecodeLaunch& L, int32_t split, int64_t len) {
  if (!L.by_length) return {split * L.cols_per_split, L.cols_per_split};
  return length_split_cols(L, split, len);
}

// Query row rr of KV head h of sequence b: its row of query, out and lse (b * q_len + i) and its
// query head (h * group + g).
struct QueryRow {
  int64_t row, hq;
};
__device__ __forceinline__ QueryRow query_row(const DecodeLaunch& L, int64_t b, int32_t h, int32_t rr) {
  const RowPos r = row_pos(L, rr);
  return {b * L.p.q_len + r.i, int64_t{h} * L.p.group + r.g};
}

// This block's KV head and chunk of query rows: grid y = head x chunk.
__device__ __forceinline__ int32_t block_head(const DecodeLaunch& L) {
  return static_cast<int32_t>(L.chunks.div(blockIdx.y));
}
__device__ __forceinline__ int32_t block_chunk(const DecodeLaunch& L, int32_t h) {
  return static_cast<int32_t>(blockIdx.y - h * L.chunks.d);
}

// Weight of a partial softmax with maximum m in a merge whose maximum is M (0 for a partial that
// saw no token).
__device__ __forceinline__ float merge_weight(float m, float M) { return m == -INFINITY ? 0.0f : __expf(m - M); }

// A query element's 16 bits (fp16 or bf16) as a float.
__device__ __forceinline__ float query_to_float(DType dtype, uint16_t h) {
  return dtype == DType::kFloat16 ? f16_to_float(h) : bf16_to_float(h);
}

template <DType kDType>
__device__ __forceinline__ float load_q(const void* base, int64_t idx) {
  return query_to_float(kDType, static_cast<const uint16_t*>(base)[idx]);
}

template <DType kDType>
__device__ __forceinline__ void store_out(void* base, int64_t idx, float v) {
  static_cast<uint16_t*>(base)[idx] = kDType == DType::kFloat16 ? float_to_f16(v) : float_to_bf16(v);
}

// The output element d (and, for d == 0, the lse) of one query row and head from its merged
// numerator o, denominator lsum and maximum M (natural log). A row that saw no token has lsum 0
// (output 0, lse -inf); one that saw a NaN logit has lsum NaN, and NaN is what it must give
// (FORMAT.md §1: a NaN never becomes a number).
template <DType kDType>
__device__ __forceinline__ void store_result(const DecodeParams& p, int64_t row, int64_t hq, int d, float o, float lsum,
                                             float M, float vscale) {
  const float out = !(lsum <= 0.0f) ? o / lsum * vscale : 0.0f;
  store_out<kDType>(p.out, row * p.out_stride[0] + hq * p.out_stride[1] + d, out);
  if (p.lse && d == 0)
    p.lse[row * p.lse_stride[0] + hq * p.lse_stride[1]] = !(lsum <= 0.0f) ? M + logf(lsum) : -INFINITY;
}

// The block's result from its warps' (max, denominator, unnormalized output) per row, merged in
// warp order (m_s in natural-log units; acc: warp w's kRows rows of kD outputs at acc + w *
// acc_stride floats, acc_row floats apart, times the value scale's 1): the output where the
// sequence has one split, else this split's partial: in the workspace, or in cluster_part
// ([row][decode_partial_floats(kD)] in shared memory) where the splits merge in their cluster
// (merge_cluster).
// Thread r < R computes row r's weights e^(m_w - M) once, into m_s (l_s[0] and l_s[1] take the
// merged denominator and maximum); one barrier, then every thread sums its elements: faster than
// each thread computing its rows' weights without the barrier (design notes: "the fixed cost of
// a block").
template <DType kDType, int kD, int kRows>
__device__ __forceinline__ void merge_warps(const DecodeLaunch& L, int64_t b, int32_t h, int32_t r0, int32_t R,
                                            int32_t split, float (&m_s)[kDecodeWarps][kRows],
                                            float (&l_s)[kDecodeWarps][kRows], const float* acc, int acc_stride,
                                            int acc_row, float* cluster_part = nullptr) {
  static_assert(kDecodeWarps >= 2, "l_s holds the merged denominator and maximum");
  const DecodeParams& p = L.p;
  if (threadIdx.x < R) {
    const int r = threadIdx.x;
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) M = fmaxf(M, m_s[w][r]);
    float lsum = 0.0f;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) {
      const float c = merge_weight(m_s[w][r], M);
      lsum += l_s[w][r] * c;
      m_s[w][r] = c;  // from here on, m_s holds the weights
    }
    l_s[0][r] = lsum;
    l_s[1][r] = M;
  }
  __syncthreads();
  const float vscale = read_scale(p.v_scale);
  for (int idx = threadIdx.x; idx < R * kD; idx += kDecodeThreads) {
    const int r = idx / kD, d = idx % kD;
    float o = 0.0f;
#pragma unroll
    for (int w = 0; w < kDecodeWarps; ++w) o += acc[w * acc_stride + r * acc_row + d] * m_s[w][r];
    const float lsum = l_s[0][r], M = l_s[1][r];
    const QueryRow q = query_row(L, b, h, r0 + r);
    if (L.splits == 1) {
      store_result<kDType>(p, q.row, q.hq, d, o, lsum, M, vscale);
    } else {
      // Partial of this split: [row][hq][split] -> (M, l, Dv outputs).
      const int64_t Hq = int64_t{p.H} * p.group;
      constexpr int kPart = decode_partial_floats(kD);
      float* part = cluster_part ? cluster_part + r * kPart
                                 : p.workspace + ((q.row * Hq + q.hq) * L.splits + split) * kPart;
      if (d == 0) {
        part[0] = M;
        part[1] = lsum;
      }
      part[2 + d] = o;
    }
  }
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
// The float at `p` (this block's shared memory) in the shared memory of block `rank` of the cluster.
__device__ __forceinline__ float load_cluster(const float* p, uint32_t rank) {
  uint32_t a;
  asm("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(a) : "r"(smem_u32(p)), "r"(rank));
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(a) : "memory");
  return v;
}
#endif

// The splits' partials (merge_warps' cluster_part, at the same place in every block of the
// cluster: block `split` is the cluster's rank `split`) merged in split order, as
// decode_combine_kernel does from the workspace: block s writes elements s, s + S, ... of the
// R x kD outputs. Every thread of every block of the cluster calls it.
template <DType kDType, int kD>
__device__ __forceinline__ void merge_cluster(const DecodeLaunch& L, int64_t b, int32_t h, int32_t r0, int32_t R,
                                              int32_t split, const float* part) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const DecodeParams& p = L.p;
  const int S = L.splits;
  cluster_sync();  // every split's partials are in its shared memory
  const float vscale = read_scale(p.v_scale);
  for (int idx = split * kDecodeThreads + threadIdx.x; idx < R * kD; idx += S * kDecodeThreads) {
    const int r = idx / kD, d = idx % kD;
    const float* at = part + r * decode_partial_floats(kD);
    float m[kMaxClusterSplits], l[kMaxClusterSplits], v[kMaxClusterSplits];  // all loads in flight
#pragma unroll
    for (int s = 0; s < kMaxClusterSplits; ++s) {
      m[s] = s < S ? load_cluster(at, s) : -INFINITY;
      l[s] = s < S ? load_cluster(at + 1, s) : 0.0f;
      v[s] = s < S ? load_cluster(at + 2 + d, s) : 0.0f;
    }
    float M = -INFINITY;
#pragma unroll
    for (int s = 0; s < kMaxClusterSplits; ++s) M = fmaxf(M, m[s]);
    float lsum = 0.0f, o = 0.0f;
#pragma unroll
    for (int s = 0; s < kMaxClusterSplits; ++s) {
      const float c = merge_weight(m[s], M);
      lsum += l[s] * c;
      o += v[s] * c;
    }
    const QueryRow q = query_row(L, b, h, r0 + r);
    store_result<kDType>(p, q.row, q.hq, d, o, lsum, M, vscale);
  }
  cluster_sync();  // no block leaves while another reads its shared memory
#endif
}

// kRowsPerBlock: 1, 2, 4 or 8 query rows per block (the smallest power of two that holds the
// group's rows, at most kMaxRows): the logits cost one FMA per row and element.
template <DType kDType, int kD, int kRowsPerBlock>
__global__ void __launch_bounds__(kDecodeThreads) decode_kernel(const __grid_constant__ DecodeLaunch L) {
  constexpr int kE = kD / 32;  // output elements per lane
  const DecodeParams& p = L.p;
  const int64_t b = L.b0 + blockIdx.z;
  const int32_t h = block_head(L), chunk = block_chunk(L, h);
  const int32_t split = static_cast<int32_t>(blockIdx.x);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int32_t rows_total = p.group * p.q_len;
  const int32_t r0 = chunk * kRowsPerBlock;
  const int32_t R = min(kRowsPerBlock, rows_total - r0);

  __shared__ float q_s[kRowsPerBlock][kD];
  __shared__ double kq_s[kRowsPerBlock];  // each row's logit factor, its 2^-k included (params.h)
  __shared__ float p_s[kDecodeWarps][kRowsPerBlock][32];
  __shared__ float m_s[kDecodeWarps][kRowsPerBlock], l_s[kDecodeWarps][kRowsPerBlock];
  __shared__ float acc_s[kDecodeWarps][kRowsPerBlock][kD];

  wait_for_prior_grids();
  allow_next_grids();
  const int64_t len = load_index(p.seq_lens, b);
  const float kq = read_scale(p.k_scale) * p.sm_scale;

  // Query rows of this chunk (query_row).
  for (int idx = threadIdx.x; idx < kRowsPerBlock * kD; idx += kDecodeThreads) {
    const int r = idx / kD, d = idx % kD;
    float v = 0.0f;
    if (r < R) {
      const QueryRow q = query_row(L, b, h, r0 + r);
      v = load_q<kDType>(p.query, q.row * p.q_stride[0] + q.hq * p.q_stride[1] + d);
    }
    q_s[r][d] = v;
  }
  __syncthreads();
  // Each row scaled by its power of two (decode_query_exp), a warp per row: q . k cannot
  // overflow fp32 where the logit does not (review of the CPU path, which summed as this did).
  for (int r = warp; r < kRowsPerBlock; r += kDecodeWarps) {
    float mx = 0.0f;
    for (int d = lane; d < kD; d += 32) mx = fmaxf(mx, fabsf(q_s[r][d]));
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    const int k = decode_query_exp(mx);
    for (int d = lane; d < kD; d += 32) q_s[r][d] *= pow2f(k);
    if (lane == 0) kq_s[r] = static_cast<double>(kq) * static_cast<double>(pow2f(-k));
  }
  __syncthreads();

  // Each row's token range: [first, last] with last = len - q_len + i, first from the window.
  int64_t first[kRowsPerBlock], last[kRowsPerBlock];
#pragma unroll
  for (int r = 0; r < kRowsPerBlock; ++r) {
    row_range(L, r < R ? len : 0, r0 + r, first[r], last[r]);
  }
  const SplitCols sc = split_cols(L, split, len);
  const int64_t lo = sc.col * p.T;
  // Saturated as on the CPU (mul_sat): one split of a table of 2^60 columns (a broadcast view)
  // wrapped to 0 positions, and the sequence read as empty (review). The tensor-core reader's
  // products stay below 2^63: its splits hold fewer than 2^31 positions, and the columns of those
  // that follow the lengths end below 2^63 positions (a host model of plan.cpp, 325M cases).
  const int64_t hi = min64(mul_sat(min64(sc.col + sc.cols, p.max_blocks), p.T), len);
  const IndexVec bt_row = block_table_row(p, b);
  PageOffsets kat, vat;  // this KV head's rows: 32-bit offsets per position and group
  kat.init(L.off[0], h, 0);
  vat.init(L.off[1], h, lane * kE / kGroupSize);

  float m[kRowsPerBlock], l[kRowsPerBlock], acc[kRowsPerBlock][kE];
#pragma unroll
  for (int r = 0; r < kRowsPerBlock; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.0f;
#pragma unroll
    for (int e = 0; e < kE; ++e) acc[r][e] = 0.0f;
  }

  for (int64_t t0 = lo + warp * 32; t0 < hi; t0 += kDecodeWarps * 32) {
    // Logits: lane = token.
    const int64_t j = t0 + lane;
    int64_t page = -1;
    const int64_t blk = L.block_size.div_any(j);
    const uint32_t pos = static_cast<uint32_t>(j - blk * p.T);
    if (j < hi) {
      page = load_index(bt_row, blk);
      if (page < 0 || page >= p.N) page = -1;  // masked out, never read
    }
    float s[kRowsPerBlock];
#pragma unroll
    for (int r = 0; r < kRowsPerBlock; ++r) s[r] = 0.0f;
    if (page >= 0) {
      const uint8_t* side = p.k.base + page * p.k.page_stride;
      const uint8_t* codes = side + kat.data(pos);
#pragma unroll
      for (int g = 0; g < kD / kGroupSize; ++g) {
        const uint32_t* cw = reinterpret_cast<const uint32_t*>(codes + 8 * g);  // 4-byte aligned
        const uint32_t sfb = side[kat.scale(pos, g)];
        float k[kGroupSize];
        const uint32_t words[2] = {__ldg(cw), __ldg(cw + 1)};
#pragma unroll
        for (int i = 0; i < kGroupSize; ++i) k[i] = e2m1_decode(words[i >> 3] >> (4 * (i & 7)));
        const float sfq = (sfb & 0x7Fu) == kScaleNaN ? quiet_nan() : e4m3_decode(sfb);
#pragma unroll
        for (int r = 0; r < kRowsPerBlock; ++r) {
          float dot = 0.0f;
#pragma unroll
          for (int i = 0; i < kGroupSize; ++i) dot = fmaf(q_s[r][kGroupSize * g + i], k[i], dot);
          s[r] = fmaf(dot, sfq, s[r]);
        }
      }
    }
    // Scale, soft cap, mask; online softmax per row over the warp's 32 tokens.
    uint32_t seen[kRowsPerBlock];  // bit t: the row attends token t0 + t
#pragma unroll
    for (int r = 0; r < kRowsPerBlock; ++r) {
      float x = static_cast<float>(static_cast<double>(s[r]) * kq_s[r]);
      if (p.soft_cap > 0.0f) x = p.soft_cap * tanhf(x / p.soft_cap);
      const bool ok = page >= 0 && j >= first[r] && j <= last[r];
      seen[r] = __ballot_sync(0xffffffffu, ok);
      x = ok ? x : -INFINITY;
      float mx = x;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      const float m_new = fmaxf(m[r], mx);
      // A logit of -inf (an fp32 overflow) weighs 0, also while the maximum is -inf: subtracting
      // 0 then, not -inf, whose difference is NaN (as m_use in the tensor-core reader; review).
      const float pr = ok ? __expf(x - (m_new == -INFINITY ? 0.0f : m_new)) : 0.0f;
      float sum = pr;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
      const float corr = m_new == -INFINITY ? 1.0f : __expf(m[r] - m_new);
      l[r] = l[r] * corr + sum;
#pragma unroll
      for (int e = 0; e < kE; ++e) acc[r][e] *= corr;
      m[r] = m_new;
      p_s[warp][r][lane] = pr;
    }
    __syncwarp();
    // Output: lane = kE consecutive elements of each of the step's tokens, kVBatch tokens' loads
    // in flight at once (one token at a time left every warp waiting on one load's latency).
    constexpr int kVBatch = 8;
    const int step = static_cast<int>(min64(32, hi - t0));
    for (int t8 = 0; t8 < step; t8 += kVBatch) {
      uint32_t cw[kVBatch], sb[kVBatch];
#pragma unroll
      for (int u = 0; u < kVBatch; ++u) {
        const int t = t8 + u;
        const int64_t pg = __shfl_sync(0xffffffffu, page, t & 31);
        const uint32_t pt = __shfl_sync(0xffffffffu, pos, t & 31);
        cw[u] = 0u;
        sb[u] = 0u;  // a masked token: codes and scale 0, so its values are 0 (and its p is 0)
        if (t < step && pg >= 0) {
          const uint8_t* side = p.v.base + pg * p.v.page_stride;
          const uint8_t* codes = side + vat.data(pt) + (lane * kE / 2) % 8;
          if constexpr (kE == 2) cw[u] = __ldg(codes);
          else if constexpr (kE == 4) cw[u] = __ldg(reinterpret_cast<const uint16_t*>(codes));
          else cw[u] = __ldg(reinterpret_cast<const uint32_t*>(codes));
          sb[u] = __ldg(side + vat.scale(pt, 0));
        }
      }
#pragma unroll
      for (int u = 0; u < kVBatch; ++u) {
        const int t = t8 + u;
        if (t >= step) break;  // warp-uniform
        const float sfq = (sb[u] & 0x7Fu) == kScaleNaN ? quiet_nan() : e4m3_decode(sb[u]);
        float v[kE];
#pragma unroll
        for (int e = 0; e < kE; ++e) v[e] = e2m1_decode(cw[u] >> (4 * e)) * sfq;
#pragma unroll
        for (int r = 0; r < kRowsPerBlock; ++r) {
          // Only tokens the row attends: a NaN group of a masked one must not reach it (0 x NaN).
          if (!((seen[r] >> t) & 1u)) continue;  // warp-uniform
          const float pr = p_s[warp][r][t];
#pragma unroll
          for (int e = 0; e < kE; ++e) acc[r][e] = fmaf(pr, v[e], acc[r][e]);
        }
      }
    }
    __syncwarp();
  }

  // Merge the warps in warp order.
#pragma unroll
  for (int r = 0; r < kRowsPerBlock; ++r) {
    if (lane == 0) {
      m_s[warp][r] = m[r];
      l_s[warp][r] = l[r];
    }
#pragma unroll
    for (int e = 0; e < kE; ++e) acc_s[warp][r][lane * kE + e] = acc[r][e];
  }
  __syncthreads();
  merge_warps<kDType, kD, kRowsPerBlock>(L, b, h, r0, R, split, m_s, l_s, &acc_s[0][0][0], kRowsPerBlock * kD, kD);
}

// ---- The tensor-core reader (T % 16 == 0) ------------------------------------------------------
// docs/design-notes.md, "Decode attention: the tensor-core reader". One warp takes 16 tokens of one
// page at a time (kTiles tiles per step) for a block's <= 8 query rows, on mma.sync m16n8k16
// (fp16 operands, fp32 accumulation):
// - logits, S^T = K Q^T: A = 16 tokens x 16 head elements of K, B = the rows' query. Lane (g, t)
//   (g = lane / 4, t = lane % 4) reads D/4 code bytes of tokens g and g + 8 from the warp's stage
//   in shared memory; the head dimension is summed in any order, so each mma's 16 elements are
//   whichever the lanes hold, and the query fragment is gathered in the same order once per block.
// - output, O^T = V^T P^T: A = 16 head elements x 16 tokens of V, B = the probabilities. Lane
//   (g, t) owns head elements [g D/8, (g+1) D/8) of tokens 2t, 2t+1, 2t+8, 2t+9, and a byte
//   permute pairs two tokens' codes of one element in an fp16x2.
// Codes become fp16 as value * 2^-kUnpackExp times their scale byte, exact; the global scales,
// 2^kUnpackExp and the query's power-of-two scale are applied to the logits and the output. The
// logits' C fragment becomes the probabilities' B fragment by an 8x8 transpose in registers
// (movmatrix). Each warp copies its next step into its stage with cp.async while it computes
// the current one.
// Query rows of a block: 8 (the n of m16n8k16) per n-tile, kN n-tiles. Two tiles decode each K
// and V element once for 16 rows (q_len 2-8, GQA 16) at the cost of registers.
constexpr int kMmaRowsPerTile = 8;

__device__ __forceinline__ void mma_16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// 2^x, results below 2^-126 flushed to 0: a probability that small is 0 against the row's
// largest (1) in any sum; exp2f's subnormal handling cost 3 instructions per call.
__device__ __forceinline__ float exp2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t transpose_8x8(uint32_t x) {
  uint32_t y;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}

__device__ __forceinline__ uint32_t pack_f16x2(float lo, float hi) {
  uint32_t r;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}

// Half kHi of an fp16x2 in both halves (an operand selector of the fp16 multiply that reads it).
template <int kHi>
__device__ __forceinline__ uint32_t f16x2_bcast(uint32_t x) {
  uint32_t r;
  asm("mov.b32 %0, {%1, %1};" : "=r"(r) : "h"(half_of<kHi>(x)));
  return r;
}

__device__ __forceinline__ uint32_t byte_perm(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}

// A word of 8 E2M1 codes as 4 fp16x2 pairs, exact, each value times 2^-kUnpackExp. sm_89 and
// later go through E4M3 (the codes' bits moved into E4M3 fields byte-wise, 4 codes per integer
// operation, then one conversion per pair): pair i holds codes kcode_lo(i) and kcode_lo(i) + 2.
// Earlier GPUs place each code's bits in an fp16 directly (format_device.cuh): pair i holds codes
// i and i + 4. v_interleave sets two tokens' words side by side so that pair i of x[k] holds code
// 4k + i of both tokens (a in the low half, b in the high half).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
__device__ __forceinline__ uint32_t mul_hi(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("mul.hi.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
__device__ __forceinline__ uint32_t mul_lo(uint32_t a, uint32_t b) {
  uint32_t r;
  asm("mul.lo.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}
constexpr int kUnpackExp = 6;
__device__ __forceinline__ int kcode_lo(int i) { return (i & 1) + 4 * (i >> 1); }
__device__ __forceinline__ int kcode_hi(int i) { return kcode_lo(i) + 2; }
__device__ __forceinline__ void unpack_word(uint32_t w, uint32_t (&h)[4]) {
  // High nibble of each byte: sign at bit 7 already, magnitude from bits 6..4 to E4M3's 4..2
  // (exponent's low two bits and the mantissa's top bit): the value times 2^-6. Low nibble:
  // the same after a 4-bit shift.
  // The shifts go to the multiply pipe (w >> 2 as the high word of w * 2^30, left shifts as
  // multiplies): the integer logic pipe, which the masks need, is the reader's busiest.
  const uint32_t hi = (w & 0x80808080u) | (mul_hi(w, 1u << 30) & 0x1C1C1C1Cu);
  const uint32_t lo = (mul_lo(w, 16u) & 0x80808080u) | (mul_lo(w, 4u) & 0x1C1C1C1Cu);
  h[0] = e4m3x2_f16x2<0>(lo);  // codes 0, 2
  h[1] = e4m3x2_f16x2<0>(hi);  // codes 1, 3
  h[2] = e4m3x2_f16x2<1>(lo);  // codes 4, 6
  h[3] = e4m3x2_f16x2<1>(hi);  // codes 5, 7
}
__device__ __forceinline__ void v_interleave(uint32_t a, uint32_t b, uint32_t (&x)[2]) {
  x[0] = byte_perm(a, b, 0x5140u);  // a.b0 b.b0 a.b1 b.b1
  x[1] = byte_perm(a, b, 0x7362u);  // a.b2 b.b2 a.b3 b.b3
}
#else
constexpr int kUnpackExp = 14;
__device__ __forceinline__ int kcode_lo(int i) { return i; }
__device__ __forceinline__ int kcode_hi(int i) { return i + 4; }
__device__ __forceinline__ void unpack_word(uint32_t w, uint32_t (&h)[4]) {
#pragma unroll
  for (int j = 0; j < 4; ++j) h[j] = e2m1_pair_h(w, j);
}
__device__ __forceinline__ void v_interleave(uint32_t a, uint32_t b, uint32_t (&x)[2]) {
  x[0] = byte_perm(a, b, 0x5410u);  // a.b0 a.b1 b.b0 b.b1
  x[1] = byte_perm(a, b, 0x7632u);  // a.b2 a.b3 b.b2 b.b3
}
#endif
constexpr float kUnpackScale = static_cast<float>(1u << kUnpackExp);

// Asynchronous copies global -> shared (sm_80+): `ok` false copies nothing and fills zeros.
// kLine: L2 fetches the source's whole 128-byte line from DRAM, not only its sectors (design
// notes: "Decode attention: pages shorter than a tile").
template <int kN, bool kLine = false>
__device__ __forceinline__ void cp_async(uint32_t dst, const void* src, bool ok) {
  static_assert(kN == 4 || kN == 8 || kN == 16, "cp.async sizes");
  if constexpr (kN == 16 && kLine)
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0) : "memory");
  else if constexpr (kN == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0) : "memory");
  else if constexpr (kLine)
    asm volatile("cp.async.ca.shared.global.L2::128B [%0], [%1], %2, %3;" ::"r"(dst), "l"(src), "n"(kN), "r"(ok ? kN : 0)
                 : "memory");
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;" ::"r"(dst), "l"(src), "n"(kN), "r"(ok ? kN : 0)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int kN>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(kN) : "memory");
}
// 16 bytes of shared memory, stored and loaded in program order (volatile: a value loaded this
// way is neither recomputed by the compiler nor hoisted out of a loop). No other access needs
// ordering against them: a thread reads back only what it stored.
__device__ __forceinline__ void st_shared16(uint32_t a, uint4 v) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(a), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w));
}
__device__ __forceinline__ uint4 ld_shared16(uint32_t a) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
  return v;
}
__device__ __forceinline__ uint4 addr_pair(uint64_t x, uint64_t y) {
  return make_uint4(static_cast<uint32_t>(x), static_cast<uint32_t>(x >> 32), static_cast<uint32_t>(y),
                    static_cast<uint32_t>(y >> 32));
}
__device__ __forceinline__ uint64_t addr_of(uint32_t lo, uint32_t hi) { return (uint64_t{hi} << 32) | lo; }
__device__ __forceinline__ uint64_t addr(const void* p) { return reinterpret_cast<uint64_t>(p); }
// A block-table entry: 8 bytes where `w64`, 4 (the low word) where `w32`, else nothing; read-only
// path, predicated rather than branched around.
__device__ __forceinline__ void load_entry(const void* at, bool w64, bool w32, uint32_t& lo, uint32_t& hi) {
  asm("{\n .reg .pred p, q;\n setp.ne.u32 p, %2, 0;\n setp.ne.u32 q, %3, 0;\n"
      " @p ld.global.nc.v2.u32 {%0, %1}, [%4];\n @q ld.global.nc.u32 %0, [%4];\n}"
      : "+r"(lo), "+r"(hi)
      : "r"(static_cast<uint32_t>(w64)), "r"(static_cast<uint32_t>(w32)), "l"(at));
}
// base + page * stride + off as a pointer: a 32 x 32 -> 64-bit multiply-add, no 64-bit multiply.
__device__ __forceinline__ const uint8_t* page_at(uint64_t base, uint32_t page, uint32_t stride, uint32_t off) {
  uint64_t r;
  asm("mad.wide.u32 %0, %1, %2, %3;" : "=l"(r) : "r"(page), "r"(stride), "l"(base));
  return reinterpret_cast<const uint8_t*>(r + off);
}

// One warp's stage in shared memory: the K and V code rows and scale bytes of kTiles tiles of 16
// tokens. Row strides are chosen so that the lanes' reads hit distinct banks: a K row of 64 bytes
// (D 128) is read by 4 lanes and 2 rows per 8-lane phase; a V row is read 8 bytes (D 128) by 8
// lanes of 4 rows at once, so V rows are padded by 16 bytes; D 256's K rows by 64.
template <int kD, int kTiles>
struct MmaStage {
  static constexpr int kStep = 16 * kTiles;            // tokens
  static constexpr int kS = kD / kGroupSize;           // scale bytes of a row
  static constexpr int kKRow = kD == 256 ? 192 : kD / 2;
  static constexpr int kVRow = kD / 2 + 16;
  static constexpr int kK = 0;
  static constexpr int kV = kK + kStep * kKRow;
  static constexpr int kKs = kV + kStep * kVRow;       // K scales: [token][kS] (linear)
  static constexpr int kVs = kKs + kStep * kS;         // V scales: [token][kS] or the interleaved blocks
  static constexpr int kBytes = kVs + kStep * kS;
  static_assert(kBytes % 16 == 0, "16-byte aligned stages");
};
// Stages per warp: the step it computes and the one in flight. With 2, a block of 4 warps at D
// 128 needs 44 KB with its query rows and 4 blocks fit an SM (registers allow 4): 16 warps, each
// with a step in flight, against 12 warps with 3 stages ("Decode attention: the tensor-core
// reader").
constexpr int kMmaStages = 2;

// The block's dynamic shared memory: the query rows (fp32), the warps' stages (each warp's
// outputs go over its own stages for the merge), and a split's partial where the splits merge in
// their cluster. The query rows and the partial have their own places so that step 0's copies
// start before the query is read and that no warp waits for another before writing its outputs
// (design notes: "the fixed cost of a block").
// Both are padded so that the lanes of one 16-byte shared-memory access hit distinct banks (ncu
// counted 32 wavefronts per query-fragment load and 16 per output store, against 4; design
// notes: "the fixed cost of a block"):
// - a query row takes 4 more floats after every 32 (element d at d + 4 (d / 32)), and at D 256
//   16 more at its end: the fragment's lanes (g, t) read rows g at 32t (D 64: 16t);
// - a warp's output row takes 4 more floats: lanes (g, t) write rows 2t and 2t + 1 at 16g.
template <int kD>
__host__ __device__ constexpr int mma_q_row() {  // floats
  return kD + kD / 8 + (kD % 256 == 0 ? 16 : 0);
}
__host__ __device__ constexpr int mma_q_at(int d) { return d + 4 * (d / 32); }
template <int kD>
__host__ __device__ constexpr int mma_out_row() {  // floats
  return kD + 4;
}
template <int kD, int kN>
__host__ __device__ constexpr size_t mma_query_bytes() {
  return size_t{kMmaRowsPerTile} * kN * mma_q_row<kD>() * 4;
}
template <int kD, int kTiles>
__host__ __device__ constexpr size_t mma_warp_bytes() {  // one warp's stages
  return size_t{kMmaStages} * MmaStage<kD, kTiles>::kBytes;
}
template <int kD, int kN>
__host__ __device__ constexpr size_t mma_part_bytes() {  // the block's partial where splits merge in a cluster
  return size_t{kMmaRowsPerTile} * kN * decode_partial_floats(kD) * 4;
}
// Each thread's copy constants, two 16-byte words, kept in shared memory where the registers are
// capped at 128 (D <= 128; decode_mma_kernel's issue).
template <int kD>
__host__ __device__ constexpr bool mma_lane_smem() {
  return kD <= 128;
}
template <int kD>
__host__ __device__ constexpr size_t mma_lane_bytes() {
  return mma_lane_smem<kD>() ? 2 * 16 * kDecodeThreads : 0;
}
// Shared memory of a block: query rows, the warps' stages, the cluster partial, the lane constants.
template <int kD, int kTiles, int kN>
__host__ __device__ constexpr size_t mma_smem_bytes() {
  static_assert(size_t{kMmaRowsPerTile} * kN * mma_out_row<kD>() * 4 <= mma_warp_bytes<kD, kTiles>(),
                "a warp's outputs fit its stages");
  return mma_query_bytes<kD, kN>() + kDecodeWarps * mma_warp_bytes<kD, kTiles>() + mma_part_bytes<kD, kN>() +
         mma_lane_bytes<kD>();
}

// Blocks per SM that the kernel's registers must allow: 4 with one n-tile at D <= 128 (16
// warps; left to itself the compiler took 154 registers, 3 blocks, 8 % slower: design notes),
// 3 at D 64 and 2 at D 128 with two n-tiles; D 256 takes the registers it needs.
template <int kD, int kN>
constexpr int mma_min_blocks() {
  return kD > 128 ? 1 : kN == 1 ? 4 : kD == 64 ? 3 : 2;
}

// kPerToken: T is not a multiple of 16, so a 16-token tile may hold tokens of several pages, and
// each token's page and position are found on their own (design notes: "Decode attention: pages
// shorter than a tile"); otherwise a tile lies in one page.
// kByLength: the launch's splits follow the lengths (DecodeLaunch::by_length); a kernel of its
// own, since the split's code cost launches that do not use it 0.18 us at 1 x 1024 even when
// skipped (design notes: "Decode attention: splits from the lengths").
// kCopy: the bytes of one code-row copy, 16, or where kPerToken pages leave the sides only 8- or
// 4-byte aligned, decode_narrow_copy(kD) (design notes: "Decode attention: narrow copies").
template <int kD, int kTiles, int kN, bool kCapped, bool kPerToken, bool kByLength, int kCopy>
__global__ void __launch_bounds__(kDecodeThreads, (mma_min_blocks<kD, kN>())) decode_mma_kernel(
    const __grid_constant__ DecodeLaunch L) {
  static_assert(kCopy == 16 || (kPerToken && (kCopy == 8 || kCopy == 4)), "narrow copies: per-token pages");
  using St = MmaStage<kD, kTiles>;
  constexpr int kRows = kMmaRowsPerTile * kN;
  constexpr int kStep = St::kStep;
  constexpr int kKW = kD / 32;                    // code words of a lane's K slice of one token (D/4 elements)
  constexpr int kKG = kD / 64;                    // scale groups of that slice (1, 2 or 4)
  constexpr int kVW = kD / 64;                    // code words of a lane's V slice of one token (D/8 elements)
  constexpr int kVG = kD >= 128 ? kD / 128 : 1;  // scale groups of that slice
  constexpr int kM = kD / 16;                     // mma tiles along the head dimension
  const DecodeParams& p = L.p;
  const int64_t b = L.b0 + blockIdx.z;
  const int32_t h = block_head(L), chunk = block_chunk(L, h);
  const int32_t split = static_cast<int32_t>(blockIdx.x);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int32_t rows_total = p.group * p.q_len;
  const int32_t r0 = chunk * kRows;
  const int32_t R = min(kRows, rows_total - r0);

  // The query rows, then the warps' stages, then the merge over both: one region of dynamic
  // shared memory (static arrays would add to it and cost a resident block).
  extern __shared__ __align__(16) uint8_t smem[];
  auto& q_s = *reinterpret_cast<float(*)[kRows][mma_q_row<kD>()]>(smem);  // element d at mma_q_at(d)
  __shared__ float qf_s[kRows], qi_s[kRows];  // the query rows' power-of-two scale, its inverse
  __shared__ float m_s[kDecodeWarps][kRows], l_s[kDecodeWarps][kRows];

  wait_for_prior_grids();
  allow_next_grids();
  const IndexVec bt_row = block_table_row(p, b);

  // Block-table entries of the tiles of the step issued next, loaded one step ahead so that no
  // issue waits on them: the loaded words stay untouched until the next issue (even an int32's
  // sign extension would wait for the load), which checks them (a bad entry is never read through).
  // The entry and position of each tile (or token) advance by kAdvance tokens per step (no division).
  uint32_t next_lo[kTiles], next_hi[kTiles], next_pos[kTiles];
  constexpr int kAdvance = kDecodeWarps * kStep;
  const int64_t bt_bytes = bt_row.stride * (bt_row.is_int64 ? 8 : 4);  // between block-table columns
  const uint32_t adv_blocks = L.block_size.div(kAdvance), adv_pos = kAdvance - adv_blocks * p.T;
  const uint8_t* bt_base = static_cast<const uint8_t*>(bt_row.ptr);
  uint32_t bt_at[kTiles], bt_pos[kTiles];  // byte offset of the entry (a row is below 4 GiB: small_pages)
  // kPerToken: lane l holds the entry and position of token l % kStep of the step in next_lo[0],
  // next_hi[0] and next_pos[0] (a step starts at a multiple of 16 tokens: plan_decode_split,
  // decode_split_cols).
  constexpr int kEntries = kPerToken ? 1 : kTiles;  // entries of a lane per step
  const uint32_t lane_tok = static_cast<uint32_t>(lane % kStep);
  // `left`: tokens from the prefetched step's first to the end of what it may read.
  const auto prefetch = [&](int32_t left) {
#pragma unroll
    for (int u = 0; u < kEntries; ++u) {
      // Predicated loads, no branch: -1 (no page) where nothing is loaded; an int32 entry's high
      // word is 0 (a negative entry is >= 2^31 > N as unsigned).
      const bool load = left > static_cast<int32_t>(kPerToken ? lane_tok : 16 * u);
      next_lo[u] = 0xFFFFFFFFu;
      next_hi[u] = load && !bt_row.is_int64 ? 0u : 0xFFFFFFFFu;
      next_pos[u] = bt_pos[u];
      load_entry(bt_base + bt_at[u], load && bt_row.is_int64, load && !bt_row.is_int64, next_lo[u], next_hi[u]);
      bt_pos[u] += adv_pos;
      bt_at[u] += adv_blocks * static_cast<uint32_t>(bt_bytes);
      if (bt_pos[u] >= static_cast<uint32_t>(p.T)) {
        bt_pos[u] -= p.T;
        bt_at[u] += static_cast<uint32_t>(bt_bytes);
      }
    }
  };

  // The first step's entries of a split of columns [col, col + cols), up to its last column or
  // the table's: they load while the query rows are read (later steps stop at the sequence's
  // end). Clamped: a split past the table's last column has its end before this warp's first
  // step, by up to 2^31 tokens at the largest pages, whose int32 would wrap to a positive count
  // (review).
  const auto first_entries = [&](int64_t col, int64_t cols) {
#pragma unroll
    for (int u = 0; u < kEntries; ++u) {
      const uint32_t rel = warp * kStep + (kPerToken ? lane_tok : 16 * u);
      const uint32_t rb = L.block_size.div(rel);
      bt_pos[u] = rel - rb * p.T;
      bt_at[u] = static_cast<uint32_t>((col + rb) * bt_bytes);
    }
    const int64_t end = min64(col + cols, p.max_blocks) * p.T;
    prefetch(static_cast<int32_t>(max64(end - (col * p.T + warp * kStep), 0)));
  };
  // The entries of the plan's split first, where a launch that does not follow the lengths, and a
  // sequence that fills the table without a window, has it: they and the query's loads wait for
  // nothing. A split that the sequence's length or window moves (with a window, every sequence
  // longer than about its window) loads its entries again, after the query's loads.
  const int64_t plan_col = split * L.cols_per_split;
  first_entries(plan_col, L.cols_per_split);

  // The query rows' 16-byte chunks (8 elements), all loads in flight at once; they become the
  // mma fragment once step 0's copies have started (build_query, in the pipeline below).
  constexpr int kQChunks = kRows * kD / 8;
  constexpr int kQPerThread = (kQChunks + kDecodeThreads - 1) / kDecodeThreads;
  uint4 q_raw[kQPerThread];
#pragma unroll
  for (int c = 0; c < kQPerThread; ++c) {
    const int idx = threadIdx.x + c * kDecodeThreads, r = idx / (kD / 8), d = 8 * (idx % (kD / 8));
    q_raw[c] = make_uint4(0u, 0u, 0u, 0u);
    if (idx < kQChunks && r < R) {
      const QueryRow q = query_row(L, b, h, r0 + r);
      const uint16_t* src = static_cast<const uint16_t*>(p.query) + q.row * p.q_stride[0] + q.hq * p.q_stride[1] + d;
      if (L.q_vec) {
        q_raw[c] = __ldg(reinterpret_cast<const uint4*>(src));
      } else {
        uint32_t e[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) e[k] = __ldg(src + k);
        q_raw[c] = make_uint4(e[0] | e[1] << 16, e[2] | e[3] << 16, e[4] | e[5] << 16, e[6] | e[7] << 16);
      }
    }
  }
  // The length is loaded after the query (in program order): the split computed from it, and
  // the wait for its load, then come after the query's loads too (SASS).
  const int64_t len = load_index(p.seq_lens, b);
  const SplitCols sc = kByLength ? length_split_cols(L, split, len) : SplitCols{plan_col, L.cols_per_split};
  if (kByLength && sc.col != plan_col) first_entries(sc.col, sc.cols);
  // The split's tokens [lo, hi); this warp's steps start at s0 = lo + (warp + kDecodeWarps * n) * kStep.
  const int64_t lo = sc.col * p.T;
  const int64_t hi = min64(min64(sc.col + sc.cols, p.max_blocks) * p.T, len);
  // With the split's start from the length, the D 128 reader keeps 4 bytes of its loop in local
  // memory at the 128-register cap; reading the start back from shared memory instead cost 2-3 %
  // (design notes: "Decode attention: splits from the lengths").
  const int64_t first_s0 = lo + warp * kStep;

  // Lane t's K slice of a row: 16-byte chunks at 16t and 64 + 16t (D 256), 16t (D 128), 8-byte
  // at 8t (D 64); word w of it starts at byte k_byte(w). Its scale bytes: groups 2t, 2t + 1
  // (and 8 + 2t, 9 + 2t), or t (D 64): word w's group is k = w / 2 of them.
  const auto k_byte = [&](int w) { return kD == 64 ? 8 * t + 4 * w : 16 * t + 64 * (w / 4) + 4 * (w % 4); };
  // This lane's C rows: 8n + 2t and 8n + 2t + 1. Logit = acc * kq[n][j], in the log2 domain for
  // exp2 (the soft cap, when there is one, takes the natural logit).
  constexpr float kLog2e = 1.4426950408889634f;
  // B fragments of the query (row g of each n-tile), in the order the lanes' K words are
  // unpacked: fp16x2 i holds the elements of codes kcode_lo(i % 4) and kcode_hi(i % 4) of word i / 4.
  uint32_t qb[kN][kD / 8];
  float kq[kN][2];
  const auto build_query = [&]() {
    // Each query row is scaled by a power of two that brings its largest element to [2^13, 2^14):
    // exact, and inside fp16's range whatever the query's dtype (bf16 reaches 2^127). A row's
    // chunks sit on kD / 8 neighbouring lanes of one warp, so their maximum takes shuffles, not
    // a barrier and a second pass over the rows.
#pragma unroll
    for (int c = 0; c < kQPerThread; ++c) {
      const int idx = threadIdx.x + c * kDecodeThreads, r = idx / (kD / 8), d = 8 * (idx % (kD / 8));
      float mx = 0.0f;
      if (idx < kQChunks) {
        const uint32_t w[4] = {q_raw[c].x, q_raw[c].y, q_raw[c].z, q_raw[c].w};
        float v[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          const uint16_t e = static_cast<uint16_t>(w[k / 2] >> (16 * (k % 2)));
          v[k] = query_to_float(p.dtype, e);
          mx = fmaxf(mx, fabsf(v[k]));
        }
        *reinterpret_cast<float4*>(&q_s[r][mma_q_at(d)]) = make_float4(v[0], v[1], v[2], v[3]);
        *reinterpret_cast<float4*>(&q_s[r][mma_q_at(d) + 4]) = make_float4(v[4], v[5], v[6], v[7]);  // d % 8 == 0
      }
#pragma unroll
      for (int o = kD / 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
      if (idx < kQChunks && d == 0) {
        const int k = decode_query_exp(mx);  // k in [-114, 126]
        qf_s[r] = pow2f(k);
        qi_s[r] = pow2f(-k);  // kq's multiply
      }
    }
    __syncthreads();
#pragma unroll
    for (int n = 0; n < kN; ++n) {
      const int r = 8 * n + g;
      const float f = qf_s[r];
#pragma unroll
      for (int i = 0; i < kD / 8; ++i) {
        const int d = mma_q_at(2 * k_byte(i / 4));  // its 8 elements lie in one run of 32
        qb[n][i] = pack_f16x2(q_s[r][d + kcode_lo(i % 4)] * f, q_s[r][d + kcode_hi(i % 4)] * f);
      }
    }
    // The powers of two together first (exact), then the global scales in the CPU path's order:
    // k_scale * sm_scale * kUnpackScale overflowed to inf for scales the CPU path takes (5.3e36 on
    // sm_89+), and a token with a zero K row then gave 0 * inf = NaN (review). The factor still
    // passes FLT_MAX where k_scale * sm_scale * max|q| nears it (2^kUnpackExp over the row's
    // 2^-k): held at FLT_MAX, a zero logit stays 0 and the others still overflow to -inf or +inf
    // as on the CPU path (sm_80's 2^14 did at sm_scale 3e38 and max|q| 2). Only where
    // k_scale * sm_scale itself is finite: the CPU path's inf there gives NaN, and so does this.
    const float kq0 = read_scale(p.k_scale) * p.sm_scale;
#pragma unroll
    for (int n = 0; n < kN; ++n)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const float f = kq0 * (kUnpackScale * qi_s[8 * n + 2 * t + j]) * (kCapped ? 1.0f : kLog2e);
        kq[n][j] = isinf(f) && !isinf(kq0) ? copysignf(FLT_MAX, f) : f;
      }
  };

  int64_t first[kN][2], last[kN][2];
#pragma unroll
  for (int n = 0; n < kN; ++n)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int r = 8 * n + 2 * t + j;
      row_range(L, r < R ? len : 0, r0 + r, first[n][j], last[n][j]);
    }
  // Tokens every real row attends to: [first_all, last_all]; a step inside it needs no mask.
  // The block's rows r0 .. r0 + R - 1 hold positions i0 .. i0 + R - 1, or every position where
  // they wrap past q_len; the bounds come from the lowest and highest (a row's range grows with i).
  int64_t first_all, last_all;
  {
    const int32_t i0 = row_pos(L, r0).i, q_len = L.p.q_len;
    const bool all = i0 + R > q_len;
    first_all = pos_first(p, pos_last(p, len, all ? q_len - 1 : i0 + R - 1));
    last_all = pos_last(p, len, all ? 0 : i0);
  }

  PageOffsets kat, vat;  // this KV head's rows, group 0
  kat.init(L.off[0], h, 0);
  vat.init(L.off[1], h, 0);
  const uint32_t v_slice = g * (kD / 16);         // byte of lane g's V slice in a row
  const int v_group = g * (kD / 8) / kGroupSize;  // its first scale group

  float m[kN][2], l[kN][2], o[kN][kM][4];
  uint32_t vnan[kN][2];  // bit k: the row attended a token whose V group k of this lane's slice is NaN
#pragma unroll
  for (int n = 0; n < kN; ++n) {
    vnan[n][0] = vnan[n][1] = 0u;
    m[n][0] = m[n][1] = -INFINITY;
    l[n][0] = l[n][1] = 0.0f;
#pragma unroll
    for (int i = 0; i < kM; ++i) o[n][i][0] = o[n][i][1] = o[n][i][2] = o[n][i][3] = 0.0f;
  }

  // Where the warps' stages start (after the query rows), the cluster partial (after every
  // warp's stages) and the lane constants (after it): mma_smem_bytes' layout.
  constexpr uint32_t kStagesAt = static_cast<uint32_t>(mma_query_bytes<kD, kN>());
  constexpr uint32_t kWarpBytes = static_cast<uint32_t>(mma_warp_bytes<kD, kTiles>());
  constexpr uint32_t kPartAt = kStagesAt + kDecodeWarps * kWarpBytes;
  constexpr uint32_t kLaneAt = kPartAt + static_cast<uint32_t>(mma_part_bytes<kD, kN>());
  const uint32_t stages = smem_u32(smem) + kStagesAt + warp * kWarpBytes;
  const uint8_t* stages_p = smem + kStagesAt + warp * kWarpBytes;
  const int64_t nsteps = hi > first_s0 ? (hi - first_s0 + kDecodeWarps * kStep - 1) / (kDecodeWarps * kStep) : 0;
  uint32_t valid = 0;  // bit st * kTiles + u: tile u of the step in stage st has a valid page
  uint64_t tok_valid = 0;  // kPerToken: bit 32 st + e, token e of the step in stage st has a valid page

  // The lane's share of a tile's code rows: kCopy-byte chunk `ch` of rows e_l + i * kRowStep
  // (i < kPerLane), at page-relative offsets that move by a constant per row (K and V have the
  // same geometry: one data_pos). Each copy instruction of the warp reads whole rows, 32
  // neighbouring chunks where rows are contiguous.
  constexpr int kChunks = kD / 2 / kCopy;  // chunks of a code row
  static_assert(kChunks >= 2 && kChunks <= 16, "lanes 0-15 (the K scales' copies) are whole rows");
  constexpr int kRowStep = 32 / kChunks;   // rows between a lane's chunks
  constexpr int kPerLane = 16 / kRowStep;  // chunks of a lane per tile and side
  const int ch = lane % kChunks, e_l = lane / kChunks;
  const uint32_t lane_src = (kPerToken ? 0u : e_l * kat.data_pos) + kCopy * ch;  // kPerToken: each row's own
  const uint64_t k_from = addr(p.k.base) + kat.data0 + lane_src;
  const uint32_t k_dst = stages + St::kK + e_l * St::kKRow + kCopy * ch;  // V: at St::kV, rows of kVRow
  // Scale bytes: one copy instruction for both sides, K on lanes 0-15 and V on 16-31, kS bytes
  // each. A tile's (pos0 % 16 == 0) K scales, linear, are kS bytes per token at a stride of
  // scale_pos; its interleaved V scales are one run of 16 kS bytes (FORMAT.md §4: blocks of 4
  // tokens side by side), which lane e copies from byte e kS like a linear row of stride kS. A
  // block partly past the end is copied whole (the reader zeroes the bytes of tokens past the
  // end); a linear row only where its token exists.
  const int e_s = lane & 15;
  const bool k_lane = lane < 16;
  const uint32_t ks_step = kat.scale_pos, vs_step = vat.interleaved ? St::kS : vat.scale_pos;  // bytes per token
  const uint32_t s_step = k_lane ? ks_step : vs_step;
  const uint32_t s_src = (k_lane ? kat : vat).scale0 + (kPerToken ? 0u : e_s * s_step);
  const int s_tok = k_lane || !vat.interleaved ? e_s : e_s & ~3;  // the token whose existence decides the copy
  const uint32_t s_dst = stages + (k_lane ? St::kKs : St::kVs) + e_s * St::kS;
  const uint64_t s_from = addr(k_lane ? p.k.base : p.v.base) + s_src;
  // Each issue reads these lane constants back from shared memory (two 16-byte loads), where
  // the compiler otherwise recomputed them from the thread index in every step, for want of
  // registers through the compute (design notes: "the copies' lane constants"). V's addresses
  // are K's plus a block constant (the same data_pos on both sides), the scales' stride and
  // page stride the K or V side's.
  const uint32_t lane_c = smem_u32(smem) + kLaneAt + 16 * threadIdx.x;
  constexpr uint32_t kLaneStride = 16 * kDecodeThreads;
  const uint4 lane0 = addr_pair(k_from, s_from);
  const uint4 lane1 = make_uint4(k_dst, s_dst, static_cast<uint32_t>(e_l), static_cast<uint32_t>(s_tok));
  // D 256 has registers to spare and one block of 4 warps per SM, where the loads' latency at
  // every step is not hidden: it keeps them in registers.
  constexpr bool kLaneSmem = mma_lane_smem<kD>();
  if constexpr (kLaneSmem) {
    st_shared16(lane_c, lane0);
    st_shared16(lane_c + kLaneStride, lane1);
  }
  const uint64_t v_delta = (addr(p.v.base) + vat.data0) - (addr(p.k.base) + kat.data0);  // modulo 2^64
  const uint32_t k_page = static_cast<uint32_t>(p.k.page_stride), v_page = static_cast<uint32_t>(p.v.page_stride);
  const uint32_t data_pos = kat.data_pos;
  const uint64_t row_step = uint64_t{kRowStep} * data_pos;

  // Starts the copies of step n into stage st; tokens past the end of the split or in a masked
  // page are filled with zeros, never read. Then loads the block-table entries of step n + 1.
  // Fewer than 2^31 pages, page strides below 2^32 bytes, splits below 2^31 tokens
  // (select_decode_kernel): 32-bit products and counts.
  int32_t togo = static_cast<int32_t>(hi - first_s0);  // tokens from the issued step's first to the end
  const uint32_t n_pages = static_cast<uint32_t>(p.N);
  // The first issue takes the lane constants as computed (no store and load on the setup's
  // chain); the loop's read them back.
  const auto issue = [&](int st, const uint4 c0, const uint4 c1) {
    const int32_t rem = min(togo, kStep);  // tokens of the step that exist
    togo -= kAdvance;
    const uint32_t at = st * St::kBytes;
    const uint64_t k_base = addr_of(c0.x, c0.y), v_base = k_base + v_delta, s_base = addr_of(c0.z, c0.w);
    const uint32_t kd = c1.x + at, sd = c1.y + at, row = c1.z, stok = c1.w;
    const uint32_t vd = kd + (St::kV - St::kK) + row * static_cast<uint32_t>(St::kVRow - St::kKRow);  // modulo 2^32
    const bool k_scales = row < 16u / kChunks;  // lanes 0-15 copy the K scales
    const uint32_t s_page = k_scales ? k_page : v_page, s_step = k_scales ? ks_step : vs_step;
    // A loaded entry names a page: int64 entries 0 <= raw < N; an int32 entry's high word is 0 and
    // a negative one is >= 2^31 > N as unsigned.
    const auto entry_ok = [&](int u) { return next_hi[u] == 0u && next_lo[u] < n_pages; };
    if constexpr (kPerToken) {
      // Each row's page and position from the lane that loaded its token's entry (lane 16u + token).
      constexpr uint32_t kNoPage = 0xFFFFFFFFu;
      const uint32_t mine = entry_ok(0) ? next_lo[0] : kNoPage;
      const uint32_t es = threadIdx.x & 15u;
#pragma unroll
      for (int u = 0; u < kTiles; ++u) {
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) {
          const uint32_t r = row + kRowStep * i;
          const uint32_t page = __shfl_sync(0xffffffffu, mine, 16 * u + r);
          const bool ok = page != kNoPage && static_cast<int32_t>(r) < rem - 16 * u;
          const uint32_t off = __shfl_sync(0xffffffffu, next_pos[0], 16 * u + r) * data_pos;
          cp_async<kCopy, true>(kd + (16 * u + kRowStep * i) * St::kKRow, page_at(k_base, ok ? page : 0u, k_page, off),
                                ok);
          cp_async<kCopy, true>(vd + (16 * u + kRowStep * i) * St::kVRow, page_at(v_base, ok ? page : 0u, v_page, off),
                                ok);
        }
        // The scale lane's bytes lie in the page of its token stok (an interleaved block of 4
        // tokens lies in one page: T % 4 == 0, and a tile starts at a multiple of 4 in its
        // page), at token es's position of the page's run like a linear row.
        const uint32_t page = __shfl_sync(0xffffffffu, mine, 16 * u + stok);
        const uint32_t pos = __shfl_sync(0xffffffffu, next_pos[0], 16 * u + es);
        const bool ok = page != kNoPage && static_cast<int32_t>(stok) < rem - 16 * u;
        cp_async<St::kS, true>(sd + 16 * u * St::kS, page_at(s_base, ok ? page : 0u, s_page, pos * s_step), ok);
      }
      const uint32_t vm = __ballot_sync(0xffffffffu, mine != kNoPage);
      tok_valid = (tok_valid & ~(uint64_t{0xFFFFFFFFu} << (32 * st))) | (uint64_t{vm} << (32 * st));
    } else {
      uint32_t vbits = 0;
#pragma unroll
      for (int u = 0; u < kTiles; ++u) {
        const bool ok_page = entry_ok(u);
        vbits |= ok_page ? 1u << u : 0u;
        const int32_t n_ok = ok_page ? min(max(rem - 16 * u, 0), 16) : 0;
        const uint32_t page = ok_page ? next_lo[u] : 0u;
        const uint32_t pos0 = next_pos[u];
        const uint8_t* kp = page_at(k_base, page, k_page, pos0 * data_pos);
        const uint8_t* vp = page_at(v_base, page, v_page, pos0 * data_pos);
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) {
          const bool ok = static_cast<int32_t>(row) + kRowStep * i < n_ok;
          cp_async<16>(kd + (16 * u + kRowStep * i) * St::kKRow, kp + i * row_step, ok);
          cp_async<16>(vd + (16 * u + kRowStep * i) * St::kVRow, vp + i * row_step, ok);
        }
        cp_async<St::kS>(sd + 16 * u * St::kS, page_at(s_base, page, s_page, pos0 * s_step),
                         static_cast<int32_t>(stok) < n_ok);
      }
      const uint32_t mask = ((1u << kTiles) - 1u) << (st * kTiles);
      valid = (valid & ~mask) | (vbits << (st * kTiles));
    }
    prefetch(togo);
  };

  // Computes step n from stage st. kFull: every token of the step exists, its pages are valid and
  // every real row attends to all of it: no per-token test (most steps of a decode).
  const auto compute = [&](int64_t n, int st, auto full_tag) {
    constexpr bool kFull = decltype(full_tag)::value;
    const int64_t s0 = first_s0 + n * (kDecodeWarps * kStep);
    const uint8_t* sp = stages_p + st * St::kBytes;
    // Tile u: n_ok[u] tokens exist and their page is valid, or (kPerToken) token e
    // exists and its page is valid where bit e of okm[u] is set. tok_off(u, e): token e of tile u
    // does not exist or is in a masked page.
    int32_t n_ok[kTiles];
    uint32_t okm[kTiles];
#pragma unroll
    for (int u = 0; u < kTiles; ++u) {
      if constexpr (kPerToken) {
        const int32_t exist = static_cast<int32_t>(max64(min64(16, hi - (s0 + 16 * u)), 0));
        okm[u] = static_cast<uint32_t>(tok_valid >> (32 * st + 16 * u)) & ((1u << exist) - 1u);
        n_ok[u] = 0;  // unused
      } else {
        n_ok[u] = kFull ? 16 : (valid >> (st * kTiles + u)) & 1u ? static_cast<int32_t>(min64(16, hi - (s0 + 16 * u))) : 0;
        okm[u] = 0u;  // unused
      }
    }
    const auto tok_off = [&](int u, int e) { return kPerToken ? ((okm[u] >> e) & 1u) == 0u : e >= n_ok[u]; };

    // Logits: S^T[token][row], lane (g, t) holds tokens g, g + 8 and rows 2t, 2t + 1.
    float sc[kTiles][kN][4];
#pragma unroll
    for (int u = 0; u < kTiles; ++u) {
#pragma unroll
      for (int n = 0; n < kN; ++n) sc[u][n][0] = sc[u][n][1] = sc[u][n][2] = sc[u][n][3] = 0.0f;
      uint32_t kw[2][kKW], s2[2][kKG];
#pragma unroll
      for (int a = 0; a < 2; ++a) {
        const int tok = 16 * u + g + 8 * a;
        const uint8_t* row = sp + St::kK + tok * St::kKRow;
        if constexpr (kD == 64) {
          const uint2 v = *reinterpret_cast<const uint2*>(row + 8 * t);
          kw[a][0] = v.x, kw[a][1] = v.y;
        } else {
#pragma unroll
          for (int c = 0; c < kKW / 4; ++c) {
            const uint4 v = *reinterpret_cast<const uint4*>(row + 16 * t + 64 * c);
            kw[a][4 * c] = v.x, kw[a][4 * c + 1] = v.y, kw[a][4 * c + 2] = v.z, kw[a][4 * c + 3] = v.w;
          }
        }
        const uint8_t* ks = sp + St::kKs + tok * St::kS;
        uint32_t bytes;
        if constexpr (kD == 64) bytes = ks[t];
        else if constexpr (kD == 128) bytes = *reinterpret_cast<const uint16_t*>(ks + 2 * t);
        else
          bytes = *reinterpret_cast<const uint16_t*>(ks + 2 * t) |
                  static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(ks + 8 + 2 * t)) << 16;
        // Both halves of one conversion hold two groups' scales; each multiply takes one half
        // twice (an operand selector of the fp16 multiply, no instruction of its own).
        const uint32_t c0 = e4m3x2_f16x2<0>(bytes);
        s2[a][0] = f16x2_bcast<0>(c0);
        if constexpr (kKG > 1) s2[a][1] = f16x2_bcast<1>(c0);
        if constexpr (kKG > 2) {
          const uint32_t c1 = e4m3x2_f16x2<1>(bytes);
          s2[a][2] = f16x2_bcast<0>(c1), s2[a][3] = f16x2_bcast<1>(c1);
        }
      }
#pragma unroll
      for (int w = 0; w < kKW; ++w) {  // word w: chunks 2w and 2w + 1 (fp16x2 4w .. 4w + 3)
        uint32_t h0[4], h1[4];
        unpack_word(kw[0][w], h0);
        unpack_word(kw[1][w], h1);
        const int k = w / 2;  // its scale group
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const uint32_t a0 = mul_f16x2(h0[2 * c], s2[0][k]), a1 = mul_f16x2(h1[2 * c], s2[1][k]);
          const uint32_t a2 = mul_f16x2(h0[2 * c + 1], s2[0][k]), a3 = mul_f16x2(h1[2 * c + 1], s2[1][k]);
#pragma unroll
          for (int n = 0; n < kN; ++n)  // one unpacked K fragment for every n-tile of query rows
            mma_16816(sc[u][n], a0, a1, a2, a3, qb[n][4 * w + 2 * c], qb[n][4 * w + 2 * c + 1]);
        }
      }
    }

    // Token s0 + e is in the range of row 8n + 2t + j when lo_e <= e < hi_e (relative to s0).
    int32_t lo_e[kN][2], hi_e[kN][2];
#pragma unroll
    for (int n = 0; n < kN; ++n)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        lo_e[n][j] = kFull ? 0 : static_cast<int32_t>(min64(max64(first[n][j] - s0, -1), kStep));
        hi_e[n][j] = kFull ? kStep : static_cast<int32_t>(max64(min64(min64(last[n][j] + 1, hi) - s0, kStep), 0));
      }

    // Online softmax per row (log2 domain); rows 8n + 2t + j of this lane, tokens over g and tiles.
    // The probabilities are taken against the running maximum m as it stands while no logit of
    // the warp exceeds it by more than kSlack (they reach at most 2^kSlack, well inside fp16):
    // no reduction over the lanes waits between the logits and the exponentials. Otherwise (the
    // first steps, typically; a NaN, or a row that has seen nothing yet) m moves to the step's
    // maximum, as the classic online softmax does.
    constexpr float kSlack = kDecodeSlackLog2;  // params.h
    float pr[kTiles][kN][4];
    bool slow = false;
#pragma unroll
    for (int n = 0; n < kN; ++n)
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int u = 0; u < kTiles; ++u)
#pragma unroll
          for (int a = 0; a < 2; ++a) {
            float x = sc[u][n][2 * a + j] * kq[n][j];
            if constexpr (kCapped) x = p.soft_cap * tanhf(x / p.soft_cap) * kLog2e;
            if (!kFull) {
              const int32_t e = 16 * u + g + 8 * a;
              x = (kPerToken ? !tok_off(u, g + 8 * a) : n_ok[u] > 0) && e >= lo_e[n][j] && e < hi_e[n][j] ? x : -INFINITY;
            }
            sc[u][n][2 * a + j] = x;
            const float d = x - m[n][j];
            slow |= !(d <= kSlack);  // also NaN: -inf - -inf, a NaN logit
            pr[u][n][2 * a + j] = d;
          }
    // A step that breaks the slack first moves each row's maximum and rescales what the row has
    // summed; then both kinds of step take their exponentials against m as it stands.
    if (__any_sync(0xffffffffu, slow)) {
      float corr[kN][2];
      bool moved = false;
#pragma unroll
      for (int n = 0; n < kN; ++n)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          float mx = -INFINITY;
#pragma unroll
          for (int u = 0; u < kTiles; ++u)
#pragma unroll
            for (int a = 0; a < 2; ++a) mx = fmaxf(mx, sc[u][n][2 * a + j]);
#pragma unroll
          for (int o_ = 4; o_ < 32; o_ <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o_));
          const float m_new = fmaxf(m[n][j], mx);
          const float m_use = m_new == -INFINITY ? 0.0f : m_new;  // a row that has seen nothing: p = 0
          corr[n][j] = exp2_ftz(m[n][j] - m_use);
          moved |= m_new != m[n][j];
#pragma unroll
          for (int u = 0; u < kTiles; ++u)
#pragma unroll
            for (int a = 0; a < 2; ++a) pr[u][n][2 * a + j] = sc[u][n][2 * a + j] - m_use;
          l[n][j] *= corr[n][j];
          m[n][j] = m_new;
        }
      // A step that moved no row's maximum (a NaN, rows that have seen nothing) rescales nothing.
      if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
        for (int n = 0; n < kN; ++n)
#pragma unroll
          for (int i = 0; i < kM; ++i) {
            o[n][i][0] *= corr[n][0];
            o[n][i][1] *= corr[n][1];
            o[n][i][2] *= corr[n][0];
            o[n][i][3] *= corr[n][1];
          }
      }
    }
#pragma unroll
    for (int n = 0; n < kN; ++n)
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        float sum = 0.0f;
#pragma unroll
        for (int u = 0; u < kTiles; ++u)
#pragma unroll
          for (int a = 0; a < 2; ++a) {
            const float e = exp2_ftz(pr[u][n][2 * a + j]);
            pr[u][n][2 * a + j] = e;
            sum += e;
          }
        l[n][j] += sum;
      }

    // Output: O^T[element][row] += V^T P^T per tile.
#pragma unroll
    for (int u = 0; u < kTiles; ++u) {
      uint32_t pb0[kN], pb1[kN];
#pragma unroll
      for (int n = 0; n < kN; ++n) {
        pb0[n] = transpose_8x8(pack_f16x2(pr[u][n][0], pr[u][n][1]));  // tokens 2t, 2t+1; row 8n + g
        pb1[n] = transpose_8x8(pack_f16x2(pr[u][n][2], pr[u][n][3]));  // tokens 2t+8, 2t+9
      }
      uint32_t vw[4][kVW], s2[2][kVG];
      uint32_t nan_tok[kVG];  // bit e: token e of the tile has a NaN V group k (this lane's tokens)
#pragma unroll
      for (int k = 0; k < kVG; ++k) nan_tok[k] = 0u;
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const int e0 = 2 * t + 8 * q;  // tokens e0, e0 + 1 of the tile
#pragma unroll
        for (int z = 0; z < 2; ++z) {
          const uint8_t* row = sp + St::kV + (16 * u + e0 + z) * St::kVRow + v_slice;
          if constexpr (kVW == 1) {
            vw[2 * q + z][0] = *reinterpret_cast<const uint32_t*>(row);
          } else if constexpr (kVW == 2) {
            const uint2 v = *reinterpret_cast<const uint2*>(row);
            vw[2 * q + z][0] = v.x, vw[2 * q + z][1] = v.y;
          } else {
            const uint4 v = *reinterpret_cast<const uint4*>(row);
            vw[2 * q + z][0] = v.x, vw[2 * q + z][1] = v.y, vw[2 * q + z][2] = v.z, vw[2 * q + z][3] = v.w;
          }
        }
#pragma unroll
        for (int k = 0; k < kVG; ++k) {
          const int G = v_group + k, tok = 16 * u + e0;
          uint32_t two = vat.interleaved
                             ? *reinterpret_cast<const uint16_t*>(sp + St::kVs + (tok / 4) * 4 * St::kS + 4 * G + tok % 4)
                             : sp[St::kVs + tok * St::kS + G] | static_cast<uint32_t>(sp[St::kVs + (tok + 1) * St::kS + G]) << 8;
          if (!kFull) {
            // Scale bytes of tokens past the end are not data: their V is 0.
            if (tok_off(u, e0)) two &= 0xFF00u;
            if (tok_off(u, e0 + 1)) two &= 0x00FFu;
            // A NaN group (scale byte 0x7F or 0xFF) must reach only the rows that attend its
            // token, but the product would carry 0 x NaN = NaN to the rows that mask it: its V
            // becomes 0 here, and the rows that attend it are marked below (vnan).
            const bool n0 = (two & 0x7Fu) == kScaleNaN, n1 = ((two >> 8) & 0x7Fu) == kScaleNaN;
            nan_tok[k] |= (n0 ? 1u << e0 : 0u) | (n1 ? 2u << e0 : 0u);
            two &= (n0 ? 0xFF00u : 0xFFFFu) & (n1 ? 0x00FFu : 0xFFFFu);
          }
          s2[q][k] = e4m3x2_f16x2(two);
        }
      }
#pragma unroll
      for (int w = 0; w < kVW; ++w) {
        // Pair q: tokens (2t, 2t+1) + 8q, side by side; hv[q][n] holds element 8w + n of both.
        uint32_t hv[2][8];
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          uint32_t x[2], hh[4];
          v_interleave(vw[2 * q][w], vw[2 * q + 1][w], x);
          const uint32_t sv = s2[q][kVG > 1 ? w / 2 : 0];  // 8w is in the slice's group w / 2
#pragma unroll
          for (int k = 0; k < 2; ++k) {
            unpack_word(x[k], hh);
#pragma unroll
            for (int i = 0; i < 4; ++i) hv[q][4 * k + i] = mul_f16x2(hh[i], sv);
          }
        }
        // mma tile 4w + mi: elements 8w + 2mi (A rows g) and 8w + 2mi + 1 (A rows g + 8).
#pragma unroll
        for (int mi = 0; mi < 4; ++mi)
#pragma unroll
          for (int n = 0; n < kN; ++n)
            mma_16816(o[n][4 * w + mi], hv[0][2 * mi], hv[0][2 * mi + 1], hv[1][2 * mi], hv[1][2 * mi + 1], pb0[n],
                      pb1[n]);
      }
      if (!kFull) {
        // The 4 lanes of slice g hold its 16 tokens; this lane's rows that attend a NaN token
        // take NaN in that group's elements (as the CPU path, which reads only attended tokens).
#pragma unroll
        for (int k = 0; k < kVG; ++k) {
          if (!__any_sync(0xffffffffu, nan_tok[k] != 0u)) continue;  // warp-uniform, rare
          uint32_t bits = nan_tok[k];
          bits |= __shfl_xor_sync(0xffffffffu, bits, 1);
          bits |= __shfl_xor_sync(0xffffffffu, bits, 2);
#pragma unroll
          for (int n = 0; n < kN; ++n)
#pragma unroll
            for (int j = 0; j < 2; ++j) {
              const int32_t a = min(max(lo_e[n][j] - 16 * u, 0), 16), z = min(max(hi_e[n][j] - 16 * u, 0), 16);
              const uint32_t seen = ((1u << z) - 1u) & ~((1u << a) - 1u);
              if (bits & seen) vnan[n][j] |= 1u << k;
            }
        }
      }
    }
  };

  // The pipeline: step i's copies start kMmaStages - 1 steps before step i is computed (one
  // call site each, so that the lambdas inline); the query fragment is built while step 0's
  // copies are on their way (every thread runs i = 0: the loop runs at least once).
  // Steps n0_full <= n < n1_full lie inside [first_all, last_all] and before the split's end:
  // full when their pages are valid.
  const auto floor_div = [](int64_t a, int64_t b) { return a >= 0 ? a / b : -((-a + b - 1) / b); };
  const int64_t n0_full = -floor_div(first_s0 - first_all, kAdvance);  // ceil((first_all - first_s0) / kAdvance)
  const int64_t n1_full = floor_div(min64(hi, last_all + 1) - kStep - first_s0, kAdvance) + 1;
  // Clamped to [0, nsteps] before the cast: a length of 2^38 with a window put n0_full past
  // 2^31, whose int32 wrapped and made every step "full" (unmasked; review).
  const int32_t n0 = static_cast<int32_t>(min64(max64(n0_full, 0), nsteps));
  const int32_t n1 = static_cast<int32_t>(max64(min64(n1_full, nsteps), 0));
  const int32_t steps = static_cast<int32_t>(nsteps);
  if (steps > 0) issue(0, lane0, lane1);
  cp_async_commit();
  build_query();
  for (int32_t i = 1; i < steps + kMmaStages - 1; ++i) {
    if (i < steps) {
      if constexpr (kLaneSmem)
        issue(i % kMmaStages, ld_shared16(lane_c), ld_shared16(lane_c + kLaneStride));
      else
        issue(i % kMmaStages, lane0, lane1);
    }
    cp_async_commit();  // possibly empty: the wait below counts groups
    const int32_t n = i - (kMmaStages - 1);
    if (n < 0) continue;
    const int st = n % kMmaStages;
    cp_async_wait<kMmaStages - 1>();  // step n's copies (this lane's) have landed
    __syncwarp();                     // and every lane's
    constexpr uint32_t kStepBits = kStep == 32 ? 0xFFFFFFFFu : (1u << kStep) - 1u;  // kPerToken: every token's
    const bool pages_ok = kPerToken ? (static_cast<uint32_t>(tok_valid >> (32 * st)) & kStepBits) == kStepBits
                                 : ((valid >> (st * kTiles)) & ((1u << kTiles) - 1)) == (1u << kTiles) - 1;
    const bool full = pages_ok && n >= n0 && n < n1;
    if (full)
      compute(n, st, std::true_type{});
    else
      compute(n, st, std::false_type{});
    __syncwarp();  // every lane is done with stage st before a later issue overwrites it
  }
  cp_async_wait<0>();

  // Each lane's denominators are partial (its tokens): sum over the 8 lanes of a row pair.
#pragma unroll
  for (int n = 0; n < kN; ++n)
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int o_ = 4; o_ < 32; o_ <<= 1) l[n][j] += __shfl_xor_sync(0xffffffffu, l[n][j], o_);
      if (g == 0) {
        m_s[warp][8 * n + 2 * t + j] = m[n][j] == -INFINITY ? -INFINITY : m[n][j] / kLog2e;  // natural log
        l_s[warp][8 * n + 2 * t + j] = l[n][j];
      }
    }
  __syncwarp();  // every lane is done with the warp's stages (all its copies landed): its outputs go there
  auto& acc_s = *reinterpret_cast<float(*)[kRows][mma_out_row<kD>()]>(smem + kStagesAt + warp * kWarpBytes);
  // The V loop's C fragments: tile 4w + mi holds element 8w + 2mi of lane g's slice in c0, c1 and
  // 8w + 2mi + 1 in c2, c3 (rows 8n + 2t, 8n + 2t + 1).
#pragma unroll
  for (int n = 0; n < kN; ++n)
#pragma unroll
    for (int i = 0; i < kM; ++i) {
      const int e = (i / 4) * 8 + 2 * (i % 4);
      const int d = g * (kD / 8) + e;
      const int k = kVG > 1 ? i / 8 : 0;  // e's scale group in the slice
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const bool nan = (vnan[n][j] >> k) & 1u;
        acc_s[8 * n + 2 * t + j][d] = nan ? quiet_nan() : o[n][i][j] * kUnpackScale;
        acc_s[8 * n + 2 * t + j][d + 1] = nan ? quiet_nan() : o[n][i][2 + j] * kUnpackScale;
      }
    }
  __syncthreads();
  float* const part = L.cluster ? reinterpret_cast<float*>(smem + kPartAt) : nullptr;
  const float* acc = reinterpret_cast<const float*>(smem + kStagesAt);
  if (p.dtype == DType::kFloat16) {
    merge_warps<DType::kFloat16, kD, kRows>(L, b, h, r0, R, split, m_s, l_s, acc, kWarpBytes / 4, mma_out_row<kD>(),
                                            part);
    if (L.cluster) merge_cluster<DType::kFloat16, kD>(L, b, h, r0, R, split, part);
  } else {
    merge_warps<DType::kBFloat16, kD, kRows>(L, b, h, r0, R, split, m_s, l_s, acc, kWarpBytes / 4, mma_out_row<kD>(),
                                             part);
    if (L.cluster) merge_cluster<DType::kBFloat16, kD>(L, b, h, r0, R, split, part);
  }
}

// Merges the splits of one (row, query head). The (max, denominator) of every split are loaded
// at once (thread s takes split s) and reduced by warp shuffles in a fixed order; kCombineGroups
// threads per output element each sum a fixed residue class of the splits (s = q mod
// kCombineGroups, in increasing order) with all of their loads in flight, and the groups are
// added in group order: the same bits on every run. A loop that waits for one load per split
// costs a cache latency per split (about 30 us at 64 splits, measured on the H200); the chain
// from the reader's end to the output is what this kernel's time is (design notes: "the split
// merge's chain").
constexpr int kCombineGroups = 2;

template <DType kDType, int kD>
__global__ void __launch_bounds__(kD * kCombineGroups) decode_combine_kernel(const __grid_constant__ DecodeLaunch L) {
  static_assert(kD * kCombineGroups >= kDecodeMaxSplits && kDecodeMaxSplits % 32 == 0, "whole warps of splits");
  constexpr int kPerGroup = kDecodeMaxSplits / kCombineGroups;
  constexpr int kSplitWarps = kDecodeMaxSplits / 32;
  const DecodeParams& p = L.p;
  __shared__ float c_s[kDecodeMaxSplits], max_s[kSplitWarps], sum_s[kSplitWarps];
  __shared__ float o_s[kCombineGroups][kD];
  // The value scale is read before the wait: the reader, the only grid this one can overlap,
  // does not write it, and every grid before the reader has completed once this one starts (the
  // reader's blocks allow it only after their own wait).
  const float vscale = read_scale(p.v_scale);
  wait_for_prior_grids();
  allow_next_grids();
  const int64_t Hq = int64_t{p.H} * p.group;
  const int64_t unit = blockIdx.x;  // row * Hq + hq
  const int64_t row = unit / Hq, hq = unit % Hq;
  constexpr int kPart = decode_partial_floats(kD);
  const float* part = p.workspace + unit * L.splits * kPart;
  const int tid = threadIdx.x, q = tid / kD, d = tid % kD, lane = tid % 32;
  const int splits = L.splits;
  const bool has_split = tid < splits;  // threads below kDecodeMaxSplits: split tid
  const float m = has_split ? part[tid * kPart] : -INFINITY;
  const float l = has_split ? part[tid * kPart + 1] : 0.0f;
  float v[kPerGroup];  // loaded with the maxima: one cache latency, not two
#pragma unroll
  for (int k = 0; k < kPerGroup; ++k) {
    const int s = q + kCombineGroups * k;
    v[k] = s < splits ? part[s * kPart + 2 + d] : 0.0f;
  }
  float M = m;
  if (tid < kDecodeMaxSplits) {
#pragma unroll
    for (int o_ = 1; o_ < 32; o_ <<= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o_));
    if (lane == 0) max_s[tid / 32] = M;
  }
  __syncthreads();
  M = max_s[0];
#pragma unroll
  for (int w = 1; w < kSplitWarps; ++w) M = fmaxf(M, max_s[w]);
  if (tid < kDecodeMaxSplits) {
    const float c = merge_weight(m, M);
    c_s[tid] = c;
    float sum = l * c;
#pragma unroll
    for (int o_ = 16; o_ > 0; o_ >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o_);
    if (lane == 0) sum_s[tid / 32] = sum;
  }
  __syncthreads();
  float o = 0.0f;
#pragma unroll
  for (int k = 0; k < kPerGroup; ++k) {
    const int s = q + kCombineGroups * k;
    if (s < splits) o += v[k] * c_s[s];
  }
  o_s[q][d] = o;
  __syncthreads();
  if (q != 0) return;
  o = 0.0f;
#pragma unroll
  for (int g = 0; g < kCombineGroups; ++g) o += o_s[g][d];
  float lsum = 0.0f;
#pragma unroll
  for (int w = 0; w < kSplitWarps; ++w) lsum += sum_s[w];
  store_result<kDType>(p, row, hq, d, o, lsum, M, vscale);
}

// n-tiles of query rows per block of the tensor-core reader: two where a block has more than 8
// rows (q_len 2-8 times the GQA group) and D <= 128 has the registers for them.
inline int mma_row_tiles(int D, int rows) { return rows > kMmaRowsPerTile && D <= 128 ? 2 : 1; }

// Whether a cluster of `size` blocks of `kernel` can be resident on this device (asked once per
// device and size): a GPU whose partition or sharing leaves no room for one merges the splits in
// the second kernel instead of failing the launch.
template <auto kernel, size_t kSmem>
bool cluster_fits(int device, int size) {
  static std::atomic<uint8_t> known[64][kMaxClusterSplits + 1];  // 0: not asked, 1: fits, 2: does not
  const bool keep = device >= 0 && device < 64 && size >= 1 && size <= kMaxClusterSplits;
  if (keep) {
    const uint8_t k = known[device][size].load(std::memory_order_relaxed);
    if (k != 0) return k == 1;
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(size));
  config.blockDim = dim3(kDecodeThreads);
  config.dynamicSmemBytes = kSmem;
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = static_cast<unsigned>(size);
  attr.val.clusterDim.y = attr.val.clusterDim.z = 1;
  config.attrs = &attr;
  config.numAttrs = 1;
  int clusters = 0;
  const bool fits = cudaOccupancyMaxActiveClusters(&clusters, kernel, &config) == cudaSuccess && clusters > 0;
  if (!fits) (void)cudaGetLastError();  // the query's own error: the launch goes without a cluster
  if (keep) known[device][size].store(fits ? 1 : 2, std::memory_order_relaxed);
  return fits;
}

template <int kD, int kN, bool kCapped, bool kPerToken, bool kByLength, int kCopy>
cudaError_t launch_mma_kernel(DecodeLaunch& L, dim3 grid, int device, cudaStream_t stream) {
  // Two tiles per step halve the per-step overhead; D 256 has the registers for one.
  constexpr int kTiles = kD >= 256 ? 1 : 2;
  constexpr auto kernel = decode_mma_kernel<kD, kTiles, kN, kCapped, kPerToken, kByLength, kCopy>;
  constexpr size_t smem = mma_smem_bytes<kD, kTiles, kN>();
  const cudaError_t err = allow_shared_memory<kernel, smem>(device);
  if (err != cudaSuccess) return err;
  // The splits merge in their cluster where the plan says so (it asks for code compiled for 9.0
  // or later: merge_cluster's body is compiled out below, and a build of compute_80 PTX alone,
  // compiled by the driver for a Hopper GPU, would leave the outputs unwritten; design notes:
  // "Programmatic dependent launch") and the device can hold such a cluster; otherwise
  // launch_decode launches the second kernel. The plan counts the blocks of the whole call, not
  // of this launch's 65535 sequences: every launch of a call must decide alike, since the second
  // kernel runs once for all of them.
  const int64_t blocks = int64_t{L.splits} * L.p.H * L.chunks.d * L.p.B;
  L.cluster = decode_cluster_merge(kCopy == 16 ? DecodeKernel::kMma : DecodeKernel::kMmaNarrow, L.splits, blocks,
                                   device_info(device)) &&
              cluster_fits<kernel, smem>(device, L.splits);
  return launch_pdl(kernel, grid, dim3(kDecodeThreads), device, stream, L, smem, L.cluster ? L.splits : 1);
}

template <int kD, int kN, bool kCapped, bool kPerToken, int kCopy>
cudaError_t launch_mma(DecodeLaunch& L, dim3 grid, int device, cudaStream_t stream) {
  return L.by_length ? launch_mma_kernel<kD, kN, kCapped, kPerToken, true, kCopy>(L, grid, device, stream)
                     : launch_mma_kernel<kD, kN, kCapped, kPerToken, false, kCopy>(L, grid, device, stream);
}

// The tensor-core reader's kernel for the block's query rows and the soft cap.
template <int kD, bool kPerToken, int kCopy = 16>
cudaError_t launch_mma_rows(DecodeLaunch& L, int rows, dim3 grid, int device, cudaStream_t stream) {
  const bool capped = L.p.soft_cap > 0.0f;
  if (mma_row_tiles(kD, rows) == 2)
    return capped ? launch_mma<kD, kD <= 128 ? 2 : 1, true, kPerToken, kCopy>(L, grid, device, stream)
                  : launch_mma<kD, kD <= 128 ? 2 : 1, false, kPerToken, kCopy>(L, grid, device, stream);
  return capped ? launch_mma<kD, 1, true, kPerToken, kCopy>(L, grid, device, stream)
                : launch_mma<kD, 1, false, kPerToken, kCopy>(L, grid, device, stream);
}

template <DType kDType, int kD>
cudaError_t launch_decode(DecodeLaunch& L, DecodeKernel kind, int device, cudaStream_t stream) {
  const DecodeParams& p = L.p;
  const int rows = p.group * p.q_len;
  const auto lanes = rows <= 1   ? decode_kernel<kDType, kD, 1>
                     : rows <= 2 ? decode_kernel<kDType, kD, 2>
                     : rows <= 4 ? decode_kernel<kDType, kD, 4>
                                 : decode_kernel<kDType, kD, kMaxRows>;
  for (int64_t b0 = 0; b0 < p.B; b0 += 65535) {
    L.b0 = b0;
    const dim3 grid(static_cast<unsigned>(L.splits), static_cast<unsigned>(p.H * L.chunks.d),
                    static_cast<unsigned>(std::min<int64_t>(65535, p.B - b0)));
    cudaError_t err;
    if (kind == DecodeKernel::kMma)
      err = decode_per_token_pages(p.T) ? launch_mma_rows<kD, true>(L, rows, grid, device, stream)
                                        : launch_mma_rows<kD, false>(L, rows, grid, device, stream);
    else if (kind == DecodeKernel::kMmaNarrow)  // per-token pages (select_decode_kernel); never at D 256
      err = launch_mma_rows<kD, true, decode_narrow_copy(kD)>(L, rows, grid, device, stream);
    else
      err = launch_pdl(lanes, grid, dim3(kDecodeThreads), device, stream, L);
    if (err != cudaSuccess) return err;
  }
  if (L.splits > 1 && !L.cluster) {
    const int64_t units = p.B * p.q_len * int64_t{p.H} * p.group;
    // One block per (row, query head): splits > 1 only where B * H is small (decode_splits).
    const cudaError_t err =
        launch_pdl(decode_combine_kernel<kDType, kD>, dim3(static_cast<unsigned>(units)), dim3(kD * kCombineGroups), device,
                   stream, L);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

template <DType kDType>
cudaError_t decode_dtype(DecodeLaunch& L, DecodeKernel kind, int device, cudaStream_t stream) {
  switch (L.p.k.D) {
    case 64: return launch_decode<kDType, 64>(L, kind, device, stream);
    case 128: return launch_decode<kDType, 128>(L, kind, device, stream);
    default: return launch_decode<kDType, 256>(L, kind, device, stream);
  }
}

}  // namespace

int cuda_decode(const DecodeParams& p, int device, void* stream_ptr, const char** message) {
  *message = nullptr;
  // Equal head sizes of 64, 128 or 256 and 4-byte aligned sides: checked by the C ABI.
  if (p.B == 0) return 0;
  DeviceGuard guard(device);
  if (guard.error() != cudaSuccess) return guard.error();
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  DecodeLaunch L;
  L.p = p;
  // With a window the splits cover the columns a sequence's window can touch (split_cols), not
  // the whole table.
  const int64_t span = decode_span_cols(p.max_blocks, p.T, p.q_len, p.window_left);
  L.window = span < p.max_blocks;
  L.unit_shift = decode_unit_shift(p.T);
  const DecodeSplit split = plan_decode_split(p.B, p.H, span, p.T);
  L.splits = static_cast<int32_t>(split.splits);
  // The splits follow the lengths where a short sequence would otherwise leave its work to a
  // few of them (decode_by_length); not where every split is short, since taking the splits from
  // the lengths cost 0.33 us at 1 x 1024 (design notes: "Decode attention: splits from the
  // lengths").
  L.by_length = decode_by_length(split, p.T, L.window);
  if (L.splits > 1 && (p.workspace == nullptr ||
                       p.workspace_floats < decode_workspace_floats(p.B * p.q_len, int64_t{p.H} * p.group, p.v.D, L.splits))) {
    *message = "decode_attention: this geometry splits each sequence and needs a workspace (nvfp4kv.decode_workspace)";
    return cudaErrorInvalidValue;
  }
  L.cols_per_split = split.cols;
  L.off[0] = SideOffsets::make(p.k, p.layout, p.H, p.T);
  L.off[1] = SideOffsets::make(p.v, p.layout, p.H, p.T);
  L.block_size = FastDiv(static_cast<uint32_t>(p.T));
  L.q_len = FastDiv(static_cast<uint32_t>(p.q_len));
  L.q_vec = aligned(16, p.query, {p.q_stride[0], p.q_stride[1]}, 2);
  constexpr double k2G = 2147483648.0, k4G = 4294967296.0;
  const auto d = [](int64_t x) { return static_cast<double>(x); };
  const auto align = [&](int64_t to) {
    return aligned(to, p.k.base, {p.k.page_stride}) && aligned(to, p.v.base, {p.v.page_stride});
  };
  const DecodeKernel kind = select_decode_kernel(
      {p.T, p.k.D, align(16) ? 16 : align(8) ? 8 : align(4) ? 4 : 1, p.k.interleaved != 0,
       d(p.N) < k2G && d(p.k.page_stride) < k4G && d(p.v.page_stride) < k4G && p.bt_stride[1] >= 0 &&
           d(p.max_blocks) * d(p.bt_stride[1]) * 8.0 < k4G && d(L.cols_per_split) * d(p.T) < k2G});
  const int rows = p.group * p.q_len;
  const int per_block = decode_mma(kind) ? kMmaRowsPerTile * mma_row_tiles(p.k.D, rows)
                        : rows <= 1                ? 1
                        : rows <= 2                ? 2
                        : rows <= 4                ? 4
                                                   : kMaxRows;  // as launch_decode
  L.chunks = FastDiv(static_cast<uint32_t>((rows + per_block - 1) / per_block));
  if (int64_t{p.H} * L.chunks.d > 65535) {  // the grid's y dimension (review: H 8192 at T 1)
    *message = "decode_attention on the GPU takes at most 65535 (KV head, query-row block) pairs: num_kv_heads "
               "times ceil(group * q_len / rows per block), 8 or 16 rows a block; fewer KV heads per call";
    return cudaErrorInvalidValue;
  }
  L.cluster = false;  // the tensor-core reader's launch decides (launch_mma)
  const cudaError_t err = p.dtype == DType::kFloat16 ? decode_dtype<DType::kFloat16>(L, kind, device, stream)
                                                     : decode_dtype<DType::kBFloat16>(L, kind, device, stream);
  if (err != cudaSuccess) *message = check_kernel_image(err);
  return err;
}

}  // namespace nvfp4kv
