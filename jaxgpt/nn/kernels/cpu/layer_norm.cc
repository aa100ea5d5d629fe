// LayerNorm and RMSNorm over the last axis for the CPU, forward and backward, as XLA FFI custom
// calls (kernels/norm_ffi.py builds, loads and differentiates them).
//
// Why a kernel: XLA:CPU gives the norms' reductions to YNNPACK fusions, which take only
// materialised operands, so a differentiated LayerNorm wrote its scale and its 1/std broadcast to
// full (B, T, D) tensors and the centred input and normalised input besides, a visible share of a
// 6 x 384, B 64, T 256 train step on each device (docs/performance.md).
// Here each row of D floats is read once into cache and every pass over it runs there.
//
// forward:  mean = sum(x) / D (0 for RMSNorm), var = sum((x - mean)^2) / D (two passes, as torch;
//           no E[x^2] - E[x]^2 cancellation), rstd = 1 / sqrt(var + eps), y = (x - mean) rstd w + b
// backward: xhat = (x - mean) rstd, g = dy w, dx = rstd (g - mean(g) - xhat mean(g xhat))
//           (RMSNorm: no mean(g) term), dw = sum_rows dy xhat, db = sum_rows dy
#include <cmath>
#include <cstdint>
#include <vector>

#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace jaxgpt_simd;  // NOLINT: V, Load, Store, ParallelParts, Parts (simd.h)

// Fewer floats than this a part are not worth a thread hand-off.
constexpr int64_t kMinPart = 1 << 16;

// Sum of a row of D floats (D a multiple of kLanes handled in vectors, the rest one by one).
inline float RowSum(const float* x, int64_t D) {
  V a = {}, b = {};
  int64_t d = 0;
  for (; d + 2 * kLanes <= D; d += 2 * kLanes) {
    a += Load(x + d);
    b += Load(x + d + kLanes);
  }
  for (; d + kLanes <= D; d += kLanes) a += Load(x + d);
  float s = Sum(a + b);
  for (; d < D; ++d) s += x[d];
  return s;
}

inline float RowSquares(const float* x, float mean, int64_t D) {
  const V m = Splat(mean);
  V a = {}, b = {};
  int64_t d = 0;
  for (; d + 2 * kLanes <= D; d += 2 * kLanes) {
    const V u = Load(x + d) - m, v = Load(x + d + kLanes) - m;
    a += u * u;
    b += v * v;
  }
  for (; d + kLanes <= D; d += kLanes) {
    const V u = Load(x + d) - m;
    a += u * u;
  }
  float s = Sum(a + b);
  for (; d < D; ++d) s += (x[d] - mean) * (x[d] - mean);
  return s;
}

ffi::Error Rows(const ffi::Buffer<ffi::F32>& x, const ffi::Buffer<ffi::F32>& w, int64_t* rows, int64_t* D) {
  auto dims = x.dimensions();
  if (dims.size() == 0 || w.dimensions().size() != 1 || w.dimensions()[0] != dims.back())
    return ffi::Error::InvalidArgument("norm: x (..., D) and a scale of D values");
  *D = dims.back();
  *rows = *D ? static_cast<int64_t>(x.element_count()) / *D : 0;
  return ffi::Error::Success();
}

ffi::Error ForwardImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                       ffi::Buffer<ffi::F32> b, ffi::ResultBuffer<ffi::F32> y, ffi::ResultBuffer<ffi::F32> mean,
                       ffi::ResultBuffer<ffi::F32> rstd, float eps, bool center) {
  int64_t N, D;
  if (auto e = Rows(x, w, &N, &D); e.failure()) return e;
  const float *xp = x.typed_data(), *wp = w.typed_data(), *bp = b.typed_data();
  float *yp = y->typed_data(), *mp = mean->typed_data(), *rp = rstd->typed_data();
  const float inv_d = 1.0f / static_cast<float>(D);
  ParallelParts(pool, Parts(pool, N * D, kMinPart), N, [&](int64_t, int64_t lo, int64_t hi) {
    for (int64_t r = lo; r < hi; ++r) {
      const float* xr = xp + r * D;
      float* yr = yp + r * D;
      const float m = center ? RowSum(xr, D) * inv_d : 0.0f;
      const float s = 1.0f / std::sqrt(RowSquares(xr, m, D) * inv_d + eps);
      mp[r] = m;
      rp[r] = s;
      const V vm = Splat(m), vs = Splat(s);
      int64_t d = 0;
      for (; d + kLanes <= D; d += kLanes) Store(yr + d, (Load(xr + d) - vm) * vs * Load(wp + d) + Load(bp + d));
      for (; d < D; ++d) yr[d] = (xr[d] - m) * s * wp[d] + bp[d];
    }
  });
  return ffi::Error::Success();
}

