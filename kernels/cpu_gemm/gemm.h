// bf16 linear layers on CPUs with AVX512-BF16 (vdpbf16ps) or AVX2/AVX512 (fp32 FMAs, further down):
// out[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]).
//
// The weight is packed once into blocks of 64 output rows, each stored k-pair by k-pair:
//
//     packed[b][p][j][t] = w[64 b + j][2 p + t]        b < ceil(N / 64), p < K / 2, j < 64, t < 2
//
// (rows past N are zero). One 64-byte vector then holds the pairs (k, k+1) of 16 output rows,
// which is what vdpbf16ps multiplies against a broadcast pair of x: each lane adds
// x[k] w[n, k] + x[k+1] w[n, k+1] into an fp32 sum, with no horizontal reduction at the end.
// A block is one contiguous stream of K * 128 bytes, so a thread reads its share of the weight as
// a few long sequential runs, which is what the hardware prefetchers handle best. At batch 1 this
// reads the weight at close to the machine's read bandwidth when the pages are 2 MiB (see
// runtime/layers/packed_linear.py); oneDNN's packed matmul reached about half of it here.
//
// Each thread takes a contiguous range of (block, row tile) pairs (run_row_chunks); within a block,
// rows of x go 4 at a time (16 accumulators) over the whole K, so every weight byte is loaded once
// per 4 rows and stays in L1/L2 between the row tiles; the last 5 or 6 rows go together
// (block_rows). Rows are handled in chunks of kRowChunk so that the chunk of x stays in cache for
// large prefills. The sums are fp32 in k
// order; the bias is added in fp32 and the result rounded to bf16 once (nearest even), as oneDNN's
// bf16 matmul does. Its outputs equal F.linear's for most shapes; where oneDNN splits K differently
// they differ by rounding.
#pragma once
#include <ATen/Parallel.h>
#include <torch/extension.h>
#include <immintrin.h>

#include "parallel.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace radixlm_gemm {

using bf16 = c10::BFloat16;
constexpr int64_t kBlock = 64;        // output rows per packed block (4 vectors of 16 lanes)
constexpr int64_t kRowChunk = 256;    // rows of x per pass over the weight

int64_t packed_numel(int64_t n, int64_t k) { return (n + kBlock - 1) / kBlock * kBlock * k; }

// w [N, K] bf16 contiguous -> out (packed_numel(N, K) bf16, contiguous), in the layout above.
void pack(const at::Tensor& w, at::Tensor& out) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && w.scalar_type() == at::kBFloat16,
              "gemm pack: w must be a contiguous 2-D bf16 tensor");
  const int64_t N = w.size(0), K = w.size(1), K2 = K / 2, blocks = (N + kBlock - 1) / kBlock;
  TORCH_CHECK(K % 2 == 0, "gemm pack: the input size must be even, got ", K);
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == at::kBFloat16 && out.numel() == packed_numel(N, K),
              "gemm pack: out must be a contiguous bf16 tensor of ", packed_numel(N, K), " elements");
  // a (k, k+1) pair of bf16 is moved as one 32-bit word
  const uint32_t* src = reinterpret_cast<const uint32_t*>(w.data_ptr<bf16>());
  uint32_t* dst = reinterpret_cast<uint32_t*>(out.data_ptr<bf16>());
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t p = 0; p < K2; ++p)
        for (int64_t j = 0; j < kBlock; ++j) {
          const int64_t n = b * kBlock + j;
          dst[(b * K2 + p) * kBlock + j] = n < N ? src[n * K2 + p] : 0u;
        }
  });
}

// A slice of the next block to fetch into L2 while a tile computes: `lines` (at most K2) cache lines
// from `at`, one per k pair (next_block_slice).
struct Prefetch {
  const char* at = nullptr;
  int64_t lines = 0;
};

