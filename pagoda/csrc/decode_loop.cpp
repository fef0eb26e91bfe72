// A decode step's layers in one C++ call: the same kernels, in the same order, with the
// same arguments as the Python model's forward (pagoda/model_executor/models/
// transformer.py's DecoderLayer), so each row's result is bitwise what eager mode gives;
// what goes away is the Python between them (about 40 module calls, views and
// dispatches per layer).
//
// Each layer is described as the Python layer's config describes it (heads, scale,
// sliding window, soft cap, rope table or none, q/k norms, Gemma's output norms,
// Granite's residual multiplier, the MLP's activation); pagoda/model_executor/
// decode_loop.py hands them over from the built model, field by field.
// Mixture-of-experts layers run here too, as FusedMoE does: moe_group, each chosen
// expert's two products, moe_combine, then a shared expert if there is one.
//
// Built once per engine from the loaded weights and the KV cache tensors, for steps
// where every row is a decode row (one query token at its own position, drafts
// included) and at most 64 rows run. Everything else takes the Python path.
// Linear::operator() repeats the row-count dispatch of pagoda.ops.cpu (`linear`,
// `quant_linear`): a few rows on the small-batch kernels, more on oneDNN's GEMMs
// (bf16 rows padded to pagoda.ops.cpu.bucket_rows, a quantized weight dequantized into
// a scratch buffer first); its `decode_loop_linear` admits a linear only where the two
// agree, and tests/kernels/test_decode_loop.py holds them equal.
#include <ATen/ATen.h>

#include <algorithm>
#include <vector>

at::Tensor paged_decode_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache,
                                  at::Tensor block_tables, at::Tensor seq_lens, double scale,
                                  c10::optional<at::Tensor> k_scales,
                                  c10::optional<at::Tensor> v_scales, int64_t window,
                                  double softcap, int64_t v_dim);
at::Tensor small_gemm(at::Tensor x, at::Tensor w, c10::optional<at::Tensor> bias);
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
void fused_add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps);
void rotary_embedding(at::Tensor x, at::Tensor positions, at::Tensor cos, at::Tensor sin);
at::Tensor quant_linear(at::Tensor x, at::Tensor qs, at::Tensor d, c10::optional<at::Tensor> m,
                        int64_t format, c10::optional<at::Tensor> bias,
                        c10::optional<at::Tensor> qh, c10::optional<at::Tensor> sc);
at::Tensor int8_linear_small(at::Tensor x, at::Tensor w, at::Tensor w_scale,
                             c10::optional<at::Tensor> bias);
at::Tensor int8_linear_large(at::Tensor x, at::Tensor w, at::Tensor w_scale,
                             c10::optional<at::Tensor> bias);
at::Tensor dequantize(at::Tensor qs, at::Tensor d, c10::optional<at::Tensor> m, int64_t format,
                      at::ScalarType dtype, c10::optional<at::Tensor> out_buffer,
                      c10::optional<at::Tensor> qh, c10::optional<at::Tensor> sc);
void lora_add(at::Tensor y, at::Tensor x, at::Tensor a, at::Tensor b, at::Tensor ranks,
              std::vector<int64_t> slice_offsets, at::Tensor segments);
std::vector<at::Tensor> moe_group(at::Tensor x, at::Tensor router_logits, int64_t top_k,
                                  bool renormalize);
at::Tensor moe_combine(at::Tensor out, at::Tensor token_of, at::Tensor pair_weights,
                       int64_t num_tokens);

