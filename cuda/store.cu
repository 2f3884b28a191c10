// CUDA quantize-and-store: the format core's recipe, one thread per work item of kG consecutive
// 16-element groups of one (token, side, head) row.
//
// Thread mapping: a block covers `tokens_per_block` tokens side by side, each with one thread per
// work item of the token's row (K heads, then V heads), and steps through the tokens with a
// grid-wide stride (blocks keep room for about 256 threads; a call with fewer tokens per SM than
// that puts fewer tokens in each, and the other lanes only help build the block's out-scale
// table). So a thread keeps the same (side, head, groups) for the whole launch: the decode of its
// work item, its input and cache offsets inside a token and a page, and its side's global scale
// are computed once, and each token costs the thread one slot load, one division by the block
// size and two multiply-adds of addresses. A per-block table of out scales (out depends only on the scale byte
// for a given global scale) replaces one IEEE division per group.
// Small calls with aligned inputs (kSmallPerSm, kSmallPerSm4over6 tokens per SM at most) take a
// variant without the table: one token per block, one group per thread, out scales computed per
// group (kDirect).
// Rows of more than kMaxRow items are split over gridDim.y.
// Large calls given a workspace whose rows overflow L2 (kSortedL2Multiple) go in page order:
// claim_pages_kernel and order_tokens_kernel list the targeted pages and each slot's token, then
// the kSorted kernel writes whole runs of each page's head rows (its scattered 64-byte rows in
// token order reach DRAM as partial lines once the pages no longer fit in L2).
#include <algorithm>

#include "backend.h"
#include "common.cuh"
#include "format_device.cuh"
#include "plan.h"

namespace nvfp4kv {
namespace {

constexpr int kMaxRow = 512;  // most threads of one block (one token row, or a slice of a long one)
std::atomic<int> g_store_order{NVFP4KV_TESTING_STORE_AUTO};  // nvfp4kv_testing_set_store_order

// The workspace's parts (params.h, StoreWorkspaceLayout).
struct WorkspaceParts {
  int32_t* header;  // [0] count of listed pages, [1] blocks done (the sorted kernel's last resets both)
  int32_t* claim;   // [N]: the token that listed each page
  int32_t* index;   // [N]: where each listed page is in `pages`
  int32_t* pages;   // [N]: the listed pages
  int32_t* token;   // [N * T]: the last token of each slot
  int32_t* order;   // [N * T]: token of position p of the i-th listed page at i * T + p, or -1
  uint32_t N;       // pages the lists hold (a count beyond it is a header that was not zero)

  static WorkspaceParts of(int32_t* base, int64_t N, int64_t T) {
    const StoreWorkspaceLayout at = StoreWorkspaceLayout::of(N, T);
    return WorkspaceParts{base, base + at.claim, base + at.index, base + at.pages, base + at.token, base + at.order,
                          static_cast<uint32_t>(N)};
  }
};

struct StoreLaunch {
  StoreParams p;
  WorkspaceParts ws;          // the sorted kernels' (p.workspace)
  RowItems items;             // decode of a work item within a token row
  FastDiv row_slice;          // items of a token row each block covers (the row, or a slice)
  uint32_t tokens_per_block;  // tokens one block covers per step
  uint32_t num_tokens;        // tokens of this launch (< 2^31)
  SideOffsets off[2];         // K, V
  FastDiv block_size;         // T, for slot -> (page, position)
  int64_t token0;             // first token of this launch (large calls are split)
};

// Input is read once: streaming loads (evict-first in L2) keep it from evicting the cache lines
// the stores are still filling. With the evict-last scale stores below: 145 µs instead of 155 µs
// at 65536 tokens (docs/design-notes.md, "Store: streaming input loads, evict-last scale stores").
__device__ __forceinline__ uint4 load_input(const uint4* p) { return __ldcs(p); }

// Scale bytes fill their 32-byte sectors a few bytes at a time from tokens that arrive in any
// order; kept in L2 (evict-last) until the sector is whole, they reach DRAM as one full write
// instead of several partial ones.
__device__ __forceinline__ void store_scale(uint8_t* p, uint32_t byte) {
  uint64_t policy;
  asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
  asm volatile("st.global.L2::cache_hint.u8 [%0], %1, %2;" ::"l"(p), "r"(byte), "l"(policy) : "memory");
}

// Raw input words of one group, loaded ahead of use: 16-byte vectors when aligned (two for 16-bit
// types, four for fp32), else 16 scalars widened to fp32 at load time.
template <DType kDType, bool kVec>
struct Raw {
  static constexpr int kWords = kVec ? dtype_bytes(kDType) : 0;  // uint4 words of 16 elements
  uint4 v[kVec ? kWords : 1];
  float f[kVec ? 1 : kGroupSize];

