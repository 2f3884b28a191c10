// Memory ceilings of the store's and the gather's access patterns, with no quantization: what the
// memory system allows for each pattern, so the library's kernels can be judged against the
// right ceiling. Standalone (CUDA runtime only):
//   nvcc -O3 -arch=sm_90 -o /tmp/patterns tools/patterns.cu && /tmp/patterns
// Geometry of the issues' benchmark: H 8, D 128, T 16, bf16, HND pages [K data|K scale|V data|V
// scale], random unique slots. The "compute" is an XOR fold so the loads cannot be dropped.
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>

#include <algorithm>
#include <random>
#include <string>
#include <vector>

#define CHECK(x)                                                                    \
  do {                                                                              \
    cudaError_t e_ = (x);                                                           \
    if (e_ != cudaSuccess) {                                                        \
      fprintf(stderr, "%s:%d %s\n", __FILE__, __LINE__, cudaGetErrorString(e_));    \
      return 1;                                                                     \
    }                                                                               \
  } while (0)

constexpr int H = 8, D = 128, T = 16;
constexpr int kRowBytes = D * 2;                 // one head row of bf16 input
constexpr int kTokenIn = H * kRowBytes;          // one side of one token: 2048 B
constexpr int kSide = H * T * (D / 2 + D / 16);  // 9216 B
constexpr int kPage = 2 * kSide;
constexpr int kItems = 2 * H * (D / 32);         // items of 2 groups per token: 64

__device__ __forceinline__ uint32_t fold(uint4 a) { return a.x ^ a.y ^ a.z ^ a.w; }

__device__ __forceinline__ uint64_t evict_last() {
  uint64_t policy;
  asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(policy));
  return policy;
}

// Store pattern: one thread per (token, side, head, 2 groups); kCoalesced loads the block's token
// rows with consecutive 16-byte words per lane through shared memory instead of 64 contiguous
// bytes per thread. kScales: also the 2 scale bytes per item (2: with an L2 evict-last hint).
// kData: code stores plain (0), evict-last (1) or streaming (2). `order` (thread loads only): step
// i takes token order[i] instead of token i.
template <bool kCoalesced, int kScales, int kData = 0>
__global__ void __launch_bounds__(256) store_pattern(const uint8_t* __restrict__ k, const uint8_t* __restrict__ v,
                                                     const int32_t* __restrict__ slots, uint8_t* cache, int n,
                                                     const int32_t* __restrict__ order = nullptr) {
  __shared__ uint4 tile[4 * 2 * kTokenIn / 16];  // 4 tokens x 2 sides
  const int at = blockIdx.x * 4 + threadIdx.x / kItems;  // step
  const int t = !kCoalesced && order && at < n ? order[at] : at;
  const int item = threadIdx.x % kItems;
  const int side = item / (kItems / 2), h = (item / 4) % H, u = item % 4;
  uint4 w[4];
  if (kCoalesced) {
    const int t0 = blockIdx.x * 4;
    for (int i = threadIdx.x; i < 4 * 2 * kTokenIn / 16; i += 256) {
      const int tok = i / (2 * kTokenIn / 16), rem = i % (2 * kTokenIn / 16);
      const int sd = rem / (kTokenIn / 16), off = rem % (kTokenIn / 16);
      if (t0 + tok < n)
        tile[i] = __ldcs(reinterpret_cast<const uint4*>((sd ? v : k) + (int64_t)(t0 + tok) * kTokenIn) + off);
    }
    __syncthreads();
    if (t >= n) return;
    const uint4* s = tile + (threadIdx.x / kItems) * (2 * kTokenIn / 16) + side * (kTokenIn / 16) + h * (kRowBytes / 16) + u * 4;
#pragma unroll
    for (int j = 0; j < 4; ++j) w[j] = s[(j + u) % 4];  // rotated: fewer bank conflicts
  } else {
    if (at >= n) return;
    const uint4* s = reinterpret_cast<const uint4*>((side ? v : k) + (int64_t)t * kTokenIn + h * kRowBytes + u * 64);
#pragma unroll
    for (int j = 0; j < 4; ++j) w[j] = __ldcs(s + j);
  }
  const int slot = slots[t];
  const int page = slot / T, pos = slot % T;
  uint8_t* base = cache + (int64_t)page * kPage + side * kSide;
  const uint32_t a = fold(w[0]), b = fold(w[1]), c = fold(w[2]), d = fold(w[3]);
  uint4* dp = reinterpret_cast<uint4*>(base + (h * T + pos) * (D / 2) + u * 16);
  if (kData == 0) *dp = make_uint4(a, b, c, d);
  if (kData == 1)
    asm volatile("st.global.L2::cache_hint.v4.u32 [%0], {%1, %2, %3, %4}, %5;" ::"l"(dp), "r"(a), "r"(b), "r"(c), "r"(d),
                 "l"(evict_last()) : "memory");
  if (kData == 2) __stcs(dp, make_uint4(a, b, c, d));
  uint8_t* sc = base + H * T * (D / 2) + (h * T + pos) * (D / 16) + 2 * u;
  if (kScales == 1) {
    sc[0] = static_cast<uint8_t>(a ^ b);
    sc[1] = static_cast<uint8_t>(c ^ d);
  }
  if (kScales == 2) {
    asm volatile("st.global.L2::cache_hint.u8 [%0], %1, %2;" ::"l"(sc), "r"(a ^ b), "l"(evict_last()) : "memory");
    asm volatile("st.global.L2::cache_hint.u8 [%0], %1, %2;" ::"l"(sc + 1), "r"(c ^ d), "l"(evict_last()) : "memory");
  }
}

