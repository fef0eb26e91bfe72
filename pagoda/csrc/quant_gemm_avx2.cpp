// The int8 dot products of quant_gemm.cpp and kquant_gemm.cpp for CPUs with AVX2 and no
// AVX512-VNNI (AMD Zen 2/3, Intel before Ice Lake): the same activations (quant_blocks.h,
// per 64-byte group of weight codes) and the same sums, read 32 bytes at a time.
//
// vpmaddubsw multiplies unsigned weight bytes by signed activation bytes and adds
// adjacent pairs into int16 lanes, saturating; vpmaddwd with ones then adds pairs of
// those into int32 lanes (the K-quants: with their block scales in place of the ones,
// see k_dot_rows), so lane l of a 32-byte load's sums holds 4 products of the
// block l / (8 / blocks per load). No pair can saturate: codes of at most 6 bits give
// 2 x 63 x 127 = 16,002, and q4/q5's low and high nibbles' pairs are added in int16
// (at most 2 x 2 x 31 x 127 = 15,748). q8_0's codes (stored + 128) are read as signed
// bytes instead, |q| times the activation with q's sign (vpsignb), as 2 x 128 x 127 also
// fits; its offset term is then zero.
#include <cstring>

#include "quant_blocks.h"

#if defined(PAGODA_HAS_INT8_DOT) && !defined(PAGODA_HAS_VNNI)
namespace pagoda_quant {
namespace {

using pagoda_simd::sum8;

// Activation rows per pass over the weights: 4, where AVX512's kernels take 8 (16
// registers, not 32). Single-threaded on a 2048 x 2048 weight, 16 rows (AMD EPYC Zen 3):
// q4_0 1.26 ms at 4 against 1.41 at 8, q6_k 2.79 against 3.15.
constexpr int64_t kTile = 4;

inline __m256i load32(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
// int16 pairs added into int32 lanes.
inline __m256i widen(__m256i pairs) { return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)); }
inline __m256i nibble_mask() { return _mm256_set1_epi8(0x0F); }

// 32 bytes, byte j 0x10 where bit j of `bits` is set (q5's fifth bits as code bytes).
inline __m256i fifth_bit_bytes(uint32_t bits) {
  const __m256i byte_of_bit = _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303);
  const __m256i other_bits = _mm256_set1_epi64x(0x7FBFDFEFF7FBFDFE);  // all but bit j % 8
  const __m256i spread = _mm256_or_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int32_t>(bits)), byte_of_bit), other_bits);
  return _mm256_and_si256(_mm256_cmpeq_epi8(spread, _mm256_set1_epi8(-1)), _mm256_set1_epi8(0x10));
}
// q5's fifth bits of the two blocks whose 32 code bytes are one load (bits of 0 where
// the second is absent): the low nibbles are elements 0-15, the high ones 16-31.
inline void or_fifth_bit_bytes(__m256i& lo, __m256i& hi, uint32_t first, uint32_t second) {
  lo = _mm256_or_si256(lo, fifth_bit_bytes((first & 0xFFFFu) | (second << 16)));
  hi = _mm256_or_si256(hi, fifth_bit_bytes((first >> 16) | (second & 0xFFFF0000u)));
}

// The fp16 scales of a group's `count` blocks (of kPerLoad: 4 or 2) as floats; zero
// past count.
template <int64_t kPerLoad>
inline __m128 block_scales(const at::Half* p, int64_t count) {
  if (count == kPerLoad) {
    if constexpr (kPerLoad == 4) return _mm_cvtph_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
    int32_t two;
    std::memcpy(&two, p, sizeof two);
    return _mm_cvtph_ps(_mm_cvtsi32_si128(two));
  }
  float f[4] = {};
  for (int64_t c = 0; c < count; ++c) f[c] = to_float(p[c]);
  return _mm_loadu_ps(f);
}

// Sums of 8 blocks' constant terms at a time: c_b s_a for MT activation rows.
template <int64_t MT>
inline void add_constant_terms(const Activations& a, int64_t mi, int64_t row_blocks,
                               const at::Half* d, const at::Half* m, float offset, int64_t nb,
                               float* extra) {
  __m256 acc[MT];
  for (int64_t t = 0; t < MT; ++t) acc[t] = _mm256_setzero_ps();
  const __m256 minus_offset = _mm256_set1_ps(-offset);
  int64_t b = 0;
  for (; b + 8 <= nb; b += 8) {
    __m256 c = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + b))), minus_offset);
    if (m != nullptr) c = _mm256_add_ps(c, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + b))));
    for (int64_t t = 0; t < MT; ++t)
      acc[t] = _mm256_fmadd_ps(c, _mm256_loadu_ps(a.sum.data() + (mi + t) * row_blocks + b), acc[t]);
  }
  for (int64_t t = 0; t < MT; ++t) extra[t] = sum8(acc[t]);
  for (; b < nb; ++b) {
    const float c = (m != nullptr ? to_float(m[b]) : 0.f) - offset * to_float(d[b]);
    for (int64_t t = 0; t < MT; ++t) extra[t] += c * a.sum[(mi + t) * row_blocks + b];
  }
}

