// Causal self-attention for CPU training, forward and backward, as XLA FFI custom calls
// (kernels/causal_ffi.py builds, loads and differentiates them).
//
// Why a kernel: on the 2-core CPU, XLA runs a short-sequence attention layer as a dozen thunks
// (score dot, mask select, max, exp, sum, divide, value dot; their backward; layout copies between
// token-major and head-major operands), and the softmax reductions alone took 1 ms per layer of a
// 4 x 128, T 64 train step (docs/performance.md). Here one call per direction reads q, k, v where
// they lie, (B, T, H, D), and keeps each (batch, head)'s T x T scores in a thread-local buffer.
//
// forward:  s_ij = q_i . k_j * scale (j <= i), lse_i = log sum_j exp(s_ij), out_i = sum_j exp(s_ij - lse_i) v_j
// backward: FlashAttention-2's, scores recomputed from lse: p = exp(s - lse), dv = p^T dout,
//           dp = dout v^T, ds = p (dp - rowsum(dout * out)) scale, dq = ds k, dk = ds^T q.
// Query head h reads key/value head h / (H / H_kv) (grouped-query attention).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kRows = 4;    // rows of a register tile
constexpr int64_t kLanes = 16;  // columns of a register tile (one AVX-512 / two AVX2 vectors)

// 16 floats in one AVX-512 register (two AVX2 ones): the tiles below keep their accumulators in
// registers, which the auto-vectorised loops did not (they reloaded them on every multiply-add).
typedef float V __attribute__((vector_size(4 * kLanes), aligned(4)));

inline V Load(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void Store(float* p, V v) { std::memcpy(p, &v, sizeof v); }

// s[i * T + j] = a_i . bt[:, j] for the tiles of (kRows, kLanes) that hold a j <= i (the causal
// lower triangle and its diagonal tiles; entries past the diagonal are scratch, never read).
// a: rows of length D with stride sa; bt: (D, T) packed.
void ScoresTile(const float* a, int64_t sa, const float* bt, float* s, int64_t T, int64_t D) {
  for (int64_t i0 = 0; i0 < T; i0 += kRows) {
    const int64_t rows = std::min(kRows, T - i0);
    const int64_t n = std::min(T, i0 + rows);  // keys any row of the tile sees
    for (int64_t j0 = 0; j0 < n; j0 += kLanes) {
      const int64_t lanes = std::min(kLanes, T - j0);
      if (rows == kRows && lanes == kLanes) {
        V c0 = {}, c1 = {}, c2 = {}, c3 = {};
        const float *a0 = a + i0 * sa, *a1 = a0 + sa, *a2 = a1 + sa, *a3 = a2 + sa;
        for (int64_t d = 0; d < D; ++d) {
          const V b = Load(bt + d * T + j0);
          c0 += a0[d] * b;
          c1 += a1[d] * b;
          c2 += a2[d] * b;
          c3 += a3[d] * b;
        }
        Store(s + i0 * T + j0, c0);
        Store(s + (i0 + 1) * T + j0, c1);
        Store(s + (i0 + 2) * T + j0, c2);
        Store(s + (i0 + 3) * T + j0, c3);
        continue;
      }
      float acc[kRows][kLanes] = {};
      for (int64_t d = 0; d < D; ++d)
        for (int64_t r = 0; r < rows; ++r)
          for (int64_t l = 0; l < lanes; ++l) acc[r][l] += a[(i0 + r) * sa + d] * bt[d * T + j0 + l];
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t l = 0; l < lanes; ++l) s[(i0 + r) * T + j0 + l] = acc[r][l];
    }
  }
}

// out_i (+)= sum_j p[i * T + j] v_j over j <= i (lower) or j >= i (upper), the other entries of p
// being scratch. v: rows of D with stride sv; out: rows of D with stride so.
// NV = D / kLanes registers per row (a template, so the accumulators stay in registers); 0: any D.
template <int NV>
void MixRows(const float* p, const float* v, int64_t sv, float* out, int64_t so, int64_t T, int64_t Drt, bool lower,
             bool accumulate) {
  const int64_t D = NV > 0 ? NV * kLanes : Drt;
  for (int64_t i0 = 0; i0 < T; i0 += kRows) {
    const int64_t rows = std::min(kRows, T - i0);
    const int64_t jlo = lower ? 0 : i0, jhi = lower ? std::min(T, i0 + rows) : T;
    if (NV > 0 && rows == kRows) {
      V acc[kRows][NV > 0 ? NV : 1] = {};
      for (int64_t j = jlo; j < jhi; ++j) {
        const float* vj = v + j * sv;
        V vv[NV > 0 ? NV : 1];
        for (int c = 0; c < NV; ++c) vv[c] = Load(vj + c * kLanes);
        for (int64_t r = 0; r < kRows; ++r) {
          const int64_t i = i0 + r;
          const float w = (lower ? j <= i : j >= i) ? p[i * T + j] : 0.0f;
          for (int c = 0; c < NV; ++c) acc[r][c] += w * vv[c];
        }
      }
      for (int64_t r = 0; r < kRows; ++r)
        for (int c = 0; c < NV; ++c) {
          float* o = out + (i0 + r) * so + c * kLanes;
          Store(o, accumulate ? Load(o) + acc[r][c] : acc[r][c]);
        }
      continue;
    }
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = i0 + r;
      float* o = out + i * so;
      if (!accumulate)
        for (int64_t d = 0; d < D; ++d) o[d] = 0.0f;
      for (int64_t j = lower ? 0 : i; j < (lower ? i + 1 : T); ++j) {
        const float w = p[i * T + j];
        const float* vj = v + j * sv;
        for (int64_t d = 0; d < D; ++d) o[d] += w * vj[d];
      }
    }
  }
}

