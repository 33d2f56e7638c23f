// vlserve's int8 product: llama.cpp's Q8_0 x Q8_0 arithmetic, one source per ISA, equal results on all.
//
// Weights: int8 values w in [-127, 127] with an fp16 scale per output and block of 32 inputs
// (d_w = max|w| / 127 over the block, as llama.cpp's Q8_0 rounds them). Inputs: rounded at every call
// per row and block of 32 the same way (d_x = max|x| / 127 over the block in float32, q = x / d_x
// rounded half to even, clamped to +-127; a block of zeros stays zeros), so a channel much larger
// than the others coarsens the rounding of its own block of 32 and no other (one scale per row let
// it coarsen the whole row: docs/quantization.md).
//
// The product, the definition every ISA below computes exactly:
//   acc = 0; for each block g in order: acc = fma(float(I_g), d_w,g * d_x,g, acc); y = acc (+ bias)
// where I_g is the exact integer sum of w * q over the block (|I_g| < 2^19: exact in float32), then
// rounded to the rows' dtype. The integers are exact on every ISA and the float32 operations are the
// same ones in the same order (the file is built without FMA contraction), so AVX-512 VNNI and AVX2
// give the same bits: a test holds them to it, and the accuracy measured on one holds on the other.
//
// Layout (vlserve.kernels.quantized.q8_tiles): per tile of 16 outputs (outputs padded with zero weights to a
// multiple of 16) and block of 32 inputs, kStep = 544 bytes: eight 64-byte lines whose byte 4o + i of
// line l holds output o's input 4l + i as the unsigned byte w + 128, then the 16 outputs' fp16 scales.
// A tile's blocks follow each other, so each tile is one stream of bytes.
//
// AVX-512 VNNI: vpdpbusd multiplies the unsigned weight bytes by the row's four inputs, broadcast to
// all 16 outputs: the lane sums (w + 128) * q = I + 128 * sum(q), and 128 * sum(q) of the row's block
// is subtracted. AVX2 (no VNNI): the inputs' signs move onto the weights (vpsignb) and vpmaddubsw
// multiplies |q| <= 127 by them, so a pair's sum stays within int16 (2 * 127 * 127 < 32767). oneDNN's
// int8 kernels feed unsigned inputs up to 255 to vpmaddubsw on CPUs without VNNI, whose pair sums
// saturate: held to AVX2, torch._int_mm and oneDNN's prepacked product returned wrong sums here.
//
// Each function that uses an ISA is compiled for it through a target attribute; the caller names the
// ISA (vlserve.kernels.native picks it from the CPU) and the op refuses one the CPU lacks.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/string_view.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "lanes.h"
#include "ops.h"

