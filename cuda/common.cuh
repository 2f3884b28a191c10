// Shared pieces of the CUDA kernels: launch geometry, fast integer division, device guard.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include <atomic>
#include <initializer_list>

#include "params.h"
#include "plan.h"

namespace nvfp4kv {

constexpr int kThreads = 256;

// Rows of `row` work items side by side in a block of about kThreads threads (at least one row):
// the block shape of the kernels that keep one work item per thread for a whole launch.
inline uint32_t rows_per_block(uint32_t row) { return row < kThreads ? kThreads / row : 1; }

// Unsigned division by a divisor fixed for the whole launch: one mul.hi, one add, one shift
// instead of the ~20 instructions of a run-time `/`. Valid for dividends < 2^31.
struct FastDiv {
  uint32_t d, mul, shift;
  FastDiv() = default;
  explicit FastDiv(uint32_t divisor) : d(divisor) {
    shift = 0;
    while (shift < 32 && (1ull << shift) < divisor) ++shift;
    mul = static_cast<uint32_t>(((1ull << 32) * ((1ull << shift) - divisor)) / divisor + 1);
  }
  __device__ __forceinline__ uint32_t div(uint32_t n) const {
    return (__umulhi(n, mul) + n) >> shift;
  }
  // n / d for any n >= 0: the fast division below 2^31, the hardware one above.
  __device__ __forceinline__ int64_t div_any(int64_t n) const {
    return n < (int64_t{1} << 31) ? static_cast<int64_t>(div(static_cast<uint32_t>(n))) : n / d;
  }
};

// The work items of one row position (a token being stored or read, or a (page, position)):
// H heads of the K side, then H heads of the V side, each row split into its groups, g groups per
// item. Shared by every kernel so the decomposition is written once.
struct RowItems {
  FastDiv per_row;           // items per row position: H * (Gk + Gv) / g
  FastDiv k_units, v_units;  // items per head row of each side: G / g
  uint32_t k_items;          // items of the K side: H * Gk / g

  RowItems() = default;
  RowItems(int32_t H, int32_t Dk, int32_t Dv, uint32_t g)
      : per_row(static_cast<uint32_t>(H) * (Dk / kGroupSize + Dv / kGroupSize) / g),
        k_units(static_cast<uint32_t>(Dk / kGroupSize) / g),
        v_units(static_cast<uint32_t>(Dv / kGroupSize) / g),
        k_items(static_cast<uint32_t>(H) * (Dk / kGroupSize) / g) {}

  // Item r (< per_row.d) of a row position -> side (0 K, 1 V), head, item within the head's row.
  __device__ __forceinline__ void decode(uint32_t r, int& side, uint32_t& h, uint32_t& unit) const {
    side = r >= k_items;
    if (side) r -= k_items;
    const FastDiv& units = side ? v_units : k_units;
    h = units.div(r);
    unit = r - h * units.d;
  }
};

// Where the codes and scale bytes of a thread's groups sit inside one side of a page, for a
// thread that keeps one (head h, first group g0) for a whole launch. Every offset of FORMAT.md §4
// is affine in h and g0 at position 0, and in the position (interleaved scales: in pos / 4 and
// pos % 4), so the launcher evaluates the format core's offset functions at a few points once
// per call (SideOffsets, host) and each thread needs two multiply-adds per offset (PageOffsets):
// the layout stays defined in one place, and a small launch does not spend its latency on
// 64-bit index arithmetic.
struct SideOffsets {
  uint32_t data0, data_h, data_g, data_pos;  // code bytes of (h, g0, pos)
  uint32_t scale0, scale_h, scale_g, scale_pos;  // scale byte; scale_pos per 4 positions if interleaved
  int32_t interleaved;

