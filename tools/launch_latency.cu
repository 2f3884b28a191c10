// Small calls without Python. First the host time per call back to back (an empty kernel, one
// with a store-sized parameter block, nvfp4kv_store of 1 token through the C ABI): what the C ABI
// and the launcher add to a launch. Then the time per node of CUDA graphs of small kernels: what
// a small store's ~2 µs inside a graph is made of. Each variant adds one ingredient of the store
// kernel's start (a large parameter block read through dependent constant loads, a global load, a
// shared-memory table and a barrier, a chain of two dependent loads, instruction fetch), and the
// last rows are nvfp4kv_store itself.
//   inc=$(python3 -c "import nvfp4kv; print(nvfp4kv.get_include())")
//   lib=$(python3 -c "import nvfp4kv; print(nvfp4kv.get_library())")
//   nvcc -O2 -arch=sm_90 -I$inc tools/launch_latency.cu $lib -Xlinker -rpath=$(dirname $lib) -o /tmp/lat && /tmp/lat
#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>

#include "nvfp4kv/nvfp4kv.h"

struct Params {
  const float* in;
  const long long* idx;
  float* out;
  int table[80];  // pads the block to ~336 bytes, like the store's
};

__global__ void k_empty() {}

// Three dependent constant loads (an index read from the parameters picks the next word).
__global__ void k_param(const __grid_constant__ Params p) {
  const int a = p.table[threadIdx.x & 7];
  const int b = p.table[(a + threadIdx.x) & 63];
  const int c = p.table[(b + 1) & 63];
  if (c == 12345) p.out[0] = 1.0f;
}

// One global load, one global store.
__global__ void k_load_store(const __grid_constant__ Params p) {
  p.out[threadIdx.x] = p.in[threadIdx.x] * 2.0f;
}

// A scale load, a 256-entry shared table from it, a barrier, one lookup, a store.
__global__ void k_table(const __grid_constant__ Params p) {
  __shared__ float table[256];
  const float g = p.in[0];
  table[threadIdx.x] = 1.0f / (g * (threadIdx.x + 1));
  __syncthreads();
  p.out[threadIdx.x] = table[(threadIdx.x * 7) & 255];
}

// Slot load, then an input load at an address it gives, then a store.
__global__ void k_chain(const __grid_constant__ Params p) {
  const long long s = p.idx[0];
  p.out[threadIdx.x] = p.in[(s + threadIdx.x) & 1023];
}

// Straight-line code of about N instructions (one 16-byte instruction each): what fetching a
// large kernel's instructions on an SM whose instruction cache is cold costs.
// Eight independent chains, one warp: it issues about one instruction per cycle, so N
// instructions take ~N/1.98 ns to run; the rest of the node's time is fetching them.
template <int N>
__global__ void k_long(const __grid_constant__ Params p) {
  float x[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) x[j] = p.table[(threadIdx.x + j) & 7];
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("add.f32 %0, %0, 0f3F800000;" : "+f"(x[i & 7]));
  float sum = 0.0f;
#pragma unroll
  for (int j = 0; j < 8; ++j) sum += x[j];
  if (sum == 12345.0f) p.out[0] = sum;
}

__global__ void k_big(const __grid_constant__ Params p) {}

// Host time per call, back to back (the best of 5 runs of 20000 calls).
template <class F>
double host_us_per_call(F f, int n = 20000) {
  for (int i = 0; i < 1000; ++i) f();
  cudaDeviceSynchronize();
  double best = 1e9;
  for (int rep = 0; rep < 5; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < n; ++i) f();
    cudaDeviceSynchronize();
    const double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / n;
    best = us < best ? us : best;
  }
  return best;
}

template <class F>
float graph_us_per_node(F launch, cudaStream_t s, int nodes = 100) {
  cudaGraph_t g;
  cudaGraphExec_t e;
  cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal);
  for (int i = 0; i < nodes; ++i) launch();
  cudaStreamEndCapture(s, &g);
  cudaGraphInstantiate(&e, g, 0);
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  for (int i = 0; i < 3; ++i) cudaGraphLaunch(e, s);
  float best = 1e9f;
  for (int rep = 0; rep < 10; ++rep) {
    cudaEventRecord(a, s);
    cudaGraphLaunch(e, s);
    cudaEventRecord(b, s);
    cudaEventSynchronize(b);
    float ms;
    cudaEventElapsedTime(&ms, a, b);
    best = ms < best ? ms : best;
  }
  cudaGraphExecDestroy(e);
  cudaGraphDestroy(g);
  return best * 1000.0f / nodes;
}

