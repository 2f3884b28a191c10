// Shared pieces of the CUDA kernels: launch geometry, fast integer division, device guard.
#pragma once

#include <cuda_runtime.h>
#include <stdint.h>

#include "params.h"

namespace nvfp4kv {

constexpr int kThreads = 256;

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

// Multiprocessors of a device (cached per device).
int sm_count(int device);

// Blocks for a grid-stride kernel: enough to fill every SM, never more than the work needs.
int grid_blocks(int device, int64_t threads_needed, int blocks_per_sm);

// Message for "this GPU has no code in this build", or nullptr if the kernel can run.
const char* check_kernel_image(cudaError_t err);

}  // namespace nvfp4kv
