// nvfp4kv._C: the nanobind bridge from DLPack-capable Python objects (torch, numpy, cupy, ...)
// to the C ABI. It only converts: arrays become DLTensor views (never copies: an implicit copy of
// a cache would make the write vanish), Python floats become host scalars, statuses become
// exceptions in one place (raise_for). The GIL is released around every call into the library.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/array.h>
#include <nanobind/stl/string.h>

#include <stdint.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <utility>

#include "nvfp4kv/format.h"
#include "nvfp4kv/nvfp4kv.h"
#include "float_mode.h"  // the IEEE mode for the host conversion of a scale (cpp/src/float_mode.h)
#include "params.h"      // decode_heads_ok, kGlobalScaleRule (cpp/src/params.h)
#include "testing.h"  // the library's test switches (cpp/src/testing.h), for _set_* below

namespace nb = nanobind;

namespace {

void raise_for(nvfp4kv_status status) {
  if (status == NVFP4KV_SUCCESS) return;
  const std::string msg = nvfp4kv_last_error();
  switch (status) {
    case NVFP4KV_ERROR_INVALID_VALUE:
    case NVFP4KV_ERROR_DEVICE_MISMATCH:
      throw nb::value_error(msg.c_str());
    case NVFP4KV_ERROR_INVALID_DTYPE:
      throw nb::type_error(msg.c_str());
    case NVFP4KV_ERROR_OUT_OF_MEMORY:
      PyErr_SetString(PyExc_MemoryError, msg.c_str());
      throw nb::python_error();
    default:
      throw std::runtime_error(msg);
  }
}

std::string python_type_name(nb::handle h) { return nb::type_name(h.type()).c_str(); }

// One argument as a DLTensor view; keeps the imported array alive for the call.
struct Arg {
  nb::ndarray<nb::ro> array;
  nb::object keep_alive;  // the torch tensor on the fast path
  int64_t shape[8];
  int64_t strides[8];
  float scalar;  // storage when the argument is a Python number
  DLTensor t{};
  bool present = false;

