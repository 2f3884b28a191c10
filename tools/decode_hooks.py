#!/usr/bin/env python3
"""Adds a measurement hook to cuda/decode.cu of a source tree (a copy: never the checkout), for
the two questions of design notes, "Decode attention: the fixed cost of a block":

- NVFP4KV_DECODE_TIMELINE: every warp of the tensor-core reader records %globaltimer and clock64
  at entry, after its query fragment, after its first step, after its last step and at its end,
  with its SM and step count (and the split merge its blocks' entry, wait and end); the library
  then exports nvfp4kv_diag_timeline() that tools/decode_timeline.py reads.
- NVFP4KV_DECODE_MEMONLY: the reader without its arithmetic (same grid, block table, copies and
  merges): the memory-side ceiling of this pipeline at each geometry.
- NVFP4KV_DECODE_COMPUTEONLY: the reader without its page traffic: every copy instruction stays,
  with a source size of 0 that the compiler cannot see (so it reads nothing and fills zeros), and
  the arithmetic runs on the zeros: the instruction-side ceiling at each geometry.

Usage: python tools/decode_hooks.py SRC_DIR, then build SRC_DIR with
  -C cmake.define.CMAKE_CUDA_FLAGS=-DNVFP4KV_DECODE_TIMELINE (or _MEMONLY, _COMPUTEONLY)
e.g. pip install --target /tmp/pkg_tl. Fails loudly when decode.cu no longer has the text it hooks.
"""
import pathlib
import sys

path = pathlib.Path(sys.argv[1]) / "cuda" / "decode.cu"
s = path.read_text()


def rep(a, b):
    global s
    if s.count(a) != 1:
        sys.exit(f"decode_hooks: {path} no longer has exactly one of:\n{a}")
    s = s.replace(a, b)


rep('''constexpr int kMaxRows = 8;  // query rows (group x q_len) of one block; more rows: more chunks
''', '''constexpr int kMaxRows = 8;  // query rows (group x q_len) of one block; more rows: more chunks
#ifdef NVFP4KV_DECODE_TIMELINE
constexpr int kTlSlots = 16384;
__device__ unsigned long long g_tl[kTlSlots][12];
__device__ unsigned long long g_tl_comb[8192][4];
__device__ __forceinline__ unsigned long long gtimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
#define TLM(i) (tl[2 * (i)] = gtimer(), tl[2 * (i) + 1] = clock64())
#else
#define TLM(i) ((void)0)
#endif
''')
rep('''  static_assert(kN == 4 || kN == 8 || kN == 16, "cp.async sizes");
''', '''  static_assert(kN == 4 || kN == 8 || kN == 16, "cp.async sizes");
#ifdef NVFP4KV_DECODE_COMPUTEONLY
  // A zero the compiler cannot fold (the dynamic shared memory size is below 2^31): two
  // instructions more per copy, about 2 % of a step's.
  uint32_t z;
  asm volatile("mov.u32 %0, %%dynamic_smem_size;" : "=r"(z));
  ok = ok && (z >> 31) != 0u;
#endif
''')
rep('''  wait_for_prior_grids();
  allow_next_grids();
  const IndexVec bt_row = block_table_row(p, b);

  // Block-table entries''', '''#ifdef NVFP4KV_DECODE_TIMELINE
  unsigned long long tl[10] = {};
#endif
  TLM(0);
  wait_for_prior_grids();
  allow_next_grids();
  const IndexVec bt_row = block_table_row(p, b);

  // Block-table entries''')
rep('''  build_query();
''', '''  build_query();
  TLM(1);
''')
rep('''    if (full)
      compute(n, st, std::true_type{});
    else
      compute(n, st, std::false_type{});
    __syncwarp();  // every lane is done with stage st before a later issue overwrites it
  }
  cp_async_wait<0>();
''', '''#ifndef NVFP4KV_DECODE_MEMONLY
    if (full)
      compute(n, st, std::true_type{});
    else
      compute(n, st, std::false_type{});
#endif
    __syncwarp();  // every lane is done with stage st before a later issue overwrites it
    if (n == 0) TLM(2);
  }
  cp_async_wait<0>();
  TLM(3);
''')
rep('''    if (L.cluster) merge_cluster<DType::kBFloat16, kD>(L, b, h, r0, R, split, part);
  }
}
''', '''    if (L.cluster) merge_cluster<DType::kBFloat16, kD>(L, b, h, r0, R, split, part);
  }
  TLM(4);
#ifdef NVFP4KV_DECODE_TIMELINE
  const unsigned long long slot = ((blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x) * kDecodeWarps + warp;
  if (lane == 0 && slot < kTlSlots) {
    for (int i = 0; i < 10; ++i) g_tl[slot][i] = tl[i];
    unsigned smid;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
    g_tl[slot][10] = smid;
    g_tl[slot][11] = static_cast<unsigned long long>(nsteps);
  }
#endif
}
''')
rep('''  const float vscale = read_scale(p.v_scale);
  wait_for_prior_grids();
  allow_next_grids();
''', '''  const float vscale = read_scale(p.v_scale);
#ifdef NVFP4KV_DECODE_TIMELINE
  const unsigned long long c0 = gtimer();
#endif
  wait_for_prior_grids();
  allow_next_grids();
#ifdef NVFP4KV_DECODE_TIMELINE
  const unsigned long long c1 = gtimer();
#endif
''')
rep('''  store_result<kDType>(p, row, hq, d, o, lsum, M, vscale);
}
''', '''  store_result<kDType>(p, row, hq, d, o, lsum, M, vscale);
#ifdef NVFP4KV_DECODE_TIMELINE
  if (d == 0 && blockIdx.x < 8192) g_tl_comb[blockIdx.x][0] = c0, g_tl_comb[blockIdx.x][1] = c1, g_tl_comb[blockIdx.x][2] = gtimer();
#endif
}
''')
rep('''int cuda_decode(const DecodeParams& p, int device, void* stream_ptr, const char** message) {''', '''#ifdef NVFP4KV_DECODE_TIMELINE
// which 0: the warps' records, 1: the split merge's, else: zero both.
extern "C" __attribute__((visibility("default"))) int nvfp4kv_diag_timeline(unsigned long long* dst, int which) {
  if (which == 0) return cudaMemcpyFromSymbol(dst, g_tl, sizeof(g_tl));
  if (which == 1) return cudaMemcpyFromSymbol(dst, g_tl_comb, sizeof(g_tl_comb));
  void* a = nullptr;
  void* c = nullptr;
  cudaGetSymbolAddress(&a, g_tl);
  cudaGetSymbolAddress(&c, g_tl_comb);
  cudaMemset(a, 0, sizeof(g_tl));
  return cudaMemset(c, 0, sizeof(g_tl_comb));
}
#endif
int cuda_decode(const DecodeParams& p, int device, void* stream_ptr, const char** message) {''')
path.write_text(s)
print(f"decode_hooks: {path} hooked")
