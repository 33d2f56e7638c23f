// vlserve's decode products: each level's weights times the few rows of a decode step.
//
// A decode step multiplies a few rows by every weight of the model once, so its speed is the speed
// at which the weights stream from memory. torch's stock kernels do not reach it on one row: oneDNN's
// int8 kernels (torch._int_mm and the prepacked ones) about half of it, and the int4 kernel
// (_weight_int4pack_mm_for_cpu) is bound by its dequantization to bfloat16. Both products here keep
// the weights as integers and multiply them with inputs rounded to int8 through vpdpbusd (AVX-512
// VNNI: 64 byte products a instruction), several weight rows in flight per thread. The int8 product,
// for every row count and on AVX2 too, is q8.cpp's.
//
// int4_linear: weights as levels 0..15 in groups of 32 inputs with a bfloat16 scale and low value per
// group and output (w = level * scale + low), in this file's block layout (vlserve.kernels.quantized.int4_blocks),
// one stream per 64 outputs: per block and group, four tiles of 16 outputs, each four 64-byte lines
// whose byte j of line l holds output j / 4's inputs 8l + j % 4 (low nibble) and 8l + 4 + j % 4 (high
// nibble), so one line feeds two vpdpbusd with four inputs broadcast; then the four tiles' (scale,
// low) pairs, a 32-bit word per output. The inputs are rounded to int8 per block of 32 with a scale
// each (llama.cpp's Q8_0 for its Q4 products): a group's sum is then
// scale_w * scale_x * sum(level * q) + low * scale_x * sum(q).
//
// It takes float32 or bfloat16 rows and returns the rows' dtype (bfloat16 rounded from the float32
// result): a decode step converts nothing around it.
//
// bf16_linear: the exact level's weights, plain (out, in) bfloat16, times bfloat16 rows (four at a
// time, more over panels of weights held in L2) through vdpbf16ps (AVX-512 BF16: 32 products a
// instruction, float32 sums), rounded to bfloat16 once. On
// CPUs with AMX, oneDNN runs such one-row products on AMX tiles and its speed swings between about
// 9 and 20 GB/s from one call to the next; streamed, several weight rows in flight per thread, they
// hold the memory's read speed. The sums add in another order than oneDNN's, so a result may differ from its by a
// rounding of bfloat16. Each thread prefetches the weight lines 1 KiB ahead of its streams from
// `prefetch_rows` rows on, into L1 on Intel and into L2 on AMD: on a Zen 5 EPYC (2 threads, a decode
// step's products of the real-size model, with and without in one process, interleaved) a prefetch
// cost one row 1.15x the time (87 against 75 ms; every distance and hint tried cost as much) and two
// rows 1.09x, was even at three and saved four rows 7% (the int8 and int4 products: even at one row,
// 20-25% saved at four). On a Zen 4 EPYC (the same products, the builds loaded in one process and
// taking turns, 14-16 passes, median ratio of each pass) the L1 prefetch cost one row 1.20x, two
// 1.25x and three 1.07x the time of none, where into L2 it cost one row 1.00x and saved two 13%,
// three 8% and four 16% against L1: the L1 prefetches of four streams wait on the core's few L1
// miss buffers, where L2 has more. From three rows on, AMD prefetches into L2 4 KiB ahead and from
// L2 into L1 512 bytes ahead: the products of four rows then hide more of their arithmetic (~30 ms of
// vdpbf16ps in a step) behind the reads. Zen 4, the same way (12-16 passes, four runs over an hour):
// four rows 0.84x, 0.86x, 0.92x and 0.93x the time of L2 alone (the smaller gains where the memory
// read 28-30 GB/s, the larger at 33-41), three rows 0.94x and 0.99x, two rows 1.04x (so two keep L2
// alone); 8 and 16 rows (the panels) 0.98x and 1.03x; an L1 prefetch alone at four rows 1.21x. The
// whole step of four sequences (bench-decode, the trees alternating, 6 pairs, mostly slow memory): 0.94x.
//
// rms_norm, rotary and one_query_attention: the decoder layer's small operations, each one call
// instead of the 8 (norm), 12 (rotary on a query and a key) and ~13 (attention) that transformers'
// Qwen3-VL modules and vlserve.model.attention dispatch, with the same roundings: the norm in float32,
// rounded to the rows' dtype, then times the weight and rounded again; rotary's two products and
// their sum each rounded to the dtype; attention as vlserve.model.attention's Python path (below). The
// norm and rotary are plain C++ (a decode step's rows are a few thousand values: the cost was the
// dispatch, not the arithmetic); the attention reads the cache's bfloat16 keys and values in place.
//
// Every function that uses AVX-512 is compiled for it through a target attribute, the rest of the
// file for the baseline ISA: the library loads on any x86-64 CPU, and vlserve.kernels.native calls it only
// where the CPU has AVX-512 VNNI (and bf16_linear only where it has AVX-512 BF16 too).
#include <ATen/Parallel.h>
#include <ATen/TensorIterator.h>
#include <ATen/Version.h>
#include <ATen/core/Tensor.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

#include "lanes.h"
#include "ops.h"

namespace {
constexpr int64_t kOutTile = 4;  // weight rows a prompt's pass multiplies together (and the unit threads share out)
constexpr int64_t kMaxRows = 4;  // rows multiplied in one pass over the weights (their sums in registers)
constexpr int64_t kBf16PanelBytes = 256 << 10;  // bf16_linear: weights kept in L2 while more rows pass
constexpr int64_t kBf16Chunk = 32;  // bfloat16 inputs per vdpbf16ps
constexpr int64_t kGroup = 32;        // int4: inputs per scale and low value, and per input scale
constexpr int64_t kTileOutputs = 16;  // int4: outputs per tile
constexpr int64_t kTiles = 4;         // int4: tiles per block (64 outputs), read as one stream
constexpr int64_t kBlockOutputs = kTiles * kTileOutputs;
constexpr int64_t kTileBytes = kTileOutputs * kGroup / 2;  // int4: one tile's levels for one group (four lines)
constexpr int64_t kParamBytes = kTileOutputs * 4;          // int4: one tile's (scale, low) pairs for one group
constexpr int64_t kBlockStep = kTiles * (kTileBytes + kParamBytes);  // int4: a block's bytes per group

using vlserve::lanes::load16;
using vlserve::lanes::store16;

// int4 ---------------------------------------------------------------------------------------------

// One row in blocks of 32: q (int8), each block's scale, and each block's scale times its sum of q.
template <typename T>
__attribute__((target("avx512f,avx512bw"))) void round_blocks(const T* x, int64_t k, int8_t* q, float* scale,
                                                              float* scaled_sum) {
  for (int64_t g = 0; g < k / kGroup; ++g) {
    const __m512 v0 = load16(x + g * kGroup), v1 = load16(x + g * kGroup + 16);
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

// One tile's group (16 outputs x 32 inputs), unpacked once for every row that multiplies it: the low
// nibbles masked, the high ones masked in place (16 times their level: every term of their sums a
// multiple of 16, so one shift back is exact), and the 16 outputs' bfloat16 (scale, low) pairs.
struct Int4Tile {
  __m512i low[4], high[4];
  __m512 scale, zero;
};

__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline Int4Tile unpack(const uint8_t* lines,
                                                                             const uint8_t* params) {
  const __m512i low = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8((char)0xF0);
  Int4Tile tile;
  for (int l = 0; l < 4; ++l) {
    const __m512i v = _mm512_loadu_si512(lines + 64 * l);
    tile.low[l] = _mm512_and_si512(v, low);
    tile.high[l] = _mm512_and_si512(v, high);
  }
  const __m512i pair = _mm512_loadu_si512(params);  // one 32-bit word per output: scale, then low
  tile.scale = _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));
  tile.zero = _mm512_castsi512_ps(_mm512_and_si512(pair, _mm512_set1_epi32((int)0xFFFF0000u)));
  return tile;
}

// acc += (sum of level * q) * scale_w * scale_x + low_w * (scale_x * sum q), 16 outputs, for one row's
// rounded group `q` (its scale `sx`, and `sq` = sx * sum q). Every path adds in this order, group by group.
__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline void add_row(__m512& acc, const Int4Tile& tile,
                                                                           const int8_t* q, float sx, float sq) {
  const int32_t* a = (const int32_t*)q;
  __m512i d0 = _mm512_setzero_si512(), d1 = _mm512_setzero_si512();
  for (int l = 0; l < 4; ++l) {
    d0 = _mm512_dpbusd_epi32(d0, tile.low[l], _mm512_set1_epi32(a[2 * l]));
    d1 = _mm512_dpbusd_epi32(d1, tile.high[l], _mm512_set1_epi32(a[2 * l + 1]));
  }
  const __m512i dot = _mm512_add_epi32(d0, _mm512_srai_epi32(d1, 4));
  acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(tile.scale, _mm512_set1_ps(sx)), acc);
  acc = _mm512_fmadd_ps(tile.zero, _mm512_set1_ps(sq), acc);
}