// The store's writes in page order (what a store that first sorted its tokens by slot could do):
// one thread per (page, side, head, position, 2 groups), so a warp writes 512 contiguous code
// bytes and 64 contiguous scale bytes; the token of each slot comes from `inv` (slot -> token),
// so the loads are 64-byte pieces of random input rows instead.
__global__ void __launch_bounds__(256) store_page_order(const uint8_t* __restrict__ k, const uint8_t* __restrict__ v,
                                                        const int32_t* __restrict__ inv, uint8_t* cache, int pages) {
  const int64_t i = (int64_t)blockIdx.x * 256 + threadIdx.x;
  constexpr int kPerSide = H * T * 4;  // items of one side of one page
  const int64_t page = i / (2 * kPerSide);
  if (page >= pages) return;
  const int rem = static_cast<int>(i % (2 * kPerSide));
  const int side = rem / kPerSide, r = rem % kPerSide;  // r = (h * T + pos) * 4 + u
  const int h = r / (T * 4), pos = (r / 4) % T, u = r % 4;
  const int t = inv[page * T + pos];
  if (t < 0) return;
  const uint4* s = reinterpret_cast<const uint4*>((side ? v : k) + (int64_t)t * kTokenIn + h * kRowBytes + u * 64);
  uint4 w[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) w[j] = __ldcs(s + j);
  uint8_t* base = cache + page * kPage + side * kSide;
  const uint32_t a = fold(w[0]), b = fold(w[1]), c = fold(w[2]), d = fold(w[3]);
  __stcs(reinterpret_cast<uint4*>(base + r * 16), make_uint4(a, b, c, d));
  *reinterpret_cast<uint16_t*>(base + H * T * (D / 2) + 2 * r) = static_cast<uint16_t>((a ^ b) | ((c ^ d) << 8));
}

// The pass that such a store needs first: slot -> token.
__global__ void invert_slots(const int32_t* __restrict__ slots, int32_t* inv, int n) {
  const int i = blockIdx.x * 256 + threadIdx.x;
  if (i < n) inv[slots[i]] = i;
}

// Gather pattern: one thread per (token, side, head, 2 groups) of the output, reading 16 code
// bytes and 2 scale bytes from the token's page (random page order) and writing 64 B of bf16.
__global__ void __launch_bounds__(256) gather_pattern(const uint8_t* __restrict__ cache, const int32_t* __restrict__ pages,
                                                      uint8_t* __restrict__ k_out, uint8_t* __restrict__ v_out, int n) {
  const int64_t i = (int64_t)blockIdx.x * 256 + threadIdx.x;
  const int t = static_cast<int>(i / kItems);
  if (t >= n) return;
  const int item = static_cast<int>(i % kItems);
  const int side = item / (kItems / 2), h = (item / 4) % H, u = item % 4;
  const int page = pages[t / T], pos = t % T;
  const uint8_t* base = cache + (int64_t)page * kPage + side * kSide;
  const uint4 c = *reinterpret_cast<const uint4*>(base + (h * T + pos) * (D / 2) + u * 16);
  const uint16_t s = *reinterpret_cast<const uint16_t*>(base + H * T * (D / 2) + (h * T + pos) * (D / 16) + 2 * u);
  uint4* out = reinterpret_cast<uint4*>((side ? v_out : k_out) + (int64_t)t * kTokenIn + h * kRowBytes + u * 64);
#pragma unroll
  for (int j = 0; j < 4; ++j) __stcs(out + j, make_uint4(c.x ^ s, c.y + j, c.z, c.w ^ j));
}

