// Linear layers on GGUF's K-quants kept in their super-blocks of 256 weights, q4_k, q5_k
// and q6_k (layouts: pagoda/model_executor/quantization.py), as quant_gemm.cpp runs the
// 32-weight formats: the activations quantized per block of 32 to int8, then per
// 64-byte load of codes (4 blocks, 128 weights: low nibbles, then high ones) two
// AVX512-VNNI dot products against the activations' matching halves.
//
//   q4_k  weight = d sc q - dmin mn (per block of 32: sc, mn 6-bit integers)
//         sum_k w_k x_k = d sc d_a sum_k q_k a_k - dmin mn s_a   (as q4_1)
//   q5_k  the same, each code's fifth bit ORed in as for q5_1
//   q6_k  weight = d sc (q - 32) (sc int8 per 16 weights)
//         sum_k w_k x_k = d sc d_a sum_k q_k a_k - 32 d sc s16_a  (per half block: the
//         low nibbles, elements 0-15 of each block, and the high ones take their own
//         scales; s16_a: Activations::sum16)
//
// The lane scales d sc and q4_k/q5_k's products d sc q are exact in float32 (d has 11
// significant bits, sc 6, q 4 or 5), so dequantize rounds as the PyTorch twin does,
// once; q6_k's d sc (q - 32) is one rounding of an exact d sc, as in the twin.
#include <ATen/Parallel.h>

#include "quant_blocks.h"

