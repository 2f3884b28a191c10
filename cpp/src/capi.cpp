// The C ABI: validation of every argument (before any byte is written), translation of DLPack
// views into the parameter structs, and dispatch to the CPU path or the CUDA launchers.
// Errors are thrown as `Failure` inside this file and turned into a status plus a thread-local
// message at the boundary; nothing escapes an extern "C" function.
#include <stdarg.h>
#include <stdio.h>

#include <exception>
#include <initializer_list>
#include <string>

#include "cpu.h"
#include "nvfp4kv/nvfp4kv.h"
#if defined(NVFP4KV_WITH_CUDA)
#include "launch.h"
#endif

// The CUDA launcher of an operation, or nullptr in a build without CUDA (never called then).
#if defined(NVFP4KV_WITH_CUDA)
#define CUDA_OR_NULL(f) f
#else
#define CUDA_OR_NULL(f) nullptr
#endif

#define NVFP4KV_STR2(x) #x
#define NVFP4KV_STR(x) NVFP4KV_STR2(x)

namespace nvfp4kv {
namespace {

thread_local std::string g_last_error;

struct Failure {
  nvfp4kv_status status;
  std::string message;
};

[[noreturn]] void fail(nvfp4kv_status status, const char* fmt, ...) {
  char buf[1024];
  va_list args;
  va_start(args, fmt);
  vsnprintf(buf, sizeof buf, fmt, args);
  va_end(args);
  throw Failure{status, buf};
}

// Runs `body` and converts whatever it throws into a status; the only exit from the ABI.
template <class Body>
nvfp4kv_status guarded(const char* fn, Body&& body) {
  try {
    body();
    g_last_error.clear();
    return NVFP4KV_SUCCESS;
  } catch (const Failure& f) {
    g_last_error = std::string(fn) + ": " + f.message;
    return f.status;
  } catch (const std::exception& e) {
    g_last_error = std::string(fn) + ": internal error: " + e.what();
  } catch (...) {
    g_last_error = std::string(fn) + ": internal error";
  }
  return NVFP4KV_ERROR_INTERNAL;
}

std::string dtype_name(DLDataType t) {
  const char* base = nullptr;
  switch (t.code) {
    case kDLInt: base = "int"; break;
    case kDLUInt: base = "uint"; break;
    case kDLFloat: base = "float"; break;
    case kDLBfloat: base = "bfloat"; break;
    case kDLBool: return "bool";
    case kDLComplex: base = "complex"; break;
    default: break;
  }
  std::string s = base ? std::string(base) + std::to_string(t.bits)
                       : "dtype(code=" + std::to_string(t.code) + ", bits=" +
                             std::to_string(t.bits) + ")";
  if (t.lanes != 1) s += "x" + std::to_string(t.lanes);
  return s;
}

bool is_dtype(DLDataType t, uint8_t code, uint8_t bits) {
  return t.code == code && t.bits == bits && t.lanes == 1;
}

std::string device_name(DLDevice d) {
  switch (d.device_type) {
    case kDLCPU: return "cpu";
    case kDLCUDA: return "cuda:" + std::to_string(d.device_id);
    case kDLCUDAHost: return "cuda_host";
    case kDLCUDAManaged: return "cuda_managed:" + std::to_string(d.device_id);
    default: return "device(type=" + std::to_string(d.device_type) + ")";
  }
}

bool host_readable(DLDevice d) { return d.device_type == kDLCPU || d.device_type == kDLCUDAHost; }

bool same_device(DLDevice a, DLDevice b) {
  if (host_readable(a) && host_readable(b)) return true;
  return a.device_type == b.device_type && a.device_id == b.device_id;
}

// A named DLTensor with strides filled in (DLPack allows NULL for compact row-major).
struct Tensor {
  const DLTensor* t;
  const char* name;
  int64_t stride_[8];

  Tensor(const DLTensor* tensor, const char* n) : t(tensor), name(n) {
    if (!t) fail(NVFP4KV_ERROR_INVALID_VALUE, "%s: NULL tensor", name);
    if (t->ndim < 0 || t->ndim > 8) fail(NVFP4KV_ERROR_INVALID_VALUE, "%s: rank %d", name, t->ndim);
    int64_t s = 1;
    for (int i = t->ndim - 1; i >= 0; --i) {
      stride_[i] = t->strides ? t->strides[i] : s;
      s *= t->shape[i];
    }
  }
  int ndim() const { return t->ndim; }
  int64_t size(int i) const { return t->shape[i]; }
  int64_t stride(int i) const { return stride_[i]; }
  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < t->ndim; ++i) n *= t->shape[i];
    return n;
  }
  uint8_t* ptr() const { return static_cast<uint8_t*>(t->data) + t->byte_offset; }
  DLDevice device() const { return t->device; }