void Mix(const float* p, const float* v, int64_t sv, float* out, int64_t so, int64_t T, int64_t D, bool lower,
         bool accumulate) {
  switch (D) {
    case 16: return MixRows<1>(p, v, sv, out, so, T, D, lower, accumulate);
    case 32: return MixRows<2>(p, v, sv, out, so, T, D, lower, accumulate);
    case 64: return MixRows<4>(p, v, sv, out, so, T, D, lower, accumulate);
    case 128: return MixRows<8>(p, v, sv, out, so, T, D, lower, accumulate);
    default: return MixRows<0>(p, v, sv, out, so, T, D, lower, accumulate);
  }
}

// bt (D, T) = rows of a (T rows of D, stride sa), transposed
void PackT(const float* a, int64_t sa, float* bt, int64_t T, int64_t D) {
  for (int64_t j = 0; j < T; ++j)
    for (int64_t d = 0; d < D; ++d) bt[d * T + j] = a[j * sa + d];
}

void TransposeSquare(const float* a, float* at, int64_t T) {
  for (int64_t i = 0; i < T; ++i)
    for (int64_t j = 0; j < T; ++j) at[j * T + i] = a[i * T + j];
}

// fn(lo, hi) over [0, items) in chunks, run by the caller and by XLA's intra-op threads as they come
// free. The caller takes chunks too and waits only for chunks another thread has started: with several
// host devices sharing the pool, every pool thread may be a caller, so waiting for a task that was
// merely scheduled could deadlock.
template <typename Fn>
void ParallelFor(ffi::ThreadPool& pool, int64_t items, Fn fn) {
  const int64_t parts = std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), items);
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
  auto work = [st, parts, items, &fn] {  // fn outlives every chunk: the caller waits for all of them
    for (int64_t c; (c = st->next.fetch_add(1)) < parts;) {
      fn(items * c / parts, items * (c + 1) / parts);
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

struct Shape {
  int64_t B, T, H, K, D;
};

ffi::Error CheckShapes(const ffi::Buffer<ffi::F32>& q, const ffi::Buffer<ffi::F32>& k, const ffi::Buffer<ffi::F32>& v,
                       Shape* s) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4)
    return ffi::Error::InvalidArgument("causal attention: q (B, T, H, D), k and v (B, T, H_kv, D)");
  *s = Shape{qd[0], qd[1], qd[2], kd[2], qd[3]};
  for (int a = 0; a < 4; ++a)
    if (kd[a] != vd[a] || (a != 2 && kd[a] != qd[a]) || s->H % s->K != 0)
      return ffi::Error::InvalidArgument("causal attention: q, k and v disagree in shape");
  return ffi::Error::Success();
}

// exp(x) for x <= 0 (scores minus their row max or logsumexp), vectorisable: std::exp is a libm call
// per element, which took most of the kernel's time. Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2,
// a degree-6 polynomial for exp(r) (about 1 ulp), 2^n from the exponent bits. Below -87 -> 0.
inline float ExpNeg(float x) {
  const float xc = std::max(x, -87.0f);
  const float n = std::nearbyint(xc * 1.44269504088896341f);
  float r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < -87.0f ? 0.0f : p * scale;
}

// Causal softmax of row i of s (scaled in place into probabilities); returns the row's logsumexp.
// Max and sum in kLanes partial results, so the compiler vectorises them without reassociating.
float SoftmaxRow(float* s, int64_t i, float scale) {
  const int64_t n = i + 1;
  float mx[kLanes], sm[kLanes];
  for (int64_t l = 0; l < kLanes; ++l) mx[l] = -INFINITY, sm[l] = 0.0f;
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) {
      s[j + l] *= scale;
      mx[l] = mx[l] > s[j + l] ? mx[l] : s[j + l];
    }
  float m = -INFINITY;
  for (; j < n; ++j) {
    s[j] *= scale;
    m = std::max(m, s[j]);
  }
  for (int64_t l = 0; l < kLanes; ++l) m = std::max(m, mx[l]);
  for (j = 0; j + kLanes <= n; j += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) {
      s[j + l] = ExpNeg(s[j + l] - m);
      sm[l] += s[j + l];
    }
  float sum = 0.0f;
  for (; j < n; ++j) {
    s[j] = ExpNeg(s[j] - m);
    sum += s[j];
  }
  for (int64_t l = 0; l < kLanes; ++l) sum += sm[l];
  const float inv = 1.0f / sum;
  for (j = 0; j < n; ++j) s[j] *= inv;
  return m + std::log(sum);
}

