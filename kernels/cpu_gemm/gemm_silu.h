// A gated MLP's first half in one pass: silu(x . W_gate^T) * (x . W_up^T) from the packed gate_up
// weight ([gate; up], 2 * I output rows, I a multiple of kBlock), without the [M, 2 * I] product.
//
// Gate block b and up block b + I / kBlock hold the same 64 columns of the two halves. Per block and
// tile of rows, tile() computes both into two small bf16 buffers (rounded exactly as linear() stores
// them), and radixlm_ops::silu_and_mul_row turns them into the 64 output columns while they are in
// L1. The result has the same bits as linear() followed by silu_and_mul() (every element takes the
// vector path there too, I being a multiple of 64), and the [M, 2 * I] intermediate is never written
// to memory nor read back: at prefill that was a 12 MB round trip per layer for SmolLM2's 2,048-row
// chunks, and silu_and_mul alone 5% of the prefill.
#pragma once

#include "fused_ops.h"
#include "gemm.h"

namespace radixlm_gemm {

// rows per gate / up pass: a tile on the AVX512-BF16 path, 96 on the AVX2 path (2 x 12 KiB of results)
#if defined(__AVX512BF16__)
constexpr int64_t kHalfRows = kMaxTileRows;
#else
constexpr int64_t kHalfRows = 96;
#endif

// Rows [0, rows) of x (at most kMaxTileRows) against gate block wg and up block wu into gate / up
// ([rows][kBlock] bf16 each); pg / pu: the slices of the next gate / up block to fetch meanwhile.
inline void gate_up_tile(int64_t rows, const bf16* x, int64_t ldx, const bf16* wg, const bf16* wu, int64_t K2,
                         bf16* gate, bf16* up, Prefetch pg = {}, Prefetch pu = {}) {
  block_rows(rows, x, ldx, wg, K2, 0, kBlock, nullptr, gate, kBlock, pg);
  block_rows(rows, x, ldx, wu, K2, 0, kBlock, nullptr, up, kBlock, pu);
}

// x [M, K] bf16 (last dim contiguous), packed from pack() of the [2 * I, K] gate_up weight -> [M, I].
at::Tensor linear_silu_mul(const at::Tensor& x, const at::Tensor& packed, int64_t I) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1,
              "gemm linear_silu_mul: x must be 2-D bf16 with a contiguous last dim");
  const int64_t K = x.size(1), K2 = K / 2, blocks = I / kBlock;
  TORCH_CHECK(I % kBlock == 0 && K % 2 == 0 && packed.scalar_type() == at::kBFloat16 && packed.is_contiguous() &&
                  packed.numel() == packed_numel(2 * I, K),
              "gemm linear_silu_mul: the packed gate_up weight does not match x's ", K, " features and 2 x ", I,
              " outputs (I a multiple of ", kBlock, ")");
  return run_row_chunks(x, packed, I, blocks, [&](const bf16* xp, int64_t ldx, const bf16* wp, bf16* op, int64_t b,
                                                  int64_t m, int64_t m_end, int64_t m1, int64_t tiles) {
    const bf16* wg = wp + b * K2 * kBlock * 2;
    const bf16* wu = wp + (b + blocks) * K2 * kBlock * 2;
    const bool more = b + 1 < blocks;   // the next gate / up blocks, fetched meanwhile (next_block_slice)
    const bf16* next_g = more ? wg + K2 * kBlock * 2 : nullptr;
    const bf16* next_u = more ? wu + K2 * kBlock * 2 : nullptr;
    bf16 gate[kHalfRows * kBlock], up[kHalfRows * kBlock];
    for (int64_t mr; m < m_end; m += mr) {
#if !defined(__AVX512BF16__)   // AVX2: block_range widens each half once per pass (from kWidenRows rows)
      mr = std::min(kHalfRows, m_end - m);
      block_range(mr, mr, xp + m * ldx, ldx, wg, K2, 0, kBlock, nullptr, gate, kBlock);
      block_range(mr, mr, xp + m * ldx, ldx, wu, K2, 0, kBlock, nullptr, up, kBlock);
#else
      mr = next_tile_rows(m1 - m);
      gate_up_tile(mr, xp + m * ldx, ldx, wg, wu, K2, gate, up, next_block_slice(next_g, K2, tiles, m1 - m),
                   next_block_slice(next_u, K2, tiles, m1 - m));
#endif
      for (int64_t r = 0; r < mr; ++r)
        radixlm_ops::silu_and_mul_row(op + (m + r) * I + b * kBlock, gate + r * kBlock, up + r * kBlock, kBlock);
    }
  });
}

}  // namespace radixlm_gemm