// S blocks of 64 outputs each (anywhere in the weights: `w[0..S)`, results at `out[0..S)`) for M (1 to
// 4) rows, whose inputs are `k` apart; outputs `ldo` apart: a decode step's, streamed group by group.
// Each tile is unpacked once for all the rows (a step of 4 sequences took 84.2 ms against 89.2 when each
// row re-masked it: real-size int4, 3 alternating runs). The S blocks are S streams of weights read at
// once, as q8.cpp's decode product streams its tiles: one stream a thread leaves the memory idle while
// the core unpacks and multiplies. Each block's sums are the same whatever blocks come with it.
// Far (AMD): besides the prefetch into L1 two groups ahead, one into L2 four groups ahead for one row
// and eight for more (2-vCPU Zen 4, a decode step's 28 layers of int4 products, the builds in one
// process taking turns, 20-30 passes, median ratio of each pass: four ahead took one row 0.94x and
// 0.92x the time of L1 alone, four rows 0.99x and 1.00x; eight ahead one row 0.99x and 0.98x, four
// rows 0.94x twice; the build with both, one row 0.89x and 0.91x, four rows 0.89x and 0.90x; the
// whole step in bench-decode, the trees alternating, 8 pairs: 0.93x and 0.92x); q8.cpp's
// tiles_avx512 says why.
template <int M, int S, typename O, bool Far = false>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void int4_blocks(const uint8_t* const* w, int64_t groups,
                                                                         const int8_t* q, const float* xs,
                                                                         const float* xsum, int64_t k, O* const* out,
                                                                         int64_t ldo) {
  __m512 acc[S][kTiles][M];
  for (int b = 0; b < S; ++b)
    for (int t = 0; t < kTiles; ++t)
      for (int r = 0; r < M; ++r) acc[b][t][r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    for (int b = 0; b < S; ++b) {
      const uint8_t* wg = w[b] + g * kBlockStep;
      // Every line of the group two ahead: two lines a group (the hardware prefetcher left the rest)
      // read 16-20 GB/s where this reads 18-24, about the int8 product's rate (interleaved runs).
      for (int64_t line = 0; line < kBlockStep; line += 64) {
        _mm_prefetch((const char*)(wg + 2 * kBlockStep + line), _MM_HINT_T0);
        if constexpr (Far) _mm_prefetch((const char*)(wg + (M == 1 ? 4 : 8) * kBlockStep + line), _MM_HINT_T1);
      }
      for (int t = 0; t < kTiles; ++t) {
        const Int4Tile tile = unpack(wg + t * kTileBytes, wg + kTiles * kTileBytes + t * kParamBytes);
        for (int r = 0; r < M; ++r)
          add_row(acc[b][t][r], tile, q + r * k + g * kGroup, xs[r * groups + g], xsum[r * groups + g]);
      }
    }
  }
  for (int b = 0; b < S; ++b)
    for (int t = 0; t < kTiles; ++t)
      for (int r = 0; r < M; ++r) store16(acc[b][t][r], out[b] + r * ldo + t * kTileOutputs);
}

// Blocks streamed at once by M rows: four for one row (16 sums); two for more, though four rows' 32
// sums then leave the registers (2-vCPU AMX Xeon, an up projection's blocks: one row 21-22 GB/s with
// one stream, 26-27 with two or four; four rows 17 with one, 21-22 with two or four).
// Not on AMD, where a thread reads its blocks one at a time, the hardware prefetcher following a
// single stream (2-vCPU Zen 4 EPYC, a decode step's 28 layers of int4 products in 2 MiB pages): one row
// took 0.6-0.85x the time of four streams (3 interleaved rounds: 20.9-30.7 ms against 33.2-37.6;
// eight streams 40.7-47.6); four rows 0.89x the time of two (0.76-0.94 over 16 passes, both builds
// loaded in one process and taking turns), two rows 0.98x (0.84-1.13).
constexpr int int4_streams(int m) { return m == 1 ? 4 : 2; }
constexpr int kMaxInt4Streams = 4;
using vlserve::lanes::amd_cpu;

template <typename O>
using Int4Fn = void (*)(const uint8_t* const*, int64_t, const int8_t*, const float*, const float*, int64_t, O* const*,
                        int64_t);
// [rows - 1][0]: one block alone; [rows - 1][1]: int4_streams(rows) blocks together; [rows - 1][2]:
// one block alone, prefetched Far (AMD).
template <typename O>
constexpr Int4Fn<O> kInt4Fns[kMaxRows][3] = {
    {int4_blocks<1, 1, O>, int4_blocks<1, int4_streams(1), O>, int4_blocks<1, 1, O, true>},
    {int4_blocks<2, 1, O>, int4_blocks<2, int4_streams(2), O>, int4_blocks<2, 1, O, true>},
    {int4_blocks<3, 1, O>, int4_blocks<3, int4_streams(3), O>, int4_blocks<3, 1, O, true>},
    {int4_blocks<4, 1, O>, int4_blocks<4, int4_streams(4), O>, int4_blocks<4, 1, O, true>}};

// R rows of a prompt times one block of 64 outputs, tile by tile over every group (the block stays in
// L2 while the rows pass): more rows share each unpacked tile than a decode step's 4, as q8.cpp's
// product loads a tile once for eight rows. The same sums in the same order as int4_block's, so a
// row's bits do not depend on how many came with it.
template <int R, typename O>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void int4_block_rows(const uint8_t* w, int64_t groups,
                                                                             const int8_t* q, const float* xs,
                                                                             const float* xsum, int64_t k, O* out,
                                                                             int64_t ldo) {
  for (int t = 0; t < kTiles; ++t) {
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* group = w + g * kBlockStep;
      const Int4Tile tile = unpack(group + t * kTileBytes, group + kTiles * kTileBytes + t * kParamBytes);
      for (int r = 0; r < R; ++r)
        add_row(acc[r], tile, q + r * k + g * kGroup, xs[r * groups + g], xsum[r * groups + g]);
    }
    for (int r = 0; r < R; ++r) store16(acc[r], out + r * ldo + t * kTileOutputs);
  }
}

// Rows per pass: 12 accumulators, 8 nibble vectors and the temporaries fit the 32 registers (8 rows
// measured 7% slower, 16 no faster).
constexpr int kInt4PromptRows = 12;

template <typename O>
void int4_block_rows_any(int rows, const uint8_t* w, int64_t groups, const int8_t* q, const float* xs,
                         const float* xsum, int64_t k, O* out, int64_t ldo) {
  switch (rows) {
    case 1: return int4_block_rows<1>(w, groups, q, xs, xsum, k, out, ldo);
    case 2: return int4_block_rows<2>(w, groups, q, xs, xsum, k, out, ldo);
    case 3: return int4_block_rows<3>(w, groups, q, xs, xsum, k, out, ldo);
    case 4: return int4_block_rows<4>(w, groups, q, xs, xsum, k, out, ldo);
    case 5: return int4_block_rows<5>(w, groups, q, xs, xsum, k, out, ldo);
    case 6: return int4_block_rows<6>(w, groups, q, xs, xsum, k, out, ldo);
    case 7: return int4_block_rows<7>(w, groups, q, xs, xsum, k, out, ldo);
    case 8: return int4_block_rows<8>(w, groups, q, xs, xsum, k, out, ldo);
    case 9: return int4_block_rows<9>(w, groups, q, xs, xsum, k, out, ldo);
    case 10: return int4_block_rows<10>(w, groups, q, xs, xsum, k, out, ldo);
    case 11: return int4_block_rows<11>(w, groups, q, xs, xsum, k, out, ldo);
    default: return int4_block_rows<kInt4PromptRows>(w, groups, q, xs, xsum, k, out, ldo);
  }
}

