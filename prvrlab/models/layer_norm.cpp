// LayerNorm's forward over branches and its backward on CPU (prvrlab/models/layer_norm.py builds and calls them).
//
// Forward (branch_layer_norm's, bfloat16): rows n of (N, D), row n normalised with the affine of its branch
// n / rows_per_affine: mean = sum_j x / D, var = sum_j (x - mean)^2 / D (two passes, float32),
// rstd = 1 / sqrt(var + eps), y = (x * rstd - mean * rstd) * w + b rounded once, mean and rstd kept in
// float32 for the backward.  Layouts: x, y (N, D) bfloat16; w, b (N / rows_per_affine, D) float32 or null
// (1, 0); mean, rstd (N,) float32.
//
// Backward, fused: per row of D values, with the forward's mean and 1/std,
//     xhat = (x - mean) * rstd,   g = dy * w,
//     dx = rstd * (g - mean_j(g) - xhat * mean_j(g * xhat)),
// and the affine's gradients dw = sum_rows dy * xhat, db = sum_rows dy, every sum in float32, each input
// read once (prvrlab/models/layer_norm.py builds and calls it).
//
// Layouts: dy, x, dx (N, D) contiguous bfloat16 (uint16 storage; dx rounded to nearest even);
// mean, rstd (N,) float32; w (D,) float32 or null (no affine: 1); dw, db (D,) float32 or null (not
// wanted); dx null: not wanted.  Threads: contiguous ranges of rows, each summing dw and db into its own
// float32 row, added up at the end in thread order (the same threads, the same sums).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "native_common.h"

namespace {

using prvrlab::load;
using prvrlab::store;

using T = uint16_t;  // bfloat16 bits

void backward(const T* dy, const T* x, const float* mean, const float* rstd, const float* w, T* dx, float* dw,
              float* db, int64_t N, int64_t D, int threads) {
  const bool sums = dw != nullptr || db != nullptr;
  const int64_t parts = std::max(1, threads);
  std::vector<float> partial(sums ? static_cast<size_t>(parts * 2 * D) : 0, 0.0f);  // per thread: dw, db
  prvrlab::run_parallel(
      N, threads,
      [&](int worker, int64_t lo, int64_t hi) {
        std::vector<float> xhat(D), g(D), ones(D, 1.0f), sink(2 * D);
        const float* __restrict wr = w ? w : ones.data();
        float* __restrict pw = sums ? partial.data() + worker * 2 * D : sink.data();  // sink: sums not wanted
        float* __restrict pb = pw + D;
        float* __restrict xh = xhat.data();
        float* __restrict gr = g.data();
        for (int64_t n = lo; n < hi; ++n) {
          const T* __restrict dyr = dy + n * D;
          const T* __restrict xr = x + n * D;
          const float m = mean[n], r = rstd[n];
          float a = 0.0f, c = 0.0f;
          for (int64_t j = 0; j < D; ++j) {
            const float d = load(dyr, j), h = (load(xr, j) - m) * r, gj = d * wr[j];
            xh[j] = h;
            gr[j] = gj;
            pw[j] += d * h;
            pb[j] += d;
            a += gj;
            c += gj * h;
          }
          if (!dx) continue;
          const float inv = 1.0f / static_cast<float>(D), ma = a * inv, mc = c * inv;
          T* out = dx + n * D;
          for (int64_t j = 0; j < D; ++j) store(out, j, r * (gr[j] - ma - xh[j] * mc));
        }
      },
      64);
  if (!sums) return;
  for (int64_t j = 0; j < D; ++j) {
    float sw = 0.0f, sb = 0.0f;
    for (int64_t t = 0; t < parts; ++t) {
      sw += partial[t * 2 * D + j];
      sb += partial[t * 2 * D + D + j];
    }
    if (dw) dw[j] = sw;
    if (db) db[j] = sb;
  }
}

void forward(const T* x, const float* w, const float* b, T* y, float* mean, float* rstd, int64_t N, int64_t D,
             int64_t rows_per_affine, float eps, int threads) {
  prvrlab::run_parallel(
      N, threads,
      [&](int, int64_t lo, int64_t hi) {
        std::vector<float> row(D), ones(D, 1.0f), zeros(D, 0.0f);
        float* __restrict v = row.data();
        for (int64_t n = lo; n < hi; ++n) {
          const int64_t branch = n / rows_per_affine;
          const float* __restrict wr = w ? w + branch * D : ones.data();
          const float* __restrict br = b ? b + branch * D : zeros.data();
          const T* __restrict xr = x + n * D;
          float sum = 0.0f;
          for (int64_t j = 0; j < D; ++j) {
            v[j] = load(xr, j);
            sum += v[j];
          }
          const float m = sum / static_cast<float>(D);
          float squares = 0.0f;
          for (int64_t j = 0; j < D; ++j) squares += (v[j] - m) * (v[j] - m);
          const float r = 1.0f / std::sqrt(squares / static_cast<float>(D) + eps), shift = -m * r;
          T* __restrict out = y + n * D;
          for (int64_t j = 0; j < D; ++j) store(out, j, (v[j] * r + shift) * wr[j] + br[j]);
          mean[n] = m;
          rstd[n] = r;
        }
      },
      64);
}

}  // namespace

extern "C" {

int prvrlab_layer_norm_abi() { return 1; }

// y, mean, rstd of a LayerNorm over the last dim of bfloat16 (N, D), row n with the affine row n / rows_per_affine.
void prvrlab_layer_norm_forward(const void* x, const float* w, const float* b, void* y, float* mean, float* rstd,
                                int64_t N, int64_t D, int64_t rows_per_affine, float eps, int threads) {
  forward(static_cast<const T*>(x), w, b, static_cast<T*>(y), mean, rstd, N, D, rows_per_affine, eps, threads);
}

// dx (if not null), dw and db (each if not null) of a LayerNorm over the last dim of bfloat16 (N, D).
void prvrlab_layer_norm_backward(const void* dy, const void* x, const float* mean, const float* rstd,
                                 const float* w, void* dx, float* dw, float* db, int64_t N, int64_t D,
                                 int threads) {
  backward(static_cast<const T*>(dy), static_cast<const T*>(x), mean, rstd, w, static_cast<T*>(dx), dw, db, N, D,
           threads);
}

}  // extern "C"
