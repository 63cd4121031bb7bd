// K-quant matrix products for the CPU: y[M, N] = x[M, K] @ W[N, K]^T with W held in GGUF-style blocks of
// 128 inputs and x quantised to int8 per 128 inputs (one float scale a block).
//
// Layouts (engine/kquant.py builds them: pack_tiles). The weight rows are interleaved in tiles of 16 rows
// (NT; the last tile zero-padded), so one 64-byte load holds 4 consecutive inputs of 16 rows and the 16
// lanes of a vector are 16 outputs; a tile is nb = ceil(K / 128) blocks:
//
//   k4 (Q4_K):  codes  uint8 [T, nb, 16, 64]  quad-row r, byte 4 * j + i: low nibble = code of input 4r + i of
//                                             row j, high nibble = input 64 + 4r + i
//               meta   uint8 [T, nb, 192]     fp16 d[16], fp16 dmin[16], uint8 sc[4][16], uint8 m[4][16]
//               w = d * sc[g] * code - dmin * m[g],   g = input / 32 (one scale and min a 32 inputs)
//   k6 (Q6_K):  lo     uint8 [T, nb, 16, 64]  low 4 bits of the codes, as k4
//               hi     uint8 [T, nb, 8, 64]   row r, byte 4j + i: bits 0-1 = high 2 bits of input 4r + i,
//                                             2-3 of 32 + 4r + i, 4-5 of 64 + 4r + i, 6-7 of 96 + 4r + i
//               meta   uint8 [T, nb, 160]     fp16 d[16], int8 sc[8][16]
//               w = d * sc[g] * (code - 32),   g = input / 16
//
// Arithmetic (every path, every row count): for output (m, n) and block b, with c the weight codes, q the
// activation codes, s_g the sum of q over group g:
//   k4:  I = sum_g sc[g] * sum_{k in g} c_k q_k,   J = sum_g m[g] * s_g          (exact integers)
//        acc = fma((float)I, d * xd, acc),  accm = fma((float)J, dmin * xd, accm),   y = acc - accm
//   k6:  I = sum_g sc[g] * (sum_{k in g} c_k q_k - 32 s_g),   acc = fma((float)I, d * xd, acc),   y = acc
// over b = 0, 1, ... in order (xd: the activation block's scale; d * xd one float product), then + bias.
// Integer sums are exact in any order and the float operations per output are the same sequence whichever
// instructions compute them, so the AVX-512 VNNI, AVX2 and portable paths give the same bits, and row m
// of an M-row product is bitwise the 1-row product: batch invariance by construction. Threads split the
// tiles only. Activations: d = max|x| / 127 per block, code = round-half-even(x / d); a block holding a NaN
// or an infinity gets d = NaN (codes 0), so its outputs are NaN (never a silently finite value).

#include "kquant.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

// Instruction paths, chosen at compile time (-march=native): AVX-512 VNNI; else AVX2 with FMA and F16C (the
// integer dot products by AVX-VNNI where the CPU has it, else vpmaddubsw + vpmaddwd); else portable C++.
// All three compute every output bit for bit alike (the arithmetic above). KQ_NO_AVX512 (a -D flag)
// compiles the AVX2 path on an AVX-512 machine, to test exactly that; KQ_NO_SIMD the portable one;
// KQ_NO_AVXVNNI keeps the AVX2 path off AVX-VNNI (what an AVX2 CPU without it, e.g. before Alder Lake or
// Zen 5, runs).
#if defined(__AVXVNNI__) && !defined(KQ_NO_AVXVNNI)
#define KQ_AVXVNNI 1
#else
#define KQ_AVXVNNI 0
#endif
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
// AMX (Intel Sapphire Rapids and later): the prefill's products (more than 16 rows) take the int8 tile
// multiply for whole groups of 16 activation rows; same integers, same float operations, same bits (used
// only where the OS grants the tile state: amx_permitted). KQ_NO_AMX compiles it out.
#if KQ_AVX512 && !defined(KQ_NO_AMX) && defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__linux__)
#define KQ_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#else
#define KQ_AMX 0
#endif

namespace kq {
namespace {

// Software prefetch distance in bytes of codes (0: none); a decode step streams ~1 GB of weights with one
// activation row and the hardware prefetcher alone left bandwidth unused (docs/results/README.md).
// Prefetches never fault and change no arithmetic.
#ifndef KQ_PREFETCH
#define KQ_PREFETCH 2048
#endif
// Activation rows sharing one pass over a weight tile (AVX-512: 5 registers a row). Few rows (decode, draft,
// verification: the weights come from memory) take up to 8 a pass, trading register spills for weight
// loads; a prefill 4 (compute-bound; measured on the default target's layers: docs/results/README.md).
// AVX2 (16 registers): 4 either way; its accumulators spill, but a weight load and its nibble split serve
// twice the rows of 2 a pass (measured on a Zen 3 EPYC: 4 rows 0.83x, 64 rows 0.82x the time of 2 a pass;
// 8 a pass no faster than 4: docs/results/2026-12-03-avx2-rows-per-pass.md).
#ifndef KQ_ROWS
#if KQ_AVX512
#define KQ_ROWS 8
#define KQ_PREFILL_ROWS 4
#else
#define KQ_ROWS 4
#define KQ_PREFILL_ROWS 4
#endif
#endif
#ifndef KQ_PREFILL_ROWS
#define KQ_PREFILL_ROWS KQ_ROWS
#endif
constexpr int MAX_TILE = KQ_ROWS;
constexpr int PREFILL_TILE = KQ_PREFILL_ROWS;
constexpr int64_t FEW_ROWS = 16;  // calls of at most this many rows take MAX_TILE rows a pass
// AVX2 without AVX-VNNI: calls of at least this many rows take the block-outer kernels (k4_tile_many)
#ifndef KQ_MANY_ROWS
#define KQ_MANY_ROWS 16
#endif
constexpr int64_t MANY_ROWS = KQ_MANY_ROWS;
// run_linears: above MIN_CHUNKED_ROWS rows, a thread takes the activation rows in chunks of about CHUNK_BYTES
// of codes (at least MIN_CHUNK rows)
constexpr int64_t CHUNK_BYTES = 512 * 1024;
constexpr int64_t MIN_CHUNKED_ROWS = 256;
constexpr int64_t MIN_CHUNK = 64;
constexpr int64_t K4_TILE = NT * 64;  // codes bytes of one block of a tile
constexpr int64_t K4_META = NT * 12;
constexpr int64_t K6_HI = NT * 32;
constexpr int64_t K6_META = NT * 10;

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

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline int32_t pair16(int32_t lo, int32_t hi) { return (int32_t)(((uint32_t)hi << 16) | ((uint32_t)lo & 0xFFFFu)); }

}  // namespace

void quantize_rows(const float* x, int64_t M, int64_t K, int64_t nb, QuantizedRows& out) {
  out.q.assign((size_t)(M * nb * QB), 0);
  out.d.assign((size_t)(M * nb), 0.f);
  out.sum.assign((size_t)(M * nb * G16), 0);
  out.p32.assign((size_t)(M * nb * 2), 0);
  out.p16.assign((size_t)(M * nb * 4), 0);
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
      int64_t j0 = 0;
#if KQ_AVX512 || KQ_AVX2
      if (len == QB) {  // a whole block 8 lanes at a time: max and the finite test are exact in any order
        const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
        __m256 mx = _mm256_setzero_ps(), ok = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
        for (; j0 < QB; j0 += 8) {
          const __m256 v = _mm256_and_ps(_mm256_loadu_ps(xr + k0 + j0), absmask);
          ok = _mm256_and_ps(ok, _mm256_cmp_ps(v, _mm256_set1_ps(INFINITY), _CMP_LT_OQ));  // NaN, inf: false
          mx = _mm256_max_ps(mx, v);
        }
        finite = _mm256_movemask_ps(ok) == 0xFF;
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, mx);
        for (const float v : lanes) amax = std::max(amax, v);
      }
#endif
      for (int64_t j = j0; j < len; ++j) {
        const float v = xr[k0 + j];
        if (!std::isfinite(v)) finite = false;
        amax = std::max(amax, std::fabs(v));
      }
      float* d = &out.d[(size_t)i];
      if (!finite) {
        *d = NAN;  // codes and sums stay 0: every product with this block is 0 * NaN = NaN
        continue;
      }
      if (amax == 0.f) continue;
      *d = amax / 127.f;
      const float id = 127.f / amax;
      int8_t* q = &out.q[(size_t)(i * QB)];
      j0 = 0;
#if KQ_AVX512 || KQ_AVX2
      if (len == QB) {  // x * id rounded in the current mode (what nearbyint does), clamped: the same codes
        const __m256 vid = _mm256_set1_ps(id), hi = _mm256_set1_ps(127.f), lo = _mm256_set1_ps(-127.f);
        const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lane interleave
        for (; j0 < QB; j0 += 32) {
          __m256i c[4];
          for (int t = 0; t < 4; ++t) {
            const __m256 r = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + k0 + j0 + 8 * t), vid),
                                             _MM_FROUND_CUR_DIRECTION | _MM_FROUND_NO_EXC);
            c[t] = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, r)));
          }
          const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
          _mm256_storeu_si256((__m256i*)(q + j0), _mm256_permutevar8x32_epi32(p, order));
        }
      }
