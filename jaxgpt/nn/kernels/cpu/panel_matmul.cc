// A vocabulary projection and its greedy pick for the CPU, as an XLA FFI custom call (kernels/panel_ffi.py
// packs w once and builds this): y (M, N) = x (M, K) @ w (K, N) + b, with the columns from `valid` on at
// float32's minimum (a padded vocabulary), and each row's argmax (the first maximum; the first NaN if any).
// w comes packed in column panels, (ceil(N / 64), K, 64): each panel 64 columns of w, row after row,
// zero-padded past N; b padded alike, (ceil(N / 64) * 64,).
//
// Why: the serving engine's vocabulary projection (a (d, V) weight, 33 MB for 256 x 32,000) runs for a
// decode step's 1-32 rows, and XLA:CPU's GEMM reads it at a fraction of the memory bandwidth at those row
// counts: 4 rows took more than twice as long as 1 (docs/performance.md). Row-major w makes a register
// tile's columns a stride of N floats apart, one page per k; packed, a tile streams one contiguous 64 KB
// panel, and 4 rows take about as long as 1 did.
//
// The argmax is taken as the tile leaves the registers: read back from memory after the kernel, the 4 MB of
// a 32-row step's logits cost XLA's max and min reductions more than the kernel saved.
//
// Every output is one register accumulator summed over k in order (0, 1, ..., K-1), plus b: the result
// depends on neither the split over threads nor the row tiling; nor does the argmax, whose parts are merged
// in column order.
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "simd.h"

namespace ffi = xla::ffi;
using namespace jaxgpt_simd;

