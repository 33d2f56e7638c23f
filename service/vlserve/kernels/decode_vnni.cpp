// vlserve's decode products: the int8 and int4 levels' weights times the few rows of a decode step.
//
// A decode step multiplies a few rows by every weight of the model once, so its speed is the speed
// at which the weights stream from memory. torch's stock kernels do not reach it on one row: oneDNN's
// int8 kernels (torch._int_mm and the prepacked ones) about half of it, and the int4 kernel
// (_weight_int4pack_mm_for_cpu) is bound by its dequantization to bfloat16. Both products here keep
// the weights as integers and multiply them with inputs rounded to int8 through vpdpbusd (AVX-512
// VNNI: 64 byte products a instruction), several weight rows in flight per thread.
//
// int8_linear: weights in their plain (out, in) int8 layout, the one the weight cache maps, one
// scale per output. The inputs are rounded exactly as vlserve.quantized.quantize_rows rounds them
// (symmetric int8 per row: scale = max|x| / 127, q = round-half-even(x / scale), clamped to +-127),
// the int32 sums are exact, and the rescaling multiplies in the same order as the Python path ((sum *
// row scale) * weight scale, then + bias; built without FMA contraction): the result equals that
// path's bit for bit. vpdpbusd multiplies unsigned bytes by signed ones, so the inputs are stored
// shifted by 128: sum((q + 128) * w) - 128 * sum(w) = sum(q * w), where sum(w) comes from one more
// vpdpbusd of the same weight bytes with ones, shared by every row of the step.
//
// int4_linear: weights as levels 0..15 in groups of 32 inputs with a bfloat16 scale and zero point
// per group and output (w = (level - 8) * scale + zero, torch's convention), in this file's tiled
// layout (vlserve.quantized.int4_tiles): per 16 outputs and group, four 64-byte lines, byte j of
// line l holding output j / 4's inputs 8l + j % 4 (low nibble) and 8l + 4 + j % 4 (high nibble), so
// one line feeds two vpdpbusd with four inputs broadcast. The inputs are rounded to int8 per block
// of 32 with a scale each (llama.cpp's Q8_0 for its Q4 products): a group's sum is then
// scale_w * scale_x * sum(level * q) + (zero - 8 * scale_w) * scale_x * sum(q).
//
// Every function that uses AVX-512 is compiled for it through a target attribute, the rest of the
// file for the baseline ISA: the library loads on any x86-64 CPU, and vlserve.native calls it only
// where the CPU has AVX-512 VNNI.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <vector>

namespace {
constexpr int64_t kChunk = 64;   // input bytes per vpdpbusd
constexpr int64_t kOutTile = 4;  // weight rows streamed together by one thread
constexpr int64_t kMaxRows = 4;  // int8_linear's rows per call: a decode batch of up to four sequences
constexpr int64_t kGroup = 32;   // int4: inputs per scale and zero point, and per input scale
constexpr int64_t kBlock = 16;   // int4: outputs per tile
constexpr int64_t kGroupBytes = kBlock * kGroup / 2;  // int4: one tile's bytes for one group (four lines)

__attribute__((target("avx512f,avx512bw"))) void round_row(const float* x, int64_t k, uint8_t* shifted,
                                                           float* scale) {
  __m512 amax = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
  const float d = std::max(_mm512_reduce_max_ps(amax) / 127.f, FLT_MIN);
  *scale = d;
  const __m512 vd = _mm512_set1_ps(d), hi = _mm512_set1_ps(127.f), lo = _mm512_set1_ps(-127.f);
  const __m512i shift = _mm512_set1_epi32(128);
  for (int64_t i = 0; i < k; i += 16) {
    __m512 q = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(x + i), vd),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    q = _mm512_min_ps(_mm512_max_ps(q, lo), hi);
    _mm_storeu_si128((__m128i*)(shifted + i), _mm512_cvtepi32_epi8(_mm512_add_epi32(_mm512_cvtps_epi32(q), shift)));
  }
}

template <int M>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline void store(int64_t n, const __m512i* acc, __m512i sum,
                                                                          const float* xs, const float* ws,
                                                                          const float* bias, float* out, int64_t ldo) {
  const int32_t correction = 128 * _mm512_reduce_add_epi32(sum);
  for (int r = 0; r < M; ++r) {
    float y = (float)(_mm512_reduce_add_epi32(acc[r]) - correction) * xs[r] * ws[n];
    out[r * ldo + n] = bias ? y + bias[n] : y;
  }
}

