// Fused elementwise decoder ops for CPU: RMSNorm (+ residual add), SiLU*mul and neox rotary; and the
// argmax of each row of a batch's logits (the greedy sampler's).
//
// Numerics: every op rounds to the activation dtype exactly where the eager torch code (and HF
// transformers) does, with round-to-nearest-even, and RMSNorm sums in torch's order, so results are
// bit-identical to it (see kernels/cpu_ops/__init__.py for the reference formulas).
// Built with -ffp-contract=off: a*b+c must stay two roundings, as in the eager code.
//
// Shapes: activations are [n, m, d] with any strides for n and m and a contiguous last dim
// (2-D tensors are [n, 1, d]); weight is [d] contiguous; all of one dtype (fp32, bf16, fp16).
#pragma once
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <sleef.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "simd.h"

namespace radixlm_ops {
using namespace radixlm_cpu;  // simd.h

// ---------------------------------------------------------------- dtype I/O: load, store, round
#if defined(RADIXLM_AVX512)
using ivec = __m512i;
inline ivec as_int(fvec a) { return _mm512_castps_si512(a.v); }
inline fvec as_float(ivec a) { return _mm512_castsi512_ps(a); }
inline ivec iadd(ivec a, ivec b) { return _mm512_add_epi32(a, b); }
inline ivec iand(ivec a, ivec b) { return _mm512_and_si512(a, b); }
inline ivec isrl(ivec a, int s) { return _mm512_srli_epi32(a, s); }
inline ivec iset1(int x) { return _mm512_set1_epi32(x); }
inline ivec blend_nan(fvec v, ivec r, ivec nan) {
  return _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(v.v, v.v, _CMP_UNORD_Q), r, nan);
}
inline void store_u16(void* p, ivec x) {   // low 16 bits of each lane
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(x));
}
inline fvec load_half(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline void store_half(c10::Half* p, fvec v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline fvec round_half(fvec v) {
  return _mm512_cvtph_ps(_mm512_cvtps_ph(v.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline fvec operator/(fvec a, fvec b) { return _mm512_div_ps(a.v, b.v); }
inline fvec torch_exp(fvec v) { return Sleef_expf16_u10(v.v); }   // what torch's Vectorized<float>::exp calls
constexpr int kTorchVecBytes = 64;                            // torch's Vectorized<T> width on this ISA
#elif defined(RADIXLM_AVX2)
using ivec = __m256i;
inline ivec as_int(fvec a) { return _mm256_castps_si256(a.v); }
inline fvec as_float(ivec a) { return _mm256_castsi256_ps(a); }
inline ivec iadd(ivec a, ivec b) { return _mm256_add_epi32(a, b); }
inline ivec iand(ivec a, ivec b) { return _mm256_and_si256(a, b); }
inline ivec isrl(ivec a, int s) { return _mm256_srli_epi32(a, s); }
inline ivec iset1(int x) { return _mm256_set1_epi32(x); }
inline ivec blend_nan(fvec v, ivec r, ivec nan) {
  return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(nan),
                                              _mm256_cmp_ps(v.v, v.v, _CMP_UNORD_Q)));
}
inline void store_u16(void* p, ivec x) {
  __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}
inline fvec load_half(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline void store_half(c10::Half* p, fvec v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline fvec round_half(fvec v) {
  return _mm256_cvtph_ps(_mm256_cvtps_ph(v.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
inline fvec operator/(fvec a, fvec b) { return _mm256_div_ps(a.v, b.v); }
inline fvec torch_exp(fvec v) { return Sleef_expf8_u10(v.v); }
constexpr int kTorchVecBytes = 32;
#endif

// fp32 bits rounded to nearest even at bit 16 (the bf16 value in the high half); NaN -> 0x7FC00000,
// exactly as c10::BFloat16's round_to_nearest_even.
inline ivec bf16_round_bits(fvec v) {
  ivec bits = as_int(v);
  ivec lsb = iand(isrl(bits, 16), iset1(1));
  ivec r = iadd(bits, iadd(lsb, iset1(0x7FFF)));
  return blend_nan(v, r, iset1(0x7FC00000));
}

template <typename T>
struct io;

template <>
struct io<float> {
  static fvec load(const float* p) { return fvec::load(p); }
  static void store(float* p, fvec v) { v.store(p); }
  static fvec round(fvec v) { return v; }
};

template <>
struct io<c10::BFloat16> {
  static fvec load(const c10::BFloat16* p) { return fvec::load(p); }
  static void store(c10::BFloat16* p, fvec v) { store_u16(p, isrl(bf16_round_bits(v), 16)); }
  static fvec round(fvec v) { return as_float(iand(bf16_round_bits(v), iset1(static_cast<int>(0xFFFF0000u)))); }
};

template <>
struct io<c10::Half> {
  static fvec load(const c10::Half* p) { return load_half(p); }
  static void store(c10::Half* p, fvec v) { store_half(p, v); }
  static fvec round(fvec v) { return round_half(v); }
};

// The first `n` (< fvec::N) elements at p, zero-padded; and the store of the first `n` lanes.
template <typename T>
inline fvec load_part(const T* p, int n) {
  T tmp[fvec::N];
  std::memset(static_cast<void*>(tmp), 0, sizeof(tmp));
  std::memcpy(static_cast<void*>(tmp), p, n * sizeof(T));
  return io<T>::load(tmp);
}
template <typename T>
inline void store_part(T* p, fvec v, int n) {
  T tmp[fvec::N];
  io<T>::store(tmp, v);
  std::memcpy(static_cast<void*>(p), tmp, n * sizeof(T));
}

// Applies f(i, width) over [0, d) in vector steps, the last one partial.
template <typename F>
inline void for_vec(int64_t d, F&& f) {
  int64_t i = 0;
  for (; i + fvec::N <= d; i += fvec::N) f(i, static_cast<int>(fvec::N));
  if (i < d) f(i, static_cast<int>(d - i));
}
template <typename T>
inline fvec ld(const T* p, int w) { return w == fvec::N ? io<T>::load(p) : load_part(p, w); }
template <typename T>
inline void st(T* p, fvec v, int w) {
  if (w == fvec::N) io<T>::store(p, v); else store_part(p, v, w);
}

// ---------------------------------------------------------------- views
struct Rows {   // a [n, m, d] tensor with a contiguous last dim
  int64_t n, m, d, s0, s1;
  explicit Rows(const at::Tensor& t) {
    TORCH_CHECK(t.dim() == 2 || t.dim() == 3, "expected a 2-D or 3-D tensor, got ", t.dim(), "-D");
    TORCH_CHECK(t.stride(-1) == 1 || t.size(-1) == 1, "the last dim must be contiguous");
    TORCH_CHECK(t.device().is_cpu(), "expected a CPU tensor");
    n = t.size(0);
    d = t.size(-1);
    s0 = t.stride(0);
    m = t.dim() == 3 ? t.size(1) : 1;
    s1 = t.dim() == 3 ? t.stride(1) : 0;
  }
  int64_t offset(int64_t row) const { return (row / m) * s0 + (row % m) * s1; }   // row in [0, n*m)
};

inline int64_t grain_rows(int64_t d) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(d, 1)); }

#define RADIXLM_DISPATCH(dtype, NAME, ...)                                              \
  [&] {                                                                                \
    switch (dtype) {                                                                   \
      case at::kFloat: { using scalar_t = float; return __VA_ARGS__(); }               \
      case at::kBFloat16: { using scalar_t = c10::BFloat16; return __VA_ARGS__(); }    \
      case at::kHalf: { using scalar_t = c10::Half; return __VA_ARGS__(); }            \
      default: TORCH_CHECK(false, NAME ": unsupported dtype ", dtype);                 \
    }                                                                                  \
  }()

// ---------------------------------------------------------------- RMSNorm
// torch's own order for the fp32 sum over one contiguous row (the cascade of ATen's SumKernel.cpp:
// 4 interleaved partial sums of torch vectors, summed in levels of 2^level_power, then the scalar
// tail, then the lanes), so the mean of squares equals torch's bit for bit. `at(j)` is the j-th
// element of the row (a float) or, with Acc = f8, the j-th full 8-float vector.
inline int64_t ceil_log2(int64_t x) {
  if (x <= 2) return 1;
  int64_t bits = 0;
  for (uint64_t v = static_cast<uint64_t>(x - 1); v; v >>= 1) ++bits;
  return bits;
}

template <typename Acc, typename At>
inline Acc cascade_row_sum(int64_t size, Acc zero, At&& at) {
  constexpr int levels = 4, ilp = 4;
  const int64_t rows = size / ilp;
  const int64_t level_power = std::max<int64_t>(4, ceil_log2(rows) / levels);
  const int64_t level_step = int64_t(1) << level_power, level_mask = level_step - 1;
  Acc acc[levels][ilp];
  for (auto& level : acc)
    for (auto& a : level) a = zero;
  int64_t i = 0;
  while (i + level_step <= rows) {
    for (int64_t j = 0; j < level_step; ++j, ++i)
      for (int k = 0; k < ilp; ++k) acc[0][k] = acc[0][k] + at(i * ilp + k);
    for (int j = 1; j < levels; ++j) {
      for (int k = 0; k < ilp; ++k) {
        acc[j][k] = acc[j][k] + acc[j - 1][k];
        acc[j - 1][k] = zero;
      }
      if ((i & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; i < rows; ++i)
    for (int k = 0; k < ilp; ++k) acc[0][k] = acc[0][k] + at(i * ilp + k);
  for (int j = 1; j < levels; ++j)
    for (int k = 0; k < ilp; ++k) acc[0][k] = acc[0][k] + acc[j][k];
  Acc sum = acc[0][0];
  for (int64_t j = rows * ilp; j < size; ++j) sum = sum + at(j);
  for (int k = 1; k < ilp; ++k) sum = sum + acc[0][k];
  return sum;
}

// torch runs its sum kernel 8 floats wide (AVX2) even on AVX512 CPUs (that kernel has no AVX512
// dispatch), so the lane partial sums here are 8 wide on both ISAs.
struct f8 {
  static constexpr int N = 8;
  __m256 v;
};
inline f8 operator+(f8 a, f8 b) { return {_mm256_add_ps(a.v, b.v)}; }
inline f8 operator*(f8 a, f8 b) { return {_mm256_mul_ps(a.v, b.v)}; }
inline f8 load8(const float* p) { return {_mm256_loadu_ps(p)}; }
inline f8 load8(const c10::BFloat16* p) {
  __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))};
}
inline f8 load8(const c10::Half* p) { return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))}; }

// sum(x[j]^2) over the row in fp32, added in torch's order (x[j]^2 rounded to fp32 first)
template <typename T>
inline float sum_squares(const T* x, int64_t d) {
  auto sq = [&](int64_t j) { float v = static_cast<float>(x[j]); return v * v; };
  if (d < f8::N) return cascade_row_sum(d, 0.0f, sq);
  const int64_t nvec = d / f8::N;
  f8 lanes_sum = cascade_row_sum(nvec, f8{_mm256_setzero_ps()}, [&](int64_t j) {
    f8 v = load8(x + j * f8::N);
    return v * v;
  });
  float total = 0.0f;
  for (int64_t j = nvec * f8::N; j < d; ++j) total += sq(j);
  float lanes[f8::N];
  _mm256_storeu_ps(lanes, lanes_sum.v);
  for (int k = 0; k < f8::N; ++k) total += lanes[k];
  return total;
}

// y = round(w * round(x * rsqrt(mean(x^2) + eps))), mean = sum / d in fp32.
template <typename T>
inline void rms_norm_row(T* out, const T* x, const T* w, int64_t d, float eps) {
  float var = sum_squares(x, d) / static_cast<float>(d);
  fvec r = fvec::set1(1.0f / std::sqrt(var + eps));
  for_vec(d, [&](int64_t i, int wd) {
    fvec normed = io<T>::round(ld(x + i, wd) * r);
    st(out + i, ld(w + i, wd) * normed, wd);
  });
}

void rms_norm(at::Tensor out, at::Tensor x, at::Tensor weight, double eps) {
  Rows xr(x), outr(out);
  TORCH_CHECK(out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type() && weight.scalar_type() == x.scalar_type(),
              "rms_norm: out, x and weight must share shape and dtype");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == xr.d, "rms_norm: weight must be contiguous [d]");
  RADIXLM_DISPATCH(x.scalar_type(), "rms_norm", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, xr.n * xr.m, grain_rows(xr.d), [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row)
        rms_norm_row(op + outr.offset(row), xp + xr.offset(row), wp, xr.d, static_cast<float>(eps));
    });
  });
}