namespace {

// The contract with Python, defined here once and registered with the module
// (bind_decode_loop): pagoda.ops.cpu builds each linear's LinearSpec with these kinds,
// and decode_loop.py names each layer's activation with Activation.
enum LinearKind : int64_t { kDense = 0, kBlocks = 1, kPerChannel = 2, kStacked = 3 };
enum Activation : int64_t { kSilu = 0, kGeluTanh = 1 };

// A linear's LoRA slots (pagoda/lora/manager.py's LinearLoRA), added as Linear.forward adds
// them: lora_add on the product, with the step's segments.
struct LoRASlots {
  at::Tensor a, b, ranks;
  std::vector<int64_t> offsets;
};

// pagoda.ops.cpu.bucket_rows: a row count rounded up to one of a few sizes per octave,
// so that oneDNN sees few distinct M (tests/kernels/test_decode_loop.py holds them equal).
int64_t bucket_rows(int64_t rows) {
  int64_t top = 1;
  while (top * 2 <= rows) top *= 2;
  const int64_t step = std::max<int64_t>(8, top / 8);
  return (rows + step - 1) / step * step;
}

// x's rows padded with zero rows to bucket_rows (pagoda.ops.cpu.pad_rows).
at::Tensor pad_rows(const at::Tensor& x) {
  const int64_t n = x.size(0), rows = bucket_rows(n);
  if (rows == n) return x;
  at::Tensor padded = at::empty({rows, x.size(1)}, x.options());
  padded.narrow(0, 0, n).copy_(x);
  padded.narrow(0, n, rows - n).zero_();
  return padded;
}

// A dense product as pagoda.ops.cpu's `linear` takes it: float32 to F.linear; bf16 to
// small_gemm up to `small_rows` rows, past them to oneDNN's GEMM on padded rows.
at::Tensor dense(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                 int64_t small_rows) {
  const int64_t n = x.size(0);
  if (x.scalar_type() != at::kBFloat16) return at::linear(x, w, bias);
  if (n <= small_rows) return small_gemm(x, w, bias);
  return at::linear(pad_rows(x), w, bias).narrow(0, 0, n);
}

// A linear as the loop runs it (Python: LinearSpec, built by pagoda.ops.cpu's
// decode_loop_linear).
struct Linear {
  LinearKind kind;
  at::Tensor w;  // dense [N, K], or the quants (qs)
  c10::optional<at::Tensor> d, m, qh, sc, bias;
  int64_t format;
  int64_t small_rows;  // quantized: the most rows its small-batch kernel takes
  c10::optional<LoRASlots> lora;
  std::vector<Linear> parts;  // kStacked: the pieces, their outputs side by side

  // As pagoda.ops.cpu dispatches: dense as `dense` above (dense_small_rows: the loop's,
  // for bf16); quantized, up to small_rows quant_linear on the blocks or
  // int8_linear_small per channel, past them the blocks dequantized into `scratch` and
  // a dense product, or per channel int8_linear_large on padded rows; then the
  // adapters' part.
  at::Tensor operator()(const at::Tensor& x, const c10::optional<at::Tensor>& segments,
                        at::Tensor& scratch, int64_t dense_small_rows) const {
    const int64_t n = x.size(0);
    at::Tensor y;
    if (kind == kStacked) {
      std::vector<at::Tensor> ys;
      for (const Linear& part : parts) ys.push_back(part(x, c10::nullopt, scratch, dense_small_rows));
      y = at::cat(ys, 1);
    } else if (kind == kDense) {
      y = dense(x, w, bias, dense_small_rows);
    } else if (n <= small_rows) {
      y = kind == kBlocks ? quant_linear(x.contiguous(), w, *d, m, format, bias, qh, sc)
                          : int8_linear_small(x.contiguous(), w, *d, bias);
    } else if (kind == kPerChannel) {
      y = int8_linear_large(pad_rows(x.contiguous()), w, *d, bias).narrow(0, 0, n);
    } else {
      const int64_t numel = w.size(0) * w.size(1) * 32;  // [N, K / 32 blocks, ...]
      if (!scratch.defined() || scratch.scalar_type() != x.scalar_type() || scratch.numel() < numel)
        scratch = at::empty({numel}, x.options());  // (reused: fresh pages cost a fault each)
      y = dense(x, dequantize(w, *d, m, format, x.scalar_type(), scratch, qh, sc), bias,
                dense_small_rows);
    }
    if (lora.has_value() && segments.has_value())
      lora_add(y, x, lora->a, lora->b, lora->ranks, lora->offsets, *segments);
    return y;
  }
};

// A mixture-of-experts MLP (models/llama.py's SparseMoeBlock and FusedMoE): the router,
// the stacked experts, and Qwen2-MoE's gated shared expert (indices -1 without one).
struct MoE {
  int64_t router;
  at::Tensor w13, w2;  // [E, 2I, H], [E, H, I]
  int64_t top_k;
  bool renormalize;
  int64_t shared_gate_up, shared_down, shared_gate;
  // Quantized experts: each one's gate_up (down) as a linear of its own, by index into
  // DecodeLoop::linears; empty: the stacked w13 (w2) above.
  std::vector<int64_t> gate_up_linears, down_linears;
};

// A layer's q/k norms, as SelfAttention._norm_and_clip does them: over each head's D
// values (per_head: Qwen3, Gemma 3) or over the whole q and k projections (OLMoE), then
// q, k, v clamped (clip <= 0: no clamp).
struct QKNorm {
  at::Tensor q_weight, k_weight;
  bool per_head;
  double clip;
};

// One decoder layer, as pagoda/model_executor/models/transformer.py's DecoderLayer: its
// attention's shape and options, its norms, its MLP (dense or experts).
struct Layer {
  int64_t qkv, o, gate_up, down;  // indices into DecodeLoop::linears (MLP: -1 with moe)
  at::Tensor input_norm, ffn_norm;
  at::Tensor k_cache, v_cache;  // [num_blocks, block_size, KVH, D]
  int64_t H, KVH, D;
  double scale;
  int64_t window;  // 0: full attention
  double softcap;  // 0: none
  Activation activation;  // the MLP's gate
  double residual_multiplier;  // 0: none (Granite's)
  c10::optional<at::Tensor> cos, sin;  // this layer's rope table; none: no rotary
  c10::optional<at::Tensor> attn_output_norm, ffn_output_norm;  // Gemma's sandwich norms
  c10::optional<MoE> moe;
  c10::optional<QKNorm> qk_norm;
};

at::Tensor activate(const at::Tensor& gate, Activation activation) {
  return activation == kGeluTanh ? at::gelu(gate, "tanh") : at::silu(gate);
}

}  // namespace