ffi::Error ForwardImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                       ffi::Buffer<ffi::F32> v, ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> lse,
                       float scale) {
  Shape s;
  if (auto e = CheckShapes(q, k, v, &s); e.failure()) return e;
  const auto [B, T, H, K, D] = s;
  const int64_t G = H / K;
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data();
  float *op = out->typed_data(), *lp = lse->typed_data();  // lse (B, H, T)
  ParallelFor(pool, B * H, [&](int64_t lo, int64_t hi) {
    std::vector<float> kt(D * T), sc(T * T);
    for (int64_t it = lo; it < hi; ++it) {
      const int64_t b = it / H, h = it % H, hk = h / G;
      const float* qh = qp + (b * T * H + h) * D;
      const float* kh = kp + (b * T * K + hk) * D;
      const float* vh = vp + (b * T * K + hk) * D;
      PackT(kh, K * D, kt.data(), T, D);
      ScoresTile(qh, H * D, kt.data(), sc.data(), T, D);
      for (int64_t i = 0; i < T; ++i) {
        float* row = sc.data() + i * T;
        lp[it * T + i] = SoftmaxRow(row, i, scale);
      }
      Mix(sc.data(), vh, K * D, op + (b * T * H + h) * D, H * D, T, D, true, false);
    }
  });
  return ffi::Error::Success();
}

ffi::Error BackwardImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                        ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::F32> out, ffi::Buffer<ffi::F32> lse,
                        ffi::Buffer<ffi::F32> dout, ffi::ResultBuffer<ffi::F32> dq, ffi::ResultBuffer<ffi::F32> dk,
                        ffi::ResultBuffer<ffi::F32> dv, float scale) {
  Shape s;
  if (auto e = CheckShapes(q, k, v, &s); e.failure()) return e;
  const auto [B, T, H, K, D] = s;
  const int64_t G = H / K;
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data(), *op = out.typed_data(),
              *lp = lse.typed_data(), *gp = dout.typed_data();
  float *dqp = dq->typed_data(), *dkp = dk->typed_data(), *dvp = dv->typed_data();
  // one item per (batch, key/value head): its G query heads add into the same dk, dv rows
  ParallelFor(pool, B * K, [&](int64_t lo, int64_t hi) {
    std::vector<float> kt(D * T), vt(D * T), p(T * T), dp(T * T), t(T * T), delta(T);
    for (int64_t it = lo; it < hi; ++it) {
      const int64_t b = it / K, hk = it % K;
      const float* kh = kp + (b * T * K + hk) * D;
      const float* vh = vp + (b * T * K + hk) * D;
      float* dkh = dkp + (b * T * K + hk) * D;
      float* dvh = dvp + (b * T * K + hk) * D;
      PackT(kh, K * D, kt.data(), T, D);
      PackT(vh, K * D, vt.data(), T, D);
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = hk * G + g, rq = (b * T * H + h) * D;
        const float* l = lp + (b * H + h) * T;
        ScoresTile(qp + rq, H * D, kt.data(), p.data(), T, D);   // scores
        ScoresTile(gp + rq, H * D, vt.data(), dp.data(), T, D);  // dout v^T
        for (int64_t i = 0; i < T; ++i) {
          const float* oi = op + rq + i * H * D;
          const float* gi = gp + rq + i * H * D;
          float dl = 0.0f;
          for (int64_t d = 0; d < D; ++d) dl += oi[d] * gi[d];
          float* pi = p.data() + i * T;
          float* dpi = dp.data() + i * T;
          for (int64_t j = 0; j <= i; ++j) {
            pi[j] = ExpNeg(pi[j] * scale - l[i]);
            dpi[j] = pi[j] * (dpi[j] - dl) * scale;  // ds
          }
        }
        Mix(dp.data(), kh, K * D, dqp + rq, H * D, T, D, true, false);  // dq = ds k
        TransposeSquare(p.data(), t.data(), T);
        Mix(t.data(), gp + rq, H * D, dvh, K * D, T, D, false, g > 0);  // dv = p^T dout
        TransposeSquare(dp.data(), t.data(), T);
        Mix(t.data(), qp + rq, H * D, dkh, K * D, T, D, false, g > 0);  // dk = ds^T q
      }
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgptCausalAttentionFwd, ForwardImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q (B, T, H, D)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k (B, T, H_kv, D)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v (B, T, H_kv, D)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out (B, T, H, D)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // lse (B, H, T)
                                  .Attr<float>("scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgptCausalAttentionBwd, BackwardImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v
                                  .Arg<ffi::Buffer<ffi::F32>>()  // out
                                  .Arg<ffi::Buffer<ffi::F32>>()  // lse
                                  .Arg<ffi::Buffer<ffi::F32>>()  // dout
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dq
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dk
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dv
                                  .Attr<float>("scale"));