#endif
      for (int64_t j = j0; j < len; ++j) {
        float r = std::nearbyint(xr[k0 + j] * id);
        r = std::min(127.f, std::max(-127.f, r));
        q[j] = (int8_t)r;
      }
      int32_t* s = &out.sum[(size_t)(i * G16)];
      for (int64_t g = 0; g < G16; ++g) {
        int32_t t = 0;
        for (int64_t j = 0; j < 16; ++j) t += q[g * 16 + j];
        s[g] = t;  // |t| <= 16 * 127: an int16
      }
      for (int64_t j = 0; j < 4; ++j) out.p16[(size_t)(i * 4 + j)] = pair16(s[2 * j], s[2 * j + 1]);
      for (int64_t j = 0; j < 2; ++j)
        out.p32[(size_t)(i * 2 + j)] = pair16(s[4 * j] + s[4 * j + 1], s[4 * j + 2] + s[4 * j + 3]);  // <= 4064
    }
  });
}

namespace {
// ------------------------------------------------------------------------------------------- portable
// The arithmetic of the header, output by output (any CPU).
inline int k4_code(const uint8_t* c, int k) {  // input k (0..127) of row j: c = the block's codes + 4 * j
  const int r = (k % 64) / 4, i = k % 4;
  const uint8_t byte = c[r * 64 + i];
  return k < 64 ? (byte & 0xF) : (byte >> 4);
}

void k4_tile_portable(const QuantizedRows& a, int64_t m0, int rows, int64_t nb, const uint8_t* codes,
                      const uint8_t* meta, float* out) {
  for (int r = 0; r < rows; ++r) {
    for (int j = 0; j < NT; ++j) {
      float acc = 0.f, accm = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* c = codes + b * K4_TILE + 4 * j;
        const uint8_t* mt = meta + b * K4_META;
        const int64_t row = (m0 + r) * nb + b;
        const int8_t* q = &a.q[(size_t)(row * QB)];
        const int32_t* s = &a.sum[(size_t)(row * G16)];
        int32_t I = 0, J = 0;
        for (int g = 0; g < 4; ++g) {
          int32_t t = 0;
          for (int k = g * 32; k < g * 32 + 32; ++k) t += k4_code(c, k) * q[k];
          I += (int32_t)mt[64 + 16 * g + j] * t;
          J += (int32_t)mt[128 + 16 * g + j] * (s[2 * g] + s[2 * g + 1]);
        }
        const float xd = a.d[(size_t)row];
        acc = std::fma((float)I, half_to_float(load_u16(mt + 2 * j)) * xd, acc);
        accm = std::fma((float)J, half_to_float(load_u16(mt + 32 + 2 * j)) * xd, accm);
      }
      out[r * NT + j] = acc - accm;
    }
  }
}

void k6_tile_portable(const QuantizedRows& a, int64_t m0, int rows, int64_t nb, const uint8_t* lo,
                      const uint8_t* hi, const uint8_t* meta, float* out) {
  for (int r = 0; r < rows; ++r) {
    for (int j = 0; j < NT; ++j) {
      float acc = 0.f;
      for (int64_t b = 0; b < nb; ++b) {
        const uint8_t* l = lo + b * K4_TILE + 4 * j;
        const uint8_t* h = hi + b * K6_HI + 4 * j;
        const uint8_t* mt = meta + b * K6_META;
        const int64_t row = (m0 + r) * nb + b;
        const int8_t* q = &a.q[(size_t)(row * QB)];
        const int32_t* s = &a.sum[(size_t)(row * G16)];
        int32_t I = 0;
        for (int g = 0; g < 8; ++g) {
          int32_t t = 0;
          for (int k = g * 16; k < g * 16 + 16; ++k) {
            const int u = k % 32, i = k % 4;
            const int high = (h[(u / 4) * 64 + i] >> (2 * (k / 32))) & 3;
            t += (k4_code(l, k) | (high << 4)) * q[k];
          }
          I += (int32_t)(int8_t)mt[32 + 16 * g + j] * (t - 32 * s[g]);
        }
        acc = std::fma((float)I, half_to_float(load_u16(mt + 2 * j)) * a.d[(size_t)row], acc);
      }
      out[r * NT + j] = acc;
    }
  }
}

#if KQ_AVX512 || KQ_AVX2
// Ask for a tile block's bytes KQ_PREFETCH bytes of codes ahead (prefetches never fault)
inline void prefetch(const uint8_t* p, int64_t offset) {
#if KQ_PREFETCH
  _mm_prefetch((const char*)(p + offset), _MM_HINT_T0);
#else
  (void)p;
  (void)offset;
#endif
}
#endif

#if KQ_AVX512
// --------------------------------------------------------------------------------------------- AVX-512
// Lane j = output j of the tile. One 64-byte quad-row load serves every activation row of the call; each
// row's 4 codes of that quad are broadcast to the 16 lanes.
// The per-block pieces the AVX-512 and AMX paths share (lane j: output j of the tile):
// k4 mins as int16 pairs (m[0] | m[1] << 16, m[2] | m[3] << 16), for the rows' pairs of 32-sums
inline void k4_min_pairs512(const uint8_t* mt, __m512i& m01, __m512i& m23) {
  m01 = _mm512_or_si512(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(mt + 128))),
                        _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(mt + 144))), 16));
  m23 = _mm512_or_si512(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(mt + 160))),
                        _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(mt + 176))), 16));
}

// k4: J = sum_g m[g] * s_g of activation block `row`
inline __m512i k4_min_sum512(const QuantizedRows& a, int64_t row, __m512i m01, __m512i m23) {
  return _mm512_add_epi32(_mm512_madd_epi16(m01, _mm512_set1_epi32(a.p32[(size_t)(row * 2)])),
                          _mm512_madd_epi16(m23, _mm512_set1_epi32(a.p32[(size_t)(row * 2 + 1)])));
}

// k6 scales as int16 pairs (sc[2i] | sc[2i + 1] << 16), for the rows' pairs of 16-sums
inline void k6_scale_pairs512(const uint8_t* mt, __m512i* scp) {
  const __m512i lo16 = _mm512_set1_epi32(0xFFFF);
  for (int i = 0; i < 4; ++i)
    scp[i] = _mm512_or_si512(
        _mm512_and_si512(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(mt + 32 + 32 * i))), lo16),
        _mm512_slli_epi32(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(mt + 48 + 32 * i))), 16));
}

// k6: sum_g sc[g] * s_g of activation block `row`
inline __m512i k6_scaled_sums512(const QuantizedRows& a, int64_t row, const __m512i* scp) {
  const int32_t* p = &a.p16[(size_t)(row * 4)];
  return _mm512_add_epi32(
      _mm512_add_epi32(_mm512_madd_epi16(scp[0], _mm512_set1_epi32(p[0])), _mm512_madd_epi16(scp[1], _mm512_set1_epi32(p[1]))),
      _mm512_add_epi32(_mm512_madd_epi16(scp[2], _mm512_set1_epi32(p[2])), _mm512_madd_epi16(scp[3], _mm512_set1_epi32(p[3]))));
}

template <int R>
void k4_tile_avx512(const QuantizedRows& a, int64_t m0, int64_t nb, const uint8_t* codes, const uint8_t* meta,
                    float* out) {
  const __m512i mask4 = _mm512_set1_epi8(0x0F);
  __m512 acc[R], accm[R];
  for (int r = 0; r < R; ++r) acc[r] = accm[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* c = codes + b * K4_TILE;
    const uint8_t* mt = meta + b * K4_META;
    const int8_t* q[R];
    for (int r = 0; r < R; ++r) q[r] = &a.q[(size_t)(((m0 + r) * nb + b) * QB)];
    __m512i I[R];
    for (int r = 0; r < R; ++r) I[r] = _mm512_setzero_si512();
    for (int half = 0; half < 2; ++half) {  // groups (half, 2 + half): quad-rows 8 * half .. 8 * half + 7
      __m512i tl[R], th[R];
      for (int r = 0; r < R; ++r) tl[r] = th[r] = _mm512_setzero_si512();
      for (int u = 8 * half; u < 8 * half + 8; ++u) {
        prefetch(c, u * 64 + KQ_PREFETCH);
        const __m512i w = _mm512_loadu_si512(c + u * 64);
        const __m512i wl = _mm512_and_si512(w, mask4);
        const __m512i wh = _mm512_and_si512(_mm512_srli_epi16(w, 4), mask4);
        for (int r = 0; r < R; ++r) {
          tl[r] = _mm512_dpbusd_epi32(tl[r], wl, _mm512_set1_epi32(load_i32(q[r] + 4 * u)));
          th[r] = _mm512_dpbusd_epi32(th[r], wh, _mm512_set1_epi32(load_i32(q[r] + 64 + 4 * u)));
        }
      }
      const __m512i scl = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(mt + 64 + 16 * half)));
      const __m512i sch = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(mt + 64 + 16 * (2 + half))));
      for (int r = 0; r < R; ++r)
        I[r] = _mm512_add_epi32(I[r], _mm512_add_epi32(_mm512_mullo_epi32(tl[r], scl), _mm512_mullo_epi32(th[r], sch)));
    }
    prefetch(mt, KQ_PREFETCH * K4_META / K4_TILE);
    prefetch(mt, 64 + KQ_PREFETCH * K4_META / K4_TILE);
    prefetch(mt, 128 + KQ_PREFETCH * K4_META / K4_TILE);
    __m512i m01, m23;
    k4_min_pairs512(mt, m01, m23);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)mt));
    const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(mt + 32)));
    for (int r = 0; r < R; ++r) {
      const int64_t row = (m0 + r) * nb + b;
      const __m512i J = k4_min_sum512(a, row, m01, m23);
      const __m512 xd = _mm512_set1_ps(a.d[(size_t)row]);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(I[r]), _mm512_mul_ps(d, xd), acc[r]);
      accm[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(J), _mm512_mul_ps(dmin, xd), accm[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * NT, _mm512_sub_ps(acc[r], accm[r]));
}

