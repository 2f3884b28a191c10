// The C ABI's operations: validation of every argument (before any byte is written), translation
// of DLPack views into the parameter structs, and dispatch to a backend (backend.h). Errors are
// thrown as `Failure` (tensor.h) and turned into a status plus a thread-local message at the
// boundary (guarded); nothing escapes an extern "C" function.
#include <stdio.h>

#include <exception>
#include <initializer_list>
#include <string>
#include <utility>

#include "backend.h"
#include "cache.h"
#include "float_mode.h"
#include "nvfp4kv/nvfp4kv.h"
#include "tensor.h"
#include "testing.h"

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

// The message of the calling thread's last failed call. A fixed buffer, written with snprintf:
// reporting an error allocates nothing, so running out of memory is an error like the others
// (a std::string here threw std::bad_alloc out of the catch handlers, past the extern "C" boundary).
// fail() formats into 1024 bytes, and the entry point's name comes first.
thread_local char g_last_error[1024 + 128];

void set_last_error(const char* fn, const char* what, const char* detail) {
  snprintf(g_last_error, sizeof g_last_error, "%s: %s%s", fn, what, detail);
}

// Runs `body` and converts whatever it throws into a status; the only exit from the ABI.
template <class Body>
nvfp4kv_status guarded(const char* fn, Body&& body) noexcept {
  const FloatModeGuard ieee;  // the caller's FTZ/DAZ or rounding mode changes no check and no byte
  try {
    body();
    g_last_error[0] = '\0';
    return NVFP4KV_SUCCESS;
  } catch (const Failure& f) {
    set_last_error(fn, f.message.c_str(), "");
    return f.status;
  } catch (const std::bad_alloc&) {  // a caller can retry smaller: not a bug (review)
    set_last_error(fn, "out of host memory", "");
    return NVFP4KV_ERROR_OUT_OF_MEMORY;
  } catch (const std::exception& e) {
    set_last_error(fn, "internal error: ", e.what());
  } catch (...) {
    set_last_error(fn, "internal error", "");
  }
  return NVFP4KV_ERROR_INTERNAL;
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

// Host memory, pageable or pinned (kDLCUDAHost), runs the CPU path: it is what the other
// arguments' checks (host_readable) already accept next to a CPU cache.
Where where(DLDevice d, const char* name) {
  if (host_readable(d)) return Where::kCpu;
  if (d.device_type == kDLCUDA) {
#if defined(NVFP4KV_WITH_CUDA)
    return Where::kCuda;
#else
    fail(NVFP4KV_ERROR_NOT_SUPPORTED,
         "%s: on %s, but this build of nvfp4kv has no CUDA kernels (nvfp4kv_cuda_built() is 0)",
         name, device_name(d).c_str());
#endif
  }
  fail(NVFP4KV_ERROR_NOT_SUPPORTED, "%s: on %s; supported devices are cpu (pageable or pinned) and cuda", name,
       device_name(d).c_str());
}

#if defined(NVFP4KV_WITH_CUDA)
// A CUDA launcher's failure: NOT_SUPPORTED for a GPU without code in this build (`msg`), else
// CUDA, said as nvfp4kv_cuda_device_count says it where no device is usable (the runtime's own
// words for a missing driver are "CUDA driver version is insufficient").
[[noreturn]] void cuda_failure(int err, const char* msg) {
  if (msg) fail(NVFP4KV_ERROR_NOT_SUPPORTED, "%s", msg);
  const char* why = nullptr;
  if (cuda_device_count(&why) <= 0 && why)
    fail(NVFP4KV_ERROR_CUDA, "%s (CUDA runtime: %s)", why, cuda_error_string(err));
  fail(NVFP4KV_ERROR_CUDA, "%s", cuda_error_string(err));
}
#endif

// Runs an operation's parameters on the path for the cache's device: the CPU loops, or the CUDA
// launcher (cuda_failure).
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
  if (err) cuda_failure(err, msg);
#else
  (void)cuda;
  (void)stream;
#endif
}

// A store workspace covers at most 2^40 slots (its words are counted in int64 with room to spare).
bool store_workspace_covers(int64_t num_blocks, int64_t block_size) {
  return num_blocks >= 0 && block_size > 0 && num_blocks <= (int64_t{1} << 40) / block_size;
}

