// K-quant matrix products for the CPU: y[M, N] = x[M, K] @ W[N, K]^T with W held in GGUF-style blocks of
// 128 inputs and x quantised to int8 per 128 inputs (one float scale a block), integer dot products
// (AVX-512 VNNI `vpdpbusd`: unsigned weight codes x signed activation codes), one float multiply-add per
// block. Layouts (built in engine/quant.py; a row of W is nb = ceil(K / 128) blocks):
//
//   k4 (Q4_K):  codes  uint8 [N, nb, 64]  byte i: low nibble = code of input i, high nibble = input 64 + i
//               meta   uint8 [N, nb, 12]  fp16 d, fp16 dmin, uint8 sc[4], uint8 m[4]   (one per 32 inputs)
//               w = d * sc[g] * code - dmin * m[g],   g = input / 32
//   k6 (Q6_K):  lo     uint8 [N, nb, 64]  low 4 bits of the codes, as k4
//               hi     uint8 [N, nb, 32]  byte t: bits 0-1 = high 2 bits of input t, 2-3 of t + 32,
//                                         4-5 of t + 64, 6-7 of t + 96
//               meta   uint8 [N, nb, 10]  fp16 d, int8 sc[8]                             (one per 16 inputs)
//               w = d * sc[g] * (code - 32),   g = input / 16
//
// Exactness: every output y[m, n] is computed by one thread with the same sequence of operations whatever
// M is and whichever rows share its tile (rows are only tiled to share weight loads), so row m of an
// M-row product is bitwise the 1-row product: batch invariance by construction. Threads split N only.
// Activations: d = max|x| / 127 per block, code = round-half-even(x / d); a block holding a NaN or an
// infinity gets d = NaN, so its outputs are NaN (never a silently finite value).

#include "kquant.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

// Instruction paths, chosen at compile time (-march=native): AVX-512 VNNI; else AVX2 with FMA and F16C (the
// integer dot products by AVX-VNNI where the CPU has it, else vpmaddubsw + vpmaddwd); else portable C++.
// The AVX2 path computes every output bit for bit as the AVX-512 one (the same integer lane sums, the same
// float operations per lane, the same reduction tree), so traces, profiles and the fingerprint tests hold on
// both. KQ_NO_AVX512 (a -D flag) compiles the AVX2 path on an AVX-512 machine, to test exactly that;
// KQ_NO_SIMD the portable one (to measure it).
#if !defined(KQ_NO_AVX512) && !defined(KQ_NO_SIMD) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && \
    defined(__AVX512VL__) && defined(__F16C__)
#include <immintrin.h>
#define KQ_AVX512 1
#define KQ_AVX2 0
#elif !defined(KQ_NO_SIMD) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define KQ_AVX512 0
#define KQ_AVX2 1
#else
#define KQ_AVX512 0
#define KQ_AVX2 0
#endif

