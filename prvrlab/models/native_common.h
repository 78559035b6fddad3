// Helpers shared by the C++ kernels beside this file (prvrlab/models/native.py builds each kernel with
// the headers it includes in its cache key).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#ifdef PRVRLAB_OPENMP
#include <omp.h>
#include <unistd.h>
#endif

// 1 where this library runs its ranges on the OpenMP team PyTorch runs on (built with PRVRLAB_OPENMP), else 0: every
// kernel library is one source file, so each defines it once (prvrlab/models/native.py: kernel_openmp).
extern "C" int prvrlab_kernel_openmp() {
#ifdef PRVRLAB_OPENMP
  return 1;
#else
  return 0;
#endif
}

namespace prvrlab {

// exp(v) in a form the compiler vectorises inline (the C library's vector exp is an out-of-line call):
// v = k ln2 + r with k = round(v / ln2), |r| <= ln2 / 2, exp(r) by its degree-6 Taylor polynomial
// (relative error <= 1.3e-7, about one float32 ulp) and 2^k from the exponent bits.  v is clamped to
// [-87, 88]: below, the result is 2^-126 (~1e-38) instead of a denormal or 0 (a scan's decay that
// small erases its state either way; the softmax zeroes what must be exactly 0 itself).
inline float exp_fast(float v) {
  v = std::min(std::max(v, -87.0f), 88.0f);
  const float k = std::nearbyint(v * 1.44269504088896341f);
  const float r = (v - k * 0.693145751953125f) - k * 1.42860682030941723e-6f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// Element j of a float32 or bfloat16 (uint16 bits) array, as float; store() writes v there, bf16 rounded to
// nearest even (a NaN stays a NaN).
inline float load(const float* p, int64_t j) { return p[j]; }
inline float load(const uint16_t* p, int64_t j) {
  const uint32_t bits = static_cast<uint32_t>(p[j]) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline void store(float* p, int64_t j, float v) { p[j] = v; }
inline void store(uint16_t* p, int64_t j, float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
  bits += 0x7fffu + ((bits >> 16) & 1u);
  p[j] = nan ? static_cast<uint16_t>(0x7fc0u) : static_cast<uint16_t>(bits >> 16);
}

// x * 0 from x's bits alone (the build's -ffast-math would let the compiler drop signed zeros and NaNs):
// a zero of x's sign, or a quiet NaN where x is infinite or NaN (Exp: the exponent bits, Quiet: the quiet bit).
// One select, no branch, so that loops calling it vectorise.
template <typename T, T Exp, T Quiet>
inline T dropped(T bits) {
  constexpr T sign = static_cast<T>(T(1) << (sizeof(T) * 8 - 1));
  return static_cast<T>((bits & Exp) == Exp ? (bits | Quiet) : (bits & sign));
}

// kept ? v * scale : v * 0 for a float32 v, the zero taken from v's bits (see dropped: a zero of v's sign, or
// a NaN where v is not finite), selected on the bits so that loops calling it vectorise.
inline float keep_or_drop(float v, bool kept, float scale) {
  uint32_t bits, scaled;
  const float s = v * scale;
  std::memcpy(&bits, &v, sizeof bits);
  std::memcpy(&scaled, &s, sizeof scaled);
  const uint32_t zero = dropped<uint32_t, 0x7f800000u, 0x00400000u>(bits);
  const uint32_t mask = 0u - static_cast<uint32_t>(kept);  // all ones where kept
  const uint32_t out = (scaled & mask) | (zero & ~mask);
  float r;
  std::memcpy(&r, &out, sizeof r);
  return r;
}

#ifdef PRVRLAB_OPENMP
// The process that loaded this library: GNU OpenMP's team does not survive fork() (a child's first team waits for
// workers that exist only in the parent), so a forked child starts threads of its own instead.
inline const pid_t kLoadedBy = getpid();
#endif

// fn(worker, lo, hi) over `threads` contiguous ranges of [0, items) (at most one per item, at least
// `grain` items each), range 0 on the calling thread.  Built with OpenMP (PRVRLAB_OPENMP: the runtime PyTorch's
// own operations run on, prvrlab/models/native.py), the ranges run on that runtime's thread team, whose workers
// are still spinning from PyTorch's last operation; otherwise on threads started for the call (which then share
// the cores with those spinning workers).  The ranges are the same either way: a result never depends on it.
// (One difference: a started thread takes the caller's floating-point mode, flush-to-zero included, where the
// team's workers keep the one they started with, as for PyTorch's own operations; this project never sets it.)
template <typename F>
void run_parallel(int64_t items, int threads, F fn, int64_t grain = 1) {
  const int64_t most = std::max<int64_t>(1, items / std::max<int64_t>(1, grain));
  const int n = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, most)));
  if (n == 1) {
    fn(0, 0, items);
    return;
  }
#ifdef PRVRLAB_OPENMP
  if (getpid() == kLoadedBy) {
#pragma omp parallel num_threads(n)
    {
      const int team = omp_get_num_threads();  // fewer than n where the runtime allows fewer: a thread takes several
      for (int i = omp_get_thread_num(); i < n; i += team) fn(i, items * i / n, items * (i + 1) / n);
    }
    return;
  }
#endif
  std::vector<std::thread> pool;
  for (int i = 1; i < n; ++i) pool.emplace_back(fn, i, items * i / n, items * (i + 1) / n);
  fn(0, 0, items / n);
  for (auto& t : pool) t.join();
}

}  // namespace prvrlab
