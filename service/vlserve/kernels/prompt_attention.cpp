// prompt_attention: attention for many queries at once (a prompt's prefill, an image's patches) in
// bfloat16, its two products through vdpbf16ps (AVX-512 BF16: 32 bfloat16 products a instruction,
// float32 sums).
//
// torch 2.13's CPU flash-attention kernel, which sdpa runs for bfloat16 queries, multiplies its blocks
// in float32 on CPUs without AMX: one layer of the vision tower (720 patches, 16 heads of 64) took
// 12.7 ms on a 2-vCPU Zen 5, 170 GFLOP/s where oneDNN's bfloat16 products run about 950, and the
// tower's 24 layers were a third of an image's encoding.
//
// It rounds as the flash kernel and vlserve.model.attention's Python path round: scores are float32
// sums of the exact products of the bfloat16 queries and keys, scaled in float32; the mask applied
// (boolean: False never attends; float: added); softmax in float32; the probabilities rounded to
// bfloat16 and their products with the values summed in float32, rounded once to bfloat16. A query
// whose every key is masked gets zeros. The sums add in another order than the flash kernel's, so a
// result may differ from its by a rounding of bfloat16.
//
// Layouts: per batch row and key head, the keys are repacked in blocks of 16 keys whose dimensions
// interleave in pairs (block, dim / 2, key, 2), so one vdpbf16ps multiplies one query's pair of
// dimensions with 16 keys; the values in pairs of tokens (token / 2, dim, 2), so one multiplies one
// query's pair of probabilities with 16 dimensions. Each work item is 16 queries of one head: its
// scores (16 x keys, float32) stay in the cache between the two products, and it stops at the last key
// one of its queries attends to (a causal prompt's early queries skip the keys after them).
//
// On a 2-vCPU Zen 4 (one vdpbf16ps a cycle a core), a vision layer (720 patches, 16 heads of 64) takes
// 7.4 ms, ~80% of that rate in its two products; packing the keys and values with scalar moves and
// copying the queries element by element took 2.4 ms more (9.8), and a 210-token causal prompt's layer
// 2.0 ms where skipping the masked keys' half of the work takes 0.9.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "lanes.h"

namespace {
using vlserve::lanes::exp_nonpositive;
constexpr int64_t kKeys = 16;       // keys per packed block: one vector of scores
constexpr int64_t kQueries = 16;    // queries per work item
constexpr int64_t kRowTile = 8;     // queries per score tile (x two key blocks: 16 accumulators)
constexpr int64_t kKeyMultiple = 32;  // keys padded to two blocks (and so to pairs of tokens)
constexpr int64_t kDimTile = 64;    // dimensions per output tile (four vectors x four queries)

// Keys t of (tokens, dim) at `key` (rows `stride` apart) as (padded / 16, dim / 2, 16, 2), zeros past
// `tokens`: each pair of dimensions of 16 keys gathered into one vector.
__attribute__((target("avx512f"))) void pack_keys(const at::BFloat16* key, int64_t stride, int64_t tokens,
                                                  int64_t dim, int64_t padded, uint16_t* out) {
  const int64_t pairs = dim / 2;
  const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                          _mm512_set1_epi32(int32_t(stride / 2)));  // a key row, in pairs
  for (int64_t t = 0; t < padded; t += kKeys) {
    const int64_t left = std::min<int64_t>(kKeys, std::max<int64_t>(0, tokens - t));
    const __mmask16 real = left == kKeys ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
    const int32_t* first = reinterpret_cast<const int32_t*>(key + t * stride);
    for (int64_t j = 0; j < pairs; ++j)
      _mm512_storeu_si512(out + ((t / kKeys) * pairs + j) * kKeys * 2,
                          _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), real, rows, first + j, 4));
  }
}

