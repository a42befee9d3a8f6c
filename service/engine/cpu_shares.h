// How the matmul kernels (cpu_gemm.cpp, cpu_gemm_bf16.cpp) split a matmul's units of work (panels,
// or groups of adjacent panels) between torch's OpenMP threads: each thread takes a contiguous share
// of the units from its front, and a thread whose share is done takes the other shares' units from
// their backs.
//
// Why: a thread that reads a contiguous run of panels reads one long stream of memory, which the
// hardware prefetchers follow. Threads that took the next free unit from one shared counter read
// interleaved units, a jump in each thread's stream at every unit. On a 2-core Zen 5 EPYC whose
// memory moves between two states (about 35 and 60-70 GB/s to a reader on both vCPUs), the 76M
// shape's 40 one-row fp32 matmuls read at 50-51 GB/s in the fast state with the shared counter and
// 4-panel units, at 58-59 with these shares of single panels, and at the same ~35 in the slow state
// (in alternating processes). A fixed split alone reads as fast but waits for a preempted thread: in
// a standalone probe with a busy loop taking 30% of a core beside it, the fixed split read 24-45
// GB/s, the shared counter 30-37, these shares 44-46.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace inferkiln {

// A thread's units [front, back), both in one word so that its owner and a thief never take the
// same unit; on a cache line of its own.
struct alignas(64) Share {
  std::atomic<uint64_t> ends{0};

  static uint64_t pack(int64_t front, int64_t back) { return (uint64_t(front) << 32) | uint64_t(back); }

  // The next unit from the front (owner) or the back (thief), or -1 once the share is empty.
  int64_t take(bool from_front) {
    uint64_t seen = ends.load(std::memory_order_relaxed);
    while (true) {
      const int64_t front = int64_t(seen >> 32), back = int64_t(seen & 0xffffffffu);
      if (front >= back) return -1;
      const uint64_t next = from_front ? pack(front + 1, back) : pack(front, back - 1);
      if (ends.compare_exchange_weak(seen, next, std::memory_order_relaxed)) return from_front ? front : back - 1;
    }
  }
};

// Calls run(unit) once for every unit in [0, units), on torch's threads, as above.
template <typename Run>
void for_each_unit(int64_t units, const Run& run) {
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(units, at::get_num_threads()));
  std::vector<Share> shares(threads);
  for (int64_t t = 0; t < threads; ++t) shares[t].ends.store(Share::pack(units * t / threads, units * (t + 1) / threads));
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t u = shares[t].take(true); u >= 0; u = shares[t].take(true)) run(u);
      for (int64_t o = 1; o < threads; ++o) {
        Share& other = shares[(t + o) % threads];
        for (int64_t u = other.take(false); u >= 0; u = other.take(false)) run(u);
      }
    }
  });
}

}  // namespace inferkiln
