// W8A8 linear layers: int8 weights with one float scale per output channel, the
// activations quantized to int8 per row at run time (SmoothQuant's and vLLM's W8A8):
//
//   y[i, n] = s_x[i] s_w[n] sum_k q_x[i, k] q_w[n, k]  (+ bias[n])
//   s_x[i] = max_k |x[i, k]| / 127,   q_x = round(x / s_x)
//
// int8_linear_small (decode, a few rows): AVX512-VNNI's vpdpbusd multiplies unsigned by
// signed bytes, so the activations go in shifted to unsigned (q_x + 128) and the shift
// is taken back with the weight row's sum, itself a vpdpbusd against ones in the same
// pass: sum_k (q_x + 128) q_w - 128 sum_k q_w. Each weight byte is read once, the sums
// stay integers until one scale per output. AVX2 alone: see its dot_rows below.
//
// int8_linear_large (prefill, big batches): the same quantization, then oneDNN's integer
// GEMM (at::_int_mm: AMX-INT8 or VNNI where the CPU has them) and one pass applying
// the scales and bias; on AVX2 alone, our own integer GEMM (gemm_avx2 below).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "quant_blocks.h"  // (for_row_tiles)
#include "simd.h"

namespace {

void check_args(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [M, K] tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "x must be float32 or bfloat16");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar && w.is_contiguous(),
              "w must be a contiguous int8 [N, K] tensor");
  TORCH_CHECK(w.size(1) == x.size(1), "x has ", x.size(1), " columns; the weight takes ", w.size(1));
  TORCH_CHECK(x.size(1) > 0, "x must have at least one column");
  TORCH_CHECK(w_scale.dim() == 1 && w_scale.scalar_type() == at::kFloat && w_scale.is_contiguous() &&
                  w_scale.size(0) == w.size(0),
              "w_scale must be a contiguous float32 [N] tensor");
}

// One row of x as int8 codes, returning its scale: into q_u8 shifted by 128 (for
// vpdpbusd's unsigned operand) or into q_s8 as they are, whichever is given.
template <typename T>
float quantize_row(const T* x, int64_t K, uint8_t* q_u8, int8_t* q_s8) {
#if defined(__AVX512F__)
  using namespace pagoda_simd;
  __m512 vmax = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(load16(x + k, tail_mask(K - k))));
  const float scale = _mm512_reduce_max_ps(vmax) / 127.f;
  const __m512 inv = _mm512_set1_ps(scale != 0.f ? 1.f / scale : 0.f);
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 mask = tail_mask(K - k);
    // Round to nearest even (the default MXCSR mode), as std::nearbyint.
    const __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(load16(x + k, mask), inv));
    if (q_u8 != nullptr)
      _mm_mask_storeu_epi8(q_u8 + k, mask, _mm512_cvtepi32_epi8(_mm512_add_epi32(v, _mm512_set1_epi32(128))));
    if (q_s8 != nullptr) _mm_mask_storeu_epi8(q_s8 + k, mask, _mm512_cvtepi32_epi8(v));
  }
  return scale;