// Outputs n0..n1 of M rows.
template <int M>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void outputs(const int8_t* w, int64_t k, int64_t n0,
                                                                    int64_t n1, const uint8_t* a, const float* xs,
                                                                    const float* ws, const float* bias, float* out,
                                                                    int64_t ldo) {
  const int64_t chunks = k / kChunk;
  const __m512i ones = _mm512_set1_epi8(1);
  int64_t n = n0;
  for (; n + kOutTile <= n1; n += kOutTile) {
    __m512i acc[kOutTile][M], sum[kOutTile];
    for (int t = 0; t < kOutTile; ++t) {
      sum[t] = _mm512_setzero_si512();
      for (int r = 0; r < M; ++r) acc[t][r] = _mm512_setzero_si512();
    }
    const int8_t* base = w + n * k;
    for (int64_t c = 0; c < chunks; ++c) {
      __m512i x[M];
      for (int r = 0; r < M; ++r) x[r] = _mm512_loadu_si512(a + r * k + c * kChunk);
      for (int t = 0; t < kOutTile; ++t) {
        const int8_t* p = base + t * k + c * kChunk;
        _mm_prefetch((const char*)(p + 1024), _MM_HINT_T0);
        const __m512i v = _mm512_loadu_si512(p);
        sum[t] = _mm512_dpbusd_epi32(sum[t], ones, v);
        for (int r = 0; r < M; ++r) acc[t][r] = _mm512_dpbusd_epi32(acc[t][r], x[r], v);
      }
    }
    for (int t = 0; t < kOutTile; ++t) store<M>(n + t, acc[t], sum[t], xs, ws, bias, out, ldo);
  }
  for (; n < n1; ++n) {
    __m512i acc[M], sum = _mm512_setzero_si512();
    for (int r = 0; r < M; ++r) acc[r] = _mm512_setzero_si512();
    for (int64_t c = 0; c < chunks; ++c) {
      const __m512i v = _mm512_loadu_si512(w + n * k + c * kChunk);
      sum = _mm512_dpbusd_epi32(sum, ones, v);
      for (int r = 0; r < M; ++r) acc[r] = _mm512_dpbusd_epi32(acc[r], _mm512_loadu_si512(a + r * k + c * kChunk), v);
    }
    store<M>(n, acc, sum, xs, ws, bias, out, ldo);
  }
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "int8_linear: x must be (rows, in) and weight (out, in)");
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.is_contiguous() && weight.size(1) == k,
              "int8_linear: weight must be contiguous int8 of shape (out, ", k, ")");
  TORCH_CHECK(k % kChunk == 0, "int8_linear: inputs must come in multiples of ", kChunk, ", not ", k);
  TORCH_CHECK(m >= 1 && m <= kMaxRows, "int8_linear: 1 to ", kMaxRows, " rows, not ", m);
  TORCH_CHECK(scales.numel() == n, "int8_linear: one scale per output");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  const at::Tensor ws = scales.to(at::kFloat).contiguous();
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, "int8_linear: one bias per output");
    b = bias->to(at::kFloat).contiguous();
  }
  std::vector<uint8_t> a(m * k);
  float xs[kMaxRows];
  for (int64_t r = 0; r < m; ++r) round_row(xf.data_ptr<float>() + r * k, k, a.data() + r * k, xs + r);
  at::Tensor out = at::empty({m, n}, xf.options());
  const int8_t* pw = weight.data_ptr<int8_t>();
  const float* ps = ws.data_ptr<float>();
  const float* pb = b.defined() ? b.data_ptr<float>() : nullptr;
  float* po = out.data_ptr<float>();
  const int64_t tiles = (n + kOutTile - 1) / kOutTile;
  at::parallel_for(0, tiles, 16, [&](int64_t t0, int64_t t1) {
    const int64_t n0 = t0 * kOutTile, n1 = std::min(n, t1 * kOutTile);
    switch (m) {
      case 1: outputs<1>(pw, k, n0, n1, a.data(), xs, ps, pb, po, n); break;
      case 2: outputs<2>(pw, k, n0, n1, a.data(), xs, ps, pb, po, n); break;
      case 3: outputs<3>(pw, k, n0, n1, a.data(), xs, ps, pb, po, n); break;
      default: outputs<4>(pw, k, n0, n1, a.data(), xs, ps, pb, po, n); break;
    }
  });
  return out;
}
// int4 ---------------------------------------------------------------------------------------------

