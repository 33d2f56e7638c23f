// AVX-512 helpers more than one source uses. The sources are compiled as one translation unit
// (vlserve.kernels.native), so a helper two of them need lives here once.
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

namespace vlserve::lanes {

// Whether the CPU is AMD's: the decode products' streams per thread depend on it (a Zen 4 EPYC
// reads quantized weights fastest with fewer streams than Intel's Xeons: decode_vnni.cpp, q8.cpp).
inline bool amd_cpu() {
  static const bool amd = __builtin_cpu_is("amd");
  return amd;
}

// 16 inputs as float32, from float32 or bfloat16 (the model's dtypes): no converted copy of the rows.
__attribute__((target("avx512f,avx512bw"))) inline __m512 load16(const float* x) { return _mm512_loadu_ps(x); }
__attribute__((target("avx512f,avx512bw"))) inline __m512 load16(const at::BFloat16* x) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)x)), 16));
}

}  // namespace vlserve::lanes
