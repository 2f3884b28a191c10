// CUDA gather (FORMAT.md §6): the tokens of each sequence, through its block table, into
// contiguous outputs. Three kernels write the same bytes: gather_kernel (one thread per group, any
// dtype and alignment), gather_pairs_kernel (rows, two groups per thread) and gather_pages_kernel
// (whole page sides through bulk copies, sm_90+); plan.h chooses.
#include <algorithm>
#include <atomic>

#include "backend.h"
#include "plan.h"
#include "read.cuh"

namespace nvfp4kv {
namespace {

struct GatherLaunch {
  GatherParams p;
  RowItems items;     // per token, one group per item
  FastDiv block_size;
  int64_t b0;         // first sequence of this launch (gridDim.y is capped)
};

// blockIdx.y: sequence; x: a grid-stride share of its tokens' items, one group per item. The
// general gather, for the geometries gather_pairs_kernel below does not take.
template <DType kDType, bool kVec>
__global__ void __launch_bounds__(kThreads) gather_kernel(const __grid_constant__ GatherLaunch L) {
  const GatherParams& p = L.p;
  const int64_t b = L.b0 + blockIdx.y;
  wait_for_prior_grids();  // no parameter arithmetic worth overlapping: wait first
  allow_next_grids();
  const int64_t len = load_index(p.seq_lens, b), start = load_index(p.cu_seqlens, b);
  const SeqRows rows = gather_rows(len, start, p.total_tokens);  // never outside the output
  if (rows.hi <= rows.lo) return;
  const float g_k = read_scale(p.k.scale), g_v = read_scale(p.v.scale);
  const uint32_t per_token = L.items.per_row.d;
  const uint64_t items = static_cast<uint64_t>(rows.hi - rows.lo) * per_token;
  for (uint64_t u = blockIdx.x * kThreads + threadIdx.x; u < items; u += gridDim.x * kThreads) {
    const int64_t i = L.items.per_row.div_any(static_cast<int64_t>(u));
    const uint32_t r = static_cast<uint32_t>(u - static_cast<uint64_t>(i) * per_token);
    const int64_t j = rows.lo + i, out_tok = start + j;
    const int64_t blk = L.block_size.div_any(j);
    const uint32_t t = static_cast<uint32_t>(j - blk * L.block_size.d);
    const int64_t page = blk < p.max_blocks ? load_index(block_table_row(p, b), blk) : -1;
    int side;
    uint32_t h, g;
    L.items.decode(r, side, h, g);
    const DequantSide& s = side ? p.v : p.k;
    float y[16];
    bool ok = true;
    if (page >= 0 && page < p.N) {
      uint32_t w[2];
      const uint32_t sfb = load_group<kVec>(s.cache.base + page * s.cache.page_stride, s.cache,
                                            p.layout, h, t, g, p.H, p.T, w);
      ok = dequantize_group(w, sfb, side ? g_v : g_k, y);
    } else {  // a bad block-table entry reads as zeros, and nothing outside the cache is read
#pragma unroll
      for (int i = 0; i < 16; ++i) y[i] = 0.0f;
    }
    store_group<kDType, kVec>(s.out, out_tok * s.out_stride[0] + h * s.out_stride[1] + g * 16, y, !ok);
  }
}

// The gather for the common geometry (16-bit outputs, head sizes a multiple of 64, 16-byte
// aligned rows): each thread keeps one (side, head, pair of groups) for the whole launch, like
// the store, so a token costs it one block-table read, one 16-byte code load, two scale bytes
// and no index decode (the general kernel above spends ~290 of its ~410 instructions per group
// on index arithmetic). A warp's outputs go out through shared memory, 512 contiguous bytes per
// store where its rows are contiguous (see the loop).
// blockDim.x = tokens_per_block * row items, rounded up to whole warps; gridDim.y: sequences.
// Dynamic shared memory: kStageBytes per warp.
struct GatherPairsLaunch {
  GatherParams p;
  RowItems items;             // per token, two groups per item
  FastDiv block_size;
  SideOffsets off[2];         // K, V
  uint32_t tokens_per_block;
  int64_t b0;                 // first sequence of this launch
};

// A warp's stage: its 128 chunks of 16 bytes, chunk x at x + x / 8 (one chunk of padding after
// every 8), so the 8 lanes of one shared-memory phase hit 8 different 16-byte bank groups both
// when lane l writes chunks 4l + j and when it reads chunks 32i + l.
constexpr int kStageChunks = 128 + 16;
constexpr int kStageBytes = kStageChunks * 16;

template <DType kDType>
__global__ void __launch_bounds__(1024) gather_pairs_kernel(const __grid_constant__ GatherPairsLaunch L) {
  const GatherParams& p = L.p;
  const int64_t b = L.b0 + blockIdx.y;
  // Parameter arithmetic only, until the grids before this one are done (wait_for_prior_grids).
  const uint32_t row = L.items.per_row.d;
  const uint32_t slot = L.items.per_row.div(threadIdx.x);  // token of this thread within the block's step
  const bool lane_used = slot < L.tokens_per_block;
  int side = 0;
  uint32_t h = 0, unit = 0;
  if (lane_used) L.items.decode(threadIdx.x - slot * row, side, h, unit);
  const DequantSide& s = side ? p.v : p.k;
  PageOffsets at;
  at.init(L.off[side], h, 2 * unit);
  const uint8_t* cache = s.cache.base;
  const int64_t page_stride = s.cache.page_stride;
  uint4* out = reinterpret_cast<uint4*>(static_cast<uint16_t*>(s.out) + h * s.out_stride[1] + 32 * unit);
  // In uint4 (8 elements); a multiple of 8 by the output's alignment check. Divided, not scaled to
  // bytes first: a size-1 row dimension may carry any stride, and 2 * 2^62 overflows.
  const int64_t out_stride = s.out_stride[0] / 8;
  const IndexVec bt_row = block_table_row(p, b);
  // Codes and scale bytes of step j, or zeros (and read false) for a bad block-table entry.
  struct Step {
    uint4 c;
    uint32_t sfb[2];
    bool read;
  };
  const auto load_step = [&](int64_t j) {
    Step r{make_uint4(0u, 0u, 0u, 0u), {0u, 0u}, false};
    const int64_t blk = L.block_size.div_any(j);
    const uint32_t pos = static_cast<uint32_t>(j - blk * p.T);
    const int64_t page = blk < p.max_blocks ? load_index(bt_row, blk) : -1;
    if (page >= 0 && page < p.N) {  // a bad entry reads as zeros; nothing outside the cache is read
      const uint8_t* base = cache + page * page_stride;
      r.c = __ldg(reinterpret_cast<const uint4*>(base + at.data(pos)));
      r.sfb[0] = base[at.scale(pos, 0)];
      r.sfb[1] = base[at.scale(pos, 1)];
      r.read = true;
    }
    return r;
  };
  const int64_t j0 = blockIdx.x * L.tokens_per_block + slot;
  wait_for_prior_grids();
  allow_next_grids();
  // The first step's block-table entry and codes need neither the sequence's length nor its
  // start: loaded beside them, the block's first stores wait on two dependent loads, not three.
  Step first{make_uint4(0u, 0u, 0u, 0u), {0u, 0u}, false};
  if (lane_used) first = load_step(j0);
  const int64_t len = load_index(p.seq_lens, b), start = load_index(p.cu_seqlens, b);
  const float g = read_scale(s.scale);  // before the test below, so the three loads overlap
  if (len <= 0) return;  // the whole block
  const float g14 = mul_rn(g, 0x1p14f);
  const bool fast = !(fabsf(g) >= 0x1p113f) || isinf(g);  // g * 2^14 exact and finite (or Inf/NaN)
  extern __shared__ uint4 stages[];
  uint4* stage = stages + (threadIdx.x / 32) * kStageChunks;
  const uint32_t lane = threadIdx.x & 31;

  // Decodes one step's codes and writes its outputs (dst: the lane's output row, or null).
  const auto emit = [&](const Step& st, const uint4* dst) {
    const float gk = st.read ? g : 0.0f, gk14 = st.read ? g14 : 0.0f;
    const uint32_t codes[2][2] = {{st.c.x, st.c.y}, {st.c.z, st.c.w}};
    uint32_t w[16];
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      float y[16];
      const bool ok = fast ? dequantize_group_h(codes[k], st.sfb[k], gk14, y) : dequantize_group(codes[k], st.sfb[k], gk, y);
      uint32_t wk[8];
      group_words<kDType>(y, !ok, wk);
#pragma unroll
      for (int i = 0; i < 8; ++i) w[8 * k + i] = wk[i];
    }
    // Each lane holds 64 contiguous output bytes (4 chunks of 16). Written as they are, a warp's
    // store touches 16 lines, half a sector per lane; staged through shared memory, store i writes chunk
    // (lane % 4) of lane 8i + lane / 4, so a row of a warp goes out as 512 contiguous bytes per
    // store (a plain write of the 4K gather's output took 7.0 µs in this kernel's old pattern,
    // 5.2 µs in 512-byte runs; tools/gather_diag.py). The stage's padding (kStageChunks)
    // keeps both its writes and its reads free of bank conflicts.
#pragma unroll
    for (int q = 0; q < 4; ++q)  // chunk 4 lane + q
      stage[4 * lane + lane / 2 + q] = make_uint4(w[4 * q], w[4 * q + 1], w[4 * q + 2], w[4 * q + 3]);
    __syncwarp();
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint4 v = stage[lane + lane / 8 + 36 * i];  // chunk 32 i + lane
      const uint64_t to = __shfl_sync(0xffffffffu, reinterpret_cast<uint64_t>(dst), 8 * i + (lane >> 2));
      if (to != 0) __stcs(reinterpret_cast<uint4*>(to) + (lane & 3), v);
    }
    __syncwarp();  // the stage is rewritten in the next step
  };