template <typename T>
at::Tensor int4_rows(const at::Tensor& x, const at::Tensor& blocks) {
  const int64_t m = x.size(0), k = x.size(1), groups = k / kGroup, n = blocks.size(0) * kBlockOutputs;
  std::vector<int8_t> q(m * k);
  std::vector<float> xs(m * groups), xsum(m * groups);
  const T* px = x.data_ptr<T>();
  for (int64_t r = 0; r < m; ++r)
    round_blocks(px + r * k, k, q.data() + r * k, xs.data() + r * groups, xsum.data() + r * groups);
  at::Tensor out = at::empty({m, n}, x.options());
  const uint8_t* pw = blocks.data_ptr<uint8_t>();
  T* po = out.data_ptr<T>();
  const int64_t stride = groups * kBlockStep;
  if (m > kMaxRows) {  // a prompt: each block's weights unpacked once per kInt4PromptRows rows (the block stays in L2)
    at::parallel_for(0, blocks.size(0), 1, [&](int64_t b0, int64_t b1) {
      for (int64_t b = b0; b < b1; ++b)
        for (int64_t r = 0; r < m; r += kInt4PromptRows)
          int4_block_rows_any((int)std::min<int64_t>(kInt4PromptRows, m - r), pw + b * stride, groups, q.data() + r * k,
                              xs.data() + r * groups, xsum.data() + r * groups, k, po + r * n + b * kBlockOutputs, n);
    });
    return out;
  }
  // Each thread splits its blocks into `streams` runs and streams the runs' i-th blocks together (on
  // AMD its blocks go one at a time, prefetched Far: int4_streams).
  const bool amd = amd_cpu();
  const int streams = int4_streams((int)m);
  const Int4Fn<T>* fns = kInt4Fns<T>[m - 1];
  const Int4Fn<T> alone = fns[amd ? 2 : 0];
  at::parallel_for(0, blocks.size(0), 1, [&](int64_t b0, int64_t b1) {
    const uint8_t* w_at[kMaxInt4Streams];
    T* out_at[kMaxInt4Streams];
    const int64_t run = amd ? 0 : (b1 - b0) / streams;
    for (int64_t i = 0; i < run; ++i) {
      for (int s = 0; s < streams; ++s) {
        w_at[s] = pw + (b0 + s * run + i) * stride;
        out_at[s] = po + (b0 + s * run + i) * kBlockOutputs;
      }
      fns[1](w_at, groups, q.data(), xs.data(), xsum.data(), k, out_at, n);
    }
    for (int64_t b = b0 + streams * run; b < b1; ++b) {  // the rest, one at a time
      w_at[0] = pw + b * stride;
      out_at[0] = po + b * kBlockOutputs;
      alone(w_at, groups, q.data(), xs.data(), xsum.data(), k, out_at, n);
    }
  });
  return out;
}

}  // namespace

namespace vlserve {
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& blocks) {
  TORCH_CHECK(x.dim() == 2 && blocks.dim() == 2, "int4_linear: x must be (rows, in) and blocks 2-d");
  const int64_t k = x.size(1), groups = k / kGroup;
  TORCH_CHECK(k % kGroup == 0, "int4_linear: inputs must come in groups of ", kGroup, ", not ", k);
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.is_contiguous() && blocks.size(1) == groups * kBlockStep,
              "int4_linear: blocks must be contiguous uint8 of shape (out / ", kBlockOutputs, ", ",
              groups * kBlockStep, ")");
  TORCH_CHECK(x.size(0) >= 1, "int4_linear: no rows");
  if (x.scalar_type() == at::kBFloat16) return int4_rows<at::BFloat16>(x.contiguous(), blocks);
  return int4_rows<float>(x.to(at::kFloat).contiguous(), blocks);
}
}  // namespace vlserve

namespace {
// bf16 ---------------------------------------------------------------------------------------------

// M rows times S weight rows anywhere in the weights (`w[0..S)`, their outputs `n[0..S)`): S streams of
// weights read at once, as q8.cpp's decode product streams its tiles. A decode step's products of the
// real-size model on the 2-vCPU AMX Xeon: one row 24 GB/s with a tile's four adjacent rows a thread at
// a time (one stream, in effect), 26-28 with four tiles apart, 28-30 with 16 rows apart, the memory
// reading 28-33 (a later day: 8 apart faster than 16, below); two rows 25 with two tiles apart, 29-31 with 8 rows apart. The same sums in the same
// order whatever rows come together, so a row's bits do not depend on the grouping.
// Where bf16_streams prefetches the weights ahead: nowhere, into L1, into L2, or both (into L2 4 KiB
// ahead and from there into L1 512 bytes ahead).
enum class Fetch { kNone, kL1, kL2, kL1L2 };

template <int M, int S, Fetch F>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void bf16_streams(const at::BFloat16* const* w, int64_t k,
                                                                          const at::BFloat16* x, const float* bias,
                                                                          const int64_t* n, at::BFloat16* out,
                                                                          int64_t ldo) {
  const int64_t chunks = k / kBf16Chunk;
  __m512 acc[S][M];
  for (int s = 0; s < S; ++s)
    for (int r = 0; r < M; ++r) acc[s][r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    __m512bh xs[M];
    for (int r = 0; r < M; ++r) xs[r] = (__m512bh)_mm512_loadu_si512(x + r * k + c * kBf16Chunk);
    for (int s = 0; s < S; ++s) {
      const at::BFloat16* p = w[s] + c * kBf16Chunk;
      if constexpr (F == Fetch::kL1) _mm_prefetch((const char*)p + 1024, _MM_HINT_T0);
      if constexpr (F == Fetch::kL2) _mm_prefetch((const char*)p + 1024, _MM_HINT_T1);
      if constexpr (F == Fetch::kL1L2) {
        _mm_prefetch((const char*)p + 4096, _MM_HINT_T1);
        _mm_prefetch((const char*)p + 512, _MM_HINT_T0);
      }
      const __m512bh v = (__m512bh)_mm512_loadu_si512(p);
      for (int r = 0; r < M; ++r) acc[s][r] = _mm512_dpbf16_ps(acc[s][r], xs[r], v);
    }
  }
  for (int s = 0; s < S; ++s)
    for (int r = 0; r < M; ++r) {
      const float y = _mm512_reduce_add_ps(acc[s][r]);
      out[r * ldo + n[s]] = at::BFloat16(bias ? y + bias[n[s]] : y);
    }
}

// Outputs n0..n1 of M bfloat16 rows: kOutTile adjacent weight rows at a time, then the rest one by one.
template <int M, Fetch F>
void bf16_outputs(const at::BFloat16* w, int64_t k, int64_t n0, int64_t n1, const at::BFloat16* x, const float* bias,
                  at::BFloat16* out, int64_t ldo) {
  const at::BFloat16* w_at[kOutTile];
  int64_t n_at[kOutTile];
  int64_t n = n0;
  for (; n + kOutTile <= n1; n += kOutTile) {
    for (int t = 0; t < kOutTile; ++t) {
      n_at[t] = n + t;
      w_at[t] = w + (n + t) * k;
    }
    bf16_streams<M, kOutTile, F>(w_at, k, x, bias, n_at, out, ldo);
  }
  for (; n < n1; ++n) {
    n_at[0] = n;
    w_at[0] = w + n * k;
    bf16_streams<M, 1, Fetch::kNone>(w_at, k, x, bias, n_at, out, ldo);
  }
}

template <int M>
void bf16_dispatch(Fetch fetch, const at::BFloat16* w, int64_t k, int64_t n0, int64_t n1, const at::BFloat16* x,
                   const float* bias, at::BFloat16* out, int64_t ldo) {
  switch (fetch) {
    case Fetch::kL1: return bf16_outputs<M, Fetch::kL1>(w, k, n0, n1, x, bias, out, ldo);
    case Fetch::kL2: return bf16_outputs<M, Fetch::kL2>(w, k, n0, n1, x, bias, out, ldo);
    case Fetch::kL1L2: return bf16_outputs<M, Fetch::kL1L2>(w, k, n0, n1, x, bias, out, ldo);
    default: return bf16_outputs<M, Fetch::kNone>(w, k, n0, n1, x, bias, out, ldo);
  }
}

// Weight rows streamed at once by M rows: as many as 16 sums allow, but eight for one row. On the
// 2-vCPU AMX Xeon (2026-12-06, bench-decode at `none`, one sequence, interleaved pairs) 16 streams took
// 153.0-159.7 ms a step and 8 took 139.2-148.8 (3 pairs, each 11-14 ms faster); 4 against 8, 127.3-133.7
// against 131.4-137.1 ms (3 pairs: within the noise), so 8, as two rows take.
// Four for one row on AMD: on a 2-vCPU Zen 4 EPYC (a decode step's 28 layers of bfloat16 products in
// 2 MiB pages, the builds loaded in one process and taking turns, 12-16 passes, five runs) one, two or
// four streams took 0.79-0.83x the time of eight in three runs, 0.96x in one and 0.99x in one (those
// two where the memory read 33-34 GB/s, the others 36-61); one stream at four rows took 1.19x.
constexpr int bf16_streams_for(int m, bool amd) { return m == 1 ? (amd ? 4 : 8) : 16 / m; }
constexpr int kMaxBf16Streams = 16;

template <int M, int S>
void bf16_fetch_dispatch(Fetch fetch, const at::BFloat16* const* w, int64_t k, const at::BFloat16* x,
                         const float* bias, const int64_t* n, at::BFloat16* out, int64_t ldo) {
  switch (fetch) {
    case Fetch::kL1: return bf16_streams<M, S, Fetch::kL1>(w, k, x, bias, n, out, ldo);
    case Fetch::kL2: return bf16_streams<M, S, Fetch::kL2>(w, k, x, bias, n, out, ldo);
    case Fetch::kL1L2: return bf16_streams<M, S, Fetch::kL1L2>(w, k, x, bias, n, out, ldo);
    default: return bf16_streams<M, S, Fetch::kNone>(w, k, x, bias, n, out, ldo);
  }
}

template <int M>
void bf16_streams_dispatch(bool amd, Fetch fetch, const at::BFloat16* const* w, int64_t k, const at::BFloat16* x,
                           const float* bias, const int64_t* n, at::BFloat16* out, int64_t ldo) {
  constexpr int S = bf16_streams_for(M, false), A = bf16_streams_for(M, true);
  if constexpr (A != S) {
    if (amd) return bf16_fetch_dispatch<M, A>(fetch, w, k, x, bias, n, out, ldo);
  }
  bf16_fetch_dispatch<M, S>(fetch, w, k, x, bias, n, out, ldo);
}

}  // namespace

