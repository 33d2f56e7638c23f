// stream_read: read a buffer once, as fast as this CPU streams memory, and return the sum of its bytes.
//
// The decode benchmarks hold each step against the time its bytes take at the memory's read speed
// (vlserve.bench.bandwidth), so that speed must be the fastest read a core can make, not one
// library's. torch's reductions do not reach it: on the 2-vCPU AMX Xeon VM (two threads, a 2 GiB
// buffer in 2 MiB pages, the readers taking turns in one process) torch.dot read 33.9-34.2 GB/s and
// this op 35.6-35.8 in three measurements of 9 turns; torch's amax 33.7, sum 30.1, a byte max 35.5
// (medians of 5). What it adds: every line prefetched 1 KiB ahead (2 and 4 KiB ahead measured no
// faster; without a prefetch the same loop read 30 GB/s) and whole vectors a load (its AVX2 loads:
// 34.6). On AMD every line is prefetched 4 KiB ahead into L2 instead: on a 2-vCPU Zen 4 EPYC (2 GiB,
// two threads, the variants taking turns, 8-10 turns, six runs over an hour as the VM's memory
// swung) 4 KiB into L2 read 34.5-60.2 GB/s where 1 KiB into L1 read 32.5-51.9 (5-16% less in every
// run), no prefetch 32.8-52.9, both 35.1-53.3. The sum (vpsadbw: one instruction per 64 bytes) keeps the reads from being optimised away
// and lets vlserve.kernels.native check the op exactly.
//
// Each thread reads one contiguous share, with the loads of the tier it is asked for (avx512_vnni:
// 64-byte vectors; avx2: 32-byte ones); the rest of the file compiles for the baseline ISA.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>
#include <immintrin.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "lanes.h"

namespace {
constexpr int64_t kChunk = 256;     // bytes a pass: four 64-byte lines
constexpr int64_t kAhead = 1024;    // bytes prefetched ahead of the pass into L1
constexpr int64_t kAheadL2 = 4096;  // on AMD: bytes prefetched ahead of the pass into L2 instead
constexpr int64_t kShare = 1 << 16;  // bytes parallel_for hands out at the least

// Every line of the pass `p` prefetched ahead: into L2 on AMD (`l2`), else into L1.
inline void prefetch_pass(const uint8_t* p, bool l2) {
  for (int64_t line = 0; line < kChunk; line += 64) {
    if (l2)
      _mm_prefetch((const char*)(p + kAheadL2 + line), _MM_HINT_T1);
    else
      _mm_prefetch((const char*)(p + kAhead + line), _MM_HINT_T0);
  }
}

__attribute__((target("avx512f,avx512bw"))) uint64_t sum_avx512(const uint8_t* p, int64_t n, bool l2) {
  const __m512i zero = _mm512_setzero_si512();
  __m512i s0 = zero, s1 = zero, s2 = zero, s3 = zero;
  int64_t i = 0;
  for (; i + kChunk <= n; i += kChunk) {
    prefetch_pass(p + i, l2);
    s0 = _mm512_add_epi64(s0, _mm512_sad_epu8(_mm512_loadu_si512(p + i), zero));
    s1 = _mm512_add_epi64(s1, _mm512_sad_epu8(_mm512_loadu_si512(p + i + 64), zero));
    s2 = _mm512_add_epi64(s2, _mm512_sad_epu8(_mm512_loadu_si512(p + i + 128), zero));
    s3 = _mm512_add_epi64(s3, _mm512_sad_epu8(_mm512_loadu_si512(p + i + 192), zero));
  }
  uint64_t total = (uint64_t)_mm512_reduce_add_epi64(_mm512_add_epi64(_mm512_add_epi64(s0, s1), _mm512_add_epi64(s2, s3)));
  for (; i < n; ++i) total += p[i];
  return total;
}

__attribute__((target("avx2"))) uint64_t sum_avx2(const uint8_t* p, int64_t n, bool l2) {
  const __m256i zero = _mm256_setzero_si256();
  __m256i s0 = zero, s1 = zero, s2 = zero, s3 = zero;
  int64_t i = 0;
  for (; i + kChunk <= n; i += kChunk) {
    prefetch_pass(p + i, l2);
    for (int64_t half = 0; half < kChunk; half += 128) {
      s0 = _mm256_add_epi64(s0, _mm256_sad_epu8(_mm256_loadu_si256((const __m256i*)(p + i + half)), zero));
      s1 = _mm256_add_epi64(s1, _mm256_sad_epu8(_mm256_loadu_si256((const __m256i*)(p + i + half + 32)), zero));
      s2 = _mm256_add_epi64(s2, _mm256_sad_epu8(_mm256_loadu_si256((const __m256i*)(p + i + half + 64)), zero));
      s3 = _mm256_add_epi64(s3, _mm256_sad_epu8(_mm256_loadu_si256((const __m256i*)(p + i + half + 96)), zero));
    }
  }
  const __m256i s = _mm256_add_epi64(_mm256_add_epi64(s0, s1), _mm256_add_epi64(s2, s3));
  uint64_t total = (uint64_t)(_mm256_extract_epi64(s, 0) + _mm256_extract_epi64(s, 1) + _mm256_extract_epi64(s, 2) +
                              _mm256_extract_epi64(s, 3));
  for (; i < n; ++i) total += p[i];
  return total;
}

int64_t stream_read(const at::Tensor& buffer, c10::string_view isa) {
  TORCH_CHECK(buffer.scalar_type() == at::kByte && buffer.dim() == 1 && buffer.is_contiguous(),
              "stream_read: the buffer must be contiguous 1-d uint8");
  const bool wide = isa == "avx512_vnni";
  TORCH_CHECK(wide || isa == "avx2", "stream_read: unknown ISA '", std::string(isa), "' (avx512_vnni or avx2)");
  TORCH_CHECK(wide ? __builtin_cpu_supports("avx512bw") : __builtin_cpu_supports("avx2"),
              "stream_read: this CPU lacks ", wide ? "AVX-512 BW" : "AVX2");
  const uint8_t* p = buffer.data_ptr<uint8_t>();
  const int64_t n = buffer.numel();
  const bool l2 = vlserve::lanes::amd_cpu();
  std::atomic<uint64_t> total{0};
  at::parallel_for(0, n, kShare, [&](int64_t begin, int64_t end) {
    total += wide ? sum_avx512(p + begin, end - begin, l2) : sum_avx2(p + begin, end - begin, l2);
  });
  return (int64_t)total.load();
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(vlserve, lib) { lib.def("stream_read(Tensor buffer, str isa) -> int"); }
TORCH_LIBRARY_IMPL(vlserve, CPU, lib) { lib.impl("stream_read", stream_read); }
