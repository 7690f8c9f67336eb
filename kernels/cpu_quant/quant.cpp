// Python bindings of quant.h (the layout and the kernels are described there).
#include "quant.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("packed_bytes", &radixlm_quant::packed_bytes, "bytes of the repacked copy of an [n, k] weight of a GGUF type");
  m.def("repack", &radixlm_quant::repack, "repack(raw uint8, type, n, k, out uint8): file blocks -> the kernel layout");
  m.def("dequantize_rows", &radixlm_quant::dequantize_rows,
        "dequantize_rows(packed, type, n, k, ids int64) -> [len(ids), k] fp32");
  m.def("linear", &radixlm_quant::linear, "linear(x [m, k] bf16/fp32, packed, type, n) -> [m, n] in x's dtype");
}
