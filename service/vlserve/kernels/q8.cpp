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
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <memory>
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
constexpr int64_t kPrefetchL2 = 8;                   // on AMD: blocks ahead prefetched into L2 (tiles_avx512's Far)
constexpr int64_t kPrefetchL1 = 2;                   // and from there into L1
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
using vlserve::lanes::store16;

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
// Far (AMD): each stream prefetched into L2 kPrefetchL2 blocks ahead and into L1 kPrefetchL1 ahead,
// where Intel's Xeons take kPrefetch ahead into L1. A 2-vCPU Zen 4 core keeps too few lines in flight
// through L1's miss buffers to hold the memory's speed (a plain read of 2 GiB on two threads: 4 KiB
// ahead into L2 read 36-60 GB/s where 1 KiB into L1 read 34-52, the same minutes); a decode step's 28
// layers of int8 products (the builds in one process, taking turns, 20-24 passes, median ratio of each
// pass, five runs) took 0.85-0.95x the time at one row and 0.78-0.98x at four, the smaller gains in
// the VM's minutes of slow memory (~30 GB/s); the whole step (bench-decode, the trees alternating, 8
// pairs, mostly slow memory) 0.96x at one sequence, 0.94x at four.
template <int R, int S, bool Far>
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
      for (int64_t line = 0; line < kStep; line += 64) {
        if constexpr (Far) {
          _mm_prefetch((const char*)(p + kPrefetchL2 * kStep + line), _MM_HINT_T1);
          _mm_prefetch((const char*)(p + kPrefetchL1 * kStep + line), _MM_HINT_T0);
        } else {
          _mm_prefetch((const char*)(p + kPrefetch * kStep + line), _MM_HINT_T0);
        }
      }
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
// Fewer on AMD: on a 2-vCPU Zen 4 EPYC (a decode step's 28 layers of int8 products in 2 MiB pages, the
// builds loaded in one process and taking turns, 16-26 passes, median ratio of each pass against four
// streams) one stream took 0.75-0.93x the time at one row, 0.79x at two and 0.89x at three (two
// streams 0.96x, 0.87x, 0.98x); at four rows two streams took 0.83x and one 0.89x.
constexpr int streams_for(int rows, bool amd) {
  if (amd) return rows <= 3 ? 1 : 2;
  return rows <= 4 ? 4 : 2;
}
constexpr int kMaxStreams = 4;
using vlserve::lanes::amd_cpu;

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

// ---- AMX: many bfloat16 rows times the tiles made bfloat16 in the cache ---------------------------
//
// On CPUs with AMX its bfloat16 tiles multiply faster than vpdpbusd, so a prompt's or image's rows
// (vlserve.kernels.native.AMX_PROMPT_ROWS and more, bfloat16) are multiplied as they come, unrounded,
// by the weight made bfloat16 (w * d_w, rounded to nearest even) a few tiles at a time into a buffer
// that stays in the core's L2: the weight is read once, as int8, and no bfloat16 copy of a layer is
// written to memory. On a 2-vCPU Xeon with AMX (two threads), the decoder's products of a 200-row
// prompt, all 28 layers: 351 ms against 452 for the layer made bfloat16 then multiplied by oneDNN (the
// route before) and 338 for oneDNN on a bfloat16 weight (`none`); 647 rows 858-966 against 1033-1107
// and 864-946; the vision tower's (720 rows) within 5% of the route before. What remains behind
// `none` is the conversion itself, ~60 ns a block of 512 weights a core (the shifts, conversions and
// multiplies of block_to_amx on the two vector ports), paid once a call whatever the rows.