// The 6-bit codes of quad-row u (0..15) of a k6 block: low half (inputs 4u..) and high half (64 + 4u..)
inline void k6_codes512(const uint8_t* l, const uint8_t* h, int u, __m512i& cl, __m512i& ch) {
  const __m512i mask4 = _mm512_set1_epi8(0x0F), mask30 = _mm512_set1_epi8(0x30);
  const __m512i w = _mm512_loadu_si512(l + u * 64);
  const __m512i hb = _mm512_loadu_si512(h + (u % 8) * 64);
  // the 2 high bits of the low half sit at bits 0-1 (u < 8) or 2-3, of the high half at 4-5 or 6-7
  const __m512i hl = u < 8 ? _mm512_slli_epi16(hb, 4) : _mm512_slli_epi16(hb, 2);
  const __m512i hh = u < 8 ? hb : _mm512_srli_epi16(hb, 2);
  cl = _mm512_or_si512(_mm512_and_si512(w, mask4), _mm512_and_si512(hl, mask30));
  ch = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(w, 4), mask4), _mm512_and_si512(hh, mask30));
}

template <int R>
void k6_tile_avx512(const QuantizedRows& a, int64_t m0, int64_t nb, const uint8_t* lo, const uint8_t* hi,
                    const uint8_t* meta, float* out) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* l = lo + b * K4_TILE;
    const uint8_t* h = hi + b * K6_HI;
    const uint8_t* mt = meta + b * K6_META;
    const int8_t* q[R];
    for (int r = 0; r < R; ++r) q[r] = &a.q[(size_t)(((m0 + r) * nb + b) * QB)];
    __m512i I[R];
    for (int r = 0; r < R; ++r) I[r] = _mm512_setzero_si512();
    for (int quarter = 0; quarter < 4; ++quarter) {  // groups (quarter, 4 + quarter): quad-rows 4 * quarter ..
      __m512i tl[R], th[R];
      for (int r = 0; r < R; ++r) tl[r] = th[r] = _mm512_setzero_si512();
      for (int u = 4 * quarter; u < 4 * quarter + 4; ++u) {
        prefetch(l, u * 64 + KQ_PREFETCH);
        if (u < 8) prefetch(h, u * 64 + KQ_PREFETCH / 2);
        __m512i cl, ch;
        k6_codes512(l, h, u, cl, ch);
        for (int r = 0; r < R; ++r) {
          tl[r] = _mm512_dpbusd_epi32(tl[r], cl, _mm512_set1_epi32(load_i32(q[r] + 4 * u)));
          th[r] = _mm512_dpbusd_epi32(th[r], ch, _mm512_set1_epi32(load_i32(q[r] + 64 + 4 * u)));
        }
      }
      const __m512i scl = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(mt + 32 + 16 * quarter)));
      const __m512i sch = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(mt + 32 + 16 * (4 + quarter))));
      for (int r = 0; r < R; ++r)
        I[r] = _mm512_add_epi32(I[r], _mm512_add_epi32(_mm512_mullo_epi32(tl[r], scl), _mm512_mullo_epi32(th[r], sch)));
    }
    prefetch(mt, KQ_PREFETCH * K6_META / K4_TILE);
    prefetch(mt, 64 + KQ_PREFETCH * K6_META / K4_TILE);
    prefetch(mt, 128 + KQ_PREFETCH * K6_META / K4_TILE);
    __m512i scp[4];  // I - 32 * sum_g sc[g] s_g
    k6_scale_pairs512(mt, scp);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)mt));
    for (int r = 0; r < R; ++r) {
      const int64_t row = (m0 + r) * nb + b;
      const __m512i Ib = _mm512_sub_epi32(I[r], _mm512_slli_epi32(k6_scaled_sums512(a, row, scp), 5));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(Ib), _mm512_mul_ps(d, _mm512_set1_ps(a.d[(size_t)row])), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + r * NT, acc[r]);
}
#endif

#if KQ_AVX2
// ------------------------------------------------------------------------------------------------ AVX2
// The AVX-512 path in two passes of 8 lanes (outputs 8 * hf .. 8 * hf + 7 of the tile): every lane gets the
// same integers and the same float operations, so the same bits.

// 8 int32 lanes: lane j += sum over bytes 4j..4j+3 of w (unsigned, < 64) x q (signed, |q| <= 127). Exact either
// way: a vpmaddubsw pair sum is at most 2 * 63 * 127 = 16002, inside int16.
inline __m256i dot_u8s8(__m256i acc, __m256i w, __m256i q) {
#if KQ_AVXVNNI
  return _mm256_dpbusd_avx_epi32(acc, w, q);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, q), _mm256_set1_epi16(1)));
#endif
}

// Without AVX-VNNI (KQ_I16): vpmaddubsw's int16 pair sums are added up in int16 over several quad-rows and
// widened once (vpmaddwd by ones), instead of widening every product: a Q4_K pair sum is at most
// 2 * 15 * 127 = 3810, so 8 quad-rows stay <= 30480 (k4: one widening a half-group of 8); a Q6_K one
// 16002, so 2 (k6: one widening a pair). The same exact integers, one instruction fewer a product and row.
// KQ_NO_I16ACC (a -D flag) widens every product, as before.
#if !KQ_AVXVNNI && !defined(KQ_NO_I16ACC)
#define KQ_I16 1
#else
#define KQ_I16 0
#endif
inline __m256i widen16(__m256i acc16) { return _mm256_madd_epi16(acc16, _mm256_set1_epi16(1)); }
inline __m256i add_u8s8_16(__m256i acc16, __m256i w, __m256i q) {
  return _mm256_add_epi16(acc16, _mm256_maddubs_epi16(w, q));
}

inline __m256i u8x8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
inline __m256i i8x8(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)); }
inline __m256 f16x8(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }

template <int R>
void k4_tile_avx2(const QuantizedRows& a, int64_t m0, int64_t nb, const uint8_t* codes, const uint8_t* meta,
                  float* out) {
  const __m256i mask4 = _mm256_set1_epi8(0x0F);
  for (int hf = 0; hf < 2; ++hf) {
    __m256 acc[R], accm[R];
    for (int r = 0; r < R; ++r) acc[r] = accm[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* c = codes + b * K4_TILE + 32 * hf;
      const uint8_t* mt = meta + b * K4_META;
      const int8_t* q[R];
      for (int r = 0; r < R; ++r) q[r] = &a.q[(size_t)(((m0 + r) * nb + b) * QB)];
      __m256i I[R];
      for (int r = 0; r < R; ++r) I[r] = _mm256_setzero_si256();
      for (int half = 0; half < 2; ++half) {
        __m256i tl[R], th[R];
        for (int r = 0; r < R; ++r) tl[r] = th[r] = _mm256_setzero_si256();
        for (int u = 8 * half; u < 8 * half + 8; ++u) {
          prefetch(c, u * 64 + KQ_PREFETCH);
          const __m256i w = _mm256_loadu_si256((const __m256i*)(c + u * 64));
          const __m256i wl = _mm256_and_si256(w, mask4);
          const __m256i wh = _mm256_and_si256(_mm256_srli_epi16(w, 4), mask4);
          for (int r = 0; r < R; ++r) {
#if KQ_I16
            tl[r] = add_u8s8_16(tl[r], wl, _mm256_set1_epi32(load_i32(q[r] + 4 * u)));
            th[r] = add_u8s8_16(th[r], wh, _mm256_set1_epi32(load_i32(q[r] + 64 + 4 * u)));
#else
            tl[r] = dot_u8s8(tl[r], wl, _mm256_set1_epi32(load_i32(q[r] + 4 * u)));
            th[r] = dot_u8s8(th[r], wh, _mm256_set1_epi32(load_i32(q[r] + 64 + 4 * u)));
#endif
          }
        }
#if KQ_I16
        for (int r = 0; r < R; ++r) {
          tl[r] = widen16(tl[r]);
          th[r] = widen16(th[r]);
        }
#endif
        const __m256i scl = u8x8(mt + 64 + 16 * half + 8 * hf);
        const __m256i sch = u8x8(mt + 64 + 16 * (2 + half) + 8 * hf);
        for (int r = 0; r < R; ++r)
          I[r] = _mm256_add_epi32(I[r], _mm256_add_epi32(_mm256_mullo_epi32(tl[r], scl), _mm256_mullo_epi32(th[r], sch)));
      }
      prefetch(mt, KQ_PREFETCH * K4_META / K4_TILE);
      prefetch(mt, 64 + KQ_PREFETCH * K4_META / K4_TILE);
      prefetch(mt, 128 + KQ_PREFETCH * K4_META / K4_TILE);
      const __m256i m01 = _mm256_or_si256(u8x8(mt + 128 + 8 * hf), _mm256_slli_epi32(u8x8(mt + 144 + 8 * hf), 16));
      const __m256i m23 = _mm256_or_si256(u8x8(mt + 160 + 8 * hf), _mm256_slli_epi32(u8x8(mt + 176 + 8 * hf), 16));
      const __m256 d = f16x8(mt + 16 * hf);
      const __m256 dmin = f16x8(mt + 32 + 16 * hf);
      for (int r = 0; r < R; ++r) {
        const int64_t row = (m0 + r) * nb + b;
        const __m256i J = _mm256_add_epi32(_mm256_madd_epi16(m01, _mm256_set1_epi32(a.p32[(size_t)(row * 2)])),
                                           _mm256_madd_epi16(m23, _mm256_set1_epi32(a.p32[(size_t)(row * 2 + 1)])));
        const __m256 xd = _mm256_set1_ps(a.d[(size_t)row]);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I[r]), _mm256_mul_ps(d, xd), acc[r]);
        accm[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(J), _mm256_mul_ps(dmin, xd), accm[r]);
      }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * NT + 8 * hf, _mm256_sub_ps(acc[r], accm[r]));
  }
}

