// inferkiln::linear_fp32: x @ W.T (+ b) in fp32 with AVX2 and FMA, W packed by service/engine/cpu_gemm.py
// into panels of 24 output columns, [panels, K, 24], so that each k reads 96 contiguous bytes of W.
//
// Each panel is computed by 4x24 tiles: 12 ymm accumulators, 3 loads of W and 4 broadcasts of x per
// k, so the FMA units are the bound with several rows and memory is with one. One row (a decode step
// of one sequence) is a panel at a time (4 adjacent ones at once on AVX-512 CPUs other than AMD's:
// one_row), each thread reading its contiguous share of the panels
// (cpu_shares.h: a thread that is preempted mid-matmul, on a machine whose cores are shared with a
// load generator or the event loop, has the rest of its share taken by the others). On CPUs with
// AVX-512 the one-row tile runs with zmm registers (row_tiles_avx512), and the tiles of several rows
// take one zmm and one ymm FMA a k and row where AVX2 takes three (tile_avx512). With several rows
// threads take a panel at a time as each is done.
// Why not oneDNN: see cpu_gemm.py.
//
// The AVX-512 functions are compiled for it by a pragma (below), the rest of the library for AVX2:
// one_row checks the CPU before it calls them. The headers come first, so that none of their inline
// functions is compiled for AVX-512 here.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "cpu_math.h"
#include "cpu_shares.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace {

constexpr int64_t kPanel = 24;

// Rows R (1-4) of x against one panel over k0..k1, accumulating into acc (from zero when `first`);
// `ahead` > 0 prefetches W that many floats ahead (the next k block, see linear_fp32).
template <int R>
inline void tile(const float* a, int64_t lda, const float* w, int64_t k0, int64_t k1, float (*acc)[kPanel],
                 bool first, int64_t ahead) {
  __m256 c00, c01, c02, c10, c11, c12, c20, c21, c22, c30, c31, c32;
  if (first) {
    c00 = _mm256_setzero_ps(); c01 = c00; c02 = c00; c10 = c00; c11 = c00; c12 = c00;
    c20 = c00; c21 = c00; c22 = c00; c30 = c00; c31 = c00; c32 = c00;
  } else {
    c00 = _mm256_load_ps(acc[0]); c01 = _mm256_load_ps(acc[0] + 8); c02 = _mm256_load_ps(acc[0] + 16);
    c10 = _mm256_load_ps(acc[1]); c11 = _mm256_load_ps(acc[1] + 8); c12 = _mm256_load_ps(acc[1] + 16);
    c20 = _mm256_load_ps(acc[2]); c21 = _mm256_load_ps(acc[2] + 8); c22 = _mm256_load_ps(acc[2] + 16);
    c30 = _mm256_load_ps(acc[3]); c31 = _mm256_load_ps(acc[3] + 8); c32 = _mm256_load_ps(acc[3] + 16);
  }
  const float *a0 = a, *a1 = a + lda, *a2 = a + 2 * lda, *a3 = a + 3 * lda;
  for (int64_t k = k0; k < k1; ++k) {
    const float* wk = w + k * kPanel;
    if (ahead) {  // prefetches never fault, past the panel's end included
      _mm_prefetch(reinterpret_cast<const char*>(wk + ahead), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(wk + ahead + 16), _MM_HINT_T0);
    }
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
  // Named registers stored at the end: an array of accumulators indexed in the loop made gcc keep
  // them in memory, a store per FMA.
  _mm256_store_ps(acc[0], c00); _mm256_store_ps(acc[0] + 8, c01); _mm256_store_ps(acc[0] + 16, c02);
  _mm256_store_ps(acc[1], c10); _mm256_store_ps(acc[1] + 8, c11); _mm256_store_ps(acc[1] + 16, c12);
  _mm256_store_ps(acc[2], c20); _mm256_store_ps(acc[2] + 8, c21); _mm256_store_ps(acc[2] + 16, c22);
  _mm256_store_ps(acc[3], c30); _mm256_store_ps(acc[3] + 8, c31); _mm256_store_ps(acc[3] + 16, c32);
}

// One row of x against one panel over all k, into out's columns of panel p. Threads read their
// shares of the panels as one stream each (one_row), which the hardware prefetchers follow. W is
// read with non-temporal loads where it is aligned (see row_tiles_avx512), each k 3 aligned ymm.
void row_tile(const float* a, const float* w, int64_t K, float* out, int64_t n, int64_t p) {
  __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0;
  if ((reinterpret_cast<uintptr_t>(w) & 31) == 0) {
    for (int64_t k = 0; k < K; ++k) {
      const __m256 x = _mm256_broadcast_ss(a + k);
      const __m256i* wk = reinterpret_cast<const __m256i*>(w + k * kPanel);
      c0 = _mm256_fmadd_ps(x, _mm256_castsi256_ps(_mm256_stream_load_si256(wk)), c0);
      c1 = _mm256_fmadd_ps(x, _mm256_castsi256_ps(_mm256_stream_load_si256(wk + 1)), c1);
      c2 = _mm256_fmadd_ps(x, _mm256_castsi256_ps(_mm256_stream_load_si256(wk + 2)), c2);
    }
  } else {
    for (int64_t k = 0; k < K; ++k) {
      const __m256 x = _mm256_broadcast_ss(a + k);
      const float* wk = w + k * kPanel;
      c0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(wk), c0);
      c1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(wk + 8), c1);
      c2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(wk + 16), c2);
    }
  }
  alignas(32) float acc[kPanel];
  _mm256_store_ps(acc, c0); _mm256_store_ps(acc + 8, c1); _mm256_store_ps(acc + 16, c2);
  std::memcpy(out + p * kPanel, acc, std::min(kPanel, n - p * kPanel) * sizeof(float));
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl")

