// The decoder layer's small ops fused, beside linear_fp32 (cpu_gemm.cpp) and linear_bf16
// (cpu_gemm_bf16.cpp) in the same library, for fp32 and for bf16 tensors:
//   rms_norm          RMSNorm of each row
//   add_rms_norm      the residual add and the next RMSNorm in one pass (hidden += y, in place)
//   silu_mul          the MLP's SiLU(gate) * up from the fused gate_up projection's output
//   rope_store        rotary positions on q's and k's heads (in place) and k, v into the paged cache
//   decode_attention  one query a sequence over its cache rows, read where they lie
//   decode_layers     every layer of a decode step (one token a sequence), these and the matmuls
//                     called from here: one call from the graph instead of ~15 a layer
//   decode_inputs     what decode_layers takes, from the step's token ids, positions and block
//                     tables: one call instead of the ~20 small aten ops the graph ran for them
// In bf16 each op rounds where the aten ops it replaces round (llama_graph.py: the norm computed
// in fp32, rounded, then times the weight; rotary's two products and their sum each rounded; the
// residual add rounded), and attention computes in fp32 from the bf16 cache, as the upcast SDPA
// did, rounding its output once. The arithmetic is fp32 throughout (AVX2: the library's ISA).
// Run as aten ops from TorchScript these were ~25 calls a layer (the norm alone 5 kernels, attention
// a gather of every key and value before SDPA); a c=1 decode step of the 76M shape spent 2-4 ms of
// its 13-16 ms in them on the 2-core EPYC. Why each exists: llama_graph.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <immintrin.h>

#include "cpu_math.h"
#include "cpu_shares.h"

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

namespace inferkiln {
at::Tensor linear_fp32(const at::Tensor& input, const at::Tensor& packed, int64_t n,
                       const c10::optional<at::Tensor>& bias);  // cpu_gemm.cpp
at::Tensor linear_bf16(const at::Tensor& input, const at::Tensor& packed, int64_t n,
                       const c10::optional<at::Tensor>& bias);  // cpu_gemm_bf16.cpp
}  // namespace inferkiln

namespace {

using at::BFloat16;

// 8 elements as fp32: bf16's 16 bits are the top half of its fp32
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const BFloat16* p) {
  const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
}

// x rounded to T (bf16: to nearest even, as aten rounds); the identity for fp32
template <typename T>
inline T rounded(float x) { return static_cast<T>(x); }

inline float horizontal_sum(__m256 v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pairs = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1)));
}

template <typename T>
inline float dot(const T* a, const T* b, int64_t n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(load8(a + i), load8(b + i), acc0);
    acc1 = _mm256_fmadd_ps(load8(a + i + 8), load8(b + i + 8), acc1);
  }
  for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(load8(a + i), load8(b + i), acc0);
  float sum = horizontal_sum(_mm256_add_ps(acc0, acc1));
  for (; i < n; ++i) sum += static_cast<float>(a[i]) * static_cast<float>(b[i]);
  return sum;
}

// The sums of four vectors' lanes, each added in one order: ((0+1)+(2+3))+((4+5)+(6+7)).
inline __m128 lane_sums(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1));
}

// x . rows[r] for R (1 or 4) rows at once: R independent chains where one waited on its last FMA,
// and four rows' sums reduced together. Each row's sum is added in the same order whatever R.
template <int R, typename T>
inline void dots(const T* x, const T* const* rows, int64_t n, float* out) {
  static_assert(R == 1 || R == 4, "one row or four");
  __m256 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 x0 = load8(x + i), x1 = load8(x + i + 8);
    for (int r = 0; r < R; ++r) {
      acc0[r] = _mm256_fmadd_ps(x0, load8(rows[r] + i), acc0[r]);
      acc1[r] = _mm256_fmadd_ps(x1, load8(rows[r] + i + 8), acc1[r]);
    }
  }
  for (; i + 8 <= n; i += 8) {
    const __m256 x0 = load8(x + i);
    for (int r = 0; r < R; ++r) acc0[r] = _mm256_fmadd_ps(x0, load8(rows[r] + i), acc0[r]);
  }
  __m256 v[4];
  for (int r = 0; r < 4; ++r) v[r] = _mm256_add_ps(acc0[r % R], acc1[r % R]);
  alignas(16) float sums[4];
  _mm_store_ps(sums, lane_sums(v[0], v[1], v[2], v[3]));
  for (int r = 0; r < R; ++r) {
    float sum = sums[r];
    for (int64_t k = i; k < n; ++k) sum += static_cast<float>(x[k]) * static_cast<float>(rows[r][k]);
    out[r] = sum;
  }
}

