"""``window_length: batch`` (GMMFormer, MamFusion): the frame windows span the frames' padded length, i.e.
the batch's longest video, as in the reference code, whose collate functions pad each batch to it.

A video's frame embedding then depends on the other videos of its batch: in a batch with a longer video it
equals its own encoding zero-padded to that video's length, not its encoding alone.  Under ``padded`` (frames
span ``max_frames``) the batch changes nothing, and ``batch`` on frames padded to ``max_frames`` is ``padded``.
"""

from __future__ import annotations

import pytest
import torch

from prvrlab.models.factory import build_model
from prvrlab.platform.config import validate
from prvrlab.registry import BACKBONES

MAX_FRAMES = 40  # at least the 32 clips (they share the positional table)
EXTRA = {"gmmformer": {}, "mamfusion": {"mamba": True, "t2v": False, "v2t": False}}


def model(backbone: str, window_length: str, seed: int = 0):
    torch.manual_seed(seed)
    m = BACKBONES.build(
        backbone, video_dim=12, query_dim=8, hidden_size=16, num_heads=2, dropout=0.0, max_frames=MAX_FRAMES,
        window_length=window_length, **EXTRA[backbone],
    )
    with torch.no_grad():  # weights large enough that the windows move the result (the N(0, 0.02) start barely does)
        for name, p in m.named_parameters():
            if "qkv" in name:
                p.mul_(40.0)
    return m.eval()


def videos(lengths: list[int], seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    longest = max(lengths)
    mask = torch.arange(longest)[None] < torch.tensor(lengths)[:, None]  # (B, Lf)
    frames = torch.randn(len(lengths), longest, 12, generator=g) * mask[..., None]  # (B, Lf, Dv)
    clips = torch.randn(len(lengths), 32, 12, generator=g)  # (B, Lc, Dv)
    return clips, frames, mask


def frame_vectors(m, clips, frames, mask) -> torch.Tensor:
    with torch.no_grad():
        return m.encode_videos(clips, frames, mask).frame  # (B, D)


def padded_to(frames, mask, length: int):
    extra = length - frames.shape[1]
    return torch.nn.functional.pad(frames, (0, 0, 0, extra)), torch.nn.functional.pad(mask, (0, extra))


@pytest.mark.parametrize("backbone", ["gmmformer", "mamfusion"])
def test_a_video_encodes_as_its_batch_pads_it(backbone):
    m = model(backbone, "batch")
    clips, frames, mask = videos([6, 17])  # video 0 in a batch whose longest video has 17 frames
    in_batch = frame_vectors(m, clips, frames, mask)[0]
    short_frames, short_mask = frames[:1, :6], mask[:1, :6]
    alone = frame_vectors(m, clips[:1], short_frames, short_mask)[0]
    alone_padded = frame_vectors(m, clips[:1], *padded_to(short_frames, short_mask, 17))[0]
    torch.testing.assert_close(in_batch, alone_padded, atol=1e-5, rtol=1e-5)
    assert (in_batch - alone).abs().max() > 1e-3  # the span changed the windows: another embedding
    assert m.batch_dependent_videos()


@pytest.mark.parametrize("backbone", ["gmmformer", "mamfusion"])
def test_padded_windows_ignore_the_batch_and_equal_batch_windows_over_max_frames(backbone):
    m = model(backbone, "padded")
    assert not m.batch_dependent_videos()
    clips, frames, mask = videos([6, 17])
    in_batch = frame_vectors(m, clips, frames, mask)
    alone = frame_vectors(m, clips[:1], frames[:1, :6], mask[:1, :6])[0]
    torch.testing.assert_close(in_batch[0], alone, atol=1e-5, rtol=1e-5)
    b = model(backbone, "batch")
    b.load_state_dict(m.state_dict())
    torch.testing.assert_close(frame_vectors(b, clips, *padded_to(frames, mask, MAX_FRAMES)), in_batch, atol=1e-5, rtol=1e-5)


def test_window_length_is_checked_and_plugged_models_report_their_backbone(tmp_path):
    with pytest.raises(ValueError, match="window_length must be one of padded, batch, real, got 'batches'"):
        BACKBONES.build("gmmformer", video_dim=12, query_dim=8, window_length="batches")
    raw = {
        "name": "t", "data": {"root": str(tmp_path), "collection": "synth", "visual_feature": "f"},
        "model": {"name": "gmmformer", "hidden_size": 16, "num_heads": 2, "window_length": "batch"},
        "plugins": {"ral": {"msra": False}},
        "losses": {"clip_nce": {"loss": "infonce", "weight": 1.0, "branch": "clip"}},
        "tracking": {"uri": f"sqlite:///{tmp_path / 'm.db'}"},
    }
    cfg = validate(raw)
    plugged = build_model(cfg.model, cfg.plugins, video_dim=12, query_dim=8)
    assert type(plugged).__name__ == "PluggedModel" and plugged.batch_dependent_videos()
    raw["model"]["window_length"] = "real"
    cfg = validate(raw)
    assert not build_model(cfg.model, cfg.plugins, video_dim=12, query_dim=8).batch_dependent_videos()