class DecodeLoop {
 public:
  // dense_small_rows: the most rows pagoda.ops.cpu's `linear` gives small_gemm (bf16).
  DecodeLoop(double eps, at::Tensor final_norm, int64_t dense_small_rows)
      : eps_(eps), final_norm_(final_norm), dense_small_rows_(dense_small_rows) {}

  int64_t add_linear(const Linear& spec) {
    TORCH_CHECK(spec.kind == kDense || spec.kind == kStacked || spec.d.has_value(),
                "a quantized linear needs its scales");
    linears_.push_back(spec);
    return static_cast<int64_t>(linears_.size()) - 1;
  }

  void set_lora(int64_t linear, at::Tensor a, at::Tensor b, at::Tensor ranks,
                std::vector<int64_t> offsets) {
    TORCH_CHECK(linear >= 0 && linear < static_cast<int64_t>(linears_.size()), "no linear ", linear);
    linears_[linear].lora = LoRASlots{a, b, ranks, offsets};
  }

  void add_layer(int64_t qkv, int64_t o, int64_t gate_up, int64_t down, at::Tensor input_norm,
                 at::Tensor ffn_norm, at::Tensor k_cache, at::Tensor v_cache, int64_t num_heads,
                 double scale, int64_t window, double softcap, Activation activation,
                 double residual_multiplier) {
    const int64_t n = static_cast<int64_t>(linears_.size());
    for (int64_t i : {qkv, o}) TORCH_CHECK(i >= 0 && i < n, "no linear ", i);
    for (int64_t i : {gate_up, down}) TORCH_CHECK(i >= -1 && i < n, "no linear ", i);
    TORCH_CHECK(k_cache.dim() == 4 && num_heads % k_cache.size(2) == 0,
                "k_cache must be [blocks, block_size, KVH, D] with KVH dividing the heads");
    layers_.push_back({qkv, o, gate_up, down, input_norm, ffn_norm, k_cache, v_cache, num_heads,
                       k_cache.size(2), k_cache.size(3), scale, window, softcap, activation,
                       residual_multiplier, c10::nullopt, c10::nullopt, c10::nullopt,
                       c10::nullopt, c10::nullopt, c10::nullopt});
  }

  // The last added layer turns q and k with this table ([positions, R / 2], R <= D).
  void set_rope(at::Tensor cos, at::Tensor sin) {
    TORCH_CHECK(!layers_.empty(), "set_rope: no layer");
    layers_.back().cos = cos;
    layers_.back().sin = sin;
  }

  // The last added layer's attention normalizes q and k; clip <= 0: no clamp.
  void set_qk_norm(at::Tensor q_weight, at::Tensor k_weight, bool per_head, double clip) {
    TORCH_CHECK(!layers_.empty(), "set_qk_norm: no layer");
    layers_.back().qk_norm = QKNorm{q_weight, k_weight, per_head, clip};
  }

