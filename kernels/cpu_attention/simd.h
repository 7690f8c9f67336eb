// A tiny float-vector wrapper over AVX512 or AVX2 (chosen by the build's -D flag), enough for
// paged attention: loads from fp32/bf16, FMA, reductions and a vectorized exp.
#pragma once

#include <immintrin.h>
#include <c10/util/BFloat16.h>

#include <cstdint>

namespace radixlm_cpu {

#if defined(RADIXLM_AVX512)

struct fvec {
  static constexpr int N = 16;
  __m512 v;
  fvec() = default;
  fvec(__m512 x) : v(x) {}
  static fvec zero() { return _mm512_setzero_ps(); }
  static fvec set1(float x) { return _mm512_set1_ps(x); }
  static fvec load(const float* p) { return _mm512_loadu_ps(p); }
  static fvec load(const c10::BFloat16* p) {
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  float sum() const { return _mm512_reduce_add_ps(v); }
  float hmax() const { return _mm512_reduce_max_ps(v); }
};
// out[0..4) = horizontal sums of a[0..4), in one shuffle tree
inline void sum4(const fvec* a, float* out) {
  __m512 x01 = _mm512_add_ps(_mm512_unpacklo_ps(a[0].v, a[1].v), _mm512_unpackhi_ps(a[0].v, a[1].v));
  __m512 x23 = _mm512_add_ps(_mm512_unpacklo_ps(a[2].v, a[3].v), _mm512_unpackhi_ps(a[2].v, a[3].v));
  __m512 y = _mm512_add_ps(_mm512_shuffle_ps(x01, x23, 0x44), _mm512_shuffle_ps(x01, x23, 0xEE));
  __m256 h = _mm256_add_ps(_mm512_castps512_ps256(y), _mm512_extractf32x8_ps(y, 1));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}
inline fvec operator+(fvec a, fvec b) { return _mm512_add_ps(a.v, b.v); }
inline fvec operator-(fvec a, fvec b) { return _mm512_sub_ps(a.v, b.v); }
inline fvec operator*(fvec a, fvec b) { return _mm512_mul_ps(a.v, b.v); }
inline fvec fmadd(fvec a, fvec b, fvec c) { return _mm512_fmadd_ps(a.v, b.v, c.v); }
inline fvec fnmadd(fvec a, fvec b, fvec c) { return _mm512_fnmadd_ps(a.v, b.v, c.v); }
inline fvec vmin(fvec a, fvec b) { return _mm512_min_ps(a.v, b.v); }
inline fvec vmax(fvec a, fvec b) { return _mm512_max_ps(a.v, b.v); }
inline fvec vround(fvec a) { return _mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// a * 2^n for integral-valued n in [-126, 127]
inline fvec vscale2(fvec a, fvec n) { return _mm512_scalef_ps(a.v, n.v); }
// x where keep_if_ge(x, t) else 0
inline fvec zero_below(fvec r, fvec x, fvec t) {
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x.v, t.v, _CMP_GE_OQ), r.v);
}
// bit i set where a[i] == b[i] (ordered: NaN is equal to nothing)
inline unsigned eq_mask(fvec a, fvec b) { return _mm512_cmp_ps_mask(a.v, b.v, _CMP_EQ_OQ); }
#define RADIXLM_ISA_NAME "avx512"

#elif defined(RADIXLM_AVX2)

struct fvec {
  static constexpr int N = 8;
  __m256 v;
  fvec() = default;
  fvec(__m256 x) : v(x) {}
  static fvec zero() { return _mm256_setzero_ps(); }
  static fvec set1(float x) { return _mm256_set1_ps(x); }
  static fvec load(const float* p) { return _mm256_loadu_ps(p); }
  static fvec load(const c10::BFloat16* p) {
    __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  float sum() const {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  float hmax() const {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
};
inline void sum4(const fvec* a, float* out) {
  __m256 x01 = _mm256_add_ps(_mm256_unpacklo_ps(a[0].v, a[1].v), _mm256_unpackhi_ps(a[0].v, a[1].v));
  __m256 x23 = _mm256_add_ps(_mm256_unpacklo_ps(a[2].v, a[3].v), _mm256_unpackhi_ps(a[2].v, a[3].v));
  __m256 y = _mm256_add_ps(_mm256_shuffle_ps(x01, x23, 0x44), _mm256_shuffle_ps(x01, x23, 0xEE));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1)));
}
inline fvec operator+(fvec a, fvec b) { return _mm256_add_ps(a.v, b.v); }
inline fvec operator-(fvec a, fvec b) { return _mm256_sub_ps(a.v, b.v); }
inline fvec operator*(fvec a, fvec b) { return _mm256_mul_ps(a.v, b.v); }
inline fvec fmadd(fvec a, fvec b, fvec c) { return _mm256_fmadd_ps(a.v, b.v, c.v); }
inline fvec fnmadd(fvec a, fvec b, fvec c) { return _mm256_fnmadd_ps(a.v, b.v, c.v); }
inline fvec vmin(fvec a, fvec b) { return _mm256_min_ps(a.v, b.v); }
inline fvec vmax(fvec a, fvec b) { return _mm256_max_ps(a.v, b.v); }
inline fvec vround(fvec a) { return _mm256_round_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline fvec vscale2(fvec a, fvec n) {
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n.v), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(a.v, _mm256_castsi256_ps(e));
}
inline fvec zero_below(fvec r, fvec x, fvec t) { return _mm256_and_ps(r.v, _mm256_cmp_ps(x.v, t.v, _CMP_GE_OQ)); }
inline unsigned eq_mask(fvec a, fvec b) { return _mm256_movemask_ps(_mm256_cmp_ps(a.v, b.v, _CMP_EQ_OQ)); }
#define RADIXLM_ISA_NAME "avx2"

#else
#error "build with -DRADIXLM_AVX512 or -DRADIXLM_AVX2"
#endif

// exp(x) for x <= 0 in practice (relative error ~2e-7); exactly 0 below -87.3, including -inf.
inline fvec vexp(fvec x) {
  const fvec lo = fvec::set1(-87.3f);
  fvec xc = vmin(vmax(x, lo), fvec::set1(88.3f));
  fvec n = vround(xc * fvec::set1(1.44269504088896341f));
  fvec r = fnmadd(n, fvec::set1(0.693359375f), xc);
  r = fnmadd(n, fvec::set1(-2.12194440e-4f), r);
  fvec p = fvec::set1(1.9875691500E-4f);
  p = fmadd(p, r, fvec::set1(1.3981999507E-3f));
  p = fmadd(p, r, fvec::set1(8.3334519073E-3f));
  p = fmadd(p, r, fvec::set1(4.1665795894E-2f));
  p = fmadd(p, r, fvec::set1(1.6666665459E-1f));
  p = fmadd(p, r, fvec::set1(5.0000001201E-1f));
  p = fmadd(p * r, r, r + fvec::set1(1.0f));
  return zero_below(vscale2(p, n), x, lo);
}

}  // namespace radixlm_cpu
