// Tight in-register microkernels: the matrix-multiply peak of this CPU's vector units (benchmarks/roof.py).
// Each runs `iters` rounds of independent multiply-accumulate chains on registers only (no memory traffic),
// on every thread at once (OpenMP), and returns the operations done (2 per multiply-accumulate); the caller
// times it. Built by engine.backends.native.roof() with the kernels' flags (-O3 -march=native), separate
// from the kernels' extension so that a git revision's kernels (benchmarks/decoder_ab.py) still build alone.
//
// Paths (each only where compiled for the CPU; the others return -1):
//   int8_maddubs_i16  AVX2 vpmaddubsw (u8 x s8 -> int16 pair sums) + vpaddw: the int16 accumulation the AVX2
//                     kquant kernels use (exact while the sums stay in int16; widened to int32 now and then)
//   int8_maddubs_i32  AVX2 vpmaddubsw + vpmaddwd by ones + vpaddd: every product widened to int32
//   int8_vnni256      AVX-VNNI vpdpbusd on 256 bits
//   int8_vnni512      AVX-512 VNNI vpdpbusd on 512 bits
//   fp32_fma256       AVX2 FMA, 8 floats
//   fp32_fma512       AVX-512 FMA, 16 floats
//   bf16_dp512        AVX-512 BF16 vdpbf16ps (2 bf16 products a float lane)
// AMX tiles are not here: where a CPU has them, roof.py says so and the kernels' AMX path is the one to time.

#include <torch/extension.h>

#include <immintrin.h>
#include <omp.h>

#include <cstdint>
#include <string>
#include <vector>