// Cache rows an attention task reads at a time, the next tile's asked for (inferkiln::prefetch): a
// cache row's run of heads starts where the row's block lies, which no prefetcher can guess at a
// block's end.
constexpr int64_t kTile = 32;

// y += a * x
template <typename T>
inline void axpy(float* y, float a, const T* x, int64_t n) {
  const __m256 av = _mm256_set1_ps(a);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(y + i, _mm256_fmadd_ps(av, load8(x + i), _mm256_loadu_ps(y + i)));
  }
  for (; i < n; ++i) y[i] += a * static_cast<float>(x[i]);
}

// y += p[j] * row_at(j) for j in [from, to), in order: axpy's floats, with each 64 floats of y held in
// registers through the positions instead of loaded and stored at each
template <typename RowAt>
inline void accumulate(float* y, const float* p, int64_t from, int64_t to, const RowAt& row_at, int64_t n) {
  int64_t i = 0;
  for (; i + 64 <= n; i += 64) {
    __m256 acc[8];
    for (int c = 0; c < 8; ++c) acc[c] = _mm256_loadu_ps(y + i + 8 * c);
    for (int64_t j = from; j < to; ++j) {
      const __m256 a = _mm256_set1_ps(p[j]);
      const auto* x = row_at(j) + i;
      for (int c = 0; c < 8; ++c) acc[c] = _mm256_fmadd_ps(a, load8(x + 8 * c), acc[c]);
    }
    for (int c = 0; c < 8; ++c) _mm256_storeu_ps(y + i + 8 * c, acc[c]);
  }
  if (i < n) {
    for (int64_t j = from; j < to; ++j) axpy(y + i, p[j], row_at(j) + i, n - i);
  }
}

// out = x / sqrt(mean(x^2) + eps) * w, as transformers' LlamaRMSNorm computes it in fp32 (in bf16:
// the normed row rounded before the weight multiplies it)
template <typename T>
inline void norm_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  const float inverse = 1.0f / std::sqrt(dot(x, x, n) / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) {
    out[i] = rounded<T>(static_cast<float>(w[i]) * static_cast<float>(rounded<T>(static_cast<float>(x[i]) * inverse)));
  }
}

// The element type of the fused ops: float32 or bfloat16, named by the tensor that decides it.
void check_type(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, name, " must be float32 or bfloat16");
}

void check_weight(const at::Tensor& weight, int64_t n, at::ScalarType type) {
  TORCH_CHECK(weight.scalar_type() == type && weight.is_contiguous() && weight.numel() == n,
              "weight must be [features], of x's dtype");
}

void check_cache(const at::Tensor& keys, const at::Tensor& values, at::ScalarType type) {
  TORCH_CHECK(keys.scalar_type() == type && keys.dim() == 3 && keys.is_contiguous() &&
                  values.sizes() == keys.sizes() && values.scalar_type() == type && values.is_contiguous(),
              "keys and values must be one layer's cache, of qkv's dtype");
}

void check_rows(const at::Tensor& t, const char* name) {
  check_type(t, name);
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, name, " must be [rows, features] with contiguous rows");
}

// body<float>() or body<BFloat16>() by `type` (checked by check_type)
template <typename F>
auto by_type(at::ScalarType type, const F& body) {
  return type == at::kFloat ? body(float{}) : body(BFloat16{});
}

// Rows are independent; threads take at least ~32K elements each (fewer: the team costs more than it saves).
template <typename F>
void each_row(int64_t rows, int64_t width, const F& body) {
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(1, width));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) body(r);
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, "x");
  const int64_t n = x.size(1);
  check_weight(weight, n, x.scalar_type());
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  by_type(x.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    const T *a = x.data_ptr<T>(), *w = weight.data_ptr<T>();
    T* c = out.data_ptr<T>();
    each_row(x.size(0), n, [&](int64_t r) { norm_row(a + r * x.stride(0), w, c + r * n, n, static_cast<float>(eps)); });
  });
  return out;
}

