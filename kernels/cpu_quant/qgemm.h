// Prefill (many-row) GEMM for the GGUF weights of quant.h and kquant.h, in their repacked layouts:
// out[m, n] = sum_k x[m, k] * w[n, k], x quantized once per call to int8 per block of 32.
//
// The decode kernels (quant.h / kquant.h `linear`) run 4 rows of x against one 16-row group and
// read x for every group; at a few hundred rows that leaves most of the VNNI throughput unused. Here:
//
// - x is quantized once (as quant.h does: dx = max|x| / 127 per row and block of 32, xq = round(x / dx))
//   together with the integer sums of xq over each 16, which carry the types' zero points and mins;
// - rows of x go in chunks of about kChunkBytes of int8 (so a chunk stays in L2 while every weight
//   tile passes over it); within a chunk the threads split the weight into tiles of NG groups
//   (16 NG output rows), and a tile runs MR rows of x at a time over the whole k: MR x NG int32
//   accumulators, each weight vector (unpacked once) feeding MR vpdpbusd, each broadcast of 4 int8
//   of x feeding NG;
// - the symmetric types fold their zero point into the int32 start value (-z * sum(xq)), so a block
//   of one (row of x, 16 output rows) costs 8 vpdpbusd + one int->fp32 conversion + 2 fp32 ops:
//     Q4_0/Q5_0/Q8_0  acc += (d dx) * sum((u - z) xq)
//     Q4_1/Q5_1       acc += (d dx) * sum(u xq) + m * (dx sum(xq))
//     Q4_K/Q5_K       acc += (d sc dx) * sum(u xq) - (dmin mn) * (dx sum(xq))
//     Q6_K            acc += per half of 16: (d sc dx) * sum((u - 32) xq)
//
// The arithmetic is the decode kernels' (same int8 activations, exact integer block sums, fp32 scale
// products), only the fp32 summation order differs, so outputs agree with `linear` to fp32 rounding.
#pragma once
#include "kquant.h"
#include "quant.h"

namespace radixlm_qgemm {

using radixlm_quant::kNR;
constexpr int64_t kQB = 32;                       // weights per activation block
constexpr int64_t kChunkBytes = 384 * 1024;       // int8 bytes of x per chunk (L2-resident)

// x [M, K] quantized (xquant.h: q, dx, sx, half sums) plus two int32 start values zs per row and
// block of 32 of the block's integer sums: -zero * sum(q) in zs[0] (zs[1] = 0), or with `halves`
// (Q6_K) -zero * the sum over each half of 16.
struct QX : radixlm_xquant::QuantizedRows {
  std::vector<int32_t> zs;
};

template <typename T>
QX quantize(const T* x, int64_t ldx, int64_t M, int64_t K, int32_t zero, bool halves) {
  QX r{radixlm_xquant::quantize_rows(x, ldx, M, K), std::vector<int32_t>(2 * M * (K / kQB))};
  for (size_t i = 0; i < r.zs.size(); i += 2) {
    const int32_t h0 = r.half[i], h1 = r.half[i + 1];
    r.zs[i] = -zero * (halves ? h0 : h0 + h1);
    r.zs[i + 1] = halves ? -zero * h1 : 0;
  }
  return r;
}

// The zero point z of a type's codes (w = d * (u - z)), or 0 for the types with a min.
inline int32_t zero_point(int64_t type) {
  switch (type) {
    case radixlm_quant::Q8_0: return 128;
    case radixlm_quant::Q4_0: return 8;
    case radixlm_quant::Q5_0: return 16;
    case radixlm_kquant::Q6_K: return 32;
    default: return 0;
  }
}

// Where block b (of 32 weights along k) of a group lives, and its code vectors.
template <int64_t TYPE>
struct Block {
  static constexpr bool kK = TYPE == radixlm_kquant::Q4_K || TYPE == radixlm_kquant::Q5_K ||
                             TYPE == radixlm_kquant::Q6_K;
  static constexpr int64_t kZero = TYPE == radixlm_quant::Q8_0 ? 128 : TYPE == radixlm_quant::Q4_0 ? 8
                                 : TYPE == radixlm_quant::Q5_0 ? 16 : TYPE == radixlm_kquant::Q6_K ? 32 : 0;
  static constexpr bool kMin = TYPE == radixlm_quant::Q4_1 || TYPE == radixlm_quant::Q5_1 ||
                               TYPE == radixlm_kquant::Q4_K || TYPE == radixlm_kquant::Q5_K;