// Floats of a panel the one-row tile prefetches ahead of each k it reads with plain loads: 768
// bytes, 4 of its steps (row_tiles_avx512).
constexpr int64_t kRowAhead = 192;

// An aligned 64-byte line of W: with a non-temporal load where `Stream` (see row_tiles_avx512).
template <bool Stream>
inline __m512 line(float* at) {
  if constexpr (Stream) return _mm512_castsi512_ps(_mm512_stream_load_si512(at));
  return _mm512_load_ps(at);
}

// row_tile with AVX-512, for S adjacent panels at once from p0 (S streams of W): a k of a panel is
// one zmm (16 columns) and one ymm (8). Each column sums its k in the same order, one FMA each, as
// row_tile's: the same floats, whatever S. Not inlined into its AVX2 caller (the compiler refuses to
// across targets).
//
// W is read two k at a time where its 192 bytes are three aligned lines. How, differs by vendor
// (one_row): on AMD's CPUs one panel at a time (S = 1) with non-temporal loads (vmovntdqa,
// `Stream`); on others 4 panels at once with plain loads. On a 2-core Zen 5 EPYC, from contiguous
// shares one stream without prefetches read the 76M shape's 40 matmuls the fastest (cpu_shares.h;
// until 2026-12 it read 4 panels at once, each prefetched ahead), and the non-temporal loads kept
// the weights' stream from evicting what the rest of the step runs on (the interpreter, torch's
// dispatcher, the small tensors between the matmuls): a c=1 sampled decode's 640-token sampling
// took 193 us after a forward against 36 us warm, and 80-160 with these loads. On a 2-core Intel
// Xeon with AMX (a standalone probe of the tile over 312 MB, 2 threads, a contiguous half each) one
// panel at a time read 25.1-26.8 GB/s with non-temporal loads and 26.7-29.8 with plain ones, 4
// panels at once with plain loads 33.5-34.1 (a reader of several streams a core 30.5-34.4), and in
// the engine plain loads decoded at c=1 76.7 tok/s against 70.2 (4 alternating rounds, in process).
// There each stream is prefetched kRowAhead floats ahead: a unit's 4 streams start anew every 4
// panels (295 KB at K 768), and the hardware's prefetchers take a while to follow each one. A
// TorchEngine in process (76M fp32, c=1, alternating processes) then decoded at 8.7-9.5 ms a token
// against 9.4-10.2 without (5 and 10 rounds; 128, 256, 512 and 1024 floats ahead: 8.9-9.3,
// 9.0-9.5, 9.3-9.4, 9.6-9.8).
template <bool Stream, int S>
__attribute__((noinline)) void row_tiles_avx512(const float* a, const float* w, int64_t K, float* out, int64_t n,
                                                int64_t p0) {
  __m512 lo[S];
  __m256 hi[S];
#pragma GCC unroll 4
  for (int s = 0; s < S; ++s) {
    lo[s] = _mm512_setzero_ps();
    hi[s] = _mm256_setzero_ps();
  }
  const int64_t stride = K * kPanel;
  int64_t k = 0;
  if ((reinterpret_cast<uintptr_t>(w) & 63) == 0 && (S == 1 || (stride * sizeof(float)) % 64 == 0)) {
    for (; k + 2 <= K; k += 2) {  // lines: k's columns 0-15 | k's 16-23, k+1's 0-7 | k+1's 8-23
      const __m512 x0 = _mm512_set1_ps(a[k]), x1 = _mm512_set1_ps(a[k + 1]);
#pragma GCC unroll 4
      for (int s = 0; s < S; ++s) {
        float* wk = const_cast<float*>(w + s * stride + k * kPanel);  // GCC 12 declares the intrinsic's pointer non-const
        if constexpr (!Stream) {  // these 3 lines, kRowAhead floats on (a prefetch never faults)
          inferkiln::prefetch<_MM_HINT_T0>(wk + kRowAhead, 2 * kPanel);
        }
        const __m512 l0 = line<Stream>(wk), l1 = line<Stream>(wk + 16), l2 = line<Stream>(wk + 32);
        lo[s] = _mm512_fmadd_ps(x0, l0, lo[s]);
        hi[s] = _mm256_fmadd_ps(_mm512_castps512_ps256(x0), _mm512_castps512_ps256(l1), hi[s]);
        lo[s] = _mm512_fmadd_ps(x1, _mm512_shuffle_f32x4(l1, l2, 0x4E), lo[s]);  // l1's upper half, l2's lower
        hi[s] = _mm256_fmadd_ps(_mm512_castps512_ps256(x1),
                                _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(l2), 1)), hi[s]);
      }
    }
  }
  for (; k < K; ++k) {  // an odd K's last k, or panels that are not aligned
    const __m512 x = _mm512_set1_ps(a[k]);
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s) {
      const float* wk = w + s * stride + k * kPanel;
      lo[s] = _mm512_fmadd_ps(x, _mm512_loadu_ps(wk), lo[s]);
      hi[s] = _mm256_fmadd_ps(_mm512_castps512_ps256(x), _mm256_loadu_ps(wk + 16), hi[s]);
    }
  }