at::Tensor add_rms_norm(at::Tensor& hidden, const at::Tensor& y, const at::Tensor& weight, double eps) {
  check_rows(hidden, "hidden");
  check_rows(y, "y");
  TORCH_CHECK(y.sizes() == hidden.sizes() && y.scalar_type() == hidden.scalar_type(),
              "y must have hidden's shape and dtype");
  const int64_t n = hidden.size(1);
  check_weight(weight, n, hidden.scalar_type());
  at::Tensor out = at::empty({hidden.size(0), n}, hidden.options());
  by_type(hidden.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    T* h = hidden.data_ptr<T>();
    const T *b = y.data_ptr<T>(), *w = weight.data_ptr<T>();
    T* c = out.data_ptr<T>();
    each_row(hidden.size(0), n, [&](int64_t r) {
      T* row = h + r * hidden.stride(0);
      const T* add = b + r * y.stride(0);
      for (int64_t i = 0; i < n; ++i) row[i] = rounded<T>(static_cast<float>(row[i]) + static_cast<float>(add[i]));
      norm_row(row, w, c + r * n, n, static_cast<float>(eps));
    });
  });
  return out;
}

// x / (1 + e^-x), 8 at a time, from e^-|x| (exp8 takes x <= 0): x / (1 + t) where x >= 0, and
// x t / (1 + t) below, where t = e^x. Within a few ulp of aten's silu.
inline __m256 silu8(__m256 x) {
  const __m256 t = inferkiln::exp8(_mm256_or_ps(x, _mm256_set1_ps(-0.0f)));  // the sign bit set: -|x|
  const __m256 negative = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ);
  return _mm256_div_ps(_mm256_blendv_ps(x, _mm256_mul_ps(x, t), negative), _mm256_add_ps(t, _mm256_set1_ps(1.0f)));
}

inline float silu1(float x) {
  const float t = inferkiln::exp1(-std::fabs(x));
  return (x < 0.0f ? x * t : x) / (1.0f + t);
}

// 8 floats as T at p (bf16: each rounded to nearest even, as `rounded`)
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(BFloat16* p, __m256 v) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, v);
  for (int i = 0; i < 8; ++i) p[i] = rounded<BFloat16>(lanes[i]);
}

// out = silu(gate) * up for gate_up = [gate | up] a row, rounded where aten's two ops round (bf16:
// the SiLU, then the product). Why one op: aten's silu and mul_ after a matmul took 47 us a layer in
// a c=1 step of the 76M shape on the 2-core Xeon, where the same ops on the same data at once after
// took 5: the weights' stream had evicted aten's code and tables, and this runs on a few lines.
at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up's width must be even: [gate | up]");
  const int64_t half = gate_up.size(1) / 2;
  at::Tensor out = at::empty({gate_up.size(0), half}, gate_up.options());
  by_type(gate_up.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    const T* in = gate_up.data_ptr<T>();
    T* o = out.data_ptr<T>();
    each_row(gate_up.size(0), half, [&](int64_t r) {
      const T *gate = in + r * gate_up.stride(0), *up = gate + half;
      T* row = o + r * half;
      int64_t i = 0;
      for (; i + 8 <= half; i += 8) {
        alignas(32) T activated[8];
        store8(activated, silu8(load8(gate + i)));
        store8(row + i, _mm256_mul_ps(load8(activated), load8(up + i)));
      }
      for (; i < half; ++i) {
        row[i] = rounded<T>(static_cast<float>(rounded<T>(silu1(gate[i]))) * static_cast<float>(up[i]));
      }
    });
  });
  return out;
}

// One head in place: x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x[half:], x[:half]).
template <typename T>
inline void rotate_head(T* x, const T* cos, const T* sin, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float first = x[i], second = x[i + half];
    x[i] = rounded<T>(static_cast<float>(rounded<T>(first * static_cast<float>(cos[i]))) -
                      static_cast<float>(rounded<T>(second * static_cast<float>(sin[i]))));
    x[i + half] = rounded<T>(static_cast<float>(rounded<T>(second * static_cast<float>(cos[i + half]))) +
                             static_cast<float>(rounded<T>(first * static_cast<float>(sin[i + half]))));
  }
}