// One row in blocks of 32: q (int8), each block's scale, and each block's scale times its sum of q.
__attribute__((target("avx512f,avx512bw"))) void round_blocks(const float* x, int64_t k, int8_t* q, float* scale,
                                                              float* scaled_sum) {
  for (int64_t g = 0; g < k / kGroup; ++g) {
    const __m512 v0 = _mm512_loadu_ps(x + g * kGroup), v1 = _mm512_loadu_ps(x + g * kGroup + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
    const float d = std::max(amax / 127.f, FLT_MIN);
    const __m512 vd = _mm512_set1_ps(d);
    const int rounding = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_div_ps(v0, vd), rounding));
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_div_ps(v1, vd), rounding));
    _mm_storeu_si128((__m128i*)(q + g * kGroup), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128((__m128i*)(q + g * kGroup + 16), _mm512_cvtsepi32_epi8(q1));
    scale[g] = d;
    scaled_sum[g] = d * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
  }
}

__attribute__((target("avx512f,avx512bw"))) inline __m512 bf16x16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// NT tiles of 16 outputs for one row: independent vpdpbusd chains, so the loop is not bound by the
// latency of one accumulator.
template <int NT>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void int4_tiles_one_row(
    const uint8_t* packed, const uint16_t* params, int64_t groups, const int8_t* q, const float* xs,
    const float* xsum, float* out) {
  __m512 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512 eight = _mm512_set1_ps(8.f);
  const int64_t stride = groups * kGroupBytes, params_stride = groups * 2 * kBlock;
  for (int64_t g = 0; g < groups; ++g) {
    const int32_t* a = (const int32_t*)(q + g * kGroup);
    __m512i b[8];
    for (int l = 0; l < 8; ++l) b[l] = _mm512_set1_epi32(a[l]);
    const __m512 sx = _mm512_set1_ps(xs[g]), sq = _mm512_set1_ps(xsum[g]);
    for (int t = 0; t < NT; ++t) {
      const uint8_t* w = packed + t * stride + g * kGroupBytes;
      _mm_prefetch((const char*)(w + 8 * kGroupBytes), _MM_HINT_T0);
      __m512i d0 = _mm512_setzero_si512(), d1 = _mm512_setzero_si512();
      for (int l = 0; l < 4; ++l) {
        const __m512i v = _mm512_loadu_si512(w + 64 * l);
        d0 = _mm512_dpbusd_epi32(d0, _mm512_and_si512(v, nibble), b[2 * l]);
        d1 = _mm512_dpbusd_epi32(d1, _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble), b[2 * l + 1]);
      }
      const uint16_t* p = params + t * params_stride + g * 2 * kBlock;
      const __m512 s = bf16x16(p), low = _mm512_fnmadd_ps(eight, s, bf16x16(p + kBlock));  // zero - 8 * scale
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(d0, d1)), _mm512_mul_ps(s, sx), acc[t]);
      acc[t] = _mm512_fmadd_ps(low, sq, acc[t]);
    }
  }
  for (int t = 0; t < NT; ++t) _mm512_storeu_ps(out + t * kBlock, acc[t]);
}

