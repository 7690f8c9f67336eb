// The decoder layers of a CPU decode step in one call: what runtime/models/llama.py does layer by
// layer in Python, here as a plain C++ loop over the same kernels.
//
// At batch 1 a decode step of a small model is many small ops: SmolLM2-135M has 30 layers of two
// RMSNorms, four matmuls, rotary, a K/V write and attention. Each op called from Python pays for
// the module call, argument parsing and the tensor wrappers; together that was about a third of
// the step. This loop calls the kernels of kernels/cpu_ops, cpu_attention and cpu_gemm directly
// (they are compiled into this library from their headers, with the same flags), in the order the
// Python code calls them and with the same arguments, so its output is the same to the bit.
//
// Per layer (residual stream SGLang style; h: [bs, hidden] of the model dtype):
//
//     h, residual = add_rms_norm(h, residual)        (first layer: residual = h; h = rms_norm(h))
//     q | k | v = qkv_proj(h)                        views into one [bs, (H + 2 KVH) D] output
//     q, k = rms_norm per head (Qwen3 only)          new tensors
//     rotary(q, k) in place; k_cache[loc] = k; v_cache[loc] = v
//                                                    (the first 2 * cos_cache.size(1) lanes of each head:
//                                                    partial rotary when that is below head_dim)
//     h = o_proj(paged_decode(q, k_cache, v_cache))
//     h, residual = add_rms_norm(h, residual)
//     h = down_proj(silu_and_mul(gate_up_proj(h)))   or, in a sparse layer (MoE), SparseMoeBlock's
//                                                    fused path (runtime/layers/moe.py): router gemm,
//                                                    fp32 softmax, top-k (renormalized if the model
//                                                    says so), kernels/cpu_moe's experts_forward, and
//                                                    Qwen2-MoE's shared expert times sigmoid(its gate)
//
// and after the last layer h = add_rms_norm(h, residual). A linear is radixlm's AVX512-BF16 gemm on
// a weight in its layout, oneDNN's packed matmul (mkldnn::_linear_pointwise, CPUs without
// AVX512-BF16) or at::linear on a dense weight, as runtime/layers/packed_linear.py calls them. A bias of a
// row-parallel layer (o_proj, down_proj) is added after the matmul, rounded separately, as
// RowParallelLinear does. One process, one tensor-parallel rank: no all-reduce.
#include <torch/extension.h>

#include <cstring>
#include <memory>
#include <tuple>
#include <vector>

#include "fused_ops.h"
#include "paged_attention.h"
#include "extend_brgemm.h"
#ifdef RADIXLM_WITH_QUANT
#include "quant.h"
#include "kquant.h"   // k-quants (Q4_K, Q5_K, Q6_K): same kind numbering, 100 + ggml type
#endif
#ifdef RADIXLM_WITH_GEMM
#include "gemm_silu.h"
#include "moe.h"
#endif

namespace radixlm_decoder {

enum LinearKind : int64_t { kDense = 0, kGemm = 1, kOneDnn = 2, kQuantParts = 3, kQuantBase = 100 };   // 100 + ggml type: cpu_quant

#ifdef RADIXLM_WITH_QUANT
// A weight kept quantized, of one ggml type, in cpu_quant's layout (quant.h or, for k-quants, kquant.h).
inline at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& w, int64_t type, int64_t out_features) {
  return radixlm_kquant::is_kquant(type) ? radixlm_kquant::linear(x, w, type, out_features)
                                         : radixlm_quant::linear(x, w, type, out_features);
}
#endif
using QuantParts = std::vector<std::tuple<at::Tensor, int64_t, int64_t>>;   // (packed, ggml type, rows)

// oneDNN's matmul on a weight packed by torch.ops.mkldnn._reorder_linear_weight
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
                                         c10::string_view, c10::List<c10::optional<c10::Scalar>>,
                                         c10::optional<c10::string_view>)>();
  return op.call(x, w, bias, "none", c10::List<c10::optional<c10::Scalar>>(), c10::string_view(""));
}

