// Launchers of the CUDA kernels: plain C++ declarations, no CUDA headers, so the C ABI compiles
// without nvcc. Parameters are validated by the C ABI; the launchers check only what needs the
// device (alignment of vector accesses, an architecture with code in this build) and return
// cudaError_t as an int (0 = success) plus a message for the last error.
#pragma once

#include "params.h"

namespace nvfp4kv {

// device: the CUDA ordinal of the tensors; the launcher switches to it and back.
int cuda_store(const StoreParams& p, int device, void* stream, const char** message);
// Which store kernels take calls given a workspace, process-wide (nvfp4kv_set_store_order).
constexpr int kStoreOrderAuto = 0, kStoreOrderPage = 1, kStoreOrderToken = 2;
void cuda_set_store_order(int order);
int cuda_dequantize(const DequantParams& p, int device, void* stream, const char** message);
int cuda_gather(const GatherParams& p, int device, void* stream, const char** message);
// Which gather kernels take calls, process-wide (nvfp4kv_set_gather_kernel).
constexpr int kGatherAuto = 0, kGatherPages = 1, kGatherRows = 2;
void cuda_set_gather_kernel(int which);
// Number of devices, or -1 with *reason on failure.
int cuda_device_count(const char** reason);
const char* cuda_error_string(int err);

}  // namespace nvfp4kv