#elif defined(__AVX2__) && defined(__FMA__)
  using namespace pagoda_simd;
  const int64_t whole = K / 8 * 8;
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 vmax = _mm256_setzero_ps();
  for (int64_t k = 0; k < whole; k += 8) vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, load8(x + k)));
  float amax = max8(vmax);
  for (int64_t k = whole; k < K; ++k) amax = std::max(amax, std::fabs(static_cast<float>(x[k])));
  const float scale = amax / 127.f;
  const float inv = scale != 0.f ? 1.f / scale : 0.f;
  const __m256 vinv = _mm256_set1_ps(inv);
  for (int64_t k = 0; k < whole; k += 8) {
    // Round to nearest even (the default MXCSR mode), as std::nearbyint below.
    const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(load8(x + k), vinv));
    const __m128i v16 = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    const __m128i v8 = _mm_packs_epi16(v16, v16);  // (|v| <= 127: no saturation)
    if (q_u8 != nullptr) _mm_storel_epi64(reinterpret_cast<__m128i*>(q_u8 + k), _mm_add_epi8(v8, _mm_set1_epi8(static_cast<char>(0x80))));
    if (q_s8 != nullptr) _mm_storel_epi64(reinterpret_cast<__m128i*>(q_s8 + k), v8);
  }
  for (int64_t k = whole; k < K; ++k) {
    const int32_t v = static_cast<int32_t>(std::nearbyint(static_cast<float>(x[k]) * inv));
    if (q_u8 != nullptr) q_u8[k] = static_cast<uint8_t>(v + 128);
    if (q_s8 != nullptr) q_s8[k] = static_cast<int8_t>(v);
  }
  return scale;
#else
  float amax = 0.f;
  for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(static_cast<float>(x[k])));
  const float scale = amax / 127.f;
  const float inv = scale != 0.f ? 1.f / scale : 0.f;
  for (int64_t k = 0; k < K; ++k) {
    const int32_t v = static_cast<int32_t>(std::nearbyint(static_cast<float>(x[k]) * inv));  // ties to even
    if (q_u8 != nullptr) q_u8[k] = static_cast<uint8_t>(v + 128);
    if (q_s8 != nullptr) q_s8[k] = static_cast<int8_t>(v);
  }
  return scale;
#endif
}

// y[n] = acc[n] * sx * sw[n] + bias[n], in y's dtype.
template <typename Tout>
void store_row(Tout* y, const int32_t* acc, float sx, const float* sw, const float* bias, int64_t N) {
#if defined(__AVX512F__)
  using namespace pagoda_simd;
  const __m512 vsx = _mm512_set1_ps(sx);
  for (int64_t n = 0; n < N; n += 16) {
    const __mmask16 mask = tail_mask(N - n);
    const __m512 a = _mm512_cvtepi32_ps(_mm512_maskz_loadu_epi32(mask, acc + n));
    const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(mask, bias + n) : _mm512_setzero_ps();
    store16(y + n, _mm512_fmadd_ps(_mm512_mul_ps(a, vsx), _mm512_maskz_loadu_ps(mask, sw + n), b), mask);
  }
#elif defined(__AVX2__) && defined(__FMA__)
  using namespace pagoda_simd;
  const __m256 vsx = _mm256_set1_ps(sx);
  int64_t n = 0;
  for (; n + 8 <= N; n += 8) {
    const __m256 a = _mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(acc + n)));
    const __m256 b = bias != nullptr ? _mm256_loadu_ps(bias + n) : _mm256_setzero_ps();
    store8(y + n, _mm256_fmadd_ps(_mm256_mul_ps(a, vsx), _mm256_loadu_ps(sw + n), b));
  }
  for (; n < N; ++n)  // (the lanes' rounding: one fma)
    y[n] = static_cast<Tout>(std::fma(static_cast<float>(acc[n]) * sx, sw[n], bias != nullptr ? bias[n] : 0.f));
#else
  for (int64_t n = 0; n < N; ++n) {
    const float v = static_cast<float>(acc[n]) * sx * sw[n] + (bias != nullptr ? bias[n] : 0.f);
    y[n] = static_cast<Tout>(v);
  }
#endif
}