namespace vlserve {
// From how many rows on bf16_linear prefetches the weights ahead (the library's choice; a caller may
// pass another to bf16_linear, as the tests do to compare sums with and without): two on AMD, where
// a prefetch cost one row 1.15x the time on Zen 5 and nothing on Zen 4, and saved two rows 13% on
// Zen 4 (the figures above); one elsewhere, as measured on Intel's Xeons (one row at 95% of the
// memory's read speed with it).
int64_t bf16_prefetch_rows() { return amd_cpu() ? 2 : 1; }

at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                       int64_t prefetch_rows) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "bf16_linear: x must be (rows, in) and weight (out, in)");
  const int64_t m = x.size(0), k = x.size(1), n = weight.size(0);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "bf16_linear: rows must be bfloat16");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.is_contiguous() && weight.size(1) == k,
              "bf16_linear: weight must be contiguous bfloat16 of shape (out, ", k, ")");
  TORCH_CHECK(k % kBf16Chunk == 0, "bf16_linear: inputs must come in multiples of ", kBf16Chunk, ", not ", k);
  TORCH_CHECK(m >= 1, "bf16_linear: no rows");
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n, "bf16_linear: one bias per output");
    b = bias->to(at::kFloat).contiguous();
  }
  const at::Tensor rows = x.contiguous();
  at::Tensor out = at::empty({m, n}, x.options());
  const at::BFloat16* pw = weight.data_ptr<at::BFloat16>();
  const at::BFloat16* px = rows.data_ptr<at::BFloat16>();
  const float* pb = b.defined() ? b.data_ptr<float>() : nullptr;
  at::BFloat16* po = out.data_ptr<at::BFloat16>();
  const int64_t tiles = (n + kOutTile - 1) / kOutTile;
  // More than four rows: a panel of outputs at a time, every group of four rows in turn; the first
  // group streams the panel's weights from memory, the others find them in L2. Each row's sums are
  // the same whatever rows come with it.
  const int64_t panel = std::max<int64_t>(kOutTile, kBf16PanelBytes / (2 * k) / kOutTile * kOutTile);
  const bool amd = amd_cpu();
  const int64_t pass_rows = std::min(m, kMaxRows);
  const Fetch prefetch = pass_rows < prefetch_rows ? Fetch::kNone
                         : !amd                    ? Fetch::kL1
                         : pass_rows >= 3          ? Fetch::kL1L2
                                                   : Fetch::kL2;
  if (m <= kMaxRows) {
    // A decode step's rows: each thread splits its outputs into S runs and streams the runs' i-th
    // weight rows together; the rest as bf16_outputs does.
    const int streams = bf16_streams_for((int)m, amd);
    at::parallel_for(0, tiles, 16, [&](int64_t t0, int64_t t1) {
      const int64_t first = t0 * kOutTile, last = std::min(n, t1 * kOutTile);
      const int64_t run = (last - first) / streams;
      const at::BFloat16* w_at[kMaxBf16Streams];
      int64_t n_at[kMaxBf16Streams];
      for (int64_t i = 0; i < run; ++i) {
        for (int s = 0; s < streams; ++s) {
          n_at[s] = first + s * run + i;
          w_at[s] = pw + n_at[s] * k;
        }
        switch (m) {
          case 1: bf16_streams_dispatch<1>(amd, prefetch, w_at, k, px, pb, n_at, po, n); break;
          case 2: bf16_streams_dispatch<2>(amd, prefetch, w_at, k, px, pb, n_at, po, n); break;
          case 3: bf16_streams_dispatch<3>(amd, prefetch, w_at, k, px, pb, n_at, po, n); break;
          default: bf16_streams_dispatch<4>(amd, prefetch, w_at, k, px, pb, n_at, po, n); break;
        }
      }
      const int64_t r0 = first + streams * run;
      if (r0 >= last) return;
      switch (m) {
        case 1: bf16_dispatch<1>(prefetch, pw, k, r0, last, px, pb, po, n); break;
        case 2: bf16_dispatch<2>(prefetch, pw, k, r0, last, px, pb, po, n); break;
        case 3: bf16_dispatch<3>(prefetch, pw, k, r0, last, px, pb, po, n); break;
        default: bf16_dispatch<4>(prefetch, pw, k, r0, last, px, pb, po, n); break;
      }
    });
    return out;
  }
  at::parallel_for(0, tiles, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t p0 = t0 * kOutTile; p0 < std::min(n, t1 * kOutTile); p0 += panel) {
      const int64_t p1 = std::min({n, t1 * kOutTile, p0 + panel});
      for (int64_t r = 0; r < m; r += kMaxRows) {
        const at::BFloat16* xr = px + r * k;
        at::BFloat16* orow = po + r * n;
        switch (std::min(kMaxRows, m - r)) {
          case 1: bf16_dispatch<1>(prefetch, pw, k, p0, p1, xr, pb, orow, n); break;
          case 2: bf16_dispatch<2>(prefetch, pw, k, p0, p1, xr, pb, orow, n); break;
          case 3: bf16_dispatch<3>(prefetch, pw, k, p0, p1, xr, pb, orow, n); break;
          default: bf16_dispatch<4>(prefetch, pw, k, p0, p1, xr, pb, orow, n); break;
        }
      }
    }
  });
  return out;
}
}  // namespace vlserve

namespace {

// transformers' Qwen3VLTextRMSNorm: weight * to_dtype(x * rsqrt(mean(x^2) + eps)), float32 inside.
template <typename T>
void norm_rows(const T* x, const T* weight, T* out, int64_t rows, int64_t d, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * d;
      T* o = out + r * d;
      float partial[8] = {0, 0, 0, 0, 0, 0, 0, 0};  // eight chains: as exact as one, and not bound by its latency
      int64_t i = 0;
      for (; i + 8 <= d; i += 8)
        for (int j = 0; j < 8; ++j) partial[j] += float(xr[i + j]) * float(xr[i + j]);
      for (; i < d; ++i) partial[0] += float(xr[i]) * float(xr[i]);
      const float sum = ((partial[0] + partial[1]) + (partial[2] + partial[3])) +
                        ((partial[4] + partial[5]) + (partial[6] + partial[7]));
      const float inverse = 1.f / std::sqrt(sum / float(d) + eps);
      for (i = 0; i < d; ++i) o[i] = T(float(weight[i]) * float(T(float(xr[i]) * inverse)));
    }
  });
}

}  // namespace

