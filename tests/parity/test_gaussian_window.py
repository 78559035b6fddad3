"""The Gaussian window switch: official (j/(L-1) - i/L over the padded span) vs centred ((j-i)/(L-1))."""

import math

import pytest
import torch

from prvrlab.models.factory import build_model
from prvrlab.models.gmm import GaussianAttention, batched_windows, gaussian_window


def hand_window(length: int, span: int, sigma: float, window: str) -> list[list[float]]:
    """Row i, column j of the first ``length`` positions of a ``span``-long window, by the formulas: the
    reference's ``generate_gauss_weight`` for ``official`` (w / width * exp(...) over the whole span, each
    row divided by its maximum), without the division for ``official_raw``."""
    width = max(sigma, 0.01) / 9
    out = []
    for i in range(length):
        row = []
        for j in range(span):
            if window in ("official", "official_raw"):
                d = j / max(span - 1, 1) - i / span
            else:
                d = (j - i) / max(span - 1, 1)
            row.append(0.3989422804014327 / width * math.exp(-(d * d) / (2 * width * width)))
        peak = max(row) if window == "official" else 0.3989422804014327 / width
        out.append([value / peak for value in row[:length]])
    return out


@pytest.mark.parametrize("window", ["official", "centred", "official_raw"])
@pytest.mark.parametrize("length, span, sigma", [(4, 4, 1.0), (3, 6, 0.5), (5, 5, 5.0), (1, 1, 1.0), (2, 7, 3.0),
                                                 (32, 32, 0.1), (20, 128, 0.3)])
def test_window_matches_hand_loops(window, length, span, sigma):
    got = gaussian_window(length, sigma, window=window, span=span)
    expected = torch.tensor(hand_window(length, span, sigma, window))
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


def test_official_rows_are_divided_by_their_maximum_as_the_reference():
    """32 clips, sigma 0.1 (v2's narrowest): the middle row has no column at d = 0; its peak is 1, not 0.35."""
    official, raw = gaussian_window(32, 0.1, window="official"), gaussian_window(32, 0.1, window="official_raw")
    torch.testing.assert_close(official.amax(dim=1), torch.ones(32))
    assert raw[16].max().item() == pytest.approx(math.exp(-((15 / 31 - 16 / 32) ** 2) / (2 * (0.1 / 9) ** 2)), rel=1e-5)
    assert raw[16].max().item() < 0.36
    torch.testing.assert_close(official, raw / raw.amax(dim=1, keepdim=True))
    short = batched_windows(torch.tensor([2]), 2, (0.1,), "official")  # exp(-1012) underflows: no 0/0
    assert torch.isfinite(short).all() and short[0, 0].amax(dim=1).tolist() == [1.0, 1.0]
    for window in ("official", "centred", "official_raw"):  # widths below 0.01 are clamped, as the reference
        assert torch.equal(gaussian_window(16, 0.001, window=window), gaussian_window(16, 0.01, window=window))
    centred = gaussian_window(32, 0.1, window="centred")
    assert torch.equal(centred.diagonal(), torch.ones(32))  # already 1 on the diagonal: nothing to divide