  // The last added layer normalizes its attention's and its MLP's outputs (Gemma).
  void set_output_norms(at::Tensor attn_output_norm, at::Tensor ffn_output_norm) {
    TORCH_CHECK(!layers_.empty(), "set_output_norms: no layer");
    layers_.back().attn_output_norm = attn_output_norm;
    layers_.back().ffn_output_norm = ffn_output_norm;
  }

  // The last added layer's MLP becomes a mixture of experts (add_layer with gate_up and
  // down of -1 first). shared_*: Qwen2-MoE's shared expert, or -1.
  void set_moe(int64_t router, at::Tensor w13, at::Tensor w2, int64_t top_k, bool renormalize,
               int64_t shared_gate_up, int64_t shared_down, int64_t shared_gate) {
    TORCH_CHECK(!layers_.empty(), "set_moe: no layer");
    TORCH_CHECK(w13.dim() == 3 && w2.dim() == 3 && w13.size(0) == w2.size(0), "set_moe: bad experts");
    layers_.back().moe = MoE{router, w13, w2, top_k, renormalize, shared_gate_up, shared_down,
                             shared_gate, {}, {}};
  }

  // The last MoE layer's experts that are quantized: one linear each (add_linear) for
  // gate_up and/or down, in expert order; an empty list keeps that part stacked.
  void set_moe_experts(std::vector<int64_t> gate_up, std::vector<int64_t> down) {
    TORCH_CHECK(!layers_.empty() && layers_.back().moe.has_value(), "set_moe_experts: no MoE");
    MoE& M = *layers_.back().moe;
    const int64_t n = static_cast<int64_t>(linears_.size());
    for (const std::vector<int64_t>* v : {&gate_up, &down}) {
      TORCH_CHECK(v->empty() || static_cast<int64_t>(v->size()) == M.w13.size(0),
                  "set_moe_experts: one linear per expert");
      for (int64_t i : *v) TORCH_CHECK(i >= 0 && i < n, "no linear ", i);
    }
    M.gate_up_linears = std::move(gate_up);
    M.down_linears = std::move(down);
  }

