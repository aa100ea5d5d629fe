// Attention over a KV cache, read in place, for the CPU, as XLA FFI custom calls (kernels/paged_ffi.py
// builds and loads them). Two handlers share one inner loop:
//
// JaxgptPagedAttention: the serving engine's page pools. In pure JAX a paged step gathers every row's
//   pages into a padded (B * H_kv, S, D) copy and then reads it again; on a 2-core CPU that gather was
//   half of a 32-row decode step (docs/serving.md). This reads the keys and values through the page table.
// JaxgptCachedAttention: generate()'s contiguous cache (B * H_kv, S, D) or (B, H_kv, S, D). XLA's
//   einsum reads (and masks) all S slots on every decode step; this reads only the written ones, up to
//   each query's position (a 1,024-slot cache is empty for most of a generation).
//
// out[b, t, h] = softmax_j(q[b, t, h] . k_j * scale) v_j over keys j = lo .. q_pos[b, t], the keys of
// (b, h / (H / H_kv)), lo = max(0, q_pos - window + 1) (a sliding window; a scalar operand, so a
// scanned layer's traced window works too). q_pos < 0 (padding) -> zeros. The float32 arithmetic of kernels/xla.py: scores
// scaled after the dot, max-subtracted exp, weights normalised before the value sum.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "simd.h"

namespace ffi = xla::ffi;
using namespace jaxgpt_simd;

