// Kernel selection of the CUDA backend (cuda/plan.h): pure host functions, tested on any machine.
// Each case states which kernel a call must get and why (the thresholds' design notes).
#include <stdio.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <numeric>

#include "params.h"
#include "plan.h"

using namespace nvfp4kv;

static int g_failures = 0;
#define CHECK(cond, ...)                                                 \
  do {                                                                   \
    if (!(cond)) {                                                       \
      ++g_failures;                                                      \
      fprintf(stderr, "%s:%d: CHECK(%s) ", __FILE__, __LINE__, #cond);   \
      fprintf(stderr, __VA_ARGS__);                                      \
      fprintf(stderr, "\n");                                             \
    }                                                                    \
  } while (0)

static const DeviceInfo kH200{132, 60 << 20, 9};
static const DeviceInfo kA100{108, 40 << 20, 8};

static StoreShape store_shape(int64_t tokens) {
  StoreShape s{};
  s.num_tokens = tokens;
  s.num_slots = int64_t{1} << 22;
  s.H = 8;
  s.T = 16;
  s.Dk = s.Dv = 128;
  s.recipe = Recipe::kNvfp4;
  s.layout = Layout::kHND;
  s.vec = s.cache_aligned = true;
  s.workspace = false;
  return s;
}

static void test_store() {
  const auto AUTO = NVFP4KV_TESTING_STORE_AUTO, PAGE = NVFP4KV_TESTING_STORE_PAGE, TOKEN = NVFP4KV_TESTING_STORE_TOKEN;
  // The small kernel up to kSmallPerSm tokens per SM, then group pairs.
  CHECK(select_store_variant(store_shape(1), kH200, AUTO) == StoreVariant::kSmall, "1 token");
  CHECK(select_store_variant(store_shape(kSmallPerSm * 132), kH200, AUTO) == StoreVariant::kSmall, "8 per SM");
  CHECK(select_store_variant(store_shape(kSmallPerSm * 132 + 1), kH200, AUTO) == StoreVariant::kPairs, "past it");
  StoreShape s = store_shape(3 * 132);
  s.recipe = Recipe::kNvfp4_4over6;  // its limit is kSmallPerSm4over6
  CHECK(select_store_variant(s, kH200, AUTO) == StoreVariant::kPairs, "4over6 at 3 per SM");
  s.num_tokens = 2 * 132;
  CHECK(select_store_variant(s, kH200, AUTO) == StoreVariant::kSmall, "4over6 at 2 per SM");
  // Unaligned inputs: scalar loads at any size; D = 16 * odd: one group per item.
  s = store_shape(1);
  s.vec = false;
  CHECK(select_store_variant(s, kH200, AUTO) == StoreVariant::kScalar, "unaligned");
  s = store_shape(100000);
  s.Dk = s.Dv = 80;
  CHECK(select_store_variant(s, kH200, AUTO) == StoreVariant::kVec, "D 80");
  s = store_shape(100000);
  s.cache_aligned = false;
  CHECK(select_store_variant(s, kH200, AUTO) == StoreVariant::kVec, "8-byte aligned cache");
  // Page order: only with a workspace, by default from kSortedL2Multiple times the L2.
  const int64_t row_bytes = 8 * 2 * full_dim(128);  // a token's cache bytes, H 8
  const int64_t at = (kSortedL2Multiple * kH200.l2_bytes + row_bytes - 1) / row_bytes;
  s = store_shape(at);
  CHECK(select_store_variant(s, kH200, AUTO) == StoreVariant::kPairs, "no workspace");
  s.workspace = true;
  CHECK(select_store_variant(s, kH200, AUTO) == StoreVariant::kSorted, "at the L2 multiple");
  CHECK(select_store_variant(s, kH200, TOKEN) == StoreVariant::kPairs, "forced token order");
  s.num_tokens = at - 1;
  CHECK(select_store_variant(s, kH200, AUTO) == StoreVariant::kPairs, "below the L2 multiple");
  CHECK(select_store_variant(s, kH200, PAGE) == StoreVariant::kSorted, "forced page order");
  s.num_tokens = 4 * at;
  s.recipe = Recipe::kNvfp4_4over6;
  CHECK(select_store_variant(s, kH200, AUTO) == StoreVariant::kPairs, "4over6 stays in token order");
  s = store_shape(4 * at);
  s.workspace = true;
  s.layout = Layout::kNHD;
  CHECK(select_store_variant(s, kH200, PAGE) == StoreVariant::kPairs, "NHD has no page order");
  s = store_shape(16 * at);
  s.workspace = true;
  s.Dk = s.Dv = 256;  // rows of whole 128-byte lines: token order by default
  CHECK(select_store_variant(s, kH200, AUTO) == StoreVariant::kPairs, "D 256");
  CHECK(select_store_variant(s, kH200, PAGE) == StoreVariant::kSorted, "D 256 forced");
  // Found by review: past kSortedMaxHeads the page-order grid's y dimension would pass 65535.
  s = store_shape(4 * at);
  s.workspace = true;
  s.H = kSortedMaxHeads;
  CHECK(select_store_variant(s, kH200, PAGE) == StoreVariant::kSorted, "page order at the most heads");
  s.H = kSortedMaxHeads + 1;
  CHECK(select_store_variant(s, kH200, PAGE) == StoreVariant::kPairs, "more heads: token order");
  CHECK(kSortedMaxHeads == 524280, "16 warps a block, 2 rows a head, 65535 blocks along y");
  // Page order only where K and V rows have one size made of whole pairs that tile a warp; group
  // pairs only where both sides have an even number of groups (found by mutation testing).
  s = store_shape(4 * at);
  s.workspace = true;
  s.Dk = 32;
  s.Dv = 64;
  CHECK(select_store_variant(s, kH200, PAGE) == StoreVariant::kPairs, "Dk != Dv: token order");
  s.Dk = s.Dv = 96;  // 3 pairs a row: not a divisor of 32
  CHECK(select_store_variant(s, kH200, PAGE) == StoreVariant::kPairs, "D 96: token order");
  s = store_shape(kSmallPerSm * 132 + 1);
  s.H = 1;
  s.Dk = 32;
  s.Dv = 16;  // one V group: no pairs
  CHECK(select_store_variant(s, kH200, AUTO) == StoreVariant::kVec, "Dv 16: one group per item");
}

static GatherShape gather_shape(int64_t B, int64_t len) {
  GatherShape s{};
  s.dtype = DType::kBFloat16;
  s.layout = Layout::kHND;
  s.H = 8;
  s.T = 16;
  s.Dk = s.Dv = 128;
  s.B = B;
  s.max_blocks = (len + 15) / 16;
  s.total_tokens = B * len;
  s.vec = s.k_aligned16 = s.v_aligned16 = true;
  return s;
}

static void test_gather() {
  const auto AUTO = NVFP4KV_TESTING_GATHER_AUTO, PAGES = NVFP4KV_TESTING_GATHER_PAGES, ROWS = NVFP4KV_TESTING_GATHER_ROWS;
  GatherShape s = gather_shape(8, 512);  // 4096 tokens
  PagesPlan p = plan_gather_pages(s, kH200);
  CHECK(p.heads == 8 && p.stage_bytes == 8 * 16 * 72, "unit of 8 heads: %lld heads, %lld bytes",
        static_cast<long long>(p.heads), static_cast<long long>(p.stage_bytes));
  CHECK(p.units_per_seq == 32 * 2 && p.units == 8 * 64, "units %lld", static_cast<long long>(p.units));
  const int64_t resident = 132 * 5;
  // 512 units < 2 per resident block: the row kernel (pairs); 16K tokens: the page-side kernel.
  CHECK(select_gather_kernel(s, p, resident, AUTO) == GatherKernel::kPairs, "4K");
  CHECK(select_gather_kernel(s, p, resident, PAGES) == GatherKernel::kPages, "4K forced");
  s = gather_shape(8, 2048);
  p = plan_gather_pages(s, kH200);
  CHECK(p.units == 8 * 256 && select_gather_kernel(s, p, resident, AUTO) == GatherKernel::kPages, "16K");
  CHECK(select_gather_kernel(s, p, resident, ROWS) == GatherKernel::kPairs, "16K forced rows");
  // No bulk copies before sm_90, nor on a Hopper GPU running a build of compute_80 PTX (device_info
  // reports the code's architecture); fp32 outputs only through the general kernel.
  CHECK(plan_gather_pages(s, kA100).heads == 0, "A100");
  CHECK(select_gather_kernel(s, plan_gather_pages(s, kA100), resident, AUTO) == GatherKernel::kPairs, "no sm_90 code");
  s.dtype = DType::kFloat32;
  CHECK(plan_gather_pages(s, kH200).heads == 0 && !gather_pairs_ok(s), "fp32");
  CHECK(select_gather_kernel(s, plan_gather_pages(s, kH200), resident, AUTO) == GatherKernel::kGeneral, "fp32 kernel");
  // D 96: pairs (multiple of 64? no) -> general; D 192: pairs, no page side (not a power of two).
  s = gather_shape(8, 2048);
  s.Dk = s.Dv = 192;
  CHECK(plan_gather_pages(s, kH200).heads == 0 && gather_pairs_ok(s), "D 192");
  s.Dk = s.Dv = 96;
  CHECK(!gather_pairs_ok(s), "D 96");
  // Without pairs the page-side kernel takes every call it can (the general kernel is slow).
  s = gather_shape(1, 16);
  s.Dk = 64;
  s.Dv = 128;
  s.H = 4;
  p = plan_gather_pages(s, kH200);
  CHECK(p.heads == 4 && gather_pairs_ok(s), "mixed D");
  // D 512 with H 8: a unit of fewer heads so that its stage fits.
  s = gather_shape(8, 2048);
  s.Dk = s.Dv = 512;
  p = plan_gather_pages(s, kH200);
  CHECK(p.heads == 2 && p.stage_bytes <= kPagesMaxStage, "D 512: %lld heads", static_cast<long long>(p.heads));
  // NHD: a unit is every head.
  s = gather_shape(8, 2048);
  s.layout = Layout::kNHD;
  s.H = 6;
  CHECK(plan_gather_pages(s, kH200).heads == 0, "NHD with H 6 (not a power of two)");
  // Each unit's runs must start and end on 16 bytes (bulk copies): H 1, T 1, D 128 has 8-byte
  // scale runs; head sizes from 64; a unit's chunks in one pass of the block's threads (HND D 512,
  // H 8: 4 heads a unit; NHD cannot split a page's heads). Found by mutation testing.
  s = gather_shape(8, 2048);
  s.H = 1;
  s.T = 1;
  CHECK(plan_gather_pages(s, kH200).heads == 0, "8-byte scale runs");
  s = gather_shape(8, 2048);
  s.H = 1;
  s.T = 8;
  s.Dk = 32;
  s.Dv = 64;
  CHECK(plan_gather_pages(s, kH200).heads == 0, "Dk 32");
  s = gather_shape(8, 2048);
  s.T = 1;
  s.Dk = s.Dv = 512;
  CHECK(plan_gather_pages(s, kH200).heads == 4, "HND D 512, T 1: %lld heads", static_cast<long long>(plan_gather_pages(s, kH200).heads));
  s.layout = Layout::kNHD;
  CHECK(plan_gather_pages(s, kH200).heads == 0, "NHD D 512, T 1");
  // Row pairs need both sides' code rows 16-byte aligned.
  s = gather_shape(8, 2048);
  s.k_aligned16 = false;
  CHECK(!gather_pairs_ok(s), "K side 8-byte aligned");
  s = gather_shape(8, 2048);
  s.v_aligned16 = false;
  CHECK(!gather_pairs_ok(s), "V side 8-byte aligned");
  // A block table of no columns is a valid call (every token masked): still one block a sequence.
  s = gather_shape(1, 1);
  s.max_blocks = 0;
  p = plan_gather_pages(s, kH200);
  CHECK(gather_rows_blocks_per_seq(s, 2, resident) == 1 && gather_pages_blocks_per_seq(s, p, resident) == 1,
        "no columns: %lld, %lld", static_cast<long long>(gather_rows_blocks_per_seq(s, 2, resident)),
        static_cast<long long>(gather_pages_blocks_per_seq(s, p, resident)));
  s = gather_shape(1, 64);  // 32 block steps: one wave, a block per step
  CHECK(gather_rows_blocks_per_seq(s, 2, resident) == 32, "64 tokens");
  // Grid sizes: one wave of the row kernel for small gathers, up to four for large ones; the
  // page-side kernel gives each block at most kPageStages units.
  s = gather_shape(8, 512);  // 2048 block steps: two waves of 660 blocks over 8 sequences
  CHECK(gather_rows_blocks_per_seq(s, 2, resident) == 165, "4K rows: %lld",
        static_cast<long long>(gather_rows_blocks_per_seq(s, 2, resident)));
  s = gather_shape(8, 131072);
  p = plan_gather_pages(s, kH200);
  CHECK(gather_pages_blocks_per_seq(s, p, resident) == p.units_per_seq / kPageStages, "1M pages: %lld",
        static_cast<long long>(gather_pages_blocks_per_seq(s, p, resident)));
  // Terabyte outputs: the grid's x stays within CUDA's 2^31 - 1 (review: 2^34 tokens of T 4 gave
  // 2^31 blocks, 2^35 a cast to 0).
  p.units_per_seq = int64_t{1} << 40;
  CHECK(gather_pages_blocks_per_seq(s, p, resident) == INT32_MAX, "2^40 units: %lld",
        static_cast<long long>(gather_pages_blocks_per_seq(s, p, resident)));
  // A broadcast block table (stride 0) of 2^60 columns, and 2^62 sequences: sized as the table of
  // the output's size (review: max_blocks * T and B * units overflowed, giving a grid of one
  // block a sequence and a kernel chosen from wrapped sizes).
  s = gather_shape(8, 131072);
  const GatherShape real = s;
  const PagesPlan real_p = plan_gather_pages(real, kH200);
  s.max_blocks = int64_t{1} << 60;
  CHECK(max_seq_len(s.max_blocks, s.T, s.total_tokens) == s.total_tokens, "2^60 columns");
  CHECK(max_seq_len(real.max_blocks, 16, s.total_tokens) == 131072, "a real row");
  CHECK(max_seq_len(INT64_MAX, 1, INT64_MAX) == INT64_MAX && max_seq_len(3, 7, 100) == 21, "edges");
  p = plan_gather_pages(s, kH200);
  CHECK(p.units > 0 && p.units <= (s.total_tokens / 16 + s.B) * 2 && p.units_per_seq > 0, "2^60 columns: units %lld",
        static_cast<long long>(p.units));
  CHECK(gather_rows_blocks_per_seq(s, 2, resident) >= gather_rows_blocks_per_seq(real, 2, resident) &&
            select_gather_kernel(s, p, resident, AUTO) == select_gather_kernel(real, real_p, resident, AUTO),
        "2^60 columns: %lld blocks a sequence", static_cast<long long>(gather_rows_blocks_per_seq(s, 2, resident)));
  s.B = int64_t{1} << 62;
  p = plan_gather_pages(s, kH200);
  CHECK(p.units > 0, "2^62 sequences: units %lld", static_cast<long long>(p.units));
}

void test_decode() {
  // The tensor-core reader takes 16-token tiles of one page, or of whole short pages, with
  // vector loads.
  CHECK(select_decode_kernel({16, 128, 16, false, true}) == DecodeKernel::kMma, "T 16");
  CHECK(select_decode_kernel({64, 64, 16, false, true}) == DecodeKernel::kMma, "T 64, D 64");
  CHECK(select_decode_kernel({32, 256, 16, false, true}) == DecodeKernel::kMma, "T 32, D 256");
  for (int T : {1, 2, 3, 4, 8, 12, 24, 40})  // every block size: a tile in its tokens' pages
    CHECK(select_decode_kernel({T, 128, 16, false, true}) == DecodeKernel::kMma, "T %d", T);
  CHECK(select_decode_kernel({3, 64, 16, false, true}) == DecodeKernel::kMma, "T 3, D 64");
  for (int T : {1, 2, 3, 4, 8, 12, 15, 17, 24, 40})  // a 16-token tile may cross pages
    CHECK(decode_per_token_pages(T), "T %d: per-token pages", T);
  for (int T : {16, 32, 48, 64, 256})
    CHECK(!decode_per_token_pages(T), "T %d: a tile in one page", T);
  CHECK(select_decode_kernel({12, 128, 4, false, true}) == DecodeKernel::kLanes, "T 12, sides on 4 bytes at D 128");
  // Narrow copies where a block size that is not a multiple of 16 leaves the sides on 8 bytes (D
  // 128: 72 bytes a token and head) or 4 (D 64: 36); D 256's sides (144) and those of T 16k are on
  // 16 unless a view moved them, which the lane reader takes.
  for (int T : {1, 3, 12})
    CHECK(select_decode_kernel({T, 128, 8, false, true}) == DecodeKernel::kMmaNarrow, "T %d, D 128 on 8 bytes", T);
  for (int T : {1, 3, 8}) {
    CHECK(select_decode_kernel({T, 64, 4, false, true}) == DecodeKernel::kMmaNarrow, "T %d, D 64 on 4 bytes", T);
    CHECK(select_decode_kernel({T, 64, 8, false, true}) == DecodeKernel::kMmaNarrow, "T %d, D 64 on 8 bytes", T);
    CHECK(select_decode_kernel({T, 64, 1, false, true}) == DecodeKernel::kLanes, "T %d, D 64 on 1 byte", T);
  }
  CHECK(select_decode_kernel({1, 256, 8, false, true}) == DecodeKernel::kLanes, "T 1, D 256 on 8 bytes");
  CHECK(select_decode_kernel({16, 128, 8, false, true}) == DecodeKernel::kLanes, "T 16 on 8 bytes");
  CHECK(select_decode_kernel({1, 128, 8, true, true}) == DecodeKernel::kLanes, "narrow, K scales interleaved");
  CHECK(select_decode_kernel({1, 128, 8, false, false}) == DecodeKernel::kLanes, "narrow, large pages");
  CHECK(decode_narrow_copy(64) == 4 && decode_narrow_copy(128) == 8 && decode_narrow_copy(256) == 16, "copy bytes");
  for (int D : {64, 128, 256})  // a token's page side of one head is a multiple of the copy
    CHECK((D / 2 + D / 16) % decode_narrow_copy(D) == 0, "D %d", D);
  CHECK(decode_mma(DecodeKernel::kMma) && decode_mma(DecodeKernel::kMmaNarrow) && !decode_mma(DecodeKernel::kLanes),
        "decode_mma");
  for (int T = 1; T <= 64; ++T)  // the unit: the fewest whole pages that make a multiple of 16 tokens
    for (int64_t c = 1; c <= decode_unit_cols(T); ++c)
      CHECK(((c * T) % 16 == 0) == (c == decode_unit_cols(T)), "T %d, %lld columns", T, (long long)c);
  for (int T = 1; T <= 64; ++T)
    CHECK(int64_t{1} << decode_unit_shift(T) == decode_unit_cols(T), "T %d: shift %d", T, decode_unit_shift(T));
  // The query rows' power of two (decode_query_exp): a row's largest magnitude lands in [2^13, 2^14),
  // which the tensor-core reader's fp16 operands rely on; rows below 2^-113 take 2^126 (the most a
  // float factor holds); zero, infinite and NaN rows take 1.
  CHECK(decode_query_exp(1.0f) == 13 && decode_query_exp(1.9999999f) == 13 && decode_query_exp(2.0f) == 12,
        "2^13 for [1, 2)");
  CHECK(decode_query_exp(0x1p127f) == -114 && decode_query_exp(0x1p-113f) == 126 && decode_query_exp(0x1p-120f) == 126,
        "the ends");
  CHECK(decode_query_exp(0.0f) == 0 && decode_query_exp(INFINITY) == 0 && decode_query_exp(NAN) == 0, "0, inf, NaN");
  CHECK(select_decode_kernel({16, 128, 4, false, true}) == DecodeKernel::kLanes, "unaligned sides");
  CHECK(select_decode_kernel({16, 96, 16, false, true}) == DecodeKernel::kLanes, "D 96");
  CHECK(select_decode_kernel({16, 128, 16, true, true}) == DecodeKernel::kLanes, "K scales interleaved");
  CHECK(select_decode_kernel({16, 128, 16, false, false}) == DecodeKernel::kLanes, "2^31 pages or more, or larger strides");

  // Splits: T 16 as decode_splits; short pages counted in 16-token columns, each split a whole
  // number of them, never more splits than the workspace (decode_splits over the columns) holds.
  DecodeSplit sp = plan_decode_split(1, 8, 64, 16);  // 1 x 1024
  CHECK(sp.splits == 8 && sp.cols == 8, "1 x 1024, T 16: %lld x %lld", (long long)sp.splits, (long long)sp.cols);
  sp = plan_decode_split(1, 8, 1024, 1);  // 1 x 1024 at T 1: the same 8 splits of 128 tokens
  CHECK(sp.splits == 8 && sp.cols == 128, "1 x 1024, T 1: %lld x %lld", (long long)sp.splits, (long long)sp.cols);
  sp = plan_decode_split(16, 8, 4096 / 16, 16);
  CHECK(sp.splits == 4 && sp.cols == 64, "16 x 4096, T 16");
  sp = plan_decode_split(1, 1, 8192, 16);  // one sequence of one KV head: at most kDecodeMaxSplits
  CHECK(sp.splits == 64 && sp.cols == 128, "1 x 131072, one KV head: %lld x %lld", (long long)sp.splits,
        (long long)sp.cols);
  for (int T : {1, 2, 3, 4, 8, 12, 24, 40})
    for (int64_t cols : {int64_t{1}, int64_t{3}, int64_t{17}, int64_t{100}, int64_t{1000}, int64_t{131072 / 4}, int64_t{131072} / T}) {
      sp = plan_decode_split(1, 8, cols, T);
      CHECK(sp.splits >= 1 && sp.splits <= decode_splits(1, 8, cols) && sp.splits * sp.cols >= cols &&
                (sp.cols * T) % 16 == 0,
            "T %d, %lld columns: %lld x %lld", T, (long long)cols, (long long)sp.splits, (long long)sp.cols);
    }
  // Columns past int32 (an 8 GiB block table): the splits still cover the table.
  sp = plan_decode_split(1, 1, int64_t{1} << 31, 16);
  CHECK(sp.splits == decode_splits(1, 1, int64_t{1} << 31) && sp.splits > 1 && sp.splits * sp.cols >= int64_t{1} << 31,
        "2^31 columns: %lld x %lld", (long long)sp.splits, (long long)sp.cols);
  sp = plan_decode_split(1, 8, 4096, 12);  // 1 x 49152 at T 12: splits of whole 48-token units
  CHECK(sp.splits == decode_splits(1, 8, 1024) && sp.cols % 4 == 0, "1 x 49152, T 12: %lld x %lld", (long long)sp.splits,
        (long long)sp.cols);

  // A window's columns: for every length, the columns from the run of decode_unit_cols(T) holding
  // the first attended token (as decode_split_cols finds it) to the last token's fit the
  // span, and some length needs all of it; no window, or one as wide as the table: the table.
  for (int T : {1, 2, 3, 8, 12, 16, 64, 100})
    for (int q_len : {1, 3, 8})
      for (int64_t w : {int64_t{0}, int64_t{1}, int64_t{15}, int64_t{16}, int64_t{17}, int64_t{100}, int64_t{777}}) {
        const int64_t max_blocks = 4000000 / T, unit = decode_unit_cols(T);
        const int64_t span = decode_span_cols(max_blocks, T, q_len, w);
        int64_t most = 0;
        for (int64_t len = 1; len < 3000; ++len) {
          const int64_t first = std::max<int64_t>(0, len - q_len - w);
          const int64_t col0 = first / T / unit * unit, last_col = (len - 1) / T;
          most = std::max(most, last_col - col0 + 1);
        }
        CHECK(most == span, "T %d, q_len %d, window %lld: span %lld, needed %lld", T, q_len, (long long)w,
              (long long)span, (long long)most);
      }
  CHECK(decode_span_cols(256, 16, 1, -1) == 256, "no window: the table");
  CHECK(decode_span_cols(256, 16, 1, 4095) == 256 && decode_span_cols(256, 16, 1, 4000) == 251,
        "a window as wide as the table: the table; one of 4001 tokens: 251 columns");
  CHECK(decode_span_cols(256, 16, 1, INT64_MAX) == 256 && decode_span_cols(256, 16, 8, INT64_MAX - 3) == 256,
        "a window past int64: the table");
  CHECK(decode_span_cols(int64_t{1} << 44, 1 << 20, 1, INT64_MAX - 8) == int64_t{1} << 44,
        "a window near int64's end over a table past it: the table, no overflow");
  // Counts past 32 bits (tables of 2^31 columns or more; found by mutation testing).
  CHECK(decode_span_cols((int64_t{1} << 31) + 2, 1, 1, (int64_t{1} << 31) - 16) == int64_t{1} << 31,
        "a window of 2^31 tokens at T 1: %lld", (long long)decode_span_cols((int64_t{1} << 31) + 2, 1, 1, (int64_t{1} << 31) - 16));
  {
    const auto div16 = [](int64_t x) { return x / 16; };
    const SplitCols sc = decode_split_cols(int64_t{1} << 36, 0, 1, int64_t{1} << 32, 0, false, -1, 1, div16);
    CHECK(sc.col == 0 && sc.cols == int64_t{1} << 32, "one split of 2^32 columns: %lld + %lld", (long long)sc.col,
          (long long)sc.cols);
  }
  CHECK(decode_span_cols(256, 16, 1, 1023) == 65, "window 1023 at T 16: %lld", (long long)decode_span_cols(256, 16, 1, 1023));

  // Each sequence's splits (decode_split_cols over the plan of the span): for every length, the
  // nonempty splits start where tiles may (a multiple of 16 tokens, lcm(16, T)), lie within the
  // table, do not overlap, and together hold every position some query row attends inside the
  // table; a sequence that fills the table without a window has the plan's split exactly (the
  // kernels' bits for it are those of the plan before splits followed the lengths).
  for (int T : {1, 3, 8, 12, 16, 64})
    for (int64_t max_blocks : {int64_t{1}, int64_t{7}, int64_t{64}, int64_t{300}, int64_t{2048}})
      for (int64_t B : {int64_t{1}, int64_t{5}, int64_t{64}})
        for (int q_len : {1, 3})
          for (int64_t w : {int64_t{-1}, int64_t{0}, int64_t{17}, int64_t{500}, INT64_MAX}) {
            const int64_t span = decode_span_cols(max_blocks, T, q_len, w);
            const DecodeSplit sp = plan_decode_split(B, 8, span, T);
            const bool window = span < max_blocks;
            const int shift = decode_unit_shift(T);
            const int64_t table = max_blocks * T;
            const auto div_T = [&](int64_t x) { return x / T; };
            for (int64_t len = 0; len <= table + 40; len += len < 600 ? 1 : 1 + len / 50) {
              const int64_t lastp = len - 1;  // the last row's last position; the earliest row's first:
              const int64_t firstp = w >= 0 ? std::max<int64_t>(0, len - q_len - (w == INT64_MAX ? len : w)) : 0;
              int64_t covered = 0, prev_end = -1;
              bool ok = true;
              for (int64_t s = 0; s < sp.splits; ++s) {
                const SplitCols sc = decode_split_cols(len, s, sp.splits, max_blocks, shift, window, w, q_len, div_T);
                const int64_t lo = sc.col * T, hi = std::min(std::min(sc.col + sc.cols, max_blocks) * T, len);
                if (hi <= lo) continue;
                ok = ok && lo % std::lcm(16, T) == 0 && lo >= prev_end && hi <= table;
                // tokens of [firstp, min(lastp, table - 1)] inside [lo, hi)
                covered += std::max<int64_t>(0, std::min(hi, std::min(lastp + 1, table)) - std::max(lo, firstp));
                prev_end = hi;
              }
              const int64_t want = std::max<int64_t>(0, std::min(lastp + 1, table) - firstp);
              // No split longer than the plan's (the readers' 32-bit counts rely on it).
              for (int64_t s = 0; s < sp.splits; ++s)
                ok = ok && decode_split_cols(len, s, sp.splits, max_blocks, shift, window, w, q_len, div_T).cols <= sp.cols;
              if (!window && len == table) {
                const SplitCols sc = decode_split_cols(len, sp.splits - 1, sp.splits, max_blocks, shift, window, w, q_len, div_T);
                ok = ok && sc.col == (sp.splits - 1) * sp.cols && sc.cols == sp.cols;
              }
              CHECK(ok && covered == want, "T %d, table %lld, B %lld, q_len %d, window %lld, len %lld: covered %lld of %lld",
                    T, (long long)max_blocks, (long long)B, q_len, (long long)w, (long long)len, (long long)covered,
                    (long long)want);
              if (!(ok && covered == want)) break;
            }
          }

  // Splits from the lengths wherever a plan split holds more than 256 tokens: a short sequence in a
  // wide table (an engine's) would otherwise leave its tokens to the first of few long splits.
  CHECK(!decode_by_length(plan_decode_split(1, 8, 64, 16), 16, false), "1 x 1024: 8 splits of 128 tokens");
  CHECK(!decode_by_length(plan_decode_split(1, 8, 1024, 1), 1, false), "1 x 1024 at T 1: 8 splits of 128 tokens");
  CHECK(!decode_by_length(plan_decode_split(16, 8, 64, 16), 16, false), "16 x 1024: 4 splits of 256 tokens");
  CHECK(decode_by_length(plan_decode_split(16, 8, 256, 16), 16, false), "16 x 4096: 4 splits of 1024 tokens");
  CHECK(decode_by_length(plan_decode_split(16, 8, 8192, 16), 16, false), "16 x 4096 in a 131072-token table");
  CHECK(!decode_by_length(plan_decode_split(64, 8, 8192, 16), 16, false), "one split: nothing to share");
  CHECK(decode_by_length(plan_decode_split(1, 8, 8192, 16), 16, false), "64 splits: more than a cluster");
  CHECK(decode_by_length({1, 8192}, 16, true) && decode_by_length({2, 8}, 16, true), "a window");
  CHECK(!decode_by_length({2, 85}, 3, false) && decode_by_length({2, 86}, 3, false), "T 3: 255 and 258 tokens");
  CHECK(decode_by_length({2, int64_t{1} << 44}, 1 << 20, false), "2^64 tokens a split: no overflow");

  // 1 x 1024 (Hkv 8, 64 columns): 8 splits, 64 blocks; 16 x 4096: 4 splits, 512 blocks.
  CHECK(decode_cluster_merge(DecodeKernel::kMma, 8, 64, kH200), "8 splits, 64 blocks merge in their clusters on sm_90");
  CHECK(decode_cluster_merge(DecodeKernel::kMmaNarrow, 8, 64, kH200), "the narrow copies too");
  CHECK(decode_cluster_merge(DecodeKernel::kMma, 2, 132, kH200), "one block per SM");
  CHECK(!decode_cluster_merge(DecodeKernel::kMma, 4, 512, kH200), "a full grid merges in the second kernel");
  CHECK(!decode_cluster_merge(DecodeKernel::kMma, 1, 8, kH200), "one split: nothing to merge");
  CHECK(!decode_cluster_merge(DecodeKernel::kMma, 16, 128, kH200), "more splits than a portable cluster");
  CHECK(!decode_cluster_merge(DecodeKernel::kMma, 8, 64, kA100), "no clusters before sm_90");
  CHECK(!decode_cluster_merge(DecodeKernel::kLanes, 8, 64, kH200), "the lane reader merges from the workspace");
}

int main() {
  test_store();
  test_gather();
  test_decode();
  if (g_failures) {
    fprintf(stderr, "test_plan: %d failures\n", g_failures);
    return 1;
  }
  printf("test_plan: all checks passed\n");
  return 0;
}
