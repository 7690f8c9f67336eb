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
// Sliding window: with window_left >= 0, the query at position i sees only keys
// [i - window_left, i] (FlashInfer's `window_left`; HF's sliding_window is window_left + 1); -1
// means no window. Keys older than the window are skipped, not just masked, where whole blocks are.
//
// Soft-capping (Gemma 2): with logit_cap > 0 each score s = scale * q.k becomes
// logit_cap * tanh(s / logit_cap) before the softmax (SGLang's `logit_cap`, FlashInfer's
// `logits_soft_cap`); 0 leaves scores as they are.
//
// GQA: the G = heads / kv_heads query heads of a kv head are processed together, so each K/V
// row is read once for all of them. Math is fp32 with an online softmax over key blocks of kBlk.
// Work is split over (request, kv split) for decode (every kv head in one task: a slot's rows
// for all kv heads are adjacent), (request, kv head, query block) for extend, on torch's intra-op threads; decode splits combine by log-sum-exp.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "decode_dpbf16.h"
#include "parallel.h"
#include "simd.h"

namespace radixlm_attn {
using namespace radixlm_cpu;  // simd.h
namespace {

constexpr int kMaxGroup = 16;   // query heads per kv head
// keys per online-softmax block (a multiple of every fvec::N). 64 rather than 32: the next block's K
// rows are prefetched while this one is scored, and at batch 64 x 400 keys on a Zen 5 EPYC (2 threads,
// scattered slots) decode took 0.46-0.63 ms per layer at 64 against 0.53-0.66 at 32 (128: 0.8).
constexpr int kBlk = 64;
constexpr int64_t kDecodeSplitLen = 512;     // keys per decode split (fewer: one split)
constexpr int64_t kMaxDecodeSplits = 32;     // longer requests get longer splits

// Keys per decode split of a request with `keys` visible keys (see decode_num_splits).
inline int64_t decode_split_len(int64_t keys) {
  return std::max(kDecodeSplitLen, (keys + kMaxDecodeSplits - 1) / kMaxDecodeSplits);
}
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
  int64_t bs, H, KVH, G, S;     // S: kv splits (decode), the most any request has
  bool split_by_len;            // decode: a request's splits hold decode_split_len(its keys) keys (else keys / S)
  int64_t window_left;          // -1: no sliding window
  float scale;
  float logit_cap;              // > 0: scores soft-capped, cap * tanh(s / cap)
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

// One key block for one query vector: s[0, kBlk) are scores, -inf where masked or past the
// block's end. Rewrites s as exp(s - m_new) (0 where masked), updates the running max m and
// sum l, and returns the factor for the old acc.
inline float softmax_block(float* s, float& m, float& l) {
  fvec mx = fvec::set1(kNegInf);
  for (int t = 0; t < kBlk; t += fvec::N) mx = vmax(mx, fvec::load(s + t));
  const float bm = mx.hmax();
  if (bm == kNegInf) {          // fully masked block: contributes nothing
    for (int t = 0; t < kBlk; t += fvec::N) fvec::zero().store(s + t);
    return 1.f;
  }
  const float mn = std::max(m, bm);
  const float alpha = (m == kNegInf) ? 0.f : std::exp(m - mn);
  const fvec mv = fvec::set1(mn);
  fvec sum = fvec::zero();
  for (int t = 0; t < kBlk; t += fvec::N) {
    const fvec e = vexp(fvec::load(s + t) - mv);
    e.store(s + t);
    sum = sum + e;
  }
  l = l * alpha + sum.sum();
  m = mn;
  return alpha;
}

#if defined(RADIXLM_AVX512)
constexpr int kAccRegs = 16;    // accumulator registers the PV loop may hold
#else
constexpr int kAccRegs = 8;
#endif

constexpr int pow2_floor(int x) { return x >= 16 ? 16 : x >= 8 ? 8 : x >= 4 ? 4 : x >= 2 ? 2 : 1; }

// Software prefetch of one K or V row (D elements): paged rows are scattered, and the hardware
// prefetchers do not follow the slot table. Into L2 (T1), not L1: a block's next K rows and its V
// rows for every query group are more lines than L1 keeps in flight, and on a Zen 4 EPYC (2 threads,
// batch 64 x 448 keys, SmolLM2's 3 kv heads) decode took 0.71-0.82 ms per layer with T1 against
// 1.29 with T0 when a request's slots were consecutive, 0.95-1.04 against 2.5 when shuffled.
template <int D, typename kv_t>
inline void prefetch_row(const kv_t* row) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int b = 0; b < static_cast<int>(D * sizeof(kv_t)); b += 64) _mm_prefetch(p + b, _MM_HINT_T1);
}

