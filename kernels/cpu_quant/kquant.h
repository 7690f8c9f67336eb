// GGUF k-quants (Q4_K, Q5_K, Q6_K) kept quantized on CPUs with AVX512-VNNI: out[m, n] = sum_k x[m, k] * w[n, k].
//
// ggml's super-blocks of 256 weights per row:
//   Q4_K  144 bytes: fp16 d, fp16 dmin, 12 bytes of 6-bit (scale, min) for 8 sub-blocks of 32, 128 bytes
//         of 4-bit codes;  w = d * sc * q - dmin * m
//   Q5_K  176 bytes: as Q4_K plus 32 bytes of fifth bits;  q is 5-bit
//   Q6_K  210 bytes: 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 scales (sub-blocks of 16),
//         fp16 d;  w = d * sc * (q - 32), q 6-bit
//
// Repacked layout (`repack`): rows in groups of 16 (as quant.h), each group storing its super-blocks
// one after the other along k. A super-block of a group holds the 8 blocks of 32 codes in quant.h's
// layout (4 vectors of 64 bytes per block: row j's quad t in bytes 4j..4j+3, quad t in the low nibbles
// and quad t + 4 in the high nibbles of vector t, so vectors' low nibbles hold weights 0..15 of the
// block and the high nibbles weights 16..31), then:
//   Q4_K  [codes 8 x 256][d 16 x fp16][dmin 16 x fp16][sc 8 x 16 u8][m 8 x 16 u8]      148 bytes/row (file 144)
//   Q5_K  [codes][fifth bits 8 x 64 (quant.h's Q5 masks)][d][dmin][sc][m]              180 bytes/row (file 176)
//   Q6_K  [codes][high 2 bits 8 x 128][d 16 x fp16][sc 16 x 16 int8]                   210 bytes/row (file 210)
// Q6_K's high bits: per block two 64-byte vectors, H0 for quads 0..3 and H1 for quads 4..7; bits
// 2s..2s+1 of a byte of H0 (H1) are the high bits of quad s (s + 4) at that byte's lane.
// Q4_K/Q5_K grow by 4 bytes per 256 weights (+2.8% / +2.3%): the 6-bit scales and mins unpacked to bytes.
//
// Activations: per row and block of 32, dx = max|x| / 127, xq = round(x / dx) int8 (as quant.h), plus
// the integer sums of xq over each half of 16. Block b of row j then adds
//   Q4_K/Q5_K  dx * (d*sc) * sum(u * xq) - (dmin*m) * dx * sum(xq)
//   Q6_K       dx * sum_halves (d*sc_half) * (sum_half(u * xq) - 32 * sum_half(xq))
// the integer sums through vpdpbusd (u unsigned codes, xq signed), the rest in fp32.
#pragma once
#include "quant.h"

