// Parameter structs of the operations: plain memory descriptions, filled and validated by the C
// ABI (capi.cpp), consumed by the CPU loops (cpu.cpp) and passed whole to the CUDA kernels
// (cuda/) as one __grid_constant__ argument. No pointers to host objects, no owning members.
#pragma once

#include <stdint.h>

#include "nvfp4kv/format.h"

namespace nvfp4kv {

// One side (K or V) of the cache.
struct CacheSide {
  uint8_t* base;        // this side of page 0
  int64_t page_stride;  // bytes between pages
  int32_t D;            // head size of this side
  int32_t interleaved;  // token-4 interleaved scales (HND only)
};

// A global scale: the value when it is known on the host, else a device pointer read by the
// kernel (CUDA graphs replay with whatever the pointer holds then).
struct ScaleArg {
  const float* device_ptr;  // nullptr: use `value`
  float value;
};

struct StoreSide {
  const void* src;        // [num_tokens, H, D] elements
  int64_t token_stride;   // elements
  int64_t head_stride;    // elements
  CacheSide cache;
  ScaleArg scale;
};

// An int32 or int64 vector (slot lists, page lists, sequence lengths).
struct IndexVec {
  const void* ptr;   // nullptr: absent
  int64_t stride;    // elements
  int32_t is_int64;
};

NVFP4KV_HD int64_t load_index(const IndexVec& v, int64_t i) {
  return v.is_int64 ? static_cast<const int64_t*>(v.ptr)[i * v.stride]
                    : static_cast<const int32_t*>(v.ptr)[i * v.stride];
}

// The store's workspace (nvfp4kv_store_with_workspace): int32 words
//   [count, done, 0, 0 | claim: N | index: N | pages: N | token: N * T | order: N * T]
// with which the CUDA store of a large batch first lists the pages its tokens target and the
// token of each targeted slot, then writes page by page (cuda/store.cu). Between calls only
// count and done must be 0, and every call leaves them so; the other words may hold anything
// (an earlier call's entries, or whatever the memory held): claim and token entries are checked
// against the call's own slot_mapping before they are used, the rest is written before it is read.
struct StoreWorkspaceLayout {
  int64_t claim, index, pages, token, order, words;  // word offsets of the parts, and the total