// One key block [j0, j0 + n) for GB query vectors (qf, acc, s, m, l each start at this group):
// scores, causal mask (key j is visible to vector g iff j <= lim[g], and j >= lo[g] when lo is not
// null: the sliding window), soft-capping when cap > 0, online softmax, and PV.
// K/V rows are read in place from their slots; the GB query vectors sit in registers so that
// each K/V row is loaded once for all of them.
template <typename kv_t, int D, int GB>
inline void attend_group(const float* qf, float* acc, float* s, float* m, float* l, const int64_t* lim,
                         const int64_t* lo, const kv_t* k, const kv_t* v, const int32_t* slots, int64_t j0, int n,
                         int64_t k_s0, int64_t k_off, int64_t v_s0, int64_t v_off, int n_next, float cap) {
  constexpr int NV = D / fvec::N;
  // scores: s[g * kBlk + t] = qf[g] . K[slot t]; meanwhile prefetch this block's V rows and the
  // next block's K rows (slots[kBlk + t], n_next of them; 0 when this is not the first group)
  for (int t = 0; t < n; ++t) {
    if (n_next >= 0) {
      prefetch_row<D>(v + static_cast<int64_t>(slots[t]) * v_s0 + v_off);
      if (t < n_next) prefetch_row<D>(k + static_cast<int64_t>(slots[kBlk + t]) * k_s0 + k_off);
    }
    const kv_t* kr = k + static_cast<int64_t>(slots[t]) * k_s0 + k_off;
    fvec a[4];
    for (int g = 0; g < 4; ++g) a[g] = fvec::zero();
    for (int i = 0; i < NV; ++i) {
      const fvec kv = fvec::load(kr + i * fvec::N);
      for (int g = 0; g < GB; ++g) a[g] = fmadd(fvec::load(qf + g * D + i * fvec::N), kv, a[g]);
    }
    float dots[4];
    sum4(a, dots);
    if (cap > 0.f) {
      for (int g = 0; g < GB; ++g) s[g * kBlk + t] = cap * std::tanh(dots[g] / cap);
    } else {
      for (int g = 0; g < GB; ++g) s[g * kBlk + t] = dots[g];
    }
  }
  float alpha[GB];
  for (int g = 0; g < GB; ++g) {
    // -inf past the block's end and where causally masked (keys j > lim[g])
    for (int t = std::min<int64_t>(n, std::max<int64_t>(0, lim[g] + 1 - j0)); t < kBlk; ++t) s[g * kBlk + t] = kNegInf;
    // -inf before the sliding window (keys j < lo[g])
    if (lo != nullptr)
      for (int t = 0; t < std::min<int64_t>(n, lo[g] - j0); ++t) s[g * kBlk + t] = kNegInf;
    alpha[g] = softmax_block(s + g * kBlk, m[g], l[g]);
  }
  // acc[g] = acc[g] * alpha[g] + sum_t p[g, t] * V[slot t], D split in chunks that fit registers
  constexpr int NC = std::min(NV, pow2_floor(std::max(1, kAccRegs / GB)));
  for (int c = 0; c < NV; c += NC) {
    fvec o[GB][NC];
    for (int g = 0; g < GB; ++g) {
      const fvec al = fvec::set1(alpha[g]);
      for (int i = 0; i < NC; ++i) o[g][i] = fvec::load(acc + g * D + (c + i) * fvec::N) * al;
    }
    for (int t = 0; t < n; ++t) {
      const kv_t* vr = v + static_cast<int64_t>(slots[t]) * v_s0 + v_off + c * fvec::N;
      fvec vv[NC];
      for (int i = 0; i < NC; ++i) vv[i] = fvec::load(vr + i * fvec::N);
      for (int g = 0; g < GB; ++g) {
        const fvec pt = fvec::set1(s[g * kBlk + t]);
        for (int i = 0; i < NC; ++i) o[g][i] = fmadd(pt, vv[i], o[g][i]);
      }
    }
    for (int g = 0; g < GB; ++g)
      for (int i = 0; i < NC; ++i) o[g][i].store(acc + g * D + (c + i) * fvec::N);
  }
}