namespace kq {
namespace {

// Software prefetch distance in bytes of codes (0: none). A decode step streams ~1 GB of weights with one
// activation row: the hardware prefetcher alone kept two threads at ~22 GB/s on the AMD EPYC of
// docs/results (31 GB/s readable); 2 KiB ahead (16 blocks) took the linears of a target layer ~20% faster
// at 1 row and ~12% at 2-8 rows, 1-8 KiB all within noise of each other (benchmarks: docs/results/README.md).
// Prefetches never fault and change no arithmetic.
#ifndef KQ_PREFETCH
#define KQ_PREFETCH 2048
#endif
constexpr int MAX_TILE = 8;  // activation rows sharing one pass over a weight row
// run_linears: above MIN_CHUNKED_ROWS rows, a thread takes the activation rows in chunks of about CHUNK_BYTES
// of codes (at least MIN_CHUNK rows)
constexpr int64_t CHUNK_BYTES = 512 * 1024;
constexpr int64_t MIN_CHUNKED_ROWS = 256;
constexpr int64_t MIN_CHUNK = 64;

float half_to_float(uint16_t h) {
  // IEEE binary16 -> binary32 (exact), portable
  const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F;
  uint32_t man = h & 0x3FF;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while ((man & 0x400) == 0) {
        man <<= 1;
        --exp;
      }
      man &= 0x3FF;
      bits = sign | (exp << 23) | (man << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7F800000u | (man << 13);
  } else {
    bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

}  // namespace

void quantize_rows(const float* x, int64_t M, int64_t K, int64_t nb, QuantizedRows& out) {
  out.q.assign((size_t)(M * nb * QB), 0);
  out.d.assign((size_t)(M * nb), 0.f);
  out.sum.assign((size_t)(M * nb * G16), 0);
  out.dsum.assign((size_t)(M * nb * G16), 0.f);
  // blocks are independent: a block's codes and sums are the same whichever thread computes them; split
  // from 48 blocks (a target's 8960-wide MLP row: 70), below that a parallel region costs more than it saves
  at::parallel_for(0, M * nb, 48, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t m = i / nb, b = i % nb;
      const float* xr = x + m * K;
      const int64_t k0 = b * QB;
      const int64_t len = std::min<int64_t>(QB, K - k0);
      float amax = 0.f;
      bool finite = true;
      for (int64_t j = 0; j < len; ++j) {
        const float v = xr[k0 + j];
        if (!std::isfinite(v)) finite = false;
        amax = std::max(amax, std::fabs(v));
      }
      float* d = &out.d[(size_t)(m * nb + b)];
      if (!finite) {
        *d = NAN;  // codes stay 0: every product with this block is NaN * 0 = NaN
        for (int64_t g = 0; g < G16; ++g) out.dsum[(size_t)((m * nb + b) * G16 + g)] = NAN;
        continue;
      }
      if (amax == 0.f) continue;
      *d = amax / 127.f;
      const float id = 127.f / amax;
      int8_t* q = &out.q[(size_t)((m * nb + b) * QB)];
      for (int64_t j = 0; j < len; ++j) {
        float r = std::nearbyint(xr[k0 + j] * id);
        r = std::min(127.f, std::max(-127.f, r));
        q[j] = (int8_t)r;
      }
      int32_t* s = &out.sum[(size_t)((m * nb + b) * G16)];
      for (int64_t g = 0; g < G16; ++g) {
        int32_t t = 0;
        for (int64_t j = 0; j < 16; ++j) t += q[g * 16 + j];
        s[g] = t;
        out.dsum[(size_t)((m * nb + b) * G16 + g)] = *d * (float)t;
      }
    }
  });
}

namespace {
// ------------------------------------------------------------------------------------------- portable
// Reference arithmetic (any CPU): the same integer sums per block, one float multiply-add per block.
void k4_rows_portable(const QuantizedRows& a, int64_t m0, int tile, int64_t nb, const uint8_t* codes,
                      const uint8_t* meta, float* acc) {
  for (int r = 0; r < tile; ++r) acc[r] = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* c = codes + b * 64;
    const uint8_t* mt = meta + b * 12;
    const float d = half_to_float(load_u16(mt)), dmin = half_to_float(load_u16(mt + 2));
    for (int r = 0; r < tile; ++r) {
      const int64_t row = (m0 + r) * nb + b;
      const int8_t* q = &a.q[(size_t)(row * QB)];
      const int32_t* s = &a.sum[(size_t)(row * G16)];
      int32_t isum = 0, imin = 0;
      for (int g = 0; g < 4; ++g) {
        int32_t t = 0;
        for (int i = 0; i < 32; ++i) {
          const int k = g * 32 + i;
          const int code = k < 64 ? (c[k] & 0xF) : (c[k - 64] >> 4);
          t += code * q[k];
        }
        isum += t * mt[4 + g];
        imin += (s[2 * g] + s[2 * g + 1]) * mt[8 + g];
      }
      const float xd = a.d[(size_t)row];
      acc[r] += (float)isum * (d * xd) - (float)imin * (dmin * xd);
    }
  }
}

void k6_rows_portable(const QuantizedRows& a, int64_t m0, int tile, int64_t nb, const uint8_t* lo,
                      const uint8_t* hi, const uint8_t* meta, float* acc) {
  for (int r = 0; r < tile; ++r) acc[r] = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* l = lo + b * 64;
    const uint8_t* h = hi + b * 32;
    const uint8_t* mt = meta + b * 10;
    const float d = half_to_float(load_u16(mt));
    const int8_t* sc = reinterpret_cast<const int8_t*>(mt + 2);
    for (int r = 0; r < tile; ++r) {
      const int64_t row = (m0 + r) * nb + b;
      const int8_t* q = &a.q[(size_t)(row * QB)];
      const int32_t* s = &a.sum[(size_t)(row * G16)];
      int32_t isum = 0;
      for (int g = 0; g < 8; ++g) {
        int32_t t = 0;
        for (int i = 0; i < 16; ++i) {
          const int k = g * 16 + i;
          const int low = k < 64 ? (l[k] & 0xF) : (l[k - 64] >> 4);
          const int high = (h[k % 32] >> (2 * (k / 32))) & 3;
          t += (low | (high << 4)) * q[k];
        }
        isum += (t - 32 * s[g]) * sc[g];
      }
      acc[r] += (float)isum * (d * a.d[(size_t)row]);
    }
  }
}

