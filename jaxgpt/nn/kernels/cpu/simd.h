// What the CPU kernels share (causal_attention.cc, layer_norm.cc, gelu.cc, paged_attention.cc,
// matvec.cc): 16-float vectors, a vector exp for x <= 0, and the split of a call's work over XLA's
// intra-op threads.
// kernels/native.py compiles each kernel with this header and keys its cache on both files.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace jaxgpt_simd {

namespace ffi = xla::ffi;

// Floats in one vector: one register. 16 with AVX-512; 8 elsewhere (AVX2, NEON pairs, the portable
// build): GCC lowers a vector wider than the target's registers through the stack (every scalar
// broadcast stored and reloaded), which made the AVX2 build of the attention kernel many times slower
// (docs/performance.md).
#ifdef __AVX512F__
constexpr int64_t kLanes = 16;
#else
constexpr int64_t kLanes = 8;
#endif

// Vector registers the target has, counted in V-sized vectors: they bound a kernel's register tile
// (accumulators + operands), past which GCC spills accumulators to the stack. AVX-512: 32 zmm; AVX2:
// 16 ymm; NEON: 32 q registers, two to a V; the x86 baseline (SSE2): 16 xmm, two to a V.
#if defined(__AVX512F__)
constexpr int kVRegs = 32;
#elif defined(__AVX__) || defined(__aarch64__)
constexpr int kVRegs = 16;
#else
constexpr int kVRegs = 8;
#endif

// Explicit vectors: GCC vectorised neither the attention softmax's exp loop nor its backward's, and
// its auto-vectorised dot loops reloaded their accumulators on every multiply-add. Loads and stores
// go through a may_alias, 4-byte-aligned vector type: the memcpy idiom made GCC bounce every loaded
// vector and every accumulator through the stack, several times slower for the scores (docs/performance.md).
typedef float V __attribute__((vector_size(4 * kLanes)));
typedef int32_t VI __attribute__((vector_size(4 * kLanes)));
// the same vector at any float's address (loads and stores through it are unaligned; may_alias: it
// reads what float stores wrote)
typedef float VU __attribute__((vector_size(4 * kLanes), aligned(4), may_alias));

typedef int32_t VIU __attribute__((vector_size(4 * kLanes), aligned(4), may_alias));

inline V Load(const float* p) { return *reinterpret_cast<const VU*>(p); }

inline VI LoadI(const int32_t* p) { return *reinterpret_cast<const VIU*>(p); }

inline void Store(float* p, V v) { *reinterpret_cast<VU*>(p) = v; }

inline V Splat(float x) { return V{} + x; }

inline float Sum(V v) {
  float s = 0.0f;
  for (int64_t l = 0; l < kLanes; ++l) s += v[l];
  return s;
}

// The same lanes summed as a tree: Sum is a 16-add dependency chain (kept: the other kernels'
// results depend on its order), paid once a key in paged_attention.cc's dot products.
inline float TreeSum(V v) {
  typedef float V8 __attribute__((vector_size(32)));
  typedef float V4 __attribute__((vector_size(16)));
#ifdef __AVX512F__
  const V8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
#else
  const V8 a = v;
#endif
  const V4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

inline float Max(V v) {
  float m = v[0];
  for (int64_t l = 1; l < kLanes; ++l) m = std::max(m, v[l]);
  return m;
}

// exp(x) for x <= 0, 16 lanes at once: std::exp is a libm call per element, which took most of the
// attention kernel's time. Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial for
// exp(r) (about 1 ulp), 2^n from the exponent bits. Below -87 -> 0.
inline V ExpNeg(V x) {
  const V xc = x < -87.0f ? Splat(-87.0f) : x;
  const V n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest: 1.5 * 2^23
  V r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  V p = Splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const VI bits = (__builtin_convertvector(n, VI) + 127) << 23;
  return x < -87.0f ? Splat(0.0f) : p * (V)bits;
}

// fn(part, lo, hi) over [0, items) in `parts` contiguous parts, run by the caller and by XLA's
// intra-op threads as they come free. The caller takes parts too and waits only for parts another
// thread has started: with several host devices sharing the pool, every pool thread may be a caller,
// so waiting for a task that was merely scheduled could deadlock. The parts are fixed, so a result
// summed per part does not depend on which thread ran which.
template <typename Fn>
void ParallelParts(ffi::ThreadPool& pool, int64_t parts, int64_t items, Fn fn) {
  if (parts <= 1) {
    fn(0, 0, items);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0}, done{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  auto st = std::make_shared<State>();
  auto work = [st, parts, items, &fn] {  // fn outlives every part: the caller waits for all of them
    for (int64_t c; (c = st->next.fetch_add(1)) < parts;) {
      fn(c, items * c / parts, items * (c + 1) / parts);
      if (st->done.fetch_add(1) + 1 == parts) {
        std::lock_guard<std::mutex> lock(st->mu);
        st->cv.notify_all();
      }
    }
  };
  for (int64_t q = 1; q < parts; ++q) pool.Schedule([work] { work(); });
  work();
  std::unique_lock<std::mutex> lock(st->mu);
  st->cv.wait(lock, [&] { return st->done.load() == parts; });
}

// One part per pool thread, and none smaller than min_items (not worth a thread hand-off).
inline int64_t Parts(ffi::ThreadPool& pool, int64_t items, int64_t min_items) {
  return std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), items / std::max<int64_t>(min_items, 1)));
}

}  // namespace jaxgpt_simd