namespace {
constexpr int64_t kBlock = 32;                       // inputs per scale
constexpr int64_t kTile = 16;                        // outputs per tile
constexpr int64_t kLines = 8;                        // 64-byte lines per tile and block
constexpr int64_t kStep = kLines * 64 + kTile * 2;   // bytes per tile and block: lines, then fp16 scales
constexpr int64_t kRowsAvx2 = 4;                     // rows multiplied per pass over a tile on AVX2
constexpr int64_t kTilesPerTask = 4;                 // tiles a thread takes at a time (64 outputs)
constexpr int64_t kPrefetch = 4;                     // blocks ahead that each tile's stream is prefetched
constexpr int kPromptRows = 4;                       // rows_avx512's rows per pass (6 x 2 and 4 x 3: no faster)
constexpr int kPromptTiles = 2;                      // and tiles per pass
constexpr int64_t kPromptFrom = 8;                   // rows from which products take rows_avx512 (AVX-512)

enum class Isa { kAvx512Vnni, kAvx2 };

Isa parse_isa(c10::string_view name) {
  if (name == "avx512_vnni") {
    TORCH_CHECK(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                    __builtin_cpu_supports("avx512vnni"),
                "q8_linear: this CPU lacks AVX-512 VNNI");
    return Isa::kAvx512Vnni;
  }
  if (name == "avx2") {
    TORCH_CHECK(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"),
                "q8_linear: this CPU lacks AVX2, FMA or F16C");
    return Isa::kAvx2;
  }
  TORCH_CHECK(false, "q8_linear: unknown ISA '", std::string(name), "' (avx512_vnni or avx2)");
}

// Rows rounded per block: q (rows x k), each block's scale, and per ISA what its products need
// (AVX-512: 128 * sum(q) per block; AVX2: |q|).
struct RoundedRows {
  std::vector<int8_t> q, magnitude;
  std::vector<float> scale;
  std::vector<int32_t> shifted_sum;
};

// ---- AVX-512 ------------------------------------------------------------------------------------

using vlserve::lanes::load16;

template <typename T>
__attribute__((target("avx512f,avx512bw"))) void round_row_avx512(const T* x, int64_t k, int8_t* q, float* scale,
                                                                  int32_t* shifted_sum) {
  const __m512 hi = _mm512_set1_ps(127.f), lo = _mm512_set1_ps(-127.f);
  for (int64_t g = 0; g < k / kBlock; ++g) {
    const __m512 v0 = load16(x + g * kBlock), v1 = load16(x + g * kBlock + 16);
    const float d = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1))) / 127.f;
    scale[g] = d;
    if (d == 0.f) {  // zeros (or values so small their step underflows): zeros
      std::fill(q + g * kBlock, q + (g + 1) * kBlock, 0);
      shifted_sum[g] = 0;
      continue;
    }
    const __m512 vd = _mm512_set1_ps(d);
    const int rounding = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    const __m512i q0 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(_mm512_div_ps(v0, vd), rounding), lo), hi));
    const __m512i q1 = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(_mm512_div_ps(v1, vd), rounding), lo), hi));
    _mm_storeu_si128((__m128i*)(q + g * kBlock), _mm512_cvtsepi32_epi8(q0));
    _mm_storeu_si128((__m128i*)(q + g * kBlock + 16), _mm512_cvtsepi32_epi8(q1));
    shifted_sum[g] = 128 * _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
  }
}

// R rows times S tiles (16 outputs each, anywhere in the weights: `w[0..S)`), every block, into `acc`
// (S x R x 16). Each tile's lines are loaded once per block for all R rows; two chains of vpdpbusd per
// row halve the wait on its latency. The S tiles are S streams of weights read at once: one stream a
// thread left the memory idle while the core multiplied (on a 2-vCPU Xeon with AMX, 13 GB/s a thread
// where a plain read takes 17, which is the read's time plus the in-cache multiply's, not the larger of
// the two); four streams read 16 GB/s, within 5% of the plain read (docs/benchmarks.md has the runs).
// Every tile's sums are the same whatever tiles come with it.
template <int R, int S>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void tiles_avx512(const uint8_t* const* w, int64_t groups,
                                                                          const int8_t* q, int64_t k,
                                                                          const float* scale,
                                                                          const int32_t* shifted_sum, float* acc) {
  __m512 sums[S][R];
  for (int t = 0; t < S; ++t)
    for (int r = 0; r < R; ++r) sums[t][r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    for (int t = 0; t < S; ++t) {
      const uint8_t* p = w[t] + g * kStep;
      for (int64_t line = 0; line < kStep; line += 64) _mm_prefetch((const char*)(p + kPrefetch * kStep + line), _MM_HINT_T0);
      __m512i v[kLines];
      for (int l = 0; l < kLines; ++l) v[l] = _mm512_loadu_si512(p + 64 * l);
      const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(p + kLines * 64)));
      for (int r = 0; r < R; ++r) {
        const int32_t* a = (const int32_t*)(q + r * k + g * kBlock);
        __m512i even = _mm512_setzero_si512(), odd = _mm512_setzero_si512();
        for (int l = 0; l < kLines; l += 2) {
          even = _mm512_dpbusd_epi32(even, v[l], _mm512_set1_epi32(a[l]));
          odd = _mm512_dpbusd_epi32(odd, v[l + 1], _mm512_set1_epi32(a[l + 1]));
        }
        const __m512i dot = _mm512_sub_epi32(_mm512_add_epi32(even, odd), _mm512_set1_epi32(shifted_sum[r * groups + g]));
        const __m512 s = _mm512_mul_ps(dw, _mm512_set1_ps(scale[r * groups + g]));
        sums[t][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, sums[t][r]);
      }
    }
  }
  for (int t = 0; t < S; ++t)
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc + (t * R + r) * kTile, sums[t][r]);
}

