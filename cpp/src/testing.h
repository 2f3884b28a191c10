/* Test-only switches of the library: not part of the public C ABI (nvfp4kv.h), for the project's
 * tests, benchmarks and tools. The symbols are exported (the Python extension's _C module calls
 * them) but may change in any release. Each selects, for the whole process, which of several
 * kernels that write the same bytes takes the calls, so tests cover every kernel and benchmarks
 * compare them. Kernel choice itself is policy (cuda/plan.h). */
#ifndef NVFP4KV_TESTING_H_
#define NVFP4KV_TESTING_H_

#include "nvfp4kv/nvfp4kv.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Which CUDA store takes the calls given a workspace. */
typedef enum nvfp4kv_testing_store_order NVFP4KV_ENUM_INT {
  NVFP4KV_TESTING_STORE_AUTO = 0,  /* page order where it measured faster (cuda/plan.h) */
  NVFP4KV_TESTING_STORE_PAGE = 1,  /* page order wherever it applies */
  NVFP4KV_TESTING_STORE_TOKEN = 2  /* token order always */
} nvfp4kv_testing_store_order;

/* Which CUDA kernel takes gather calls. */
typedef enum nvfp4kv_testing_gather_kernel NVFP4KV_ENUM_INT {
  NVFP4KV_TESTING_GATHER_AUTO = 0,   /* the page-side kernel where it measured faster */
  NVFP4KV_TESTING_GATHER_PAGES = 1,  /* the page-side kernel wherever it applies */
  NVFP4KV_TESTING_GATHER_ROWS = 2    /* the row kernels only */
} nvfp4kv_testing_gather_kernel;

/* INVALID_VALUE for a value outside the enum; SUCCESS (no effect) in a build without CUDA. */
NVFP4KV_API nvfp4kv_status nvfp4kv_testing_set_store_order(nvfp4kv_testing_store_order order);
NVFP4KV_API nvfp4kv_status nvfp4kv_testing_set_gather_kernel(nvfp4kv_testing_gather_kernel kernel);

#ifdef __cplusplus
}
#endif

#endif /* NVFP4KV_TESTING_H_ */
