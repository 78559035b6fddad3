// MS-SL retrieval, fused: for every (query, video) pair, the best sliding-window proposal of the video
// for the query and that proposal's attended frame vector's dot with the query's frame vector, without
// materialising the (Q, V, P) proposal scores (prvrlab/models/window_best.py builds and calls it;
// prvrlab/models/mssl.py documents the model).
//
// Proposal p = window [s, s + k) of a video's L clip items, in window order (k = 1..min(W, L), then s);
// its score for query q is  (sum_{i in window} dots[q, v, i]) * scale[v, p],  with the caller's
// scale = 1 / (k |p|), so the score is q . p / |p|.  Each window's sum runs left to right (the windows
// of length k extend those of length k - 1 by one item), vectorised over the window starts.  best = the first proposal with the highest score (torch.max's rule);
// frame_dot = qf[q] . unit[v, best].
//
// Layouts (contiguous): dots (Q, V, L) float32; scale (V, P) float32; unit (V, P, D) float32 and
// qf (Q, D) float32, or both null (no frame dots); outputs top, frame_dot (Q, V) float32, best (Q, V)
// int64.  Inputs must be finite (the caller checks: -ffast-math assumes it).
//
// Work is split by videos; a thread runs all queries against one video at a time, so the video's
// scales and attended vectors stay in cache while the queries stream past.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "native_common.h"

extern "C" {

int prvrlab_window_abi() { return 1; }

void prvrlab_window_best(const float* dots, const float* scale, const float* unit, const float* qf, float* top,
                         int64_t* best, float* frame_dot, int64_t Q, int64_t V, int64_t L, int64_t W, int64_t D,
                         int threads) {
  const int64_t K = std::min(W, L);
  int64_t P = 0;
  for (int64_t k = 1; k <= K; ++k) P += L - k + 1;
  prvrlab::run_parallel(V, threads, [&](int, int64_t lo, int64_t hi) {
    std::vector<float> window(L);
    std::vector<float> score(P);
    float* w = window.data();
    float* sc = score.data();
    for (int64_t v = lo; v < hi; ++v) {
      const float* sv = scale + v * P;
      for (int64_t q = 0; q < Q; ++q) {
        const float* d = dots + (q * V + v) * L;
        std::fill(w, w + L, 0.0f);
        int64_t p = 0;
        for (int64_t k = 1; k <= K; ++k) {  // w[s] = d[s] + ... + d[s + k - 1], summed left to right
          const int64_t n = L - k + 1;
          const float* dk = d + k - 1;
          const float* sk = sv + p;
          float* out = sc + p;
          for (int64_t s = 0; s < n; ++s) {
            w[s] += dk[s];
            out[s] = w[s] * sk[s];
          }
          p += n;
        }
        float m = sc[0];
        for (int64_t j = 1; j < P; ++j) m = std::max(m, sc[j]);
        int64_t b = 0;
        while (b + 1 < P && sc[b] != m) ++b;  // bounded: never past the buffer, whatever the inputs
        top[q * V + v] = m;
        best[q * V + v] = b;
        if (unit != nullptr) {
          const float* u = unit + (v * P + b) * D;
          const float* f = qf + q * D;
          float acc = 0.0f;
          for (int64_t j = 0; j < D; ++j) acc += u[j] * f[j];
          frame_dot[q * V + v] = acc;
        }
      }
    }
  });
}

}  // extern "C"
