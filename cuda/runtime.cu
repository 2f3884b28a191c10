// Device queries shared by the launchers, and the CUDA-availability report of build_info().
#include <stdio.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include <mutex>

#include "backend.h"
#include "common.cuh"

namespace nvfp4kv {

namespace {

// A device attribute, read once per device (devices 0..63 are kept; others are asked each time).
// `fallback` stands in for a failed query, for that call only: a kept fallback (an SM count of 1)
// would shrink every later launch's grid on that device for the life of the process.
int device_attribute(std::atomic<int> (&kept)[64], cudaDeviceAttr attr, int device, int fallback) {
  const bool keep = device >= 0 && device < 64;
  int v = keep ? kept[device].load(std::memory_order_relaxed) : 0;
  if (v != 0) return v;
  if (cudaDeviceGetAttribute(&v, attr, device) != cudaSuccess) {
    (void)cudaGetLastError();  // the query's own error, not left for the caller's next check
    return fallback;
  }
  if (v <= 0) return fallback;
  if (keep) kept[device].store(v, std::memory_order_relaxed);
  return v;
}

}  // namespace

int sm_count(int device) {
  static std::atomic<int> counts[64];  // zero: not read yet
  return device_attribute(counts, cudaDevAttrMultiProcessorCount, device, 1);
}

int64_t l2_bytes(int device) {
  static std::atomic<int> sizes[64];
  return device_attribute(sizes, cudaDevAttrL2CacheSize, device, 50 << 20);
}

namespace {
// Compiled like every kernel of the library (one architecture list for every file), so its PTX
// version is that of the code the device runs.
__global__ void code_probe_kernel() {}

int device_major(int device) {
  static std::atomic<int> major[64];  // compute capability major; -1: the query failed
  return device_attribute(major, cudaDevAttrComputeCapabilityMajor, device, -1);
}

// The architecture major the device's code was compiled for: the device's own, or lower where the
// driver compiled an older architecture's PTX for it at load time (a build of compute_80 PTX alone
// on a Hopper GPU). Such code lacks what that architecture lacks (bulk copies, cluster merges,
// griddepcontrol.wait: compiled out below 9.0), so every selection asks this, not the device
// (design notes: "Programmatic dependent launch"). 0 where the build has no code for the device
// (not kept: asked again at the next call), -1 where the device's own query failed; otherwise
// asked once per device and kept.
int code_major(int device) {
  static std::atomic<int> kept[64];  // the major + 1; 0: not asked yet
  const bool keep = device >= 0 && device < 64;
  if (keep) {
    const int v = kept[device].load(std::memory_order_relaxed);
    if (v != 0) return v - 1;
  }
  cudaFuncAttributes attr{};
  if (cudaFuncGetAttributes(&attr, code_probe_kernel) != cudaSuccess) {
    (void)cudaGetLastError();  // the query's own error, not left for the caller's next check
    return 0;
  }
  const int major = std::min(device_major(device), attr.ptxVersion / 10);
  if (keep) kept[device].store(major + 1, std::memory_order_relaxed);
  return major;
}
}  // namespace

DeviceInfo device_info(int device) { return DeviceInfo{sm_count(device), l2_bytes(device), code_major(device)}; }

bool pdl_supported(int device) {
  // Once per process: NVFP4KV_PDL=0 turns it off; and the driver must be able to capture such
  // launches in CUDA graphs (programmatic graph edges came with CUDA 12.3).
  static const bool allowed = [] {
    const char* env = std::getenv("NVFP4KV_PDL");
    if (env && std::strcmp(env, "0") == 0) return false;
    int driver = 0;
    return cudaDriverGetVersion(&driver) == cudaSuccess && driver >= 12030;
  }();
  // And code compiled for 9.0 or later: without griddepcontrol.wait in the kernels (compiled out
  // below 9.0), nothing would order a kernel after the one before it (review).
  return allowed && code_major(device) >= 9;
}

int grid_blocks(int device, int64_t threads_needed, int blocks_per_sm) {
  const int sms = sm_count(device);
  const int64_t needed = (threads_needed + kThreads - 1) / kThreads;
  const int64_t cap = static_cast<int64_t>(sms) * blocks_per_sm;
  return static_cast<int>(needed < cap ? (needed > 0 ? needed : 1) : cap);
}

const char* check_kernel_image(cudaError_t err) {
  if (err == cudaErrorNoKernelImageForDevice || err == cudaErrorInvalidDeviceFunction ||
      err == cudaErrorUnsupportedPtxVersion) {
    return "this GPU's architecture has no code in this build of nvfp4kv (built for "
           NVFP4KV_CUDA_ARCHS "); rebuild with -DNVFP4KV_CUDA_ARCHS=<your sm> or install the "
           "wheel matching your CUDA driver";
  }
  return nullptr;
}

int cuda_device_count(const char** reason) {
  int driver = 0;
  const cudaError_t derr = cudaDriverGetVersion(&driver);
  if (derr != cudaSuccess || driver == 0) {
    *reason = "no NVIDIA driver found (libcuda.so.1 is not loadable)";
    return -1;
  }
  if (driver < CUDART_VERSION / 1000 * 1000) {
    static char msg[160];
    snprintf(msg, sizeof msg,
             "the NVIDIA driver supports CUDA %d.%d but this build needs CUDA %d.x; update the "
             "driver or install the wheel for your CUDA major version",
             driver / 1000, driver % 1000 / 10, CUDART_VERSION / 1000);
    *reason = msg;
    return -1;
  }
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err == cudaErrorNoDevice || (err == cudaSuccess && n == 0)) {
    *reason = "no CUDA device is visible (check CUDA_VISIBLE_DEVICES)";
    return -1;
  }
  if (err != cudaSuccess) {
    *reason = cudaGetErrorString(err);
    return -1;
  }
  return n;
}

const char* cuda_error_string(int err) { return cudaGetErrorString(static_cast<cudaError_t>(err)); }

}  // namespace nvfp4kv
