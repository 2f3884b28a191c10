/* The C ABI header compiles as strict C99 (-pedantic -Werror) and links from C. */
#include <stdio.h>
#include <string.h>

#include "nvfp4kv/nvfp4kv.h"

/* The DLPack 1.3 declarations come with the header (the bindings use the exchange table). */
typedef char dlpack_is_1x[DLPACK_MAJOR_VERSION >= 1 ? 1 : -1];
typedef char exchange_table_layout[sizeof(DLPackExchangeAPI) == sizeof(DLPackExchangeAPIHeader) + 5 * sizeof(void*) ? 1 : -1];

int main(void) {
  float key[16] = {0}, value[16] = {0}, scale = 1.0f;
  unsigned char cache[2 * 9] = {0};
  long long slot = 0;
  int64_t kshape[3] = {1, 1, 16}, cshape[5] = {1, 2, 1, 1, 9}, sshape[1] = {1}, one[1] = {1};
  DLTensor k, v, c, s, g;
  nvfp4kv_status st;
  const char* reason = NULL;
  memset(&k, 0, sizeof k);
  k.data = key; k.device.device_type = kDLCPU; k.ndim = 3; k.shape = kshape;
  k.dtype.code = kDLFloat; k.dtype.bits = 32; k.dtype.lanes = 1;
  v = k; v.data = value;
  c = k; c.data = cache; c.ndim = 5; c.shape = cshape; c.dtype.code = kDLUInt; c.dtype.bits = 8;
  s = k; s.data = &slot; s.ndim = 1; s.shape = sshape; s.dtype.code = kDLInt; s.dtype.bits = 64;
  g = k; g.data = &scale; g.ndim = 1; g.shape = one;
  size_t page = 0;
  if (nvfp4kv_page_bytes(1, 1, 16, 16, &page, NULL) != NVFP4KV_SUCCESS || page != sizeof cache) {
    fprintf(stderr, "page bytes %u: %s\n", (unsigned)page, nvfp4kv_last_error());
    return 1;
  }
  key[3] = 6.0f;
  st = nvfp4kv_store(&k, &v, &c, NULL, &s, &g, &g, NVFP4KV_RECIPE_NVFP4, NVFP4KV_SCALES_LINEAR, NULL);
  if (st != NVFP4KV_SUCCESS) {
    fprintf(stderr, "store: %s: %s\n", nvfp4kv_status_string(st), nvfp4kv_last_error());
    return 1;
  }
  /* key[3] = 6 -> code 7 in the high nibble of byte 1; scale byte 1.0 = 0x38 */
  if (cache[1] != 0x70 || cache[8] != 0x38) {
    fprintf(stderr, "unexpected bytes %02x %02x\n", cache[1], cache[8]);
    return 1;
  }
  st = (nvfp4kv_status)nvfp4kv_cuda_device_count(&reason);
  printf("nvfp4kv %s from C: ok (CUDA devices: %d%s%s)\n", nvfp4kv_version_string(), (int)st,
         *reason ? "; " : "", reason);
  return 0;
}