  static SideOffsets make(const CacheSide& c, Layout layout, int32_t H, int32_t T) {
    const int32_t D = c.D;
    const auto data = [&](int64_t h, int64_t pos, int64_t g) {
      return data_offset(row_index(layout, h, pos, H, T), D) + 8 * g;
    };
    const auto scale = [&](int64_t h, int64_t pos, int64_t g) {
      return c.interleaved ? scale_offset_interleaved(h, pos, g, T, H, D)
                           : scale_offset_linear(row_index(layout, h, pos, H, T), g, H, T, D);
    };
    SideOffsets o;
    o.interleaved = c.interleaved;
    o.data0 = static_cast<uint32_t>(data(0, 0, 0));
    o.data_h = static_cast<uint32_t>(data(1, 0, 0) - data(0, 0, 0));
    o.data_g = static_cast<uint32_t>(data(0, 0, 1) - data(0, 0, 0));
    o.data_pos = static_cast<uint32_t>(data(0, 1, 0) - data(0, 0, 0));
    o.scale0 = static_cast<uint32_t>(scale(0, 0, 0));
    o.scale_h = static_cast<uint32_t>(scale(1, 0, 0) - scale(0, 0, 0));
    o.scale_g = static_cast<uint32_t>(scale(0, 0, 1) - scale(0, 0, 0));
    o.scale_pos = static_cast<uint32_t>(scale(0, c.interleaved ? kInterleave : 1, 0) - scale(0, 0, 0));
    return o;
  }
};

struct PageOffsets {
  uint32_t data0, data_pos;                // code bytes of group g0: data0 + pos * data_pos
  uint32_t scale0, scale_pos, scale_step;  // scale byte of group g0 + k: see scale()
  int32_t interleaved;

  __device__ __forceinline__ void init(const SideOffsets& o, uint32_t h, uint32_t g0) {
    data0 = o.data0 + h * o.data_h + g0 * o.data_g;
    data_pos = o.data_pos;
    scale0 = o.scale0 + h * o.scale_h + g0 * o.scale_g;
    scale_pos = o.scale_pos;
    scale_step = o.scale_g;
    interleaved = o.interleaved;
  }

  __device__ __forceinline__ uint32_t data(uint32_t pos) const { return data0 + pos * data_pos; }
  __device__ __forceinline__ uint32_t scale(uint32_t pos, int k) const {
    const uint32_t q = interleaved ? (pos / kInterleave) * scale_pos + pos % kInterleave : pos * scale_pos;
    return scale0 + q + k * scale_step;
  }
};

// The shared-memory address of a pointer into shared memory (the operand of asynchronous copies,
// mbarriers and cluster loads).
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Makes `device` current for the launch and restores the caller's device afterwards, so tensors
// on cuda:1 work whatever the current device is.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (cudaGetDevice(&prev_) != cudaSuccess) prev_ = -1;
    if (prev_ != device) err_ = cudaSetDevice(device);
  }
  ~DeviceGuard() {
    if (prev_ >= 0 && err_ == cudaSuccess) cudaSetDevice(prev_);
  }
  cudaError_t error() const { return err_; }

 private:
  int prev_ = -1;
  cudaError_t err_ = cudaSuccess;
};

// A global scale's value: read on the device when it lives there (graph replays see its current
// value), else the one the host passed.
__device__ __forceinline__ float read_scale(const ScaleArg& s) {
  return s.device_ptr ? *s.device_ptr : s.value;
}

// Whether a pointer and every stride times `esize` bytes are multiples of `to`, a power of two
// (vector loads and stores). The products are taken modulo 2^64, a multiple of `to`, so the answer
// is the same: a dimension of size 1 may carry any stride, and 2^62 x 4 overflows an int64.
inline bool aligned(int64_t to, const void* ptr, std::initializer_list<int64_t> strides, int64_t esize = 1) {
  const uint64_t m = static_cast<uint64_t>(to);
  if (reinterpret_cast<uintptr_t>(ptr) % m != 0) return false;
  for (const int64_t s : strides)
    if (static_cast<uint64_t>(s) * static_cast<uint64_t>(esize) % m != 0) return false;
  return true;
}

// Multiprocessors of a device, and its L2 cache in bytes (cached per device).
int sm_count(int device);
int64_t l2_bytes(int device);
// What kernel selection (plan.h) needs to know of a device (cached per device).
DeviceInfo device_info(int device);

// Blocks for a grid-stride kernel: enough to fill every SM, never more than the work needs.
int grid_blocks(int device, int64_t threads_needed, int blocks_per_sm);

