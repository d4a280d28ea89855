// The Python module: one extension holds every CPU kernel, so there is one build to cache.
#include "amx_dot.h"
#include "amx_tiles.h"
#include "kernels.h"
#include "moe_gemm.h"
#include "step_graph.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("write_kv", step_graph::recorded<-1>("write_kv", &write_kv),
        "Store K/V rows at their cache slots (an fp8 cache: value / kv_scale, saturated)", py::arg("key"),
        py::arg("value"), py::arg("key_cache"), py::arg("value_cache"), py::arg("slot_mapping"),
        py::arg("kv_scale") = py::none());
  m.def("paged_attention", step_graph::recorded<-1>("paged_attention", &paged_attention),
        "Paged attention reading K/V through block tables", py::arg("query"), py::arg("key_cache"),
        py::arg("value_cache"), py::arg("block_tables"), py::arg("seq_lens"), py::arg("query_start"), py::arg("out"),
        py::arg("scale"), py::arg("req_indices"), py::arg("allow_amx") = true, py::arg("kv_scale") = py::none());
  m.def("encoder_attention", step_graph::recorded<-1>("encoder_attention", &encoder_attention),
        "Attention within each sequence of a flat batch (bidirectional, or causal), K/V read in place -> [T, H, D]; "
        "key_start: the sequences' offsets in key/value when they differ from query_start (causal: queries over "
        "keys that include earlier context)",
        py::arg("query"), py::arg("key"), py::arg("value"), py::arg("query_start"), py::arg("scale"),
        py::arg("kernel") = "auto", py::arg("causal") = false, py::arg("key_start") = py::none());
  m.def("encoder_attention_kernels", &encoder_attention_kernels,
        "The encoder_attention kernels that can run this query on this CPU, fastest first "
        "(amx: bf16 of head dim 32 or 64, not causal; avx512_bf16: bf16 of head dim 32 or 64; generic: float32 and bf16)",
        py::arg("query"), py::arg("causal") = false);
  m.def("add_layer_norm", step_graph::recorded<-1>("add_layer_norm", &add_layer_norm),
        "(layer_norm(x + residual) in float32, its bfloat16 copy if want_bf16 else the same tensor)",
        py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("bias"), py::arg("eps"),
        py::arg("want_bf16"));
  m.def("gelu_", step_graph::recorded<-1>("gelu_", &gelu_), "In place GELU (erf form, or the tanh approximation)", py::arg("x"),
        py::arg("tanh_approx") = false);
  m.def("packed_gemm", step_graph::recorded<4>("packed_gemm", &packed_gemm), "x[M,K] @ W^T (+ bias) with W packed in 16-column panels [N/16, K, 16]",
        py::arg("x"), py::arg("packed"), py::arg("out_features"), py::arg("bias") = py::none(),
        py::arg("out") = py::none());
  m.def("moe_packed_gemm", step_graph::recorded<4>("moe_packed_gemm", &moe_packed_gemm),
        "MoE experts: x[R,K] sorted by expert, rows [ends[e-1], ends[e]) @ expert e's W^T, W [E, N/16, K, 16] panels",
        py::arg("x"), py::arg("packed"), py::arg("ends"), py::arg("out_features"), py::arg("out") = py::none());
  m.def("moe_quant_gemm", step_graph::recorded<8>("moe_quant_gemm", &moe_quant_gemm),
        "MoE quantized experts: x[R,K] sorted by expert, rows [ends[e-1], ends[e]) @ expert e's W^T, W the dense "
        "quantized panels stacked [E, ...] (layout 0 int8, 1 q4 pairs, 2 fp8, 3 dot8, 4 dot4)",
        py::arg("x"), py::arg("qweight"), py::arg("scales"), py::arg("mins"), py::arg("layout"), py::arg("group"),
        py::arg("out_features"), py::arg("ends"), py::arg("out") = py::none(), py::arg("isa") = 0);
  m.def("moe_bf16_gemm", step_graph::recorded<4>("moe_bf16_gemm", &moe_bf16_gemm),
        "MoE bf16 experts: x[R,K] bf16 sorted by expert, rows [ends[e-1], ends[e]) @ expert e's W^T, W bf16 panels "
        "[E, N/16, K/2, 16, 2]", py::arg("x"), py::arg("packed"), py::arg("ends"), py::arg("out_features"),
        py::arg("out") = py::none(), py::arg("generic") = false);
  m.def("moe_route", step_graph::recorded<-1>("moe_route", &moe_route),
        "MoE router logits [T, E] -> top-k experts and weights, rows sorted by expert: token_of, weight, ends",
        py::arg("router_logits"), py::arg("top_k"), py::arg("topk_first"), py::arg("renormalize"),
        py::arg("token_of"), py::arg("weight"), py::arg("ends"));
  m.def("moe_gather_rows", step_graph::recorded<-1>("moe_gather_rows", &moe_gather_rows),
        "out[r] = x[token_of[r]]", py::arg("x"), py::arg("token_of"), py::arg("out"));
  m.def("moe_combine", step_graph::recorded<-1>("moe_combine", &moe_combine),
        "out[t] = sum of weight[r] * y[r] over the rows r of token t (+ sigmoid(shared_gate[t]) * shared[t]); out "
        "overwritten", py::arg("y"), py::arg("token_of"), py::arg("weight"), py::arg("out"),
        py::arg("shared") = py::none(), py::arg("shared_gate") = py::none());
  m.def("bf16_gemm", step_graph::recorded<4>("bf16_gemm", &bf16_gemm),
        "bf16 x[M,K] @ W^T (+ bias) -> bf16, W in panels of 16 columns and pairs of k [ceil(N/16), K/2, 16, 2]",
        py::arg("x"), py::arg("packed"), py::arg("out_features"), py::arg("bias") = py::none(),
        py::arg("out") = py::none(), py::arg("generic") = false);
  m.def("bf16_gemm_supported", &bf16_gemm_supported, "Whether this CPU runs bf16_gemm's AVX-512 BF16 path");
  m.def("q8_gemm", step_graph::recorded<6>("q8_gemm", &q8_gemm), "x[M,K] @ (scale * int8 W)^T (+ bias), W in 16-column panels [P, K, 16]",
        py::arg("x"), py::arg("qweight"), py::arg("scales"), py::arg("group"), py::arg("out_features"),
        py::arg("bias") = py::none(), py::arg("out") = py::none(), py::arg("isa") = 0);
  m.def("q4_gemm", step_graph::recorded<7>("q4_gemm", &q4_gemm), "x[M,K] @ (scale * q4 + min)^T (+ bias), W nibbles in panels [P, K/2, 16]",
        py::arg("x"), py::arg("qweight"), py::arg("scales"), py::arg("mins"), py::arg("group"),
        py::arg("out_features"), py::arg("bias") = py::none(), py::arg("out") = py::none(), py::arg("isa") = 0);
  m.def("q4_dot_gemm", step_graph::recorded<7>("q4_dot_gemm", &q4_dot_gemm),
        "x[M,K] quantized per group to int8 @ (scale * q4 + min)^T (+ bias), W in dot8 blocks [P, K/8, 64]",
        py::arg("x"), py::arg("qweight"), py::arg("scales"), py::arg("mins"), py::arg("group"),
        py::arg("out_features"), py::arg("bias") = py::none(), py::arg("out") = py::none(), py::arg("isa") = 0);
  m.def("amx_bf16_supported", &amx_tiles::bf16_supported,
        "Whether this CPU has AMX-BF16 and the kernel granted the tile state (paged_attention's bf16 scores use it)");
  m.def("amx_dot_supported", &amx_dot::supported, "Whether q4_dot_gemm / q8_dot_gemm run on AMX tiles (isa 4) here");
  m.def("q8_dot_supported", &q8_dot_supported, "Whether this CPU runs q8_dot_gemm fast (AVX-512 VNNI)");
  m.def("q8_dot_gemm", step_graph::recorded<6>("q8_dot_gemm", &q8_dot_gemm),
        "x[M,K] quantized per group to int8 @ (scale * q8)^T (+ bias), W + 128 in dot4 blocks [P, K/4, 64]",
        py::arg("x"), py::arg("qweight"), py::arg("scales"), py::arg("group"), py::arg("out_features"),
        py::arg("bias") = py::none(), py::arg("out") = py::none(), py::arg("isa") = 0);
  m.def("f8_gemm", step_graph::recorded<6>("f8_gemm", &f8_gemm), "x[M,K] @ (scale * fp8 e4m3 W)^T (+ bias), W bytes in panels [P, K, 16]",
        py::arg("x"), py::arg("qweight"), py::arg("scales"), py::arg("group"), py::arg("out_features"),
        py::arg("bias") = py::none(), py::arg("out") = py::none(), py::arg("isa") = 0);
  m.def("supported_isas", &supported_isas, "Kernel ISA codes this CPU runs (3 = portable, 1 = AVX2, 2 = AVX-512)");
  // Whether this build's plain C++ loops (the generic attention kernels) were vectorised for AVX-512: their register
  // blocks are twice as tall there, and their speed against torch's SDPA differs with it.