// residual = round(x + residual); x = rms_norm(residual)   (both in place)
template <typename T>
inline void add_rms_norm_row(T* x, T* res, const T* w, int64_t d, float eps) {
  for_vec(d, [&](int64_t i, int wd) { st(res + i, io<T>::round(ld(x + i, wd) + ld(res + i, wd)), wd); });
  float var = sum_squares(res, d) / static_cast<float>(d);
  fvec r = fvec::set1(1.0f / std::sqrt(var + eps));
  for_vec(d, [&](int64_t i, int wd) {
    fvec normed = io<T>::round(ld(res + i, wd) * r);
    st(x + i, ld(w + i, wd) * normed, wd);
  });
}

void fused_add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor weight, double eps) {
  Rows xr(x), rr(residual);
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type() &&
              weight.scalar_type() == x.scalar_type(), "fused_add_rms_norm: x, residual and weight must share shape and dtype");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == xr.d, "fused_add_rms_norm: weight must be contiguous [d]");
  RADIXLM_DISPATCH(x.scalar_type(), "fused_add_rms_norm", [&] {
    scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    at::parallel_for(0, xr.n * xr.m, grain_rows(xr.d), [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row)
        add_rms_norm_row(xp + xr.offset(row), rp + rr.offset(row), wp, xr.d, static_cast<float>(eps));
    });
  });
}

