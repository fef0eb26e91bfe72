// Linear layers on weights kept in GGUF's block formats (32 weights a block, one fp16
// scale each): q8_0, q4_0, q4_1, q5_0 and q5_1, as pagoda repacks them at load (see
// pagoda/model_executor/quantization.py):
//
//   qs  uint8 [N, K/32, B]  q4: B = 16, element j in byte j's low nibble, j + 16 in its high
//                           q8: B = 32, stored + 128 so that every weight byte is unsigned
//   d   fp16  [N, K/32]     scale
//   m   fp16  [N, K/32]     the block's minimum: always for q4_1/q5_1, optional otherwise
//   qh  int32 [N, K/32]     q5: bit j is element j's fifth bit, set into the nibble's byte
//   weight = d * (q - offset) + m      offset: 8 (q4_0), 16 (q5_0), 128 (q8_0), 0 (q4_1, q5_1)
//
// quant_linear (decode, a few rows): the activations are quantized per block of 32 to
// int8 (d_a = max|x| / 127, as llama.cpp's q8_1) and each weight byte is read once into
// AVX512-VNNI dot products (vpdpbusd: unsigned weight bytes x signed activation bytes,
// four products summed into each int32 lane). Per block and activation row:
//
//   sum_k w_k x_k = d_w d_a sum_k q_k a_k + (m_w - offset d_w) s_a,   s_a = d_a sum_k a_k
//
// A 64-byte load holds 4 q4 blocks (4 lanes each) or 2 q8 blocks (8 lanes each); the
// activations are laid out to match, so lane l of the int32 sums belongs to block
// l / (16 / blocks per load), and one fused multiply-add per load applies the scales.
//
// dequantize (prefill, many rows): the weights back to a float matrix, for oneDNN's GEMM.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "quant_blocks.h"

namespace {
using namespace pagoda_quant;


bool has_high_bits(int64_t format) { return format == kQ5_0 || format == kQ5_1; }
float offset_of(int64_t format) {
  return format == kQ8_0 ? 128.f : format == kQ4_0 ? 8.f : format == kQ5_0 ? 16.f : 0.f;
}

void check_weight(const at::Tensor& qs, const at::Tensor& d, const c10::optional<at::Tensor>& m,
                  const c10::optional<at::Tensor>& qh, int64_t format) {
  TORCH_CHECK(format >= kQ8_0 && format <= kQ5_1, "unknown format ", format);
  TORCH_CHECK(qs.dim() == 3 && qs.scalar_type() == at::kByte && qs.is_contiguous(),
              "qs must be a contiguous uint8 [N, K/32, bytes] tensor");
  TORCH_CHECK(qs.size(2) == block_bytes(format), "qs has ", qs.size(2), " bytes a block");
  TORCH_CHECK(d.scalar_type() == at::kHalf && d.is_contiguous() && d.dim() == 2 &&
                  d.size(0) == qs.size(0) && d.size(1) == qs.size(1),
              "d must be a contiguous float16 [N, K/32] tensor");
  TORCH_CHECK(m.has_value() || (format != kQ4_1 && format != kQ5_1), "q4_1/q5_1 need minimums m");
  TORCH_CHECK(qh.has_value() == has_high_bits(format), "qh is given exactly for q5_0/q5_1");
  if (qh.has_value())
    TORCH_CHECK(qh->sizes() == d.sizes() && qh->scalar_type() == at::kInt && qh->is_contiguous(),
                "qh must be a contiguous int32 [N, K/32] tensor");
  if (m.has_value())
    TORCH_CHECK(m->sizes() == d.sizes() && m->scalar_type() == at::kHalf && m->is_contiguous(),
                "m must be like d");
}

// ---- dequantize ----------------------------------------------------------------------

// One block of 32 into o: value = q * scale + shift, shift = m - offset * scale. q * scale
// is exact (an 8-bit integer times an fp16 scale), so one rounding, as in the PyTorch
// twin. bits: q5's fifth bits (0 for the other formats).
#if defined(__AVX512F__)
template <typename T>
inline void dequantize_block(const uint8_t* q, int64_t format, uint32_t bits, float scale,
                             float shift, T* o) {
  using pagoda_simd::store16;
  const __m512 sv = _mm512_set1_ps(scale), hv = _mm512_set1_ps(shift);
  const __m512i first = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  if (format == kQ8_0) {
    const __m512i second = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16)));
    store16(o, _mm512_fmadd_ps(_mm512_cvtepi32_ps(first), sv, hv), 0xFFFF);
    store16(o + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(second), sv, hv), 0xFFFF);
    return;
  }
  // elements 0..15 in the low nibbles, 16..31 in the high ones
  __m512i lo = _mm512_and_si512(first, _mm512_set1_epi32(0x0F)), hi = _mm512_srli_epi32(first, 4);
  if (bits != 0u) or_fifth_bits(lo, hi, bits);
  store16(o, _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), sv, hv), 0xFFFF);
  store16(o + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), sv, hv), 0xFFFF);
}
#elif defined(__AVX2__)
template <typename T>
inline void dequantize_block(const uint8_t* q, int64_t format, uint32_t bits, float scale,
                             float shift, T* o) {
  using pagoda_simd::store8;
  const __m256 sv = _mm256_set1_ps(scale), hv = _mm256_set1_ps(shift);
  if (format == kQ8_0) {
    for (int c = 0; c < 4; ++c) {
      const __m256i codes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * c)));
      store8(o + 8 * c, _mm256_fmadd_ps(_mm256_cvtepi32_ps(codes), sv, hv));
    }
    return;
  }
  for (int c = 0; c < 2; ++c) {
    __m256i lo, hi;
    nibbles8(q, c, lo, hi);
    if (bits != 0u) or_fifth_bits(lo, hi, bits, c);
    store8(o + 8 * c, _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), sv, hv));
    store8(o + 16 + 8 * c, _mm256_fmadd_ps(_mm256_cvtepi32_ps(hi), sv, hv));
  }
}
#else
template <typename T>
inline void dequantize_block(const uint8_t* q, int64_t format, uint32_t bits, float scale,
                             float shift, T* o) {
  for (int64_t j = 0; j < 16; ++j) {
    const int lo = format == kQ8_0 ? q[j] : (q[j] & 0x0F) | (((bits >> j) & 1) << 4);
    const int hi = format == kQ8_0 ? q[j + 16] : (q[j] >> 4) | (((bits >> (j + 16)) & 1) << 4);
    o[j] = static_cast<T>(std::fma(static_cast<float>(lo), scale, shift));
    o[j + 16] = static_cast<T>(std::fma(static_cast<float>(hi), scale, shift));
  }
}
#endif