// Streams: every thread reads r_words and writes w_words 16-byte words per step, coalesced, for
// the pure read / write / mixed ceilings.
__global__ void stream_mix(const uint4* __restrict__ src, uint4* __restrict__ dst, int64_t r_words, int64_t w_words) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  uint32_t acc = 0;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < r_words; i += stride) acc ^= fold(__ldcs(src + i));
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < w_words; i += stride)
    __stcs(dst + i, make_uint4(acc, (uint32_t)i, 0, 0));
}

// Read and write interleaved in one loop at a ratio of rr reads to ww writes per step.
template <int rr, int ww>
__global__ void stream_ratio(const uint4* __restrict__ src, uint4* __restrict__ dst, int64_t steps) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < steps; i += stride) {
    uint32_t acc = 0;
#pragma unroll
    for (int j = 0; j < rr; ++j) acc ^= fold(__ldcs(src + i + j * steps));
#pragma unroll
    for (int j = 0; j < ww; ++j) __stcs(dst + i + j * steps, make_uint4(acc, (uint32_t)i, j, 0));
  }
}

// *out = a device copy of `v`.
cudaError_t to_device(const std::vector<int32_t>& v, int32_t** out) {
  cudaError_t e = cudaMalloc(out, v.size() * 4);
  if (e == cudaSuccess) e = cudaMemcpy(*out, v.data(), v.size() * 4, cudaMemcpyHostToDevice);
  return e;
}

// Median over `reps` samples of `inner` back-to-back launches each, per launch.
template <class F>
float median_us(F launch, int reps = 30, int inner = 1) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  for (int i = 0; i < 3; ++i) launch();
  std::vector<float> ts;
  for (int i = 0; i < reps; ++i) {
    cudaEventRecord(a);
    for (int j = 0; j < inner; ++j) launch();
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float ms;
    cudaEventElapsedTime(&ms, a, b);
    ts.push_back(ms * 1000.0f / inner);
  }
  std::sort(ts.begin(), ts.end());
  return ts[ts.size() / 2];
}

