// Python bindings of quant.h (the layout and the kernels are described there).
#include "quant.h"
#include "kquant.h"
#include "qgemm.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("packed_bytes", &radixlm_quant::packed_bytes, "bytes of the repacked copy of an [n, k] weight of a GGUF type");
  m.def("repack", &radixlm_quant::repack, "repack(raw uint8, type, n, k, out uint8): file blocks -> the kernel layout");
  m.def("dequantize_rows", &radixlm_quant::dequantize_rows,
        "dequantize_rows(packed, type, n, k, ids int64) -> [len(ids), k] fp32");
  m.def("linear", &radixlm_kquant::linear,
        "linear(x [m, k] bf16/fp32, packed, type, n) -> [m, n] in x's dtype: the GEMV, any type (k-quants too)");
  // k-quants (Q4_K, Q5_K, Q6_K; kquant.h): the same three calls for 256-weight super-blocks
  m.def("k_packed_bytes", &radixlm_kquant::packed_bytes, "bytes of the repacked copy of an [n, k] k-quant weight");
  m.def("k_repack", &radixlm_kquant::repack, "k_repack(raw uint8, type, n, k, out uint8)");
  m.def("k_dequantize_rows", &radixlm_kquant::dequantize_rows, "k_dequantize_rows(packed, type, n, k, ids) -> fp32");
  m.def("gemm", &radixlm_qgemm::gemm, "gemm(x [m, k] bf16/fp32, packed, type, n) -> [m, n]: the prefill kernel, any type");
  m.def("dequantize_bf16", &radixlm_qgemm::dequantize_bf16,
        "dequantize_bf16(packed, type, n, k, g0, g1) -> rows of groups [g0, g1) as [rows, k] bf16");
}
