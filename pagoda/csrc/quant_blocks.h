// What the linear layers on quantized blocks share (quant_gemm.cpp, kquant_gemm.cpp):
// the formats' codes, and the activations quantized per block of 32 to int8 in the
// layout the dot products read. Layouts: pagoda/model_executor/quantization.py.
#pragma once
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "simd.h"
#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace pagoda_quant {

constexpr int64_t kBlock = 32;
// The index in pagoda.model_executor.quantization.FORMATS.
enum Format : int64_t {
  kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2, kQ5_0 = 3, kQ5_1 = 4, kQ4_K = 5, kQ6_K = 6, kQ5_K = 7
};

inline bool is_k_quant(int64_t format) { return format >= kQ4_K && format <= kQ5_K; }
// Bytes of qs a block of 32 takes.
inline int64_t block_bytes(int64_t format) { return format == kQ8_0 ? 32 : 16; }

// fp16 to float in one instruction (F16C) where there is one: c10::Half's own
// conversion is a dozen integer operations, once per block in the kernels.
inline float to_float(at::Half h) {
#if defined(__F16C__)
  return _cvtsh_ss(h.x);
#else
  return static_cast<float>(h);
#endif
}

#if defined(__AVX512F__)
// q5's fifth bits (bit j of `bits`: element j's) into a block's codes as int32 lanes:
// lo holds elements 0-15, hi 16-31.
inline void or_fifth_bits(__m512i& lo, __m512i& hi, uint32_t bits) {
  const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i h = _mm512_set1_epi32(static_cast<int32_t>(bits)), one = _mm512_set1_epi32(1);
  const __m512i iota16 = _mm512_add_epi32(iota, _mm512_set1_epi32(16));
  lo = _mm512_or_si512(lo, _mm512_slli_epi32(_mm512_and_si512(_mm512_srlv_epi32(h, iota), one), 4));
  hi = _mm512_or_si512(hi, _mm512_slli_epi32(_mm512_and_si512(_mm512_srlv_epi32(h, iota16), one), 4));
}
#endif

// ---- the K-quants (kquant_gemm.cpp) ------------------------------------------------------

struct KWeight {  // a q4_k, q5_k or q6_k weight's parts, checked
  int64_t format, N, nb;  // nb: blocks of 32 along K (a multiple of 8)
  const uint8_t* qs;
  const at::Half* d;       // [N, nb / 8]
  const at::Half* m;       // q4_k, q5_k: [N, nb / 8] (dmin), else null
  const uint8_t* qh;       // q6_k: [N, nb / 4, 32], else null
  const int32_t* fifth;    // q5_k: [N, nb], bit j: element j's fifth bit; else null
  const uint8_t* sc;       // [N, nb, 2] (uint8 for q4_k and q5_k, int8 for q6_k)
};

KWeight check_k_weight(const at::Tensor& qs, const at::Tensor& d, const c10::optional<at::Tensor>& m,
                       const c10::optional<at::Tensor>& qh, const c10::optional<at::Tensor>& sc,
                       int64_t format);
template <typename T>
void dequantize_k_rows(const KWeight& w, T* out, int64_t n0, int64_t n1);

#if defined(__AVX2__) && !defined(__AVX512F__)
// Elements 8c to 8c + 7 (lo) and 16 + 8c to 16 + 8c + 7 (hi) of a block whose 16 bytes
// of codes are at q, as int32 lanes; and q5's fifth bits (bit j: element j's) into them.
inline void nibbles8(const uint8_t* q, int c, __m256i& lo, __m256i& hi) {
  const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * c)));
  lo = _mm256_and_si256(bytes, _mm256_set1_epi32(0x0F));
  hi = _mm256_srli_epi32(bytes, 4);
}
inline void or_fifth_bits(__m256i& lo, __m256i& hi, uint32_t bits, int c) {
  const __m256i iota = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(8 * c));
  const __m256i h = _mm256_set1_epi32(static_cast<int32_t>(bits)), one = _mm256_set1_epi32(1);
  const __m256i iota16 = _mm256_add_epi32(iota, _mm256_set1_epi32(16));
  lo = _mm256_or_si256(lo, _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(h, iota), one), 4));
  hi = _mm256_or_si256(hi, _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(h, iota16), one), 4));
}
#endif