  std::string shape_str() const {
    std::string s = "(";
    for (int i = 0; i < t->ndim; ++i) s += (i ? ", " : "") + std::to_string(t->shape[i]);
    return s + (t->ndim == 1 ? ",)" : ")");
  }
  std::string strides_str() const {
    std::string s = "(";
    for (int i = 0; i < t->ndim; ++i) s += (i ? ", " : "") + std::to_string(stride_[i]);
    return s + (t->ndim == 1 ? ",)" : ")");
  }
  void expect_ndim(int n, const char* what) const {
    if (t->ndim != n)
      fail(NVFP4KV_ERROR_INVALID_VALUE, "%s: rank %d (shape %s) received; expected %s", name,
           t->ndim, shape_str().c_str(), what);
  }
};

DType float_dtype(const Tensor& x) {
  const DLDataType t = x.t->dtype;
  if (is_dtype(t, kDLFloat, 32)) return DType::kFloat32;
  if (is_dtype(t, kDLFloat, 16)) return DType::kFloat16;
  if (is_dtype(t, kDLBfloat, 16)) return DType::kBFloat16;
  fail(NVFP4KV_ERROR_INVALID_DTYPE, "%s: dtype %s received; expected float32, float16 or bfloat16",
       x.name, dtype_name(t).c_str());
}

void expect_uint8(const Tensor& x) {
  if (!is_dtype(x.t->dtype, kDLUInt, 8))
    fail(NVFP4KV_ERROR_INVALID_DTYPE,
         "%s: dtype %s received; expected uint8 (the NVFP4 cache holds raw bytes)", x.name,
         dtype_name(x.t->dtype).c_str());
}

void expect_same_device(const Tensor& x, const Tensor& ref) {
  if (!same_device(x.device(), ref.device()))
    fail(NVFP4KV_ERROR_DEVICE_MISMATCH, "%s: on %s, but %s is on %s; all tensors must be on one device",
         x.name, device_name(x.device()).c_str(), ref.name, device_name(ref.device()).c_str());
}

void check_head_size(int64_t D, const char* name) {
  if (D <= 0 || D % kGroupSize != 0 || D > kMaxHeadSize)
    fail(NVFP4KV_ERROR_INVALID_VALUE,
         "%s: head size %lld received; expected a multiple of 16 between 16 and %d", name,
         static_cast<long long>(D), kMaxHeadSize);
}

// Head size of a cache side from its full dim F = 9D/16.
int64_t head_size_from_full_dim(const Tensor& c, int64_t F) {
  if (F <= 0 || F % 9 != 0 || F / 9 * 16 > kMaxHeadSize)
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
         "%s: page stride %lld bytes received; pages would overlap (one page needs %lld bytes)",
         c.name, static_cast<long long>(page_stride), static_cast<long long>(min_bytes));
}

struct Cache {
  CacheSide k, v;
  int64_t N, T, H;
  Layout layout;
  DLDevice device;
  const char* k_name;  // argument to name in messages about the K side
  const char* v_name;
};

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

Cache resolve_cache(const DLTensor* kv_cache, const DLTensor* value_cache) {
  Cache r{};
  if (value_cache) {
    Tensor kc(kv_cache, "key_cache"), vc(value_cache, "value_cache");
    kc.expect_ndim(4, "(num_blocks, block_size, num_kv_heads, F)");
    vc.expect_ndim(4, "(num_blocks, block_size, num_kv_heads, F)");
    expect_uint8(kc);
    expect_uint8(vc);
    expect_same_device(vc, kc);
    for (int i = 0; i < 3; ++i)
      if (kc.size(i) != vc.size(i))
        fail(NVFP4KV_ERROR_INVALID_VALUE, "value_cache: shape %s does not match key_cache %s",
             vc.shape_str().c_str(), kc.shape_str().c_str());
    r.N = kc.size(0);
    r.T = kc.size(1);
    r.H = kc.size(2);
    check_geometry(kc, r.T, r.H);
    const int64_t Fk = kc.size(3), Fv = vc.size(3);
    r.k.D = static_cast<int32_t>(head_size_from_full_dim(kc, Fk));
    r.v.D = static_cast<int32_t>(head_size_from_full_dim(vc, Fv));
    const Layout lk = side_layout(kc, r.T, r.H, Fk), lv = side_layout(vc, r.T, r.H, Fv);
    if (lk != lv)
      fail(NVFP4KV_ERROR_INVALID_VALUE, "value_cache: layout %s but key_cache is %s",
           lv == Layout::kHND ? "HND" : "NHD", lk == Layout::kHND ? "HND" : "NHD");
    r.layout = lk;
    r.k.base = kc.ptr();
    r.v.base = vc.ptr();
    r.k.page_stride = kc.stride(0);
    r.v.page_stride = vc.stride(0);
    check_page_stride(kc, r.N, r.k.page_stride, r.H * r.T * Fk);
    check_page_stride(vc, r.N, r.v.page_stride, r.H * r.T * Fv);
    r.device = kc.device();
    r.k_name = "key_cache";
    r.v_name = "value_cache";
    return r;
  }

  Tensor c(kv_cache, "kv_cache");
  expect_uint8(c);
  r.device = c.device();
  r.k_name = r.v_name = "kv_cache";
  if (c.ndim() == 5) {  // (N, 2, T, H, F)
    if (c.size(1) != 2)
      fail(NVFP4KV_ERROR_INVALID_VALUE,
           "kv_cache: shape %s received; expected (num_blocks, 2, block_size, num_kv_heads, F)",
           c.shape_str().c_str());
    r.N = c.size(0);
    r.T = c.size(2);
    r.H = c.size(3);
    check_geometry(c, r.T, r.H);
    const int64_t F = c.size(4);
    r.k.D = r.v.D = static_cast<int32_t>(head_size_from_full_dim(c, F));
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
         "scale_layout: profile %d received; expected NVFP4KV_SCALES_VLLM (0, 'vllm') or "
         "NVFP4KV_SCALES_LINEAR (1, 'linear')",
         static_cast<int>(profile));
  c.k.interleaved = 0;
  c.v.interleaved = profile == NVFP4KV_SCALES_VLLM;
  if (!c.v.interleaved) return;
  if (c.layout != Layout::kHND)
    fail(NVFP4KV_ERROR_INVALID_VALUE,
         "scale_layout: the 'vllm' profile interleaves V scales, which is defined for the HND "
         "layout only (%s is NHD); use scale_layout='linear'", c.v_name);
  if (c.T % kInterleave != 0)
    fail(NVFP4KV_ERROR_INVALID_VALUE,
         "scale_layout: the 'vllm' profile interleaves V scales over 4 tokens, which needs a block "
         "size divisible by 4 (%s has block size %lld); use scale_layout='linear'",
         c.v_name, static_cast<long long>(c.T));
  if (c.v.D % 64 != 0)
    fail(NVFP4KV_ERROR_INVALID_VALUE,
         "scale_layout: the 'vllm' profile interleaves V scales, which needs a V head size "
         "divisible by 64 (got %d); use scale_layout='linear'",
         c.v.D);
}