  // Only the positions that land in the output (gather_rows); the first step's preload is used
  // when the range starts at 0 (unless cu_seqlens holds a negative start, always).
  // Positions in uint64: a start near -2^63 in cu_seqlens puts rows.lo and rows.hi near
  // INT64_MAX, where j + stride wrapped in int64 and the loop never ended (review); below
  // rows.hi + stride < 2^64 nothing wraps.
  const SeqRows rows = gather_rows(len, start, p.total_tokens);
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * L.tokens_per_block;
  const uint64_t lo = static_cast<uint64_t>(rows.lo), hi = static_cast<uint64_t>(rows.hi);
  const uint64_t j_first = lo > uint64_t(j0) ? j0 + (lo - j0 + stride - 1) / stride * stride : j0;
  for (uint64_t j = j_first;; j += stride) {
    const bool active = lane_used && j < hi;
    if (!__any_sync(0xffffffffu, active)) break;  // warp-uniform: the shuffles see every lane
    const bool write = active && j >= lo;
    // Codes and scale bytes of this step (the first step's were loaded above). Where nothing is
    // read (a bad block-table entry, or a lane with nothing to write) they stay zero and so does
    // the scale, which decodes to +0: the zeros a bad entry must give, without a separate path.
    const int64_t jw = write ? static_cast<int64_t>(j) : 0;  // below rows.hi <= INT64_MAX
    emit(j == uint64_t(j0) ? first : write ? load_step(jw) : Step{make_uint4(0u, 0u, 0u, 0u), {0u, 0u}, false},
         write ? out + (start + jw) * out_stride : nullptr);
  }
}

