// GMMFormer v2's learned-query summary attention on packed tokens, on CPU (prvrlab/models/summary_pool.py
// builds and calls it).  With x (K, N, D) the K branches' packed tokens, the tokens of video b at rows
// [off[b], off[b + 1]) of every branch, H heads:
//   pool:      out[k, b, h, :] = sum_{n of b} p[k, n, h] * x[k, n, :]
//   its backward, given g (K, B, H, D):
//              dx[k, n, :] = sum_h p[k, n, h] * g[k, b, h, :],    dp[k, n, h] = g[k, b, h, :] . x[k, n, :]
// Each reads x once and writes each output once, sums in float32, one rounding per output element.  As
// batched products on a padded copy of x these have an inner or outer size of H (4).
//
// Layouts, contiguous: x, dx (K, N, D), p, dp (K, N, H), out, g (K, B, H, D) bfloat16 (uint16 storage,
// rounded to nearest even); off (B + 1,) int64, non-decreasing from 0 to N.  A null output is not
// wanted.  Threads: ranges of (branch, video) pairs.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "native_common.h"

namespace {

using prvrlab::load;
using prvrlab::store;
using T = uint16_t;  // bfloat16 bits

void pool(const T* p, const T* x, const int64_t* off, T* out, int64_t K, int64_t N, int64_t B, int64_t H, int64_t D,
          int threads) {
  prvrlab::run_parallel(K * B, threads, [&](int, int64_t lo, int64_t hi) {
    std::vector<float> acc(H * D), row(D);
    float* __restrict a = acc.data();
    float* __restrict xf = row.data();
    for (int64_t kb = lo; kb < hi; ++kb) {
      const int64_t k = kb / B, b = kb % B;
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t n = off[b]; n < off[b + 1]; ++n) {
        const T* __restrict xr = x + (k * N + n) * D;
        for (int64_t d = 0; d < D; ++d) xf[d] = load(xr, d);
        for (int64_t h = 0; h < H; ++h) {
          const float w = load(p, (k * N + n) * H + h);
          float* __restrict ah = a + h * D;
          for (int64_t d = 0; d < D; ++d) ah[d] += w * xf[d];
        }
      }
      T* o = out + kb * H * D;
      for (int64_t i = 0; i < H * D; ++i) store(o, i, a[i]);
    }
  });
}

void pool_backward(const T* g, const T* p, const T* x, const int64_t* off, T* dx, T* dp, int64_t K, int64_t N,
                   int64_t B, int64_t H, int64_t D, int threads) {
  prvrlab::run_parallel(K * B, threads, [&](int, int64_t lo, int64_t hi) {
    std::vector<float> gbuf(H * D), row(D), xrow(D);
    float* __restrict gf = gbuf.data();
    float* __restrict r = row.data();
    float* __restrict xf = xrow.data();
    for (int64_t kb = lo; kb < hi; ++kb) {
      const int64_t k = kb / B, b = kb % B;
      const T* gk = g + kb * H * D;
      for (int64_t i = 0; i < H * D; ++i) gf[i] = load(gk, i);
      for (int64_t n = off[b]; n < off[b + 1]; ++n) {
        const int64_t t = k * N + n;
        if (dp) {
          const T* __restrict xr = x + t * D;
          for (int64_t d = 0; d < D; ++d) xf[d] = load(xr, d);
          for (int64_t h = 0; h < H; ++h) {
            const float* __restrict gh = gf + h * D;
            float dot = 0.0f;
            for (int64_t d = 0; d < D; ++d) dot += gh[d] * xf[d];
            store(dp, t * H + h, dot);
          }
        }
        if (!dx) continue;
        for (int64_t d = 0; d < D; ++d) r[d] = 0.0f;
        for (int64_t h = 0; h < H; ++h) {
          const float w = load(p, t * H + h);
          const float* __restrict gh = gf + h * D;
          for (int64_t d = 0; d < D; ++d) r[d] += w * gh[d];
        }
        T* o = dx + t * D;
        for (int64_t d = 0; d < D; ++d) store(o, d, r[d]);
      }
    }
  });
}

}  // namespace

extern "C" {

int prvrlab_summary_pool_abi() { return 1; }

void prvrlab_summary_pool(const void* p, const void* x, const int64_t* off, void* out, int64_t K, int64_t N,
                          int64_t B, int64_t H, int64_t D, int threads) {
  pool(static_cast<const T*>(p), static_cast<const T*>(x), off, static_cast<T*>(out), K, N, B, H, D, threads);
}

void prvrlab_summary_pool_backward(const void* g, const void* p, const void* x, const int64_t* off, void* dx,
                                   void* dp, int64_t K, int64_t N, int64_t B, int64_t H, int64_t D, int threads) {
  pool_backward(static_cast<const T*>(g), static_cast<const T*>(p), static_cast<const T*>(x), off,
                static_cast<T*>(dx), static_cast<T*>(dp), K, N, B, H, D, threads);
}

}  // extern "C"
