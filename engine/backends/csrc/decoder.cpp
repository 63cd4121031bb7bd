// The native decoder: every layer of a Qwen2 model whose linear layers are in the k4 / k6 layouts, for the
// decode, draft and verification forwards (a few query rows), in one call -- RMSNorm, the q/k/v projections
// (one quantised input), rotary embedding, the KV cache write, attention, the output projection, the MLP
// (gate and up on one quantised input, SiLU, down) and the residual adds. It replaces ~25 torch operations
// a layer dispatched from Python (engine/lean.py) whose overhead is a sizeable share of a quantized step.
//
// Exactness: every value a query row gets is computed by one thread with the same operations whatever the
// number of rows and whichever rows share the forward: norms and activations row by row, linear layers by
// the batch-invariant products of kquant.cpp, attention for one (row, head) over exactly the keys that row
// may see, listed in cache order (a prefix, or the committed prefix plus the row's ancestors for a tree),
// so a row sees the same numbers in the same order as the one-row step that would decode it (however the
// rows and heads are grouped into tasks: `attention` below). Greedy
// speculative decoding through this decoder is therefore token-identical to autoregressive decoding
// through it. Its logits are close to, not bitwise, transformers' forward (other summation orders).
//
// Batches: `forward_batch` takes the rows of several sequences, each on its own KV cache buffers. The linear
// layers run over all rows at once; attention of a row reads its own sequence's cache only. Every value of a
// row is computed as above whatever other sequences share the forward, so a sequence's rows are bitwise
// those of `forward` of that sequence alone (engine/batch_forward.py; tests/engine/test_batch_forward.py).

#include "kquant.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

// AVX-512, else AVX2 with FMA computing the same bits (dot products as 16 lanes in two halves, reduced by
// _mm512_reduce_add_ps's tree; the value sums lane by lane with the same fused multiply-adds), else portable.
// KQ_NO_AVX512 compiles the AVX2 path on an AVX-512 machine (tests compare the two builds bit for bit),
// KQ_NO_SIMD the portable one.
#if !defined(KQ_NO_AVX512) && !defined(KQ_NO_SIMD) && defined(__AVX512F__)
#include <immintrin.h>
#define DEC_AVX512 1
#define DEC_AVX2 0
#elif !defined(KQ_NO_SIMD) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define DEC_AVX512 0
#define DEC_AVX2 1
#else
#define DEC_AVX512 0
#define DEC_AVX2 0
#endif

namespace kq {
namespace {

// Dot product of two float vectors in a fixed order (depends on n only).
inline float dot(const float* a, const float* b, int64_t n) {
#if DEC_AVX512
  if (n % 16 == 0) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    return _mm512_reduce_add_ps(acc);
  }
#elif DEC_AVX2
  if (n % 16 == 0) {  // lanes 0-7 and 8-15 of the AVX-512 accumulator
    __m256 lo = _mm256_setzero_ps(), hi = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
      lo = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), lo);
      hi = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), hi);
    }
    const __m256 t = _mm256_add_ps(lo, hi);  // then (0 + 4, ...), (a + c, b + d), the two
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
#endif
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

void rms_norm(const float* x, const float* w, float eps, int64_t H, float* out) {
  double ss = 0.0;
  for (int64_t i = 0; i < H; ++i) ss += (double)x[i] * (double)x[i];
  const float inv = 1.f / std::sqrt((float)(ss / (double)H) + eps);
  for (int64_t i = 0; i < H; ++i) out[i] = w[i] * (x[i] * inv);
}

// q_embed = q * cos + rotate_half(q) * sin, rotate_half(q) = (-q[D/2:], q[:D/2])
void rope(float* v, const float* cos, const float* sin, int64_t D) {
  const int64_t h = D / 2;
  float tmp[512];
  for (int64_t i = 0; i < D; ++i) tmp[i] = v[i];
  for (int64_t i = 0; i < h; ++i) v[i] = tmp[i] * cos[i] - tmp[i + h] * sin[i];
  for (int64_t i = h; i < D; ++i) v[i] = tmp[i] * cos[i] + tmp[i - h] * sin[i];
}

// Scores p[0..n) -> exp(p - max) in place, summed in key order; returns 1 / sum.
float softmax_in_place(float* p, int64_t n) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) mx = std::max(mx, p[j]);
  float sum = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    const float e = std::exp(p[j] - mx);
    p[j] = e;
    sum += e;
  }
  return 1.f / sum;
}

