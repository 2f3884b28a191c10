// CUDA amax (nvfp4kv_amax): max(|x|) over a tensor at memory bandwidth. A grid-stride loop in
// which each thread keeps kUnroll loads in flight (16-byte loads where x's rows allow them), the
// largest |x| kept on the elements' bits (params.h: non-negative floats, NaN included, order like
// their bits), a block reduction, then one atomicMax per block on the result's int32 bits: the
// result does not depend on the order in which blocks finish, and equals the CPU path's bit for
// bit. No allocation, no host synchronization; with accumulate 0 a one-thread kernel writes 0
// first, so a CUDA graph that captured the call recomputes the maximum at each replay.
#include "backend.h"
#include "common.cuh"

namespace nvfp4kv {
namespace {

constexpr int kUnroll = 4;

// n / d for 0 <= n < 2^62: the fast division where n and d are below 2^31, else the hardware one.
struct Div64 {
  FastDiv fast;
  int64_t d;
  Div64() = default;
  explicit Div64(int64_t divisor)
      : fast(divisor < (int64_t{1} << 31) ? static_cast<uint32_t>(divisor) : 1u), d(divisor) {}
  __device__ __forceinline__ int64_t div(int64_t n) const {
    return d < (int64_t{1} << 31) && n < (int64_t{1} << 31) ? static_cast<int64_t>(fast.div(static_cast<uint32_t>(n)))
                                                            : n / d;
  }
};

enum class Mode : int { kFlat, kRowsVec, kScalar };

struct AmaxLaunch {
  AmaxParams p;
  int64_t units;            // work items: 16-byte vectors (kFlat, kRowsVec) or elements (kScalar)
  Div64 per_row;            // items per row (the last dimension)
  Div64 outer[8];           // shape[d] of the outer dimensions (d < ndim - 1)
  const uint8_t* body;      // kFlat: the first 16-byte aligned address
  const uint8_t* head;      // kFlat: elements before body
  const uint8_t* tail;      // kFlat: elements after the last whole vector
  int32_t nhead, ntail;
  int32_t vec;              // elements per vector
};

// The |x| bits of a 32-bit word folded into a running maximum: one float32 element, or two
// 16-bit elements kept as two halves (a maximum per half).
template <bool k16>
__device__ __forceinline__ uint32_t fold(uint32_t m, uint32_t w) {
  if constexpr (k16)
    return __vmaxu2(m, w & 0x7FFF7FFFu);
  else
    return max(m, w & 0x7FFFFFFFu);
}

template <bool k16>
__device__ __forceinline__ uint32_t load_element(const uint8_t* ptr) {
  if constexpr (k16)
    return __ldg(reinterpret_cast<const unsigned short*>(ptr));
  else
    return __ldg(reinterpret_cast<const unsigned int*>(ptr));
}

template <bool k16, Mode kMode>
__global__ void __launch_bounds__(kThreads) amax_kernel(const __grid_constant__ AmaxLaunch L) {
  const AmaxParams& p = L.p;
  constexpr int64_t kElem = k16 ? 2 : 4;
  wait_for_prior_grids();  // x may be the previous kernel's output
  allow_next_grids();
  const int64_t gid = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t step = static_cast<int64_t>(gridDim.x) * kThreads;
  const int last = p.ndim - 1;
  const auto address = [&](int64_t u) -> const uint8_t* {
    if constexpr (kMode == Mode::kFlat) {
      return L.body + u * 16;
    } else {
      int64_t row = L.per_row.div(u);
      const int64_t c = u - row * L.per_row.d;
      int64_t off = c * (kMode == Mode::kRowsVec ? L.vec : p.stride[last]);
      for (int d = last - 1; d > 0; --d) {
        const int64_t q = L.outer[d].div(row);
        off += (row - q * p.shape[d]) * p.stride[d];
        row = q;
      }
      if (last > 0) off += row * p.stride[0];
      return static_cast<const uint8_t*>(p.x) + off * kElem;
    }
  };
  uint32_t m = 0;
  for (int64_t u0 = gid; u0 < L.units; u0 += kUnroll * step) {
    if constexpr (kMode == Mode::kScalar) {
      uint32_t w[kUnroll];
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        const int64_t u = u0 + k * step;
        w[k] = u < L.units ? load_element<k16>(address(u)) : 0u;
      }
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) m = fold<k16>(m, w[k]);
    } else {
      uint4 v[kUnroll];
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        const int64_t u = u0 + k * step;
        v[k] = u < L.units ? __ldg(reinterpret_cast<const uint4*>(address(u))) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        m = fold<k16>(fold<k16>(m, v[k].x), v[k].y);
        m = fold<k16>(fold<k16>(m, v[k].z), v[k].w);
      }
    }
  }
  if constexpr (kMode == Mode::kFlat) {  // the unaligned ends: fewer than one vector each
    if (gid < L.nhead) m = fold<k16>(m, load_element<k16>(L.head + gid * kElem));
    if (gid < L.ntail) m = fold<k16>(m, load_element<k16>(L.tail + gid * kElem));
  }
  uint32_t raw = k16 ? max(m & 0xFFFFu, m >> 16) : m;
  raw = __reduce_max_sync(0xFFFFFFFFu, raw);
  __shared__ uint32_t warp_max[kThreads / 32];
  if (threadIdx.x % 32 == 0) warp_max[threadIdx.x / 32] = raw;
  __syncthreads();
  if (threadIdx.x < 32) {
    raw = threadIdx.x < kThreads / 32 ? warp_max[threadIdx.x] : 0u;
    raw = __reduce_max_sync(0xFFFFFFFFu, raw);
    if (threadIdx.x == 0) {
      const int32_t r = amax_bits(raw, p.dtype);
      // The stored value only grows: an update at or below what it holds already changes nothing.
      if (r > *reinterpret_cast<volatile int32_t*>(p.amax)) atomicMax(p.amax, r);
    }
  }
}