namespace {

constexpr int64_t kPanel = 64;                 // columns a panel: 4 AVX-512 vectors, 8 AVX2 ones
constexpr int64_t kPV = kPanel / kLanes;       // vectors a panel row
// A register tile of kMR rows x kNV vectors: kMR * kNV accumulators + kNV panel vectors + a broadcast
// fit the target's registers (simd.h kVRegs): 6 x 4 = 24 (+5) of 32 with AVX-512, 2 x 4 = 8 (+5) of 16
// with AVX2, 2 x 2 where a V takes two registers (SSE2). With AVX2 the 4-row 256 x 32,000 head's time
// varied from process to process with 2 x 4 tiles, sometimes behind XLA's (4 x 2 ones, reading each panel
// row in four passes, were no better), while 32 rows won (docs/performance.md): the engine's calibration
// decides on each machine (panel_ffi.wins).
constexpr int kNV = kVRegs >= 16 ? 4 : 2;
constexpr int kMR = kVRegs >= 32 ? 6 : 2;
static_assert(kPV % kNV == 0, "a panel row is a whole number of tiles");

// A row's running argmax over the columns seen so far, lane by lane (each lane keeps its first maximum:
// a strictly greater value replaces it), and the first NaN's column.
struct Best {
  V val;
  VI col;
  int64_t nan;
};

inline Best NewBest() { return {Splat(-INFINITY), VI{} - 1, -1}; }

inline VI Iota() {
  VI i;
  for (int64_t l = 0; l < kLanes; ++l) i[l] = int32_t(l);
  return i;
}

// Folds the vector of logits at columns c .. c + kLanes into b.
inline void Take(Best& b, V y, int64_t c) {
  const VI col = Iota() + int32_t(c);
  const VI more = (y > b.val) | (b.col < 0);  // a lane's first column always (all -inf: column 0); NaN below
  b.val = more ? y : b.val;
  b.col = more ? col : b.col;
  if (b.nan < 0) {
    const VI nan = y != y;
    for (int64_t l = 0; l < kLanes; ++l)
      if (nan[l]) {
        b.nan = c + l;
        break;
      }
  }
}

// The argmax of the columns b has seen: the first NaN, else the smallest column holding the maximum.
inline void Reduce(const Best& b, float* val, int64_t* col) {
  float v = b.val[0];
  int64_t c = b.col[0];  // every lane has seen a column (Take keeps a lane's first)
  for (int64_t l = 1; l < kLanes; ++l)
    if (b.val[l] > v || (b.val[l] == v && b.col[l] < c)) v = b.val[l], c = b.col[l];
  *val = v, *col = b.nan >= 0 ? b.nan : c;
  if (b.nan >= 0) *val = NAN;
}

// y[m, c .. c + NV * kLanes) for rows m < MR, over the panel's columns from vector v on: yp points at
// (row 0, column c) of an output whose rows are ldy apart; b at the bias of column c. Columns from `valid`
// on get float32's minimum; columns before `end` are folded into best[m].
template <int MR, int NV>
inline void Tile(const float* x, int64_t K, const float* panel, int64_t v, float* yp, int64_t ldy, const float* b,
                 int64_t c, int64_t valid, int64_t end, Best* best) {
  V acc[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NV; ++j) acc[m][j] = Splat(0.0f);
  const float* pk = panel + v * kLanes;
  for (int64_t k = 0; k < K; ++k, pk += kPanel) {
    V wv[NV];
    for (int j = 0; j < NV; ++j) wv[j] = Load(pk + j * kLanes);
    for (int m = 0; m < MR; ++m) {
      const V xs = Splat(x[m * K + k]);
      for (int j = 0; j < NV; ++j) acc[m][j] += xs * wv[j];
    }
  }
  const VI lane = Iota();
  for (int j = 0; j < NV; ++j) {
    const int64_t cj = c + j * kLanes;
    const V bias = Load(b + j * kLanes);
    const VI padded = lane + int32_t(cj) >= int32_t(valid);
    for (int m = 0; m < MR; ++m) {
      V y = acc[m][j] + bias;
      if (cj + kLanes > valid) y = padded ? Splat(-std::numeric_limits<float>::max()) : y;
      Store(yp + m * ldy + j * kLanes, y);
      if (cj + kLanes <= end) {
        Take(best[m], y, cj);
      } else if (cj < end) {  // the last panel's columns past N are zero padding, not logits
        y = lane + int32_t(cj) < int32_t(end) ? y : Splat(-INFINITY);
        Take(best[m], y, cj);
      }
    }
  }
}

// Rows [0, M) of panel p's 64 columns, into yp (row stride ldy); best: M running argmaxes.
void Panel(const float* x, int64_t M, int64_t K, const float* panel, float* yp, int64_t ldy, const float* b,
           int64_t p, int64_t valid, int64_t end, Best* best) {
  for (int64_t v = 0; v < kPV; v += kNV) {
    const int64_t c = p * kPanel + v * kLanes;
    const float* bv = b + c;
    int64_t m = 0;
    for (; m + kMR <= M; m += kMR)
      Tile<kMR, kNV>(x + m * K, K, panel, v, yp + m * ldy + v * kLanes, ldy, bv, c, valid, end, best + m);
    const float* xm = x + m * K;
    float* ym = yp + m * ldy + v * kLanes;
    switch (M - m) {  // the rows left over: a smaller tile
      case 5: Tile<5, kNV>(xm, K, panel, v, ym, ldy, bv, c, valid, end, best + m); break;
      case 4: Tile<4, kNV>(xm, K, panel, v, ym, ldy, bv, c, valid, end, best + m); break;
      case 3: Tile<3, kNV>(xm, K, panel, v, ym, ldy, bv, c, valid, end, best + m); break;
      case 2: Tile<2, kNV>(xm, K, panel, v, ym, ldy, bv, c, valid, end, best + m); break;
      case 1: Tile<1, kNV>(xm, K, panel, v, ym, ldy, bv, c, valid, end, best + m); break;
    }
  }
}

ffi::Error PanelMatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                           ffi::Buffer<ffi::F32> b, ffi::ResultBuffer<ffi::F32> y, ffi::ResultBuffer<ffi::S32> top,
                           int64_t valid) {
  auto xd = x.dimensions();   // (M, K)
  auto wd = w.dimensions();   // (P, K, 64)
  auto yd = y->dimensions();  // (M, N)
  if (xd.size() != 2 || wd.size() != 3 || yd.size() != 2 || wd[1] != xd[1] || wd[2] != kPanel || yd[0] != xd[0] ||
      (yd[1] + kPanel - 1) / kPanel != wd[0] || b.dimensions().size() != 1 || b.dimensions()[0] != wd[0] * kPanel ||
      top->dimensions().size() != 1 || top->dimensions()[0] != xd[0])
    return ffi::Error::InvalidArgument("panel matmul: x (M, K), panels (ceil(N / 64), K, 64), bias (ceil(N / 64) * 64) "
                                       "-> y (M, N), argmax (M)");
  const int64_t M = xd[0], K = xd[1], P = wd[0], N = yd[1];
  const float* xp = x.typed_data();
  const float* wp = w.typed_data();
  const float* bp = b.typed_data();
  float* yp = y->typed_data();
  // one part a pool thread, each at least 256K weights (a 1 MB read): the hand-off is worth it
  const int64_t parts = std::min<int64_t>(P, Parts(pool, P * K * kPanel, int64_t(1) << 18));
  std::vector<float> part_val(parts * M);
  std::vector<int64_t> part_col(parts * M);
  ParallelParts(pool, parts, P, [&](int64_t part, int64_t lo, int64_t hi) {
    std::vector<Best> best(M, NewBest());
    for (int64_t p = lo; p < hi; ++p) {
      const float* panel = wp + p * K * kPanel;
      if ((p + 1) * kPanel <= N) {
        Panel(xp, M, K, panel, yp + p * kPanel, N, bp, p, valid, N, best.data());
        continue;
      }
      // the last panel, past N: computed into a scratch row block, its first N - p * 64 columns copied
      const int64_t cols = N - p * kPanel;
      float scratch[kMR * kPanel];
      for (int64_t m0 = 0; m0 < M; m0 += kMR) {
        const int64_t rows = std::min<int64_t>(kMR, M - m0);
        Panel(xp + m0 * K, rows, K, panel, scratch, kPanel, bp, p, valid, N, best.data() + m0);
        for (int64_t m = 0; m < rows; ++m) std::memcpy(yp + (m0 + m) * N + p * kPanel, scratch + m * kPanel, cols * 4);
      }
    }
    for (int64_t m = 0; m < M; ++m) Reduce(best[m], &part_val[part * M + m], &part_col[part * M + m]);
  });
  int32_t* tp = top->typed_data();
  for (int64_t m = 0; m < M; ++m) {  // the parts in column order: a later part wins only by a greater value
    float v = part_val[m];
    int64_t c = part_col[m];
    for (int64_t q = 1; q < parts && !std::isnan(v); ++q) {
      const float u = part_val[q * M + m];
      if (std::isnan(u) || u > v) v = u, c = part_col[q * M + m];
    }
    tp[m] = int32_t(c);
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxgptPanelMatmul, PanelMatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()   // x (M, K)
                                  .Arg<ffi::Buffer<ffi::F32>>()   // panels (ceil(N / 64), K, 64)
                                  .Arg<ffi::Buffer<ffi::F32>>()   // bias (ceil(N / 64) * 64)
                                  .Ret<ffi::Buffer<ffi::F32>>()   // y (M, N)
                                  .Ret<ffi::Buffer<ffi::S32>>()   // argmax (M)
                                  .Attr<int64_t>("valid"));       // columns from here on: float32's minimum