// Tiles streamed at once for `rows` rows: what the 32 registers hold beside a tile's 8 lines (S x R sums).
constexpr int streams_for(int rows) { return rows <= 4 ? 4 : 2; }
constexpr int kMaxStreams = 4;

// A prompt's M rows times T adjacent tiles (16T outputs), every block, into `acc` (M x 16T). Each
// row's four inputs, broadcast once, meet T tiles' lines and each line, loaded once, meets M rows: 48
// loads for 64 vpdpbusd at 4 x 2, where tiles_avx512's eight rows over one tile take 72 for 64 and
// reach about half the VNNI peak on prompts (Zen 5, one core, in L2: 800 against 575 GOPS; the op on
// real-size shapes 1.4 against 1.15 TOPS on two). What bounds it now is the Q8_0 epilogue (convert,
// scale, fma a row, tile and block) on the pipes vpdpbusd uses. A row's integer sum starts at
// -128 * sum(q) instead of subtracting it after; the float operations are tiles_avx512's, in its
// order: the same bits for a row whichever path multiplies it.
template <int M, int T>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void rows_avx512(const uint8_t* w, int64_t tile_bytes,
                                                                         int64_t groups, const int8_t* q, int64_t k,
                                                                         const float* scale,
                                                                         const int32_t* shifted_sum, float* acc) {
  __m512 sums[M][T];
  for (int r = 0; r < M; ++r)
    for (int t = 0; t < T; ++t) sums[r][t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* p = w + g * kStep;
    __m512i dots[M][T];
    for (int r = 0; r < M; ++r) {
      const __m512i start = _mm512_set1_epi32(-shifted_sum[r * groups + g]);
      for (int t = 0; t < T; ++t) dots[r][t] = start;
    }
    for (int l = 0; l < kLines; ++l) {
      __m512i v[T];
      for (int t = 0; t < T; ++t) v[t] = _mm512_loadu_si512(p + t * tile_bytes + 64 * l);
      for (int r = 0; r < M; ++r) {
        const __m512i a = _mm512_set1_epi32(((const int32_t*)(q + r * k + g * kBlock))[l]);
        for (int t = 0; t < T; ++t) dots[r][t] = _mm512_dpbusd_epi32(dots[r][t], v[t], a);
      }
    }
    for (int t = 0; t < T; ++t) {
      const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(p + t * tile_bytes + kLines * 64)));
      for (int r = 0; r < M; ++r) {
        const __m512 s = _mm512_mul_ps(dw, _mm512_set1_ps(scale[r * groups + g]));
        sums[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots[r][t]), s, sums[r][t]);
      }
    }
  }
  for (int r = 0; r < M; ++r)
    for (int t = 0; t < T; ++t) _mm512_storeu_ps(acc + (r * T + t) * kTile, sums[r][t]);
}

// ---- int8 tiles to bfloat16 rows -----------------------------------------------------------------
//
// Where AMX multiplies bfloat16 (oneDNN, through torch), a prompt's product is faster as the tiles made
// bfloat16 again (w * d_w, rounded to nearest even) and multiplied by the rows as they come than on
// vpdpbusd (docs/service.md has the figures): vlserve.kernels.quantized does that from a few hundred
// rows on, one layer's matrix at a time.

