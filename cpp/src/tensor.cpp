// Tensor arguments of the C ABI (tensor.h).
#include "tensor.h"

#include <stdarg.h>
#include <stdio.h>

namespace nvfp4kv {

void fail(nvfp4kv_status status, const char* fmt, ...) {
  char buf[1024];
  va_list args;
  va_start(args, fmt);
  vsnprintf(buf, sizeof buf, fmt, args);
  va_end(args);
  throw Failure{status, buf};
}

std::string dtype_name(DLDataType t) {
  const char* base = nullptr;   // followed by the bit count
  const char* whole = nullptr;  // a name that carries its width
  switch (t.code) {
    case kDLInt: base = "int"; break;
    case kDLUInt: base = "uint"; break;
    case kDLFloat: base = "float"; break;
    case kDLBfloat: base = "bfloat"; break;
    case kDLBool: whole = "bool"; break;
    case kDLComplex: base = "complex"; break;
    // The narrow floats by their DLPack names (torch's float8_e4m3fn is code 10), so a message
    // says which one was passed instead of a bare code.
    case kDLFloat8_e3m4: whole = "float8_e3m4"; break;
    case kDLFloat8_e4m3: whole = "float8_e4m3"; break;
    case kDLFloat8_e4m3b11fnuz: whole = "float8_e4m3b11fnuz"; break;
    case kDLFloat8_e4m3fn: whole = "float8_e4m3fn"; break;
    case kDLFloat8_e4m3fnuz: whole = "float8_e4m3fnuz"; break;
    case kDLFloat8_e5m2: whole = "float8_e5m2"; break;
    case kDLFloat8_e5m2fnuz: whole = "float8_e5m2fnuz"; break;
    case kDLFloat8_e8m0fnu: whole = "float8_e8m0fnu"; break;
    case kDLFloat6_e2m3fn: whole = "float6_e2m3fn"; break;
    case kDLFloat6_e3m2fn: whole = "float6_e3m2fn"; break;
    case kDLFloat4_e2m1fn: whole = "float4_e2m1fn"; break;
    default: break;
  }
  std::string s = whole ? std::string(whole)
                  : base ? std::string(base) + std::to_string(t.bits)
                         : "dtype(code=" + std::to_string(t.code) + ", bits=" +
                               std::to_string(t.bits) + ")";
  if (t.lanes != 1) s += "x" + std::to_string(t.lanes);
  return s;
}

namespace {

// Bytes of one element (its lanes together), rounded up.
int64_t element_bytes(DLDataType t) { return (int64_t{t.bits} * t.lanes + 7) / 8; }

// The most bytes a tensor may span, and the largest byte_offset: more than any memory.
constexpr uint64_t kMaxSpan = uint64_t{1} << 62;

}  // namespace

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

Tensor::Tensor(const DLTensor* tensor, const char* n) : t(tensor), name(n) {
  if (!t) fail(NVFP4KV_ERROR_INVALID_VALUE, "%s: NULL tensor", name);
  if (t->ndim < 0 || t->ndim > 8) fail(NVFP4KV_ERROR_INVALID_VALUE, "%s: rank %d; expected 0 to 8", name, t->ndim);
  if (t->ndim > 0 && !t->shape)
    fail(NVFP4KV_ERROR_INVALID_VALUE, "%s: rank %d with a NULL shape pointer", name, t->ndim);
  numel_ = 1;
  bool empty = false;
  for (int i = 0; i < t->ndim; ++i) {
    if (t->shape[i] < 0)
      fail(NVFP4KV_ERROR_INVALID_VALUE, "%s: extent %lld along dimension %d; extents must be >= 0",
           name, static_cast<long long>(t->shape[i]), i);
    empty = empty || t->shape[i] == 0;
  }
  // Element count and compact strides, with overflow checked (a count past 2^62 elements cannot
  // describe memory; the check keeps every later product of extents in range). An empty array
  // whose strides are all 0 (NumPy 2 gives such, having no memory to describe) takes the compact
  // ones too, so that its layout reads as that of its shape.
  bool placeholder = empty && t->strides;
  for (int i = 0; placeholder && i < t->ndim; ++i) placeholder = t->strides[i] == 0;
  // No empty array's strides show its layout for sure: NumPy 1.x exports none for any array it
  // flags C-contiguous, every empty one included whatever its view's strides, and DLPack readers
  // (nanobind) fill in compact ones (found under NumPy 1.26).
  stand_in_ = empty;
  int64_t s = 1;
  for (int i = t->ndim - 1; i >= 0; --i) {
    stride_[i] = t->strides && !placeholder ? t->strides[i] : s;
    if (empty)  // no memory behind it: compact strides as row-major would give them
      s = static_cast<int64_t>(static_cast<uint64_t>(s) * static_cast<uint64_t>(t->shape[i]));
    else if (__builtin_mul_overflow(s, t->shape[i], &s))
      fail(NVFP4KV_ERROR_INVALID_VALUE, "%s: shape %s has more than 2^62 elements", name,
           shape_str().c_str());
  }
  numel_ = empty ? 0 : s;
  if (numel_ > (int64_t{1} << 62))
    fail(NVFP4KV_ERROR_INVALID_VALUE, "%s: shape %s has more than 2^62 elements", name, shape_str().c_str());
  if (numel_ > 0 && !t->data)
    fail(NVFP4KV_ERROR_INVALID_VALUE,
         "%s: NULL data pointer for a tensor of %lld elements (a meta or fake tensor has no memory "
         "to read or write)",
         name, static_cast<long long>(numel_));
  // The bytes its elements span, and their addresses: byte_offset and strides that no memory can
  // have (elements past 2^62 bytes from the first, or addresses that wrap around) describe no
  // tensor. Refused here, every later product of an index and a stride stays in range.
  if (numel_ > 0) {
    const uint64_t esize = static_cast<uint64_t>(element_bytes(t->dtype));
    uint64_t below = 0, above = 0;  // elements before and after the first one's address
    bool ok = t->byte_offset <= kMaxSpan;
    for (int i = 0; ok && i < t->ndim; ++i) {
      if (t->shape[i] <= 1) continue;
      const uint64_t mag = stride_[i] < 0 ? 0 - static_cast<uint64_t>(stride_[i]) : static_cast<uint64_t>(stride_[i]);
      uint64_t reach = 0;
      uint64_t& side = stride_[i] < 0 ? below : above;
      ok = !__builtin_mul_overflow(static_cast<uint64_t>(t->shape[i] - 1), mag, &reach) &&
           !__builtin_add_overflow(side, reach, &side) && side <= kMaxSpan;
    }
    uint64_t lo_bytes = 0, hi_bytes = 0;
    ok = ok && !__builtin_mul_overflow(below, esize, &lo_bytes) && !__builtin_mul_overflow(above + 1, esize, &hi_bytes) &&
         lo_bytes + hi_bytes <= kMaxSpan;
    const uintptr_t base = reinterpret_cast<uintptr_t>(t->data);
    uintptr_t first = 0, end = 0;
    ok = ok && !__builtin_add_overflow(base, static_cast<uintptr_t>(t->byte_offset), &first) && first >= lo_bytes &&
         !__builtin_add_overflow(first, static_cast<uintptr_t>(hi_bytes), &end);
    if (!ok)
      fail(NVFP4KV_ERROR_INVALID_VALUE,
           "%s: shape %s with strides %s at byte_offset %llu addresses elements past the address space "
           "(more than 2^62 bytes apart, or wrapping around); no memory has that layout",
           name, shape_str().c_str(), strides_str().c_str(), static_cast<unsigned long long>(t->byte_offset));
    lowest_ = first - lo_bytes;
    end_ = end;
  }
  // Every path reads and writes whole elements at their type (the CPU's as C++ objects, the
  // kernels' by typed loads, where a misaligned address faults and ends the CUDA context), and the
  // strides count elements: an address that is a multiple of the element size keeps every element
  // aligned. DLPack producers can hand out any address (a NumPy or CuPy view at an odd byte).
  // Only the types the ABI reads are asked (another type is a dtype error, raised by its check).
  const DLDataType d = t->dtype;
  const bool read_at_type = is_dtype(d, kDLFloat, 32) || is_dtype(d, kDLFloat, 16) || is_dtype(d, kDLBfloat, 16) ||
                            is_dtype(d, kDLInt, 32) || is_dtype(d, kDLInt, 64);
  const int64_t esize = d.bits / 8;
  if (numel_ > 0 && read_at_type && reinterpret_cast<uintptr_t>(ptr()) % static_cast<uint64_t>(esize) != 0)
    fail(NVFP4KV_ERROR_INVALID_VALUE, "%s: address not a multiple of its element size (%lld bytes)", name,
         static_cast<long long>(esize));
}

std::string Tensor::shape_str() const {
  std::string s = "(";
  for (int i = 0; i < t->ndim; ++i) s += (i ? ", " : "") + std::to_string(t->shape[i]);
  return s + (t->ndim == 1 ? ",)" : ")");
}

std::string Tensor::strides_str() const {
  std::string s = "(";
  for (int i = 0; i < t->ndim; ++i) s += (i ? ", " : "") + std::to_string(stride_[i]);
  return s + (t->ndim == 1 ? ",)" : ")");
}

void Tensor::expect_ndim(int n, const char* what) const {
  if (t->ndim != n)
    fail(NVFP4KV_ERROR_INVALID_VALUE, "%s: rank %d (shape %s) received; expected %s", name,
         t->ndim, shape_str().c_str(), what);
}

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

bool index_is_int64(const Tensor& x) {
  if (is_dtype(x.t->dtype, kDLInt, 64)) return true;
  if (is_dtype(x.t->dtype, kDLInt, 32)) return false;
  fail(NVFP4KV_ERROR_INVALID_DTYPE, "%s: dtype %s received; expected int64 or int32", x.name,
       dtype_name(x.t->dtype).c_str());
}

IndexVec index_vec(const Tensor& x, const Tensor& ref, int64_t length) {
  x.expect_ndim(1, "a vector");
  expect_same_device(x, ref);
  const bool i64 = index_is_int64(x);
  if (length >= 0 && x.size(0) != length)
    fail(NVFP4KV_ERROR_INVALID_VALUE, "%s: %lld entries received; expected %lld", x.name,
         static_cast<long long>(x.size(0)), static_cast<long long>(length));
  return IndexVec{x.ptr(), x.stride(0), i64};
}

bool overlap(const Tensor& a, const Tensor& b) {
  return a.numel() > 0 && b.numel() > 0 && a.lowest() < b.end() && b.lowest() < a.end();
}

namespace {

// Whether two distinct indices of x address the same element: with the dimensions of size > 1
// sorted by |stride|, each stride must exceed the span of the ones before it.
bool self_overlapping(const Tensor& x) {
  if (x.numel() <= 1) return false;
  int64_t dims[8][2];  // |stride|, size
  int n = 0;
  for (int i = 0; i < x.ndim(); ++i)
    if (x.size(i) > 1) {
      const int64_t st = x.stride(i) < 0 ? -x.stride(i) : x.stride(i);
      int k = n++;
      while (k > 0 && dims[k - 1][0] > st) {
        dims[k][0] = dims[k - 1][0];
        dims[k][1] = dims[k - 1][1];
        --k;
      }
      dims[k][0] = st;
      dims[k][1] = x.size(i);
    }
  int64_t span = 0;  // largest offset reachable with the dimensions so far
  for (int k = 0; k < n; ++k) {
    if (dims[k][0] <= span) return true;
    if (__builtin_mul_overflow(dims[k][1] - 1, dims[k][0], &dims[k][1]) ||
        __builtin_add_overflow(span, dims[k][1], &span))
      return true;  // beyond any memory
  }
  return false;
}

}  // namespace

// Whether some element of b occupies a byte of some element of a. Exact where the two share
// their element size and strides (non-zero, each larger in magnitude than the span of the
// smaller ones: the views of one allocation, such as the K and V halves of a paged cache, or
// those halves reversed): b's offsets minus a's, delta, must then be a sum of j_k * stride_k
// with j_k inside both extents, which a search over at most two candidates per dimension
// decides. A dimension both walk backwards is walked forwards from its far end (the same
// elements). Elsewhere the byte ranges decide (conservative: a false "overlap" only for
// interleaved views of different layouts).
bool elements_overlap(const Tensor& a, const Tensor& b) {
  if (!overlap(a, b)) return false;
  const int64_t e = element_bytes(a.t->dtype);
  if (element_bytes(b.t->dtype) != e || a.ndim() != b.ndim() || e == 0) return true;
  struct Dim {
    int64_t stride, lo, hi;  // j in [lo, hi]
  } dims[8];
  int n = 0;
  int64_t shift = 0;  // elements added to b's offset from a's by the dimensions walked forwards
  for (int i = 0; i < a.ndim(); ++i) {
    if (a.size(i) <= 1 && b.size(i) <= 1) continue;
    int64_t st = a.stride(i);
    if (b.stride(i) != st || st == 0) return true;
    if (st < 0) {
      // a's far end lies (size_a - 1) |st| below its start, b's (size_b - 1) |st| below its own.
      st = -st;
      int64_t d;
      if (__builtin_mul_overflow(a.size(i) - b.size(i), st, &d) || __builtin_add_overflow(shift, d, &shift))
        return true;
    }
    int k = n++;
    while (k > 0 && dims[k - 1].stride < st) {  // descending strides
      dims[k] = dims[k - 1];
      --k;
    }
    dims[k] = Dim{st, -(b.size(i) - 1), a.size(i) - 1};
  }
  const intptr_t diff = reinterpret_cast<intptr_t>(b.ptr()) - reinterpret_cast<intptr_t>(a.ptr());
  if (diff % e != 0) return true;
  int64_t delta;
  if (__builtin_add_overflow(static_cast<int64_t>(diff / e), shift, &delta)) return true;
  // span[k]: the largest |sum| of the dimensions after k (smaller strides).
  int64_t span[9] = {0};
  for (int k = n - 1; k >= 0; --k) {
    const int64_t reach = (dims[k].hi > -dims[k].lo ? dims[k].hi : -dims[k].lo) * dims[k].stride;
    span[k] = span[k + 1] + reach;
    if (span[k + 1] >= dims[k].stride) return true;  // not a layout the search decides
  }
  const auto floor_div = [](int64_t x, int64_t y) { return x / y - ((x % y != 0) && ((x < 0) != (y < 0))); };
  // Depth-first over the dimensions, largest stride first: j_k must leave a remainder the
  // smaller dimensions can still reach.
  struct Search {
    const Dim* dims;
    const int64_t* span;
    int n;
    decltype(floor_div) fdiv;
    bool operator()(int k, int64_t r) const {
      if (k == n) return r == 0;
      const Dim& d = dims[k];
      int64_t j_lo = -fdiv(-(r - span[k + 1]), d.stride), j_hi = fdiv(r + span[k + 1], d.stride);
      if (j_lo < d.lo) j_lo = d.lo;
      if (j_hi > d.hi) j_hi = d.hi;
      for (int64_t j = j_lo; j <= j_hi; ++j)
        if ((*this)(k + 1, r - j * d.stride)) return true;
      return false;
    }
  };
  return Search{dims, span, n, floor_div}(0, delta);
}

void check_apart(std::initializer_list<const Tensor*> outputs, std::initializer_list<const Tensor*> inputs,
                 bool outputs_checked) {
  for (const Tensor* o : outputs) {
    if (!o) continue;
    if (self_overlapping(*o))
      fail(NVFP4KV_ERROR_INVALID_VALUE,
           "%s: shape %s with strides %s may address some elements more than once (an expand()ed or "
           "as_strided view); an output must address each element once, with each stride larger than "
           "the span of the smaller ones",
           o->name, o->shape_str().c_str(), o->strides_str().c_str());
  }
  const auto apart = [](const Tensor& a, const Tensor& b) {
    return !same_device(a.device(), b.device()) || !elements_overlap(a, b);
  };
  for (const Tensor* const* a = outputs.begin(); a != outputs.end(); ++a) {
    if (!*a) continue;
    if (!outputs_checked)
      for (const Tensor* const* b = a + 1; b != outputs.end(); ++b)
        if (*b && !apart(**a, **b))
          fail(NVFP4KV_ERROR_INVALID_VALUE, "%s: shares memory with %s; the outputs of a call must not overlap",
               (*b)->name, (*a)->name);
    for (const Tensor* in : inputs)
      if (in && !apart(**a, *in))
        fail(NVFP4KV_ERROR_INVALID_VALUE,
             "%s: shares memory with %s; an input must not overlap an output of the call", in->name, (*a)->name);
  }
}

}  // namespace nvfp4kv
