// Shared declarations of the K-quant products (kquant.cpp) and the native decoder (decoder.cpp).
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <vector>

namespace kq {

constexpr int64_t QB = 128;       // inputs per block
constexpr int64_t G16 = QB / 16;  // 16-input sums of activation codes per block

// Activation rows quantised to int8 per block of 128 inputs (kquant.cpp: quantize_rows).
struct QuantizedRows {
  std::vector<int8_t> q;     // [M, nb, 128]
  std::vector<float> d;      // [M, nb]
  std::vector<int32_t> sum;  // [M, nb, 8] sums of 16 codes
  std::vector<int32_t> p32;  // [M, nb, 2] the four sums of 32 codes as int16 pairs (s0 | s1 << 16, s2 | s3 << 16)
  std::vector<int32_t> p16;  // [M, nb, 4] the eight sums of 16 codes as int16 pairs
};

void quantize_rows(const float* x, int64_t M, int64_t K, int64_t nb, QuantizedRows& out);

constexpr int64_t NT = 16;  // weight rows interleaved in one tile (engine/kquant.py: pack_tiles)

// One linear layer y = x @ W^T (+ bias) in the tiled k4 (kind 4: p0 codes, p2 meta) or k6 (kind 6: p0 lo,
// p1 hi, p2 meta) layout: T = ceil(N / 16) tiles of 16 weight rows (kquant.cpp's header); `keep` holds the
// tensors the pointers point into.
struct Linear {
  int kind = 4;
  const uint8_t* p0 = nullptr;
  const uint8_t* p1 = nullptr;
  const uint8_t* p2 = nullptr;
  const float* bias = nullptr;
  int64_t N = 0, K = 0, nb = 0, T = 0;
  std::vector<torch::Tensor> keep;
  // y[m * ldy + n] for the 16 outputs n of tile t (those < N) and activation rows m_begin <= m < m_end (one
  // thread; every output computed the same way whatever rows share the call)
  void tile(int64_t t, const QuantizedRows& a, int64_t m_begin, int64_t m_end, float* y, int64_t ldy) const;
};

Linear make_linear(const std::vector<torch::Tensor>& parts, const c10::optional<torch::Tensor>& bias, int64_t K,
                   int64_t N);

// outs[i]: [M, layers[i]->N] row-major; the layers share the quantised input `a` (one parallel region).
void run_linears(const std::vector<const Linear*>& layers, const QuantizedRows& a, int64_t M,
                 const std::vector<float*>& outs);

void register_decoder(pybind11::module& m);

}  // namespace kq
