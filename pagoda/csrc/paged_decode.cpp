// Paged decode attention for the CPU: one query token per sequence against its
// context, read in place through the block table (no gathered copy of the cache).
//
// Work is split over (sequence, kv head) pairs; each pair serves the G = H / KVH
// query heads that share its K/V rows (GQA), so every K/V row is read once.
// Two passes: scores (reads K), then the softmax-weighted sum (reads V).
//
// The softmax's exp runs 16 lanes at a time with at::vec's exp_u20, the same
// approximation torch's CPU flash attention uses (and so HF's SDPA path).
//
// The cache holds the model's dtype, or int8 / fp8 (e4m3) with one fp16 scale per
// token and head (k_scales, v_scales: [num_blocks, block_size, KVH]); a quantized row
// is widened to float32 and scaled as it is read.
//
// Multi-head latent attention (DeepSeek) passes its latent rows as both caches and a
// value width Dv below the key's D: values are the first Dv dims of each row, the
// output [B, H, Dv].
//
// A sliding window (window > 0) reads only a sequence's last `window` tokens: the
// blocks behind it are never touched (they may even be reused by then). Soft-capped
// logits (softcap > 0, Gemma 2) become softcap * tanh(logit / softcap).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define CPU_CAPABILITY_AVX512
#define CPU_CAPABILITY AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY_AVX2
#define CPU_CAPABILITY AVX2
#endif
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define PAGODA_BF16_DOT 1
constexpr bool kHaveBf16Dot = true;
#else
constexpr bool kHaveBf16Dot = false;
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kMaxHeadDim = 1024;
// Context tokens per work item (rounded to whole blocks): long enough that a chunk's
// setup is noise, short enough that one sequence at a few thousand tokens feeds
// every thread.
constexpr int64_t kChunkTokens = 512;

inline void load_row(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }

inline void load_row(const at::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(s[i]) << 16;  // exact widening
    std::memcpy(dst + i, &bits, sizeof(bits));
  }
}

inline void load_row(const int8_t* src, float scale, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]) * scale;
}

// fp8 e4m3 -> float32 for every byte value, built once.
const float* fp8_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(256);
    for (int i = 0; i < 256; ++i)
      t[i] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(i), c10::Float8_e4m3fn::from_bits()));
    return t;
  }();
  return table.data();
}

inline void load_row(const c10::Float8_e4m3fn* src, float scale, float* dst, int64_t n) {
  const float* table = fp8_table();
  const uint8_t* s = reinterpret_cast<const uint8_t*>(src);
  for (int64_t i = 0; i < n; ++i) dst[i] = table[s[i]] * scale;
}

template <typename T>
constexpr bool kQuantized = std::is_same_v<T, int8_t> || std::is_same_v<T, c10::Float8_e4m3fn>;

// A cache row as float32: the model's dtype widened, or a quantized one scaled.
template <typename T>
inline void read_row(const T* src, const at::Half* scales, int64_t scale_index, float* dst, int64_t n) {
  if constexpr (kQuantized<T>)
    load_row(src, static_cast<float>(scales[scale_index]), dst, n);
  else
    load_row(src, dst, n);
}

// Blocks sit anywhere in the pool, out of the hardware prefetcher's sight: ask for the next one.
template <typename T>
inline void prefetch_block(const T* first_row, int64_t rows, int64_t row_stride, int64_t D) {
  for (int64_t j = 0; j < rows; ++j)
    for (int64_t off = 0; off < D * static_cast<int64_t>(sizeof(T)); off += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(first_row + j * row_stride) + off);
}

#ifdef PAGODA_BF16_DOT
// v[i] -> lane i of the result holds the sum of v[i]'s 16 lanes: 16 horizontal sums
// for the price of about three, by transposing as it adds.
inline __m512 sum_lanes_16(const __m512* v) {
  __m512 a[8], b[4];
  for (int j = 0; j < 8; ++j)  // within 128-bit lanes, pairs of vectors
    a[j] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * j], v[2 * j + 1]), _mm512_unpackhi_ps(v[2 * j], v[2 * j + 1]));
  for (int k = 0; k < 4; ++k) {  // within 128-bit lanes, quads: lane L holds v[4k..4k+3]'s partial sums
    const __m512d x = _mm512_castps_pd(a[2 * k]), y = _mm512_castps_pd(a[2 * k + 1]);
    b[k] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  // across 128-bit lanes: 128-bit lane k of the result is b[k] summed over its four lanes
  const __m512 d01 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
  const __m512 d23 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d01, d23, 0x88), _mm512_shuffle_f32x4(d01, d23, 0xDD));
}

