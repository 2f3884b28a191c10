// Kernel selection of the CUDA backend (plan.h).
#include "plan.h"

#include <algorithm>

#include "params.h"

namespace nvfp4kv {

StoreVariant select_store_variant(const StoreShape& s, const DeviceInfo& d,
                                  nvfp4kv_testing_store_order order) {
  const int64_t gk = s.Dk / kGroupSize, gv = s.Dv / kGroupSize;
  // Two groups per item when both sides have an even number of groups and the 16-byte code
  // stores stay aligned (D/2 is then a multiple of 16).
  const bool pairs = s.vec && gk % 2 == 0 && gv % 2 == 0 && s.cache_aligned;
  const int64_t per_sm = s.recipe == Recipe::kNvfp4 ? kSmallPerSm : kSmallPerSm4over6;
  const bool small = s.vec && s.num_tokens <= per_sm * d.sm_count;
  // Page order: HND pages (rows of one head are contiguous there), K and V rows of one size whose
  // items (two groups each) tile a warp; token indices and slots within the kernels' 32 bits.
  const int64_t units = gk / 2;
  const bool can_sort = s.workspace && pairs && !small && s.layout == Layout::kHND && gk == gv &&
                        units > 0 && 32 % units == 0 && s.num_tokens <= (int64_t{1} << 30) &&
                        s.num_slots < (int64_t{1} << 31) && s.H <= kSortedMaxHeads;
  const int64_t rows = mul_sat(mul_sat(s.num_tokens, s.H), full_dim(s.Dk) + full_dim(s.Dv));
  // Not for nvfp4_4over6 by default: bound by its arithmetic, it was slower in page order.
  const bool pays = s.recipe == Recipe::kNvfp4 && data_bytes(s.Dk) < kCacheLine &&
                    rows >= kSortedL2Multiple * d.l2_bytes;
  const bool sorted = can_sort && (order == NVFP4KV_TESTING_STORE_PAGE ||
                                   (order == NVFP4KV_TESTING_STORE_AUTO && pays));
  return small    ? StoreVariant::kSmall
         : sorted ? StoreVariant::kSorted
         : pairs  ? StoreVariant::kPairs
         : s.vec  ? StoreVariant::kVec
                  : StoreVariant::kScalar;
}

namespace {

bool pow2(int64_t v) { return v > 0 && (v & (v - 1)) == 0; }

}  // namespace

PagesPlan plan_gather_pages(const GatherShape& s, const DeviceInfo& d) {
  PagesPlan none{0, 0, 0, 0};
  // 16-bit outputs on the vector path, a GPU with bulk copies, head sizes a power of two from 64
  // (8 outputs per 4 code bytes, shifts for the chunk arithmetic), 16-byte aligned sides.
  if (!s.vec || s.dtype == DType::kFloat32 || d.cc_major < 9) return none;
  if (!pow2(s.Dk) || !pow2(s.Dv) || s.Dk < 64 || s.Dv < 64 || !s.k_aligned16 || !s.v_aligned16) return none;
  int64_t heads = s.H & -int64_t{s.H};  // the largest power of two dividing H
  if (s.layout == Layout::kNHD && heads != s.H) return none;  // NHD interleaves heads: all of them
  const int64_t D = std::max(s.Dk, s.Dv);
  const auto stage = [&](int64_t h) { return h * s.T * (D / 2 + D / kGroupSize); };
  // Fewer heads per unit where a unit would exceed its stage, or a position's chunks one pass.
  const auto fits = [&](int64_t h) { return stage(h) <= kPagesMaxStage && h * D / 8 <= kPageThreads; };
  while (s.layout == Layout::kHND && heads > 1 && !fits(heads)) heads /= 2;
  if (!fits(heads)) return none;
  // Each unit's codes and scales are two contiguous runs; bulk copies need both starts and both
  // lengths in whole 16 bytes. The runs of the unit of heads h0 = k * heads start where the
  // format core puts head h0's first code byte and first scale byte.
  for (const int32_t Ds : {s.Dk, s.Dv}) {
    const int64_t code_start = data_offset(row_index(s.layout, heads, 0, s.H, s.T), Ds);
    const int64_t scale_start = scale_offset_linear(row_index(s.layout, heads, 0, s.H, s.T), 0, s.H, s.T, Ds);
    const int64_t scale0 = scale_offset_linear(0, 0, s.H, s.T, Ds);
    for (const int64_t v : {code_start, scale0, scale_start - scale0, heads * s.T * (Ds / 2),
                            heads * s.T * (Ds / kGroupSize)})
      if (v % 16 != 0) return none;
  }
  PagesPlan p;
  p.heads = heads;
  p.stage_bytes = (stage(heads) + 15) / 16 * 16;
  p.units_per_seq = (max_seq_len(s.max_blocks, s.T, s.total_tokens) + s.T - 1) / s.T * (2 * s.H / heads);
  // Saturated: B and the table's width may be a broadcast's (2^60 and more).
  const int64_t cols = s.B > INT64_MAX - s.total_tokens / s.T ? INT64_MAX : s.total_tokens / s.T + s.B;
  p.units = std::min(mul_sat(s.B, p.units_per_seq), mul_sat(cols, 2 * s.H / heads));
  return p;
}

bool gather_pairs_ok(const GatherShape& s) {
  // 16-bit outputs on the vector path, head sizes a multiple of 64, 16-byte aligned code rows, a
  // token row of at most 1024 items.
  if (!s.vec || s.dtype == DType::kFloat32) return false;
  if (s.Dk % 64 != 0 || s.Dv % 64 != 0 || !s.k_aligned16 || !s.v_aligned16) return false;
  return int64_t{s.H} * (s.Dk + s.Dv) / 32 <= 1024;
}

GatherKernel select_gather_kernel(const GatherShape& s, const PagesPlan& pages, int64_t pages_resident,
                                  nvfp4kv_testing_gather_kernel forced) {
  const bool pairs = gather_pairs_ok(s);
  if (pages.heads > 0 && forced != NVFP4KV_TESTING_GATHER_ROWS) {
    // Where each block would get one unit, nothing overlaps the unit's copy latency and the row
    // kernel is faster; the general row kernel is far slower, so without pairs the page-side
    // kernel takes every call it can.
    if (forced == NVFP4KV_TESTING_GATHER_PAGES || !pairs ||
        pages.units >= kPagesMinUnitsPerBlock * pages_resident)
      return GatherKernel::kPages;
  }
  return pairs ? GatherKernel::kPairs : GatherKernel::kGeneral;
}

int64_t gather_rows_blocks_per_seq(const GatherShape& s, int64_t tokens_per_block, int64_t resident) {
  const int64_t per_seq = (max_seq_len(s.max_blocks, s.T, s.total_tokens) + tokens_per_block - 1) / tokens_per_block;
  // Blocks stride through their sequence's tokens. Four waves of resident blocks for large
  // gathers; a small one gets fewer blocks with more steps each, so fewer blocks start late in a
  // last partial wave: 1 wave up to 2 waves' worth of single steps, 2 up to 8.
  const int64_t steps = mul_sat(per_seq, s.B);  // blocks if each made one step
  const int64_t waves = steps <= 2 * resident ? 1 : steps <= 8 * resident ? 2 : 4;
  const int64_t share = std::max<int64_t>(1, waves * resident / std::max<int64_t>(1, s.B));
  return std::max<int64_t>(1, std::min(per_seq, share));
}

int64_t gather_pages_blocks_per_seq(const GatherShape& s, const PagesPlan& pages, int64_t resident) {
  // A sequence's share of one wave of resident blocks, or more where that would give a block more
  // than one round of the pipeline (kPageStages units): short blocks let the hardware's block
  // scheduler balance the SMs.
  const int64_t share = std::max<int64_t>(1, resident / std::max<int64_t>(1, s.B));
  const int64_t per_seq =
      std::max(std::min(pages.units_per_seq, share), (pages.units_per_seq + kPageStages - 1) / kPageStages);
  // At most gridDim.x's 2^31 - 1 (terabyte outputs passed it: review); the blocks stride through
  // the units, so fewer take more rounds each.
  return std::max<int64_t>(1, std::min<int64_t>(per_seq, INT32_MAX));
}

bool decode_cluster_merge(DecodeKernel kind, int64_t splits, int64_t blocks, const DeviceInfo& d) {
  return decode_mma(kind) && splits > 1 && splits <= kMaxClusterSplits && blocks <= d.sm_count &&
         d.cc_major >= 9;
}

bool decode_by_length(const DecodeSplit& split, int32_t T, bool window) {
  // split.cols * T > kDecodePlanSplitTokens, without the product (a table may hold 2^62 tokens).
  return window || split.splits > kMaxClusterSplits ||
         (split.splits > 1 && split.cols > kDecodePlanSplitTokens / std::max<int32_t>(T, 1));
}

DecodeKernel select_decode_kernel(const DecodeShape& s) {
  // Every block size: a tile lies in one page, or (decode_per_token_pages) in its tokens' pages.
  const bool head_ok = s.D == 64 || s.D == 128 || s.D == 256;
  if (!head_ok || s.k_interleaved || !s.small_pages) return DecodeKernel::kLanes;
  if (s.align >= 16) return DecodeKernel::kMma;
  // Narrow copies only where the block size leaves the sides so: with T % 16 == 0 a page side is
  // a multiple of 16 bytes, and only a view moved off 16 bytes, which the lane reader still takes,
  // misaligns it (design notes: "Decode attention: narrow copies").
  return decode_per_token_pages(s.T) && s.align >= decode_narrow_copy(s.D) && decode_narrow_copy(s.D) < 16
             ? DecodeKernel::kMmaNarrow
             : DecodeKernel::kLanes;
}

int64_t decode_span_cols(int64_t max_blocks, int32_t T, int32_t q_len, int64_t window_left) {
  // In doubles first: window_left may be near 2^63 (no window in effect).
  const double unit_tokens = static_cast<double>(decode_unit_cols(T)) * T;
  if (window_left < 0 || static_cast<double>(window_left) + q_len + unit_tokens >= static_cast<double>(max_blocks) * T ||
      window_left > INT64_MAX - 2 * static_cast<int64_t>(unit_tokens))  // the sum below would overflow
    return max_blocks;
  // The last column holds token len - 1 <= col0 T + unit T - 1 + window_left + q_len - 1.
  const int64_t cols = (decode_unit_cols(T) * T + window_left + q_len - 2) / T + 1;
  return std::min(cols, max_blocks);
}

DecodeSplit plan_decode_split(int64_t B, int64_t H, int64_t max_blocks, int32_t T) {
  const int64_t per = decode_unit_cols(T);
  const int64_t units = (max_blocks + per - 1) / per;
  const int64_t splits = decode_splits(B, H, units);
  return {splits, std::max<int64_t>(1, (units + splits - 1) / splits) * per};
}

}  // namespace nvfp4kv