template <int R>
void k6_tile_avx2(const QuantizedRows& a, int64_t m0, int64_t nb, const uint8_t* lo, const uint8_t* hi,
                  const uint8_t* meta, float* out) {
  const __m256i mask4 = _mm256_set1_epi8(0x0F), mask30 = _mm256_set1_epi8(0x30);
  const __m256i lo16 = _mm256_set1_epi32(0xFFFF);
  for (int hf = 0; hf < 2; ++hf) {
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* l = lo + b * K4_TILE + 32 * hf;
      const uint8_t* h = hi + b * K6_HI + 32 * hf;
      const uint8_t* mt = meta + b * K6_META;
      const int8_t* q[R];
      for (int r = 0; r < R; ++r) q[r] = &a.q[(size_t)(((m0 + r) * nb + b) * QB)];
      __m256i I[R];
      for (int r = 0; r < R; ++r) I[r] = _mm256_setzero_si256();
      for (int quarter = 0; quarter < 4; ++quarter) {
        __m256i tl[R], th[R];
#if KQ_I16
        __m256i pl16[R], ph16[R];
#endif
        for (int r = 0; r < R; ++r) tl[r] = th[r] = _mm256_setzero_si256();
        for (int u = 4 * quarter; u < 4 * quarter + 4; ++u) {
          prefetch(l, u * 64 + KQ_PREFETCH);
          if (u < 8) prefetch(h, u * 64 + KQ_PREFETCH / 2);
          const __m256i w = _mm256_loadu_si256((const __m256i*)(l + u * 64));
          const __m256i hb = _mm256_loadu_si256((const __m256i*)(h + (u % 8) * 64));
          const __m256i hl = u < 8 ? _mm256_slli_epi16(hb, 4) : _mm256_slli_epi16(hb, 2);
          const __m256i hh = u < 8 ? hb : _mm256_srli_epi16(hb, 2);
          const __m256i cl = _mm256_or_si256(_mm256_and_si256(w, mask4), _mm256_and_si256(hl, mask30));
          const __m256i ch =
              _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(w, 4), mask4), _mm256_and_si256(hh, mask30));
#if KQ_I16
          for (int r = 0; r < R; ++r) {  // the pair (u - 1, u) in int16, widened at odd u
            const __m256i pl = _mm256_maddubs_epi16(cl, _mm256_set1_epi32(load_i32(q[r] + 4 * u)));
            const __m256i ph = _mm256_maddubs_epi16(ch, _mm256_set1_epi32(load_i32(q[r] + 64 + 4 * u)));
            if (u % 2 == 0) {
              pl16[r] = pl;
              ph16[r] = ph;
            } else {
              tl[r] = _mm256_add_epi32(tl[r], widen16(_mm256_add_epi16(pl16[r], pl)));
              th[r] = _mm256_add_epi32(th[r], widen16(_mm256_add_epi16(ph16[r], ph)));
            }
          }
#else
          for (int r = 0; r < R; ++r) {
            tl[r] = dot_u8s8(tl[r], cl, _mm256_set1_epi32(load_i32(q[r] + 4 * u)));
            th[r] = dot_u8s8(th[r], ch, _mm256_set1_epi32(load_i32(q[r] + 64 + 4 * u)));
          }
#endif
        }
        const __m256i scl = i8x8(mt + 32 + 16 * quarter + 8 * hf);
        const __m256i sch = i8x8(mt + 32 + 16 * (4 + quarter) + 8 * hf);
        for (int r = 0; r < R; ++r)
          I[r] = _mm256_add_epi32(I[r], _mm256_add_epi32(_mm256_mullo_epi32(tl[r], scl), _mm256_mullo_epi32(th[r], sch)));
      }
      prefetch(mt, KQ_PREFETCH * K6_META / K4_TILE);
      prefetch(mt, 64 + KQ_PREFETCH * K6_META / K4_TILE);
      prefetch(mt, 128 + KQ_PREFETCH * K6_META / K4_TILE);
      __m256i scp[4];
      for (int i = 0; i < 4; ++i)
        scp[i] = _mm256_or_si256(_mm256_and_si256(i8x8(mt + 32 + 32 * i + 8 * hf), lo16),
                                 _mm256_slli_epi32(i8x8(mt + 48 + 32 * i + 8 * hf), 16));
      const __m256 d = f16x8(mt + 16 * hf);
      for (int r = 0; r < R; ++r) {
        const int64_t row = (m0 + r) * nb + b;
        const int32_t* p = &a.p16[(size_t)(row * 4)];
        const __m256i S = _mm256_add_epi32(
            _mm256_add_epi32(_mm256_madd_epi16(scp[0], _mm256_set1_epi32(p[0])), _mm256_madd_epi16(scp[1], _mm256_set1_epi32(p[1]))),
            _mm256_add_epi32(_mm256_madd_epi16(scp[2], _mm256_set1_epi32(p[2])), _mm256_madd_epi16(scp[3], _mm256_set1_epi32(p[3]))));
        const __m256i Ib = _mm256_sub_epi32(I[r], _mm256_slli_epi32(S, 5));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(Ib), _mm256_mul_ps(d, _mm256_set1_ps(a.d[(size_t)row])), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) _mm256_storeu_ps(out + r * NT + 8 * hf, acc[r]);
  }
}

