// Random 64-bit words for dropout masks on CPU: the SplitMix64 sequence of a seed, word i being
//     z = seed + (i + 1) * 0x9e3779b97f4a7c15,  then three xor-shift-multiply rounds of z
// (Steele, Lea & Flood 2014; the generator of Java's SplittableRandom, which passes BigCrush).  Each word
// depends only on (seed, i), so threads fill disjoint ranges and the result does not depend on their
// number (prvrlab/models/random_bits.py builds and calls it).
//
// prvrlab_dropout_mask writes a dropout mask straight from the same words: element i takes the 16-bit
// lane i % 4 of word i / 4 (little-endian: the int16 view of the words), and is `scale` where that lane,
// read as a signed integer, is at least `threshold`, else 0.  One pass instead of the draw, a comparison
// and a select; element sizes 2 (bf16, fp16) and 4 (fp32), `scale` given as its bit pattern.  Both it and
// prvrlab_dropout_apply(_to) (the mask multiplied into a tensor, in place or into another, never written) take a run of
// elements starting at any `offset` of the draw, so a slice of a draw gets the slice of its mask;
// prvrlab_dropout_residual adds a bfloat16 tensor times the mask to another (a residual connection's dropout).
#include <cstdint>

#include "native_common.h"

extern "C" {

int prvrlab_random_abi() { return 5; }

}  // extern "C"

