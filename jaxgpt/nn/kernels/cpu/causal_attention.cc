// Causal self-attention for CPU training, forward and backward, as XLA FFI custom calls
// (kernels/causal_ffi.py builds, loads and differentiates them).
//
// Why a kernel: on the 2-core CPU, XLA runs a short-sequence attention layer as a dozen thunks
// (score dot, mask select, max, exp, sum, divide, value dot; their backward; layout copies between
// token-major and head-major operands), and the softmax reductions alone were a large share of each
// layer of a 4 x 128, T 64 train step (docs/performance.md). Here one call per direction reads q, k, v where
// they lie, (B, T, H, D), and keeps each (batch, head)'s T x T scores in a thread-local buffer.
//
// forward:  s_ij = q_i . k_j * scale (j <= i), lse_i = log sum_j exp(s_ij), out_i = sum_j exp(s_ij - lse_i) v_j
// backward: FlashAttention-2's, scores recomputed from lse: p = exp(s - lse), dv = p^T dout,
//           dp = dout v^T, ds = p (dp - rowsum(dout * out)) scale, dq = ds k, dk = ds^T q.
// Query head h reads key/value head h / (H / H_kv) (grouped-query attention).
// Segment ids (B, T) pack documents into a row: s_ij counts only where seg_i == seg_j, so each
// row's softmax and its backward see its own document's keys (all ids equal: plain causal).
// A sliding window W > 0 (Mistral, Qwen2) also needs j > i - W: the weights outside it are zeros,
// so the value mixes and the backward's products over the causal pairs add nothing for them.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace jaxgpt_simd;  // NOLINT: V, Load, Store, ExpNeg, ParallelParts (simd.h)

// Register tiles, from the target's vector registers (simd.h's kVRegs), so that accumulators and
// operands stay in registers on every ISA; the AVX-512 tiles are the ones measured there.
// A score tile: kSRows x 2 accumulators + 2 key vectors + a broadcast query element (AVX-512: 8 rows,
// the fastest there, docs/performance.md; AVX2: 6).
constexpr int64_t kSRows = std::min<int64_t>(8, (kVRegs - 3) / 2);
// A value-mixing tile: MixRows<NC>() output rows x NC vectors of columns + NC value vectors + a weight
// (AVX-512: 4 x 4 at D 64, as tuned there; AVX2: 6 x 2).
constexpr int kMixCols = kVRegs >= 32 ? 4 : 2;
template <int NC>
constexpr int64_t MixRows() {
  return std::min<int64_t>(kVRegs >= 32 ? 4 : 8, (kVRegs - 1 - NC) / NC);
}

const VI kIota = [] {
  VI v;
  for (int l = 0; l < kLanes; ++l) v[l] = l;
  return v;
}();

// lanes j, j + 1, ... below n
inline VI Below(int64_t j, int64_t n) { return (static_cast<int32_t>(j) + kIota) < static_cast<int32_t>(n); }

// lanes j, j + 1, ... above lo (lo may be negative)
inline VI Above(int64_t j, int64_t lo) { return (static_cast<int32_t>(j) + kIota) > static_cast<int32_t>(lo); }

// Score rows have a padded stride, a multiple of kLanes, so every row is read and written in whole
// vectors; lanes past the causal diagonal are masked where they would count.
inline int64_t Padded(int64_t T) { return (T + kLanes - 1) / kLanes * kLanes; }