// Tiles t0..t1 into rows of `out` (outputs x groups * 32). A block's eight lines are a matrix of 8 x 16
// four-byte pieces (line l, output o: o's inputs 4l..4l+3); transposed in registers, each output's 32
// inputs are one 256-bit half, widened, scaled and rounded to bfloat16 by vcvtne2ps2bf16 (to nearest
// even, as torch rounds finite values), and written as one line.
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void tiles_to_bf16(const uint8_t* tiles, int64_t t0,
                                                                          int64_t t1, int64_t groups,
                                                                          int64_t outputs, at::BFloat16* out) {
  const int64_t k = groups * kBlock;
  alignas(64) float dws[kTile];
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t rows_here = std::min(kTile, outputs - t * kTile);
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* block = tiles + (t * groups + g) * kStep;
      _mm512_store_ps(dws, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(block + kLines * 64))));
      __m512i r[kLines], pairs[kLines], quads[kLines];
      for (int l = 0; l < kLines; ++l)
        r[l] = _mm512_xor_si512(_mm512_loadu_si512(block + 64 * l), _mm512_set1_epi8((char)0x80));  // w + 128 -> w
      for (int l = 0; l < kLines; l += 2) {
        pairs[l] = _mm512_unpacklo_epi32(r[l], r[l + 1]);  // a 128-bit lane q: l, l+1 of outputs 4q, 4q + 1
        pairs[l + 1] = _mm512_unpackhi_epi32(r[l], r[l + 1]);  // ... of outputs 4q + 2, 4q + 3
      }
      for (int h = 0; h < 2; ++h)  // lines 0-3 (h = 0) and 4-7 of output 4q + j in quads[4h + j]'s lane q
        for (int j = 0; j < 2; ++j) {
          quads[4 * h + j] = _mm512_unpacklo_epi64(pairs[4 * h + j], pairs[4 * h + 2 + j]);
          quads[4 * h + 2 + j] = _mm512_unpackhi_epi64(pairs[4 * h + j], pairs[4 * h + 2 + j]);
        }
      // quads[0] = [o0 | o4 | o8 | o12] lines 0-3 (o1.. in quads[2], o2 in quads[1], o3 in quads[3])
      const int order[4] = {0, 2, 1, 3};  // quads index of output 4q + j, lines 0-3
      for (int j = 0; j < 4; ++j) {
        const __m512i low = quads[order[j]], high = quads[4 + order[j]];
        // [low.q0 high.q0 low.q1 high.q1] and [low.q2 high.q2 low.q3 high.q3]: outputs j, 4 + j | 8 + j, 12 + j
        const __m512i front = _mm512_permutex2var_epi64(low, _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11), high);
        const __m512i back = _mm512_permutex2var_epi64(low, _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15), high);
        for (int half = 0; half < 4; ++half) {
          const int64_t o = 4 * half + j;
          if (o >= rows_here) continue;
          const __m512i both = half < 2 ? front : back;
          const __m256i bytes = half % 2 == 0 ? _mm512_castsi512_si256(both) : _mm512_extracti64x4_epi64(both, 1);
          const __m512 d = _mm512_set1_ps(dws[o]);
          const __m512 first = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(bytes))), d);
          const __m512 second = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(bytes, 1))), d);
          _mm512_storeu_si512(out + (t * kTile + o) * k + g * kBlock, (__m512i)_mm512_cvtne2ps_pbh(second, first));
        }
      }
    }
  }
}

// ---- AVX2 ---------------------------------------------------------------------------------------

__attribute__((target("avx2,fma"))) inline __m256 load8(const float* x) { return _mm256_loadu_ps(x); }
__attribute__((target("avx2,fma"))) inline __m256 load8(const at::BFloat16* x) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)x)), 16));
}