template <typename T>
void dequantize_rows(const uint8_t* qs, const at::Half* d, const at::Half* m, const int32_t* qh,
                     int64_t format, T* out, int64_t nb, int64_t n0, int64_t n1) {
  const int64_t bb = block_bytes(format);
  const float offset = offset_of(format);
  for (int64_t n = n0; n < n1; ++n) {
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t at = n * nb + b;
      const float scale = to_float(d[at]);
      const float shift = (m != nullptr ? to_float(m[at]) : 0.f) - offset * scale;
      const uint32_t bits = qh != nullptr ? static_cast<uint32_t>(qh[at]) : 0u;
      dequantize_block(qs + at * bb, format, bits, scale, shift, out + at * kBlock);
    }
  }
}

#ifdef PAGODA_HAS_VNNI
// ---- the dot products ------------------------------------------------------------

// 16 fp32 lanes holding the fp16 scales of the `count` blocks at p, each repeated over
// its lanes; lanes of absent blocks are 0 (a masked load: never garbage, never NaN).
inline __m512 lane_scales(const at::Half* p, int64_t count, int64_t per_load) {
  const __m128i h = _mm_maskz_loadu_epi16(static_cast<__mmask8>((1u << count) - 1), p);
  const __m512 f = _mm512_castps256_ps512(_mm256_cvtph_ps(h));
  const __m512i index = per_load == 4
                            ? _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0)
                            : _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  return _mm512_permutexvar_ps(index, f);
}