// s[i * ld + j] = a_i . bt[:, j] for the tiles that hold a j <= i. a: rows of D with stride sa;
// bt: (D, ld) packed. A tile is kSRows x 2 vectors (12-16 independent accumulators keep two FMA units
// of latency 4 busy), or x 1 vector for the last kLanes columns a row tile needs.
void Scores(const float* a, int64_t sa, const float* bt, int64_t ld, float* s, int64_t T, int64_t D) {
  for (int64_t i0 = 0; i0 < T; i0 += kSRows) {
    const int64_t rows = std::min(kSRows, T - i0);
    const int64_t n = std::min(T, i0 + rows);  // keys any row of the tile sees
    const float* ar[kSRows];
    for (int64_t r = 0; r < kSRows; ++r) ar[r] = a + (i0 + std::min(r, rows - 1)) * sa;  // short tile: repeat a row
    int64_t j0 = 0;
    for (; j0 + kLanes < n; j0 += 2 * kLanes) {
      V c[kSRows][2] = {};
      for (int64_t d = 0; d < D; ++d) {
        const V b0 = Load(bt + d * ld + j0), b1 = Load(bt + d * ld + j0 + kLanes);
        for (int64_t r = 0; r < kSRows; ++r) {
          c[r][0] += ar[r][d] * b0;
          c[r][1] += ar[r][d] * b1;
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        Store(s + (i0 + r) * ld + j0, c[r][0]);
        Store(s + (i0 + r) * ld + j0 + kLanes, c[r][1]);
      }
    }
    if (j0 < n) {
      V c[kSRows] = {};
      for (int64_t d = 0; d < D; ++d) {
        const V b0 = Load(bt + d * ld + j0);
        for (int64_t r = 0; r < kSRows; ++r) c[r] += ar[r][d] * b0;
      }
      for (int64_t r = 0; r < rows; ++r) Store(s + (i0 + r) * ld + j0, c[r]);
    }
  }
}

// out_o (+)= sum_s w(o, s) x_s over the causal pairs, x: rows of D with stride sx, out: rows of D with
// stride so. kT false: w = p[o * ld + s] for s <= o (out = p x: the output, dq). kT true: w = p[s * ld + o]
// for s >= o (out = p^T x: dv, dk), read from p as it lies, so no T x T transpose is made.
// NC > 0: D is a multiple of NC vectors, done NC at a time (a template, so the accumulators stay in
// registers); a short last row tile weighs its missing rows 0. NC = 0: any D, one row at a time.
template <int NC, bool kT>
void Mix(const float* p, int64_t ld, const float* x, int64_t sx, float* out, int64_t so, int64_t T, int64_t D,
         bool accumulate) {
  auto weight = [&](int64_t o, int64_t s) { return kT ? p[s * ld + o] : p[o * ld + s]; };
  if constexpr (NC > 0) {
    constexpr int64_t R = MixRows<NC>();
    for (int64_t o0 = 0; o0 < T; o0 += R) {
      const int64_t rows = std::min(R, T - o0);
      for (int64_t c0 = 0; c0 < D; c0 += NC * kLanes) {
        V acc[R][NC] = {};
        for (int64_t s = kT ? o0 : 0; s < (kT ? T : o0 + rows); ++s) {
          const float* xs = x + s * sx + c0;
          V xv[NC];
          for (int c = 0; c < NC; ++c) xv[c] = Load(xs + c * kLanes);
          for (int64_t r = 0; r < R; ++r) {
            const float w = r < rows && (kT ? o0 + r <= s : s <= o0 + r) ? weight(o0 + r, s) : 0.0f;
            for (int c = 0; c < NC; ++c) acc[r][c] += w * xv[c];
          }
        }
        for (int64_t r = 0; r < rows; ++r)
          for (int c = 0; c < NC; ++c) {
            float* o = out + (o0 + r) * so + c0 + c * kLanes;
            Store(o, accumulate ? Load(o) + acc[r][c] : acc[r][c]);
          }
      }
    }
    return;
  }
  for (int64_t i = 0; i < T; ++i) {
    float* o = out + i * so;
    if (!accumulate)
      for (int64_t d = 0; d < D; ++d) o[d] = 0.0f;
    for (int64_t s = kT ? i : 0; s < (kT ? T : i + 1); ++s) {
      const float w = weight(i, s);
      const float* xs = x + s * sx;
      for (int64_t d = 0; d < D; ++d) o[d] += w * xs[d];
    }
  }
}

template <bool kT>
void MixD(const float* p, int64_t ld, const float* x, int64_t sx, float* out, int64_t so, int64_t T, int64_t D,
          bool accumulate) {
  // a tile takes the most column vectors (up to kMixCols) that divide D
  if (D % kLanes) return Mix<0, kT>(p, ld, x, sx, out, so, T, D, accumulate);
  if (kMixCols >= 4 && D % (4 * kLanes) == 0) return Mix<4, kT>(p, ld, x, sx, out, so, T, D, accumulate);
  if (kMixCols >= 2 && D % (2 * kLanes) == 0) return Mix<2, kT>(p, ld, x, sx, out, so, T, D, accumulate);
  return Mix<1, kT>(p, ld, x, sx, out, so, T, D, accumulate);
}

// bt (D, ld) = rows of a (T rows of D, stride sa), transposed; columns past T zero
void PackT(const float* a, int64_t sa, float* bt, int64_t ld, int64_t T, int64_t D) {
  for (int64_t j0 = 0; j0 < ld; j0 += kLanes)  // in kLanes-row strips: each output row is written in whole vectors
    for (int64_t d = 0; d < D; ++d) {
      float* o = bt + d * ld + j0;
      for (int64_t l = 0; l < kLanes; ++l) o[l] = j0 + l < T ? a[(j0 + l) * sa + d] : 0.0f;
    }
}

// fn(lo, hi) over [0, items), one part per intra-op thread (simd.h's ParallelParts).
template <typename Fn>
void ParallelFor(ffi::ThreadPool& pool, int64_t items, Fn fn) {
  const int64_t parts = std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), items);
  ParallelParts(pool, parts, items, [&fn](int64_t, int64_t lo, int64_t hi) { fn(lo, hi); });
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

