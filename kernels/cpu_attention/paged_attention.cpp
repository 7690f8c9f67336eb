// Paged attention on CPU, reading K/V in place through the req->token table.
//
// Layout (see runtime/mem_cache/memory_pool.py):
//   k_buf, v_buf   [num_slots, kv_heads, head_dim]     (fp32 or bf16; last dim contiguous)
//   req_to_token   [rows, context_len] int32           slot of token j of the request in `row`
//   q, out         [num_tokens, heads, head_dim]        (fp32 or bf16; out has q's dtype)
//
// Request b owns table row rows[b]; its keys are tokens [0, seq_lens[b]). In extend, its queries
// are q[qo_indptr[b] : qo_indptr[b+1]], the tokens [prefix_lens[b], seq_lens[b]), and query i
// (position prefix_len + i) attends keys [0, prefix_len + i]. Decode is one query per request at
// position seq_len - 1.
//
// GQA: the G = heads / kv_heads query heads of a kv head are processed together, so each K/V
// row is read once for all of them. Math is fp32 with an online softmax over key blocks of kBlk.
// Work is split over (request, kv head, kv split) for decode, (request, kv head, query block)
// for extend, on torch's intra-op threads; decode splits combine by log-sum-exp.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "simd.h"

namespace radixlm_cpu {
namespace {

constexpr int kMaxGroup = 16;   // query heads per kv head
constexpr int kBlk = 32;        // keys per online-softmax block (a multiple of every fvec::N)
constexpr int kExtendQVecs = 64;  // query vectors (rows x group heads) per extend task
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
using bf16 = c10::BFloat16;

struct Args {
  void* out;
  const void* q;
  const void* k;
  const void* v;
  int64_t q_s0, q_s1, o_s0, o_s1, k_s0, k_s1, v_s0, v_s1;
  const int32_t* table;
  int64_t table_s0;
  const int64_t* rows;
  const int64_t* seq_lens;
  const int64_t* prefix_lens;   // extend only
  const int64_t* qo_indptr;     // extend only
  int64_t bs, H, KVH, G, S;     // S: kv splits (decode)
  float scale;
  bool q_bf16;
  float* part_o;                // [bs, H, S, D] when S > 1
  float* part_lse;              // [bs, H, S]
};

inline void load_q(float* dst, const void* src, bool is_bf16, int D, float scale) {
  if (is_bf16) {
    auto p = static_cast<const bf16*>(src);
    for (int d = 0; d < D; ++d) dst[d] = static_cast<float>(p[d]) * scale;
  } else {
    auto p = static_cast<const float*>(src);
    for (int d = 0; d < D; ++d) dst[d] = p[d] * scale;
  }
}

inline void store_out(void* dst, const float* src, bool is_bf16, int D, float mul) {
  if (is_bf16) {
    auto p = static_cast<bf16*>(dst);
    for (int d = 0; d < D; ++d) p[d] = static_cast<bf16>(src[d] * mul);
  } else {
    auto p = static_cast<float*>(dst);
    for (int d = 0; d < D; ++d) p[d] = src[d] * mul;
  }
}

// One key block for one query vector: s[0, n) are scores (-inf where masked). Rewrites s as
// exp(s - m_new), updates the running max m and sum l, and returns the factor for the old acc.
inline float softmax_block(float* s, int n, float& m, float& l) {
  float bm = kNegInf;
  for (int t = 0; t < n; ++t) bm = std::max(bm, s[t]);
  if (bm == kNegInf) {          // fully masked block: contributes nothing
    for (int t = 0; t < n; ++t) s[t] = 0.f;
    return 1.f;
  }
  const float mn = std::max(m, bm);
  const float alpha = (m == kNegInf) ? 0.f : std::exp(m - mn);
  const fvec mv = fvec::set1(mn);
  for (int t = 0; t < n; t += fvec::N) vexp(fvec::load(s + t) - mv).store(s + t);
  float sum = 0.f;
  for (int t = 0; t < n; ++t) sum += s[t];
  l = l * alpha + sum;
  m = mn;
  return alpha;
}

// acc[0, D) = acc * alpha + sum_t p[t] * vf[t, :]
template <int D>
inline void pv_accum(float* acc, float alpha, const float* p, const float* vf, int n) {
  constexpr int NV = D / fvec::N;
  fvec a[NV];
  const fvec al = fvec::set1(alpha);
  for (int i = 0; i < NV; ++i) a[i] = fvec::load(acc + i * fvec::N) * al;
  for (int t = 0; t < n; ++t) {
    const fvec pt = fvec::set1(p[t]);
    const float* vr = vf + t * D;
    for (int i = 0; i < NV; ++i) a[i] = fmadd(pt, fvec::load(vr + i * fvec::N), a[i]);
  }
  for (int i = 0; i < NV; ++i) a[i].store(acc + i * fvec::N);
}

// vf[t, :] = float(V row of slots[t]) for t < n: a block-local staging of at most kBlk rows.
template <int D, typename kv_t>
inline void load_v_block(float* vf, const kv_t* v, const int32_t* slots, int n, int64_t s0, int64_t off) {
  for (int t = 0; t < n; ++t) {
    const kv_t* r = v + static_cast<int64_t>(slots[t]) * s0 + off;
    for (int i = 0; i < D / fvec::N; ++i) fvec::load(r + i * fvec::N).store(vf + t * D + i * fvec::N);
  }
}

// s[qv * kBlk + t] = qf[qv] . K[slot t] for the query vectors qv in [qv_first, nq)
template <int D, typename kv_t>
inline void qk_row(float* s, const float* qf, const kv_t* kr_ptr, int qv_first, int nq, int t) {
  constexpr int NV = D / fvec::N;
  fvec kr[NV];
  for (int i = 0; i < NV; ++i) kr[i] = fvec::load(kr_ptr + i * fvec::N);
  for (int qv = qv_first; qv < nq; ++qv) {
    const float* qp = qf + qv * D;
    fvec a = fvec::zero();
    for (int i = 0; i < NV; ++i) a = fmadd(fvec::load(qp + i * fvec::N), kr[i], a);
    s[qv * kBlk + t] = a.sum();
  }
}

struct Scratch {
  std::vector<float> qf, acc, s, vf, m, l, alpha;
  Scratch(int nq, int D) : qf(nq * D), acc(nq * D), s(nq * kBlk), vf(kBlk * D), m(nq), l(nq), alpha(nq) {}
  void reset(int nq, int D) {
    std::fill(acc.begin(), acc.begin() + nq * D, 0.f);
    std::fill(m.begin(), m.begin() + nq, kNegInf);
    std::fill(l.begin(), l.begin() + nq, 0.f);
  }
};

// ----------------------------------------------------------------------------------- decode
template <typename kv_t, int D>
void decode_kernel(const Args& a) {
  const auto* k = static_cast<const kv_t*>(a.k);
  const auto* v = static_cast<const kv_t*>(a.v);
  const int G = static_cast<int>(a.G);
  at::parallel_for(0, a.bs * a.KVH * a.S, 1, [&](int64_t begin, int64_t end) {
    Scratch w(G, D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / (a.KVH * a.S), kvh = (task / a.S) % a.KVH, sp = task % a.S;
      const int64_t L = a.seq_lens[b];
      const int64_t chunk = (L + a.S - 1) / a.S;
      const int64_t j_begin = std::min(L, sp * chunk), j_end = std::min(L, j_begin + chunk);
      const int32_t* tok = a.table + a.rows[b] * a.table_s0;
      const auto* qb = static_cast<const char*>(a.q);
      const int64_t qsz = a.q_bf16 ? 2 : 4;
      for (int g = 0; g < G; ++g)
        load_q(w.qf.data() + g * D, qb + (b * a.q_s0 + (kvh * G + g) * a.q_s1) * qsz, a.q_bf16, D, a.scale);
      w.reset(G, D);
      for (int64_t j0 = j_begin; j0 < j_end; j0 += kBlk) {
        const int n = static_cast<int>(std::min<int64_t>(kBlk, j_end - j0));
        for (int t = 0; t < n; ++t)
          qk_row<D>(w.s.data(), w.qf.data(), k + static_cast<int64_t>(tok[j0 + t]) * a.k_s0 + kvh * a.k_s1, 0, G, t);
        for (int g = 0; g < G; ++g) w.alpha[g] = softmax_block(w.s.data() + g * kBlk, n, w.m[g], w.l[g]);
        load_v_block<D>(w.vf.data(), v, tok + j0, n, a.v_s0, kvh * a.v_s1);
        for (int g = 0; g < G; ++g)
          pv_accum<D>(w.acc.data() + g * D, w.alpha[g], w.s.data() + g * kBlk, w.vf.data(), n);
      }
      for (int g = 0; g < G; ++g) {
        const int64_t h = kvh * G + g;
        const float inv = w.l[g] > 0.f ? 1.f / w.l[g] : 0.f;
        if (a.S == 1) {
          store_out(static_cast<char*>(a.out) + (b * a.o_s0 + h * a.o_s1) * qsz, w.acc.data() + g * D, a.q_bf16, D, inv);
        } else {
          const int64_t idx = (b * a.H + h) * a.S + sp;
          store_out(a.part_o + idx * D, w.acc.data() + g * D, false, D, inv);
          a.part_lse[idx] = w.l[g] > 0.f ? w.m[g] + std::log(w.l[g]) : kNegInf;
        }
      }
    }
  });
}

// out[b, h] = sum_s exp(lse_s - M) o_s / sum_s exp(lse_s - M)
void combine_splits(const Args& a, int D) {
  at::parallel_for(0, a.bs * a.H, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> o(D), wts(a.S);
    const int64_t qsz = a.q_bf16 ? 2 : 4;
    for (int64_t bh = begin; bh < end; ++bh) {
      const float* lse = a.part_lse + bh * a.S;
      float M = kNegInf;
      for (int64_t s = 0; s < a.S; ++s) M = std::max(M, lse[s]);
      float total = 0.f;
      for (int64_t s = 0; s < a.S; ++s) total += (wts[s] = (M == kNegInf) ? 0.f : std::exp(lse[s] - M));
      std::fill(o.begin(), o.end(), 0.f);
      for (int64_t s = 0; s < a.S; ++s) {
        if (wts[s] == 0.f) continue;
        const float* po = a.part_o + (bh * a.S + s) * D;
        for (int d = 0; d < D; ++d) o[d] += wts[s] * po[d];
      }
      const int64_t b = bh / a.H, h = bh % a.H;
      store_out(static_cast<char*>(a.out) + (b * a.o_s0 + h * a.o_s1) * qsz, o.data(), a.q_bf16, D,
                total > 0.f ? 1.f / total : 0.f);
    }
  });
}

// ----------------------------------------------------------------------------------- extend
template <typename kv_t, int D>
void extend_kernel(const Args& a) {
  const auto* k = static_cast<const kv_t*>(a.k);
  const auto* v = static_cast<const kv_t*>(a.v);
  const int G = static_cast<int>(a.G);
  const int BQ = std::max(1, kExtendQVecs / G);   // query rows per task
  std::vector<std::pair<int64_t, int64_t>> blocks;  // (request, first query row)
  for (int64_t b = 0; b < a.bs; ++b)
    for (int64_t i0 = 0; i0 < a.qo_indptr[b + 1] - a.qo_indptr[b]; i0 += BQ) blocks.emplace_back(b, i0);
  const int64_t nblocks = static_cast<int64_t>(blocks.size());
  at::parallel_for(0, nblocks * a.KVH, 1, [&](int64_t begin, int64_t end) {
    Scratch w(BQ * G, D);
    const int64_t qsz = a.q_bf16 ? 2 : 4;
    for (int64_t task = begin; task < end; ++task) {
      const auto [b, i0] = blocks[task / a.KVH];
      const int64_t kvh = task % a.KVH;
      const int64_t ext = a.qo_indptr[b + 1] - a.qo_indptr[b], p = a.prefix_lens[b];
      const int nr = static_cast<int>(std::min<int64_t>(BQ, ext - i0)), nq = nr * G;
      const int32_t* tok = a.table + a.rows[b] * a.table_s0;
      const auto* qb = static_cast<const char*>(a.q);
      for (int r = 0; r < nr; ++r)
        for (int g = 0; g < G; ++g)
          load_q(w.qf.data() + (r * G + g) * D, qb + ((a.qo_indptr[b] + i0 + r) * a.q_s0 + (kvh * G + g) * a.q_s1) * qsz,
                 a.q_bf16, D, a.scale);
      w.reset(nq, D);
      // keys [0, p + i0 + nr): query row r (position p + i0 + r) sees keys j <= p + i0 + r
      const int64_t k_end = p + i0 + nr;
      for (int64_t j0 = 0; j0 < k_end; j0 += kBlk) {
        const int n = static_cast<int>(std::min<int64_t>(kBlk, k_end - j0));
        for (int t = 0; t < n; ++t) {
          const int64_t j = j0 + t;
          const int r_first = static_cast<int>(std::max<int64_t>(0, j - p - i0));  // rows < r_first: masked
          for (int qv = 0; qv < r_first * G; ++qv) w.s[qv * kBlk + t] = kNegInf;
          qk_row<D>(w.s.data(), w.qf.data(), k + static_cast<int64_t>(tok[j]) * a.k_s0 + kvh * a.k_s1, r_first * G, nq, t);
        }
        for (int qv = 0; qv < nq; ++qv) w.alpha[qv] = softmax_block(w.s.data() + qv * kBlk, n, w.m[qv], w.l[qv]);
        load_v_block<D>(w.vf.data(), v, tok + j0, n, a.v_s0, kvh * a.v_s1);
        for (int qv = 0; qv < nq; ++qv) {
          if (p + i0 + qv / G < j0) continue;  // row sees none of this block
          pv_accum<D>(w.acc.data() + qv * D, w.alpha[qv], w.s.data() + qv * kBlk, w.vf.data(), n);
        }
      }
      for (int r = 0; r < nr; ++r)
        for (int g = 0; g < G; ++g) {
          const int qv = r * G + g;
          const float inv = w.l[qv] > 0.f ? 1.f / w.l[qv] : 0.f;
          store_out(static_cast<char*>(a.out) + ((a.qo_indptr[b] + i0 + r) * a.o_s0 + (kvh * G + g) * a.o_s1) * qsz,
                    w.acc.data() + qv * D, a.q_bf16, D, inv);
        }
    }
  });
}

// ----------------------------------------------------------------------------------- dispatch
#define RADIXLM_DISPATCH_D(KV_T, FN, ARGS)                                      \
  switch (D) {                                                                  \
    case 16: FN<KV_T, 16>(ARGS); break;                                         \
    case 32: FN<KV_T, 32>(ARGS); break;                                         \
    case 64: FN<KV_T, 64>(ARGS); break;                                         \
    case 128: FN<KV_T, 128>(ARGS); break;                                       \
    case 256: FN<KV_T, 256>(ARGS); break;                                       \
    default: TORCH_CHECK(false, "radixlm cpu attention: unsupported head_dim ", D); \
  }

#define RADIXLM_DISPATCH(KV_DTYPE, FN, ARGS)                 \
  if ((KV_DTYPE) == at::kBFloat16) {                         \
    RADIXLM_DISPATCH_D(bf16, FN, ARGS)                       \
  } else {                                                   \
    RADIXLM_DISPATCH_D(float, FN, ARGS)                      \
  }

Args make_args(at::Tensor& out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
               const at::Tensor& table, const at::Tensor& rows, const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.dim() == 3 && out.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q/out/k/v must be 3-D");
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && table.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat, "q must be bf16 or fp32");
  TORCH_CHECK(out.scalar_type() == q.scalar_type() && out.sizes() == q.sizes(), "out must match q");
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && (k.scalar_type() == at::kBFloat16 || k.scalar_type() == at::kFloat),
              "k/v must both be bf16 or fp32");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1,
              "head_dim must be contiguous");
  TORCH_CHECK(k.size(2) == q.size(2) && v.size(2) == q.size(2) && k.size(1) == v.size(1), "k/v shape");
  TORCH_CHECK(q.size(1) % k.size(1) == 0 && q.size(1) / k.size(1) <= kMaxGroup, "unsupported GQA ratio");
  TORCH_CHECK(table.scalar_type() == at::kInt && table.dim() == 2 && table.stride(1) == 1, "req_to_token: int32 [rows, ctx]");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.is_contiguous(), "req_pool_indices: contiguous int64");
  TORCH_CHECK(seq_lens.scalar_type() == at::kLong && seq_lens.is_contiguous(), "seq_lens: contiguous int64");
  TORCH_CHECK(rows.numel() == seq_lens.numel(), "req_pool_indices and seq_lens differ in length");
  Args a{};
  a.out = out.data_ptr();
  a.q = q.data_ptr();
  a.k = k.data_ptr();
  a.v = v.data_ptr();
  a.q_s0 = q.stride(0); a.q_s1 = q.stride(1);
  a.o_s0 = out.stride(0); a.o_s1 = out.stride(1);
  a.k_s0 = k.stride(0); a.k_s1 = k.stride(1);
  a.v_s0 = v.stride(0); a.v_s1 = v.stride(1);
  a.table = table.data_ptr<int32_t>();
  a.table_s0 = table.stride(0);
  a.rows = rows.data_ptr<int64_t>();
  a.seq_lens = seq_lens.data_ptr<int64_t>();
  a.bs = rows.numel();
  a.H = q.size(1);
  a.KVH = k.size(1);
  a.G = a.H / a.KVH;
  a.S = 1;
  a.scale = static_cast<float>(scale);
  a.q_bf16 = q.scalar_type() == at::kBFloat16;
  return a;
}

}  // namespace

