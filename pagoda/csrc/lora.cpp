// Multi-LoRA's batched products (Punica's shrink and expand) for one linear layer:
// y[rows of a segment] += (x @ A[slot]^T) @ B[slot]^T, per slice of a fused layer's
// output (q/k/v, gate/up), for every adapter segment of the step in one call.
//
//   a      [L, S, R, K]          each slot's A per slice, rank rows zero-padded to R
//   b      [L, R, N]             each slot's B^T (scaling in), slice i in its columns
//                                (a and b in float32, or both in bf16)
//   ranks  [L, S] int32          each slot's rank per slice (0: that module not adapted)
//   segments [G, 3] int64        (start row, end row, slot)
//
// Two passes, each spread over both threads: the shrink (row tile x slice x 4 rank
// rows: each loaded chunk of A serves up to 4 rows of x) into a float32 scratch, then
// the expand (row tile x 64 columns), added to y with one rounding. With bf16 x and
// weights both passes use AVX512-BF16 dot products (the expand rounds the shrink's
// output to bf16 pairs, as a bf16 GEMM would); otherwise float32 FMAs (16 lanes on
// AVX512; 8 on AVX2, bf16 widened as it loads, smaller register tiles). Rank rows past
// a slot's own rank are never read, so a low-rank adapter, or one that skips a module,
// costs its own bytes, not the slot's. At a few rows this is a stream of the adapter's
// weights (SmolLM2 at rank 16 on every linear: 9.8 MB in bf16).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <limits>
#include <memory>
#include <vector>

#include "simd.h"

namespace {

constexpr int64_t kRowTile = 8;
constexpr int64_t kRankTile = 4;
constexpr int64_t kColChunk = 64;
constexpr int64_t kMaxRank = 512;  // the largest max_lora_rank (a stack buffer's size)

struct Tile {
  int64_t row0, rows, slot;
  int64_t s_row0;  // its first row in the shrink's output, which holds segment rows only
};

struct ColChunk {
  int64_t slice, col0, col1;
};

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define PAGODA_LORA_ADD 1
#endif

#if defined(__AVX512F__)
using namespace pagoda_simd;

// Rows of a tile the shrink and the expand take at once (their accumulators in registers).
constexpr int64_t kShrinkRows = 4, kExpandRows = kRowTile;

// Tile sizes are template arguments, so that the accumulators stay in registers.
template <int64_t ROWS, int64_t NR, typename XT, typename WT>
void shrink_tile(const XT* x, int64_t K, const WT* a, const Tile& t, int64_t r0, float* s,
                 int64_t s_stride) {
  // s[t.s_row0 + i][r0 + j] = dot(x row t.row0 + i, a row r0 + j), i < ROWS, j < NR.
  __m512 acc[ROWS][NR];
  for (int64_t i = 0; i < ROWS; ++i)
    for (int64_t j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 mask = tail_mask(K - k);
    __m512 xv[ROWS];
    for (int64_t i = 0; i < ROWS; ++i) xv[i] = load16(x + (t.row0 + i) * K + k, mask);
    for (int64_t j = 0; j < NR; ++j) {
      const __m512 av = load16(a + (r0 + j) * K + k, mask);
      for (int64_t i = 0; i < ROWS; ++i) acc[i][j] = _mm512_fmadd_ps(xv[i], av, acc[i][j]);
    }
  }
  for (int64_t i = 0; i < ROWS; ++i)
    for (int64_t j = 0; j < NR; ++j)
      s[(t.s_row0 + i) * s_stride + r0 + j] = _mm512_reduce_add_ps(acc[i][j]);
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// bf16 x and A: AVX512-BF16 dot products, 32 products per instruction, no widening.
template <int64_t ROWS, int64_t NR>
void shrink_tile(const at::BFloat16* x, int64_t K, const at::BFloat16* a, const Tile& t,
                 int64_t r0, float* s, int64_t s_stride) {
  __m512 acc[ROWS][NR];
  for (int64_t i = 0; i < ROWS; ++i)
    for (int64_t j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    const __mmask32 mask = K - k >= 32 ? ~__mmask32(0) : (__mmask32(1) << (K - k)) - 1;
    __m512bh xv[ROWS];
    for (int64_t i = 0; i < ROWS; ++i)
      xv[i] = reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(mask, x + (t.row0 + i) * K + k));
    for (int64_t j = 0; j < NR; ++j) {
      const __m512bh av =
          reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(mask, a + (r0 + j) * K + k));
      for (int64_t i = 0; i < ROWS; ++i) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv[i], av);
    }
  }
  for (int64_t i = 0; i < ROWS; ++i)
    for (int64_t j = 0; j < NR; ++j)
      s[(t.s_row0 + i) * s_stride + r0 + j] = _mm512_reduce_add_ps(acc[i][j]);
}
#endif

