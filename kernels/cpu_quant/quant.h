// GGUF block-quantized linear layers on CPUs with AVX512-VNNI: out[m, n] = sum_k x[m, k] * w[n, k].
//
// Types (ggml's block formats, 32 weights per block, fp16 scale d, optional fp16 min m):
//   Q8_0  w = d * q            q int8            34 bytes / 32 weights
//   Q4_0  w = d * (q - 8)      q 4-bit           18
//   Q4_1  w = d * q + m        q 4-bit           20
//   Q5_0  w = d * (q - 16)     q 5-bit           22
//   Q5_1  w = d * q + m        q 5-bit           24
// Every type is stored as an unsigned code u and an affine map w = d * u + c, where c = m for the
// *_1 types and c = -z * d for the others (z = 128 for Q8_0, whose codes are stored as q + 128).
//
// Repacked layout (`repack`), same bytes per weight as the file: the rows go in groups of 16 and
// each group stores its blocks one after the other, block by block along k:
//
//   [codes][high bits (Q5 only)][16 x fp16 d][16 x fp16 m (*_1 only)]
//
// codes, for the k-quad t (k = 4t .. 4t+3 of the block, t < 8) of row j: bytes 4j .. 4j+3 of one
// 64-byte vector, which is what vpdpbusd multiplies against a broadcast quad of int8 activations
// (each 32-bit lane j sums 4 products into row j's int32 sum). Q8_0 stores 8 such vectors; the
// 4-bit types store 4, quad t in the low nibbles and quad t + 4 in the high nibbles of vector t.
// Q5's fifth bits are 8 64-bit masks, one per quad vector (bit 4j + i of mask t = bit 4 of the code).
//
// The activations are quantized once per call (`quantize_rows`): per row and block, dx = max|x| / 127
// and xq = round(x / dx) in int8, with sx = dx * sum(xq). A block then adds
//   dx * (d * sum(u * xq)) + c * sx
// to row j's fp32 sum. The int8 rounding of x is the only approximation (llama.cpp's Q8 activations
// make the same); `linear` rounds the fp32 sums to the output dtype once.
//
// Threads take contiguous ranges of row groups; inside a group, rows of x go kMR at a time over the
// whole k, so each weight byte is read from memory once per call and from L1/L2 once per kMR rows.
#pragma once
#include <ATen/Parallel.h>
#include <torch/extension.h>
#include <immintrin.h>
#include "xquant.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace radixlm_quant {

enum Type : int64_t { Q8_0 = 8, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7 };   // ggml's type numbers
constexpr int64_t kQK = 32;      // weights per block
constexpr int64_t kNR = 16;      // rows per group (16 int32 lanes)
constexpr int kMR = 4;           // rows of x per pass over a group

struct Format {
  int64_t code_bytes, high_bytes, has_min, zero, file_bytes;   // per block of one row: file_bytes
  constexpr int64_t group_block_bytes() const { return code_bytes + high_bytes + 2 * kNR * (1 + has_min); }
};

constexpr Format format(int64_t type) {
  switch (type) {
    case Q8_0: return {512, 0, 0, 128, 34};
    case Q4_0: return {256, 0, 0, 8, 18};
    case Q4_1: return {256, 0, 1, 0, 20};
    case Q5_0: return {256, 64, 0, 16, 22};
    case Q5_1: return {256, 64, 1, 0, 24};
    default: return {0, 0, 0, 0, 0};
  }
}

inline Format checked_format(int64_t type) {
  const Format f = format(type);
  TORCH_CHECK(f.file_bytes != 0, "cpu_quant: unsupported GGUF type ", type);
  return f;
}

inline int64_t packed_bytes(int64_t type, int64_t n, int64_t k) {
  TORCH_CHECK(k % kQK == 0, "cpu_quant: the input size must be a multiple of 32, got ", k);
  return (n + kNR - 1) / kNR * (k / kQK) * checked_format(type).group_block_bytes();
}