// ------------------------------------------------------------------------------- AVX2, many rows a call
// A call of MANY_ROWS rows or more (a prefill chunk, a batch of drafted rows, a verification tree) takes the
// weight block outside and the rows inside: each 128-input block of a tile is unpacked once to int8 codes
// (2 KB, kept in L1) and then serves every row of the call, the rows' float accumulators in memory (rows x 32
// floats). The microkernels below compute a whole block for both 8-output halves of the tile at once (each
// activation broadcast serves both) and keep the int32 block sums in registers, in assembly: k4 2 rows (8
// int16 group sums, 4 int32 block sums), k6 4 rows (8 int32 block sums). Per output the same integers are
// formed -- group sums in int16 within the bounds above (k4: 8 quad-rows, k6: 2), multiplied by the scale
// by vpmaddwd against the scale repeated in both int16 halves of a lane: sc * (p0 + p1), exact in int32 --
// and the same float operations follow in the same block order, so every output bit is the 1-row one.
#if KQ_I16
// int32 lanes x (each < 2^15 in magnitude) -> the same value in both int16 halves of the lane
inline __m256i pair_same(__m256i x) {
  return _mm256_or_si256(_mm256_and_si256(x, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(x, 16));
}

// n zeroed floats of `buf`, 64-byte aligned: the rows' float accumulators, read and written 32 bytes at a time,
// then never split a cache line (a heap block is only 16-byte aligned: then half the accesses split a line;
// 2-13% slower in a standalone harness with the buffer so misaligned)
inline float* zeroed_aligned(std::vector<float>& buf, int64_t n) {
  buf.assign((size_t)(n + 16), 0.f);
  return buf.data() + (64 - (uintptr_t)buf.data() % 64) % 64 / sizeof(float);
}

// k4, rows m0 and m0 + 1 (the second one only where rows == 2; else row m0 again, not written), one block b:
// W the unpacked block ([u][low hf0 | low hf1 | high hf0 | high hf1], 32 bytes each), sc the scales as int16
// pairs ([hf][g]), acc the rows' accumulators (row r at 32 r: acc hf0, acc hf1, accm hf0, accm hf1).
inline void k4_rows2_block(const QuantizedRows& a, int64_t m0, int rows, int64_t nb, int64_t b, const uint8_t* W,
                           const __m256i* sc, const __m256i* mins, const __m256* d, const __m256* dmin, float* acc) {
  const int64_t row0 = m0 * nb + b, row1 = (m0 + (rows > 1 ? 1 : 0)) * nb + b;
  const int8_t* q0 = &a.q[(size_t)(row0 * QB)];
  const int8_t* q1 = &a.q[(size_t)(row1 * QB)];
  __m256i I00, I01, I10, I11;  // I[row][hf]
  const uint8_t* w = W;
  // ymm0-3: row 0's int16 sums (low hf0, low hf1, high hf0, high hf1), ymm4-7 row 1's; ymm8-9 weights;
  // ymm10-11 the broadcast codes and products. After each half (8 quad-rows) the sums are multiplied by their
  // group's scale (vpmaddwd: sc * (p0 + p1)) into the int32 block sums I, which stay in registers. Unrolled: as two
  // loops of 8 quad-rows it was up to ~10% slower in a standalone harness (within this shared machine's noise).
#define KQ_U(U)                                                                                              \
  "vmovdqa " #U "*128(%[w]), %%ymm8\n vmovdqa " #U "*128+32(%[w]), %%ymm9\n"                                 \
  "vpbroadcastd " #U "*4(%[q0]), %%ymm10\n vpmaddubsw %%ymm10, %%ymm8, %%ymm11\n vpaddw %%ymm11, %%ymm0, %%ymm0\n" \
  "vpmaddubsw %%ymm10, %%ymm9, %%ymm10\n vpaddw %%ymm10, %%ymm1, %%ymm1\n"                                   \
  "vpbroadcastd " #U "*4(%[q1]), %%ymm10\n vpmaddubsw %%ymm10, %%ymm8, %%ymm11\n vpaddw %%ymm11, %%ymm4, %%ymm4\n" \
  "vpmaddubsw %%ymm10, %%ymm9, %%ymm10\n vpaddw %%ymm10, %%ymm5, %%ymm5\n"                                   \
  "vmovdqa " #U "*128+64(%[w]), %%ymm8\n vmovdqa " #U "*128+96(%[w]), %%ymm9\n"                              \
  "vpbroadcastd 64+" #U "*4(%[q0]), %%ymm10\n vpmaddubsw %%ymm10, %%ymm8, %%ymm11\n vpaddw %%ymm11, %%ymm2, %%ymm2\n" \
  "vpmaddubsw %%ymm10, %%ymm9, %%ymm10\n vpaddw %%ymm10, %%ymm3, %%ymm3\n"                                   \
  "vpbroadcastd 64+" #U "*4(%[q1]), %%ymm10\n vpmaddubsw %%ymm10, %%ymm8, %%ymm11\n vpaddw %%ymm11, %%ymm6, %%ymm6\n" \
  "vpmaddubsw %%ymm10, %%ymm9, %%ymm10\n vpaddw %%ymm10, %%ymm7, %%ymm7\n"
#define KQ_ZERO                                                                                     \
  "vpxor %%ymm0, %%ymm0, %%ymm0\n vpxor %%ymm1, %%ymm1, %%ymm1\n vpxor %%ymm2, %%ymm2, %%ymm2\n" \
  "vpxor %%ymm3, %%ymm3, %%ymm3\n vpxor %%ymm4, %%ymm4, %%ymm4\n vpxor %%ymm5, %%ymm5, %%ymm5\n" \
  "vpxor %%ymm6, %%ymm6, %%ymm6\n vpxor %%ymm7, %%ymm7, %%ymm7\n"
// sums of half H times the scales: low group H (sc[hf][H]), high group 2 + H (sc[hf][2 + H]), 32 bytes a vector
#define KQ_SCALE(H)                                                                                                \
  "vpmaddwd " #H "*32(%[sc]), %%ymm0, %%ymm0\n vpmaddwd (2+" #H ")*32(%[sc]), %%ymm2, %%ymm2\n"                  \
  "vpmaddwd (4+" #H ")*32(%[sc]), %%ymm1, %%ymm1\n vpmaddwd (6+" #H ")*32(%[sc]), %%ymm3, %%ymm3\n"              \
  "vpmaddwd " #H "*32(%[sc]), %%ymm4, %%ymm4\n vpmaddwd (2+" #H ")*32(%[sc]), %%ymm6, %%ymm6\n"                  \
  "vpmaddwd (4+" #H ")*32(%[sc]), %%ymm5, %%ymm5\n vpmaddwd (6+" #H ")*32(%[sc]), %%ymm7, %%ymm7\n"              \
  "vpaddd %%ymm2, %%ymm0, %%ymm0\n vpaddd %%ymm3, %%ymm1, %%ymm1\n vpaddd %%ymm6, %%ymm4, %%ymm4\n"             \
  "vpaddd %%ymm7, %%ymm5, %%ymm5\n"
  __asm__ volatile(
      KQ_ZERO
      KQ_U(0) KQ_U(1) KQ_U(2) KQ_U(3) KQ_U(4) KQ_U(5) KQ_U(6) KQ_U(7)
      KQ_SCALE(0)
      "vmovdqa %%ymm0, %[I00]\n vmovdqa %%ymm1, %[I01]\n vmovdqa %%ymm4, %[I10]\n vmovdqa %%ymm5, %[I11]\n"
      KQ_ZERO
      KQ_U(8) KQ_U(9) KQ_U(10) KQ_U(11) KQ_U(12) KQ_U(13) KQ_U(14) KQ_U(15)
      KQ_SCALE(1)
      "vpaddd %%ymm0, %[I00], %[I00]\n vpaddd %%ymm1, %[I01], %[I01]\n vpaddd %%ymm4, %[I10], %[I10]\n"
      "vpaddd %%ymm5, %[I11], %[I11]\n"
      : [I00] "=&x"(I00), [I01] "=&x"(I01), [I10] "=&x"(I10), [I11] "=&x"(I11)
      : [w] "r"(w), [q0] "r"(q0), [q1] "r"(q1), [sc] "r"(sc)
      : "memory", "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",
        "xmm11");
#undef KQ_U
#undef KQ_ZERO
#undef KQ_SCALE
  const __m256i I[2][2] = {{I00, I01}, {I10, I11}};
  for (int r = 0; r < rows; ++r) {
    const int64_t row = r == 0 ? row0 : row1;
    const __m256i p0 = _mm256_set1_epi32(a.p32[(size_t)(row * 2)]), p1 = _mm256_set1_epi32(a.p32[(size_t)(row * 2 + 1)]);
    const __m256 xd = _mm256_set1_ps(a.d[(size_t)row]);
    float* ar = acc + r * 32;
    for (int hf = 0; hf < 2; ++hf) {
      const __m256i J = _mm256_add_epi32(_mm256_madd_epi16(mins[2 * hf], p0), _mm256_madd_epi16(mins[2 * hf + 1], p1));
      _mm256_storeu_ps(ar + 8 * hf, _mm256_fmadd_ps(_mm256_cvtepi32_ps(I[r][hf]), _mm256_mul_ps(d[hf], xd),
                                                    _mm256_loadu_ps(ar + 8 * hf)));
      _mm256_storeu_ps(ar + 16 + 8 * hf, _mm256_fmadd_ps(_mm256_cvtepi32_ps(J), _mm256_mul_ps(dmin[hf], xd),
                                                         _mm256_loadu_ps(ar + 16 + 8 * hf)));
    }
  }
}

// rows [m0, m1) of one k4 tile: out[r * 16 + j] as k4_tile_avx2 computes it
void k4_tile_many(const QuantizedRows& a, int64_t m0, int64_t m1, int64_t nb, const uint8_t* codes,
                  const uint8_t* meta, float* out) {
  const int64_t M = m1 - m0;
  thread_local std::vector<float> buf;
  float* accs = zeroed_aligned(buf, M * 32);
  alignas(64) uint8_t W[16 * 128];
  const __m256i mask4 = _mm256_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* c = codes + b * K4_TILE;
    const uint8_t* mt = meta + b * K4_META;
    for (int u = 0; u < 16; ++u) {
      prefetch(c, u * 64 + KQ_PREFETCH);
      for (int hf = 0; hf < 2; ++hf) {
        const __m256i w = _mm256_loadu_si256((const __m256i*)(c + u * 64 + 32 * hf));
        _mm256_store_si256((__m256i*)(W + u * 128 + 32 * hf), _mm256_and_si256(w, mask4));
        _mm256_store_si256((__m256i*)(W + u * 128 + 64 + 32 * hf), _mm256_and_si256(_mm256_srli_epi16(w, 4), mask4));
      }
    }
    alignas(32) __m256i sc[8];
    __m256i mins[4];
    __m256 d[2], dmin[2];
    for (int hf = 0; hf < 2; ++hf) {
      for (int g = 0; g < 4; ++g) sc[hf * 4 + g] = pair_same(u8x8(mt + 64 + 16 * g + 8 * hf));
      mins[2 * hf] = _mm256_or_si256(u8x8(mt + 128 + 8 * hf), _mm256_slli_epi32(u8x8(mt + 144 + 8 * hf), 16));
      mins[2 * hf + 1] = _mm256_or_si256(u8x8(mt + 160 + 8 * hf), _mm256_slli_epi32(u8x8(mt + 176 + 8 * hf), 16));
      d[hf] = f16x8(mt + 16 * hf);
      dmin[hf] = f16x8(mt + 32 + 16 * hf);
    }
    for (int64_t m = 0; m < M; m += 2)
      k4_rows2_block(a, m0 + m, (int)std::min<int64_t>(2, M - m), nb, b, W, sc, mins, d, dmin, &accs[(size_t)(m * 32)]);
  }
  for (int64_t r = 0; r < M; ++r)
    for (int hf = 0; hf < 2; ++hf)
      _mm256_storeu_ps(out + r * NT + 8 * hf, _mm256_sub_ps(_mm256_loadu_ps(&accs[(size_t)(r * 32 + 8 * hf)]),
                                                            _mm256_loadu_ps(&accs[(size_t)(r * 32 + 16 + 8 * hf)])));
}