  static constexpr int64_t group_bytes_per_block() {   // quant.h: bytes of one block of a group
    return kK ? 0 : radixlm_quant::format(TYPE).group_block_bytes();
  }
  static constexpr int64_t group_bytes(int64_t K) {
    return kK ? K / 256 * radixlm_kquant::layout(TYPE).total : K / kQB * group_bytes_per_block();
  }
  // Code vector of quad t (0..3) of half h (0: weights 0..15 of the block, 1: 16..31) of block b.
  static inline __m512i codes(const uint8_t* gp, int64_t b, int h, int t) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    if constexpr (kK) {
      constexpr radixlm_kquant::Layout L = radixlm_kquant::layout(TYPE);
      const uint8_t* o = gp + (b / 8) * L.total;
      const int64_t bb = b % 8;
      __m512i v = _mm512_loadu_si512(o + 256 * bb + 64 * t);
      v = _mm512_and_si512(h ? _mm512_srli_epi16(v, 4) : v, low);
      if constexpr (TYPE == radixlm_kquant::Q5_K) {
        uint64_t bits;
        std::memcpy(&bits, o + L.high + 64 * bb + 8 * (t + 4 * h), 8);
        v = _mm512_or_si512(v, _mm512_maskz_mov_epi8(_cvtu64_mask64(bits), _mm512_set1_epi8(0x10)));
      }
      if constexpr (TYPE == radixlm_kquant::Q6_K) {
        const __m512i hv = _mm512_loadu_si512(o + L.high + 128 * bb + 64 * h);
        const __m512i m30 = _mm512_set1_epi8(0x30);
        __m512i hi;
        switch (t) {
          case 0: hi = _mm512_slli_epi16(hv, 4); break;
          case 1: hi = _mm512_slli_epi16(hv, 2); break;
          case 2: hi = hv; break;
          default: hi = _mm512_srli_epi16(hv, 2); break;
        }
        v = _mm512_or_si512(v, _mm512_and_si512(hi, m30));
      }
      return v;
    } else {
      const uint8_t* o = gp + b * group_bytes_per_block();
      if constexpr (TYPE == radixlm_quant::Q8_0) return _mm512_loadu_si512(o + 64 * (t + 4 * h));
      __m512i v = _mm512_loadu_si512(o + 64 * t);
      v = _mm512_and_si512(h ? _mm512_srli_epi16(v, 4) : v, low);
      if constexpr (TYPE == radixlm_quant::Q5_0 || TYPE == radixlm_quant::Q5_1) {
        uint64_t bits;
        std::memcpy(&bits, o + 256 + 8 * (t + 4 * h), 8);
        v = _mm512_or_si512(v, _mm512_maskz_mov_epi8(_cvtu64_mask64(bits), _mm512_set1_epi8(0x10)));
      }
      return v;
    }
  }
  // Code vectors of quads t and t + 4 of block b (every type but Q6_K).
  static inline void codes2(const uint8_t* gp, int64_t b, int t, __m512i& lo, __m512i& hi) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    const uint8_t* c;
    const uint8_t* bits = nullptr;
    if constexpr (kK) {
      constexpr radixlm_kquant::Layout L = radixlm_kquant::layout(TYPE);
      const uint8_t* o = gp + (b / 8) * L.total;
      c = o + 256 * (b % 8);
      if constexpr (TYPE == radixlm_kquant::Q5_K) bits = o + L.high + 64 * (b % 8);
    } else {
      c = gp + b * group_bytes_per_block();
      if constexpr (TYPE == radixlm_quant::Q8_0) {
        lo = _mm512_loadu_si512(c + 64 * t);
        hi = _mm512_loadu_si512(c + 64 * (t + 4));
        return;
      }
      if constexpr (TYPE == radixlm_quant::Q5_0 || TYPE == radixlm_quant::Q5_1) bits = c + 256;
    }
    const __m512i v = _mm512_loadu_si512(c + 64 * t);
    lo = _mm512_and_si512(v, low);
    hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    if (bits != nullptr) {
      uint64_t b0, b1;
      std::memcpy(&b0, bits + 8 * t, 8);
      std::memcpy(&b1, bits + 8 * (t + 4), 8);
      const __m512i sixteen = _mm512_set1_epi8(0x10);
      lo = _mm512_or_si512(lo, _mm512_maskz_mov_epi8(_cvtu64_mask64(b0), sixteen));
      hi = _mm512_or_si512(hi, _mm512_maskz_mov_epi8(_cvtu64_mask64(b1), sixteen));
    }
  }
  // Per output row of the group: the scale of sum(u xq) (half h, or the whole block when h < 0) and the
  // coefficient of dx * sum(xq) (mins; zero for the symmetric types).
  static inline __m512 scale(const uint8_t* gp, int64_t b, int h) {
    if constexpr (kK) {
      constexpr radixlm_kquant::Layout L = radixlm_kquant::layout(TYPE);
      const uint8_t* o = gp + (b / 8) * L.total;
      const __m512 d = radixlm_quant::load_half16(reinterpret_cast<const uint16_t*>(o + L.d));
      if constexpr (TYPE == radixlm_kquant::Q6_K)
        return _mm512_mul_ps(d, radixlm_kquant::load_i8x16(o + L.sc + 16 * (2 * (b % 8) + h)));
      else
        return _mm512_mul_ps(d, radixlm_kquant::load_u8x16(o + L.sc + 16 * (b % 8)));
    } else {
      constexpr radixlm_quant::Format f = radixlm_quant::format(TYPE);
      const uint8_t* o = gp + b * group_bytes_per_block();
      return radixlm_quant::load_half16(reinterpret_cast<const uint16_t*>(o + f.code_bytes + f.high_bytes));
    }
  }
  static inline __m512 min_coef(const uint8_t* gp, int64_t b) {
    if constexpr (kK) {
      constexpr radixlm_kquant::Layout L = radixlm_kquant::layout(TYPE);
      const uint8_t* o = gp + (b / 8) * L.total;
      const __m512 dmin = radixlm_quant::load_half16(reinterpret_cast<const uint16_t*>(o + L.dmin));
      return _mm512_mul_ps(dmin, radixlm_kquant::load_u8x16(o + L.m + 16 * (b % 8)));   // subtracted
    } else {
      constexpr radixlm_quant::Format f = radixlm_quant::format(TYPE);
      const uint8_t* o = gp + b * group_bytes_per_block();
      return radixlm_quant::load_half16(reinterpret_cast<const uint16_t*>(o + f.code_bytes + f.high_bytes) + kNR);
    }
  }
};

