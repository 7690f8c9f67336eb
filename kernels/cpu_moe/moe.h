// Fused MoE experts on CPUs with AVX512-BF16, over kernels/cpu_gemm's packed bf16 weights.
//
//     y[t] = sum_j w[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])),   e = ids[t, j]
//
// Steps (each one at::parallel_for, so both cores work on every step even at batch 1):
//   1. group: the n*k (token, slot) pairs are sorted by expert (counting sort, stable: within one
//      expert the pairs keep token order), and x's rows are gathered in that order into xs [n*k, H].
//   2. gate_up: tasks are (expert with tokens, 64-row output block of its gate_up weight); each task
//      runs gemm.h's `tile` microkernel over all rows of its expert, 4 at a time -> h [n*k, 2I] bf16.
//      Spreading experts x blocks over the threads keeps both cores busy when each expert got one
//      or two rows (decode), where a per-expert gemm would have 12 blocks and a thread launch each.
//   3. act: a = round(round(silu(gate)) * up) per row (cpu_ops' silu_and_mul_row: torch's rounding).
//      Where I is a multiple of 64, steps 2 and 3 are one pass (grouped_gate_up_silu: gemm_silu.h's
//      tiles, the same bits, one parallel region fewer and no [n*k, 2I] buffer).
//   4. down: tasks (expert, 64-row block of down) -> ys [n*k, H] bf16 (each rounded as F.linear's is).
//   5. combine: out[t] = round_bf16(sum_j w[t, j] * ys[pair(t, j)]) with the sum in fp32, per token,
//      slots in j order (no atomics, the same result for any thread count).
// The weights are found through tables of data pointers (int64 [E]) into the packed arena; the
// caller keeps the arena alive. The rounding differs from the torch loop (runtime/layers/moe.py)
// only in step 5: the loop rounds each weighted expert output to bf16 before adding it.
#pragma once
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cstdint>
#include <vector>

#include "fused_ops.h"
#include "gemm.h"
#include "gemm_silu.h"

namespace radixlm_moe {

using bf16 = c10::BFloat16;
using radixlm_gemm::kBlock;

// Rows [0, rows) of x (stride ldx) against packed block b of a weight with N outputs and K inputs.
inline void run_block(const bf16* x, int64_t ldx, int64_t rows, const bf16* packed, int64_t K, int64_t N,
                      int64_t b, bf16* out, int64_t ldo) {
  const int64_t K2 = K / 2, n0 = b * kBlock;
  const bf16* wb = packed + b * K2 * kBlock * 2;
  for (int64_t m = 0, mr; m < rows; m += mr) {
    mr = radixlm_gemm::next_tile_rows(rows - m);
    radixlm_gemm::block_rows(mr, x + m * ldx, ldx, wb, K2, n0, N, nullptr, out + m * ldo, ldo);
  }
}

// One pass of packed gemms: for every expert e with rows, in [starts[e], starts[e+1]) of `in`
// ([P, K] contiguous), out[rows] = in[rows] @ W_e^T, W_e [N, K] packed at ptrs[e].
inline void grouped_gemm(const bf16* in, int64_t K, const int64_t* ptrs, int64_t N, const std::vector<int64_t>& starts,
                         const std::vector<int64_t>& active, bf16* out) {
  const int64_t blocks = (N + kBlock - 1) / kBlock, tasks = static_cast<int64_t>(active.size()) * blocks;
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t e = active[t / blocks], b = t % blocks, r0 = starts[e];
      run_block(in + r0 * K, K, starts[e + 1] - r0, reinterpret_cast<const bf16*>(ptrs[e]), K, N, b, out + r0 * N, N);
    }
  });
}

// Steps 2-3 in one pass where the intermediate size is whole 64-row blocks (gemm_silu.h's way, the
// same bits): tasks (expert with rows, block b of I) compute gate block b and up block b + I / kBlock
// of the expert's packed gate_up for its rows, tile by tile, and write silu(gate) * up -> a [P, I].
inline void grouped_gate_up_silu(const bf16* in, int64_t K, const int64_t* ptrs, int64_t I,
                                 const std::vector<int64_t>& starts, const std::vector<int64_t>& active, bf16* a) {
  const int64_t blocks = I / kBlock, tasks = static_cast<int64_t>(active.size()) * blocks, K2 = K / 2;
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    bf16 gate[radixlm_gemm::kMaxTileRows * kBlock], up[radixlm_gemm::kMaxTileRows * kBlock];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t e = active[t / blocks], b = t % blocks, r0 = starts[e], rows = starts[e + 1] - r0;
      const bf16* w = reinterpret_cast<const bf16*>(ptrs[e]);
      const bf16 *wg = w + b * K2 * kBlock * 2, *wu = w + (b + blocks) * K2 * kBlock * 2;
      for (int64_t m = 0, mr; m < rows; m += mr) {
        mr = radixlm_gemm::next_tile_rows(rows - m);
        radixlm_gemm::gate_up_tile(mr, in + (r0 + m) * K, K, wg, wu, K2, gate, up);
        for (int64_t r = 0; r < mr; ++r)
          radixlm_ops::silu_and_mul_row(a + (r0 + m + r) * I + b * kBlock, gate + r * kBlock, up + r * kBlock, kBlock);
      }
    }
  });
}