#ifdef PAGODA_HAS_VNNI
// q5's fifth bits into `count` blocks' codes as bytes (a 64-byte load of 4-bit codes:
// byte 16 b + j holds block b's element j in lo and j + 16 in hi), one masked move each.
inline void or_fifth_bits(__m512i& lo, __m512i& hi, const int32_t* bits, int64_t count) {
  uint64_t lo_bits = 0, hi_bits = 0;
  for (int64_t b = 0; b < count; ++b) {
    const uint32_t h = static_cast<uint32_t>(bits[b]);
    lo_bits |= static_cast<uint64_t>(h & 0xFFFFu) << (16 * b);
    hi_bits |= static_cast<uint64_t>(h >> 16) << (16 * b);
  }
  const __m512i fifth = _mm512_set1_epi8(0x10);
  lo = _mm512_or_si512(lo, _mm512_maskz_mov_epi8(lo_bits, fifth));
  hi = _mm512_or_si512(hi, _mm512_maskz_mov_epi8(hi_bits, fifth));
}
#endif

#ifdef PAGODA_HAS_INT8_DOT
// Every weight row is read once per kMaxTile activation rows (8; AVX2's 16 registers
// hold fewer sums than AVX512's 32): `tile(MT, i)` for the rows [i, i + MT) of M, MT
// a compile-time constant so the tile's sums stay in registers.
template <int64_t kMaxTile = 8, typename Tile>
inline void for_row_tiles(int64_t M, Tile&& tile) {
  auto tile_of = [&](auto mt, int64_t i) {
    if constexpr (decltype(mt)::value <= kMaxTile) tile(mt, i);
  };
  for (int64_t i = 0; i < M; i += kMaxTile) {
    switch (std::min<int64_t>(kMaxTile, M - i)) {
      case 1: tile_of(std::integral_constant<int64_t, 1>{}, i); break;
      case 2: tile_of(std::integral_constant<int64_t, 2>{}, i); break;
      case 3: tile_of(std::integral_constant<int64_t, 3>{}, i); break;
      case 4: tile_of(std::integral_constant<int64_t, 4>{}, i); break;
      case 5: tile_of(std::integral_constant<int64_t, 5>{}, i); break;
      case 6: tile_of(std::integral_constant<int64_t, 6>{}, i); break;
      case 7: tile_of(std::integral_constant<int64_t, 7>{}, i); break;
      default: tile_of(std::integral_constant<int64_t, 8>{}, i); break;
    }
  }
}

struct Activations {
  int64_t groups;            // 64-byte loads a row of weights takes
  std::vector<int8_t> q;     // [M, groups, 64] (q4: [M, groups, 2, 64], low then high halves)
  std::vector<float> scale;  // [M, groups, 16]: d_a of the block each lane belongs to
  std::vector<float> sum;    // [M, groups * blocks per load]: s_a, zero past the last block
  // q6_k: [M, blocks, 2], d_a times the sum of each half block's codes (its 16 weights
  // share a scale), for the products' -32 d sc offset.
  std::vector<float> sum16;
};

// One row's blocks: codes in the layout the dot products read, the lane scales, s_a.
// Vectorized where AVX512 is: the same float operations as the scalar form (max of
// |x|, d = amax / 127, x * (1 / d) rounded to nearest even), so the same codes.
template <typename Tin>
inline void quantize_row_blocks(const Tin* x, int64_t nb, int64_t per_load, bool q4, Activations& a,
                         int64_t i) {
  const int64_t lanes = 16 / per_load;  // int32 lanes per block
  const int64_t halves = q4 ? 2 : 1;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t g = b / per_load, slot = b % per_load;
    int8_t* dst = a.q.data() + ((i * a.groups + g) * halves) * 64;
    float d;
    int32_t half_total[2];  // elements 0-15, 16-31
#if defined(__AVX512F__)
    using pagoda_simd::load16;
    const __m512 lo = load16(x + b * kBlock, 0xFFFF), hi = load16(x + b * kBlock + 16, 0xFFFF);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    d = amax / 127.f;
    const __m512 id = _mm512_set1_ps(d != 0.f ? 1.f / d : 0.f);
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, id));  // ties to even
    const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, id));
    half_total[0] = _mm512_reduce_add_epi32(qlo);
    half_total[1] = _mm512_reduce_add_epi32(qhi);
    // q4: byte j of a block pairs with element j (low nibble) and j + 16 (high).
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (q4 ? slot * 16 : slot * 32)), _mm512_cvtepi32_epi8(qlo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (q4 ? 64 + slot * 16 : slot * 32 + 16)), _mm512_cvtepi32_epi8(qhi));
#elif defined(__AVX2__)
    using pagoda_simd::load8;
    using pagoda_simd::sum8;
    __m256 v[4];
    __m256 amax8 = _mm256_setzero_ps();
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    for (int c = 0; c < 4; ++c) {
      v[c] = load8(x + b * kBlock + 8 * c);
      amax8 = _mm256_max_ps(amax8, _mm256_and_ps(v[c], abs_mask));
    }
    d = pagoda_simd::max8(amax8) / 127.f;
    const __m256 id = _mm256_set1_ps(d != 0.f ? 1.f / d : 0.f);
    __m256i q[4];
    for (int c = 0; c < 4; ++c) q[c] = _mm256_cvtps_epi32(_mm256_mul_ps(v[c], id));  // ties to even
    half_total[0] = sum8(_mm256_add_epi32(q[0], q[1]));
    half_total[1] = sum8(_mm256_add_epi32(q[2], q[3]));
    // Packing interleaves the 128-bit lanes; the permute puts elements 0-31 in order.
    const __m256i packed = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])),
        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (q4 ? slot * 16 : slot * 32)), _mm256_castsi256_si128(packed));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (q4 ? 64 + slot * 16 : slot * 32 + 16)), _mm256_extracti128_si256(packed, 1));