void rope_store(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t kv_heads,
                at::Tensor& keys, at::Tensor& values, const at::Tensor& rows) {
  check_rows(qkv, "qkv");
  const at::ScalarType type = qkv.scalar_type();
  check_cache(keys, values, type);
  const int64_t tokens = qkv.size(0), dim = keys.size(2);
  TORCH_CHECK(keys.size(1) == kv_heads && qkv.size(1) == (heads + 2 * kv_heads) * dim,
              "qkv's width must be (heads + 2 kv_heads) x head_dim");
  TORCH_CHECK(cos.scalar_type() == type && sin.scalar_type() == type && cos.size(0) == tokens &&
              sin.size(0) == tokens && cos.size(-1) == dim && sin.size(-1) == dim && cos.stride(-1) == 1 &&
              sin.stride(-1) == 1, "cos and sin must be [tokens, ..., head_dim], of qkv's dtype");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.numel() == tokens,
              "rows must be [tokens] int64");
  const at::Tensor where = rows.contiguous();
  const int64_t* row = where.data_ptr<int64_t>();
  const int64_t cache_rows = keys.size(0), kv_width = kv_heads * dim;
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(row[t] >= 0 && row[t] < cache_rows, "a cache row is out of range");
  }
  by_type(type, [&](auto zero) {
    using T = decltype(zero);
    T* base = qkv.data_ptr<T>();
    T *k_cache = keys.data_ptr<T>(), *v_cache = values.data_ptr<T>();
    each_row(tokens, qkv.size(1), [&](int64_t t) {
      T* x = base + t * qkv.stride(0);
      const T *c = cos.data_ptr<T>() + t * cos.stride(0), *s = sin.data_ptr<T>() + t * sin.stride(0);
      for (int64_t h = 0; h < heads + kv_heads; ++h) rotate_head(x + h * dim, c, s, dim);
      std::copy(x + heads * dim, x + heads * dim + kv_width, k_cache + row[t] * kv_width);
      std::copy(x + heads * dim + kv_width, x + heads * dim + 2 * kv_width, v_cache + row[t] * kv_width);
    });
  });
}

// Rows that attend over the same cache rows are read together. The runner splits a chunk of
// 2..SPLIT_WIDTH tokens (a short prompt after a cached prefix, an n-gram draft's verify) into rows
// of one token, side by side at consecutive positions over one block table; read a row at a time,
// an 8-token chunk after a 480-token prefix read its cache 8 times over. A group is a run of
// adjacent rows, at most kGroup, each at or past the first's position, whose cache rows agree up to
// it: in one task, a tile the first row reads is in cache for the others. Each row still reads its
// own cache rows to its own position, so a grouping changes where data is found, never a result.
constexpr int64_t kGroup = 8;
constexpr size_t kKeptScores = size_t(1) << 22;  // the most scores (16 MB) a thread keeps between tasks

// The first row of each group, then `count`.
std::vector<int64_t> group_starts(const int64_t* row, const int64_t* position, int64_t count, int64_t span) {
  std::vector<int64_t> starts;
  for (int64_t s = 0; s < count; ++s) {
    const int64_t g = starts.empty() ? -1 : starts.back();
    const bool joins = g >= 0 && s - g < kGroup && position[s] >= position[g] &&
                       std::equal(row + g * span, row + g * span + position[g] + 1, row + s * span);
    if (!joins) starts.push_back(s);
  }
  starts.push_back(count);
  return starts;
}

// A task: a group's rows over a run of KV heads.
struct AttentionTask {
  int64_t first, members, first_kv, last_kv;
};

// A task is a group's run of KV heads: a cache row holds every KV head side by side, and a block's
// rows lie one after another, so a task's tile of positions is a few long runs of memory (asked for a
// tile ahead), where a head at a time took 256 bytes of every 3 KB row (the 76M shape) and a c=1 step's
// attention waited on memory. A group is split into as many runs as there are threads for each group
// (c=1), or as it has rows, at most one a KV head; the threads take the tasks as cpu_shares.h shares
// units, so a preempted thread's tasks are taken by the other.
std::vector<AttentionTask> attention_tasks(const std::vector<int64_t>& starts, int64_t kv_heads) {
  const int64_t groups = static_cast<int64_t>(starts.size()) - 1;
  const int64_t per_group = std::max<int64_t>(1, at::get_num_threads() / groups);
  std::vector<AttentionTask> tasks;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t members = starts[g + 1] - starts[g];
    const int64_t runs = std::min(kv_heads, std::max(per_group, members));
    const int64_t per_run = (kv_heads + runs - 1) / runs;
    for (int64_t kv = 0; kv < kv_heads; kv += per_run) {
      tasks.push_back({starts[g], members, kv, std::min(kv_heads, kv + per_run)});
    }
  }
  return tasks;
}