// Rows [0, MR) of the quantized x chunk (q at xq, row stride K; per-block arrays at dx/sx/h) against
// NG consecutive groups starting at gp (group stride gbytes) -> out rows, columns n0 .. n0 + 16 NG.
template <int64_t TYPE, int MR, int NG, typename T>
inline void tile(const uint8_t* gp, int64_t gbytes, const int8_t* xq, const float* dx, const float* sx,
                 const int32_t* zs, int64_t K, T* out, int64_t ldo, int64_t n0, int64_t N) {
  using B = Block<TYPE>;
  const int64_t nb = K / kQB;
  __m512 acc[MR][NG];
  for (int m = 0; m < MR; ++m)
    for (int g = 0; g < NG; ++g) acc[m][g] = _mm512_setzero_ps();
  constexpr bool kHalves = TYPE == radixlm_kquant::Q6_K;     // a scale per 16 weights
  for (int64_t b = 0; b < nb; ++b) {
    __m512i s[MR][NG];
    if constexpr (!kHalves) {        // one pass: the vector of quad t holds quad t + 4 in its high nibbles
      for (int m = 0; m < MR; ++m) {
        const __m512i start = B::kZero != 0 ? _mm512_set1_epi32(zs[2 * (m * nb + b)]) : _mm512_setzero_si512();
        for (int g = 0; g < NG; ++g) s[m][g] = start;
      }
      for (int t = 0; t < 4; ++t) {
        __m512i lo[NG], hi[NG];
        for (int g = 0; g < NG; ++g) B::codes2(gp + g * gbytes, b, t, lo[g], hi[g]);
        for (int m = 0; m < MR; ++m) {
          const int32_t* xv = reinterpret_cast<const int32_t*>(xq + m * K + b * kQB);
          const __m512i xl = _mm512_set1_epi32(xv[t]), xh = _mm512_set1_epi32(xv[t + 4]);
          for (int g = 0; g < NG; ++g) {
            s[m][g] = _mm512_dpbusd_epi32(s[m][g], lo[g], xl);
            s[m][g] = _mm512_dpbusd_epi32(s[m][g], hi[g], xh);
          }
        }
      }
      __m512 sc[NG];
      for (int g = 0; g < NG; ++g) sc[g] = B::scale(gp + g * gbytes, b, 0);
      for (int m = 0; m < MR; ++m) {
        const __m512 dxm = _mm512_set1_ps(dx[m * nb + b]);
        for (int g = 0; g < NG; ++g)
          acc[m][g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[m][g]), _mm512_mul_ps(sc[g], dxm), acc[m][g]);
      }
    } else {
      for (int h = 0; h < 2; ++h) {    // Q6_K: a scale per 16 weights (a half block)
        for (int m = 0; m < MR; ++m) {
          const __m512i start = _mm512_set1_epi32(zs[2 * (m * nb + b) + h]);
          for (int g = 0; g < NG; ++g) s[m][g] = start;
        }
        for (int t = 0; t < 4; ++t) {
          __m512i w[NG];
          for (int g = 0; g < NG; ++g) w[g] = B::codes(gp + g * gbytes, b, h, t);
          for (int m = 0; m < MR; ++m) {
            const int32_t* xv = reinterpret_cast<const int32_t*>(xq + m * K + b * kQB);
            const __m512i xb = _mm512_set1_epi32(xv[4 * h + t]);
            for (int g = 0; g < NG; ++g) s[m][g] = _mm512_dpbusd_epi32(s[m][g], w[g], xb);
          }
        }
        __m512 sc[NG];
        for (int g = 0; g < NG; ++g) sc[g] = B::scale(gp + g * gbytes, b, h);
        for (int m = 0; m < MR; ++m) {
          const __m512 dxm = _mm512_set1_ps(dx[m * nb + b]);
          for (int g = 0; g < NG; ++g)
            acc[m][g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[m][g]), _mm512_mul_ps(sc[g], dxm), acc[m][g]);
        }
      }
    }
    if constexpr (B::kMin) {
      __m512 mc[NG];
      for (int g = 0; g < NG; ++g) mc[g] = B::min_coef(gp + g * gbytes, b);
      for (int m = 0; m < MR; ++m) {
        const __m512 sxm = _mm512_set1_ps(sx[m * nb + b]);
        for (int g = 0; g < NG; ++g)
          acc[m][g] = B::kK ? _mm512_fnmadd_ps(mc[g], sxm, acc[m][g]) : _mm512_fmadd_ps(mc[g], sxm, acc[m][g]);
      }
    }
  }
  for (int g = 0; g < NG; ++g) {
    const int64_t n = n0 + kNR * g;
    if (n >= N) break;
    const int64_t cols = std::min<int64_t>(kNR, N - n);
    for (int m = 0; m < MR; ++m) {
      alignas(64) float v[kNR];
      _mm512_store_ps(v, acc[m][g]);
      radixlm_quant::store_row(v, out + m * ldo + n, cols);
    }
  }
}

