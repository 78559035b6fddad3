// GMMFormer's Gaussian-windowed attention weights on CPU, fused: forward and backward of
//     P = softmax_j(S_ij * W_ij  [-inf where key j is padding]),   Pd = P * dropout mask
// per (batch, branch, head) matrix, one row at a time, each element read and written once
// (prvrlab/models/window_softmax.py builds and calls it; prvrlab/models/gmm.py documents the attention).
//
// Layouts: S, P, Pd, dPd, dS (M, L, L) with M = B * K * H matrices, contiguous, float32 or bfloat16
// (uint16 storage, rounded to nearest even); W float32 (L, L) blocks at W + b * w_b + k * w_k, or null
// for the scalar `scale`; keys (B, L) uint8 (1: a key attention may look at) or null for all; rows (B,)
// int64 real query rows per batch entry (rows beyond are written as zeros) or null for all; draw int16
// (L, L) blocks at draw + b * d_b + k * d_k + h * L * L, or null: no dropout.  A key survives dropout
// when its draw is >= `threshold` and is then scaled by `keep` (prvrlab.models.blocks.mask_from_draw).
// Non-finite values follow GaussianAttention's PyTorch path (softmax of S * W plus a huge finite negative
// bias on padded keys): a row where some product S_ij * W_ij, padded key or not, is NaN or +inf gets NaN
// weights; a -inf product weighs 0; a row whose real keys all have -inf (or no real keys) is uniform
// over its keys whose product is not -inf, and NaN when there are none.  The build assumes finite
// arithmetic, so every product is classified on its bits.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <climits>
#include <cstring>
#include <limits>
#include <vector>

#include "native_common.h"

namespace {

using prvrlab::load;
using prvrlab::store;

inline uint32_t bits_of(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  return bits;
}

struct Args {
  const void* S;
  const void* P;
  const void* dPd;
  void* out;   // forward: P; backward: dS
  void* out2;  // forward: Pd (null without dropout)
  const float* W;
  int64_t w_b, w_k;
  float scale;
  const uint8_t* keys;
  const int64_t* rows;
  const int16_t* draw;
  int64_t d_b, d_k;
  int32_t threshold;
  float keep;
  int64_t B, K, H, L;
};

// The pieces of matrix m = (b, k, h) a row needs; every pointer valid (each_row stands in rows of the
// scale, of all-true keys and of a draw that keeps everything where the caller gave none).
struct Matrix {
  const float* w;
  int64_t w_row;  // L, or 0 for the scale row
  const uint8_t* keys;
  const int16_t* draw;
  int64_t d_row;  // L, or 0 for the keep-all row
  int64_t rows, offset;
};

// fn(matrix, i, row, buffer) for every real query row i of every matrix (row: the offset of its first
// element; buffer: L floats of the calling thread), in parallel over matrices; the outputs' rows at or
// beyond the matrix's real rows are written as zeros.
template <typename T, typename F>
void each_row(const Args& a, int threads, F fn) {
  const int64_t L = a.L;
  prvrlab::run_parallel(a.B * a.K * a.H, threads, [&](int, int64_t lo, int64_t hi) {
    std::vector<float> buffer(L), scale(L, a.scale);
    std::vector<uint8_t> all_keys(L, 1);
    std::vector<int16_t> keep_all(L, INT16_MAX);
    for (int64_t m = lo; m < hi; ++m) {
      const int64_t b = m / (a.K * a.H), k = (m / a.H) % a.K, h = m % a.H;
      const Matrix mx{a.W ? a.W + b * a.w_b + k * a.w_k : scale.data(),
                      a.W ? L : 0,
                      a.keys ? a.keys + b * L : all_keys.data(),
                      a.draw ? a.draw + b * a.d_b + k * a.d_k + h * L * L : keep_all.data(),
                      a.draw ? L : 0,
                      a.rows ? a.rows[b] : L,
                      m * L * L};
      for (int64_t i = 0; i < L; ++i) {
        const int64_t row = mx.offset + i * L;
        if (i < mx.rows) {
          fn(mx, i, row, buffer.data());
          continue;
        }
        for (void* out : {a.out, a.out2})
          if (out) std::memset(static_cast<T*>(out) + row, 0, L * sizeof(T));
      }
    }
  });
}

// v as stored in T and read back (bf16: rounded to nearest even).
inline float rounded(float v, float*) { return v; }
inline float rounded(float v, uint16_t*) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
  bits = nan ? bits : (bits + 0x7fffu + ((bits >> 16) & 1u)) & 0xffff0000u;
  float r;
  std::memcpy(&r, &bits, sizeof r);
  return r;
}

// Into x (L), the weights of a row of logits s and window w with a non-finite product or no real key
// (module comment).
template <typename T>
void special_row(const T* s, const float* w, const uint8_t* keys, int64_t L, float* x) {
  float top = -std::numeric_limits<float>::max();
  int64_t bad = 0, real = 0, not_minus_inf = 0;
  for (int64_t j = 0; j < L; ++j) {
    x[j] = load(s, j) * w[j];
    const uint32_t bits = bits_of(x[j]);
    const bool non_finite = (bits & 0x7f800000u) == 0x7f800000u, minus_inf = bits == 0xff800000u;
    bad += non_finite && !minus_inf;
    not_minus_inf += !minus_inf;
    if (keys[j] && !non_finite) {
      ++real;
      top = std::max(top, x[j]);
    }
  }
  if (bad || !real) {  // NaN weights, or uniform ones over the keys not at -inf
    const bool none = bad || !not_minus_inf;
    const float u = none ? std::numeric_limits<float>::quiet_NaN() : 1.0f / static_cast<float>(not_minus_inf);
    for (int64_t j = 0; j < L; ++j) x[j] = none || bits_of(x[j]) != 0xff800000u ? u : 0.0f;
    return;
  }
  float sum = 0.0f;  // the softmax over the real keys with finite products; the -inf ones weigh 0
  for (int64_t j = 0; j < L; ++j) {
    const bool take = keys[j] && (bits_of(x[j]) & 0x7f800000u) != 0x7f800000u;
    x[j] = take ? prvrlab::exp_fast(x[j] - top) : 0.0f;
    sum += x[j];
  }
  for (int64_t j = 0; j < L; ++j) x[j] /= sum;
}