// The unsigned codes u[32] and (d, m) of one file block (m = 0 for the symmetric types).
inline void decode_block(int64_t type, const uint8_t* b, uint8_t* u, uint16_t& d, uint16_t& m) {
  std::memcpy(&d, b, 2);
  m = 0;
  if (type == Q8_0) {
    for (int i = 0; i < 32; ++i) u[i] = static_cast<uint8_t>(static_cast<int8_t>(b[2 + i]) + 128);
    return;
  }
  const Format f = format(type);
  if (f.has_min) std::memcpy(&m, b + 2, 2);
  const uint8_t* p = b + 2 + 2 * f.has_min;
  uint32_t qh = 0;
  if (f.high_bytes) { std::memcpy(&qh, p, 4); p += 4; }
  for (int i = 0; i < 16; ++i) {   // byte i: weight i in the low nibble, weight i + 16 in the high
    u[i] = (p[i] & 0x0F) | (((qh >> i) & 1u) << 4);
    u[i + 16] = (p[i] >> 4) | (((qh >> (i + 16)) & 1u) << 4);
  }
}

// raw: the file's bytes for an [n, k] tensor (row-major blocks) -> out (packed_bytes, uint8).
inline void repack(const at::Tensor& raw, int64_t type, int64_t n, int64_t k, at::Tensor& out) {
  const Format f = checked_format(type);
  const int64_t kb = k / kQK, groups = (n + kNR - 1) / kNR, gbb = f.group_block_bytes();
  TORCH_CHECK(raw.is_contiguous() && raw.scalar_type() == at::kByte && raw.numel() == n * kb * f.file_bytes,
              "cpu_quant repack: raw must hold ", n * kb * f.file_bytes, " bytes");
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == at::kByte && out.numel() == packed_bytes(type, n, k),
              "cpu_quant repack: out must hold ", packed_bytes(type, n, k), " bytes");
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    uint8_t u[32];
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t b = 0; b < kb; ++b) {
        uint8_t* o = dst + (g * kb + b) * gbb;
        std::memset(o, 0, gbb);
        uint8_t* high = o + f.code_bytes;
        uint16_t* dd = reinterpret_cast<uint16_t*>(high + f.high_bytes);
        uint16_t* mm = dd + kNR;
        for (int64_t j = 0; j < kNR; ++j) {
          const int64_t row = g * kNR + j;
          if (row >= n) break;                      // padding rows: zero codes and scales
          uint16_t d, m;
          decode_block(type, src + (row * kb + b) * f.file_bytes, u, d, m);
          dd[j] = d;
          if (f.has_min) mm[j] = m;
          for (int t = 0; t < 8; ++t)
            for (int i = 0; i < 4; ++i) {
              const uint8_t c = u[4 * t + i];
              const int64_t lane = 4 * j + i;
              if (type == Q8_0) { o[64 * t + lane] = c; continue; }
              o[64 * (t % 4) + lane] |= static_cast<uint8_t>((c & 0x0F) << (t < 4 ? 0 : 4));
              if (f.high_bytes && (c & 0x10)) high[8 * t + lane / 8] |= static_cast<uint8_t>(1u << (lane % 8));
            }
        }
      }
  });
}

// dequantize_rows for both headers (kquant.h's too): checks that `packed` holds `nbytes` for an [n, k]
// weight and that every id is a row of it, then calls row(wp, id, y) in parallel to write the k fp32
// weights of row `id` of the packed weight at wp into y -> [len(ids), k].
template <typename Row>
at::Tensor dequantize_rows_with(const at::Tensor& packed, int64_t nbytes, int64_t n, int64_t k, const at::Tensor& ids,
                                Row&& row) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.is_contiguous() && packed.numel() == nbytes,
              "cpu_quant dequantize_rows: the packed weight does not match ", n, " x ", k);
  TORCH_CHECK(ids.scalar_type() == at::kLong && ids.dim() == 1, "cpu_quant dequantize_rows: ids must be 1-D int64");
  const at::Tensor idc = ids.contiguous();
  const int64_t rows = idc.numel();
  at::Tensor out = at::empty({rows, k}, packed.options().dtype(at::kFloat));
  const int64_t* ip = idc.data_ptr<int64_t>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(ip[r] >= 0 && ip[r] < n, "cpu_quant dequantize_rows: row ", ip[r], " out of range [0, ", n, ")");
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) row(wp, ip[r], op + r * k);
  });
  return out;
}

