// A per-token weighted sum of K branch outputs on CPU, forward and backward (GMMFormer v2's branch
// aggregation, prvrlab/models/branch_mix.py builds and calls it):
//     out[n, :] = sum_k w[n, k] * br[k, n, :]
//     dbr[k, n, :] = w[n, k] * g[n, :],     dw[n, k] = sum_d g[n, d] * br[k, n, d]
// one token at a time, each element read once, sums in float32 and one rounding of each output.  As
// batched products these are K x 1 and 1 x K tiles, which run at a few GFLOP/s.
//
// Layouts, all contiguous bfloat16 (uint16 storage, rounded to nearest even): w, dw (N, K); br, dbr
// (K, N, D); out, g (N, D).  (In float32 the einsum is as fast: prvrlab/models/branch_mix.py.)  dw or dbr null: not wanted.  Threads: contiguous ranges of tokens.
#include <cstdint>
#include <vector>

#include "native_common.h"

namespace {

using prvrlab::load;
using prvrlab::store;

constexpr int64_t kGrain = 256;  // tokens per thread at least

template <typename T>
void forward(const T* w, const T* br, T* out, int64_t N, int64_t K, int64_t D, int threads) {
  prvrlab::run_parallel(
      N, threads,
      [&](int, int64_t lo, int64_t hi) {
        std::vector<float> acc(D);
        float* __restrict a = acc.data();
        for (int64_t n = lo; n < hi; ++n) {
          for (int64_t d = 0; d < D; ++d) a[d] = 0.0f;
          for (int64_t k = 0; k < K; ++k) {
            const float wk = load(w, n * K + k);
            const T* __restrict row = br + (k * N + n) * D;
            for (int64_t d = 0; d < D; ++d) a[d] += wk * load(row, d);
          }
          T* o = out + n * D;
          for (int64_t d = 0; d < D; ++d) store(o, d, a[d]);
        }
      },
      kGrain);
}

template <typename T>
void backward(const T* g, const T* w, const T* br, T* dbr, T* dw, int64_t N, int64_t K, int64_t D, int threads) {
  prvrlab::run_parallel(
      N, threads,
      [&](int, int64_t lo, int64_t hi) {
        std::vector<float> gbuf(D);
        float* __restrict gr = gbuf.data();
        for (int64_t n = lo; n < hi; ++n) {
          const T* gn = g + n * D;
          for (int64_t d = 0; d < D; ++d) gr[d] = load(gn, d);
          for (int64_t k = 0; k < K; ++k) {
            const int64_t row = (k * N + n) * D;
            if (dw) {
              const T* __restrict b = br + row;
              float dot = 0.0f;
              for (int64_t d = 0; d < D; ++d) dot += gr[d] * load(b, d);
              store(dw, n * K + k, dot);
            }
            if (dbr) {
              const float wk = load(w, n * K + k);
              T* __restrict o = dbr + row;
              for (int64_t d = 0; d < D; ++d) store(o, d, wk * gr[d]);
            }
          }
        }
      },
      kGrain);
}

}  // namespace

extern "C" {

int prvrlab_branch_mix_abi() { return 1; }

// out from w and br.
void prvrlab_branch_mix_forward(const void* w, const void* br, void* out, int64_t N, int64_t K, int64_t D,
                                int threads) {
  forward(static_cast<const uint16_t*>(w), static_cast<const uint16_t*>(br), static_cast<uint16_t*>(out), N, K, D,
          threads);
}

// dbr and dw (each if not null) from g, w and br.
void prvrlab_branch_mix_backward(const void* g, const void* w, const void* br, void* dbr, void* dw, int64_t N,
                                 int64_t K, int64_t D, int threads) {
  backward(static_cast<const uint16_t*>(g), static_cast<const uint16_t*>(w), static_cast<const uint16_t*>(br),
           static_cast<uint16_t*>(dbr), static_cast<uint16_t*>(dw), N, K, D, threads);
}

}  // extern "C"