#if KQ_AVX512 || KQ_AVX2
// the sum of 8 lanes: (0 + 4, 1 + 5, 2 + 6, 3 + 7), then (a + c, b + d), then the two (the tree of
// _mm512_reduce_add_ps after its first step, which adds the two 256-bit halves)
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Ask for a block's codes and scales KQ_PREFETCH bytes of codes ahead (prefetches never fault)
inline void prefetch_k4(const uint8_t* codes, const uint8_t* meta, int64_t b) {
#if KQ_PREFETCH
  _mm_prefetch((const char*)(codes + b * 64 + KQ_PREFETCH), _MM_HINT_T0);
  _mm_prefetch((const char*)(meta + b * 12 + KQ_PREFETCH * 12 / 64), _MM_HINT_T0);
#endif
}

inline void prefetch_k6(const uint8_t* lo, const uint8_t* hi, const uint8_t* meta, int64_t b) {
#if KQ_PREFETCH
  _mm_prefetch((const char*)(lo + b * 64 + KQ_PREFETCH), _MM_HINT_T0);
  _mm_prefetch((const char*)(hi + b * 32 + KQ_PREFETCH / 2), _MM_HINT_T0);
  _mm_prefetch((const char*)(meta + b * 10 + KQ_PREFETCH * 10 / 64), _MM_HINT_T0);
#endif
}

// A k6 block's 8 scales as floats; d its fp16 super-scale as a float (exact conversions)
inline __m256 k6_scales(const uint8_t* mt, float& d) {
  d = _cvtsh_ss(load_u16(mt));
  int64_t sc8;
  std::memcpy(&sc8, mt + 2, 8);
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_cvtsi64_si128(sc8)));
}

// A k4 block's scales as one vector P = [d * sc[0..3], dmin * m[0..3]] (fp16 -> fp32 is exact and each
// product is one IEEE multiply of the same two floats on every path)
inline __m256 k4_scales(const uint8_t* mt) {
  int32_t ddm;
  int64_t scm;
  std::memcpy(&ddm, mt, 4);
  std::memcpy(&scm, mt + 4, 8);
  const __m256i idx_dd = _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0);  // [d x 4, dmin x 4]
  const __m256 dd = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_cvtph_ps(_mm_cvtsi32_si128(ddm))), idx_dd);
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(scm))), dd);
}
#endif

#if KQ_AVX512
// --------------------------------------------------------------------------------------------- AVX-512
inline float hsum(__m512 v) { return _mm512_reduce_add_ps(v); }

// One activation row against one weight block: wl / wh are the unsigned codes of inputs 0..63 / 64..127,
// s_lo / s_hi the weight scale of each 32-bit lane (4 inputs), offs the 8 per-16-input offsets (k4: the mins,
// k6: 32 * scale) that multiply the row's scaled 16-input code sums.
inline void block_product(const QuantizedRows& a, int64_t row, __m512i wl, __m512i wh, __m512 s_lo, __m512 s_hi,
                          __m256 offs, __m512& acc, __m256& acc_off) {
  const int8_t* q = &a.q[(size_t)(row * QB)];
  const __m512i il = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wl, _mm512_loadu_si512(q));
  const __m512i ih = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wh, _mm512_loadu_si512(q + 64));
  const __m512 blk = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ih), s_hi, _mm512_mul_ps(_mm512_cvtepi32_ps(il), s_lo));
  acc = _mm512_fmadd_ps(blk, _mm512_set1_ps(a.d[(size_t)row]), acc);
  acc_off = _mm256_fmadd_ps(offs, _mm256_loadu_ps(&a.dsum[(size_t)(row * G16)]), acc_off);
}