ScaleArg resolve_scale(const DLTensor* scale, const char* name, DLDevice data_device) {
  if (!scale) fail(NVFP4KV_ERROR_INVALID_VALUE, "%s: NULL; expected a 1-element float32 tensor", name);
  Tensor s(scale, name);
  if (!is_dtype(s.t->dtype, kDLFloat, 32))
    fail(NVFP4KV_ERROR_INVALID_DTYPE, "%s: dtype %s received; expected a float32 tensor (or a Python float)",
         name, dtype_name(s.t->dtype).c_str());
  if (s.numel() != 1)
    fail(NVFP4KV_ERROR_INVALID_VALUE, "%s: shape %s received; expected exactly one element", name,
         s.shape_str().c_str());
  ScaleArg r{nullptr, 1.0f};
  if (host_readable(s.device())) {
    r.value = *reinterpret_cast<const float*>(s.ptr());
    if (!global_scale_valid(r.value))
      fail(NVFP4KV_ERROR_INVALID_VALUE,
           "%s: %.9g received; a global scale must be finite and > 0 with a finite reciprocal "
           "(the decode scale, usually amax / 448)",
           name, static_cast<double>(r.value));
    return r;
  }
  if (host_readable(data_device) || !same_device(s.device(), data_device))
    fail(NVFP4KV_ERROR_DEVICE_MISMATCH, "%s: on %s, but the cache is on %s", name,
         device_name(s.device()).c_str(), device_name(data_device).c_str());
  r.device_ptr = reinterpret_cast<const float*>(s.ptr());
  return r;
}

void check_input(const Tensor& x, const Cache& c, int64_t D, const char* cache_name) {
  x.expect_ndim(3, "(num_tokens, num_kv_heads, head_size)");
  if (x.size(1) != c.H)
    fail(NVFP4KV_ERROR_INVALID_VALUE, "%s: %lld heads (shape %s) but %s holds %lld KV heads",
         x.name, static_cast<long long>(x.size(1)), x.shape_str().c_str(), cache_name,
         static_cast<long long>(c.H));
  check_head_size(x.size(2), x.name);
  if (x.size(2) != D)
    fail(NVFP4KV_ERROR_INVALID_VALUE,
         "%s: head size %lld (shape %s) but %s has head size %lld (F = %lld)", x.name,
         static_cast<long long>(x.size(2)), x.shape_str().c_str(), cache_name,
         static_cast<long long>(D), static_cast<long long>(full_dim(static_cast<int>(D))));
  if (x.numel() > 0 && x.stride(2) != 1)  // an empty array may report any stride
    fail(NVFP4KV_ERROR_INVALID_VALUE, "%s: stride along head_size is %lld; expected 1", x.name,
         static_cast<long long>(x.stride(2)));
}

enum class Where { kCpu, kCuda };