struct Linear {
  at::Tensor weight;      // in the layout `kind` names (dense: [out, in])
  at::Tensor bias;        // undefined when there is none
  int64_t out_features = 0;
  int64_t kind = kDense;
  bool bias_after = false;
  QuantParts parts;       // kQuantParts: row ranges of different ggml types (Q4_K_M's qkv), outputs joined

  at::Tensor operator()(const at::Tensor& x) const {
    const c10::optional<at::Tensor> b = bias.defined() && !bias_after ? c10::optional<at::Tensor>(bias) : c10::nullopt;
    at::Tensor y;
    if (kind == kGemm) {
#ifdef RADIXLM_WITH_GEMM
      y = radixlm_gemm::linear(x, weight, out_features, b);
#endif
    } else if (kind >= kQuantBase) {
#ifdef RADIXLM_WITH_QUANT
      y = quant_linear(x, weight, kind - kQuantBase, out_features);
      if (b.has_value()) y = at::add(y, *b);
#endif
    } else if (kind == kQuantParts) {
#ifdef RADIXLM_WITH_QUANT
      std::vector<at::Tensor> outs;
      for (const auto& [w, type, rows] : parts) outs.push_back(quant_linear(x, w, type, rows));
      y = at::cat(outs, -1);     // as runtime/layers/quant_linear.py joins them
      if (b.has_value()) y = at::add(y, *b);
#endif
    } else if (kind == kOneDnn) {
      y = onednn_linear(x, weight, b);
    } else {
      y = at::linear(x, weight, b);
    }
    return bias.defined() && bias_after ? at::add(y, bias) : y;
  }
};

// silu(gate) * up of the gate_up projection: in one pass from the gemm layout where the halves are
// whole 64-row blocks (gemm_silu.h, the same bits), else the projection then silu_and_mul.
at::Tensor silu_mlp_half(const Linear& gate_up, const at::Tensor& h) {
#ifdef RADIXLM_WITH_GEMM
  if (gate_up.kind == kGemm && !gate_up.bias.defined() && gate_up.out_features % (2 * radixlm_gemm::kBlock) == 0)
    return radixlm_gemm::linear_silu_mul(h, gate_up.weight, gate_up.out_features / 2);
#endif
  const at::Tensor y = gate_up(h);
  at::Tensor act = at::empty({h.size(0), y.size(1) / 2}, h.options());
  radixlm_ops::silu_and_mul(act, y);
  return act;
}

// weight, bias, out, kind, quantized parts (kind kQuantParts; else empty)
using LinearArgs = std::tuple<at::Tensor, c10::optional<at::Tensor>, int64_t, int64_t, QuantParts>;
Linear make_linear(const LinearArgs& a, bool bias_after);

// router weight [E, hidden] in the gemm layout, top_k, renormalize, gate_up / down pointer tables
// (int64 [E], into the packed arena; see kernels/cpu_moe), intermediate size, the tensors those
// pointers point into (kept alive here), and Qwen2-MoE's shared expert: gate_up, down, gate weight
// [1, hidden] (all or none)
using MoeArgs = std::tuple<at::Tensor, int64_t, bool, at::Tensor, at::Tensor, int64_t, std::vector<at::Tensor>,
                           c10::optional<LinearArgs>, c10::optional<LinearArgs>, c10::optional<at::Tensor>>;

// The sparse MLP, as SparseMoeBlock.forward's fused path and _add_shared_and_reduce run it (same ops,
// same order, so the same bits).
struct Moe {
  at::Tensor router, gate_up_ptrs, down_ptrs, shared_gate;   // shared_gate undefined: no shared expert
  int64_t top_k = 0, inter = 0;
  bool renormalize = false;
  std::vector<at::Tensor> keep;
  Linear shared_gate_up, shared_down;