// Lanes j, j + 1, ... that row i attends to: at or below the diagonal, (kSeg) in row i's segment
// and (kWin) inside its window of w keys. seg: the batch row's ids, padded to a multiple of kLanes.
// Without segments the compare is compiled out, and so is the window's: the segment compare slowed a
// T 64 train step's attention (fwd + bwd) by about a third on AVX-512 (docs/performance.md).
template <bool kSeg, bool kWin>
inline VI Visible(const int32_t* seg, int64_t j, int64_t i, int64_t w) {
  VI v = Below(j, i + 1);
  if constexpr (kSeg) v = v & (LoadI(seg + j) == seg[i]);
  if constexpr (kWin) v = v & Above(j, i - w);
  return v;
}

// Bring a batch row's segment ids into a buffer padded to ld (whole-vector loads stay inside it).
void CopySegments(const int32_t* from, int64_t T, std::vector<int32_t>& to) {
  std::copy(from, from + T, to.begin());
  std::fill(to.begin() + T, to.end(), -1);
}

// Causal softmax of row i (stride-padded, scaled in place into probabilities, zero past i and
// outside its segment); returns the row's logsumexp.
template <bool kSeg, bool kWin>
float SoftmaxRow(float* s, int64_t i, float scale, const int32_t* seg, int64_t w) {
  const int64_t n = i + 1;
  V mx = Splat(-INFINITY);
  for (int64_t j = 0; j < n; j += kLanes) {
    const V x = Load(s + j) * scale;
    Store(s + j, x);
    mx = Visible<kSeg, kWin>(seg, j, i, w) ? (x > mx ? x : mx) : mx;
  }
  const float m = Max(mx);
  V sm = {};
  for (int64_t j = 0; j < n; j += kLanes) {
    const V e = Visible<kSeg, kWin>(seg, j, i, w) ? ExpNeg(Load(s + j) - m) : Splat(0.0f);
    Store(s + j, e);
    sm += e;
  }
  const float sum = Sum(sm), inv = 1.0f / sum;
  for (int64_t j = 0; j < n; j += kLanes) Store(s + j, Load(s + j) * inv);
  return m + std::log(sum);
}

