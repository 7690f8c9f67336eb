// Paged extend attention on the matrix units: flash attention whose two products, S = Q.K^T and
// O += P.V, are torch's CPU micro-kernel `at::native::cpublas::brgemm` (oneDNN's brgemm ukernel:
// AMX tiles where the CPU has them). Same inputs and result as extend() in paged_attention.h (its
// contract: causal over a cached prefix, window_left, logit_cap), bf16 q and K/V only.
//
// Work: one task per (request, kv head, block of kRows query rows); the G query heads of the kv head
// are stacked into one [G * nr][D] query block, so each key block is gathered and packed once for
// all of them and each product is one brgemm call of G * nr rows. Tasks are pulled by the threads
// from a shared counter, longest first (a causal prefill's last query blocks see the most keys).
//
// One task, per key block [j0, j0 + n) of its visible keys (kKeys at a time, aligned to kKeys):
//   kp  [D/2][kKeys][2]  bf16   K^T of the block, VNNI-packed (pairs of d adjacent); keys n.. zero
//   vp  [npad/2][D][2]   bf16   V of the block, VNNI-packed (pairs of keys adjacent); rows n.. zero
//   qs  [G*nr][D]    bf16       the G heads' query rows, copied once per task (row g*nr + r)
//   s   [G*nr][kKeys] fp32      q.k from one brgemm
//   p   [G*nr][kKeys] bf16      2^(c*s - m) under the mask, 0 past n and past each row's last
//                               visible key (no exp there; online softmax in base 2, fp32)
//   o   [G*nr][Dv]   fp32       o * 2^(m_old - m) + p.V (one brgemm with add_C, columns 0..D-1); column D
//                               holds the softmax denominator l, rescaled with the row and added to by
//                               the softmax (the sum of the row's rounded p); Dv = D + 16; out = o / o[:, D]
// npad: n rounded up to kKeyPad (the AMX tile depth for bf16). The products run on AMX tiles, on
// vdpbf16ps (dpbf16_gemm.h, AVX512-BF16 without AMX: same packed layout) or, on neither, in brgemm's
// plain gemm fallback, for which kp is K^T [D][kKeys] and vp is V [npad][D]. A key block that
// several tasks read (a request with more than one query block, or a prefix whose slots several
// requests share) is packed once into a shared arena by whichever task needs it first
// (SharedBlocks); the others are packed by their task.
//
// P is rounded to bf16 before P.V and l sums the rounded values, so the weights the output uses sum
// to exactly l. Results differ from extend()'s fp32 math by the bf16 rounding of P.
#pragma once

#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "dpbf16_gemm.h"
#include "paged_attention.h"