namespace pagoda_quant {

KWeight check_k_weight(const at::Tensor& qs, const at::Tensor& d, const c10::optional<at::Tensor>& m,
                       const c10::optional<at::Tensor>& qh, const c10::optional<at::Tensor>& sc,
                       int64_t format) {
  const bool with_min = format != kQ6_K, q5 = format == kQ5_K;
  TORCH_CHECK(qs.dim() == 3 && qs.scalar_type() == at::kByte && qs.is_contiguous() && qs.size(2) == 16,
              "qs must be a contiguous uint8 [N, K/32, 16] tensor");
  const int64_t N = qs.size(0), nb = qs.size(1);
  TORCH_CHECK(nb % 8 == 0, "a K-quant weight's K must be a multiple of 256");
  auto halves = [&](const at::Tensor& t, const char* name) {
    TORCH_CHECK(t.scalar_type() == at::kHalf && t.is_contiguous() && t.dim() == 2 &&
                    t.size(0) == N && t.size(1) == nb / 8,
                name, " must be a contiguous float16 [N, K/256] tensor");
  };
  halves(d, "d");
  TORCH_CHECK(m.has_value() == with_min, "m (dmin) is given exactly for q4_k and q5_k");
  if (with_min) halves(*m, "m");
  TORCH_CHECK(qh.has_value() == (q5 || !with_min), "qh is given exactly for q5_k and q6_k");
  if (!with_min)
    TORCH_CHECK(qh->scalar_type() == at::kByte && qh->is_contiguous() && qh->dim() == 3 &&
                    qh->size(0) == N && qh->size(1) == nb / 4 && qh->size(2) == 32,
                "qh must be a contiguous uint8 [N, K/128, 32] tensor");
  if (q5)
    TORCH_CHECK(qh->scalar_type() == at::kInt && qh->is_contiguous() && qh->dim() == 2 &&
                    qh->size(0) == N && qh->size(1) == nb,
                "qh must be a contiguous int32 [N, K/32] tensor");
  TORCH_CHECK(sc.has_value(), "a K-quant weight needs its scales sc");
  TORCH_CHECK(sc->scalar_type() == (with_min ? at::kByte : at::kChar) && sc->is_contiguous() &&
                  sc->dim() == 3 && sc->size(0) == N && sc->size(1) == nb && sc->size(2) == 2,
              "sc must be a contiguous ", with_min ? "uint8" : "int8", " [N, K/32, 2] tensor");
  return KWeight{format,
                 N,
                 nb,
                 qs.data_ptr<uint8_t>(),
                 d.data_ptr<at::Half>(),
                 with_min ? m->data_ptr<at::Half>() : nullptr,
                 with_min ? nullptr : qh->data_ptr<uint8_t>(),  // q6_k's high bit pairs
                 q5 ? qh->data_ptr<int32_t>() : nullptr,        // q5_k's fifth bits
                 static_cast<const uint8_t*>(sc->data_ptr())};
}

namespace {

// Block b of row n: its scale and shift per half (elements 0-15, 16-31), as floats.
struct BlockScales {
  float scale[2], shift[2];
};
inline BlockScales block_scales(const KWeight& w, int64_t n, int64_t b) {
  const float d = to_float(w.d[n * (w.nb / 8) + b / 8]);
  const uint8_t* s = w.sc + (n * w.nb + b) * 2;
  if (w.format != kQ6_K) {
    const float scale = d * s[0], shift = -(to_float(w.m[n * (w.nb / 8) + b / 8]) * s[1]);
    return {{scale, scale}, {shift, shift}};
  }
  const int8_t* signed_s = reinterpret_cast<const int8_t*>(s);
  return {{d * signed_s[0], d * signed_s[1]}, {0.f, 0.f}};
}

// Where block b's q6_k high bits lie: 16 bytes of its group's qh, and the shift of the
// low nibbles' pairs in them (the high nibbles' are 4 further).
inline const uint8_t* q6_high(const KWeight& w, int64_t n, int64_t b, int* shift) {
  *shift = 2 * ((b % 4) / 2);
  return w.qh + (n * (w.nb / 4) + b / 4) * 32 + 16 * (b % 2);
}

}  // namespace

template <typename T>
void dequantize_k_rows(const KWeight& w, T* out, int64_t n0, int64_t n1) {
  const bool q6 = w.format == kQ6_K;
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t b = 0; b < w.nb; ++b) {
      const uint8_t* q = w.qs + (n * w.nb + b) * 16;
      const BlockScales s = block_scales(w, n, b);
      int shift = 0;
      const uint8_t* high = q6 ? q6_high(w, n, b, &shift) : nullptr;
      const uint32_t fifth = w.fifth != nullptr ? static_cast<uint32_t>(w.fifth[n * w.nb + b]) : 0u;
      T* o = out + (n * w.nb + b) * kBlock;
#if defined(__AVX512F__)
      using pagoda_simd::store16;
      const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
      __m512i lo = _mm512_and_si512(bytes, _mm512_set1_epi32(0x0F)), hi = _mm512_srli_epi32(bytes, 4);
      if (q6) {
        const __m512i h = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(high)));
        const __m512i three = _mm512_set1_epi32(3), minus32 = _mm512_set1_epi32(-32);
        lo = _mm512_add_epi32(_mm512_or_si512(lo, _mm512_slli_epi32(_mm512_and_si512(_mm512_srl_epi32(h, _mm_cvtsi32_si128(shift)), three), 4)), minus32);
        hi = _mm512_add_epi32(_mm512_or_si512(hi, _mm512_slli_epi32(_mm512_and_si512(_mm512_srl_epi32(h, _mm_cvtsi32_si128(shift + 4)), three), 4)), minus32);
      }
      if (fifth != 0u) or_fifth_bits(lo, hi, fifth);  // q5_k
      store16(o, _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), _mm512_set1_ps(s.scale[0]), _mm512_set1_ps(s.shift[0])), 0xFFFF);
      store16(o + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), _mm512_set1_ps(s.scale[1]), _mm512_set1_ps(s.shift[1])), 0xFFFF);
#elif defined(__AVX2__)
      using pagoda_simd::store8;
      for (int c = 0; c < 2; ++c) {
        __m256i lo, hi;
        nibbles8(q, c, lo, hi);
        if (q6) {
          const __m256i h = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(high + 8 * c)));
          const __m256i three = _mm256_set1_epi32(3), minus32 = _mm256_set1_epi32(-32);
          lo = _mm256_add_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(_mm256_and_si256(_mm256_srl_epi32(h, _mm_cvtsi32_si128(shift)), three), 4)), minus32);
          hi = _mm256_add_epi32(_mm256_or_si256(hi, _mm256_slli_epi32(_mm256_and_si256(_mm256_srl_epi32(h, _mm_cvtsi32_si128(shift + 4)), three), 4)), minus32);
        }
        if (fifth != 0u) or_fifth_bits(lo, hi, fifth, c);  // q5_k
        store8(o + 8 * c, _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_set1_ps(s.scale[0]), _mm256_set1_ps(s.shift[0])));
        store8(o + 16 + 8 * c, _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), _mm256_set1_ps(s.scale[1]), _mm256_set1_ps(s.shift[1])));
      }