// Values of (tokens, dim) as (padded / 2, dim, 2), zeros past `tokens`: two tokens' rows interleaved.
__attribute__((target("avx512f,avx512bw"))) void pack_values(const at::BFloat16* value, int64_t stride, int64_t tokens,
                                                             int64_t dim, int64_t padded, uint16_t* out) {
  __m512i low, high;  // vpermt2w: dimension i of the even token, then of the odd, for dimensions 0-15 and 16-31
  alignas(64) uint16_t low_index[32], high_index[32];
  for (int i = 0; i < 16; ++i) {
    low_index[2 * i] = uint16_t(i), low_index[2 * i + 1] = uint16_t(32 + i);
    high_index[2 * i] = uint16_t(16 + i), high_index[2 * i + 1] = uint16_t(48 + i);
  }
  low = _mm512_load_si512(low_index);
  high = _mm512_load_si512(high_index);
  for (int64_t t = 0; t < padded; t += 2) {
    const at::BFloat16* even = value + t * stride;
    for (int64_t d = 0; d < dim; d += 32) {
      const __m512i a = t < tokens ? _mm512_loadu_si512(even + d) : _mm512_setzero_si512();
      const __m512i b = t + 1 < tokens ? _mm512_loadu_si512(even + stride + d) : _mm512_setzero_si512();
      uint16_t* o = out + ((t / 2) * dim + d) * 2;
      _mm512_storeu_si512(o, _mm512_permutex2var_epi16(a, low, b));
      _mm512_storeu_si512(o + 32, _mm512_permutex2var_epi16(a, high, b));
    }
  }
}

// Scores of kRowTile queries (rows of `dim` at q) against two packed key blocks, into s (rows `lds` apart).
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void score_tile(const uint16_t* q, int64_t dim,
                                                                      const uint16_t* keys, float* s, int64_t lds) {
  const int64_t pairs = dim / 2;
  const uint16_t* second = keys + pairs * kKeys * 2;
  __m512 acc[kRowTile][2];
  for (int r = 0; r < kRowTile; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t j = 0; j < pairs; ++j) {
    const __m512bh a = (__m512bh)_mm512_loadu_si512(keys + j * kKeys * 2);
    const __m512bh b = (__m512bh)_mm512_loadu_si512(second + j * kKeys * 2);
    for (int r = 0; r < kRowTile; ++r) {
      int32_t pair;
      std::memcpy(&pair, q + r * dim + 2 * j, sizeof(pair));
      const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], x, a);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], x, b);
    }
  }
  for (int r = 0; r < kRowTile; ++r) {
    _mm512_storeu_ps(s + r * lds, acc[r][0]);
    _mm512_storeu_ps(s + r * lds + kKeys, acc[r][1]);
  }
}

// One query's scores (s, `padded` of them, the first `tokens` real) -> its probabilities in bfloat16
// (out): scaled, masked (`bool_mask` or `float_mask`, or neither), softmax, rounded.
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void softmax_row(float* s, int64_t tokens, int64_t padded,
                                                                        float scale, const bool* bool_mask,
                                                                        const float* float_mask, uint16_t* out) {
  const __m512 minus_infinity = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 high = minus_infinity;
  for (int64_t t = 0; t < padded; t += 16) {
    const int64_t left = std::min<int64_t>(16, std::max<int64_t>(0, tokens - t));
    const __mmask16 real = left == 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
    __m512 v = _mm512_mul_ps(_mm512_loadu_ps(s + t), _mm512_set1_ps(scale));
    __mmask16 attends = real;
    if (bool_mask != nullptr && left > 0) {
      alignas(16) uint8_t bytes[16] = {};  // no read past the mask's row
      std::memcpy(bytes, bool_mask + t, left);
      const __m512i wide = _mm512_cvtepu8_epi32(_mm_load_si128((const __m128i*)bytes));
      attends &= _mm512_test_epi32_mask(wide, wide);
    }
    if (float_mask != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(real, float_mask + t));
    v = _mm512_mask_blend_ps(attends, minus_infinity, v);
    _mm512_storeu_ps(s + t, v);
    high = _mm512_max_ps(high, v);
  }
  const float top = _mm512_reduce_max_ps(high);
  if (top == -std::numeric_limits<float>::infinity()) {  // nothing to attend to: zeros, as the flash kernel
    std::fill(out, out + padded, uint16_t(0));
    return;
  }
  __m512 total = _mm512_setzero_ps();
  for (int64_t t = 0; t < padded; t += 16) {
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(s + t), _mm512_set1_ps(top)));
    _mm512_storeu_ps(s + t, e);
    total = _mm512_add_ps(total, e);
  }
  const __m512 inverse = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(total));
  for (int64_t t = 0; t < padded; t += 16)
    _mm256_storeu_si256((__m256i*)(out + t), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(s + t), inverse)));
}

