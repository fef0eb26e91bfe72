// y = x @ w.T (+ bias) for a few rows of x and a bf16 weight: the decode GEMMs
// at small batch, where every weight byte is read for very little arithmetic.
//
// oneDNN runs these at about 16 GB/s on the machine we measured (its M=1 path
// is not bandwidth-bound); streaming each weight row once with AVX512-BF16 dot
// products reaches the memory bandwidth instead. Accumulation is float32, one
// rounding to bf16 at the end, as in oneDNN. Large M stays with oneDNN, which
// wins once the weights are reused from cache.
//
// Every output element is one accumulator over K in the same order (16 lanes, a
// chunk of K at a time, then one horizontal sum), whatever M, the tile it falls in,
// or the threads: a row's result never depends on the other rows. The batch-invariant
// mode (pagoda.ops.cpu) therefore runs every bf16 product here, and float32 ones in
// the float32 twin below, at any M; rows are then taken in blocks that stay in cache.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <algorithm>
#include <cstring>
#include <type_traits>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define PAGODA_HAS_BF16_DOT 1
#define PAGODA_HAS_SMALL_GEMM 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PAGODA_HAS_SMALL_GEMM 1  // bf16 widened to float32, 8 lanes (no AVX512-BF16)
#endif

namespace {

#ifdef PAGODA_HAS_SMALL_GEMM
constexpr int64_t kRowBlock = 4;  // weight rows per pass: four independent accumulators

inline uint16_t to_bf16_bits(float f) {
  const c10::BFloat16 b(f);  // round to nearest even
  uint16_t bits;
  std::memcpy(&bits, &b, sizeof(bits));
  return bits;
}
inline void store_out(uint16_t* y, float v) { *y = to_bf16_bits(v); }
inline void store_out(float* y, float v) { *y = v; }
#endif

#ifdef PAGODA_HAS_BF16_DOT
using Acc = __m512;
inline Acc zero_acc() { return _mm512_setzero_ps(); }
inline float sum_acc(Acc a) { return _mm512_reduce_add_ps(a); }

inline __m512bh load_pairs(const uint16_t* p, int64_t n) {
  // n bf16 values (n <= 32), zero-filled past n.
  if (n == 32) return reinterpret_cast<__m512bh>(_mm512_loadu_si512(p));
  return reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16((__mmask32(1) << n) - 1, p));
}

inline __m512 load_floats(const float* p, int64_t n) {
  // n floats (n <= 16), zero-filled past n.
  if (n == 16) return _mm512_loadu_ps(p);
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p);
}