template <int T>
void k4_rows_avx512(const QuantizedRows& a, int64_t m0, int64_t nb, const uint8_t* codes, const uint8_t* meta,
                    float* out) {
  const __m512i mask4 = _mm512_set1_epi8(0x0F);
  // the block's scales, one 256-bit vector P = [d * sc[0..3], dmin * m[0..3]]; lane -> sub-block: low
  // nibbles cover inputs 0..63 (groups 0, 1), high nibbles 64..127 (groups 2, 3)
  const __m512i idx_lo = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i idx_hi = _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2);
  // the 8 sums of 16 activation codes pair with the 4 mins: m[g] (lane 4 + g of P) for sums 2g and 2g + 1
  const __m256i idx_min = _mm256_set_epi32(7, 7, 6, 6, 5, 5, 4, 4);
  __m512 acc[T];
  __m256 accm[T];
  for (int r = 0; r < T; ++r) {
    acc[r] = _mm512_setzero_ps();
    accm[r] = _mm256_setzero_ps();
  }
  for (int64_t b = 0; b < nb; ++b) {
    prefetch_k4(codes, meta, b);
    const __m512i c = _mm512_loadu_si512(codes + b * 64);
    const __m512i wl = _mm512_and_si512(c, mask4);
    const __m512i wh = _mm512_and_si512(_mm512_srli_epi16(c, 4), mask4);
    const __m256 p = k4_scales(meta + b * 12);
    const __m512 s_lo = _mm512_permutexvar_ps(idx_lo, _mm512_castps256_ps512(p));  // d * sc per lane
    const __m512 s_hi = _mm512_permutexvar_ps(idx_hi, _mm512_castps256_ps512(p));
    const __m256 mins = _mm256_permutevar8x32_ps(p, idx_min);
    for (int r = 0; r < T; ++r) block_product(a, (m0 + r) * nb + b, wl, wh, s_lo, s_hi, mins, acc[r], accm[r]);
  }
  for (int r = 0; r < T; ++r) out[r] = hsum(acc[r]) - hsum(accm[r]);
}

template <int T>
void k6_rows_avx512(const QuantizedRows& a, int64_t m0, int64_t nb, const uint8_t* lo, const uint8_t* hi,
                    const uint8_t* meta, float* out) {
  const __m512i mask4 = _mm512_set1_epi8(0x0F);
  const __m512i mask2 = _mm512_set1_epi8(0x03);
  // 16-bit shift counts: the 32 high-bit bytes are broadcast to both 256-bit halves; the first half takes
  // bits 0-1 (inputs t) and the second bits 2-3 (inputs t + 32); for the high nibbles 4-5 and 6-7
  const __m512i cnt_lo = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1);
  const __m512i cnt_hi = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1);
  const __m512i idx_lo = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  const __m512i idx_hi = _mm512_set_epi32(7, 7, 7, 7, 6, 6, 6, 6, 5, 5, 5, 5, 4, 4, 4, 4);
  __m512 acc[T];
  __m256 accc[T];
  for (int r = 0; r < T; ++r) {
    acc[r] = _mm512_setzero_ps();
    accc[r] = _mm256_setzero_ps();
  }
  for (int64_t b = 0; b < nb; ++b) {
    prefetch_k6(lo, hi, meta, b);
    const __m512i l = _mm512_loadu_si512(lo + b * 64);
    const __m512i h = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(hi + b * 32)));
    const __m512i wl = _mm512_or_si512(_mm512_and_si512(l, mask4),
                                       _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(h, cnt_lo), mask2), 4));
    const __m512i wh = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), mask4),
                                       _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(h, cnt_hi), mask2), 4));
    float d;
    const __m256 scf = k6_scales(meta + b * 10, d);
    const __m256 p = _mm256_mul_ps(scf, _mm256_set1_ps(d));
    const __m512 s_lo = _mm512_permutexvar_ps(idx_lo, _mm512_castps256_ps512(p));  // d * sc per lane
    const __m512 s_hi = _mm512_permutexvar_ps(idx_hi, _mm512_castps256_ps512(p));
    const __m256 corr = _mm256_mul_ps(scf, _mm256_set1_ps(32.f * d));
    for (int r = 0; r < T; ++r) block_product(a, (m0 + r) * nb + b, wl, wh, s_lo, s_hi, corr, acc[r], accc[r]);
  }
  for (int r = 0; r < T; ++r) out[r] = hsum(acc[r]) - hsum(accc[r]);
}
#endif

