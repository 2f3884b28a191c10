/* nvfp4kv C ABI: quantize K/V into an NVFP4 paged KV cache and read it back.
 *
 * Pure C (C99; it also compiles as C89 and C++98). Every function is prefixed nvfp4kv_ and never
 * lets a C++ exception escape; those that take tensors or sizes return a status (the version and
 * build queries return their value). All validation happens before any byte is written: a call
 * that returns an error has left every output untouched. On error, nvfp4kv_last_error()
 * (thread-local) names the argument, the value received and what is allowed.
 *
 * Tensors are DLPack DLTensor views (dlpack.h); strides are in elements. Tensors in host memory
 * (kDLCPU, or pinned: kDLCUDAHost) run the CPU path, tensors on a CUDA device the CUDA kernels
 * on the stream given as `void*` (a cudaStream_t; NULL is the legacy default stream). CUDA calls
 * never synchronize and never allocate. The byte format is FORMAT.md's (the project's
 * docs/FORMAT.md); the reference of this ABI is docs/c-api.md. cmake --install puts both beside
 * the license (share/doc/nvfp4kv).
 */
#ifndef NVFP4KV_NVFP4KV_H_
#define NVFP4KV_NVFP4KV_H_

#include <stddef.h>
#include <stdint.h>

#include "nvfp4kv/dlpack.h"
/* An upstream dlpack.h included before this header provides the declarations instead (the two
 * share DLPack's include guard); the C ABI needs DLPack 1.x's DLTensor layout. */
#if !defined(DLPACK_MAJOR_VERSION) || DLPACK_MAJOR_VERSION < 1
#error "nvfp4kv.h needs DLPack 1.x declarations; an older dlpack.h was included first"
#endif

/* The one source of the version: CMake and the Python package read these three lines. */
#define NVFP4KV_VERSION_MAJOR 0
#define NVFP4KV_VERSION_MINOR 1
#define NVFP4KV_VERSION_PATCH 0
#define NVFP4KV_VERSION \
  (NVFP4KV_VERSION_MAJOR * 10000 + NVFP4KV_VERSION_MINOR * 100 + NVFP4KV_VERSION_PATCH)
/* Whether a library of version v (nvfp4kv_version()) serves code compiled against this header:
   the same MAJOR.MINOR (the ABI, as the SONAME libnvfp4kv.so.MAJOR.MINOR) and no older patch. */
#define NVFP4KV_VERSION_COMPATIBLE(v) ((v) / 100 == NVFP4KV_VERSION / 100 && (v) >= NVFP4KV_VERSION)

#if defined(_WIN32)
#define NVFP4KV_API __declspec(dllexport)
#else
#define NVFP4KV_API __attribute__((visibility("default")))
#endif

/* The enums' type in C++11 and later: int, so that every value a C caller may pass is one the
 * enum holds and the library's range checks are not undefined behaviour (-fstrict-enums). */
#if defined(__cplusplus) && (__cplusplus >= 201103L || defined(_MSC_VER))
#define NVFP4KV_ENUM_INT : int
#else
#define NVFP4KV_ENUM_INT
#endif