  // x: [T, hidden], the embedded tokens (written over) -> the final norm's output.
  // lora_segments: the step's adapter segments (LoRAMapping.segment_tensor), if any.
  at::Tensor run(at::Tensor x, at::Tensor positions, at::Tensor slot_mapping,
                 at::Tensor block_tables, at::Tensor seq_lens,
                 c10::optional<at::Tensor> lora_segments) {
    const c10::optional<at::Tensor>& seg = lora_segments;
    const int64_t T = x.size(0);
    at::Tensor residual;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& L = layers_[i];
      const int64_t q_size = L.H * L.D, kv_size = L.KVH * L.D;
      at::Tensor h;
      if (i == 0) {
        residual = x;
        h = rms_norm(x, L.input_norm, eps_);
      } else {
        fused_add_rms_norm(x, residual, L.input_norm, eps_);
        h = x;
      }
      at::Tensor qkv_out = linear(L.qkv, h, seg);
      if (L.qk_norm.has_value()) qkv_out = norm_and_clip(*L.qk_norm, qkv_out, L);
      const std::vector<at::Tensor> qkv = qkv_out.split({q_size + kv_size, kv_size}, -1);
      at::Tensor qk = qkv[0].view({T, L.H + L.KVH, L.D});
      if (L.cos.has_value()) rotary_embedding(qk, positions, *L.cos, *L.sin);
      const std::vector<at::Tensor> q_k = qk.split({L.H, L.KVH}, 1);
      L.k_cache.view({-1, L.KVH, L.D}).index_copy_(0, slot_mapping, q_k[1]);
      L.v_cache.view({-1, L.KVH, L.D}).index_copy_(0, slot_mapping, qkv[1].view({T, L.KVH, L.D}));
      const at::Tensor o = paged_decode_attention(q_k[0], L.k_cache, L.v_cache, block_tables,
                                                  seq_lens, L.scale, c10::nullopt, c10::nullopt,
                                                  L.window, L.softcap, 0);
      h = finish(L, linear(L.o, o.reshape({T, q_size}), seg), L.attn_output_norm);
      fused_add_rms_norm(h, residual, L.ffn_norm, eps_);
      if (L.moe.has_value()) {
        x = finish(L, moe(*L.moe, h, seg), L.ffn_output_norm);
        continue;
      }
      const std::vector<at::Tensor> gate_up = linear(L.gate_up, h, seg).chunk(2, -1);
      x = finish(L, linear(L.down, activate(gate_up[0], L.activation) * gate_up[1], seg),
                 L.ffn_output_norm);
    }
    fused_add_rms_norm(x, residual, final_norm_, eps_);
    return x;
  }

 private:
  // A sublayer's output as DecoderLayer._finish leaves it: normed, then scaled.
  at::Tensor finish(const Layer& L, at::Tensor h, const c10::optional<at::Tensor>& norm) const {
    if (norm.has_value()) h = rms_norm(h, *norm, eps_);
    if (L.residual_multiplier != 0.0) h = h * L.residual_multiplier;
    return h;
  }

  at::Tensor norm_and_clip(const QKNorm& N, const at::Tensor& qkv, const Layer& L) const {
    const int64_t q_size = L.H * L.D, kv_size = L.KVH * L.D;
    const std::vector<at::Tensor> parts = qkv.split({q_size, kv_size, kv_size}, -1);
    at::Tensor q, k;
    if (N.per_head) {
      q = rms_norm(parts[0].reshape({-1, L.D}), N.q_weight, eps_).view(parts[0].sizes());
      k = rms_norm(parts[1].reshape({-1, L.D}), N.k_weight, eps_).view(parts[1].sizes());
    } else {
      q = rms_norm(parts[0].contiguous(), N.q_weight, eps_);
      k = rms_norm(parts[1].contiguous(), N.k_weight, eps_);
    }
    at::Tensor out = at::cat({q, k, parts[2]}, -1);
    if (N.clip > 0) out.clamp_(-N.clip, N.clip);
    return out;
  }

  // SparseMoeBlock.forward: the chosen experts over their rows, then the shared expert.
  at::Tensor moe(const MoE& M, const at::Tensor& h, const c10::optional<at::Tensor>& seg) {
    const at::Tensor logits = linear(M.router, h, seg);
    const std::vector<at::Tensor> grouped = moe_group(h, logits, M.top_k, M.renormalize);
    const at::Tensor& xs = grouped[0];
    const at::Tensor counts = grouped[3];
    const int64_t* cp = counts.data_ptr<int64_t>();
    at::Tensor out = at::empty_like(xs);
    int64_t start = 0;
    for (int64_t e = 0; e < counts.size(0); ++e) {
      const int64_t n = cp[e];
      if (n == 0) continue;
      const at::Tensor rows = xs.narrow(0, start, n);
      const std::vector<at::Tensor> gate_up =
          (M.gate_up_linears.empty() ? dense(rows, M.w13[e], c10::nullopt, dense_small_rows_)
                                     : linear(M.gate_up_linears[e], rows, c10::nullopt))
              .chunk(2, -1);
      const at::Tensor act = at::silu(gate_up[0]) * gate_up[1];
      out.narrow(0, start, n).copy_(M.down_linears.empty()
                                        ? dense(act, M.w2[e], c10::nullopt, dense_small_rows_)
                                        : linear(M.down_linears[e], act, c10::nullopt));
      start += n;
    }
    at::Tensor y = moe_combine(out, grouped[1], grouped[2], h.size(0));
    if (M.shared_gate_up >= 0) {
      const std::vector<at::Tensor> gate_up = linear(M.shared_gate_up, h, seg).chunk(2, -1);
      const at::Tensor shared = linear(M.shared_down, at::silu(gate_up[0]) * gate_up[1], seg);
      y = y + at::sigmoid(linear(M.shared_gate, h, seg)) * shared;
    }
    return y;
  }

  // Linear i on x (with the step's LoRA segments, the loop's scratch and dense threshold).
  at::Tensor linear(int64_t i, const at::Tensor& x, const c10::optional<at::Tensor>& seg) {
    return linears_[i](x, seg, scratch_, dense_small_rows_);
  }

  double eps_;
  at::Tensor final_norm_;
  int64_t dense_small_rows_;
  at::Tensor scratch_;  // where a quantized weight is dequantized past its small rows
  std::vector<Linear> linears_;
  std::vector<Layer> layers_;
};