#if KQ_AVX2
// ------------------------------------------------------------------------------------------------ AVX2
// The AVX-512 path's 16 float lanes held as two 256-bit halves: A = lanes 0-7 (inputs 0-31 of a 64-input
// half-block), B = lanes 8-15 (inputs 32-63). Each lane gets the same integer sum (4 inputs) and the same
// float operations as there; _mm512_reduce_add_ps(acc) adds the halves first, so it equals hsum(A + B).

// 8 int32 lanes: lane j = sum over bytes 4j..4j+3 of w (unsigned, < 64) x q (signed, |q| <= 127). Exact either
// way: a vpmaddubsw pair sum is at most 2 * 63 * 127 = 16002, inside int16.
inline __m256i dot_u8s8(__m256i w, __m256i q) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, q);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, q), _mm256_set1_epi16(1));
#endif
}

// One activation row against one weight block: w[0..3] = unsigned codes of inputs 0-31, 32-63, 64-95,
// 96-127; s[0..3] their per-lane weight scales; offs the 8 per-16-input offsets (as block_product above).
inline void block_product2(const QuantizedRows& a, int64_t row, const __m256i* w, const __m256* s, __m256 offs,
                           __m256& acc_a, __m256& acc_b, __m256& acc_off) {
  const int8_t* q = &a.q[(size_t)(row * QB)];
  const __m256i il_a = dot_u8s8(w[0], _mm256_loadu_si256((const __m256i*)q));
  const __m256i il_b = dot_u8s8(w[1], _mm256_loadu_si256((const __m256i*)(q + 32)));
  const __m256i ih_a = dot_u8s8(w[2], _mm256_loadu_si256((const __m256i*)(q + 64)));
  const __m256i ih_b = dot_u8s8(w[3], _mm256_loadu_si256((const __m256i*)(q + 96)));
  const __m256 xd = _mm256_set1_ps(a.d[(size_t)row]);
  const __m256 blk_a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ih_a), s[2], _mm256_mul_ps(_mm256_cvtepi32_ps(il_a), s[0]));
  const __m256 blk_b = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ih_b), s[3], _mm256_mul_ps(_mm256_cvtepi32_ps(il_b), s[1]));
  acc_a = _mm256_fmadd_ps(blk_a, xd, acc_a);
  acc_b = _mm256_fmadd_ps(blk_b, xd, acc_b);
  acc_off = _mm256_fmadd_ps(offs, _mm256_loadu_ps(&a.dsum[(size_t)(row * G16)]), acc_off);
}

template <int T>
void k4_rows_avx2(const QuantizedRows& a, int64_t m0, int64_t nb, const uint8_t* codes, const uint8_t* meta,
                  float* out) {
  const __m256i mask4 = _mm256_set1_epi8(0x0F);
  const __m256i idx_min = _mm256_set_epi32(7, 7, 6, 6, 5, 5, 4, 4);
  __m256 acc_a[T], acc_b[T], accm[T];
  for (int r = 0; r < T; ++r) acc_a[r] = acc_b[r] = accm[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    prefetch_k4(codes, meta, b);
    const __m256i c0 = _mm256_loadu_si256((const __m256i*)(codes + b * 64));
    const __m256i c1 = _mm256_loadu_si256((const __m256i*)(codes + b * 64 + 32));
    const __m256i w[4] = {_mm256_and_si256(c0, mask4), _mm256_and_si256(c1, mask4),
                          _mm256_and_si256(_mm256_srli_epi16(c0, 4), mask4),
                          _mm256_and_si256(_mm256_srli_epi16(c1, 4), mask4)};
    const __m256 p = k4_scales(meta + b * 12);
    // d * sc[g] for the 32 inputs of group g = 0..3 (every lane of a half covers one group)
    const __m256 s[4] = {_mm256_permutevar8x32_ps(p, _mm256_set1_epi32(0)),
                         _mm256_permutevar8x32_ps(p, _mm256_set1_epi32(1)),
                         _mm256_permutevar8x32_ps(p, _mm256_set1_epi32(2)),
                         _mm256_permutevar8x32_ps(p, _mm256_set1_epi32(3))};
    const __m256 mins = _mm256_permutevar8x32_ps(p, idx_min);
    for (int r = 0; r < T; ++r) block_product2(a, (m0 + r) * nb + b, w, s, mins, acc_a[r], acc_b[r], accm[r]);
  }
  for (int r = 0; r < T; ++r) out[r] = hsum(_mm256_add_ps(acc_a[r], acc_b[r])) - hsum(accm[r]);
}

