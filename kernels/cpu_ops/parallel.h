// Work split between threads at run time (guided scheduling), for loops whose units cost unevenly or
// run beside a neighbour.
//
// at::parallel_for gives each thread one fixed range. That is even only when every unit costs the
// same and every core runs at the same speed: decode attention's tasks are requests of different
// lengths, and beside a neighbour (another tenant of a shared VM, a compile, our own HTTP and
// detokenizer processes) one core often runs slower than the other for a while, and the fast thread
// waits at the region's end. Here threads take units from a shared counter, a share of what is left
// each time, so a thread that runs faster takes more: the gemm's linears at decode batch 64 on a
// 2-core EPYC took 1.2x less time (median) beside a busy process, 1.05x beside a nice-19 one.
// The units and what each writes are the same as with a fixed split: results do not depend on it.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace radixlm_parallel {

// Calls fn(u0, u1) on disjoint ranges covering [0, units), from every thread at::parallel_for
// starts; take(left) says how many units a thread takes next when `left` remain (at least 1).
template <typename Take, typename Fn>
inline void guided_for(int64_t units, Take&& take, Fn&& fn) {
  const int64_t threads = at::get_num_threads();
  if (threads == 1 || units <= 1 || at::in_parallel_region()) {
    if (units > 0) fn(int64_t{0}, units);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    int64_t u0 = next.load(std::memory_order_relaxed);
    while (u0 < units) {
      const int64_t n = std::max<int64_t>(1, take(units - u0));
      if (!next.compare_exchange_weak(u0, u0 + n, std::memory_order_relaxed)) continue;   // u0 reloaded
      fn(u0, std::min(units, u0 + n));
      u0 = next.load(std::memory_order_relaxed);
    }
  });
}

// The usual take: half of an even share of what is left, never under `least`.
inline int64_t guided_share(int64_t left, int64_t least) {
  return std::max<int64_t>(left / (2 * at::get_num_threads()), least);
}

}  // namespace radixlm_parallel
