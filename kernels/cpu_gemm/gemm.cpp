// Python bindings of gemm.h (the kernels and their contract are described there).
#include "gemm_silu.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("packed_numel", &radixlm_gemm::packed_numel, "elements of the packed copy of an [n, k] weight");
  m.def("pack", &radixlm_gemm::pack, "pack(w [n, k] bf16, out): writes the blocked k-pair layout into out");
  m.def("linear", &radixlm_gemm::linear, "linear(x [m, k] bf16, packed, n, bias or None) -> [m, n] bf16");
  m.def("linear_silu_mul", &radixlm_gemm::linear_silu_mul,
        "linear_silu_mul(x [m, k] bf16, packed gate_up [2i, k], i) -> silu(gate) * up [m, i] bf16 (i % 64 == 0)");
}