namespace vlserve {
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const int64_t d = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == d, "rms_norm: weight must be (", d, ")");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "rms_norm: x and weight must share a dtype");
  const at::Tensor rows = x.contiguous(), w = weight.contiguous();
  at::Tensor out = at::empty(x.sizes(), rows.options());
  const int64_t n = d ? rows.numel() / d : 0;
  if (x.scalar_type() == at::kBFloat16)
    norm_rows(rows.data_ptr<at::BFloat16>(), w.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), n, d, float(eps));
  else if (x.scalar_type() == at::kFloat)
    norm_rows(rows.data_ptr<float>(), w.data_ptr<float>(), out.data_ptr<float>(), n, d, float(eps));
  else
    TORCH_CHECK(false, "rms_norm: float32 or bfloat16 only, not ", x.scalar_type());
  return out;
}
}  // namespace vlserve

namespace {

// float32 -> bfloat16 (in the high half of each lane), as ATen's vectorized conversion rounds: to
// nearest even, NaN 0xFFFF.
__attribute__((target("avx512f,avx512bw"))) inline __m512i round_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  rounded = _mm512_and_si512(rounded, _mm512_set1_epi32((int)0xFFFF0000u));
  return _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32((int)0xFFFF0000u));
}

// transformers' apply_rotary_pos_emb: x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1);
// x (batch, heads, tokens, dim) with any strides, cos and sin (batch, tokens, dim), broadcast over heads.
template <typename T>
void rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  const int64_t batch = x.size(0), heads = x.size(1), tokens = x.size(2), dim = x.size(3), half = dim / 2;
  const T *px = x.data_ptr<T>(), *pc = cos.data_ptr<T>(), *ps = sin.data_ptr<T>();
  T* po = out.data_ptr<T>();
  const int64_t xb = x.stride(0), xh = x.stride(1), xt = x.stride(2), xd = x.stride(3);
  const int64_t cb = cos.stride(0), ct = cos.stride(1), cd = cos.stride(2);
  const int64_t sb = sin.stride(0), st = sin.stride(1), sd = sin.stride(2);
  at::parallel_for(0, batch * heads * tokens, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / (heads * tokens), h = i / tokens % heads, t = i % tokens;
      const T* xr = px + b * xb + h * xh + t * xt;
      const T *c = pc + b * cb + t * ct, *s = ps + b * sb + t * st;
      T* o = po + i * dim;
      for (int64_t j = 0; j < dim; ++j) {
        const float rotated = j < half ? -float(xr[(j + half) * xd]) : float(xr[(j - half) * xd]);
        o[j] = T(float(T(float(xr[j * xd]) * float(c[j * cd]))) + float(T(rotated * float(s[j * sd]))));
      }
    }
  });
}

// The vision tower's rotary (transformers' apply_rotary_pos_emb_vision): bfloat16 x widened, float32
// tables, x * cos + rotate_half(x) * sin in float32 (each product and the sum rounded to float32, as
// its three ATen calls round them), rounded once to bfloat16 as ATen's vectorized conversion rounds.
// 16 lanes at a time where the dimensions are contiguous and half of them a multiple of 16; a vision
// layer's query and key (720 patches, 16 heads of 64) took 1.7 ms through ATen's 12 calls.
__attribute__((target("avx512f,avx512bw"))) inline __m512 widen(const at::BFloat16* x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)x)), 16));
}
__attribute__((target("avx512f,avx512bw"))) inline void store_rounded(at::BFloat16* o, __m512 v) {
  _mm256_storeu_si256((__m256i*)o, _mm512_cvtepi32_epi16(_mm512_srli_epi32(round_bf16(v), 16)));
}
__attribute__((target("avx512f,avx512bw"))) inline __m512 rounded(__m512 v) {
  return _mm512_castsi512_ps(round_bf16(v));
}
__attribute__((target("avx512f,avx512bw"))) void rotate_row_wide(const at::BFloat16* x, const float* c,
                                                                 const float* s, int64_t half, at::BFloat16* o) {
  for (int64_t j = 0; j < half; j += 16) {
    const __m512 first = widen(x + j), second = widen(x + half + j);
    const __m512 negated =
        _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(second), _mm512_set1_epi32((int)0x80000000u)));
    store_rounded(o + j, _mm512_add_ps(_mm512_mul_ps(first, _mm512_loadu_ps(c + j)),
                                       _mm512_mul_ps(negated, _mm512_loadu_ps(s + j))));
    store_rounded(o + half + j, _mm512_add_ps(_mm512_mul_ps(second, _mm512_loadu_ps(c + half + j)),
                                              _mm512_mul_ps(first, _mm512_loadu_ps(s + half + j))));
  }
}
// The text model's (all bfloat16): each product rounded to bfloat16, then their sum, as ATen's mul and add
// round them; 16 lanes at a time. A 210-token prompt's query and key took 0.5 ms a layer through rotate<>.
__attribute__((target("avx512f,avx512bw"))) void rotate_row_bf16(const at::BFloat16* x, const at::BFloat16* c,
                                                                 const at::BFloat16* s, int64_t half,
                                                                 at::BFloat16* o) {
  for (int64_t j = 0; j < half; j += 16) {
    const __m512 first = widen(x + j), second = widen(x + half + j);
    const __m512 negated =
        _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(second), _mm512_set1_epi32((int)0x80000000u)));
    store_rounded(o + j, _mm512_add_ps(rounded(_mm512_mul_ps(first, widen(c + j))),
                                       rounded(_mm512_mul_ps(negated, widen(s + j)))));
    store_rounded(o + half + j, _mm512_add_ps(rounded(_mm512_mul_ps(second, widen(c + half + j))),
                                              rounded(_mm512_mul_ps(first, widen(s + half + j)))));
  }
}

// rotate_row_wide or rotate_row_bf16 over every (batch, head, token) row of x; the tables' rows by batch and token.
template <typename Table, typename Row>
void rotate_rows(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out, Row row) {
  const int64_t batch = x.size(0), heads = x.size(1), tokens = x.size(2), dim = x.size(3);
  const at::BFloat16* px = x.data_ptr<at::BFloat16>();
  const Table *pc = cos.data_ptr<Table>(), *ps = sin.data_ptr<Table>();
  at::BFloat16* po = out.data_ptr<at::BFloat16>();
  const int64_t xb = x.stride(0), xh = x.stride(1), xt = x.stride(2);
  const int64_t cb = cos.stride(0), ct = cos.stride(1), sb = sin.stride(0), st = sin.stride(1);
  at::parallel_for(0, batch * heads * tokens, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / (heads * tokens), h = i / tokens % heads, t = i % tokens;
      row(px + b * xb + h * xh + t * xt, pc + b * cb + t * ct, ps + b * sb + t * st, dim / 2, po + i * dim);
    }
  });
}

// The same where those vectors do not run: each value rounded once by c10's conversion (NaN kept, its
// payload may differ).
void rotate_wide_scalar(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out) {
  const at::Tensor wide = x.to(at::kFloat);
  const int64_t half = x.size(3) / 2;
  const at::Tensor rotated = at::cat({-wide.narrow(3, half, half), wide.narrow(3, 0, half)}, 3);
  out.copy_(wide * cos.unsqueeze(1) + rotated * sin.unsqueeze(1));
}

}  // namespace

namespace vlserve {
std::tuple<at::Tensor, at::Tensor> rotary(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos,
                                         const at::Tensor& sin) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && cos.dim() == 3 && sin.dim() == 3,
              "rotary: q and k must be (batch, heads, tokens, dim), cos and sin (batch, tokens, dim)");
  const bool wide = q.scalar_type() == at::kBFloat16 && cos.scalar_type() == at::kFloat;  // the vision tower's
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && cos.scalar_type() == sin.scalar_type() &&
                  (wide || q.scalar_type() == cos.scalar_type()),
              "rotary: q, k, cos and sin must share a dtype (or bfloat16 q and k, float32 cos and sin)");
  TORCH_CHECK(q.size(-1) % 2 == 0 && k.size(-1) == q.size(-1) && cos.size(-1) == q.size(-1), "rotary: dims differ");
  static const bool vectors = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  std::tuple<at::Tensor, at::Tensor> out;
  for (int which = 0; which < 2; ++which) {
    const at::Tensor& x = which ? k : q;
    const std::vector<int64_t> table{x.size(0), x.size(2), x.size(3)};
    const at::Tensor c = cos.expand(table), s = sin.expand(table);
    at::Tensor o = at::empty(x.sizes(), x.options());
    const bool lanes = vectors && x.stride(3) == 1 && c.stride(2) == 1 && s.stride(2) == 1 && x.size(3) % 32 == 0;
    if (wide && lanes)
      rotate_rows<float>(x, c, s, o, rotate_row_wide);
    else if (wide)
      rotate_wide_scalar(x, c, s, o);
    else if (x.scalar_type() == at::kBFloat16 && lanes)
      rotate_rows<at::BFloat16>(x, c, s, o, rotate_row_bf16);
    else if (x.scalar_type() == at::kBFloat16)
      rotate<at::BFloat16>(x, c, s, o);
    else if (x.scalar_type() == at::kFloat)
      rotate<float>(x, c, s, o);
    else
      TORCH_CHECK(false, "rotary: float32 or bfloat16 only, not ", x.scalar_type());
    (which ? std::get<1>(out) : std::get<0>(out)) = o;
  }
  return out;
}
}  // namespace vlserve