// Rows `ids` of a repacked [n, k] weight, dequantized to fp32 exactly as ggml does: [len(ids), k].
inline at::Tensor dequantize_rows(const at::Tensor& packed, int64_t type, int64_t n, int64_t k, const at::Tensor& ids) {
  const Format f = checked_format(type);
  const int64_t kb = k / kQK, gbb = f.group_block_bytes();
  return dequantize_rows_with(packed, packed_bytes(type, n, k), n, k, ids, [&](const uint8_t* wp, int64_t id, float* y) {
    const int64_t g = id / kNR, j = id % kNR;
    for (int64_t b = 0; b < kb; ++b) {
      const uint8_t* o = wp + (g * kb + b) * gbb;
      const uint16_t* dd = reinterpret_cast<const uint16_t*>(o + f.code_bytes + f.high_bytes);
      const float d = static_cast<float>(c10::Half(dd[j], c10::Half::from_bits()));
      const float c = f.has_min ? static_cast<float>(c10::Half(dd[kNR + j], c10::Half::from_bits()))
                                : -static_cast<float>(f.zero) * d;
      for (int t = 0; t < 8; ++t)
        for (int i = 0; i < 4; ++i) {
          const int64_t lane = 4 * j + i;
          int u = type == Q8_0 ? o[64 * t + lane] : (o[64 * (t % 4) + lane] >> (t < 4 ? 0 : 4)) & 0x0F;
          if (f.high_bytes) u |= ((o[f.code_bytes + 8 * t + lane / 8] >> (lane % 8)) & 1) << 4;
          y[b * kQK + 4 * t + i] = d * static_cast<float>(u) + c;
        }
    }
  });
}

using radixlm_xquant::QuantizedRows;


inline __m512 load_half16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Row j's sum over one block of 32 of u * xq, for the 16 rows of a group as fp32 lanes: w the block's
// unsigned codes as load_codes gives them, xb the block's 32 int8 activations (broadcast a quad at a time).
inline __m512 dot_block(const __m512i w[8], const int8_t* xb) {
  const int32_t* quads = reinterpret_cast<const int32_t*>(xb);
  __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
  for (int t = 0; t < 8; t += 2) {
    s0 = _mm512_dpbusd_epi32(s0, w[t], _mm512_set1_epi32(quads[t]));
    s1 = _mm512_dpbusd_epi32(s1, w[t + 1], _mm512_set1_epi32(quads[t + 1]));
  }
  return _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
}

