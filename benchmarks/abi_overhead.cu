// Host time per call of nvfp4kv_store from C (no Python), against a bare kernel launch: what the
// C ABI and the launcher add to a small store. Build and run on a GPU machine:
//   inc=$(python3 -c "import nvfp4kv; print(nvfp4kv.get_include())")
//   lib=$(python3 -c "import nvfp4kv; print(nvfp4kv.get_library_dir())")
//   nvcc -O2 -arch=sm_90 -I$inc benchmarks/abi_overhead.cu -L$lib -lnvfp4kv -Xlinker -rpath=$lib -o /tmp/abi && /tmp/abi
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>

#include "nvfp4kv/nvfp4kv.h"

__global__ void empty_kernel() {}

struct Big { char bytes[336]; };  // about the store's parameter block
__global__ void empty_big(const __grid_constant__ Big b) {}

template <class F>
double us_per_call(F f, int n = 20000) {
  for (int i = 0; i < 1000; ++i) f();
  cudaDeviceSynchronize();
  double best = 1e9;
  for (int rep = 0; rep < 5; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < n; ++i) f();
    cudaDeviceSynchronize();
    const auto t1 = std::chrono::steady_clock::now();
    const double us = std::chrono::duration<double, std::micro>(t1 - t0).count() / n;
    best = us < best ? us : best;
  }
  return best;
}

int main() {
  const int64_t N = 64, T = 16, H = 8, D = 128, F = 72;
  uint8_t* cache;
  uint16_t* kv;
  int64_t* slot;
  float* g;
  cudaMalloc(&cache, N * 2 * H * T * F);
  cudaMalloc(&kv, 2 * H * D * 2);
  cudaMalloc(&slot, 8);
  cudaMalloc(&g, 4);
  const int64_t one = 37;
  const float gv = 0.02f;
  cudaMemcpy(slot, &one, 8, cudaMemcpyHostToDevice);
  cudaMemcpy(g, &gv, 4, cudaMemcpyHostToDevice);
  cudaMemset(kv, 0, 2 * H * D * 2);
  int64_t ks[3] = {1, H, D}, kst[3] = {H * D, D, 1};
  int64_t cs[5] = {N, 2, T, H, F}, cst[5] = {2 * H * T * F, H * T * F, F, T * F, 1};
  int64_t ss[1] = {1}, sst[1] = {1};
  const DLDevice dev{kDLCUDA, 0};
  DLTensor kt{kv, dev, 3, {kDLBfloat, 16, 1}, ks, kst, 0};
  DLTensor vt{kv + H * D, dev, 3, {kDLBfloat, 16, 1}, ks, kst, 0};
  DLTensor ct{cache, dev, 5, {kDLUInt, 8, 1}, cs, cst, 0};
  DLTensor st{slot, dev, 1, {kDLInt, 64, 1}, ss, sst, 0};
  DLTensor gt{g, dev, 0, {kDLFloat, 32, 1}, nullptr, nullptr, 0};
  cudaStream_t stream;
  cudaStreamCreate(&stream);
  const double bare = us_per_call([&] { empty_kernel<<<1, 1, 0, stream>>>(); });
  const Big big{};
  const double bare_big = us_per_call([&] { empty_big<<<1, 1, 0, stream>>>(big); });
  const double store = us_per_call([&] {
    if (nvfp4kv_store(&kt, &vt, &ct, nullptr, &st, &gt, &gt, NVFP4KV_RECIPE_NVFP4, NVFP4KV_SCALES_VLLM, stream))
      printf("error: %s\n", nvfp4kv_last_error());
  });
  printf("host us per call, back to back: empty kernel %.2f, empty kernel with a 336-byte parameter %.2f, "
         "nvfp4kv_store of 1 token %.2f\n", bare, bare_big, store);
  return 0;
}