// ---------------------------------------------------------------- SiLU * mul
// out = round(round(silu(gate)) * up), silu(g) = g / (1 + exp(-g)) in fp32. Like torch's silu kernel,
// each row runs whole blocks of two torch vectors with Sleef's exp and the rest with std::exp.
template <typename T>
inline void silu_and_mul_row(T* out, const T* gate, const T* up, int64_t d) {
  constexpr int64_t block = 2 * kTorchVecBytes / static_cast<int64_t>(sizeof(T));
  const int64_t vec_end = d / block * block;
  const fvec one = fvec::set1(1.0f);
  int64_t i = 0;
  for (; i + 2 * fvec::N <= vec_end; i += 2 * fvec::N) {   // two vectors per step, as torch's loop
    fvec g0 = io<T>::load(gate + i), g1 = io<T>::load(gate + i + fvec::N);
    fvec e0 = torch_exp(fvec::zero() - g0), e1 = torch_exp(fvec::zero() - g1);
    fvec s0 = io<T>::round(g0 / (one + e0)), s1 = io<T>::round(g1 / (one + e1));
    io<T>::store(out + i, s0 * io<T>::load(up + i));
    io<T>::store(out + i + fvec::N, s1 * io<T>::load(up + i + fvec::N));
  }
  for_vec(vec_end - i, [&](int64_t j, int wd) {
    fvec g = ld(gate + i + j, wd);
    fvec s = io<T>::round(g / (one + torch_exp(fvec::zero() - g)));
    st(out + i + j, s * ld(up + i + j, wd), wd);
  });
  for (int64_t i = vec_end; i < d; ++i) {
    float g = static_cast<float>(gate[i]);
    T s = static_cast<T>(g / (1.0f + std::exp(-g)));
    out[i] = static_cast<T>(static_cast<float>(s) * static_cast<float>(up[i]));
  }
}

