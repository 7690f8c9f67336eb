// Python bindings of fused_ops.h (the kernels and their contract are described there).
#include "fused_ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &radixlm_ops::rms_norm, "out = weight * rms_normalize(x) (rounded as eager torch)");
  m.def("fused_add_rms_norm", &radixlm_ops::fused_add_rms_norm,
        "in place: residual = x + residual; x = rms_norm(residual)");
  m.def("silu_and_mul", &radixlm_ops::silu_and_mul, "out = silu(x[:, :d]) * x[:, d:]");
  m.def("rotary_embedding", &radixlm_ops::rotary_embedding, "neox rotary applied in place to q and k");
  m.def("argmax_rows", &radixlm_ops::argmax_rows, "out[r] = torch.max(x[r], 0).indices, for x [n, d]");
  m.def("isa", [] { return std::string(RADIXLM_ISA_NAME); });
}