// The gather through whole page sides (sm_90+): a unit is one side of one page for a group of
// `heads` heads, whose codes and scale bytes are two contiguous runs of the page (HND; NHD only
// with every head). A block takes up to kPageStages units at once: warp 0 reads their
// block-table entries and its lane 0 bulk-copies each unit's two runs into a shared-memory stage
// (cp.async.bulk, completion counted on an mbarrier), so all of them are in flight together and
// no register holds a load. Then every thread decodes 8 outputs per 4 code bytes, the block's
// 256 threads writing 4 KB of consecutive output per pass (a warp store is 512 contiguous bytes
// where a token's row of the unit is). Against gather_pairs_kernel, whose warps wait on one
// step's loads at a time, this took 16K-1M tokens from 81-88 % to 87-92 % of copy
// (docs/design-notes.md, "Gather: the row kernel and the page-side kernel"). blockIdx.y: sequence. Dynamic shared memory: kPageStages stages of
// stage_bytes, their mbarriers, page-valid flags and a zero word.

struct PagesSide {
  SideOffsets off;      // byte offsets within one side of a page (the format core's, affine)
  uint32_t code_bytes;  // codes of one head group: heads * T * D / 2, contiguous
  uint32_t scale_bytes; // its scale bytes: heads * T * D / 16, contiguous
  uint32_t lg_chunks;   // log2 of a position's chunks in the unit: heads * D / 8
  uint32_t lg_head;     // log2 of a head's chunks: D / 8
};

