// The Python bindings of pagoda's CPU kernels (one extension, built on first use).
#include <torch/extension.h>

at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                  at::Tensor block_tables, at::Tensor seq_lens, double scale,
                                  c10::optional<at::Tensor> k_scales,
                                  c10::optional<at::Tensor> v_scales, int64_t window,
                                  double softcap, int64_t v_dim);
bool small_gemm_available();
at::Tensor small_gemm(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias);
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
void fused_add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps);
void rotary_embedding(at::Tensor x, at::Tensor positions, at::Tensor cos, at::Tensor sin);
bool quant_linear_available();
at::Tensor quant_linear(at::Tensor x, at::Tensor qs, at::Tensor d, c10::optional<at::Tensor> m,
                        int64_t format, c10::optional<at::Tensor> bias,
                        c10::optional<at::Tensor> qh, c10::optional<at::Tensor> sc);
at::Tensor dequantize(at::Tensor qs, at::Tensor d, c10::optional<at::Tensor> m, int64_t format,
                      at::ScalarType dtype, c10::optional<at::Tensor> out_buffer,
                      c10::optional<at::Tensor> qh, c10::optional<at::Tensor> sc);
bool int8_linear_small_available();
at::Tensor int8_linear_small(at::Tensor x, at::Tensor w, at::Tensor w_scale,
                             c10::optional<at::Tensor> bias);
at::Tensor int8_linear_large(at::Tensor x, at::Tensor w, at::Tensor w_scale,
                             c10::optional<at::Tensor> bias);
void int8_dequantize(at::Tensor w, at::Tensor w_scale, at::Tensor out);
void apply_token_bitmask(at::Tensor logits, at::Tensor rows, at::Tensor bitmask);
bool lora_add_available();
void lora_add(at::Tensor y, at::Tensor x, at::Tensor a, at::Tensor b, at::Tensor ranks,
              std::vector<int64_t> slice_offsets, at::Tensor segments);
std::vector<at::Tensor> moe_group(at::Tensor x, at::Tensor router_logits, int64_t top_k,
                                  bool renormalize);
at::Tensor moe_combine(at::Tensor out, at::Tensor token_of, at::Tensor pair_weights,
                       int64_t num_tokens);
void bind_decode_loop(py::module_& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "Paged decode attention (CPU)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"),
        py::arg("seq_lens"), py::arg("scale"), py::arg("k_scales") = py::none(),
        py::arg("v_scales") = py::none(), py::arg("window") = 0, py::arg("softcap") = 0.0,
        py::arg("v_dim") = 0);
  m.def("small_gemm_available", &small_gemm_available, "Whether small_gemm was built (AVX512-BF16)");
  m.def("small_gemm", &small_gemm, "y = x @ w.T (+ bias), bf16 or float32, one sum order per element at any M (CPU)");
  m.def("apply_token_bitmask", &apply_token_bitmask,
        "logits[rows[r], t] = -inf where bit t of bitmask[r] is clear, in place (CPU)");
  m.def("rms_norm", &rms_norm, "RMSNorm of [T, n] rows (CPU)");
  m.def("fused_add_rms_norm", &fused_add_rms_norm, "residual += x; x = RMSNorm(residual), in place (CPU)");
  m.def("rotary_embedding", &rotary_embedding, "Rotary embedding in place, rotate-half layout (CPU)");
  m.def("quant_linear_available", &quant_linear_available, "Whether quant_linear was built (AVX512-VNNI)");
  m.def("quant_linear", &quant_linear, "y = x @ dequant(w).T (+ bias), int8 activations (CPU)",
        py::arg("x"), py::arg("qs"), py::arg("d"), py::arg("m"), py::arg("format"),
        py::arg("bias"), py::arg("qh") = py::none(), py::arg("sc") = py::none());
  m.def("dequantize", &dequantize, "A block-quantized weight as a float matrix (CPU)",
        py::arg("qs"), py::arg("d"), py::arg("m"), py::arg("format"), py::arg("dtype"),
        py::arg("out_buffer") = py::none(), py::arg("qh") = py::none(), py::arg("sc") = py::none());
  m.def("int8_linear_small_available", &int8_linear_small_available,
        "Whether int8_linear_small was built (AVX512-VNNI)");
  m.def("int8_linear_small", &int8_linear_small,
        "W8A8 y = x @ w.T, a few rows: per-row int8 activations, VNNI dot products (CPU)");
  m.def("int8_linear_large", &int8_linear_large,
        "W8A8 y = x @ w.T, many rows: per-row int8 activations, oneDNN integer GEMM (CPU)");
  m.def("int8_dequantize", &int8_dequantize, "out = w * w_scale[:, None], per-channel int8 (CPU)");
  m.def("lora_add_available", &lora_add_available, "Whether lora_add was built (AVX-512)");
  m.def("lora_add", &lora_add,
        "y[segment rows] += x @ A[slot]^T @ B[slot]^T per slice, in place (multi-LoRA, CPU)");
  m.def("moe_group", &moe_group,
        "MoE routing: softmax top-k, pairs sorted by expert, rows gathered (CPU)");
  m.def("moe_combine", &moe_combine,
        "MoE: y[t] = sum of t's pairs' weighted expert outputs, in pair order (CPU)");
  bind_decode_loop(m);
}