template <int64_t ROWS, typename YT, typename WT>
void expand_rows(YT* y, int64_t y_stride, const WT* b, int64_t N, const Tile& t, const float* s,
                 int64_t s_stride, int64_t rank, int64_t col0, int64_t col1) {
  // y[row][col0:col1] += sum_r s[row][r] * b[r][col0:col1], 32 columns at a time.
  for (int64_t c = col0; c < col1; c += 32) {
    const __mmask16 m0 = tail_mask(col1 - c), m1 = col1 - c > 16 ? tail_mask(col1 - c - 16) : 0;
    __m512 acc[ROWS][2];
    for (int64_t i = 0; i < ROWS; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (int64_t r = 0; r < rank; ++r) {
      const __m512 b0 = load16(b + r * N + c, m0), b1 = load16(b + r * N + c + 16, m1);
      for (int64_t i = 0; i < ROWS; ++i) {
        const __m512 sv = _mm512_set1_ps(s[(t.s_row0 + i) * s_stride + r]);
        acc[i][0] = _mm512_fmadd_ps(sv, b0, acc[i][0]);
        acc[i][1] = _mm512_fmadd_ps(sv, b1, acc[i][1]);
      }
    }
    for (int64_t i = 0; i < ROWS; ++i) {
      YT* out = y + (t.row0 + i) * y_stride + c;
      store16(out, _mm512_add_ps(load16(out, m0), acc[i][0]), m0);
      if (m1) store16(out + 16, _mm512_add_ps(load16(out + 16, m1), acc[i][1]), m1);
    }
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// bf16 B: two ranks per AVX512-BF16 dot product. Rows r and r + 1 of 16 columns are
// interleaved in a register (one permute), the tile's s values rounded to bf16 pairs.
template <int64_t ROWS, typename YT>
void expand_rows(YT* y, int64_t y_stride, const at::BFloat16* b, int64_t N, const Tile& t,
                 const float* s, int64_t s_stride, int64_t rank, int64_t col0, int64_t col1) {
  const int64_t pairs = (rank + 1) / 2;
  uint32_t sp[ROWS][kMaxRank / 2];
  for (int64_t i = 0; i < ROWS; ++i)
    for (int64_t p = 0; p < pairs; ++p) {
      const float* row = s + (t.s_row0 + i) * s_stride;
      const c10::BFloat16 lo(row[2 * p]), hi(2 * p + 1 < rank ? row[2 * p + 1] : 0.f);
      sp[i][p] = static_cast<uint32_t>(lo.x) | (static_cast<uint32_t>(hi.x) << 16);
    }
  // Picks b[r][c], b[r+1][c] for c = 0..15 from (row r, row r + 1) side by side.
  const __m512i interleave = _mm512_set_epi16(
      47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
      39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);  // fmt: skip
  for (int64_t c = col0; c < col1; c += 16) {
    const __mmask16 mask = tail_mask(col1 - c);
    __m512 acc[ROWS];
    for (int64_t i = 0; i < ROWS; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
      const int64_t r = 2 * p;
      const at::BFloat16* row = b + r * N + c;
      const __m512i lo = _mm512_castsi256_si512(_mm256_maskz_loadu_epi16(mask, row));
      const __m512i hi = r + 1 < rank
                             ? _mm512_castsi256_si512(_mm256_maskz_loadu_epi16(mask, row + N))
                             : _mm512_setzero_si512();
      const __m512bh bv = reinterpret_cast<__m512bh>(_mm512_permutex2var_epi16(lo, interleave, hi));
      for (int64_t i = 0; i < ROWS; ++i)
        acc[i] = _mm512_dpbf16_ps(
            acc[i], reinterpret_cast<__m512bh>(_mm512_set1_epi32(sp[i][p])), bv);
    }
    for (int64_t i = 0; i < ROWS; ++i) {
      YT* out = y + (t.row0 + i) * y_stride + c;
      store16(out, _mm512_add_ps(load16(out, mask), acc[i]), mask);
    }
  }
}
#endif
#elif defined(PAGODA_LORA_ADD)  // AVX2
using namespace pagoda_simd;

// 16 registers: 2 rows x 4 ranks in the shrink, 4 rows x 16 columns in the expand.
constexpr int64_t kShrinkRows = 2, kExpandRows = 4;

// n values from p (fewer than 8 at a tail), the rest zero; and back.
template <typename T>
__m256 load_part(const T* p, int64_t n) {
  if (n >= 8) return load8(p);
  float part[8] = {};
  for (int64_t i = 0; i < n; ++i) part[i] = static_cast<float>(p[i]);
  return _mm256_loadu_ps(part);
}

template <typename T>
void store_part(T* p, __m256 v, int64_t n) {
  if (n >= 8) return store8(p, v);
  float part[8];
  _mm256_storeu_ps(part, v);
  for (int64_t i = 0; i < n; ++i) p[i] = static_cast<T>(part[i]);
}

template <int64_t ROWS, int64_t NR, typename XT, typename WT>
void shrink_tile(const XT* x, int64_t K, const WT* a, const Tile& t, int64_t r0, float* s,
                 int64_t s_stride) {
  __m256 acc[ROWS][NR];
  for (int64_t i = 0; i < ROWS; ++i)
    for (int64_t j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 xv[ROWS];
    for (int64_t i = 0; i < ROWS; ++i) xv[i] = load_part(x + (t.row0 + i) * K + k, K - k);
    for (int64_t j = 0; j < NR; ++j) {
      const __m256 av = load_part(a + (r0 + j) * K + k, K - k);
      for (int64_t i = 0; i < ROWS; ++i) acc[i][j] = _mm256_fmadd_ps(xv[i], av, acc[i][j]);
    }
  }
  for (int64_t i = 0; i < ROWS; ++i)
    for (int64_t j = 0; j < NR; ++j) s[(t.s_row0 + i) * s_stride + r0 + j] = sum8(acc[i][j]);
}

template <int64_t ROWS, typename YT, typename WT>
void expand_rows(YT* y, int64_t y_stride, const WT* b, int64_t N, const Tile& t, const float* s,
                 int64_t s_stride, int64_t rank, int64_t col0, int64_t col1) {
  // y[row][col0:col1] += sum_r s[row][r] * b[r][col0:col1], 16 columns at a time.
  for (int64_t c = col0; c < col1; c += 16) {
    const int64_t n0 = col1 - c, n1 = col1 - c - 8;
    __m256 acc[ROWS][2];
    for (int64_t i = 0; i < ROWS; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t r = 0; r < rank; ++r) {
      const __m256 b0 = load_part(b + r * N + c, n0);
      const __m256 b1 = n1 > 0 ? load_part(b + r * N + c + 8, n1) : _mm256_setzero_ps();
      for (int64_t i = 0; i < ROWS; ++i) {
        const __m256 sv = _mm256_set1_ps(s[(t.s_row0 + i) * s_stride + r]);
        acc[i][0] = _mm256_fmadd_ps(sv, b0, acc[i][0]);
        acc[i][1] = _mm256_fmadd_ps(sv, b1, acc[i][1]);
      }
    }
    for (int64_t i = 0; i < ROWS; ++i) {
      YT* out = y + (t.row0 + i) * y_stride + c;
      store_part(out, _mm256_add_ps(load_part(out, n0), acc[i][0]), n0);
      if (n1 > 0) store_part(out + 8, _mm256_add_ps(load_part(out + 8, n1), acc[i][1]), n1);
    }
  }
}
#endif

#if defined(PAGODA_LORA_ADD)
template <int64_t ROWS, typename XT, typename WT>
void shrink_rows(const XT* x, int64_t K, const WT* a, const Tile& t, int64_t r0, int64_t nr,
                 float* s, int64_t s_stride) {
  switch (nr) {
    case 1: return shrink_tile<ROWS, 1>(x, K, a, t, r0, s, s_stride);
    case 2: return shrink_tile<ROWS, 2>(x, K, a, t, r0, s, s_stride);
    case 3: return shrink_tile<ROWS, 3>(x, K, a, t, r0, s, s_stride);
    default: return shrink_tile<ROWS, kRankTile>(x, K, a, t, r0, s, s_stride);
  }
}

// A tile's rows in register-sized pieces of `max` rows, then halves: 7 rows = 4 + 2 + 1.
template <typename F>
void in_pieces(const Tile& t, int64_t max, F&& piece) {
  for (int64_t done = 0; done < t.rows;) {
    int64_t rows = max;
    while (rows > t.rows - done) rows /= 2;
    piece(Tile{t.row0 + done, rows, t.slot, t.s_row0 + done});
    done += rows;
  }
}

template <typename XT, typename WT>
void shrink(const XT* x, int64_t K, const WT* a, const Tile& t, int64_t r0, int64_t nr, float* s,
            int64_t s_stride) {
  in_pieces(t, kShrinkRows, [&](const Tile& p) {  // rows x 4 ranks of accumulators
    switch (p.rows) {
      case 1: return shrink_rows<1>(x, K, a, p, r0, nr, s, s_stride);
      case 2: return shrink_rows<2>(x, K, a, p, r0, nr, s, s_stride);
      default: return shrink_rows<kShrinkRows>(x, K, a, p, r0, nr, s, s_stride);
    }
  });
}

template <typename YT, typename WT>
void expand(YT* y, int64_t y_stride, const WT* b, int64_t N, const Tile& t, const float* s,
            int64_t s_stride, int64_t rank, int64_t col0, int64_t col1) {
  in_pieces(t, kExpandRows, [&](const Tile& p) {  // each loaded chunk of B serves them all
    switch (p.rows) {
      case 1: return expand_rows<1>(y, y_stride, b, N, p, s, s_stride, rank, col0, col1);
      case 2: return expand_rows<2>(y, y_stride, b, N, p, s, s_stride, rank, col0, col1);
      case 4: return expand_rows<4>(y, y_stride, b, N, p, s, s_stride, rank, col0, col1);
      default: return expand_rows<kExpandRows>(y, y_stride, b, N, p, s, s_stride, rank, col0, col1);
    }
  });
}

template <typename XT, typename YT, typename WT>
void run(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
         const int32_t* ranks, const std::vector<int64_t>& offsets, const std::vector<Tile>& tiles,
         int64_t num_rows) {
  const int64_t S = a.size(1), R = a.size(2), K = a.size(3), N = b.size(2);
  const XT* xp = x.data_ptr<XT>();
  YT* yp = y.data_ptr<YT>();
  const int64_t y_stride = y.stride(0);
  const WT* ap = a.data_ptr<WT>();
  const WT* bp = b.data_ptr<WT>();
  // s[segment row][slice * R + r]: the shrink's output. Only entries below each slot's
  // rank are written, and only those are read.
  const int64_t s_stride = S * R;
  const std::unique_ptr<float[]> s(new float[num_rows * s_stride]);  // not zeroed: see above
  // One row (batch-1 decode) stays on this thread: two parallel regions cost more than
  // they save there (SmolLM2's 120 linears: 0.50 ms against 0.67 on two threads).
  const int64_t grain = num_rows == 1 ? std::numeric_limits<int64_t>::max() : 1;
  const int64_t rank_tiles = (R + kRankTile - 1) / kRankTile;
  const int64_t num_shrink = static_cast<int64_t>(tiles.size()) * S * rank_tiles;
  at::parallel_for(0, num_shrink, grain, [&](int64_t w0, int64_t w1) {
    for (int64_t w = w0; w < w1; ++w) {
      const Tile& t = tiles[w / (S * rank_tiles)];
      const int64_t slice = w / rank_tiles % S, r0 = w % rank_tiles * kRankTile;
      const int64_t rank = ranks[t.slot * S + slice];
      if (r0 >= rank) continue;
      const WT* a_slice = ap + (t.slot * S + slice) * R * K;
      shrink(xp, K, a_slice, t, r0, std::min(kRankTile, rank - r0), s.get() + slice * R, s_stride);
    }
  });
  std::vector<ColChunk> chunks;
  for (int64_t i = 0; i < S; ++i) {
    const int64_t end = i + 1 < S ? offsets[i + 1] : N;
    for (int64_t c = offsets[i]; c < end; c += kColChunk)
      chunks.push_back({i, c, std::min(c + kColChunk, end)});
  }
  const int64_t num_chunks = static_cast<int64_t>(chunks.size());
  const int64_t num_expand = static_cast<int64_t>(tiles.size()) * num_chunks;
  at::parallel_for(0, num_expand, grain, [&](int64_t w0, int64_t w1) {
    for (int64_t w = w0; w < w1; ++w) {
      const Tile& t = tiles[w / num_chunks];
      const ColChunk& c = chunks[w % num_chunks];
      const int64_t rank = ranks[t.slot * S + c.slice];
      if (rank == 0) continue;
      expand(yp, y_stride, bp + t.slot * R * N, N, t, s.get() + c.slice * R, s_stride, rank, c.col0,
             c.col1);
    }
  });
}
#endif

}  // namespace

// y [T, N] (float32 or bf16, rows of any stride) += each segment's adapter product, in
// place; x [T, K] (float32 or bf16). See the top of the file for the other arguments.
void lora_add(at::Tensor y, at::Tensor x, at::Tensor a, at::Tensor b, at::Tensor ranks,
              std::vector<int64_t> slice_offsets, at::Tensor segments) {
#if defined(PAGODA_LORA_ADD)
  TORCH_CHECK(a.dim() == 4 && b.dim() == 3 && a.size(0) == b.size(0) && a.size(2) == b.size(1),
              "lora_add: a must be [L, S, R, K] and b [L, R, N]");
  TORCH_CHECK(a.scalar_type() == b.scalar_type() &&
                  (a.scalar_type() == at::kFloat || a.scalar_type() == at::kBFloat16),
              "lora_add: a and b both float32 or both bfloat16");
  TORCH_CHECK(a.is_contiguous() && b.is_contiguous() && ranks.is_contiguous(),
              "lora_add: contiguous a, b, ranks");
  TORCH_CHECK(ranks.scalar_type() == at::kInt && ranks.numel() == a.size(0) * a.size(1),
              "lora_add: ranks must be [L, S] int32");
  TORCH_CHECK(static_cast<int64_t>(slice_offsets.size()) == a.size(1),
              "lora_add: one offset per slice");
  TORCH_CHECK(a.size(2) <= kMaxRank, "lora_add: rank above ", kMaxRank);
  TORCH_CHECK(x.dim() == 2 && y.dim() == 2 && x.size(0) == y.size(0) && x.size(1) == a.size(3) &&
                  y.size(1) == b.size(2) && y.stride(1) == 1,
              "lora_add: x must be [T, K] and y [T, N] with contiguous rows");
  TORCH_CHECK(segments.dim() == 2 && segments.size(1) == 3 && segments.scalar_type() == at::kLong,
              "lora_add: segments must be [G, 3] int64");
  x = x.contiguous();
  segments = segments.contiguous();
  const int64_t T = x.size(0), L = a.size(0);
  const int64_t* seg = segments.data_ptr<int64_t>();
  std::vector<Tile> tiles;
  int64_t num_rows = 0;
  for (int64_t g = 0; g < segments.size(0); ++g) {
    const int64_t start = seg[3 * g], end = seg[3 * g + 1], slot = seg[3 * g + 2];
    TORCH_CHECK(0 <= start && start <= end && end <= T && 0 <= slot && slot < L,
                "lora_add: bad segment");
    for (int64_t r = start; r < end; r += kRowTile) {
      tiles.push_back({r, std::min(kRowTile, end - r), slot, num_rows});
      num_rows += tiles.back().rows;
    }
  }
  if (tiles.empty()) return;
  const int32_t* rk = ranks.data_ptr<int32_t>();
  // The manager keeps these right; a bad call from elsewhere must not read past a slot.
  for (int64_t i = 0; i < ranks.numel(); ++i)
    TORCH_CHECK(0 <= rk[i] && rk[i] <= a.size(2), "lora_add: a rank outside [0, R]");
  for (size_t i = 0; i < slice_offsets.size(); ++i)
    TORCH_CHECK(slice_offsets[i] >= (i ? slice_offsets[i - 1] : 0) && slice_offsets[i] <= y.size(1),
                "lora_add: slice offsets must rise within [0, N]");
  for (int64_t g = 1; g < segments.size(0); ++g)
    TORCH_CHECK(seg[3 * g] >= seg[3 * (g - 1) + 1], "lora_add: segments must not overlap");
  const bool xf = x.scalar_type() == at::kFloat, yf = y.scalar_type() == at::kFloat;
  TORCH_CHECK((xf || x.scalar_type() == at::kBFloat16) && (yf || y.scalar_type() == at::kBFloat16),
              "lora_add: x and y must be float32 or bfloat16");
  using BF = at::BFloat16;
  const bool wf = a.scalar_type() == at::kFloat;
  if (xf && yf && wf) run<float, float, float>(y, x, a, b, rk, slice_offsets, tiles, num_rows);
  else if (xf && yf) run<float, float, BF>(y, x, a, b, rk, slice_offsets, tiles, num_rows);
  else if (xf && wf) run<float, BF, float>(y, x, a, b, rk, slice_offsets, tiles, num_rows);
  else if (xf) run<float, BF, BF>(y, x, a, b, rk, slice_offsets, tiles, num_rows);
  else if (yf && wf) run<BF, float, float>(y, x, a, b, rk, slice_offsets, tiles, num_rows);
  else if (yf) run<BF, float, BF>(y, x, a, b, rk, slice_offsets, tiles, num_rows);
  else if (wf) run<BF, BF, float>(y, x, a, b, rk, slice_offsets, tiles, num_rows);
  else run<BF, BF, BF>(y, x, a, b, rk, slice_offsets, tiles, num_rows);
#else
  TORCH_CHECK(false, "lora_add: built without AVX-512 or AVX2");
#endif
}

bool lora_add_available() {
#if defined(PAGODA_LORA_ADD)
  return true;
#else
  return false;
#endif
}