// The attention of sequences s (one query each) over their cache rows, into `o` [count, heads*dim];
// sums in fp32, each head's output rounded to T once. A task takes its positions a tile at a time,
// and each (row, head) lane works through the tile with independent chains: four keys' dots at once
// (dots), the weighted values summed in registers (accumulate), the softmax's exponentials 8 at a
// time (exp8). Each lane's arithmetic is the same, in the same order, however rows are grouped and
// tasks split: the same floats as a row alone. On the 76M shape in bf16 (2 threads, per layer) a
// decode at 489 positions took 56 against 88 us before, 4 decodes 184 against 282, a decode and
// three 8-token chunks after 480 cached positions 870 against 1596 (std::max_element had kept its
// running maximum in memory, and std::exp was one call a score).
template <typename T>
void attend(const T* q, int64_t q_stride, const T* k, const T* v, T* o, const int64_t* row, const int64_t* position,
            int64_t count, int64_t span, int64_t heads, int64_t kv_heads, int64_t dim, float scale) {
  if (count == 0) return;
  const int64_t group = heads / kv_heads, kv_width = kv_heads * dim;
  const std::vector<AttentionTask> tasks = attention_tasks(group_starts(row, position, count, span), kv_heads);
  inferkiln::for_each_unit(static_cast<int64_t>(tasks.size()), [&](int64_t index) {
    const AttentionTask& task = tasks[index];
    const int64_t first_head = task.first_kv * group, task_heads = (task.last_kv - task.first_kv) * group;
    const int64_t run_width = (task.last_kv - task.first_kv) * dim, lanes = task.members * task_heads;
    const int64_t* positions = position + task.first;
    const int64_t longest = *std::max_element(positions, positions + task.members) + 1;
    thread_local std::vector<float> scores, totals, sums;  // lane m * task_heads + h: row m of the task, head h
    scores.resize(lanes * span);
    totals.resize(lanes);
    sums.assign(lanes * dim, 0.0f);
    // head h's KV head in position j's cache row, as row m of the task finds it
    auto at = [&](const T* cache, int64_t m, int64_t j, int64_t h) {
      return cache + row[(task.first + m) * span + j] * kv_width + (task.first_kv + h / group) * dim;
    };
    auto prefetch_tile = [&](const T* cache, int64_t from) {  // the first row's: the rows every row reads
      for (int64_t j = from; j < std::min(from + kTile, positions[0] + 1); ++j) {
        inferkiln::prefetch<_MM_HINT_T1>(at(cache, 0, j, 0), run_width);
      }
    };
    for (int64_t from = 0; from < longest; from += kTile) {
      prefetch_tile(k, from + kTile);
      for (int64_t m = 0; m < task.members; ++m) {
        const int64_t to = std::min(from + kTile, positions[m] + 1);
        for (int64_t h = 0; h < task_heads; ++h) {
          const T* query = q + (task.first + m) * q_stride + (first_head + h) * dim;
          float* lane = scores.data() + (m * task_heads + h) * span;
          int64_t j = from;
          for (; j + 4 <= to; j += 4) {
            const T* keys[4] = {at(k, m, j, h), at(k, m, j + 1, h), at(k, m, j + 2, h), at(k, m, j + 3, h)};
            dots<4>(query, keys, dim, lane + j);
          }
          for (; j < to; ++j) {
            const T* key = at(k, m, j, h);
            dots<1>(query, &key, dim, lane + j);
          }
          for (j = from; j < to; ++j) lane[j] *= scale;
        }
      }
    }
    for (int64_t m = 0; m < task.members; ++m) {
      const int64_t length = positions[m] + 1;
      for (int64_t h = 0; h < task_heads; ++h) {
        float* lane = scores.data() + (m * task_heads + h) * span;
        const float top = inferkiln::row_max(lane, length);
        float total = 0.0f;  // in a register: summed in memory, each add waited on the last one's store
        int64_t j = 0;
        for (; j + 8 <= length; j += 8) {
          _mm256_storeu_ps(lane + j, inferkiln::exp8(_mm256_sub_ps(_mm256_loadu_ps(lane + j), _mm256_set1_ps(top))));
          for (int i = 0; i < 8; ++i) total += lane[j + i];
        }
        for (; j < length; ++j) {
          lane[j] = inferkiln::exp1(lane[j] - top);
          total += lane[j];
        }
        totals[m * task_heads + h] = total;
      }
    }
    for (int64_t from = 0; from < longest; from += kTile) {
      prefetch_tile(v, from + kTile);
      for (int64_t m = 0; m < task.members; ++m) {
        const int64_t to = std::min(from + kTile, positions[m] + 1);
        for (int64_t h = 0; h < task_heads && from < to; ++h) {
          const int64_t lane = m * task_heads + h;
          accumulate(sums.data() + lane * dim, scores.data() + lane * span, from, to,
                     [&](int64_t j) { return at(v, m, j, h); }, dim);
        }
      }
    }
    for (int64_t m = 0; m < task.members; ++m) {
      T* result = o + (task.first + m) * heads * dim + first_head * dim;
      for (int64_t h = 0; h < task_heads; ++h) {
        const int64_t lane = m * task_heads + h;
        for (int64_t i = 0; i < dim; ++i) result[h * dim + i] = rounded<T>(sums[lane * dim + i] / totals[lane]);
      }
    }
    if (scores.capacity() > kKeptScores) std::vector<float>().swap(scores);  // a long context's, not kept
  });
}