// silu_mul: the MLP's silu(gate) * up in one pass over a decode step's rows, with at::silu's and
// at::mul's bits (the decoder layer stays the Python layer's bit for bit): at::silu rounds each
// x / (1 + e^-x) to bfloat16 with libtorch_cpu's vectorized e^x (Sleef's, the same bits from its AVX2
// and AVX-512 kernels: 4M values compared), at::mul multiplies in float32 and rounds; silu_mul_exact
// says for which sizes ATen runs vectors alone. Weak, so a torch build without Sleef's symbol still loads
// the library, and its layers keep at::silu.
extern "C" __attribute__((weak)) __m512 Sleef_expf16_u10(__m512);

namespace {

// 16 of silu(x) * up in bfloat16, as at::silu's and at::mul's vectorized kernels round them.
__attribute__((target("avx512f,avx512bw"))) inline __m256i silu_times(__m512 x, __m512 up) {
  const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
  const __m512 e = Sleef_expf16_u10(_mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x), sign)));
  const __m512 silu = _mm512_castsi512_ps(round_bf16(_mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), e))));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(round_bf16(_mm512_mul_ps(silu, up)), 16));
}

// silu(gate) * up for elements [i0, i1) of the (rows, width) result, gate and up the two halves of
// each row of `gate_up`.
__attribute__((target("avx512f,avx512bw"))) void silu_mul_range(const at::BFloat16* gate_up, int64_t width,
                                                                at::BFloat16* out, int64_t i0, int64_t i1) {
  const auto gate_at = [&](int64_t i) { return gate_up + i / width * 2 * width + i % width; };
  for (int64_t i = i0; i < i1;) {
    const at::BFloat16* gate = gate_at(i);
    const int64_t whole = std::min(i1 - i, width - i % width) / 16 * 16;  // whole vectors along this row
    for (int64_t j = 0; j < whole; j += 16)
      _mm256_storeu_si256((__m256i*)(out + i + j), silu_times(load16(gate + j), load16(gate + width + j)));
    i += whole;
    if (whole > 0) continue;
    // A vector across a row's end, or the range's last few: element by element.
    const int64_t count = std::min<int64_t>(16, i1 - i);
    alignas(64) float gates[16] = {}, ups[16] = {};
    for (int64_t j = 0; j < count; ++j) {
      gates[j] = float(*gate_at(i + j));
      ups[j] = float(gate_at(i + j)[width]);
    }
    alignas(32) uint16_t part[16];
    _mm256_store_si256((__m256i*)part, silu_times(_mm512_load_ps(gates), _mm512_load_ps(ups)));
    std::memcpy(out + i, part, count * sizeof(uint16_t));
    i += count;
  }
}

}  // namespace

namespace vlserve {
bool silu_mul_exact(int64_t elements) {
  // ATen's loops leave what is past their last two vectors (64 bfloat16 on AVX-512, 32 on AVX2) to
  // scalar forms (std::exp, another NaN): every element must fall in those vectors, on each thread's
  // share (at::parallel_for's split). Without AVX2 or AVX-512 its e^x is std::exp's.
  static const bool vectors = at::get_cpu_capability() == "AVX512" || at::get_cpu_capability() == "AVX2";
  if (Sleef_expf16_u10 == nullptr || !vectors || elements % 64 != 0) return false;
  const int64_t grain = at::internal::GRAIN_SIZE;
  if (elements <= grain) return true;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), (elements + grain - 1) / grain);
  return (elements + threads - 1) / threads % 64 == 0;
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 && gate_up.scalar_type() == at::kBFloat16,
              "silu_mul: gate_up must be (rows, 2 * width) bfloat16");
  const at::Tensor rows = gate_up.contiguous();
  const int64_t width = rows.size(1) / 2, n = rows.size(0) * width;
  TORCH_CHECK(silu_mul_exact(n), "silu_mul: ", n, " elements would not round as at::silu and at::mul round them here");
  at::Tensor out = at::empty({rows.size(0), width}, rows.options());
  const at::BFloat16* in = rows.data_ptr<at::BFloat16>();
  at::BFloat16* po = out.data_ptr<at::BFloat16>();
  // A decode step's four rows of 6144 take both threads, one row stays on one.
  at::parallel_for(0, n, 8192, [&](int64_t i0, int64_t i1) { silu_mul_range(in, width, po, i0, i1); });
  return out;
}
}  // namespace vlserve

namespace {
// vlserve.model.attention's one-query attention (a decode step): q (batch, heads, 1, dim), key and value
// (batch, kv_heads, tokens, dim), views of the growing cache with any strides but a contiguous last
// dimension, dim a multiple of 16; mask None, boolean (True attends) or additive, (batch, 1, 1, tokens).
// As the Python path rounds: float32 scores from the float32 query (scaled first) and the keys read
// as float32, float32 softmax, probabilities rounded to the values' dtype, float32 sums of them times
// the values, rounded to the dtype. The query heads that share a key head read each key row once.
//
// A thread reads the cache one head at a time, a few hundred rows each, and the hardware's prefetch
// alone left those reads at 9-16 GB/s on a 2-vCPU Xeon with AMX (28 layers' keys and values for one
// and for four sequences of 280 tokens; the memory reads 27-35 GB/s there). Each row is asked for
// `kRowsAhead` rows before it is used, and near a head's end the next head's first rows: 17-23 GB/s
// (8 rows ahead about the same, 32 slower). Into L2, not L1 (2026-12-06, the same loop with the
// cache evicted between passes as a step's weights evict it, four sequences: 5.1-5.3 ms against
// 5.5-5.8; 24-48 rows ahead no better): fewer of L1's fill buffers held by rows not yet needed.
constexpr int64_t kRowsAhead = 16;

// Row `t` of a head's `tokens` rows (`stride` apart) into L2, or row t - tokens of the next head's
// (`next_rows`, nullptr after a thread's last head): prefetches do not fault, but no pointer is made
// outside the cache's buffers.
template <typename T>
__attribute__((target("avx512f,avx512bw"))) inline void prefetch_row(const T* rows, const T* next_rows, int64_t stride,
                                                                     int64_t tokens, int64_t t, int64_t bytes) {
  const T* row = nullptr;
  if (t < tokens)
    row = rows + t * stride;
  else if (next_rows != nullptr && t - tokens < tokens)
    row = next_rows + (t - tokens) * stride;
  if (row == nullptr) return;
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch((const char*)row + b, _MM_HINT_T1);
}

// One key head's scores: `group` float32 query rows (scaled) times `tokens` key rows.
template <typename T>
__attribute__((target("avx512f,avx512bw"))) void head_scores(const float* wide, int64_t group, const T* key,
                                                             int64_t key_stride, int64_t tokens, int64_t dim,
                                                             const T* next_key, float* out) {
  for (int64_t t = 0; t < tokens; ++t) {
    const T* k = key + t * key_stride;
    prefetch_row(key, next_key, key_stride, tokens, t + kRowsAhead, dim * int64_t(sizeof(T)));
    for (int64_t g = 0; g < group; ++g) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t j = 0; j < dim; j += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(wide + g * dim + j), load16(k + j), acc);
      out[g * tokens + t] = _mm512_reduce_add_ps(acc);
    }
  }
}

// A bfloat16 row of 32 as float32: its even elements (shifted up) and its odd ones (masked), one
// instruction each where load16 takes two for 16. Sums over them come in another order than load16's.
__attribute__((target("avx512f,avx512bw"))) inline void load32_split(const at::BFloat16* x, __m512& even,
                                                                     __m512& odd) {
  const __m512i v = _mm512_loadu_si512(x);
  even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000u)));
}