template <int T>
void k6_rows_avx2(const QuantizedRows& a, int64_t m0, int64_t nb, const uint8_t* lo, const uint8_t* hi,
                  const uint8_t* meta, float* out) {
  const __m256i mask4 = _mm256_set1_epi8(0x0F);
  const __m256i mask2 = _mm256_set1_epi8(0x03);
  __m256 acc_a[T], acc_b[T], accc[T];
  for (int r = 0; r < T; ++r) acc_a[r] = acc_b[r] = accc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    prefetch_k6(lo, hi, meta, b);
    const __m256i l0 = _mm256_loadu_si256((const __m256i*)(lo + b * 64));
    const __m256i l1 = _mm256_loadu_si256((const __m256i*)(lo + b * 64 + 32));
    const __m256i h = _mm256_loadu_si256((const __m256i*)(hi + b * 32));
    // byte t of h: bits 0-1 = high bits of input t, 2-3 of t + 32, 4-5 of t + 64, 6-7 of t + 96
    const __m256i w[4] = {
        _mm256_or_si256(_mm256_and_si256(l0, mask4), _mm256_slli_epi16(_mm256_and_si256(h, mask2), 4)),
        _mm256_or_si256(_mm256_and_si256(l1, mask4),
                        _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2), mask2), 4)),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), mask4),
                        _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 4), mask2), 4)),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), mask4),
                        _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 6), mask2), 4))};
    float d;
    const __m256 scf = k6_scales(meta + b * 10, d);
    const __m256 p = _mm256_mul_ps(scf, _mm256_set1_ps(d));
    // d * sc[g] for the 16 inputs of group g = 0..7 (4 lanes a group)
    const __m256 s[4] = {_mm256_permutevar8x32_ps(p, _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0)),
                         _mm256_permutevar8x32_ps(p, _mm256_set_epi32(3, 3, 3, 3, 2, 2, 2, 2)),
                         _mm256_permutevar8x32_ps(p, _mm256_set_epi32(5, 5, 5, 5, 4, 4, 4, 4)),
                         _mm256_permutevar8x32_ps(p, _mm256_set_epi32(7, 7, 7, 7, 6, 6, 6, 6))};
    const __m256 corr = _mm256_mul_ps(scf, _mm256_set1_ps(32.f * d));
    for (int r = 0; r < T; ++r) block_product2(a, (m0 + r) * nb + b, w, s, corr, acc_a[r], acc_b[r], accc[r]);
  }
  for (int r = 0; r < T; ++r) out[r] = hsum(_mm256_add_ps(acc_a[r], acc_b[r])) - hsum(accc[r]);
}
#endif

// One weight row n against activation rows [m0, m0 + tile): out[r] = y[m0 + r, n].
struct K4Row {
  const uint8_t* codes;
  const uint8_t* meta;
  template <int T>
  void run(const QuantizedRows& a, int64_t m0, int64_t nb, float* out) const {
#if KQ_AVX512
    k4_rows_avx512<T>(a, m0, nb, codes, meta, out);
#elif KQ_AVX2
    k4_rows_avx2<T>(a, m0, nb, codes, meta, out);
#else
    k4_rows_portable(a, m0, T, nb, codes, meta, out);
#endif
  }
};

struct K6Row {
  const uint8_t* lo;
  const uint8_t* hi;
  const uint8_t* meta;
  template <int T>
  void run(const QuantizedRows& a, int64_t m0, int64_t nb, float* out) const {
#if KQ_AVX512
    k6_rows_avx512<T>(a, m0, nb, lo, hi, meta, out);
#elif KQ_AVX2
    k6_rows_avx2<T>(a, m0, nb, lo, hi, meta, out);
#else
    k6_rows_portable(a, m0, T, nb, lo, hi, meta, out);
#endif
  }
};