__global__ void amax_zero(int32_t* amax) {
  wait_for_prior_grids();  // an earlier kernel of the stream may still read or update it
  allow_next_grids();
  *amax = 0;
}

template <bool k16>
cudaError_t launch(const AmaxLaunch& L, Mode mode, int blocks, int device, cudaStream_t stream) {
  switch (mode) {
    case Mode::kFlat: return launch_pdl(amax_kernel<k16, Mode::kFlat>, dim3(blocks), dim3(kThreads), device, stream, L);
    case Mode::kRowsVec:
      return launch_pdl(amax_kernel<k16, Mode::kRowsVec>, dim3(blocks), dim3(kThreads), device, stream, L);
    default: return launch_pdl(amax_kernel<k16, Mode::kScalar>, dim3(blocks), dim3(kThreads), device, stream, L);
  }
}

}  // namespace

int cuda_amax(const AmaxParams& p, int device, void* stream_ptr, const char** message) {
  *message = nullptr;
  const bool any = p.ndim > 0 && p.numel > 0;
  if (!any && p.accumulate) return 0;
  DeviceGuard guard(device);
  if (guard.error() != cudaSuccess) return guard.error();
  cudaStream_t stream = static_cast<cudaStream_t>(stream_ptr);
  if (!p.accumulate) {
    const cudaError_t err = launch_pdl(amax_zero, dim3(1), dim3(1), device, stream, p.amax);
    if (err != cudaSuccess) {
      *message = check_kernel_image(err);
      return err;
    }
  }
  if (!any) return 0;

  AmaxLaunch L{};
  L.p = p;
  const int64_t esize = dtype_bytes(p.dtype);
  const int last = p.ndim - 1;
  const uintptr_t base = reinterpret_cast<uintptr_t>(p.x);
  L.vec = static_cast<int32_t>(16 / esize);
  Mode mode = Mode::kScalar;
  if (p.ndim == 1 && p.stride[0] == 1) {
    mode = Mode::kFlat;
    const int64_t head = static_cast<int64_t>((16 - base % 16) % 16) / esize;
    L.nhead = static_cast<int32_t>(head < p.numel ? head : p.numel);
    L.head = static_cast<const uint8_t*>(p.x);
    L.body = L.head + L.nhead * esize;
    L.units = (p.numel - L.nhead) / L.vec;
    L.tail = L.body + L.units * 16;
    L.ntail = static_cast<int32_t>(p.numel - L.nhead - L.units * L.vec);
  } else {
    bool vec = p.stride[last] == 1 && p.shape[last] % L.vec == 0 && base % 16 == 0;
    for (int d = 0; d < last; ++d) vec = vec && p.stride[d] % L.vec == 0;
    mode = vec ? Mode::kRowsVec : Mode::kScalar;
    const int64_t per_row = vec ? p.shape[last] / L.vec : p.shape[last];
    L.per_row = Div64(per_row);
    for (int d = 0; d < last; ++d) L.outer[d] = Div64(p.shape[d]);
    L.units = p.numel / p.shape[last] * per_row;
  }
  const int64_t threads = (L.units + kUnroll - 1) / kUnroll;
  const int64_t ends = L.nhead > L.ntail ? L.nhead : L.ntail;
  const int blocks = grid_blocks(device, threads > ends ? threads : ends, 8);
  const cudaError_t err = esize == 2 ? launch<true>(L, mode, blocks, device, stream)
                                     : launch<false>(L, mode, blocks, device, stream);
  if (err != cudaSuccess) {
    *message = check_kernel_image(err);
    return err;
  }
  return 0;
}

}  // namespace nvfp4kv