Where where(DLDevice d, const char* name) {
  if (d.device_type == kDLCPU) return Where::kCpu;
  if (d.device_type == kDLCUDA) {
#if defined(NVFP4KV_WITH_CUDA)
    return Where::kCuda;
#else
    fail(NVFP4KV_ERROR_NOT_SUPPORTED,
         "%s: on %s, but this build of nvfp4kv has no CUDA kernels (see nvfp4kv.build_info())",
         name, device_name(d).c_str());
#endif
  }
  fail(NVFP4KV_ERROR_NOT_SUPPORTED, "%s: on %s; supported devices are cpu and cuda", name,
       device_name(d).c_str());
}

// Runs an operation's parameters on the path for the cache's device: the CPU loops, or the CUDA
// launcher (whose failure becomes NOT_SUPPORTED for a GPU without code in this build, else CUDA).
template <class T>
struct NonDeduced {
  using type = T;
};

template <class Params>
void run(const Cache& c, const Params& p, void (*cpu)(const Params&),
         int (*cuda)(const typename NonDeduced<Params>::type&, int, void*, const char**),
         void* stream) {
  if (where(c.device, c.k_name) == Where::kCpu) {
    cpu(p);
    return;
  }
#if defined(NVFP4KV_WITH_CUDA)
  const char* msg = nullptr;
  const int err = cuda(p, c.device.device_id, stream, &msg);
  if (err)
    fail(msg ? NVFP4KV_ERROR_NOT_SUPPORTED : NVFP4KV_ERROR_CUDA, "%s",
         msg ? msg : cuda_error_string(err));
#else
  (void)cuda;
  (void)stream;
#endif
}

// Whether two tensors' byte ranges (from their lowest to their highest element) intersect.
bool overlap(const Tensor& a, const Tensor& b) {
  const auto range = [](const Tensor& x, uintptr_t& lo, uintptr_t& hi) {
    int64_t first = 0, last = 0;
    for (int i = 0; i < x.ndim(); ++i) {
      if (x.size(i) == 0) return false;
      const int64_t span = (x.size(i) - 1) * x.stride(i);
      (span < 0 ? first : last) += span;
    }
    const int64_t bytes = (x.t->dtype.bits * x.t->dtype.lanes + 7) / 8;
    lo = reinterpret_cast<uintptr_t>(x.ptr()) + first * bytes;
    hi = reinterpret_cast<uintptr_t>(x.ptr()) + last * bytes + bytes;
    return true;
  };
  uintptr_t alo, ahi, blo, bhi;
  return range(a, alo, ahi) && range(b, blo, bhi) && alo < bhi && blo < ahi;
}

int64_t store_workspace_bytes(int64_t num_blocks, int64_t block_size) {
  if (num_blocks < 0 || block_size <= 0 || num_blocks > (int64_t{1} << 40) / block_size)
    fail(NVFP4KV_ERROR_INVALID_VALUE,
         "num_blocks %lld, block_size %lld received; expected num_blocks >= 0, block_size > 0 "
         "and at most 2^40 slots",
         static_cast<long long>(num_blocks), static_cast<long long>(block_size));
  return 4 * store_workspace_words(num_blocks, block_size);
}

// The workspace's words, checked: uint8, one contiguous run, 4-byte aligned, on the cache's
// device, large enough for this cache.
int32_t* store_workspace(const Tensor& w, const Tensor& cache_ref, const Cache& c) {
  expect_same_device(w, cache_ref);
  if (!is_dtype(w.t->dtype, kDLUInt, 8))
    fail(NVFP4KV_ERROR_INVALID_DTYPE, "workspace: dtype %s received; expected uint8",
         dtype_name(w.t->dtype).c_str());
  w.expect_ndim(1, "(bytes,)");
  if (w.size(0) > 1 && w.stride(0) != 1)
    fail(NVFP4KV_ERROR_INVALID_VALUE, "workspace: stride %lld; expected one contiguous run (stride 1)",
         static_cast<long long>(w.stride(0)));
  const int64_t need = store_workspace_bytes(c.N, c.T);
  if (w.size(0) < need)
    fail(NVFP4KV_ERROR_INVALID_VALUE,
         "workspace: %lld bytes, but a cache of %lld blocks of %lld tokens needs %lld "
         "(nvfp4kv.store_workspace_bytes)",
         static_cast<long long>(w.size(0)), static_cast<long long>(c.N),
         static_cast<long long>(c.T), static_cast<long long>(need));
  if (reinterpret_cast<uintptr_t>(w.ptr()) % 4 != 0)
    fail(NVFP4KV_ERROR_INVALID_VALUE, "workspace: address not a multiple of 4 bytes");
  return reinterpret_cast<int32_t*>(w.ptr());
}