// Rows [n0, n1) of y = x w^T for the M activation rows (MT at a time).
template <int64_t Format, int64_t MT, typename Tout>
void dot_rows(const Activations& a, const uint8_t* qs, const at::Half* d, const at::Half* m,
              const int32_t* qh, const float* bias, Tout* y, int64_t mi, int64_t N, int64_t nb,
              int64_t n0, int64_t n1) {
  constexpr bool kQ4 = Format != kQ8_0;  // 4-bit nibbles (and q5's fifth bits apart)
  constexpr bool kQ5 = Format == kQ5_0 || Format == kQ5_1;
  constexpr int64_t kBytes = kQ4 ? 16 : 32;
  constexpr int64_t kPerLoad = 64 / kBytes;
  const float offset = offset_of(Format);
  const int64_t groups = a.groups;
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* wrow = qs + n * nb * kBytes;
    const at::Half* drow = d + n * nb;
    __m512 acc[MT];
    for (int64_t t = 0; t < MT; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t count = std::min(kPerLoad, nb - g * kPerLoad);
      _mm_prefetch(reinterpret_cast<const char*>(wrow + g * 64 + kPrefetchBytes), _MM_HINT_T0);
      const __m512i w = count == kPerLoad
                            ? _mm512_loadu_si512(wrow + g * 64)
                            : _mm512_maskz_loadu_epi8((~0ULL) >> (64 - count * kBytes), wrow + g * 64);
      const __m512 dw = lane_scales(drow + g * kPerLoad, count, kPerLoad);
      __m512i lo = w, hi = w;
      if constexpr (kQ4) {
        lo = _mm512_and_si512(w, low);
        hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), low);
      }
      if constexpr (kQ5) or_fifth_bits(lo, hi, qh + n * nb + g * kPerLoad, count);
#pragma GCC unroll 8
      for (int64_t t = 0; t < MT; ++t) {
        const int64_t i = mi + t;
        const int8_t* act = a.q.data() + ((i * groups + g) * (kQ4 ? 2 : 1)) * 64;
        __m512i sum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(act));
        if constexpr (kQ4) sum = _mm512_dpbusd_epi32(sum, hi, _mm512_loadu_si512(act + 64));
        const __m512 scale = _mm512_mul_ps(dw, _mm512_loadu_ps(a.scale.data() + (i * groups + g) * 16));
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), scale, acc[t]);
      }
    }
    // The per-block constant: (m_w - offset d_w) s_a, 16 blocks at a time.
    __m512 extra[MT];
    for (int64_t t = 0; t < MT; ++t) extra[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b += 16) {
      const __mmask16 mask = static_cast<__mmask16>(nb - b >= 16 ? 0xFFFF : (1u << (nb - b)) - 1);
      const __m512 dv = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, drow + b));
      __m512 c = _mm512_mul_ps(dv, _mm512_set1_ps(-offset));
      if (m != nullptr) c = _mm512_add_ps(c, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, m + n * nb + b)));
      for (int64_t t = 0; t < MT; ++t) {
        const float* s = a.sum.data() + (mi + t) * groups * kPerLoad + b;
        extra[t] = _mm512_fmadd_ps(c, _mm512_maskz_loadu_ps(mask, s), extra[t]);
      }
    }
    const float b0 = bias != nullptr ? bias[n] : 0.f;
    for (int64_t t = 0; t < MT; ++t)
      y[(mi + t) * N + n] = static_cast<Tout>(_mm512_reduce_add_ps(_mm512_add_ps(acc[t], extra[t])) + b0);
  }
}

template <int64_t Format, typename Tout>
void dot_all(const Activations& a, const uint8_t* qs, const at::Half* d, const at::Half* m,
             const int32_t* qh, const float* bias, Tout* y, int64_t M, int64_t N, int64_t nb,
             int64_t n0, int64_t n1) {
  for_row_tiles(M, [&](auto mt, int64_t i) {
    dot_rows<Format, decltype(mt)::value>(a, qs, d, m, qh, bias, y, i, N, nb, n0, n1);
  });
}
#endif

}  // namespace

#ifdef PAGODA_HAS_VNNI
namespace pagoda_quant {
template <typename Tout>
void block_dot_all(const Activations& a, int64_t format, const uint8_t* qs, const at::Half* d,
                   const at::Half* m, const int32_t* qh, const float* bias, Tout* y, int64_t M,
                   int64_t N, int64_t nb, int64_t n0, int64_t n1) {
  switch (format) {
    case kQ8_0: return dot_all<kQ8_0>(a, qs, d, m, qh, bias, y, M, N, nb, n0, n1);
    case kQ4_0: return dot_all<kQ4_0>(a, qs, d, m, qh, bias, y, M, N, nb, n0, n1);
    case kQ4_1: return dot_all<kQ4_1>(a, qs, d, m, qh, bias, y, M, N, nb, n0, n1);
    case kQ5_0: return dot_all<kQ5_0>(a, qs, d, m, qh, bias, y, M, N, nb, n0, n1);
    default: return dot_all<kQ5_1>(a, qs, d, m, qh, bias, y, M, N, nb, n0, n1);
  }
}
}  // namespace pagoda_quant
#endif

bool quant_linear_available() {
#ifdef PAGODA_HAS_INT8_DOT
  return true;
#else
  return false;
#endif
}