  explicit Moe(const MoeArgs& a)
      : router(std::get<0>(a)), gate_up_ptrs(std::get<3>(a)), down_ptrs(std::get<4>(a)), top_k(std::get<1>(a)),
        inter(std::get<5>(a)), renormalize(std::get<2>(a)), keep(std::get<6>(a)) {
#ifndef RADIXLM_WITH_GEMM
    TORCH_CHECK(false, "cpu_decoder: built without the gemm kernel, so MoE layers are not supported");
#endif
    TORCH_CHECK(gate_up_ptrs.numel() == down_ptrs.numel(), "cpu_decoder: the expert pointer tables differ in size");
    const bool shared = std::get<7>(a).has_value();
    TORCH_CHECK(shared == std::get<8>(a).has_value() && shared == std::get<9>(a).has_value(),
                "cpu_decoder: a shared expert needs its gate_up, down and gate");
    if (shared) {
      shared_gate_up = make_linear(*std::get<7>(a), false);
      shared_down = make_linear(*std::get<8>(a), true);
      shared_gate = *std::get<9>(a);
    }
  }

  at::Tensor operator()(const at::Tensor& x) const {
    at::Tensor out;
#ifdef RADIXLM_WITH_GEMM
    const at::Tensor logits = radixlm_gemm::linear(x, router, gate_up_ptrs.numel(), c10::nullopt);
    const at::Tensor probs = at::softmax(logits, -1, at::kFloat);   // moe.py's route()
    auto [weights, ids] = at::topk(probs, top_k, -1);
    if (renormalize) weights = weights / weights.sum(-1, true);
    out = radixlm_moe::experts_forward(x, ids.contiguous(), weights.contiguous(), gate_up_ptrs, down_ptrs, inter);
    if (shared_gate.defined()) {
      const at::Tensor gate = at::sigmoid(at::linear(x, shared_gate).to(at::kFloat));
      out += (shared_down(silu_mlp_half(shared_gate_up, x)).to(at::kFloat) * gate).to(x.scalar_type());
    }
#endif
    return out;
  }
};

struct Layer {
  at::Tensor input_norm, post_norm, q_norm, k_norm;   // q_norm/k_norm undefined unless per-head norms
  Linear qkv, o, gate_up, down;                       // gate_up/down unset in a sparse layer
  std::shared_ptr<Moe> moe;                           // null in a dense layer
  at::Tensor k_cache, v_cache;                        // [slots, KVH, D]
};

Linear make_linear(const LinearArgs& a, bool bias_after) {
  Linear l;
  l.weight = std::get<0>(a);
  if (std::get<1>(a).has_value()) l.bias = *std::get<1>(a);
  l.out_features = std::get<2>(a);
  l.kind = std::get<3>(a);
  l.bias_after = bias_after;
  l.parts = std::get<4>(a);
  TORCH_CHECK((l.kind == kQuantParts) == !l.parts.empty(), "cpu_decoder: quantized parts go with kind 3 only");
  TORCH_CHECK(l.kind == kDense || l.kind == kGemm || l.kind == kOneDnn || l.kind == kQuantParts || l.kind > kQuantBase,
              "cpu_decoder: unknown linear kind ", l.kind);
#ifndef RADIXLM_WITH_QUANT
  TORCH_CHECK(l.kind < kQuantBase && l.kind != kQuantParts, "cpu_decoder: built without the quantized kernel, so GGUF weights are not supported");
#endif
#ifndef RADIXLM_WITH_GEMM
  TORCH_CHECK(l.kind != kGemm, "cpu_decoder: built without the gemm kernel, so its layout is not supported");
#endif
  return l;
}

// k [bs, KVH*D] rows (last dim contiguous, any row stride) -> cache rows loc[b] ([slots, KVH, D] contiguous)
void write_kv(at::Tensor& cache, const at::Tensor& x, const int64_t* loc, int64_t bs) {
  const int64_t row_elems = cache.size(1) * cache.size(2), slots = cache.size(0);
  const int64_t bytes = row_elems * cache.element_size();
  auto* dst = static_cast<char*>(cache.data_ptr());
  const auto* src = static_cast<const char*>(x.data_ptr());
  const int64_t src_stride = x.stride(0) * x.element_size();
  for (int64_t b = 0; b < bs; ++b) {
    TORCH_CHECK(loc[b] >= 0 && loc[b] < slots, "cpu_decoder: KV slot ", loc[b], " out of range [0, ", slots, ")");
    std::memcpy(dst + loc[b] * bytes, src + b * src_stride, bytes);
  }
}