template <typename T>
__attribute__((target("avx2,fma"))) void round_row_avx2(const T* x, int64_t k, int8_t* q, int8_t* magnitude,
                                                        float* scale) {
  const __m256 hi = _mm256_set1_ps(127.f), lo = _mm256_set1_ps(-127.f);
  const __m256 sign = _mm256_set1_ps(-0.f);
  for (int64_t g = 0; g < k / kBlock; ++g) {
    __m256 v[4], amax = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = load8(x + g * kBlock + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    const float d = _mm_cvtss_f32(m) / 127.f;
    scale[g] = d;
    if (d == 0.f) {
      std::fill(q + g * kBlock, q + (g + 1) * kBlock, 0);
      std::fill(magnitude + g * kBlock, magnitude + (g + 1) * kBlock, 0);
      continue;
    }
    const __m256 vd = _mm256_set1_ps(d);
    __m256i ints[4];
    for (int i = 0; i < 4; ++i) {
      const __m256 rounded = _mm256_round_ps(_mm256_div_ps(v[i], vd), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      ints[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(rounded, lo), hi));
    }
    // int32 -> int8 in input order: packs work within 128-bit halves, the permute puts them back in order.
    const __m256i words = _mm256_packs_epi32(ints[0], ints[1]), words2 = _mm256_packs_epi32(ints[2], ints[3]);
    __m256i bytes = _mm256_packs_epi16(words, words2);
    bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i*)(q + g * kBlock), bytes);
    _mm256_storeu_si256((__m256i*)(magnitude + g * kBlock), _mm256_abs_epi8(bytes));
  }
}

// R rows times one tile (16 outputs, as two halves of 8), every block, into `acc` (R x 16).
template <int R>
__attribute__((target("avx2,fma,f16c"))) void tile_avx2(const uint8_t* w, int64_t groups, const int8_t* q,
                                                        const int8_t* magnitude, int64_t k, const float* scale,
                                                        float* acc) {
  __m256 sums[R][2];
  for (int r = 0; r < R; ++r) sums[r][0] = sums[r][1] = _mm256_setzero_ps();
  const __m256i flip = _mm256_set1_epi8((char)0x80), ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* p = w + g * kStep;
    for (int64_t line = 0; line < kStep; line += 64) _mm_prefetch((const char*)(p + kPrefetch * kStep + line), _MM_HINT_T0);
    for (int h = 0; h < 2; ++h) {
      __m256i dot[R];
      for (int r = 0; r < R; ++r) dot[r] = _mm256_setzero_si256();
      for (int l = 0; l < kLines; ++l) {
        const __m256i v = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(p + 64 * l + 32 * h)), flip);
        for (int r = 0; r < R; ++r) {
          const int32_t signs = ((const int32_t*)(q + r * k + g * kBlock))[l];
          const int32_t sizes = ((const int32_t*)(magnitude + r * k + g * kBlock))[l];
          const __m256i signed_w = _mm256_sign_epi8(v, _mm256_set1_epi32(signs));
          const __m256i pairs = _mm256_maddubs_epi16(_mm256_set1_epi32(sizes), signed_w);
          dot[r] = _mm256_add_epi32(dot[r], _mm256_madd_epi16(pairs, ones));
        }
      }
      const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + kLines * 64 + 16 * h)));
      for (int r = 0; r < R; ++r) {
        const __m256 s = _mm256_mul_ps(dw, _mm256_set1_ps(scale[r * groups + g]));
        sums[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[r]), s, sums[r][h]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(acc + r * kTile, sums[r][0]);
    _mm256_storeu_ps(acc + r * kTile + 8, sums[r][1]);
  }
}

// ---- the op -------------------------------------------------------------------------------------

template <typename T>
RoundedRows round_rows(const T* x, int64_t m, int64_t k, Isa isa) {
  const int64_t groups = k / kBlock;
  RoundedRows rows;
  rows.q.resize(m * k);
  rows.scale.resize(m * groups);
  if (isa == Isa::kAvx512Vnni)
    rows.shifted_sum.resize(m * groups);
  else
    rows.magnitude.resize(m * k);
  at::parallel_for(0, m, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      if (isa == Isa::kAvx512Vnni)
        round_row_avx512(x + r * k, k, rows.q.data() + r * k, rows.scale.data() + r * groups,
                         rows.shifted_sum.data() + r * groups);
      else
        round_row_avx2(x + r * k, k, rows.q.data() + r * k, rows.magnitude.data() + r * k,
                       rows.scale.data() + r * groups);
    }
  });
  return rows;
}