struct GatherPagesLaunch {
  GatherParams p;
  PagesSide side[2];     // K, V
  uint32_t heads;        // heads per unit
  FastDiv groups;        // head groups per side: H / heads
  FastDiv per_block;     // units per block-table entry: 2 * groups
  uint32_t stage_bytes;  // one stage: the larger side's codes + scales, rounded up to 16
  int64_t b0;            // first sequence of this launch
};


template <DType kDType>
__global__ void __launch_bounds__(kPageThreads, 4) gather_pages_kernel(const __grid_constant__ GatherPagesLaunch L) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const GatherParams& p = L.p;
  const int64_t b = L.b0 + blockIdx.y;
  extern __shared__ __align__(128) uint8_t smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kPageStages * L.stage_bytes);
  int32_t* page_ok = reinterpret_cast<int32_t*>(full + kPageStages);
  uint8_t* zero = reinterpret_cast<uint8_t*>(page_ok + kPageStages);  // 4 zero bytes
  if (threadIdx.x == 0) {
    *reinterpret_cast<uint32_t*>(zero) = 0u;
    for (int s = 0; s < kPageStages; ++s)
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" :: "r"(smem_u32(full + s)) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const IndexVec bt_row = block_table_row(p, b);
  const uint32_t lane = threadIdx.x & 31;
  // Unit i of this block (blockIdx.x + i * gridDim.x of the sequence's): its block-table column,
  // side and first head.
  struct Unit {
    int64_t blk;
    uint32_t side, h0;
  };
  // Units count from the first block-table column that lands in the output (first_col), so unit
  // numbers stay below the output's size: counted from column 0, a start near -2^63 in cu_seqlens
  // overflowed them and the rows were skipped (review). Unit blk is column first_col + blk.
  int64_t first_col = 0, cols_left = p.max_blocks;  // columns of the table from first_col on
  const auto unit = [&](int64_t i) {
    const int64_t k = blockIdx.x + i * gridDim.x;
    const int64_t blk = L.per_block.div_any(k);
    const uint32_t r = static_cast<uint32_t>(k - blk * L.per_block.d);
    const uint32_t side = L.groups.div(r);
    return Unit{blk, side, (r - side * L.groups.d) * L.heads};
  };
  // The units i < n are taken in rounds of kPageStages (one round unless a sequence runs past its
  // block-table row: see the launcher). Lane j of warp 0 holds the block-table entry of unit
  // round + j; its lane 0 issues the round's copies.
  int64_t lane_page = -1;
  const auto load_round = [&](int64_t r0) {
    const int64_t blk = unit(r0 + lane).blk;
    lane_page = lane < kPageStages && blk < cols_left ? load_index(bt_row, first_col + blk) : -1;
  };
  wait_for_prior_grids();
  allow_next_grids();
  // The first round's entries need neither the sequence's length nor its start (entries past
  // the length are read but not used): loaded beside them, the copies wait on one load, not two.
  if (threadIdx.x < 32) load_round(0);
  const int64_t len = load_index(p.seq_lens, b), start = load_index(p.cu_seqlens, b);
  // Positions outside the output are never written, so they need no units either.
  const SeqRows rows = gather_rows(len, start, p.total_tokens);
  const int64_t used = rows.hi;
  if (rows.hi <= rows.lo) return;  // the whole block
  if (rows.lo >= p.T) {  // a negative start (cu_seqlens): skip the columns before the output
    first_col = rows.lo / p.T;
    cols_left = first_col < p.max_blocks ? p.max_blocks - first_col : 0;
    if (threadIdx.x < 32) load_round(0);
  }
  const float gk = read_scale(p.k.scale), gv = read_scale(p.v.scale);
  // Units of blocks past the block table's width read as zeros, like bad entries (as in the
  // other gather kernels). used >= 1 here.
  const int64_t avail = ((used - 1) / p.T + 1 - first_col) * L.per_block.d;
  const int64_t n = avail > blockIdx.x ? (avail - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;

  for (int64_t r0 = 0; r0 < n; r0 += kPageStages) {
    const int count = n - r0 < kPageStages ? static_cast<int>(n - r0) : kPageStages;
    const uint32_t parity = static_cast<uint32_t>(r0 / kPageStages) & 1;
    if (threadIdx.x < 32) {
      if (r0 > 0) load_round(r0);
      for (int s = 0; s < count; ++s) {
        const int64_t page = __shfl_sync(0xffffffffu, lane_page, s);
        if (lane != 0) continue;
        const uint32_t bar = smem_u32(full + s);
        const bool ok = page >= 0 && page < p.N;  // a bad entry reads as zeros; nothing outside is read
        page_ok[s] = ok;
        if (!ok) {
          asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(bar) : "memory");
          continue;
        }
        const Unit un = unit(r0 + s);
        const uint32_t h0 = un.h0;
        const PagesSide& ps = L.side[un.side];
        const CacheSide& cs = (un.side ? p.v : p.k).cache;
        const uint8_t* base = cs.base + page * cs.page_stride;
        const uint8_t* stage = smem + s * L.stage_bytes;
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                     :: "r"(bar), "r"(ps.code_bytes + ps.scale_bytes) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     :: "r"(smem_u32(stage)), "l"(base + ps.off.data0 + h0 * ps.off.data_h), "r"(ps.code_bytes),
                        "r"(bar) : "memory");
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                     :: "r"(smem_u32(stage + ps.code_bytes)), "l"(base + ps.off.scale0 + h0 * ps.off.scale_h),
                        "r"(ps.scale_bytes), "r"(bar) : "memory");
      }
    }
    for (int s = 0; s < count; ++s) {
      const int64_t i = r0 + s;
      const uint32_t bar = smem_u32(full + s);
      uint32_t done = 0;
      do {
        asm volatile("{ .reg .pred q; mbarrier.try_wait.parity.shared::cta.b64 q, [%1], %2; selp.u32 %0, 1, 0, q; }"
                     : "=r"(done) : "r"(bar), "r"(parity) : "memory");
      } while (!done);
      const Unit un = unit(i);
      const int64_t blk = first_col + un.blk;
      const uint32_t side = un.side, h0 = un.h0;
      const PagesSide ps = L.side[side];
      const DequantSide& ds = side ? p.v : p.k;
      const float g = side ? gv : gk;
      const bool ok = page_ok[s];
      // A bad entry's unit reads code word 0 and scale byte 0 (the zero word after the stages'
      // barriers) at every position, with g 0: +0 outputs, on the same path.
      const float g14 = ok ? mul_rn(g, 0x1p14f) : 0.0f, g0 = ok ? g : 0.0f;
      const bool fast = !(fabsf(g) >= 0x1p113f) || isinf(g);  // as in gather_pairs_kernel
      // This thread's chunk of every position it visits (a position has 2^lg_chunks <= 256
      // chunks): head hl of the unit, 8-output piece of that head's row, at positions t0 + k step.
      const uint32_t c = threadIdx.x & ((1u << ps.lg_chunks) - 1);
      const uint32_t hl = c >> ps.lg_head, piece = c & ((1u << ps.lg_head) - 1);
      const uint32_t step = kPageThreads >> ps.lg_chunks;
      PageOffsets at;
      at.init(ps.off, hl, piece >> 1);
      const uint8_t* stage = smem + s * L.stage_bytes;
      const uint8_t* codes = ok ? stage + at.data0 - ps.off.data0 + 4 * (piece & 1) : zero;
      const uint8_t* scales = ok ? stage + ps.code_bytes + at.scale0 - ps.off.scale0 : zero;
      const uint32_t code_pos = ok ? at.data_pos : 0;
      at.scale0 = 0;  // scale offsets from `scales`
      if (!ok) {
        at.scale_pos = 0;
        at.interleaved = 0;
      }
      // Positions [t_lo, t_hi) land inside the output (never write outside it).
      const int64_t tok0 = start + blk * p.T;
      const int64_t left = used - blk * p.T, room = p.total_tokens - tok0;
      const int64_t t_end = left < p.T ? left : p.T;
      const uint32_t t_hi = static_cast<uint32_t>(t_end < room ? t_end : room);
      const uint32_t t_lo = static_cast<uint32_t>(tok0 < 0 ? (-tok0 < p.T ? -tok0 : p.T) : 0);
      uint4* out = reinterpret_cast<uint4*>(static_cast<uint16_t*>(ds.out) + tok0 * ds.out_stride[0] +
                                            (h0 + hl) * ds.out_stride[1] + 8 * piece);
      const int64_t out_pos = ds.out_stride[0] / 8;  // in uint4: rows are 16-byte aligned (vec)
      for (uint32_t t = threadIdx.x >> ps.lg_chunks; t < t_hi; t += step) {
        if (t < t_lo) continue;
        const uint32_t cw = *reinterpret_cast<const uint32_t*>(codes + t * code_pos);
        const uint32_t sfb = scales[at.scale(t, 0)];
        uint32_t words[4];
        if (fast && (sfb & 0x7Fu) != kScaleNaN) {
          float y[8];
          dequantize_word_h(cw, scale_f16x2(sfb), g14, y);
#pragma unroll
          for (int k = 0; k < 4; ++k) words[k] = pack_words<kDType>(y[2 * k], y[2 * k + 1]);
        } else {
          const uint32_t w[2] = {cw, 0u};
          float y[16];
          const bool fine = dequantize_group(w, sfb, g0, y);
          uint32_t all[8];
          group_words<kDType>(y, !fine, all);
#pragma unroll
          for (int k = 0; k < 4; ++k) words[k] = all[k];
        }
        __stcs(out + t * out_pos, make_uint4(words[0], words[1], words[2], words[3]));
      }
    }
    __syncthreads();  // every thread is done with the stages before the next round's copies
  }
