// The small per-layer ops, fused: one pass each instead of the 9-15 PyTorch ops
// (and their Python dispatch) they replace. Each rounds where Hugging Face's
// eager code rounds, so bf16 results match it up to the order of float sums.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "float_dtypes.h"

#include <cmath>
#include <cstdint>
#include <type_traits>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

using pagoda_dtypes::dispatch;
using pagoda_dtypes::round_to;
using pagoda_dtypes::to_f;

// out = w * T(h * rsqrt(mean(h^2) + eps)), h = float(x): HF's LlamaRMSNorm. A float32
// weight with T = bf16 is Gemma's norm: T(w * h * rsqrt(...)), rounded once (w holds 1 + w).
template <typename T, typename W>
inline void norm_row(const T* x, const W* w, T* out, int64_t n, float eps) {
  float sum_sq = 0.f;
#pragma omp simd reduction(+ : sum_sq)
  for (int64_t i = 0; i < n; ++i) sum_sq += to_f(x[i]) * to_f(x[i]);
  const float inv_rms = 1.f / std::sqrt(sum_sq / static_cast<float>(n) + eps);
  if constexpr (std::is_same_v<W, T>) {
    for (int64_t i = 0; i < n; ++i)
      out[i] = static_cast<T>(to_f(w[i]) * round_to<T>(to_f(x[i]) * inv_rms));
  } else {
    for (int64_t i = 0; i < n; ++i) out[i] = static_cast<T>((to_f(x[i]) * inv_rms) * w[i]);
  }
}

// f(T{}, W{}): the row type and the weight's (the row's, or float32 for Gemma's norm).
template <typename F>
void dispatch_norm(const at::Tensor& x, const at::Tensor& weight, const char* name, F&& f) {
  TORCH_CHECK(weight.scalar_type() == x.scalar_type() || weight.scalar_type() == at::kFloat,
              name, ": the weight is in x's dtype or float32");
  dispatch(x, name, [&](auto tag) {
    using T = decltype(tag);
    if (weight.scalar_type() == x.scalar_type()) f(T{}, T{});
    else f(T{}, float{});
  });
}

// Products and sums rounded one at a time, like eager PyTorch (no fused multiply-add).
template <typename T, typename C>
__attribute__((optimize("fp-contract=off"))) void rotate_row(T* x, const C* cos_row,
                                                             const C* sin_row, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float c = round_to<T>(to_f(cos_row[i])), s = round_to<T>(to_f(sin_row[i]));
    const float x1 = to_f(x[i]), x2 = to_f(x[i + half]);
    const float a = round_to<T>(x1 * c), b = round_to<T>(x2 * s);
    const float d = round_to<T>(x2 * c), e = round_to<T>(x1 * s);
    x[i] = static_cast<T>(a - b);
    x[i + half] = static_cast<T>(d + e);
  }
}

}  // namespace

// x: [T, n] -> rms_norm(x) * weight, a new tensor.
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && x.size(1) == weight.size(0), "rms_norm: bad shapes");
  x = x.contiguous();
  weight = weight.contiguous();
  auto out = at::empty_like(x);
  const int64_t rows = x.size(0), n = x.size(1);
  dispatch_norm(x, weight, "rms_norm", [&](auto tag, auto weight_tag) {
    using T = decltype(tag);
    using W = decltype(weight_tag);
    const T* xp = x.data_ptr<T>();
    const W* wp = weight.data_ptr<W>();
    T* op = out.data_ptr<T>();
    at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) norm_row(xp + r * n, wp, op + r * n, n, static_cast<float>(eps));
    });
  });
  return out;
}

// In place: residual <- x + residual (rounded to the dtype), x <- rms_norm(residual) * weight.
void fused_add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.sizes() == residual.sizes() && x.size(1) == weight.size(0),
              "fused_add_rms_norm: bad shapes");
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous(), "fused_add_rms_norm: contiguous inputs only");
  TORCH_CHECK(x.scalar_type() == residual.scalar_type(), "fused_add_rms_norm: dtype mismatch");
  weight = weight.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  dispatch_norm(x, weight, "fused_add_rms_norm", [&](auto tag, auto weight_tag) {
    using T = decltype(tag);
    using W = decltype(weight_tag);
    T* xp = x.data_ptr<T>();
    T* rp = residual.data_ptr<T>();
    const W* wp = weight.data_ptr<W>();
    at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        T* xr = xp + r * n;
        T* rr = rp + r * n;
        for (int64_t i = 0; i < n; ++i) rr[i] = static_cast<T>(to_f(xr[i]) + to_f(rr[i]));
        norm_row(rr, wp, xr, n, static_cast<float>(eps));
      }
    });
  });
}