// AVX2: R rows times one tile into acc (R x 16).
template <int R>
void tile_rows_avx2(const uint8_t* w, int64_t groups, const RoundedRows& rows, int64_t r0, int64_t k, float* acc) {
  tile_avx2<R>(w, groups, rows.q.data() + r0 * k, rows.magnitude.data() + r0 * k, k, rows.scale.data() + r0 * groups,
               acc);
}
using Avx2Fn = void (*)(const uint8_t*, int64_t, const RoundedRows&, int64_t, int64_t, float*);
constexpr Avx2Fn kAvx2Fns[kRowsAvx2 + 1] = {nullptr, tile_rows_avx2<1>, tile_rows_avx2<2>, tile_rows_avx2<3>,
                                            tile_rows_avx2<4>};

// AVX-512 VNNI, a decode step's R rows (fewer than kPromptFrom): one tile alone, or streams_for(R) together.
using StreamsFn = void (*)(const uint8_t* const*, int64_t, const int8_t*, int64_t, const float*, const int32_t*,
                           float*);
template <int R>
constexpr StreamsFn kStreamFns[2] = {tiles_avx512<R, 1>, tiles_avx512<R, streams_for(R)>};
constexpr const StreamsFn* kDecodeFns[kPromptFrom] = {nullptr,         kStreamFns<1>, kStreamFns<2>, kStreamFns<3>,
                                                      kStreamFns<4>,   kStreamFns<5>, kStreamFns<6>, kStreamFns<7>};

using RowsFn = void (*)(const uint8_t*, int64_t, int64_t, const int8_t*, int64_t, const float*, const int32_t*,
                       float*);
// rows_avx512 for `rows` (1 to R) rows and T tiles.
template <int T, int R = kPromptRows>
RowsFn rows_fn(int rows) {
  if constexpr (R == 1)
    return rows_avx512<1, T>;
  else
    return rows == R ? rows_avx512<R, T> : rows_fn<T, R - 1>(rows);
}
// ... and `tiles` (1 to T) tiles.
template <int T = kPromptTiles>
RowsFn pass_fn(int tiles, int rows) {
  if constexpr (T == 1)
    return rows_fn<1>(rows);
  else
    return tiles == T ? rows_fn<T>(rows) : pass_fn<T - 1>(tiles, rows);
}

// Many rows on AVX-512 VNNI: threads take 64 outputs at a time, as below, and run every row over each
// pair of their tiles in turn, kPromptRows at a time (rows outside, tiles inside: no faster).
template <typename T>
void prompt_product(const RoundedRows& rows, int64_t m, int64_t k, const uint8_t* w, int64_t tile_count,
                    const float* bias, int64_t outputs, T* po) {
  const int64_t groups = k / kBlock, tile_bytes = groups * kStep;
  at::parallel_for(0, (tile_count + kTilesPerTask - 1) / kTilesPerTask, 1, [&](int64_t p0, int64_t p1) {
    float acc[kPromptRows * kPromptTiles * kTile];
    const int64_t end = std::min(tile_count, p1 * kTilesPerTask);
    for (int64_t t = p0 * kTilesPerTask; t < end; t += kPromptTiles) {
      const int tiles_here = (int)std::min<int64_t>(kPromptTiles, end - t);
      const int64_t n0 = t * kTile, n1 = std::min(outputs, n0 + tiles_here * kTile);
      for (int64_t r0 = 0; r0 < m; r0 += kPromptRows) {
        const int rows_here = (int)std::min<int64_t>(kPromptRows, m - r0);
        pass_fn(tiles_here, rows_here)(w + t * tile_bytes, tile_bytes, groups, rows.q.data() + r0 * k, k,
                                       rows.scale.data() + r0 * groups, rows.shifted_sum.data() + r0 * groups, acc);
        for (int r = 0; r < rows_here; ++r)
          for (int64_t n = n0; n < n1; ++n) {
            const float y = acc[r * tiles_here * kTile + (n - n0)];
            po[(r0 + r) * outputs + n] = T(bias ? y + bias[n] : y);
          }
      }
    }
  });
}

