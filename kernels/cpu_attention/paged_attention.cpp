// Python bindings of paged_attention.h (the kernels and their contract are described there).
#include "paged_attention.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode", &radixlm_attn::decode, "paged decode attention (in place over the KV cache)");
  m.def("extend", &radixlm_attn::extend, "paged extend attention over a cached prefix, causal");
  m.def("decode_num_splits", &radixlm_attn::decode_num_splits, "kv splits the decode kernel picks");
  m.def("isa", []() { return std::string(RADIXLM_ISA_NAME); }, "the SIMD path this build uses");
}
