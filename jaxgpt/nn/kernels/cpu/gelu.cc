// Exact GELU for the CPU, forward and backward, as XLA FFI custom calls (kernels/gelu_ffi.py
// builds, loads and differentiates them).
//
// Why a kernel: XLA:CPU ran the differentiated GELU of a 6 x 384, B 64, T 256 train step as three
// passes over the (N, 4 d) hidden activations (erf into a saved Phi(x), then x Phi(x), then the
// backward's), 63 ms a layer on each device, 380 ms of its 4.4 s (docs/performance.md). Here the
// forward reads x once and writes y, and the backward reads x and dy once and writes dx; Phi and
// phi are recomputed in registers.
//
// forward:  y = x Phi(x),  Phi(x) = (1 + erf(x / sqrt 2)) / 2
// backward: dx = dy (Phi(x) + x phi(x)),  phi(x) = exp(-x^2 / 2) / sqrt(2 pi)
#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kLanes = 16;  // floats in one vector (one AVX-512 / two AVX2 registers)

// Loads and stores through a may_alias, 4-byte-aligned vector type (kernels/cpu/causal_attention.cc
// explains why).
typedef float V __attribute__((vector_size(4 * kLanes)));
typedef int32_t VI __attribute__((vector_size(4 * kLanes)));
typedef float VU __attribute__((vector_size(4 * kLanes), aligned(4), may_alias));

inline V Load(const float* p) { return *reinterpret_cast<const VU*>(p); }
inline void Store(float* p, V v) { *reinterpret_cast<VU*>(p) = v; }
inline V Splat(float x) { return V{} + x; }

// erf(x): Eigen's (and so XLA:CPU's) float rational approximation, x P(x^2) / Q(x^2) on
// [-4, 4] and +-1 beyond; within 2e-7 of erf (tested against float64 in parity_tests).
inline V Erf(V a) {
  const V x = a > 4.0f ? Splat(4.0f) : (a < -4.0f ? Splat(-4.0f) : a);
  const V x2 = x * x;
  V p = x2 * -2.72614225801306e-10f + 2.77068142495902e-08f;
  p = p * x2 + -2.10102402082508e-06f;
  p = p * x2 + -5.69250639462346e-05f;
  p = p * x2 + -7.34990630326855e-04f;
  p = p * x2 + -2.95459980854025e-03f;
  p = p * x2 + -1.60960333262415e-02f;
  p = p * x;
  V q = x2 * -1.45660718464996e-05f + -2.13374055278905e-04f;
  q = q * x2 + -1.68282697438203e-03f;
  q = q * x2 + -7.37332916720468e-03f;
  q = q * x2 + -1.42647390514189e-02f;
  return p / q;
}

// exp(x) for x <= 0, 16 lanes at once (Cephes' expf, as kernels/cpu/causal_attention.cc): about
// 1 ulp; below -87 -> 0.
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

constexpr float kSqrtHalf = 0.70710678118654752f;
constexpr float kInvSqrt2Pi = 0.39894228040143268f;

inline V Phi(V x) { return 0.5f + 0.5f * Erf(x * kSqrtHalf); }

inline float Scalar(V (*f)(V), float x) { return f(Splat(x))[0]; }

// Splits [0, items) into contiguous parts, one per pool thread; every caller helps (with host
// devices sharing the pool, waiting on a merely scheduled task could deadlock).
template <typename Fn>
void ParallelFor(ffi::ThreadPool& pool, int64_t items, Fn fn) {
  constexpr int64_t kMinPart = 1 << 16;  // fewer floats a part are not worth a thread hand-off
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), items / kMinPart));
  if (parts <= 1) {
    fn(0, items);
    return;
  }
  struct State {
    std::atomic<int64_t> next{0}, done{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  auto st = std::make_shared<State>();
  auto work = [st, parts, items, &fn] {
    for (int64_t c; (c = st->next.fetch_add(1)) < parts;) {
      // part boundaries on whole vectors
      const int64_t lo = items * c / parts / kLanes * kLanes;
      const int64_t hi = c + 1 == parts ? items : items * (c + 1) / parts / kLanes * kLanes;
      fn(lo, hi);
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

V Forward(V x) { return x * Phi(x); }

ffi::Error ForwardImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y) {
  const float* xp = x.typed_data();
  float* yp = y->typed_data();
  ParallelFor(pool, static_cast<int64_t>(x.element_count()), [&](int64_t lo, int64_t hi) {
    int64_t i = lo;
    for (; i + kLanes <= hi; i += kLanes) Store(yp + i, Forward(Load(xp + i)));
    for (; i < hi; ++i) yp[i] = Scalar(Forward, xp[i]);
  });
  return ffi::Error::Success();
}

inline V Slope(V x) { return Phi(x) + x * kInvSqrt2Pi * ExpNeg(-0.5f * x * x); }

ffi::Error BackwardImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> dy,
                        ffi::ResultBuffer<ffi::F32> dx) {
  const float *xp = x.typed_data(), *gp = dy.typed_data();
  float* dp = dx->typed_data();
  ParallelFor(pool, static_cast<int64_t>(x.element_count()), [&](int64_t lo, int64_t hi) {
    int64_t i = lo;
    for (; i + kLanes <= hi; i += kLanes) Store(dp + i, Load(gp + i) * Slope(Load(xp + i)));
    for (; i < hi; ++i) dp[i] = gp[i] * Scalar(Slope, xp[i]);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgptGeluFwd, ForwardImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgptGeluBwd, BackwardImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x
                                  .Arg<ffi::Buffer<ffi::F32>>()   // dy
                                  .Ret<ffi::Buffer<ffi::F32>>());  // dx