// y[i, n] for rows [n0, n1): MT activation rows from mi, 32-weight formats.
template <int64_t Format, int64_t MT, typename Tout>
void dot_rows(const Activations& a, const uint8_t* qs, const at::Half* d, const at::Half* m,
              const int32_t* qh, const float* bias, Tout* y, int64_t mi, int64_t N, int64_t nb,
              int64_t n0, int64_t n1) {
  constexpr bool kQ4 = Format != kQ8_0, kQ5 = Format == kQ5_0 || Format == kQ5_1;
  constexpr int64_t kBytes = kQ4 ? 16 : 32, kPerLoad = 64 / kBytes, kPerHalf = kPerLoad / 2;
  // q8_0 reads its codes as signed: no offset (see the top).
  const float offset = kQ4 ? (Format == kQ4_0 ? 8.f : Format == kQ5_0 ? 16.f : 0.f) : 0.f;
  const int64_t groups = a.groups;
  // The lanes of half h's sums take the scales of blocks 2h (lanes 0-3) and 2h + 1 (4-7)
  // of the group (q4), or of block h (q8).
  const __m256i lanes[2] = {
      kQ4 ? _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1) : _mm256_setzero_si256(),
      kQ4 ? _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3) : _mm256_set1_epi32(1)};
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wrow = qs + n * nb * kBytes;
    const at::Half* drow = d + n * nb;
    __m256 acc[MT];
    for (int64_t t = 0; t < MT; ++t) acc[t] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      _mm_prefetch(reinterpret_cast<const char*>(wrow + g * 64 + kPrefetchBytes), _MM_HINT_T0);
      const int64_t count = std::min(kPerLoad, nb - g * kPerLoad);
      const __m256 scales = _mm256_castps128_ps256(block_scales<kPerLoad>(drow + g * kPerLoad, count));
      for (int64_t h = 0; h < 2; ++h) {
        const int64_t b0 = g * kPerLoad + h * kPerHalf, here = std::min(kPerHalf, nb - b0);
        if (here <= 0) break;
        const uint8_t* p = wrow + b0 * kBytes;
        const __m256 dw = _mm256_permutevar8x32_ps(scales, lanes[h]);
        // An absent second block of a q4 half reads as zero codes (its activations are
        // zero too).
        const __m256i w = here == kPerHalf ? load32(p) : _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
        __m256i lo = w, hi = w;
        if constexpr (kQ4) {
          lo = _mm256_and_si256(w, nibble_mask());
          hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), nibble_mask());
          if constexpr (kQ5)
            or_fifth_bit_bytes(lo, hi, static_cast<uint32_t>(qh[n * nb + b0]), here > 1 ? static_cast<uint32_t>(qh[n * nb + b0 + 1]) : 0u);
        } else {
          lo = _mm256_xor_si256(w, _mm256_set1_epi8(static_cast<char>(0x80)));  // signed codes
          hi = _mm256_sign_epi8(lo, lo);                                      // |q|
        }
#pragma GCC unroll 8
        for (int64_t t = 0; t < MT; ++t) {
          const int64_t i = mi + t;
          const int8_t* act = a.q.data() + ((i * groups + g) * (kQ4 ? 2 : 1)) * 64 + h * 32;
          __m256i pairs;
          if constexpr (kQ4)
            pairs = _mm256_add_epi16(_mm256_maddubs_epi16(lo, load32(act)), _mm256_maddubs_epi16(hi, load32(act + 64)));
          else
            pairs = _mm256_maddubs_epi16(hi, _mm256_sign_epi8(load32(act), lo));
          const __m256 scale = _mm256_mul_ps(dw, _mm256_loadu_ps(a.scale.data() + (i * groups + g) * 16 + h * 8));
          acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(widen(pairs)), scale, acc[t]);
        }
      }
    }
    // The per-block constant: (m_w - offset d_w) s_a.
    float extra[MT] = {};
    if (m != nullptr || offset != 0.f)
      add_constant_terms<MT>(a, mi, groups * kPerLoad, drow, m != nullptr ? m + n * nb : nullptr, offset, nb, extra);
    const float b0 = bias != nullptr ? bias[n] : 0.f;
    for (int64_t t = 0; t < MT; ++t) y[(mi + t) * N + n] = static_cast<Tout>(sum8(acc[t]) + extra[t] + b0);
  }
}