#pragma GCC unroll 4
  for (int s = 0; s < S; ++s) {
    alignas(64) float acc[32];
    _mm512_store_ps(acc, lo[s]);
    _mm256_store_ps(acc + 16, hi[s]);
    const int64_t p = p0 + s;
    std::memcpy(out + p * kPanel, acc, std::min(kPanel, n - p * kPanel) * sizeof(float));
  }
}

// Bytes the tiles of several rows prefetch W ahead (row_groups), 16 k.
constexpr int64_t kAhead = 1536;

// tile with AVX-512, up to 8 rows: per k and row, one zmm FMA (16 columns) and one ymm (8) where
// AVX2 takes three ymm. With several rows the AVX2 tiles are bound by the FMA units on a 2-core Zen 5 EPYC (the 76M
// shape's 40 matmuls took 9.4 ms at 8 rows against 6.4 at one); Zen 5's FMA units are 512 bits
// wide. The same floats: each column sums its k in order, one FMA each, as tile's.
template <int R>
inline void tile_avx512(const float* a, int64_t lda, const float* w, int64_t k0, int64_t k1, float (*acc)[kPanel],
                        bool first, int64_t ahead) {
  __m512 lo[R];
  __m256 hi[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    lo[r] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(acc[r]);
    hi[r] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(acc[r] + 16);
  }
  for (int64_t k = k0; k < k1; ++k) {
    const float* wk = w + k * kPanel;
    if (ahead) {  // as tile's
      _mm_prefetch(reinterpret_cast<const char*>(wk + ahead), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(wk + ahead + 16), _MM_HINT_T0);
    }
    const __m512 w0 = _mm512_loadu_ps(wk);
    const __m256 w1 = _mm256_loadu_ps(wk + 16);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_set1_ps(a[r * lda + k]);
      lo[r] = _mm512_fmadd_ps(x, w0, lo[r]);
      hi[r] = _mm256_fmadd_ps(_mm512_castps512_ps256(x), w1, hi[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(acc[r], lo[r]);
    _mm256_storeu_ps(acc[r] + 16, hi[r]);
  }
}

// group_tile with AVX-512, up to 8 rows (not inlined into its AVX2 caller, as row_tiles_avx512).
__attribute__((noinline)) void group_tile_avx512(int64_t rows, const float* a, int64_t lda, const float* w,
                                                 int64_t k0, int64_t k1, float (*acc)[kPanel], bool first,
                                                 int64_t ahead) {
  switch (rows) {
    case 8: tile_avx512<8>(a, lda, w, k0, k1, acc, first, ahead); break;
    case 7: tile_avx512<7>(a, lda, w, k0, k1, acc, first, ahead); break;
    case 6: tile_avx512<6>(a, lda, w, k0, k1, acc, first, ahead); break;
    case 5: tile_avx512<5>(a, lda, w, k0, k1, acc, first, ahead); break;
    case 4: tile_avx512<4>(a, lda, w, k0, k1, acc, first, ahead); break;
    case 3: tile_avx512<3>(a, lda, w, k0, k1, acc, first, ahead); break;
    case 2: tile_avx512<2>(a, lda, w, k0, k1, acc, first, ahead); break;
    default: tile_avx512<1>(a, lda, w, k0, k1, acc, first, ahead); break;
  }
}

#pragma GCC pop_options

// A group of up to 4 rows against a panel over k0..k1 with AVX2 (tile): the rows from `rows`.
void group_tile(int64_t rows, const float* a, int64_t lda, const float* w, int64_t k0, int64_t k1,
                float (*acc)[kPanel], bool first, int64_t ahead) {
  switch (rows) {
    case 4: tile<4>(a, lda, w, k0, k1, acc, first, ahead); break;
    case 3: tile<3>(a, lda, w, k0, k1, acc, first, ahead); break;
    case 2: tile<2>(a, lda, w, k0, k1, acc, first, ahead); break;
    default: tile<1>(a, lda, w, k0, k1, acc, first, ahead); break;
  }
}

// Whether this CPU runs the AVX-512 paths: where it has AVX-512F and VL, unless INFERKILN_GEMM_AVX2=1
// keeps the AVX2 ones (so that the tests compare the two on such a CPU; cpu_gemm.fp32_isa).
bool has_avx512() {
  static const bool avx512 = [] {
    const char* keep_avx2 = std::getenv("INFERKILN_GEMM_AVX2");
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
           !(keep_avx2 && std::strcmp(keep_avx2, "1") == 0);
  }();
  return avx512;
}

// Panels the one-row AVX-512 tile reads at once off AMD's CPUs (row_tiles_avx512).
constexpr int64_t kStreams = 4;

// y = x W.T for one row, from each thread's contiguous share of the units (cpu_shares.h): a unit is
// a panel on AMD's CPUs and without AVX-512, kStreams adjacent panels on other AVX-512 CPUs
// (row_tiles_avx512 says why).
void one_row(const float* a, const float* w, int64_t K, int64_t panels, float* c, int64_t n) {
  static const bool amd = __builtin_cpu_is("amd");
  const int64_t stride = K * kPanel;
  if (!has_avx512()) {
    inferkiln::for_each_unit(panels, [&](int64_t p) { row_tile(a, w + p * stride, K, c, n, p); });
  } else if (amd) {
    inferkiln::for_each_unit(panels, [&](int64_t p) { row_tiles_avx512<true, 1>(a, w + p * stride, K, c, n, p); });
  } else {
    inferkiln::for_each_unit((panels + kStreams - 1) / kStreams, [&](int64_t u) {
      const int64_t p0 = u * kStreams;
      switch (std::min(kStreams, panels - p0)) {
        case 4: row_tiles_avx512<false, 4>(a, w + p0 * stride, K, c, n, p0); break;
        case 3: row_tiles_avx512<false, 3>(a, w + p0 * stride, K, c, n, p0); break;
        case 2: row_tiles_avx512<false, 2>(a, w + p0 * stride, K, c, n, p0); break;
        default: row_tiles_avx512<false, 1>(a, w + p0 * stride, K, c, n, p0); break;
      }
    });
  }
}

constexpr int64_t kGroups = 16;  // row groups a panel takes at once

// y = x W.T for M rows: threads take a panel at a time, as each is done; a panel takes up to
// kGroups groups of rows at once, 4 rows a group with AVX2 and 8 with AVX-512 (its 32 registers hold
// 8 rows' sums), so that up to 8 rows read W once, as one stream, prefetched ahead as one row's are.
void row_groups(const float* a, const float* w, int64_t K, int64_t M, int64_t panels, float* c, int64_t n) {
  const bool wide = has_avx512();
  const auto group = wide ? group_tile_avx512 : group_tile;
  const int64_t height = wide ? 8 : 4;
  // With two to four groups a panel is read from memory by the first group and from cache by the
  // rest, which leaves memory idle while they compute: in blocks of 32 k, the last group prefetches
  // the next block, so reading and computing overlap (8 and 16 rows of the 76M shape's matmuls
  // 1.1-1.3x faster with AVX2; one group, or many, ran as fast or faster unblocked).
  const int64_t block = (M > height && M <= 4 * height) ? 32 : K;
  const int64_t ahead = block < K ? block * kPanel : wide ? kAhead / int64_t(sizeof(float)) : 0;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(panels, at::get_num_threads()), 1, [&](int64_t, int64_t) {
    alignas(64) float acc[kGroups * 8][kPanel];
    for (int64_t p = next++; p < panels; p = next++) {
      const float* wp = w + p * K * kPanel;
      const int64_t cols = std::min(kPanel, n - p * kPanel);
      for (int64_t m0 = 0; m0 < M; m0 += height * kGroups) {
        const int64_t rows = std::min(M - m0, height * kGroups), groups = (rows + height - 1) / height;
        for (int64_t k0 = 0; k0 < K; k0 += block) {
          const int64_t k1 = std::min(K, k0 + block);
          for (int64_t g = 0; g < groups; ++g) {
            group(std::min(height, rows - height * g), a + (m0 + height * g) * K, K, wp, k0, k1, acc + height * g,
                  k0 == 0, g == groups - 1 ? ahead : 0);
          }
        }
        for (int64_t r = 0; r < rows; ++r) std::memcpy(c + (m0 + r) * n + p * kPanel, acc[r], cols * sizeof(float));
      }
    }
  });
}

}  // namespace

namespace inferkiln {

at::Tensor linear_fp32(const at::Tensor& input, const at::Tensor& packed, int64_t n,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(input.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat, "linear_fp32 takes float32");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous(), "W must come from cpu_gemm.pack");
  const int64_t K = input.size(-1), panels = packed.size(0);
  TORCH_CHECK(K > 0 && packed.size(1) == K && n > (panels - 1) * kPanel && n <= panels * kPanel,
              "W's shape does not match x");
  const at::Tensor x = input.contiguous();
  const int64_t M = x.numel() / K;
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  at::Tensor out = at::empty(sizes, x.options());
  const float* a = x.data_ptr<float>();
  const float* w = packed.data_ptr<float>();
  float* c = out.data_ptr<float>();
  if (M == 1) {
    one_row(a, w, K, panels, c, n);
  } else {
    row_groups(a, w, K, M, panels, c, n);
  }
  if (bias.has_value()) out.add_(*bias);
  return out;
}

}  // namespace inferkiln

// The schema is defined in cpu_gemm.py (so that TorchScript can compile a call to it where this
// library is not loaded); this registers the kernel.
TORCH_LIBRARY_IMPL(inferkiln, CPU, m) {
  m.impl("linear_fp32", &inferkiln::linear_fp32);
}