// One key block for query vectors [0, nq), in register groups of up to 4. lim[qv] (and lo[qv]) must
// be nondecreasing in qv; groups that see none of the block are skipped. `n_next`: keys in the
// next block (their slots follow at slots[kBlk...]), prefetched during the first group.
template <typename kv_t, int D>
inline void attend_block(int nq, const float* qf, float* acc, float* s, float* m, float* l, const int64_t* lim,
                         const int64_t* lo, const kv_t* k, const kv_t* v, const int32_t* slots, int64_t j0, int n,
                         int64_t k_s0, int64_t k_off, int64_t v_s0, int64_t v_off, int n_next, bool first,
                         float cap) {
  if (first) {  // nothing prefetched this block's K rows yet
    for (int t = 0; t < n; ++t) prefetch_row<D>(k + static_cast<int64_t>(slots[t]) * k_s0 + k_off);
  }
  int pf = n_next;  // -1: no prefetching at all
  for (int q0 = 0; q0 < nq; q0 += 4) {
    const int gb = std::min(4, nq - q0);
    if (lim[q0 + gb - 1] < j0 || (lo != nullptr && lo[q0] >= j0 + n)) continue;
#define RADIXLM_GROUP(GB)                                                                           \
  attend_group<kv_t, D, GB>(qf + q0 * D, acc + q0 * D, s + q0 * kBlk, m + q0, l + q0, lim + q0,            \
                            lo == nullptr ? nullptr : lo + q0, k, v,                                       \
                            slots, j0, n, k_s0, k_off, v_s0, v_off, pf, cap)
    switch (gb) {
      case 4: RADIXLM_GROUP(4); break;
      case 3: RADIXLM_GROUP(3); break;
      case 2: RADIXLM_GROUP(2); break;
      default: RADIXLM_GROUP(1); break;
    }
#undef RADIXLM_GROUP
    pf = -1;
  }
}

// dst[t, :] = float(row of slots[t]) for t < n: a block-local fp32 copy (at most kBlk rows), so
// that many query groups do not each convert the same bf16 rows again.
template <int D, typename kv_t>
inline void stage_rows(float* dst, const kv_t* src, const int32_t* slots, int n, int64_t s0, int64_t off) {
  for (int t = 0; t < n; ++t) {
    const kv_t* r = src + static_cast<int64_t>(slots[t]) * s0 + off;
    for (int i = 0; i < D / fvec::N; ++i) fvec::load(r + i * fvec::N).store(dst + t * D + i * fvec::N);
  }
}

struct Scratch {
  std::vector<float> qf, acc, s, m, l, kf, vf;
  std::vector<int64_t> lim;  // last visible key index per query vector
  std::vector<int64_t> lo;   // first visible key index per query vector (sliding window)
  std::vector<int32_t> iota;  // 0..kBlk-1: the "slots" of a staged block
  Scratch(int nq, int D)
      : qf(nq * D), acc(nq * D), s(nq * kBlk), m(nq), l(nq), kf(kBlk * D), vf(kBlk * D), lim(nq), lo(nq), iota(kBlk) {
    for (int t = 0; t < kBlk; ++t) iota[t] = t;
  }
  void reset(int nq, int D) {
    std::fill(acc.begin(), acc.begin() + nq * D, 0.f);
    std::fill(m.begin(), m.begin() + nq, kNegInf);
    std::fill(l.begin(), l.begin() + nq, 0.f);
  }
};

// ----------------------------------------------------------------------------------- decode
// decode_kernel's keys [j_begin, j_end) of request b on vdpbf16ps (decode_dpbf16.h): w.acc, w.m, w.l
// as its fp32 loop leaves them. Only for bf16 K/V and q, head_dim a multiple of 64 (decode_dpbf16_usable).
template <typename kv_t, int D>
inline void decode_keys_dp(const Args& a, int64_t b, const int32_t* tok, int64_t j_begin, int64_t j_end, Scratch& w) {
#if defined(RADIXLM_AVX512)
  if constexpr (std::is_same_v<kv_t, bf16> && D % 64 == 0) {
    decode_keys_dpbf16<D>(static_cast<const uint16_t*>(a.q) + b * a.q_s0, a.q_s1, static_cast<int>(a.H),
                          static_cast<int>(a.G), a.scale, a.logit_cap, static_cast<const uint16_t*>(a.k),
                          static_cast<const uint16_t*>(a.v), a.k_s0, a.k_s1, a.v_s0, a.v_s1, tok, j_begin, j_end,
                          w.acc.data(), w.m.data(), w.l.data());
    return;
  }
#endif
  TORCH_CHECK(false, "decode_keys_dp: bf16 K/V, head_dim a multiple of 64, AVX512 builds only");
}