// Unpacks block `o` of a group into 8 vectors of unsigned codes (quad t in w[t]).
template <int64_t TYPE>
inline void load_codes(const uint8_t* o, __m512i w[8]) {
  if constexpr (TYPE == Q8_0) {
    for (int t = 0; t < 8; ++t) w[t] = _mm512_loadu_si512(o + 64 * t);
  } else {
    const __m512i low = _mm512_set1_epi8(0x0F);
    for (int t = 0; t < 4; ++t) {
      const __m512i v = _mm512_loadu_si512(o + 64 * t);
      w[t] = _mm512_and_si512(v, low);
      w[t + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
    if constexpr (TYPE == Q5_0 || TYPE == Q5_1) {
      const __m512i sixteen = _mm512_set1_epi8(0x10);
      for (int t = 0; t < 8; ++t) {
        uint64_t bits;
        std::memcpy(&bits, o + 256 + 8 * t, 8);
        w[t] = _mm512_or_si512(w[t], _mm512_maskz_mov_epi8(_cvtu64_mask64(bits), sixteen));
      }
    }
  }
}

// Rows [0, MR) of the quantized x against row group `g` (output rows 16g .. 16g + 15); writes fp32 sums.
template <int64_t TYPE, int MR>
inline void group_tile(const uint8_t* gp, int64_t kb, const int8_t* xq, const float* dx, const float* sx,
                       int64_t K, float out[kMR][kNR]) {
  constexpr Format f = format(TYPE);
  constexpr int64_t gbb = f.group_block_bytes();
  __m512 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < kb; ++b) {
    const uint8_t* o = gp + b * gbb;
    __m512i w[8];
    load_codes<TYPE>(o, w);
    const uint16_t* dd = reinterpret_cast<const uint16_t*>(o + f.code_bytes + f.high_bytes);
    const __m512 d = load_half16(dd);
    const __m512 c = f.has_min != 0 ? load_half16(dd + kNR) : _mm512_mul_ps(d, _mm512_set1_ps(-float(f.zero)));
    for (int m = 0; m < MR; ++m) {
      const __m512 s = dot_block(w, xq + m * K + b * kQK);
      acc[m] = _mm512_fmadd_ps(s, _mm512_mul_ps(d, _mm512_set1_ps(dx[m * kb + b])), acc[m]);
      acc[m] = _mm512_fmadd_ps(c, _mm512_set1_ps(sx[m * kb + b]), acc[m]);
    }
  }
  for (int m = 0; m < MR; ++m) _mm512_storeu_ps(out[m], acc[m]);
}

template <typename T>
inline void store_row(const float* v, T* dst, int64_t count) {
  for (int64_t j = 0; j < count; ++j) dst[j] = static_cast<T>(v[j]);
}

// The GEMV's loops over the output, for both headers (kquant.h's too): threads take contiguous ranges
// of row groups; for group g (gbytes bytes at gp = wp + g * gbytes) and each run of MR <= kMR rows of
// x from row m, tile(std::integral_constant<int, MR>{}, gp, m, sums) writes the fp32 sums[MR][kNR],
// which are then stored to rows m .. m + MR - 1, columns 16g .. 16g + 15 (those < N) of op [M, N].
template <typename T, typename Tile>
void for_each_tile(const uint8_t* wp, int64_t gbytes, int64_t M, int64_t N, T* op, Tile&& tile) {
  const int64_t groups = (N + kNR - 1) / kNR;
  const int64_t threads = at::get_num_threads();
  at::parallel_for(0, groups, (groups + threads - 1) / threads, [&](int64_t g0, int64_t g1) {
    float sums[kMR][kNR];
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t n0 = g * kNR, rows = std::min(kNR, N - n0);
      const uint8_t* gp = wp + g * gbytes;
      for (int64_t m = 0; m < M; m += kMR) {
        const int64_t mr = std::min<int64_t>(kMR, M - m);
        switch (mr) {
          case 4: tile(std::integral_constant<int, 4>{}, gp, m, sums); break;
          case 3: tile(std::integral_constant<int, 3>{}, gp, m, sums); break;
          case 2: tile(std::integral_constant<int, 2>{}, gp, m, sums); break;
          default: tile(std::integral_constant<int, 1>{}, gp, m, sums); break;
        }
        for (int64_t i = 0; i < mr; ++i) store_row(sums[i], op + (m + i) * N + n0, rows);
      }
    }
  });
}

template <int64_t TYPE, typename T>
void run(const QuantizedRows& xr, const uint8_t* wp, int64_t M, int64_t N, int64_t K, T* op) {
  const int64_t kb = K / kQK;
  for_each_tile(wp, kb * format(TYPE).group_block_bytes(), M, N, op,
                [&](auto mr, const uint8_t* gp, int64_t m, float (&sums)[kMR][kNR]) {
                  group_tile<TYPE, decltype(mr)::value>(gp, kb, xr.q.data() + m * K, xr.dx.data() + m * kb,
                                                        xr.sx.data() + m * kb, K, sums);
                });
}

// Calls f(std::integral_constant<int64_t, TYPE>{}) for the one TYPE of TYPES that equals `type` (the
// run-time type to the template a kernel is instantiated for); false where none does.
template <int64_t... TYPES, typename F>
inline bool with_type(int64_t type, F&& f) {
  return ((type == TYPES ? (f(std::integral_constant<int64_t, TYPES>{}), true) : false) || ...);
}

template <typename T>
void dispatch(int64_t type, const QuantizedRows& xr, const uint8_t* wp, int64_t M, int64_t N, int64_t K, T* op) {
  const bool known = with_type<Q8_0, Q4_0, Q4_1, Q5_0, Q5_1>(
      type, [&](auto t) { run<decltype(t)::value>(xr, wp, M, N, K, op); });
  TORCH_CHECK(known, "cpu_quant: unsupported GGUF type ", type);
}

// x [M, K] bf16 or fp32 (contiguous last dim), packed from repack() -> [M, N] in x's dtype.
// (kquant.h's linear takes every type, the k-quants included.)
inline at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t type, int64_t N) {
  const int64_t M = x.size(0), K = x.dim() == 2 ? x.size(1) : 0;
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  return radixlm_xquant::linear(x, packed, packed_bytes(type, N, K), N,
                                [&](const QuantizedRows& xr, auto* op) { dispatch(type, xr, wp, M, N, K, op); });
}

}  // namespace radixlm_quant
