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
// Where the CPU has AMX the same panels are multiplied on its tiles instead, whatever the rows: 16
// pairs of k of a panel are one B tile as they lie (16 rows of 64 bytes), up to 16 rows of x's 32 k
// one A tile, and a block of up to 32 rows against 2 adjacent panels is 4 tiles of sums, all in
// AMX's 8 tile registers. On a 2-core Xeon with AMX the 76M shape's 40 matmuls took
// 7.6-8.3 ms with AMX against 8.0-8.2 on AVX-512 at one row, 5.8-7.8 against 11.9-12.7 at 8, and
// 48-53 ms against 401-443 at 480 (a prompt's prefill; oneDNN's AMX kernels 59 ms): in process,
// alternating processes. An output rounds differently from AVX-512's in about one of 10^4, by a
// bf16 step (tdpbf16ps does not round a pair's products as vdpbf16ps does). AMX needs K in whole
// tiles (32 k, as real models' are); other K keep AVX-512.
// Why not oneDNN: see cpu_gemm.py.
//
// The kernel's functions are compiled for AVX-512 (the pragma below), the rest of the library is
// not: the op checks the CPU before it calls them. The headers come first, so that none of their
// inline functions is compiled for AVX-512 here.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "cpu_math.h"
#include "cpu_shares.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace {

constexpr int64_t kColumns = 16;  // output columns a panel
constexpr int64_t kStreams = 4;   // panels a tile reads at once
constexpr int64_t kRows = 4;      // rows of x a tile takes
constexpr int64_t kTile = 16;     // rows of an AMX tile: of x, or pairs of k of a panel

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

// A panel's bias as 16 fp32 (zeros without one), `mask` its columns that exist.
inline __m512 panel_bias(const Matmul& mm, int64_t column, __mmask16 mask) {
  if (!mm.bias) return _mm512_setzero_ps();
  // bf16 to fp32: the 16 bits above 16 zero bits
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, mm.bias + column));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

inline __mmask16 panel_mask(const Matmul& mm, int64_t column) {
  return static_cast<__mmask16>((1u << std::min<int64_t>(kColumns, mm.n - column)) - 1u);
}

// One row's 16 sums of a panel, with the bias, rounded once to bf16 into out.
inline void store_row(const Matmul& mm, int64_t row, int64_t column, __mmask16 mask, __m512 sums, __m512 bias) {
  const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_add_ps(sums, bias));
  _mm256_mask_storeu_epi16(mm.out + row * mm.n + column, mask, (__m256i)rounded);
}

// Rows m0..m0+rows-1 of a block's sums, [32][32] (its `count` panels from p0 side by side), into out.
inline void store_block(const Matmul& mm, int64_t m0, int64_t rows, int64_t p0, int count, const float* sums) {
  for (int s = 0; s < count; ++s) {
    const int64_t column = (p0 + s) * kColumns;
    const __mmask16 mask = panel_mask(mm, column);
    const __m512 bias = panel_bias(mm, column, mask);
    for (int64_t r = 0; r < rows; ++r) store_row(mm, m0 + r, column, mask, _mm512_load_ps(sums + r * 32 + s * kColumns), bias);
  }
}

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
    const __mmask16 mask = panel_mask(mm, column);
    const __m512 bias = panel_bias(mm, column, mask);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) store_row(mm, m0 + r, column, mask, sums[r][s], bias);
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

// AMX: tiles 0-3 hold the sums (rows 0-15 and 16-31 of a block against its first and second
// panel), 4 and 5 those rows of x, 6 and 7 the two panels' pairs of k.
struct alignas(64) TileConfig {  // what ldtilecfg reads (palette 1)
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes[16] = {};
  uint8_t rows[16] = {};
};

// A block of `rows` rows (up to 32): tiles of 64-byte rows, the second half's left unconfigured
// where the block has none.
TileConfig tile_config(int64_t rows) {
  TileConfig config;
  const auto first = static_cast<uint8_t>(std::min(rows, kTile)), second = static_cast<uint8_t>(rows - first);
  for (int t = 0; t < 8; ++t) config.bytes[t] = 64;
  config.rows[0] = config.rows[1] = config.rows[4] = first;
  config.rows[2] = config.rows[3] = config.rows[5] = second;
  config.rows[6] = config.rows[7] = kTile;
  if (!second) config.bytes[2] = config.bytes[3] = config.bytes[5] = 0;
  return config;
}

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16")