#else
      for (int64_t j = 0; j < 16; ++j) {
        int lo = q[j] & 0x0F, hi = q[j] >> 4;
        if (q6) {
          lo = (lo | (((high[j] >> shift) & 3) << 4)) - 32;
          hi = (hi | (((high[j] >> (shift + 4)) & 3) << 4)) - 32;
        }
        lo |= ((fifth >> j) & 1) << 4;
        hi |= ((fifth >> (j + 16)) & 1) << 4;
        o[j] = static_cast<T>(std::fma(static_cast<float>(lo), s.scale[0], s.shift[0]));
        o[j + 16] = static_cast<T>(std::fma(static_cast<float>(hi), s.scale[1], s.shift[1]));
      }
#endif
    }
  }
}
template void dequantize_k_rows<float>(const KWeight&, float*, int64_t, int64_t);
template void dequantize_k_rows<at::BFloat16>(const KWeight&, at::BFloat16*, int64_t, int64_t);

#ifdef PAGODA_HAS_VNNI
namespace {

// 512 bits of 16-bit lanes: `first` in the low 256, `second` in the high.
inline __m512i halves16(int16_t first, int16_t second) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set1_epi16(first)), _mm256_set1_epi16(second), 1);
}

template <int64_t Format, int64_t MT, typename Tout>
void k_dot_rows(const Activations& a, const KWeight& w, const float* bias, Tout* y, int64_t mi,
                int64_t n0, int64_t n1) {
  constexpr bool kQ6 = Format == kQ6_K, kQ5 = Format == kQ5_K;
  const int64_t groups = a.groups, nb = w.nb, supers = nb / 8;
  const __m512i low = _mm512_set1_epi8(0x0F), pair = _mm512_set1_epi8(0x30);
  // q6_k: a group's 32 bytes of high bits, twice; the pairs for the low nibbles' 64
  // positions are bits 0-1 (first 32) and 2-3 (last 32), the high nibbles' bits 4-7.
  const __m512i lo_shift = halves16(4, 2), hi_shift = halves16(0, 2);
  // Lane l of a load belongs to block l / 4: its scale (and, q6_k, its second half's).
  const __m512i even = _mm512_set_epi32(6, 6, 6, 6, 4, 4, 4, 4, 2, 2, 2, 2, 0, 0, 0, 0);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wrow = w.qs + n * nb * 16;
    const uint8_t* srow = w.sc + n * nb * 2;
    __m512 acc[MT];
    for (int64_t t = 0; t < MT; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      _mm_prefetch(reinterpret_cast<const char*>(wrow + g * 64 + kPrefetchBytes), _MM_HINT_T0);
      const __m512i codes = _mm512_loadu_si512(wrow + g * 64);
      __m512i lo = _mm512_and_si512(codes, low), hi = _mm512_and_si512(_mm512_srli_epi16(codes, 4), low);
      const __m128i s8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(srow + g * 8));
      const __m512 d = _mm512_set1_ps(to_float(w.d[n * supers + g / 2]));
      __m512 dlo, dhi;
      if constexpr (kQ6) {
        const __m512i h = _mm512_broadcast_i64x4(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.qh + (n * groups + g) * 32)));
        lo = _mm512_or_si512(lo, _mm512_and_si512(_mm512_sllv_epi16(h, lo_shift), pair));
        hi = _mm512_or_si512(hi, _mm512_and_si512(_mm512_srlv_epi16(h, hi_shift), pair));
        const __m512 s = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(s8));
        dlo = _mm512_mul_ps(_mm512_permutexvar_ps(even, s), d);
        dhi = _mm512_mul_ps(_mm512_permutexvar_ps(odd, s), d);
      } else {
        if constexpr (kQ5) or_fifth_bits(lo, hi, w.fifth + n * nb + g * 4, 4);
        dlo = _mm512_mul_ps(_mm512_permutexvar_ps(even, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(s8))), d);
        dhi = dlo;
      }