def test_official_rows_past_the_middle_peak_one_column_early():
    L = 128
    peaks = gaussian_window(L, 0.5, window="official").argmax(dim=1).tolist()
    assert all(peaks[i] == i for i in range(L // 2))
    assert all(peaks[i] == i - 1 for i in range(L // 2 + 1, L))
    assert gaussian_window(L, 0.5, window="centred").argmax(dim=1).tolist() == list(range(L))


@pytest.mark.parametrize("window", ["official", "centred", "official_raw"])
def test_batched_windows_span_each_real_length(window):
    windows = batched_windows(torch.tensor([5, 3]), 5, (1.0, math.inf), window)  # (B, K, L, L)
    torch.testing.assert_close(windows[0, 0], torch.tensor(hand_window(5, 5, 1.0, window)))
    torch.testing.assert_close(windows[1, 0, :3, :3], torch.tensor(hand_window(3, 3, 1.0, window)))
    assert torch.equal(windows[:, 1], torch.ones(2, 5, 5))


def attention(window: str, window_length) -> GaussianAttention:
    torch.manual_seed(0)
    attn = GaussianAttention(hidden_size=8, num_heads=2, sigmas=(0.5, 2.0), window=window, window_length=window_length)
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.5)
    return attn.eval()


@pytest.mark.parametrize("window", ["official", "centred"])
@pytest.mark.parametrize("window_length", ["real", 8])
def test_real_or_fixed_span_makes_outputs_independent_of_padding(window, window_length):
    attn = attention(window, window_length)
    x = torch.randn(1, 4, 8)
    alone = attn(x)  # (K, 1, 4, D)
    padded = torch.cat([x, torch.full((1, 3, 8), 50.0)], dim=1)  # garbage padding
    mask = torch.tensor([[True] * 4 + [False] * 3])
    got = attn(padded, mask)  # (K, 1, 7, D)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got[:, :, :4], alone, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[:, :, 4:], torch.zeros_like(got[:, :, 4:]))  # padding gets no output


def test_padded_span_follows_the_padded_length_as_the_reference():
    attn = attention("official", "padded")
    x = torch.randn(1, 4, 8)
    padded = torch.cat([x, torch.zeros(1, 3, 8)], dim=1)
    got = attn(padded, torch.tensor([[True] * 4 + [False] * 3]))
    assert torch.isfinite(got).all()
    assert not torch.allclose(got[:, :, :4], attn(x), atol=1e-4)  # span 7 vs span 4


def test_a_sequence_longer_than_the_fixed_span_is_refused():
    with pytest.raises(ValueError, match="window_length"):
        attention("official", 3)(torch.randn(1, 4, 8))
    with pytest.raises(ValueError, match="window"):
        GaussianAttention(hidden_size=8, num_heads=2, window="left")
    with pytest.raises(ValueError, match="window_length"):
        GaussianAttention(hidden_size=8, num_heads=2, window_length="batch")


SETTINGS = [("official", "padded"), ("official", "real"), ("centred", "real"), ("centred", "padded")]


@pytest.mark.parametrize("name", ["gmmformer", "gmmformer_v2"])
@pytest.mark.parametrize("window, window_length", SETTINGS)
def test_backbone_video_embeddings_are_finite_and_padding_invariant(name, window, window_length):
    torch.manual_seed(0)
    cfg = {"name": name, "hidden_size": 16, "num_heads": 2, "max_frames": 12}
    cfg.update(window=window, window_length=window_length)
    model = build_model(cfg, video_dim=6, query_dim=5).eval()
    clips, frames = torch.randn(2, 4, 6), torch.randn(2, 7, 6)
    mask = torch.tensor([[True] * 7, [True] * 5 + [False] * 2])
    with torch.no_grad():
        short = model.encode_videos(clips, frames, mask)
        longer = torch.cat([frames, torch.randn(2, 3, 6)], dim=1)  # 3 more padding frames, within max_frames
        more = model.encode_videos(clips, longer, torch.cat([mask, torch.zeros(2, 3, dtype=torch.bool)], dim=1))
    assert torch.isfinite(short.clip).all() and torch.isfinite(short.frame).all()
    torch.testing.assert_close(more.clip, short.clip)
    frame = more.frame if more.frame.dim() == 2 else more.frame[:, :7]
    torch.testing.assert_close(frame, short.frame, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["gmmformer", "gmmformer_v2"])
def test_backbones_default_to_the_official_window_over_max_frames(name):
    model = build_model({"name": name, "hidden_size": 16, "num_heads": 2, "max_frames": 12}, video_dim=6, query_dim=5)
    frame_attn, clip_attn = model.frame.layers[0].attention, model.clip.layers[0].attention
    assert (frame_attn.window, frame_attn.window_length) == ("official", 12)
    assert (clip_attn.window, clip_attn.window_length) == ("official", "padded")  # clips are never padded
    with pytest.raises(ValueError, match="window"):
        build_model({"name": name, "window": "left"}, video_dim=6, query_dim=5)