void store(const DLTensor* key_t, const DLTensor* value_t, const DLTensor* kv_cache,
           const DLTensor* value_cache, const DLTensor* slot_t, const DLTensor* k_scale,
           const DLTensor* v_scale, nvfp4kv_recipe recipe, nvfp4kv_scale_profile profile,
           const DLTensor* workspace, void* stream) {
  Tensor key(key_t, "key"), value(value_t, "value"), slots(slot_t, "slot_mapping");
  if (!kv_cache) fail(NVFP4KV_ERROR_INVALID_VALUE, "kv_cache: NULL tensor");
  Cache c = resolve_cache(kv_cache, value_cache);
  const Tensor cache_ref(kv_cache, c.k_name);

  expect_same_device(key, cache_ref);
  expect_same_device(value, cache_ref);
  expect_same_device(slots, cache_ref);

  const DType dtype = float_dtype(key);
  if (float_dtype(value) != dtype)
    fail(NVFP4KV_ERROR_INVALID_DTYPE, "value: dtype %s but key is %s; they must match",
         dtype_name(value.t->dtype).c_str(), dtype_name(key.t->dtype).c_str());
  check_input(key, c, c.k.D, c.k_name);
  check_input(value, c, c.v.D, c.v_name);
  if (value.size(0) != key.size(0))
    fail(NVFP4KV_ERROR_INVALID_VALUE, "value: %lld tokens (shape %s) but key has %lld",
         static_cast<long long>(value.size(0)), value.shape_str().c_str(),
         static_cast<long long>(key.size(0)));

  slots.expect_ndim(1, "(num_tokens,)");
  const bool slots_i64 = is_dtype(slots.t->dtype, kDLInt, 64);
  if (!slots_i64 && !is_dtype(slots.t->dtype, kDLInt, 32))
    fail(NVFP4KV_ERROR_INVALID_DTYPE, "slot_mapping: dtype %s received; expected int64 or int32",
         dtype_name(slots.t->dtype).c_str());
  if (slots.size(0) != key.size(0))
    fail(NVFP4KV_ERROR_INVALID_VALUE, "slot_mapping: %lld entries but key has %lld tokens",
         static_cast<long long>(slots.size(0)), static_cast<long long>(key.size(0)));

  if (recipe != NVFP4KV_RECIPE_NVFP4 && recipe != NVFP4KV_RECIPE_NVFP4_4OVER6)
    fail(NVFP4KV_ERROR_INVALID_VALUE,
         "recipe: %d received; expected NVFP4KV_RECIPE_NVFP4 (0, 'nvfp4') or "
         "NVFP4KV_RECIPE_NVFP4_4OVER6 (1, 'nvfp4_4over6')",
         static_cast<int>(recipe));
  apply_profile(c, profile);

  StoreParams p{};
  p.k = StoreSide{key.ptr(), key.stride(0), key.stride(1), c.k, resolve_scale(k_scale, "k_scale", c.device)};
  p.v = StoreSide{value.ptr(), value.stride(0), value.stride(1), c.v,
                  resolve_scale(v_scale, "v_scale", c.device)};
  p.slots = IndexVec{slots.ptr(), slots.stride(0), slots_i64};
  p.num_tokens = key.size(0);
  p.num_slots = c.N * c.T;
  p.H = static_cast<int32_t>(c.H);
  p.T = static_cast<int32_t>(c.T);
  p.dtype = dtype;
  p.layout = c.layout;
  p.recipe = recipe == NVFP4KV_RECIPE_NVFP4 ? Recipe::kNvfp4 : Recipe::kNvfp4_4over6;
  if (workspace) {
    const Tensor w(workspace, "workspace");
    p.workspace = store_workspace(w, cache_ref, c);
    // The kernels write the workspace while they read the inputs and write the cache.
    for (const Tensor* x : std::initializer_list<const Tensor*>{&key, &value, &slots, &cache_ref})
      if (overlap(w, *x))
        fail(NVFP4KV_ERROR_INVALID_VALUE, "workspace: overlaps %s; it must be memory of its own", x->name);
    if (value_cache && overlap(w, Tensor(value_cache, c.v_name)))
      fail(NVFP4KV_ERROR_INVALID_VALUE, "workspace: overlaps %s; it must be memory of its own", c.v_name);
  }

  run(c, p, cpu_store, CUDA_OR_NULL(cuda_store), stream);
}

IndexVec index_vec(const DLTensor* t, const char* name, const Tensor& ref, int64_t length) {
  Tensor x(t, name);
  x.expect_ndim(1, "a vector");
  expect_same_device(x, ref);
  const bool i64 = is_dtype(x.t->dtype, kDLInt, 64);
  if (!i64 && !is_dtype(x.t->dtype, kDLInt, 32))
    fail(NVFP4KV_ERROR_INVALID_DTYPE, "%s: dtype %s received; expected int64 or int32", name,
         dtype_name(x.t->dtype).c_str());
  if (length >= 0 && x.size(0) != length)
    fail(NVFP4KV_ERROR_INVALID_VALUE, "%s: %lld entries received; expected %lld", name,
         static_cast<long long>(x.size(0)), static_cast<long long>(length));
  return IndexVec{x.ptr(), x.stride(0), i64};
}

