// y = x @ w.T (+ bias) for a few rows of x and a bf16 weight: the decode GEMMs
// at small batch, where every weight byte is read for very little arithmetic.
//
// oneDNN runs these at about 16 GB/s on the machine we measured (its M=1 path
// is not bandwidth-bound); streaming each weight row once with AVX512-BF16 dot
// products reaches the memory bandwidth instead. Accumulation is float32, one
// rounding to bf16 at the end, as in oneDNN. Large M stays with oneDNN, which
// wins once the weights are reused from cache.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define PAGODA_HAS_BF16_DOT 1
#endif

namespace {

#ifdef PAGODA_HAS_BF16_DOT
constexpr int64_t kRowBlock = 4;  // weight rows per pass: four independent accumulators

inline __m512bh load_pairs(const uint16_t* p, int64_t n) {
  // n bf16 values (n <= 32), zero-filled past n.
  if (n == 32) return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p));
  return reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16((__mmask32(1) << n) - 1, p));
}

inline uint16_t to_bf16_bits(float f) {
  const c10::BFloat16 b(f);  // round to nearest even
  uint16_t bits;
  std::memcpy(&bits, &b, sizeof(bits));
  return bits;
}

// Rows [n0, n1) of y for all M rows of x: R weight rows against MT rows of x at a
// time (R x MT accumulators), so each loaded weight chunk serves MT dot products.
template <int64_t R, int64_t MT>
void tile(const uint16_t* x, const uint16_t* w, const float* bias, uint16_t* y, int64_t N,
          int64_t K, int64_t n, int64_t m) {
  __m512 acc[MT][R];
  for (int64_t i = 0; i < MT; ++i)
    for (int64_t r = 0; r < R; ++r) acc[i][r] = _mm512_setzero_ps();
  auto step = [&](int64_t k, int64_t len) {
    __m512bh xv[MT];
    for (int64_t i = 0; i < MT; ++i) xv[i] = load_pairs(x + (m + i) * K + k, len);
    for (int64_t r = 0; r < R; ++r) {
      // The next tile's rows, one tile ahead: the hardware prefetcher alone leaves the
      // stream at about 60% of the memory bandwidth (benchmarks/cpu_kernels.py).
      _mm_prefetch(reinterpret_cast<const char*>(w + (n + R + r) * K + k), _MM_HINT_T0);
      const __m512bh wv = load_pairs(w + (n + r) * K + k, len);
      for (int64_t i = 0; i < MT; ++i) acc[i][r] = _mm512_dpbf16_ps(acc[i][r], xv[i], wv);
    }
  };
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) step(k, 32);
  if (k < K) step(k, K - k);
  for (int64_t i = 0; i < MT; ++i)
    for (int64_t r = 0; r < R; ++r) {
      const float b = bias != nullptr ? bias[n + r] : 0.f;
      y[(m + i) * N + n + r] = to_bf16_bits(_mm512_reduce_add_ps(acc[i][r]) + b);
    }
}

template <int64_t R>
void rows_pass(const uint16_t* x, const uint16_t* w, const float* bias, uint16_t* y, int64_t M,
               int64_t N, int64_t K, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n + R <= n1; n += R) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) tile<R, 4>(x, w, bias, y, N, K, n, m);
    if (m + 2 <= M) tile<R, 2>(x, w, bias, y, N, K, n, m), m += 2;
    if (m < M) tile<R, 1>(x, w, bias, y, N, K, n, m);
  }
}
#endif

}  // namespace

bool small_gemm_available() {
#ifdef PAGODA_HAS_BF16_DOT
  return true;
#else
  return false;
#endif
}

// x: [M, K] bf16, w: [N, K] bf16, bias: [N] or undefined -> [M, N] bf16.
at::Tensor small_gemm(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(small_gemm_available(), "small_gemm: built without AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "small_gemm: bad shapes");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16,
              "small_gemm: bfloat16 only");
  x = x.contiguous();
  w = w.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = at::empty({M, N}, x.options());
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) bias_f = bias->to(at::kFloat).contiguous();
#ifdef PAGODA_HAS_BF16_DOT
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  const int64_t blocks = N / kRowBlock;
  // Contiguous row ranges per thread: each streams its own part of the weight.
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    rows_pass<kRowBlock>(xp, wp, bp, yp, M, N, K, b0 * kRowBlock, b1 * kRowBlock);
  });
  rows_pass<1>(xp, wp, bp, yp, M, N, K, blocks * kRowBlock, N);  // the N % 4 tail
#endif
  return y;
}
