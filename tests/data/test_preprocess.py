"""Preprocessing against expectations computed by hand or by explicit loops."""

from __future__ import annotations

import numpy as np
import torch
import pytest

from prvrlab.data.preprocess import (
    bin_edges,
    l2_normalize,
    mean_pool_bins,
    preprocess_clips,
    preprocess_frames,
    preprocess_query,
)


def _bins_by_loop(x: np.ndarray, num_bins: int, last_bin: str = "inclusive") -> np.ndarray:
    """Reference: the binning rule written out with Python round-half-even and a loop."""
    n = len(x)
    edges = [round(i * n / num_bins) for i in range(num_bins + 1)]
    if last_bin == "official":
        edges = [min(e, n - 1) for e in edges]
    out = []
    for i in range(num_bins):
        s, e = edges[i], edges[i + 1]
        out.append(x[s:e].mean(axis=0) if s < e else x[min(s, n - 1)])
    return np.stack(out)


def test_five_frames_to_32_clips_repeat_pattern():
    x = np.arange(5, dtype=np.float32)[:, None] * np.ones((1, 2), np.float32)  # frame i = [i, i]
    clips = mean_pool_bins(x, 32, last_bin="inclusive")
    # Edges round(i * 5 / 32) by hand: 0 for i <= 3, 1 for 4..9, 2 for 10..16 (16 * 5 / 32 = 2.5
    # rounds half to even), 3 for 17..22, 4 for 23..28, 5 for 29..32 (start clamped to frame 4).
    expected = [0] * 4 + [1] * 6 + [2] * 7 + [3] * 6 + [4] * 9
    assert clips[:, 0].tolist() == expected
    assert bin_edges(5, 32)[:8].tolist() == [0, 0, 0, 0, 1, 1, 1, 1]


def test_one_frame_fills_every_clip():
    x = np.array([[3.0, 4.0]], dtype=np.float32)
    clips = preprocess_clips(x, 32)
    assert clips.shape == (32, 2)
    np.testing.assert_allclose(clips, np.tile([[3.0, 4.0]], (32, 1)) / (5.0 + 1e-5), rtol=1e-6)  # official: / (|x| + 1e-5)


def test_300_frames_to_128_bins_matches_explicit_loop():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((300, 7)).astype(np.float32)
    pooled = mean_pool_bins(x, 128, last_bin="inclusive")
    edges = [round(i * 300 / 128) for i in range(129)]
    assert edges[-1] == 300  # the last frame belongs to the last bin
    for i in range(128):
        np.testing.assert_allclose(pooled[i], x[edges[i] : edges[i + 1]].mean(axis=0), rtol=1e-5, atol=1e-6)
    frames = preprocess_frames(x, 128, last_bin="inclusive", normalize="exact")
    np.testing.assert_allclose(frames, pooled / np.linalg.norm(pooled, axis=1, keepdims=True), rtol=1e-5)


@pytest.mark.parity
@pytest.mark.parametrize("n", [1, 2, 15, 31, 32, 33, 64, 100, 127, 128, 129, 255, 1000])
@pytest.mark.parametrize("num_bins", [3, 32, 128])
@pytest.mark.parametrize("last_bin", ["official", "inclusive"])
def test_binning_matches_loop_for_many_lengths(n, num_bins, last_bin):
    x = np.random.default_rng(n).standard_normal((n, 3)).astype(np.float32)
    got = mean_pool_bins(x, num_bins, last_bin=last_bin)
    np.testing.assert_allclose(got, _bins_by_loop(x, num_bins, last_bin), rtol=1e-5, atol=1e-6)


def _reference_edges(n: int, num_bins: int, clips: bool) -> list[int]:
    """The official edges before clamping: clips by torch in float32 (``average_to_fixed_length``),
    frames by numpy in float64 (``uniform_feature_sampling``)."""
    if clips:
        return torch.round(torch.arange(0, num_bins + 1, 1.0) / num_bins * n).long().tolist()
    return np.round(np.arange(0, num_bins + 1, 1.0) / num_bins * n).astype(np.int32).tolist()