// scores[j] = scale * q . k_j for the n rows of one block: bf16 pairs straight into
// float32 dot products (AVX512-BF16; products are exact), 16 rows per reduction.
template <int64_t kD>
inline void bf16_scores(const at::BFloat16* q, const at::BFloat16* k_block, int64_t n,
                        int64_t row_stride, float scale, float* scores) {
  constexpr int64_t kChunks = kD / 32;
  __m512bh qv[kChunks];
  for (int64_t c = 0; c < kChunks; ++c)
    qv[c] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(q + c * 32));
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t count = std::min<int64_t>(16, n - j0);
    __m512 acc[16];
    for (int64_t j = 0; j < 16; ++j) {
      acc[j] = _mm512_setzero_ps();
      if (j >= count) continue;
      const at::BFloat16* row = k_block + (j0 + j) * row_stride;
      for (int64_t c = 0; c < kChunks; ++c)
        acc[j] = _mm512_dpbf16_ps(acc[j], qv[c], reinterpret_cast<__m512bh>(_mm512_loadu_si512(row + c * 32)));
    }
    const __mmask16 mask = count == 16 ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1);
    _mm512_mask_storeu_ps(scores + j0, mask, _mm512_mul_ps(sum_lanes_16(acc), vscale));
  }
}
#endif

// s <- exp(s - max(s)); returns the sum (and the max in *max_out). Vector lanes first,
// then a scalar tail.
inline float softmax_numerators(float* s, int64_t len, float* max_out) {
  using Vec = at::vec::Vectorized<float>;
  const float m = *std::max_element(s, s + len);
  *max_out = m;
  const Vec vm(m);
  Vec vsum(0.f);
  int64_t t = 0;
  for (; t + Vec::size() <= len; t += Vec::size()) {
    const Vec e = (Vec::loadu(s + t) - vm).exp_u20();
    vsum = vsum + e;
    e.store(s + t);
  }
  float sum = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, vsum);
  for (; t < len; ++t) {
    s[t] = std::exp(s[t] - m);
    sum += s[t];
  }
  return sum;
}