#if defined(__AVX512F__)
  m.attr("built_for_avx512") = true;
#else
  m.attr("built_for_avx512") = false;
#endif
  // Whether it was built for AVX-512 BF16 (a -march with it): the paged attention's bf16 dot products then take a
  // bf16 query's scores and P.V with P rounded to bf16; other builds keep P in float32.
#if defined(__AVX512BF16__)
  m.attr("built_for_avx512_bf16") = true;
#else
  m.attr("built_for_avx512_bf16") = false;
#endif
  m.def("w8a8_supported", &w8a8_supported, "Whether this CPU runs w8a8_gemm (AVX-512 VNNI)");
  m.def("w8a8_gemm", step_graph::recorded<5>("w8a8_gemm", &w8a8_gemm), "x[M,K] quantized per row to int8 @ (scale * int8 W)^T (+ bias), VNNI",
        py::arg("x"), py::arg("qweight"), py::arg("scales"), py::arg("out_features"), py::arg("bias") = py::none(),
        py::arg("out") = py::none());
  m.def("sample_from_logits", step_graph::recorded<-1>("sample_from_logits", &sample_from_logits), "Inverse-CDF sample of softmax(logits / temperature) per row",
        py::arg("logits"), py::arg("temperature"), py::arg("uniform"));
  m.def("argmax_rows", step_graph::recorded<-1>("argmax_rows", &argmax_rows),
        "Per row the first index of the largest logit (torch.argmax's tie rule)");
  m.def("sample_masked", step_graph::recorded<-1>("sample_masked", &sample_masked), "Per row argmax or inverse-CDF draw over the tokens a bitmask allows",
        py::arg("logits"), py::arg("temperature"), py::arg("uniform"), py::arg("greedy"), py::arg("bitmask"),
        py::arg("mask_row"));
  m.def("rms_norm_", step_graph::recorded<-1>("rms_norm_", &rms_norm_), "In place: residual += x (if given); x = rms_norm(residual or x) * weight");
  m.def("rotary_", step_graph::recorded<-1>("rotary_", &rotary_), "In place rotate-half rotary embedding on the first num_heads heads of each row");
  m.def("rms_norm_heads_", step_graph::recorded<-1>("rms_norm_heads_", &rms_norm_heads_),
        "In place: each of num_heads heads (weight.numel() values) from column col of every row of x RMS-normed",
        py::arg("x"), py::arg("weight"), py::arg("col"), py::arg("num_heads"), py::arg("eps"));
  m.def("hadamard_heads_", step_graph::recorded<-1>("hadamard_heads_", &hadamard_heads_),
        "In place: each head of x [T, H, D] times the block-diagonal Hadamard matrix of order block, times scale",
        py::arg("x"), py::arg("block"), py::arg("scale"));
  m.def("rms_norm", step_graph::recorded<3>("rms_norm", &rms_norm), "rms_norm(x) * weight into out (new if none)",
        py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("out") = py::none());
  m.def("layer_norm_", step_graph::recorded<-1>("layer_norm_", &layer_norm_),
        "In place: residual += x (if given); x = layer_norm(residual or x) * weight + bias");
  m.def("layer_norm", step_graph::recorded<4>("layer_norm", &layer_norm),
        "layer_norm(x) * weight + bias into out (new if none)", py::arg("x"), py::arg("weight"), py::arg("bias"),
        py::arg("eps"), py::arg("out") = py::none());
  m.def("silu_and_mul", step_graph::recorded<1>("silu_and_mul", &silu_and_mul),
        "silu(gate) * up for gate_up = [gate | up], into out (new if none)", py::arg("gate_up"),
        py::arg("out") = py::none());
  m.def("embedding_rows", step_graph::recorded<2>("embedding_rows", &embedding_rows),
        "table[ids] into out (new if none); an id outside the table is an error", py::arg("table"), py::arg("ids"),
        py::arg("out") = py::none());

  m.def("lora_sgmv_", step_graph::recorded<-1>("lora_sgmv_", &lora_sgmv_),
        "In place: y[t] += (x[t] @ A[s]) @ B[s] for each row t whose slot s = row_slots[t] is >= 0 (multi-LoRA)",
        py::arg("y"), py::arg("x"), py::arg("a_slots"), py::arg("b_slots"), py::arg("slot_ranks"),
        py::arg("max_rank"), py::arg("row_slots"), py::arg("band_cols"));

  // Step graphs (step_graph.h): record the kernel calls of one forward, replay them in one call.
  py::class_<step_graph::StepGraph, std::shared_ptr<step_graph::StepGraph>>(m, "StepGraph")
      .def("replay", &step_graph::StepGraph::replay, py::call_guard<py::gil_scoped_release>(),
           "Run the recorded kernel calls again, in order, on the same tensors")
      .def("profile", &step_graph::StepGraph::profile, py::arg("reps"), py::call_guard<py::gil_scoped_release>(),
           "Replay reps times timing each op: [(kernel name, seconds over all reps)] in the recorded order")
      .def_property_readonly("num_ops", [](const step_graph::StepGraph& g) { return g.ops.size(); })
      .def_readonly("broken", &step_graph::StepGraph::broken,
                    "Why the recording cannot be replayed (empty when it can)");
  m.def("begin_step_graph", &step_graph::begin, "Start recording this thread's kernel calls");
  m.def("end_step_graph", &step_graph::end, "Stop recording: the StepGraph of the calls since begin_step_graph");
  m.def("in_recorded_kernel", &step_graph::in_recorded_kernel,
        "Whether a recorded kernel is running on this thread (its own torch ops are part of it)");
}