// k6, rows m0 .. m0 + 3 (the first `rows` of them real; the others repeat row m0 and are not written), one block b:
// W the unpacked 6-bit codes ([u][low half hf0 | low hf1 | high half hf0 | high hf1], 32 bytes each), sc the
// scales as int16 pairs ([g][hf]), scp the scale pairs of the -32 term ([hf][4]), acc row r at 16 r.
inline void k6_rows4_block(const QuantizedRows& a, int64_t m0, int rows, int64_t nb, int64_t b, const uint8_t* W,
                           const __m256i* sc, const __m256i* scp, const __m256* d, float* acc) {
  int64_t row[4];
  for (int r = 0; r < 4; ++r) row[r] = (m0 + (r < rows ? r : 0)) * nb + b;
  const int8_t* q0 = &a.q[(size_t)(row[0] * QB)];
  const int8_t* q1 = &a.q[(size_t)(row[1] * QB)];
  const int8_t* q2 = &a.q[(size_t)(row[2] * QB)];
  const int8_t* q3 = &a.q[(size_t)(row[3] * QB)];
  __m256i I[4][2];  // the int32 block sums, in registers throughout (ymm0-7 below)
  int64_t i = 0;
  const uint8_t* w = W;
  const __m256i* s = sc;
  // One row, a pair of quad-rows (u, u + 1) of one half of the inputs (X: 0 low, 64 high; J: the pair's first
  // quad-row within the quarter): the two products of each 8-output half summed in int16 (<= 2 * 16002), then
  // times the group's scale in both int16 halves of a lane (vpmaddwd) into the row's int32 sums A (hf0), B (hf1).
  // ymm8-11: broadcast codes and products; ymm12-15: the pair's weights (loaded by KQ_W).
#define KQ_W(X, J)                                                                                     \
  "vmovdqa " #J "*128+" #X "(%[w]), %%ymm12\n vmovdqa " #J "*128+" #X "+32(%[w]), %%ymm13\n"          \
  "vmovdqa " #J "*128+128+" #X "(%[w]), %%ymm14\n vmovdqa " #J "*128+128+" #X "+32(%[w]), %%ymm15\n"
#define KQ_R(Q, X, J, S, A, B)                                                                                      \
  "vpbroadcastd " #X "+" #J "*4(%[" Q "],%[i]), %%ymm8\n vpmaddubsw %%ymm8, %%ymm12, %%ymm9\n"                   \
  "vpmaddubsw %%ymm8, %%ymm13, %%ymm8\n vpbroadcastd " #X "+" #J "*4+4(%[" Q "],%[i]), %%ymm10\n"                 \
  "vpmaddubsw %%ymm10, %%ymm14, %%ymm11\n vpaddw %%ymm11, %%ymm9, %%ymm9\n vpmaddubsw %%ymm10, %%ymm15, %%ymm10\n" \
  "vpaddw %%ymm10, %%ymm8, %%ymm8\n vpmaddwd " #S "(%[s]), %%ymm9, %%ymm9\n vpmaddwd " #S "+32(%[s]), %%ymm8, %%ymm8\n" \
  "vpaddd %%ymm9, %%ymm" #A ", %%ymm" #A "\n vpaddd %%ymm8, %%ymm" #B ", %%ymm" #B "\n"
#define KQ_PAIR(X, J, S) \
  KQ_W(X, J) KQ_R("q0", X, J, S, 0, 1) KQ_R("q1", X, J, S, 2, 3) KQ_R("q2", X, J, S, 4, 5) KQ_R("q3", X, J, S, 6, 7)
  __asm__ volatile(
      "vpxor %%ymm0, %%ymm0, %%ymm0\n vpxor %%ymm1, %%ymm1, %%ymm1\n vpxor %%ymm2, %%ymm2, %%ymm2\n"
      "vpxor %%ymm3, %%ymm3, %%ymm3\n vpxor %%ymm4, %%ymm4, %%ymm4\n vpxor %%ymm5, %%ymm5, %%ymm5\n"
      "vpxor %%ymm6, %%ymm6, %%ymm6\n vpxor %%ymm7, %%ymm7, %%ymm7\n"
      "1:\n"  // one quarter: quad-rows 4k .. 4k + 3, low half group k (sc at s), high half group 4 + k (s + 256)
      KQ_PAIR(0, 0, 0) KQ_PAIR(0, 2, 0) KQ_PAIR(64, 0, 256) KQ_PAIR(64, 2, 256)
      "add $512, %[w]\n add $64, %[s]\n add $16, %[i]\n cmp $64, %[i]\n jne 1b\n"
      "vmovdqu %%ymm0, (%[o])\n vmovdqu %%ymm1, 32(%[o])\n vmovdqu %%ymm2, 64(%[o])\n vmovdqu %%ymm3, 96(%[o])\n"
      "vmovdqu %%ymm4, 128(%[o])\n vmovdqu %%ymm5, 160(%[o])\n vmovdqu %%ymm6, 192(%[o])\n vmovdqu %%ymm7, 224(%[o])\n"
      : [w] "+r"(w), [i] "+r"(i), [s] "+r"(s)
      : [q0] "r"(q0), [q1] "r"(q1), [q2] "r"(q2), [q3] "r"(q3), [o] "r"(&I[0][0])
      : "memory", "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10",
        "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");
#undef KQ_W
#undef KQ_R
#undef KQ_PAIR
  for (int r = 0; r < rows; ++r) {
    const int32_t* p = &a.p16[(size_t)(row[r] * 4)];
    const __m256i p0 = _mm256_set1_epi32(p[0]), p1 = _mm256_set1_epi32(p[1]), p2 = _mm256_set1_epi32(p[2]),
                  p3 = _mm256_set1_epi32(p[3]);
    const __m256 xd = _mm256_set1_ps(a.d[(size_t)row[r]]);
    for (int hf = 0; hf < 2; ++hf) {
      const __m256i* t = scp + 4 * hf;
      const __m256i S = _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(t[0], p0), _mm256_madd_epi16(t[1], p1)),
                                         _mm256_add_epi32(_mm256_madd_epi16(t[2], p2), _mm256_madd_epi16(t[3], p3)));
      const __m256i Ib = _mm256_sub_epi32(I[r][hf], _mm256_slli_epi32(S, 5));
      float* ar = acc + r * 16 + 8 * hf;
      _mm256_storeu_ps(ar, _mm256_fmadd_ps(_mm256_cvtepi32_ps(Ib), _mm256_mul_ps(d[hf], xd), _mm256_loadu_ps(ar)));
    }
  }
}

// rows [m0, m1) of one k6 tile: out[r * 16 + j] as k6_tile_avx2 computes it
void k6_tile_many(const QuantizedRows& a, int64_t m0, int64_t m1, int64_t nb, const uint8_t* lo, const uint8_t* hi,
                   const uint8_t* meta, float* out) {
  const int64_t M = m1 - m0;
  thread_local std::vector<float> buf;
  float* accs = zeroed_aligned(buf, M * 16);
  alignas(64) uint8_t W[16 * 128];
  const __m256i mask4 = _mm256_set1_epi8(0x0F), mask30 = _mm256_set1_epi8(0x30);
  const __m256i lo16 = _mm256_set1_epi32(0xFFFF);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* l = lo + b * K4_TILE;
    const uint8_t* h = hi + b * K6_HI;
    const uint8_t* mt = meta + b * K6_META;
    for (int u = 0; u < 16; ++u) {
      prefetch(l, u * 64 + KQ_PREFETCH);
      if (u < 8) prefetch(h, u * 64 + KQ_PREFETCH / 2);
      for (int hf = 0; hf < 2; ++hf) {  // as k6_tile_avx2 forms them
        const __m256i w = _mm256_loadu_si256((const __m256i*)(l + u * 64 + 32 * hf));
        const __m256i hb = _mm256_loadu_si256((const __m256i*)(h + (u % 8) * 64 + 32 * hf));
        const __m256i hl = u < 8 ? _mm256_slli_epi16(hb, 4) : _mm256_slli_epi16(hb, 2);
        const __m256i hh = u < 8 ? hb : _mm256_srli_epi16(hb, 2);
        _mm256_store_si256((__m256i*)(W + u * 128 + 32 * hf),
                           _mm256_or_si256(_mm256_and_si256(w, mask4), _mm256_and_si256(hl, mask30)));
        _mm256_store_si256((__m256i*)(W + u * 128 + 64 + 32 * hf),
                           _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(w, 4), mask4), _mm256_and_si256(hh, mask30)));
      }
    }
    alignas(32) __m256i sc[16];
    __m256i scp[8];
    __m256 d[2];
    for (int hf = 0; hf < 2; ++hf) {
      for (int g = 0; g < 8; ++g) sc[g * 2 + hf] = pair_same(i8x8(mt + 32 + 16 * g + 8 * hf));
      for (int i = 0; i < 4; ++i)
        scp[hf * 4 + i] = _mm256_or_si256(_mm256_and_si256(i8x8(mt + 32 + 32 * i + 8 * hf), lo16),
                                          _mm256_slli_epi32(i8x8(mt + 48 + 32 * i + 8 * hf), 16));
      d[hf] = f16x8(mt + 16 * hf);
    }
    for (int64_t m = 0; m < M; m += 4)
      k6_rows4_block(a, m0 + m, (int)std::min<int64_t>(4, M - m), nb, b, W, sc, scp, d, &accs[(size_t)(m * 16)]);
  }
  for (int64_t r = 0; r < M; ++r) std::memcpy(out + r * NT, &accs[(size_t)(r * 16)], NT * sizeof(float));
}
#endif
#endif

#if KQ_AMX
// ------------------------------------------------------------------------------------------------- AMX
// A tile multiply gives, for 16 activation rows x 16 outputs, the exact integer sum over one group of
// inputs (k4: 32, k6: 16) -- the sums the AVX-512 path accumulates lane by lane -- so per output the same
// integers I and J come out, and the float step below is the AVX-512 path's, operation for operation.
// Tiles: 0-3 sums of four groups, 4 activations (rows x group bytes), 5 weight codes (quads x 16 outputs).

