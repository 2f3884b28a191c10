// CUDA read path (FORMAT.md §6): dequantize of whole pages and the gather. The general kernels
// take one thread per 16-element group of the output, groups fastest so a warp reads consecutive
// code words and writes consecutive output chunks; gather_pairs_kernel is the fast gather for
// the common geometry (see there).
#include <algorithm>
#include <initializer_list>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common.cuh"
#include "launch.h"

namespace nvfp4kv {
namespace {

struct DequantLaunch {
  DequantParams p;
  RowItems items;   // per (page, position), one group per item
  uint32_t total;
  int64_t row0;     // first (page-list index, position) of this launch
};

// The 8 output words (16 bf16/fp16 values) of one group.
template <DType kDType>
__device__ __forceinline__ void group_words(const float (&y)[16], bool nan_group, uint32_t (&w)[8]) {
  if (nan_group) {
    const uint32_t h = kDType == DType::kFloat16 ? float_to_f16(quiet_nan()) : float_to_bf16(quiet_nan());
#pragma unroll
    for (int i = 0; i < 8; ++i) w[i] = h | (h << 16);
    return;
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    if constexpr (kDType == DType::kFloat16) {
      const __half2 v = __floats2half2_rn(y[2 * i], y[2 * i + 1]);
      w[i] = *reinterpret_cast<const uint32_t*>(&v);
    } else {
      const __nv_bfloat162 v = __floats2bfloat162_rn(y[2 * i], y[2 * i + 1]);
      w[i] = *reinterpret_cast<const uint32_t*>(&v);
    }
  }
}

// 16 outputs of one group. Values of a normal group convert with the hardware RNE conversions
// (two values per instruction); a NaN group writes the one NaN pattern the format core gives on
// the host too, since hardware NaN conversion uses another payload. Vector stores are streaming
// (evict-first): the output is written once and read by another kernel, and keeping it out of
// L2's way took the 1M-token gather from 69.7 % to 74.0 % of copy (RESULTS.md run 24).
template <DType kDType, bool kVec>
__device__ __forceinline__ void store_group(void* out, int64_t idx, const float (&y)[16], bool nan_group) {
  if constexpr (kDType == DType::kFloat32) {
    float* o = static_cast<float*>(out) + idx;
    if (kVec) {
#pragma unroll
      for (int i = 0; i < 4; ++i)
        __stcs(reinterpret_cast<float4*>(o) + i, make_float4(y[4 * i], y[4 * i + 1], y[4 * i + 2], y[4 * i + 3]));
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i) o[i] = y[i];
    }
  } else {
    uint32_t w[8];
    group_words<kDType>(y, nan_group, w);
    uint16_t* o = static_cast<uint16_t*>(out) + idx;
    if (kVec) {
      __stcs(reinterpret_cast<uint4*>(o), make_uint4(w[0], w[1], w[2], w[3]));
      __stcs(reinterpret_cast<uint4*>(o) + 1, make_uint4(w[4], w[5], w[6], w[7]));
    } else {
#pragma unroll
      for (int i = 0; i < 16; ++i) o[i] = static_cast<uint16_t>(w[i >> 1] >> (16 * (i & 1)));
    }
  }
}

// Code words and scale byte of group g of row (h, t) of one side of one page.
template <bool kVec>
__device__ __forceinline__ uint32_t load_group(const uint8_t* base, const CacheSide& c, Layout layout,
                                               uint32_t h, int64_t t, uint32_t g, int32_t H,
                                               int32_t T, uint32_t (&w)[2]) {
  const int64_t row = row_index(layout, h, t, H, T);
  const uint8_t* data = base + data_offset(row, c.D) + 8 * g;
  if (kVec) {
    const uint2 v = __ldg(reinterpret_cast<const uint2*>(data));
    w[0] = v.x;
    w[1] = v.y;
  } else {
    w[0] = w[1] = 0;
#pragma unroll
    for (int b = 0; b < 8; ++b) w[b >> 2] |= static_cast<uint32_t>(data[b]) << (8 * (b & 3));
  }
  const int64_t soff = c.interleaved ? scale_offset_interleaved(h, t, g, T, H, c.D)
                                     : scale_offset_linear(row, g, H, T, c.D);
  return base[soff];
}

template <DType kDType, bool kVec>
__global__ void __launch_bounds__(kThreads) dequant_kernel(const __grid_constant__ DequantLaunch L) {
  const DequantParams& p = L.p;
  wait_for_prior_grids();  // no parameter arithmetic worth overlapping: wait first
  allow_next_grids();
  const float g_k = read_scale(p.k.scale), g_v = read_scale(p.v.scale);
  for (uint32_t u = blockIdx.x * kThreads + threadIdx.x; u < L.total; u += gridDim.x * kThreads) {
    const uint32_t rr = L.items.per_row.div(u);
    const int64_t flat = L.row0 + rr;  // page-list index * T + position
    const int64_t i = flat / p.T, t = flat - i * p.T;
    const int64_t page = p.pages.ptr ? load_index(p.pages, i) : i;
    if (page < 0 || page >= p.N) continue;
    int side;
    uint32_t h, g;
    L.items.decode(u - rr * L.items.per_row.d, side, h, g);
    const DequantSide& s = side ? p.v : p.k;
    uint32_t w[2];
    const uint32_t sfb = load_group<kVec>(s.cache.base + page * s.cache.page_stride, s.cache,
                                          p.layout, h, t, g, p.H, p.T, w);
    float y[16];
    const bool ok = dequantize_group(w, sfb, side ? g_v : g_k, y);
    store_group<kDType, kVec>(s.out, page * s.out_stride[0] + t * s.out_stride[1] + h * s.out_stride[2] + g * 16, y, !ok);
  }
}

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
  if (len <= 0) return;
  const float g_k = read_scale(p.k.scale), g_v = read_scale(p.v.scale);
  const uint32_t per_token = L.items.per_row.d;
  const uint64_t items = static_cast<uint64_t>(len) * per_token;
  for (uint64_t u = blockIdx.x * kThreads + threadIdx.x; u < items; u += gridDim.x * kThreads) {
    const uint32_t j = static_cast<uint32_t>(L.items.per_row.div_any(static_cast<int64_t>(u)));
    const uint32_t r = static_cast<uint32_t>(u - static_cast<uint64_t>(j) * per_token);
    const int64_t out_tok = start + j;
    if (out_tok < 0 || out_tok >= p.total_tokens) continue;  // never write outside the output
    const uint32_t blk = static_cast<uint32_t>(L.block_size.div_any(j));
    const uint32_t t = j - blk * L.block_size.d;
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
  const int64_t out_stride = s.out_stride[0] * 2 / 16;  // in uint4
  const IndexVec bt_row = block_table_row(p, b);
  // Codes and scale bytes of step j, or zeros (and read false) for a bad block-table entry.
  struct Step {
    uint4 c;
    uint32_t sfb[2];
    bool read;
  };
  const auto load_step = [&](int64_t j) {
    Step r{make_uint4(0u, 0u, 0u, 0u), {0u, 0u}, false};
    const uint32_t blk = static_cast<uint32_t>(L.block_size.div_any(j));
    const uint32_t pos = static_cast<uint32_t>(j - static_cast<int64_t>(blk) * p.T);
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
    // 5.2 µs in 512-byte runs; benchmarks/gather_diag.py). The stage's padding (kStageChunks)
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

  for (int64_t j = j0;; j += gridDim.x * L.tokens_per_block) {
    const bool active = lane_used && j < len;
    if (!__any_sync(0xffffffffu, active)) break;  // warp-uniform: the shuffles see every lane
    const int64_t out_tok = start + j;
    const bool write = active && out_tok >= 0 && out_tok < p.total_tokens;
    // Codes and scale bytes of this step (the first step's were loaded above). Where nothing is
    // read (a bad block-table entry, or a lane with nothing to write) they stay zero and so does
    // the scale, which decodes to +0: the zeros a bad entry must give, without a separate path.
    emit(j == j0 ? first : write ? load_step(j) : Step{make_uint4(0u, 0u, 0u, 0u), {0u, 0u}, false},
         write ? out + out_tok * out_stride : nullptr);
  }
}

template <DType kDType>
cudaError_t launch(const DequantLaunch& L, bool vec, int blocks, int device, cudaStream_t stream) {
  return vec ? launch_pdl(dequant_kernel<kDType, true>, dim3(blocks), dim3(kThreads), device, stream, L)
             : launch_pdl(dequant_kernel<kDType, false>, dim3(blocks), dim3(kThreads), device, stream, L);
}

}  // namespace

// Vector path when outputs (16 elements per group) and cache sides (8-byte code words) align.
template <class Side>
bool sides_vec(const Side& k, const Side& v, int64_t esize, int nstrides) {
  bool vec = true;
  for (const Side* s : {&k, &v}) {
    int64_t st[3] = {0, 0, 0};
    for (int i = 0; i < nstrides; ++i) st[i] = s->out_stride[i] * esize;
    vec = vec && aligned(16, s->out, {st[0], st[1], st[2]}) &&
          aligned(8, s->cache.base, {s->cache.page_stride});
  }
  return vec;
}

int cuda_dequantize(const DequantParams& p, int device, void* stream_ptr, const char** message) {
  *message = nullptr;
  if (p.num_pages == 0) return 0;
  DeviceGuard guard(device);
  if (guard.error() != cudaSuccess) return guard.error();
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const bool vec = sides_vec(p.k, p.v, dtype_bytes(p.dtype), 3);
  DequantLaunch L;
  L.p = p;
  L.items = RowItems(p.H, p.k.cache.D, p.v.cache.D, 1);
  const uint32_t per_row = L.items.per_row.d;
  const int64_t rows = p.num_pages * p.T;
  const int64_t max_rows = ((int64_t{1} << 31) - 1) / per_row - kThreads;
  for (int64_t r0 = 0; r0 < rows; r0 += max_rows) {
    const int64_t n = rows - r0 < max_rows ? rows - r0 : max_rows;
    L.row0 = r0;
    L.total = static_cast<uint32_t>(n * per_row);
    const int blocks = grid_blocks(device, L.total, 8);
    cudaError_t err;
    switch (p.dtype) {
      case DType::kFloat32: err = launch<DType::kFloat32>(L, vec, blocks, device, stream); break;
      case DType::kFloat16: err = launch<DType::kFloat16>(L, vec, blocks, device, stream); break;
      default: err = launch<DType::kBFloat16>(L, vec, blocks, device, stream); break;
    }
    if (err != cudaSuccess) {
      *message = check_kernel_image(err);
      return err;
    }
  }
  return 0;
}

template <DType kDType>
cudaError_t launch_gather(const GatherLaunch& L, bool vec, dim3 grid, int device, cudaStream_t stream) {
  return vec ? launch_pdl(gather_kernel<kDType, true>, grid, dim3(kThreads), device, stream, L)
             : launch_pdl(gather_kernel<kDType, false>, grid, dim3(kThreads), device, stream, L);
}

// The pairs kernel's conditions: 16-bit outputs on the vector path, head sizes a multiple of 64,
// 16-byte aligned code rows, a token row of at most 1024 items. (Its lanes once traded halves
// of group pairs, which needed an even number per row; since the shared-memory stage, D % 32
// would do, but only multiples of 64 are tested on a GPU.)
bool gather_pairs_ok(const GatherParams& p, bool vec) {
  if (!vec || p.dtype == DType::kFloat32) return false;
  for (const DequantSide* s : {&p.k, &p.v})
    if (s->cache.D % 64 != 0 || !aligned(16, s->cache.base, {s->cache.page_stride})) return false;
  return int64_t{p.H} * (p.k.cache.D + p.v.cache.D) / 32 <= 1024;
}

// Lets `kernel` take the stage of the largest block (32 warps) on `device`, once per device: one
// value for every call, so concurrent callers with different row sizes cannot undo each other's
// setting between it and their launch. The runtime applies it to the current device (callers
// hold a DeviceGuard).
template <auto kernel>
cudaError_t allow_stage_memory(int device) {
  static std::atomic<bool> done[64];
  const bool keep = device >= 0 && device < 64;
  if (keep && done[device].load(std::memory_order_relaxed)) return cudaSuccess;
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 32 * kStageBytes);
  if (err == cudaSuccess && keep) done[device].store(true, std::memory_order_relaxed);
  return err;
}

