// y (M, N) = x (M, K) @ w (K, N) for a few rows M (a decode step's projections), float32, as an XLA FFI
// custom call (kernels/matvec_ffi.py builds and loads it).
//
// Why: a decode step reads every weight once per token, so its dots are bound by memory bandwidth.
// XLA:CPU runs each one on a single thread, and two threads read faster (NumPy on OpenBLAS), but
// XLA's pool threads sleep between ops, and waking one cost more than the half matvec it would run.
// So the second thread is our own helper that spins for a short while after each job, as OpenBLAS's
// threads do, and reads as fast as they do (docs/performance.md).
//
// Each output column is summed by one thread in one fixed order (rows of w 4 at a time, in order),
// so the result does not depend on the split.
#include <pthread.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <thread>

#include "simd.h"

namespace ffi = xla::ffi;
using namespace jaxgpt_simd;

namespace {

// Columns [lo, hi) of y: every row of w streamed once over that column block, 4 rows at a time.
// The 4 x values are splatted once per (row block, m): read inside the column loop, they were
// reloaded and broadcast after every store to y (x and y may alias, as far as the compiler knows),
// which made the AVX2 build, at 8 floats a vector, much slower than the AVX-512 one (docs/performance.md).
void Columns(const float* x, const float* w, float* y, int64_t M, int64_t K, int64_t N, int64_t lo, int64_t hi) {
  for (int64_t m = 0; m < M; ++m) std::memset(y + m * N + lo, 0, (hi - lo) * sizeof(float));
  int64_t i = 0;
  for (; i + 4 <= K; i += 4) {
    const float *w0 = w + i * N, *w1 = w0 + N, *w2 = w1 + N, *w3 = w2 + N;
    for (int64_t m = 0; m < M; ++m) {
      const float* xm = x + m * K + i;
      const float s0 = xm[0], s1 = xm[1], s2 = xm[2], s3 = xm[3];
      const V x0 = Splat(s0), x1 = Splat(s1), x2 = Splat(s2), x3 = Splat(s3);
      float* ym = y + m * N;
      int64_t c = lo;
      for (; c + kLanes <= hi; c += kLanes)
        Store(ym + c, Load(ym + c) + (Load(w0 + c) * x0 + Load(w1 + c) * x1 + Load(w2 + c) * x2 + Load(w3 + c) * x3));
      for (; c < hi; ++c) ym[c] += w0[c] * s0 + w1[c] * s1 + w2[c] * s2 + w3[c] * s3;
    }
  }
  for (; i < K; ++i)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t c = lo; c < hi; ++c) y[m * N + c] += w[i * N + c] * x[m * K + i];
}

// A spin-wait's pause: x86's pause, ARM's yield (the kernels build on both: simd.h's portable vectors).
inline void CpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

// One helper thread, spinning for kSpin after each job and then sleeping until the next.
class Helper {
 public:
  static constexpr auto kSpin = std::chrono::microseconds(300);  // outlasts the gap between a decode step's dots

  Helper() { std::thread([this] { Loop(); }).detach(); }

  // Runs fn on the helper while the caller works; false (fn not run) while another caller holds it
  // (several host devices decoding at once): that caller then does all the work itself.
  bool Post(std::function<void()> fn) {
    bool idle = false;
    if (!held_.compare_exchange_strong(idle, true)) return false;
    job_ = std::move(fn);
    posted_.fetch_add(1);
    std::lock_guard<std::mutex> lock(mu_);
    if (asleep_) cv_.notify_one();
    return true;
  }

  void Wait() {
    while (finished_.load(std::memory_order_acquire) != posted_.load(std::memory_order_relaxed)) CpuRelax();
    held_.store(false);
  }

 private:
  void Loop() {
    for (int64_t seen = 0;; finished_.store(seen, std::memory_order_release)) {
      auto start = std::chrono::steady_clock::now();
      while (posted_.load(std::memory_order_acquire) == seen) {
        if (std::chrono::steady_clock::now() - start > kSpin) {
          std::unique_lock<std::mutex> lock(mu_);
          asleep_ = true;
          cv_.wait(lock, [&] { return posted_.load() != seen; });
          asleep_ = false;
        }
        CpuRelax();
      }
      seen = posted_.load();
      job_();
    }
  }

  std::atomic<bool> held_{false};
  std::atomic<int64_t> posted_{0}, finished_{0};
  std::function<void()> job_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool asleep_ = false;
};

Helper* g_helper = nullptr;
std::once_flag g_atfork;

Helper& GetHelper() {
  // A forked child has no helper thread: it makes its own (the parent's is leaked in the child).
  std::call_once(g_atfork, [] { pthread_atfork(nullptr, nullptr, [] { g_helper = nullptr; }); });
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  if (g_helper == nullptr) g_helper = new Helper();
  return *g_helper;
}

// Below this many weights (1 MB) the caller reads them alone. The split pays in generate()'s loop,
// where nothing else runs; in the serving engine the host thread works beside the device, and a
// spinning helper left it half a core: 64K-float weights split made the engine benchmark 8-20% slower,
// 256K-float ones (the engine model's are all smaller) kept it level (docs/performance.md).
constexpr int64_t kMinSplit = int64_t(1) << 18;

ffi::Error MatvecImpl(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();  // (M, K)
  auto wd = w.dimensions();  // (K, N)
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[0] || y->dimensions()[0] != xd[0] || y->dimensions()[1] != wd[1])
    return ffi::Error::InvalidArgument("matvec: x (M, K), w (K, N) -> y (M, N)");
  const int64_t M = xd[0], K = wd[0], N = wd[1];
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  const int64_t mid = (N / 2 + kLanes - 1) / kLanes * kLanes;  // a whole number of vectors on the caller's side
  Helper* helper = K * N < kMinSplit || mid >= N ? nullptr : &GetHelper();
  if (helper == nullptr || !helper->Post([=] { Columns(xp, wp, yp, M, K, N, mid, N); })) {
    Columns(xp, wp, yp, M, K, N, 0, N);
    return ffi::Error::Success();
  }
  Columns(xp, wp, yp, M, K, N, 0, mid);
  helper->Wait();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgptMatvec, MatvecImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x (M, K)
                                  .Arg<ffi::Buffer<ffi::F32>>()   // w (K, N)
                                  .Ret<ffi::Buffer<ffi::F32>>());  // y (M, N)