// Splits per request for decode: enough (request, kv head, split) tasks to keep every thread
// busy, with at least kMinSplitLen keys per split.
int64_t decode_num_splits(int64_t bs, int64_t kv_heads, int64_t max_seq_len) {
  constexpr int64_t kMinSplitLen = 64;
  const int64_t want_tasks = 8 * static_cast<int64_t>(at::get_num_threads());
  const int64_t work = std::max<int64_t>(1, bs * kv_heads);
  if (work >= want_tasks) return 1;
  const int64_t s = (want_tasks + work - 1) / work;
  return std::max<int64_t>(1, std::min(s, max_seq_len / kMinSplitLen));
}

void decode(at::Tensor out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& table,
            const at::Tensor& rows, const at::Tensor& seq_lens, double scale, int64_t num_splits) {
  Args a = make_args(out, q, k, v, table, rows, seq_lens, scale);
  TORCH_CHECK(q.size(0) == a.bs, "decode: one query per request");
  const int D = static_cast<int>(q.size(2));
  if (a.bs == 0) return;
  const int64_t max_len = *std::max_element(a.seq_lens, a.seq_lens + a.bs);
  a.S = num_splits > 0 ? num_splits : decode_num_splits(a.bs, a.KVH, max_len);
  at::Tensor part_o, part_lse;
  if (a.S > 1) {
    part_o = at::empty({a.bs, a.H, a.S, D}, q.options().dtype(at::kFloat));
    part_lse = at::empty({a.bs, a.H, a.S}, q.options().dtype(at::kFloat));
    a.part_o = part_o.data_ptr<float>();
    a.part_lse = part_lse.data_ptr<float>();
  }
  RADIXLM_DISPATCH(k.scalar_type(), decode_kernel, a)
  if (a.S > 1) combine_splits(a, D);
}