// x [n, H] bf16 contiguous; ids [n, k] int64; weights [n, k] fp32; gate_up_ptrs / down_ptrs int64 [E]
// (packed [2I, H] and [H, I] weights, in gemm.h's layout) -> [n, H] bf16.
inline at::Tensor experts_forward(const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
                                  const at::Tensor& gate_up_ptrs, const at::Tensor& down_ptrs, int64_t inter) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16, "moe: x must be contiguous bf16 [n, H]");
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == x.size(0) && ids.is_contiguous() && ids.scalar_type() == at::kLong,
              "moe: ids must be contiguous int64 [n, k]");
  TORCH_CHECK(weights.sizes() == ids.sizes() && weights.is_contiguous() && weights.scalar_type() == at::kFloat,
              "moe: weights must be contiguous fp32 [n, k]");
  TORCH_CHECK(gate_up_ptrs.scalar_type() == at::kLong && down_ptrs.scalar_type() == at::kLong &&
                  gate_up_ptrs.is_contiguous() && down_ptrs.is_contiguous() && gate_up_ptrs.numel() == down_ptrs.numel(),
              "moe: the pointer tables must be contiguous int64 [E]");
  const int64_t n = x.size(0), H = x.size(1), k = ids.size(1), P = n * k, E = gate_up_ptrs.numel();
  TORCH_CHECK(H % 2 == 0 && inter % 2 == 0, "moe: hidden and intermediate sizes must be even");
  const int64_t* id = ids.data_ptr<int64_t>();
  const float* wt = weights.data_ptr<float>();
  // 1. counting sort of the pairs by expert
  std::vector<int64_t> starts(E + 1, 0), pos(P), src(P);
  for (int64_t p = 0; p < P; ++p) {
    TORCH_CHECK(id[p] >= 0 && id[p] < E, "moe: expert id ", id[p], " out of range [0, ", E, ")");
    ++starts[id[p] + 1];
  }
  std::vector<int64_t> active;
  for (int64_t e = 0; e < E; ++e) {
    if (starts[e + 1] > 0) active.push_back(e);
    starts[e + 1] += starts[e];
  }
  {
    std::vector<int64_t> fill(starts.begin(), starts.end() - 1);
    for (int64_t p = 0; p < P; ++p) {
      const int64_t r = fill[id[p]]++;
      pos[p] = r;        // pair p = (token p / k, slot p % k) is sorted row r
      src[r] = p / k;    // sorted row r reads token src[r]
    }
  }
  auto opts = x.options();
  at::Tensor xs = at::empty({P, H}, opts), a = at::empty({P, inter}, opts);
  at::Tensor ys = at::empty({P, H}, opts), out = at::empty({n, H}, opts);
  const bf16* xp = x.data_ptr<bf16>();
  bf16 *xsp = xs.data_ptr<bf16>(), *ap = a.data_ptr<bf16>(), *ysp = ys.data_ptr<bf16>();
  at::parallel_for(0, P, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) std::memcpy(xsp + r * H, xp + src[r] * H, H * sizeof(bf16));
  });
  // 2-4. gate_up, SiLU * up (in one pass where inter is whole blocks), down
  if (inter % kBlock == 0) {
    grouped_gate_up_silu(xsp, H, gate_up_ptrs.data_ptr<int64_t>(), inter, starts, active, ap);
  } else {
    at::Tensor h = at::empty({P, 2 * inter}, opts);
    bf16* hp = h.data_ptr<bf16>();
    grouped_gemm(xsp, H, gate_up_ptrs.data_ptr<int64_t>(), 2 * inter, starts, active, hp);
    at::parallel_for(0, P, 4, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        radixlm_ops::silu_and_mul_row(ap + r * inter, hp + r * 2 * inter, hp + r * 2 * inter + inter, inter);
    });
  }
  grouped_gemm(ap, inter, down_ptrs.data_ptr<int64_t>(), H, starts, active, ysp);
  // 5. weighted sum per token, fp32, slots in order
  bf16* op = out.data_ptr<bf16>();
  at::parallel_for(0, n, 4, [&](int64_t t0, int64_t t1) {
    std::vector<float> acc(H);
    for (int64_t t = t0; t < t1; ++t) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = 0; j < k; ++j) {
        const float w = wt[t * k + j];
        const bf16* y = ysp + pos[t * k + j] * H;
        for (int64_t c = 0; c < H; ++c) acc[c] += w * static_cast<float>(y[c]);
      }
      for (int64_t c = 0; c < H; ++c) op[t * H + c] = static_cast<bf16>(acc[c]);
    }
  });
  return out;
}

}  // namespace radixlm_moe