@pytest.mark.parity
def test_bin_edges_round_where_the_references_float_arithmetic_rounds():
    """Bin counts that are not powers of two: an exact half can come out a hair below (45 frames in 100
    bins, edge 70: 31.499999999999996 in float64 -> 31, not 32); float32 clip edges differ elsewhere."""
    assert bin_edges(45, 100)[70] == 31 and bin_edges(45, 100, dtype=np.float32)[70] == 32  # float32: 31.5 again
    differ = {True: 0, False: 0}
    for num_bins in (3, 10, 20, 24, 32, 48, 64, 100, 128, 200):
        for n in range(1, 400):
            for clips in (True, False):
                got = bin_edges(n, num_bins, dtype=np.float32 if clips else np.float64).tolist()
                expected = _reference_edges(n, num_bins, clips)
                assert got == expected, (n, num_bins, clips)
                exact = [round(i * n / num_bins) for i in range(num_bins + 1)]  # the exact quotient, half to even
                differ[clips] += got != exact
                if num_bins in (32, 128):
                    assert got == exact  # powers of two: the float quotients are exact
    assert differ[True] > 0 and differ[False] > 0  # the case the reference's arithmetic decides exists


@pytest.mark.parity
def test_clips_and_frames_pool_with_the_references_edges():
    x = np.random.default_rng(4).standard_normal((45, 3)).astype(np.float32)
    for clips, bins in ((True, 100), (False, 40)):
        edges = [min(e, 44) for e in _reference_edges(45, bins, clips)]
        expected = np.stack([x[s:e].mean(axis=0) if s < e else x[s] for s, e in zip(edges[:-1], edges[1:])])
        if clips:
            got = preprocess_clips(x, bins)
        else:
            got = preprocess_frames(x, bins)
        norms = np.linalg.norm(expected, axis=1, keepdims=True) + 1e-5
        np.testing.assert_allclose(got, expected / norms, rtol=1e-5, atol=1e-6)


def test_frames_kept_up_to_max_frames():
    x = np.random.default_rng(1).standard_normal((128, 4)).astype(np.float32)
    out = preprocess_frames(x, 128)
    assert out.shape == (128, 4)
    np.testing.assert_allclose(out, x / (np.linalg.norm(x, axis=1, keepdims=True) + 1e-5), rtol=1e-6)
    assert preprocess_frames(x[:10], 128).shape == (10, 4)
    assert preprocess_frames(np.vstack([x, x]), 128).shape == (128, 4)


def test_rows_have_unit_norm_and_zero_rows_stay_zero():
    x = np.random.default_rng(2).standard_normal((40, 5)).astype(np.float32) * 7
    x[3] = 0
    out = l2_normalize(x, "exact")
    norms = np.linalg.norm(out, axis=1)
    assert norms[3] == 0 and np.isfinite(out).all()
    np.testing.assert_allclose(np.delete(norms, 3), 1.0, rtol=1e-6)
    for normalize in ("official", "exact"):
        clips = preprocess_clips(np.zeros((4, 5), np.float32), 32, normalize=normalize)
        assert np.isfinite(clips).all() and not clips.any()


@pytest.mark.parity
def test_official_normalisation_divides_by_the_norm_plus_1e_5():
    """Every reference's l2_normalize_np_array(x, eps=1e-5) = x / (|x| + eps): rows fall short of unit
    norm by eps / (|x| + eps), which matters only for small rows."""
    x = np.array([[3.0, 4.0], [3e-5, 4e-5], [0.0, 0.0]], dtype=np.float32)
    out = l2_normalize(x)
    np.testing.assert_allclose(out[0], [3 / (5 + 1e-5), 4 / (5 + 1e-5)], rtol=1e-6)
    np.testing.assert_allclose(out[1], [3e-5 / (5e-5 + 1e-5), 4e-5 / (5e-5 + 1e-5)], rtol=1e-5)  # norm 5/6
    assert not out[2].any()
    np.testing.assert_allclose(np.linalg.norm(l2_normalize(x[:2], "exact"), axis=1), 1.0, rtol=1e-6)
    with pytest.raises(ValueError, match="normalize"):
        l2_normalize(x, "unit")