  const DLTensor* get() const { return present ? &t : nullptr; }
  DLTensor* get_mut() { return present ? &t : nullptr; }
};

// torch.Tensor fast paths. torch's __dlpack__ costs ~3 µs per tensor, a store takes seven, and
// small decode-time stores are bound by this host work. Two cheaper ways describe the same memory:
// - DLPack 1.3's C exchange table (torch >= 2.10: `torch.Tensor.__dlpack_c_exchange_api__`), whose
//   dltensor_from_py_object_no_sync fills a DLTensor from the tensor object in C, and whose
//   current_work_stream gives torch's current stream;
// - on older torch, reading the tensor's own attributes (a fraction of __dlpack__'s cost).
// Used only when torch is already imported (never imports it) and only for exact torch.Tensor
// objects of the dtypes and devices the library takes; anything else goes through DLPack, which
// also produces the error messages.

struct TorchInfo {
  PyObject* tensor_type = nullptr;
  PyObject* dtypes[6] = {};
  DLDataType dl[6] = {{kDLFloat, 32, 1}, {kDLFloat, 16, 1}, {kDLBfloat, 16, 1},
                      {kDLUInt, 8, 1},   {kDLInt, 32, 1},   {kDLInt, 64, 1}};
  // Interned attribute names: no string is built per call.
  PyObject *dtype, *get_device, *is_cpu, *is_cuda, *is_neg, *shape, *stride, *data_ptr;
  // torch._C._cuda_getCurrentRawStream(device) -> int, or nullptr (CPU-only torch, older torch)
  PyObject* raw_stream = nullptr;
  const DLPackExchangeAPI* exchange = nullptr;  // torch's C exchange table, or nullptr (torch < 2.10)
};

const TorchInfo* torch_info() {
  static TorchInfo info;
  static bool ready = false;
  if (ready) return &info;
  PyObject* torch = PyDict_GetItemString(PyImport_GetModuleDict(), "torch");  // borrowed
  if (!torch) return nullptr;  // not imported (yet): try again next time
  try {
    nb::handle t(torch);
    info.tensor_type = t.attr("Tensor").inc_ref().ptr();
    const char* names[6] = {"float32", "float16", "bfloat16", "uint8", "int32", "int64"};
    for (int i = 0; i < 6; ++i) info.dtypes[i] = t.attr(names[i]).inc_ref().ptr();
  } catch (const nb::python_error&) {
    return nullptr;
  }
  PyObject* c_mod = PyObject_GetAttrString(torch, "_C");
  if (c_mod) {
    info.raw_stream = PyObject_GetAttrString(c_mod, "_cuda_getCurrentRawStream");  // new ref, kept
    Py_DECREF(c_mod);
  }
  PyErr_Clear();
  // The table is a capsule on the type, alive for the whole process (DLPack's contract).
  PyObject* cap = PyObject_GetAttrString(info.tensor_type, "__dlpack_c_exchange_api__");
  if (cap && PyCapsule_IsValid(cap, "dlpack_exchange_api")) {
    const auto* api = static_cast<const DLPackExchangeAPI*>(PyCapsule_GetPointer(cap, "dlpack_exchange_api"));
    if (api && api->header.version.major == 1 && api->header.version.minor >= 3 && api->dltensor_from_py_object_no_sync &&
        api->current_work_stream)
      info.exchange = api;
  }
  Py_XDECREF(cap);
  PyErr_Clear();
  info.dtype = PyUnicode_InternFromString("dtype");
  info.get_device = PyUnicode_InternFromString("get_device");
  info.is_cpu = PyUnicode_InternFromString("is_cpu");
  info.is_cuda = PyUnicode_InternFromString("is_cuda");
  info.is_neg = PyUnicode_InternFromString("is_neg");
  info.shape = PyUnicode_InternFromString("shape");
  info.stride = PyUnicode_InternFromString("stride");
  info.data_ptr = PyUnicode_InternFromString("data_ptr");
  ready = true;
  return &info;
}

nb::object get(nb::handle obj, PyObject* name) {
  return nb::steal(PyObject_GetAttr(obj.ptr(), name));
}
nb::object call(nb::handle obj, PyObject* name) {
  return nb::steal(PyObject_CallMethodObjArgs(obj.ptr(), name, nullptr));
}

// torch's lazy negation bit (torch.conj(z).imag, torch._neg_view, and views of them) marks a view
// whose memory holds the negated values. torch's own exports (__dlpack__, the C exchange table,
// data_ptr) all hand out that memory as it is, so the binding refuses such a view rather than read
// or write the wrong signs. Every tensor is asked, whatever its dtype (is_neg() costs ~0.1 µs a
// call): the bit is not visible in the strides (as_strided gives an imaginary part stride 1), and
// an integer view carries it too (torch._neg_view of slots read as their negation: padding).

void reject_negated(nb::handle obj, const TorchInfo* info, const char* name) {
  nb::object neg = call(obj, info->is_neg);
  if (!neg.is_valid()) throw nb::python_error();
  if (neg.ptr() != Py_False)
    throw nb::value_error((std::string(name) + ": a lazily negated torch view (is_neg() is True) "
                           "exports its un-negated memory; pass x.resolve_neg()").c_str());
}

// A torch tensor the library cannot read as strided memory: a sparse (or other non-strided)
// layout, whose data pointer torch refuses to give, and a device without memory the library
// addresses (meta and fake tensors have none). Named here, before DLPack's generic refusal.
std::string str_of(nb::handle h) {
  nb::object s = nb::steal(PyObject_Str(h.ptr()));
  if (!s.is_valid()) throw nb::python_error();
  const char* c = PyUnicode_AsUTF8AndSize(s.ptr(), nullptr);
  if (!c) throw nb::python_error();
  return c;
}

void reject_unsupported_torch(nb::handle obj, const char* name) {
  const std::string layout = str_of(obj.attr("layout"));
  if (layout != "torch.strided")
    throw nb::type_error((std::string(name) + ": a torch tensor of layout " + layout +
                          " received; expected a dense (torch.strided) tensor (x.to_dense())").c_str());
  const std::string device = str_of(obj.attr("device").attr("type"));
  if (device != "cpu" && device != "cuda")
    throw nb::value_error((std::string(name) + ": a torch tensor on device '" + device +
                           "' received; expected CPU or CUDA memory (a meta or fake tensor has no data)").c_str());
}

// A torch tensor whose shape, strides or data pointer torch would not give (sparse CSR has no
// strides, a functorch wrapper no storage): refused as the DLPack path refuses it, a TypeError
// naming the argument (with torch's reason), never torch's bare RuntimeError.
[[noreturn]] void reject_unreadable_torch(nb::handle obj, const char* name) {
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  PyErr_NormalizeException(&type, &value, &tb);
  std::string why = "unknown";
  if (value) {
    PyObject* text = PyObject_Str(value);
    // PyUnicode_AsUTF8AndSize: in the limited API since 3.10 (PyUnicode_AsUTF8 only since 3.13,
    // and the abi3 build targets 3.12: it did not compile there).
    const char* utf8 = text && PyUnicode_Check(text) ? PyUnicode_AsUTF8AndSize(text, nullptr) : nullptr;
    if (utf8) why = utf8;
    Py_XDECREF(text);
    PyErr_Clear();
  }
  Py_XDECREF(type);
  Py_XDECREF(value);
  Py_XDECREF(tb);
  reject_unsupported_torch(obj, name);  // a layout or device it names
  throw nb::type_error((std::string(name) + ": a torch tensor whose memory cannot be read (torch: " + why +
                        "); expected a dense tensor with storage").c_str());
}

// Through torch's C exchange table.
bool import_torch_exchange(Arg& a, nb::handle obj, const TorchInfo* info, const char* name) {
  DLTensor t;
  if (info->exchange->dltensor_from_py_object_no_sync(obj.ptr(), &t) != 0) {
    PyErr_Clear();  // meta, sparse, ...: the attribute path and DLPack decide and explain
    return false;
  }
  int which = -1;
  for (int i = 0; i < 6; ++i)
    if (t.dtype.code == info->dl[i].code && t.dtype.bits == info->dl[i].bits && t.dtype.lanes == 1) which = i;
  if (which < 0 || t.ndim < 0 || t.ndim > 8 || t.byte_offset != 0 ||
      (t.device.device_type != kDLCPU && t.device.device_type != kDLCUDA))
    return false;
  reject_negated(obj, info, name);
  // The exported shape and strides live in the tensor; copied so they outlive this frame.
  // NULL strides: compact row-major. Unsigned products: an empty tensor's other extents may
  // multiply past int64 (UBSan, review); the C ABI checks the strides of a tensor with elements.
  uint64_t stride = 1;
  for (int i = t.ndim - 1; i >= 0; --i) {
    a.shape[i] = t.shape[i];
    a.strides[i] = t.strides ? t.strides[i] : static_cast<int64_t>(stride);
    stride *= static_cast<uint64_t>(t.shape[i]);
  }
  a.t = t;
  a.t.dtype = info->dl[which];
  a.t.shape = a.shape;
  a.t.strides = a.strides;
  a.keep_alive = nb::borrow(obj);
  a.present = true;
  return true;
}

// Which torch fast paths may run: 2 both, 1 the attribute path only, 0 none (DLPack for every
// tensor). Only the tests change it (_C._set_torch_paths), to cover each path with any torch.
int g_torch_paths = 2;
// Tensors each path imported (indexed as g_torch_paths; the GIL is held): what the tests read
// (_C._torch_path_counts) to know that the path they selected is the one that ran.
uint64_t g_torch_path_counts[3] = {0, 0, 0};

bool import_torch(Arg& a, nb::handle obj, const char* name) {
  if (g_torch_paths == 0) return false;
  const TorchInfo* info = torch_info();
  if (!info || reinterpret_cast<PyObject*>(Py_TYPE(obj.ptr())) != info->tensor_type) return false;
  if (g_torch_paths == 2 && info->exchange && import_torch_exchange(a, obj, info, name)) {
    ++g_torch_path_counts[2];
    return true;
  }
  nb::object dtype = get(obj, info->dtype);
  int which = -1;
  for (int i = 0; i < 6; ++i)
    if (dtype.ptr() == info->dtypes[i]) which = i;
  if (which < 0) return false;
  // get_device(): -1 on the CPU, else the CUDA ordinal (one call instead of a torch.device).
  nb::object ord = call(obj, info->get_device);
  if (!ord.is_valid()) throw nb::python_error();
  const int32_t ordinal = static_cast<int32_t>(PyLong_AsLong(ord.ptr()));
  if (ordinal == -1 && PyErr_Occurred()) throw nb::python_error();
  DLDevice dev;
  nb::object on = get(obj, ordinal < 0 ? info->is_cpu : info->is_cuda);
  if (!on.is_valid()) throw nb::python_error();
  if (on.ptr() != Py_True) return false;  // meta, mps, ...: DLPack decides
  dev = ordinal < 0 ? DLDevice{kDLCPU, 0} : DLDevice{kDLCUDA, ordinal};
  nb::object shape = get(obj, info->shape);
  if (!shape.is_valid()) reject_unreadable_torch(obj, name);
  nb::object strides = call(obj, info->stride);
  if (!strides.is_valid()) reject_unreadable_torch(obj, name);
  const Py_ssize_t nd = PyTuple_Size(shape.ptr());  // torch.Size is a tuple
  if (nd < 0 || nd > 8 || PyTuple_Size(strides.ptr()) != nd) {
    PyErr_Clear();
    return false;
  }
  for (Py_ssize_t i = 0; i < nd; ++i) {
    a.shape[i] = PyLong_AsLongLong(PyTuple_GetItem(shape.ptr(), i));
    a.strides[i] = PyLong_AsLongLong(PyTuple_GetItem(strides.ptr(), i));
  }
  if (PyErr_Occurred()) throw nb::python_error();
  a.t.ndim = static_cast<int32_t>(nd);
  a.t.dtype = info->dl[which];
  a.t.shape = a.shape;
  reject_negated(obj, info, name);
  nb::object ptr = call(obj, info->data_ptr);
  if (!ptr.is_valid()) reject_unreadable_torch(obj, name);  // sparse, a functorch wrapper
  a.t.data = PyLong_AsVoidPtr(ptr.ptr());
  a.t.device = dev;
  a.t.strides = a.strides;
  a.t.byte_offset = 0;
  a.keep_alive = nb::borrow(obj);
  a.present = true;
  ++g_torch_path_counts[1];
  return true;
}

// Imports `obj` without conversion. writable: reject read-only arrays with a clear message
// (nanobind refuses them for a writable ndarray, so try that first, then a read-only import
// to tell "read-only" apart from "not an array").
void import_array(Arg& a, nb::handle obj, const char* name, bool writable) {
  if (import_torch(a, obj, name)) return;
  const TorchInfo* info = torch_info();  // a torch subclass, the fast paths are off, or a
                                         // tensor they do not take (sparse, meta, ...)
  int is_tensor = 0;
  if (info) {
    is_tensor = PyObject_IsInstance(obj.ptr(), info->tensor_type);
    if (is_tensor < 0) throw nb::python_error();
    if (is_tensor) {
      // A tensor without memory (meta, or a FakeTensor under FakeTensorMode / torch.compile):
      // rejected before anything could read its pointer; nvfp4kv.api then routes the call to the
      // torch custom ops, whose fake implementations take such tensors (nvfp4kv/ops.py).
      nb::object meta = nb::getattr(obj, "is_meta", nb::none());
      if (meta.ptr() == Py_True || nb::hasattr(obj, "fake_mode"))
        throw nb::value_error((std::string(name) + ": a tensor without data (meta or fake); such tensors "
                               "go through torch.ops.nvfp4kv").c_str());
      reject_unsupported_torch(obj, name);
      reject_negated(obj, info, name);
    }
  }
  bool ok = false;
  if (writable) {
    nb::ndarray<> w;
    if (nb::try_cast(obj, w, false)) {
      a.array = nb::ndarray<nb::ro>(w);
      ok = true;
    } else if (nb::try_cast(obj, a.array, false)) {
      throw nb::value_error((std::string(name) +
                             ": the array is read-only; nvfp4kv writes into it in place, so it "
                             "must be writable")
                                .c_str());
    }
  } else {
    ok = nb::try_cast(obj, a.array, false);
  }
  if (!ok) {
    // An array whose exporter refuses it (NumPy: a big-endian array, strides that are not whole
    // elements) says why when asked directly.
    std::string why;
    if (nb::hasattr(obj, "__dlpack__")) {
      try {
        obj.attr("__dlpack__")();
      } catch (nb::python_error& e) {
        why = ": " + std::string(nb::str(e.value()).c_str());
      }
    }
    throw nb::type_error((std::string(name) + ": expected an array supporting DLPack (torch, "
                          "numpy, cupy, ...), got " + python_type_name(obj) + why)
                             .c_str());
  }
  if (is_tensor) ++g_torch_path_counts[0];
  const size_t nd = a.array.ndim();
  if (nd > 8) throw nb::value_error((std::string(name) + ": rank above 8").c_str());
  const int64_t item = (int64_t{a.array.dtype().bits} * a.array.dtype().lanes + 7) / 8;  // bytes
  for (size_t i = 0; i < nd; ++i) {
    a.shape[i] = static_cast<int64_t>(a.array.shape(i));
    a.strides[i] = static_cast<int64_t>(a.array.stride(i));
    // A negative stride that reaches us divided as an unsigned number of bytes (CuPy's [:, ::-1]
    // of int32 arrives as 2^62 - 1 elements, 2^64 - 4 bytes): its bytes, taken modulo 2^64 as
    // every address is, are the stride it means. Only strides no memory could have change (the
    // address-space check refused them, and before it they read right by wrapping around).
    const int64_t bytes = static_cast<int64_t>(static_cast<uint64_t>(a.strides[i]) * static_cast<uint64_t>(item));
    if (item > 1 && a.strides[i] > 0 && bytes < 0 && bytes > -(int64_t{1} << 62) && bytes % item == 0)
      a.strides[i] = bytes / item;
  }
  a.t.data = const_cast<void*>(a.array.data());
  a.t.device.device_type = static_cast<DLDeviceType>(a.array.device_type());
  a.t.device.device_id = a.array.device_id();
  a.t.ndim = static_cast<int32_t>(nd);
  const nb::dlpack::dtype dt = a.array.dtype();
  a.t.dtype.code = dt.code;
  a.t.dtype.bits = dt.bits;
  a.t.dtype.lanes = dt.lanes;
  a.t.shape = a.shape;
  a.t.strides = a.strides;
  a.t.byte_offset = 0;
  a.present = true;
}

void import_optional(Arg& a, nb::handle obj, const char* name, bool writable) {
  if (!obj.is_none()) import_array(a, obj, name, writable);
}

// x as the C ABI's float, converted and compared in IEEE mode: the caller's FTZ must not flush a
// subnormal to 0, nor its DAZ read one as 0 in the test. `lost`: x finite and nonzero, but 0 or
// infinite as a float.
float to_float32(double x, bool* lost) {
  const nvfp4kv::FloatModeGuard ieee;
  const float f = static_cast<float>(x);
  *lost = std::isfinite(x) && x != 0.0 && (f == 0.0f || std::isinf(f));
  return f;
}

[[noreturn]] void refuse_scale_number(nb::handle obj, const char* name) {
  std::string text = nb::repr(obj).c_str();
  if (text.size() > 40)  // a huge int: its first digits and its length
    text = text.substr(0, 20) + "... (" + std::to_string(text.size() - (text[0] == '-')) + " digits)";
  throw nb::value_error((std::string(name) + ": " + text + " received; " + nvfp4kv::kGlobalScaleRule).c_str());
}

// A scale imported from a Python number (import_scale: a host float32 scalar in `a.scalar`) that
// the C ABI would refuse, refused now. Checked in the ABI's floating-point mode: the caller's
// flush must not refuse a subnormal scale.
void refuse_invalid_number(const Arg& a, nb::handle obj, const char* name) {
  if (a.t.data != &a.scalar) return;  // an array: read at each call
  bool valid;
  {
    const nvfp4kv::FloatModeGuard ieee;
    valid = nvfp4kv::global_scale_valid(a.scalar);
  }
  if (!valid) refuse_scale_number(obj, name);
}

// A global scale: a Python number becomes a host float32 scalar, anything else an array.
void import_scale(Arg& a, nb::handle obj, const char* name) {
  if (PyBool_Check(obj.ptr()))
    throw nb::type_error((std::string(name) + ": a bool received; expected a float (the decode scale) "
                          "or a 1-element float32 tensor").c_str());
  if (nb::isinstance<nb::float_>(obj) || nb::isinstance<nb::int_>(obj)) {
    const double v = PyFloat_AsDouble(obj.ptr());  // ints too; OverflowError past the double range
    const bool past_double = v == -1.0 && PyErr_Occurred();
    if (past_double) PyErr_Clear();
    bool lost;
    a.scalar = to_float32(v, &lost);
    // A number the C ABI's float cannot hold is named here: the ABI would report the inf or the 0
    // it became.
    if (past_double || lost) refuse_scale_number(obj, name);
    a.t.data = &a.scalar;
    a.t.device = DLDevice{kDLCPU, 0};
    a.t.ndim = 0;
    a.t.dtype = DLDataType{kDLFloat, 32, 1};
    a.t.shape = nullptr;
    a.t.strides = nullptr;
    a.t.byte_offset = 0;
    a.present = true;
    return;
  }
  import_array(a, obj, name, false);
}

// The Python helpers of nvfp4kv.api, for what the fast paths below do not cover (they also
// produce the error messages): _choice, _scale, _stream_handle.
nb::object api_helper(const char* name) {
  return nb::module_::import_("nvfp4kv.api").attr(name);
}

// recipe / scale_layout strings -> enum values; anything else goes to api._choice, which raises.
int choice(nb::handle value, const char* const* names, int count, const char* table, const char* arg) {
  if (PyUnicode_Check(value.ptr())) {
    Py_ssize_t size = 0;
    const char* v = PyUnicode_AsUTF8AndSize(value.ptr(), &size);  // in the limited API
    if (!v) throw nb::python_error();
    for (int i = 0; i < count; ++i)  // the whole string: "nvfp4\0junk" is not "nvfp4"
      if (std::strlen(names[i]) == static_cast<size_t>(size) && std::memcmp(v, names[i], size) == 0) return i;
  }
  return nb::cast<int>(api_helper("_choice")(value, api_helper(table), arg));
}

// The stream to run on: an int as given; None: none for a cache on the CPU, torch's current
// stream of the cache's device when the cache is a CUDA torch tensor (read in C++: this is the
// per-call path of a decode step); every other case through api._stream_handle.
// A stream handle from a Python int: a cudaStream_t is a pointer, so [0, 2^64).
uintptr_t handle_value(nb::handle v) {
  if (PyLong_Check(v.ptr()) && !PyBool_Check(v.ptr())) {
    const unsigned long long h = PyLong_AsUnsignedLongLong(v.ptr());
    if (!(h == static_cast<unsigned long long>(-1) && PyErr_Occurred())) return static_cast<uintptr_t>(h);
    PyErr_Clear();
  }
  throw nb::value_error((std::string("stream: ") + nb::repr(v).c_str() +
                         " received; expected None, a stream object, or a cudaStream_t handle as an "
                         "integer in [0, 2**64)").c_str());
}

uintptr_t stream_handle(nb::handle stream, nb::handle like, const Arg& cache) {
  if (PyLong_Check(stream.ptr())) return handle_value(stream);
  if (stream.is_none() && cache.t.device.device_type == kDLCPU) return 0;  // no stream on the CPU
  if (stream.is_none() && cache.keep_alive.is_valid() && cache.t.device.device_type == kDLCUDA) {
    const TorchInfo* info = torch_info();
    if (info && info->exchange && g_torch_paths == 2) {
      void* s = nullptr;
      if (info->exchange->current_work_stream(kDLCUDA, cache.t.device.device_id, &s) != 0)
        throw nb::python_error();
      return reinterpret_cast<uintptr_t>(s);
    }
    if (info && info->raw_stream) {
      nb::object s = nb::steal(PyObject_CallFunction(info->raw_stream, "i", cache.t.device.device_id));
      if (!s.is_valid()) throw nb::python_error();
      return handle_value(s);
    }
  }
  return handle_value(api_helper("_stream_handle")(stream, like));
}

// k_scale / v_scale: a Python number or an array as they are; numpy scalars and the like
// through api._scale (which turns them into floats).
nb::object scale_arg(nb::handle x, const char* name) {
  if (PyFloat_Check(x.ptr()) || PyLong_Check(x.ptr())) return nb::borrow(x);
  const TorchInfo* info = torch_info();
  if (info && reinterpret_cast<PyObject*>(Py_TYPE(x.ptr())) == info->tensor_type) return nb::borrow(x);
  return api_helper("_scale")(x, name);
}

// Cache sides given apart are (N, T, H, F) in logical order (vLLM's reshape_and_cache_flash
// convention). The halves of a packed (N, 2H, T, F) cache taken with split(H, dim=1) are
// (N, H, T, F): their shape and strides equal those of an NHD side with H and T exchanged, and
// only their origin tells them apart: torch halves whose _base is such a packed cache, with the
// same strides, are read transposed (orient_sides), by every call at every shape, so that a
// call's head count (the store's key, the reads' outputs) is checked against the cache's own
// (design notes: "Split halves of a packed cache: oriented in the binding"). Where the caller
// names the memory order (kv_layout), the Python API decides by the strides instead and passes
// `orient` (api._orientation): 0 as given, 1 exchanged; -1 is the rule above, and -2 the same
// without warn_if_ambiguous (the torch ops: under torch.compile inductor hands them views rebuilt
// without their origin, after the traced call has oriented the sides, kv_layout included).
bool split_half(nb::handle obj, const Arg& a) {
  const TorchInfo* info = torch_info();
  if (!info || !PyObject_TypeCheck(obj.ptr(), reinterpret_cast<PyTypeObject*>(info->tensor_type))) return false;
  nb::object base = nb::getattr(obj, "_base", nb::none());
  if (base.is_none()) return false;
  nb::object shape = base.attr("shape");
  // A half keeps its base's token and byte dimensions (api._split_halves says why).
  if (nb::len(shape) != 4 || nb::cast<int64_t>(shape[1]) % 2 != 0 || nb::cast<int64_t>(shape[1]) / 2 != a.shape[1] ||
      nb::cast<int64_t>(shape[2]) != a.shape[2] || nb::cast<int64_t>(shape[3]) != a.shape[3])
    return false;
  nb::object stride = base.attr("stride")();
  for (int i = 0; i < 4; ++i)
    if (nb::cast<int64_t>(stride[i]) != a.strides[i]) return false;
  return true;
}

// An array's origin (torch's `_base`, numpy's and cupy's `base`) where it is 5-D with integer
// extents, which go to `d`; else None.
nb::object origin_5d(nb::handle obj, int64_t (&d)[5]) {
  nb::object base = nb::getattr(obj, nb::hasattr(obj, "_base") ? "_base" : "base", nb::none());
  if (base.is_none()) return base;
  nb::object shape = nb::getattr(base, "shape", nb::none());
  if (!PyTuple_Check(shape.ptr()) || PyTuple_Size(shape.ptr()) != 5) return nb::none();  // torch.Size too; limited API
  for (Py_ssize_t i = 0; i < 5; ++i)
    if (!nb::try_cast(nb::handle(PyTuple_GetItem(shape.ptr(), i)), d[i], false)) return nb::none();
  return base;
}

// The page stride (elements) of a uint8 cache argument. NumPy 1.x exports no strides for an array
// it flags C-contiguous, which it decides ignoring size-1 dimensions, and nanobind fills in compact
// ones: a one-page view's page stride is then lost (a review found a one-page view of part of the
// pages accepted, and written through, under NumPy 1.26). Read from the array itself then.
int64_t page_stride(nb::handle obj, const Arg& a) {
  if (a.t.ndim < 1 || a.shape[0] != 1) return a.strides[0];
  const TorchInfo* info = torch_info();
  const bool torch_obj = info && PyObject_TypeCheck(obj.ptr(), reinterpret_cast<PyTypeObject*>(info->tensor_type));
  nb::object strides = torch_obj ? obj.attr("stride")() : nb::getattr(obj, "strides", nb::none());
  int64_t itemsize = 0, s0 = 0;
  if (!nb::try_cast(nb::getattr(obj, "itemsize", nb::none()), itemsize, false) || itemsize != 1 ||
      !PyTuple_Check(strides.ptr()) || PyTuple_Size(strides.ptr()) < 1 ||
      !nb::try_cast(nb::handle(PyTuple_GetItem(strides.ptr(), 0)), s0, false))
    return a.strides[0];
  return s0;
}

// Whether the sides (N, A, B, F) `a` of array `obj` are [:, 0] or [:, 1] of their origin, a 5-D
// (N, 2, A, B, F) cache.
bool sides_of_5d(nb::handle obj, const Arg& a) {
  int64_t d[5];
  return !origin_5d(obj, d).is_none() && d[1] == 2 && d[0] == a.shape[0] && d[2] == a.shape[1] &&
         d[3] == a.shape[2] && d[4] == a.shape[3];
}

// What of a call's own head count can tell the two readings of ambiguous sides apart (below).
// kEqual: the store's key, whose head count must equal the cache's, so only A == B is silent;
// kGroup: decode's query, whose count must pass decode_heads_ok with the cache's heads;
// kNone: the reads, whose outputs the Python API shapes from the sides as read.
enum class HeadsTell { kEqual, kGroup, kNone };

// Sides the origin rule reads as NHD sides (N, T, H, F) whose bytes are also those of the
// (N, H, T, F) halves of a packed HND cache: both rows of a side contiguous ((page, B F, F, 1)),
// V one side after K in the same pages. Where their origin names neither a packed cache
// (split_half) nor a 5-D one (sides_of_5d: read in the 5-D cache's own convention, (N, 2, T, H,
// F)), as for views of a view (vLLM views a raw buffer, and torch keeps only the root in `_base`)
// or numpy's halves, nothing tells which was meant, and a misread is silent
// where the call's head count fits both: warned, with the way to say it (found by an
// integrator's review: vLLM's halves read transposed by decode, relative error 1.45, no error).
void warn_if_ambiguous(const Arg& c, nb::handle c_obj, const Arg& vc, HeadsTell tell, int64_t heads) {
  const int64_t A = c.shape[1], B = c.shape[2], F = c.shape[3];
  // Empty sides read nothing; one head and one-token pages read the same either way.
  if (c.shape[0] <= 0 || A <= 0 || B <= 0 || F <= 0 || (A == 1 && B == 1)) return;
  int64_t side;
  if (__builtin_mul_overflow(A, B, &side) || __builtin_mul_overflow(side, F, &side) || side > INT64_MAX / 2) return;
  if (tell == HeadsTell::kEqual ? A != B
                                : tell == HeadsTell::kGroup &&
                                      !(nvfp4kv::decode_heads_ok(heads, A) && nvfp4kv::decode_heads_ok(heads, B)))
    return;
  for (int i = 0; i < 4; ++i)
    if (c.shape[i] != vc.shape[i] || c.strides[i] != vc.strides[i]) return;
  if (c.t.dtype.code != kDLUInt || c.t.dtype.bits != 8 || c.strides[3] != 1 || c.strides[2] != F ||
      c.strides[1] != B * F || page_stride(c_obj, c) < 2 * side ||
      static_cast<const uint8_t*>(vc.t.data) - static_cast<const uint8_t*>(c.t.data) != side)
    return;
  if (sides_of_5d(c_obj, c)) return;
  const std::string msg =
      "key_cache, value_cache: two sides of shape (" + std::to_string(c.shape[0]) + ", " + std::to_string(A) + ", " +
      std::to_string(B) + ", " + std::to_string(F) + "), V one side after K in each page, are read as NHD sides: " +
      "block size " + std::to_string(A) + ", " + std::to_string(B) + " KV heads. The same bytes are the halves of a " +
      "packed HND cache (N, " + std::to_string(2 * A) + ", " + std::to_string(B) + ", F) taken with split(" +
      std::to_string(A) + ", dim=1) (" + std::to_string(A) + " KV heads, block size " + std::to_string(B) +
      "), and their origin does not say which. Pass kv_layout='NHD' or 'HND' (the memory "
      "order), or the packed cache itself";
  // stacklevel 2: the caller of the Python API function (api.py) that called the binding.
  if (PyErr_WarnEx(PyExc_UserWarning, msg.c_str(), 2) != 0) throw nb::python_error();
}

// A 4-D cache argument cut from part of the page sides of a 5-D cache: its origin (`_base`,
// `base`) a uint8 (N, 2, X, Y, F) array of the same F and page stride whose sides hold other rows
// than the argument's (one head of several, the first tokens of each page), as a side (with a
// value_cache) or a packed cache. A page side holds the codes of all its heads and tokens before
// their scales (FORMAT.md §4), so such a view is no cache: its "scales" are other heads' codes,
// and a store through it wrote into heads it never named (found by review: fuzzing). The shapes
// and strides alone match a cache of fewer heads in padded pages. Only 5-D origins whose first
// dimension is this cache's pages say so: a 4-D origin may hold several layers' caches in each
// page (a review found (N, L 2H, T, F) pools refused), and vLLM views a flat buffer.
// `shape` and `stride0`: the argument's 4 extents and its page stride (nvfp4kv.views passes its own).
void refuse_part_of_pages(nb::handle obj, const int64_t* shape, int64_t stride0, bool side, const char* name) {
  int64_t d[5], itemsize = 0, base_stride0 = 0;
  const nb::object base = origin_5d(obj, d);
  if (base.is_none()) return;
  // A side is one of the origin's two sides ([:, 0], [:, 1]); a packed cache, the whole page (the
  // common case, decided without more attribute reads: stores of a few tokens are host-bound).
  int64_t rows = 0, sides = 0;  // of broadcast dimensions may overflow: no cache then either
  if (__builtin_mul_overflow(shape[1], shape[2], &rows) || __builtin_mul_overflow(d[2], d[3], &sides)) return;
  if (d[1] != 2 || d[4] != shape[3] || (side ? rows == sides : rows == 2 * sides)) return;
  // Its elements bytes and its page stride the argument's: torch's stride() and numpy's strides
  // agree for one-byte elements.
  if (!nb::try_cast(nb::getattr(base, "itemsize", nb::none()), itemsize, false) || itemsize != 1) return;
  const TorchInfo* info = torch_info();
  const bool torch_base =
      info && PyObject_TypeCheck(base.ptr(), reinterpret_cast<PyTypeObject*>(info->tensor_type));
  nb::object strides = torch_base ? base.attr("stride")() : nb::getattr(base, "strides", nb::none());
  if (!PyTuple_Check(strides.ptr()) || PyTuple_Size(strides.ptr()) != 5 ||
      !nb::try_cast(nb::handle(PyTuple_GetItem(strides.ptr(), 0)), base_stride0, false) || base_stride0 != stride0)
    return;
  const std::string dims = std::to_string(d[0]) + ", 2, " + std::to_string(d[2]) + ", " + std::to_string(d[3]) +
                           ", " + std::to_string(d[4]);
  // One whole side given where the whole cache goes (value_cache forgotten): say so (review).
  const std::string hint = !side && rows == sides
                               ? ". It is one whole side ([:, 0] or [:, 1]): pass the 5-D cache itself, or both "
                                 "sides, [:, 0] as key_cache and [:, 1] as value_cache"
                               : ": pass the whole cache (its [:, 0] and [:, 1] as the sides)";
  throw nb::value_error((std::string(name) + ": a view of part of the pages of the cache it was taken from (its origin, " +
                         "shape (" + dims + ")): " + std::to_string(shape[1]) + " x " + std::to_string(shape[2]) +
                         " rows of F bytes a page" + (side ? " side" : "") +
                         ". A page side holds the codes of all its heads and tokens before their scales " +
                         "(FORMAT.md §4), so part of one is not a cache" + hint)
                            .c_str());
}
void refuse_part_of_pages(nb::handle obj, const Arg& a, bool side, const char* name) {
  if (a.t.ndim == 4) refuse_part_of_pages(obj, a.shape, page_stride(obj, a), side, name);
}

// `profile`: the call's scale layout; "vllm" interleaves V scales, defined for HND only, so the C
// ABI refuses the NHD reading of such sides and nothing is silent.
void orient_sides(Arg& c, nb::handle c_obj, Arg& vc, nb::handle vc_obj, int orient, int profile,
                  HeadsTell tell = HeadsTell::kNone, int64_t heads = 0) {
  refuse_part_of_pages(c_obj, c, vc.present, vc.present ? "key_cache" : "kv_cache");
  if (vc.present) refuse_part_of_pages(vc_obj, vc, true, "value_cache");
  if (!vc.present || c.t.ndim != 4 || vc.t.ndim != 4 || orient == 0) return;
  if (orient < 0 && (!split_half(c_obj, c) || !split_half(vc_obj, vc))) {
    if (orient == -1 && static_cast<nvfp4kv_scale_profile>(profile) != NVFP4KV_SCALES_VLLM)
      warn_if_ambiguous(c, c_obj, vc, tell, heads);
    return;
  }
  for (Arg* a : {&c, &vc}) {
    std::swap(a->shape[1], a->shape[2]);
    std::swap(a->strides[1], a->strides[2]);
  }
}

const char* const kRecipeNames[] = {"nvfp4", "nvfp4_4over6"};          // enum order
const char* const kScaleLayoutNames[] = {"vllm", "linear"};           // enum order

// nvfp4kv_store, or nvfp4kv_store_with_workspace when there is a workspace (so that errors of
// calls without one keep the name of the plain entry point). Called without the GIL.
nvfp4kv_status store_call(const Arg& k, const Arg& v, const Arg& c, const Arg& vc, const Arg& s, const Arg& ks,
                          const Arg& vs, int recipe, int profile, const Arg& ws, uintptr_t stream) {
  const auto r = static_cast<nvfp4kv_recipe>(recipe);
  const auto p = static_cast<nvfp4kv_scale_profile>(profile);
  void* st = reinterpret_cast<void*>(stream);
  return ws.present ? nvfp4kv_store_with_workspace(k.get(), v.get(), c.get(), vc.get(), s.get(), ks.get(), vs.get(),
                                                   r, p, ws.get(), st)
                    : nvfp4kv_store(k.get(), v.get(), c.get(), vc.get(), s.get(), ks.get(), vs.get(), r, p, st);
}

// A store with its per-layer arguments imported once (nvfp4kv.prepare_store): each call imports
// only key, value and slot_mapping (a decode step's store is bound by this host work, and the
// cache, scales and workspace are the same tensors at every step). The imported views point into
// the members, so the object is built in place and never copied; it keeps the tensors alive.
struct PreparedStore {
  Arg cache, value_cache, k_scale, v_scale, workspace;
  int recipe = 0, profile = 0;
  nb::object cache_obj;
  nb::object memory;  // what keeps the imported memory itself alive (api.prepare_store: torch storages)