// The scores of Qwen3-VL's shape (bfloat16 keys, 128 values a head, two query heads a key head), eight
// key rows at a time: a row's two heads' sums fold into one vector (its halves), and eight such
// vectors into one of 16 scores by three rounds of shuffles and adds, where a reduction a head and row
// took about twice the instructions. `query` is the two heads' scaled query as even then odd elements
// (query[h][2c] the even, [2c + 1] the odd of chunk c); rows past `tokens` read `zeros`.
__attribute__((target("avx512f,avx512bw"))) void head_scores_pair_128(const __m512 (*query)[8],
                                                                       const at::BFloat16* key, int64_t key_stride,
                                                                       int64_t tokens, const at::BFloat16* next_key,
                                                                       float* out) {
  alignas(64) static const at::BFloat16 zeros[128] = {};
  // After the rounds, lanes 0-3 hold head 0's rows 0, 2, 4, 6, lanes 4-7 head 1's, lanes 8-15 the odd
  // rows the same way: `order` puts head 0's eight rows first, then head 1's.
  const __m512i order = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
  for (int64_t t0 = 0; t0 < tokens; t0 += 8) {
    __m512 folded[8];
    for (int r = 0; r < 8; ++r) {
      const int64_t t = t0 + r;
      const at::BFloat16* k = t < tokens ? key + t * key_stride : zeros;
      prefetch_row(key, next_key, key_stride, tokens, t + kRowsAhead, 256);
      __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
      for (int c = 0; c < 4; ++c) {
        __m512 even, odd;
        load32_split(k + 32 * c, even, odd);
        acc0 = _mm512_fmadd_ps(query[0][2 * c], even, acc0);
        acc1 = _mm512_fmadd_ps(query[1][2 * c], even, acc1);
        acc0 = _mm512_fmadd_ps(query[0][2 * c + 1], odd, acc0);
        acc1 = _mm512_fmadd_ps(query[1][2 * c + 1], odd, acc1);
      }
      // [head 0: lanes 0-7 + 8-15 | head 1: the same]: 128-bit quarters 0,1 of each, then 2,3.
      folded[r] = _mm512_add_ps(_mm512_shuffle_f32x4(acc0, acc1, 0x44), _mm512_shuffle_f32x4(acc0, acc1, 0xEE));
    }
    // Rows r, r + 1: quarters [r h0, r h0, r h1, r h1] -> [r h0, r h1, r+1 h0, r+1 h1], four sums each.
    __m512 four[4];
    for (int r = 0; r < 4; ++r)
      four[r] = _mm512_add_ps(_mm512_shuffle_f32x4(folded[2 * r], folded[2 * r + 1], 0x88),
                              _mm512_shuffle_f32x4(folded[2 * r], folded[2 * r + 1], 0xDD));
    // Within each quarter: two sums of each of two (row, head) pairs, then one of four.
    __m512 two[2];
    for (int r = 0; r < 2; ++r)
      two[r] = _mm512_add_ps(_mm512_shuffle_ps(four[2 * r], four[2 * r + 1], 0x44),
                             _mm512_shuffle_ps(four[2 * r], four[2 * r + 1], 0xEE));
    const __m512 one = _mm512_add_ps(_mm512_shuffle_ps(two[0], two[1], 0x88), _mm512_shuffle_ps(two[0], two[1], 0xDD));
    alignas(64) float scores[16];
    _mm512_store_ps(scores, _mm512_permutexvar_ps(order, one));
    const int64_t here = std::min<int64_t>(8, tokens - t0);
    std::copy(scores, scores + here, out + t0);
    std::copy(scores + 8, scores + 8 + here, out + tokens + t0);
  }
}

// One key head's outputs: `group` rows of probabilities times `tokens` value rows, into (group, dim).
// Qwen3-VL's shape (two query heads a key head, 128 values a head): the sums stay in 16 registers.
// bfloat16 values: each row split into even and odd elements (load32_split), every output's sum over
// the rows in the same order as the generic path's, so the same bits with half the conversions.
template <int G>
__attribute__((target("avx512f,avx512bw"))) void head_values_128_split(const float* weights,
                                                                       const at::BFloat16* value,
                                                                       int64_t value_stride, int64_t tokens,
                                                                       const at::BFloat16* next_value,
                                                                       at::BFloat16* out) {
  __m512 acc[G][8];  // [g][2c]: chunk c's even elements, [g][2c + 1] its odd ones
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < 8; ++j) acc[g][j] = _mm512_setzero_ps();
  for (int64_t t = 0; t < tokens; ++t) {
    const at::BFloat16* v = value + t * value_stride;
    prefetch_row(value, next_value, value_stride, tokens, t + kRowsAhead, 256);
    __m512 row[8];
    for (int c = 0; c < 4; ++c) load32_split(v + 32 * c, row[2 * c], row[2 * c + 1]);
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(float(at::BFloat16(weights[g * tokens + t])));  // as the Python path rounds
      for (int j = 0; j < 8; ++j) acc[g][j] = _mm512_fmadd_ps(p, row[j], acc[g][j]);
    }
  }
  const __m512i low = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i high = _mm512_add_epi32(low, _mm512_set1_epi32(8));
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 4; ++c) {
      store16(_mm512_permutex2var_ps(acc[g][2 * c], low, acc[g][2 * c + 1]), out + g * 128 + 32 * c);
      store16(_mm512_permutex2var_ps(acc[g][2 * c], high, acc[g][2 * c + 1]), out + g * 128 + 32 * c + 16);
    }
}

template <typename T, int G>
__attribute__((target("avx512f,avx512bw"))) void head_values_128(const float* weights, const T* value,
                                                                 int64_t value_stride, int64_t tokens,
                                                                 const T* next_value, T* out) {
  __m512 acc[G][8];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < 8; ++j) acc[g][j] = _mm512_setzero_ps();
  for (int64_t t = 0; t < tokens; ++t) {
    const T* v = value + t * value_stride;
    prefetch_row(value, next_value, value_stride, tokens, t + kRowsAhead, 128 * int64_t(sizeof(T)));
    __m512 row[8];
    for (int j = 0; j < 8; ++j) row[j] = load16(v + 16 * j);
    for (int g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(float(T(weights[g * tokens + t])));  // rounded as the Python path rounds
      for (int j = 0; j < 8; ++j) acc[g][j] = _mm512_fmadd_ps(p, row[j], acc[g][j]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < 8; ++j) store16(acc[g][j], out + g * 128 + 16 * j);
}

template <typename T>
__attribute__((target("avx512f,avx512bw"))) void head_values(const float* weights, int64_t group, const T* value,
                                                             int64_t value_stride, int64_t tokens, int64_t dim,
                                                             const T* next_value, float* acc, T* out) {
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (dim == 128 && group == 2)
      return head_values_128_split<2>(weights, value, value_stride, tokens, next_value, out);
  }
  if (dim == 128 && group == 2) return head_values_128<T, 2>(weights, value, value_stride, tokens, next_value, out);
  if (dim == 128 && group == 1) return head_values_128<T, 1>(weights, value, value_stride, tokens, next_value, out);
  std::fill(acc, acc + group * dim, 0.f);
  for (int64_t t = 0; t < tokens; ++t) {
    const T* v = value + t * value_stride;
    prefetch_row(value, next_value, value_stride, tokens, t + kRowsAhead, dim * int64_t(sizeof(T)));
    for (int64_t g = 0; g < group; ++g) {
      const __m512 p = _mm512_set1_ps(float(T(weights[g * tokens + t])));  // rounded as the Python path rounds
      for (int64_t j = 0; j < dim; j += 16)
        _mm512_storeu_ps(acc + g * dim + j, _mm512_fmadd_ps(p, load16(v + j), _mm512_loadu_ps(acc + g * dim + j)));
    }
  }
  for (int64_t j = 0; j < group * dim; j += 16) store16(_mm512_loadu_ps(acc + j), out + j);
}

// head_scores_pair_128 with the two heads' scaled query (`wide`, 256 floats) split into even and odd elements.
__attribute__((target("avx512f,avx512bw"))) inline void scores_pair_128(const float* wide, const at::BFloat16* key,
                                                                         int64_t key_stride, int64_t tokens,
                                                                         const at::BFloat16* next_key, float* out) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  __m512 query[2][8];
  for (int h = 0; h < 2; ++h)
    for (int c = 0; c < 4; ++c) {
      const __m512 lo = _mm512_loadu_ps(wide + h * 128 + 32 * c), hi = _mm512_loadu_ps(wide + h * 128 + 32 * c + 16);
      query[h][2 * c] = _mm512_permutex2var_ps(lo, even, hi);
      query[h][2 * c + 1] = _mm512_permutex2var_ps(lo, odd, hi);
    }
  head_scores_pair_128(query, key, key_stride, tokens, next_key, out);
}