template <DType kDType>
cudaError_t launch_gather_pairs(const GatherParams& p, int device, cudaStream_t stream) {
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
    const cudaError_t err = allow_stage_memory<kernel>(device);
    if (err != cudaSuccess) return err;
  }
  int per_sm = 0;
  const cudaError_t occ = resident_per_sm<kernel>(device, static_cast<int>(threads), &per_sm, smem);
  if (occ != cudaSuccess) return occ;
  const int64_t resident = static_cast<int64_t>(sm_count(device)) * per_sm;
  const int64_t max_len = std::min<int64_t>(p.max_blocks * p.T, p.total_tokens);
  const int64_t per_seq = (max_len + L.tokens_per_block - 1) / L.tokens_per_block;
  // Blocks stride through their sequence's tokens. Four waves of resident blocks for large
  // gathers; a small one gets fewer blocks with more steps each, so fewer blocks start late in a
  // last partial wave: 1 wave up to 2 waves' worth of single steps, 2 up to 8 (4096 tokens: -5 %,
  // 16384: -1 %, RESULTS.md run 55).
  const int64_t steps = per_seq * p.B;  // blocks if each made one step
  const int64_t waves = steps <= 2 * resident ? 1 : steps <= 8 * resident ? 2 : 4;
  const int64_t share = std::max<int64_t>(1, waves * resident / std::max<int64_t>(1, p.B));
  const unsigned gx = static_cast<unsigned>(std::max<int64_t>(1, std::min(per_seq, share)));
  for (int64_t b0 = 0; b0 < p.B; b0 += 65535) {
    L.b0 = b0;
    const dim3 grid(gx, static_cast<unsigned>(std::min<int64_t>(65535, p.B - b0)));
    const cudaError_t err = launch_pdl(kernel, grid, dim3(threads), device, stream, L, smem);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

int cuda_gather(const GatherParams& p, int device, void* stream_ptr, const char** message) {
  *message = nullptr;
  if (p.B == 0 || p.total_tokens == 0) return 0;
  DeviceGuard guard(device);
  if (guard.error() != cudaSuccess) return guard.error();
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  const bool vec = sides_vec(p.k, p.v, dtype_bytes(p.dtype), 2);
  if (gather_pairs_ok(p, vec)) {
    const cudaError_t err = p.dtype == DType::kFloat16 ? launch_gather_pairs<DType::kFloat16>(p, device, stream)
                                                       : launch_gather_pairs<DType::kBFloat16>(p, device, stream);
    if (err != cudaSuccess) *message = check_kernel_image(err);
    return err;
  }
  GatherLaunch L;
  L.p = p;
  L.items = RowItems(p.H, p.k.cache.D, p.v.cache.D, 1);
  const uint32_t per_token = L.items.per_row.d;
  L.block_size = FastDiv(static_cast<uint32_t>(p.T));
  // Sequence lengths live on the device (no host sync), so the grid is sized from what a
  // sequence can hold at most (its block-table row) and from the output size, and each CTA
  // strides over its sequence's items.
  const int64_t max_len = std::min<int64_t>(p.max_blocks * p.T, p.total_tokens);
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
    if (err != cudaSuccess) {
      *message = check_kernel_image(err);
      return err;
    }
  }
  return 0;
}

}  // namespace nvfp4kv