void silu_and_mul(at::Tensor out, at::Tensor x) {
  Rows xr(x), outr(out);
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.size(0) == out.size(0) && x.size(1) == 2 * out.size(1) &&
              out.scalar_type() == x.scalar_type(), "silu_and_mul: x [n, 2d] and out [n, d] of one dtype");
  const int64_t d = outr.d;
  RADIXLM_DISPATCH(x.scalar_type(), "silu_and_mul", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, xr.n, grain_rows(d), [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        const scalar_t* g = xp + row * xr.s0;
        silu_and_mul_row(op + row * outr.s0, g, g + d, d);
      }
    });
  });
}

// ---------------------------------------------------------------- rotary (neox: halves)
// The rotated width rot_dim is 2 * the cos/sin table's columns (rot_dim < head_dim: partial rotary,
// the first rot_dim lanes of each head rotate as two halves, the rest are left as they are).
// With c, s = round(cos), round(sin) at the token's position, per head x = [x1 | x2]:
//   x1' = round(round(x1*c) - round(x2*s)),  x2' = round(round(x2*c) + round(x1*s))
template <typename T>
inline void rotate_heads(T* x, int64_t heads, int64_t head_stride, int64_t half, const float* cos, const float* sin) {
  for (int64_t h = 0; h < heads; ++h) {
    T* x1 = x + h * head_stride;
    T* x2 = x1 + half;
    for_vec(half, [&](int64_t i, int wd) {
      fvec c = io<T>::round(ld(cos + i, wd)), s = io<T>::round(ld(sin + i, wd));
      fvec a = ld(x1 + i, wd), b = ld(x2 + i, wd);
      fvec a2 = io<T>::round(io<T>::round(a * c) - io<T>::round(b * s));
      fvec b2 = io<T>::round(io<T>::round(b * c) + io<T>::round(a * s));
      st(x1 + i, a2, wd);
      st(x2 + i, b2, wd);
    });
  }
}

