// What the CPU kernels share: PAGODA_HAS_VNNI where AVX512-VNNI (with BW and VL) was
// compiled in, and 16 floats to and from float32 or bfloat16 memory, masked for tails.
#pragma once
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PAGODA_HAS_VNNI 1
#endif
#include <cstdint>

// How far ahead the decode kernels prefetch the weight stream they read once: the
// hardware prefetcher alone leaves it at 60-70% of the memory bandwidth. Measured on
// SmolLM2's 30 q4_1 layers at one row (Sapphire Rapids, 2 threads): 4.8 ms without,
// 2.7-2.9 ms at 2-8 KiB ahead.
constexpr int64_t kPrefetchBytes = 4096;

#if defined(__AVX512F__)
#include <ATen/ATen.h>
#include <immintrin.h>

namespace pagoda_simd {

inline __m512 load16(const float* p, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, p); }
inline __m512 load16(const at::BFloat16* p, __mmask16 mask) {
  const __m256i h = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

inline void store16(float* p, __m512 v, __mmask16 mask) { _mm512_mask_storeu_ps(p, mask, v); }
// Round to nearest even, as c10::BFloat16 does (NaN never occurs: finite inputs).
inline void store16(at::BFloat16* p, __m512 v, __mmask16 mask) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  _mm256_mask_storeu_epi16(p, mask, _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}

inline __mmask16 tail_mask(int64_t remaining) {
  return remaining >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << remaining) - 1);
}

}  // namespace pagoda_simd
#endif