#if defined(__AVX512BF16__)
// Rows [0, MR) of x against packed block `wb` (output rows n0 .. n0 + 63).
template <int MR>
inline void tile(const bf16* x, int64_t ldx, const bf16* wb, int64_t K2, int64_t n0, int64_t N,
                 const bf16* bias, bf16* out, int64_t ldo, Prefetch pf = {}) {
  __m512 acc[MR][4];
  for (int m = 0; m < MR; ++m)
    for (int i = 0; i < 4; ++i) acc[m][i] = _mm512_setzero_ps();
  for (int64_t p = 0; p < K2; ++p) {
    if (p < pf.lines) _mm_prefetch(pf.at + 64 * p, _MM_HINT_T1);
    const bf16* w = wb + p * kBlock * 2;
    __m512bh wv[4];
    for (int i = 0; i < 4; ++i) wv[i] = (__m512bh)_mm512_loadu_si512(w + 32 * i);
    for (int m = 0; m < MR; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * ldx + 2 * p, sizeof(pair));
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int i = 0; i < 4; ++i) acc[m][i] = _mm512_dpbf16_ps(acc[m][i], xv, wv[i]);
    }
  }
  for (int i = 0; i < 4; ++i) {
    const int64_t n = n0 + 16 * i;
    if (n >= N) break;
    const __mmask16 mask = (__mmask16)((1u << std::min<int64_t>(16, N - n)) - 1);
    __m512 b = _mm512_setzero_ps();
    if (bias != nullptr)   // bf16 -> fp32 is a 16-bit shift
      b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias + n)), 16));
    for (int m = 0; m < MR; ++m) {
      const __m512 v = bias != nullptr ? _mm512_add_ps(acc[m][i], b) : acc[m][i];
      _mm256_mask_storeu_epi16(out + m * ldo + n, mask, (__m256i)_mm512_cvtneps_pbh(v));
    }
  }
}

#else
// AVX2 + FMA (no bf16 dot product): the same packed layout. A 32-bit pair word holds w[n, k + 1] in
// its high half, which is that weight as an fp32 with the low half masked off, and w[n, k] in its low
// half, which a 16-bit shift turns into fp32: so one 256-bit load gives 8 output rows' (k, k + 1)
// weights as two fp32 vectors, each multiplied with a broadcast x[m, k] resp. x[m, k + 1] (fp32 sums,
// k order, one fused multiply-add per product). x's rows are first widened into an fp32 copy, so a
// broadcast is a plain load.
namespace avx2 {

inline __m256 low_half(__m256i v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
inline __m256 high_half(__m256i v) { return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(-65536))); }

// 8 fp32 -> 8 bf16, nearest even, NaN -> 0x7fc0 (c10::BFloat16's rounding)
inline __m128i to_bf16(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
}

#define RADIXLM_GEMM_INLINE inline __attribute__((always_inline))

// Rows [0, R) of xf (fp32, row stride ld) against V vectors (8 V output rows) of block wb starting at
// vector v0 -> acc. Per k pair the V weight vectors are widened once and used by all R rows.
template <int R, int V>
RADIXLM_GEMM_INLINE void dot(const float* xf, int64_t ld, const bf16* wb, int64_t K2, int v0, __m256 (&acc)[R][V]) {
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < V; ++i) acc[r][i] = _mm256_setzero_ps();
  for (int64_t p = 0; p < K2; ++p) {
    const bf16* w = wb + p * kBlock * 2 + 16 * v0;
    if (v0 == 0) {   // the first pass brings whole k-pair rows (4 lines) in, so the later passes hit cache
      const char* ahead = reinterpret_cast<const char*>(wb + (p + 8) * kBlock * 2);
      for (int l = 0; l < 4; ++l) _mm_prefetch(ahead + 64 * l, _MM_HINT_T0);
    }
    __m256 lo[V], hi[V];
    for (int i = 0; i < V; ++i) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16 * i));
      lo[i] = low_half(wv);
      hi[i] = high_half(wv);
    }
    for (int r = 0; r < R; ++r) {
      const __m256 x0 = _mm256_broadcast_ss(xf + r * ld + 2 * p), x1 = _mm256_broadcast_ss(xf + r * ld + 2 * p + 1);
      for (int i = 0; i < V; ++i) acc[r][i] = _mm256_fmadd_ps(x1, hi[i], _mm256_fmadd_ps(x0, lo[i], acc[r][i]));
    }
  }
}

