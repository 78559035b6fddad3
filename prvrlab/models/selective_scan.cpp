// The selective scan on CPU, fused: forward and backward of
//     h_t = exp(delta_t A) * h_{t-1} + delta_t x_t B_t,   y_t = <C_t, h_t>
// per channel, never materialising an (L, E, N) tensor (prvrlab/models/fused_scan.py builds and
// calls it; prvrlab/models/mamba.py documents the recurrence and its adjoint).
//
// Layouts (float32, contiguous): x, delta, y, dy, dx, ddelta (B, L, E); At (N, E) = A transposed;
// Bm, C, dB, dC (B, L, N); entering (K, B, N, E): the state entering each chunk of `chunk` steps;
// dAt (threads, N, E): one partial sum of dL/dA^T per thread, summed by the caller.
//
// Work is split by sequences (each thread owns whole sequences, so dB and dC need no locks) and,
// within a sequence, by blocks of EB channels whose N-dimensional states stay in registers / L1:
// every inner loop runs over the EB channels of a block and is vectorised by the compiler.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "native_common.h"

namespace {

constexpr int EB = 16;  // channels per block: two AVX2 / one AVX-512 vector

struct Dims {
  int64_t B, L, E, N, chunk;
};

// Channel block [e0, e0 + EB) of row r of a (rows, E) matrix into a zero-padded local array.
inline void load(const float* src, int64_t e0, int64_t E, float* dst) {
  const int64_t w = std::min<int64_t>(EB, E - e0);
  for (int j = 0; j < EB; ++j) dst[j] = j < w ? src[e0 + j] : 0.0f;
}

inline void store(const float* src, int64_t e0, int64_t E, float* dst) {
  const int64_t w = std::min<int64_t>(EB, E - e0);
  for (int64_t j = 0; j < w; ++j) dst[e0 + j] = src[j];
}

}  // namespace