#else
    float v[kBlock];
    float amax = 0.f;
    for (int64_t j = 0; j < kBlock; ++j) {
      v[j] = static_cast<float>(x[b * kBlock + j]);
      amax = std::max(amax, std::fabs(v[j]));
    }
    d = amax / 127.f;
    const float id = d != 0.f ? 1.f / d : 0.f;
    half_total[0] = half_total[1] = 0;
    for (int64_t j = 0; j < kBlock; ++j) {
      const int32_t q = static_cast<int32_t>(std::nearbyint(v[j] * id));  // ties to even
      half_total[j / 16] += q;
      const int64_t at = q4 ? (j / 16) * 64 + slot * 16 + j % 16 : slot * 32 + j;
      dst[at] = static_cast<int8_t>(q);
    }
#endif
    for (int64_t l = 0; l < lanes; ++l) a.scale[(i * a.groups + g) * 16 + slot * lanes + l] = d;
    a.sum[i * a.groups * per_load + b] = d * static_cast<float>(half_total[0] + half_total[1]);
    if (!a.sum16.empty()) {
      a.sum16[(i * nb + b) * 2] = d * static_cast<float>(half_total[0]);
      a.sum16[(i * nb + b) * 2 + 1] = d * static_cast<float>(half_total[1]);
    }
  }
}

template <typename Tin>
inline Activations quantize_activations(const Tin* x, int64_t M, int64_t K, int64_t format) {
  const int64_t nb = K / kBlock;
  const int64_t per_load = 64 / block_bytes(format);  // blocks per 64-byte weight load
  const bool q4 = format != kQ8_0;
  Activations a;
  a.groups = (nb + per_load - 1) / per_load;
  a.q.assign(M * a.groups * (q4 ? 2 : 1) * 64, 0);
  a.scale.assign(M * a.groups * 16, 0.f);
  a.sum.assign(M * a.groups * per_load, 0.f);
  if (format == kQ6_K) a.sum16.assign(M * nb * 2, 0.f);
  for (int64_t i = 0; i < M; ++i) quantize_row_blocks(x + i * K, nb, per_load, q4, a, i);
  return a;
}

// Rows [n0, n1) of y = x w^T (y [M, N]) on a 32-weight format's blocks (quant_gemm.cpp
// with VNNI, quant_gemm_avx2.cpp with AVX2 alone).
template <typename Tout>
void block_dot_all(const Activations& a, int64_t format, const uint8_t* qs, const at::Half* d,
                   const at::Half* m, const int32_t* qh, const float* bias, Tout* y, int64_t M,
                   int64_t N, int64_t nb, int64_t n0, int64_t n1);
// The same on a K-quant weight (kquant_gemm.cpp, quant_gemm_avx2.cpp).
template <typename Tout>
void k_dot_all(const Activations& a, const KWeight& w, const float* bias, Tout* y, int64_t M,
               int64_t n0, int64_t n1);
#endif

}  // namespace pagoda_quant