#ifdef PAGODA_HAS_VNNI
// Rows [n0, n1) of the integer sums for activation rows mi..mi+MT.
template <int64_t MT>
void dot_rows(const uint8_t* xq, int64_t kpad, const int8_t* w, int64_t K, int32_t* acc_out,
              int64_t N, int64_t mi, int64_t n0, int64_t n1) {
  const int64_t chunks = kpad / 64;
  const __mmask64 tail = K % 64 == 0 ? ~0ULL : (~0ULL) >> (64 - K % 64);
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wrow = w + n * K;
    __m512i acc[MT];
    for (int64_t t = 0; t < MT; ++t) acc[t] = _mm512_setzero_si512();
    __m512i wsum = _mm512_setzero_si512();
    for (int64_t c = 0; c < chunks; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(wrow + c * 64 + kPrefetchBytes), _MM_HINT_T0);
      const __m512i wv = c + 1 < chunks || K % 64 == 0 ? _mm512_loadu_si512(wrow + c * 64)
                                                       : _mm512_maskz_loadu_epi8(tail, wrow + c * 64);
      wsum = _mm512_dpbusd_epi32(wsum, ones, wv);
      for (int64_t t = 0; t < MT; ++t)
        acc[t] = _mm512_dpbusd_epi32(acc[t], _mm512_loadu_si512(xq + (mi + t) * kpad + c * 64), wv);
    }
    const int32_t shift = 128 * _mm512_reduce_add_epi32(wsum);
    for (int64_t t = 0; t < MT; ++t) acc_out[(mi + t) * N + n] = _mm512_reduce_add_epi32(acc[t]) - shift;
  }
}
using ActivationCode = uint8_t;  // q_x + 128
constexpr bool kShifted = true;
#elif defined(PAGODA_HAS_INT8_DOT)
// AVX2: vpmaddubsw takes |q_w| (unsigned) against q_x with q_w's sign, int16 pairs of at
// most 2 x 128 x 127 (no saturation), then vpmaddwd adds pairs of those into int32 lanes.
// The activations stay signed; the last K % 32 products are summed one by one.
template <int64_t MT>
void dot_rows(const int8_t* xq, int64_t kpad, const int8_t* w, int64_t K, int32_t* acc_out,
              int64_t N, int64_t mi, int64_t n0, int64_t n1) {
  const int64_t whole = K / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wrow = w + n * K;
    __m256i acc[MT];
    for (int64_t t = 0; t < MT; ++t) acc[t] = _mm256_setzero_si256();
    for (int64_t c = 0; c < whole; ++c) {
      _mm_prefetch(reinterpret_cast<const char*>(wrow + c * 32 + kPrefetchBytes), _MM_HINT_T0);
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wrow + c * 32));
      const __m256i magnitude = _mm256_sign_epi8(wv, wv);
      for (int64_t t = 0; t < MT; ++t) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + (mi + t) * kpad + c * 32));
        acc[t] = _mm256_add_epi32(acc[t], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(xv, wv)), ones));
      }
    }
    for (int64_t t = 0; t < MT; ++t) {
      int32_t sum = pagoda_simd::sum8(acc[t]);
      for (int64_t k = whole * 32; k < K; ++k) sum += static_cast<int32_t>(wrow[k]) * xq[(mi + t) * kpad + k];
      acc_out[(mi + t) * N + n] = sum;
    }
  }
}
using ActivationCode = int8_t;  // q_x as it is
constexpr bool kShifted = false;
#endif

#if defined(PAGODA_HAS_INT8_DOT) && !defined(PAGODA_HAS_VNNI) && !defined(__AVXVNNI__)
#define PAGODA_AVX2_INT8_GEMM 1
// AVX2 alone (AMD Zen 2/3, Intel before Ice Lake): oneDNN's integer GEMM there is 23x
// slower than float32's (8192x768x768: 3.9 against 90 GFLOP/s, AMD EPYC Zen 3 class, 2
// threads), so the products are ours. Each thread repacks the weight, a panel of 16
// columns at a time, 4 bytes of K at a time (64 bytes: two vectors of 8 columns x 4
// bytes), so that an activation row's 4 bytes, broadcast, meet 16 columns in two
// vpmaddubsw (dot_rows's sign trick: |q_w| against q_x with q_w's sign, no saturation);
// a tile of 4 rows x 16 columns keeps its 8 int32 accumulators in registers. vpmaddubsw
// + vpmaddwd run at twice the FMA's rate there: 1.7-1.9x float32's F.linear at 4,096 rows
// (benchmarks/w8a8_gemm.py --dtype float32, same CPU).
constexpr int64_t kPanel = 16, kTileRows = 4;

