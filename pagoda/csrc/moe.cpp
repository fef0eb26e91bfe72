// Mixture of experts: the routing and grouping around the experts' products, one
// pass each instead of the ten PyTorch ops (and their dispatch) they replace.
//
//   moe_group:   router logits [T, E] -> float32 softmax, top-k (renormalized or not);
//                the T*k (token, expert) pairs sorted by expert, stably (a counting
//                sort); x's rows gathered in that order.
//   moe_combine: y[t] = sum over t's pairs, in their sorted order, of w * out[pair],
//                rounded where the PyTorch twin's mul_ and index_add_ round (no fused
//                multiply-add), so the two agree bit for bit.
//
// Top-k ties (equal probabilities, common with bf16 logits and many experts) go to the
// lowest expert id; torch.topk leaves their order unspecified.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "float_dtypes.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

using pagoda_dtypes::dispatch;
using pagoda_dtypes::round_to;
using pagoda_dtypes::to_f;

// One token's top-k of softmax(logits): ids in descending probability (lowest id first
// among equals), their probabilities (renormalized to sum 1 if asked).
template <typename L>
void route_row(const L* logits, int64_t num_experts, int64_t top_k, bool renormalize,
               float* probs, int64_t* ids, float* weights) {
  float max_logit = -INFINITY;
  for (int64_t e = 0; e < num_experts; ++e) max_logit = std::max(max_logit, to_f(logits[e]));
  float sum = 0.f;
  for (int64_t e = 0; e < num_experts; ++e) {
    probs[e] = std::exp(to_f(logits[e]) - max_logit);
    sum += probs[e];
  }
  for (int64_t e = 0; e < num_experts; ++e) probs[e] /= sum;
  float chosen_sum = 0.f;
  for (int64_t j = 0; j < top_k; ++j) {
    int64_t best = -1;
    for (int64_t e = 0; e < num_experts; ++e)
      if (probs[e] >= 0.f && (best < 0 || probs[e] > probs[best])) best = e;
    ids[j] = best;
    weights[j] = probs[best];
    chosen_sum += probs[best];
    probs[best] = -1.f;  // taken
  }
  if (renormalize)
    for (int64_t j = 0; j < top_k; ++j) weights[j] /= chosen_sum;
}

// acc[h] += T(w * row[h]): the product rounded to T (as the twin's mul_ stores it), the
// sum kept in float32 (as index_add_ accumulates a reduced-precision dtype). The
// attribute goes on this function itself: a lambda's body would not inherit it.
template <typename T>
__attribute__((optimize("fp-contract=off"))) void add_weighted_row(float* acc, const T* row,
                                                                   float w, int64_t n) {
  for (int64_t h = 0; h < n; ++h) acc[h] += round_to<T>(w * to_f(row[h]));
}

}  // namespace