  __device__ __forceinline__ void load(const void* src, int64_t idx) {
    if constexpr (kVec) {
      const uint4* p = reinterpret_cast<const uint4*>(static_cast<const char*>(src) +
                                                      idx * dtype_bytes(kDType));
#pragma unroll
      for (int i = 0; i < kWords; ++i) v[i] = load_input(p + i);
    } else if constexpr (kDType == DType::kFloat32) {
#pragma unroll
      for (int i = 0; i < kGroupSize; ++i) f[i] = static_cast<const float*>(src)[idx + i];
    } else {
#pragma unroll
      for (int i = 0; i < kGroupSize; ++i) {
        const uint16_t h = static_cast<const uint16_t*>(src)[idx + i];
        f[i] = kDType == DType::kFloat16 ? f16_to_float(h) : bf16_to_float(h);
      }
    }
  }

  __device__ __forceinline__ void to_float(float (&x)[kGroupSize]) const {
    if constexpr (!kVec) {
#pragma unroll
      for (int i = 0; i < kGroupSize; ++i) x[i] = f[i];
    } else if constexpr (kDType == DType::kFloat32) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        x[4 * i] = __uint_as_float(v[i].x);
        x[4 * i + 1] = __uint_as_float(v[i].y);
        x[4 * i + 2] = __uint_as_float(v[i].z);
        x[4 * i + 3] = __uint_as_float(v[i].w);
      }
    } else {
      const uint32_t w[8] = {v[0].x, v[0].y, v[0].z, v[0].w, v[1].x, v[1].y, v[1].z, v[1].w};
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        if constexpr (kDType == DType::kBFloat16) {
          x[2 * i] = __uint_as_float(w[i] << 16);  // bf16 is the top half of an fp32
          x[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
        } else {
          x[2 * i] = f16_to_float(static_cast<uint16_t>(w[i]));
          x[2 * i + 1] = f16_to_float(static_cast<uint16_t>(w[i] >> 16));
        }
      }
    }
  }
};

// What one thread keeps for the whole launch: where its groups sit in a token's input row and in
// a page, and its side's scales.
struct Lane {
  const char* src;          // input of its groups in token 0 (Item::load adds the token)
  int64_t token_stride;     // bytes
  uint8_t* cache;           // its side of page 0
  int64_t page_stride;      // bytes
  PageOffsets at;
  GlobalScale gs;

  __device__ __forceinline__ void init(const StoreSide& s, const SideOffsets& o, uint32_t h,
                                       uint32_t g0, int64_t esize) {
    src = static_cast<const char*>(s.src) + (h * s.head_stride + g0 * kGroupSize) * esize;
    // Unsigned: one token may carry any stride (common.cuh `aligned`), and token 0 reads at 0.
    token_stride = static_cast<int64_t>(static_cast<uint64_t>(s.token_stride) * static_cast<uint64_t>(esize));
    cache = s.cache.base;
    page_stride = s.cache.page_stride;
    at.init(o, h, g0);
  }
};

// One token's work for a thread: its slot and its input words, loaded ahead of use.
template <DType kDType, bool kVec, int kG>
struct Item {
  int64_t slot;
  Raw<kDType, kVec> raw[kG];

  __device__ __forceinline__ void load(const StoreParams& p, const Lane& lane, int64_t token) {
    slot = load_index(p.slots, token);
    load_input(lane, token);
  }

