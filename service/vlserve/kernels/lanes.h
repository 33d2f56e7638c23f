// AVX-512 helpers more than one source uses. The sources are compiled as one translation unit
// (vlserve.kernels.native), so a helper two of them need lives here once.
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

namespace vlserve::lanes {

// Whether the CPU is AMD's: the decode products' streams per thread and every read's prefetch depend
// on it (a Zen 4 EPYC reads quantized weights fastest with fewer streams than Intel's Xeons, and
// streams memory fastest with lines prefetched far ahead into L2: decode_vnni.cpp, q8.cpp,
// stream_read.cpp).
inline bool amd_cpu() {
  static const bool amd = __builtin_cpu_is("amd");
  return amd;
}

// 16 inputs as float32, from float32 or bfloat16 (the model's dtypes): no converted copy of the rows.
__attribute__((target("avx512f,avx512bw"))) inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
__attribute__((target("avx512f,avx512bw"))) inline __m512 load16(const at::BFloat16* x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)x)), 16));
}

// 16 results in the rows' dtype. bfloat16 rounds to nearest even, NaN made 0x7FC0, as
// c10::BFloat16(float) does (the kernels' own scalar stores), in integer lanes: vcvtneps2bf16
// (AVX-512 BF16) flushes subnormals to zero, which torch's conversion does not.
__attribute__((target("avx512f,avx512bw"))) inline void store16(__m512 v, float* out) { _mm512_storeu_ps(out, v); }
__attribute__((target("avx512f,avx512bw"))) inline void store16(__m512 v, at::BFloat16* out) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256((__m256i*)out, _mm512_cvtepi32_epi16(rounded));
}

// e^x for x <= 0 (scores less their row's maximum), 0 below -87 (and for -inf): Cephes' expf
// polynomial on x - n ln 2, scaled by 2^n; within 2 units of float32's last place.
__attribute__((target("avx512f"))) inline __m512 exp_nonpositive(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_GE_OQ);
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, n));
}

}  // namespace vlserve::lanes
