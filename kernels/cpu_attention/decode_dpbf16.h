// Paged decode attention on vdpbf16ps, for bf16 q and K/V on CPUs with AVX512-BF16 (AMD Zen 4/5,
// Intel Cooper Lake and later). paged_attention.h's decode_kernel hands one task's keys here in
// place of its fp32-FMA loop; the task, the splits and the output are the same.
//
// Why: the fp32 loop widens every bf16 K and V element and multiplies it with an FMA per query
// head, and that, not memory, bounded decode: at batch 64 x 384 keys on a 2-core Zen 4 (SmolLM2,
// 3 kv heads of 3 query heads) one layer took 0.72 ms with its K/V in L3 and 0.85 from memory.
// vdpbf16ps multiplies pairs of bf16 straight from the rows and adds both products into one fp32
// lane, so each K/V element costs half an instruction per head, and no widening.
//
// Per key block (kKeys keys) and kv head, for its query heads in groups of up to 4:
//   scores  s[g][t] = scale * (q_g . K_t): q_g's raw bf16 pairs against the K row's, one fp32
//           vector per head, summed across lanes (sum4); soft-capped when cap > 0
//   softmax online, base e, fp32: p = exp(s - m_new) rounded to bf16 (vcvtneps2bf16), and the
//           denominator l sums the rounded p, so the weights the output uses sum to exactly l
//   PV      acc_g = acc_g * exp(m_old - m_new) + sum_t p[g][t] V_t over key pairs (t, t + 1):
//           vpunpck{l,h}wd of the two V rows gives the (V_t[c], V_t+1[c]) pairs of 8-column
//           groups, against the broadcast pair (p[g][t], p[g][t + 1])
// The unpacks leave acc's columns permuted within each 32 (lo: 0-3, 8-11, 16-19, 24-27; hi: the
// others); decode_keys_dpbf16 puts them back in order before it returns.
//
// Against the fp32 loop the results differ by p's bf16 rounding (as extend_brgemm.h's) and by the
// order of the fp32 sums; they do not depend on the batch: one request's keys, one task's order.
#pragma once

#include <atomic>
#include <cstdint>

#if defined(RADIXLM_AVX512)
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "dpbf16_gemm.h"
#include "simd.h"

namespace radixlm_attn {
namespace dp_decode {
using radixlm_cpu::fvec;

constexpr int kKeys = 64;   // keys per block: as paged_attention.h's kBlk, for the same prefetch distance
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// one K or V row into L2, as paged_attention.h's prefetch_row
template <int D>
inline void prefetch_row(const uint16_t* row) {
  for (int b = 0; b < D * 2; b += 64) _mm_prefetch(reinterpret_cast<const char*>(row) + b, _MM_HINT_T1);
}

// Scores of keys [0, n) for GB heads: s[g * kKeys + t]; -inf for t in [n, kKeys). When pf is set,
// prefetches the next block's K and V rows (next_slots, n_next of them).
template <int D, int GB>
RADIXLM_TARGET_BF16 inline void scores(const uint16_t* const* q, const uint16_t* k, const uint16_t* v,
                                       const int32_t* slots, int n, int64_t k_s0, int64_t v_s0, bool pf,
                                       const int32_t* next_slots, int n_next, float scale, float cap, float* s) {
  constexpr int NV = D / 32;
  for (int t = 0; t < n; ++t) {
    if (pf && t < n_next) {
      prefetch_row<D>(k + static_cast<int64_t>(next_slots[t]) * k_s0);
      prefetch_row<D>(v + static_cast<int64_t>(next_slots[t]) * v_s0);
    }
    const uint16_t* kr = k + static_cast<int64_t>(slots[t]) * k_s0;
    fvec a[4];
    for (int g = 0; g < 4; ++g) a[g] = fvec::zero();
    for (int i = 0; i < NV; ++i) {
      const __m512bh kv = (__m512bh)_mm512_loadu_si512(kr + 32 * i);
      for (int g = 0; g < GB; ++g)
        a[g].v = _mm512_dpbf16_ps(a[g].v, (__m512bh)_mm512_loadu_si512(q[g] + 32 * i), kv);
    }
    float dots[4];
    radixlm_cpu::sum4(a, dots);
    for (int g = 0; g < GB; ++g) s[g * kKeys + t] = cap > 0.f ? cap * std::tanh(dots[g] * scale / cap) : dots[g] * scale;
  }
  for (int g = 0; g < GB; ++g) std::fill(s + g * kKeys + n, s + (g + 1) * kKeys, kNegInf);
}

// Online softmax of one head's block: p (bf16 bits, kKeys) = round(exp(s - m_new)); m, l updated;
// returns exp(m_old - m_new), the factor for the old acc (0 when there was none).
RADIXLM_TARGET_BF16 inline float softmax(const float* s, uint16_t* p, float& m, float& l) {
  fvec mx = fvec::load(s);
  for (int t = fvec::N; t < kKeys; t += fvec::N) mx = radixlm_cpu::vmax(mx, fvec::load(s + t));
  const float mn = std::max(m, mx.hmax());   // a block holds at least one key: finite
  const float alpha = m == kNegInf ? 0.f : std::exp(m - mn);
  const fvec neg = fvec::set1(-mn);
  fvec sum = fvec::zero();
  for (int t = 0; t < kKeys; t += fvec::N) {
    const __m256i pb = (__m256i)_mm512_cvtneps_pbh(radixlm_cpu::vexp(fvec::load(s + t) + neg).v);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + t), pb);
    sum = sum + fvec(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(pb), 16)));
  }
  l = l * alpha + sum.sum();
  m = mn;
  return alpha;
}