// The two outputs of a read: rank, shape (dims after the leading ones checked by the caller),
// dtype (float, the same for both), device, last stride 1.
DType check_outputs(const Tensor& ko, const Tensor& vo, const Tensor& cache_ref) {
  expect_same_device(ko, cache_ref);
  expect_same_device(vo, cache_ref);
  const DType dtype = float_dtype(ko);
  if (float_dtype(vo) != dtype)
    fail(NVFP4KV_ERROR_INVALID_DTYPE, "value_out: dtype %s but key_out is %s; they must match",
         dtype_name(vo.t->dtype).c_str(), dtype_name(ko.t->dtype).c_str());
  for (const Tensor* o : {&ko, &vo})
    if (o->numel() > 0 && o->stride(o->ndim() - 1) != 1)
      fail(NVFP4KV_ERROR_INVALID_VALUE, "%s: last stride %lld; expected 1", o->name,
           static_cast<long long>(o->stride(o->ndim() - 1)));
  return dtype;
}

void dequantize(const DLTensor* kv_cache, const DLTensor* value_cache, const DLTensor* pages,
                const DLTensor* k_scale, const DLTensor* v_scale, nvfp4kv_scale_profile profile,
                DLTensor* key_out_t, DLTensor* value_out_t, void* stream) {
  if (!kv_cache) fail(NVFP4KV_ERROR_INVALID_VALUE, "kv_cache: NULL tensor");
  Cache c = resolve_cache(kv_cache, value_cache);
  apply_profile(c, profile);
  const Tensor cache_ref(kv_cache, c.k_name);
  Tensor ko(key_out_t, "key_out"), vo(value_out_t, "value_out");
  const Tensor* outs[2] = {&ko, &vo};
  const int64_t Ds[2] = {c.k.D, c.v.D};
  for (int i = 0; i < 2; ++i) {
    const Tensor& o = *outs[i];
    o.expect_ndim(4, "(num_blocks, block_size, num_kv_heads, head_size)");
    if (o.size(0) != c.N || o.size(1) != c.T || o.size(2) != c.H || o.size(3) != Ds[i])
      fail(NVFP4KV_ERROR_INVALID_VALUE, "%s: shape %s received; expected (%lld, %lld, %lld, %lld)",
           o.name, o.shape_str().c_str(), static_cast<long long>(c.N), static_cast<long long>(c.T),
           static_cast<long long>(c.H), static_cast<long long>(Ds[i]));
  }
  const DType dtype = check_outputs(ko, vo, cache_ref);

  DequantParams p{};
  p.k = DequantSide{c.k, resolve_scale(k_scale, "k_scale", c.device), ko.ptr(),
                    {ko.stride(0), ko.stride(1), ko.stride(2)}};
  p.v = DequantSide{c.v, resolve_scale(v_scale, "v_scale", c.device), vo.ptr(),
                    {vo.stride(0), vo.stride(1), vo.stride(2)}};
  p.pages = IndexVec{nullptr, 0, 0};
  p.num_pages = c.N;
  if (pages) {
    p.pages = index_vec(pages, "pages", cache_ref, -1);
    p.num_pages = Tensor(pages, "pages").size(0);
  }
  p.N = c.N;
  p.H = static_cast<int32_t>(c.H);
  p.T = static_cast<int32_t>(c.T);
  p.dtype = dtype;
  p.layout = c.layout;

  run(c, p, cpu_dequantize, CUDA_OR_NULL(cuda_dequantize), stream);
}