template <typename T>
at::Tensor product(const at::Tensor& x, const at::Tensor& tiles, const float* bias, int64_t outputs, Isa isa) {
  const int64_t m = x.size(0), k = x.size(1), groups = k / kBlock, tile_count = tiles.size(0);
  const RoundedRows rows = round_rows(x.data_ptr<T>(), m, k, isa);
  at::Tensor out = at::empty({m, outputs}, x.options());
  const uint8_t* w = tiles.data_ptr<uint8_t>();
  T* po = out.data_ptr<T>();
  if (isa == Isa::kAvx512Vnni && m >= kPromptFrom) {
    prompt_product(rows, m, k, w, tile_count, bias, outputs, po);
    return out;
  }
  const int64_t tile_bytes = groups * kStep;
  // R rows' results for tile t, from acc (R x 16), into the outputs.
  auto store = [&](int64_t t, int64_t r0, int rows_here, const float* acc) {
    const int64_t n0 = t * kTile, n1 = std::min(outputs, n0 + kTile);
    for (int r = 0; r < rows_here; ++r)
      for (int64_t n = n0; n < n1; ++n) {
        const float y = acc[r * kTile + (n - n0)];
        po[(r0 + r) * outputs + n] = T(bias ? y + bias[n] : y);
      }
  };
  if (isa == Isa::kAvx512Vnni) {
    // Threads take 64 outputs at a time; each splits its tiles into S runs and streams the runs' i-th
    // tiles together, every row (fewer than kPromptFrom) in one pass.
    const StreamsFn* fns = kDecodeFns[m];
    const int streams = streams_for((int)m);
    at::parallel_for(0, (tile_count + kTilesPerTask - 1) / kTilesPerTask, 1, [&](int64_t p0, int64_t p1) {
      float acc[kMaxStreams * kPromptFrom * kTile];
      const uint8_t* w_at[kMaxStreams];
      const int64_t t0 = p0 * kTilesPerTask, t1 = std::min(tile_count, p1 * kTilesPerTask), run = (t1 - t0) / streams;
      for (int64_t i = 0; i < run; ++i) {
        for (int s = 0; s < streams; ++s) w_at[s] = w + (t0 + s * run + i) * tile_bytes;
        fns[1](w_at, groups, rows.q.data(), k, rows.scale.data(), rows.shifted_sum.data(), acc);
        for (int s = 0; s < streams; ++s) store(t0 + s * run + i, 0, (int)m, acc + s * m * kTile);
      }
      for (int64_t t = t0 + streams * run; t < t1; ++t) {  // the rest, one at a time
        w_at[0] = w + t * tile_bytes;
        fns[0](w_at, groups, rows.q.data(), k, rows.scale.data(), rows.shifted_sum.data(), acc);
        store(t, 0, (int)m, acc);
      }
    });
    return out;
  }
  // AVX2: threads take 64 outputs at a time and run every row over each tile of them in turn: the tile's
  // 17 KB a block of 512 inputs stays in the core's cache while the rows go by, kRowsAvx2 at a time.
  at::parallel_for(0, (tile_count + kTilesPerTask - 1) / kTilesPerTask, 1, [&](int64_t p0, int64_t p1) {
    float acc[kRowsAvx2 * kTile];
    for (int64_t t = p0 * kTilesPerTask; t < std::min(tile_count, p1 * kTilesPerTask); ++t)
      for (int64_t r0 = 0; r0 < m; r0 += kRowsAvx2) {
        const int rows_here = (int)std::min(kRowsAvx2, m - r0);
        kAvx2Fns[rows_here](w + t * tile_bytes, groups, rows, r0, k, acc);
        store(t, r0, rows_here, acc);
      }
  });
  return out;
}

}  // namespace