// acc[g] (D fp32, permuted columns) = acc[g] * alpha[g] + sum_t p[g][t] V_t, keys [0, n).
template <int D, int GB>
RADIXLM_TARGET_BF16 inline void pv(float* const* acc, const float* alpha, const uint16_t* p, const uint16_t* v,
                                   const int32_t* slots, int n, int64_t v_s0) {
  for (int c = 0; c < D; c += 64) {   // 64 columns at a time: 4 vectors per head
    __m512 o[GB][4];
    for (int g = 0; g < GB; ++g) {
      const __m512 al = _mm512_set1_ps(alpha[g]);
      for (int i = 0; i < 4; ++i) o[g][i] = _mm512_mul_ps(_mm512_loadu_ps(acc[g] + c + 16 * i), al);
    }
    for (int t = 0; t < n; t += 2) {
      const uint16_t* r0 = v + static_cast<int64_t>(slots[t]) * v_s0 + c;
      const __m512i a0 = _mm512_loadu_si512(r0), b0 = _mm512_loadu_si512(r0 + 32);
      __m512i a1 = _mm512_setzero_si512(), b1 = _mm512_setzero_si512();   // no key t + 1: zeros, not
      if (t + 1 < n) {                                                    // whatever a stale slot holds
        const uint16_t* r1 = v + static_cast<int64_t>(slots[t + 1]) * v_s0 + c;
        a1 = _mm512_loadu_si512(r1);
        b1 = _mm512_loadu_si512(r1 + 32);
      }
      const __m512bh pairs[4] = {(__m512bh)_mm512_unpacklo_epi16(a0, a1), (__m512bh)_mm512_unpackhi_epi16(a0, a1),
                                 (__m512bh)_mm512_unpacklo_epi16(b0, b1), (__m512bh)_mm512_unpackhi_epi16(b0, b1)};
      for (int g = 0; g < GB; ++g) {
        uint32_t pp;
        std::memcpy(&pp, p + g * kKeys + t, sizeof(pp));
        const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(pp));
        for (int i = 0; i < 4; ++i) o[g][i] = _mm512_dpbf16_ps(o[g][i], w, pairs[i]);
      }
    }
    for (int g = 0; g < GB; ++g)
      for (int i = 0; i < 4; ++i) _mm512_storeu_ps(acc[g] + c + 16 * i, o[g][i]);
  }
}

// Column order back: pv() leaves column 8L + k (k < 4) of each 32 in lane 4L + k of its first
// vector and column 8L + 4 + k in lane 4L + k of its second.
template <int D>
inline void unpermute(float* acc) {
  float tmp[32];
  for (int c = 0; c < D; c += 32) {
    std::memcpy(tmp, acc + c, sizeof(tmp));
    for (int L = 0; L < 4; ++L)
      for (int k = 0; k < 4; ++k) {
        acc[c + 8 * L + k] = tmp[4 * L + k];
        acc[c + 8 * L + 4 + k] = tmp[16 + 4 * L + k];
      }
  }
}

// One group of GB query heads of kv head kvh over one key block.
template <int D, int GB>
RADIXLM_TARGET_BF16 inline void group_block(const uint16_t* const* q, float* const* acc, float* m, float* l,
                                            const uint16_t* k, const uint16_t* v, const int32_t* slots, int n,
                                            int64_t k_s0, int64_t v_s0, bool pf, const int32_t* next_slots,
                                            int n_next, float scale, float cap, float* s, uint16_t* p) {
  scores<D, GB>(q, k, v, slots, n, k_s0, v_s0, pf, next_slots, n_next, scale, cap, s);
  float alpha[GB];
  for (int g = 0; g < GB; ++g) alpha[g] = softmax(s + g * kKeys, p + g * kKeys, m[g], l[g]);
  pv<D, GB>(acc, alpha, p, v, slots, n, v_s0);
}

}  // namespace dp_decode