// Sums (+ bias) rounded into out: res holds rows [0, rows) of 8 V sums (row stride 8 V) for output
// rows n0 + 8 v0 .. (those below N). The sums come through memory because indexing a register array
// in this loop made GCC keep that array on the stack for the whole k loop (halving the speed); and
// not inlined, so that its constants do not take registers from the sums.
__attribute__((noinline)) inline void store(const float* res, int rows, int V, int64_t n0, int v0, int64_t N,
                                            const bf16* bias, bf16* out, int64_t ldo) {
  for (int i = 0; i < V; ++i) {
    const int64_t n = n0 + 8 * (v0 + i), count = std::min<int64_t>(8, N - n);
    if (count <= 0) break;
    __m256 b = _mm256_setzero_ps();
    if (bias != nullptr) {
      float bf[8] = {};
      for (int64_t j = 0; j < count; ++j) bf[j] = static_cast<float>(bias[n + j]);
      b = _mm256_loadu_ps(bf);
    }
    for (int r = 0; r < rows; ++r) {
      const __m128i h = to_bf16(_mm256_add_ps(_mm256_loadu_ps(res + r * 8 * V + 8 * i), b));
      if (count == 8) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(out + r * ldo + n), h);
      } else {
        uint16_t tmp[8];
        _mm_storeu_si128(reinterpret_cast<__m128i*>(tmp), h);
        std::memcpy(out + r * ldo + n, tmp, count * sizeof(uint16_t));
      }
    }
  }
}

// acc -> res (row stride 8 V), constant indices only
template <int R, int V>
RADIXLM_GEMM_INLINE void spill(const __m256 (&acc)[R][V], float* res) {
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < V; ++i) _mm256_storeu_ps(res + r * 8 * V + 8 * i, acc[r][i]);
}

// Rows [0, R) against the whole block, V vectors at a time.
template <int R, int V>
inline void rows(const float* xf, int64_t ld, const bf16* wb, int64_t K2, int64_t n0, int64_t N, const bf16* bias,
                 bf16* out, int64_t ldo) {
  for (int v0 = 0; v0 < kBlock / 8 && n0 + 8 * v0 < N; v0 += V) {
    __m256 acc[R][V];
    dot<R, V>(xf, ld, wb, K2, v0, acc);
    float res[R * 8 * V];
    spill<R, V>(acc, res);
    store(res, R, V, n0, v0, N, bias, out, ldo);
  }
}

// Larger row ranges widen the whole block once into wf[k][j] = w[n0 + j, k] (fp32, K x 64) and
// then run a plain fp32 kernel: 6 rows x 16 outputs take 12 sums, 2 weight vectors and a broadcast,
// one multiply-add per sum and k with no widening in the loop (the same products and order as
// dot(), so the same bits).
inline void widen_block(const bf16* wb, int64_t K2, float* wf) {
  for (int64_t p = 0; p < K2; ++p)
    for (int i = 0; i < kBlock / 8; ++i) {
      const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb + p * kBlock * 2 + 16 * i));
      _mm256_storeu_ps(wf + (2 * p) * kBlock + 8 * i, low_half(wv));
      _mm256_storeu_ps(wf + (2 * p + 1) * kBlock + 8 * i, high_half(wv));
    }
}

// rows of x (row stride ldx) -> xf, fp32 with row stride K
inline void widen_rows(const bf16* x, int64_t ldx, int64_t rows, int64_t K, float* xf) {
  for (int64_t m = 0; m < rows; ++m) {
    const bf16* xr = x + m * ldx;
    float* dst = xf + m * K;
    int64_t k = 0;
    for (; k + 8 <= K; k += 8)
      _mm256_storeu_ps(dst + k, _mm256_castsi256_ps(_mm256_slli_epi32(
          _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xr + k))), 16)));
    for (; k < K; ++k) dst[k] = static_cast<float>(xr[k]);
  }
}