  // Page order (the sorted kernel): step t is position t % T of the (t / T)-th listed page, and
  // `token` (read ahead from the workspace's order) its token, or -1 for a position no token
  // targets. The page number is only needed by the stores, so its load is not waited for here.
  // Both are range-checked: workspace words left by a call that failed half-way, or a header
  // that was not zero, can then misplace rows but never reach outside the inputs or the cache.
  // (Checking each token against slot_mapping instead cost 7-15 %: docs/design-notes.md, "Store:
  // page order with a workspace".)
  __device__ __forceinline__ void load_sorted(const StoreLaunch& L, const Lane& lane, uint32_t t, int32_t token) {
    slot = -1;
    if (token >= 0 && token < L.p.num_tokens) {
      const uint32_t li = L.block_size.div(t);
      const int32_t page = L.ws.pages[li];
      load_input(lane, token);
      if (page >= 0 && static_cast<uint32_t>(page) < L.ws.N)
        slot = static_cast<int64_t>(page) * L.block_size.d + (t - li * L.block_size.d);
    }
  }

  __device__ __forceinline__ void load_input(const Lane& lane, int64_t token) {
    const char* src = lane.src + token * lane.token_stride;
#pragma unroll
    for (int k = 0; k < kG; ++k) raw[k].load(src, k * kGroupSize);
  }
};

template <DType kDType, Recipe kRecipe, bool kVec, int kG, bool kDirect = false>
__device__ __forceinline__ void store_item(const StoreLaunch& L, const Lane& lane, const float* table,
                                           const float* rcp_table, const Item<kDType, kVec, kG>& it) {
  const StoreParams& p = L.p;
  const int64_t slot = it.slot;
  if (slot < 0 || slot >= p.num_slots) return;  // padding or out of range: never written
  const int64_t page = L.block_size.div_any(slot);
  const uint32_t pos = static_cast<uint32_t>(slot - page * L.block_size.d);
  uint32_t packed[kG][2], sfb[kG];
#pragma unroll
  for (int k = 0; k < kG; ++k) {
    float x[kGroupSize];
    it.raw[k].to_float(x);
    const float inv_enc = lane.gs.inv_enc;
    const auto out_of = [table, inv_enc](uint32_t b) { return kDirect ? out_scale(b, inv_enc) : table[b]; };
    if constexpr (kRecipe == Recipe::kNvfp4_4over6)  // rcp_table exists for this recipe only
      sfb[k] = quantize_group<kRecipe>(
          x, lane.gs, out_of, packed[k],
          [rcp_table](const float(&xs)[kGroupSize], uint32_t b, float out, uint32_t(&codes)[2]) {
            const float r = kDirect ? candidate_rcp(out) : rcp_table[b];
            return encode_group_scored(xs, out, r, codes);
          });
    else
      sfb[k] = quantize_group<kRecipe>(x, lane.gs, out_of, packed[k]);
  }
  uint8_t* base = lane.cache + page * lane.page_stride;
  uint8_t* data = base + lane.at.data(pos);
  // Code words are written once and whole (16 or 8 bytes, whole sectors per warp): streaming
  // (evict-first) stores leave L2 to the scale bytes that are still being filled. In a copy of
  // the store's access pattern without the arithmetic (tools/patterns.cu) this took 65536
  // random-slot tokens from 115.9 to 102.0 µs; in this kernel the difference was within the
  // run-to-run noise (docs/design-notes.md, "Store: streaming input loads, evict-last scale
  // stores").
  if (kVec && kG == 2) {
    __stcs(reinterpret_cast<uint4*>(data), make_uint4(packed[0][0], packed[0][1], packed[kG - 1][0], packed[kG - 1][1]));
  } else if (kVec) {
    __stcs(reinterpret_cast<uint2*>(data), make_uint2(packed[0][0], packed[0][1]));
  } else {
#pragma unroll
    for (int k = 0; k < kG; ++k)
#pragma unroll
      for (int b = 0; b < 8; ++b) data[8 * k + b] = static_cast<uint8_t>(packed[k][b >> 2] >> (8 * (b & 3)));
  }
#pragma unroll
  for (int k = 0; k < kG; ++k) store_scale(base + lane.at.scale(pos, k), sfb[k]);
}