ffi::Error CheckSegments(const ffi::Buffer<ffi::S32>& seg, const Shape& s) {
  auto sd = seg.dimensions();
  if (sd.size() != 2 || sd[0] != s.B || sd[1] != s.T)
    return ffi::Error::InvalidArgument("causal attention: segment ids (B, T)");
  return ffi::Error::Success();
}

// Row i of the backward: p = exp(s * scale - lse) where visible, ds = p (dp - dl) scale, in place.
template <bool kSeg, bool kWin>
void BackwardRow(float* pi, float* dpi, int64_t i, float scale, float lse, float dl, const int32_t* seg, int64_t w) {
  for (int64_t j = 0; j <= i; j += kLanes) {
    const V pj = Visible<kSeg, kWin>(seg, j, i, w) ? ExpNeg(Load(pi + j) * scale - lse) : Splat(0.0f);
    Store(pi + j, pj);
    Store(dpi + j, pj * (Load(dpi + j) - dl) * scale);  // ds
  }
}

// The row functions' four instantiations (segments, window), picked once per row.
inline float Softmax(bool seg, int64_t w, float* s, int64_t i, float scale, const int32_t* sg) {
  if (seg) return w > 0 ? SoftmaxRow<true, true>(s, i, scale, sg, w) : SoftmaxRow<true, false>(s, i, scale, sg, w);
  return w > 0 ? SoftmaxRow<false, true>(s, i, scale, sg, w) : SoftmaxRow<false, false>(s, i, scale, sg, w);
}

inline void Backward(bool seg, int64_t w, float* pi, float* dpi, int64_t i, float scale, float lse, float dl,
                     const int32_t* sg) {
  if (seg)
    return w > 0 ? BackwardRow<true, true>(pi, dpi, i, scale, lse, dl, sg, w)
                 : BackwardRow<true, false>(pi, dpi, i, scale, lse, dl, sg, w);
  return w > 0 ? BackwardRow<false, true>(pi, dpi, i, scale, lse, dl, sg, w)
               : BackwardRow<false, false>(pi, dpi, i, scale, lse, dl, sg, w);
}

ffi::Error ForwardImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                       ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> seg, ffi::ResultBuffer<ffi::F32> out,
                       ffi::ResultBuffer<ffi::F32> lse, float scale, bool segments, int64_t window) {
  Shape s;
  if (auto e = CheckShapes(q, k, v, &s); e.failure()) return e;
  if (auto e = CheckSegments(seg, s); e.failure()) return e;
  const auto [B, T, H, K, D] = s;
  const int64_t G = H / K, ld = Padded(T);
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data();
  const int32_t* sp = seg.typed_data();
  float *op = out->typed_data(), *lp = lse->typed_data();  // lse (B, H, T)
  ParallelFor(pool, B * H, [&](int64_t lo, int64_t hi) {
    std::vector<float> kt(D * ld), sc(T * ld);
    std::vector<int32_t> sg(ld);
    for (int64_t it = lo; it < hi; ++it) {
      const int64_t b = it / H, h = it % H, hk = h / G;
      if (segments) CopySegments(sp + b * T, T, sg);
      const float* qh = qp + (b * T * H + h) * D;
      const float* kh = kp + (b * T * K + hk) * D;
      const float* vh = vp + (b * T * K + hk) * D;
      PackT(kh, K * D, kt.data(), ld, T, D);
      Scores(qh, H * D, kt.data(), ld, sc.data(), T, D);
      for (int64_t i = 0; i < T; ++i) lp[it * T + i] = Softmax(segments, window, sc.data() + i * ld, i, scale, sg.data());
      MixD<false>(sc.data(), ld, vh, K * D, op + (b * T * H + h) * D, H * D, T, D, false);
    }
  });
  return ffi::Error::Success();
}