// In place on x: [T, heads, D] (rotate-half layout); positions: [T] int64;
// cos/sin: [max_position, R / 2], float32 or x's dtype, cast to x's dtype as HF does.
// R <= D: partial rotary turns the first R dims of each head and leaves the rest.
void rotary_embedding(at::Tensor x, at::Tensor positions, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "rotary_embedding: x must be [T, heads, D], D contiguous");
  TORCH_CHECK(positions.scalar_type() == at::kLong && cos.scalar_type() == sin.scalar_type() &&
                  (cos.scalar_type() == at::kFloat || cos.scalar_type() == x.scalar_type()) &&
                  cos.is_contiguous() && sin.is_contiguous(),
              "rotary_embedding: positions int64; cos/sin contiguous, float32 or x's dtype");
  const int64_t T = x.size(0), heads = x.size(1), half = cos.size(1);
  TORCH_CHECK(half >= 1 && 2 * half <= x.size(2) && sin.size(1) == half,
              "rotary_embedding: cos/sin width must be at most D / 2");
  positions = positions.contiguous();
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t max_pos = cos.size(0);
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "rotary_embedding: position out of range");
  const int64_t st = x.stride(0), sh = x.stride(1);
  dispatch(x, "rotary_embedding", [&](auto tag) {
    using S = decltype(tag);
    S* xp = x.data_ptr<S>();
    auto run = [&](const auto* cp, const auto* sp) {
      at::parallel_for(0, T, 16, [&](int64_t t0, int64_t t1) {
        for (int64_t t = t0; t < t1; ++t)
          for (int64_t h = 0; h < heads; ++h)
            rotate_row(xp + t * st + h * sh, cp + pos[t] * half, sp + pos[t] * half, half);
      });
    };
    if (cos.scalar_type() == at::kFloat) run(cos.data_ptr<float>(), sin.data_ptr<float>());
    else run(cos.data_ptr<S>(), sin.data_ptr<S>());
  });
}

// Structured outputs: logits[rows[r], t] = -inf where bit t of bitmask[r] is clear, in
// place. logits: [B, V] float32, contiguous rows; rows: [R] int64; bitmask: [R, W]
// int32 with W * 32 >= V (llguidance's layout: token t is bit t % 32 of word t / 32).
void apply_token_bitmask(at::Tensor logits, at::Tensor rows, at::Tensor bitmask) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "apply_token_bitmask: logits must be [B, V] float32 with contiguous rows");
  TORCH_CHECK(rows.scalar_type() == at::kLong && bitmask.scalar_type() == at::kInt &&
                  bitmask.dim() == 2 && bitmask.size(0) == rows.size(0),
              "apply_token_bitmask: rows [R] int64, bitmask [R, W] int32");
  const int64_t V = logits.size(1), W = bitmask.size(1), R = rows.size(0);
  TORCH_CHECK(W * 32 >= V, "apply_token_bitmask: bitmask narrower than the vocabulary");
  rows = rows.contiguous();
  bitmask = bitmask.contiguous();
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  for (int64_t r = 0; r < R; ++r)
    TORCH_CHECK(row_ids[r] >= 0 && row_ids[r] < logits.size(0), "apply_token_bitmask: row out of range");
  const auto* words = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  float* base = logits.data_ptr<float>();
  const int64_t stride = logits.stride(0);
  at::parallel_for(0, R, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* row = base + row_ids[r] * stride;
      const uint32_t* m = words + r * W;
      for (int64_t w = 0; w * 32 < V; ++w) {
        uint32_t banned = ~m[w];
        const int64_t left = V - w * 32;
        if (left < 32) banned &= (1u << left) - 1;  // past the vocabulary
#ifdef __AVX512F__
        // Two masked stores of -inf per word, whatever the number of forbidden tokens.
        const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
        _mm512_mask_storeu_ps(row + w * 32, static_cast<__mmask16>(banned), neg_inf);
        _mm512_mask_storeu_ps(row + w * 32 + 16, static_cast<__mmask16>(banned >> 16), neg_inf);
#else
        for (; banned; banned &= banned - 1) row[w * 32 + __builtin_ctz(banned)] = -INFINITY;
#endif
      }
    }
  });
}