void extend(at::Tensor out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& table,
            const at::Tensor& rows, const at::Tensor& prefix_lens, const at::Tensor& seq_lens,
            const at::Tensor& qo_indptr, double scale) {
  Args a = make_args(out, q, k, v, table, rows, seq_lens, scale);
  TORCH_CHECK(prefix_lens.scalar_type() == at::kLong && prefix_lens.is_contiguous() && prefix_lens.numel() == a.bs,
              "prefix_lens: contiguous int64 [bs]");
  TORCH_CHECK(qo_indptr.scalar_type() == at::kLong && qo_indptr.is_contiguous() && qo_indptr.numel() == a.bs + 1,
              "qo_indptr: contiguous int64 [bs + 1]");
  a.prefix_lens = prefix_lens.data_ptr<int64_t>();
  a.qo_indptr = qo_indptr.data_ptr<int64_t>();
  TORCH_CHECK(a.qo_indptr[a.bs] == q.size(0), "qo_indptr[-1] must equal the number of query tokens");
  for (int64_t b = 0; b < a.bs; ++b)
    TORCH_CHECK(a.prefix_lens[b] + a.qo_indptr[b + 1] - a.qo_indptr[b] == a.seq_lens[b],
                "prefix_len + extend_len must equal seq_len");
  const int D = static_cast<int>(q.size(2));
  RADIXLM_DISPATCH(k.scalar_type(), extend_kernel, a)
}

}  // namespace radixlm_cpu

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode", &radixlm_cpu::decode, "paged decode attention (in place over the KV cache)");
  m.def("extend", &radixlm_cpu::extend, "paged extend attention over a cached prefix, causal");
  m.def("decode_num_splits", &radixlm_cpu::decode_num_splits, "kv splits the decode kernel picks");
  m.def("isa", []() { return std::string(RADIXLM_ISA_NAME); }, "the SIMD path this build uses");
}