template <typename T>
void forward(const Args& a, int threads) {
  const int64_t L = a.L;
  const int16_t threshold = static_cast<int16_t>(a.draw ? a.threshold : INT16_MIN);
  const float keep = a.keep;
  each_row<T>(a, threads, [&](const Matrix& mx, int64_t i, int64_t row, float* x) {
    const T* s = static_cast<const T*>(a.S) + row;
    const float* w = mx.w + i * mx.w_row;
    const float lowest = -std::numeric_limits<float>::max();
    float top = lowest;
    uint32_t odd = 0;  // nonzero once some product is not finite
    int64_t valid = 0;
    for (int64_t j = 0; j < L; ++j) {
      const float v = load(s, j) * w[j];
      odd |= (bits_of(v) & 0x7f800000u) == 0x7f800000u;
      valid += mx.keys[j];
      x[j] = mx.keys[j] ? v : lowest;
      top = std::max(top, x[j]);
    }
    if (odd || !valid) {
      special_row(s, w, mx.keys, L, x);
    } else {
      float sum = 0.0f;
      for (int64_t j = 0; j < L; ++j) {
        const float e = mx.keys[j] ? prvrlab::exp_fast(x[j] - top) : 0.0f;
        x[j] = e;
        sum += e;
      }
      const float inv = 1.0f / sum;
      for (int64_t j = 0; j < L; ++j) x[j] *= inv;
    }
    T* p = static_cast<T*>(a.out) + row;
    for (int64_t j = 0; j < L; ++j) store(p, j, x[j]);
    if (!a.out2) return;
    T* pd = static_cast<T*>(a.out2) + row;
    const int16_t* d = mx.draw + i * mx.d_row;
    for (int64_t j = 0; j < L; ++j) {  // a dropped NaN stays NaN, as PyTorch's multiply by the mask gives
      const float v = rounded(x[j], p);
      store(pd, j, prvrlab::keep_or_drop(v, d[j] >= threshold, keep));
    }
  });
}

template <typename T>
void backward(const Args& a, int threads) {
  const int64_t L = a.L;
  const int16_t threshold = static_cast<int16_t>(a.draw ? a.threshold : INT16_MIN);
  const float keep = a.draw ? a.keep : 1.0f;
  each_row<T>(a, threads, [&](const Matrix& mx, int64_t i, int64_t row, float* g) {
    const T* p = static_cast<const T*>(a.P) + row;
    const T* dpd = static_cast<const T*>(a.dPd) + row;
    const float* w = mx.w + i * mx.w_row;
    const int16_t* d = mx.draw + i * mx.d_row;
    for (int64_t j = 0; j < L; ++j) {  // a dropped NaN or inf gradient gives NaN, as in PyTorch
      const float v = load(dpd, j);
      g[j] = prvrlab::keep_or_drop(v, d[j] >= threshold, keep);
    }
    float dot = 0.0f;
    for (int64_t j = 0; j < L; ++j) dot += load(p, j) * g[j];
    T* ds = static_cast<T*>(a.out) + row;
    for (int64_t j = 0; j < L; ++j) store(ds, j, load(p, j) * (g[j] - dot) * w[j]);
  });
}

}  // namespace

extern "C" {

int prvrlab_softmax_abi() { return 1; }

// P (and Pd) from S; bf16 != 0: bfloat16 tensors, else float32.
void prvrlab_softmax_forward(const void* S, void* P, void* Pd, const float* W, int64_t w_b, int64_t w_k, float scale,
                             const uint8_t* keys, const int64_t* rows, const int16_t* draw, int64_t d_b, int64_t d_k,
                             int32_t threshold, float keep, int64_t B, int64_t K, int64_t H, int64_t L, int bf16,
                             int threads) {
  const Args a{S, nullptr, nullptr, P, Pd, W, w_b, w_k, scale, keys, rows, draw, d_b, d_k, threshold, keep, B, K, H, L};
  if (bf16)
    forward<uint16_t>(a, threads);
  else
    forward<float>(a, threads);
}

// dS from dPd and the saved P.
void prvrlab_softmax_backward(const void* P, const void* dPd, void* dS, const float* W, int64_t w_b, int64_t w_k,
                              float scale, const int64_t* rows, const int16_t* draw, int64_t d_b, int64_t d_k,
                              int32_t threshold, float keep, int64_t B, int64_t K, int64_t H, int64_t L, int bf16,
                              int threads) {
  const Args a{nullptr, P, dPd, dS, nullptr, W, w_b, w_k, scale, nullptr, rows, draw, d_b, d_k, threshold, keep,
               B, K, H, L};
  if (bf16)
    backward<uint16_t>(a, threads);
  else
    backward<float>(a, threads);
}

}  // extern "C"
