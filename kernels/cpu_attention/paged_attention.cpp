// Python bindings of paged_attention.h and extend_brgemm.h (the kernels and their contract are described there).
#include "paged_attention.h"
#include "extend_brgemm.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("decode", &radixlm_attn::decode, "paged decode attention (in place over the KV cache)", py::arg("out"),
        py::arg("q"), py::arg("k_buf"), py::arg("v_buf"), py::arg("req_to_token"), py::arg("req_pool_indices"),
        py::arg("seq_lens"), py::arg("scale"), py::arg("num_splits"), py::arg("window_left") = -1,
        py::arg("logit_cap") = 0.0);
  m.def("extend", &radixlm_attn::extend, "paged extend attention over a cached prefix, causal", py::arg("out"),
        py::arg("q"), py::arg("k_buf"), py::arg("v_buf"), py::arg("req_to_token"), py::arg("req_pool_indices"),
        py::arg("prefix_lens"), py::arg("seq_lens"), py::arg("qo_indptr"), py::arg("scale"),
        py::arg("window_left") = -1, py::arg("logit_cap") = 0.0);
  m.def("extend_brgemm", &radixlm_attn::extend_brgemm, "extend() with brgemm (matrix units), bf16 only",
        py::arg("out"), py::arg("q"), py::arg("k_buf"), py::arg("v_buf"), py::arg("req_to_token"),
        py::arg("req_pool_indices"), py::arg("prefix_lens"), py::arg("seq_lens"), py::arg("qo_indptr"),
        py::arg("scale"), py::arg("window_left") = -1, py::arg("logit_cap") = 0.0);
  m.def("extend_brgemm_micro", &radixlm_attn::extend_brgemm_micro,
        "the micro-kernel of extend_brgemm's products: amx, avx512_bf16 or gemm (torch's fallback)");
  m.def("force_extend_brgemm_micro", &radixlm_attn::force_extend_brgemm_micro,
        "tests: run extend_brgemm's products on 'gemm' or the best micro-kernel until 'auto'", py::arg("name"));
  m.def("decode_micro", [](int64_t head_dim) {
          return std::string(radixlm_attn::decode_dpbf16_usable(head_dim) ? "avx512_bf16" : "fma");
        }, "what bf16 decode runs its products on at this head_dim: avx512_bf16 (decode_dpbf16.h) or fma",
        py::arg("head_dim"));
  m.def("set_decode_dpbf16", &radixlm_attn::set_decode_dpbf16,
        "tests, benchmarks: allow (default) or forbid bf16 decode on vdpbf16ps", py::arg("allowed"));
  m.def("decode_num_splits", &radixlm_attn::decode_num_splits, "kv splits the decode kernel picks");
  m.def("isa", []() { return std::string(RADIXLM_ISA_NAME); }, "the SIMD path this build uses");
}
