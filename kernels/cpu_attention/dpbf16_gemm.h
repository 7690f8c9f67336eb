// The small bf16 products of extend_brgemm.h on AVX512-BF16 (vdpbf16ps), for CPUs that have it but
// no AMX (AMD Zen 4/5, Intel Cooper Lake). There torch's brgemm has no micro-kernel and falls back
// to a generic gemm call per product, which made a 2,048-token prefill's attention 60% of its time
// on a Zen 5 EPYC.
//
//     dpbf16_gemm(M, N, K, A, lda, B, ldb, C, ldc, add_C)
//     C[M][N] = (add_C ? C : 0) + A[M][K] . B        A bf16 row-major, C fp32
//
// B is VNNI-packed exactly as the AMX tiles take it: [K/2][ldb][2], element (p, j) holding B[2p][j]
// and B[2p + 1][j]. So one 64-byte load is the k-pairs of 16 columns, vdpbf16ps multiplies them
// against a broadcast pair of one A row and adds both products into 16 fp32 sums: no horizontal
// reduction. K even, N a multiple of 16, lda even. Register tile: MR rows x NV vectors of 16 columns
// (6 x 4 = 24 sums, or 4 x 5 when 80 columns are left, as at head_dim 80), B's vectors loaded once
// per k-pair and reused by the MR rows. Sums are fp32, in k-pair order.
#pragma once

#if defined(RADIXLM_AVX512)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace radixlm_attn {

#define RADIXLM_TARGET_BF16 __attribute__((target("avx512f,avx512bw,avx512bf16")))

// Whether this CPU executes vdpbf16ps (the kernel is compiled into every AVX512 build and only run here).
inline bool cpu_has_avx512_bf16() {
  static const bool has = __builtin_cpu_supports("avx512bf16");
  return has;
}

template <int MR, int NV>
RADIXLM_TARGET_BF16 inline void dpbf16_tile(int K2, const uint16_t* A, int64_t lda, const uint32_t* B, int64_t ldb,
                                            float* C, int64_t ldc, bool add_C) {
  __m512 acc[MR][NV];
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) acc[r][v] = add_C ? _mm512_loadu_ps(C + r * ldc + 16 * v) : _mm512_setzero_ps();
  for (int p = 0; p < K2; ++p) {
    __m512bh b[NV];
    for (int v = 0; v < NV; ++v) b[v] = (__m512bh)_mm512_loadu_si512(B + p * ldb + 16 * v);
    for (int r = 0; r < MR; ++r) {
      int32_t pair;
      std::memcpy(&pair, A + r * lda + 2 * p, sizeof(pair));
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], a, b[v]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(C + r * ldc + 16 * v, acc[r][v]);
}

// Every row of A against NV vectors of columns: full MR-row tiles, then one tile for the rest.
template <int MR, int NV>
RADIXLM_TARGET_BF16 inline void dpbf16_cols(int M, int K2, const uint16_t* A, int64_t lda, const uint32_t* B,
                                            int64_t ldb, float* C, int64_t ldc, bool add_C) {
  int m = 0;
  for (; m + MR <= M; m += MR) dpbf16_tile<MR, NV>(K2, A + m * lda, lda, B, ldb, C + m * ldc, ldc, add_C);
  const uint16_t* a = A + m * lda;
  float* c = C + m * ldc;
  switch (M - m) {
    case 1: dpbf16_tile<1, NV>(K2, a, lda, B, ldb, c, ldc, add_C); break;
    case 2: dpbf16_tile<2, NV>(K2, a, lda, B, ldb, c, ldc, add_C); break;
    case 3: dpbf16_tile<3, NV>(K2, a, lda, B, ldb, c, ldc, add_C); break;
    case 4: dpbf16_tile<4, NV>(K2, a, lda, B, ldb, c, ldc, add_C); break;
    case 5: dpbf16_tile<5, NV>(K2, a, lda, B, ldb, c, ldc, add_C); break;
    default: break;   // 0 (MR is at most 6)
  }
}

template <typename T>
RADIXLM_TARGET_BF16 __attribute__((noinline)) void dpbf16_gemm(int M, int N, int K, const T* A, int64_t lda,
                                                               const T* B, int64_t ldb, float* C, int64_t ldc,
                                                               bool add_C) {
  static_assert(sizeof(T) == 2, "bf16 operands");
  const auto* a = reinterpret_cast<const uint16_t*>(A);
  const auto* b = reinterpret_cast<const uint32_t*>(B);
  const int K2 = K / 2;
  for (int n0 = 0; n0 < N;) {
    const int left = (N - n0) / 16;
    if (left == 5) {   // 80 columns (head_dim 80) in one pass
      dpbf16_cols<4, 5>(M, K2, a, lda, b + n0, ldb, C + n0, ldc, add_C);
      n0 += 80;
      continue;
    }
    const int nv = std::min(left, 4);
    switch (nv) {
      case 4: dpbf16_cols<6, 4>(M, K2, a, lda, b + n0, ldb, C + n0, ldc, add_C); break;
      case 3: dpbf16_cols<6, 3>(M, K2, a, lda, b + n0, ldb, C + n0, ldc, add_C); break;
      case 2: dpbf16_cols<6, 2>(M, K2, a, lda, b + n0, ldb, C + n0, ldc, add_C); break;
      default: dpbf16_cols<6, 1>(M, K2, a, lda, b + n0, ldb, C + n0, ldc, add_C); break;
    }
    n0 += 16 * nv;
  }
}

}  // namespace radixlm_attn
#endif  // RADIXLM_AVX512