namespace {

constexpr int CHAINS = 12;  // independent accumulators: more than latency x throughput of any unit here

template <typename V, typename Step>
double run_all(int64_t iters, int threads, double ops_per_step, Step step, int chains = CHAINS) {
  // every thread runs the same loop; a sink keeps the compiler from dropping it
  std::vector<double> sink(threads, 0.0);
#pragma omp parallel num_threads(threads)
  { sink[omp_get_thread_num()] = step(iters); }
  double s = 0.0;
  for (double v : sink) s += v;
  if (s == 12345.678) return -2;  // never: keeps `sink` alive
  return ops_per_step * (double)iters * chains * threads;
}

#if defined(__AVX2__)
template <int N>
inline double sum_epi32(const __m256i (&acc)[N]) {
  __m256i t = acc[0];
  for (int i = 1; i < N; ++i) t = _mm256_add_epi32(t, acc[i]);
  alignas(32) int32_t v[8];
  _mm256_store_si256((__m256i*)v, t);
  double s = 0;
  for (int i = 0; i < 8; ++i) s += v[i];
  return s;
}
#endif

// The AVX2 int8 loops are written in assembly: with 8 accumulators and 6 operands in 16 registers the compiler
// spills accumulators to the stack and the loop then measures store forwarding, not the multiply units.
// ymm0-7: accumulators, ymm8-11: weights, ymm12: activations, ymm13: ones (i32), ymm14-15: products.
#if defined(__AVX2__)
#define KQ_ROOF_LOOP(BODY)                                                                              \
  do {                                                                                                  \
    alignas(32) int32_t out[8] = {};                                                                    \
    int64_t count = n;                                                                                  \
    __asm__ volatile(                                                                                   \
        "vpxor %%ymm0, %%ymm0, %%ymm0\n vpxor %%ymm1, %%ymm1, %%ymm1\n vpxor %%ymm2, %%ymm2, %%ymm2\n" \
        "vpxor %%ymm3, %%ymm3, %%ymm3\n vpxor %%ymm4, %%ymm4, %%ymm4\n vpxor %%ymm5, %%ymm5, %%ymm5\n" \
        "vpxor %%ymm6, %%ymm6, %%ymm6\n vpxor %%ymm7, %%ymm7, %%ymm7\n"                               \
        "vpcmpeqw %%ymm13, %%ymm13, %%ymm13\n vpsrlw $15, %%ymm13, %%ymm13\n" /* ones (int16) */      \
        "vpxor %%ymm12, %%ymm12, %%ymm12\n" /* zero activations: the sums never saturate */            \
        "vmovdqa %%ymm13, %%ymm8\n vmovdqa %%ymm13, %%ymm9\n vmovdqa %%ymm13, %%ymm10\n"             \
        "vmovdqa %%ymm13, %%ymm11\n"                                                                  \
        "1:\n" BODY "dec %[count]\n jnz 1b\n"                                                          \
        "vpaddd %%ymm1, %%ymm0, %%ymm0\n vpaddd %%ymm2, %%ymm0, %%ymm0\n vpaddd %%ymm3, %%ymm0, %%ymm0\n" \
        "vpaddd %%ymm4, %%ymm0, %%ymm0\n vpaddd %%ymm5, %%ymm0, %%ymm0\n vpaddd %%ymm6, %%ymm0, %%ymm0\n" \
        "vpaddd %%ymm7, %%ymm0, %%ymm0\n vmovdqa %%ymm0, (%[out])\n"                                  \
        : [count] "+r"(count)                                                                           \
        : [out] "r"(out)                                                                                \
        : "memory", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",   \
          "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15");                                        \
    return (double)out[0];                                                                              \
  } while (0)
// one chain: product of weights W into temp T, accumulated into A
#define I16(W, T, A) "vpmaddubsw %%ymm12, %%ymm" #W ", %%ymm" #T "\n vpaddw %%ymm" #T ", %%ymm" #A ", %%ymm" #A "\n"
#define I32(W, T, A)                                                                                   \
  "vpmaddubsw %%ymm12, %%ymm" #W ", %%ymm" #T "\n vpmaddwd %%ymm13, %%ymm" #T ", %%ymm" #T "\n vpaddd %%ymm" #T \
  ", %%ymm" #A ", %%ymm" #A "\n"
#endif

double int8_maddubs_i16(int64_t iters, int threads) {
#if defined(__AVX2__)
  return run_all<__m256i>(iters, threads, 2.0 * 32, [](int64_t n) -> double {
    KQ_ROOF_LOOP(I16(8, 14, 0) I16(9, 15, 1) I16(10, 14, 2) I16(11, 15, 3) I16(8, 14, 4) I16(9, 15, 5)
                     I16(10, 14, 6) I16(11, 15, 7));
  }, 8);
#else
  (void)iters;
  (void)threads;
  return -1;
#endif
}

double int8_maddubs_i32(int64_t iters, int threads) {
#if defined(__AVX2__)
  return run_all<__m256i>(iters, threads, 2.0 * 32, [](int64_t n) -> double {
    KQ_ROOF_LOOP(I32(8, 14, 0) I32(9, 15, 1) I32(10, 14, 2) I32(11, 15, 3) I32(8, 14, 4) I32(9, 15, 5)
                     I32(10, 14, 6) I32(11, 15, 7));
  }, 8);
#else
  (void)iters;
  (void)threads;
  return -1;
#endif
}

double int8_vnni256(int64_t iters, int threads) {
#if defined(__AVXVNNI__)
  return run_all<__m256i>(iters, threads, 2.0 * 32, [](int64_t n) {
    __m256i acc[CHAINS];
    for (int i = 0; i < CHAINS; ++i) acc[i] = _mm256_setzero_si256();
    __m256i w = _mm256_set1_epi8(1), q = _mm256_set1_epi8(0);
    for (int64_t it = 0; it < n; ++it) {
      __asm__ volatile("" : "+x"(w), "+x"(q));
      for (int i = 0; i < CHAINS; ++i) acc[i] = _mm256_dpbusd_avx_epi32(acc[i], w, q);
    }
    return sum_epi32(acc);
  });
#else
  (void)iters;
  (void)threads;
  return -1;
#endif
}

double int8_vnni512(int64_t iters, int threads) {
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
  return run_all<__m512i>(iters, threads, 2.0 * 64, [](int64_t n) {
    __m512i acc[CHAINS];
    for (int i = 0; i < CHAINS; ++i) acc[i] = _mm512_setzero_si512();
    __m512i w = _mm512_set1_epi8(1), q = _mm512_set1_epi8(0);
    for (int64_t it = 0; it < n; ++it) {
      __asm__ volatile("" : "+v"(w), "+v"(q));
      for (int i = 0; i < CHAINS; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], w, q);
    }
    __m512i t = acc[0];
    for (int i = 1; i < CHAINS; ++i) t = _mm512_add_epi32(t, acc[i]);
    return (double)_mm512_reduce_add_epi32(t);
  });
#else
  (void)iters;
  (void)threads;
  return -1;
#endif
}

double fp32_fma256(int64_t iters, int threads) {
#if defined(__AVX2__) && defined(__FMA__)
  return run_all<__m256>(iters, threads, 2.0 * 8, [](int64_t n) {
    __m256 acc[CHAINS];
    for (int i = 0; i < CHAINS; ++i) acc[i] = _mm256_setzero_ps();
    __m256 a = _mm256_set1_ps(0.f), b = _mm256_set1_ps(0.f);
    for (int64_t it = 0; it < n; ++it) {
      __asm__ volatile("" : "+x"(a), "+x"(b));
      for (int i = 0; i < CHAINS; ++i) acc[i] = _mm256_fmadd_ps(a, b, acc[i]);
    }
    __m256 t = acc[0];
    for (int i = 1; i < CHAINS; ++i) t = _mm256_add_ps(t, acc[i]);
    alignas(32) float v[8];
    _mm256_store_ps(v, t);
    return (double)(v[0] + v[7]);
  });
#else
  (void)iters;
  (void)threads;
  return -1;
#endif
}

double fp32_fma512(int64_t iters, int threads) {
#if defined(__AVX512F__)
  return run_all<__m512>(iters, threads, 2.0 * 16, [](int64_t n) {
    __m512 acc[CHAINS];
    for (int i = 0; i < CHAINS; ++i) acc[i] = _mm512_setzero_ps();
    __m512 a = _mm512_set1_ps(0.f), b = _mm512_set1_ps(0.f);
    for (int64_t it = 0; it < n; ++it) {
      __asm__ volatile("" : "+v"(a), "+v"(b));
      for (int i = 0; i < CHAINS; ++i) acc[i] = _mm512_fmadd_ps(a, b, acc[i]);
    }
    __m512 t = acc[0];
    for (int i = 1; i < CHAINS; ++i) t = _mm512_add_ps(t, acc[i]);
    return (double)_mm512_reduce_add_ps(t);
  });
#else
  (void)iters;
  (void)threads;
  return -1;
#endif
}

double bf16_dp512(int64_t iters, int threads) {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  return run_all<__m512>(iters, threads, 2.0 * 32, [](int64_t n) {
    __m512 acc[CHAINS];
    for (int i = 0; i < CHAINS; ++i) acc[i] = _mm512_setzero_ps();
    __m512bh a = (__m512bh)_mm512_setzero_si512(), b = (__m512bh)_mm512_setzero_si512();
    for (int64_t it = 0; it < n; ++it) {
      __asm__ volatile("" : "+v"(a), "+v"(b));
      for (int i = 0; i < CHAINS; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
    }
    __m512 t = acc[0];
    for (int i = 1; i < CHAINS; ++i) t = _mm512_add_ps(t, acc[i]);
    return (double)_mm512_reduce_add_ps(t);
  });
#else
  (void)iters;
  (void)threads;
  return -1;
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_maddubs_i16", &int8_maddubs_i16, "AVX2 vpmaddubsw + vpaddw peak: operations done (-1: not compiled)");
  m.def("int8_maddubs_i32", &int8_maddubs_i32, "AVX2 vpmaddubsw + vpmaddwd + vpaddd peak");
  m.def("int8_vnni256", &int8_vnni256, "AVX-VNNI vpdpbusd (256 bits) peak");
  m.def("int8_vnni512", &int8_vnni512, "AVX-512 VNNI vpdpbusd peak");
  m.def("fp32_fma256", &fp32_fma256, "AVX2 FMA peak (float32)");
  m.def("fp32_fma512", &fp32_fma512, "AVX-512 FMA peak (float32)");
  m.def("bf16_dp512", &bf16_dp512, "AVX-512 BF16 vdpbf16ps peak");
}
