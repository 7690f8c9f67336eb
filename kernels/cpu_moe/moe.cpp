// Python bindings of moe.h (the kernel and its contract are described there).
#include "moe.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("experts_forward", &radixlm_moe::experts_forward,
        "experts_forward(x [n, H] bf16, ids [n, k] int64, weights [n, k] fp32, gate_up_ptrs [E] int64, "
        "down_ptrs [E] int64, intermediate) -> [n, H] bf16");
}
