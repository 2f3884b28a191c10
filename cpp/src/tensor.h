// Tensor arguments of the C ABI: a DLTensor with its name (for messages), checked once on
// construction, and the errors every check raises. Failures are thrown as `Failure` and turned
// into a status and a message at the ABI boundary (capi.cpp, guarded()); nothing here is seen by a
// backend.
#pragma once

#include <stdint.h>

#include <initializer_list>
#include <string>

#include "nvfp4kv/format.h"
#include "nvfp4kv/nvfp4kv.h"
#include "params.h"

namespace nvfp4kv {

struct Failure {
  nvfp4kv_status status;
  std::string message;
};

// Throws Failure{status, printf(fmt, ...)}.
[[noreturn]] void fail(nvfp4kv_status status, const char* fmt, ...);

std::string dtype_name(DLDataType t);
bool is_dtype(DLDataType t, uint8_t code, uint8_t bits);
std::string device_name(DLDevice d);
bool host_readable(DLDevice d);
bool same_device(DLDevice a, DLDevice b);

// A named DLTensor with strides filled in (DLPack allows NULL for compact row-major). The
// constructor rejects what no operation can read: a NULL tensor, a rank outside 0..8, a NULL
// shape, negative extents, an element count past 2^62, and a NULL data pointer for a tensor with
// elements (meta or fake tensors).
class Tensor {
 public:
  const DLTensor* t;
  const char* name;

  Tensor(const DLTensor* tensor, const char* n);
  int ndim() const { return t->ndim; }
  int64_t size(int i) const { return t->shape[i]; }
  int64_t stride(int i) const { return stride_[i]; }
  int64_t numel() const { return numel_; }
  // In integers: an empty tensor's byte_offset is not checked (nothing is addressed) and may pass
  // the address space, where pointer arithmetic would be undefined (found by a C ABI fuzzer).
  uint8_t* ptr() const {
    return reinterpret_cast<uint8_t*>(reinterpret_cast<uintptr_t>(t->data) + static_cast<uintptr_t>(t->byte_offset));
  }
  DLDevice device() const { return t->device; }
  std::string shape_str() const;
  std::string strides_str() const;
  void expect_ndim(int n, const char* what) const;
  // Whether its strides may be stand-ins that say nothing of its layout: an empty array's
  // (NumPy 2 gives all-zero ones, NumPy 1.x none, which DLPack readers fill in as compact).
  bool stand_in_strides() const { return stand_in_; }
  // The addresses of its lowest byte and one past its highest (both 0 when it has no element),
  // as the constructor checked them.
  uintptr_t lowest() const { return lowest_; }
  uintptr_t end() const { return end_; }

 private:
  int64_t stride_[8];
  int64_t numel_;
  bool stand_in_ = false;
  uintptr_t lowest_ = 0, end_ = 0;
};

// Checks shared by the operations.
DType float_dtype(const Tensor& x);                                 // float32, float16 or bfloat16
void expect_uint8(const Tensor& x);
void expect_same_device(const Tensor& x, const Tensor& ref);
bool index_is_int64(const Tensor& x);                               // int64 (true) or int32 (false)
// A vector of int32 or int64 indices on ref's device; `length` < 0: any length.
IndexVec index_vec(const Tensor& x, const Tensor& ref, int64_t length);
// Whether two tensors' byte ranges (from their lowest to their highest element) intersect.
bool overlap(const Tensor& a, const Tensor& b);
// Whether some element of b shares a byte with some element of a: exact for views of one
// allocation with the same strides (the K and V halves of a paged cache), else by byte range.
bool elements_overlap(const Tensor& a, const Tensor& b);
// The one overlap rule of every operation, checked before anything is written: no output
// addresses an element twice (expand()), no two outputs share a byte range, and no output shares
// one with an input; a failure names both arguments. Absent (nullptr) entries are skipped.
// `outputs_checked` skips the output pairs (the caller proved them apart otherwise, as the two
// sides of a cache, page by page).
void check_apart(std::initializer_list<const Tensor*> outputs, std::initializer_list<const Tensor*> inputs,
                 bool outputs_checked = false);

}  // namespace nvfp4kv