// The binding lives here with the class (module.cpp calls this).
#include <torch/extension.h>

void bind_decode_loop(py::module_& m) {
  py::enum_<LinearKind>(m, "LinearKind")
      .value("DENSE", kDense)          // small_gemm or oneDNN (bf16), F.linear (float32)
      .value("BLOCKS", kBlocks)        // quant_linear on GGUF blocks, or dequantized
      .value("PER_CHANNEL", kPerChannel)  // int8_linear_small or _large (w8a8)
      .value("STACKED", kStacked);        // pieces of other kinds, outputs side by side
  m.def("bucket_rows", &bucket_rows, "pagoda.ops.cpu.bucket_rows, as the loop pads rows");
  py::enum_<Activation>(m, "Activation").value("SILU", kSilu).value("GELU_TANH", kGeluTanh);
  py::class_<Linear>(m, "LinearSpec")
      .def(py::init([](LinearKind kind, at::Tensor w, c10::optional<at::Tensor> d,
                       c10::optional<at::Tensor> m, c10::optional<at::Tensor> qh,
                       c10::optional<at::Tensor> sc, int64_t format,
                       c10::optional<at::Tensor> bias, int64_t small_rows) {
             return Linear{kind, w, d, m, qh, sc, bias, format, small_rows, c10::nullopt};
           }),
           py::kw_only(), py::arg("kind"), py::arg("w"), py::arg("d") = py::none(),
           py::arg("m") = py::none(), py::arg("qh") = py::none(), py::arg("sc") = py::none(),
           py::arg("format") = 0,
           py::arg("bias") = py::none(), py::arg("small_rows") = 0)
      .def_static(
          "stacked",
          [](std::vector<Linear> parts) {
            TORCH_CHECK(!parts.empty(), "a stacked linear needs its parts");
            Linear stacked{kStacked, parts[0].w};  // (w unused: each part has its own)
            stacked.parts = std::move(parts);
            return stacked;
          },
          py::arg("parts"))
      .def_readonly("kind", &Linear::kind)
      .def_readonly("w", &Linear::w)
      .def_readonly("format", &Linear::format);
  py::class_<DecodeLoop>(m, "DecodeLoop")
      .def(py::init<double, at::Tensor, int64_t>(), py::arg("eps"), py::arg("final_norm"),
           py::arg("dense_small_rows"))
      .def("add_linear", &DecodeLoop::add_linear, py::arg("spec"))
      .def("set_lora", &DecodeLoop::set_lora, py::arg("linear"), py::arg("a"), py::arg("b"),
           py::arg("ranks"), py::arg("offsets"))
      .def("add_layer", &DecodeLoop::add_layer, py::arg("qkv"), py::arg("o"), py::arg("gate_up"),
           py::arg("down"), py::arg("input_norm"), py::arg("ffn_norm"), py::arg("k_cache"),
           py::arg("v_cache"), py::arg("num_heads"), py::arg("scale"), py::arg("window"),
           py::arg("softcap"), py::arg("activation"), py::arg("residual_multiplier"))
      .def("set_rope", &DecodeLoop::set_rope, py::arg("cos"), py::arg("sin"))
      .def("set_qk_norm", &DecodeLoop::set_qk_norm, py::arg("q_weight"), py::arg("k_weight"),
           py::arg("per_head"), py::arg("clip"))
      .def("set_output_norms", &DecodeLoop::set_output_norms, py::arg("attn_output_norm"),
           py::arg("ffn_output_norm"))
      .def("set_moe", &DecodeLoop::set_moe, py::arg("router"), py::arg("w13"), py::arg("w2"),
           py::arg("top_k"), py::arg("renormalize"), py::arg("shared_gate_up"),
           py::arg("shared_down"), py::arg("shared_gate"))
      .def("set_moe_experts", &DecodeLoop::set_moe_experts, py::arg("gate_up"), py::arg("down"))
      .def("run", &DecodeLoop::run, "The decode step's layers and final norm (x written over)",
           py::arg("x"), py::arg("positions"), py::arg("slot_mapping"), py::arg("block_tables"),
           py::arg("seq_lens"), py::arg("lora_segments") = py::none(),
           py::call_guard<py::gil_scoped_release>());
}