// Shuffle bytes that put int16 element `low` of each 128-bit half in all 8 int16s of
// the low half, and `high` in those of the high half.
inline __m256i spread_int16(int low, int high) {
  const auto both_bytes = [](int e) { return static_cast<short>((2 * e + 1) << 8 | 2 * e); };
  return _mm256_setr_m128i(_mm_set1_epi16(both_bytes(low)), _mm_set1_epi16(both_bytes(high)));
}

// The same for q4_k, q5_k and q6_k (their sums: kquant_gemm.cpp).
template <int64_t Format, int64_t MT, typename Tout>
void k_dot_rows(const Activations& a, const KWeight& w, const float* bias, Tout* y, int64_t mi,
                int64_t n0, int64_t n1) {
  constexpr bool kQ6 = Format == kQ6_K, kQ5 = Format == kQ5_K;
  const int64_t groups = a.groups, nb = w.nb, supers = nb / 8;
  const __m256i pair = _mm256_set1_epi8(0x30);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wrow = w.qs + n * nb * 16;
    const uint8_t* srow = w.sc + n * nb * 2;
    // The block scales multiply the int16 pair sums inside vpmaddwd (in place of its
    // ones; an int32 lane is at most 2 x 15,748 x 63 for q4_k/q5_k, 2 x 2 x 16,002 x 128
    // over q6_k's two halves: exact, and exact in float too, below 2^24), so a row
    // takes one conversion and one FMA per 32 bytes, and the super-block's d once.
    __m256 acc[MT], super_sum[MT];
    for (int64_t t = 0; t < MT; ++t) acc[t] = super_sum[t] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      _mm_prefetch(reinterpret_cast<const char*>(wrow + g * 64 + kPrefetchBytes), _MM_HINT_T0);
      // The group's 4 blocks' (sc, mn), or q6_k's two scales a block, as 8 int16s in
      // both 128-bit halves.
      const __m128i s8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(srow + g * 8));
      const __m256i s = _mm256_broadcastsi128_si256(kQ6 ? _mm_cvtepi8_epi16(s8) : _mm_cvtepu8_epi16(s8));
      __m256i hb = _mm256_setzero_si256();
      if constexpr (kQ6) hb = load32(w.qh + (n * groups + g) * 32);
      for (int64_t h = 0; h < 2; ++h) {
        const __m256i codes = load32(wrow + g * 64 + h * 32);
        __m256i lo = _mm256_and_si256(codes, nibble_mask());
        __m256i hi = _mm256_and_si256(_mm256_srli_epi16(codes, 4), nibble_mask());
        // Lanes 0-3 belong to block 2h of the group, 4-7 to block 2h + 1: the scale at
        // int16 2b (+ 1: q6_k's second half) of block b, in every int16 of its lanes.
        const int first = 4 * static_cast<int>(h);
        const __m256i slo = _mm256_shuffle_epi8(s, spread_int16(first, first + 2));
        __m256i shi = slo;
        if constexpr (kQ6) {
          // The low nibbles' high bit pairs: bits 0-1 (h = 0) or 2-3 of qh's bytes; the
          // high nibbles': bits 4-5 or 6-7.
          lo = _mm256_or_si256(lo, _mm256_and_si256(h == 0 ? _mm256_slli_epi16(hb, 4) : _mm256_slli_epi16(hb, 2), pair));
          hi = _mm256_or_si256(hi, _mm256_and_si256(h == 0 ? hb : _mm256_srli_epi16(hb, 2), pair));
          shi = _mm256_shuffle_epi8(s, spread_int16(first + 1, first + 3));
        } else if constexpr (kQ5) {
          const int32_t* fifth = w.fifth + n * nb + g * 4 + 2 * h;
          or_fifth_bit_bytes(lo, hi, static_cast<uint32_t>(fifth[0]), static_cast<uint32_t>(fifth[1]));
        }
#pragma GCC unroll 8
        for (int64_t t = 0; t < MT; ++t) {
          const int64_t i = mi + t;
          const int8_t* act = a.q.data() + (i * groups + g) * 128 + h * 32;
          const __m256 as = _mm256_loadu_ps(a.scale.data() + (i * groups + g) * 16 + h * 8);
          const __m256i plo = _mm256_maddubs_epi16(lo, load32(act)), phi = _mm256_maddubs_epi16(hi, load32(act + 64));
          const __m256i sums = kQ6 ? _mm256_add_epi32(_mm256_madd_epi16(plo, slo), _mm256_madd_epi16(phi, shi))
                                   : _mm256_madd_epi16(_mm256_add_epi16(plo, phi), slo);
          super_sum[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), as, super_sum[t]);
        }
      }
      if (g % 2 == 1) {  // a super-block's end (2 groups; K-quant rows hold whole ones)
        const __m256 d = _mm256_set1_ps(to_float(w.d[n * supers + g / 2]));
        for (int64_t t = 0; t < MT; ++t) {
          acc[t] = _mm256_fmadd_ps(super_sum[t], d, acc[t]);
          super_sum[t] = _mm256_setzero_ps();
        }
      }
    }
    // The constant terms, a super-block at a time: q6_k's -32 d sc s16_a (16 half
    // blocks), q4_k/q5_k's -dmin mn s_a (8 blocks).
    __m256 extra[MT];
    for (int64_t t = 0; t < MT; ++t) extra[t] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < supers; ++sb) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(srow + sb * 16));
      if constexpr (kQ6) {
        const __m256 d32 = _mm256_set1_ps(-32.f * to_float(w.d[n * supers + sb]));
        const __m256 c0 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), d32);
        const __m256 c1 = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(bytes, bytes))), d32);
        for (int64_t t = 0; t < MT; ++t) {
          const float* s16 = a.sum16.data() + ((mi + t) * nb + sb * 8) * 2;
          extra[t] = _mm256_fmadd_ps(c1, _mm256_loadu_ps(s16 + 8), _mm256_fmadd_ps(c0, _mm256_loadu_ps(s16), extra[t]));
        }
      } else {
        const __m256 mins = _mm256_cvtepi32_ps(_mm256_srli_epi32(_mm256_cvtepu16_epi32(bytes), 8));  // (sc, mn)
        const __m256 c = _mm256_mul_ps(mins, _mm256_set1_ps(-to_float(w.m[n * supers + sb])));
        for (int64_t t = 0; t < MT; ++t)
          extra[t] = _mm256_fmadd_ps(c, _mm256_loadu_ps(a.sum.data() + (mi + t) * groups * 4 + sb * 8), extra[t]);
      }
    }
    const float b0 = bias != nullptr ? bias[n] : 0.f;
    for (int64_t t = 0; t < MT; ++t)
      y[(mi + t) * w.N + n] = static_cast<Tout>(sum8(_mm256_add_ps(acc[t], extra[t])) + b0);
  }
}

}  // namespace