// Four queries' outputs over kDimTile dimensions from d0: probabilities p (rows `ldp` apart) times the
// packed values, rounded to bfloat16 into out (rows `ldo` apart).
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void value_tile(const uint16_t* p, int64_t ldp, int64_t padded,
                                                                      const uint16_t* values, int64_t dim, int64_t d0,
                                                                      at::BFloat16* out, int64_t ldo, int rows) {
  __m512 acc[4][4];
  for (int r = 0; r < 4; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t t2 = 0; t2 < padded / 2; ++t2) {
    const uint16_t* v = values + (t2 * dim + d0) * 2;
    __m512bh columns[4];
    for (int c = 0; c < 4; ++c) columns[c] = (__m512bh)_mm512_loadu_si512(v + c * 32);
    for (int r = 0; r < 4; ++r) {
      int32_t pair;
      std::memcpy(&pair, p + r * ldp + 2 * t2, sizeof(pair));
      const __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], x, columns[c]);
    }
  }
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < 4; ++c)
      _mm256_storeu_si256((__m256i*)(out + r * ldo + d0 + c * 16), (__m256i)_mm512_cvtneps_pbh(acc[r][c]));
}

at::Tensor prompt_attention(const at::Tensor& q, const at::Tensor& key, const at::Tensor& value,
                            const c10::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(q.dim() == 4 && key.dim() == 4 && value.dim() == 4,
              "prompt_attention: q must be (batch, heads, queries, dim), key and value (batch, kv_heads, tokens, dim)");
  const int64_t batch = q.size(0), heads = q.size(1), queries = q.size(2), dim = q.size(3);
  const int64_t kv_heads = key.size(1), tokens = key.size(2);
  TORCH_CHECK(key.size(0) == batch && value.sizes() == key.sizes() && key.size(3) == dim && heads % kv_heads == 0,
              "prompt_attention: shapes do not match");
  TORCH_CHECK(dim % kDimTile == 0 && q.stride(3) == 1 && key.stride(3) == 1 && value.stride(3) == 1,
              "prompt_attention: dim must be a multiple of ", kDimTile, " and contiguous");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && key.scalar_type() == at::kBFloat16 &&
                  value.scalar_type() == at::kBFloat16,
              "prompt_attention: q, key and value must be bfloat16");
  at::Tensor m;
  if (mask.has_value() && mask->defined()) {
    TORCH_CHECK(mask->dim() == 4 && mask->size(3) == tokens && mask->stride(3) == 1 &&
                    (mask->scalar_type() == at::kBool || mask->scalar_type() == at::kFloat),
                "prompt_attention: mask must be boolean or float32 (batch or 1, heads or 1, queries or 1, tokens), "
                "contiguous in its last dimension");
    m = mask->expand({batch, heads, queries, tokens});
  }
  const int64_t padded = (tokens + kKeyMultiple - 1) / kKeyMultiple * kKeyMultiple;
  const int64_t group = heads / kv_heads, streams = batch * kv_heads, packed = padded * dim;
  std::vector<uint16_t> keys(streams * packed), values(streams * packed);
  // pack_keys gathers each key's dimensions in pairs, rows stride / 2 pairs apart: an odd row stride
  // (no caller's, but a view can have one) is copied first.
  const at::Tensor key_rows = key.stride(2) % 2 == 0 ? key : key.contiguous();
  const at::BFloat16 *pk = key_rows.data_ptr<at::BFloat16>(), *pv = value.data_ptr<at::BFloat16>();
  at::parallel_for(0, streams, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / kv_heads, h = i % kv_heads;
      pack_keys(pk + b * key_rows.stride(0) + h * key_rows.stride(1), key_rows.stride(2), tokens, dim, padded,
                keys.data() + i * packed);
      pack_values(pv + b * value.stride(0) + h * value.stride(1), value.stride(2), tokens, dim, padded,
                  values.data() + i * packed);
    }
  });
  at::Tensor out = at::empty({batch, queries, heads, dim}, q.options());  // transformers' layout after attention
  const at::BFloat16* pq = q.data_ptr<at::BFloat16>();
  at::BFloat16* po = out.data_ptr<at::BFloat16>();
  const int64_t q_batch = q.stride(0), q_head = q.stride(1), q_row = q.stride(2);
  const bool* bool_rows = m.defined() && m.scalar_type() == at::kBool ? m.data_ptr<bool>() : nullptr;
  const float* float_rows = m.defined() && m.scalar_type() == at::kFloat ? m.data_ptr<float>() : nullptr;
  const int64_t m_batch = m.defined() ? m.stride(0) : 0, m_head = m.defined() ? m.stride(1) : 0,
                m_row = m.defined() ? m.stride(2) : 0;
  const int64_t blocks = (queries + kQueries - 1) / kQueries;
  at::parallel_for(0, batch * heads * blocks, 1, [&](int64_t i0, int64_t i1) {
    std::vector<uint16_t> rows(kQueries * dim), probabilities(kQueries * padded);
    std::vector<float> scores(kQueries * padded);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / (heads * blocks), h = i / blocks % heads, first = i % blocks * kQueries;
      const int64_t count = std::min(kQueries, queries - first), stream = b * kv_heads + h / group;
      const at::BFloat16* block_queries = pq + b * q_batch + h * q_head + first * q_row;
      for (int64_t r = 0; r < kQueries; ++r)  // the block's queries, zeros past the last
        if (r < count)
          std::memcpy(rows.data() + r * dim, block_queries + r * q_row, dim * sizeof(uint16_t));
        else
          std::fill_n(rows.data() + r * dim, dim, uint16_t(0));
      // The block's keys end where the last key any of its queries attends to does (a causal prompt's
      // early queries, a shorter sequence's padding): past it every score is masked, so no product,
      // exponential or value of it is computed; the sums over the keys before it are the same.
      const int64_t mask_offset = b * m_batch + h * m_head + first * m_row;
      int64_t reach = bool_rows == nullptr && float_rows == nullptr ? tokens : 0;
      for (int64_t r = count - 1; r >= 0 && reach < tokens; --r) {  // a causal block's last query reaches furthest
        int64_t last = tokens;
        if (bool_rows != nullptr)
          while (last > reach && !bool_rows[mask_offset + r * m_row + last - 1]) --last;
        else
          while (last > reach && float_rows[mask_offset + r * m_row + last - 1] == -std::numeric_limits<float>::infinity())
            --last;
        reach = std::max(reach, last);
      }
      const int64_t width = (reach + kKeyMultiple - 1) / kKeyMultiple * kKeyMultiple;  // <= padded
      const uint16_t* packed_keys = keys.data() + stream * packed;
      for (int64_t r = 0; r < kQueries; r += kRowTile)
        for (int64_t t = 0; t < width; t += 2 * kKeys)
          score_tile(rows.data() + r * dim, dim, packed_keys + t * dim, scores.data() + r * padded + t, padded);
      for (int64_t r = 0; r < count; ++r) {
        const int64_t offset = mask_offset + r * m_row;
        softmax_row(scores.data() + r * padded, tokens, width, float(scale),
                    bool_rows != nullptr ? bool_rows + offset : nullptr,
                    float_rows != nullptr ? float_rows + offset : nullptr, probabilities.data() + r * padded);
      }
      at::BFloat16* target = po + (b * queries + first) * heads * dim + h * dim;
      for (int64_t r = 0; r < count; r += 4)
        for (int64_t d0 = 0; d0 < dim; d0 += kDimTile)
          value_tile(probabilities.data() + r * padded, padded, width, values.data() + stream * packed, dim, d0,
                     target + r * heads * dim, heads * dim, int(std::min<int64_t>(4, count - r)));
    }
  });
  return out;
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(vlserve, lib) {
  lib.def("prompt_attention(Tensor q, Tensor key, Tensor value, Tensor? mask, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(vlserve, CPU, lib) { lib.impl("prompt_attention", prompt_attention); }