extern "C" {

int prvrlab_scan_abi() { return 1; }

void prvrlab_scan_forward(const float* x, const float* delta, const float* At, const float* Bm, const float* C,
                          float* y, float* entering, int64_t B, int64_t L, int64_t E, int64_t N, int64_t chunk,
                          int threads) {
  const Dims d{B, L, E, N, chunk};
  prvrlab::run_parallel(B, threads, [&](int, int64_t lo, int64_t hi) {
    std::vector<float> h(d.N * EB), a(d.N * EB);
    float dv[EB], xv[EB], u[EB], yv[EB];
    for (int64_t b = lo; b < hi; ++b) {
      for (int64_t e0 = 0; e0 < d.E; e0 += EB) {
        for (int64_t n = 0; n < d.N; ++n) load(At + n * d.E, e0, d.E, &a[n * EB]);
        std::fill(h.begin(), h.end(), 0.0f);
        for (int64_t t = 0; t < d.L; ++t) {
          if (t % d.chunk == 0) {
            float* dst = entering + ((t / d.chunk) * d.B + b) * d.N * d.E;
            for (int64_t n = 0; n < d.N; ++n) store(&h[n * EB], e0, d.E, dst + n * d.E);
          }
          const int64_t row = b * d.L + t;
          load(delta + row * d.E, e0, d.E, dv);
          load(x + row * d.E, e0, d.E, xv);
          for (int j = 0; j < EB; ++j) {
            u[j] = dv[j] * xv[j];
            yv[j] = 0.0f;
          }
          const float* bt = Bm + row * d.N;
          const float* ct = C + row * d.N;
          for (int64_t n = 0; n < d.N; ++n) {
            float* hn = &h[n * EB];
            const float* an = &a[n * EB];
            const float bn = bt[n], cn = ct[n];
            for (int j = 0; j < EB; ++j) {
              hn[j] = prvrlab::exp_fast(dv[j] * an[j]) * hn[j] + u[j] * bn;
              yv[j] += cn * hn[j];
            }
          }
          store(yv, e0, d.E, y + row * d.E);
        }
      }
    }
  });
}

void prvrlab_scan_backward(const float* x, const float* delta, const float* At, const float* Bm, const float* C,
                           const float* entering, const float* dy, float* dx, float* ddelta, float* dAt, float* dB,
                           float* dC, int64_t B, int64_t L, int64_t E, int64_t N, int64_t chunk, int threads) {
  const Dims d{B, L, E, N, chunk};
  const int64_t K = (d.L + d.chunk - 1) / d.chunk;
  std::fill(dB, dB + d.B * d.L * d.N, 0.0f);
  std::fill(dC, dC + d.B * d.L * d.N, 0.0f);
  prvrlab::run_parallel(B, threads, [&](int worker, int64_t lo, int64_t hi) {
    // Per block: the chunk's states and decays (T, N, EB), the adjoint carried between steps (N, EB).
    std::vector<float> a(d.N * EB), h0(d.N * EB), hs(d.chunk * d.N * EB), decay(d.chunk * d.N * EB);
    std::vector<float> carry(d.N * EB), dA(d.N * EB);
    float dv[EB], xv[EB], u[EB], g[EB], dyv[EB], du[EB], dd[EB];
    float* dAt_mine = dAt + worker * d.N * d.E;
    for (int64_t b = lo; b < hi; ++b) {
      for (int64_t e0 = 0; e0 < d.E; e0 += EB) {
        for (int64_t n = 0; n < d.N; ++n) load(At + n * d.E, e0, d.E, &a[n * EB]);
        std::fill(carry.begin(), carry.end(), 0.0f);
        std::fill(dA.begin(), dA.end(), 0.0f);
        for (int64_t k = K - 1; k >= 0; --k) {
          const int64_t t0 = k * d.chunk, T = std::min(d.chunk, d.L - t0);
          const float* src = entering + (k * d.B + b) * d.N * d.E;
          for (int64_t n = 0; n < d.N; ++n) load(src + n * d.E, e0, d.E, &h0[n * EB]);
          for (int64_t s = 0; s < T; ++s) {  // recompute the chunk's states and decays
            const int64_t row = b * d.L + t0 + s;
            load(delta + row * d.E, e0, d.E, dv);
            load(x + row * d.E, e0, d.E, xv);
            const float* bt = Bm + row * d.N;
            for (int64_t n = 0; n < d.N; ++n) {
              const float* prev = s ? &hs[((s - 1) * d.N + n) * EB] : &h0[n * EB];
              float* hn = &hs[(s * d.N + n) * EB];
              float* dn = &decay[(s * d.N + n) * EB];
              const float* an = &a[n * EB];
              const float bn = bt[n];
              for (int j = 0; j < EB; ++j) {
                dn[j] = prvrlab::exp_fast(dv[j] * an[j]);
                hn[j] = dn[j] * prev[j] + dv[j] * xv[j] * bn;
              }
            }
          }
          for (int64_t s = T - 1; s >= 0; --s) {  // the adjoint, backwards through the chunk
            const int64_t row = b * d.L + t0 + s;
            load(delta + row * d.E, e0, d.E, dv);
            load(x + row * d.E, e0, d.E, xv);
            load(dy + row * d.E, e0, d.E, dyv);
            for (int j = 0; j < EB; ++j) {
              u[j] = dv[j] * xv[j];
              du[j] = 0.0f;
              dd[j] = 0.0f;
            }
            const float* bt = Bm + row * d.N;
            const float* ct = C + row * d.N;
            float* dbt = dB + row * d.N;
            float* dct = dC + row * d.N;
            for (int64_t n = 0; n < d.N; ++n) {
              const float* hn = &hs[(s * d.N + n) * EB];
              const float* prev = s ? &hs[((s - 1) * d.N + n) * EB] : &h0[n * EB];
              const float* dn = &decay[(s * d.N + n) * EB];
              const float* an = &a[n * EB];
              float* cn_carry = &carry[n * EB];
              float* dAn = &dA[n * EB];
              const float bn = bt[n], cn = ct[n];
              float sc = 0.0f, sb = 0.0f;
              for (int j = 0; j < EB; ++j) {
                g[j] = cn_carry[j] + cn * dyv[j];  // dL/dh_t
                sc += hn[j] * dyv[j];
                sb += g[j] * u[j];
                du[j] += g[j] * bn;
                const float gd = g[j] * dn[j];  // dL/dh_t times the decay: carried to step t - 1
                const float w = gd * prev[j];     // dL/d(delta_t A)
                dd[j] += w * an[j];
                dAn[j] += w * dv[j];
                cn_carry[j] = gd;
              }
              dct[n] += sc;
              dbt[n] += sb;
            }
            for (int j = 0; j < EB; ++j) {
              dd[j] += du[j] * xv[j];
              du[j] *= dv[j];
            }
            store(du, e0, d.E, dx + row * d.E);
            store(dd, e0, d.E, ddelta + row * d.E);
          }
        }
        for (int64_t n = 0; n < d.N; ++n) {
          const int64_t w = std::min<int64_t>(EB, d.E - e0);
          for (int64_t j = 0; j < w; ++j) dAt_mine[n * d.E + e0 + j] += dA[n * EB + j];
        }
      }
    }
  });
}

}  // extern "C"