void gather(const DLTensor* kv_cache, const DLTensor* value_cache, const DLTensor* block_table_t,
            const DLTensor* seq_lens, const DLTensor* cu_seqlens, const DLTensor* k_scale,
            const DLTensor* v_scale, nvfp4kv_scale_profile profile, DLTensor* key_out_t,
            DLTensor* value_out_t, void* stream) {
  if (!kv_cache) fail(NVFP4KV_ERROR_INVALID_VALUE, "kv_cache: NULL tensor");
  Cache c = resolve_cache(kv_cache, value_cache);
  apply_profile(c, profile);
  const Tensor cache_ref(kv_cache, c.k_name);
  Tensor bt(block_table_t, "block_table");
  bt.expect_ndim(2, "(num_seqs, max_blocks_per_seq)");
  expect_same_device(bt, cache_ref);
  const bool bt64 = is_dtype(bt.t->dtype, kDLInt, 64);
  if (!bt64 && !is_dtype(bt.t->dtype, kDLInt, 32))
    fail(NVFP4KV_ERROR_INVALID_DTYPE, "block_table: dtype %s received; expected int32 or int64",
         dtype_name(bt.t->dtype).c_str());
  const int64_t B = bt.size(0);
  Tensor ko(key_out_t, "key_out"), vo(value_out_t, "value_out");
  const Tensor* outs[2] = {&ko, &vo};
  const int64_t Ds[2] = {c.k.D, c.v.D};
  for (int i = 0; i < 2; ++i) {
    const Tensor& o = *outs[i];
    o.expect_ndim(3, "(total_tokens, num_kv_heads, head_size)");
    if (o.size(0) != ko.size(0) || o.size(1) != c.H || o.size(2) != Ds[i])
      fail(NVFP4KV_ERROR_INVALID_VALUE, "%s: shape %s received; expected (%lld, %lld, %lld)",
           o.name, o.shape_str().c_str(), static_cast<long long>(ko.size(0)),
           static_cast<long long>(c.H), static_cast<long long>(Ds[i]));
  }
  const DType dtype = check_outputs(ko, vo, cache_ref);

  GatherParams p{};
  p.k = DequantSide{c.k, resolve_scale(k_scale, "k_scale", c.device), ko.ptr(),
                    {ko.stride(0), ko.stride(1), 0}};
  p.v = DequantSide{c.v, resolve_scale(v_scale, "v_scale", c.device), vo.ptr(),
                    {vo.stride(0), vo.stride(1), 0}};
  p.block_table = bt.ptr();
  p.bt_stride[0] = bt.stride(0);
  p.bt_stride[1] = bt.stride(1);
  p.bt_int64 = bt64;
  p.seq_lens = index_vec(seq_lens, "seq_lens", cache_ref, B);
  p.cu_seqlens = index_vec(cu_seqlens, "cu_seqlens", cache_ref, B + 1);
  p.B = B;
  p.max_blocks = bt.size(1);
  p.N = c.N;
  p.total_tokens = ko.size(0);
  p.H = static_cast<int32_t>(c.H);
  p.T = static_cast<int32_t>(c.T);
  p.dtype = dtype;
  p.layout = c.layout;

  run(c, p, cpu_gather, CUDA_OR_NULL(cuda_gather), stream);
}

}  // namespace
}  // namespace nvfp4kv

using nvfp4kv::guarded;