#pragma GCC unroll 8
      for (int64_t t = 0; t < MT; ++t) {
        const int64_t i = mi + t;
        const int8_t* act = a.q.data() + (i * groups + g) * 128;
        const __m512 as = _mm512_loadu_ps(a.scale.data() + (i * groups + g) * 16);
        if constexpr (kQ6) {
          const __m512i slo = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(act));
          const __m512i shi = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi, _mm512_loadu_si512(act + 64));
          const __m512 both = _mm512_fmadd_ps(_mm512_cvtepi32_ps(shi), dhi, _mm512_mul_ps(_mm512_cvtepi32_ps(slo), dlo));
          acc[t] = _mm512_fmadd_ps(both, as, acc[t]);
        } else {
          __m512i sum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(act));
          sum = _mm512_dpbusd_epi32(sum, hi, _mm512_loadu_si512(act + 64));
          acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(dlo, as), acc[t]);
        }
      }
    }
    // The constant terms: q6_k's -32 d sc s16_a, a super-block (16 half blocks) at a
    // time; q4_k's -dmin mn s_a, 16 blocks (two super-blocks) at a time.
    __m512 extra[MT];
    for (int64_t t = 0; t < MT; ++t) extra[t] = _mm512_setzero_ps();
    if constexpr (kQ6) {
      for (int64_t s = 0; s < supers; ++s) {
        const __m128i s16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(srow + s * 16));
        const __m512 c = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(s16)),
                                       _mm512_set1_ps(-32.f * to_float(w.d[n * supers + s])));
        for (int64_t t = 0; t < MT; ++t)
          extra[t] = _mm512_fmadd_ps(c, _mm512_loadu_ps(a.sum16.data() + ((mi + t) * nb + s * 8) * 2), extra[t]);
      }
    } else {
      const __m512i which = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
      for (int64_t b = 0; b < nb; b += 16) {
        const bool whole = nb - b >= 16;
        const __mmask16 mask = whole ? 0xFFFF : 0x00FF;
        const __m512i pairs = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, srow + b * 2));
        const __m512 mins = _mm512_cvtepi32_ps(_mm512_srli_epi32(pairs, 8));  // (sc, mn) bytes
        const __m128i dmin_h = _mm_maskz_loadu_epi16(whole ? 0x3 : 0x1, w.m + n * supers + b / 8);
        const __m512 dmin = _mm512_permutexvar_ps(which, _mm512_castps128_ps512(_mm_cvtph_ps(dmin_h)));
        const __m512 c = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(mins, dmin));
        for (int64_t t = 0; t < MT; ++t) {
          const float* s = a.sum.data() + (mi + t) * groups * 4 + b;
          extra[t] = _mm512_fmadd_ps(c, _mm512_maskz_loadu_ps(mask, s), extra[t]);
        }
      }
    }
    const float b0 = bias != nullptr ? bias[n] : 0.f;
    for (int64_t t = 0; t < MT; ++t)
      y[(mi + t) * w.N + n] = static_cast<Tout>(_mm512_reduce_add_ps(_mm512_add_ps(acc[t], extra[t])) + b0);
  }
}

template <int64_t Format, typename Tout>
void k_dot_format(const Activations& a, const KWeight& w, const float* bias, Tout* y, int64_t M,
                  int64_t n0, int64_t n1) {
  for_row_tiles(M, [&](auto mt, int64_t i) {
    k_dot_rows<Format, decltype(mt)::value>(a, w, bias, y, i, n0, n1);
  });
}

}  // namespace

template <typename Tout>
void k_dot_all(const Activations& a, const KWeight& w, const float* bias, Tout* y, int64_t M,
               int64_t n0, int64_t n1) {
  if (w.format == kQ4_K)
    k_dot_format<kQ4_K>(a, w, bias, y, M, n0, n1);
  else if (w.format == kQ5_K)
    k_dot_format<kQ5_K>(a, w, bias, y, M, n0, n1);
  else
    k_dot_format<kQ6_K>(a, w, bias, y, M, n0, n1);
}
template void k_dot_all<float>(const Activations&, const KWeight&, const float*, float*, int64_t,
                               int64_t, int64_t);
template void k_dot_all<at::BFloat16>(const Activations&, const KWeight&, const float*,
                                      at::BFloat16*, int64_t, int64_t, int64_t);
#endif

}  // namespace pagoda_quant