  PreparedStore(nb::handle kv_cache, nb::handle k_scale_, nb::handle v_scale_, nb::handle value_cache_,
                nb::handle recipe_, nb::handle scale_layout, nb::handle workspace_, int orient,
                nb::handle memory_ = nb::none(), bool prepared = false) {
    recipe = choice(recipe_, kRecipeNames, 2, "_RECIPES", "recipe");
    profile = choice(scale_layout, kScaleLayoutNames, 2, "_SCALE_LAYOUTS", "scale_layout");
    const nb::object ksc = scale_arg(k_scale_, "k_scale"), vsc = scale_arg(v_scale_, "v_scale");
    import_array(cache, kv_cache, value_cache_.is_none() ? "kv_cache" : "key_cache", true);
    import_optional(value_cache, value_cache_, "value_cache", true);
    orient_sides(cache, kv_cache, value_cache, value_cache_, orient, profile, HeadsTell::kEqual);
    import_scale(k_scale, ksc, "k_scale");
    import_scale(v_scale, vsc, "v_scale");
    // Numbers are taken by value: prepare_store refuses an invalid one here, once, where every
    // call would refuse it. store() leaves it to the C ABI's checks, in their order.
    if (prepared) {
      refuse_invalid_number(k_scale, ksc, "k_scale");
      refuse_invalid_number(v_scale, vsc, "v_scale");
    }
    import_optional(workspace, workspace_, "workspace", true);
    cache_obj = nb::borrow(kv_cache);
    memory = nb::borrow(memory_);
  }
  PreparedStore(const PreparedStore&) = delete;
  PreparedStore& operator=(const PreparedStore&) = delete;