template <typename kv_t, int D>
void decode_kernel(const Args& a) {
  const auto* k = static_cast<const kv_t*>(a.k);
  const auto* v = static_cast<const kv_t*>(a.v);
  const int G = static_cast<int>(a.G);
  const int H = static_cast<int>(a.H);
  const bool dp = std::is_same_v<kv_t, bf16> && a.q_bf16 && decode_dpbf16_usable(D);   // decode_keys_dp
  // one task per (request, kv split), all kv heads inside: a slot's K/V rows for every kv head
  // are adjacent in memory, so each key block is read from DRAM once
  // requests differ in length: tasks taken at run time (parallel.h), not in one fixed range per thread
  radixlm_parallel::guided_for(a.bs * a.S, [](int64_t left) { return radixlm_parallel::guided_share(left, 1); },
                               [&](int64_t begin, int64_t end) {
    Scratch w(H, D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / a.S, sp = task % a.S;
      const int64_t L = a.seq_lens[b];
      // keys [first, L) are visible to the one query at position L - 1; split S ways
      const int64_t first = a.window_left >= 0 ? std::max<int64_t>(0, L - 1 - a.window_left) : 0;
      const int64_t chunk = a.split_by_len ? decode_split_len(L - first) : (L - first + a.S - 1) / a.S;
      const int64_t j_begin = std::min(L, first + sp * chunk), j_end = std::min(L, j_begin + chunk);
      const int32_t* tok = a.table + a.rows[b] * a.table_s0;
      const auto* qb = static_cast<const char*>(a.q);
      const int64_t qsz = a.q_bf16 ? 2 : 4;
      if (dp) {
        decode_keys_dp<kv_t, D>(a, b, tok, j_begin, j_end, w);
      } else {
        for (int h = 0; h < H; ++h)
          load_q(w.qf.data() + h * D, qb + (b * a.q_s0 + h * a.q_s1) * qsz, a.q_bf16, D, a.scale);
        w.reset(H, D);
        std::fill(w.lim.begin(), w.lim.end(), L - 1);
        for (int64_t j0 = j_begin; j0 < j_end; j0 += kBlk) {
          const int n = static_cast<int>(std::min<int64_t>(kBlk, j_end - j0));
          const int n_next = static_cast<int>(std::min<int64_t>(kBlk, std::max<int64_t>(0, j_end - j0 - kBlk)));
          for (int64_t kvh = 0; kvh < a.KVH; ++kvh) {
            const int64_t h0 = kvh * G;  // query heads [h0, h0 + G) read this kv head
            attend_block<kv_t, D>(G, w.qf.data() + h0 * D, w.acc.data() + h0 * D, w.s.data() + h0 * kBlk,
                                  w.m.data() + h0, w.l.data() + h0, w.lim.data() + h0, nullptr, k, v, tok + j0, j0,
                                  n, a.k_s0, kvh * a.k_s1, a.v_s0, kvh * a.v_s1, n_next, j0 == j_begin, a.logit_cap);
          }
        }
      }
      for (int h = 0; h < H; ++h) {
        const float inv = w.l[h] > 0.f ? 1.f / w.l[h] : 0.f;
        if (a.S == 1) {
          store_out(static_cast<char*>(a.out) + (b * a.o_s0 + h * a.o_s1) * qsz, w.acc.data() + h * D, a.q_bf16, D, inv);
        } else {
          const int64_t idx = (b * a.H + h) * a.S + sp;
          store_out(a.part_o + idx * D, w.acc.data() + h * D, false, D, inv);
          a.part_lse[idx] = w.l[h] > 0.f ? w.m[h] + std::log(w.l[h]) : kNegInf;
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
      for (int qv = 0; qv < nq; ++qv) w.lim[qv] = p + i0 + qv / G;
      // sliding window: row r sees keys j >= p + i0 + r - window_left; keys before row 0's window are skipped
      const bool windowed = a.window_left >= 0;
      for (int qv = 0; qv < nq && windowed; ++qv) w.lo[qv] = p + i0 + qv / G - a.window_left;
      const int64_t* lo = windowed ? w.lo.data() : nullptr;
      const int64_t k_begin = windowed ? std::max<int64_t>(0, p + i0 - a.window_left) : 0;
      const int64_t k_end = p + i0 + nr;
      for (int64_t j0 = k_begin; j0 < k_end; j0 += kBlk) {
        const int n = static_cast<int>(std::min<int64_t>(kBlk, k_end - j0));
        const int n_next = static_cast<int>(std::min<int64_t>(kBlk, std::max<int64_t>(0, k_end - j0 - kBlk)));
        if (std::is_same_v<kv_t, bf16> && nq > 8) {  // many groups: convert each bf16 row once
          stage_rows<D>(w.kf.data(), k, tok + j0, n, a.k_s0, kvh * a.k_s1);
          stage_rows<D>(w.vf.data(), v, tok + j0, n, a.v_s0, kvh * a.v_s1);
          attend_block<float, D>(nq, w.qf.data(), w.acc.data(), w.s.data(), w.m.data(), w.l.data(), w.lim.data(),
                                 lo, w.kf.data(), w.vf.data(), w.iota.data(), j0, n, D, 0, D, 0, -1, false, a.logit_cap);
        } else {
          attend_block<kv_t, D>(nq, w.qf.data(), w.acc.data(), w.s.data(), w.m.data(), w.l.data(), w.lim.data(), lo,
                                k, v, tok + j0, j0, n, a.k_s0, kvh * a.k_s1, a.v_s0, kvh * a.v_s1, n_next,
                                j0 == k_begin, a.logit_cap);
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
  a.window_left = -1;
  a.scale = static_cast<float>(scale);
  a.logit_cap = 0.f;
  a.q_bf16 = q.scalar_type() == at::kBFloat16;
  return a;
}

}  // namespace

// Splits per request for decode: a request's keys go in splits of decode_split_len(keys) keys, a
// length that depends on that request alone, never on the batch. So a request's attention output has
// the same bits whatever else is in the batch: decoding alone, beside others, or as one of the rows of
// a speculative verify pass (whose greedy tokens must equal plain decoding's, bf16 included).
int64_t decode_num_splits(int64_t max_keys) {
  const int64_t keys = std::max<int64_t>(1, max_keys);
  const int64_t len = decode_split_len(keys);
  return (keys + len - 1) / len;
}

void decode(at::Tensor out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& table,
            const at::Tensor& rows, const at::Tensor& seq_lens, double scale, int64_t num_splits,
            int64_t window_left = -1, double logit_cap = 0.0) {
  Args a = make_args(out, q, k, v, table, rows, seq_lens, scale);
  a.window_left = window_left;
  a.logit_cap = static_cast<float>(logit_cap);
  TORCH_CHECK(q.size(0) == a.bs, "decode: one query per request");
  const int D = static_cast<int>(q.size(2));
  if (a.bs == 0) return;
  const int64_t max_len = *std::max_element(a.seq_lens, a.seq_lens + a.bs);
  const int64_t max_keys = window_left >= 0 ? std::min<int64_t>(max_len, window_left + 1) : max_len;
  // num_splits > 0 (tests): every request's keys in that many equal splits
  a.split_by_len = num_splits <= 0;
  a.S = num_splits > 0 ? num_splits : decode_num_splits(max_keys);
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

namespace {
// make_args plus extend's own inputs (prefix_lens, qo_indptr), checked against each other.
Args make_extend_args(at::Tensor& out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& table, const at::Tensor& rows, const at::Tensor& prefix_lens,
                      const at::Tensor& seq_lens, const at::Tensor& qo_indptr, double scale, int64_t window_left,
                      double logit_cap) {
  Args a = make_args(out, q, k, v, table, rows, seq_lens, scale);
  a.window_left = window_left;
  a.logit_cap = static_cast<float>(logit_cap);
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
  return a;
}
}  // namespace

void extend(at::Tensor out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& table,
            const at::Tensor& rows, const at::Tensor& prefix_lens, const at::Tensor& seq_lens,
            const at::Tensor& qo_indptr, double scale, int64_t window_left = -1, double logit_cap = 0.0) {
  Args a = make_extend_args(out, q, k, v, table, rows, prefix_lens, seq_lens, qo_indptr, scale, window_left,
                            logit_cap);
  const int D = static_cast<int>(q.size(2));
  RADIXLM_DISPATCH(k.scalar_type(), extend_kernel, a)
}

}  // namespace radixlm_attn
#undef RADIXLM_DISPATCH
#undef RADIXLM_DISPATCH_D
