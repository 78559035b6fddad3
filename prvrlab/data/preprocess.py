"""Feature preprocessing applied by the PRVR reference implementations.

- Frames: a video with more than ``max_frames`` frames is mean-pooled into
  ``max_frames`` bins; shorter videos are kept as they are.
- Clips: always ``num_clips`` bins over the raw frames (frames repeat when the
  video has fewer than ``num_clips`` frames).
- Binning of ``n`` frames into ``B`` bins: edges ``e_i = round(i / B * n)``
  (half to even), bin ``i`` averages frames ``[e_i, e_{i+1})``; an empty bin
  takes frame ``min(e_i, n - 1)``.  The quotient is computed as the reference
  computes it: in float32 for clips (``average_to_fixed_length``:
  ``torch.arange(0, B + 1, 1.0) / B * n``), in float64 for frames
  (``uniform_feature_sampling``, numpy), so an edge whose exact value is a
  half lands where the reference's rounding puts it.  For B a power of two
  (the shipped 32 clips and 128 frames) both are exact.
- ``last_bin="official"`` (the reference code's ``average_to_fixed_length`` /
  ``uniform_feature_sampling``) clamps every edge to ``n - 1``, so the last bin
  ends one frame early and the final frame is dropped whenever that bin spans
  several frames; ``last_bin="inclusive"`` keeps it (edges run to ``n``).
- Every frame / clip row and every query token is L2-normalised after pooling:
  ``normalize="official"`` (every reference's ``l2_normalize_np_array``)
  divides by ``|x| + 1e-5``, ``normalize="exact"`` by ``|x|``; all-zero rows
  stay zero either way.  Queries are truncated to ``max_query_len`` tokens.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

LastBin = Literal["official", "inclusive"]
LAST_BIN_CHOICES: tuple[str, ...] = ("official", "inclusive")
Normalize = Literal["official", "exact"]
NORMALIZE_CHOICES: tuple[str, ...] = ("official", "exact")
OFFICIAL_NORM_EPS = 1e-5  # l2_normalize_np_array(np_array, eps=1e-5): np_array / (norm + eps)


def bin_edges(n: int, num_bins: int, *, dtype: type = np.float64) -> np.ndarray:
    """Bin edges ``round(i / num_bins * n)`` for i = 0..num_bins, (num_bins + 1,) int64: the quotient and
    product rounded in ``dtype`` (float32: the reference's clips, float64: its frames), then rounded half
    to even."""
    if n < 1 or num_bins < 1:
        raise ValueError(f"bin_edges needs n >= 1 and num_bins >= 1, got n={n}, num_bins={num_bins}")
    fractions = np.arange(num_bins + 1, dtype=dtype) / dtype(num_bins)  # (B + 1,)
    return np.round(fractions * dtype(n)).astype(np.int64)


def mean_pool_bins(
    x: np.ndarray, num_bins: int, *, last_bin: LastBin = "official", out: np.ndarray | None = None,
    edge_dtype: type = np.float64,
) -> np.ndarray:
    """Mean of each bin of rows of ``x`` (n, D) -> (num_bins, D), float32 (into ``out`` when given);
    ``edge_dtype``: the float type :func:`bin_edges` computes in.

    Non-empty bins tile ``[0, n)`` (``[0, n - 1)`` with ``last_bin="official"``)
    in order; each is summed row by row, in order, as one ``np.add.reduce`` over
    its rows sums them, but for all bins at once: their first rows, then their
    second rows where they have one, and so on (a few array operations a video
    instead of one reduction a bin).  ``np.add.reduceat`` sums in another order,
    which differs by float32 rounding (a few ulps of a bin's sum).  The float32
    quotient equals the float64 one rounded to float32 (double rounding is
    innocuous for division).  Empty bins copy the frame at their start.
    """
    if last_bin not in LAST_BIN_CHOICES:
        raise ValueError(f"last_bin must be one of {LAST_BIN_CHOICES}, got {last_bin!r}")
    x = np.asarray(x, dtype=np.float32)  # (n, D) as each row was summed in float32 before
    n = x.shape[0]
    edges = bin_edges(n, num_bins, dtype=edge_dtype)  # (B + 1,)
    if last_bin == "official":
        edges = np.minimum(edges, n - 1)  # the last bin stops before frame n - 1
    covered = x[: edges[-1]]  # (n or n - 1, D) the frames non-empty bins tile
    starts, counts = edges[:-1], np.diff(edges)  # (B,), (B,)
    full = counts > 0  # (B,)
    if out is None:
        out = np.empty((num_bins, x.shape[1]), dtype=np.float32)  # (B, D)
    if full.any():
        first, size = starts[full], counts[full]  # (B_full,) each
        sums = covered[first]  # (B_full, D) each bin's first row (a gathered copy)
        for j in range(1, int(size.max())):  # each bin's (j+1)-th row, where it has one
            more = size > j  # (B_full,)
            if more.all():
                sums += covered[first + j]
            else:
                sums[more] += covered[first[more] + j]
        out[full] = np.divide(sums, size[:, None].astype(np.float32), out=sums)
    if not full.all():
        out[~full] = x[np.minimum(starts[~full], n - 1)]
    return out


def l2_normalize(x: np.ndarray, normalize: Normalize = "official", *, out: np.ndarray | None = None) -> np.ndarray:
    """Rows of ``x`` (..., D) divided by their L2 norm (``exact``) or by norm + 1e-5 (``official``),
    float32 (into ``out`` when given; it may be ``x``); zero rows stay zero."""
    if normalize not in NORMALIZE_CHOICES:
        raise ValueError(f"normalize must be one of {NORMALIZE_CHOICES}, got {normalize!r}")
    x = np.asarray(x, dtype=np.float32)
    norms = np.linalg.norm(x, axis=-1, keepdims=True)  # (..., 1)
    if normalize == "official":
        return np.divide(x, norms + np.float32(OFFICIAL_NORM_EPS), out=out)
    return np.divide(x, np.where(norms > 0, norms, 1.0).astype(np.float32), out=out)


def preprocess_frames(
    frames: np.ndarray, max_frames: int, *, last_bin: LastBin = "official", normalize: Normalize = "official",
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Frame features (n, D) -> (min(n, max_frames), D), mean-pooled if n > max_frames, L2-normalised
    (into ``out`` (min(n, max_frames), D) when given: e.g. a row of a padded batch)."""
    _check_frames(frames)
    if frames.shape[0] > max_frames:
        frames = mean_pool_bins(frames, max_frames, last_bin=last_bin)  # (max_frames, D)
    return l2_normalize(frames, normalize, out=out)


def preprocess_clips(
    frames: np.ndarray, num_clips: int, *, last_bin: LastBin = "official", normalize: Normalize = "official",
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Frame features (n, D) -> (num_clips, D) clip features, L2-normalised (into ``out`` when given)."""
    _check_frames(frames)
    pooled = mean_pool_bins(frames, num_clips, last_bin=last_bin, out=out, edge_dtype=np.float32)  # (num_clips, D)
    return l2_normalize(pooled, normalize, out=pooled)


def preprocess_query(tokens: np.ndarray, max_query_len: int, *, normalize: Normalize = "official") -> np.ndarray:
    """Token features (n, Dq) -> (min(n, max_query_len), Dq), each token L2-normalised."""
    if tokens.ndim != 2 or tokens.shape[0] == 0:
        raise ValueError(f"query tokens must be (n >= 1, Dq), got shape {tokens.shape}")
    return l2_normalize(tokens[:max_query_len], normalize)


def _check_frames(frames: np.ndarray) -> None:
    if frames.ndim != 2 or frames.shape[0] == 0:
        raise ValueError(f"frames must be (n >= 1, D), got shape {frames.shape}")
