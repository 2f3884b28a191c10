// The backend interface: what the C ABI (capi.cpp) calls to run an operation, implemented by the
// CPU backend (cpu/) and the CUDA backend (cuda/). Plain C++ over the parameter structs, no CUDA
// headers, so the C ABI compiles without nvcc. Parameters arrive validated; a backend checks only
// what needs its device.
#pragma once

#include "params.h"
#include "testing.h"

namespace nvfp4kv {

// ---- CPU backend (cpu/cpu.cpp) -------------------------------------------------------------------
void cpu_store(const StoreParams& p);
void cpu_dequantize(const DequantParams& p);
void cpu_gather(const GatherParams& p);
void cpu_decode(const DecodeParams& p);
void cpu_amax(const AmaxParams& p);  // cpu/amax.cpp
// Most threads a CPU call uses (1 to kMaxCpuThreads; 0: one per usable CPU, at most 16):
// nvfp4kv_set_cpu_threads.
constexpr int kMaxCpuThreads = 256;
void cpu_set_threads(int threads);
int cpu_threads();

// ---- CUDA backend (cuda/), only in a build with CUDA -----------------------------------------------
// Each launcher runs on the caller's stream, switches to `device` (the tensors' CUDA ordinal) and
// back, and returns a cudaError_t as an int (0: success); *message is set when the failure is
// that this GPU has no code in this build (reported as NOT_SUPPORTED), else left null.
int cuda_store(const StoreParams& p, int device, void* stream, const char** message);
int cuda_dequantize(const DequantParams& p, int device, void* stream, const char** message);
int cuda_gather(const GatherParams& p, int device, void* stream, const char** message);
int cuda_decode(const DecodeParams& p, int device, void* stream, const char** message);
// cuda/amax.cu: no host synchronization; with accumulate 0, a one-thread kernel writes 0 first, so
// a captured graph resets the result at every replay.
int cuda_amax(const AmaxParams& p, int device, void* stream, const char** message);
// The test switches of testing.h, as the CUDA backend keeps them.
void cuda_set_store_order(nvfp4kv_testing_store_order order);
void cuda_set_gather_kernel(nvfp4kv_testing_gather_kernel kernel);
// Number of devices, or -1 with *reason on failure.
int cuda_device_count(const char** reason);
const char* cuda_error_string(int err);

}  // namespace nvfp4kv
