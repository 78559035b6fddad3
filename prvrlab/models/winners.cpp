// The winners of max_scores' training maxima on CPU (prvrlab/models/winners.py builds and calls it;
// prvrlab/models/scoring.py documents the scores): for every (query q, video c) pair, the position l that
// wins the max over the video's L vectors of
//     the cosine  dots[q, c, l] / (q_norm[q] * v_norm[c, l])   (-inf on padding), and, with logits,
//     the raw dot dots[q, c, l]                                  (-FLT_MAX on padding),
// each as torch.argmax picks it: the first NaN if there is one, else the first of the largest values.
// One read of the (Q, C, L) dots where PyTorch made six passes (the denominators, the division, two
// masked fills, two argmax).  Built without -ffast-math (prvrlab/models/native.py, fast_math=False):
// the quotient is rounded as ATen's division rounds it (the product first, then the division) and NaN
// compares as IEEE says, so the winners are torch's, bit for bit.
//
// Layouts (contiguous): dots (Q, C, L) float32; q_norm (Q,) float32; v_norm (C, L) float32; real (C, L)
// uint8 (1: a real vector) or null for all real; out (Q, C, W) int64 with W = 2 where logits are asked
// for (out[..., 0] the cosine's winner, out[..., 1] the raw dot's), else 1.
#include <algorithm>
#include <cfloat>
#include <climits>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "native_common.h"

namespace {

// The float's place in torch.argmax's order as an int32 (larger: wins): the bits themselves for a positive
// float, the magnitude bits flipped for a negative one, both zeros equal (torch compares them equal, so the
// first wins) and every NaN above every number (the first NaN wins).  Integer arithmetic only: the loops
// that call it vectorise.
inline int32_t rank_of(float v) {
  int32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  const int32_t magnitude = bits & 0x7fffffff;
  const int32_t ordered = bits < 0 ? bits ^ 0x7fffffff : bits;
  return magnitude > 0x7f800000 ? INT32_MAX : (magnitude == 0 ? 0 : ordered);
}

// The first position of the largest rank among x[0 .. L), padding (keys[l] == 0) ranked `padding`: one max
// reduction over (rank, L - 1 - l) packed into an int64 (ties go to the least l), which vectorises;
// L < 2^31 (the caller checks).
inline int64_t first_best(const float* __restrict x, const uint8_t* __restrict keys, int32_t padding, int64_t L) {
  int64_t top = INT64_MIN;
  for (int64_t l = 0; l < L; ++l) {
    const int32_t own = rank_of(x[l]);  // read unconditionally: a masked load would not vectorise
    const int64_t rank = keys[l] ? own : padding;
    top = std::max(top, static_cast<int64_t>(static_cast<uint64_t>(rank) << 32) | (L - 1 - l));
  }
  return L - 1 - (top & 0xffffffff);
}

}  // namespace

extern "C" {

int prvrlab_winners_abi() { return 1; }

void prvrlab_winners(const float* dots, const float* q_norm, const float* v_norm, const uint8_t* real, int64_t Q,
                     int64_t C, int64_t L, int with_logits, int64_t* out, int threads) {
  const float minus_inf = -std::numeric_limits<float>::infinity();
  const int64_t W = with_logits ? 2 : 1;
  prvrlab::run_parallel(
      Q * C, threads,
      [&](int, int64_t lo, int64_t hi) {
        std::vector<float> buffer(L);
        std::vector<uint8_t> all_real(L, 1);
        float* __restrict x = buffer.data();
        for (int64_t m = lo; m < hi; ++m) {
          const int64_t q = m / C, c = m % C;
          const float* __restrict d = dots + m * L;
          const float* __restrict vn = v_norm + c * L;
          const uint8_t* __restrict keys = real ? real + c * L : all_real.data();
          const float qn = q_norm[q];
          for (int64_t l = 0; l < L; ++l) x[l] = d[l] / (qn * vn[l]);  // every quotient: the loop vectorises
          out[m * W] = first_best(x, keys, rank_of(minus_inf), L);
          if (with_logits) out[m * W + 1] = first_best(d, keys, rank_of(-FLT_MAX), L);
        }
      },
      64);
}

}  // extern "C"