namespace vlserve {

at::Tensor q8_linear(const at::Tensor& x, const at::Tensor& tiles, const c10::optional<at::Tensor>& bias,
                     int64_t outputs, c10::string_view isa_name) {
  const Isa isa = parse_isa(isa_name);
  TORCH_CHECK(x.dim() == 2 && tiles.dim() == 2, "q8_linear: x must be (rows, in) and tiles 2-d");
  const int64_t k = x.size(1), groups = k / kBlock;
  TORCH_CHECK(k % kBlock == 0, "q8_linear: inputs must come in blocks of ", kBlock, ", not ", k);
  TORCH_CHECK(outputs >= 1 && tiles.size(0) == (outputs + kTile - 1) / kTile, "q8_linear: ", tiles.size(0),
              " tiles cannot hold ", outputs, " outputs");
  TORCH_CHECK(tiles.scalar_type() == at::kByte && tiles.is_contiguous() && tiles.size(1) == groups * kStep,
              "q8_linear: tiles must be contiguous uint8 of shape (", (outputs + kTile - 1) / kTile, ", ",
              groups * kStep, ")");
  TORCH_CHECK(x.size(0) >= 1, "q8_linear: no rows");
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == outputs, "q8_linear: one bias per output");
    b = bias->to(at::kFloat).contiguous();
  }
  const float* pb = b.defined() ? b.data_ptr<float>() : nullptr;
  if (x.scalar_type() == at::kBFloat16) return product<at::BFloat16>(x.contiguous(), tiles, pb, outputs, isa);
  return product<float>(x.to(at::kFloat).contiguous(), tiles, pb, outputs, isa);
}

// `into`, where given, holds the result in its first outputs x inputs values (a buffer the caller keeps:
// a fresh 50 MB tensor a call is page faults and zeroing by the kernel each time).
at::Tensor q8_bfloat16(const at::Tensor& tiles, int64_t outputs, int64_t inputs, const c10::optional<at::Tensor>& into) {
  TORCH_CHECK(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                  __builtin_cpu_supports("avx512bf16"),
              "q8_bfloat16: this CPU lacks AVX-512 BF16");
  TORCH_CHECK(inputs >= kBlock && inputs % kBlock == 0, "q8_bfloat16: inputs must come in blocks of ", kBlock);
  TORCH_CHECK(outputs >= 1 && tiles.dim() == 2 && tiles.size(0) == (outputs + kTile - 1) / kTile &&
                  tiles.size(1) == inputs / kBlock * kStep && tiles.scalar_type() == at::kByte && tiles.is_contiguous(),
              "q8_bfloat16: tiles must be contiguous uint8 of shape (", (outputs + kTile - 1) / kTile, ", ",
              inputs / kBlock * kStep, ")");
  at::Tensor out;
  if (into.has_value() && into->defined()) {
    TORCH_CHECK(into->scalar_type() == at::kBFloat16 && into->is_contiguous() && into->numel() >= outputs * inputs,
                "q8_bfloat16: `into` must be contiguous bfloat16 of at least ", outputs * inputs, " values");
    out = into->view({-1}).narrow(0, 0, outputs * inputs).view({outputs, inputs});
  } else {
    out = at::empty({outputs, inputs}, tiles.options().dtype(at::kBFloat16));
  }
  at::BFloat16* po = out.data_ptr<at::BFloat16>();
  const uint8_t* w = tiles.data_ptr<uint8_t>();
  at::parallel_for(0, tiles.size(0), 1, [&](int64_t t0, int64_t t1) {
    tiles_to_bf16(w, t0, t1, inputs / kBlock, outputs, po);
  });
  return out;
}

}  // namespace vlserve

TORCH_LIBRARY_FRAGMENT(vlserve, lib) {
  lib.def("q8_linear(Tensor x, Tensor tiles, Tensor? bias, int outputs, str isa) -> Tensor");
  lib.def("q8_bfloat16(Tensor tiles, int outputs, int inputs, Tensor? into=None) -> Tensor");
}
TORCH_LIBRARY_IMPL(vlserve, CPU, lib) {
  lib.impl("q8_linear", vlserve::q8_linear);
  lib.impl("q8_bfloat16", vlserve::q8_bfloat16);
}