// `next` (or null): the packed block this thread takes next, K * 128 bytes, fetched into L2 a line
// every other k while this one computes (widening reads a block from memory in one go otherwise:
// at 16 rows that read took a third of the block's time).
template <int R>
inline void rows_widened(const float* xf, int64_t K, const float* wf, int64_t n0, int64_t N, const bf16* bias,
                         bf16* out, int64_t ldo, const char* next) {
  for (int v0 = 0; v0 < kBlock / 8 && n0 + 8 * v0 < N; v0 += 2) {
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const float* w = wf + 8 * v0;
    const char* pf = next != nullptr ? next + v0 / 2 * K * 32 : nullptr;
    for (int64_t k = 0; k < K; ++k, w += kBlock) {
      if (pf != nullptr && (k & 1) == 0) _mm_prefetch(pf + k * 32, _MM_HINT_T1);
      const __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 xb = _mm256_broadcast_ss(xf + r * K + k);
        acc[r][0] = _mm256_fmadd_ps(xb, w0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(xb, w1, acc[r][1]);
      }
    }
    float res[R * 16];
    spill<R, 2>(acc, res);
    store(res, R, 2, n0, v0, N, bias, out, ldo);
  }
}

}  // namespace avx2

// Rows [0, MR) of x against packed block `wb` (output rows n0 .. n0 + 63): one row goes 32 outputs
// at a time, more rows 16 at a time (4 rows: 8 sums, 4 widened weights and two broadcasts in the 16
// vector registers), the 5th and 6th rows as a second group.
template <int MR>
inline void tile(const bf16* x, int64_t ldx, const bf16* wb, int64_t K2, int64_t n0, int64_t N,
                 const bf16* bias, bf16* out, int64_t ldo, Prefetch = {}) {   // AVX2: block_range prefetches
  const int64_t K = 2 * K2;
  thread_local std::vector<float> xf_buf;
  if (static_cast<int64_t>(xf_buf.size()) < MR * K) xf_buf.resize(MR * K);
  float* xf = xf_buf.data();
  avx2::widen_rows(x, ldx, MR, K, xf);
  if constexpr (MR == 1) {
    avx2::rows<1, 4>(xf, K, wb, K2, n0, N, bias, out, ldo);
  } else if constexpr (MR <= 4) {
    avx2::rows<MR, 2>(xf, K, wb, K2, n0, N, bias, out, ldo);
  } else {
    avx2::rows<4, 2>(xf, K, wb, K2, n0, N, bias, out, ldo);
    avx2::rows<MR - 4, 2>(xf + 4 * K, K, wb, K2, n0, N, bias, out + 4 * ldo, ldo);
  }
}
#endif

// Rows [0, rows) of x (1 <= rows <= kMaxTileRows) against the whole block, in one pass over its 4
// vectors: 6 rows take 24 accumulators, 4 weight vectors and the broadcast x pair, 29 of the 32
// vector registers. So a decode batch with a few speculative proposals streams each block once.
constexpr int kMaxTileRows = 6;
inline void block_rows(int64_t rows, const bf16* x, int64_t ldx, const bf16* wb, int64_t K2, int64_t n0, int64_t N,
                       const bf16* bias, bf16* out, int64_t ldo, Prefetch pf = {}) {
  switch (rows) {
    case 1: tile<1>(x, ldx, wb, K2, n0, N, bias, out, ldo, pf); break;
    case 2: tile<2>(x, ldx, wb, K2, n0, N, bias, out, ldo, pf); break;
    case 3: tile<3>(x, ldx, wb, K2, n0, N, bias, out, ldo, pf); break;
    case 4: tile<4>(x, ldx, wb, K2, n0, N, bias, out, ldo, pf); break;
    case 5: tile<5>(x, ldx, wb, K2, n0, N, bias, out, ldo, pf); break;
    default: tile<6>(x, ldx, wb, K2, n0, N, bias, out, ldo, pf); break;
  }
}

// Rows in the next tile starting `left` rows before the end: 4 at a time, the last 5 or 6 together.
inline int64_t next_tile_rows(int64_t left) { return left > kMaxTileRows ? 4 : left; }

