// The Python module: one extension holds every CPU kernel, so there is one build to cache.
#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("write_kv", &write_kv, "Store K/V rows at their cache slots");
  m.def("paged_attention", &paged_attention, "Paged attention reading K/V through block tables");
  m.def("packed_gemm", &packed_gemm, "x[M,K] @ W^T (+ bias) with W packed in 16-column panels [N/16, K, 16]",
        py::arg("x"), py::arg("packed"), py::arg("out_features"), py::arg("bias") = py::none(),
        py::arg("out") = py::none());
  m.def("sample_from_logits", &sample_from_logits, "Inverse-CDF sample of softmax(logits / temperature) per row",
        py::arg("logits"), py::arg("temperature"), py::arg("uniform"));
  m.def("rms_norm_", &rms_norm_, "In place: residual += x (if given); x = rms_norm(residual or x) * weight");
  m.def("rotary_", &rotary_, "In place rotate-half rotary embedding on the first num_heads heads of each row");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up for gate_up = [gate | up]");
}