// Panel p of w [N, K] (its columns 16p to 16p + 15) into `out`, `groups` x 64 bytes: K
// padded with zeros to 4 x groups, N with zero columns. Blocks of 8 columns x 8 groups
// (32 bytes of 8 rows) are an 8 x 8 transpose of 4-byte words; the rest word by word.
void pack_panel(const int8_t* w, int64_t N, int64_t K, int64_t groups, int64_t p, int32_t* panel) {
  for (int64_t c0 = 0; c0 < kPanel; c0 += 8) {
    const int64_t n0 = p * kPanel + c0;
    int64_t g0 = 0;
    for (; n0 + 8 <= N && 4 * (g0 + 8) <= K; g0 += 8) {
      __m256i r[8];
      for (int64_t c = 0; c < 8; ++c) r[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (n0 + c) * K + 4 * g0));
      pagoda_simd::transpose8x8(r);
      for (int64_t g = 0; g < 8; ++g) _mm256_storeu_si256(reinterpret_cast<__m256i*>(panel + (g0 + g) * kPanel + c0), r[g]);
    }
    for (int64_t c = 0; c < 8; ++c) {
      const int64_t n = n0 + c;
      for (int64_t g = g0; g < groups; ++g) {
        int32_t word = 0;
        if (n < N) std::memcpy(&word, w + n * K + 4 * g, std::min<int64_t>(4, K - 4 * g));
        panel[g * kPanel + c0 + c] = word;
      }
    }
  }
}

// The int32 sums of MT activation rows (from `a`, `lda` bytes apart) with one panel's 16
// columns, into out[MT][16].
template <int64_t MT>
inline void tile_sums(const int8_t* a, int64_t lda, const int8_t* panel, int64_t groups, int32_t* out) {
  __m256i acc[MT][2];
  for (int64_t t = 0; t < MT; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t g = 0; g < groups; ++g) {
    const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + g * 64));
    const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + g * 64 + 32));
    const __m256i m0 = _mm256_sign_epi8(w0, w0), m1 = _mm256_sign_epi8(w1, w1);
#pragma GCC unroll 4
    for (int64_t t = 0; t < MT; ++t) {
      int32_t four;
      std::memcpy(&four, a + t * lda + 4 * g, 4);
      const __m256i x = _mm256_set1_epi32(four);
      acc[t][0] = _mm256_add_epi32(acc[t][0], _mm256_madd_epi16(_mm256_maddubs_epi16(m0, _mm256_sign_epi8(x, w0)), ones));
      acc[t][1] = _mm256_add_epi32(acc[t][1], _mm256_madd_epi16(_mm256_maddubs_epi16(m1, _mm256_sign_epi8(x, w1)), ones));
    }
  }
  for (int64_t t = 0; t < MT; ++t) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + t * kPanel), acc[t][0]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + t * kPanel + 8), acc[t][1]);
  }
}

