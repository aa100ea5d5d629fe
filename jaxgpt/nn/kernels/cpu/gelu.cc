// Exact GELU for the CPU, forward and backward, as XLA FFI custom calls (kernels/gelu_ffi.py
// builds, loads and differentiates them).
//
// Why a kernel: XLA:CPU ran the differentiated GELU of a 6 x 384, B 64, T 256 train step as three
// passes over the (N, 4 d) hidden activations (erf into a saved Phi(x), then x Phi(x), then the
// backward's), nearly a tenth of the step on each device (docs/performance.md). Here the
// forward reads x once and writes y, and the backward reads x and dy once and writes dx; Phi and
// phi are recomputed in registers.
//
// forward:  y = x Phi(x),  Phi(x) = (1 + erf(x / sqrt 2)) / 2
// backward: dx = dy (Phi(x) + x phi(x)),  phi(x) = exp(-x^2 / 2) / sqrt(2 pi)
#include <cstdint>

#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace jaxgpt_simd;  // NOLINT: V, Load, Store, ExpNeg, ParallelParts, Parts (simd.h)

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

constexpr float kSqrtHalf = 0.70710678118654752f;
constexpr float kInvSqrt2Pi = 0.39894228040143268f;

inline V Phi(V x) { return 0.5f + 0.5f * Erf(x * kSqrtHalf); }

inline float Scalar(V (*f)(V), float x) { return f(Splat(x))[0]; }

constexpr int64_t kMinPart = 1 << 16;  // fewer floats a part are not worth a thread hand-off

// fn(lo, hi) over the n floats, one part per intra-op thread
template <typename Fn>
void ParallelFor(ffi::ThreadPool& pool, int64_t n, Fn fn) {
  ParallelParts(pool, Parts(pool, n, kMinPart), n, [&fn](int64_t, int64_t lo, int64_t hi) { fn(lo, hi); });
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