template <typename Row>
void run_tile(const Row& row, const QuantizedRows& a, int64_t m0, int tile, int64_t nb, float* out) {
  switch (tile) {
    case 1: row.template run<1>(a, m0, nb, out); break;
    case 2: row.template run<2>(a, m0, nb, out); break;
    case 3: row.template run<3>(a, m0, nb, out); break;
    case 4: row.template run<4>(a, m0, nb, out); break;
    case 5: row.template run<5>(a, m0, nb, out); break;
    case 6: row.template run<6>(a, m0, nb, out); break;
    case 7: row.template run<7>(a, m0, nb, out); break;
    default: row.template run<8>(a, m0, nb, out); break;
  }
}

}  // namespace

void Linear::rows(int64_t n, const QuantizedRows& a, int64_t m_begin, int64_t m_end, float* y, int64_t ldy) const {
  float out[MAX_TILE];
  const float b = bias ? bias[n] : 0.f;
  for (int64_t m0 = m_begin; m0 < m_end; m0 += MAX_TILE) {
    const int tile = (int)std::min<int64_t>(MAX_TILE, m_end - m0);
    if (kind == 4) {
      run_tile(K4Row{p0 + n * nb * 64, p2 + n * nb * 12}, a, m0, tile, nb, out);
    } else {
      run_tile(K6Row{p0 + n * nb * 64, p1 + n * nb * 32, p2 + n * nb * 10}, a, m0, tile, nb, out);
    }
    for (int r = 0; r < tile; ++r) y[(m0 + r) * ldy] = bias ? out[r] + b : out[r];
  }
}

namespace {
void check_weight(const torch::Tensor& t, int64_t N, int64_t nb, int64_t width, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kUInt8 && t.is_contiguous(),
              "kquant: ", name, " must be a contiguous uint8 CPU tensor");
  TORCH_CHECK(t.numel() == N * nb * width, "kquant: ", name, " has ", t.numel(), " bytes, expected ",
              N * nb * width);
}
}  // namespace

Linear make_linear(const std::vector<torch::Tensor>& parts, const c10::optional<torch::Tensor>& bias, int64_t K) {
  TORCH_CHECK(parts.size() == 2 || parts.size() == 3,
              "kquant: a layer is 2 tensors (k4: codes, meta) or 3 (k6: lo, hi, meta), got ", parts.size());
  Linear L;
  L.kind = parts.size() == 2 ? 4 : 6;
  L.K = K;
  L.nb = (K + QB - 1) / QB;
  L.N = parts[0].size(0);
  if (L.kind == 4) {
    check_weight(parts[0], L.N, L.nb, 64, "codes");
    check_weight(parts[1], L.N, L.nb, 12, "meta");
    L.p0 = parts[0].data_ptr<uint8_t>();
    L.p2 = parts[1].data_ptr<uint8_t>();
  } else {
    check_weight(parts[0], L.N, L.nb, 64, "lo");
    check_weight(parts[1], L.N, L.nb, 32, "hi");
    check_weight(parts[2], L.N, L.nb, 10, "meta");
    L.p0 = parts[0].data_ptr<uint8_t>();
    L.p1 = parts[1].data_ptr<uint8_t>();
    L.p2 = parts[2].data_ptr<uint8_t>();
  }
  if (bias.has_value()) {
    const torch::Tensor& b = *bias;
    TORCH_CHECK(b.device().is_cpu() && b.scalar_type() == torch::kFloat32 && b.is_contiguous() && b.dim() == 1 &&
                    b.size(0) == L.N,
                "kquant: bias must be a contiguous float32 CPU tensor of ", L.N, " values");
    L.bias = b.data_ptr<float>();
  }
  L.keep = parts;
  if (bias.has_value()) L.keep.push_back(*bias);
  return L;
}