ffi::Error BackwardImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                        ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> seg, ffi::Buffer<ffi::F32> out,
                        ffi::Buffer<ffi::F32> lse, ffi::Buffer<ffi::F32> dout, ffi::ResultBuffer<ffi::F32> dq,
                        ffi::ResultBuffer<ffi::F32> dk, ffi::ResultBuffer<ffi::F32> dv, float scale,
                        bool segments, int64_t window) {
  Shape s;
  if (auto e = CheckShapes(q, k, v, &s); e.failure()) return e;
  if (auto e = CheckSegments(seg, s); e.failure()) return e;
  const int32_t* sp = seg.typed_data();
  const auto [B, T, H, K, D] = s;
  const int64_t G = H / K, ld = Padded(T);
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data(), *op = out.typed_data(),
              *lp = lse.typed_data(), *gp = dout.typed_data();
  float *dqp = dq->typed_data(), *dkp = dk->typed_data(), *dvp = dv->typed_data();
  // one item per (batch, key/value head): its G query heads add into the same dk, dv rows
  ParallelFor(pool, B * K, [&](int64_t lo, int64_t hi) {
    std::vector<float> kt(D * ld), vt(D * ld), p(T * ld), dp(T * ld);
    std::vector<int32_t> sg(ld);
    for (int64_t it = lo; it < hi; ++it) {
      const int64_t b = it / K, hk = it % K;
      if (segments) CopySegments(sp + b * T, T, sg);
      const float* kh = kp + (b * T * K + hk) * D;
      const float* vh = vp + (b * T * K + hk) * D;
      float* dkh = dkp + (b * T * K + hk) * D;
      float* dvh = dvp + (b * T * K + hk) * D;
      PackT(kh, K * D, kt.data(), ld, T, D);
      PackT(vh, K * D, vt.data(), ld, T, D);
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = hk * G + g, rq = (b * T * H + h) * D;
        const float* l = lp + (b * H + h) * T;
        Scores(qp + rq, H * D, kt.data(), ld, p.data(), T, D);   // scores
        Scores(gp + rq, H * D, vt.data(), ld, dp.data(), T, D);  // dout v^T
        for (int64_t i = 0; i < T; ++i) {
          const float* oi = op + rq + i * H * D;
          const float* gi = gp + rq + i * H * D;
          float dl = 0.0f;
          for (int64_t d = 0; d < D; ++d) dl += oi[d] * gi[d];
          float* pi = p.data() + i * ld;
          float* dpi = dp.data() + i * ld;
          Backward(segments, window, pi, dpi, i, scale, l[i], dl, sg.data());
        }
        MixD<false>(dp.data(), ld, kh, K * D, dqp + rq, H * D, T, D, false);  // dq = ds k
        MixD<true>(p.data(), ld, gp + rq, H * D, dvh, K * D, T, D, g > 0);   // dv = p^T dout
        MixD<true>(dp.data(), ld, qp + rq, H * D, dkh, K * D, T, D, g > 0);  // dk = ds^T q
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
                                  .Arg<ffi::Buffer<ffi::S32>>()  // segment ids (B, T)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out (B, T, H, D)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // lse (B, H, T)
                                  .Attr<float>("scale")
                                  .Attr<bool>("segments")
                                  .Attr<int64_t>("window"));  // 0: no sliding window

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgptCausalAttentionBwd, BackwardImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v
                                  .Arg<ffi::Buffer<ffi::S32>>()  // segment ids
                                  .Arg<ffi::Buffer<ffi::F32>>()  // out
                                  .Arg<ffi::Buffer<ffi::F32>>()  // lse
                                  .Arg<ffi::Buffer<ffi::F32>>()  // dout
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dq
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dk
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dv
                                  .Attr<float>("scale")
                                  .Attr<bool>("segments")
                                  .Attr<int64_t>("window"));  // 0: no sliding window