  void operator()(nb::handle key, nb::handle value, nb::handle slot_mapping, nb::handle stream) {
    Arg k, v, s;
    import_array(k, key, "key", false);
    import_array(v, value, "value", false);
    import_array(s, slot_mapping, "slot_mapping", false);
    const uintptr_t st_handle = stream_handle(stream, cache_obj, cache);
    nvfp4kv_status st;
    {
      nb::gil_scoped_release release;
      st = store_call(k, v, cache, value_cache, s, k_scale, v_scale, recipe, profile, workspace, st_handle);
    }
    raise_for(st);
  }
};

// store(): a PreparedStore used once (the same imports, checks and call).
void store(nb::handle key, nb::handle value, nb::handle kv_cache, nb::handle slot_mapping,
           nb::handle k_scale, nb::handle v_scale, nb::handle value_cache, nb::handle recipe,
           nb::handle scale_layout, nb::handle stream, nb::handle workspace, int orient) {
  PreparedStore(kv_cache, k_scale, v_scale, value_cache, recipe, scale_layout, workspace, orient)(key, value,
                                                                                                 slot_mapping, stream);
}

void dequantize(nb::handle kv_cache, nb::handle value_cache, nb::handle pages, nb::handle k_scale,
                nb::handle v_scale, nb::handle scale_layout, nb::handle key_out,
                nb::handle value_out, nb::handle stream, int orient) {
  const int profile = choice(scale_layout, kScaleLayoutNames, 2, "_SCALE_LAYOUTS", "scale_layout");
  const nb::object ksc = scale_arg(k_scale, "k_scale"), vsc = scale_arg(v_scale, "v_scale");
  Arg c, vc, pg, ks, vs, ko, vo;
  import_array(c, kv_cache, value_cache.is_none() ? "kv_cache" : "key_cache", false);
  import_optional(vc, value_cache, "value_cache", false);
  import_optional(pg, pages, "pages", false);
  import_scale(ks, ksc, "k_scale");
  import_scale(vs, vsc, "v_scale");
  import_array(ko, key_out, "key_out", true);
  import_array(vo, value_out, "value_out", true);
  orient_sides(c, kv_cache, vc, value_cache, orient, profile);
  const uintptr_t st_handle = stream_handle(stream, kv_cache, c);
  nvfp4kv_status st;
  {
    // Without pages, the plain entry point, whose name the errors then carry (review: a call
    // without pages was refused by "nvfp4kv_dequantize_pages"), as store_call does.
    nb::gil_scoped_release release;
    const auto prof = static_cast<nvfp4kv_scale_profile>(profile);
    void* const strm = reinterpret_cast<void*>(st_handle);
    st = pages.is_none()
             ? nvfp4kv_dequantize(c.get(), vc.get(), ks.get(), vs.get(), prof, ko.get_mut(), vo.get_mut(), strm)
             : nvfp4kv_dequantize_pages(c.get(), vc.get(), pg.get(), ks.get(), vs.get(), prof, ko.get_mut(),
                                        vo.get_mut(), strm);
  }
  raise_for(st);
}

void gather_dequant(nb::handle kv_cache, nb::handle value_cache, nb::handle block_table,
                    nb::handle seq_lens, nb::handle cu_seqlens, nb::handle k_scale,
                    nb::handle v_scale, nb::handle scale_layout, nb::handle key_out,
                    nb::handle value_out, nb::handle stream, int orient) {
  const int profile = choice(scale_layout, kScaleLayoutNames, 2, "_SCALE_LAYOUTS", "scale_layout");
  const nb::object ksc = scale_arg(k_scale, "k_scale"), vsc = scale_arg(v_scale, "v_scale");
  Arg c, vc, bt, sl, cu, ks, vs, ko, vo;
  import_array(c, kv_cache, value_cache.is_none() ? "kv_cache" : "key_cache", false);
  import_optional(vc, value_cache, "value_cache", false);
  import_array(bt, block_table, "block_table", false);
  import_array(sl, seq_lens, "seq_lens", false);
  import_array(cu, cu_seqlens, "cu_seqlens", false);
  import_scale(ks, ksc, "k_scale");
  import_scale(vs, vsc, "v_scale");
  import_array(ko, key_out, "key_out", true);
  import_array(vo, value_out, "value_out", true);
  orient_sides(c, kv_cache, vc, value_cache, orient, profile);
  const uintptr_t st_handle = stream_handle(stream, kv_cache, c);
  nvfp4kv_status st;
  {
    nb::gil_scoped_release release;
    st = nvfp4kv_gather_dequant(c.get(), vc.get(), bt.get(), sl.get(), cu.get(), ks.get(),
                                vs.get(), static_cast<nvfp4kv_scale_profile>(profile),
                                ko.get_mut(), vo.get_mut(), reinterpret_cast<void*>(st_handle));
  }
  raise_for(st);
}

// A scalar argument as the C ABI's float. A finite nonzero value that float cannot hold (it would
// become 0 or infinite: a soft cap of 1e-50 would turn into "no cap", -1e-50 into an accepted
// -0) is a ValueError naming it; NaN and infinities go on to the C ABI's checks.
float scalar_float(double x, const char* name) {
  bool lost;
  const float f = to_float32(x, &lost);
  if (lost) {
    char msg[160];
    snprintf(msg, sizeof msg, "%s: %.9g received; outside float32's range (the C ABI takes a float)", name, x);
    throw nb::value_error(msg);
  }
  return f;
}

void decode_attention(nb::handle query, nb::handle kv_cache, nb::handle value_cache, nb::handle block_table,
                      nb::handle seq_lens, nb::handle k_scale, nb::handle v_scale, nb::handle scale_layout,
                      int64_t q_len, double sm_scale, double logits_soft_cap, int64_t window_left, nb::handle out,
                      nb::handle lse, nb::handle workspace, nb::handle stream, int orient) {
  const int profile = choice(scale_layout, kScaleLayoutNames, 2, "_SCALE_LAYOUTS", "scale_layout");
  if (q_len < INT32_MIN || q_len > INT32_MAX)  // the C ABI's q_len is an int32_t
    throw nb::value_error(("q_len: " + std::to_string(q_len) + " received; expected 1 to 8 query rows per "
                           "sequence").c_str());
  const nb::object ksc = scale_arg(k_scale, "k_scale"), vsc = scale_arg(v_scale, "v_scale");
  Arg q, c, vc, bt, sl, ks, vs, o, l, ws;
  import_array(q, query, "query", false);
  import_array(c, kv_cache, value_cache.is_none() ? "kv_cache" : "key_cache", false);
  import_optional(vc, value_cache, "value_cache", false);
  orient_sides(c, kv_cache, vc, value_cache, orient, profile, HeadsTell::kGroup, q.t.ndim == 3 ? q.shape[1] : 0);
  import_array(bt, block_table, "block_table", false);
  import_array(sl, seq_lens, "seq_lens", false);
  import_scale(ks, ksc, "k_scale");
  import_scale(vs, vsc, "v_scale");
  import_array(o, out, "out", true);
  import_optional(l, lse, "lse", true);
  import_optional(ws, workspace, "workspace", true);
  const uintptr_t st_handle = stream_handle(stream, kv_cache, c);
  const float sm = scalar_float(sm_scale, "sm_scale"), cap = scalar_float(logits_soft_cap, "logits_soft_cap");
  nvfp4kv_status st;
  {
    nb::gil_scoped_release release;
    st = nvfp4kv_decode_attention(q.get(), c.get(), vc.get(), bt.get(), sl.get(), ks.get(), vs.get(),
                                  static_cast<nvfp4kv_scale_profile>(profile), static_cast<int32_t>(q_len), sm, cap,
                                  window_left, o.get_mut(), l.get_mut(), ws.get(), reinterpret_cast<void*>(st_handle));
  }
  raise_for(st);
}

// nvfp4kv_amax: x read, out (a 1-element float32 tensor) written; the stream as for the other
// calls, from x (torch's current stream of its device when stream is None).
void amax(nb::handle x, nb::handle out, int accumulate, nb::handle stream) {
  Arg a, o;
  import_array(a, x, "x", false);
  import_array(o, out, "out", true);
  const uintptr_t st_handle = stream_handle(stream, x, a);
  nvfp4kv_status st;
  {
    nb::gil_scoped_release release;
    st = nvfp4kv_amax(a.get(), o.get_mut(), accumulate, reinterpret_cast<void*>(st_handle));
  }
  raise_for(st);
}

nb::dict cuda_info() {
  nb::dict d;
  const char* reason = nullptr;
  int count;
  {
    nb::gil_scoped_release release;
    count = nvfp4kv_cuda_device_count(&reason);
  }
  d["cuda_option"] = NVFP4KV_CUDA_OPTION;  // the build's NVFP4KV_CUDA (CMakeLists.txt)
  d["cuda_built"] = nvfp4kv_cuda_built() != 0;
  const int v = nvfp4kv_cuda_build_version();
  d["cuda_version"] =
      v ? nb::object(nb::str((std::to_string(v / 1000) + "." + std::to_string(v % 1000 / 10)).c_str()))
        : nb::none();
  d["cuda_archs"] = nb::str(nvfp4kv_cuda_archs());
  d["cuda_device_count"] = count;
  d["cuda_available"] = count > 0;
  d["cuda_unavailable_reason"] = count > 0 ? nb::object(nb::none()) : nb::object(nb::str(reason));
  return d;
}

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "nvfp4kv compiled core (use the nvfp4kv package, not this module)";
  m.attr("__version__") = nvfp4kv_version_string();
  m.attr("ABI_VERSION") = nvfp4kv_version();
  m.attr("LIBRARY_FILE") = NVFP4KV_LIBRARY_FILE;  // the library's SONAME (CMakeLists.txt)
  m.attr("GROUP_SIZE") = nvfp4kv::kGroupSize;
  m.attr("MAX_HEAD_SIZE") = nvfp4kv::kMaxHeadSize;
  m.attr("E2M1_MAX") = nvfp4kv::kE2M1Max;
  m.attr("E4M3_MAX") = nvfp4kv::kE4M3Max;
  m.attr("SCALE_NAN") = nvfp4kv::kScaleNaN;
  m.attr("DECODE_MAX_GROUP") = nvfp4kv::kDecodeMaxGroup;
  m.attr("RECIPES") = nb::make_tuple(kRecipeNames[0], kRecipeNames[1]);
  m.attr("SCALE_LAYOUTS") = nb::make_tuple(kScaleLayoutNames[0], kScaleLayoutNames[1]);
  m.def("store", &store, nb::arg("key"), nb::arg("value"), nb::arg("kv_cache"),
        nb::arg("slot_mapping"), nb::arg("k_scale").none(), nb::arg("v_scale").none(),
        nb::arg("value_cache").none(), nb::arg("recipe").none(), nb::arg("scale_layout").none(),
        nb::arg("stream").none(), nb::arg("workspace").none() = nb::none(), nb::arg("orient") = -1);
  nb::class_<PreparedStore>(m, "PreparedStore",
                            "One layer's store, made by nvfp4kv.prepare_store: call it as "
                            "prepared(key, value, slot_mapping, stream=None).")
      .def(nb::init<nb::handle, nb::handle, nb::handle, nb::handle, nb::handle, nb::handle, nb::handle, int,
                    nb::handle, bool>(),
           nb::arg("kv_cache"), nb::arg("k_scale").none(), nb::arg("v_scale").none(),
           nb::arg("value_cache").none(), nb::arg("recipe").none(), nb::arg("scale_layout").none(),
           nb::arg("workspace").none(), nb::arg("orient") = -1, nb::arg("memory").none() = nb::none(),
           nb::arg("prepared") = true)
      .def("__call__", &PreparedStore::operator(), nb::arg("key"), nb::arg("value"),
           nb::arg("slot_mapping"), nb::arg("stream").none() = nb::none(),
           "Store key and value [tokens, H, D] at slot_mapping, as nvfp4kv.store with the prepared "
           "cache, scales and workspace.");
  m.def("store_workspace_bytes", [](int64_t num_blocks, int64_t block_size) {
    size_t bytes = 0;
    raise_for(nvfp4kv_store_workspace_size(num_blocks, block_size, &bytes));
    return bytes;
  }, nb::arg("num_blocks"), nb::arg("block_size"));
  m.def("dequantize", &dequantize, nb::arg("kv_cache"), nb::arg("value_cache").none(),
        nb::arg("pages").none(), nb::arg("k_scale").none(), nb::arg("v_scale").none(),
        nb::arg("scale_layout").none(), nb::arg("key_out"), nb::arg("value_out"),
        nb::arg("stream").none(), nb::arg("orient") = -1);
  m.def("gather_dequant", &gather_dequant, nb::arg("kv_cache"), nb::arg("value_cache").none(),
        nb::arg("block_table"), nb::arg("seq_lens"), nb::arg("cu_seqlens"),
        nb::arg("k_scale").none(), nb::arg("v_scale").none(), nb::arg("scale_layout").none(),
        nb::arg("key_out"), nb::arg("value_out"), nb::arg("stream").none(), nb::arg("orient") = -1);
  m.def("decode_attention", &decode_attention, nb::arg("query"), nb::arg("kv_cache"), nb::arg("value_cache").none(),
        nb::arg("block_table"), nb::arg("seq_lens"), nb::arg("k_scale").none(), nb::arg("v_scale").none(),
        nb::arg("scale_layout").none(), nb::arg("q_len"), nb::arg("sm_scale"), nb::arg("logits_soft_cap"),
        nb::arg("window_left"), nb::arg("out"), nb::arg("lse").none(), nb::arg("workspace").none(),
        nb::arg("stream").none(), nb::arg("orient") = -1);
  m.def("decode_workspace_bytes",
        [](int64_t num_seqs, int64_t q_len, int64_t num_qo_heads, int64_t num_kv_heads, int64_t head_size_v,
           int64_t max_blocks_per_seq) {
          if (q_len < INT32_MIN || q_len > INT32_MAX)
            throw nb::value_error(("q_len: " + std::to_string(q_len) + " received; expected 1 to 8").c_str());
          size_t bytes = 0;
          raise_for(nvfp4kv_decode_workspace_size(num_seqs, static_cast<int32_t>(q_len), num_qo_heads, num_kv_heads,
                                                  head_size_v, max_blocks_per_seq, &bytes));
          return bytes;
        },
        nb::arg("num_seqs"), nb::arg("q_len"), nb::arg("num_qo_heads"), nb::arg("num_kv_heads"),
        nb::arg("head_size_v"), nb::arg("max_blocks_per_seq"));
  m.def("amax", &amax, nb::arg("x"), nb::arg("out"), nb::arg("accumulate"), nb::arg("stream").none() = nb::none());
  m.def("cuda_info", &cuda_info);
  m.def("set_cpu_threads", [](int threads) { raise_for(nvfp4kv_set_cpu_threads(threads)); }, nb::arg("threads"));
  m.def("cpu_threads", [] { return nvfp4kv_cpu_threads(); });
  // Tests and benchmarks only: which store takes calls given a workspace ("auto", "page",
  // "token"; nvfp4kv_testing_set_store_order). Process-wide.
  m.def("_set_store_order", [](const std::string& which) {
    const std::pair<const char*, nvfp4kv_testing_store_order> names[] = {
        {"auto", NVFP4KV_TESTING_STORE_AUTO}, {"page", NVFP4KV_TESTING_STORE_PAGE}, {"token", NVFP4KV_TESTING_STORE_TOKEN}};
    for (const auto& [name, order] : names)
      if (which == name) return raise_for(nvfp4kv_testing_set_store_order(order));
    throw nb::value_error("expected 'auto', 'page' or 'token'");
  });
  // nvfp4kv.views' helpers refuse what the calls refuse: a 4-D view cut from part of a 5-D cache's pages.
  m.def("_refuse_part_of_pages", [](nb::handle obj, std::array<int64_t, 4> shape, int64_t stride0, bool side,
                                    const std::string& name) {
    refuse_part_of_pages(obj, shape.data(), stride0, side, name.c_str());
  }, nb::arg("obj"), nb::arg("shape"), nb::arg("stride0"), nb::arg("side"), nb::arg("name"));
  // Tests and benchmarks only: which kernel takes CUDA gathers ("auto", "pages", "rows";
  // nvfp4kv_testing_set_gather_kernel). Process-wide.
  m.def("_set_gather_kernel", [](const std::string& which) {
    const std::pair<const char*, nvfp4kv_testing_gather_kernel> names[] = {
        {"auto", NVFP4KV_TESTING_GATHER_AUTO}, {"pages", NVFP4KV_TESTING_GATHER_PAGES}, {"rows", NVFP4KV_TESTING_GATHER_ROWS}};
    for (const auto& [name, kernel] : names)
      if (which == name) return raise_for(nvfp4kv_testing_set_gather_kernel(kernel));
    throw nb::value_error("expected 'auto', 'pages' or 'rows'");
  });
  // Tests only: whether torch's C exchange table was found (torch imported and >= 2.10).
  m.def("_torch_exchange_found", [] {
    const TorchInfo* info = torch_info();
    return info != nullptr && info->exchange != nullptr;
  });
  // Tests only: "exchange" (default: the C exchange table where torch has one, else attributes),
  // "attributes" or "dlpack". Returns the previous setting.
  m.def("_set_torch_paths", [](const std::string& which) {
    const char* names[] = {"dlpack", "attributes", "exchange"};
    const std::string prev = names[g_torch_paths];
    for (int i = 0; i < 3; ++i)
      if (which == names[i]) {
        g_torch_paths = i;
        return prev;
      }
    throw nb::value_error("expected 'exchange', 'attributes' or 'dlpack'");
  });
  m.def("_torch_path_counts", [] {  // tests only: torch tensors imported by each path so far
    return nb::make_tuple(g_torch_path_counts[2], g_torch_path_counts[1], g_torch_path_counts[0]);
  });
}