// T: q and out; C: the cache (T, or quantized with scales). kD > 0 fixes the head dim
// at compile time (fully unrolled inner loops); 0 reads `D_`.
template <typename T, typename C, int64_t kD>
void decode(const T* q, const C* k_cache, const C* v_cache, const at::Half* k_scales,
            const at::Half* v_scales, const int64_t* block_tables, const int64_t* seq_lens, T* out,
            int64_t B, int64_t H, int64_t KVH, int64_t D_, int64_t Dv, int64_t block_size,
            int64_t max_blocks, float scale, int64_t window, float softcap) {
  const int64_t D = kD > 0 ? kD : D_;
  const int64_t G = H / KVH;
  // bf16 with a head dim of whole 32-pair chunks: q.k straight from bf16 (bf16_scores).
  constexpr bool kBf16Dot = kHaveBf16Dot && std::is_same_v<T, at::BFloat16> &&
                            std::is_same_v<C, at::BFloat16> && kD > 0 && kD % 32 == 0;
  const int64_t row_stride = KVH * D;  // between consecutive tokens of a block
  // Work items are (sequence, kv head, chunk of the context): a long context splits into
  // chunks of whole blocks, about kChunkTokens each, so that one sequence keeps every
  // thread busy (flash-decoding). Each chunk keeps its own max, sum and weighted V sum;
  // a sequence of several chunks is combined afterwards in chunk order. The split
  // depends only on the sequence's own length, never on the batch or the threads, so a
  // row's result is the same whatever else runs (speculative verification relies on it);
  // a one-chunk sequence is computed exactly as before the split existed. Chunk
  // boundaries sit at multiples of the chunk size; a window starts the first one late.
  const int64_t chunk_blocks = std::max<int64_t>(1, kChunkTokens / block_size);
  const int64_t chunk = chunk_blocks * block_size;
  struct Item { int64_t b, kvh, start, end, slot; };  // slot: partials, or -1 (one chunk)
  std::vector<Item> items;
  int64_t num_slots = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t len = seq_lens[b];
    const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
    const int64_t c0 = first / chunk, chunks = (len + chunk - 1) / chunk - c0;
    for (int64_t kvh = 0; kvh < KVH; ++kvh)
      for (int64_t c = c0; c < c0 + chunks; ++c)
        items.push_back({b, kvh, std::max(first, c * chunk), std::min(len, (c + 1) * chunk),
                         chunks > 1 ? num_slots++ : -1});
  }
  // Per partial chunk and query head: max, sum, then the D weighted V sums.
  const int64_t part = Dv + 2;
  std::vector<float> partials(num_slots * G * part);
  // Torch's own thread pool (a second OpenMP runtime would spin against it). Each
  // thread takes every T-th item: contexts differ in length, and contiguous halves
  // would leave one thread idle.
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t num_workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_items));
  at::parallel_for(0, num_workers, 1, [&](int64_t first, int64_t last) {
    std::vector<float> qf(G * D), acc(G * Dv), inv_sum(G), maxes(G), scores;
    float row[kMaxHeadDim];
    for (int64_t t = first; t < last; ++t)
    for (int64_t index = t; index < num_items; index += num_workers) {
      const Item& item = items[index];
      const int64_t b = item.b, kvh = item.kvh, c0 = item.start, len = item.end - item.start;
      const int64_t* table = block_tables + b * max_blocks;
      scores.resize(G * len);
      if constexpr (!kBf16Dot)
        for (int64_t g = 0; g < G; ++g) load_row(q + (b * H + kvh * G + g) * D, qf.data() + g * D, D);
      // Walk the chunk block by block (the first may start mid-block): no division per token.
      for (int64_t start = 0; start < len;) {
        const int64_t offset = (c0 + start) % block_size;
        const int64_t n = std::min(block_size - offset, len - start);
        const int64_t block = table[(c0 + start) / block_size];
        const C* k_block = k_cache + (block * block_size + offset) * row_stride + kvh * D;
        if (start + n < len) prefetch_block(k_cache + table[(c0 + start) / block_size + 1] * block_size * row_stride + kvh * D, block_size, row_stride, D);
#ifdef PAGODA_BF16_DOT
        if constexpr (kBf16Dot) {
          for (int64_t g = 0; g < G; ++g)
            bf16_scores<kD>(q + (b * H + kvh * G + g) * D, k_block, n, row_stride, scale,
                            scores.data() + g * len + start);
          start += n;
          continue;
        }
#endif
        for (int64_t j = 0; j < n; ++j) {
          read_row(k_block + j * row_stride, k_scales, (block * block_size + offset + j) * KVH + kvh, row, D);
          for (int64_t g = 0; g < G; ++g) {
            const float* qg = qf.data() + g * D;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; ++d) dot += qg[d] * row[d];
            scores[g * len + start + j] = dot * scale;
          }
        }
        start += n;
      }
      if (softcap > 0.f)
        for (int64_t i = 0; i < G * len; ++i) scores[i] = softcap * std::tanh(scores[i] / softcap);
      for (int64_t g = 0; g < G; ++g) {
        const float sum = softmax_numerators(scores.data() + g * len, len, &maxes[g]);
        inv_sum[g] = item.slot < 0 ? 1.f / sum : sum;  // partials keep the sum itself
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t start = 0; start < len;) {
        const int64_t offset = (c0 + start) % block_size;
        const int64_t n = std::min(block_size - offset, len - start);
        const int64_t block = table[(c0 + start) / block_size];
        const C* v_block = v_cache + (block * block_size + offset) * row_stride + kvh * D;
        if (start + n < len) prefetch_block(v_cache + table[(c0 + start) / block_size + 1] * block_size * row_stride + kvh * D, block_size, row_stride, D);
        for (int64_t j = 0; j < n; ++j) {
          read_row(v_block + j * row_stride, v_scales, (block * block_size + offset + j) * KVH + kvh, row, Dv);
          for (int64_t g = 0; g < G; ++g) {
            const float p = scores[g * len + start + j];
            float* a = acc.data() + g * Dv;
#pragma omp simd
            for (int64_t d = 0; d < Dv; ++d) a[d] += p * row[d];
          }
        }
        start += n;
      }
      for (int64_t g = 0; g < G; ++g) {
        if (item.slot < 0) {
          T* o = out + (b * H + kvh * G + g) * Dv;
          for (int64_t d = 0; d < Dv; ++d) o[d] = static_cast<T>(acc[g * Dv + d] * inv_sum[g]);
        } else {
          float* dst = partials.data() + (item.slot * G + g) * part;
          dst[0] = maxes[g];
          dst[1] = inv_sum[g];
          std::copy(acc.begin() + g * Dv, acc.begin() + (g + 1) * Dv, dst + 2);
        }
      }
    }
  });
  // Sequences of several chunks: rescale each chunk's sums to the common max, in order.
  for (int64_t first = 0; first < num_items;) {
    const Item& head = items[first];
    int64_t last = first + 1;
    while (last < num_items && items[last].b == head.b && items[last].kvh == head.kvh) ++last;
    if (head.slot >= 0) {
      for (int64_t g = 0; g < G; ++g) {
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t i = first; i < last; ++i) m = std::max(m, partials[(items[i].slot * G + g) * part]);
        float total = 0.f, o[kMaxHeadDim] = {};
        for (int64_t i = first; i < last; ++i) {
          const float* src = partials.data() + (items[i].slot * G + g) * part;
          const float w = std::exp(src[0] - m);
          total += w * src[1];
          for (int64_t d = 0; d < Dv; ++d) o[d] += w * src[2 + d];
        }
        T* dst = out + (head.b * H + head.kvh * G + g) * Dv;
        for (int64_t d = 0; d < Dv; ++d) dst[d] = static_cast<T>(o[d] / total);
      }
    }
    first = last;
  }
}

}  // namespace

