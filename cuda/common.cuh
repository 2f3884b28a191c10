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

// Blocks for a grid-stride kernel: enough to fill every SM, never more than the work needs.
int grid_blocks(int device, int64_t threads_needed, int blocks_per_sm);

// Message for "this GPU has no code in this build", or nullptr if the kernel can run.
const char* check_kernel_image(cudaError_t err);

}  // namespace nvfp4kv