// Row tiles of a chunk of `rows` rows as next_tile_rows() cuts them: all of 4 rows but the last
// (1 to 6 rows), tile t starting at row 4 t.
inline int64_t num_row_tiles(int64_t rows) { return rows > kMaxTileRows ? 1 + (rows - kMaxTileRows + 3) / 4 : 1; }

// The slice of block `next` (K2 * 256 bytes: 4 K2 lines) that the tile starting `left` rows before the
// end of a chunk of `tiles` tiles fetches into L2 while it computes: the chunk's tiles split the block's
// lines between them, so by the chunk's last tile of this block the next block is in L2. Without it
// a block's first tile waited for its weights from memory: at decode batch 64 on a 2-core Zen 4,
// SmolLM2's lm_head took 8.6-8.9 ms with it against 10.3, qkv_proj 174 us against 199, gate_up with
// SiLU 567-575 against 607 (batch 16: lm_head 2.3-2.5 ms against 2.9). Off below 4 tiles (a slice
// would be more lines than k pairs; a decode of a few rows streams the weight at memory speed
// anyway) and without a next block.
constexpr int64_t kPrefetchTiles = 4;
inline Prefetch next_block_slice(const bf16* next, int64_t K2, int64_t tiles, int64_t left) {
  if (next == nullptr || tiles < kPrefetchTiles) return {};
  const int64_t lines = 4 * K2, per = (lines + tiles - 1) / tiles, s = num_row_tiles(left) - 1;
  const int64_t l0 = std::min(lines, s * per), l1 = std::min(lines, l0 + per);
  return {reinterpret_cast<const char*>(next) + 64 * l0, std::min(l1 - l0, K2)};
}

// Rows [0, rows) of x against the whole block, the first of them `left` rows before the end of their
// chunk: tiles as next_tile_rows(left) cuts them. On the AVX2 path a range of kWidenRows rows or more
// widens the block once and takes rows_widened (the same bits).
// On the AVX512-BF16 path each tile fetches its slice of `next` (null: none), the block after wb, for
// a chunk of `tiles` tiles (next_block_slice).
constexpr int64_t kWidenRows = 8;
inline void block_range(int64_t rows, int64_t left, const bf16* x, int64_t ldx, const bf16* wb, int64_t K2,
                        int64_t n0, int64_t N, const bf16* bias, bf16* out, int64_t ldo, const bf16* next = nullptr,
                        int64_t tiles = 0) {
#if !defined(__AVX512BF16__)
  if (rows >= kWidenRows) {
    const int64_t K = 2 * K2;
    thread_local std::vector<float> wf, xf;
    if (static_cast<int64_t>(wf.size()) < K * kBlock) wf.resize(K * kBlock);
    if (static_cast<int64_t>(xf.size()) < 6 * K) xf.resize(6 * K);
    avx2::widen_block(wb, K2, wf.data());
    for (int64_t m = 0, r; m < rows; m += r) {
      r = std::min<int64_t>(6, rows - m);
      avx2::widen_rows(x + m * ldx, ldx, r, K, xf.data());
      bf16* o = out + m * ldo;
      // the next block in memory is the one a thread takes next (run_row_chunks goes block-major)
      const char* next = m == 0 ? reinterpret_cast<const char*>(wb + K2 * kBlock * 2) : nullptr;
      switch (r) {
        case 1: avx2::rows_widened<1>(xf.data(), K, wf.data(), n0, N, bias, o, ldo, next); break;
        case 2: avx2::rows_widened<2>(xf.data(), K, wf.data(), n0, N, bias, o, ldo, next); break;
        case 3: avx2::rows_widened<3>(xf.data(), K, wf.data(), n0, N, bias, o, ldo, next); break;
        case 4: avx2::rows_widened<4>(xf.data(), K, wf.data(), n0, N, bias, o, ldo, next); break;
        case 5: avx2::rows_widened<5>(xf.data(), K, wf.data(), n0, N, bias, o, ldo, next); break;
        default: avx2::rows_widened<6>(xf.data(), K, wf.data(), n0, N, bias, o, ldo, next); break;
      }
    }
    return;
  }
#endif
  for (int64_t mr; rows > 0; rows -= mr, left -= mr, x += mr * ldx, out += mr * ldo) {
    mr = next_tile_rows(left);
    block_rows(mr, x, ldx, wb, K2, n0, N, bias, out, ldo, next_block_slice(next, K2, tiles, left));
  }
}