namespace radixlm_attn {
namespace {

constexpr int kRows = 64;     // query rows per task (per head)
constexpr int kKeys = 128;    // keys per block (a multiple of kKeyPad and of every fvec::N)
constexpr int kKeyPad = 32;   // a block's keys padded to this: AMX bf16 tiles are 32 deep
constexpr int kLCols = 16;    // o's columns past D: l in the first (one vector, so rows stay aligned)
constexpr int kAhead = 16;    // K/V rows prefetched ahead while packing (paged rows are scattered:
                              // the hardware prefetchers do not follow the slot table)

inline void prefetch_bytes(const void* p, int bytes) {
  for (int b = 0; b < bytes; b += 64) _mm_prefetch(static_cast<const char*>(p) + b, _MM_HINT_T0);
}

// The micro-kernel of the block products: oneDNN's brgemm on AMX tiles, vdpbf16ps where the CPU has
// AVX512-BF16 but no AMX (dpbf16_gemm.h), else torch's brgemm with its plain gemm fallback. The first
// two take B VNNI-packed, the third plain. The best one this CPU runs is used unless a test forces
// another (force_extend_brgemm_micro).
enum class Micro { kAmx, kDpbf16, kGemm };
const char* const kMicroNames[] = {"amx", "avx512_bf16", "gemm"};

Micro best_micro_kernel() {
  static const Micro best = [] {
    if (at::native::cpublas::could_pack(at::kBFloat16)) return Micro::kAmx;
#if defined(RADIXLM_AVX512)
    if (cpu_has_avx512_bf16()) return Micro::kDpbf16;
#endif
    return Micro::kGemm;
  }();
  return best;
}

std::atomic<int> forced_micro{-1};   // a Micro, or -1: the best

Micro micro_kernel() {
  const int f = forced_micro.load(std::memory_order_relaxed);
  return f < 0 ? best_micro_kernel() : static_cast<Micro>(f);
}

// C (+)= A . B for one block product (see the layouts at the top of this file).
inline void block_product(Micro mk, int M, int N, int K, int64_t lda, int64_t ldb, int64_t ldc, bool add_C,
                          const bf16* A, const bf16* B, float* C) {
#if defined(RADIXLM_AVX512)
  if (mk == Micro::kDpbf16) return dpbf16_gemm(M, N, K, A, lda, B, ldb, C, ldc, add_C);
#endif
  at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, add_C, A, B, C, mk == Micro::kAmx);
}

// dst = bf16(x) rounded to nearest even; returns float(dst). x finite.
inline fvec store_bf16(fvec x, bf16* dst) {
#if defined(RADIXLM_AVX512)
  __m512i b = _mm512_castps_si512(x.v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  b = _mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  b = _mm512_and_si512(b, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(_mm512_srli_epi32(b, 16)));
  return _mm512_castsi512_ps(b);
#else
  __m256i b = _mm256_castps_si256(x.v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  b = _mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  b = _mm256_and_si256(b, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
  __m256i h = _mm256_srli_epi32(b, 16);
  __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), packed);
  return _mm256_castsi256_ps(b);
#endif
}

// Gathers the block's K rows (slots[t], t < n) as B of S = Q.K^T; zero columns for t in [n, npad).
inline void pack_k(bf16* dst, const bf16* k, const int32_t* slots, int n, int npad, int D, int64_t s0, int64_t off,
                   bool vnni) {
  for (int t = 0; t < std::min(n, kAhead); ++t) prefetch_bytes(k + static_cast<int64_t>(slots[t]) * s0 + off, D * 2);
  if (vnni) {  // dst as uint32 [D/2][kKeys]: element (p, t) holds K[t][2p], K[t][2p + 1]
    auto* d32 = reinterpret_cast<uint32_t*>(dst);
    for (int t = 0; t < n; ++t) {
      if (t + kAhead < n) prefetch_bytes(k + static_cast<int64_t>(slots[t + kAhead]) * s0 + off, D * 2);
      const auto* r = reinterpret_cast<const uint32_t*>(k + static_cast<int64_t>(slots[t]) * s0 + off);
      for (int p = 0; p < D / 2; ++p) d32[p * kKeys + t] = r[p];
    }
    for (int p = 0; p < D / 2; ++p)
      for (int t = n; t < npad; ++t) d32[p * kKeys + t] = 0;
  } else {     // dst [D][kKeys]
    for (int t = 0; t < n; ++t) {
      if (t + kAhead < n) prefetch_bytes(k + static_cast<int64_t>(slots[t + kAhead]) * s0 + off, D * 2);
      const bf16* r = k + static_cast<int64_t>(slots[t]) * s0 + off;
      for (int d = 0; d < D; ++d) dst[d * kKeys + t] = r[d];
    }
    for (int d = 0; d < D; ++d)
      for (int t = n; t < npad; ++t) dst[d * kKeys + t] = bf16(0.f);
  }
}

// Gathers the block's V rows as B of O += P.V; zero rows for t in [n, npad) (P is 0 there, but
// 0 * a stale NaN is not).
inline void pack_v(bf16* dst, const bf16* v, const int32_t* slots, int n, int npad, int D, int64_t s0, int64_t off,
                   bool vnni) {
  auto* d16 = reinterpret_cast<uint16_t*>(dst);
  for (int t = 0; t < std::min(n, kAhead); ++t) prefetch_bytes(v + static_cast<int64_t>(slots[t]) * s0 + off, D * 2);
  if (vnni) {  // [npad/2][D][2]: element (i, d) holds row 2i's and row 2i + 1's column d
    for (int i = 0; i < npad / 2; ++i) {
      const int t = 2 * i;
      for (int u = t + kAhead; u < std::min(n, t + kAhead + 2); ++u)
        prefetch_bytes(v + static_cast<int64_t>(slots[u]) * s0 + off, D * 2);
      const auto* r0 = t < n ? reinterpret_cast<const uint16_t*>(v + static_cast<int64_t>(slots[t]) * s0 + off) : nullptr;
      const auto* r1 = t + 1 < n ? reinterpret_cast<const uint16_t*>(v + static_cast<int64_t>(slots[t + 1]) * s0 + off)
                                 : nullptr;
      uint16_t* o = d16 + static_cast<int64_t>(i) * D * 2;
      for (int d = 0; d < D; ++d) {
        o[2 * d] = r0 ? r0[d] : 0;
        o[2 * d + 1] = r1 ? r1[d] : 0;
      }
    }
  } else {     // [npad][D]
    for (int t = 0; t < n; ++t) {
      if (t + kAhead < n) prefetch_bytes(v + static_cast<int64_t>(slots[t + kAhead]) * s0 + off, D * 2);
      std::memcpy(dst + t * D, v + static_cast<int64_t>(slots[t]) * s0 + off, D * sizeof(bf16));
    }
    std::memset(static_cast<void*>(dst + n * D), 0, static_cast<size_t>(npad - n) * D * sizeof(bf16));
  }
}

// 2^x to bf16 precision (relative error < 5e-5): x clamped to >= -126, f = x - round(x) in
// [-0.5, 0.5], 2^f by its degree-4 Taylor polynomial. Lanes where x < -126 (masked: -inf) give 0.
inline fvec exp2_bf16(fvec x) {
  const fvec lo = fvec::set1(-126.f);
  const fvec xc = vmax(x, lo);
  const fvec n = vround(xc);
  const fvec f = xc - n;
  fvec p = fvec::set1(9.6181291e-3f);                 // ln2^4 / 24
  p = fmadd(p, f, fvec::set1(5.5504109e-2f));         // ln2^3 / 6
  p = fmadd(p, f, fvec::set1(2.4022651e-1f));         // ln2^2 / 2
  p = fmadd(p, f, fvec::set1(6.9314718e-1f));         // ln2
  p = fmadd(p, f, fvec::set1(1.f));
  return zero_below(vscale2(p, n), x, lo);
}

constexpr float kLog2e = 1.44269504088896341f;

// Online softmax over one key block for rows [0, nr) of one head, in base 2. s [nr][kKeys] holds
// q.k; row r is the query at position pos0 + r and sees keys j <= pos0 + r (and j >= pos0 + r -
// window_left when window_left >= 0). m: the running max of c * score (c = scale * log2e; soft-capped
// scores are written in those units, c = 1). Writes p (bf16, 0 where masked and in [n, npad)), updates
// m, scales row r of o ([nr][Dv], the denominator l in column D = Dv - kLCols) by 2^(m_old - m_new)
// so that brgemm can add p.V to it, and adds the row's rounded p to l. bm: scratch of kRows floats.
inline void softmax_block_rows(float* s, bf16* p, float* m, float* o, float* bm, int nr, int Dv, int64_t pos0,
                               int64_t j0, int n, int npad, int64_t window_left, float scale, float cap) {
  const float c = cap > 0.f ? 1.f : scale * kLog2e;
  // 1. mask, soft-cap, each row's new max (-inf: the row sees none of the block)
  for (int r = 0; r < nr; ++r) {
    float* sr = s + r * kKeys;
    const int64_t pos = pos0 + r;
    const int t_hi = static_cast<int>(std::clamp<int64_t>(pos + 1 - j0, 0, n));   // visible: t < t_hi
    const int t_lo = window_left >= 0 ? static_cast<int>(std::clamp<int64_t>(pos - window_left - j0, 0, n)) : 0;
    if (t_lo >= t_hi) {        // p will be 0: max unchanged
      std::fill(sr, sr + npad, kNegInf);
      bm[r] = m[r];
      continue;
    }
    if (cap > 0.f)
      for (int t = t_lo; t < t_hi; ++t) sr[t] = cap * std::tanh(sr[t] * scale / cap) * kLog2e;
    for (int t = 0; t < t_lo; ++t) sr[t] = kNegInf;
    for (int t = t_hi; t < npad; ++t) sr[t] = kNegInf;
    fvec mx = fvec::load(sr);
    for (int t = fvec::N; t < npad; t += fvec::N) mx = vmax(mx, fvec::load(sr + t));
    bm[r] = std::max(m[r], mx.hmax() * c);
  }
  // 2. per row: p = 2^(c * s - m_new); o *= 2^(m_old - m_new) (m_old = -inf: o is still 0)
  const fvec cv = fvec::set1(c);
  for (int r = 0; r < nr; ++r) {
    bf16* pr = p + r * kKeys;
    const float mn = bm[r];
    if (mn == kNegInf) {       // nothing visible yet: p = 0, m and o stay
      std::memset(static_cast<void*>(pr), 0, npad * sizeof(bf16));
      continue;
    }
    const float* sr = s + r * kKeys;
    const fvec neg_mn = fvec::set1(-mn);
    // keys past the row's last visible one are -inf: p = 0 there without the exp
    const int t_hi = static_cast<int>(std::clamp<int64_t>(pos0 + r + 1 - j0, 0, n));
    const int t_end = (t_hi + fvec::N - 1) / fvec::N * fvec::N;
    fvec sum = fvec::zero();   // of the rounded p, so the weights P.V uses sum to exactly l
    for (int t = 0; t < t_end; t += fvec::N)
      sum = sum + store_bf16(exp2_bf16(fmadd(fvec::load(sr + t), cv, neg_mn)), pr + t);
    if (t_end < npad) std::memset(static_cast<void*>(pr + t_end), 0, (npad - t_end) * sizeof(bf16));
    float* orow = o + r * Dv;
    if (mn != m[r]) {
      const fvec alpha = exp2_bf16(fvec::set1(m[r] - mn));
      for (int d = 0; d < Dv; d += fvec::N) (fvec::load(orow + d) * alpha).store(orow + d);
      m[r] = mn;
    }
    orow[Dv - kLCols] += sum.sum();
  }
}

struct BrgemmTask {
  int64_t b, i0, kvh, cost;
};

// Key blocks packed once and shared (an arena): a block that more than one task reads, i.e. one
// that belongs to a request with more than one query block (all its tasks read it), or whose slots
// are the same in several requests (a prefix they share through the radix cache, e.g. a system
// prompt: every request of a batch would otherwise gather and pack the same keys). Blocks are
// compared by their slots: same block index, same length, same slot ids. Each shared block has one
// arena entry per kv head, its K^T then its V; the first task to need it packs it there (state 0 ->
// 1 -> 2), and a task that finds it being packed (1) packs its own copy instead of waiting.
struct SharedBlocks {
  std::vector<int64_t> base, first;   // per request: its entries in `unit` start at base[b], block first[b]
  std::vector<int64_t> unit;          // per (request, block): the arena unit, -1 when packed by its task
  int64_t units = 0;
};

// first key any query row of request b sees (its first row's window start; 0 without a window)
int64_t first_visible_key(int64_t b, int64_t i0, const Args& a) {
  return a.window_left >= 0 ? std::max<int64_t>(0, a.prefix_lens[b] + i0 - a.window_left) : int64_t{0};
}

// Which key blocks go to the arena (SharedBlocks above).
SharedBlocks find_shared_blocks(const Args& a) {
  struct Canon { const int32_t* slots; int n; int users; };
  std::vector<Canon> canon;
  std::unordered_map<uint64_t, std::vector<int64_t>> by_key;
  std::vector<int64_t> canon_of;
  SharedBlocks sb;
  sb.base.resize(a.bs);
  sb.first.resize(a.bs);
  for (int64_t b = 0; b < a.bs; ++b) {
    const int32_t* tok = a.table + a.rows[b] * a.table_s0;
    const int64_t ext = a.qo_indptr[b + 1] - a.qo_indptr[b];
    const int64_t first = first_visible_key(b, 0, a) / kKeys, last = (a.seq_lens[b] + kKeys - 1) / kKeys;
    sb.base[b] = static_cast<int64_t>(canon_of.size());
    sb.first[b] = first;
    for (int64_t i = first; i < last; ++i) {
      const int32_t* sl = tok + i * kKeys;
      const int n = static_cast<int>(std::min<int64_t>(kKeys, a.seq_lens[b] - i * kKeys));
      const uint64_t key = (static_cast<uint64_t>(i) * 0x9E3779B97F4A7C15ull) ^ static_cast<uint32_t>(sl[0]) ^
                           (static_cast<uint64_t>(n) << 40);
      int64_t c = -1;
      for (int64_t cand : by_key[key]) {
        if (canon[cand].n == n && std::memcmp(canon[cand].slots, sl, n * sizeof(int32_t)) == 0) {
          c = cand;
          break;
        }
      }
      if (c < 0) {
        c = static_cast<int64_t>(canon.size());
        canon.push_back({sl, n, 0});
        by_key[key].push_back(c);
      }
      canon[c].users += ext > kRows ? 2 : 1;
      canon_of.push_back(c);
    }
  }
  std::vector<int64_t> unit_of_canon(canon.size(), -1);
  for (size_t c = 0; c < canon.size(); ++c)
    if (canon[c].users >= 2) unit_of_canon[c] = sb.units++;
  sb.unit.resize(canon_of.size());
  for (size_t e = 0; e < canon_of.size(); ++e) sb.unit[e] = unit_of_canon[canon_of[e]];
  return sb;
}

void extend_brgemm_kernel(const Args& a, int D) {
  namespace cpublas = at::native::cpublas;
  const auto* k = static_cast<const bf16*>(a.k);
  const auto* v = static_cast<const bf16*>(a.v);
  const auto* q = static_cast<const bf16*>(a.q);
  auto* out = static_cast<bf16*>(a.out);
  const int G = static_cast<int>(a.G);
  const Micro mk = micro_kernel();
  const bool vnni = mk != Micro::kGemm;
  const int Dv = D + kLCols;
  const int64_t block_elems = static_cast<int64_t>(kKeys) * 2 * D;   // K^T and V of one key block
  std::vector<BrgemmTask> tasks;
  for (int64_t b = 0; b < a.bs; ++b) {
    const int64_t ext = a.qo_indptr[b + 1] - a.qo_indptr[b], p = a.prefix_lens[b];
    for (int64_t i0 = 0; i0 < ext; i0 += kRows) {
      const int64_t nr = std::min<int64_t>(kRows, ext - i0);
      for (int64_t kvh = 0; kvh < a.KVH; ++kvh)
        tasks.push_back({b, i0, kvh, nr * (p + i0 + nr - first_visible_key(b, i0, a))});
    }
  }
  const SharedBlocks shared_blocks = find_shared_blocks(a);
  const int64_t packed_blocks = shared_blocks.units * a.KVH;
  // uninitialized (every block is packed before it is read): a zero fill cost ~4% of a short prefill
  std::unique_ptr<bf16[]> arena(new bf16[static_cast<size_t>(packed_blocks * block_elems)]);
  std::unique_ptr<std::atomic<int>[]> state(new std::atomic<int>[packed_blocks]);   // 0 empty, 1 packing, 2 ready
  for (int64_t i = 0; i < packed_blocks; ++i) state[i].store(0, std::memory_order_relaxed);
  auto pack_block = [&](bf16* dst, int64_t b, int64_t kvh, int64_t j0) {
    const int32_t* tok = a.table + a.rows[b] * a.table_s0;
    const int n = static_cast<int>(std::min<int64_t>(kKeys, a.seq_lens[b] - j0));
    const int npad = (n + kKeyPad - 1) / kKeyPad * kKeyPad;
    pack_k(dst, k, tok + j0, n, npad, D, a.k_s0, kvh * a.k_s1, vnni);
    pack_v(dst + static_cast<int64_t>(kKeys) * D, v, tok + j0, n, npad, D, a.v_s0, kvh * a.v_s1, vnni);
  };
  // the packed block of request b, kv head kvh holding keys from j0 (a multiple of kKeys): the shared
  // copy (packed now if nobody has), or `own` packed now
  auto block_of = [&](int64_t b, int64_t kvh, int64_t j0, bf16* own) -> const bf16* {
    const int64_t u = shared_blocks.unit[shared_blocks.base[b] + j0 / kKeys - shared_blocks.first[b]];
    if (u >= 0) {
      const int64_t i = u * a.KVH + kvh;
      bf16* shared = arena.get() + i * block_elems;
      int st = state[i].load(std::memory_order_acquire);
      if (st == 2) return shared;
      if (st == 0 && state[i].compare_exchange_strong(st, 1, std::memory_order_acq_rel)) {
        pack_block(shared, b, kvh, j0);
        state[i].store(2, std::memory_order_release);
        return shared;
      }
    }
    pack_block(own, b, kvh, j0);
    return own;
  };
  std::stable_sort(tasks.begin(), tasks.end(), [](const BrgemmTask& x, const BrgemmTask& y) { return x.cost > y.cost; });
  const int64_t ntasks = static_cast<int64_t>(tasks.size());
  std::atomic<int64_t> next{0};
  const int64_t nthreads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), ntasks));
  at::parallel_for(0, nthreads, 1, [&](int64_t, int64_t) {
    std::vector<bf16> own(static_cast<size_t>(block_elems)), qs(static_cast<size_t>(G) * kRows * D),
        pb(static_cast<size_t>(G) * kRows * kKeys);
    std::vector<float> s(static_cast<size_t>(G) * kRows * kKeys), o(static_cast<size_t>(G) * kRows * Dv),
        m(G * kRows), bm(kRows);
    for (int64_t ti; (ti = next.fetch_add(1)) < ntasks;) {
      const BrgemmTask& task = tasks[ti];
      const int64_t b = task.b, i0 = task.i0, kvh = task.kvh;
      const int64_t ext = a.qo_indptr[b + 1] - a.qo_indptr[b], p = a.prefix_lens[b];
      const int nr = static_cast<int>(std::min<int64_t>(kRows, ext - i0));
      const int rows = G * nr;       // the G heads' query rows stacked: row g * nr + r
      const int64_t pos0 = p + i0;   // position of the task's first query row
      const bf16* q0 = q + (a.qo_indptr[b] + i0) * a.q_s0 + kvh * G * a.q_s1;   // row 0, head kvh * G
      for (int g = 0; g < G; ++g)
        for (int r = 0; r < nr; ++r)
          std::memcpy(qs.data() + static_cast<int64_t>(g * nr + r) * D, q0 + r * a.q_s0 + g * a.q_s1, D * sizeof(bf16));
      std::fill(o.begin(), o.begin() + static_cast<int64_t>(rows) * Dv, 0.f);
      std::fill(m.begin(), m.begin() + rows, kNegInf);
      // keys [j_begin, k_end) in blocks aligned to kKeys: every key a row sees (rows mask the rest)
      const int64_t j_begin = first_visible_key(b, i0, a) / kKeys * kKeys, k_end = pos0 + nr;
      for (int64_t j0 = j_begin; j0 < k_end; j0 += kKeys) {
        const int n = static_cast<int>(std::min<int64_t>(kKeys, k_end - j0));
        const int npad = (n + kKeyPad - 1) / kKeyPad * kKeyPad;
        const bf16* blk = block_of(b, kvh, j0, own.data());
        const bf16* kp = blk;
        const bf16* vp = blk + static_cast<int64_t>(kKeys) * D;
        block_product(mk, rows, npad, D, D, kKeys, kKeys, false, qs.data(), kp, s.data());
        for (int g = 0; g < G; ++g) {
          const int64_t r0 = static_cast<int64_t>(g) * nr;
          softmax_block_rows(s.data() + r0 * kKeys, pb.data() + r0 * kKeys, m.data() + r0, o.data() + r0 * Dv,
                             bm.data(), nr, Dv, pos0, j0, n, npad, a.window_left, a.scale, a.logit_cap);
        }
        block_product(mk, rows, D, npad, kKeys, D, Dv, true, pb.data(), vp, o.data());
      }
      for (int g = 0; g < G; ++g)
        for (int r = 0; r < nr; ++r) {
          const float* src = o.data() + static_cast<int64_t>(g * nr + r) * Dv;
          const float lr = src[D];   // the softmax denominator
          bf16* dst = out + (a.qo_indptr[b] + i0 + r) * a.o_s0 + (kvh * G + g) * a.o_s1;
          const fvec inv = fvec::set1(lr > 0.f ? 1.f / lr : 0.f);
          for (int d = 0; d < D; d += fvec::N) store_bf16(fvec::load(src + d) * inv, dst + d);
        }
    }
    if (mk == Micro::kAmx) cpublas::brgemm_release(true);
  });
}

}  // namespace