constexpr int64_t kAmxTile = 16 * 64;          // an AMX bfloat16 B tile: 16 input pairs x 16 outputs x 2
constexpr int64_t kAmxRows = 32;               // rows a pass: two A tiles
constexpr int64_t kAmxBlockBytes = 1 << 20;    // converted tiles a task keeps in L2: 1 MiB
constexpr int64_t kAmxChunk = 2048;            // inputs at most a chunk: 16 tiles of them fill kAmxBlockBytes
struct alignas(64) TileConfig {                // ldtilecfg's 64 bytes, palette 1
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

// Whether Linux lets this process use AMX's tile data (asked once; kernels before 5.16 do not).
bool amx_permitted_once() {
  static const bool permitted = [] {
    constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return permitted;
}

// One block of a tile (16 outputs x 32 inputs) into a B tile, whose row r holds inputs 2r, 2r + 1 of
// each output. A line's dword o is output o's inputs 4l..4l+3: shifts sign-extend each input into
// lane o, where output o's scale multiplies it (w * d_w in float32, the Q8_0 weight), and
// vpermw pairs two inputs' bfloat16 (vcvtne2ps2bf16: nearest even) per output.
__attribute__((target("avx512f,avx512bw,avx512bf16"))) inline void block_to_amx(const uint8_t* block, uint8_t* tile) {
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(block + kLines * 64)));
  const __m512i pairs = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int l = 0; l < kLines; ++l) {
    const __m512i v = _mm512_xor_si512(_mm512_loadu_si512(block + 64 * l), _mm512_set1_epi8((char)0x80));  // w
    const __m512 w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 24), 24)), d);
    const __m512 w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 16), 24)), d);
    const __m512 w2 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 8), 24)), d);
    const __m512 w3 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srai_epi32(v, 24)), d);
    _mm512_store_si512(tile + 2 * l * 64, _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(w1, w0)));
    _mm512_store_si512(tile + (2 * l + 1) * 64, _mm512_permutexvar_epi16(pairs, (__m512i)_mm512_cvtne2ps_pbh(w3, w2)));
  }
}

// kAmxRows rows (A tiles 4 and 5, rows `row_bytes` apart) times T tiles of 16 outputs (B tiles 6 and 7,
// each tile's blocks kAmxTile apart) over `groups` blocks, added to the sums at c_in (C tiles 0-3, rows
// `in_stride` bytes apart; none: zeros) and stored at c_out (rows `out_stride` bytes apart).
template <int T>
__attribute__((target("amx-tile,amx-bf16"))) void rows_amx(const uint8_t* a, int64_t row_bytes, const uint8_t* b0,
                                                           const uint8_t* b1, int64_t groups, const float* c_in,
                                                           int64_t in_stride, float* c_out, int64_t out_stride) {
  if (c_in) {
    _tile_loadd(0, c_in, in_stride);
    _tile_loadd(2, (const uint8_t*)c_in + 16 * in_stride, in_stride);
    if (T == 2) {
      _tile_loadd(1, c_in + 16, in_stride);
      _tile_loadd(3, (const uint8_t*)(c_in + 16) + 16 * in_stride, in_stride);
    }
  } else {
    _tile_zero(0);
    _tile_zero(2);
    if (T == 2) {
      _tile_zero(1);
      _tile_zero(3);
    }
  }
  for (int64_t g = 0; g < groups; ++g) {
    _tile_loadd(4, a + g * 64, row_bytes);
    _tile_loadd(5, a + 16 * row_bytes + g * 64, row_bytes);
    _tile_loadd(6, b0 + g * kAmxTile, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(2, 5, 6);
    if (T == 2) {
      _tile_loadd(7, b1 + g * kAmxTile, 64);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, c_out, out_stride);
  _tile_stored(2, (uint8_t*)c_out + 16 * out_stride, out_stride);
  if (T == 2) {
    _tile_stored(1, c_out + 16, out_stride);
    _tile_stored(3, (uint8_t*)(c_out + 16) + 16 * out_stride, out_stride);
  }
}

// `rows` results (16T floats each in acc) for outputs n0..n1, plus the bias, rounded to bfloat16 into
// out (rows `outputs` apart).
__attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16"))) void store_amx(const float* acc, int t, int64_t rows,
                                                                               int64_t n0, int64_t n1,
                                                                               const float* bias, at::BFloat16* out,
                                                                               int64_t outputs) {
  for (int64_t c = n0; c < n1; c += kTile) {
    const __mmask16 mask = (__mmask16)((1u << std::min<int64_t>(kTile, n1 - c)) - 1);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + c) : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; ++r) {
      const __m512 y = _mm512_add_ps(_mm512_loadu_ps(acc + r * t * kTile + (c - n0)), b);
      _mm256_mask_storeu_epi16(out + r * outputs + c, mask, (__m256i)_mm512_cvtneps_pbh(y));
    }
  }
}

// Every tile register as 16 rows of 64 bytes. GCC 12's _tile_loadconfig names only 8 bytes of the
// config as read, which lets the compiler drop the stores before it: the whole struct is the operand.
__attribute__((target("amx-tile"))) void configure_amx() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.bytes_per_row[t] = 64;
  }
  asm volatile("ldtilecfg %0" ::"m"(config));
}
__attribute__((target("amx-tile"))) void release_amx() { _tile_release(); }