// kVec: input rows and cache sides are aligned (checked by the launcher), so groups load as
// 16-byte vectors and code words store as 8-byte (kG == 1) or 16-byte (kG == 2) words.
// kG: consecutive groups per work item; 2 halves the per-item work per element.
// The store is bound by load latency (docs/design-notes.md, "Store: one work item per thread for
// the whole launch": half the issue slots idle,
// warps waiting on global loads), so each thread loads its next token's item before quantizing
// the current one: two item buffers, the loop unrolled by two so they swap roles without copies.
// The first item's loads overlap the global scales and the out-scale table.
// kDirect: no table; each group's out scale is computed where it is needed (small calls, whose
// blocks make one step or few, where building a table costs more than it saves).
// kSorted: the page-order kernel (after claim_pages_kernel and order_tokens_kernel; HND, two
// groups per item, K and V rows of one size): a warp holds (position, item) lanes of one (side,
// head), so its 16-byte code stores cover a run of 32 / units positions of one head row (512
// contiguous bytes for D 128), and a block's step covers those positions of one page for every
// (side, head) of its slice.
template <DType kDType, Recipe kRecipe, bool kVec, int kG, bool kDirect = false, bool kSorted = false>
__global__ void __launch_bounds__(kMaxRow) store_kernel(const __grid_constant__ StoreLaunch L) {
  // Per side, per scale byte: out, and for nvfp4_4over6 candidate_rcp(out).
  constexpr bool kScored = kRecipe == Recipe::kNvfp4_4over6;
  __shared__ float out_table[2][128];
  __shared__ float rcp_tables[kScored ? 2 : 1][kScored ? 128 : 1];
  const StoreParams& p = L.p;
  constexpr int64_t esize = dtype_bytes(kDType);
  // Parameter arithmetic only, until the grids before this one are done (wait_for_prior_grids).
  uint32_t in_block, r;  // token (or position) of this thread in the block's step; item of the row
  if constexpr (kSorted) {
    const uint32_t lane_id = threadIdx.x & 31, units = L.items.k_units.d;
    in_block = L.items.k_units.div(lane_id);
    r = blockIdx.y * L.row_slice.d + (threadIdx.x >> 5) * units + lane_id - in_block * units;
  } else {
    in_block = L.row_slice.div(threadIdx.x);
    r = blockIdx.y * L.row_slice.d + threadIdx.x - in_block * L.row_slice.d;
  }
  const uint32_t step = gridDim.x * L.tokens_per_block;
  uint32_t t = blockIdx.x * L.tokens_per_block + in_block;
  // Idle: past the row in the last slice of a split row, or past the block's tokens.
  const bool active = r < L.items.per_row.d && in_block < L.tokens_per_block;
  int side = 0;
  uint32_t h = 0, unit = 0;
  if (active) L.items.decode(r, side, h, unit);
  Lane lane;
  lane.init(side ? p.v : p.k, L.off[side], h, unit * kG, esize);
  wait_for_prior_grids();
  allow_next_grids();
  // Steps of this launch: its tokens, or in page order T per listed page.
  const uint32_t n = !active ? 0u
                     : kSorted ? min(static_cast<uint32_t>(L.ws.header[0]), L.ws.N) * L.block_size.d
                               : L.num_tokens;
  // In page order each item's token comes from the workspace: read one step ahead of the item's
  // own loads (so two steps ahead of its use), no load waits on another within a step.
  int32_t ahead = -1;  // token of step t + step (sorted)
  const auto fetch = [&](Item<kDType, kVec, kG>& it, uint32_t u) {
    if constexpr (kSorted) {
      it.load_sorted(L, lane, u, ahead);
      ahead = u + step < n ? __ldcs(L.ws.order + u + step) : -1;
    } else {
      it.load(p, lane, L.token0 + u);
    }
  };

  // Global scales first: on a small call the kernel is one dependent chain (scale -> out scale
  // -> quantize; slot, input -> quantize -> store), so its loads start before anything else.
  const float g_k = read_scale(p.k.scale), g_v = read_scale(p.v.scale);
  Item<kDType, kVec, kG> a, b;
  if constexpr (kSorted) ahead = t < n ? __ldcs(L.ws.order + t) : -1;
  if (t < n) fetch(a, t);

  const float* table = nullptr;
  const float* rcp_table = nullptr;
  if constexpr (kDirect) {
    lane.gs = make_global_scale(side ? g_v : g_k);
  } else {
    const GlobalScale gsk = make_global_scale(g_k);
    const GlobalScale gsv = make_global_scale(g_v);
    lane.gs = side ? gsv : gsk;
    for (uint32_t i = threadIdx.x; i < 2 * 128; i += blockDim.x) {
      const uint32_t sd = i >> 7, byte = i & 127;
      const float out = byte < kScaleNaN ? out_scale(byte, sd ? gsv.inv_enc : gsk.inv_enc) : 0.0f;
      out_table[sd][byte] = out;
      if constexpr (kScored) rcp_tables[sd][byte] = candidate_rcp(out);
    }
    __syncthreads();
    table = out_table[side];
    rcp_table = rcp_tables[kScored ? side : 0];
  }

  while (t < n) {
    if (t + step < n) fetch(b, t + step);
    store_item<kDType, kRecipe, kVec, kG, kDirect>(L, lane, table, rcp_table, a);
    t += step;
    if (t >= n) break;
    if (t + step < n) fetch(a, t + step);
    store_item<kDType, kRecipe, kVec, kG, kDirect>(L, lane, table, rcp_table, b);
    t += step;
  }

  if constexpr (kSorted) {
    // The last block to finish leaves the workspace's header at zero for the next call: every
    // block read the page count before it counts itself done.
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      if (atomicAdd(&L.ws.header[1], 1) == static_cast<int>(gridDim.x * gridDim.y) - 1) {
        L.ws.header[0] = 0;
        L.ws.header[1] = 0;
      }
    }
  }
}

