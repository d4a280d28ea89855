// Declarations of pagedllm's CPU kernels (one extension module; see bindings.cpp).
#pragma once
#include <torch/extension.h>

#include <optional>
#include <string>
#include <vector>

// paged_attention.cpp
void paged_attention(const torch::Tensor& query, const torch::Tensor& key_cache, const torch::Tensor& value_cache,
                     const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                     const torch::Tensor& query_start, torch::Tensor& out, double scale,
                     const torch::Tensor& req_indices, bool allow_amx,
                     const std::optional<torch::Tensor>& kv_scale);
void write_kv(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& key_cache,
              torch::Tensor& value_cache, const torch::Tensor& slot_mapping,
              const std::optional<torch::Tensor>& kv_scale);

// encoder_attention.cpp: attention within each sequence (query_start [R + 1] int32, host; key_start the same for
// key/value, default query_start), bidirectional or causal (a sequence's queries are the last of its key positions,
// and each sees the keys up to its own: a decoder's prompt, or a later chunk of it over K/V that includes its
// context). kernel: "auto" (the first of encoder_attention_kernels: the fastest this CPU has for the query), or one
// of them by name: "amx" (encoder_attention_amx.cpp, not causal), "avx512_bf16" (encoder_attention_avx512bf16.cpp),
// "generic"
torch::Tensor encoder_attention(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                                const torch::Tensor& query_start, double scale, const std::string& kernel,
                                bool causal, const c10::optional<torch::Tensor>& key_start);
std::vector<std::string> encoder_attention_kernels(const torch::Tensor& query, bool causal);
bool encoder_attention_amx_takes(const torch::Tensor& query);
void encoder_attention_amx(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                           torch::Tensor& out, const int32_t* query_start, const int32_t* key_start, int64_t num_seqs,
                           float scale);
bool encoder_attention_avx512bf16_takes(const torch::Tensor& query);
void encoder_attention_avx512bf16(const torch::Tensor& query, const torch::Tensor& key, const torch::Tensor& value,
                                  torch::Tensor& out, const int32_t* query_start, const int32_t* key_start,
                                  int64_t num_seqs, float scale, bool causal);

// encoder_ops.cpp: (layer_norm(x + residual) float32, its bfloat16 copy or itself); GELU in place
std::tuple<torch::Tensor, torch::Tensor> add_layer_norm(const torch::Tensor& x, const torch::Tensor& residual,
                                                        const torch::Tensor& weight, const torch::Tensor& bias,
                                                        double eps, bool want_bf16);
void gelu_(torch::Tensor& x, bool tanh_approx);

// packed_gemm.cpp
torch::Tensor packed_gemm(const torch::Tensor& x, const torch::Tensor& packed, int64_t out_features,
                          const std::optional<torch::Tensor>& bias, const std::optional<torch::Tensor>& out);

// quant_gemm.cpp (isa: 0 = best, 1 = AVX2+FMA+F16C, 2 = AVX-512, 3 = portable C++)
torch::Tensor q8_gemm(const torch::Tensor& x, const torch::Tensor& qweight, const torch::Tensor& scales,
                      int64_t group, int64_t out_features, const std::optional<torch::Tensor>& bias,
                      const std::optional<torch::Tensor>& out, int64_t isa);
torch::Tensor q4_gemm(const torch::Tensor& x, const torch::Tensor& qweight, const torch::Tensor& scales,
                      const torch::Tensor& mins, int64_t group, int64_t out_features,
                      const std::optional<torch::Tensor>& bias, const std::optional<torch::Tensor>& out,
                      int64_t isa);
torch::Tensor f8_gemm(const torch::Tensor& x, const torch::Tensor& qweight, const torch::Tensor& scales,
                      int64_t group, int64_t out_features, const std::optional<torch::Tensor>& bias,
                      const std::optional<torch::Tensor>& out, int64_t isa);
std::vector<int64_t> supported_isas();

// q4_dot_gemm.cpp: 4-bit weights in the "dot8" layout [P, K/8, 64] times x quantized per group to int8
torch::Tensor q4_dot_gemm(const torch::Tensor& x, const torch::Tensor& qweight, const torch::Tensor& scales,
                          const torch::Tensor& mins, int64_t group, int64_t out_features,
                          const std::optional<torch::Tensor>& bias, const std::optional<torch::Tensor>& out,
                          int64_t isa);