// x [T, H], router_logits [T, E] -> {xs [T*k, H], token_of [T*k], pair_weights [T*k]
// float32, counts [E]}: the pairs grouped by expert, in token order within an expert.
std::vector<at::Tensor> moe_group(at::Tensor x, at::Tensor router_logits, int64_t top_k,
                                  bool renormalize) {
  TORCH_CHECK(x.dim() == 2 && router_logits.dim() == 2 && x.size(0) == router_logits.size(0),
              "moe_group: x [T, H] and router_logits [T, E] expected");
  const int64_t T = x.size(0), H = x.size(1), E = router_logits.size(1);
  TORCH_CHECK(top_k >= 1 && top_k <= E, "moe_group: top_k must be in [1, E]");
  x = x.contiguous();
  router_logits = router_logits.contiguous();
  const int64_t P = T * top_k;
  std::vector<int64_t> ids(P);
  std::vector<float> weights(P);
  dispatch(router_logits, "moe_group", [&](auto tag) {
    using L = decltype(tag);
    const L* lp = router_logits.data_ptr<L>();
    at::parallel_for(0, T, 64, [&](int64_t t0, int64_t t1) {
      std::vector<float> probs(E);
      for (int64_t t = t0; t < t1; ++t)
        route_row(lp + t * E, E, top_k, renormalize, probs.data(), ids.data() + t * top_k,
                  weights.data() + t * top_k);
    });
  });
  auto counts = at::zeros({E}, at::kLong);
  int64_t* cp = counts.data_ptr<int64_t>();
  for (int64_t p = 0; p < P; ++p) ++cp[ids[p]];
  std::vector<int64_t> next(E, 0);
  for (int64_t e = 1; e < E; ++e) next[e] = next[e - 1] + cp[e - 1];
  auto token_of = at::empty({P}, at::kLong);
  auto pair_weights = at::empty({P}, at::kFloat);
  int64_t* tp = token_of.data_ptr<int64_t>();
  float* wp = pair_weights.data_ptr<float>();
  for (int64_t p = 0; p < P; ++p) {  // pair p is token p / k: stable within each expert
    const int64_t slot = next[ids[p]]++;
    tp[slot] = p / top_k;
    wp[slot] = weights[p];
  }
  auto xs = at::empty({P, H}, x.options());
  const int64_t row_bytes = H * x.element_size();
  const char* src = static_cast<const char*>(x.data_ptr());
  char* dst = static_cast<char*>(xs.data_ptr());
  at::parallel_for(0, P, 16, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) std::memcpy(dst + p * row_bytes, src + tp[p] * row_bytes, row_bytes);
  });
  return {xs, token_of, pair_weights, counts};
}

// out [P, H] (each pair's expert output), token_of [P], pair_weights [P] float32 ->
// y [num_tokens, H]: per token, 0 + w * out[p] + ... over its pairs in order.
at::Tensor moe_combine(at::Tensor out, at::Tensor token_of, at::Tensor pair_weights,
                       int64_t num_tokens) {
  TORCH_CHECK(out.dim() == 2 && token_of.numel() == out.size(0) &&
                  pair_weights.numel() == out.size(0),
              "moe_combine: out [P, H], token_of [P], pair_weights [P] expected");
  TORCH_CHECK(token_of.scalar_type() == at::kLong && pair_weights.scalar_type() == at::kFloat,
              "moe_combine: int64 token_of and float32 pair_weights expected");
  out = out.contiguous();
  const int64_t P = out.size(0), H = out.size(1);
  const int64_t* tp = token_of.data_ptr<int64_t>();
  const float* wp = pair_weights.data_ptr<float>();
  // Each token's pairs, in their order (CSR).
  std::vector<int64_t> start(num_tokens + 1, 0), pairs(P);
  for (int64_t p = 0; p < P; ++p) {
    TORCH_CHECK(tp[p] >= 0 && tp[p] < num_tokens, "moe_combine: token_of out of range");
    ++start[tp[p] + 1];
  }
  for (int64_t t = 0; t < num_tokens; ++t) start[t + 1] += start[t];
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t p = 0; p < P; ++p) pairs[fill[tp[p]]++] = p;
  auto y = at::empty({num_tokens, H}, out.options());
  dispatch(out, "moe_combine", [&](auto tag) {
    using T = decltype(tag);
    const T* op = out.data_ptr<T>();
    T* yp = y.data_ptr<T>();
    at::parallel_for(0, num_tokens, 4, [&](int64_t t0, int64_t t1) {
      std::vector<float> acc(H);
      for (int64_t t = t0; t < t1; ++t) {
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t i = start[t]; i < start[t + 1]; ++i) {
          const int64_t p = pairs[i];
          // The twin casts the weights to the dtype first.
          add_weighted_row(acc.data(), op + p * H, round_to<T>(wp[p]), H);
        }
        for (int64_t h = 0; h < H; ++h) yp[t * H + h] = static_cast<T>(acc[h]);
      }
    });
  });
  return y;
}