// q: [B, H, D]; caches: [num_blocks, block_size, KVH, D] in q's dtype, or int8 / fp8 e4m3
// with k_scales/v_scales [num_blocks, block_size, KVH] fp16; block_tables: [B, max_blocks]
// int64; seq_lens: [B] int64 (>= 1); window: 0 or the tokens a query sees (itself
// included); softcap: 0 or the logit cap; v_dim: 0, or the value width Dv < D of MLA's
// latent rows. Returns [B, H, Dv].
at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                  at::Tensor block_tables, at::Tensor seq_lens, double scale,
                                  c10::optional<at::Tensor> k_scales,
                                  c10::optional<at::Tensor> v_scales, int64_t window,
                                  double softcap, int64_t v_dim) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "paged_decode_attention: bad ranks");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "paged_decode_attention: K/V dtype mismatch");
  const bool quantized = k_cache.scalar_type() == at::kChar || k_cache.scalar_type() == at::kFloat8_e4m3fn;
  TORCH_CHECK(quantized || q.scalar_type() == k_cache.scalar_type(),
              "paged_decode_attention: the cache holds q's dtype, int8 or fp8 e4m3");
  TORCH_CHECK(quantized == (k_scales.has_value() && v_scales.has_value()),
              "paged_decode_attention: a quantized cache needs k_scales and v_scales (and only it)");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "paged_decode_attention: block_tables and seq_lens must be int64");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_decode_attention: caches must be contiguous");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  seq_lens = seq_lens.contiguous();
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t block_size = k_cache.size(1), KVH = k_cache.size(2);
  TORCH_CHECK(D <= kMaxHeadDim && k_cache.size(3) == D && H % KVH == 0, "paged_decode_attention: bad shapes");
  TORCH_CHECK(v_cache.sizes() == k_cache.sizes(), "paged_decode_attention: K and V caches of one shape");
  const int64_t Dv = v_dim > 0 ? v_dim : D;
  TORCH_CHECK(Dv <= D, "paged_decode_attention: v_dim at most the head dim");
  if (quantized)
    for (const auto& s : {*k_scales, *v_scales})
      TORCH_CHECK(s.scalar_type() == at::kHalf && s.is_contiguous() && s.dim() == 3 &&
                      s.size(0) == k_cache.size(0) && s.size(1) == block_size && s.size(2) == KVH,
                  "paged_decode_attention: scales must be contiguous fp16 [num_blocks, block_size, KVH]");
  auto out = at::empty({B, H, Dv}, q.options());
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "paged_decode_attention: float32 or bfloat16 only");
  const at::Half* ks = quantized ? k_scales->data_ptr<at::Half>() : nullptr;
  const at::Half* vs = quantized ? v_scales->data_ptr<at::Half>() : nullptr;
  auto run = [&](auto type_tag, auto cache_tag, auto fixed_dim) {
    using scalar_t = typename decltype(type_tag)::type;
    using cache_t = typename decltype(cache_tag)::type;
    decode<scalar_t, cache_t, decltype(fixed_dim)::value>(
        q.data_ptr<scalar_t>(), reinterpret_cast<const cache_t*>(k_cache.data_ptr()),
        reinterpret_cast<const cache_t*>(v_cache.data_ptr()), ks, vs,
        block_tables.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), B, H, KVH, D,
        Dv, block_size, block_tables.size(1), static_cast<float>(scale), window,
        static_cast<float>(softcap));
  };
  auto by_dim = [&](auto type_tag, auto cache_tag) {
    if (D == 64) run(type_tag, cache_tag, std::integral_constant<int64_t, 64>{});
    else if (D == 128) run(type_tag, cache_tag, std::integral_constant<int64_t, 128>{});
    else if (D == 256) run(type_tag, cache_tag, std::integral_constant<int64_t, 256>{});  // Gemma's
    else if (D == 576) run(type_tag, cache_tag, std::integral_constant<int64_t, 576>{});  // MLA's 512 + 64
    else run(type_tag, cache_tag, std::integral_constant<int64_t, 0>{});
  };
  auto by_cache = [&](auto type_tag) {
    using scalar_t = typename decltype(type_tag)::type;
    if (k_cache.scalar_type() == at::kChar) by_dim(type_tag, std::type_identity<int8_t>{});
    else if (k_cache.scalar_type() == at::kFloat8_e4m3fn) by_dim(type_tag, std::type_identity<c10::Float8_e4m3fn>{});
    else by_dim(type_tag, std::type_identity<scalar_t>{});
  };
  if (q.scalar_type() == at::kFloat) by_cache(std::type_identity<float>{});
  else by_cache(std::type_identity<at::BFloat16>{});
  return out;
}
