// The cache argument of every operation: a combined cache (5-D, or packed 4-D) or two sides,
// resolved to the geometry its shape and strides imply (layout from strides, never from the
// shape alone), plus the global scales. Part of the C ABI's argument checks (tensor.h).
#pragma once

#include "params.h"
#include "tensor.h"

namespace nvfp4kv {

struct Cache {
  CacheSide k, v;
  int64_t N, T, H;
  Layout layout;
  bool layout_unseen;  // an empty cache whose strides are stand-ins (tensor.h): its layout is unknown
  DLDevice device;
  const char* k_name;  // argument to name in messages about the K side
  const char* v_name;
};

// The cache of kv_cache (combined) or of key_cache = kv_cache and value_cache (two sides). A side
// (4-D) is (N, T, H, F) and a 5-D cache (N, 2, T, H, F) in logical order, HND or NHD by strides;
// `heads` (from `heads_arg`, the call's key or output; -1: unknown) catches a view whose heads
// and positions are swapped (vLLM's kv_cache.split(H, dim=1) halves), which strides alone cannot
// tell from an NHD side.
Cache resolve_cache(const DLTensor* kv_cache, const DLTensor* value_cache, int64_t heads, const char* heads_arg);
// The kv_cache argument's name in messages: key_cache beside a value_cache, else kv_cache.
inline const char* cache_name(const DLTensor* value_cache) { return value_cache ? "key_cache" : "kv_cache"; }
// A NULL kv_cache refused under that name, before an entry point reads its other arguments.
void expect_cache_given(const DLTensor* kv_cache, const DLTensor* value_cache);
// The scale profile's interleaving of V scales, checked against the geometry.
void apply_profile(Cache& c, nvfp4kv_scale_profile profile);
// A global scale: a host float (checked now) or a device pointer on the cache's device.
ScaleArg resolve_scale(const DLTensor* scale, const char* name, DLDevice data_device);
void check_head_size(int64_t D, const char* name);
// H * T * F, the bytes of one side of one page; fails (naming `name`) unless below 2 GiB.
int64_t side_bytes(int64_t T, int64_t H, int64_t F, const char* name);

}  // namespace nvfp4kv