// A sorted store is three kernels. First: for each token with a valid slot, record it as the
// slot's token (the last token wins, as on the CPU) and list the slot's page once, its order
// entries set to -1. Claim and token entries already in the workspace count only where the
// call's own slot_mapping confirms them (see WorkspaceParts), so nothing needs clearing between
// calls. One atomic add on the page count per block.
__device__ __forceinline__ int64_t call_slot(const StoreLaunch& L, int32_t token) {
  if (token < 0 || token >= L.p.num_tokens) return -1;
  const int64_t s = load_index(L.p.slots, token);
  return s >= 0 && s < L.p.num_slots ? s : -1;
}

__global__ void __launch_bounds__(kThreads) claim_pages_kernel(const __grid_constant__ StoreLaunch L) {
  __shared__ int32_t warp_base[kThreads / 32];
  __shared__ int32_t block_base;
  const int32_t i = static_cast<int32_t>(blockIdx.x * kThreads + threadIdx.x);
  wait_for_prior_grids();
  allow_next_grids();
  const int64_t s = call_slot(L, i);
  bool listed = false;
  int32_t page = 0;
  if (s >= 0) {
    page = static_cast<int32_t>(L.block_size.div_any(s));
    // A valid entry is only ever replaced by a later token of the same slot, so one seen here,
    // even a stale copy, that is valid and >= i means i is not the last.
    int32_t cur = __ldcg(L.ws.token + s);
    while (!(call_slot(L, cur) == s && cur >= i)) {
      const int32_t prev = atomicCAS(L.ws.token + s, cur, i);
      if (prev == cur) break;
      cur = prev;
    }
    // A valid claim (a token of this call in this page) is never replaced: exactly one token
    // lists the page, the one whose index the claim holds.
    int32_t m = __ldcg(L.ws.claim + page);
    for (;;) {
      const int64_t ms = call_slot(L, m);
      if (ms >= 0 && L.block_size.div_any(ms) == page) {
        listed = m == i;
        break;
      }
      const int32_t prev = atomicCAS(L.ws.claim + page, m, i);
      if (prev == m) {
        listed = true;
        break;
      }
      m = prev;
    }
  }
  const uint32_t lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const uint32_t ballot = __ballot_sync(0xffffffffu, listed);
  if (lane == 0) warp_base[warp] = __popc(ballot);
  __syncthreads();
  if (threadIdx.x == 0) {
    int32_t total = 0;
    for (int w = 0; w < kThreads / 32; ++w) {
      const int32_t c = warp_base[w];
      warp_base[w] = total;
      total += c;
    }
    block_base = total ? atomicAdd(L.ws.header, total) : 0;
  }
  __syncthreads();
  const int32_t li = block_base + warp_base[warp] + __popc(ballot & ((1u << lane) - 1));
  if (listed && static_cast<uint32_t>(li) < L.ws.N) {  // always, unless the header was not zero
    L.ws.pages[li] = page;
    L.ws.index[page] = li;
    for (uint32_t pos = 0; pos < L.block_size.d; ++pos) L.ws.order[static_cast<int64_t>(li) * L.block_size.d + pos] = -1;
  }
}