template <int64_t TYPE, int MR, int NG, typename T>
void run(const QX& xr, const uint8_t* wp, int64_t M, int64_t N, int64_t K, T* op) {
  const int64_t nb = K / kQB, groups = (N + kNR - 1) / kNR, gbytes = Block<TYPE>::group_bytes(K);
  const int64_t tiles = (groups + NG - 1) / NG;
  const int64_t chunk = std::max<int64_t>(MR, kChunkBytes / K / MR * MR);
  const int64_t threads = at::get_num_threads();
  for (int64_t c0 = 0; c0 < M; c0 += chunk) {
    const int64_t c1 = std::min(M, c0 + chunk), steps = (c1 - c0 + MR - 1) / MR;
    // work items: (tile, slice of the chunk's rows); the rows are split only when there are too few
    // tiles to keep every thread busy (a small N)
    const int64_t slices = std::min(steps, std::max<int64_t>(1, (2 * threads + tiles - 1) / tiles));
    const int64_t items = tiles * slices;
    at::parallel_for(0, items, (items + threads - 1) / threads, [&](int64_t i0, int64_t i1) {
      for (int64_t it = i0; it < i1; ++it) {
        const int64_t t = it / slices, sl = it % slices;
        const int64_t g0 = t * NG, ng = std::min<int64_t>(NG, groups - g0);
        const uint8_t* gp = wp + g0 * gbytes;
        const int64_t m_lo = c0 + steps * sl / slices * MR, m_hi = std::min(c1, c0 + steps * (sl + 1) / slices * MR);
        for (int64_t m = m_lo; m < m_hi; m += MR) {
          const int64_t mr = std::min<int64_t>(MR, m_hi - m);
          const int8_t* xq = xr.q.data() + m * K;
          const float* dx = xr.dx.data() + m * nb;
          const float* sx = xr.sx.data() + m * nb;
          const int32_t* zs = xr.zs.data() + 2 * m * nb;
          T* o = op + m * N;
          const int64_t n0 = g0 * kNR;
          if (mr == MR && ng == NG) { tile<TYPE, MR, NG>(gp, gbytes, xq, dx, sx, zs, K, o, N, n0, N); continue; }
          // edges: one row of x / one group at a time
          for (int64_t i = 0; i < mr; ++i)
            for (int64_t g = 0; g < ng; ++g)
              tile<TYPE, 1, 1>(gp + g * gbytes, gbytes, xq + i * K, dx + i * nb, sx + i * nb, zs + 2 * i * nb, K,
                               o + i * N, N, n0 + g * kNR, N);
        }
      }
    });
  }
}