namespace {

// Two accumulators: one chain of D / kLanes dependent multiply-adds a key was the loop's latency
// (8 at D 64 with AVX2's 8 lanes, twice AVX-512's).
inline float Dot(const float* a, const float* b, int64_t n) {
  V acc = Splat(0.0f), acc2 = Splat(0.0f);
  int64_t i = 0;
  for (; i + 2 * kLanes <= n; i += 2 * kLanes) {
    acc += Load(a + i) * Load(b + i);
    acc2 += Load(a + i + kLanes) * Load(b + i + kLanes);
  }
  for (; i + kLanes <= n; i += kLanes) acc += Load(a + i) * Load(b + i);
  float s = TreeSum(acc + acc2);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// oh[d .. d + C * 16) = sum_i w[i] v_i[d ..]: C independent accumulators over the keys (one was a
// chain of dependent multiply-adds per key).
template <int C, typename ValAt>
void WeightedSum(const float* w, int64_t n, ValAt val, int64_t d, float* oh) {
  V acc[C];
  for (int c = 0; c < C; ++c) acc[c] = Splat(0.0f);
  for (int64_t i = 0; i < n; ++i) {
    const float* vi = val(i) + d;
    const V p = Splat(w[i]);
    for (int c = 0; c < C; ++c) acc[c] += p * Load(vi + c * kLanes);
  }
  for (int c = 0; c < C; ++c) Store(oh + d + c * kLanes, acc[c]);
}

// One (row, query, head) of the output over keys 0 .. n-1; key(j), val(j) point at key j's D floats.
// w: n floats of scratch.
template <typename KeyAt, typename ValAt>
void AttendOne(const float* qv, int64_t n, KeyAt key, ValAt val, int64_t D, float scale, float* w, float* oh) {
  float m = -INFINITY;
  for (int64_t j = 0; j < n; ++j) {
    w[j] = Dot(qv, key(j), D) * scale;
    m = w[j] > m ? w[j] : m;
  }
  V vsum = Splat(0.0f);
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    const V e = ExpNeg(Load(w + j) - m);
    Store(w + j, e);
    vsum += e;
  }
  float sum = TreeSum(vsum);
  if (j < n) {  // the tail through one vector: ExpNeg for every weight, padded lanes give 0
    V x = Splat(-INFINITY);
    for (int64_t l = 0; j + l < n; ++l) x[l] = w[j + l] - m;
    const V e = ExpNeg(x);
    for (int64_t l = 0; j + l < n; ++l) w[j + l] = e[l], sum += e[l];
  }
  j = 0;
  for (; j + kLanes <= n; j += kLanes) Store(w + j, Load(w + j) / sum);
  for (; j < n; ++j) w[j] /= sum;
  int64_t d = 0;
  for (; d + 4 * kLanes <= D; d += 4 * kLanes) WeightedSum<4>(w, n, val, d, oh);
  switch ((D - d) / kLanes) {
    case 3: WeightedSum<3>(w, n, val, d, oh); break;
    case 2: WeightedSum<2>(w, n, val, d, oh); break;
    case 1: WeightedSum<1>(w, n, val, d, oh); break;
  }
  for (d += (D - d) / kLanes * kLanes; d < D; ++d) {
    float acc = 0.0f;
    for (int64_t i = 0; i < n; ++i) acc += w[i] * val(i)[d];
    oh[d] = acc;
  }
}

// Keys and values a call reads, in floats, before it is split over threads. A decode step at batch 1
// reads at most 1,024 x 6 x 64 x 2 floats in the benchmark model, and on threads it was slower than on
// the calling thread alone: waking a sleeping pool thread costs more than half the reads (docs/performance.md).
constexpr int64_t kMinParallelFloats = int64_t(1) << 20;

// The first key a query at position p reads: the window's lower edge (window >= 1).
inline int64_t FirstKey(int64_t p, int64_t window) { return std::max<int64_t>(0, p - window + 1); }

// Every (row, query, head) item over the caller and XLA's intra-op threads. rows(b, h) -> the (key,
// value) accessors of batch row b's keys for query head h.
template <typename Rows>
void AttendAll(ffi::ThreadPool& pool, const float* qp, const int32_t* pos, float* op, int64_t B, int64_t T,
               int64_t H, int64_t D, int64_t S, float scale, int64_t window, Rows rows) {
  const int64_t items = B * T * H;
  int64_t work = 0;  // keys read
  for (int64_t i = 0; i < B * T; ++i) work += std::max<int64_t>(pos[i] + 1 - FirstKey(pos[i], window), 0) * H;
  const int64_t parts = std::min(items, Parts(pool, 2 * work * D, kMinParallelFloats));
  ParallelParts(pool, parts, items, [&](int64_t, int64_t lo, int64_t hi) {
    std::vector<float> w(S > 0 ? S : 1);
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t bt = i / H, h = i % H;
      const int64_t lo = FirstKey(pos[bt], window), n = int64_t(pos[bt]) + 1 - lo;
      float* oh = op + i * D;
      if (pos[bt] < 0) {
        for (int64_t d = 0; d < D; ++d) oh[d] = 0.0f;
        continue;
      }
      const auto kv = rows(bt / T, h);  // keys from the window's first: j -> lo + j
      AttendOne(qp + i * D, n, [&](int64_t j) { return kv.first(lo + j); },
                [&](int64_t j) { return kv.second(lo + j); }, D, scale, w.data(), oh);
    }
  });
}

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_pool,
                              ffi::Buffer<ffi::F32> v_pool, ffi::Buffer<ffi::S32> table,
                              ffi::Buffer<ffi::S32> q_pos, ffi::Buffer<ffi::S32> window_buf,
                              ffi::ResultBuffer<ffi::F32> out, float scale) {
  auto qd = q.dimensions();       // (B, T, H, D)
  auto pd = k_pool.dimensions();  // (N, H_kv, page_size, D)
  auto td = table.dimensions();   // (B, P)
  if (qd.size() != 4 || pd.size() != 4 || td.size() != 2 || q_pos.dimensions().size() != 2)
    return ffi::Error::InvalidArgument("paged attention: q (B, T, H, D), pools (N, H_kv, page_size, D), "
                                       "table (B, P), q_pos (B, T)");
  const int64_t B = qd[0], T = qd[1], H = qd[2], D = qd[3];
  const int64_t N = pd[0], Hkv = pd[1], PS = pd[2], P = td[1];
  if (pd[3] != D || H % Hkv != 0 || td[0] != B || q_pos.dimensions()[0] != B || q_pos.dimensions()[1] != T)
    return ffi::Error::InvalidArgument("paged attention: q, pools, page table and q_pos disagree in shape");
  const int64_t G = H / Hkv, S = P * PS;
  const float* kp = k_pool.typed_data();
  const float* vp = v_pool.typed_data();
  const int32_t* tp = table.typed_data();
  const int32_t* pos = q_pos.typed_data();
  const int64_t window = window_buf.typed_data()[0];
  if (window < 1) return ffi::Error::InvalidArgument("paged attention: the window must be >= 1");
  for (int64_t i = 0; i < B * T; ++i) {  // every page a query reads exists: checked before any work
    const int64_t n = int64_t(pos[i]) + 1;
    if (n > S) return ffi::Error::InvalidArgument("paged attention: a query position is past its page table");
    const int32_t* row = tp + (i / T) * P;
    for (int64_t j = FirstKey(pos[i], window) / PS * PS; j < n; j += PS)  // pages before the window may be freed
      if (row[j / PS] < 0 || row[j / PS] >= N) return ffi::Error::InvalidArgument("paged attention: page id out of range");
  }
  AttendAll(pool, q.typed_data(), pos, out->typed_data(), B, T, H, D, S, scale, window, [=](int64_t b, int64_t h) {
    const int32_t* row = tp + b * P;
    const int64_t hk = h / G;
    auto at = [=](const float* base) {
      return [=](int64_t j) { return base + ((int64_t(row[j / PS]) * Hkv + hk) * PS + j % PS) * D; };
    };
    return std::make_pair(at(kp), at(vp));
  });
  return ffi::Error::Success();
}