def test_query_tokens_normalised_and_truncated():
    tokens = np.arange(1, 41, dtype=np.float32)[:, None] * np.array([[3.0, 4.0]], np.float32)  # (40, 2)
    out = preprocess_query(tokens, 30)
    assert out.shape == (30, 2) and out.dtype == np.float32
    norms = 5.0 * np.arange(1, 31)[:, None]  # token i is (i + 1) * [3, 4]
    np.testing.assert_allclose(out, tokens[:30] / (norms + 1e-5), rtol=1e-6)
    np.testing.assert_allclose(preprocess_query(tokens, 30, normalize="exact"), np.tile([[0.6, 0.8]], (30, 1)), rtol=1e-6)
    assert preprocess_query(tokens[:3], 30).shape == (3, 2)


def test_bad_shapes_rejected():
    with pytest.raises(ValueError, match="n >= 1"):
        preprocess_clips(np.zeros((0, 3), np.float32), 32)
    with pytest.raises(ValueError, match="n >= 1"):
        preprocess_query(np.zeros((0, 3), np.float32), 30)


def _frame_index(n: int) -> np.ndarray:
    """(n, 1) features whose value is the frame index, so a bin's mean reads as a number."""
    return np.arange(n, dtype=np.float32)[:, None]


# Hand-computed bins (value = mean frame index) for L = 32 clips.
# n = 64: edges 2i, bins [2i, 2i + 2); official clamps the last edge 64 -> 63, so bin 31 = [62, 63).
# n = 70: edges round(i * 70 / 32) for i = 30, 31, 32 are 66 (65.6), 68 (67.8), 70; bin 30 = [66, 68)
#   = 66.5, the last bin [68, 70) = 68.5, official [68, 69) keeps 68 only.
# n = 32: every bin is one frame; the official clamp only turns [31, 32) into the empty bin at 31.
# n = 5 (< L): the last edges are 5 (clamped to 4 officially); bins from 29 on are empty either way.
@pytest.mark.parametrize(
    ("n", "tail_official", "tail_inclusive"),
    [
        (64, [60.5, 62.0], [60.5, 62.5]),
        (70, [66.5, 68.0], [66.5, 68.5]),
        (32, [30.0, 31.0], [30.0, 31.0]),
        (5, [4.0, 4.0], [4.0, 4.0]),
        (1, [0.0, 0.0], [0.0, 0.0]),
    ],
)
@pytest.mark.parity
def test_last_clip_bin_by_hand(n, tail_official, tail_inclusive):
    x = _frame_index(n)
    official = mean_pool_bins(x, 32, last_bin="official")[:, 0]
    inclusive = mean_pool_bins(x, 32, last_bin="inclusive")[:, 0]
    assert official[-2:].tolist() == tail_official
    assert inclusive[-2:].tolist() == tail_inclusive
    np.testing.assert_array_equal(official[:-1], inclusive[:-1])  # only the last bin differs


@pytest.mark.parity
def test_bins_not_divisible_by_hand():
    # n = 10 into L = 4: edges round(0, 2.5, 5, 7.5, 10) = 0, 2, 5, 8, 10 (half to even).
    x = _frame_index(10)
    assert bin_edges(10, 4).tolist() == [0, 2, 5, 8, 10]
    assert mean_pool_bins(x, 4, last_bin="inclusive")[:, 0].tolist() == [0.5, 3.0, 6.0, 8.5]
    assert mean_pool_bins(x, 4, last_bin="official")[:, 0].tolist() == [0.5, 3.0, 6.0, 8.0]
    # n = 3 into L = 4: edges round(0, .75, 1.5, 2.25, 3) = 0, 1, 2, 2, 3; bin 2 is empty (takes frame 2).
    x = _frame_index(3)
    assert mean_pool_bins(x, 4, last_bin="inclusive")[:, 0].tolist() == [0.0, 1.0, 2.0, 2.0]
    assert mean_pool_bins(x, 4, last_bin="official")[:, 0].tolist() == [0.0, 1.0, 2.0, 2.0]