// fp32 -> bf16, round to nearest even (finite values; AVX512F only, no AVX512-BF16 needed).
inline __m256i to_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

// Rows [16 g0, 16 g1) (clipped to N) of the weight dequantized to bf16: out [rows, K], row-major.
// The same values as dequantize_rows / k_dequantize_rows, rounded to bf16 (nearest even).
template <int64_t TYPE>
void dequantize_groups(const uint8_t* wp, int64_t N, int64_t K, int64_t g0, int64_t g1, c10::BFloat16* out) {
  using B = Block<TYPE>;
  const int64_t nb = K / kQB, gbytes = B::group_bytes(K);
  at::parallel_for(g0, g1, 1, [&](int64_t a, int64_t e) {
    __m512i idx[4];
    for (int c = 0; c < 4; ++c) {   // lane l of a 16-byte chunk c of codes belongs to row 4c + l / 4
      alignas(64) int32_t v[16];
      for (int l = 0; l < 16; ++l) v[l] = 4 * c + l / 4;
      idx[c] = _mm512_load_si512(v);
    }
    for (int64_t g = a; g < e; ++g) {
      const uint8_t* gp = wp + g * gbytes;
      const int64_t rows = std::min<int64_t>(kNR, N - g * kNR);
      c10::BFloat16* og = out + (g - g0) * kNR * K;
      for (int64_t b = 0; b < nb; ++b)
        for (int h = 0; h < 2; ++h) {
          const __m512 sc = B::scale(gp, b, h);
          __m512 off;
          if constexpr (B::kMin) off = B::kK ? _mm512_sub_ps(_mm512_setzero_ps(), B::min_coef(gp, b)) : B::min_coef(gp, b);
          else off = _mm512_mul_ps(sc, _mm512_set1_ps(-static_cast<float>(B::kZero)));
          for (int t = 0; t < 4; ++t) {
            const __m512i u = B::codes(gp, b, h, t);
            for (int c = 0; c < 4; ++c) {
              const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(u, c)));
              const __m512 v = _mm512_add_ps(_mm512_mul_ps(w, _mm512_permutexvar_ps(idx[c], sc)),
                                             _mm512_permutexvar_ps(idx[c], off));
              alignas(32) uint64_t q[4];
              _mm256_store_si256(reinterpret_cast<__m256i*>(q), to_bf16(v));
              for (int r = 0; r < 4 && 4 * c + r < rows; ++r)
                std::memcpy(og + (4 * c + r) * K + b * kQB + 16 * h + 4 * t, &q[r], 8);
            }
          }
        }
    }
  });
}