int main() {
  cudaStream_t s;
  cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
  Params p{};
  float *in, *out;
  long long* idx;
  cudaMalloc(&in, 4096 * 4);
  cudaMalloc(&out, 4096 * 4);
  cudaMalloc(&idx, 8);
  cudaMemset(in, 0, 4096 * 4);
  cudaMemset(idx, 0, 8);
  p.in = in;
  p.out = out;
  p.idx = idx;
  for (int i = 0; i < 80; ++i) p.table[i] = i;
  // nvfp4kv_store of 1 token (H 8, D 128, bf16, HND 5-D cache), device scales; then a padded
  // token (slot -1) that quantizes and stores nothing.
  const int64_t N = 64, T = 16, H = 8, D = 128, F = 72;
  uint8_t* cache;
  uint16_t* kv;
  int64_t* slots;
  float* gs;
  cudaMalloc(&cache, N * 2 * H * T * F);
  cudaMalloc(&kv, 2 * H * D * 2);
  cudaMalloc(&slots, 16);
  cudaMalloc(&gs, 4);
  const int64_t sv[2] = {37, -1};
  const float g = 0.02f;
  cudaMemcpy(slots, sv, 16, cudaMemcpyHostToDevice);
  cudaMemcpy(gs, &g, 4, cudaMemcpyHostToDevice);
  cudaMemset(kv, 0, 2 * H * D * 2);
  int64_t ks[3] = {1, H, D}, kst[3] = {H * D, D, 1};
  int64_t cs[5] = {N, 2, T, H, F}, cst[5] = {2 * H * T * F, H * T * F, F, T * F, 1};
  int64_t ss[1] = {1}, sst[1] = {1};
  const DLDevice dev{kDLCUDA, 0};
  DLTensor kt{kv, dev, 3, {kDLBfloat, 16, 1}, ks, kst, 0};
  DLTensor vt{kv + H * D, dev, 3, {kDLBfloat, 16, 1}, ks, kst, 0};
  DLTensor ct{cache, dev, 5, {kDLUInt, 8, 1}, cs, cst, 0};
  DLTensor gt{gs, dev, 0, {kDLFloat, 32, 1}, nullptr, nullptr, 0};
  float host_g = 0.02f;
  DLTensor ht{&host_g, DLDevice{kDLCPU, 0}, 0, {kDLFloat, 32, 1}, nullptr, nullptr, 0};
  DLTensor st0{slots, dev, 1, {kDLInt, 64, 1}, ss, sst, 0};
  const auto store_one = [&] {
    if (nvfp4kv_store(&kt, &vt, &ct, nullptr, &st0, &gt, &gt, NVFP4KV_RECIPE_NVFP4, NVFP4KV_SCALES_VLLM, s))
      printf("error: %s\n", nvfp4kv_last_error());
  };
  printf("host us per call, back to back:\n");
  printf("  empty kernel                                 %.2f\n", host_us_per_call([&] { k_empty<<<1, 1, 0, s>>>(); }));
  printf("  empty kernel, 336-byte parameters            %.2f\n", host_us_per_call([&] { k_big<<<1, 1, 0, s>>>(p); }));
  printf("  nvfp4kv_store of 1 token, device scales      %.2f\n", host_us_per_call(store_one));
  printf("graph us per node:\n");
  printf("  empty kernel, 1x256                          %.2f\n", graph_us_per_node([&] { k_empty<<<1, 256, 0, s>>>(); }, s));
  printf("  336-byte parameters, 3 dependent reads       %.2f\n", graph_us_per_node([&] { k_param<<<1, 256, 0, s>>>(p); }, s));
  printf("  one load, one store                          %.2f\n", graph_us_per_node([&] { k_load_store<<<1, 256, 0, s>>>(p); }, s));
  printf("  scale load, shared table, barrier, store     %.2f\n", graph_us_per_node([&] { k_table<<<1, 256, 0, s>>>(p); }, s));
  printf("  slot load, dependent input load, store       %.2f\n", graph_us_per_node([&] { k_chain<<<1, 256, 0, s>>>(p); }, s));
  printf("  straight-line code, 500 instructions, 1 warp        %.2f\n", graph_us_per_node([&] { k_long<500><<<1, 32, 0, s>>>(p); }, s));
  printf("  straight-line code, 1000 instructions, 1 warp       %.2f\n", graph_us_per_node([&] { k_long<1000><<<1, 32, 0, s>>>(p); }, s));
  printf("  straight-line code, 2000 instructions, 1 warp       %.2f\n", graph_us_per_node([&] { k_long<2000><<<1, 32, 0, s>>>(p); }, s));

  for (int which = 0; which < 2; ++which) {
    DLTensor st{slots + which, dev, 1, {kDLInt, 64, 1}, ss, sst, 0};
    for (int host = 0; host < 2; ++host) {
      const DLTensor* sc = host ? &ht : &gt;
      const float us = graph_us_per_node([&] {
        if (nvfp4kv_store(&kt, &vt, &ct, nullptr, &st, sc, sc, NVFP4KV_RECIPE_NVFP4, NVFP4KV_SCALES_VLLM, s))
          printf("error: %s\n", nvfp4kv_last_error());
      }, s);
      printf("  nvfp4kv_store, %s, %s scales %s%.2f\n", which ? "padded token (slot -1)" : "1 token", host ? "host" : "device",
             which ? "" : "               ", us);
    }
  }
  const cudaError_t err = cudaDeviceSynchronize();
  printf("%s\n", cudaGetErrorString(err));
  return 0;
}