// y = the products of xq's M rows (lda bytes apart) with w, scaled by store_row as
// int8_linear_small's are. Work items are (block of rows, panel), a block's rows about
// 256 KB (they stay in L2 while its panels pass); a thread packs each item's panel
// (L1) and passes the block's rows over it, so the weight is never written back whole.
template <typename T>
void gemm_avx2(const int8_t* xq, int64_t lda, const float* sx, int64_t M, const int8_t* w, int64_t K,
               const float* sw, const float* bias, T* y, int64_t N) {
  const int64_t groups = lda / 4, num_panels = (N + kPanel - 1) / kPanel;
  const int64_t block_rows = std::clamp<int64_t>((int64_t{256} << 10) / lda / kTileRows, 4, 128) * kTileRows;
  const int64_t row_blocks = (M + block_rows - 1) / block_rows;
  at::parallel_for(0, row_blocks * num_panels, 1, [&](int64_t b0, int64_t b1) {
    std::vector<int32_t> panel(groups * kPanel);
    const int8_t* bytes = reinterpret_cast<const int8_t*>(panel.data());
    int32_t sums[kTileRows * kPanel];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t p = b % num_panels, i_end = std::min(M, (b / num_panels + 1) * block_rows);
      pack_panel(w, N, K, groups, p, panel.data());
      const int64_t n0 = p * kPanel, cols = std::min(kPanel, N - n0), i0 = (b / num_panels) * block_rows;
      pagoda_quant::for_row_tiles<kTileRows>(i_end - i0, [&](auto mt, int64_t t0) {
        constexpr int64_t rows = decltype(mt)::value;
        const int64_t i = i0 + t0;
        tile_sums<rows>(xq + i * lda, lda, bytes, groups, sums);
        for (int64_t t = 0; t < rows; ++t)
          store_row(y + (i + t) * N + n0, sums + t * kPanel, sx[i + t], sw + n0, bias != nullptr ? bias + n0 : nullptr, cols);
      });
    }
  });
}
#endif

template <typename T>
at::Tensor small_impl(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale,
                      const float* bias) {
#ifdef PAGODA_HAS_INT8_DOT
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const int64_t kpad = (K + 63) / 64 * 64;
  // Padding: code 0 (128 shifted), against masked-off weights.
  std::vector<ActivationCode> xq(M * kpad, kShifted ? 128 : 0);
  std::vector<float> sx(M);
  const T* xp = x.data_ptr<T>();
  for (int64_t i = 0; i < M; ++i) {
    ActivationCode* row = xq.data() + i * kpad;
    if constexpr (kShifted)
      sx[i] = quantize_row(xp + i * K, K, reinterpret_cast<uint8_t*>(row), nullptr);
    else
      sx[i] = quantize_row(xp + i * K, K, nullptr, reinterpret_cast<int8_t*>(row));
  }
  std::vector<int32_t> acc(M * N);
  const int8_t* wp = w.data_ptr<int8_t>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    int64_t i = 0;
    for (; i + 4 <= M; i += 4) dot_rows<4>(xq.data(), kpad, wp, K, acc.data(), N, i, n0, n1);
    for (; i + 2 <= M; i += 2) dot_rows<2>(xq.data(), kpad, wp, K, acc.data(), N, i, n0, n1);
    for (; i < M; ++i) dot_rows<1>(xq.data(), kpad, wp, K, acc.data(), N, i, n0, n1);
  });
  auto y = at::empty({M, N}, x.options());
  for (int64_t i = 0; i < M; ++i)
    store_row(y.data_ptr<T>() + i * N, acc.data() + i * N, sx[i], w_scale.data_ptr<float>(), bias, N);
  return y;
#else
  TORCH_CHECK(false, "int8_linear_small needs AVX512-VNNI or AVX2; use int8_linear_large");
#endif
}

template <typename T>
at::Tensor large_impl(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale,
                      const float* bias) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
#ifdef PAGODA_AVX2_INT8_GEMM
  const int64_t groups = (K + 3) / 4, lda = groups * 4;  // (rows padded with zero codes)
#else
  const int64_t lda = K;
#endif
  auto xq = at::empty({M, lda}, x.options().dtype(at::kChar));
  std::vector<float> sx(M);
  const T* xp = x.data_ptr<T>();
  int8_t* qp = xq.data_ptr<int8_t>();
  at::parallel_for(0, M, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      sx[i] = quantize_row(xp + i * K, K, nullptr, qp + i * lda);
      std::memset(qp + i * lda + K, 0, lda - K);
    }
  });
