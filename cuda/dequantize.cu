// CUDA dequantize of whole pages (FORMAT.md §6): one thread per 16-element group of the output,
// groups fastest so a warp reads consecutive code words and writes consecutive output chunks.
#include <algorithm>

#include "backend.h"
#include "read.cuh"

namespace nvfp4kv {
namespace {

struct DequantLaunch {
  DequantParams p;
  RowItems items;   // per (page, position), one group per item
  uint32_t total;
  int64_t row0;     // first (page-list index, position) of this launch
};


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

template <DType kDType>
cudaError_t launch(const DequantLaunch& L, bool vec, int blocks, int device, cudaStream_t stream) {
  return vec ? launch_pdl(dequant_kernel<kDType, true>, dim3(blocks), dim3(kThreads), device, stream, L)
             : launch_pdl(dequant_kernel<kDType, false>, dim3(blocks), dim3(kThreads), device, stream, L);
}

}  // namespace

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
  // Items of a launch stay below 2^31 (FastDiv's range); at least one row a launch, whose items
  // fit (a side below 2 GiB bounds per_row below 2^31): a row of more than 8.4M items made this 0
  // or negative, and the loop never ended (review: H 131072 at D 512).
  const int64_t max_rows = std::max<int64_t>(1, ((int64_t{1} << 31) - 1) / per_row - kThreads);
  // r0 + n <= rows: no step past INT64_MAX (rows may be up to it: the ABI bounds P * T).
  for (int64_t r0 = 0, n = 0; r0 < rows; r0 += n) {
    n = rows - r0 < max_rows ? rows - r0 : max_rows;
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

}  // namespace nvfp4kv