// Softmax of one row of `tokens` float32 scores, in place (masked scores are -inf): e^(s - max) by
// exp_nonpositive, then each times the reciprocal of their sum, as torch's softmax on a last dimension
// takes it; a row with nothing to attend to gets zeros.
__attribute__((target("avx512f,avx512bw"))) void softmax_in_place(float* s, int64_t tokens) {
  const __m512 minus_infinity = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const auto part = [&](int64_t t) {
    return tokens - t >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (tokens - t)) - 1);
  };
  __m512 high = minus_infinity;
  for (int64_t t = 0; t < tokens; t += 16)
    high = _mm512_max_ps(high, _mm512_mask_loadu_ps(minus_infinity, part(t), s + t));
  const float top = _mm512_reduce_max_ps(high);
  if (top == -std::numeric_limits<float>::infinity()) {
    std::fill(s, s + tokens, 0.f);
    return;
  }
  __m512 total = _mm512_setzero_ps();
  for (int64_t t = 0; t < tokens; t += 16) {
    const __mmask16 real = part(t);
    const __m512 shifted = _mm512_sub_ps(_mm512_mask_loadu_ps(minus_infinity, real, s + t), _mm512_set1_ps(top));
    const __m512 e = vlserve::lanes::exp_nonpositive(shifted);  // 0 for the -inf lanes past the row
    _mm512_mask_storeu_ps(s + t, real, e);
    total = _mm512_add_ps(total, e);
  }
  const __m512 inverse = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(total));
  for (int64_t t = 0; t < tokens; t += 16) {
    const __mmask16 real = part(t);
    _mm512_mask_storeu_ps(s + t, real, _mm512_mul_ps(_mm512_maskz_loadu_ps(real, s + t), inverse));
  }
}

// The whole attention of one query a sequence, one key head at a time in one parallel region: its
// scores, mask and softmax stay in the thread's buffer between the two products; while a head's
// scores finish its values are prefetched, while its values finish the next head's keys. Three
// regions with torch's softmax between them cost 17 us a call for one sequence and 34 for four; in
// one, 28 layers' attention over 257 cached tokens took 0.91-0.93x the time at four sequences and
// 0.82x at one (2-vCPU Zen 4, both builds in one process taking turns, 40 passes each, caches evicted
// between). The same bits in bfloat16 wherever tested: the weights' rounding to bfloat16 hides the
// two softmaxes' last-place differences. `mask`: additive float32 (1 or batch rows, tokens), or undefined.
template <typename T>
void attend(const at::Tensor& q, const at::Tensor& key, const at::Tensor& value, const at::Tensor& mask, float scale,
            at::Tensor& out) {
  const int64_t kv_heads = key.size(1), tokens = key.size(2), dim = key.size(3), group = q.size(1) / kv_heads;
  const T *pq = q.data_ptr<T>(), *pk = key.data_ptr<T>(), *pv = value.data_ptr<T>();
  T* po = out.data_ptr<T>();  // (batch, 1, heads, dim), contiguous: key head h's rows are h * group ..
  const float* pm = mask.defined() ? mask.data_ptr<float>() : nullptr;
  const int64_t mask_step = mask.defined() && mask.size(0) > 1 ? tokens : 0;
  const bool same_strides = key.strides() == value.strides();  // prefetch_row steps both by one stride
  const auto head_of = [&](const T* base, const at::Tensor& t, int64_t i) {
    return base + i / kv_heads * t.stride(0) + i % kv_heads * t.stride(1);
  };
  at::parallel_for(0, key.size(0) * kv_heads, 1, [&](int64_t i0, int64_t i1) {
    std::vector<float> wide(group * dim), scores(group * tokens), acc(group * dim);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / kv_heads, h = i % kv_heads;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t j = 0; j < dim; ++j)
          wide[g * dim + j] = float(pq[b * q.stride(0) + (h * group + g) * q.stride(1) + j]) * scale;
      const T *keys = head_of(pk, key, i), *values = head_of(pv, value, i);
      const T* after_keys = same_strides ? values : nullptr;
      const T* after_values = same_strides && i + 1 < i1 ? head_of(pk, key, i + 1) : nullptr;
      bool paired = false;
      if constexpr (std::is_same_v<T, at::BFloat16>) {
        if (dim == 128 && group == 2) {
          scores_pair_128(wide.data(), keys, key.stride(2), tokens, after_keys, scores.data());
          paired = true;
        }
      }
      if (!paired) head_scores(wide.data(), group, keys, key.stride(2), tokens, dim, after_keys, scores.data());
      for (int64_t g = 0; g < group; ++g) {
        float* row = scores.data() + g * tokens;
        if (pm != nullptr)
          for (int64_t t = 0; t < tokens; ++t) row[t] += pm[b * mask_step + t];
        softmax_in_place(row, tokens);
      }
      head_values(scores.data(), group, values, value.stride(2), tokens, dim, after_values, acc.data(),
                  po + i * group * dim);
    }
  });
}

}  // namespace

namespace vlserve {
at::Tensor one_query_attention(const at::Tensor& q, const at::Tensor& key, const at::Tensor& value,
                               const c10::optional<at::Tensor>& mask, double scale) {
  TORCH_CHECK(q.dim() == 4 && key.dim() == 4 && value.dim() == 4 && q.size(2) == 1,
              "one_query_attention: q must be (batch, heads, 1, dim), key and value (batch, kv_heads, tokens, dim)");
  const int64_t batch = key.size(0), kv_heads = key.size(1), tokens = key.size(2), dim = key.size(3);
  TORCH_CHECK(q.size(0) == batch && value.sizes() == key.sizes() && q.size(3) == dim && q.size(1) % kv_heads == 0,
              "one_query_attention: shapes do not match");
  TORCH_CHECK(dim % 16 == 0 && key.stride(3) == 1 && value.stride(3) == 1 && q.stride(3) == 1,
              "one_query_attention: dim must be a multiple of 16 and contiguous");
  TORCH_CHECK(q.scalar_type() == key.scalar_type() && q.scalar_type() == value.scalar_type() &&
                  (q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat),
              "one_query_attention: q, key and value must be all float32 or all bfloat16");
  // As the Python path applies a mask: False never attends, a float one is added.
  at::Tensor additive;
  if (mask.has_value() && mask->defined()) {
    const at::Tensor m = mask->reshape({mask->size(0), tokens});
    TORCH_CHECK(m.size(0) == 1 || m.size(0) == batch, "one_query_attention: the mask's rows are not the batch's");
    additive = m.scalar_type() == at::kBool ? at::zeros(m.sizes(), m.options().dtype(at::kFloat))
                                                  .masked_fill_(m.logical_not(), -std::numeric_limits<float>::infinity())
                                            : m.to(at::kFloat).contiguous();
  }
  at::Tensor out = at::empty({batch, 1, q.size(1), dim}, q.options());
  if (q.scalar_type() == at::kBFloat16)
    attend<at::BFloat16>(q, key, value, additive, float(scale), out);
  else
    attend<float>(q, key, value, additive, float(scale), out);
  return out;
}
}  // namespace vlserve

TORCH_LIBRARY(vlserve, lib) {
  lib.def("int4_linear(Tensor x, Tensor blocks) -> Tensor");
  lib.def("bf16_linear(Tensor x, Tensor weight, Tensor? bias, int prefetch_rows) -> Tensor");
  lib.def("bf16_prefetch_rows() -> int", vlserve::bf16_prefetch_rows);  // no tensors to dispatch on: one kernel
  lib.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  lib.def("rotary(Tensor q, Tensor k, Tensor cos, Tensor sin) -> (Tensor, Tensor)");
  lib.def("one_query_attention(Tensor q, Tensor key, Tensor value, Tensor? mask, float scale) -> Tensor");
  lib.def("silu_mul(Tensor gate_up) -> Tensor");
  lib.def("silu_mul_exact(int elements) -> bool", vlserve::silu_mul_exact);  // no tensors: one kernel
}
TORCH_LIBRARY_IMPL(vlserve, CPU, lib) {
  lib.impl("int4_linear", vlserve::int4_linear);
  lib.impl("bf16_linear", vlserve::bf16_linear);
  lib.impl("rms_norm", vlserve::rms_norm);
  lib.impl("rotary", vlserve::rotary);
  lib.impl("one_query_attention", vlserve::one_query_attention);
  lib.impl("silu_mul", vlserve::silu_mul);
}
