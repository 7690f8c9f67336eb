// The int8 activations shared by quant.h (GEMV), kquant.h (k-quant GEMV) and qgemm.h (prefill GEMM),
// and the one `linear` wrapper the two GEMV headers use.
// x [M, K] is quantized once per call, per row and block of 32: dx = max|x| / 127, q = round(x / dx),
// sx = dx * sum(q), and the int32 sums of q over each half of 16 (the k-quants' 16-weight sub-blocks
// and qgemm's zero-point start values need them).
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace radixlm_xquant {

constexpr int64_t kXB = 32;   // activations per block

struct QuantizedRows {
  std::vector<int8_t> q;          // [M, K]
  std::vector<float> dx, sx;      // [M, K / 32]
  std::vector<int32_t> half;      // [M, K / 16]: sums of q over each 16
};

template <typename T>
QuantizedRows quantize_rows(const T* x, int64_t ldx, int64_t M, int64_t K) {
  const int64_t nb = K / kXB;
  QuantizedRows r{std::vector<int8_t>(M * K), std::vector<float>(M * nb), std::vector<float>(M * nb),
                  std::vector<int32_t>(2 * M * nb)};
  at::parallel_for(0, M * nb, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t m = i / nb, b = i % nb;
      const T* xb = x + m * ldx + b * kXB;
      float v[32], amax = 0.f;
      for (int j = 0; j < 32; ++j) { v[j] = static_cast<float>(xb[j]); amax = std::max(amax, std::fabs(v[j])); }
      const float dx = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
      int s[2] = {0, 0};
      for (int j = 0; j < 32; ++j) {
        const int q = static_cast<int>(std::nearbyint(v[j] * inv));
        r.q[m * K + b * kXB + j] = static_cast<int8_t>(q);
        s[j / 16] += q;
      }
      r.dx[i] = dx;
      r.sx[i] = dx * static_cast<float>(s[0] + s[1]);
      r.half[2 * i] = s[0];
      r.half[2 * i + 1] = s[1];
    }
  });
  return r;
}

// x [M, K] bf16 or fp32 (contiguous last dim) against a packed weight of `nbytes` bytes -> [M, N] in
// x's dtype; run(xr, out_ptr) does the product for the quantized x (called with bf16* or float*).
template <typename Run>
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t nbytes, int64_t N, Run run) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "cpu_quant linear: x must be 2-D bf16 or fp32 with a contiguous last dim");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.numel() == nbytes,
              "cpu_quant linear: the packed weight does not match x's ", K, " features and ", N, " outputs");
  at::Tensor out = at::empty({M, N}, x.options());
  if (x.scalar_type() == at::kBFloat16) {
    run(quantize_rows(x.data_ptr<c10::BFloat16>(), x.stride(0), M, K), out.data_ptr<c10::BFloat16>());
  } else {
    run(quantize_rows(x.data_ptr<float>(), x.stride(0), M, K), out.data_ptr<float>());
  }
  return out;
}

}  // namespace radixlm_xquant
