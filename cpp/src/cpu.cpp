// The CPU path: loops over the parameter structs, calling the format core for every byte.
// A real, shipped path (engines without a GPU, tests' oracle for the kernels), not a helper.
#include "cpu.h"

#include <string.h>

#include <initializer_list>

namespace nvfp4kv {
namespace {

template <DType kDType>
inline float load_elem(const void* base, int64_t idx) {
  if constexpr (kDType == DType::kFloat32) {
    return static_cast<const float*>(base)[idx];
  } else if constexpr (kDType == DType::kFloat16) {
    return f16_to_float(static_cast<const uint16_t*>(base)[idx]);
  } else {
    return bf16_to_float(static_cast<const uint16_t*>(base)[idx]);
  }
}

template <DType kDType>
inline void store_elem(void* base, int64_t idx, float v) {
  if constexpr (kDType == DType::kFloat32) {
    static_cast<float*>(base)[idx] = v;
  } else if constexpr (kDType == DType::kFloat16) {
    static_cast<uint16_t*>(base)[idx] = float_to_f16(v);
  } else {
    static_cast<uint16_t*>(base)[idx] = float_to_bf16(v);
  }
}

// out scale of every finite scale byte for one global scale: the per-group division becomes a
// lookup, with the very values out_scale() gives.
struct OutTable {
  float out[kScaleNaN];
  explicit OutTable(float inv_enc) {
    for (uint32_t b = 0; b < kScaleNaN; ++b) out[b] = out_scale(b, inv_enc);
  }
  float operator()(uint32_t sfb) const { return out[sfb]; }
};

template <DType kDType, Recipe kRecipe>
void store_token_side(const StoreParams& p, const StoreSide& s, const GlobalScale& gs,
                      const OutTable& table, int64_t token, int64_t page, int64_t pos) {
  const int64_t D = s.cache.D;
  uint8_t* side = s.cache.base + page * s.cache.page_stride;
  for (int64_t h = 0; h < p.H; ++h) {
    const int64_t row = row_index(p.layout, h, pos, p.H, p.T);
    const int64_t src_row = token * s.token_stride + h * s.head_stride;
    uint8_t* data = side + data_offset(row, D);
    for (int64_t g = 0; g < D / kGroupSize; ++g) {
      float x[kGroupSize];
      for (int i = 0; i < kGroupSize; ++i) x[i] = load_elem<kDType>(s.src, src_row + g * 16 + i);
      uint32_t packed[2];
      const uint32_t sfb = quantize_group<kRecipe>(x, gs, table, packed);
      for (int b = 0; b < 8; ++b) data[8 * g + b] = static_cast<uint8_t>(packed[b / 4] >> (8 * (b % 4)));
      const int64_t soff = s.cache.interleaved
                               ? scale_offset_interleaved(h, pos, g, p.T, p.H, D)
                               : scale_offset_linear(row, g, p.H, p.T, D);
      side[soff] = static_cast<uint8_t>(sfb);
    }
  }
}

template <DType kDType, Recipe kRecipe>
void store_impl(const StoreParams& p) {
  const GlobalScale gk = make_global_scale(p.k.scale.value);
  const GlobalScale gv = make_global_scale(p.v.scale.value);
  const OutTable tk(gk.inv_enc), tv(gv.inv_enc);
  for (int64_t i = 0; i < p.num_tokens; ++i) {
    const int64_t slot = load_index(p.slots, i);
    if (slot < 0 || slot >= p.num_slots) continue;  // padding or out of range: skipped
    const int64_t page = slot / p.T, pos = slot % p.T;
    store_token_side<kDType, kRecipe>(p, p.k, gk, tk, i, page, pos);
    store_token_side<kDType, kRecipe>(p, p.v, gv, tv, i, page, pos);
  }
}

// One row (token, head) of one side into `out` (D elements); zeros when `side` is null (a
// token whose block is invalid).
template <DType kDType>
void dequant_row(const DequantSide& s, const uint8_t* side, int64_t h, int64_t t, int32_t H, int32_t T, Layout layout, int64_t out_row) {
  const int64_t D = s.cache.D;
  if (!side) {
    for (int64_t e = 0; e < D; ++e) store_elem<kDType>(s.out, out_row + e, 0.0f);
    return;
  }
  const int64_t row = row_index(layout, h, t, H, T);
  const uint8_t* data = side + data_offset(row, D);
  const float g = s.scale.value;
  for (int64_t g16 = 0; g16 < D / kGroupSize; ++g16) {
    const int64_t soff = s.cache.interleaved ? scale_offset_interleaved(h, t, g16, T, H, D)
                                             : scale_offset_linear(row, g16, H, T, D);
    uint32_t w[2] = {0, 0};
    for (int b = 0; b < 8; ++b) w[b / 4] |= static_cast<uint32_t>(data[8 * g16 + b]) << (8 * (b % 4));
    float y[kGroupSize];
    dequantize_group(w, side[soff], g, y);
    for (int i = 0; i < kGroupSize; ++i) store_elem<kDType>(s.out, out_row + g16 * kGroupSize + i, y[i]);
  }
}

template <DType kDType>
void dequant_impl(const DequantParams& p) {
  for (int64_t i = 0; i < p.num_pages; ++i) {
    const int64_t n = p.pages.ptr ? load_index(p.pages, i) : i;
    if (n < 0 || n >= p.N) continue;  // a page id out of range: nothing to read or write
    for (const DequantSide* s : {&p.k, &p.v}) {
      const uint8_t* side = s->cache.base + n * s->cache.page_stride;
      for (int64_t t = 0; t < p.T; ++t)
        for (int64_t h = 0; h < p.H; ++h)
          dequant_row<kDType>(*s, side, h, t, p.H, p.T, p.layout,
                              n * s->out_stride[0] + t * s->out_stride[1] + h * s->out_stride[2]);
    }
  }
}

template <DType kDType>
void gather_impl(const GatherParams& p) {
  for (int64_t b = 0; b < p.B; ++b) {
    const int64_t len = load_index(p.seq_lens, b), start = load_index(p.cu_seqlens, b);
    const IndexVec row = block_table_row(p, b);
    for (int64_t j = 0; j < len; ++j) {
      const int64_t out_tok = start + j;
      if (out_tok < 0 || out_tok >= p.total_tokens) continue;  // never write outside the output
      const int64_t blk = j / p.T;
      const int64_t page = blk < p.max_blocks ? load_index(row, blk) : -1;
      const bool valid = page >= 0 && page < p.N;  // a bad block-table entry reads as zeros
      for (const DequantSide* s : {&p.k, &p.v}) {
        const uint8_t* side = valid ? s->cache.base + page * s->cache.page_stride : nullptr;
        for (int64_t h = 0; h < p.H; ++h)
          dequant_row<kDType>(*s, side, h, j % p.T, p.H, p.T, p.layout,
                              out_tok * s->out_stride[0] + h * s->out_stride[1]);
      }
    }
  }
}

}  // namespace

void cpu_store(const StoreParams& p) {
  // dtype x recipe dispatch, the only place it happens on the CPU.
  switch (p.dtype) {
    case DType::kFloat32:
      return p.recipe == Recipe::kNvfp4 ? store_impl<DType::kFloat32, Recipe::kNvfp4>(p)
                                        : store_impl<DType::kFloat32, Recipe::kNvfp4_4over6>(p);
    case DType::kFloat16:
      return p.recipe == Recipe::kNvfp4 ? store_impl<DType::kFloat16, Recipe::kNvfp4>(p)
                                        : store_impl<DType::kFloat16, Recipe::kNvfp4_4over6>(p);
    case DType::kBFloat16:
      return p.recipe == Recipe::kNvfp4 ? store_impl<DType::kBFloat16, Recipe::kNvfp4>(p)
                                        : store_impl<DType::kBFloat16, Recipe::kNvfp4_4over6>(p);
  }
}

void cpu_dequantize(const DequantParams& p) {
  switch (p.dtype) {
    case DType::kFloat32: return dequant_impl<DType::kFloat32>(p);
    case DType::kFloat16: return dequant_impl<DType::kFloat16>(p);
    case DType::kBFloat16: return dequant_impl<DType::kBFloat16>(p);
  }
}

void cpu_gather(const GatherParams& p) {
  switch (p.dtype) {
    case DType::kFloat32: return gather_impl<DType::kFloat32>(p);
    case DType::kFloat16: return gather_impl<DType::kFloat16>(p);
    case DType::kBFloat16: return gather_impl<DType::kBFloat16>(p);
  }
}

}  // namespace nvfp4kv