ffi::Error BackwardImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                        ffi::Buffer<ffi::F32> mean, ffi::Buffer<ffi::F32> rstd, ffi::Buffer<ffi::F32> dy,
                        ffi::ResultBuffer<ffi::F32> dx, ffi::ResultBuffer<ffi::F32> dw,
                        ffi::ResultBuffer<ffi::F32> db, bool center) {
  int64_t N, D;
  if (auto e = Rows(x, w, &N, &D); e.failure()) return e;
  const float *xp = x.typed_data(), *wp = w.typed_data(), *mp = mean.typed_data(), *rp = rstd.typed_data(),
              *gp = dy.typed_data();
  float* dxp = dx->typed_data();
  const float inv_d = 1.0f / static_cast<float>(D);
  const int64_t parts = Parts(pool, N * D, kMinPart);
  // each part sums its rows' dw, db here; the parts are added in order after (deterministic)
  std::vector<float> acc(parts * 2 * D, 0.0f);
  ParallelParts(pool, parts, N, [&](int64_t c, int64_t lo, int64_t hi) {
    float* aw = acc.data() + c * 2 * D;
    float* ab = aw + D;
    for (int64_t r = lo; r < hi; ++r) {
      const float *xr = xp + r * D, *gr = gp + r * D;
      float* dxr = dxp + r * D;
      const float m = mp[r], s = rp[r];
      const V vm = Splat(m), vs = Splat(s);
      V sg = {}, sgx = {};  // sum(g), sum(g xhat)
      int64_t d = 0;
      for (; d + kLanes <= D; d += kLanes) {
        const V xh = (Load(xr + d) - vm) * vs, dyv = Load(gr + d), g = dyv * Load(wp + d);
        sg += g;
        sgx += g * xh;
        Store(aw + d, Load(aw + d) + dyv * xh);
        Store(ab + d, Load(ab + d) + dyv);
      }
      float tg = Sum(sg), tgx = Sum(sgx);
      for (int64_t e = d; e < D; ++e) {
        const float xh = (xr[e] - m) * s, g = gr[e] * wp[e];
        tg += g;
        tgx += g * xh;
        aw[e] += gr[e] * xh;
        ab[e] += gr[e];
      }
      const float a = center ? tg * inv_d : 0.0f, c2 = tgx * inv_d;
      const V va = Splat(a), vc = Splat(c2);
      for (d = 0; d + kLanes <= D; d += kLanes) {
        const V xh = (Load(xr + d) - vm) * vs, g = Load(gr + d) * Load(wp + d);
        Store(dxr + d, vs * (g - va - xh * vc));
      }
      for (; d < D; ++d) {
        const float xh = (xr[d] - m) * s, g = gr[d] * wp[d];
        dxr[d] = s * (g - a - xh * c2);
      }
    }
  });
  float *dwp = dw->typed_data(), *dbp = db->typed_data();
  for (int64_t d = 0; d < D; ++d) {
    float sw = 0.0f, sb = 0.0f;
    for (int64_t c = 0; c < parts; ++c) {
      sw += acc[c * 2 * D + d];
      sb += acc[c * 2 * D + D + d];
    }
    dwp[d] = sw;
    dbp[d] = sb;
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgptNormFwd, ForwardImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x (..., D)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scale (D,)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // bias (D,)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y (..., D)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // mean (...)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // rstd (...)
                                  .Attr<float>("eps")
                                  .Attr<bool>("center"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgptNormBwd, BackwardImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scale
                                  .Arg<ffi::Buffer<ffi::F32>>()  // mean
                                  .Arg<ffi::Buffer<ffi::F32>>()  // rstd
                                  .Arg<ffi::Buffer<ffi::F32>>()  // dy
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dx
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dscale (D,)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dbias (D,)
                                  .Attr<bool>("center"));
