// Column sums of a bfloat16 matrix on CPU (a linear layer's bias gradient, the sum of its output gradient
// over the rows; prvrlab/models/column_sum.py builds and calls it): out[c] = sum_n x[n, c] in float32.
// Each thread sums a contiguous range of rows into its own float32 row; the rows are added in thread
// order at the end.  ATen's bf16 sum over dim 0 of a wide matrix reads it at a third of the memory's
// speed ((9786, 9216): 25 ms, against 13.5 ms for a full copy).
//
// Layout: x (N, C) contiguous bfloat16 (uint16 storage); out (C,) float32.
#include <cstdint>
#include <vector>

#include "native_common.h"

extern "C" {

int prvrlab_column_sum_abi() { return 1; }

void prvrlab_column_sum(const void* x, float* out, int64_t N, int64_t C, int threads) {
  const uint16_t* v = static_cast<const uint16_t*>(x);
  const int64_t parts = threads > 1 ? threads : 1;
  std::vector<float> partial(static_cast<size_t>(parts * C), 0.0f);
  prvrlab::run_parallel(
      N, threads,
      [&](int worker, int64_t lo, int64_t hi) {
        float* __restrict acc = partial.data() + worker * C;
        for (int64_t n = lo; n < hi; ++n) {
          const uint16_t* __restrict row = v + n * C;
          for (int64_t c = 0; c < C; ++c) acc[c] += prvrlab::load(row, c);
        }
      },
      64);
  for (int64_t c = 0; c < C; ++c) {
    float s = 0.0f;
    for (int64_t w = 0; w < parts; ++w) s += partial[w * C + c];
    out[c] = s;
  }
}

}  // extern "C"