// Blocks of `kernel` resident on one SM at `threads` threads per block (at least 1), asked of
// the runtime once per device and block shape (threads and dynamic shared memory) and kept (a
// few shapes per device; others replace the oldest). Fails like a launch on a GPU the build has
// no code for. The runtime answers for the current device: callers hold a DeviceGuard for
// `device`.
template <auto kernel>
cudaError_t resident_per_sm(int device, int threads, int* blocks, size_t smem = 0) {
  constexpr int kKept = 4;
  // Per instantiation: (threads << 40) | (smem << 8) | blocks; threads <= 1024, smem < 2^32,
  // blocks < 256.
  static std::atomic<uint64_t> known[64][kKept];
  static std::atomic<unsigned> next[64];
  const bool keep = device >= 0 && device < 64 && smem < (uint64_t{1} << 32);
  const uint64_t shape = static_cast<uint64_t>(threads) << 40 | static_cast<uint64_t>(smem) << 8;
  if (keep) {
    for (int i = 0; i < kKept; ++i) {
      const uint64_t k = known[device][i].load(std::memory_order_relaxed);
      if (k != 0 && (k & ~uint64_t{0xFF}) == shape) {
        *blocks = static_cast<int>(k & 0xFF);
        return cudaSuccess;
      }
    }
  }
  int n = 0;
  const cudaError_t err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem);
  if (err != cudaSuccess) return err;
  *blocks = n > 1 ? (n < 255 ? n : 255) : 1;
  if (keep)
    known[device][next[device].fetch_add(1, std::memory_order_relaxed) % kKept].store(
        shape | static_cast<uint64_t>(*blocks), std::memory_order_relaxed);
  return cudaSuccess;
}

// Lets `kernel` take kBytes of dynamic shared memory (what its largest block needs) on `device`,
// once per device: one value for every call, so concurrent callers with different block sizes
// cannot undo each other's setting between it and their launch. The runtime applies it to the
// current device (callers hold a DeviceGuard).
template <auto kernel, size_t kBytes>
cudaError_t allow_shared_memory(int device) {
  static std::atomic<bool> done[64];
  const bool keep = device >= 0 && device < 64;
  if (keep && done[device].load(std::memory_order_relaxed)) return cudaSuccess;
  const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes);
  if (err == cudaSuccess && keep) done[device].store(true, std::memory_order_relaxed);
  return err;
}

// Message for "this GPU has no code in this build", or nullptr if the kernel can run.
const char* check_kernel_image(cudaError_t err);

// Programmatic dependent launch (Hopper and later): every kernel of the library is launched so
// that it may start while the kernel before it in the stream finishes, and lets the kernel after
// it start early. A kernel does only parameter arithmetic before wait_for_prior_grids() (which
// returns once every earlier grid of the stream has completed and its writes are visible, or at
// once when launched without the attribute; one exception, decode_combine_kernel, reads a global
// scale there and says why it may), and calls allow_next_grids() once its own blocks
// are all resident: a grid launched after it with the attribute may then be scheduled, and it
// waits in turn before touching memory. Kernels launched without the attribute (torch's, most
// attention kernels) are serialized as usual. Inside a CUDA graph the same holds through
// programmatic edges.
__device__ __forceinline__ void wait_for_prior_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void allow_next_grids() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Whether launches on the device use programmatic dependent launch: code compiled for 9.0 or
// later (device_info's cc_major), a driver that captures such launches, NVFP4KV_PDL not 0.
bool pdl_supported(int device);

// kernel<<<grid, block, smem, stream>>>(arg), with programmatic stream serialization allowed
// where the device has it; cluster_x > 1: thread-block clusters of cluster_x blocks along x
// (sm_90+, grid.x a multiple of it).
template <class Arg>
cudaError_t launch_pdl(void (*kernel)(Arg), dim3 grid, dim3 block, int device, cudaStream_t stream,
                       const Arg& arg, size_t smem = 0, unsigned cluster_x = 1) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attr[2];
  unsigned n = 0;
  if (pdl_supported(device)) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster_x > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = cluster_x;
    attr[n].val.clusterDim.y = 1;
    attr[n++].val.clusterDim.z = 1;
  }
  config.attrs = attr;
  config.numAttrs = n;
  return cudaLaunchKernelEx(&config, kernel, arg);
}

}  // namespace nvfp4kv