template <typename P>
void rotary_impl(const P* pos, at::Tensor q, at::Tensor k, const float* cos, const float* sin, int64_t head_dim,
                 int64_t rot_dim, int64_t max_pos) {
  Rows qr(q), kr(k);
  const int64_t half = rot_dim / 2;   // lanes [0, rot_dim) of each head rotate; the rest pass through
  const int64_t n = qr.n, qh = qr.m * qr.d / head_dim, kh = kr.m * kr.d / head_dim;
  for (int64_t t = 0; t < n; ++t)   // checked here: an exception must not leave a parallel region
    TORCH_CHECK(pos[t] >= 0 && static_cast<int64_t>(pos[t]) < max_pos, "rotary_embedding: position ", pos[t],
                " outside the cos/sin cache [0, ", max_pos, ")");
  RADIXLM_DISPATCH(q.scalar_type(), "rotary_embedding", [&] {
    scalar_t* qp = q.data_ptr<scalar_t>();
    scalar_t* kp = k.data_ptr<scalar_t>();
    at::parallel_for(0, n, grain_rows((qh + kh) * head_dim), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const int64_t p = static_cast<int64_t>(pos[t]);
        const float* c = cos + p * half;
        const float* s = sin + p * half;
        // a 3-D [n, heads, head_dim] view has head stride s1; a 2-D [n, heads*head_dim] one head_dim
        rotate_heads(qp + t * qr.s0, qh, qr.m > 1 ? qr.s1 : head_dim, half, c, s);
        rotate_heads(kp + t * kr.s0, kh, kr.m > 1 ? kr.s1 : head_dim, half, c, s);
      }
    });
  });
}

void rotary_embedding(at::Tensor positions, at::Tensor q, at::Tensor k, at::Tensor cos_cache, at::Tensor sin_cache,
                      int64_t head_dim) {
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "rotary_embedding: q and k must share a dtype");
  TORCH_CHECK(cos_cache.scalar_type() == at::kFloat && sin_cache.scalar_type() == at::kFloat &&
              cos_cache.is_contiguous() && sin_cache.is_contiguous() && cos_cache.sizes() == sin_cache.sizes() &&
              cos_cache.dim() == 2 && cos_cache.size(1) > 0 && cos_cache.size(1) * 2 <= head_dim,
              "rotary_embedding: cos/sin caches must be contiguous fp32 [max_position, rotary_dim/2], "
              "rotary_dim <= head_dim");
  TORCH_CHECK(positions.dim() == 1 && positions.is_contiguous() && positions.size(0) == q.size(0) &&
              k.size(0) == q.size(0), "rotary_embedding: positions [n] must match q and k");
  Rows qr(q), kr(k);
  TORCH_CHECK(head_dim % 2 == 0 && (qr.m * qr.d) % head_dim == 0 && (kr.m * kr.d) % head_dim == 0 &&
              (qr.m == 1 || qr.d == head_dim) && (kr.m == 1 || kr.d == head_dim),
              "rotary_embedding: q and k must be [n, heads*head_dim] or [n, heads, head_dim]");
  const float* c = cos_cache.data_ptr<float>();
  const float* s = sin_cache.data_ptr<float>();
  const int64_t max_pos = cos_cache.size(0), rot_dim = cos_cache.size(1) * 2;
  if (positions.scalar_type() == at::kLong) {
    rotary_impl(positions.data_ptr<int64_t>(), q, k, c, s, head_dim, rot_dim, max_pos);
  } else {
    TORCH_CHECK(positions.scalar_type() == at::kInt, "rotary_embedding: positions must be int64 or int32");
    rotary_impl(positions.data_ptr<int32_t>(), q, k, c, s, head_dim, rot_dim, max_pos);
  }
}