// dequantize_bf16(packed, type, N, K, g0, g1) -> [min(16 g1, N) - 16 g0, K] bf16: the rows of groups
// [g0, g1), for a prefill that multiplies tiles of the weight in bf16 (quant_linear.py's "dequant").
inline at::Tensor dequantize_bf16(const at::Tensor& packed, int64_t type, int64_t N, int64_t K, int64_t g0, int64_t g1) {
  const int64_t want = radixlm_kquant::is_kquant(type) ? radixlm_kquant::packed_bytes(type, N, K)
                                                       : radixlm_quant::packed_bytes(type, N, K);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.numel() == want,
              "cpu_quant dequantize_bf16: the packed weight does not match ", N, " x ", K);
  const int64_t groups = (N + kNR - 1) / kNR;
  TORCH_CHECK(0 <= g0 && g0 < g1 && g1 <= groups, "cpu_quant dequantize_bf16: groups [", g0, ", ", g1,
              ") out of range [0, ", groups, ")");
  at::Tensor out = at::empty({std::min(g1 * kNR, N) - g0 * kNR, K}, packed.options().dtype(at::kBFloat16));
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  switch (type) {
    case radixlm_quant::Q8_0: dequantize_groups<radixlm_quant::Q8_0>(wp, N, K, g0, g1, op); break;
    case radixlm_quant::Q4_0: dequantize_groups<radixlm_quant::Q4_0>(wp, N, K, g0, g1, op); break;
    case radixlm_quant::Q4_1: dequantize_groups<radixlm_quant::Q4_1>(wp, N, K, g0, g1, op); break;
    case radixlm_quant::Q5_0: dequantize_groups<radixlm_quant::Q5_0>(wp, N, K, g0, g1, op); break;
    case radixlm_quant::Q5_1: dequantize_groups<radixlm_quant::Q5_1>(wp, N, K, g0, g1, op); break;
    case radixlm_kquant::Q4_K: dequantize_groups<radixlm_kquant::Q4_K>(wp, N, K, g0, g1, op); break;
    case radixlm_kquant::Q5_K: dequantize_groups<radixlm_kquant::Q5_K>(wp, N, K, g0, g1, op); break;
    case radixlm_kquant::Q6_K: dequantize_groups<radixlm_kquant::Q6_K>(wp, N, K, g0, g1, op); break;
    default: TORCH_CHECK(false, "cpu_quant dequantize_bf16: unsupported GGUF type ", type);
  }
  return out;
}

template <typename T>
void dispatch(int64_t type, const QX& xr, const uint8_t* wp, int64_t M, int64_t N, int64_t K, T* op) {
  switch (type) {
    case radixlm_quant::Q8_0: return run<radixlm_quant::Q8_0, 3, 4>(xr, wp, M, N, K, op);
    case radixlm_quant::Q4_0: return run<radixlm_quant::Q4_0, 3, 4>(xr, wp, M, N, K, op);
    case radixlm_quant::Q4_1: return run<radixlm_quant::Q4_1, 3, 4>(xr, wp, M, N, K, op);
    case radixlm_quant::Q5_0: return run<radixlm_quant::Q5_0, 3, 4>(xr, wp, M, N, K, op);
    case radixlm_quant::Q5_1: return run<radixlm_quant::Q5_1, 3, 4>(xr, wp, M, N, K, op);
    case radixlm_kquant::Q4_K: return run<radixlm_kquant::Q4_K, 4, 2>(xr, wp, M, N, K, op);
    case radixlm_kquant::Q5_K: return run<radixlm_kquant::Q5_K, 4, 2>(xr, wp, M, N, K, op);
    case radixlm_kquant::Q6_K: return run<radixlm_kquant::Q6_K, 4, 2>(xr, wp, M, N, K, op);
    default: TORCH_CHECK(false, "cpu_quant gemm: unsupported GGUF type ", type);
  }
}

// x [M, K] bf16 or fp32 (contiguous last dim), packed from repack()/k_repack() -> [M, N] in x's dtype.
inline at::Tensor gemm(const at::Tensor& x, const at::Tensor& packed, int64_t type, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat),
              "cpu_quant gemm: x must be 2-D bf16 or fp32 with a contiguous last dim");
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t want = radixlm_kquant::is_kquant(type) ? radixlm_kquant::packed_bytes(type, N, K)
                                                       : radixlm_quant::packed_bytes(type, N, K);
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.numel() == want,
              "cpu_quant gemm: the packed weight does not match x's ", K, " features and ", N, " outputs");
  at::Tensor out = at::empty({M, N}, x.options());
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  if (x.scalar_type() == at::kBFloat16) {
    const QX xr = quantize(x.data_ptr<c10::BFloat16>(), x.stride(0), M, K, zero_point(type), type == radixlm_kquant::Q6_K);
    dispatch(type, xr, wp, M, N, K, out.data_ptr<c10::BFloat16>());
  } else {
    const QX xr = quantize(x.data_ptr<float>(), x.stride(0), M, K, zero_point(type), type == radixlm_kquant::Q6_K);
    dispatch(type, xr, wp, M, N, K, out.data_ptr<float>());
  }
  return out;
}

}  // namespace radixlm_qgemm