at::Tensor decode_attention(const at::Tensor& qkv, int64_t first, int64_t heads, const at::Tensor& keys,
                            const at::Tensor& values, const at::Tensor& rows, const at::Tensor& positions,
                            double scale) {
  check_rows(qkv, "qkv");
  check_cache(keys, values, qkv.scalar_type());
  const int64_t kv_heads = keys.size(1), dim = keys.size(2);
  TORCH_CHECK(heads % kv_heads == 0 && qkv.size(1) >= heads * dim,
              "q's heads must be a multiple of the cache's");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 2 && positions.scalar_type() == at::kLong &&
              positions.numel() == rows.size(0), "rows must be [sequences, span] and positions [sequences], int64");
  const int64_t count = rows.size(0), span = rows.size(1), cache_rows = keys.size(0);
  TORCH_CHECK(first >= 0 && first + count <= qkv.size(0), "the sequences' queries must be rows of qkv");
  const at::Tensor table = rows.contiguous(), where = positions.contiguous();
  const int64_t *row = table.data_ptr<int64_t>(), *position = where.data_ptr<int64_t>();
  for (int64_t s = 0; s < count; ++s) {
    TORCH_CHECK(position[s] >= 0 && position[s] < span, "a position lies beyond its rows");
    for (int64_t j = 0; j <= position[s]; ++j) {
      TORCH_CHECK(row[s * span + j] >= 0 && row[s * span + j] < cache_rows, "a cache row is out of range");
    }
  }
  at::Tensor out = at::empty({count, heads * dim}, qkv.options());
  by_type(qkv.scalar_type(), [&](auto zero) {
    using T = decltype(zero);
    attend(qkv.data_ptr<T>() + first * qkv.stride(0), qkv.stride(0), keys.data_ptr<T>(), values.data_ptr<T>(),
           out.data_ptr<T>(), row, position, count, span, heads, kv_heads, dim, static_cast<float>(scale));
  });
  return out;
}