int64_t store_workspace_bytes(int64_t num_blocks, int64_t block_size) {
  if (!store_workspace_covers(num_blocks, block_size))
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
  if (!store_workspace_covers(c.N, c.T))
    fail(NVFP4KV_ERROR_INVALID_VALUE,
         "workspace: a cache of %lld blocks of %lld tokens received; a store workspace covers at most "
         "2^40 slots (store without one)",
         static_cast<long long>(c.N), static_cast<long long>(c.T));
  const int64_t need = store_workspace_bytes(c.N, c.T);
  if (w.size(0) < need)
    fail(NVFP4KV_ERROR_INVALID_VALUE,
         "workspace: %lld bytes, but a cache of %lld blocks of %lld tokens needs %lld "
         "(nvfp4kv_store_workspace_size, nvfp4kv.store_workspace_bytes)",
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
  expect_cache_given(kv_cache, value_cache);
  Cache c = resolve_cache(kv_cache, value_cache, key.ndim() == 3 ? key.size(1) : -1, "key");
  const Tensor cache_ref(kv_cache, c.k_name);

  expect_same_device(key, cache_ref);
  expect_same_device(value, cache_ref);

  const DType dtype = float_dtype(key);
  if (float_dtype(value) != dtype)
    fail(NVFP4KV_ERROR_INVALID_DTYPE, "value: dtype %s but key is %s; they must match",
         dtype_name(value.t->dtype).c_str(), dtype_name(key.t->dtype).c_str());
  check_input(key, c, c.k.D, c.k_name);
  check_input(value, c, c.v.D, c.v_name);

  const IndexVec slot_vec = index_vec(slots, cache_ref, -1);
  // key/value may have more rows than slot_mapping (an engine pads them for CUDA graphs, as vLLM
  // does): the first slot_mapping.size(0) rows are stored, as vLLM's and FlashInfer's kernels do.
  for (const Tensor* x : {&key, &value})
    if (x->size(0) < slots.size(0))
      fail(NVFP4KV_ERROR_INVALID_VALUE,
           "slot_mapping: %lld entries but %s has %lld tokens (shape %s); key and value need a row "
           "for each slot (extra rows are padding and are not stored)",
           static_cast<long long>(slots.size(0)), x->name, static_cast<long long>(x->size(0)),
           x->shape_str().c_str());

  if (recipe != NVFP4KV_RECIPE_NVFP4 && recipe != NVFP4KV_RECIPE_NVFP4_4OVER6)
    fail(NVFP4KV_ERROR_INVALID_VALUE,
         "recipe: %d received; expected NVFP4KV_RECIPE_NVFP4 (0, 'nvfp4') or "
         "NVFP4KV_RECIPE_NVFP4_4OVER6 (1, 'nvfp4_4over6')",
         static_cast<int>(recipe));
  apply_profile(c, profile);
  // An absent value cache or scale is stood in for by the cache, which the checks cover anyway.
  const Tensor vcache = value_cache ? Tensor(value_cache, c.v_name) : cache_ref;
  const Tensor ks(k_scale ? k_scale : kv_cache, "k_scale"), vs(v_scale ? v_scale : kv_cache, "v_scale");
  check_apart({&cache_ref, value_cache ? &vcache : nullptr}, {&key, &value, &slots, k_scale ? &ks : nullptr, v_scale ? &vs : nullptr},
              /*outputs_checked=*/true);  // the sides: resolve_cache

  StoreParams p{};
  p.k = StoreSide{key.ptr(), key.stride(0), key.stride(1), c.k, resolve_scale(k_scale, "k_scale", c.device)};
  p.v = StoreSide{value.ptr(), value.stride(0), value.stride(1), c.v,
                  resolve_scale(v_scale, "v_scale", c.device)};
  p.slots = slot_vec;
  p.num_tokens = slots.size(0);
  p.num_slots = c.N * c.T;
  p.H = static_cast<int32_t>(c.H);
  p.T = static_cast<int32_t>(c.T);
  p.dtype = dtype;
  p.layout = c.layout;
  p.recipe = recipe == NVFP4KV_RECIPE_NVFP4 ? Recipe::kNvfp4 : Recipe::kNvfp4_4over6;
  if (workspace) {
    const Tensor w(workspace, "workspace");
    p.workspace = store_workspace(w, cache_ref, c);
    // The kernels write the workspace while they read the inputs and the scales and write the cache.
    for (const Tensor* x : std::initializer_list<const Tensor*>{&key, &value, &slots, &cache_ref, &vcache, &ks, &vs})
      if (overlap(w, *x))
        fail(NVFP4KV_ERROR_INVALID_VALUE, "workspace: overlaps %s; it must be memory of its own", x->name);
  }

  run(c, p, cpu_store, CUDA_OR_NULL(cuda_store), stream);
}

// The two outputs of a read: shape `leading` + (head size of the side), one float dtype for
// both, the cache's device, last stride 1.
DType check_outputs(const Tensor& ko, const Tensor& vo, const Tensor& cache_ref,
                    std::initializer_list<int64_t> leading, int64_t Dk, int64_t Dv, const char* what) {
  const int rank = static_cast<int>(leading.size()) + 1;
  for (const Tensor* o : {&ko, &vo}) {
    o->expect_ndim(rank, what);
    const int64_t D = o == &ko ? Dk : Dv;
    bool ok = o->size(rank - 1) == D;
    int i = 0;
    for (const int64_t n : leading) ok = ok && o->size(i++) == n;
    if (!ok) {
      std::string want = "(";
      for (const int64_t n : leading) want += std::to_string(n) + ", ";
      want += std::to_string(D) + ")";
      fail(NVFP4KV_ERROR_INVALID_VALUE, "%s: shape %s received; expected %s", o->name,
           o->shape_str().c_str(), want.c_str());
    }
    expect_same_device(*o, cache_ref);
  }
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
  expect_cache_given(kv_cache, value_cache);
  const Tensor ko(key_out_t, "key_out"), vo(value_out_t, "value_out");
  Cache c = resolve_cache(kv_cache, value_cache, ko.ndim() == 4 ? ko.size(2) : -1, "key_out");
  apply_profile(c, profile);
  const Tensor cache_ref(kv_cache, c.k_name);
  const DType dtype = check_outputs(ko, vo, cache_ref, {c.N, c.T, c.H}, c.k.D, c.v.D,
                                    "(num_blocks, block_size, num_kv_heads, head_size)");

  {
    const Tensor vcache = value_cache ? Tensor(value_cache, c.v_name) : cache_ref;
    const Tensor ks(k_scale ? k_scale : kv_cache, "k_scale"), vs(v_scale ? v_scale : kv_cache, "v_scale");
    const Tensor pg = pages ? Tensor(pages, "pages") : cache_ref;
    check_apart({&ko, &vo}, {&cache_ref, value_cache ? &vcache : nullptr, pages ? &pg : nullptr, k_scale ? &ks : nullptr, v_scale ? &vs : nullptr});
  }

  DequantParams p{};
  p.pages = IndexVec{nullptr, 0, 0};
  p.num_pages = c.N;
  if (pages) {
    const Tensor pg(pages, "pages");
    p.pages = index_vec(pg, cache_ref, -1);
    p.num_pages = pg.size(0);
    // The kernels number (list entry, position) pairs in int64: a broadcast list of 2^62
    // entries wrapped them, and the GPU wrote nothing or part of a page (review).
    if (p.num_pages > INT64_MAX / c.T)
      fail(NVFP4KV_ERROR_INVALID_VALUE,
           "pages: %lld entries of block size %lld: more than 2^63 - 1 positions to dequantize",
           static_cast<long long>(p.num_pages), static_cast<long long>(c.T));
  }
  p.k = DequantSide{c.k, resolve_scale(k_scale, "k_scale", c.device), ko.ptr(),
                    {ko.stride(0), ko.stride(1), ko.stride(2)}};
  p.v = DequantSide{c.v, resolve_scale(v_scale, "v_scale", c.device), vo.ptr(),
                    {vo.stride(0), vo.stride(1), vo.stride(2)}};
  p.N = c.N;
  p.H = static_cast<int32_t>(c.H);
  p.T = static_cast<int32_t>(c.T);
  p.dtype = dtype;
  p.layout = c.layout;

  run(c, p, cpu_dequantize, CUDA_OR_NULL(cuda_dequantize), stream);
}

// The block table's strides for block_table_row (gather, decode): 0 for a table without elements
// (B or max_blocks 0), which is never read, and whose strides, which nothing checks, could
// overflow block_table_row's products (review, UBSan).
void table_strides(const Tensor& bt, int64_t* stride) {
  stride[0] = bt.size(1) == 0 ? 0 : bt.stride(0);
  stride[1] = bt.size(1) == 0 ? 0 : bt.stride(1);
}

void gather(const DLTensor* kv_cache, const DLTensor* value_cache, const DLTensor* block_table_t,
            const DLTensor* seq_lens, const DLTensor* cu_seqlens, const DLTensor* k_scale,
            const DLTensor* v_scale, nvfp4kv_scale_profile profile, DLTensor* key_out_t,
            DLTensor* value_out_t, void* stream) {
  expect_cache_given(kv_cache, value_cache);
  const Tensor ko(key_out_t, "key_out"), vo(value_out_t, "value_out");
  Cache c = resolve_cache(kv_cache, value_cache, ko.ndim() == 3 ? ko.size(1) : -1, "key_out");
  apply_profile(c, profile);
  const Tensor cache_ref(kv_cache, c.k_name);
  const Tensor bt(block_table_t, "block_table");
  bt.expect_ndim(2, "(num_seqs, max_blocks_per_seq)");
  expect_same_device(bt, cache_ref);
  const bool bt64 = index_is_int64(bt);
  const int64_t B = bt.size(0);
  const int64_t total = ko.ndim() == 3 ? ko.size(0) : 0;
  const DType dtype = check_outputs(ko, vo, cache_ref, {total, c.H}, c.k.D, c.v.D,
                                    "(total_tokens, num_kv_heads, head_size)");

  {
    const Tensor vcache = value_cache ? Tensor(value_cache, c.v_name) : cache_ref;
    const Tensor ks(k_scale ? k_scale : kv_cache, "k_scale"), vs(v_scale ? v_scale : kv_cache, "v_scale");
    const Tensor sl(seq_lens, "seq_lens"), cu(cu_seqlens, "cu_seqlens");
    check_apart({&ko, &vo}, {&cache_ref, value_cache ? &vcache : nullptr, &bt, &sl, &cu, k_scale ? &ks : nullptr, v_scale ? &vs : nullptr});
  }

  GatherParams p{};
  p.k = DequantSide{c.k, resolve_scale(k_scale, "k_scale", c.device), ko.ptr(),
                    {ko.stride(0), ko.stride(1), 0}};
  p.v = DequantSide{c.v, resolve_scale(v_scale, "v_scale", c.device), vo.ptr(),
                    {vo.stride(0), vo.stride(1), 0}};
  p.block_table = bt.ptr();
  table_strides(bt, p.bt_stride);
  p.bt_int64 = bt64;
  p.seq_lens = index_vec(Tensor(seq_lens, "seq_lens"), cache_ref, B);
  p.cu_seqlens = index_vec(Tensor(cu_seqlens, "cu_seqlens"), cache_ref, B + 1);
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

// ---- amax (nvfp4kv_amax) ------------------------------------------------------------------------

// x's elements as AmaxParams describes them: size-1 and broadcast dimensions dropped, negative
// strides flipped (the base moved to the lowest element), dimensions sorted by stride and merged
// where contiguous. The maximum visits the same elements, once each, in another order.
void collapse_amax(const Tensor& x, AmaxParams& p) {
  p.ndim = 0;
  p.numel = 0;
  p.x = x.ptr();
  if (x.numel() == 0) return;
  const int64_t esize = dtype_bytes(p.dtype);
  int64_t shape[8], stride[8];
  int n = 0;
  const uint8_t* base = x.ptr();
  for (int d = 0; d < x.ndim(); ++d) {
    int64_t e = x.size(d), s = x.stride(d);
    if (e == 1 || s == 0) continue;
    if (s < 0) {
      base += (e - 1) * s * esize;
      s = -s;
    }
    shape[n] = e;
    stride[n] = s;
    ++n;
  }
  for (int i = 1; i < n; ++i)  // insertion sort, largest stride first
    for (int j = i; j > 0 && stride[j] > stride[j - 1]; --j) {
      std::swap(stride[j], stride[j - 1]);
      std::swap(shape[j], shape[j - 1]);
    }
  p.x = base;
  p.ndim = 0;
  p.numel = 1;
  for (int i = 0; i < n; ++i) {
    if (p.ndim > 0 && p.stride[p.ndim - 1] == stride[i] * shape[i]) {
      p.shape[p.ndim - 1] *= shape[i];
      p.stride[p.ndim - 1] = stride[i];
    } else {
      p.shape[p.ndim] = shape[i];
      p.stride[p.ndim] = stride[i];
      ++p.ndim;
    }
    p.numel *= shape[i];
  }
  if (p.ndim == 0) {  // one element
    p.ndim = 1;
    p.shape[0] = 1;
    p.stride[0] = 1;
  }
}

void amax(const DLTensor* x_t, DLTensor* out_t, int accumulate, void* stream) {
  const Tensor x(x_t, "x"), out(out_t, "out");
  AmaxParams p{};
  p.dtype = float_dtype(x);
  if (!is_dtype(out.t->dtype, kDLFloat, 32))
    fail(NVFP4KV_ERROR_INVALID_DTYPE, "out: dtype %s received; expected a 1-element float32 tensor",
         dtype_name(out.t->dtype).c_str());
  if (out.numel() != 1)
    fail(NVFP4KV_ERROR_INVALID_VALUE, "out: shape %s received; expected exactly one element",
         out.shape_str().c_str());
  expect_same_device(out, x);
  if (accumulate != 0 && accumulate != 1)
    fail(NVFP4KV_ERROR_INVALID_VALUE, "accumulate: %d received; expected 0 (overwrite) or 1 (max with the existing value)",
         accumulate);
  check_apart({&out}, {&x});
  collapse_amax(x, p);
  p.amax = reinterpret_cast<int32_t*>(out.ptr());
  p.accumulate = accumulate;
  if (where(x.device(), "x") == Where::kCpu) {
    cpu_amax(p);
    return;
  }
#if defined(NVFP4KV_WITH_CUDA)
  const char* msg = nullptr;
  const int err = cuda_amax(p, x.device().device_id, stream, &msg);
  if (err) cuda_failure(err, msg);
#else
  (void)stream;
#endif
}

// ---- Decode attention (nvfp4kv_decode_attention) ------------------------------------------------

void check_decode_head_size(int64_t D, const char* name) {
  if (D != 64 && D != 128 && D != 256)
    fail(NVFP4KV_ERROR_INVALID_VALUE,
         "%s: head size %lld received; decode_attention supports head sizes 64, 128 and 256", name,
         static_cast<long long>(D));
}

void check_q_len(int64_t q_len) {
  if (q_len < 1 || q_len > 8)
    fail(NVFP4KV_ERROR_INVALID_VALUE, "q_len: %lld received; expected 1 to 8 query rows per sequence",
         static_cast<long long>(q_len));
}

// The workspace of a geometry in bytes (0: the CUDA path runs without one), checked.
int64_t decode_workspace_bytes(int64_t B, int64_t q_len, int64_t Hq, int64_t H, int64_t Dv, int64_t max_blocks) {
  if (B < 0) fail(NVFP4KV_ERROR_INVALID_VALUE, "num_seqs: %lld received; expected >= 0", static_cast<long long>(B));
  check_q_len(q_len);
  if (H <= 0) fail(NVFP4KV_ERROR_INVALID_VALUE, "num_kv_heads: %lld received; expected > 0", static_cast<long long>(H));
  if (!decode_heads_ok(Hq, H))
    fail(NVFP4KV_ERROR_INVALID_VALUE,
         "num_qo_heads: %lld received with %lld KV heads; expected a multiple of the KV heads, at most %d "
         "query heads per KV head",
         static_cast<long long>(Hq), static_cast<long long>(H), kDecodeMaxGroup);
  check_decode_head_size(Dv, "head_size_v");
  if (max_blocks < 0)
    fail(NVFP4KV_ERROR_INVALID_VALUE, "max_blocks_per_seq: %lld received; expected >= 0",
         static_cast<long long>(max_blocks));
  const int64_t splits = decode_splits(B, H, max_blocks);
  if (splits <= 1 || B == 0) return 0;  // an empty batch needs none, whatever its heads
  int64_t bytes = 4 * q_len * decode_partial_floats(Dv) * splits;  // at most 4 * 8 * 258 * 64
  if (__builtin_mul_overflow(bytes, Hq, &bytes) || __builtin_mul_overflow(bytes, B, &bytes) ||
      bytes > (int64_t{1} << 62))
    fail(NVFP4KV_ERROR_INVALID_VALUE, "num_seqs: %lld sequences need a workspace past 2^62 bytes",
         static_cast<long long>(B));
  return bytes;
}

// The decode workspace, checked: float32 or uint8, contiguous, on the cache's device; where the
// geometry may split (`need` > 0: the GPU's split plan, which the CPU call applies too), also
// 16-byte aligned and at least `need` bytes. A workspace given to a call that needs none is still
// checked for dtype, contiguity and device (and, by the caller, overlap), so that an engine's CPU
// runs refuse what its GPU runs would (c-api.md).
float* decode_workspace(const Tensor& w, const Tensor& cache_ref, int64_t need) {
  expect_same_device(w, cache_ref);
  const bool f32 = is_dtype(w.t->dtype, kDLFloat, 32);
  if (!f32 && !is_dtype(w.t->dtype, kDLUInt, 8))
    fail(NVFP4KV_ERROR_INVALID_DTYPE, "workspace: dtype %s received; expected float32 or uint8",
         dtype_name(w.t->dtype).c_str());
  int64_t expected = 1;
  for (int i = w.ndim() - 1; i >= 0 && w.numel() > 0; --i) {  // an empty array is contiguous
    if (w.size(i) > 1 && w.stride(i) != expected)
      fail(NVFP4KV_ERROR_INVALID_VALUE, "workspace: shape %s with strides %s is not contiguous",
           w.shape_str().c_str(), w.strides_str().c_str());
    expected *= w.size(i);
  }
  if (need == 0) return nullptr;
  const int64_t bytes = w.numel() * (f32 ? 4 : 1);
  if (bytes < need)
    fail(NVFP4KV_ERROR_INVALID_VALUE,
         "workspace: %lld bytes, but this call needs %lld (nvfp4kv_decode_workspace_size, "
         "nvfp4kv.decode_workspace)",
         static_cast<long long>(bytes), static_cast<long long>(need));
  if (reinterpret_cast<uintptr_t>(w.ptr()) % 16 != 0)
    fail(NVFP4KV_ERROR_INVALID_VALUE, "workspace: address not a multiple of 16 bytes");
  return reinterpret_cast<float*>(w.ptr());
}

void decode(const DLTensor* query_t, const DLTensor* kv_cache, const DLTensor* value_cache,
            const DLTensor* block_table_t, const DLTensor* seq_lens_t, const DLTensor* k_scale,
            const DLTensor* v_scale, nvfp4kv_scale_profile profile, int32_t q_len, float sm_scale,
            float soft_cap, int64_t window_left, DLTensor* out_t, DLTensor* lse_t,
            const DLTensor* workspace, void* stream) {
  expect_cache_given(kv_cache, value_cache);
  const Tensor query(query_t, "query"), out(out_t, "out"), bt(block_table_t, "block_table");
  // The query has Hq = group * H heads: no heads hint for the cache's orientation check.
  Cache c = resolve_cache(kv_cache, value_cache, -1, "query");
  const Tensor cache_ref(kv_cache, c.k_name);

  query.expect_ndim(3, "(num_seqs * q_len, num_qo_heads, head_size)");
  expect_same_device(query, cache_ref);
  const DLDataType qt = query.t->dtype;
  if (!is_dtype(qt, kDLBfloat, 16) && !is_dtype(qt, kDLFloat, 16))
    fail(NVFP4KV_ERROR_INVALID_DTYPE, "query: dtype %s received; expected bfloat16 or float16", dtype_name(qt).c_str());
  const DType dtype = float_dtype(query);
  check_decode_head_size(query.size(2), "query");
  if (query.size(2) != c.k.D)
    fail(NVFP4KV_ERROR_INVALID_VALUE, "query: head size %lld (shape %s) but %s has head size %d",
         static_cast<long long>(query.size(2)), query.shape_str().c_str(), c.k_name, c.k.D);
  check_decode_head_size(c.v.D, c.v_name);
  // After the head sizes: the 'vllm' profile refuses some of them too, but an unsupported head
  // size is the error to name (review).
  apply_profile(c, profile);
  if (query.numel() > 0 && query.stride(2) != 1)
    fail(NVFP4KV_ERROR_INVALID_VALUE, "query: stride along head_size is %lld; expected 1",
         static_cast<long long>(query.stride(2)));
  const int64_t Hq = query.size(1);
  if (!decode_heads_ok(Hq, c.H))
    fail(NVFP4KV_ERROR_INVALID_VALUE,
         "query: %lld query heads (shape %s) with the %lld KV heads of %s; expected a multiple of the KV "
         "heads, at most %d query heads per KV head",
         static_cast<long long>(Hq), query.shape_str().c_str(), static_cast<long long>(c.H), c.k_name,
         kDecodeMaxGroup);
  check_q_len(q_len);

  bt.expect_ndim(2, "(num_seqs, max_blocks_per_seq)");
  expect_same_device(bt, cache_ref);
  const bool bt64 = index_is_int64(bt);
  const int64_t B = bt.size(0);
  int64_t rows;
  if (__builtin_mul_overflow(B, int64_t{q_len}, &rows))
    fail(NVFP4KV_ERROR_INVALID_VALUE, "block_table: %lld sequences of q_len %d are more query rows than int64 holds",
         static_cast<long long>(B), static_cast<int>(q_len));
  if (query.size(0) != rows)
    fail(NVFP4KV_ERROR_INVALID_VALUE,
         "query: %lld rows (shape %s) but block_table has %lld sequences of q_len %d; expected %lld rows",
         static_cast<long long>(query.size(0)), query.shape_str().c_str(), static_cast<long long>(B),
         static_cast<int>(q_len), static_cast<long long>(rows));
  const Tensor sl(seq_lens_t, "seq_lens");
  const IndexVec seq_lens = index_vec(sl, cache_ref, B);

  out.expect_ndim(3, "(num_seqs * q_len, num_qo_heads, head_size_v)");
  if (out.size(0) != rows || out.size(1) != Hq || out.size(2) != c.v.D)
    fail(NVFP4KV_ERROR_INVALID_VALUE, "out: shape %s received; expected (%lld, %lld, %d)",
         out.shape_str().c_str(), static_cast<long long>(rows), static_cast<long long>(Hq), c.v.D);
  expect_same_device(out, cache_ref);
  if (!is_dtype(out.t->dtype, qt.code, qt.bits))
    fail(NVFP4KV_ERROR_INVALID_DTYPE, "out: dtype %s but query is %s; they must match",
         dtype_name(out.t->dtype).c_str(), dtype_name(query.t->dtype).c_str());
  if (out.numel() > 0 && out.stride(2) != 1)
    fail(NVFP4KV_ERROR_INVALID_VALUE, "out: last stride %lld; expected 1", static_cast<long long>(out.stride(2)));
  const Tensor lse = lse_t ? Tensor(lse_t, "lse") : out;
  if (lse_t) {
    lse.expect_ndim(2, "(num_seqs * q_len, num_qo_heads)");
    if (lse.size(0) != rows || lse.size(1) != Hq)
      fail(NVFP4KV_ERROR_INVALID_VALUE, "lse: shape %s received; expected (%lld, %lld)", lse.shape_str().c_str(),
           static_cast<long long>(rows), static_cast<long long>(Hq));
    expect_same_device(lse, cache_ref);
    if (!is_dtype(lse.t->dtype, kDLFloat, 32))
      fail(NVFP4KV_ERROR_INVALID_DTYPE, "lse: dtype %s received; expected float32", dtype_name(lse.t->dtype).c_str());
  }

  if (!is_finite(sm_scale) || !(sm_scale > 0.0f))
    fail(NVFP4KV_ERROR_INVALID_VALUE, "sm_scale: %.9g received; expected a finite value > 0 (usually 1/sqrt(D))",
         static_cast<double>(sm_scale));
  if (!is_finite(soft_cap) || !(soft_cap >= 0.0f))
    fail(NVFP4KV_ERROR_INVALID_VALUE, "logits_soft_cap: %.9g received; expected a finite value >= 0 (0: none)",
         static_cast<double>(soft_cap));
  if (window_left < -1)
    fail(NVFP4KV_ERROR_INVALID_VALUE, "window_left: %lld received; expected -1 (no window) or >= 0",
         static_cast<long long>(window_left));
  const ScaleArg ks = resolve_scale(k_scale, "k_scale", c.device);
  const ScaleArg vs = resolve_scale(v_scale, "v_scale", c.device);

  // What only the CPU path reads, refused on CUDA before the workspace is asked for: NOT_SUPPORTED
  // whatever else the call lacks, an empty batch included (review).
  const bool on_cuda = where(c.device, c.k_name) == Where::kCuda;
  if (on_cuda && c.k.D != c.v.D)
    fail(NVFP4KV_ERROR_NOT_SUPPORTED,
         "decode_attention on the GPU needs equal K and V head sizes (%d and %d received; the CPU path takes them)",
         c.k.D, c.v.D);
  const auto off4 = [](const CacheSide& s) {
    return reinterpret_cast<uintptr_t>(s.base) % 4 != 0 || s.page_stride % 4 != 0;
  };
  if (on_cuda && (off4(c.k) || off4(c.v)))
    fail(NVFP4KV_ERROR_NOT_SUPPORTED,
         "decode_attention on the GPU needs cache sides whose start and page stride are multiples of 4 bytes "
         "(the CPU path takes any)");

  // The workspace: read by the CUDA path only, and only where it splits the sequences. One given
  // to a CPU call is held to the GPU's rules all the same (size and alignment too), so that an
  // engine's CPU runs refuse what its GPU runs would (review: a CPU-only test could not catch an
  // undersized workspace); a CPU call without one needs none.
  const int64_t max_blocks = bt.size(1);
  const int64_t splits = decode_splits(B, c.H, max_blocks);
  // An empty batch splits nothing and needs none, as nvfp4kv_decode_workspace_size says (0 bytes).
  const int64_t need = (on_cuda || workspace) && splits > 1
                           ? decode_workspace_bytes(B, q_len, Hq, c.H, c.v.D, max_blocks)
                           : 0;
  const bool use_workspace = on_cuda && need > 0;
  float* ws_ptr = nullptr;
  int64_t ws_floats = 0;
  const Tensor ws = workspace ? Tensor(workspace, "workspace") : cache_ref;
  if (workspace) {
    float* const checked = decode_workspace(ws, cache_ref, need);  // on every call, used or not
    if (use_workspace) ws_ptr = checked;
  }
  if (use_workspace) {
    if (!workspace)
      fail(NVFP4KV_ERROR_INVALID_VALUE,
           "workspace: NULL, but %lld sequences of %lld KV heads and %lld blocks may split on the GPU and need "
           "%lld bytes of workspace (nvfp4kv_decode_workspace_size, nvfp4kv.decode_workspace)",
           static_cast<long long>(B), static_cast<long long>(c.H), static_cast<long long>(max_blocks),
           static_cast<long long>(need));
    ws_floats = need / 4;
  }

  {
    const Tensor vcache = value_cache ? Tensor(value_cache, c.v_name) : cache_ref;
    const Tensor kst(k_scale, "k_scale"), vst(v_scale, "v_scale");
    // A workspace given is memory of its own on every call, used or not: a CPU run refuses what
    // the same engine's GPU run would (C ABI review).
    check_apart({&out, lse_t ? &lse : nullptr, workspace ? &ws : nullptr},
                {&query, &cache_ref, value_cache ? &vcache : nullptr, &bt, &sl, &kst, &vst});
  }

  DecodeParams p{};
  p.k = c.k;
  p.v = c.v;
  p.k_scale = ks;
  p.v_scale = vs;
  p.query = query.ptr();
  p.q_stride[0] = query.stride(0);
  p.q_stride[1] = query.stride(1);
  p.out = out.ptr();
  p.out_stride[0] = out.stride(0);
  p.out_stride[1] = out.stride(1);
  p.lse = lse_t ? reinterpret_cast<float*>(lse.ptr()) : nullptr;
  p.lse_stride[0] = lse_t ? lse.stride(0) : 0;
  p.lse_stride[1] = lse_t ? lse.stride(1) : 0;
  p.block_table = bt.ptr();
  table_strides(bt, p.bt_stride);
  p.bt_int64 = bt64;
  p.seq_lens = seq_lens;
  p.B = B;
  p.max_blocks = max_blocks;
  p.N = c.N;
  p.H = static_cast<int32_t>(c.H);
  p.T = static_cast<int32_t>(c.T);
  p.group = static_cast<int32_t>(Hq / c.H);
  p.q_len = q_len;
  p.sm_scale = sm_scale;
  p.soft_cap = soft_cap;
  p.window_left = window_left;
  p.dtype = dtype;
  p.layout = c.layout;
  p.workspace = ws_ptr;
  p.workspace_floats = ws_floats;

  run(c, p, cpu_decode, CUDA_OR_NULL(cuda_decode), stream);
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
    case NVFP4KV_ERROR_OUT_OF_MEMORY: return "out of memory";
  }
  return "unknown status";
}

NVFP4KV_API const char* nvfp4kv_last_error(void) { return nvfp4kv::g_last_error; }

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

NVFP4KV_API nvfp4kv_status nvfp4kv_testing_set_store_order(nvfp4kv_testing_store_order order) {
  return guarded("nvfp4kv_testing_set_store_order", [&] {
    switch (order) {
      case NVFP4KV_TESTING_STORE_AUTO:
      case NVFP4KV_TESTING_STORE_PAGE:
      case NVFP4KV_TESTING_STORE_TOKEN: break;
      default:
        nvfp4kv::fail(NVFP4KV_ERROR_INVALID_VALUE, "order: %d received; expected AUTO (0), PAGE (1) or TOKEN (2)",
                      static_cast<int>(order));
    }
#if defined(NVFP4KV_WITH_CUDA)
    nvfp4kv::cuda_set_store_order(order);
#endif
  });
}

NVFP4KV_API nvfp4kv_status nvfp4kv_testing_set_gather_kernel(nvfp4kv_testing_gather_kernel kernel) {
  return guarded("nvfp4kv_testing_set_gather_kernel", [&] {
    switch (kernel) {
      case NVFP4KV_TESTING_GATHER_AUTO:
      case NVFP4KV_TESTING_GATHER_PAGES:
      case NVFP4KV_TESTING_GATHER_ROWS: break;
      default:
        nvfp4kv::fail(NVFP4KV_ERROR_INVALID_VALUE, "kernel: %d received; expected AUTO (0), PAGES (1) or ROWS (2)",
                      static_cast<int>(kernel));
    }
#if defined(NVFP4KV_WITH_CUDA)
    nvfp4kv::cuda_set_gather_kernel(kernel);
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

NVFP4KV_API nvfp4kv_status nvfp4kv_page_bytes(int64_t block_size, int64_t num_kv_heads,
                                              int64_t head_size, int64_t head_size_v,
                                              size_t* page_bytes, size_t* row_bytes) {
  return guarded("nvfp4kv_page_bytes", [&] {
    using nvfp4kv::fail;
    if (!page_bytes) fail(NVFP4KV_ERROR_INVALID_VALUE, "page_bytes: NULL pointer");
    if (block_size < 1) fail(NVFP4KV_ERROR_INVALID_VALUE, "block_size %lld received; must be positive",
                             static_cast<long long>(block_size));
    if (num_kv_heads < 1) fail(NVFP4KV_ERROR_INVALID_VALUE, "num_kv_heads %lld received; must be positive",
                               static_cast<long long>(num_kv_heads));
    nvfp4kv::check_head_size(head_size, "head_size");
    nvfp4kv::check_head_size(head_size_v, "head_size_v");
    const int64_t fk = nvfp4kv::full_dim(static_cast<int>(head_size));
    const int64_t fv = nvfp4kv::full_dim(static_cast<int>(head_size_v));
    // Each side below 2 GiB, so the sum of the two fits a size_t and an int64_t.
    const int64_t k = nvfp4kv::side_bytes(block_size, num_kv_heads, fk, "key side (head_size)");
    const int64_t v = nvfp4kv::side_bytes(block_size, num_kv_heads, fv, "value side (head_size_v)");
    *page_bytes = static_cast<size_t>(k + v);
    if (row_bytes) *row_bytes = static_cast<size_t>(fk);
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

NVFP4KV_API nvfp4kv_status nvfp4kv_decode_attention(const DLTensor* query, const DLTensor* kv_cache,
                                                    const DLTensor* value_cache,
                                                    const DLTensor* block_table,
                                                    const DLTensor* seq_lens,
                                                    const DLTensor* k_scale, const DLTensor* v_scale,
                                                    nvfp4kv_scale_profile profile, int32_t q_len,
                                                    float sm_scale, float logits_soft_cap,
                                                    int64_t window_left, DLTensor* out, DLTensor* lse,
                                                    const DLTensor* workspace, void* stream) {
  return guarded("nvfp4kv_decode_attention", [&] {
    nvfp4kv::decode(query, kv_cache, value_cache, block_table, seq_lens, k_scale, v_scale, profile, q_len,
                    sm_scale, logits_soft_cap, window_left, out, lse, workspace, stream);
  });
}

NVFP4KV_API nvfp4kv_status nvfp4kv_amax(const DLTensor* x, DLTensor* out, int accumulate, void* stream) {
  return guarded("nvfp4kv_amax", [&] { nvfp4kv::amax(x, out, accumulate, stream); });
}

NVFP4KV_API nvfp4kv_status nvfp4kv_decode_workspace_size(int64_t num_seqs, int32_t q_len,
                                                         int64_t num_qo_heads, int64_t num_kv_heads,
                                                         int64_t head_size_v,
                                                         int64_t max_blocks_per_seq, size_t* bytes) {
  return guarded("nvfp4kv_decode_workspace_size", [&] {
    if (!bytes) nvfp4kv::fail(NVFP4KV_ERROR_INVALID_VALUE, "bytes: NULL pointer");
    *bytes = static_cast<size_t>(nvfp4kv::decode_workspace_bytes(num_seqs, q_len, num_qo_heads, num_kv_heads,
                                                                 head_size_v, max_blocks_per_seq));
  });
}

}  // extern "C"