extern "C" {

NVFP4KV_API int nvfp4kv_version(void) { return NVFP4KV_VERSION; }

NVFP4KV_API const char* nvfp4kv_version_string(void) {
  return NVFP4KV_STR(NVFP4KV_VERSION_MAJOR) "." NVFP4KV_STR(NVFP4KV_VERSION_MINOR) "." NVFP4KV_STR(
      NVFP4KV_VERSION_PATCH);
}

NVFP4KV_API const char* nvfp4kv_status_string(nvfp4kv_status status) {
  switch (status) {
    case NVFP4KV_SUCCESS: return "success";
    case NVFP4KV_ERROR_INVALID_VALUE: return "invalid value";
    case NVFP4KV_ERROR_INVALID_DTYPE: return "invalid dtype";
    case NVFP4KV_ERROR_DEVICE_MISMATCH: return "device mismatch";
    case NVFP4KV_ERROR_NOT_SUPPORTED: return "not supported";
    case NVFP4KV_ERROR_CUDA: return "CUDA error";
    case NVFP4KV_ERROR_INTERNAL: return "internal error";
  }
  return "unknown status";
}

NVFP4KV_API const char* nvfp4kv_last_error(void) { return nvfp4kv::g_last_error.c_str(); }

NVFP4KV_API int nvfp4kv_cuda_built(void) {
#if defined(NVFP4KV_WITH_CUDA)
  return 1;
#else
  return 0;
#endif
}

NVFP4KV_API int nvfp4kv_cuda_build_version(void) {
#if defined(NVFP4KV_WITH_CUDA)
  return NVFP4KV_CUDA_VERSION;
#else
  return 0;
#endif
}

NVFP4KV_API const char* nvfp4kv_cuda_archs(void) {
#if defined(NVFP4KV_WITH_CUDA)
  return NVFP4KV_CUDA_ARCHS;
#else
  return "";
#endif
}

NVFP4KV_API int nvfp4kv_cuda_device_count(const char** reason) {
#if defined(NVFP4KV_WITH_CUDA)
  const char* why = nullptr;
  const int n = nvfp4kv::cuda_device_count(&why);
  if (n > 0) {
    if (reason) *reason = "";
    return n;
  }
  if (reason) *reason = why ? why : "no CUDA device found";
  return 0;
#else
  if (reason) *reason = "this build of nvfp4kv has no CUDA kernels (built without nvcc or with NVFP4KV_CUDA=OFF)";
  return 0;
#endif
}

NVFP4KV_API nvfp4kv_status nvfp4kv_store(const DLTensor* key, const DLTensor* value,
                                         const DLTensor* kv_cache, const DLTensor* value_cache,
                                         const DLTensor* slot_mapping, const DLTensor* k_scale,
                                         const DLTensor* v_scale, nvfp4kv_recipe recipe,
                                         nvfp4kv_scale_profile profile, void* stream) {
  return guarded("nvfp4kv_store", [&] {
    nvfp4kv::store(key, value, kv_cache, value_cache, slot_mapping, k_scale, v_scale, recipe,
                   profile, nullptr, stream);
  });
}

NVFP4KV_API nvfp4kv_status nvfp4kv_store_with_workspace(
    const DLTensor* key, const DLTensor* value, const DLTensor* kv_cache,
    const DLTensor* value_cache, const DLTensor* slot_mapping, const DLTensor* k_scale,
    const DLTensor* v_scale, nvfp4kv_recipe recipe, nvfp4kv_scale_profile profile,
    const DLTensor* workspace, void* stream) {
  return guarded("nvfp4kv_store_with_workspace", [&] {
    nvfp4kv::store(key, value, kv_cache, value_cache, slot_mapping, k_scale, v_scale, recipe,
                   profile, workspace, stream);
  });
}

NVFP4KV_API nvfp4kv_status nvfp4kv_set_store_order(int order) {
  return guarded("nvfp4kv_set_store_order", [&] {
    if (order < 0 || order > 2)
      nvfp4kv::fail(NVFP4KV_ERROR_INVALID_VALUE, "order: %d received; expected 0 (auto), 1 (page) or 2 (token)",
                    order);
#if defined(NVFP4KV_WITH_CUDA)
    nvfp4kv::cuda_set_store_order(order);
#endif
  });
}

NVFP4KV_API nvfp4kv_status nvfp4kv_set_gather_kernel(int which) {
  return guarded("nvfp4kv_set_gather_kernel", [&] {
    if (which < 0 || which > 2)
      nvfp4kv::fail(NVFP4KV_ERROR_INVALID_VALUE, "which: %d received; expected 0 (auto), 1 (pages) or 2 (rows)",
                    which);
#if defined(NVFP4KV_WITH_CUDA)
    nvfp4kv::cuda_set_gather_kernel(which);
#endif
  });
}

NVFP4KV_API nvfp4kv_status nvfp4kv_set_cpu_threads(int threads) {
  return guarded("nvfp4kv_set_cpu_threads", [&] {
    if (threads < 0 || threads > nvfp4kv::kMaxCpuThreads)
      nvfp4kv::fail(NVFP4KV_ERROR_INVALID_VALUE,
                    "threads: %d received; expected 1 to %d, or 0 for one per usable CPU (at most 16)", threads,
                    nvfp4kv::kMaxCpuThreads);
    nvfp4kv::cpu_set_threads(threads);
  });
}

NVFP4KV_API int nvfp4kv_cpu_threads(void) { return nvfp4kv::cpu_threads(); }

NVFP4KV_API nvfp4kv_status nvfp4kv_store_workspace_size(int64_t num_blocks, int64_t block_size,
                                                        size_t* bytes) {
  return guarded("nvfp4kv_store_workspace_size", [&] {
    if (!bytes) nvfp4kv::fail(NVFP4KV_ERROR_INVALID_VALUE, "bytes: NULL pointer");
    *bytes = static_cast<size_t>(nvfp4kv::store_workspace_bytes(num_blocks, block_size));
  });
}

NVFP4KV_API nvfp4kv_status nvfp4kv_dequantize(const DLTensor* kv_cache,
                                              const DLTensor* value_cache,
                                              const DLTensor* k_scale, const DLTensor* v_scale,
                                              nvfp4kv_scale_profile profile, DLTensor* key_out,
                                              DLTensor* value_out, void* stream) {
  return guarded("nvfp4kv_dequantize", [&] {
    nvfp4kv::dequantize(kv_cache, value_cache, nullptr, k_scale, v_scale, profile, key_out,
                        value_out, stream);
  });
}

NVFP4KV_API nvfp4kv_status nvfp4kv_dequantize_pages(const DLTensor* kv_cache,
                                                    const DLTensor* value_cache,
                                                    const DLTensor* pages,
                                                    const DLTensor* k_scale,
                                                    const DLTensor* v_scale,
                                                    nvfp4kv_scale_profile profile,
                                                    DLTensor* key_out, DLTensor* value_out,
                                                    void* stream) {
  return guarded("nvfp4kv_dequantize_pages", [&] {
    nvfp4kv::dequantize(kv_cache, value_cache, pages, k_scale, v_scale, profile, key_out,
                        value_out, stream);
  });
}

NVFP4KV_API nvfp4kv_status nvfp4kv_gather_dequant(const DLTensor* kv_cache,
                                                  const DLTensor* value_cache,
                                                  const DLTensor* block_table,
                                                  const DLTensor* seq_lens,
                                                  const DLTensor* cu_seqlens,
                                                  const DLTensor* k_scale, const DLTensor* v_scale,
                                                  nvfp4kv_scale_profile profile,
                                                  DLTensor* key_out, DLTensor* value_out,
                                                  void* stream) {
  return guarded("nvfp4kv_gather_dequant", [&] {
    nvfp4kv::gather(kv_cache, value_cache, block_table, seq_lens, cu_seqlens, k_scale, v_scale,
                    profile, key_out, value_out, stream);
  });
}

}  // extern "C"