// Second: each slot's last token writes itself into the page order. Third: the page-order
// store_kernel (kSorted).
__global__ void __launch_bounds__(kThreads) order_tokens_kernel(const __grid_constant__ StoreLaunch L) {
  const int32_t i = static_cast<int32_t>(blockIdx.x * kThreads + threadIdx.x);
  wait_for_prior_grids();
  allow_next_grids();
  const int64_t s = call_slot(L, i);
  if (s < 0 || L.ws.token[s] != i) return;
  const int64_t page = L.block_size.div_any(s);
  const int32_t li = L.ws.index[page];
  if (li >= 0 && static_cast<uint32_t>(li) < L.ws.N)  // always, unless the header was not zero
    L.ws.order[static_cast<int64_t>(li) * L.block_size.d + (s - page * L.block_size.d)] = i;
}

// Launches one kernel instantiation: reads its occupancy once per device and block size, then
// sizes the grid to one wave of the blocks that are resident at once, each stepping through an
// equal share of the tokens. (Several waves of blocks measured 15-20 % slower: docs/design-notes.md,
// "Store: one wave of resident blocks".)
template <auto kernel>
cudaError_t launch_kernel(StoreLaunch L, int threads, uint32_t slices, int device, cudaStream_t stream) {
  const int64_t total = L.p.num_tokens;
  int blocks_per_sm = 0;
  const cudaError_t occ = resident_per_sm<kernel>(device, threads, &blocks_per_sm);
  if (occ != cudaSuccess) return occ;
  const int64_t resident = std::max<int64_t>(1, static_cast<int64_t>(sm_count(device)) * blocks_per_sm / slices);
  const int64_t max_tokens = int64_t{1} << 30;  // token indices of a launch stay below 2^31
  for (int64_t t0 = 0; t0 < total; t0 += max_tokens) {
    L.token0 = t0;
    L.num_tokens = static_cast<uint32_t>(total - t0 < max_tokens ? total - t0 : max_tokens);
    const int64_t needed = (L.num_tokens + L.tokens_per_block - 1) / L.tokens_per_block;
    const int64_t steps = (needed + resident - 1) / resident;
    const dim3 grid(static_cast<uint32_t>((needed + steps - 1) / steps), slices);
    const cudaError_t err = launch_pdl(kernel, grid, dim3(threads), device, stream, L);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

// A sorted store: the claim and order kernels, then the page-order kernel on a grid of the
// blocks that are resident at once (fewer if the pages that can be listed need fewer). The
// occupancy reads come first, so a GPU without code in this build fails before anything touches
// the workspace.
template <auto kernel>
cudaError_t launch_sorted(StoreLaunch L, int threads, uint32_t slices, int device, cudaStream_t stream) {
  int blocks_per_sm = 0;
  cudaError_t err = resident_per_sm<kernel>(device, threads, &blocks_per_sm);
  if (err != cudaSuccess) return err;
  int unused = 0;
  err = resident_per_sm<claim_pages_kernel>(device, kThreads, &unused);
  if (err == cudaSuccess) err = resident_per_sm<order_tokens_kernel>(device, kThreads, &unused);
  if (err != cudaSuccess) return err;
  L.token0 = 0;
  L.num_tokens = static_cast<uint32_t>(L.p.num_tokens);
  const dim3 per_token((L.num_tokens + kThreads - 1) / kThreads);
  err = launch_pdl(claim_pages_kernel, per_token, dim3(kThreads), device, stream, L);
  if (err == cudaSuccess) err = launch_pdl(order_tokens_kernel, per_token, dim3(kThreads), device, stream, L);
  if (err != cudaSuccess) return err;
  const int64_t resident = std::max<int64_t>(1, static_cast<int64_t>(sm_count(device)) * blocks_per_sm / slices);
  const int64_t pages = std::min<int64_t>(L.p.num_tokens, L.p.num_slots / L.p.T);  // listed at most
  const int64_t needed = (pages * L.p.T + L.tokens_per_block - 1) / L.tokens_per_block;
  const dim3 grid(static_cast<uint32_t>(std::max<int64_t>(1, std::min(resident, needed))), slices);
  return launch_pdl(kernel, grid, dim3(threads), device, stream, L);
}

using Variant = StoreVariant;  // plan.h chooses

template <DType kDType, Recipe kRecipe>
cudaError_t launch(const StoreLaunch& L, Variant v, int threads, uint32_t slices, int device, cudaStream_t stream) {
  switch (v) {
    case Variant::kSmall: return launch_kernel<store_kernel<kDType, kRecipe, true, 1, true>>(L, threads, slices, device, stream);
    case Variant::kPairs: return launch_kernel<store_kernel<kDType, kRecipe, true, 2>>(L, threads, slices, device, stream);
    case Variant::kSorted:
      return launch_sorted<store_kernel<kDType, kRecipe, true, 2, false, true>>(L, threads, slices, device, stream);
    case Variant::kVec: return launch_kernel<store_kernel<kDType, kRecipe, true, 1>>(L, threads, slices, device, stream);
    case Variant::kScalar: return launch_kernel<store_kernel<kDType, kRecipe, false, 1>>(L, threads, slices, device, stream);
  }
  return cudaErrorInvalidValue;  // not reached: every variant is handled above (-Wswitch checks)
}

template <DType kDType>
cudaError_t launch_recipe(const StoreLaunch& L, Variant v, int threads, uint32_t slices, int device, cudaStream_t stream) {
  return L.p.recipe == Recipe::kNvfp4 ? launch<kDType, Recipe::kNvfp4>(L, v, threads, slices, device, stream)
                                      : launch<kDType, Recipe::kNvfp4_4over6>(L, v, threads, slices, device, stream);
}

}  // namespace

void cuda_set_store_order(nvfp4kv_testing_store_order order) {
  g_store_order.store(order, std::memory_order_relaxed);
}

int cuda_store(const StoreParams& p, int device, void* stream_ptr, const char** message) {
  *message = nullptr;
  if (p.num_tokens == 0) return 0;
  DeviceGuard guard(device);
  if (guard.error() != cudaSuccess) return guard.error();
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);

  const int64_t esize = dtype_bytes(p.dtype);
  StoreShape shape;
  shape.num_tokens = p.num_tokens;
  shape.num_slots = p.num_slots;
  shape.H = p.H;
  shape.T = p.T;
  shape.Dk = p.k.cache.D;
  shape.Dv = p.v.cache.D;
  shape.recipe = p.recipe;
  shape.layout = p.layout;
  // Vector path: 16-byte loads of every group, 8-byte stores of every code word (D/2 is a
  // multiple of 8, so row starts keep the alignment of the side).
  shape.vec = aligned(16, p.k.src, {p.k.token_stride, p.k.head_stride}, esize) &&
              aligned(16, p.v.src, {p.v.token_stride, p.v.head_stride}, esize) &&
              aligned(8, p.k.cache.base, {p.k.cache.page_stride}) &&
              aligned(8, p.v.cache.base, {p.v.cache.page_stride});
  shape.cache_aligned = aligned(16, p.k.cache.base, {p.k.cache.page_stride}) &&
                        aligned(16, p.v.cache.base, {p.v.cache.page_stride});
  shape.workspace = p.workspace != nullptr;
  const auto order = static_cast<nvfp4kv_testing_store_order>(g_store_order.load(std::memory_order_relaxed));
  const Variant variant = select_store_variant(shape, device_info(device), order);
  const bool small = variant == Variant::kSmall, sorted = variant == Variant::kSorted;
  const int64_t sms = sm_count(device);
  const uint32_t units = p.k.cache.D / kGroupSize / 2;  // items of two groups per head row (sorted)
  const int g = variant == Variant::kPairs || variant == Variant::kSorted ? 2 : 1;
  StoreLaunch L;
  L.p = p;
  L.ws = sorted ? WorkspaceParts::of(p.workspace, p.num_slots / p.T, p.T) : WorkspaceParts{};
  L.items = RowItems(p.H, p.k.cache.D, p.v.cache.D, g);
  L.block_size = FastDiv(static_cast<uint32_t>(p.T));
  L.off[0] = SideOffsets::make(p.k.cache, p.layout, p.H, p.T);
  L.off[1] = SideOffsets::make(p.v.cache, p.layout, p.H, p.T);
  // Block shape: whole token rows side by side (about 256 threads), or a long row in slices.
  const uint32_t row = L.items.per_row.d;
  uint32_t slices = (row + kMaxRow - 1) / kMaxRow;
  const uint32_t row_slice = (row + slices - 1) / slices;
  L.row_slice = FastDiv(row_slice);
  // The table kernels' calls with fewer tokens per SM than a full block holds (unaligned inputs,
  // nvfp4_4over6 above its small-kernel limit, short rows) spread their tokens over the SMs: a
  // few warps per SM finish a block's step sooner than the same warps stacked on fewer SMs. Their
  // blocks keep the full size, the lanes past the block's tokens idle, because all of them build
  // the out-scale table (with 64 threads that build took 0.35 µs longer: docs/design-notes.md,
  // "Store: full blocks for few tokens per SM").
  const uint32_t full = rows_per_block(row_slice);
  const int64_t spread = (p.num_tokens + sms - 1) / sms;
  L.tokens_per_block = small ? 1 : static_cast<uint32_t>(spread < full ? (spread > 1 ? spread : 1) : full);
  int threads = static_cast<int>(row_slice * (small ? 1 : full));
  if (sorted) {  // a warp per (side, head), up to kMaxRow threads; 32 / units positions per step
    slices = (2 * p.H + kMaxRow / 32 - 1) / (kMaxRow / 32);
    const uint32_t warps = (2 * p.H + slices - 1) / slices;  // the (side, head) rows spread evenly
    L.row_slice = FastDiv(warps * units);
    L.tokens_per_block = 32 / units;
    threads = static_cast<int>(warps * 32);
  }
  if (slices > 65535) {  // gridDim.y (review): 524,281 KV heads at D 512, far past any model
    *message = "store on the GPU splits a token's row over at most 65535 blocks of 512 threads (about 524,000 "
               "KV heads at head size 512, 8.4M at 64); fewer KV heads per call";
    return cudaErrorInvalidValue;
  }
  cudaError_t err;
  switch (p.dtype) {
    case DType::kFloat32: err = launch_recipe<DType::kFloat32>(L, variant, threads, slices, device, stream); break;
    case DType::kFloat16: err = launch_recipe<DType::kFloat16>(L, variant, threads, slices, device, stream); break;
    default: err = launch_recipe<DType::kBFloat16>(L, variant, threads, slices, device, stream); break;
  }
  if (err != cudaSuccess) {
    *message = check_kernel_image(err);
    return err;
  }
  return 0;
}

}  // namespace nvfp4kv