// extend() on the matrix units (see the top of this file): bf16 q, K/V and out; head_dim a multiple of 16.
void extend_brgemm(at::Tensor out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& table, const at::Tensor& rows, const at::Tensor& prefix_lens,
                   const at::Tensor& seq_lens, const at::Tensor& qo_indptr, double scale, int64_t window_left = -1,
                   double logit_cap = 0.0) {
  Args a = make_extend_args(out, q, k, v, table, rows, prefix_lens, seq_lens, qo_indptr, scale, window_left,
                            logit_cap);
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16,
              "extend_brgemm: bf16 q and K/V only");
  const int D = static_cast<int>(q.size(2));
  TORCH_CHECK(D % 16 == 0 && D <= 256, "extend_brgemm: head_dim must be a multiple of 16, at most 256");
  if (a.bs == 0 || q.size(0) == 0) return;
  extend_brgemm_kernel(a, D);
}

// The micro-kernel the block products run on: "amx", "avx512_bf16" or "gemm".
std::string extend_brgemm_micro() { return kMicroNames[static_cast<int>(micro_kernel())]; }

// Tests: runs the products on `name` ("gemm" or the best one, see extend_brgemm_micro) until "auto".
void force_extend_brgemm_micro(const std::string& name) {
  if (name == "auto") return forced_micro.store(-1);
  const int best = static_cast<int>(best_micro_kernel()), gemm = static_cast<int>(Micro::kGemm);
  for (int i : {best, gemm})
    if (name == kMicroNames[i]) return forced_micro.store(i);
  TORCH_CHECK(false, "extend_brgemm micro-kernel '", name, "' does not run here (auto, gemm or ", kMicroNames[best], ")");
}

}  // namespace radixlm_attn