// The attention of one (row, head) over the n keys it sees (e = ir[j], or j without an index): scores
// q.k * scale in key order, softmax_in_place, the weighted values summed in key order, times 1 / sum. Every
// path below computes exactly these operations in this order.
void head_attention(const float* qr, const float* kg, const float* vg, int64_t D, int64_t n, const int64_t* ir,
                    float scale, float* o, std::vector<float>& p) {
  p.resize((size_t)n);
  for (int64_t j = 0; j < n; ++j) p[(size_t)j] = dot(qr, kg + (ir ? ir[j] : j) * D, D) * scale;
  const float inv = softmax_in_place(p.data(), n);
  for (int64_t d = 0; d < D; ++d) o[d] = 0.f;
  for (int64_t j = 0; j < n; ++j) {
    const float w = p[(size_t)j];
    const float* ve = vg + (ir ? ir[j] : j) * D;
#if DEC_AVX2
    if (D % 8 == 0) {  // one fused multiply-add a value, as the AVX-512 path
      const __m256 vw = _mm256_set1_ps(w);
      for (int64_t d = 0; d < D; d += 8)
        _mm256_storeu_ps(o + d, _mm256_fmadd_ps(vw, _mm256_loadu_ps(ve + d), _mm256_loadu_ps(o + d)));
      continue;
    }
#endif
    for (int64_t d = 0; d < D; ++d) o[d] += w * ve[d];
  }
  for (int64_t d = 0; d < D; ++d) o[d] *= inv;
}

