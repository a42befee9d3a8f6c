// inferkiln::linear_bf16: x @ W.T (+ b) for bf16 x and W, accumulated in fp32, on x86 CPUs with
// AVX512-BF16. W is packed by service/engine/cpu_gemm.py into panels of 16 output columns with k in
// pairs, [panels, ceil(K/2), 16, 2]: a pair of k of a panel is one 64-byte line, which one
// vdpbf16ps multiplies by x's pair of k (broadcast) and adds into the panel's 16 fp32 sums. The
// sums are rounded to bf16 once, after the bias is added, as oneDNN rounds them.
//
// A tile is up to 4 rows of x against up to 4 adjacent panels (16 zmm sums): with one row (a c=1
// decode step) that is 4 streams of W per core. Threads take 4 panels at a time from their
// contiguous shares (cpu_shares.h). Where a matmul reads each line of W once (up to 4 rows, W
// aligned), it reads them with non-temporal loads, as linear_fp32's one-row tile does and for its
// reason (cpu_gemm.cpp's row_tiles_avx512); with more rows a panel's lines are read again from cache.
// Why not oneDNN: see cpu_gemm.py.
//
// The kernel's functions are compiled for AVX-512 (the pragma below), the rest of the library is
// not: the op checks the CPU before it calls them. The headers come first, so that none of their
// inline functions is compiled for AVX-512 here.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "cpu_shares.h"

#include <algorithm>
#include <cstdint>

namespace {

constexpr int64_t kColumns = 16;  // output columns a panel
constexpr int64_t kStreams = 4;   // panels a tile reads at once
constexpr int64_t kRows = 4;      // rows of x a tile takes

struct Matmul {
  const uint32_t* x;       // [M, pairs]: x's k in pairs of bf16
  const uint32_t* w;       // [panels, pairs, 16]: W's k in pairs, a panel's 16 columns side by side
  const uint16_t* bias;    // [n] bf16, or null
  uint16_t* out;           // [M, n] bf16
  int64_t pairs, M, n, panels;
  bool once;               // every line of W is read once, and W is 64-byte aligned: non-temporal loads
};

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16")

// Rows m0..m0+R-1 of x against panels p0..p0+S-1, over every pair of k (W's lines loaded non-temporally
// where `Once`).
template <int R, int S, bool Once>
inline void tile(const Matmul& mm, int64_t m0, int64_t p0) {
  __m512 sums[R][S];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s) sums[r][s] = _mm512_setzero_ps();
  }
  const uint32_t* w = mm.w + p0 * mm.pairs * kColumns;
  const uint32_t* x = mm.x + m0 * mm.pairs;
  const int64_t stride = mm.pairs * kColumns;
  for (int64_t k = 0; k < mm.pairs; ++k) {
    __m512i lines[S];
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s) {
      const uint32_t* line = w + s * stride + k * kColumns;
      // GCC 12 declares the intrinsic's pointer non-const
      lines[s] = Once ? _mm512_stream_load_si512(const_cast<uint32_t*>(line)) : _mm512_loadu_si512(line);
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512i pair = _mm512_set1_epi32(static_cast<int>(x[r * mm.pairs + k]));
#pragma GCC unroll 4
      for (int s = 0; s < S; ++s) sums[r][s] = _mm512_dpbf16_ps(sums[r][s], (__m512bh)pair, (__m512bh)lines[s]);
    }
  }
#pragma GCC unroll 4
  for (int s = 0; s < S; ++s) {
    const int64_t column = (p0 + s) * kColumns;
    const __mmask16 mask = static_cast<__mmask16>((1u << std::min<int64_t>(kColumns, mm.n - column)) - 1u);
    __m512 bias = _mm512_setzero_ps();
    if (mm.bias) {  // bf16 to fp32: the 16 bits above 16 zero bits
      const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, mm.bias + column));
      bias = _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_add_ps(sums[r][s], bias));
      _mm256_mask_storeu_epi16(mm.out + (m0 + r) * mm.n + column, mask, (__m256i)rounded);
    }
  }
}

template <int R, bool Once>
inline void tiles(const Matmul& mm, int64_t m0, int64_t p0, int64_t streams) {
  switch (streams) {
    case 4: tile<R, 4, Once>(mm, m0, p0); break;
    case 3: tile<R, 3, Once>(mm, m0, p0); break;
    case 2: tile<R, 2, Once>(mm, m0, p0); break;
    default: tile<R, 1, Once>(mm, m0, p0); break;
  }
}

// Every row of x against panels p0..p0+streams-1, in tiles of up to kRows rows.
template <bool Once>
inline void row_tiles(const Matmul& mm, int64_t p0, int64_t streams) {
  for (int64_t m0 = 0; m0 < mm.M; m0 += kRows) {
    switch (std::min(kRows, mm.M - m0)) {
      case 4: tiles<4, Once>(mm, m0, p0, streams); break;
      case 3: tiles<3, Once>(mm, m0, p0, streams); break;
      case 2: tiles<2, Once>(mm, m0, p0, streams); break;
      default: tiles<1, Once>(mm, m0, p0, streams); break;
    }
  }
}

// Panels p0..p0+kStreams-1 (fewer at the end) for every row of x.
__attribute__((noinline)) void panel_group(const Matmul& mm, int64_t p0) {
  const int64_t streams = std::min(kStreams, mm.panels - p0);
  if (mm.once) {
    row_tiles<true>(mm, p0, streams);
  } else {
    row_tiles<false>(mm, p0, streams);
  }
}

#pragma GCC pop_options

}  // namespace

namespace inferkiln {

at::Tensor linear_bf16(const at::Tensor& input, const at::Tensor& packed, int64_t n,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(__builtin_cpu_supports("avx512bf16"), "linear_bf16 needs a CPU with AVX512-BF16");
  TORCH_CHECK(input.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16,
              "linear_bf16 takes bfloat16");
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kColumns && packed.size(3) == 2 && packed.is_contiguous(),
              "W must come from cpu_gemm.pack_bf16");
  const int64_t K = input.size(-1), pairs = packed.size(1), panels = packed.size(0);
  TORCH_CHECK(K > 0 && pairs == (K + 1) / 2 && n > (panels - 1) * kColumns && n <= panels * kColumns,
              "W's shape does not match x");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == at::kBFloat16 && bias->numel() == n),
              "the bias must be bfloat16, one a column");
  at::Tensor x = input.reshape({-1, K});
  x = (K % 2 ? at::constant_pad_nd(x, {0, 1}) : x).contiguous();  // whole pairs: W's last k pairs a zero
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  auto sizes = input.sizes().vec();
  sizes.back() = n;
  at::Tensor out = at::empty(sizes, input.options());
  const auto* w = reinterpret_cast<const uint32_t*>(packed.data_ptr<at::BFloat16>());
  const Matmul mm{reinterpret_cast<const uint32_t*>(x.data_ptr<at::BFloat16>()), w,
                  b.defined() ? reinterpret_cast<const uint16_t*>(b.data_ptr<at::BFloat16>()) : nullptr,
                  reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()), pairs, x.size(0), n, panels,
                  x.size(0) <= kRows && (reinterpret_cast<uintptr_t>(w) & 63) == 0};
  if (mm.M == 0) return out;
  inferkiln::for_each_unit((panels + kStreams - 1) / kStreams, [&](int64_t u) { panel_group(mm, u * kStreams); });
  return out;
}

}  // namespace inferkiln

// The schema is defined in cpu_gemm.py, as linear_fp32's is.
TORCH_LIBRARY_IMPL(inferkiln, CPU, m) {
  m.impl("linear_bf16", &inferkiln::linear_bf16);
}
