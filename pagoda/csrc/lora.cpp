// Multi-LoRA's batched products (Punica's shrink and expand) for one linear layer:
// y[rows of a segment] += (x @ A[slot]^T) @ B[slot]^T, in float32, per slice of a fused
// layer's output (q/k/v, gate/up), for every adapter segment of the step in one call.
//
//   a      [L, S, R, K] float32  each slot's A per slice, rank rows zero-padded to R
//   b      [L, R, N] float32     each slot's B^T (scaling in), slice i in its columns
//   ranks  [L, S] int32          each slot's rank per slice (0: that module not adapted)
//   segments [G, 3] int64        (start row, end row, slot)
//
// Two passes, each spread over both threads: the shrink (row tile x slice x 4 rank
// rows: each loaded chunk of A serves up to 4 rows of x), then the expand (row tile x
// 64 columns). Rank rows past a slot's own rank are never read, so a low-rank adapter,
// or one that skips a module, costs its own bytes, not the slot's. At a few rows this
// is a stream of the adapter's weights (about 20 MB for SmolLM2 at rank 16).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "simd.h"

namespace {

constexpr int64_t kRowTile = 4;
constexpr int64_t kRankTile = 4;
constexpr int64_t kColChunk = 64;

struct Tile {
  int64_t row0, rows, slot;
  int64_t s_row0;  // its first row in the shrink's output, which holds segment rows only
};

struct ColChunk {
  int64_t slice, col0, col1;
};

#if defined(__AVX512F__)
using namespace pagoda_simd;

template <typename XT>
void shrink(const XT* x, int64_t K, const float* a, const Tile& t, int64_t r0, int64_t nr,
            float* s, int64_t s_stride) {
  // s[t.row0 + i][r0 + j] = dot(x row i, a row j) for i < t.rows, j < nr.
  __m512 acc[kRowTile][kRankTile];
  for (int64_t i = 0; i < kRowTile; ++i)
    for (int64_t j = 0; j < kRankTile; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 mask = tail_mask(K - k);
    __m512 xv[kRowTile];
    for (int64_t i = 0; i < t.rows; ++i) xv[i] = load16(x + (t.row0 + i) * K + k, mask);
    for (int64_t j = 0; j < nr; ++j) {
      const __m512 av = load16(a + (r0 + j) * K + k, mask);
      for (int64_t i = 0; i < t.rows; ++i) acc[i][j] = _mm512_fmadd_ps(xv[i], av, acc[i][j]);
    }
  }
  for (int64_t i = 0; i < t.rows; ++i)
    for (int64_t j = 0; j < nr; ++j) s[(t.s_row0 + i) * s_stride + r0 + j] = _mm512_reduce_add_ps(acc[i][j]);
}

template <typename YT>
void expand(YT* y, int64_t y_stride, const float* b, int64_t N, const Tile& t, const float* s,
            int64_t s_stride, int64_t rank, int64_t col0, int64_t col1) {
  // y[row][col0:col1] += sum_r s[row][r] * b[r][col0:col1] for the tile's rows.
  for (int64_t c = col0; c < col1; c += 16) {
    const __mmask16 mask = tail_mask(col1 - c);
    __m512 acc[kRowTile];
    for (int64_t i = 0; i < t.rows; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t r = 0; r < rank; ++r) {
      const __m512 bv = load16(b + r * N + c, mask);
      for (int64_t i = 0; i < t.rows; ++i)
        acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(s[(t.s_row0 + i) * s_stride + r]), bv, acc[i]);
    }
    for (int64_t i = 0; i < t.rows; ++i) {
      YT* out = y + (t.row0 + i) * y_stride + c;
      store16(out, _mm512_add_ps(load16(out, mask), acc[i]), mask);
    }
  }
}