// q8_dot_gemm.cpp: 8-bit weights in the "dot4" layout [P, K/4, 64] (q + 128) times x quantized per group to
// int8; AVX-512 VNNI (q8_dot_supported()) or the portable loop (isa 3)
bool q8_dot_supported();
torch::Tensor q8_dot_gemm(const torch::Tensor& x, const torch::Tensor& qweight, const torch::Tensor& scales,
                          int64_t group, int64_t out_features, const std::optional<torch::Tensor>& bias,
                          const std::optional<torch::Tensor>& out, int64_t isa);

// w8a8_gemm.cpp (AVX-512 VNNI only; w8a8_supported() says whether this CPU has it)
bool w8a8_supported();
torch::Tensor w8a8_gemm(const torch::Tensor& x, const torch::Tensor& qweight, const torch::Tensor& scales,
                        int64_t out_features, const std::optional<torch::Tensor>& bias,
                        const std::optional<torch::Tensor>& out);

// bf16_gemm.cpp (AVX-512 BF16, or the portable loop when generic): x, W [ceil(N/16), K/2, 16, 2], bias in bf16;
// y bf16, or float32 where `out` is
bool bf16_gemm_supported();
torch::Tensor bf16_gemm(const torch::Tensor& x, const torch::Tensor& packed, int64_t out_features,
                        const std::optional<torch::Tensor>& bias, const std::optional<torch::Tensor>& out,
                        bool generic);

// sampling.cpp
torch::Tensor sample_from_logits(const torch::Tensor& logits, const torch::Tensor& temperature,
                                 const torch::Tensor& uniform);
// Per row: the first index of the largest logit (torch.argmax's rule), [B] int64.
torch::Tensor argmax_rows(const torch::Tensor& logits);
// Per row: argmax (greedy[b]) or the inverse-CDF draw, over the tokens allowed by bitmask row mask_row[b]
// (every token when mask_row[b] < 0). bitmask [M, ceil(V/32)] int32, greedy [B] bool, mask_row [B] int64.
torch::Tensor sample_masked(const torch::Tensor& logits, const torch::Tensor& temperature,
                            const torch::Tensor& uniform, const torch::Tensor& greedy, const torch::Tensor& bitmask,
                            const torch::Tensor& mask_row);

// fused_ops.cpp
void rms_norm_(torch::Tensor& x, const std::optional<torch::Tensor>& residual, const torch::Tensor& weight,
               double eps);
void rotary_(torch::Tensor& qk, const torch::Tensor& positions, const torch::Tensor& cos_sin, int64_t num_heads,
             int64_t head_dim);
// In place: num_heads heads of weight.numel() values from column col of each (strided) row of x, each RMS-normed.
void rms_norm_heads_(torch::Tensor& x, const torch::Tensor& weight, int64_t col, int64_t num_heads, double eps);
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps,
                       const std::optional<torch::Tensor>& out);
// In place: each head of x [T, H, D] -> head @ (blockdiag(Hadamard(block)) * scale) (fp8 caches' key rotation).
void hadamard_heads_(torch::Tensor& x, int64_t block, double scale);
void layer_norm_(torch::Tensor& x, const std::optional<torch::Tensor>& residual, const torch::Tensor& weight,
                 const torch::Tensor& bias, double eps);
torch::Tensor layer_norm(const torch::Tensor& x, const torch::Tensor& weight, const torch::Tensor& bias, double eps,
                         const std::optional<torch::Tensor>& out);
torch::Tensor silu_and_mul(const torch::Tensor& gate_up, const std::optional<torch::Tensor>& out);
torch::Tensor embedding_rows(const torch::Tensor& table, const torch::Tensor& ids,
                             const std::optional<torch::Tensor>& out);

// lora_sgmv.cpp: y[t] += (x[t] @ A[s]) @ B[s] for each row t with slot s = row_slots[t] >= 0, in place.
// y [T, N], x [T, K] float32 or bf16 (one dtype); A [S, K, R], B [S, R, N] float32 or bf16; R = bands * max_rank,
// band b of slot s using columns [b * max_rank, b * max_rank + slot_ranks[s]); slot_ranks [S] int32, row_slots [T]
// int32 (-1: no adapter); band_cols [S, bands, 2] int32: the columns [lo, hi) of y band b of slot s writes.
void lora_sgmv_(const torch::Tensor& y, const torch::Tensor& x, const torch::Tensor& a_slots,
                const torch::Tensor& b_slots, const torch::Tensor& slot_ranks, int64_t max_rank,
                const torch::Tensor& row_slots, const torch::Tensor& band_cols);