// How many (block, row tile) units a thread takes next when `left` remain: a guided share in whole
// blocks of `tiles` units while that is at least a block (a block split between two ranges is widened
// twice on the AVX2 path), then half blocks.
inline int64_t take_units(int64_t left, int64_t tiles) {
  const int64_t share = radixlm_parallel::guided_share(left, 1);
  return share >= tiles ? share / tiles * tiles : std::max<int64_t>(share, tiles / 2);
}

// The output and loops of linear() and gemm_silu.h's linear_silu_mul(), x and packed checked by them:
// out = [M, n_out] bf16; rows of x in chunks of kRowChunk, and per chunk every (block, row tile) pair
// once. The pairs of a chunk go block-major and threads take contiguous ranges of them at run time
// (parallel.h), so a thread streams whole blocks except at the ends of its ranges;
// body(xp, ldx, wp, op, b, m, m_end, m1, tiles) writes block b for the tiles of rows [m, m_end) of the
// chunk that ends at row m1 and has `tiles` row tiles (next_tile_rows(m1 - m) rows at a time; xp: x with
// row stride ldx, wp: the packed weight, op: out). Splitting blocks alone left threads uneven whenever the block count is not
// a multiple of the thread count (SmolLM2's o_proj and down_proj have 9 blocks: 10% of their time
// spent waiting at 2 threads), and one fixed range per thread left the fast thread waiting whenever a
// neighbour slowed the other (parallel.h).
template <typename Body>
inline at::Tensor run_row_chunks(const at::Tensor& x, const at::Tensor& packed, int64_t n_out, int64_t blocks,
                                 Body&& body) {
  const int64_t M = x.size(0), ldx = x.stride(0);
  at::Tensor out = at::empty({M, n_out}, x.options());
  const bf16* xp = x.data_ptr<bf16>();
  const bf16* wp = packed.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  for (int64_t m0 = 0; m0 < M; m0 += kRowChunk) {
    const int64_t m1 = std::min(M, m0 + kRowChunk), tiles = num_row_tiles(m1 - m0), units = blocks * tiles;
    auto run = [&](int64_t u0, int64_t u1) {
      for (int64_t u = u0; u < u1;) {
        const int64_t b = u / tiles, t0 = u % tiles, t1 = std::min(tiles, t0 + (u1 - u));
        body(xp, ldx, wp, op, b, m0 + 4 * t0, t1 == tiles ? m1 : m0 + 4 * t1, m1, tiles);
        u += t1 - t0;
      }
    };
    radixlm_parallel::guided_for(units, [&](int64_t left) { return take_units(left, tiles); }, run);
  }
  return out;
}

// x [M, K] bf16 (last dim contiguous, any row stride), packed from pack(), bias [N] bf16 or None
// -> [M, N] bf16.
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t N, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1,
              "gemm linear: x must be 2-D bf16 with a contiguous last dim");
  const int64_t K = x.size(1), K2 = K / 2, blocks = (N + kBlock - 1) / kBlock;
  TORCH_CHECK(K % 2 == 0 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.numel() == packed_numel(N, K),
              "gemm linear: the packed weight does not match x's ", K, " features and ", N, " outputs");
  const bf16* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == N,
                "gemm linear: bias must be a contiguous bf16 [N]");
    bp = bias->data_ptr<bf16>();
  }
  return run_row_chunks(x, packed, N, blocks, [&](const bf16* xp, int64_t ldx, const bf16* wp, bf16* op, int64_t b,
                                                  int64_t m, int64_t m_end, int64_t m1, int64_t tiles) {
    const bf16* next = b + 1 < blocks ? wp + (b + 1) * K2 * kBlock * 2 : nullptr;
    block_range(m_end - m, m1 - m, xp + m * ldx, ldx, wp + b * K2 * kBlock * 2, K2, b * kBlock, N, bp, op + m * N, N,
                next, tiles);
  });
}

}  // namespace radixlm_gemm