#if DEC_AVX512
// The sums of 16 accumulators, in order, each by the tree of _mm512_reduce_add_ps (lanes i + i+8, then
// + 4, + 2, + 1; float addition commutes): bitwise the 16 separate reductions for ~1/8 of the shuffles.
inline __m512 reduce16(const __m512* A) {
  __m512 B[8], C[4], D[2];
  for (int k = 0; k < 8; ++k)  // B[k]: 8 half-sums of key 2k (lanes 0-7), of key 2k + 1 (lanes 8-15)
    B[k] = _mm512_add_ps(_mm512_shuffle_f32x4(A[2 * k], A[2 * k + 1], 0xEE),
                         _mm512_shuffle_f32x4(A[2 * k], A[2 * k + 1], 0x44));
  for (int k = 0; k < 4; ++k)  // C[k]: 128-bit chunk c holds the 4 quarter-sums of key 4k + c
    C[k] = _mm512_add_ps(_mm512_shuffle_f32x4(B[2 * k], B[2 * k + 1], 0xDD),
                         _mm512_shuffle_f32x4(B[2 * k], B[2 * k + 1], 0x88));
  for (int k = 0; k < 2; ++k)  // D[k], chunk c: 2 sums of key 8k + c, then 2 of key 8k + 4 + c
    D[k] = _mm512_add_ps(_mm512_shuffle_ps(C[2 * k], C[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(C[2 * k], C[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // chunk c: keys c, 4 + c, 8 + c, 12 + c
  const __m512 E = _mm512_add_ps(_mm512_shuffle_ps(D[0], D[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(D[0], D[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(order, E);
}

// head_attention for Q rows x nh heads that share one key/value head, D = 16 * ND: the same operations per
// (row, head) in the same order, with 16 keys' dot products reduced together, the keys (and values) taken
// in blocks that stay in the L1 cache while every row and head of the task uses them (rows see the same
// committed prefix: one read of the cache serves them all), each output accumulated in registers.
// qs[r * nh + h], os[r * nh + h]: the query and the output of row r, head h; n[r], ir[r]: its keys.
template <int ND>
void heads_attention_avx512(const float* const* qs, int64_t Q, int64_t nh, const float* kg, const float* vg,
                            const int64_t* n, const int64_t* const* ir, float scale, float* const* os,
                            std::vector<float>& p) {
  constexpr int64_t D = 16 * ND;
  constexpr int64_t KB = 32;  // keys a block: 16 KiB at D = 128
  int64_t nmax = 0;
  for (int64_t r = 0; r < Q; ++r) nmax = std::max(nmax, n[r]);
  p.resize((size_t)(Q * nh * nmax));
  const __m512 vscale = _mm512_set1_ps(scale);
  for (int64_t j0 = 0; j0 < nmax; j0 += KB) {
    for (int64_t r = 0; r < Q; ++r) {
      const int64_t j1 = std::min(n[r], j0 + KB);
      const int64_t* ix = ir[r];
      for (int64_t h = 0; h < nh && j0 < j1; ++h) {
        const float* qr = qs[r * nh + h];
        float* ph = p.data() + (r * nh + h) * nmax;
        __m512 qv[ND];
        for (int i = 0; i < ND; ++i) qv[i] = _mm512_loadu_ps(qr + 16 * i);
        int64_t j = j0;
        for (; j + 16 <= j1; j += 16) {
          __m512 acc[16];
          const float* kp[16];
          for (int t = 0; t < 16; ++t) {
            kp[t] = kg + (ix ? ix[j + t] : j + t) * D;
            acc[t] = _mm512_setzero_ps();
          }
          for (int i = 0; i < ND; ++i)
            for (int t = 0; t < 16; ++t) acc[t] = _mm512_fmadd_ps(qv[i], _mm512_loadu_ps(kp[t] + 16 * i), acc[t]);
          _mm512_storeu_ps(ph + j, _mm512_mul_ps(reduce16(acc), vscale));
        }
        for (; j < j1; ++j) ph[j] = dot(qr, kg + (ix ? ix[j] : j) * D, D) * scale;
      }
    }
  }
  std::vector<float> inv((size_t)(Q * nh));
  for (int64_t r = 0; r < Q; ++r) {
    for (int64_t h = 0; h < nh; ++h) {
      inv[(size_t)(r * nh + h)] = softmax_in_place(p.data() + (r * nh + h) * nmax, n[r]);
      for (int64_t d = 0; d < D; ++d) os[r * nh + h][d] = 0.f;
    }
  }
  for (int64_t j0 = 0; j0 < nmax; j0 += KB) {
    for (int64_t r = 0; r < Q; ++r) {
      const int64_t j1 = std::min(n[r], j0 + KB);
      const int64_t* ix = ir[r];
      for (int64_t h = 0; h < nh && j0 < j1; ++h) {
        const float* ph = p.data() + (r * nh + h) * nmax;
        float* out = os[r * nh + h];
        __m512 o[ND];
        for (int i = 0; i < ND; ++i) o[i] = _mm512_loadu_ps(out + 16 * i);
        for (int64_t j = j0; j < j1; ++j) {
          const __m512 w = _mm512_set1_ps(ph[j]);
          const float* ve = vg + (ix ? ix[j] : j) * D;
          for (int i = 0; i < ND; ++i) o[i] = _mm512_fmadd_ps(w, _mm512_loadu_ps(ve + 16 * i), o[i]);
        }
        for (int i = 0; i < ND; ++i) _mm512_storeu_ps(out + 16 * i, o[i]);
      }
    }
  }
  for (int64_t t = 0; t < Q * nh; ++t) {
    const __m512 vinv = _mm512_set1_ps(inv[(size_t)t]);
    for (int i = 0; i < ND; ++i) _mm512_storeu_ps(os[t] + 16 * i, _mm512_mul_ps(_mm512_loadu_ps(os[t] + 16 * i), vinv));
  }
}
#endif

#if DEC_AVX2
// The sums of 8 keys' accumulators t[k] (dot's two halves added, lo + hi), each in dot's order:
// ((t0 + t4) + (t2 + t6)) + ((t1 + t5) + (t3 + t7)); lane k of the result holds key k. Bitwise dot's
// reduction of each key, for a fraction of its shuffles.
inline __m256 reduce8(const __m256* t) {
  __m256 P[4];
  for (int k = 0; k < 4; ++k)  // 128-bit half 0: t_i + t_{i+4} of key 2k, half 1: of key 2k + 1
    P[k] = _mm256_add_ps(_mm256_permute2f128_ps(t[2 * k], t[2 * k + 1], 0x20),
                         _mm256_permute2f128_ps(t[2 * k], t[2 * k + 1], 0x31));
  __m256 R[2];
  for (int k = 0; k < 2; ++k)  // half 0: (s0 + s2, s1 + s3) of keys 4k, 4k + 2; half 1: of 4k + 1, 4k + 3
    R[k] = _mm256_add_ps(_mm256_shuffle_ps(P[2 * k], P[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm256_shuffle_ps(P[2 * k], P[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  // half 0: keys 0, 2, 4, 6; half 1: keys 1, 3, 5, 7
  const __m256 E = _mm256_add_ps(_mm256_shuffle_ps(R[0], R[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm256_shuffle_ps(R[0], R[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm256_permutevar8x32_ps(E, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

// heads_attention_avx512's layout on AVX2 (D = 16 * ND): head_attention's operations per (row, head) in the
// same order, 8 keys' dot products reduced together (each accumulated as dot does, in two 8-lane halves),
// key blocks kept in L1 while every row and head of the task uses them, outputs accumulated in registers
// (at most 8 vectors at a time: a 128-wide head in two passes over a block, each output lane still summed
// in key order).
template <int ND>
void heads_attention_avx2(const float* const* qs, int64_t Q, int64_t nh, const float* kg, const float* vg,
                          const int64_t* n, const int64_t* const* ir, float scale, float* const* os,
                          std::vector<float>& p) {
  constexpr int64_t D = 16 * ND;
  constexpr int NV = 2 * ND;             // 8-float vectors a head
  constexpr int CH = NV > 8 ? 8 : NV;    // of them accumulated at once
  constexpr int64_t KB = 32;             // keys a block: 16 KiB at D = 128
  int64_t nmax = 0;
  for (int64_t r = 0; r < Q; ++r) nmax = std::max(nmax, n[r]);
  p.resize((size_t)(Q * nh * nmax));
  const __m256 vscale = _mm256_set1_ps(scale);
  for (int64_t j0 = 0; j0 < nmax; j0 += KB) {
    for (int64_t r = 0; r < Q; ++r) {
      const int64_t j1 = std::min(n[r], j0 + KB);
      const int64_t* ix = ir[r];
      for (int64_t h = 0; h < nh && j0 < j1; ++h) {
        const float* qr = qs[r * nh + h];
        float* ph = p.data() + (r * nh + h) * nmax;
        int64_t j = j0;
        for (; j + 8 <= j1; j += 8) {
          __m256 t[8];
          for (int g = 0; g < 2; ++g) {  // keys j + 4g .. j + 4g + 3
            const float* kp[4];
            __m256 lo[4], hi[4];
            for (int u = 0; u < 4; ++u) {
              kp[u] = kg + (ix ? ix[j + 4 * g + u] : j + 4 * g + u) * D;
              lo[u] = _mm256_setzero_ps();
              hi[u] = _mm256_setzero_ps();
            }
            for (int i = 0; i < ND; ++i) {
              const __m256 ql = _mm256_loadu_ps(qr + 16 * i), qh = _mm256_loadu_ps(qr + 16 * i + 8);
              for (int u = 0; u < 4; ++u) {
                lo[u] = _mm256_fmadd_ps(ql, _mm256_loadu_ps(kp[u] + 16 * i), lo[u]);
                hi[u] = _mm256_fmadd_ps(qh, _mm256_loadu_ps(kp[u] + 16 * i + 8), hi[u]);
              }
            }
            for (int u = 0; u < 4; ++u) t[4 * g + u] = _mm256_add_ps(lo[u], hi[u]);
          }
          _mm256_storeu_ps(ph + j, _mm256_mul_ps(reduce8(t), vscale));
        }
        for (; j < j1; ++j) ph[j] = dot(qr, kg + (ix ? ix[j] : j) * D, D) * scale;
      }
    }
  }
  std::vector<float> inv((size_t)(Q * nh));
  for (int64_t r = 0; r < Q; ++r) {
    for (int64_t h = 0; h < nh; ++h) {
      inv[(size_t)(r * nh + h)] = softmax_in_place(p.data() + (r * nh + h) * nmax, n[r]);
      for (int64_t d = 0; d < D; ++d) os[r * nh + h][d] = 0.f;
    }
  }
  for (int64_t j0 = 0; j0 < nmax; j0 += KB) {
    for (int64_t r = 0; r < Q; ++r) {
      const int64_t j1 = std::min(n[r], j0 + KB);
      const int64_t* ix = ir[r];
      for (int64_t h = 0; h < nh && j0 < j1; ++h) {
        const float* ph = p.data() + (r * nh + h) * nmax;
        float* out = os[r * nh + h];
        for (int c0 = 0; c0 < NV; c0 += CH) {
          __m256 o[CH];
          for (int i = 0; i < CH; ++i) o[i] = _mm256_loadu_ps(out + 8 * (c0 + i));
          for (int64_t j = j0; j < j1; ++j) {
            const __m256 w = _mm256_set1_ps(ph[j]);
            const float* ve = vg + (ix ? ix[j] : j) * D + 8 * c0;
            for (int i = 0; i < CH; ++i) o[i] = _mm256_fmadd_ps(w, _mm256_loadu_ps(ve + 8 * i), o[i]);
          }
          for (int i = 0; i < CH; ++i) _mm256_storeu_ps(out + 8 * (c0 + i), o[i]);
        }
      }
    }
  }
  for (int64_t t = 0; t < Q * nh; ++t) {
    const __m256 vinv = _mm256_set1_ps(inv[(size_t)t]);
    for (int i = 0; i < NV; ++i) _mm256_storeu_ps(os[t] + 8 * i, _mm256_mul_ps(_mm256_loadu_ps(os[t] + 8 * i), vinv));
  }
}
#endif

struct Layer {
  torch::Tensor in_norm, post_norm;
  Linear q, k, v, o, gate, up, down;
};

class Decoder {
 public:
  Decoder(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate, double eps)
      : H_(hidden), NH_(heads), NKV_(kv_heads), D_(head_dim), I_(intermediate), eps_((float)eps) {
    TORCH_CHECK(hidden > 0 && heads > 0 && kv_heads > 0 && head_dim > 0 && intermediate > 0,
                "decoder: sizes must be positive");
    TORCH_CHECK(heads % kv_heads == 0, "decoder: heads must be a multiple of kv_heads");
    TORCH_CHECK(head_dim % 2 == 0 && head_dim <= 512, "decoder: head_dim must be even and at most 512");
  }

  void add_layer(const torch::Tensor& in_norm, const torch::Tensor& post_norm,
                 const std::vector<std::vector<torch::Tensor>>& linears,
                 const std::vector<c10::optional<torch::Tensor>>& biases) {
    TORCH_CHECK(linears.size() == 7 && biases.size() == 7, "decoder: a layer has 7 linear layers");
    for (const auto* t : {&in_norm, &post_norm})
      TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->is_contiguous() && t->numel() == H_,
                  "decoder: norm weights must be contiguous float32 [", H_, "]");
    const int64_t in[7] = {H_, H_, H_, NH_ * D_, H_, H_, I_};
    const int64_t outs[7] = {NH_ * D_, NKV_ * D_, NKV_ * D_, H_, I_, I_, H_};
    Layer L;
    L.in_norm = in_norm;
    L.post_norm = post_norm;
    Linear* dst[7] = {&L.q, &L.k, &L.v, &L.o, &L.gate, &L.up, &L.down};
    for (int i = 0; i < 7; ++i) {
      *dst[i] = make_linear(linears[i], biases[i], in[i], outs[i]);
      TORCH_CHECK(dst[i]->N == outs[i], "decoder: linear ", i, " has ", dst[i]->N, " outputs, expected ", outs[i]);
    }
    layers_.push_back(std::move(L));
  }

  int64_t num_layers() const { return (int64_t)layers_.size(); }

  // x [Q, H]: the embedded rows (not modified); cos, sin [Q, D]; keys[l], values[l]: [1, NKV, capacity, D]
  // buffers of layer l holding `past` entries (the new rows are written at past..past+Q-1); counts [Q] int64:
  // how many keys row r sees; index: empty (row r sees keys 0..counts[r]-1) or [Q, L] int64 (row r sees
  // index[r, :counts[r]], ascending). Returns the hidden states [Q, H] after the last layer (before the
  // final norm). One sequence: forward_batch with S = 1.
  torch::Tensor forward(const torch::Tensor& x_in, const torch::Tensor& cos_in, const torch::Tensor& sin_in,
                        const std::vector<torch::Tensor>& keys, const std::vector<torch::Tensor>& values,
                        int64_t past, const torch::Tensor& counts_in, const torch::Tensor& index_in) {
    return forward_batch(x_in, cos_in, sin_in, {keys}, {values}, {past}, {x_in.size(0)}, counts_in, index_in);
  }

  // Rows of S sequences in one forward. x [Q, H], cos, sin [Q, D]: the rows of sequence 0, then of sequence 1,
  // ... (rows[s] of them, sum = Q); keys[s][l], values[s][l]: the [1, NKV, capacity, D] buffers of sequence s,
  // layer l, holding past[s] entries (its new rows are written at past[s]..past[s]+rows[s]-1); counts [Q] and
  // index (empty or [Q, L]) as in `forward`, each row's positions in its own sequence's cache. The linear
  // layers run over all Q rows at once (one pass over the weights); attention of a row reads its sequence's
  // cache only. Every output row is computed exactly as `forward` of its sequence alone computes it.
  torch::Tensor forward_batch(const torch::Tensor& x_in, const torch::Tensor& cos_in, const torch::Tensor& sin_in,
                              const std::vector<std::vector<torch::Tensor>>& keys,
                              const std::vector<std::vector<torch::Tensor>>& values, const std::vector<int64_t>& past,
                              const std::vector<int64_t>& rows, const torch::Tensor& counts_in,
                              const torch::Tensor& index_in) {
    const int64_t Q = x_in.size(0), nl = num_layers(), S = (int64_t)rows.size();
    TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == H_ && x_in.scalar_type() == torch::kFloat32,
                "decoder: x must be float32 [Q, ", H_, "]");
    TORCH_CHECK(Q >= 1, "decoder: at least one row");
    TORCH_CHECK(cos_in.sizes() == sin_in.sizes() && cos_in.dim() == 2 && cos_in.size(0) == Q &&
                    cos_in.size(1) == D_ && cos_in.scalar_type() == torch::kFloat32,
                "decoder: cos/sin must be float32 [Q, ", D_, "]");
    TORCH_CHECK(S >= 1 && (int64_t)keys.size() == S && (int64_t)values.size() == S && (int64_t)past.size() == S,
                "decoder: one list of key and value buffers and one past count a sequence");
    std::vector<int64_t> first((size_t)S + 1, 0);  // rows of sequence s: first[s]..first[s + 1] - 1
    for (int64_t s = 0; s < S; ++s) {
      TORCH_CHECK(rows[s] >= 1, "decoder: sequence ", s, " has no rows");
      first[(size_t)s + 1] = first[(size_t)s] + rows[s];
    }
    TORCH_CHECK(first[(size_t)S] == Q, "decoder: the sequences' rows add up to ", first[(size_t)S], ", x has ", Q);
    std::vector<int64_t> seq((size_t)Q);  // the sequence of each row
    for (int64_t s = 0; s < S; ++s)
      for (int64_t r = first[(size_t)s]; r < first[(size_t)s + 1]; ++r) seq[(size_t)r] = s;
    for (int64_t s = 0; s < S; ++s) {
      TORCH_CHECK((int64_t)keys[s].size() == nl && (int64_t)values[s].size() == nl,
                  "decoder: one key and value buffer a layer");
      TORCH_CHECK(past[s] >= 0, "decoder: past must be >= 0");
      for (int64_t l = 0; l < nl; ++l) {
        for (const auto* t : {&keys[s][l], &values[s][l]}) {
          TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->is_contiguous() && t->dim() == 4 &&
                          t->size(0) == 1 && t->size(1) == NKV_ && t->size(3) == D_ && t->size(2) >= past[s] + rows[s],
                      "decoder: cache buffers must be contiguous float32 [1, ", NKV_, ", >= ", past[s] + rows[s], ", ",
                      D_, "]");
        }
      }
    }
    const torch::Tensor counts = counts_in.to(torch::kInt64).contiguous();
    TORCH_CHECK(counts.numel() == Q, "decoder: counts must have one entry a row");
    const bool indexed = index_in.numel() > 0;
    const torch::Tensor index = indexed ? index_in.to(torch::kInt64).contiguous() : index_in;
    const int64_t* cnt = counts.data_ptr<int64_t>();
    const int64_t* idx = indexed ? index.data_ptr<int64_t>() : nullptr;
    const int64_t idx_width = indexed ? index.size(1) : 0;
    if (indexed) TORCH_CHECK(index.dim() == 2 && index.size(0) == Q, "decoder: index must be [Q, L]");
    for (int64_t r = 0; r < Q; ++r) {
      const int64_t s = seq[(size_t)r], held = past[s] + rows[s];
      TORCH_CHECK(cnt[r] >= 1 && cnt[r] <= held && (!indexed || cnt[r] <= idx_width), "decoder: row ", r, " sees ",
                  cnt[r], " keys; the cache holds ", held);
      if (indexed)
        for (int64_t t = 0; t < cnt[r]; ++t)
          TORCH_CHECK(idx[r * idx_width + t] >= 0 && idx[r * idx_width + t] < held &&
                          (t == 0 || idx[r * idx_width + t] > idx[r * idx_width + t - 1]),
                      "decoder: index of row ", r, " must be ascending cache positions");
    }
    const torch::Tensor cosc = cos_in.contiguous(), sinc = sin_in.contiguous();
    const float* cs = cosc.data_ptr<float>();
    const float* sn = sinc.data_ptr<float>();

    torch::Tensor out = x_in.contiguous().clone();
    float* x = out.data_ptr<float>();
    const int64_t QD = NH_ * D_, KD = NKV_ * D_;
    std::vector<float> h((size_t)(Q * std::max(H_, I_))), q((size_t)(Q * QD)), k((size_t)(Q * KD)),
        v((size_t)(Q * KD)), att((size_t)(Q * QD)), gate((size_t)(Q * I_)), up((size_t)(Q * I_)), tmp((size_t)(Q * H_));
    QuantizedRows a;
    const float scale = 1.f / std::sqrt((float)D_);
    std::vector<Sequence> seqs((size_t)S);

    for (int64_t l = 0; l < nl; ++l) {
      const Layer& L = layers_[l];
      for (int64_t r = 0; r < Q; ++r) rms_norm(x + r * H_, L.in_norm.data_ptr<float>(), eps_, H_, h.data() + r * H_);
      quantize_rows(h.data(), Q, H_, L.q.nb, a);
      run_linears({&L.q, &L.k, &L.v}, a, Q, {q.data(), k.data(), v.data()});
      for (int64_t s = 0; s < S; ++s) {
        Sequence& sq = seqs[(size_t)s];
        sq.kb = keys[s][l].data_ptr<float>();
        sq.vb = values[s][l].data_ptr<float>();
        sq.cap = keys[s][l].size(2);
        sq.first = first[(size_t)s];
        sq.rows = rows[s];
      }
      for (int64_t r = 0; r < Q; ++r) {
        const Sequence& sq = seqs[(size_t)seq[(size_t)r]];
        const int64_t slot = past[seq[(size_t)r]] + r - sq.first;
        for (int64_t hh = 0; hh < NH_; ++hh) rope(q.data() + r * QD + hh * D_, cs + r * D_, sn + r * D_, D_);
        for (int64_t g = 0; g < NKV_; ++g) {
          float* kr = k.data() + r * KD + g * D_;
          rope(kr, cs + r * D_, sn + r * D_, D_);
          std::copy(kr, kr + D_, sq.kb + (g * sq.cap + slot) * D_);
          const float* vr = v.data() + r * KD + g * D_;
          std::copy(vr, vr + D_, sq.vb + (g * sq.cap + slot) * D_);
        }
      }
      // attention: one task per (sequence, key/value head, slice of the query heads sharing it)
      attention(seqs, q.data(), cnt, idx, idx_width, scale, att.data());
      quantize_rows(att.data(), Q, QD, L.o.nb, a);
      run_linears({&L.o}, a, Q, {tmp.data()});
      for (int64_t i = 0; i < Q * H_; ++i) x[i] += tmp[(size_t)i];
      for (int64_t r = 0; r < Q; ++r)
        rms_norm(x + r * H_, L.post_norm.data_ptr<float>(), eps_, H_, h.data() + r * H_);
      quantize_rows(h.data(), Q, H_, L.gate.nb, a);
      run_linears({&L.gate, &L.up}, a, Q, {gate.data(), up.data()});
      // split only where a thread's share outweighs a parallel region's start (the draft's 4864 stay serial)
      at::parallel_for(0, Q * I_, 6144, [&](int64_t i0, int64_t i1) {
        for (int64_t i = i0; i < i1; ++i) {
          const float g = gate[(size_t)i];
          h[(size_t)i] = g / (1.f + std::exp(-g)) * up[(size_t)i];
        }
      });
      quantize_rows(h.data(), Q, I_, L.down.nb, a);
      run_linears({&L.down}, a, Q, {tmp.data()});
      for (int64_t i = 0; i < Q * H_; ++i) x[i] += tmp[(size_t)i];
    }
    return out;
  }

  // One sequence's part of a layer's attention: its key/value buffers (capacity `cap` entries a head) and its
  // rows first..first + rows - 1 of the forward.
  struct Sequence {
    float* kb = nullptr;
    float* vb = nullptr;
    int64_t cap = 0, first = 0, rows = 0;
  };

  // Attention of every row: att[r, h] for every query head h. One task per (sequence, key/value head, slice
  // of the query heads sharing it) covering the sequence's rows: a key block read once serves every row and
  // head of the task. Slices only so that every thread has a task. Each (row, head) is computed whole by one
  // task (head_attention's operations) over its own sequence's keys, whatever the split and whatever other
  // sequences share the forward.
  void attention(const std::vector<Sequence>& seqs, const float* q, const int64_t* cnt, const int64_t* idx,
                 int64_t idx_width, float scale, float* att) const {
    const int64_t group = NH_ / NKV_, QD = NH_ * D_, S = (int64_t)seqs.size();
    const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
    const int64_t slices = std::min<int64_t>(group, (threads + NKV_ - 1) / NKV_);
    const int64_t per = (group + slices - 1) / slices;
    const int64_t per_group = (group + per - 1) / per;
    int64_t most = 0;
    for (const Sequence& sq : seqs) most = std::max(most, sq.rows);
    at::parallel_for(0, S * NKV_ * per_group, 1, [&](int64_t t0, int64_t t1) {
      std::vector<float> p;
      std::vector<const float*> qs((size_t)(most * per));
      std::vector<float*> os((size_t)(most * per));
      std::vector<const int64_t*> ir((size_t)most);
      for (int64_t t = t0; t < t1; ++t) {
        const Sequence& sq = seqs[(size_t)(t / (NKV_ * per_group))];
        const int64_t u = t % (NKV_ * per_group), g = u / per_group, s = u % per_group, Q = sq.rows;
        const int64_t h0 = g * group + s * per, h1 = std::min(g * group + group, h0 + per), nh = h1 - h0;
        const float* kg = sq.kb + g * sq.cap * D_;
        const float* vg = sq.vb + g * sq.cap * D_;
        const int64_t* n = cnt + sq.first;
        for (int64_t r = 0; r < Q; ++r) {
          const int64_t row = sq.first + r;
          ir[(size_t)r] = idx ? idx + row * idx_width : nullptr;
          for (int64_t h = h0; h < h1; ++h) {
            qs[(size_t)(r * nh + h - h0)] = q + row * QD + h * D_;
            os[(size_t)(r * nh + h - h0)] = att + row * QD + h * D_;
          }
        }
#if DEC_AVX512
        switch (D_) {
          case 16: heads_attention_avx512<1>(qs.data(), Q, nh, kg, vg, n, ir.data(), scale, os.data(), p); continue;
          case 32: heads_attention_avx512<2>(qs.data(), Q, nh, kg, vg, n, ir.data(), scale, os.data(), p); continue;
          case 64: heads_attention_avx512<4>(qs.data(), Q, nh, kg, vg, n, ir.data(), scale, os.data(), p); continue;
          case 128: heads_attention_avx512<8>(qs.data(), Q, nh, kg, vg, n, ir.data(), scale, os.data(), p); continue;
          default: break;
        }
#elif DEC_AVX2
        switch (D_) {
          case 16: heads_attention_avx2<1>(qs.data(), Q, nh, kg, vg, n, ir.data(), scale, os.data(), p); continue;
          case 32: heads_attention_avx2<2>(qs.data(), Q, nh, kg, vg, n, ir.data(), scale, os.data(), p); continue;
          case 64: heads_attention_avx2<4>(qs.data(), Q, nh, kg, vg, n, ir.data(), scale, os.data(), p); continue;
          case 128: heads_attention_avx2<8>(qs.data(), Q, nh, kg, vg, n, ir.data(), scale, os.data(), p); continue;
          default: break;
        }
#endif
        for (int64_t r = 0; r < Q; ++r)
          for (int64_t h = 0; h < nh; ++h)
            head_attention(qs[(size_t)(r * nh + h)], kg, vg, D_, n[r], ir[(size_t)r], scale, os[(size_t)(r * nh + h)], p);
      }
    });
  }

 private:
  int64_t H_, NH_, NKV_, D_, I_;
  float eps_;
  std::vector<Layer> layers_;
};

}  // namespace

void register_decoder(pybind11::module& m) {
  pybind11::class_<Decoder>(m, "Decoder")
      .def(pybind11::init<int64_t, int64_t, int64_t, int64_t, int64_t, double>())
      .def("add_layer", &Decoder::add_layer)
      .def("num_layers", &Decoder::num_layers)
      .def("forward", &Decoder::forward, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("forward_batch", &Decoder::forward_batch, pybind11::call_guard<pybind11::gil_scoped_release>());
}

}  // namespace kq