int main(int argc, char** argv) {
  // "windows": only the rows of random slots taken window by window (the rest is skipped).
  const bool windows_only = argc > 1 && std::string(argv[1]) == "windows";
  const int64_t copy_bytes = int64_t{1} << 30;
  uint8_t *x, *y;
  CHECK(cudaMalloc(&x, 4 * copy_bytes));
  CHECK(cudaMalloc(&y, 4 * copy_bytes));
  CHECK(cudaMemset(x, 1, 4 * copy_bytes));
  CHECK(cudaMemset(y, 0, 4 * copy_bytes));
  const float copy_us = median_us([&] { cudaMemcpyAsync(y, x, copy_bytes, cudaMemcpyDeviceToDevice); });
  const double copy = 2.0 * copy_bytes / copy_us / 1e3;
  printf("copy 1 GiB: %.1f us, %.0f GB/s (read + write)\n", copy_us, copy);
  auto report = [&](const char* name, double bytes, float us) {
    printf("%-44s %9.2f us %6.0f GB/s %5.1f %% of copy\n", name, us, bytes / us / 1e3, 100.0 * bytes / us / 1e3 / copy);
  };
  const int sm = [] { int d, v; cudaGetDevice(&d); cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, d); return v; }();
  const int64_t words = copy_bytes / 16;
  report("read only (1 GiB)", copy_bytes, median_us([&] { stream_mix<<<sm * 8, 256>>>((const uint4*)x, (uint4*)y, words, 0); }));
  report("write only (1 GiB)", copy_bytes, median_us([&] { stream_mix<<<sm * 8, 256>>>((const uint4*)x, (uint4*)y, 0, words); }));
  // Gather's mix: 1152 B read per 4096 B written (~2:7); the store's: 4096 read per 1152 written.
  {
    const int64_t steps = words / 8;
    report("interleaved 2 reads : 7 writes (gather mix)", 9.0 * 16 * steps,
           median_us([&] { stream_ratio<2, 7><<<sm * 8, 256>>>((const uint4*)x, (uint4*)y, steps); }));
    report("interleaved 7 reads : 2 writes (store mix)", 9.0 * 16 * steps,
           median_us([&] { stream_ratio<7, 2><<<sm * 8, 256>>>((const uint4*)x, (uint4*)y, steps); }));
    report("interleaved 1 read : 1 write (copy)", 2.0 * 16 * steps * 4,
           median_us([&] { stream_ratio<1, 1><<<sm * 8, 256>>>((const uint4*)x, (uint4*)y, steps * 4); }));
  }

  std::mt19937 rng(0);
  // Random unique slots, the tokens taken in order of their slot's window of pages (stable: by
  // token within a window), for K windows: K = 1 is plain token order. Ten launches per sample.
  // Each window's rows then fill up in L2 before they are written back (docs/design-notes.md,
  // "Store: page order with a workspace").
  for (int n : {16384, 65536, 262144}) {
    const int pages = n / T;
    std::vector<int32_t> perm(n);
    for (int i = 0; i < n; ++i) perm[i] = i;
    std::shuffle(perm.begin(), perm.end(), rng);
    int32_t *slots, *order;
    CHECK(to_device(perm, &slots));
    CHECK(cudaMalloc(&order, n * 4));
    const double bytes = n * (2.0 * kTokenIn + 2.0 * H * (D / 2 + D / 16) + 8);
    for (int K : {1, 2, 3, 4, 6, 8, 12, 16}) {
      const int per = (pages + K - 1) / K;
      std::vector<int32_t> ord(n);
      for (int i = 0; i < n; ++i) ord[i] = i;
      std::stable_sort(ord.begin(), ord.end(), [&](int a, int b) { return perm[a] / T / per < perm[b] / T / per; });
      CHECK(cudaMemcpy(order, ord.data(), n * 4, cudaMemcpyHostToDevice));
      char name[96];
      snprintf(name, sizeof name, "x10 store %d: %d windows of %.0f MB rows", n, K,
               (double)per * T * 2 * H * (D / 2 + D / 16) / 1e6);
      report(name, bytes, median_us([&] {
               store_pattern<false, 2, 2><<<(n + 3) / 4, 256>>>(x, x + (int64_t)n * kTokenIn, slots, y, n, order);
             }, 30, 10));
    }
    cudaFree(slots);
    cudaFree(order);
  }
  if (windows_only) return 0;
  for (int n : {65536, 262144}) {
    const int pages = n / T;
    std::vector<int32_t> perm(n);
    for (int i = 0; i < n; ++i) perm[i] = i;
    std::vector<int32_t> seq = perm;
    std::shuffle(perm.begin(), perm.end(), rng);
    int32_t *slots, *slots_seq;
    CHECK(to_device(perm, &slots));
    CHECK(to_device(seq, &slots_seq));
    const uint8_t* k = x;
    const uint8_t* v = x + (int64_t)n * kTokenIn;
    uint8_t* cache = y;
    const double bytes = n * (2.0 * kTokenIn + 2.0 * H * (D / 2 + D / 16) + 8);
    const int blocks = (n + 3) / 4;
    char name[96];
    snprintf(name, sizeof name, "store %d: thread loads, scales", n);
    report(name, bytes, median_us([&] { store_pattern<false, 1><<<blocks, 256>>>(k, v, slots, cache, n); }));
    snprintf(name, sizeof name, "store %d: scales evict-last", n);
    report(name, bytes, median_us([&] { store_pattern<false, 2><<<blocks, 256>>>(k, v, slots, cache, n); }));
    snprintf(name, sizeof name, "store %d: scales + codes evict-last", n);
    report(name, bytes, median_us([&] { store_pattern<false, 2, 1><<<blocks, 256>>>(k, v, slots, cache, n); }));
    snprintf(name, sizeof name, "store %d: scales evict-last, codes streaming", n);
    report(name, bytes, median_us([&] { store_pattern<false, 2, 2><<<blocks, 256>>>(k, v, slots, cache, n); }));
    snprintf(name, sizeof name, "store %d: scales evict-last, seq slots", n);
    report(name, bytes, median_us([&] { store_pattern<false, 2><<<blocks, 256>>>(k, v, slots_seq, cache, n); }));
    snprintf(name, sizeof name, "store %d: thread loads, no scales", n);
    report(name, bytes, median_us([&] { store_pattern<false, 0><<<blocks, 256>>>(k, v, slots, cache, n); }));
    snprintf(name, sizeof name, "store %d: thread loads, scales, seq slots", n);
    report(name, bytes, median_us([&] { store_pattern<false, 1><<<blocks, 256>>>(k, v, slots_seq, cache, n); }));
    snprintf(name, sizeof name, "store %d: coalesced loads, scales", n);
    report(name, bytes, median_us([&] { store_pattern<true, 1><<<blocks, 256>>>(k, v, slots, cache, n); }));
    snprintf(name, sizeof name, "store %d: coalesced loads, no scales", n);
    report(name, bytes, median_us([&] { store_pattern<true, 0><<<blocks, 256>>>(k, v, slots, cache, n); }));
    cudaFree(slots);
    cudaFree(slots_seq);
    (void)pages;
  }
  // Random slots in the store's order against the same bytes written in page order, ten launches
  // per sample (no launch latency in the time).
  for (int n : {16384, 65536, 262144}) {
    const int pages = n / T;
    std::vector<int32_t> perm(n), inv(n);
    for (int i = 0; i < n; ++i) perm[i] = i;
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int i = 0; i < n; ++i) inv[perm[i]] = i;
    int32_t *slots, *dinv, *scratch;
    CHECK(to_device(perm, &slots));
    CHECK(to_device(inv, &dinv));
    CHECK(cudaMalloc(&scratch, n * 4));
    const uint8_t* k = x;
    const uint8_t* v = x + (int64_t)n * kTokenIn;
    uint8_t* cache = y;
    const double bytes = n * (2.0 * kTokenIn + 2.0 * H * (D / 2 + D / 16) + 8);
    const int blocks = (n + 3) / 4;
    const int page_blocks = (int)(((int64_t)pages * 2 * H * T * 4 + 255) / 256);
    char name[96];
    snprintf(name, sizeof name, "x10 store %d: random slots, token order", n);
    report(name, bytes, median_us([&] { store_pattern<false, 2, 2><<<blocks, 256>>>(k, v, slots, cache, n); }, 30, 10));
    snprintf(name, sizeof name, "x10 store %d: page order", n);
    report(name, bytes, median_us([&] { store_page_order<<<page_blocks, 256>>>(k, v, dinv, cache, pages); }, 30, 10));
    snprintf(name, sizeof name, "x10 store %d: invert + page order", n);
    report(name, bytes, median_us([&] {
             invert_slots<<<(n + 255) / 256, 256>>>(slots, scratch, n);
             store_page_order<<<page_blocks, 256>>>(k, v, scratch, cache, pages);
           }, 30, 10));
    snprintf(name, sizeof name, "x10 copy of the same bytes %d", n);
    report(name, bytes, median_us([&] { cudaMemcpyAsync(y + (int64_t)2 * n * kTokenIn, x, (size_t)(bytes / 2), cudaMemcpyDeviceToDevice); }, 30, 10));
    cudaFree(slots);
    cudaFree(dinv);
    cudaFree(scratch);
  }
  for (int n : {65536, 262144, 1 << 20}) {
    const int pages = n / T;
    std::vector<int32_t> perm(pages);
    for (int i = 0; i < pages; ++i) perm[i] = i;
    std::shuffle(perm.begin(), perm.end(), rng);
    int32_t* table;
    CHECK(to_device(perm, &table));
    const double bytes = n * (2.0 * H * (D / 2 + D / 16) + 2.0 * kTokenIn);
    const int64_t blocks = ((int64_t)n * kItems + 255) / 256;
    char name[96];
    snprintf(name, sizeof name, "gather %d", n);
    report(name, bytes, median_us([&] {
             gather_pattern<<<blocks, 256>>>(x, table, y, y + (int64_t)n * kTokenIn, n);
           }));
    cudaFree(table);
  }
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  return 0;
}
