// The cache argument (cache.h).
#include "cache.h"

namespace nvfp4kv {

constexpr int64_t kMaxSideBytes = (int64_t{1} << 31) - 1;

void check_head_size(int64_t D, const char* name) {
  if (D <= 0 || D % kGroupSize != 0 || D > kMaxHeadSize)
    fail(NVFP4KV_ERROR_INVALID_VALUE,
         "%s: head size %lld received; expected a multiple of 16 between 16 and %d", name,
         static_cast<long long>(D), kMaxHeadSize);
}

// The bytes of one side of one page (H * T * F), checked: the kernels address a page side with
// 32-bit offsets and divide positions by T in 32 bits, so a side must stay below 2 GiB.
int64_t side_bytes(int64_t T, int64_t H, int64_t F, const char* name) {
  int64_t bytes = 0;
  if (__builtin_mul_overflow(H, T, &bytes) || __builtin_mul_overflow(bytes, F, &bytes) || bytes > kMaxSideBytes)
    fail(NVFP4KV_ERROR_INVALID_VALUE,
         "%s: block size %lld with %lld KV heads of F=%lld bytes: one side of a page would hold "
         "more than 2 GiB - 1 bytes, the most the kernels address",
         name, static_cast<long long>(T), static_cast<long long>(H), static_cast<long long>(F));
  return bytes;
}

namespace {

// Head size of a cache side from its full dim F = 9D/16.
int64_t head_size_from_full_dim(const Tensor& c, int64_t F) {
  if (F <= 0 || F % 9 != 0 || F > full_dim(kMaxHeadSize))
    fail(NVFP4KV_ERROR_INVALID_VALUE,
         "%s: last dimension %lld received; expected F = D/2 + D/16 = 9*D/16 for a head size D "
         "that is a multiple of 16 up to %d (D=128 gives F=72)",
         c.name, static_cast<long long>(F), kMaxHeadSize);
  return F / 9 * 16;
}

// A stride matters only along a dimension of size > 1.
bool stride_ok(int64_t size, int64_t stride, int64_t expected) {
  return size <= 1 || stride == expected;
}

void check_page_stride(const Tensor& c, int64_t N, int64_t page_stride, int64_t min_bytes) {
  if (N > 1 && page_stride < min_bytes)
    fail(NVFP4KV_ERROR_INVALID_VALUE,
         "%s: page stride %lld bytes received; it must be at least one page (%lld bytes): pages "
         "may not overlap or run backwards",
         c.name, static_cast<long long>(page_stride), static_cast<long long>(min_bytes));
}


// Block size and head count (the callers then bound a page side's bytes with side_bytes, at the
// larger F of the two sides).
void check_geometry(const Tensor& c, int64_t T, int64_t H) {
  if (T <= 0) fail(NVFP4KV_ERROR_INVALID_VALUE, "%s: block size T=%lld; must be positive", c.name,
                   static_cast<long long>(T));
  if (H <= 0) fail(NVFP4KV_ERROR_INVALID_VALUE, "%s: number of KV heads H=%lld; must be positive",
                   c.name, static_cast<long long>(H));
}

// One side tensor (N, T, H, F): layout read from its strides (HND when H or T is 1: the same
// bytes either way).
Layout side_layout(const Tensor& c, int64_t T, int64_t H, int64_t F) {
  if (c.stride(3) != 1)
    fail(NVFP4KV_ERROR_INVALID_VALUE, "%s: last stride %lld received; expected 1", c.name,
         static_cast<long long>(c.stride(3)));
  const bool hnd = stride_ok(T, c.stride(1), F) && stride_ok(H, c.stride(2), T * F);
  const bool nhd = stride_ok(T, c.stride(1), H * F) && stride_ok(H, c.stride(2), F);
  if (hnd) return Layout::kHND;
  if (nhd) return Layout::kNHD;
  fail(NVFP4KV_ERROR_INVALID_VALUE,
       "%s: shape %s with strides %s is not a contiguous cache side; expected strides "
       "(page, %lld, %lld, 1) for HND or (page, %lld, %lld, 1) for NHD",
       c.name, c.shape_str().c_str(), c.strides_str().c_str(), static_cast<long long>(F),
       static_cast<long long>(T * F), static_cast<long long>(H * F), static_cast<long long>(F));
}

// Whether the bytes of two cache sides meet. Each side is, page by page, one run of H * T * F
// contiguous bytes (its layout check made sure), so the sides compare as two (N, run) byte views
// at their page strides: exact where the page strides are equal (two halves of one allocation's
// pages, whatever their head sizes), by byte range otherwise.
bool sides_overlap(const Tensor& kc, const Tensor& vc, int64_t N, int64_t k_run, int64_t v_run) {
  int64_t shape_k[2] = {N, k_run}, shape_v[2] = {N, v_run};
  int64_t stride_k[2] = {kc.stride(0), 1}, stride_v[2] = {vc.stride(0), 1};
  DLTensor k = *kc.t, v = *vc.t;
  k.ndim = v.ndim = 2;
  k.shape = shape_k;
  v.shape = shape_v;
  k.strides = stride_k;
  v.strides = stride_v;
  return elements_overlap(Tensor(&k, kc.name), Tensor(&v, vc.name));
}

// A view whose dimension `h_dim` should hold the heads but whose dimension `t_dim` holds the count
// `heads_arg` has: either that count is wrong, or the view's two dimensions are exchanged (the
// message says both: review, 2026-12-07, a key of 16 heads for a cache of 16-token pages was
// called a transposed cache).
void check_orientation(const Tensor& c, int h_dim, int t_dim, int64_t heads, const char* heads_arg) {
  if (heads <= 0 || c.size(h_dim) == heads || c.size(t_dim) != heads) return;
  const bool side = c.ndim() == 4;
  fail(NVFP4KV_ERROR_INVALID_VALUE,
       "%s: shape %s has a KV head count of %lld (dimension %d), but %s has %lld heads, the size of dimension %d: "
       "either %s has the wrong head count, or the cache's dimensions %d and %d are exchanged (expected %s)",
       c.name, c.shape_str().c_str(), static_cast<long long>(c.size(h_dim)), h_dim, heads_arg,
       static_cast<long long>(heads), t_dim, heads_arg, t_dim, h_dim,
       side ? "(num_blocks, block_size, num_kv_heads, F) for a side; the halves of a packed (N, 2H, T, F) cache "
              "from split(H, dim=1) are (N, H, T, F): pass their transpose(1, 2), or the packed cache itself"
            : "(num_blocks, 2, block_size, num_kv_heads, F)");
}

}  // namespace

void expect_cache_given(const DLTensor* kv_cache, const DLTensor* value_cache) {
  if (!kv_cache) fail(NVFP4KV_ERROR_INVALID_VALUE, "%s: NULL tensor", cache_name(value_cache));
}

Cache resolve_cache(const DLTensor* kv_cache, const DLTensor* value_cache, int64_t heads, const char* heads_arg) {
  Cache r{};
  r.k_name = cache_name(value_cache);
  if (value_cache) {
    Tensor kc(kv_cache, r.k_name), vc(value_cache, "value_cache");
    // A 5-D cache holds both sides: given with value_cache, the error says which to drop.
    kc.expect_ndim(4, kc.ndim() == 5 ? "(num_blocks, block_size, num_kv_heads, F), the K side, since value_cache is "
                                       "given; a 5-D cache holds both sides: pass it without value_cache (NULL, "
                                       "None)"
                                     : "(num_blocks, block_size, num_kv_heads, F)");
    vc.expect_ndim(4, "(num_blocks, block_size, num_kv_heads, F)");
    expect_uint8(kc);
    expect_uint8(vc);
    expect_same_device(vc, kc);
    for (int i = 0; i < 3; ++i)
      if (kc.size(i) != vc.size(i))
        fail(NVFP4KV_ERROR_INVALID_VALUE, "value_cache: shape %s does not match key_cache %s",
             vc.shape_str().c_str(), kc.shape_str().c_str());
    check_orientation(kc, 2, 1, heads, heads_arg);
    check_orientation(vc, 2, 1, heads, heads_arg);
    r.N = kc.size(0);
    r.T = kc.size(1);
    r.H = kc.size(2);
    check_geometry(kc, r.T, r.H);
    const int64_t Fk = kc.size(3), Fv = vc.size(3);
    r.k.D = static_cast<int32_t>(head_size_from_full_dim(kc, Fk));
    r.v.D = static_cast<int32_t>(head_size_from_full_dim(vc, Fv));
    side_bytes(r.T, r.H, Fk > Fv ? Fk : Fv, kc.name);
    const Layout lk = side_layout(kc, r.T, r.H, Fk), lv = side_layout(vc, r.T, r.H, Fv);
    r.layout_unseen = kc.stand_in_strides() || vc.stand_in_strides();
    if (lk != lv && !r.layout_unseen)
      fail(NVFP4KV_ERROR_INVALID_VALUE, "value_cache: layout %s but key_cache is %s",
           lv == Layout::kHND ? "HND" : "NHD", lk == Layout::kHND ? "HND" : "NHD");
    r.layout = lk;
    r.k.base = kc.ptr();
    r.v.base = vc.ptr();
    r.k.page_stride = kc.stride(0);
    r.v.page_stride = vc.stride(0);
    check_page_stride(kc, r.N, r.k.page_stride, r.H * r.T * Fk);
    check_page_stride(vc, r.N, r.v.page_stride, r.H * r.T * Fv);
    if (sides_overlap(kc, vc, r.N, r.H * r.T * Fk, r.H * r.T * Fv))
      fail(NVFP4KV_ERROR_INVALID_VALUE,
           "value_cache: shares memory with key_cache; the two sides of a cache must not overlap");
    r.device = kc.device();
    r.v_name = "value_cache";
    return r;
  }

  Tensor c(kv_cache, r.k_name);
  expect_uint8(c);
  r.layout_unseen = c.stand_in_strides();
  r.device = c.device();
  r.v_name = r.k_name;
  if (c.ndim() == 5) {  // (N, 2, T, H, F)
    if (c.size(1) != 2)
      fail(NVFP4KV_ERROR_INVALID_VALUE,
           "kv_cache: shape %s received; expected (num_blocks, 2, block_size, num_kv_heads, F)",
           c.shape_str().c_str());
    check_orientation(c, 3, 2, heads, heads_arg);
    r.N = c.size(0);
    r.T = c.size(2);
    r.H = c.size(3);
    check_geometry(c, r.T, r.H);
    const int64_t F = c.size(4);
    r.k.D = r.v.D = static_cast<int32_t>(head_size_from_full_dim(c, F));
    side_bytes(r.T, r.H, F, c.name);
    const int64_t side = r.H * r.T * F;
    const bool tail_ok = c.stride(4) == 1 && c.stride(1) == side;
    const bool hnd = tail_ok && stride_ok(r.T, c.stride(2), F) && stride_ok(r.H, c.stride(3), r.T * F);
    const bool nhd = tail_ok && stride_ok(r.T, c.stride(2), r.H * F) && stride_ok(r.H, c.stride(3), F);
    if (!hnd && !nhd)
      fail(NVFP4KV_ERROR_INVALID_VALUE,
           "kv_cache: shape %s with strides %s is neither HND (strides (page, %lld, %lld, %lld, "
           "1)) nor NHD (strides (page, %lld, %lld, %lld, 1))",
           c.shape_str().c_str(), c.strides_str().c_str(), static_cast<long long>(side),
           static_cast<long long>(F), static_cast<long long>(r.T * F), static_cast<long long>(side),
           static_cast<long long>(r.H * F), static_cast<long long>(F));
    r.layout = hnd ? Layout::kHND : Layout::kNHD;
    r.k.page_stride = r.v.page_stride = c.stride(0);
    check_page_stride(c, r.N, c.stride(0), 2 * side);
    r.k.base = c.ptr();
    r.v.base = c.ptr() + side;
    return r;
  }
  if (c.ndim() == 4) {  // packed (N, 2H, T, F), HND
    r.N = c.size(0);
    r.T = c.size(2);
    if (c.size(1) % 2 != 0)
      fail(NVFP4KV_ERROR_INVALID_VALUE,
           "kv_cache: shape %s received; a packed 4-D cache is (num_blocks, 2*num_kv_heads, "
           "block_size, F) and its dimension 1 must be even",
           c.shape_str().c_str());
    r.H = c.size(1) / 2;
    check_geometry(c, r.T, r.H);
    const int64_t F = c.size(3);
    r.k.D = r.v.D = static_cast<int32_t>(head_size_from_full_dim(c, F));
    side_bytes(r.T, r.H, F, c.name);
    const int64_t side = r.H * r.T * F;
    if (c.stride(3) != 1 || !stride_ok(r.T, c.stride(2), F) || c.stride(1) != r.T * F)
      fail(NVFP4KV_ERROR_INVALID_VALUE,
           "kv_cache: packed 4-D cache with strides %s; expected (page, %lld, %lld, 1)",
           c.strides_str().c_str(), static_cast<long long>(r.T * F), static_cast<long long>(F));
    r.layout = Layout::kHND;
    r.k.page_stride = r.v.page_stride = c.stride(0);
    check_page_stride(c, r.N, c.stride(0), 2 * side);
    r.k.base = c.ptr();
    r.v.base = c.ptr() + side;
    return r;
  }
  fail(NVFP4KV_ERROR_INVALID_VALUE,
       "kv_cache: rank %d (shape %s) received; expected 5-D (num_blocks, 2, block_size, "
       "num_kv_heads, F), packed 4-D (num_blocks, 2*num_kv_heads, block_size, F), or key_cache "
       "and value_cache sides",
       c.ndim(), c.shape_str().c_str());
}

void apply_profile(Cache& c, nvfp4kv_scale_profile profile) {
  if (profile != NVFP4KV_SCALES_VLLM && profile != NVFP4KV_SCALES_LINEAR)
    fail(NVFP4KV_ERROR_INVALID_VALUE,
         "scale_layout (profile): %d received; expected NVFP4KV_SCALES_VLLM (0, 'vllm') or "
         "NVFP4KV_SCALES_LINEAR (1, 'linear')",
         static_cast<int>(profile));
  c.k.interleaved = 0;
  c.v.interleaved = profile == NVFP4KV_SCALES_VLLM;
  if (!c.v.interleaved) return;
  // An empty array's strides may be stand-ins (tensor.h) that read as NHD even for an HND view:
  // such a cache, which holds nothing, is not refused for it (review; NumPy 1.26).
  if (c.layout != Layout::kHND && !c.layout_unseen)
    fail(NVFP4KV_ERROR_INVALID_VALUE,
         "scale_layout: the 'vllm' profile interleaves V scales, which is defined for the HND "
         "layout only (%s is NHD); use scale_layout 'linear' (NVFP4KV_SCALES_LINEAR in C)", c.v_name);
  if (c.T % kInterleave != 0)
    fail(NVFP4KV_ERROR_INVALID_VALUE,
         "scale_layout: the 'vllm' profile interleaves V scales over 4 tokens, which needs a block "
         "size divisible by 4 (%s has block size %lld); use scale_layout 'linear' (NVFP4KV_SCALES_LINEAR in C)",
         c.v_name, static_cast<long long>(c.T));
  if (c.v.D % 64 != 0)
    fail(NVFP4KV_ERROR_INVALID_VALUE,
         "scale_layout: the 'vllm' profile interleaves V scales, which needs a V head size "
         "divisible by 64 (got %d); use scale_layout 'linear' (NVFP4KV_SCALES_LINEAR in C)",
         c.v.D);
}

ScaleArg resolve_scale(const DLTensor* scale, const char* name, DLDevice data_device) {
  if (!scale) fail(NVFP4KV_ERROR_INVALID_VALUE, "%s: NULL; expected a 1-element float32 tensor", name);
  Tensor s(scale, name);
  if (!is_dtype(s.t->dtype, kDLFloat, 32))
    fail(NVFP4KV_ERROR_INVALID_DTYPE, "%s: dtype %s received; expected a float32 tensor (from Python, a float too)",
         name, dtype_name(s.t->dtype).c_str());
  if (s.numel() != 1)
    fail(NVFP4KV_ERROR_INVALID_VALUE, "%s: shape %s received; expected exactly one element", name,
         s.shape_str().c_str());
  ScaleArg r{nullptr, 1.0f};
  if (host_readable(s.device())) {
    r.value = *reinterpret_cast<const float*>(s.ptr());
    if (!global_scale_valid(r.value))
      fail(NVFP4KV_ERROR_INVALID_VALUE,
           "%s: %.9g received; %s", name, static_cast<double>(r.value), kGlobalScaleRule);
    return r;
  }
  if (host_readable(data_device) || !same_device(s.device(), data_device))
    fail(NVFP4KV_ERROR_DEVICE_MISMATCH, "%s: on %s, but the cache is on %s", name,
         device_name(s.device()).c_str(), device_name(data_device).c_str());
  r.device_ptr = reinterpret_cast<const float*>(s.ptr());
  return r;
}

}  // namespace nvfp4kv