// Pairs of k of a panel that amx_block prefetches ahead of each tile of W it loads, where it reads
// W once: 3 tiles. A unit's 2 streams start anew every 2 panels (49 KB at K 768), and the hardware's
// prefetchers take a while to follow each one. A TorchEngine in process (76M bf16, c=1, alternating
// processes) decoded at 4.1-4.2 ms a token against 4.5-4.9 without (3 and 5 rounds; 1, 2, 4 and 8
// tiles ahead: 4.3-4.7, 4.2-4.3, 4.2-4.3, 4.2-4.4).
constexpr int64_t kAmxAhead = 3 * kTile;

// Rows m0..m0+31 (`Two` halves: more than 16) against panels p0 and, `Both`, p0+1, every pair of k,
// the sums into `sums` [32][32].
template <bool Two, bool Both>
void amx_block(const Matmul& mm, int64_t m0, int64_t p0, float* sums) {
  const int64_t x_stride = mm.pairs * 4, w_stride = mm.pairs * kColumns * 4;  // bytes
  const char* x = reinterpret_cast<const char*>(mm.x) + m0 * x_stride;
  const char* w = reinterpret_cast<const char*>(mm.w) + p0 * w_stride;
  _tile_zero(0);
  if (Both) _tile_zero(1);
  if (Two) _tile_zero(2);
  if (Two && Both) _tile_zero(3);
  for (int64_t k = 0; k < mm.pairs; k += kTile) {
    if (mm.M <= 2 * kTile) {  // one block of rows: each line of W is read once, from memory
      const char* ahead = w + (k + kAmxAhead) * 64;  // prefetches never fault
      inferkiln::prefetch<_MM_HINT_T0>(ahead, kTile * 64);
      if (Both) inferkiln::prefetch<_MM_HINT_T0>(ahead + w_stride, kTile * 64);
    }
    _tile_loadd(4, x + k * 4, x_stride);
    _tile_loadd(6, w + k * 64, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (Both) {
      _tile_loadd(7, w + w_stride + k * 64, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (Two) {
      _tile_loadd(5, x + kTile * x_stride + k * 4, x_stride);
      _tile_dpbf16ps(2, 5, 6);
      if (Both) _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, sums, 128);
  if (Both) _tile_stored(1, sums + kColumns, 128);
  if (Two) _tile_stored(2, sums + kTile * 32, 128);
  if (Two && Both) _tile_stored(3, sums + kTile * 32 + kColumns, 128);
}

// Panels p0 and p0+1 (p0 alone at the end) for every row of x, in blocks of 32 rows.
__attribute__((noinline)) void amx_panel_pair(const Matmul& mm, int64_t p0) {
  const bool both = p0 + 1 < mm.panels;
  alignas(64) float sums[32 * 32];
  int64_t configured = 0;
  for (int64_t m0 = 0; m0 < mm.M; m0 += 2 * kTile) {
    const int64_t rows = std::min(2 * kTile, mm.M - m0);
    if (rows != configured) {  // the last block may be smaller
      const TileConfig config = tile_config(rows);
      _tile_loadconfig(&config);
      configured = rows;
    }
    if (rows > kTile) {
      both ? amx_block<true, true>(mm, m0, p0, sums) : amx_block<true, false>(mm, m0, p0, sums);
    } else {
      both ? amx_block<false, true>(mm, m0, p0, sums) : amx_block<false, false>(mm, m0, p0, sums);
    }
    store_block(mm, m0, rows, p0, both ? 2 : 1, sums);
  }
  _tile_release();
}

#pragma GCC pop_options

#pragma GCC pop_options

// Whether the AMX path runs here: a CPU with AMX-BF16, Linux's leave to use its tile data (asked
// for once a process), and not INFERKILN_GEMM_AMX=0, which keeps AVX-512 (for comparisons).
bool amx_ready() {
  static const bool ready = [] {
    constexpr int kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    const char* amx = std::getenv("INFERKILN_GEMM_AMX");
    return __builtin_cpu_supports("amx-tile") && __builtin_cpu_supports("amx-bf16") &&
           !(amx && std::strcmp(amx, "0") == 0) && syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return ready;
}

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
  if (pairs % kTile == 0 && amx_ready()) {
    inferkiln::for_each_unit((panels + 1) / 2, [&](int64_t u) { amx_panel_pair(mm, u * 2); });
    return out;
  }
  inferkiln::for_each_unit((panels + kStreams - 1) / kStreams, [&](int64_t u) { panel_group(mm, u * kStreams); });
  return out;
}

}  // namespace inferkiln

// The schema is defined in cpu_gemm.py, as linear_fp32's is.
TORCH_LIBRARY_IMPL(inferkiln, CPU, m) {
  m.impl("linear_bf16", &inferkiln::linear_bf16);
}

TORCH_LIBRARY_IMPL(inferkiln, CompositeExplicitAutograd, m) {  // no tensor to dispatch on
  m.impl("bf16_amx", [] { return amx_ready(); });
}