// One tile of 16 outputs for M (<= 4) rows, whose inputs are `k` apart; outputs `ldo` apart.
template <int M>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void int4_tile_rows(
    const uint8_t* packed, const uint16_t* params, int64_t groups, const int8_t* q, const float* xs,
    const float* xsum, int64_t k, float* out, int64_t ldo) {
  __m512 acc[M];
  for (int r = 0; r < M; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512 eight = _mm512_set1_ps(8.f);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* w = packed + g * kGroupBytes;
    __m512i lo[4], hi[4];
    for (int l = 0; l < 4; ++l) {
      const __m512i v = _mm512_loadu_si512(w + 64 * l);
      lo[l] = _mm512_and_si512(v, nibble);
      hi[l] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
    }
    const uint16_t* p = params + g * 2 * kBlock;
    const __m512 s = bf16x16(p), low = _mm512_fnmadd_ps(eight, s, bf16x16(p + kBlock));
    for (int r = 0; r < M; ++r) {
      const int32_t* a = (const int32_t*)(q + r * k + g * kGroup);
      __m512i dot = _mm512_setzero_si512();
      for (int l = 0; l < 4; ++l) {
        dot = _mm512_dpbusd_epi32(dot, lo[l], _mm512_set1_epi32(a[2 * l]));
        dot = _mm512_dpbusd_epi32(dot, hi[l], _mm512_set1_epi32(a[2 * l + 1]));
      }
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(s, _mm512_set1_ps(xs[r * groups + g])), acc[r]);
      acc[r] = _mm512_fmadd_ps(low, _mm512_set1_ps(xsum[r * groups + g]), acc[r]);
    }
  }
  for (int r = 0; r < M; ++r) _mm512_storeu_ps(out + r * ldo, acc[r]);
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& params) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 2 && params.dim() == 2, "int4_linear: x (rows, in), tiles 2-d");
  const int64_t m = x.size(0), k = x.size(1), tiles = packed.size(0), groups = k / kGroup, n = tiles * kBlock;
  TORCH_CHECK(k % kGroup == 0, "int4_linear: inputs must come in groups of ", kGroup, ", not ", k);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.size(1) == groups * kGroupBytes,
              "int4_linear: tiles must be contiguous uint8 of shape (out / 16, ", groups * kGroupBytes, ")");
  TORCH_CHECK(params.scalar_type() == at::kBFloat16 && params.is_contiguous() && params.size(0) == tiles &&
                  params.size(1) == groups * 2 * kBlock,
              "int4_linear: scales and zeros must be contiguous bfloat16 of shape (out / 16, ", groups * 2 * kBlock,
              ")");
  TORCH_CHECK(m >= 1, "int4_linear: no rows");
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  std::vector<int8_t> q(m * k);
  std::vector<float> xs(m * groups), xsum(m * groups);
  for (int64_t r = 0; r < m; ++r)
    round_blocks(xf.data_ptr<float>() + r * k, k, q.data() + r * k, xs.data() + r * groups, xsum.data() + r * groups);
  at::Tensor out = at::empty({m, n}, xf.options());
  const uint8_t* pw = packed.data_ptr<uint8_t>();
  const uint16_t* pp = (const uint16_t*)params.data_ptr();
  float* po = out.data_ptr<float>();
  const int64_t tile_bytes = groups * kGroupBytes, tile_params = groups * 2 * kBlock;
  if (m == 1 && tiles % 4 == 0) {  // a decode step of one sequence: four tiles at a time
    at::parallel_for(0, tiles / 4, 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t)
        int4_tiles_one_row<4>(pw + 4 * t * tile_bytes, pp + 4 * t * tile_params, groups, q.data(), xs.data(),
                              xsum.data(), po + 4 * t * kBlock);
    });
    return out;
  }
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t r = 0; r < m; r += kMaxRows) {
        const int8_t* qr = q.data() + r * k;
        const float *s = xs.data() + r * groups, *su = xsum.data() + r * groups;
        const uint8_t* w = pw + t * tile_bytes;
        const uint16_t* p = pp + t * tile_params;
        float* o = po + r * n + t * kBlock;
        switch (std::min(kMaxRows, m - r)) {
          case 1: int4_tile_rows<1>(w, p, groups, qr, s, su, k, o, n); break;
          case 2: int4_tile_rows<2>(w, p, groups, qr, s, su, k, o, n); break;
          case 3: int4_tile_rows<3>(w, p, groups, qr, s, su, k, o, n); break;
          default: int4_tile_rows<4>(w, p, groups, qr, s, su, k, o, n); break;
        }
      }
    }
  });
  return out;
}
}  // namespace

TORCH_LIBRARY(vlserve, lib) {
  lib.def("int8_linear(Tensor x, Tensor weight, Tensor scales, Tensor? bias) -> Tensor");
  lib.def("int4_linear(Tensor x, Tensor tiles, Tensor params) -> Tensor");
}
TORCH_LIBRARY_IMPL(vlserve, CPU, lib) {
  lib.impl("int8_linear", int8_linear);
  lib.impl("int4_linear", int4_linear);
}
