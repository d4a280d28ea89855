// The Python module: one extension holds every CPU kernel, so there is one build to cache.
#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("write_kv", &write_kv, "Store K/V rows at their cache slots");
  m.def("paged_attention", &paged_attention, "Paged attention reading K/V through block tables");
  m.def("small_gemm", &small_gemm, "x[M,K] @ w[N,K]^T for M <= 8, streaming each weight row once",
        py::arg("x"), py::arg("weight"), py::arg("bias") = py::none());
  m.def("rms_norm_", &rms_norm_, "In place: residual += x (if given); x = rms_norm(residual or x) * weight");
  m.def("rotary_", &rotary_, "In place rotate-half rotary embedding on the first num_heads heads of each row");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up for gate_up = [gate | up]");
}