// ---------------------------------------------------------------- argmax of each row
// out[r] = the index of row r's largest value, the first one on ties, and for a row holding a NaN its
// first NaN's index: torch.max(dim).indices, which the sampler's greedy path used (1.8 ms for a
// [64, 49152] fp32 batch on a 2-core Zen 4, its threads split unevenly). Two vector passes over a row
// (the max, then the first place holding it; the row is in L2 by then); a row with a NaN or an
// infinity, which `x * 0` turns into NaN, takes one scalar pass that follows torch's rules instead.
template <typename T>
inline int64_t argmax_row(const T* x, int64_t d) {
  const int64_t dv = d / fvec::N * fvec::N;
  const fvec zero = fvec::zero();
  fvec m0 = fvec::set1(-INFINITY), m1 = m0, z = zero;
  int64_t i = 0;
  for (; i + 2 * fvec::N <= dv; i += 2 * fvec::N) {
    const fvec a = io<T>::load(x + i), b = io<T>::load(x + i + fvec::N);
    m0 = vmax(a, m0);
    m1 = vmax(b, m1);
    z = z + (a * zero + b * zero);
  }
  for (; i < dv; i += fvec::N) {
    const fvec a = io<T>::load(x + i);
    m0 = vmax(a, m0);
    z = z + a * zero;
  }
  float m = vmax(m0, m1).hmax(), tail_check = z.sum();
  for (int64_t j = dv; j < d; ++j) {
    const float v = static_cast<float>(x[j]);
    tail_check += v * 0.0f;
    m = std::max(m, v);
  }
  if (std::isnan(tail_check)) {
    int64_t best = 0;
    float best_v = static_cast<float>(x[0]);
    for (int64_t j = 0; j < d; ++j) {
      const float v = static_cast<float>(x[j]);
      if (std::isnan(v)) return j;
      if (v > best_v) best = j, best_v = v;
    }
    return best;
  }
  const fvec mv = fvec::set1(m);
  for (int64_t j = 0; j < dv; j += fvec::N) {
    const unsigned hit = eq_mask(io<T>::load(x + j), mv);
    if (hit) return j + __builtin_ctz(hit);
  }
  for (int64_t j = dv; j < d; ++j)
    if (static_cast<float>(x[j]) == m) return j;
  return 0;   // not reached: m is one of the row's values
}

// out: int64 [n] contiguous; x: [n, d] (d >= 1, contiguous last dim, any row stride).
void argmax_rows(at::Tensor out, at::Tensor x) {
  Rows xr(x);
  TORCH_CHECK(x.dim() == 2 && xr.d > 0, "argmax_rows: x must be [n, d] with d > 0");
  TORCH_CHECK(out.scalar_type() == at::kLong && out.is_contiguous() && out.dim() == 1 && out.size(0) == xr.n,
              "argmax_rows: out must be a contiguous int64 [n]");
  RADIXLM_DISPATCH(x.scalar_type(), "argmax_rows", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    int64_t* op = out.data_ptr<int64_t>();
    at::parallel_for(0, xr.n, 1, [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) op[row] = argmax_row(xp + row * xr.s0, xr.d);
    });
  });
}

}  // namespace radixlm_ops
#undef RADIXLM_DISPATCH
