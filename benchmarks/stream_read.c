/* The machine's read bandwidth as a plain reader sees it: benchmarks.engine_vs_vllm_cpu.read_bandwidth
 * takes the best of this and torch's sum.
 *
 *   stream_read GIB TRIES [4k]   prints "STREAMS BYTES_PER_SECOND" for 1, 2, 4 and 8 streams (the best of TRIES)
 *
 * GIB GiB of floats on 2 MB pages where Linux offers them (as the engine's weights are; `4k`: on
 * 4 KB pages), every core. Every thread reads its contiguous share as `streams` sequential streams
 * at once (adjacent chunks, 96 bytes from each in turn): a core with more reads in flight than one
 * stream gives it can read memory faster than torch's sum does (1.06-1.10x with 4 on a 2-core
 * EPYC). A process of its own, so that its OpenMP threads and torch's never share the cores. */
#define _GNU_SOURCE
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>

typedef float v8 __attribute__((vector_size(32))); /* AVX where the compiler targets it */

#define CHUNK 18432 /* floats a stream reads before the next chunk: 72 KB */
#define STEP 24     /* floats from each stream in turn */
#define HUGE (2UL << 20)

/* The sum of every float (in another order with several streams), so that no read is left out. */
static double read_all(const float* data, size_t count, int streams) {
  double total = 0;
#pragma omp parallel reduction(+ : total)
  {
    const size_t t = omp_get_thread_num(), threads = omp_get_num_threads(), span = (size_t)CHUNK * streams;
    const size_t begin = count * t / threads / 8 * 8, end = t + 1 == threads ? count : count * (t + 1) / threads / 8 * 8;
    size_t c = begin;
    for (; c + span <= end; c += span) {
      v8 acc[8] = {{0}}; /* a chunk's worth per lane: exact in float */
      for (size_t i = 0; i < CHUNK; i += STEP)
        for (int s = 0; s < streams; ++s) {
          const v8* p = (const v8*)(data + c + (size_t)s * CHUNK + i);
          acc[s] += p[0] + p[1] + p[2];
        }
      for (int s = 0; s < streams; ++s)
        for (int j = 0; j < 8; ++j) total += acc[s][j];
    }
    for (; c < end; ++c) total += data[c];
  }
  return total;
}

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

int main(int argc, char** argv) {
  const size_t bytes = (size_t)(argc > 1 ? atoi(argv[1]) : 1) << 30, count = bytes / sizeof(float);
  const int tries = argc > 2 ? atoi(argv[2]) : 3;
  char* mapping = mmap(NULL, bytes + HUGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mapping == MAP_FAILED) return perror("mmap"), 1;
  float* data = (float*)(((uintptr_t)mapping + HUGE - 1) & ~(HUGE - 1));
  if (argc < 4) madvise(data, bytes, MADV_HUGEPAGE); /* refused: 4 KB pages */
  for (size_t i = 0; i < count; ++i) data[i] = 1.0f;
  for (int streams = 1; streams <= 8; streams *= 2) {
    double best = 1e30;
    for (int i = 0; i < tries; ++i) {
      const double began = now();
      if (read_all(data, count, streams) != (double)count) return fprintf(stderr, "misread\n"), 1;
      const double took = now() - began;
      best = took < best ? took : best;
    }
    printf("%d %.0f\n", streams, bytes / best);
  }
  return 0;
}