#ifdef PAGODA_AVX2_INT8_GEMM
  auto y = at::empty({M, N}, x.options());
  gemm_avx2(qp, lda, sx.data(), M, w.data_ptr<int8_t>(), K, w_scale.data_ptr<float>(), bias, y.data_ptr<T>(), N);
  return y;
#else
  const at::Tensor acc = at::_int_mm(xq, w.t());  // int32 [M, N]
  auto y = at::empty({M, N}, x.options());
  const int32_t* ap = acc.data_ptr<int32_t>();
  T* yp = y.data_ptr<T>();
  const float* sw = w_scale.data_ptr<float>();
  at::parallel_for(0, M, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) store_row(yp + i * N, ap + i * N, sx[i], sw, bias, N);
  });
  return y;
#endif
}

template <typename Fn>
at::Tensor dispatch(const at::Tensor& x, const at::Tensor& w, const at::Tensor& w_scale,
                    const c10::optional<at::Tensor>& bias, Fn&& fn) {
  check_args(x, w, w_scale);
  at::Tensor bias_f;
  if (bias.has_value()) bias_f = bias->to(at::kFloat).contiguous();
  const float* bp = bias.has_value() ? bias_f.data_ptr<float>() : nullptr;
  return fn(bp);
}

template <typename T>
void dequantize_rows(const int8_t* q, const float* scale, T* out, int64_t K, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
#if defined(__AVX512F__)
    using namespace pagoda_simd;
    const __m512 s = _mm512_set1_ps(scale[n]);
    for (int64_t k = 0; k < K; k += 16) {
      const __mmask16 mask = tail_mask(K - k);
      const __m512i v = _mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, q + n * K + k));
      store16(out + n * K + k, _mm512_mul_ps(_mm512_cvtepi32_ps(v), s), mask);
    }
#else
    for (int64_t k = 0; k < K; ++k) out[n * K + k] = static_cast<T>(q[n * K + k] * scale[n]);
#endif
  }
}

}  // namespace

// w as a float matrix (q * scale, one rounding) in out [N, K] (float32 or bfloat16):
// for batches large enough that the bf16 GEMM beats the integer one.
void int8_dequantize(at::Tensor w, at::Tensor w_scale, at::Tensor out) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar && w.is_contiguous(), "w: int8 [N, K]");
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.numel() == w.size(0), "w_scale: float32 [N]");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == w.sizes() &&
                  (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16),
              "out: a contiguous float32 or bfloat16 tensor shaped like w");
  const int64_t K = w.size(1);
  at::parallel_for(0, w.size(0), 16, [&](int64_t n0, int64_t n1) {
    if (out.scalar_type() == at::kFloat)
      dequantize_rows(w.data_ptr<int8_t>(), w_scale.data_ptr<float>(), out.data_ptr<float>(), K, n0, n1);
    else
      dequantize_rows(w.data_ptr<int8_t>(), w_scale.data_ptr<float>(), out.data_ptr<at::BFloat16>(), K, n0, n1);
  });
}

bool int8_linear_small_available() {
#ifdef PAGODA_HAS_INT8_DOT
  return true;
#else
  return false;
#endif
}

at::Tensor int8_linear_small(at::Tensor x, at::Tensor w, at::Tensor w_scale,
                             c10::optional<at::Tensor> bias) {
  return dispatch(x, w, w_scale, bias, [&](const float* bp) {
    return x.scalar_type() == at::kFloat ? small_impl<float>(x, w, w_scale, bp)
                                         : small_impl<at::BFloat16>(x, w, w_scale, bp);
  });
}

at::Tensor int8_linear_large(at::Tensor x, at::Tensor w, at::Tensor w_scale,
                             c10::optional<at::Tensor> bias) {
  return dispatch(x, w, w_scale, bias, [&](const float* bp) {
    return x.scalar_type() == at::kFloat ? large_impl<float>(x, w, w_scale, bp)
                                         : large_impl<at::BFloat16>(x, w, w_scale, bp);
  });
}