template <typename A, typename B>
bool SameDims(const A& a, const B& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i] != b[i]) return false;
  return true;
}

ffi::Error CachedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                               ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> q_pos, ffi::Buffer<ffi::S32> window_buf,
                               ffi::ResultBuffer<ffi::F32> out, float scale) {
  auto qd = q.dimensions();  // (B, T, H, D)
  auto kd = k.dimensions();  // (B * H_kv, S, D) or (B, H_kv, S, D): the same memory
  if (qd.size() != 4 || (kd.size() != 3 && kd.size() != 4) || q_pos.dimensions().size() != 2)
    return ffi::Error::InvalidArgument("cached attention: q (B, T, H, D), k and v (B * H_kv, S, D) or "
                                       "(B, H_kv, S, D), q_pos (B, T)");
  const int64_t B = qd[0], T = qd[1], H = qd[2], D = qd[3];
  const int64_t rows = kd.size() == 3 ? kd[0] : kd[0] * kd[1], S = kd[kd.size() - 2];
  const int64_t Hkv = B > 0 ? rows / B : 1;
  if (kd[kd.size() - 1] != D || rows != B * Hkv || (kd.size() == 4 && kd[0] != B) || Hkv == 0 || H % Hkv != 0 ||
      !SameDims(v.dimensions(), kd) || q_pos.dimensions()[0] != B || q_pos.dimensions()[1] != T)
    return ffi::Error::InvalidArgument("cached attention: q, k, v and q_pos disagree in shape");
  // A query past the cache sees all S keys, as under kernels/xla.py's causal mask. KVCache.write refuses
  // such a write (eagerly, or as a checkify error in checked mode, which still runs the program).
  std::vector<int32_t> pos(q_pos.typed_data(), q_pos.typed_data() + B * T);
  for (auto& p : pos) p = int32_t(std::min<int64_t>(p, S - 1));
  const int64_t G = H / Hkv, window = window_buf.typed_data()[0];
  if (window < 1) return ffi::Error::InvalidArgument("cached attention: the window must be >= 1");
  const float* kp = k.typed_data();
  const float* vp = v.typed_data();
  AttendAll(pool, q.typed_data(), pos.data(), out->typed_data(), B, T, H, D, S, scale, window,
            [=](int64_t b, int64_t h) {
    const int64_t row = (b * Hkv + h / G) * S * D;
    auto at = [=](const float* base) { return [=](int64_t j) { return base + j * D; }; };
    return std::make_pair(at(kp + row), at(vp + row));
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgptPagedAttention, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q (B, T, H, D)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k pool (N, H_kv, page_size, D)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v pool
                                  .Arg<ffi::Buffer<ffi::S32>>()  // page table (B, P)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // q_pos (B, T)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // sliding window () (>= 1; huge: none)
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out (B, T, H, D)
                                  .Attr<float>("scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgptCachedAttention, CachedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q (B, T, H, D)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k (B * H_kv, S, D) or (B, H_kv, S, D)
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v, the same shape
                                  .Arg<ffi::Buffer<ffi::S32>>()  // q_pos (B, T)
                                  .Arg<ffi::Buffer<ffi::S32>>()  // sliding window ()
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out (B, T, H, D)
                                  .Attr<float>("scale"));