// One run of an extend pass (Decoder::extend): requests whose tokens are rows [q0, q1) of the pass.
struct ExtendRun {
  int64_t kernel, q0, q1;
  at::Tensor rows, seq_lens, prefix_lens;
  c10::optional<at::Tensor> qo_indptr;
};

class Decoder {
 public:
  Decoder(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps, double scaling, at::Tensor cos_cache,
          at::Tensor sin_cache, at::Tensor final_norm)
      : H_(num_heads), KVH_(num_kv_heads), D_(head_dim), eps_(eps), scaling_(scaling),
        cos_(std::move(cos_cache)), sin_(std::move(sin_cache)), final_norm_(std::move(final_norm)) {}

  void add_layer(at::Tensor input_norm, at::Tensor post_norm, c10::optional<at::Tensor> q_norm,
                 c10::optional<at::Tensor> k_norm, const LinearArgs& qkv, const LinearArgs& o,
                 const LinearArgs& gate_up, const LinearArgs& down, at::Tensor k_cache, at::Tensor v_cache) {
    Linear gate_up_l = make_linear(gate_up, false), down_l = make_linear(down, true);
    Layer& l = add_attention(std::move(input_norm), std::move(post_norm), std::move(q_norm), std::move(k_norm), qkv,
                             o, std::move(k_cache), std::move(v_cache));
    l.gate_up = std::move(gate_up_l);
    l.down = std::move(down_l);
  }