#endif
}


template <DType kDType>
cudaError_t launch_gather(const GatherLaunch& L, bool vec, dim3 grid, int device, cudaStream_t stream) {
  return vec ? launch_pdl(gather_kernel<kDType, true>, grid, dim3(kThreads), device, stream, L)
             : launch_pdl(gather_kernel<kDType, false>, grid, dim3(kThreads), device, stream, L);
}

// Launches `kernel` with gx blocks per sequence (gridDim.y: sequences, at most 65535 per launch;
// L.b0: the launch's first sequence).
template <class Launch>
cudaError_t launch_sequences(void (*kernel)(Launch), Launch& L, int64_t B, int64_t gx, unsigned threads,
                             size_t smem, int device, cudaStream_t stream) {
  for (int64_t b0 = 0; b0 < B; b0 += 65535) {
    L.b0 = b0;
    const dim3 grid(static_cast<unsigned>(gx), static_cast<unsigned>(std::min<int64_t>(65535, B - b0)));
    const cudaError_t err = launch_pdl(kernel, grid, dim3(threads), device, stream, L, smem);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

template <DType kDType>
cudaError_t launch_gather_pairs(const GatherParams& p, const GatherShape& shape, int device, cudaStream_t stream) {
  constexpr auto kernel = gather_pairs_kernel<kDType>;
  GatherPairsLaunch L;
  L.p = p;
  L.items = RowItems(p.H, p.k.cache.D, p.v.cache.D, 2);
  L.block_size = FastDiv(static_cast<uint32_t>(p.T));
  L.off[0] = SideOffsets::make(p.k.cache, p.layout, p.H, p.T);
  L.off[1] = SideOffsets::make(p.v.cache, p.layout, p.H, p.T);
  const uint32_t row = L.items.per_row.d;
  L.tokens_per_block = rows_per_block(row);
  const uint32_t threads = (row * L.tokens_per_block + 31) / 32 * 32;
  const size_t smem = threads / 32 * kStageBytes;
  if (smem > 48 * 1024) {  // blocks of 22 warps or more (rows of 673+ items) must ask for it
    const cudaError_t err = allow_shared_memory<kernel, 32 * kStageBytes>(device);
    if (err != cudaSuccess) return err;
  }
  int per_sm = 0;
  const cudaError_t occ = resident_per_sm<kernel>(device, static_cast<int>(threads), &per_sm, smem);
  if (occ != cudaSuccess) return occ;
  const int64_t resident = static_cast<int64_t>(sm_count(device)) * per_sm;
  const int64_t gx = gather_rows_blocks_per_seq(shape, L.tokens_per_block, resident);
  return launch_sequences(kernel, L, p.B, gx, threads, smem, device, stream);
}

constexpr size_t kPagesMaxSmem = kPageStages * (kPagesMaxStage + 16);

uint32_t log2_exact(int64_t v) {  // v > 0, a power of two
  uint32_t lg = 0;
  while ((int64_t{1} << lg) < v) ++lg;
  return lg;
}

// The page-side kernel's launch parameters for a unit of plan.heads heads.
GatherPagesLaunch pages_launch(const GatherParams& p, const PagesPlan& plan) {
  GatherPagesLaunch L;
  const int64_t heads = plan.heads;
  L.p = p;
  L.heads = static_cast<uint32_t>(heads);
  L.groups = FastDiv(static_cast<uint32_t>(p.H / heads));
  L.per_block = FastDiv(static_cast<uint32_t>(2 * p.H / heads));
  L.stage_bytes = static_cast<uint32_t>(plan.stage_bytes);
  for (int i = 0; i < 2; ++i) {
    const CacheSide& c = (i ? p.v : p.k).cache;
    PagesSide& ps = L.side[i];
    ps.off = SideOffsets::make(c, p.layout, p.H, p.T);
    ps.code_bytes = static_cast<uint32_t>(heads * p.T * (c.D / 2));
    ps.scale_bytes = static_cast<uint32_t>(heads * p.T * (c.D / kGroupSize));
    ps.lg_chunks = log2_exact(heads * c.D / 8);
    ps.lg_head = log2_exact(c.D / 8);
  }
  return L;
}

size_t pages_smem(const PagesPlan& plan) {
  return kPageStages * (static_cast<size_t>(plan.stage_bytes) + sizeof(uint64_t) + sizeof(int32_t)) + 4;
}

// Page-side blocks resident at once for this plan's shared memory (asks for the memory first).
template <DType kDType>
cudaError_t pages_resident(const PagesPlan& plan, int device, int64_t* resident) {
  constexpr auto kernel = gather_pages_kernel<kDType>;
  const size_t smem = pages_smem(plan);
  if (smem > 48 * 1024) {  // stages above 12 KB
    const cudaError_t err = allow_shared_memory<kernel, kPagesMaxSmem>(device);
    if (err != cudaSuccess) return err;
  }
  int per_sm = 0;
  const cudaError_t occ = resident_per_sm<kernel>(device, kPageThreads, &per_sm, smem);
  if (occ != cudaSuccess) return occ;
  *resident = static_cast<int64_t>(sm_count(device)) * per_sm;
  return cudaSuccess;
}

template <DType kDType>
cudaError_t launch_gather_pages(const GatherParams& p, const GatherShape& shape, const PagesPlan& plan,
                                int64_t resident, int device, cudaStream_t stream) {
  GatherPagesLaunch L = pages_launch(p, plan);
  const int64_t gx = gather_pages_blocks_per_seq(shape, plan, resident);
  return launch_sequences(gather_pages_kernel<kDType>, L, p.B, gx, kPageThreads, pages_smem(plan), device, stream);
}

cudaError_t launch_gather_general(const GatherParams& p, bool vec, int device, cudaStream_t stream) {
  GatherLaunch L;
  L.p = p;
  L.items = RowItems(p.H, p.k.cache.D, p.v.cache.D, 1);
  const uint32_t per_token = L.items.per_row.d;
  L.block_size = FastDiv(static_cast<uint32_t>(p.T));
  // Sequence lengths live on the device (no host sync), so the grid is sized from what a
  // sequence can hold at most (its block-table row) and from the output size, and each CTA
  // strides over its sequence's items.
  const int64_t max_len = max_seq_len(p.max_blocks, p.T, p.total_tokens);
  const int64_t total_blocks = grid_blocks(device, int64_t{1} << 40, 16);  // SMs * 16
  const int64_t per_seq = (max_len * per_token + kThreads - 1) / kThreads;
  const int64_t share = std::max<int64_t>(1, total_blocks / std::max<int64_t>(1, p.B));
  const unsigned gx = static_cast<unsigned>(std::max<int64_t>(1, std::min(per_seq, share)));
  for (int64_t b0 = 0; b0 < p.B; b0 += 65535) {
    L.b0 = b0;
    const dim3 grid(gx, static_cast<unsigned>(std::min<int64_t>(65535, p.B - b0)));
    cudaError_t err;
    switch (p.dtype) {
      case DType::kFloat32: err = launch_gather<DType::kFloat32>(L, vec, grid, device, stream); break;
      case DType::kFloat16: err = launch_gather<DType::kFloat16>(L, vec, grid, device, stream); break;
      default: err = launch_gather<DType::kBFloat16>(L, vec, grid, device, stream); break;
    }
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

std::atomic<int> g_gather_kernel{NVFP4KV_TESTING_GATHER_AUTO};  // nvfp4kv_testing_set_gather_kernel

template <DType kDType>
cudaError_t gather_16bit(const GatherParams& p, const GatherShape& shape, const DeviceInfo& info, int device,
                         cudaStream_t stream) {
  const auto forced = static_cast<nvfp4kv_testing_gather_kernel>(g_gather_kernel.load(std::memory_order_relaxed));
  const PagesPlan plan = plan_gather_pages(shape, info);
  const bool runnable = plan.heads > 0 && forced != NVFP4KV_TESTING_GATHER_ROWS;
  int64_t resident = 0;
  if (runnable) {
    const cudaError_t err = pages_resident<kDType>(plan, device, &resident);
    if (err != cudaSuccess) return err;
  }
  switch (select_gather_kernel(shape, plan, resident, forced)) {
    case GatherKernel::kPages: return launch_gather_pages<kDType>(p, shape, plan, resident, device, stream);
    case GatherKernel::kPairs: return launch_gather_pairs<kDType>(p, shape, device, stream);
    case GatherKernel::kGeneral: break;
  }
  return launch_gather_general(p, shape.vec, device, stream);
}

}  // namespace

void cuda_set_gather_kernel(nvfp4kv_testing_gather_kernel kernel) {
  g_gather_kernel.store(kernel, std::memory_order_relaxed);
}

int cuda_gather(const GatherParams& p, int device, void* stream_ptr, const char** message) {
  *message = nullptr;
  if (p.B == 0 || p.total_tokens == 0) return 0;
  DeviceGuard guard(device);
  if (guard.error() != cudaSuccess) return guard.error();
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  GatherShape shape;
  shape.dtype = p.dtype;
  shape.layout = p.layout;
  shape.H = p.H;
  shape.T = p.T;
  shape.Dk = p.k.cache.D;
  shape.Dv = p.v.cache.D;
  shape.B = p.B;
  shape.max_blocks = p.max_blocks;
  shape.total_tokens = p.total_tokens;
  shape.vec = sides_vec(p.k, p.v, dtype_bytes(p.dtype), 2);
  shape.k_aligned16 = aligned(16, p.k.cache.base, {p.k.cache.page_stride});
  shape.v_aligned16 = aligned(16, p.v.cache.base, {p.v.cache.page_stride});
  const DeviceInfo info = device_info(device);
  cudaError_t err;
  switch (p.dtype) {
    case DType::kFloat16: err = gather_16bit<DType::kFloat16>(p, shape, info, device, stream); break;
    case DType::kBFloat16: err = gather_16bit<DType::kBFloat16>(p, shape, info, device, stream); break;
    default: err = launch_gather_general(p, shape.vec, device, stream); break;
  }
  if (err != cudaSuccess) *message = check_kernel_image(err);
  return err;
}

}  // namespace nvfp4kv