// Threads take a few tiles at a time and every 32 rows over them, in chunks of at most kAmxChunk inputs:
// the chunk's tiles, converted (at most kAmxBlockBytes), stay in L2 while the rows stream by. Each pass
// over the tiles reads all the rows again, so the tiles a task takes are as many as fit; long inputs
// (6144) take their chunks in turn, their sums kept in float32 between chunks, rather than 4 tiles at a
// time: at 647 rows, 2048 x 6144 took 8.7 ms that way against 6.6 for oneDNN on a bfloat16 weight.
at::Tensor product_amx(const at::Tensor& x, const uint8_t* w, int64_t tile_count, const float* bias,
                       int64_t outputs) {
  const int64_t m = x.size(0), k = x.size(1), groups = k / kBlock, row_bytes = k * 2;
  at::Tensor out = at::empty({m, outputs}, x.options());
  const uint8_t* rows = (const uint8_t*)x.data_ptr();
  at::BFloat16* po = out.data_ptr<at::BFloat16>();
  const int64_t chunks = (groups + kAmxChunk / kBlock - 1) / (kAmxChunk / kBlock);
  const int64_t chunk = (groups + chunks - 1) / chunks;  // groups a chunk, the chunks as even as they come
  const int64_t per_task = std::max<int64_t>(2, std::min<int64_t>(32, kAmxBlockBytes / (chunk * kAmxTile))) / 2 * 2;
  const int64_t padded_rows = (m + kAmxRows - 1) / kAmxRows * kAmxRows;
  // The last few rows, zero-padded to two full A tiles, once a call (every task reads them).
  std::vector<uint8_t> padded(m % kAmxRows ? kAmxRows * row_bytes : 0, 0);
  std::copy(rows + (m - m % kAmxRows) * row_bytes, rows + m * row_bytes, padded.begin());
  at::parallel_for(0, (tile_count + per_task - 1) / per_task, 1, [&](int64_t p0, int64_t p1) {
    configure_amx();
    // Written before read: left uninitialised (zeroing 1 MiB a call and thread cost ~7% of small calls).
    std::unique_ptr<uint8_t[]> space(new uint8_t[per_task * chunk * kAmxTile + 64]);
    uint8_t* converted = (uint8_t*)(((uintptr_t)space.get() + 63) & ~(uintptr_t)63);
    std::unique_ptr<float[]> sums(new float[chunks > 1 ? padded_rows * per_task * kTile : 1]);  // between chunks
    const int64_t sums_stride = per_task * kTile * sizeof(float);
    alignas(64) float acc[kAmxRows * 2 * kTile];
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t t0 = p * per_task, t1 = std::min(tile_count, t0 + per_task);
      for (int64_t g0 = 0; g0 < groups; g0 += chunk) {
        const int64_t g1 = std::min(groups, g0 + chunk), here = g1 - g0;
        const bool first = g0 == 0, last = g1 == groups;
        for (int64_t t = t0; t < t1; ++t)
          for (int64_t g = g0; g < g1; ++g)
            block_to_amx(w + (t * groups + g) * kStep, converted + ((t - t0) * here + g - g0) * kAmxTile);
        for (int64_t r0 = 0; r0 < m; r0 += kAmxRows) {
          const int64_t rows_here = std::min(kAmxRows, m - r0);
          const uint8_t* a = rows_here < kAmxRows ? padded.data() : rows + r0 * row_bytes;
          for (int64_t t = t0; t < t1; t += 2) {
            const uint8_t* b = converted + (t - t0) * here * kAmxTile;
            const int pair = t + 1 < t1 ? 2 : 1;
            float* kept = sums.get() + r0 * per_task * kTile + (t - t0) * kTile;
            const float* c_in = first ? nullptr : kept;
            float* c_out = last ? acc : kept;
            const int64_t out_stride = last ? pair * kTile * sizeof(float) : sums_stride;
            if (pair == 2)
              rows_amx<2>(a + g0 * 64, row_bytes, b, b + here * kAmxTile, here, c_in, sums_stride, c_out, out_stride);
            else
              rows_amx<1>(a + g0 * 64, row_bytes, b, nullptr, here, c_in, sums_stride, c_out, out_stride);
            if (last)
              store_amx(acc, pair, rows_here, t * kTile, std::min(outputs, (t + pair) * kTile), bias,
                        po + r0 * outputs, outputs);
          }
        }
      }
    }
    release_amx();
  });
  return out;
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