  // A layer whose MLP is a mixture of experts (MoeArgs).
  void add_moe_layer(at::Tensor input_norm, at::Tensor post_norm, c10::optional<at::Tensor> q_norm,
                     c10::optional<at::Tensor> k_norm, const LinearArgs& qkv, const LinearArgs& o, const MoeArgs& moe,
                     at::Tensor k_cache, at::Tensor v_cache) {
    auto sparse = std::make_shared<Moe>(moe);
    add_attention(std::move(input_norm), std::move(post_norm), std::move(q_norm), std::move(k_norm), qkv, o,
                  std::move(k_cache), std::move(v_cache)).moe = std::move(sparse);
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // hidden [bs, hidden] (the embeddings; used as the first residual), positions / out_cache_loc /
  // rows (req_to_token rows) / seq_lens: int64 [bs]. Writes each layer's K/V at out_cache_loc and
  // returns the final-normed hidden states [bs, hidden].
  at::Tensor forward(at::Tensor hidden, const at::Tensor& positions, const at::Tensor& out_cache_loc,
                     const at::Tensor& req_to_token, const at::Tensor& rows, const at::Tensor& seq_lens) {
    return forward_split(std::move(hidden), positions, out_cache_loc, req_to_token, rows, seq_lens, 1);
  }

  // forward() with the batch cut into `parts` runs of consecutive requests, each taken through every
  // layer by one thread alone: its kernels run serially inside this parallel region, so the step has
  // no barrier between ops (about ten per layer otherwise). Where SmolLM2's small matmuls made those
  // barriers count this was 6-11% faster at batch 32-64 on a 2-core Zen 4; with long contexts (the
  // memory-bound attention streams slower from one thread) or larger models it is not, so the caller
  // times both (runtime/model_executor/cpu_decoder.py). Same bits as forward(): a row's gemm and
  // attention do not depend on the rows beside it (the batch-invariance tests).
  at::Tensor forward_split(at::Tensor hidden, const at::Tensor& positions, const at::Tensor& out_cache_loc,
                           const at::Tensor& req_to_token, const at::Tensor& rows, const at::Tensor& seq_lens,
                           int64_t parts) {
    const int64_t bs = hidden.size(0);
    TORCH_CHECK(parts >= 1, "cpu_decoder: forward_split needs parts >= 1");
    TORCH_CHECK(rows.scalar_type() == at::kLong && rows.is_contiguous() && rows.numel() == bs &&
                    seq_lens.scalar_type() == at::kLong && seq_lens.is_contiguous() && seq_lens.numel() == bs,
                "cpu_decoder: rows and seq_lens must be contiguous int64 [bs]");
    parts = std::min(parts, bs);
    if (parts <= 1) return decode_layers(hidden, positions, out_cache_loc, req_to_token, rows, seq_lens);
    std::vector<at::Tensor> outs(parts);
    at::parallel_for(0, parts, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t r0 = bs * p / parts, n = bs * (p + 1) / parts - r0;
        outs[p] = decode_layers(hidden.narrow(0, r0, n), positions.narrow(0, r0, n), out_cache_loc.narrow(0, r0, n),
                                req_to_token, rows.narrow(0, r0, n), seq_lens.narrow(0, r0, n));
      }
    });
    return at::cat(outs);
  }

  // A prefill / extend / mixed pass: hidden [n, hidden] for all n new tokens, positions and
  // out_cache_loc int64 [n], and the pass cut into runs as the attention backend cuts it
  // (runtime/layers/attention/torch_native.py, _Run): each run is (kernel: 0 decode, 1 the
  // AVX512/AVX2 extend, 2 the brgemm extend; q0, q1: its token rows; rows, seq_lens, prefix_lens;
  // qo_indptr from 0, or None for decode), the runs covering [0, n) in order. Per layer each run's
  // attention is the call the backend makes for it; everything else is forward()'s sequence.
  // output_rows (int64 [m], or None for all n): the rows returned, in this order; the last layer's
  // o_proj, norm and MLP run on them alone (ForwardBatch.output_rows).
  at::Tensor extend(at::Tensor hidden, const at::Tensor& positions, const at::Tensor& out_cache_loc,
                    const at::Tensor& req_to_token, const std::vector<ExtendRun>& runs,
                    const c10::optional<at::Tensor>& output_rows) {
    int64_t next = 0;
    for (const ExtendRun& r : runs) {
      TORCH_CHECK(r.q0 == next && r.q1 >= r.q0 && r.kernel >= 0 && r.kernel <= 2,
                  "cpu_decoder: extend runs must cover the tokens in order, with kernel 0, 1 or 2");
      TORCH_CHECK(r.kernel == 0 || r.qo_indptr.has_value(), "cpu_decoder: an extend run needs its qo_indptr");
      next = r.q1;
    }
    TORCH_CHECK(next == hidden.size(0), "cpu_decoder: the extend runs cover ", next, " of ", hidden.size(0), " tokens");
    const at::Tensor keep = output_rows.has_value() ? *output_rows : at::Tensor();   // index_select checks it
    return run_layers(hidden, positions, out_cache_loc, keep, [&](at::Tensor& attn, const at::Tensor& q, Layer& L) {
      for (const ExtendRun& r : runs) {
        at::Tensor o = attn.narrow(0, r.q0, r.q1 - r.q0);
        const at::Tensor qr = q.narrow(0, r.q0, r.q1 - r.q0);
        if (r.kernel == 0)
          radixlm_attn::decode(o, qr, L.k_cache, L.v_cache, req_to_token, r.rows, r.seq_lens, scaling_, 0);
        else if (r.kernel == 1)
          radixlm_attn::extend(o, qr, L.k_cache, L.v_cache, req_to_token, r.rows, r.prefix_lens, r.seq_lens,
                               *r.qo_indptr, scaling_);
        else
          radixlm_attn::extend_brgemm(o, qr, L.k_cache, L.v_cache, req_to_token, r.rows, r.prefix_lens, r.seq_lens,
                                      *r.qo_indptr, scaling_);
      }
    });
  }

 private:
  // The layer loop over decode rows (one token per request): forward_split's body, for all rows or a part.
  at::Tensor decode_layers(at::Tensor hidden, const at::Tensor& positions, const at::Tensor& out_cache_loc,
                           const at::Tensor& req_to_token, const at::Tensor& rows, const at::Tensor& seq_lens) {
    return run_layers(std::move(hidden), positions, out_cache_loc, at::Tensor(),
                      [&](at::Tensor& attn, const at::Tensor& q, Layer& L) {
      radixlm_attn::decode(attn, q, L.k_cache, L.v_cache, req_to_token, rows, seq_lens, scaling_, 0);
    });
  }

  // The layer loop of forward() and extend(); attend(attn, q, layer) fills attn [n, H, D] from
  // q [n, H, D] over the layer's K/V caches (this token's K/V already written). With `keep` defined
  // the last layer continues after attention with those rows only.
  template <typename Attend>
  at::Tensor run_layers(at::Tensor hidden, const at::Tensor& positions, const at::Tensor& out_cache_loc,
                        const at::Tensor& keep, Attend&& attend) {
    const int64_t bs = hidden.size(0);
    TORCH_CHECK(!layers_.empty(), "cpu_decoder: no layers added");
    TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "cpu_decoder: hidden must be contiguous [n, hidden]");
    for (const at::Tensor* t : {&positions, &out_cache_loc})
      TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->numel() == bs,
                  "cpu_decoder: positions and out_cache_loc must be contiguous int64 [n]");
    const int64_t* loc = out_cache_loc.data_ptr<int64_t>();
    const int64_t q_size = H_ * D_, kv_size = KVH_ * D_;
    at::Tensor h = hidden, residual;
    for (size_t i = 0; i < layers_.size(); ++i) {
      Layer& L = layers_[i];
      if (i == 0) {
        residual = h;
        h = at::empty_like(residual);
        radixlm_ops::rms_norm(h, residual, L.input_norm, eps_);
      } else {
        radixlm_ops::fused_add_rms_norm(h, residual, L.input_norm, eps_);
      }
      const at::Tensor qkv = L.qkv(h);
      at::Tensor q = qkv.narrow(1, 0, q_size), k = qkv.narrow(1, q_size, kv_size);
      const at::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size);
      if (L.q_norm.defined()) {
        q = head_norm(q, H_, L.q_norm);
        k = head_norm(k, KVH_, L.k_norm);
      }
      radixlm_ops::rotary_embedding(positions, q, k, cos_, sin_, D_);
      write_kv(L.k_cache, k, loc, bs);
      write_kv(L.v_cache, v, loc, bs);
      at::Tensor attn = at::empty({bs, H_, D_}, h.options());
      attend(attn, q.view({bs, H_, D_}), L);
      if (keep.defined() && i + 1 == layers_.size()) {
        attn = attn.index_select(0, keep);
        residual = residual.index_select(0, keep);
      }
      h = L.o(attn.view({attn.size(0), q_size}));
      radixlm_ops::fused_add_rms_norm(h, residual, L.post_norm, eps_);
      h = L.moe ? (*L.moe)(h) : L.down(silu_mlp_half(L.gate_up, h));
    }
    radixlm_ops::fused_add_rms_norm(h, residual, final_norm_, eps_);
    return h;
  }

  // A new layer with its norms, attention and K/V caches (its MLP left to the caller).
  Layer& add_attention(at::Tensor input_norm, at::Tensor post_norm, c10::optional<at::Tensor> q_norm,
                       c10::optional<at::Tensor> k_norm, const LinearArgs& qkv, const LinearArgs& o,
                       at::Tensor k_cache, at::Tensor v_cache) {
    TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 3 &&
                    k_cache.size(1) == KVH_ && k_cache.size(2) == D_ && v_cache.sizes() == k_cache.sizes(),
                "cpu_decoder: K/V caches must be contiguous [slots, kv_heads, head_dim]");
    TORCH_CHECK(std::get<2>(qkv) == (H_ + 2 * KVH_) * D_, "cpu_decoder: qkv_proj has the wrong output size");
    Layer l;
    l.input_norm = std::move(input_norm);
    l.post_norm = std::move(post_norm);
    if (q_norm.has_value()) l.q_norm = *q_norm;
    if (k_norm.has_value()) l.k_norm = *k_norm;
    l.qkv = make_linear(qkv, false);
    l.o = make_linear(o, true);
    l.k_cache = std::move(k_cache);
    l.v_cache = std::move(v_cache);
    layers_.push_back(std::move(l));
    return layers_.back();
  }

  // RMSNorm over each head of x [bs, heads*D] -> a new contiguous [bs, heads*D]
  at::Tensor head_norm(const at::Tensor& x, int64_t heads, const at::Tensor& weight) const {
    at::Tensor out = at::empty({x.size(0), heads, D_}, x.options());
    radixlm_ops::rms_norm(out, x.view({x.size(0), heads, D_}), weight, eps_);
    return out.view({x.size(0), heads * D_});
  }

  int64_t H_, KVH_, D_;
  double eps_, scaling_;
  at::Tensor cos_, sin_, final_norm_;
  std::vector<Layer> layers_;
};

}  // namespace radixlm_decoder

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  py::class_<radixlm_decoder::ExtendRun>(m, "ExtendRun")
      .def(py::init([](int64_t kernel, int64_t q0, int64_t q1, at::Tensor rows, at::Tensor seq_lens,
                       at::Tensor prefix_lens, c10::optional<at::Tensor> qo_indptr) {
             return radixlm_decoder::ExtendRun{kernel, q0, q1, rows, seq_lens, prefix_lens, qo_indptr};
           }),
           "ExtendRun(kernel, q0, q1, rows, seq_lens, prefix_lens, qo_indptr|None): int64 tensors on CPU");
  py::class_<radixlm_decoder::Decoder>(m, "Decoder")
      .def(py::init<int64_t, int64_t, int64_t, double, double, at::Tensor, at::Tensor, at::Tensor>(),
           "Decoder(num_heads, num_kv_heads, head_dim, eps, scaling, cos_cache, sin_cache, final_norm)")
      .def("add_layer", &radixlm_decoder::Decoder::add_layer,
           "add_layer(input_norm, post_norm, q_norm|None, k_norm|None, qkv, o, gate_up, down, k_cache, v_cache); "
           "each linear is (weight, bias|None, out_features, kind: 0 dense, 1 gemm layout, 2 oneDNN packed, "
           "3 quantized parts, 100 + ggml type: cpu_quant's layout; parts: [(packed, ggml type, rows)] for kind 3)")
      .def("add_moe_layer", &radixlm_decoder::Decoder::add_moe_layer,
           "add_moe_layer(input_norm, post_norm, q_norm|None, k_norm|None, qkv, o, moe, k_cache, v_cache); moe: "
           "(router weight packed in the gemm layout, top_k, renormalize, gate_up_ptrs [E], down_ptrs [E], "
           "intermediate, [tensors the pointers point into], shared gate_up|None, shared down|None, "
           "shared gate weight|None)")
      .def("forward", &radixlm_decoder::Decoder::forward, py::call_guard<py::gil_scoped_release>(),
           "forward(hidden, positions, out_cache_loc, req_to_token, rows, seq_lens) -> final-normed hidden")
      .def("forward_split", &radixlm_decoder::Decoder::forward_split, py::call_guard<py::gil_scoped_release>(),
           "forward_split(hidden, positions, out_cache_loc, req_to_token, rows, seq_lens, parts) -> forward()'s "
           "result, the batch cut into `parts` runs of requests, each through every layer on one thread")
      .def("extend", &radixlm_decoder::Decoder::extend, py::arg("hidden"), py::arg("positions"),
           py::arg("out_cache_loc"), py::arg("req_to_token"), py::arg("runs"), py::arg("output_rows") = py::none(),
           py::call_guard<py::gil_scoped_release>(),
           "extend(hidden [n, hidden], positions, out_cache_loc, req_to_token, runs, output_rows=None) -> "
           "final-normed hidden [n] (or [m]: the rows output_rows, int64 [m], whose last layer's o_proj and MLP "
           "run alone); "
           "runs: [ExtendRun(kernel 0 decode | 1 extend | 2 extend_brgemm, q0, q1, rows, seq_lens, prefix_lens, "
           "qo_indptr|None)] covering the tokens in order")
      .def_property_readonly("num_layers", &radixlm_decoder::Decoder::num_layers);
#ifdef RADIXLM_WITH_QUANT
  m.attr("with_quant") = true;
#else
  m.attr("with_quant") = false;
#endif
#ifdef RADIXLM_WITH_GEMM
  m.attr("with_gemm") = true;
#else
  m.attr("with_gemm") = false;
#endif
}
