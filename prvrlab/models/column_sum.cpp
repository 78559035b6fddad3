// Column sums of a bfloat16 matrix on CPU (a linear layer's bias gradient, the sum of its output gradient
// over the rows; prvrlab/models/column_sum.py builds and calls it): out[c] = sum_n x[n, c] in float32.
// Each thread sums a contiguous range of rows into its own float32 row; the rows are added in thread
// order at the end.  ATen's bf16 sum over dim 0 of a wide matrix reads it at a third of the memory's
// speed ((9786, 9216): 25 ms, against 13.5 ms for a full copy).
//
// prvrlab_relu_grad_column_sum first applies a ReLU's backward in place, g = h <= 0 ? 0 : g (ATen's
// threshold_backward at 0: a NaN h keeps its g), and sums the result: the ReLU's backward and the bias
// gradient of the layer before it in one pass (h: the ReLU's output, or any tensor positive where it passed).
//
// Layout: x, g, h (N, C) contiguous bfloat16 (uint16 storage); out (C,) float32.
#include <cstdint>
#include <vector>

#include "native_common.h"

namespace {

// out[c] = the float32 sum over rows n of what row_fn(n, acc) adds into acc[c] (acc: C floats of the calling
// thread; the threads' rows are added in thread order at the end).
template <typename F>
void sum_rows(float* out, int64_t N, int64_t C, int threads, F row_fn) {
  const int64_t parts = threads > 1 ? threads : 1;
  std::vector<float> partial(static_cast<size_t>(parts * C), 0.0f);
  prvrlab::run_parallel(
      N, threads,
      [&](int worker, int64_t lo, int64_t hi) {
        float* __restrict acc = partial.data() + worker * C;
        for (int64_t n = lo; n < hi; ++n) row_fn(n, acc);
      },
      64);
  for (int64_t c = 0; c < C; ++c) {
    float s = 0.0f;
    for (int64_t w = 0; w < parts; ++w) s += partial[w * C + c];
    out[c] = s;
  }
}

}  // namespace

extern "C" {

int prvrlab_column_sum_abi() { return 1; }

void prvrlab_column_sum(const void* x, float* out, int64_t N, int64_t C, int threads) {
  const uint16_t* v = static_cast<const uint16_t*>(x);
  sum_rows(out, N, C, threads, [&](int64_t n, float* __restrict acc) {
    const uint16_t* __restrict row = v + n * C;
    for (int64_t c = 0; c < C; ++c) acc[c] += prvrlab::load(row, c);
  });
}

// g = h <= 0 ? 0 : g in place (on the bits: a NaN h keeps g), then out = the column sums of g.
void prvrlab_relu_grad_column_sum(void* g, const void* h, float* out, int64_t N, int64_t C, int threads) {
  uint16_t* gv = static_cast<uint16_t*>(g);
  const uint16_t* hv = static_cast<const uint16_t*>(h);
  sum_rows(out, N, C, threads, [&](int64_t n, float* __restrict acc) {
    uint16_t* __restrict grow = gv + n * C;
    const uint16_t* __restrict hrow = hv + n * C;
    for (int64_t c = 0; c < C; ++c) {
      const uint16_t bits = hrow[c], magnitude = bits & 0x7fffu;
      const bool keep = magnitude > 0x7f80u || (!(bits & 0x8000u) && magnitude != 0);  // NaN, or above 0
      grow[c] = keep ? grow[c] : static_cast<uint16_t>(0);
      acc[c] += prvrlab::load(grow, c);
    }
  });
}

}  // extern "C"