namespace {

inline uint64_t splitmix64(uint64_t seed, int64_t i) {
  uint64_t z = seed + static_cast<uint64_t>(i + 1) * 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// fn(i0, lanes, count) over blocks of the elements [lo, hi) of a run starting at global element `offset`:
// elements i0 .. i0 + count - 1 (local indices) draw the int16 lanes[0 .. count - 1], global element e
// taking lane e % 4 of word e / 4.  The words of a block are made first and copied out as int16 lanes (the
// int16 view of the words, little-endian), so fn's loops over elements are plain and vectorise.
template <typename F>
void for_each_block(uint64_t seed, int64_t offset, int64_t lo, int64_t hi, F fn) {
  constexpr int64_t kWords = 1024;
  alignas(64) uint64_t words[kWords];
  alignas(64) int16_t lanes[4 * kWords];
  int64_t e = offset + lo;
  const int64_t end = offset + hi;
  while (e < end) {
    const int64_t w0 = e >> 2;
    const int64_t first = e - 4 * w0;  // e's lane in its word: 0..3
    const int64_t count = std::min<int64_t>(end - e, 4 * kWords - first);
    const int64_t nw = (first + count + 3) >> 2;
    for (int64_t w = 0; w < nw; ++w) words[w] = splitmix64(seed, w0 + w);
    std::memcpy(lanes, words, static_cast<size_t>(nw) * sizeof(uint64_t));
    fn(e - offset, lanes + first, count);
    e += count;
  }
}

inline float bf16_to_float(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// float -> bfloat16 rounded to nearest even, as torch rounds (a NaN stays a NaN; its bits may differ from torch's).
inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// Elements [lo, hi) of a mask (local indices; the draw's run starts at `offset`): `kept` where the lane is
// at least `t`, else 0.  Restrict pointers: the element loop vectorises.
template <typename T>
void write_mask(T* out, T kept, int16_t t, uint64_t seed, int64_t offset, int64_t lo, int64_t hi) {
  for_each_block(seed, offset, lo, hi, [out, kept, t](int64_t i0, const int16_t* lane, int64_t count) {
    T* __restrict dst = out + i0;
    const int16_t* __restrict src = lane;
    for (int64_t j = 0; j < count; ++j) dst[j] = src[j] >= t ? kept : T(0);
  });
}

// b * (lane >= t ? scale : 0) for the bits b of a bfloat16 (uint16) or float32 (uint32), rounded as torch rounds the
// product; a dropped element is 0 of b's sign, or NaN where b is not finite (prvrlab::dropped).
inline uint16_t masked(uint16_t b, int16_t lane, int16_t t, float scale) {
  const uint16_t kept = float_to_bf16(bf16_to_float(b) * scale);
  return lane >= t ? kept : prvrlab::dropped<uint16_t, 0x7f80, 0x0040>(b);
}
inline uint32_t masked(uint32_t b, int16_t lane, int16_t t, float scale) {
  float f;
  std::memcpy(&f, &b, sizeof f);
  f *= scale;
  uint32_t kept;
  std::memcpy(&kept, &f, sizeof kept);
  return lane >= t ? kept : prvrlab::dropped<uint32_t, 0x7f800000u, 0x00400000u>(b);
}

// Elements [lo, hi) of a run (local indices) masked from src into dst: one pointer where they are the same (in
// place), restrict ones otherwise, so that both loops vectorise without a runtime overlap check.
template <typename U>
void apply_run(const U* src, U* dst, uint64_t seed, int64_t offset, int64_t lo, int64_t hi, int16_t t, float scale) {
  for_each_block(seed, offset, lo, hi, [&](int64_t i0, const int16_t* lane, int64_t count) {
    if (src == dst) {
      U* v = dst + i0;
      for (int64_t j = 0; j < count; ++j) v[j] = masked(v[j], lane[j], t, scale);
      return;
    }
    const U* __restrict in = src + i0;
    U* __restrict out = dst + i0;
    for (int64_t j = 0; j < count; ++j) out[j] = masked(in[j], lane[j], t, scale);
  });
}

// Elements [lo, hi) of x + a * mask for bfloat16 x, a and out, x read at element i % period (a residual stream
// shared by every branch: period = its size; else period = n).  a * scale is exact in float (two 8-bit
// significands), so the float sum rounded once to bfloat16 is what torch.addcmul(x, a, mask) gives; a dropped
// element adds a * 0 (prvrlab::keep_or_drop: 0 of a's sign, or NaN where a is not finite).
void residual_run(const uint16_t* x, const uint16_t* a, uint16_t* out, int64_t period, uint64_t seed,
                  int64_t offset, int64_t lo, int64_t hi, int16_t t, float scale) {
  for_each_block(seed, offset, lo, hi, [&](int64_t i0, const int16_t* lane, int64_t count) {
    const uint16_t* __restrict av = a + i0;
    uint16_t* __restrict o = out + i0;
    int64_t j = 0;
    while (j < count) {
      const int64_t xi = (i0 + j) % period;
      const int64_t run = std::min<int64_t>(count - j, period - xi);  // elements before x wraps around
      const uint16_t* __restrict xv = x + xi;
      for (int64_t r = 0; r < run; ++r) {
        const float product = prvrlab::keep_or_drop(bf16_to_float(av[j + r]), lane[j + r] >= t, scale);
        o[j + r] = float_to_bf16(bf16_to_float(xv[r]) + product);
      }
      j += run;
    }
  });
}

constexpr int64_t kGrain = 1 << 16;  // elements per thread at least

}  // namespace

extern "C" {

void prvrlab_random_fill(uint64_t* out, int64_t n, uint64_t seed, int threads) {
  prvrlab::run_parallel(
      n, threads,
      [&](int, int64_t lo, int64_t hi) {
        for (int64_t i = lo; i < hi; ++i) out[i] = splitmix64(seed, i);
      },
      1 << 16);
}

// The mask of elements [offset, offset + n) of a draw, into out[0, n).  threshold: the least int16 lane
// kept, in [-32768, 32767] (the caller handles "none kept"); scale_bits: the kept value's bit pattern in
// the low elem_size bytes (2 or 4; else nothing is written).
void prvrlab_dropout_mask(void* out, int64_t n, uint64_t seed, int64_t offset, int threads, int threshold,
                          uint32_t scale_bits, int elem_size) {
  const int16_t t = static_cast<int16_t>(threshold);
  prvrlab::run_parallel(
      n, threads,
      [&](int, int64_t lo, int64_t hi) {
        if (elem_size == 2) {
          write_mask(static_cast<uint16_t*>(out), static_cast<uint16_t>(scale_bits), t, seed, offset, lo, hi);
        } else if (elem_size == 4) {
          write_mask(static_cast<uint32_t*>(out), scale_bits, t, seed, offset, lo, hi);
        }
      },
      kGrain);
}

// dst[i] = src[i] * the mask of element offset + i: src[i] * (keep ? scale : 0) in float, rounded back as torch
// rounds a product of its dtype (elem_size 2: bfloat16, round to nearest even; 4: float32).  dst == src: in
// place; otherwise the two must not overlap.
void prvrlab_dropout_apply_to(const void* src, void* dst, int64_t n, uint64_t seed, int64_t offset, int threads,
                              int threshold, float scale, int elem_size) {
  const int16_t t = static_cast<int16_t>(threshold);
  prvrlab::run_parallel(
      n, threads,
      [&](int, int64_t lo, int64_t hi) {
        if (elem_size == 2) {
          apply_run(static_cast<const uint16_t*>(src), static_cast<uint16_t*>(dst), seed, offset, lo, hi, t, scale);
        } else if (elem_size == 4) {
          apply_run(static_cast<const uint32_t*>(src), static_cast<uint32_t*>(dst), seed, offset, lo, hi, t, scale);
        }
      },
      kGrain);
}

// x[i] *= the mask of element offset + i, in place (prvrlab_dropout_apply_to with dst = src).
void prvrlab_dropout_apply(void* x, int64_t n, uint64_t seed, int64_t offset, int threads, int threshold, float scale,
                           int elem_size) {
  prvrlab_dropout_apply_to(x, x, n, seed, offset, threads, threshold, scale, elem_size);
}

// out[i] = x[i % period] + a[i] * the mask of element offset + i, for bfloat16 x, a and out (residual_run); out
// must not overlap x or a.
void prvrlab_dropout_residual(const void* x, const void* a, void* out, int64_t n, int64_t period, uint64_t seed,
                              int64_t offset, int threads, int threshold, float scale) {
  const int16_t t = static_cast<int16_t>(threshold);
  prvrlab::run_parallel(
      n, threads,
      [&](int, int64_t lo, int64_t hi) {
        residual_run(static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(a), static_cast<uint16_t*>(out),
                     period, seed, offset, lo, hi, t, scale);
      },
      kGrain);
}

}  // extern "C"