  NVFP4KV_HD static StoreWorkspaceLayout of(int64_t N, int64_t T) {
    return StoreWorkspaceLayout{4, 4 + N, 4 + 2 * N, 4 + 3 * N, 4 + 3 * N + N * T, 4 + 3 * N + 2 * N * T};
  }
};

NVFP4KV_HD int64_t store_workspace_words(int64_t N, int64_t T) { return StoreWorkspaceLayout::of(N, T).words; }

struct StoreParams {
  StoreSide k, v;
  IndexVec slots;         // [num_tokens]
  int64_t num_tokens;
  int64_t num_slots;      // N * T
  int32_t H, T;
  DType dtype;
  Layout layout;
  Recipe recipe;
  int32_t* workspace;     // store_workspace_words(N, T) words on the cache's device, or nullptr
};

struct DequantSide {
  CacheSide cache;
  ScaleArg scale;
  void* out;              // (N, T, H, D) elements
  int64_t out_stride[3];  // elements, for N, T, H
};

struct DequantParams {
  DequantSide k, v;
  IndexVec pages;    // pages to dequantize, written at the same page index; absent: all pages
  int64_t num_pages; // entries of `pages`, or N
  int64_t N;
  int32_t H, T;
  DType dtype;
  Layout layout;
};

// Read path for attention kernels without FP4: the tokens of each sequence, through its block
// table, into contiguous [total_tokens, H, D] outputs in varlen order.
struct GatherParams {
  DequantSide k, v;      // out_stride[0]: token, [1]: head; [2] unused
  const void* block_table;
  int64_t bt_stride[2];  // elements: sequence, block
  int32_t bt_int64;
  IndexVec seq_lens;     // [B]
  IndexVec cu_seqlens;   // [B + 1]: output row of each sequence's first token
  int64_t B, max_blocks, N, total_tokens;
  int32_t H, T;
  DType dtype;
  Layout layout;
};

// a * b for a, b >= 0, saturated at INT64_MAX: position and work bounds from sizes that a
// broadcast view (stride 0) can make as large as 2^62 (block-table columns, sequences).
NVFP4KV_HD int64_t mul_sat(int64_t a, int64_t b) { return b != 0 && a > INT64_MAX / b ? INT64_MAX : a * b; }

// The positions j of one sequence that a gather writes: those with j < len and an output row
// start + j inside [0, total), as [lo, hi). Every gather loop runs over this range only, so its
// work is bounded by the output whatever the (device-resident, unchecked) lengths and starts
// hold. total <= 2^62 (the C ABI's element bound); start + j never overflows.
struct SeqRows {
  int64_t lo, hi;
};

NVFP4KV_HD SeqRows gather_rows(int64_t len, int64_t start, int64_t total) {
  if (len <= 0 || start >= total) return SeqRows{0, 0};
  const int64_t lo = start >= 0 ? 0 : (start > -len ? -start : len);
  constexpr int64_t kMax = INT64_MAX;
  const int64_t room = start >= 0 || start >= total - kMax ? total - start : kMax;  // total - start, saturated
  const int64_t hi = len < room ? len : room;
  return SeqRows{lo, hi > lo ? hi : lo};
}

// Decode attention over the cache (nvfp4kv_decode_attention): q_len query rows per sequence at
// the end of the sequence, Hq = group * H query heads, outputs in the query's dtype. K and V are
// read as e2m1 * e4m3 (exact in fp32); the global scales are applied to the logits
// (k_scale * sm_scale) and to the output (v_scale). Query row i of sequence b (token position
// p = seq_len - q_len + i) attends to positions j <= p with j >= p - window_left (window_left
// < 0: no window); positions whose block-table entry is outside [0, N) are masked out and never
// read.
struct DecodeParams {
  CacheSide k, v;
  ScaleArg k_scale, v_scale;
  const void* query;          // [B * q_len, Hq, D] elements
  int64_t q_stride[2];        // elements: row, head
  void* out;                  // [B * q_len, Hq, Dv] elements, the query's dtype
  int64_t out_stride[2];      // elements: row, head
  float* lse;                 // [B * q_len, Hq] fp32 (natural log of the softmax denominator), or nullptr
  int64_t lse_stride[2];      // elements: row, head
  const void* block_table;
  int64_t bt_stride[2];       // elements: sequence, block
  int32_t bt_int64;
  IndexVec seq_lens;          // [B]
  int64_t B, max_blocks, N;
  int32_t H, T, group, q_len; // KV heads, block size, query heads per KV head, query rows per sequence
  float sm_scale;             // softmax scale (1/sqrt(D) by default)
  float soft_cap;             // logits_soft_cap: cap * tanh(logit / cap), 0: none
  int64_t window_left;        // < 0: none
  DType dtype;                // query and output: kFloat16 or kBFloat16
  Layout layout;
  float* workspace;           // split-KV partials (decode_workspace_floats), or nullptr
  int64_t workspace_floats;
};

// Query heads per KV head that decode takes (GQA groups 1 to 16): Hq a multiple of H, at most
// kDecodeMaxGroup times it. The C ABI's check, and the binding's guess of what it would refuse.
constexpr int kDecodeMaxGroup = 16;
inline bool decode_heads_ok(int64_t Hq, int64_t H) {
  return H > 0 && Hq > 0 && Hq % H == 0 && Hq / H <= kDecodeMaxGroup;
}

// The rule of format.h's global_scale_valid as the messages state it (the C ABI's and the
// binding's, which refuses a Python number before the ABI sees it), and the range it allows.
constexpr char kGlobalScaleRule[] =
    "a global scale must be a finite float32 > 0 with a finite reciprocal (about 2.9388e-39 to "
    "3.4028235e+38; the decode scale, usually amax / 448)";

// Split-KV of the CUDA decode (flash-decoding): the number of splits of each sequence's tokens,
// a function of the geometry alone (so a workspace sized once serves every call of that
// geometry, and a CUDA graph replays the same grid): enough (sequence, KV head, split) blocks to
// cover kDecodeTargetBlocks, at most kDecodeMaxSplits, and at least kDecodeMinSplitBlocks
// block-table columns per split (a split of a page or two spends its time on the block's setup
// and the merge, not on reading). More splits shorten the last partial wave of blocks but cost
// each split's setup and merge: "Decode attention: the tensor-core reader" has the measurement.
// Each split leaves, per query row and query head, its max logit, its softmax denominator and
// its Dv unnormalized outputs in the workspace, merged in split order (deterministic); short
// calls on sm_90+ merge inside a thread-block cluster instead and leave the workspace unused
// (cuda/plan.h, decode_cluster_merge).
constexpr int64_t kDecodeTargetBlocks = 512;
constexpr int64_t kDecodeMaxSplits = 64;
constexpr int64_t kDecodeMinSplitBlocks = 8;

NVFP4KV_HD int64_t decode_splits(int64_t B, int64_t H, int64_t max_blocks) {
  // B * H where it matters: from kDecodeTargetBlocks units on there is one split, so a larger
  // B or H need not be multiplied (nor overflow).
  int64_t units = 1;
  if (B > 0 && H > 0) units = B < kDecodeTargetBlocks && H < kDecodeTargetBlocks ? B * H : kDecodeTargetBlocks;
  int64_t s = (kDecodeTargetBlocks + units - 1) / units;
  s = s < kDecodeMaxSplits ? s : kDecodeMaxSplits;
  const int64_t most = max_blocks / kDecodeMinSplitBlocks;
  s = s < most ? s : most;
  return s > 1 ? s : 1;
}

// The block-table columns [col, col + cols) of split `split` of `splits` of one sequence of
// length len (the CUDA decode's blocks; design notes: "Decode attention: splits from the
// lengths"). The splits share the columns the sequence reads, not the table's: from c0 (0, or
// with `window`, the first of the run of `unit_cols` columns that holds the first token its
// earliest query row attends: a multiple of 16 tokens, where the tensor-core reader's tiles
// start) to c1 (the column of its last token, or the table's end), in runs of 2^unit_shift
// (decode_unit_cols(T)) columns, over the plan's splits or one per kDecodeMinSplitBlocks runs
// begun, whichever is fewer (so that no split is longer than the plan's: the readers' 32-bit
// token counts and the first prefetch rely on it); the first `active` splits take an equal share
// each, the rest none.
// A sequence that fills the table, without a window, has the plan's split exactly
// (plan_decode_split: split * cols). div_T(x): x / T for x >= 0.
struct SplitCols {
  int64_t col, cols;
};
template <class DivT>
NVFP4KV_HD SplitCols decode_split_cols(int64_t len, int64_t split, int64_t splits, int64_t max_blocks, int unit_shift,
                                       bool window, int64_t window_left, int64_t q_len, DivT div_T) {
  int64_t c1 = len > 0 ? div_T(len - 1) + 1 : 0;
  c1 = c1 < max_blocks ? c1 : max_blocks;
  int64_t c0 = 0;
  if (window) {  // window_left >= 0
    const int64_t last = len > 0 ? len - q_len : -1;  // the earliest row's last position
    const int64_t first = last > window_left ? last - window_left : 0;
    c0 = div_T(first) >> unit_shift << unit_shift;
    c0 = c0 < max_blocks ? c0 : max_blocks;
  }
  const int64_t units = ((c1 > c0 ? c1 - c0 : 0) + (int64_t{1} << unit_shift) - 1) >> unit_shift;
  int64_t active = (units + kDecodeMinSplitBlocks - 1) / kDecodeMinSplitBlocks;
  active = active < splits ? active : splits;
  active = active > 1 ? active : 1;
  const int64_t share = units < (int64_t{1} << 31) ? static_cast<int64_t>(static_cast<uint32_t>(units + active - 1) /
                                                                          static_cast<uint32_t>(active))
                                                   : (units + active - 1) / active;
  const int64_t cols = share << unit_shift;
  return {c0 + split * cols, cols};
}

// Floats of one split's partial of one query row and head: its maximum (natural log), its
// softmax denominator, then its Dv unnormalized outputs.
NVFP4KV_HD constexpr int64_t decode_partial_floats(int64_t Dv) { return Dv + 2; }

// Floats of the decode workspace: rows * Hq * splits partials where more than one split runs,
// else none.
NVFP4KV_HD int64_t decode_workspace_floats(int64_t rows, int64_t Hq, int64_t Dv, int64_t splits) {
  return splits > 1 ? rows * Hq * splits * decode_partial_floats(Dv) : 0;
}

// Row b of the block table as an index vector over its blocks (entries [0, max_blocks)).
template <class Params>  // GatherParams, DecodeParams
NVFP4KV_HD IndexVec block_table_row(const Params& p, int64_t b) {
  const int64_t i = b * p.bt_stride[0];
  const void* row = p.bt_int64 ? static_cast<const void*>(static_cast<const int64_t*>(p.block_table) + i)
                               : static_cast<const void*>(static_cast<const int32_t*>(p.block_table) + i);
  return IndexVec{row, p.bt_stride[1], p.bt_int64};
}

// The query's power of two, on every decode path: 2^k with k = decode_query_exp(max |q| of a row)
// brings the row's largest element to [2^13, 2^14): exact, inside fp16's range (the tensor-core
// reader's operands; bf16 reaches 2^127), and the row's dot products then stay far inside fp32 (a
// query of 2^120 against a saturated K group overflowed where its logit, 42, did not; review).
// k = 14 - e for max = m 2^e, m in [0.5, 1), from the exponent field E (e = E - 126), at most 126
// (rows of subnormal size: their logits are then below 2^-100 of the rest); 0 for a zero,
// infinite or NaN maximum. The logit factor takes 2^-k: the CPU path and the lane-per-token
// reader multiply each fp32 sum by (k_scale * sm_scale) * 2^-k held in a double, exact, so a logit
// is the float of (q . k) * k_scale * sm_scale rounded once, whatever k (held in a float, that
// factor passed FLT_MAX for rows near 2^127 and scaled every logit of the row wrongly; review).
NVFP4KV_HD int decode_query_exp(float mx) {
  const uint32_t bits = float_bits(mx), E = bits >> 23;  // mx >= 0 or NaN
  const int k = 140 - static_cast<int>(E);
  return bits == 0u || E >= 255u ? 0 : (k < 126 ? k : 126);
}
NVFP4KV_HD float pow2f(int k) { return bits_float(static_cast<uint32_t>(127 + k) << 23); }  // k in [-126, 127]

// How far (log2) a logit may pass its row's running maximum before the maximum moves, on the
// CPU path and the tensor-core reader: the probabilities then reach at most 2^8, inside fp16
// (the reader's operands), and a maximum rising a little at every step no longer rounds every
// sum at each move (design notes: "Decode attention on the CPU: one pass").
constexpr float kDecodeSlackLog2 = 8.0f;

// ---- amax (nvfp4kv_amax) -------------------------------------------------------------------------
// max(|x|) over a float tensor, exact. The C ABI hands the backends x with its dimensions
// reordered and merged (a maximum does not depend on the order it visits elements): extents >= 2,
// strides > 0 and decreasing, dimensions that were contiguous merged into one, broadcast
// (stride 0) and size-1 dimensions dropped, negative strides flipped. A 1-element tensor is
// (1,) with stride 1; ndim 0 means no element.
struct AmaxParams {
  const void* x;        // the element of lowest address
  int64_t shape[8];     // the fastest dimension last
  int64_t stride[8];    // elements
  int32_t ndim;
  int64_t numel;        // elements read: the product of shape
  DType dtype;
  int32_t* amax;        // the float32 result, as its bits (the CUDA path updates it with atomicMax)
  int32_t accumulate;   // 1: max(existing, max|x|); 0: max|x| (0 for no element)
};

// The maximum of |x| is taken on the elements' bits: |x| of an IEEE float is its bits with the
// sign cleared, and non-negative floats, NaNs included (above +inf), order like those bits as
// unsigned integers. So both backends keep the largest `bits & 0x7FFFFFFF` (float32) or
// `bits & 0x7FFF` (float16, bfloat16), the same whatever the order, and convert it once:
// amax_bits gives the float32 result's bits, every NaN as the one quiet NaN 0x7FC00000.
NVFP4KV_HD int32_t amax_bits(uint32_t raw_max, DType dtype) {
  const float f = dtype == DType::kFloat32    ? bits_float(raw_max)
                  : dtype == DType::kBFloat16 ? bits_float(raw_max << 16)
                                              : f16_to_float(static_cast<uint16_t>(raw_max));
  const uint32_t b = float_bits(f);
  return static_cast<int32_t>(b > 0x7F800000u ? 0x7FC00000u : b);
}

// The result of an accumulating update: the larger as int32 bits (the float order for
// non-negative values, NaN 0x7FC00000 above +inf; a stored negative value or negative NaN counts
// as below every |x|). Also what the CUDA path's atomicMax computes.
NVFP4KV_HD int32_t amax_combine(int32_t existing, int32_t update) { return existing > update ? existing : update; }

}  // namespace nvfp4kv
