// Python bindings of gemm.h (the kernels and their contract are described there).
#include "gemm.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("packed_numel", &radixlm_gemm::packed_numel, "elements of the packed copy of an [n, k] weight");
  m.def("pack", &radixlm_gemm::pack, "pack(w [n, k] bf16, out): writes the blocked k-pair layout into out");
  m.def("linear", &radixlm_gemm::linear, "linear(x [m, k] bf16, packed, n, bias or None) -> [m, n] bf16");
}