bool amx_permitted() {
  // Linux grants a process the AMX tile state on request (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

struct TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

inline void amx_config(int group) {  // group: inputs a group (32 or 16)
  alignas(64) TileConfig c;
  for (int i = 0; i < 4; ++i) {
    c.rows[i] = 16;
    c.colsb[i] = 64;
  }
  c.rows[4] = 16;
  c.colsb[4] = (uint16_t)group;
  c.rows[5] = (uint8_t)(group / 4);
  c.colsb[5] = 64;
  _tile_loadconfig(&c);
}

// The four group sums of 16 rows (activations at qa, row stride `stride` bytes; group g at qa + g * width)
// against the weight codes B[g] (width / 4 quads of 64 bytes), into C[g][row][output].
template <int width>
inline void amx_groups(const int8_t* qa, int64_t stride, const uint8_t* B, int32_t* C) {
  constexpr int bsz = width / 4 * 64;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, qa, stride);
  _tile_loadd(5, B, 64);
  _tile_dpbsud(0, 4, 5);
  _tile_loadd(4, qa + width, stride);
  _tile_loadd(5, B + bsz, 64);
  _tile_dpbsud(1, 4, 5);
  _tile_loadd(4, qa + 2 * width, stride);
  _tile_loadd(5, B + 2 * bsz, 64);
  _tile_dpbsud(2, 4, 5);
  _tile_loadd(4, qa + 3 * width, stride);
  _tile_loadd(5, B + 3 * bsz, 64);
  _tile_dpbsud(3, 4, 5);
  _tile_stored(0, C, 64);
  _tile_stored(1, C + 256, 64);
  _tile_stored(2, C + 512, 64);
  _tile_stored(3, C + 768, 64);
}

// rows [m0, m0 + 16 * mt): out[r * 16 + j] as k4_tile_avx512 computes it
void k4_tile_amx(const QuantizedRows& a, int64_t m0, int64_t mt, int64_t nb, const uint8_t* codes, const uint8_t* meta,
                 float* out) {
  thread_local std::vector<float> accs;
  const int64_t R = mt * 16;
  accs.assign((size_t)(R * 32), 0.f);  // row r: acc at 32 r, accm at 32 r + 16
  alignas(64) uint8_t B[4 * 8 * 64];   // group g: 8 quads x 64 bytes
  alignas(64) int32_t C[4 * 256];
  const __m512i mask4 = _mm512_set1_epi8(0x0F);
  amx_config(32);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* c = codes + b * K4_TILE;
    const uint8_t* mt_ = meta + b * K4_META;
    for (int u = 0; u < 16; ++u) {  // quad-row u: low nibbles -> group u / 8, high -> 2 + u / 8
      prefetch(c, u * 64 + KQ_PREFETCH);
      const __m512i w = _mm512_loadu_si512(c + u * 64);
      _mm512_store_si512(B + ((u >> 3) * 8 + (u & 7)) * 64, _mm512_and_si512(w, mask4));
      _mm512_store_si512(B + ((2 + (u >> 3)) * 8 + (u & 7)) * 64, _mm512_and_si512(_mm512_srli_epi16(w, 4), mask4));
    }
    __m512i sc[4];
    for (int g = 0; g < 4; ++g) sc[g] = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(mt_ + 64 + 16 * g)));
    __m512i m01, m23;
    k4_min_pairs512(mt_, m01, m23);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)mt_));
    const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(mt_ + 32)));
    for (int64_t i = 0; i < mt; ++i) {
      amx_groups<32>(&a.q[(size_t)(((m0 + 16 * i) * nb + b) * QB)], nb * QB, B, C);
      for (int r = 0; r < 16; ++r) {
        const int64_t row = (m0 + 16 * i + r) * nb + b;
        const __m512i I = _mm512_add_epi32(
            _mm512_add_epi32(_mm512_mullo_epi32(_mm512_load_si512(C + 16 * r), sc[0]),
                             _mm512_mullo_epi32(_mm512_load_si512(C + 256 + 16 * r), sc[1])),
            _mm512_add_epi32(_mm512_mullo_epi32(_mm512_load_si512(C + 512 + 16 * r), sc[2]),
                             _mm512_mullo_epi32(_mm512_load_si512(C + 768 + 16 * r), sc[3])));
        const __m512i J = k4_min_sum512(a, row, m01, m23);
        const __m512 xd = _mm512_set1_ps(a.d[(size_t)row]);
        float* acc = &accs[(size_t)((16 * i + r) * 32)];
        _mm512_storeu_ps(acc, _mm512_fmadd_ps(_mm512_cvtepi32_ps(I), _mm512_mul_ps(d, xd), _mm512_loadu_ps(acc)));
        _mm512_storeu_ps(acc + 16,
                         _mm512_fmadd_ps(_mm512_cvtepi32_ps(J), _mm512_mul_ps(dmin, xd), _mm512_loadu_ps(acc + 16)));
      }
    }
  }
  _tile_release();
  for (int64_t r = 0; r < R; ++r)
    _mm512_storeu_ps(out + r * NT, _mm512_sub_ps(_mm512_loadu_ps(&accs[(size_t)(r * 32)]),
                                                 _mm512_loadu_ps(&accs[(size_t)(r * 32 + 16)])));
}

void k6_tile_amx(const QuantizedRows& a, int64_t m0, int64_t mt, int64_t nb, const uint8_t* lo, const uint8_t* hi,
                 const uint8_t* meta, float* out) {
  thread_local std::vector<float> accs;
  const int64_t R = mt * 16;
  accs.assign((size_t)(R * 16), 0.f);
  alignas(64) uint8_t B[8 * 4 * 64];  // group g: 4 quads x 64 bytes
  alignas(64) int32_t C[4 * 256];
  alignas(64) int32_t Ipart[16 * 16];
  amx_config(16);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* l = lo + b * K4_TILE;
    const uint8_t* h = hi + b * K6_HI;
    const uint8_t* mt_ = meta + b * K6_META;
    for (int u = 0; u < 16; ++u) {  // quad-row u: low half -> group u / 4, high half -> 4 + u / 4
      prefetch(l, u * 64 + KQ_PREFETCH);
      if (u < 8) prefetch(h, u * 64 + KQ_PREFETCH / 2);
      __m512i cl, ch;
      k6_codes512(l, h, u, cl, ch);
      _mm512_store_si512(B + ((u >> 2) * 4 + (u & 3)) * 64, cl);
      _mm512_store_si512(B + ((4 + (u >> 2)) * 4 + (u & 3)) * 64, ch);
    }
    __m512i sc[8], scp[4];
    for (int g = 0; g < 8; ++g) sc[g] = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(mt_ + 32 + 16 * g)));
    k6_scale_pairs512(mt_, scp);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)mt_));
    for (int64_t i = 0; i < mt; ++i) {
      const int8_t* qa = &a.q[(size_t)(((m0 + 16 * i) * nb + b) * QB)];
      amx_groups<16>(qa, nb * QB, B, C);  // groups 0-3 (inputs 0-63)
      for (int r = 0; r < 16; ++r)
        _mm512_store_si512(Ipart + 16 * r,
                           _mm512_add_epi32(_mm512_add_epi32(_mm512_mullo_epi32(_mm512_load_si512(C + 16 * r), sc[0]),
                                                             _mm512_mullo_epi32(_mm512_load_si512(C + 256 + 16 * r), sc[1])),
                                            _mm512_add_epi32(_mm512_mullo_epi32(_mm512_load_si512(C + 512 + 16 * r), sc[2]),
                                                             _mm512_mullo_epi32(_mm512_load_si512(C + 768 + 16 * r), sc[3]))));
      amx_groups<16>(qa + 64, nb * QB, B + 4 * 4 * 64, C);  // groups 4-7 (inputs 64-127)
      for (int r = 0; r < 16; ++r) {
        const int64_t row = (m0 + 16 * i + r) * nb + b;
        const __m512i I = _mm512_add_epi32(
            _mm512_load_si512(Ipart + 16 * r),
            _mm512_add_epi32(_mm512_add_epi32(_mm512_mullo_epi32(_mm512_load_si512(C + 16 * r), sc[4]),
                                              _mm512_mullo_epi32(_mm512_load_si512(C + 256 + 16 * r), sc[5])),
                             _mm512_add_epi32(_mm512_mullo_epi32(_mm512_load_si512(C + 512 + 16 * r), sc[6]),
                                              _mm512_mullo_epi32(_mm512_load_si512(C + 768 + 16 * r), sc[7]))));
        const __m512i Ib = _mm512_sub_epi32(I, _mm512_slli_epi32(k6_scaled_sums512(a, row, scp), 5));
        float* acc = &accs[(size_t)((16 * i + r) * 16)];
        _mm512_storeu_ps(acc, _mm512_fmadd_ps(_mm512_cvtepi32_ps(Ib), _mm512_mul_ps(d, _mm512_set1_ps(a.d[(size_t)row])),
                                              _mm512_loadu_ps(acc)));
      }
    }
  }
  _tile_release();
  for (int64_t r = 0; r < R; ++r) _mm512_storeu_ps(out + r * NT, _mm512_loadu_ps(&accs[(size_t)(r * 16)]));
}
#else
bool amx_permitted() { return false; }
#endif