template <typename XT, typename YT>
void run(at::Tensor& y, const at::Tensor& x, const at::Tensor& a, const at::Tensor& b,
         const int32_t* ranks, const std::vector<int64_t>& offsets, const std::vector<Tile>& tiles,
         int64_t num_rows) {
  const int64_t S = a.size(1), R = a.size(2), K = a.size(3), N = b.size(2);
  const XT* xp = x.data_ptr<XT>();
  YT* yp = y.data_ptr<YT>();
  const int64_t y_stride = y.stride(0);
  const float* ap = a.data_ptr<float>();
  const float* bp = b.data_ptr<float>();
  // s[segment row][slice * R + r]: the shrink's output. Only entries below each slot's
  // rank are written, and only those are read.
  const int64_t s_stride = S * R;
  const std::unique_ptr<float[]> s(new float[num_rows * s_stride]);  // not zeroed: see above
  const int64_t rank_tiles = (R + kRankTile - 1) / kRankTile;
  const int64_t num_shrink = static_cast<int64_t>(tiles.size()) * S * rank_tiles;
  at::parallel_for(0, num_shrink, 1, [&](int64_t w0, int64_t w1) {
    for (int64_t w = w0; w < w1; ++w) {
      const Tile& t = tiles[w / (S * rank_tiles)];
      const int64_t slice = w / rank_tiles % S, r0 = w % rank_tiles * kRankTile;
      const int64_t rank = ranks[t.slot * S + slice];
      if (r0 >= rank) continue;
      const float* a_slice = ap + (t.slot * S + slice) * R * K;
      shrink(xp, K, a_slice, t, r0, std::min(kRankTile, rank - r0), s.get() + slice * R, s_stride);
    }
  });
  std::vector<ColChunk> chunks;
  for (int64_t i = 0; i < S; ++i) {
    const int64_t end = i + 1 < S ? offsets[i + 1] : N;
    for (int64_t c = offsets[i]; c < end; c += kColChunk) chunks.push_back({i, c, std::min(c + kColChunk, end)});
  }
  const int64_t num_chunks = static_cast<int64_t>(chunks.size());
  at::parallel_for(0, static_cast<int64_t>(tiles.size()) * num_chunks, 1, [&](int64_t w0, int64_t w1) {
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
#if defined(__AVX512F__)
  TORCH_CHECK(a.dim() == 4 && b.dim() == 3 && a.size(0) == b.size(0) && a.size(2) == b.size(1),
              "lora_add: a must be [L, S, R, K] and b [L, R, N]");
  TORCH_CHECK(a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat, "lora_add: float32 a, b");
  TORCH_CHECK(a.is_contiguous() && b.is_contiguous() && ranks.is_contiguous(), "lora_add: contiguous a, b, ranks");
  TORCH_CHECK(ranks.scalar_type() == at::kInt && ranks.numel() == a.size(0) * a.size(1),
              "lora_add: ranks must be [L, S] int32");
  TORCH_CHECK(static_cast<int64_t>(slice_offsets.size()) == a.size(1), "lora_add: one offset per slice");
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
    TORCH_CHECK(0 <= start && start <= end && end <= T && 0 <= slot && slot < L, "lora_add: bad segment");
    for (int64_t r = start; r < end; r += kRowTile) {
      tiles.push_back({r, std::min(kRowTile, end - r), slot, num_rows});
      num_rows += tiles.back().rows;
    }
  }
  if (tiles.empty()) return;
  const int32_t* rk = ranks.data_ptr<int32_t>();
  const bool xf = x.scalar_type() == at::kFloat, yf = y.scalar_type() == at::kFloat;
  TORCH_CHECK((xf || x.scalar_type() == at::kBFloat16) && (yf || y.scalar_type() == at::kBFloat16),
              "lora_add: x and y must be float32 or bfloat16");
  if (xf && yf) run<float, float>(y, x, a, b, rk, slice_offsets, tiles, num_rows);
  else if (xf) run<float, at::BFloat16>(y, x, a, b, rk, slice_offsets, tiles, num_rows);
  else if (yf) run<at::BFloat16, float>(y, x, a, b, rk, slice_offsets, tiles, num_rows);
  else run<at::BFloat16, at::BFloat16>(y, x, a, b, rk, slice_offsets, tiles, num_rows);
#else
  TORCH_CHECK(false, "lora_add: built without AVX-512");
#endif
}

bool lora_add_available() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}
