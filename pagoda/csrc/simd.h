// What the CPU kernels share: PAGODA_HAS_VNNI where AVX512-VNNI (with BW and VL) was
// compiled in, PAGODA_HAS_INT8_DOT where the int8 dot products on quantized blocks are
// (VNNI, or AVX2's vpmaddubsw without it), and 16 floats to and from float32 or
// bfloat16 memory, masked for tails.
#pragma once
#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define PAGODA_HAS_VNNI 1
#endif
#if defined(PAGODA_HAS_VNNI) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#define PAGODA_HAS_INT8_DOT 1
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

#if defined(__AVX2__) && defined(__FMA__)
#include <ATen/ATen.h>
#include <immintrin.h>

namespace pagoda_simd {

// 8 floats from float32 or bfloat16 memory, and sums of 8 lanes (AVX2 kernels).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
// Round to nearest even, as c10::BFloat16 does (finite inputs).
inline void store8(at::BFloat16* p, __m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(rounded), _mm256_extracti128_si256(rounded, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
inline float sum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float max8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
// 8 vectors of 8 int32 words transposed in place: afterwards r[j] holds word j of each.
inline void transpose8x8(__m256i r[8]) {
  __m256i u[8], v[8];
  for (int c = 0; c < 8; c += 2) {
    u[c] = _mm256_unpacklo_epi32(r[c], r[c + 1]);
    u[c + 1] = _mm256_unpackhi_epi32(r[c], r[c + 1]);
  }
  for (int c = 0; c < 8; c += 4)
    for (int h = 0; h < 2; ++h) {
      v[c + h] = _mm256_unpacklo_epi64(u[c + h], u[c + h + 2]);
      v[c + h + 2] = _mm256_unpackhi_epi64(u[c + h], u[c + h + 2]);
    }
  // v[0..3]: words (0, 4), (2, 6), (1, 5), (3, 7) of vectors 0-3 (low, high 128 bits);
  // v[4..7]: of vectors 4-7.
  constexpr int kWord[4] = {0, 2, 1, 3};
  for (int j = 0; j < 4; ++j) {
    r[kWord[j]] = _mm256_permute2x128_si256(v[j], v[j + 4], 0x20);
    r[kWord[j] + 4] = _mm256_permute2x128_si256(v[j], v[j + 4], 0x31);
  }
}
inline int32_t sum8(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 1)));
}

}  // namespace pagoda_simd
#endif