at::Tensor dequantize(at::Tensor qs, at::Tensor d, c10::optional<at::Tensor> m, int64_t format,
                      at::ScalarType dtype, c10::optional<at::Tensor> out_buffer,
                      c10::optional<at::Tensor> qh, c10::optional<at::Tensor> sc) {
  KWeight kw{};
  if (is_k_quant(format))
    kw = check_k_weight(qs, d, m, qh, sc, format);
  else
    check_weight(qs, d, m, qh, format);
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dequantize to float32 or bfloat16");
  const int64_t N = qs.size(0), nb = qs.size(1);
  // Into `out_buffer` (at least N * K elements of dtype) when given: a large weight in a
  // fresh allocation costs a page fault per 4 KiB on first write, most of the time here.
  at::Tensor out;
  if (out_buffer.has_value()) {
    TORCH_CHECK(out_buffer->scalar_type() == dtype && out_buffer->is_contiguous() &&
                    out_buffer->numel() >= N * nb * kBlock,
                "out_buffer must be a contiguous ", dtype, " tensor of at least N * K elements");
    out = out_buffer->view(-1).narrow(0, 0, N * nb * kBlock).view({N, nb * kBlock});
  } else {
    out = at::empty({N, nb * kBlock}, qs.options().dtype(dtype));
  }
  const uint8_t* q = qs.data_ptr<uint8_t>();
  const at::Half* dp = d.data_ptr<at::Half>();
  const at::Half* mp = m.has_value() ? m->data_ptr<at::Half>() : nullptr;
  const int32_t* hp = qh.has_value() && !is_k_quant(format) ? qh->data_ptr<int32_t>() : nullptr;
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    if (is_k_quant(format)) {
      if (dtype == at::kFloat)
        dequantize_k_rows(kw, out.data_ptr<float>(), n0, n1);
      else
        dequantize_k_rows(kw, out.data_ptr<at::BFloat16>(), n0, n1);
    } else if (dtype == at::kFloat)
      dequantize_rows(q, dp, mp, hp, format, out.data_ptr<float>(), nb, n0, n1);
    else
      dequantize_rows(q, dp, mp, hp, format, out.data_ptr<at::BFloat16>(), nb, n0, n1);
  });
  return out;
}

at::Tensor quant_linear(at::Tensor x, at::Tensor qs, at::Tensor d, c10::optional<at::Tensor> m,
                        int64_t format, c10::optional<at::Tensor> bias,
                        c10::optional<at::Tensor> qh, c10::optional<at::Tensor> sc) {
#ifdef PAGODA_HAS_INT8_DOT
  KWeight kw{};
  if (is_k_quant(format))
    kw = check_k_weight(qs, d, m, qh, sc, format);
  else
    check_weight(qs, d, m, qh, format);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [M, K] tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "x must be float32 or bfloat16");
  const int64_t M = x.size(0), K = x.size(1), N = qs.size(0), nb = qs.size(1);
  TORCH_CHECK(K == nb * kBlock, "x has ", K, " columns; the weight takes ", nb * kBlock);
  at::Tensor bias_f;
  if (bias.has_value()) bias_f = bias->to(at::kFloat).contiguous();
  const float* bp = bias.has_value() ? bias_f.data_ptr<float>() : nullptr;
  const Activations a = x.scalar_type() == at::kFloat
                            ? quantize_activations(x.data_ptr<float>(), M, K, format)
                            : quantize_activations(x.data_ptr<at::BFloat16>(), M, K, format);
  auto y = at::empty({M, N}, x.options());
  const uint8_t* q = qs.data_ptr<uint8_t>();
  const at::Half* dp = d.data_ptr<at::Half>();
  const at::Half* mp = m.has_value() ? m->data_ptr<at::Half>() : nullptr;
  const int32_t* hp = qh.has_value() && !is_k_quant(format) ? qh->data_ptr<int32_t>() : nullptr;
  auto run = [&](auto* out) {
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      if (is_k_quant(format)) return k_dot_all(a, kw, bp, out, M, n0, n1);
      block_dot_all(a, format, q, dp, mp, hp, bp, out, M, N, nb, n0, n1);
    });
  };
  if (x.scalar_type() == at::kFloat)
    run(y.data_ptr<float>());
  else
    run(y.data_ptr<at::BFloat16>());
  return y;
#else
  TORCH_CHECK(false, "quant_linear needs AVX512-VNNI or AVX2; use the PyTorch twin");
#endif
}