// AVX-512 VNNI, a decode step's R rows (fewer than kPromptFrom): one tile alone ([0]), or
// streams_for(R, amd) together ([1]); elsewhere, then on AMD ([2] and [3], prefetching Far).
using StreamsFn = void (*)(const uint8_t* const*, int64_t, const int8_t*, int64_t, const float*, const int32_t*,
                           float*);
template <int R>
constexpr StreamsFn kStreamFns[4] = {tiles_avx512<R, 1, false>, tiles_avx512<R, streams_for(R, false), false>,
                                     tiles_avx512<R, 1, true>, tiles_avx512<R, streams_for(R, true), true>};
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

// One row's results for a tile's `count` (up to 16) outputs, plus the bias if any, into `out`.
template <typename T>
__attribute__((target("avx512f,avx512bw"))) void store_tile(const float* acc, const float* bias, int64_t count, T* out) {
  if (count == kTile) {
    const __m512 y = _mm512_loadu_ps(acc);
    store16(bias ? _mm512_add_ps(y, _mm512_loadu_ps(bias)) : y, out);
    return;
  }
  for (int64_t n = 0; n < count; ++n) out[n] = T(bias ? acc[n] + bias[n] : acc[n]);
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
          for (int64_t n = n0; n < n1; n += kTile)
            store_tile(acc + r * tiles_here * kTile + (n - n0), bias ? bias + n : nullptr, std::min(kTile, n1 - n),
                       po + (r0 + r) * outputs + n);
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
    const bool amd = amd_cpu();
    const StreamsFn* fns = kDecodeFns[m] + (amd ? 2 : 0);
    const StreamsFn together = fns[1];
    const int streams = streams_for((int)m, amd);
    at::parallel_for(0, (tile_count + kTilesPerTask - 1) / kTilesPerTask, 1, [&](int64_t p0, int64_t p1) {
      float acc[kMaxStreams * kPromptFrom * kTile];
      const uint8_t* w_at[kMaxStreams];
      const int64_t t0 = p0 * kTilesPerTask, t1 = std::min(tile_count, p1 * kTilesPerTask), run = (t1 - t0) / streams;
      for (int64_t i = 0; i < run; ++i) {
        for (int s = 0; s < streams; ++s) w_at[s] = w + (t0 + s * run + i) * tile_bytes;
        together(w_at, groups, rows.q.data(), k, rows.scale.data(), rows.shifted_sum.data(), acc);
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

bool amx_permitted() { return amx_permitted_once(); }

at::Tensor q8_amx(const at::Tensor& x, const at::Tensor& tiles, const c10::optional<at::Tensor>& bias,
                  int64_t outputs) {
  TORCH_CHECK(__builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("amx-bf16") && amx_permitted_once(),
              "q8_amx: this CPU lacks AMX BF16, or Linux refuses its tiles to this process");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.size(0) >= 1, "q8_amx: x must be (rows, in) bfloat16");
  const int64_t k = x.size(1), groups = k / kBlock;
  TORCH_CHECK(k >= kBlock && k % kBlock == 0, "q8_amx: inputs must come in blocks of ", kBlock, ", not ", k);
  TORCH_CHECK(outputs >= 1 && tiles.dim() == 2 && tiles.size(0) == (outputs + kTile - 1) / kTile &&
                  tiles.size(1) == groups * kStep && tiles.scalar_type() == at::kByte && tiles.is_contiguous(),
              "q8_amx: tiles must be contiguous uint8 of shape (", (outputs + kTile - 1) / kTile, ", ", groups * kStep,
              ")");
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == outputs, "q8_amx: one bias per output");
    b = bias->to(at::kFloat).contiguous();
  }
  return product_amx(x.contiguous(), tiles.data_ptr<uint8_t>(), tiles.size(0), b.defined() ? b.data_ptr<float>() : nullptr,
                     outputs);
}

}  // namespace vlserve

TORCH_LIBRARY_FRAGMENT(vlserve, lib) {
  lib.def("q8_linear(Tensor x, Tensor tiles, Tensor? bias, int outputs, str isa) -> Tensor");
  lib.def("q8_amx(Tensor x, Tensor tiles, Tensor? bias, int outputs) -> Tensor");
  lib.def("amx_permitted() -> bool", vlserve::amx_permitted);  // no tensors to dispatch on: one kernel
}
TORCH_LIBRARY_IMPL(vlserve, CPU, lib) {
  lib.impl("q8_linear", vlserve::q8_linear);
  lib.impl("q8_amx", vlserve::q8_amx);
}
