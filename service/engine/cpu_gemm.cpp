// inferkiln::linear_fp32: x @ W.T (+ b) in fp32 with AVX2 and FMA, W packed by service/engine/cpu_gemm.py
// into panels of 24 output columns, [panels, K, 24], so that each k reads 96 contiguous bytes of W.
//
// Each panel is computed by 4x24 tiles: 12 ymm accumulators, 3 loads of W and 4 broadcasts of x per
// k, so the FMA units are the bound with several rows and memory is with one. Threads split the
// panels (at::parallel_for, torch's OpenMP team). Why not oneDNN here: see cpu_gemm.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <cstring>

namespace {

constexpr int64_t kPanel = 24;

// rows R (1-4) of x against one panel: c[r][0:cols] = sum_k a[r][k] * w[k][0:cols]
template <int R>
inline void tile(const float* a, int64_t lda, const float* w, int64_t K, float* c, int64_t ldc, int64_t cols) {
  __m256 c00 = _mm256_setzero_ps(), c01 = c00, c02 = c00, c10 = c00, c11 = c00, c12 = c00;
  __m256 c20 = c00, c21 = c00, c22 = c00, c30 = c00, c31 = c00, c32 = c00;
  const float *a0 = a, *a1 = a + lda, *a2 = a + 2 * lda, *a3 = a + 3 * lda;
  for (int64_t k = 0; k < K; ++k) {
    const float* wk = w + k * kPanel;
    const __m256 w0 = _mm256_loadu_ps(wk), w1 = _mm256_loadu_ps(wk + 8), w2 = _mm256_loadu_ps(wk + 16);
    __m256 x = _mm256_broadcast_ss(a0 + k);
    c00 = _mm256_fmadd_ps(x, w0, c00); c01 = _mm256_fmadd_ps(x, w1, c01); c02 = _mm256_fmadd_ps(x, w2, c02);
    if constexpr (R > 1) {
      x = _mm256_broadcast_ss(a1 + k);
      c10 = _mm256_fmadd_ps(x, w0, c10); c11 = _mm256_fmadd_ps(x, w1, c11); c12 = _mm256_fmadd_ps(x, w2, c12);
    }
    if constexpr (R > 2) {
      x = _mm256_broadcast_ss(a2 + k);
      c20 = _mm256_fmadd_ps(x, w0, c20); c21 = _mm256_fmadd_ps(x, w1, c21); c22 = _mm256_fmadd_ps(x, w2, c22);
    }
    if constexpr (R > 3) {
      x = _mm256_broadcast_ss(a3 + k);
      c30 = _mm256_fmadd_ps(x, w0, c30); c31 = _mm256_fmadd_ps(x, w1, c31); c32 = _mm256_fmadd_ps(x, w2, c32);
    }
  }
  // Through a local buffer: storing straight from an array of accumulators made gcc keep them in memory.
  alignas(32) float out[4][kPanel];
  _mm256_store_ps(out[0], c00); _mm256_store_ps(out[0] + 8, c01); _mm256_store_ps(out[0] + 16, c02);
  _mm256_store_ps(out[1], c10); _mm256_store_ps(out[1] + 8, c11); _mm256_store_ps(out[1] + 16, c12);
  _mm256_store_ps(out[2], c20); _mm256_store_ps(out[2] + 8, c21); _mm256_store_ps(out[2] + 16, c22);
  _mm256_store_ps(out[3], c30); _mm256_store_ps(out[3] + 8, c31); _mm256_store_ps(out[3] + 16, c32);
  for (int r = 0; r < R; ++r) std::memcpy(c + r * ldc, out[r], cols * sizeof(float));
}

at::Tensor linear_fp32(const at::Tensor& input, const at::Tensor& packed, int64_t n,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(input.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat, "linear_fp32 takes float32");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous(), "W must come from cpu_gemm.pack");
  const int64_t K = input.size(-1), panels = packed.size(0);
  TORCH_CHECK(packed.size(1) == K && n > (panels - 1) * kPanel && n <= panels * kPanel, "W's shape does not match x");
  const at::Tensor x = input.contiguous();
  const int64_t M = K ? x.numel() / K : 0;
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  at::Tensor out = at::empty(sizes, x.options());
  const float* a = x.data_ptr<float>();
  const float* w = packed.data_ptr<float>();
  float* c = out.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const float* wp = w + p * K * kPanel;
      const int64_t cols = std::min(kPanel, n - p * kPanel);
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) tile<4>(a + m * K, K, wp, K, c + m * n + p * kPanel, n, cols);
      const float* ar = a + m * K;
      float* cr = c + m * n + p * kPanel;
      switch (M - m) {
        case 3: tile<3>(ar, K, wp, K, cr, n, cols); break;
        case 2: tile<2>(ar, K, wp, K, cr, n, cols); break;
        case 1: tile<1>(ar, K, wp, K, cr, n, cols); break;
        default: break;
      }
    }
  });
  if (bias.has_value()) out.add_(*bias);
  return out;
}

}  // namespace

// The schema is defined in cpu_gemm.py (so that TorchScript can compile a call to it where this
// library is not loaded); this registers the kernel.
TORCH_LIBRARY_IMPL(inferkiln, CPU, m) {
  m.impl("linear_fp32", &linear_fp32);
}
