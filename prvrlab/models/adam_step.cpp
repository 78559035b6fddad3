// One update of the reference optimiser (BertAdam: Adam without bias correction, decoupled weight decay) over
// a list of float32 CPU tensors in one pass (prvrlab/models/adam_step.py builds and calls it):
//     g = grad * scale[t]                       (scale[t]: tensor t's clipping factor, 1 without clipping)
//     m = m * b1 + (1 - b1) g                   v = v * b2 + (1 - b2) g g
//     u = m / (sqrt(v) + eps) + wd p            p = p - lr u
// Each element is read once and written once where the foreach form of the same update makes nine passes
// over memory.  Each operation rounds as ATen's AVX2 / AVX-512 element-wise op of the foreach form does (built
// without -ffast-math and with -ffp-contract=off, prvrlab/models/native.py): products and sums rounded one by one,
// an add with alpha (m + (1 - b1) g, u + wd p, p - lr u) as ATen's vectorised fmadd, one rounding, and the
// addcmul v + ((1 - b2) g) g as ATen's build contracts it, ((1 - b2) g) rounded, then one fused multiply-add.
// One difference: the square root here is IEEE (correctly rounded); ATen's vectorised one is not (MKL's: one ulp
// off for ~0.7% of elements on an AMX Xeon), so an element's update can differ from the foreach form's in its
// last bit.
//
// Layout: count tensors, each a contiguous float32 array of sizes[t] elements, given by four arrays of
// pointers (params, grads, exp_avg, exp_avg_sq).  Threads: contiguous ranges of the tensors' elements
// laid end to end.
#include <cmath>
#include <cstdint>
#include <vector>

#include "native_common.h"

namespace {

constexpr int64_t kGrain = 1 << 15;  // elements per thread at least

struct Step {
  float b1, one_minus_b1, b2, one_minus_b2, eps, weight_decay, minus_lr;
};

void update(float* __restrict p, const float* __restrict grad, float* __restrict m, float* __restrict v,
            int64_t n, float scale, const Step& s) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = grad[i] * scale;
    const float mi = std::fma(s.one_minus_b1, g, m[i] * s.b1);
    const float vi = std::fma(s.one_minus_b2 * g, g, v[i] * s.b2);
    const float denom = std::sqrt(vi) + s.eps;
    float u = mi / denom;
    if (s.weight_decay != 0.0f) u = std::fma(s.weight_decay, p[i], u);
    m[i] = mi;
    v[i] = vi;
    p[i] = std::fma(s.minus_lr, u, p[i]);
  }
}

}  // namespace

extern "C" {

int prvrlab_adam_step_abi() { return 1; }

void prvrlab_adam_step(float** params, float** grads, float** exp_avg, float** exp_avg_sq, const int64_t* sizes,
                       const float* scales, int64_t count, float b1, float one_minus_b1, float b2,
                       float one_minus_b2, float eps, float weight_decay, float minus_lr, int threads) {
  const Step s{b1, one_minus_b1, b2, one_minus_b2, eps, weight_decay, minus_lr};
  std::vector<int64_t> starts(static_cast<size_t>(count) + 1, 0);  // tensor t covers [starts[t], starts[t + 1])
  for (int64_t t = 0; t < count; ++t) starts[t + 1] = starts[t] + sizes[t];
  prvrlab::run_parallel(
      starts[count], threads,
      [&](int, int64_t lo, int64_t hi) {
        for (int64_t t = 0; t < count; ++t) {
          const int64_t a = std::max(lo, starts[t]), b = std::min(hi, starts[t + 1]);
          if (a >= b) continue;
          const int64_t o = a - starts[t];
          update(params[t] + o, grads[t] + o, exp_avg[t] + o, exp_avg_sq[t] + o, b - a, scales[t], s);
        }
      },
      kGrain);
}

}  // extern "C"