namespace radixlm_kquant {

using radixlm_quant::kMR;
using radixlm_quant::kNR;
using radixlm_quant::load_half16;

enum Type : int64_t { Q4_K = 12, Q5_K = 13, Q6_K = 14 };   // ggml's type numbers
constexpr int64_t kQK = 256;    // weights per super-block
constexpr int64_t kQB = 32;     // weights per activation block (and per quant.h code block)

inline bool is_kquant(int64_t type) { return type == Q4_K || type == Q5_K || type == Q6_K; }

inline int64_t file_bytes(int64_t type) { return type == Q4_K ? 144 : type == Q5_K ? 176 : type == Q6_K ? 210 : 0; }

// Byte offsets inside one group super-block.
struct Layout {
  int64_t high, d, dmin, sc, m, total;
};

constexpr Layout layout(int64_t type) {
  // codes: 8 blocks x 256 bytes = 2048
  switch (type) {
    case Q4_K: return {2048, 2048, 2080, 2112, 2240, 2368};
    case Q5_K: return {2048, 2560, 2592, 2624, 2752, 2880};
    case Q6_K: return {2048, 3072, 0, 3104, 0, 3360};
    default: return {0, 0, 0, 0, 0, 0};
  }
}

inline void check_type(int64_t type) {
  TORCH_CHECK(is_kquant(type), "cpu_quant: unsupported GGUF k-quant type ", type);
}

inline int64_t packed_bytes(int64_t type, int64_t n, int64_t k) {
  check_type(type);
  TORCH_CHECK(k % kQK == 0, "cpu_quant: k-quant input size must be a multiple of 256, got ", k);
  return (n + kNR - 1) / kNR * (k / kQK) * layout(type).total;
}

// One file super-block -> unsigned codes u[256], d, dmin (0 for Q6_K), scales (8 for Q4_K/Q5_K, 16 for
// Q6_K, as int) and mins (8; Q4_K/Q5_K only).
inline void decode_superblock(int64_t type, const uint8_t* b, uint8_t* u, uint16_t& d, uint16_t& dmin,
                              int* sc, int* mn) {
  if (type == Q6_K) {
    const uint8_t* ql = b;
    const uint8_t* qh = b + 128;
    const int8_t* s = reinterpret_cast<const int8_t*>(b + 192);
    std::memcpy(&d, b + 208, 2);
    dmin = 0;
    for (int i = 0; i < 16; ++i) sc[i] = s[i];
    for (int w = 0; w < 256; ++w) {
      const int h = w / 128, r = w % 128;
      const int lo = (ql[64 * h + r % 64] >> (4 * (r / 64))) & 0x0F;
      const int hi = (qh[32 * h + r % 32] >> (2 * (r / 32))) & 0x03;
      u[w] = static_cast<uint8_t>(lo | (hi << 4));
    }
    return;
  }
  std::memcpy(&d, b, 2);
  std::memcpy(&dmin, b + 2, 2);
  const uint8_t* s = b + 4;   // 12 bytes: 6-bit scales and mins of the 8 sub-blocks
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 0x3F;
    mn[j] = s[j + 4] & 0x3F;
    sc[j + 4] = (s[j + 8] & 0x0F) | ((s[j] >> 6) << 4);
    mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
  }
  const uint8_t* qh = b + 16;
  const uint8_t* qs = type == Q5_K ? b + 48 : b + 16;
  for (int w = 0; w < 256; ++w) {
    const int j = w / 32, i = w % 32;                       // sub-block j: chunk j / 2, nibble j % 2
    int q = (qs[32 * (j / 2) + i] >> (4 * (j % 2))) & 0x0F;
    if (type == Q5_K) q |= ((qh[i] >> j) & 1) << 4;
    u[w] = static_cast<uint8_t>(q);
  }
}

// raw: the file's bytes for an [n, k] tensor (row-major super-blocks) -> out (packed_bytes, uint8).
inline void repack(const at::Tensor& raw, int64_t type, int64_t n, int64_t k, at::Tensor& out) {
  const int64_t total = packed_bytes(type, n, k), fb = file_bytes(type);
  const Layout L = layout(type);
  const int64_t kb = k / kQK, groups = (n + kNR - 1) / kNR;
  TORCH_CHECK(raw.is_contiguous() && raw.scalar_type() == at::kByte && raw.numel() == n * kb * fb,
              "cpu_quant repack: raw must hold ", n * kb * fb, " bytes");
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == at::kByte && out.numel() == total,
              "cpu_quant repack: out must hold ", total, " bytes");
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    uint8_t u[256];
    int sc[16], mn[8];
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t s = 0; s < kb; ++s) {
        uint8_t* o = dst + (g * kb + s) * L.total;
        std::memset(o, 0, L.total);
        uint16_t* dd = reinterpret_cast<uint16_t*>(o + L.d);
        uint16_t* dm = reinterpret_cast<uint16_t*>(o + L.dmin);
        for (int64_t j = 0; j < kNR; ++j) {
          const int64_t row = g * kNR + j;
          if (row >= n) break;                        // padding rows: zero codes and scales
          uint16_t d, dmin;
          decode_superblock(type, src + (row * kb + s) * fb, u, d, dmin, sc, mn);
          dd[j] = d;
          if (type == Q6_K) {
            for (int h = 0; h < 16; ++h) o[L.sc + 16 * h + j] = static_cast<uint8_t>(static_cast<int8_t>(sc[h]));
          } else {
            dm[j] = dmin;
            for (int h = 0; h < 8; ++h) {
              o[L.sc + 16 * h + j] = static_cast<uint8_t>(sc[h]);
              o[L.m + 16 * h + j] = static_cast<uint8_t>(mn[h]);
            }
          }
          for (int b = 0; b < 8; ++b) {
            uint8_t* codes = o + 256 * b;
            for (int t = 0; t < 8; ++t)
              for (int i = 0; i < 4; ++i) {
                const uint8_t c = u[32 * b + 4 * t + i];
                const int64_t lane = 4 * j + i;
                codes[64 * (t % 4) + lane] |= static_cast<uint8_t>((c & 0x0F) << (t < 4 ? 0 : 4));
                if (type == Q5_K && (c & 0x10))
                  o[L.high + 64 * b + 8 * t + lane / 8] |= static_cast<uint8_t>(1u << (lane % 8));
                if (type == Q6_K)
                  o[L.high + 128 * b + 64 * (t / 4) + lane] |= static_cast<uint8_t>((c >> 4) << (2 * (t % 4)));
              }
          }
        }
      }
  });
}