#ifdef __cplusplus
extern "C" {
#endif

typedef enum nvfp4kv_status NVFP4KV_ENUM_INT {
  NVFP4KV_SUCCESS = 0,
  NVFP4KV_ERROR_INVALID_VALUE = 1,   /* bad shape, stride, size or value (Python: ValueError) */
  NVFP4KV_ERROR_INVALID_DTYPE = 2,   /* wrong element type (Python: TypeError) */
  NVFP4KV_ERROR_DEVICE_MISMATCH = 3, /* tensors on different devices (Python: ValueError) */
  NVFP4KV_ERROR_NOT_SUPPORTED = 4,   /* e.g. CUDA tensors in a build without CUDA (a call whose
                                      * tensors are on different devices: DEVICE_MISMATCH) */
  NVFP4KV_ERROR_CUDA = 5,            /* the CUDA runtime reported an error */
  NVFP4KV_ERROR_INTERNAL = 6,        /* a bug: please report it */
  NVFP4KV_ERROR_OUT_OF_MEMORY = 7    /* a host allocation failed (the CPU path's buffers; a
                                      * thread that cannot start is worked around): nothing was
                                      * written (Python: MemoryError). Later releases may add
                                      * statuses: treat any nonzero one as a failure. */
} nvfp4kv_status;

typedef enum nvfp4kv_recipe NVFP4KV_ENUM_INT {
  NVFP4KV_RECIPE_NVFP4 = 0,        /* scale = amax / 6 */
  NVFP4KV_RECIPE_NVFP4_4OVER6 = 1  /* the better of amax / 6 and amax / 4 per group */
} nvfp4kv_recipe;

typedef enum nvfp4kv_scale_profile NVFP4KV_ENUM_INT {
  NVFP4KV_SCALES_VLLM = 0,  /* K scales linear, V scales token-4 interleaved (vLLM on SM100) */
  NVFP4KV_SCALES_LINEAR = 1 /* K and V scales linear */
} nvfp4kv_scale_profile;

/* Version of the library actually loaded (check it with NVFP4KV_VERSION_COMPATIBLE), and as "0.1.0". */
NVFP4KV_API int nvfp4kv_version(void);
NVFP4KV_API const char* nvfp4kv_version_string(void);

/* Static description of a status code, e.g. "invalid value". Never NULL. */
NVFP4KV_API const char* nvfp4kv_status_string(nvfp4kv_status status);

/* The message of this thread's last call that returns a status: its failure, or "" after a
 * success (the other functions leave it). Valid until this thread's next such call. */
NVFP4KV_API const char* nvfp4kv_last_error(void);

/* 1 if the library was built with its CUDA kernels, else 0. */
NVFP4KV_API int nvfp4kv_cuda_built(void);
/* CUDA version the library was built with (e.g. 13000), 0 without CUDA. */
NVFP4KV_API int nvfp4kv_cuda_build_version(void);
/* Architectures compiled, e.g. "80-real,90-real,100-real,120-real,120-virtual"; "" without CUDA. */
NVFP4KV_API const char* nvfp4kv_cuda_archs(void);
/* Number of usable CUDA devices (0 when none); when 0, *reason (if not NULL) explains why
 * (no CUDA in this build, no driver, driver too old, no device). */
NVFP4KV_API int nvfp4kv_cuda_device_count(const char** reason);

/* Quantize-and-store (vLLM's reshape_and_cache_flash for kv_cache_dtype "nvfp4").
 *
 * key, value:   [num_tokens, H, D] and [num_tokens, H, Dv], float32, float16 or bfloat16 (the
 *               same for both), last stride 1, other strides free. D, Dv multiples of 16, <= 512.
 * kv_cache:     uint8, one of
 *               - (N, 2, T, H, F) with HND strides (physical [N][2][H][T][F]) or NHD strides
 *                 (physical [N][2][T][H][F]); page stride free; requires D == Dv;
 *               - (N, 2H, T, F) packed, HND: K heads 0..H-1, V heads H..2H-1;
 *               - when value_cache is not NULL: the K side (N, T, H, F), value_cache the V side;
 *                 each side a contiguous run of H*T*F bytes per page, HND or NHD by its strides.
 *               F = D/2 + D/16.
 * slot_mapping: [num_tokens] int64 or int32. Token i goes to page slot/T, position slot%T;
 *               slots < 0 or >= N*T are skipped. Slots must be distinct among stored tokens
 *               (the CPU path keeps the last token; the CUDA path in token order may mix them,
 *               each group's codes and scale byte written from either token).
 * k_scale, v_scale: 1-element float32 tensors, the decode global scales. In host memory
 *               (whatever the cache's device) they are validated (finite, > 0, finite
 *               reciprocal); in device memory they are read by the kernel and a group
 *               quantized with an invalid one gets scale byte 0x7F.
 * recipe, profile: see the enums. The token-4 interleaved V scales of the vLLM profile need
 *               HND, T % 4 == 0 and Dv % 64 == 0.
 * stream:       cudaStream_t for CUDA tensors; ignored on the CPU. */
NVFP4KV_API nvfp4kv_status nvfp4kv_store(const DLTensor* key, const DLTensor* value,
                                         const DLTensor* kv_cache, const DLTensor* value_cache,
                                         const DLTensor* slot_mapping, const DLTensor* k_scale,
                                         const DLTensor* v_scale, nvfp4kv_recipe recipe,
                                         nvfp4kv_scale_profile profile, void* stream);

/* nvfp4kv_store with a workspace (NULL: the same as nvfp4kv_store). With one, the CUDA store of
 * a batch too large for L2 to gather its scattered rows (recipe nvfp4, HND pages, head size
 * 32, 64 or 128, rows adding up to 3 times the L2) first lists the pages its tokens target and then writes each
 * page whole, instead of writing rows of 16-64 bytes in token order: random slots then cost about
 * what sequential ones do (docs/performance.md). The bytes written are the same, except that
 * such a call keeps the last token of duplicate slots, as on the CPU. Other calls ignore the
 * workspace.
 *
 * workspace:    uint8 [bytes] on the cache's device, contiguous, 4-byte aligned, at least
 *               nvfp4kv_store_workspace_size(N, T) bytes for a cache of N blocks of T tokens (one
 *               workspace serves every cache up to that size; it must not overlap the cache or
 *               an input; a cache of more than 2^40 slots N * T takes none). Zero it once before
 *               its first use;
 *               each call leaves it ready for the next. Calls that share a workspace must not run
 *               at the same time (use it from one stream, or order the streams). After a call that
 *               failed with NVFP4KV_ERROR_CUDA, zero it again (one in another state can misplace
 *               rows within the cache, never reach outside it or the inputs). */
NVFP4KV_API nvfp4kv_status nvfp4kv_store_with_workspace(
    const DLTensor* key, const DLTensor* value, const DLTensor* kv_cache,
    const DLTensor* value_cache, const DLTensor* slot_mapping, const DLTensor* k_scale,
    const DLTensor* v_scale, nvfp4kv_recipe recipe, nvfp4kv_scale_profile profile,
    const DLTensor* workspace, void* stream);

/* Most threads one call on CPU tensors uses, for the whole process: 1 to 256, or 0 (the default)
 * for one per CPU the calling thread may run on (its affinity mask, which the threads a call
 * starts inherit; read at each call), at most 16. Until it is called, the environment variable
 * NVFP4KV_CPU_THREADS sets it (read once, at the first CPU call large enough for several threads
 * or nvfp4kv_cpu_threads(); ignored unless a whole number from 0 to 256 in base 10: white space
 * (isspace) around it, a sign and leading zeros are fine, nothing else). Small calls use fewer
 * (about 131072 elements per thread at least). Each thread takes a share of the pages (store,
 * dequantize) or of the output tokens (gather): the bytes are the same for every thread count,
 * duplicate slots included. A call whose tensors share bytes in other ways than a cache split
 * page by page into K and V runs on one thread. The threads are started by the call and joined
 * before it returns; CUDA calls are not affected. */
NVFP4KV_API nvfp4kv_status nvfp4kv_set_cpu_threads(int threads);
/* The thread count in force (nvfp4kv_set_cpu_threads; 0 resolved to the calling thread's CPUs). */
NVFP4KV_API int nvfp4kv_cpu_threads(void);

/* Bytes of a store workspace for caches of up to num_blocks blocks of block_size tokens
 * (16 + 4 * num_blocks * (2 * block_size + 3)); num_blocks >= 0, block_size >= 1, at most 2^40
 * slots (num_blocks * block_size). */
NVFP4KV_API nvfp4kv_status nvfp4kv_store_workspace_size(int64_t num_blocks, int64_t block_size,
                                                        size_t* bytes);

/* Bytes of one page (block) of a cache, for engines that allocate it themselves: block_size
 * tokens of num_kv_heads heads, K of head size head_size and V of head_size_v, each row F(D) =
 * D/2 + D/16 bytes (9D/16: 72 for D = 128), so block_size * num_kv_heads * (F(D) + F(Dv)).
 * A combined cache (N, 2, T, H, F) or packed (N, 2H, T, F) needs D == Dv and takes N such pages;
 * two sides take N * block_size * num_kv_heads * F(D) bytes for K and * F(Dv) for V.
 * INVALID_VALUE, as the store would give, for a head size that is not a multiple of 16 from 16
 * to 512, block_size or num_kv_heads below 1, or one side of a page (block_size * num_kv_heads *
 * F) of 2 GiB or more, or a NULL page_bytes; nothing is written then. row_bytes, if not NULL,
 * receives F(head_size). */
NVFP4KV_API nvfp4kv_status nvfp4kv_page_bytes(int64_t block_size, int64_t num_kv_heads,
                                              int64_t head_size, int64_t head_size_v,
                                              size_t* page_bytes, size_t* row_bytes);

/* Dequantize every page of a cache (FORMAT.md §6).
 *
 * kv_cache, value_cache, k_scale, v_scale, profile: as for nvfp4kv_store.
 * key_out, value_out: (N, T, H, D) and (N, T, H, Dv) float32, float16 or bfloat16 (the same for
 *               both), last stride 1, other strides free, on the cache's device. Values are
 *               e2m1 * scale * global scale in fp32, rounded to nearest even; NaN for a group whose
 *               scale byte is 0x7F. */
NVFP4KV_API nvfp4kv_status nvfp4kv_dequantize(const DLTensor* kv_cache,
                                              const DLTensor* value_cache,
                                              const DLTensor* k_scale, const DLTensor* v_scale,
                                              nvfp4kv_scale_profile profile, DLTensor* key_out,
                                              DLTensor* value_out, void* stream);

/* Paged to paged: dequantize the pages listed in `pages` ([P] int32 or int64; NULL: all pages)
 * into key_out/value_out as nvfp4kv_dequantize does, page p going to index p of the outputs (e.g.
 * the two sides of a bf16 paged cache of the same geometry, (N, 2, T, H, D)[:, 0] and [:, 1]).
 * Page ids < 0 or >= N are skipped; pages not listed are not written. P * T must stay below
 * 2^63 (a broadcast list can pass it), else NVFP4KV_ERROR_INVALID_VALUE. */
NVFP4KV_API nvfp4kv_status nvfp4kv_dequantize_pages(const DLTensor* kv_cache,
                                                    const DLTensor* value_cache,
                                                    const DLTensor* pages,
                                                    const DLTensor* k_scale,
                                                    const DLTensor* v_scale,
                                                    nvfp4kv_scale_profile profile,
                                                    DLTensor* key_out, DLTensor* value_out,
                                                    void* stream);

/* Gather and dequantize sequences (the read path of attention kernels without FP4, varlen form).
 *
 * block_table:  [B, max_blocks] int32 or int64: page of each block of each sequence.
 * seq_lens:     [B] int32 or int64: tokens of each sequence.
 * cu_seqlens:   [B + 1] int32 or int64: output row of each sequence's first token (the prefix
 *               sums of seq_lens, as FlashAttention's varlen interface takes them).
 * key_out, value_out: [total_tokens, H, D] / [total_tokens, H, Dv] float32, float16 or bfloat16,
 *               last stride 1. Token j of sequence b is read from page block_table[b, j / T],
 *               position j % T, and written to row cu_seqlens[b] + j. A block-table entry < 0 or
 *               >= N (or a block past max_blocks) gives zeros; rows outside [0, total_tokens) are
 *               never written; nothing is read outside the cache. Sequences' rows must not
 *               overlap (cu_seqlens[b] + seq_lens[b] <= cu_seqlens[b + 1]; not checked): a row
 *               two sequences write gets the later one's values on the CPU and, element by
 *               element, either one's on CUDA.
 * The other arguments as for nvfp4kv_dequantize. */
NVFP4KV_API nvfp4kv_status nvfp4kv_gather_dequant(const DLTensor* kv_cache,
                                                  const DLTensor* value_cache,
                                                  const DLTensor* block_table,
                                                  const DLTensor* seq_lens,
                                                  const DLTensor* cu_seqlens,
                                                  const DLTensor* k_scale, const DLTensor* v_scale,
                                                  nvfp4kv_scale_profile profile,
                                                  DLTensor* key_out, DLTensor* value_out,
                                                  void* stream);

/* Decode attention that reads the NVFP4 pages directly (no bf16 copy of K/V): for each sequence,
 * its last q_len tokens (decode, or a few speculative tokens) attend to the sequence's cached
 * tokens through its block table.
 *
 * query:        [B * q_len, Hq, D] bfloat16 or float16, last stride 1, other strides free. Row
 *               b * q_len + i is query row i of sequence b, at token position
 *               p = seq_lens[b] - q_len + i. Hq = group * H, group 1..16; query head hq reads
 *               KV head hq / group. D = the cache's K head size, one of 64, 128, 256.
 * kv_cache, value_cache, k_scale, v_scale, profile: as for nvfp4kv_store (the cache's V head
 *               size Dv is one of 64, 128, 256 too). On CUDA, Dv == D and the sides' start and
 *               page stride are multiples of 4 bytes, else NVFP4KV_ERROR_NOT_SUPPORTED (the CPU
 *               path takes both).
 * block_table:  [B, max_blocks] int32 or int64: page of each block of each sequence (B is its
 *               dimension 0).
 * seq_lens:     [B] int32 or int64: tokens of each sequence, the query rows' tokens included.
 * q_len:        query rows per sequence, 1..8 (causal among them: row i sees positions <= p).
 * sm_scale:     softmax scale (usually 1/sqrt(D)), finite and > 0. The logits are fp32: a scale
 *               that takes q . k * k_scale * sm_scale past +3.4e38 makes the row NaN, and a
 *               logit past -3.4e38 weighs 0 (a row whose logits all are gets out 0, lse -inf);
 *               a soft cap keeps them finite.
 * logits_soft_cap: finite, >= 0; > 0: logits become cap * tanh(logit / cap); 0: none.
 * window_left:  -1: no window; >= 0: row at position p sees positions [p - window_left, p].
 * out:          [B * q_len, Hq, Dv], the query's dtype, last stride 1, on the cache's device.
 * lse:          NULL, or [B * q_len, Hq] float32: natural log of each row's softmax
 *               denominator, with the logits scaled (k_scale * sm_scale) and capped.
 * workspace:    split-KV partials. Required by the CUDA path where the geometry may split
 *               sequences (nvfp4kv_decode_workspace_size gives more than 0 bytes: sized from the
 *               geometry alone for the most splits it allows; a call with pages shorter than 16
 *               tokens or a window may split less and use part of it, or none):
 *               float32 or uint8, contiguous, 16-byte aligned, at least that size, on the cache's
 *               device, sharing no byte with any other argument; its contents need no
 *               initialization. Unused otherwise (and always on the CPU: NULL is fine), where
 *               one given is still checked by the same rules (the size and alignment where the
 *               geometry may split), so that CPU runs refuse what GPU runs would.
 * stream:       cudaStream_t for CUDA tensors; ignored on the CPU.
 *
 * K and V are read as e2m1 * e4m3 (exact in fp32); logit = (q . k) * (k_scale * sm_scale),
 * out = softmax-weighted sum of v, times v_scale, rounded to nearest even. Positions whose
 * block-table entry is < 0 or >= N (or whose block is past max_blocks) are masked out and never
 * read. A row that sees no position (seq_len <= 0, p < 0, everything masked) gets out = 0 and
 * lse = -inf. A K group stored from NaN makes the rows that see its position NaN (out and lse);
 * a V group, only that group's 16 elements of out in those rows. The CPU path computes in fp32
 * and is the reference of the CUDA path (tolerances: docs/c-api.md). */
NVFP4KV_API nvfp4kv_status nvfp4kv_decode_attention(const DLTensor* query, const DLTensor* kv_cache,
                                                    const DLTensor* value_cache,
                                                    const DLTensor* block_table,
                                                    const DLTensor* seq_lens,
                                                    const DLTensor* k_scale, const DLTensor* v_scale,
                                                    nvfp4kv_scale_profile profile, int32_t q_len,
                                                    float sm_scale, float logits_soft_cap,
                                                    int64_t window_left, DLTensor* out, DLTensor* lse,
                                                    const DLTensor* workspace, void* stream);

/* The largest magnitude of a tensor, for global scales (calibration: decode scale = amax / 448).
 *
 * x:            float32, float16 or bfloat16, any shape (rank <= 8) and any strides (negative,
 *               zero and overlapping ones included: only the set of elements read matters).
 * out:          the amax: a 1-element float32 tensor on x's device, 4-byte aligned, sharing no
 *               byte with x.
 * accumulate:   0: out = max(|x|) (0 for an empty x); 1: out = max(out, max(|x|)) (an empty
 *               x leaves it unchanged), so one out gathers the maximum over many calls.
 * stream:       cudaStream_t for CUDA tensors; ignored on the CPU.
 *
 * The result is exact (|x| of a float16 or bfloat16 is exactly representable in float32) and
 * the same on the CPU and the GPU, bit for bit, whatever the order of the elements. NaN is
 * sticky: if any element is NaN the result is the quiet NaN 0x7FC00000 (and stays NaN through
 * later accumulating calls); +/-inf gives +inf. A global scale computed from such an amax is
 * rejected by nvfp4kv_store on the CPU and stores NaN groups (scale byte 0x7F) on the GPU, so
 * check the result before using it if the data may hold them. Values compare as their int32
 * bits: a stored out that is negative (or a negative NaN) counts as below every |x|.
 *
 * On CUDA the call never synchronizes and never allocates: one kernel (a grid-stride read with
 * 16-byte loads where x's rows allow them, a block reduction, then one atomicMax per block on
 * the result's bits), preceded, with accumulate 0, by a one-thread kernel that writes 0. Both
 * are plain kernel launches on `stream`, so the call can be captured in a CUDA graph; each
 * replay recomputes (accumulate 0) or keeps accumulating (1) into the same out. */
NVFP4KV_API nvfp4kv_status nvfp4kv_amax(const DLTensor* x, DLTensor* out, int accumulate, void* stream);

/* Bytes of the workspace of nvfp4kv_decode_attention for that geometry (num_seqs = B,
 * max_blocks_per_seq = the block table's dimension 1): 4 * rows * Hq * splits * (Dv + 2) with
 * rows = num_seqs * q_len, where the CUDA path splits each sequence's tokens (splits > 1), else
 * 0 (the split count is a function of the geometry alone, so one workspace serves every call of
 * that geometry, and any larger workspace does too). */
NVFP4KV_API nvfp4kv_status nvfp4kv_decode_workspace_size(int64_t num_seqs, int32_t q_len,
                                                         int64_t num_qo_heads, int64_t num_kv_heads,
                                                         int64_t head_size_v,
                                                         int64_t max_blocks_per_seq, size_t* bytes);

#ifdef __cplusplus
}
#endif

#endif /* NVFP4KV_NVFP4KV_H_ */
