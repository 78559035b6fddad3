// Random 64-bit words for dropout masks on CPU: the SplitMix64 sequence of a seed, word i being
//     z = seed + (i + 1) * 0x9e3779b97f4a7c15,  then three xor-shift-multiply rounds of z
// (Steele, Lea & Flood 2014; the generator of Java's SplittableRandom, which passes BigCrush).  Each word
// depends only on (seed, i), so threads fill disjoint ranges and the result does not depend on their
// number (prvrlab/models/random_bits.py builds and calls it).
//
// prvrlab_dropout_mask writes a dropout mask straight from the same words: element i takes the 16-bit
// lane i % 4 of word i / 4 (little-endian: the int16 view of the words), and is `scale` where that lane,
// read as a signed integer, is at least `threshold`, else 0.  One pass instead of the draw, a comparison
// and a select; element sizes 2 (bf16, fp16) and 4 (fp32), `scale` given as its bit pattern.
#include <cstdint>

#include "native_common.h"

extern "C" {

int prvrlab_random_abi() { return 2; }

}  // extern "C"

namespace {

inline uint64_t splitmix64(uint64_t seed, int64_t i) {
  uint64_t z = seed + static_cast<uint64_t>(i + 1) * 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Elements [4 lo, min(4 hi, n)) of the mask: words lo..hi-1, whole words first, then the last one's lanes.
template <typename T>
void mask_words(T* out, int64_t n, uint64_t seed, int64_t lo, int64_t hi, int16_t threshold, T scale) {
  const int64_t whole = std::min(hi, n / 4);
  for (int64_t w = lo; w < whole; ++w) {
    const uint64_t z = splitmix64(seed, w);
    for (int lane = 0; lane < 4; ++lane) {
      const int16_t draw = static_cast<int16_t>(static_cast<uint16_t>(z >> (16 * lane)));
      out[4 * w + lane] = draw >= threshold ? scale : T(0);
    }
  }
  for (int64_t w = std::max(lo, whole); w < hi; ++w) {
    const uint64_t z = splitmix64(seed, w);
    for (int lane = 0; lane < 4 && 4 * w + lane < n; ++lane) {
      const int16_t draw = static_cast<int16_t>(static_cast<uint16_t>(z >> (16 * lane)));
      out[4 * w + lane] = draw >= threshold ? scale : T(0);
    }
  }
}

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

// threshold: the least int16 lane kept, in [-32768, 32767] (the caller handles "none kept");
// scale_bits: the kept value's bit pattern in the low elem_size bytes (2 or 4; else nothing is written).
void prvrlab_dropout_mask(void* out, int64_t n, uint64_t seed, int threads, int threshold, uint32_t scale_bits,
                          int elem_size) {
  const int64_t words = (n + 3) / 4;
  const int16_t t = static_cast<int16_t>(threshold);
  prvrlab::run_parallel(
      words, threads,
      [&](int, int64_t lo, int64_t hi) {
        if (elem_size == 2) {
          mask_words(static_cast<uint16_t*>(out), n, seed, lo, hi, t, static_cast<uint16_t>(scale_bits));
        } else if (elem_size == 4) {
          mask_words(static_cast<uint32_t*>(out), n, seed, lo, hi, t, scale_bits);
        }
      },
      1 << 14);
}

}  // extern "C"
