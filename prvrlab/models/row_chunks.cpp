// Moves fixed-size chunks between a packed and a padded layout (prvrlab/models/row_chunks.py builds and
// calls it): for every row n and middle index m, the chunk at src + src_base[n] + src_mid[m] is copied to
// dst + dst_base[n] + dst_mid[m]; then, for every padding row p, the chunk at dst + pad_base[p] + dst_mid[m]
// is zeroed.  Every offset is in bytes; `middle_outer` picks the loop order that writes the destination
// in sequence (1 for a padded destination, 0 for a packed one).  So each chunk of the destination is written once, where PyTorch
// zero-fills the whole padded tensor and then scatters the real rows through generic index kernels.
//
// prvrlab_gather_rows_bf16 packs float32 rows into bfloat16 ones in one pass: dst[n] = bf16(src[rows[n]])
// (round to nearest even as torch rounds; a NaN stays a NaN, its bits may differ from torch's), where
// PyTorch gathered the float32 rows (an
// index_select) and then converted them (a second pass over a copy).
#include <cstdint>
#include <cstring>

#include "native_common.h"

extern "C" {

int prvrlab_chunks_abi() { return 2; }

void prvrlab_move_chunks(char* dst, const char* src, const int64_t* dst_base, const int64_t* src_base, int64_t rows,
                         const int64_t* dst_mid, const int64_t* src_mid, int64_t mids, int64_t chunk,
                         const int64_t* pad_base, int64_t pads, int middle_outer, int threads) {
  if (!middle_outer) {  // rows outermost: a packed destination's chunks of one row lie together
    prvrlab::run_parallel(
        rows, threads,
        [&](int, int64_t lo, int64_t hi) {
          for (int64_t n = lo; n < hi; ++n) {
            char* d = dst + dst_base[n];
            const char* s = src + src_base[n];
            for (int64_t m = 0; m < mids; ++m) std::memcpy(d + dst_mid[m], s + src_mid[m], chunk);
          }
        },
        256);
  }
  if (!middle_outer && pads == 0) return;
  // middle index outermost: a padded destination keeps one middle index's slots together (the (b, g)
  // planes of (3, B, G, L, Dh) heads), so its writes stream through memory, padding zeroed in the same sweep
  prvrlab::run_parallel(
      mids, threads,
      [&](int, int64_t lo, int64_t hi) {
        for (int64_t m = lo; m < hi; ++m) {
          char* d = dst + dst_mid[m];
          const char* s = src + src_mid[m];
          if (middle_outer) {
            for (int64_t n = 0; n < rows; ++n) std::memcpy(d + dst_base[n], s + src_base[n], chunk);
          }
          for (int64_t p = 0; p < pads; ++p) std::memset(d + pad_base[p], 0, chunk);
        }
      },
      1);
}

// dst (n, width) bfloat16 (uint16 storage) = src's rows rows[0 .. n) (float32, rows of `width`), rounded.
void prvrlab_gather_rows_bf16(uint16_t* dst, const float* src, const int64_t* rows, int64_t n, int64_t width,
                              int threads) {
  prvrlab::run_parallel(
      n, threads,
      [&](int, int64_t lo, int64_t hi) {
        for (int64_t i = lo; i < hi; ++i) {
          const float* __restrict s = src + rows[i] * width;
          uint16_t* __restrict d = dst + i * width;
          for (int64_t j = 0; j < width; ++j) prvrlab::store(d, j, s[j]);
        }
      },
      16);
}

}  // extern "C"
