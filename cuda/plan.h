// Kernel selection of the CUDA backend: which kernel takes a call and how its grid is sized, as
// pure host functions over a description of the call and of the device. No CUDA headers: unit
// tested on any machine (tests/cpp/test_plan.cpp). Each threshold is named once, here, with the
// design note (docs/design-notes.md) that gives its measured reason.
#pragma once

#include <stdint.h>

#include <numeric>

#include "nvfp4kv/format.h"
#include "params.h"
#include "testing.h"

namespace nvfp4kv {

// What selection needs to know of a device.
struct DeviceInfo {
  int sm_count;      // multiprocessors
  int64_t l2_bytes;  // L2 cache
  int cc_major;      // architecture major of the code the device runs (bulk copies, clusters and
                     // PDL from 9): the device's, or lower for a build of an older PTX alone
};

// ---- Store ---------------------------------------------------------------------------------------
// "Store: the small-call kernel": calls of at most this many tokens per SM take the small kernel.
// nvfp4_4over6 computes four reciprocals per group there where the table kernel reads them, so
// its limit is lower.
constexpr int64_t kSmallPerSm = 8;
constexpr int64_t kSmallPerSm4over6 = 2;
// "Store: page order with a workspace": with a workspace, nvfp4 calls whose cache rows add up to
// at least this many times the L2 go in page order, where head rows are narrower than a line.
constexpr int64_t kSortedL2Multiple = 3;
constexpr int64_t kCacheLine = 128;
// The page-order kernel gives each (side, head) row a warp, 16 warps a block along gridDim.y
// (at most 65535): more KV heads than this go in token order.
constexpr int64_t kSortedMaxHeads = 65535 * 16 / 2;

enum class StoreVariant {
  kSmall,   // one token per block, one group per thread, no out-scale table
  kPairs,   // vector loads, two groups per thread, token order
  kSorted,  // vector loads, two groups per thread, page order (needs the workspace)
  kVec,     // vector loads, one group per thread
  kScalar   // scalar loads (unaligned inputs or cache sides)
};

struct StoreShape {
  int64_t num_tokens, num_slots;
  int32_t H, T, Dk, Dv;
  Recipe recipe;
  Layout layout;
  bool vec;            // input rows 16-byte aligned, cache sides 8-byte aligned
  bool cache_aligned;  // cache sides 16-byte aligned (16-byte code stores of group pairs)
  bool workspace;      // a store workspace was given
};

StoreVariant select_store_variant(const StoreShape& s, const DeviceInfo& d,
                                  nvfp4kv_testing_store_order order);

// ---- Gather ------------------------------------------------------------------------------------
// "Gather: the row kernel and the page-side kernel".
constexpr int64_t kPagesMinUnitsPerBlock = 2;  // page-side kernel from 2 units per resident block
constexpr int kPageStages = 4;                 // units one page-side block has in flight
constexpr int kPageThreads = 256;
constexpr int64_t kPagesMaxStage = 16 * 1024;  // bytes of one unit's stage in shared memory

enum class GatherKernel {
  kPages,   // gather_pages_kernel: whole page sides through bulk copies (sm_90+)
  kPairs,   // gather_pairs_kernel: rows, two groups per thread
  kGeneral  // gather_kernel: rows, one group per thread, any dtype or alignment
};

struct GatherShape {
  DType dtype;
  Layout layout;
  int32_t H, T, Dk, Dv;
  int64_t B, max_blocks, total_tokens;
  bool vec;            // outputs 16-byte aligned, cache sides 8-byte aligned
  bool k_aligned16;    // K side's base and page stride 16-byte aligned
  bool v_aligned16;
};

// The page-side kernel's unit: `heads` heads of one side of one page (0: the kernel does not
// apply to this call), its stage in shared memory, and the units of the whole call.
struct PagesPlan {
  int64_t heads;
  int64_t stage_bytes;  // the larger side's codes and scales of one unit, rounded up to 16
  int64_t units;        // upper bound on the units of the call (block-table rows, output size)
  int64_t units_per_seq;
};

// Tokens a sequence can have at most: its block-table row (max_blocks * T, which overflowed for
// a broadcast table of 2^60 columns: review) or the whole output. T >= 1, total_tokens >= 0.
inline int64_t max_seq_len(int64_t max_blocks, int64_t T, int64_t total_tokens) {
  const int64_t row = mul_sat(max_blocks, T);
  return row < total_tokens ? row : total_tokens;
}

PagesPlan plan_gather_pages(const GatherShape& s, const DeviceInfo& d);
bool gather_pairs_ok(const GatherShape& s);
// pages_resident: page-side blocks resident at once on the device (occupancy), 0 if unknown.
GatherKernel select_gather_kernel(const GatherShape& s, const PagesPlan& pages, int64_t pages_resident,
                                  nvfp4kv_testing_gather_kernel forced);

// Blocks per sequence. Row kernel: tokens_per_block tokens per block step, `resident` blocks at
// once. Page-side kernel: `resident` blocks at once.
int64_t gather_rows_blocks_per_seq(const GatherShape& s, int64_t tokens_per_block, int64_t resident);
int64_t gather_pages_blocks_per_seq(const GatherShape& s, const PagesPlan& pages, int64_t resident);

// ---- Decode attention --------------------------------------------------------------------------
// "Decode attention: the tensor-core reader": it copies 16-token tiles, of one page or, where T
// is not a multiple of 16, of the pages of their tokens ("pages shorter than a tile"), with
// 16-byte asynchronous copies, or where the pages of such block sizes leave the sides 8- or 4-byte
// aligned, with copies of decode_narrow_copy(D) bytes ("narrow copies"); other head
// sizes or alignments, and larger caches, take the lane-per-token reader.
enum class DecodeKernel {
  kMma,        // decode_mma_kernel: mma.sync tiles of 16 tokens (of one page, or of their tokens' pages)
  kMmaNarrow,  // the same over their tokens' pages, with copies of decode_narrow_copy(D) bytes
  kLanes       // decode_kernel: one lane per token, fp32 products
};
constexpr bool decode_mma(DecodeKernel k) { return k != DecodeKernel::kLanes; }

// The narrow copies' bytes: a token's page side of one head is D/2 + D/16 bytes, 72 at D 128 and
// 36 at D 64, so sides of any H and T are multiples of 8 or 4 bytes (D 256's 144: of 16).
constexpr int decode_narrow_copy(int D) { return D == 64 ? 4 : D == 128 ? 8 : 16; }

struct DecodeShape {
  int32_t T, D;
  int32_t align;       // the largest of 16, 8, 4 and 1 bytes that divides both sides' base and page stride
  bool k_interleaved;  // K scales token-4 interleaved (no scale profile does this; the reader
                       // copies a token's K scale bytes as one piece)
  bool small_pages;    // fewer than 2^31 pages and tokens per split, page strides and
                       // block-table rows below 2^32 bytes, read forward (a column stride >= 0):
                       // the reader's addresses and counts are 32-bit and unsigned
};

DecodeKernel select_decode_kernel(const DecodeShape& s);

// Block sizes that are not a multiple of 16, where a 16-token tile may hold tokens of several
// pages: the tensor-core reader's kPerToken kernels find each token's page on its own.
constexpr bool decode_per_token_pages(int64_t T) { return T % 16 != 0; }

// Block-table columns of the shortest run of whole pages that is a multiple of 16 tokens:
// lcm(16, T) / T (1 where T is a multiple of 16, 16 / T for T = 1, 2, 4, 8).
constexpr int64_t decode_unit_cols(int64_t T) { return 16 / std::gcd(int64_t{16}, T); }
// Its log2 (it is a power of two: 1, 2, 4, 8 or 16), for decode_split_cols' shifts.
constexpr int decode_unit_shift(int64_t T) {
  int shift = 0;
  while ((int64_t{1} << shift) < decode_unit_cols(T)) ++shift;
  return shift;
}

// How a decode call splits each sequence's block-table columns (flash-decoding): `splits` blocks
// of `cols` columns each. Columns are counted in units of decode_unit_cols(T), so that every split
// starts at a multiple of 16 tokens, where the tensor-core reader's tiles start, and pages of
// fewer than 16 tokens make splits of as many tokens as at T 16 (not 16 / T times fewer, each
// paying a block's setup and merge). Never more splits than decode_splits(B, H, max_blocks),
// which sizes the workspace from the geometry without T.
struct DecodeSplit {
  int64_t splits, cols;
};
DecodeSplit plan_decode_split(int64_t B, int64_t H, int64_t max_blocks, int32_t T);

// The block-table columns that the splits of one sequence must cover: max_blocks, or with a
// window (window_left >= 0) at most those from the run of decode_unit_cols(T) columns that holds
// the window's first token to the sequence's end, whatever its length (decode_split_cols):
// the tokens from the run's start to the end number below unit T + window_left + q_len.
int64_t decode_span_cols(int64_t max_blocks, int32_t T, int32_t q_len, int64_t window_left);

// "the fixed cost of a block": where a sequence has at most kMaxClusterSplits splits and the
// whole grid is at most one block per SM (short sequences: a latency-bound call), the
// tensor-core reader launches each sequence's splits as one thread-block cluster (sm_90+) and
// merges them there, without the second kernel; otherwise decode_combine_kernel merges them from
// the workspace (clusters of 4 in a full grid were 17-29 % slower on the H200).
constexpr int kMaxClusterSplits = 8;  // the portable cluster size
bool decode_cluster_merge(DecodeKernel kind, int64_t splits, int64_t blocks, const DeviceInfo& d);

// Whether a launch's splits follow each sequence's length (decode_split_cols; design notes:
// "Decode attention: splits from the lengths") instead of taking the plan's fixed share of the
// table's columns each: with a window, with more splits than a cluster holds, and wherever a split
// of the plan holds more than kDecodePlanSplitTokens tokens. In the plan's shares a sequence
// shorter than its table has all its tokens in the first splits while the others idle, and an
// engine's table is as wide as its longest context (vLLM: max_model_len / T columns): 16 x 4096 in
// a table of 131072 tokens made 4 splits of 32768 and read the whole sequence in split 0. A plan
// split of at most 256 tokens holds at most two steps of each of its block's warps.
constexpr int64_t kDecodePlanSplitTokens = 256;
bool decode_by_length(const DecodeSplit& split, int32_t T, bool window);

}  // namespace nvfp4kv