// One weight tile against activation rows [m0, m0 + R): out[r * 16 + j] = y[m0 + r, 16 t + j].
struct K4Tile {
  const uint8_t* codes;
  const uint8_t* meta;
  template <int R>
  void run(const QuantizedRows& a, int64_t m0, int64_t nb, float* out) const {
#if KQ_AVX512
    k4_tile_avx512<R>(a, m0, nb, codes, meta, out);
#elif KQ_AVX2
    k4_tile_avx2<R>(a, m0, nb, codes, meta, out);
#else
    k4_tile_portable(a, m0, R, nb, codes, meta, out);
#endif
  }
};

struct K6Tile {
  const uint8_t* lo;
  const uint8_t* hi;
  const uint8_t* meta;
  template <int R>
  void run(const QuantizedRows& a, int64_t m0, int64_t nb, float* out) const {
#if KQ_AVX512
    k6_tile_avx512<R>(a, m0, nb, lo, hi, meta, out);
#elif KQ_AVX2
    k6_tile_avx2<R>(a, m0, nb, lo, hi, meta, out);
#else
    k6_tile_portable(a, m0, R, nb, lo, hi, meta, out);
#endif
  }
};

template <typename Tile>
void run_rows(const Tile& tile, const QuantizedRows& a, int64_t m0, int rows, int64_t nb, float* out) {
  switch (rows) {
    case 1: tile.template run<1>(a, m0, nb, out); break;
    case 2: tile.template run<2>(a, m0, nb, out); break;
    case 3: tile.template run<3>(a, m0, nb, out); break;
    case 4: tile.template run<4>(a, m0, nb, out); break;
    case 5: tile.template run<5>(a, m0, nb, out); break;
    case 6: tile.template run<6>(a, m0, nb, out); break;
    case 7: tile.template run<7>(a, m0, nb, out); break;
    default: tile.template run<8>(a, m0, nb, out); break;
  }
}

}  // namespace

void Linear::tile(int64_t t, const QuantizedRows& a, int64_t m_begin, int64_t m_end, float* y, int64_t ldy) const {
  const int64_t n0 = t * NT, width = std::min<int64_t>(NT, N - n0);
  auto emit = [&](int64_t m0, int64_t rows, const float* out) {  // out[r * 16 + j] -> y, plus the bias
    for (int64_t r = 0; r < rows; ++r) {
      float* yr = y + (m0 + r) * ldy + n0;
      const float* o = out + r * NT;
      if (bias) {
        for (int64_t j = 0; j < width; ++j) yr[j] = o[j] + bias[n0 + j];
      } else {
        for (int64_t j = 0; j < width; ++j) yr[j] = o[j];
      }
    }
  };
  const bool few = m_end - m_begin <= FEW_ROWS;
  int64_t m0 = m_begin;
#if KQ_AMX
  if (!few && amx_permitted()) {  // whole groups of 16 rows by tile multiplies, the rest below: same bits
    const int64_t mt = (m_end - m_begin) / 16;
    thread_local std::vector<float> buf;
    buf.resize((size_t)(mt * 16 * NT));
    if (kind == 4) {
      k4_tile_amx(a, m0, mt, nb, p0 + t * nb * K4_TILE, p2 + t * nb * K4_META, buf.data());
    } else {
      k6_tile_amx(a, m0, mt, nb, p0 + t * nb * K4_TILE, p1 + t * nb * K6_HI, p2 + t * nb * K6_META, buf.data());
    }
    emit(m0, mt * 16, buf.data());
    m0 += mt * 16;
  }
#endif
#if KQ_AVX2 && KQ_I16
  if (m_end - m0 >= MANY_ROWS) {  // every block unpacked once for all the rows: same bits
    thread_local std::vector<float> buf;
    buf.resize((size_t)((m_end - m0) * NT));
    if (kind == 4) {
      k4_tile_many(a, m0, m_end, nb, p0 + t * nb * K4_TILE, p2 + t * nb * K4_META, buf.data());
    } else {
      k6_tile_many(a, m0, m_end, nb, p0 + t * nb * K4_TILE, p1 + t * nb * K6_HI, p2 + t * nb * K6_META, buf.data());
    }
    emit(m0, m_end - m0, buf.data());
    return;
  }
#endif
  float out[8 * NT];
  const int64_t pass = few ? MAX_TILE : PREFILL_TILE;
  for (; m0 < m_end; m0 += pass) {
    const int rows = (int)std::min<int64_t>(pass, m_end - m0);
    if (kind == 4) {
      run_rows(K4Tile{p0 + t * nb * K4_TILE, p2 + t * nb * K4_META}, a, m0, rows, nb, out);
    } else {
      run_rows(K6Tile{p0 + t * nb * K4_TILE, p1 + t * nb * K6_HI, p2 + t * nb * K6_META}, a, m0, rows, nb, out);
    }
    emit(m0, rows, out);
  }
}

namespace {
void check_weight(const torch::Tensor& t, int64_t T, int64_t nb, int64_t width, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kUInt8 && t.is_contiguous(),
              "kquant: ", name, " must be a contiguous uint8 CPU tensor");
  TORCH_CHECK(t.numel() == T * nb * width, "kquant: ", name, " has ", t.numel(), " bytes, expected ",
              T * nb * width);
}
}  // namespace

Linear make_linear(const std::vector<torch::Tensor>& parts, const c10::optional<torch::Tensor>& bias, int64_t K,
                   int64_t N) {
  TORCH_CHECK(parts.size() == 2 || parts.size() == 3,
              "kquant: a layer is 2 tensors (k4: codes, meta) or 3 (k6: lo, hi, meta), got ", parts.size());
  TORCH_CHECK(K > 0 && N > 0, "kquant: a layer needs K > 0 inputs and N > 0 outputs");
  Linear L;
  L.kind = parts.size() == 2 ? 4 : 6;
  L.K = K;
  L.N = N;
  L.nb = (K + QB - 1) / QB;
  L.T = (N + NT - 1) / NT;
  check_weight(parts[0], L.T, L.nb, K4_TILE, L.kind == 4 ? "codes" : "lo");
  L.p0 = parts[0].data_ptr<uint8_t>();
  if (L.kind == 4) {
    check_weight(parts[1], L.T, L.nb, K4_META, "meta");
    L.p2 = parts[1].data_ptr<uint8_t>();
  } else {
    check_weight(parts[1], L.T, L.nb, K6_HI, "hi");
    check_weight(parts[2], L.T, L.nb, K6_META, "meta");
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
  // one parallel region over the tiles of every layer (they share the quantised input): each output is
  // computed by one thread whatever M is. Many rows (a prefill): a thread walks its tiles once per chunk of
  // activation rows sized to stay in its L2 cache, instead of streaming all M rows from the outer caches
  // for every tile. The rows of a chunk get the same per-row arithmetic, so every output is bitwise unchanged.
  std::vector<int64_t> start(layers.size() + 1, 0);
  for (size_t i = 0; i < layers.size(); ++i) start[i + 1] = start[i] + layers[i]->T;
  const int64_t row_bytes = layers.empty() ? 1 : std::max<int64_t>(1, layers[0]->nb * QB);
  // decode, draft and verification forwards (M <= 65) stay one chunk: their weights come from memory, and
  // walking them once per chunk would multiply that traffic
  const int64_t chunk = M <= MIN_CHUNKED_ROWS
                            ? std::max<int64_t>(M, 1)
                            : std::max<int64_t>(MIN_CHUNK, (CHUNK_BYTES / row_bytes) / MAX_TILE * MAX_TILE);
  at::parallel_for(0, start.back(), 1, [&](int64_t c0, int64_t c1) {
    for (int64_t m0 = 0; m0 < M; m0 += chunk) {
      const int64_t m1 = std::min(M, m0 + chunk);
      size_t i = 0;
      for (int64_t c = c0; c < c1; ++c) {
        while (c >= start[i + 1]) ++i;
        const Linear& L = *layers[i];
        L.tile(c - start[i], a, m0, m1, outs[i], L.N);
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
  if (M == 0) return y;
  QuantizedRows a;
  quantize_rows(x.data_ptr<float>(), M, L.K, L.nb, a);
  run_linears({&L}, a, M, {y.data_ptr<float>()});
  return y;
}

torch::Tensor k4_matmul(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& meta,
                        const c10::optional<torch::Tensor>& bias, int64_t K, int64_t N) {
  return matmul(x, make_linear({codes, meta}, bias, K, N));
}

torch::Tensor k6_matmul(const torch::Tensor& x, const torch::Tensor& lo, const torch::Tensor& hi,
                        const torch::Tensor& meta, const c10::optional<torch::Tensor>& bias, int64_t K, int64_t N) {
  return matmul(x, make_linear({lo, hi, meta}, bias, K, N));
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

bool amx() { return KQ_AMX && amx_permitted(); }

std::string isa() {
#if KQ_AVX512
  return "avx512-vnni";
#elif KQ_AVX2 && KQ_AVXVNNI
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
  m.def("k4_matmul", &k4_matmul, "y = x @ W.T (+ bias) with W in the tiled k4 (Q4_K) layout (K inputs, N outputs)");
  m.def("k6_matmul", &k6_matmul, "y = x @ W.T (+ bias) with W in the tiled k6 (Q6_K) layout (K inputs, N outputs)");
  m.def("quantize_activations", &quantize_activations, "the int8 codes and block scales the products use");
  m.def("simd", &simd, "whether a SIMD path (AVX-512 VNNI or AVX2, bitwise alike) was compiled (else the portable one)");
  m.def("amx", &amx, "whether prefill-sized products take AMX tile multiplies (compiled, and granted by the OS)");
  m.def("isa", &isa, "the compiled path: avx512-vnni, avx2-vnni, avx2 or portable");
  register_decoder(m);
}