// Keys [j_begin, j_end) of one request (slots: its table row) for its H query heads, G per kv head:
// q (bf16 bits) head h at q + h * q_s1; K/V rows at k/v + slot * s0 + kv head * s1. Writes acc
// [H][D] (unnormalized, in column order), m and l [H] (running max of the scaled scores, and the
// softmax denominator), as paged_attention.h's decode_kernel loop leaves them.
template <int D>
RADIXLM_TARGET_BF16 __attribute__((noinline)) void decode_keys_dpbf16(
    const uint16_t* q, int64_t q_s1, int H, int G, float scale, float cap, const uint16_t* k, const uint16_t* v,
    int64_t k_s0, int64_t k_s1, int64_t v_s0, int64_t v_s1, const int32_t* slots, int64_t j_begin, int64_t j_end,
    float* acc, float* m, float* l) {
  using namespace dp_decode;
  static_assert(D % 64 == 0, "head_dim a multiple of 64");
  std::fill(acc, acc + static_cast<int64_t>(H) * D, 0.f);
  std::fill(m, m + H, kNegInf);
  std::fill(l, l + H, 0.f);
  alignas(64) float s[4 * kKeys];
  alignas(64) uint16_t p[4 * kKeys];
  const int KVH = H / G;
  for (int64_t j0 = j_begin; j0 < j_end; j0 += kKeys) {
    const int n = static_cast<int>(std::min<int64_t>(kKeys, j_end - j0));
    const int n_next = static_cast<int>(std::min<int64_t>(kKeys, std::max<int64_t>(0, j_end - j0 - kKeys)));
    const int32_t* sl = slots + j0;
    for (int kvh = 0; kvh < KVH; ++kvh) {
      const uint16_t* kh = k + kvh * k_s1;
      const uint16_t* vh = v + kvh * v_s1;
      if (j0 == j_begin)   // nothing prefetched this block's rows yet
        for (int t = 0; t < n; ++t) {
          prefetch_row<D>(kh + static_cast<int64_t>(sl[t]) * k_s0);
          prefetch_row<D>(vh + static_cast<int64_t>(sl[t]) * v_s0);
        }
      for (int g0 = 0; g0 < G; g0 += 4) {
        const int gb = std::min(4, G - g0), h0 = kvh * G + g0;
        const uint16_t* qg[4];
        float* ag[4];
        for (int g = 0; g < gb; ++g) {
          qg[g] = q + (h0 + g) * q_s1;
          ag[g] = acc + static_cast<int64_t>(h0 + g) * D;
        }
        const bool pf = g0 == 0;   // the first group prefetches for the others
#define RADIXLM_DP_GROUP(GB)                                                                                        \
  group_block<D, GB>(qg, ag, m + h0, l + h0, kh, vh, sl, n, k_s0, v_s0, pf, sl + kKeys, n_next, scale, cap, s, p)
        switch (gb) {
          case 4: RADIXLM_DP_GROUP(4); break;
          case 3: RADIXLM_DP_GROUP(3); break;
          case 2: RADIXLM_DP_GROUP(2); break;
          default: RADIXLM_DP_GROUP(1); break;
        }
#undef RADIXLM_DP_GROUP
      }
    }
  }
  for (int h = 0; h < H; ++h) dp_decode::unpermute<D>(acc + static_cast<int64_t>(h) * D);
}

}  // namespace radixlm_attn
#endif  // RADIXLM_AVX512

namespace radixlm_attn {
// set_decode_dpbf16(false) sends bf16 decode to the fp32 loop (tests, benchmarks); one flag per library.
inline std::atomic<bool>& decode_dpbf16_allowed() {
  static std::atomic<bool> allowed{true};
  return allowed;
}
inline void set_decode_dpbf16(bool allowed) { decode_dpbf16_allowed().store(allowed); }

// Whether bf16 decode (bf16 q and K/V) at head_dim D runs decode_keys_dpbf16 here.
inline bool decode_dpbf16_usable(int64_t D) {
#if defined(RADIXLM_AVX512)
  return D % 64 == 0 && cpu_has_avx512_bf16() && decode_dpbf16_allowed().load(std::memory_order_relaxed);
#else
  return false;
#endif
}
}  // namespace radixlm_attn