template <typename Tout>
void block_dot_all(const Activations& a, int64_t format, const uint8_t* qs, const at::Half* d,
                   const at::Half* m, const int32_t* qh, const float* bias, Tout* y, int64_t M,
                   int64_t N, int64_t nb, int64_t n0, int64_t n1) {
  auto run = [&](auto format_constant) {
    for_row_tiles<kTile>(M, [&](auto mt, int64_t i) {
      dot_rows<decltype(format_constant)::value, decltype(mt)::value>(a, qs, d, m, qh, bias, y, i, N, nb, n0, n1);
    });
  };
  switch (format) {
    case kQ8_0: return run(std::integral_constant<int64_t, kQ8_0>{});
    case kQ4_0: return run(std::integral_constant<int64_t, kQ4_0>{});
    case kQ4_1: return run(std::integral_constant<int64_t, kQ4_1>{});
    case kQ5_0: return run(std::integral_constant<int64_t, kQ5_0>{});
    default: return run(std::integral_constant<int64_t, kQ5_1>{});
  }
}

template <typename Tout>
void k_dot_all(const Activations& a, const KWeight& w, const float* bias, Tout* y, int64_t M,
               int64_t n0, int64_t n1) {
  auto run = [&](auto format_constant) {
    for_row_tiles<kTile>(M, [&](auto mt, int64_t i) {
      k_dot_rows<decltype(format_constant)::value, decltype(mt)::value>(a, w, bias, y, i, n0, n1);
    });
  };
  if (w.format == kQ4_K) return run(std::integral_constant<int64_t, kQ4_K>{});
  if (w.format == kQ5_K) return run(std::integral_constant<int64_t, kQ5_K>{});
  run(std::integral_constant<int64_t, kQ6_K>{});
}

template void block_dot_all<float>(const Activations&, int64_t, const uint8_t*, const at::Half*,
                                   const at::Half*, const int32_t*, const float*, float*, int64_t,
                                   int64_t, int64_t, int64_t, int64_t);
template void block_dot_all<at::BFloat16>(const Activations&, int64_t, const uint8_t*,
                                          const at::Half*, const at::Half*, const int32_t*,
                                          const float*, at::BFloat16*, int64_t, int64_t, int64_t,
                                          int64_t, int64_t);
template void k_dot_all<float>(const Activations&, const KWeight&, const float*, float*, int64_t,
                               int64_t, int64_t);
template void k_dot_all<at::BFloat16>(const Activations&, const KWeight&, const float*,
                                      at::BFloat16*, int64_t, int64_t, int64_t);

}  // namespace pagoda_quant
#endif