// The decoder layers for one token a sequence (llama_graph.LlamaGraph._layers' fused decode, the
// same kernels in the same order, so the same floats): `hidden` [sequences, hidden] is the
// embedding, added to in place; returns the final norm of the last layer's output. Weights are 4
// a layer (qkv, o, gate_up, down) in panels of hidden's dtype (fp32's or bf16's), norms 2 a layer;
// keys/values [layers, rows, kv_heads, head_dim]; `written` the cache row of each new token, `rows`
// [sequences, span] and `positions` as decode_attention takes them. The activation is SiLU (the
// caller's check).
at::Tensor decode_layers(at::Tensor& hidden, at::TensorList weights, at::IntArrayRef columns,
                              const c10::List<c10::optional<at::Tensor>>& biases, at::TensorList norms,
                              const at::Tensor& final_norm, double eps, at::Tensor& keys, at::Tensor& values,
                              const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& written,
                              const at::Tensor& rows, const at::Tensor& positions, int64_t heads, double scale) {
  const int64_t layers = keys.size(0);
  TORCH_CHECK(keys.dim() == 4 && values.sizes() == keys.sizes(), "keys and values must be [layers, rows, kv_heads, dim]");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == 4 * layers && static_cast<int64_t>(columns.size()) == 4 * layers &&
                  static_cast<int64_t>(biases.size()) == 4 * layers && static_cast<int64_t>(norms.size()) == 2 * layers,
              "4 weights and 2 norms a layer");
  check_type(hidden, "hidden");
  const int64_t kv_heads = keys.size(2);
  const bool bf16 = hidden.scalar_type() == at::kBFloat16;
  auto linear = [&](const at::Tensor& x, int64_t w) {
    return bf16 ? inferkiln::linear_bf16(x, weights[w], columns[w], biases.get(w))
                : inferkiln::linear_fp32(x, weights[w], columns[w], biases.get(w));
  };
  at::Tensor x = rms_norm(hidden, norms[0], eps);
  for (int64_t layer = 0; layer < layers; ++layer) {
    const int64_t w = 4 * layer;
    at::Tensor k = keys.select(0, layer), v = values.select(0, layer);
    at::Tensor qkv = linear(x, w);
    rope_store(qkv, cos, sin, heads, kv_heads, k, v, written);
    x = add_rms_norm(hidden, linear(decode_attention(qkv, 0, heads, k, v, rows, positions, scale), w + 1),
                          norms[2 * layer + 1], eps);
    x = add_rms_norm(hidden, linear(silu_mul(linear(x, w + 2)), w + 3),
                     layer + 1 < layers ? norms[2 * layer + 2] : final_norm, eps);
  }
  return x;
}

// decode_layers' inputs for one token a sequence: the tokens' embeddings [sequences, hidden] (a copy,
// added to in place by decode_layers), cos and sin at each position [sequences, 1, head_dim], the
// cache row each new token is written to [sequences], every sequence's cache rows of positions
// 0..max(positions) [sequences, span] (rows past a sequence's own position are never read) and the
// positions [sequences, 1]. `tables` holds each sequence's block table, right-padded to `blocks`.
// The same integers and copies as the graph's aten ops made (llama_graph.LlamaGraph.forward).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> decode_inputs(
    at::IntArrayRef token_ids, at::IntArrayRef positions, at::IntArrayRef tables, int64_t blocks, int64_t block_size,
    const at::Tensor& embed, const at::Tensor& cos_table, const at::Tensor& sin_table) {
  const int64_t count = static_cast<int64_t>(token_ids.size());
  TORCH_CHECK(count > 0 && static_cast<int64_t>(positions.size()) == count && blocks > 0 && block_size > 0 &&
                  static_cast<int64_t>(tables.size()) == count * blocks,
              "one position and one block table of `blocks` entries a token");
  const auto [low, high] = std::minmax_element(positions.begin(), positions.end());
  const int64_t span = *high + 1;
  TORCH_CHECK(*low >= 0 && span <= blocks * block_size, "a position lies beyond its block table");
  const auto longs = at::TensorOptions().dtype(at::kLong);
  at::Tensor rows = at::empty({count, span}, longs), written = at::empty({count}, longs);
  int64_t *row = rows.data_ptr<int64_t>(), *write = written.data_ptr<int64_t>();
  for (int64_t s = 0; s < count; ++s) {
    const int64_t* table = tables.data() + s * blocks;
    for (int64_t j = 0; j < span; ++j) row[s * span + j] = table[j / block_size] * block_size + j % block_size;
    write[s] = row[s * span + positions[s]];
  }
  const at::Tensor where = at::tensor(positions, longs);
  return {embed.index_select(0, at::tensor(token_ids, longs)), cos_table.index_select(0, where).unsqueeze(1),
          sin_table.index_select(0, where).unsqueeze(1), written, rows, where.view({count, 1})};
}

}  // namespace

// The schemas are defined in cpu_gemm.py, as linear_fp32's is.
TORCH_LIBRARY_IMPL(inferkiln, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_mul", &silu_mul);
  m.impl("rope_store", &rope_store);
  m.impl("decode_attention", &decode_attention);
  m.impl("decode_layers", &decode_layers);
  m.impl("decode_inputs", &decode_inputs);
}