void run_linears(const std::vector<const Linear*>& layers, const QuantizedRows& a, int64_t M,
                 const std::vector<float*>& outs) {
  // one parallel region over the outputs of every layer (they share the quantised input): each output
  // column is computed by one thread whatever M is. Many rows (a prefill): a thread walks its columns once
  // per chunk of activation rows sized to stay in its L2 cache, instead of streaming all M rows from the
  // outer caches for every column (a 2048-row prefill ran ~2.5x slower than 2 x 1024 rows). The rows of a
  // chunk are the same 8-row tiles with the same per-row arithmetic, so every output is bitwise unchanged.
  std::vector<int64_t> start(layers.size() + 1, 0);
  for (size_t i = 0; i < layers.size(); ++i) start[i + 1] = start[i] + layers[i]->N;
  const int64_t row_bytes = layers.empty() ? 1 : std::max<int64_t>(1, layers[0]->nb * QB);
  // decode, draft and verification forwards (M <= 65) stay one chunk: their weights come from memory, and
  // walking them once per chunk would multiply that traffic
  const int64_t chunk = M <= MIN_CHUNKED_ROWS
                            ? std::max<int64_t>(M, 1)
                            : std::max<int64_t>(MIN_CHUNK, (CHUNK_BYTES / row_bytes) / MAX_TILE * MAX_TILE);
  at::parallel_for(0, start.back(), 16, [&](int64_t c0, int64_t c1) {
    for (int64_t m0 = 0; m0 < M; m0 += chunk) {
      const int64_t m1 = std::min(M, m0 + chunk);
      size_t i = 0;
      for (int64_t c = c0; c < c1; ++c) {
        while (c >= start[i + 1]) ++i;
        const Linear& L = *layers[i];
        const int64_t n = c - start[i];
        L.rows(n, a, m0, m1, outs[i] + n, L.N);
      }
    }
  });
}

namespace {
void check_input(const torch::Tensor& x, int64_t K) {
  TORCH_CHECK(x.device().is_cpu(), "kquant: input must be on the CPU");
  TORCH_CHECK(x.scalar_type() == torch::kFloat32, "kquant: input must be float32, got ", x.scalar_type());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) == K, "kquant: input must be [..., ", K, "], got ", x.sizes());
}

// y[..., N] = x[..., K] @ W^T (+ bias): one output per (row, n), each computed by one thread.
torch::Tensor matmul(const torch::Tensor& x_in, const Linear& L) {
  check_input(x_in, L.K);
  const torch::Tensor x = x_in.reshape({-1, L.K}).contiguous();
  const int64_t M = x.size(0);
  std::vector<int64_t> out_shape(x_in.sizes().begin(), x_in.sizes().end());
  out_shape.back() = L.N;
  torch::Tensor y = torch::empty(out_shape, x.options());
  if (M == 0 || L.N == 0) return y;
  QuantizedRows a;
  quantize_rows(x.data_ptr<float>(), M, L.K, L.nb, a);
  run_linears({&L}, a, M, {y.data_ptr<float>()});
  return y;
}

torch::Tensor k4_matmul(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& meta,
                        const c10::optional<torch::Tensor>& bias, int64_t K) {
  return matmul(x, make_linear({codes, meta}, bias, K));
}

torch::Tensor k6_matmul(const torch::Tensor& x, const torch::Tensor& lo, const torch::Tensor& hi,
                        const torch::Tensor& meta, const c10::optional<torch::Tensor>& bias, int64_t K) {
  return matmul(x, make_linear({lo, hi, meta}, bias, K));
}

std::vector<torch::Tensor> quantize_activations(const torch::Tensor& x_in) {
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == torch::kFloat32, "kquant: [M, K] float32 input expected");
  const torch::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), nb = (K + QB - 1) / QB;
  QuantizedRows a;
  quantize_rows(x.data_ptr<float>(), M, K, nb, a);
  auto q = torch::from_blob(a.q.data(), {M, nb * QB}, torch::kInt8).clone();
  auto d = torch::from_blob(a.d.data(), {M, nb}, torch::kFloat32).clone();
  return {q, d};
}

bool simd() { return KQ_AVX512 || KQ_AVX2; }

std::string isa() {
#if KQ_AVX512
  return "avx512-vnni";
#elif KQ_AVX2 && defined(__AVXVNNI__)
  return "avx2-vnni";
#elif KQ_AVX2
  return "avx2";
#else
  return "portable";
#endif
}

}  // namespace
}  // namespace kq

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace kq;
  m.def("k4_matmul", &k4_matmul, "y = x @ W.T (+ bias) with W in the k4 (Q4_K) layout");
  m.def("k6_matmul", &k6_matmul, "y = x @ W.T (+ bias) with W in the k6 (Q6_K) layout");
  m.def("quantize_activations", &quantize_activations, "the int8 codes and block scales the products use");
  m.def("simd", &simd, "whether a SIMD path (AVX-512 VNNI or AVX2, bitwise alike) was compiled (else the portable one)");
  m.def("isa", &isa, "the compiled path: avx512-vnni, avx2-vnni, avx2 or portable");
  register_decoder(m);
}
