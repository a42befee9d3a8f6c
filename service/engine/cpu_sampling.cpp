// sample_row: one token drawn from softmax(logits / temperature), in one call, beside the matmuls
// (cpu_gemm.cpp) in the same library.
//
// The draw is sampling.py's for the same distribution: one uniform u of the request's generator (the
// value torch.rand((), dtype=float64) takes from it) and the first token whose running sum of
// probabilities exceeds u times the total, the inverse CDF. Run as aten ops that was about ten calls
// (max, subtract, divide, softmax, a float64 cumsum, the draw, searchsorted, three reads back), each
// slowed by caches a decode step's weights had just emptied: 150 us a sampled token of the 76M shape
// after its forward, against 20 us hot (docs/engine-speed.md). Here it is three passes over the row,
// two of them vectorized, into buffers each thread keeps.
//
// A row with no finite mass (a NaN, +inf, or every logit -inf) returns -1 before anything is drawn,
// so the generator is as it was and the caller refuses the request (sampling.NO_FINITE_MASS).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/DistributionsHelper.h>
#include <torch/library.h>

#include <immintrin.h>

#include "cpu_math.h"

#include <cmath>
#include <limits>
#include <mutex>
#include <vector>

namespace {

using inferkiln::exp1;
using inferkiln::exp8;
using inferkiln::row_max;

constexpr int64_t kBlock = 64;  // tokens a partial sum covers: the draw's walk skips whole blocks


// e[i] = e^((x[i] - top) * scale); each block of kBlock tokens' sum into blocks (in double)
void exponentials(const float* x, int64_t n, float top, float scale, float* e, double* blocks) {
  const __m256 shift = _mm256_set1_ps(top), factor = _mm256_set1_ps(scale);
  for (int64_t start = 0, b = 0; start < n; start += kBlock, ++b) {
    const int64_t end = std::min(n, start + kBlock);
    __m256d low = _mm256_setzero_pd(), high = _mm256_setzero_pd();
    int64_t i = start;
    for (; i + 8 <= end; i += 8) {
      const __m256 v = exp8(_mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), shift), factor));
      _mm256_storeu_ps(e + i, v);
      low = _mm256_add_pd(low, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
      high = _mm256_add_pd(high, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
    }
    alignas(32) double lanes[4];
    _mm256_store_pd(lanes, _mm256_add_pd(low, high));
    double sum = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
    for (; i < end; ++i) {
      e[i] = exp1((x[i] - top) * scale);
      sum += e[i];
    }
    blocks[b] = sum;
  }
}

// the first token whose running sum exceeds target: whole blocks skipped by their sums, the same sums
// the total was added from, so a target below the total always lands in a block; within it, where
// rounding keeps the running sum under the target, the block's last token with mass, and where u
// times the total rounded up to the total (u = 1 - 2^-53), the row's last token with mass
int64_t walk(const float* e, int64_t n, const double* blocks, int64_t count, double target) {
  double before = 0.0;
  int64_t b = 0;
  while (b + 1 < count && before + blocks[b] <= target) before += blocks[b++];
  const int64_t start = b * kBlock, end = std::min(n, start + kBlock);
  int64_t last = -1;
  for (int64_t i = start; i < end; ++i) {
    if (e[i] > 0.0f) last = i;
    before += e[i];
    if (before > target && e[i] > 0.0f) return i;
  }
  for (int64_t i = start - 1; last < 0 && i >= 0; --i) {
    if (e[i] > 0.0f) last = i;
  }
  return last;
}

int64_t sample_row(const at::Tensor& logits, double temperature, c10::optional<at::Generator> generator) {
  TORCH_CHECK(logits.dim() == 1 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "sample_row takes one contiguous float32 row");
  TORCH_CHECK(temperature > 0.0, "sample_row samples at a positive temperature");
  const float* x = logits.data_ptr<float>();
  const int64_t n = logits.numel();
  const float top = row_max(x, n);
  if (n == 0 || !std::isfinite(top)) return -1;  // NaN, +inf, or every logit -inf: nothing to draw from
  const int64_t count = (n + kBlock - 1) / kBlock;
  thread_local std::vector<float> e;
  thread_local std::vector<double> blocks;
  e.resize(n);
  blocks.resize(count);
  exponentials(x, n, top, static_cast<float>(1.0 / temperature), e.data(), blocks.data());
  double total = 0.0;
  for (int64_t b = 0; b < count; ++b) total += blocks[b];
  auto* gen = at::get_generator_or_default<at::CPUGeneratorImpl>(generator, at::detail::getDefaultCPUGenerator());
  double u;
  {
    std::lock_guard<std::mutex> lock(gen->mutex_);
    u = at::uniform_real_distribution<double>(0.0, 1.0)(gen);  // torch.rand((), dtype=float64)'s draw
  }
  return walk(e.data(), n, blocks.data(), count, u * total);
}

}  // namespace

// The schema is defined in cpu_gemm.py, as linear_fp32's is.
TORCH_LIBRARY_IMPL(inferkiln, CPU, m) { m.impl("sample_row", &sample_row); }