inline float half_at(const uint8_t* p, int64_t j) {
  uint16_t h;
  std::memcpy(&h, p + 2 * j, 2);
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

// Rows `ids` of a repacked [n, k] weight, dequantized to fp32 exactly as ggml does: [len(ids), k].
inline at::Tensor dequantize_rows(const at::Tensor& packed, int64_t type, int64_t n, int64_t k, const at::Tensor& ids) {
  const int64_t total = packed_bytes(type, n, k);
  const Layout L = layout(type);
  const int64_t kb = k / kQK;
  return radixlm_quant::dequantize_rows_with(packed, total, n, k, ids, [&](const uint8_t* wp, int64_t id, float* row) {
    const int64_t g = id / kNR, j = id % kNR;
    for (int64_t s = 0; s < kb; ++s) {
      const uint8_t* o = wp + (g * kb + s) * L.total;
      const float d = half_at(o + L.d, j);
      const float dmin = type == Q6_K ? 0.f : half_at(o + L.dmin, j);
      float* y = row + s * kQK;
      for (int b = 0; b < 8; ++b)
        for (int t = 0; t < 8; ++t)
          for (int i = 0; i < 4; ++i) {
            const int64_t lane = 4 * j + i;
            int u = (o[256 * b + 64 * (t % 4) + lane] >> (t < 4 ? 0 : 4)) & 0x0F;
            const int w = 32 * b + 4 * t + i;
            if (type == Q6_K) {
              u |= ((o[L.high + 128 * b + 64 * (t / 4) + lane] >> (2 * (t % 4))) & 3) << 4;
              const float dsc = d * static_cast<float>(static_cast<int8_t>(o[L.sc + 16 * (w / 16) + j]));
              y[w] = dsc * static_cast<float>(u - 32);
              continue;
            }
            if (type == Q5_K) u |= ((o[L.high + 64 * b + 8 * t + lane / 8] >> (lane % 8)) & 1) << 4;
            const float dsc = d * static_cast<float>(o[L.sc + 16 * b + j]);
            const float dm = dmin * static_cast<float>(o[L.m + 16 * b + j]);
            y[w] = dsc * static_cast<float>(u) - dm;
          }
    }
  });
}

using radixlm_xquant::QuantizedRows;

inline __m512 load_u8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

inline __m512 load_i8x16(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// Block b (of 8) of a group super-block `o` -> 8 vectors of unsigned codes (quad t in w[t]).
template <int64_t TYPE>
inline void load_codes(const uint8_t* o, int b, __m512i w[8]) {
  constexpr Layout L = layout(TYPE);
  const __m512i low = _mm512_set1_epi8(0x0F);
  const uint8_t* c = o + 256 * b;
  for (int t = 0; t < 4; ++t) {
    const __m512i v = _mm512_loadu_si512(c + 64 * t);
    w[t] = _mm512_and_si512(v, low);
    w[t + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
  }
  if constexpr (TYPE == Q5_K) {
    const __m512i sixteen = _mm512_set1_epi8(0x10);
    for (int t = 0; t < 8; ++t) {
      uint64_t bits;
      std::memcpy(&bits, o + L.high + 64 * b + 8 * t, 8);
      w[t] = _mm512_or_si512(w[t], _mm512_maskz_mov_epi8(_cvtu64_mask64(bits), sixteen));
    }
  }
  if constexpr (TYPE == Q6_K) {
    const __m512i m30 = _mm512_set1_epi8(0x30);
    for (int h = 0; h < 2; ++h) {
      const __m512i v = _mm512_loadu_si512(o + L.high + 128 * b + 64 * h);
      w[4 * h + 0] = _mm512_or_si512(w[4 * h + 0], _mm512_and_si512(_mm512_slli_epi16(v, 4), m30));
      w[4 * h + 1] = _mm512_or_si512(w[4 * h + 1], _mm512_and_si512(_mm512_slli_epi16(v, 2), m30));
      w[4 * h + 2] = _mm512_or_si512(w[4 * h + 2], _mm512_and_si512(v, m30));
      w[4 * h + 3] = _mm512_or_si512(w[4 * h + 3], _mm512_and_si512(_mm512_srli_epi16(v, 2), m30));
    }
  }
}

// Rows [0, MR) of the quantized x against row group g's super-blocks at gp; writes fp32 sums.
template <int64_t TYPE, int MR>
inline void group_tile(const uint8_t* gp, int64_t kb, const int8_t* xq, const float* dx, const int32_t* half,
                       int64_t K, float out[kMR][kNR]) {
  constexpr Layout L = layout(TYPE);
  const int64_t nb = K / kQB;      // activation blocks per row
  __m512 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t s = 0; s < kb; ++s) {
    const uint8_t* o = gp + s * L.total;
    const __m512 d = load_half16(reinterpret_cast<const uint16_t*>(o + L.d));
    __m512 dmin = _mm512_setzero_ps();
    if constexpr (TYPE != Q6_K) dmin = load_half16(reinterpret_cast<const uint16_t*>(o + L.dmin));
    for (int b = 0; b < 8; ++b) {
      const int64_t xb = 8 * s + b;          // activation block index along K
      __m512i w[8];
      load_codes<TYPE>(o, b, w);
      if constexpr (TYPE == Q6_K) {
        const __m512 dlo = _mm512_mul_ps(d, load_i8x16(o + L.sc + 16 * (2 * b)));
        const __m512 dhi = _mm512_mul_ps(d, load_i8x16(o + L.sc + 16 * (2 * b + 1)));
        for (int m = 0; m < MR; ++m) {
          const int32_t* xv = reinterpret_cast<const int32_t*>(xq + m * K + xb * kQB);
          __m512i lo = _mm512_set1_epi32(-32 * half[2 * (m * nb + xb)]);
          __m512i hi = _mm512_set1_epi32(-32 * half[2 * (m * nb + xb) + 1]);
          for (int t = 0; t < 4; ++t) {
            lo = _mm512_dpbusd_epi32(lo, w[t], _mm512_set1_epi32(xv[t]));
            hi = _mm512_dpbusd_epi32(hi, w[t + 4], _mm512_set1_epi32(xv[t + 4]));
          }
          __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(lo), dlo);
          v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), dhi, v);
          acc[m] = _mm512_fmadd_ps(v, _mm512_set1_ps(dx[m * nb + xb]), acc[m]);
        }
      } else {
        const __m512 dsc = _mm512_mul_ps(d, load_u8x16(o + L.sc + 16 * b));
        const __m512 dm = _mm512_mul_ps(dmin, load_u8x16(o + L.m + 16 * b));
        for (int m = 0; m < MR; ++m) {
          const __m512 sum = radixlm_quant::dot_block(w, xq + m * K + xb * kQB);
          const int64_t hb = 2 * (m * nb + xb);
          const float sx = dx[m * nb + xb] * static_cast<float>(half[hb] + half[hb + 1]);
          acc[m] = _mm512_fmadd_ps(sum, _mm512_mul_ps(dsc, _mm512_set1_ps(dx[m * nb + xb])), acc[m]);
          acc[m] = _mm512_fnmadd_ps(dm, _mm512_set1_ps(sx), acc[m]);
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m) _mm512_storeu_ps(out[m], acc[m]);
}

template <int64_t TYPE, typename T>
void run(const QuantizedRows& xr, const uint8_t* wp, int64_t M, int64_t N, int64_t K, T* op) {
  const int64_t kb = K / kQK, nb = K / kQB;
  radixlm_quant::for_each_tile(wp, kb * layout(TYPE).total, M, N, op,
                               [&](auto mr, const uint8_t* gp, int64_t m, float (&sums)[kMR][kNR]) {
                                 group_tile<TYPE, decltype(mr)::value>(gp, kb, xr.q.data() + m * K, xr.dx.data() + m * nb,
                                                                       xr.half.data() + 2 * m * nb, K, sums);
                               });
}

template <typename T>
void dispatch(int64_t type, const QuantizedRows& xr, const uint8_t* wp, int64_t M, int64_t N, int64_t K, T* op) {
  const bool known = radixlm_quant::with_type<Q4_K, Q5_K, Q6_K>(
      type, [&](auto t) { run<decltype(t)::value>(xr, wp, M, N, K, op); });
  TORCH_CHECK(known, "cpu_quant: unsupported GGUF k-quant type ", type);
}

// x [M, K] bf16 or fp32 (contiguous last dim), a weight of any supported GGUF type packed by its
// repack (quant.h's for Q4_0 .. Q8_0, this file's for the k-quants) -> [M, N] in x's dtype.
inline at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t type, int64_t N) {
  if (!is_kquant(type)) return radixlm_quant::linear(x, packed, type, N);
  const int64_t M = x.size(0), K = x.dim() == 2 ? x.size(1) : 0;
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  return radixlm_xquant::linear(x, packed, packed_bytes(type, N, K), N,
                                [&](const QuantizedRows& xr, auto* op) { dispatch(type, xr, wp, M, N, K, op); });
}

}  // namespace radixlm_kquant