@pytest.mark.parity
@pytest.mark.parametrize("last_bin", ["official", "inclusive"])
def test_frames_pool_only_above_128(last_bin):
    # n <= 128 is kept untouched whatever the last-bin rule.
    x = _frame_index(128) + 1.0
    kept = preprocess_frames(x, 128, last_bin=last_bin, normalize="exact")
    np.testing.assert_array_equal(kept, np.ones((128, 1), np.float32))
    # n = 129: edges round(i * 129 / 128); the last bin is [128, 129), one frame, so both rules agree.
    x = _frame_index(129)
    assert mean_pool_bins(x, 128, last_bin=last_bin)[-1, 0] == 128.0
    # n = 256: bins [2i, 2i + 2); the last is [254, 256) = 254.5, official [254, 255) = 254.
    pooled = mean_pool_bins(_frame_index(256), 128, last_bin=last_bin)[:, 0]
    assert pooled[:-1].tolist() == [2 * i + 0.5 for i in range(127)]
    assert pooled[-1] == (254.0 if last_bin == "official" else 254.5)


@pytest.mark.parity
def test_official_is_the_default_and_bad_choice_rejected():
    x = _frame_index(64)
    np.testing.assert_array_equal(mean_pool_bins(x, 32), mean_pool_bins(x, 32, last_bin="official"))
    np.testing.assert_array_equal(preprocess_clips(x + 1, 32), preprocess_clips(x + 1, 32, last_bin="official"))
    with pytest.raises(ValueError, match="last_bin"):
        mean_pool_bins(x, 32, last_bin="closed")


def _bins_row_by_row(x: np.ndarray, num_bins: int, last_bin: str) -> np.ndarray:
    """Reference for the exact float32 values: each bin's rows added one after another in float32 (the
    reference code's per-bin mean sums so), divided in float64 and rounded to float32."""
    n = len(x)
    edges = [min(round(i * n / num_bins), n - 1) if last_bin == "official" else round(i * n / num_bins)
             for i in range(num_bins + 1)]
    out = np.empty((num_bins, x.shape[1]), np.float32)
    for i in range(num_bins):
        s, e = edges[i], edges[i + 1]
        if s >= e:
            out[i] = x[min(s, n - 1)]
            continue
        acc = x[s].copy()
        for r in range(s + 1, e):
            acc = (acc + x[r]).astype(np.float32)
        out[i] = (acc.astype(np.float64) / (e - s)).astype(np.float32)
    return out


@pytest.mark.parametrize("n", [1, 5, 33, 70, 129, 401, 1300])
@pytest.mark.parametrize("last_bin", ["official", "inclusive"])
def test_bins_sum_rows_in_order_bit_for_bit(n, last_bin):
    # bins of 1 to 40 rows summed for all bins at once must equal the one-bin-at-a-time row order exactly
    x = (np.random.default_rng(n).standard_normal((n, 6)) * 1e3).astype(np.float32)
    for num_bins in (32, 128):
        np.testing.assert_array_equal(mean_pool_bins(x, num_bins, last_bin=last_bin),
                                      _bins_row_by_row(x, num_bins, last_bin))


@pytest.mark.parametrize("normalize", ["official", "exact"])
def test_preprocessing_writes_into_rows_of_a_padded_batch(normalize):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((150, 8)).astype(np.float32)
    x[4] = 0.0  # a zero frame stays zero
    frames = np.full((2, 140, 8), 9.0, np.float32)  # (B, Lf, D) a padded batch, row 1 for this video
    clips = np.full((2, 32, 8), 9.0, np.float32)  # (B, Lc, D)
    short = x[:60]
    got_f = preprocess_frames(short, 128, normalize=normalize, out=frames[1, :60])
    got_c = preprocess_clips(x, 32, normalize=normalize, out=clips[1])
    assert np.shares_memory(got_f, frames) and np.shares_memory(got_c, clips)
    np.testing.assert_array_equal(frames[1, :60], preprocess_frames(short, 128, normalize=normalize))
    np.testing.assert_array_equal(clips[1], preprocess_clips(x, 32, normalize=normalize))
    assert (frames[1, 60:] == 9.0).all() and (frames[0] == 9.0).all() and (clips[0] == 9.0).all()  # nothing else written
    pooled = np.empty((128, 8), np.float32)
    preprocess_frames(x, 128, normalize=normalize, out=pooled)  # pooled first (150 > 128), then normalised into out
    np.testing.assert_array_equal(pooled, preprocess_frames(x, 128, normalize=normalize))
