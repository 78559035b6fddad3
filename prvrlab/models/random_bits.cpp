// Random 64-bit words for dropout masks on CPU: the SplitMix64 sequence of a seed, word i being
//     z = seed + (i + 1) * 0x9e3779b97f4a7c15,  then three xor-shift-multiply rounds of z
// (Steele, Lea & Flood 2014; the generator of Java's SplittableRandom, which passes BigCrush).  Each word
// depends only on (seed, i), so threads fill disjoint ranges and the result does not depend on their
// number (prvrlab/models/random_bits.py builds and calls it).
#include <cstdint>

#include "native_common.h"

extern "C" {

int prvrlab_random_abi() { return 1; }

void prvrlab_random_fill(uint64_t* out, int64_t n, uint64_t seed, int threads) {
  prvrlab::run_parallel(
      n, threads,
      [&](int, int64_t lo, int64_t hi) {
        for (int64_t i = lo; i < hi; ++i) {
          uint64_t z = seed + static_cast<uint64_t>(i + 1) * 0x9e3779b97f4a7c15ull;
          z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
          z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
          out[i] = z ^ (z >> 31);
        }
      },
      1 << 16);
}

}  // extern "C"