// bf16 (uint16_t bits): 32 values a step, in pairs; float: 16 a step.
template <typename T> constexpr int64_t kStep = std::is_same_v<T, float> ? 16 : 32;
inline __m512bh load_step(const uint16_t* p, int64_t n) { return load_pairs(p, n); }
inline __m512 load_step(const float* p, int64_t n) { return load_floats(p, n); }
inline __m512 dot_step(__m512 acc, __m512bh x, __m512bh w) { return _mm512_dpbf16_ps(acc, x, w); }
inline __m512 dot_step(__m512 acc, __m512 x, __m512 w) { return _mm512_fmadd_ps(x, w, acc); }
#elif defined(PAGODA_HAS_SMALL_GEMM)
// AVX2: 8 values a step, bf16 widened to float32 (a bf16 product is exact in float32,
// so the sums are those of the AVX512-BF16 kernel's order up to the lanes' count).
using Acc = __m256;
inline Acc zero_acc() { return _mm256_setzero_ps(); }
inline float sum_acc(Acc a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
template <typename T> constexpr int64_t kStep = 8;
inline __m256 load_step(const uint16_t* p, int64_t n) {  // zero-filled past n (n <= 8)
  uint16_t tail[8] = {};
  if (n < 8) std::memcpy(tail, p, n * sizeof(uint16_t)), p = tail;
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load_step(const float* p, int64_t n) {
  float tail[8] = {};
  if (n < 8) std::memcpy(tail, p, n * sizeof(float)), p = tail;
  return _mm256_loadu_ps(p);
}
inline __m256 dot_step(__m256 acc, __m256 x, __m256 w) { return _mm256_fmadd_ps(x, w, acc); }
#endif

#ifdef PAGODA_HAS_SMALL_GEMM
// Rows [n0, n1) of y for all M rows of x: R weight rows against MT rows of x at a
// time (R x MT accumulators), so each loaded weight chunk serves MT dot products.
template <typename T, int64_t R, int64_t MT>
void tile(const T* x, const T* w, const float* bias, T* y, int64_t N, int64_t K, int64_t n,
          int64_t m) {
  constexpr int64_t S = kStep<T>;
  Acc acc[MT][R];
  for (int64_t i = 0; i < MT; ++i)
    for (int64_t r = 0; r < R; ++r) acc[i][r] = zero_acc();
  auto step = [&](int64_t k, int64_t len) {
    decltype(load_step(x, len)) xv[MT];
    for (int64_t i = 0; i < MT; ++i) xv[i] = load_step(x + (m + i) * K + k, len);
    for (int64_t r = 0; r < R; ++r) {
      // The next tile's rows, one tile ahead: the hardware prefetcher alone leaves the
      // stream at about 60% of the memory bandwidth (benchmarks/cpu_kernels.py).
      _mm_prefetch(reinterpret_cast<const char*>(w + (n + R + r) * K + k), _MM_HINT_T0);
      const auto wv = load_step(w + (n + r) * K + k, len);
      for (int64_t i = 0; i < MT; ++i) acc[i][r] = dot_step(acc[i][r], xv[i], wv);
    }
  };
  int64_t k = 0;
  for (; k + S <= K; k += S) step(k, S);
  if (k < K) step(k, K - k);
  for (int64_t i = 0; i < MT; ++i)
    for (int64_t r = 0; r < R; ++r) {
      const float b = bias != nullptr ? bias[n + r] : 0.f;
      store_out(y + (m + i) * N + n + r, sum_acc(acc[i][r]) + b);
    }
}

// Rows of x in blocks of about 128 KiB, each against the whole weight range: at large
// M the block stays in cache while the weight rows pass (the order of the sums in an
// element is the same either way).
template <typename T, int64_t R>
void rows_pass(const T* x, const T* w, const float* bias, T* y, int64_t M, int64_t N, int64_t K,
               int64_t n0, int64_t n1) {
  const int64_t block = std::max<int64_t>(4, (128 * 1024 / (K * int64_t(sizeof(T)))) / 4 * 4);
  for (int64_t m0 = 0; m0 < M; m0 += block) {
    const int64_t m1 = std::min(M, m0 + block);
    for (int64_t n = n0; n + R <= n1; n += R) {
      int64_t m = m0;
      for (; m + 4 <= m1; m += 4) tile<T, R, 4>(x, w, bias, y, N, K, n, m);
      if (m + 2 <= m1) tile<T, R, 2>(x, w, bias, y, N, K, n, m), m += 2;
      if (m < m1) tile<T, R, 1>(x, w, bias, y, N, K, n, m);
    }
  }
}
#endif

}  // namespace

bool small_gemm_available() {
#ifdef PAGODA_HAS_SMALL_GEMM
  return true;
#else
  return false;
#endif
}

// x: [M, K], w: [N, K], both bfloat16 or both float32; bias: [N] or undefined -> [M, N].
at::Tensor small_gemm(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(small_gemm_available(), "small_gemm: built without AVX512-BF16 or AVX2");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "small_gemm: bad shapes");
  const auto dtype = x.scalar_type();
  TORCH_CHECK((dtype == at::kBFloat16 || dtype == at::kFloat) && w.scalar_type() == dtype,
              "small_gemm: bfloat16 or float32, the same for x and w");
  x = x.contiguous();
  w = w.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = at::empty({M, N}, x.options());
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) bias_f = bias->to(at::kFloat).contiguous();
#ifdef PAGODA_HAS_SMALL_GEMM
  const float* bp = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  auto run = [&]<typename T>(const T* xp, const T* wp, T* yp) {
    const int64_t blocks = N / kRowBlock;
    // Contiguous row ranges per thread: each streams its own part of the weight.
    at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
      rows_pass<T, kRowBlock>(xp, wp, bp, yp, M, N, K, b0 * kRowBlock, b1 * kRowBlock);
    });
    rows_pass<T, 1>(xp, wp, bp, yp, M, N, K, blocks * kRowBlock, N);  // the N % 4 tail
  };
  if (dtype == at::kFloat) {
    run(x.data_ptr<float>(), w.data_ptr<float>(), y.data_ptr<float>());
  } else {
    run(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()),
        reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()),
        reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()));
  }
#endif
  return y;
}
