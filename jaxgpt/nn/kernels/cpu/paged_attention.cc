// PagedAttention for the CPU, as an XLA FFI custom call (kernels/paged_ffi.py builds and loads it).
//
// Why a kernel: in pure JAX a paged step gathers every row's pages into a padded (B * H_kv, S, D)
// copy and then reads it again; on a 2-core CPU that gather was half of a 32-row decode step
// (docs/serving.md). This reads each query's keys and values in place, through the page table,
// and only up to the query's own position.
//
// out[b, t, h] = softmax_j(q[b, t, h] . k_j * scale) v_j over keys j = 0 .. q_pos[b, t], key j at
// pool[table[b, j / page_size], h / (H / H_kv), j % page_size]. q_pos < 0 (padding) -> zeros.
// The same float32 arithmetic as kernels/xla.py: scores scaled after the dot, max-subtracted exp,
// weights normalised before the value sum.
#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <mutex>
#include <cstdint>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kLanes = 16;  // independent partial sums: the compiler vectorises them without reassociating

inline float Dot(const float* a, const float* b, int64_t n) {
  float acc[kLanes] = {0};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += a[i + l] * b[i + l];
  float s = 0.0f;
  for (int l = 0; l < kLanes; ++l) s += acc[l];
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// One (row, query, head) of the output.
void AttendOne(const float* qv, const float* kp, const float* vp, const int32_t* row, int64_t n, int64_t hk,
               int64_t Hkv, int64_t PS, int64_t D, float scale, float* w, float* oh) {
  float m = -INFINITY;
  for (int64_t j = 0; j < n; ++j) {
    const float* k = kp + ((int64_t(row[j / PS]) * Hkv + hk) * PS + j % PS) * D;
    w[j] = Dot(qv, k, D) * scale;
    m = w[j] > m ? w[j] : m;
  }
  float sum = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    w[j] = std::exp(w[j] - m);
    sum += w[j];
  }
  for (int64_t d = 0; d < D; ++d) oh[d] = 0.0f;
  for (int64_t j = 0; j < n; ++j) {
    const float p = w[j] / sum;
    const float* v = vp + ((int64_t(row[j / PS]) * Hkv + hk) * PS + j % PS) * D;
    for (int64_t d = 0; d < D; ++d) oh[d] += p * v[d];
  }
}

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_pool,
                              ffi::Buffer<ffi::F32> v_pool, ffi::Buffer<ffi::S32> table,
                              ffi::Buffer<ffi::S32> q_pos, ffi::ResultBuffer<ffi::F32> out, float scale) {
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
  const float* qp = q.typed_data();
  const float* kp = k_pool.typed_data();
  const float* vp = v_pool.typed_data();
  const int32_t* tp = table.typed_data();
  const int32_t* pos = q_pos.typed_data();
  float* op = out->typed_data();
  for (int64_t i = 0; i < B * T; ++i) {  // every page a query reads exists: checked before any work
    const int64_t n = int64_t(pos[i]) + 1;
    if (n > S) return ffi::Error::InvalidArgument("paged attention: a query position is past its page table");
    const int32_t* row = tp + (i / T) * P;
    for (int64_t j = 0; j < n; j += PS)
      if (row[j / PS] < 0 || row[j / PS] >= N) return ffi::Error::InvalidArgument("paged attention: page id out of range");
  }

  // (row, query, head) items split evenly over the caller and XLA's intra-op threads
  const int64_t items = B * T * H;
  auto run = [=](int64_t lo, int64_t hi) {
    std::vector<float> w(S > 0 ? S : 1);
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t bt = i / H, h = i % H;
      const int64_t n = int64_t(pos[bt]) + 1;
      float* oh = op + i * D;
      if (n <= 0) {
        for (int64_t d = 0; d < D; ++d) oh[d] = 0.0f;
        continue;
      }
      AttendOne(qp + i * D, kp, vp, tp + (bt / T) * P, n, h / G, Hkv, PS, D, scale, w.data(), oh);
    }
  };
  int64_t parts = std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), items);
  if (parts <= 1) {
    run(0, items);
    return ffi::Error::Success();
  }
  std::mutex mu;
  std::condition_variable cv;
  int64_t left = parts - 1;
  for (int64_t p = 1; p < parts; ++p) {
    pool.Schedule([&, p] {
      run(items * p / parts, items * (p + 1) / parts);
      std::lock_guard<std::mutex> lock(mu);
      if (--left == 0) cv.notify_one();
    });
  }
  run(0, items / parts);
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return left == 0; });
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
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out (B, T, H, D)
                                  .Attr<float>("scale"));
