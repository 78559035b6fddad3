"""The probe that tells DDP whether a configuration leaves parameters out of its training steps."""

from __future__ import annotations

import pytest
import torch

from prvrlab.models.factory import build_system
from prvrlab.platform.train.unused import probe_batch, unused_parameters

VIDEO_DIM, QUERY_DIM = 12, 10
MODEL = {"name": "gmmformer", "hidden_size": 16, "num_heads": 2, "max_frames": 16, "dropout": 0.1}
LOSSES = {
    "clip_triplet": {"loss": "triplet", "weight": 1.0, "branch": "clip"},
    "frame_triplet": {"loss": "triplet", "weight": 1.0, "branch": "frame"},
}


def system(model=MODEL, plugins=None, losses=LOSSES):
    torch.manual_seed(0)
    return build_system(model, plugins, losses, video_dim=VIDEO_DIM, query_dim=QUERY_DIM)


def batch():
    return probe_batch(video_dim=VIDEO_DIM, query_dim=QUERY_DIM, num_clips=8, device=torch.device("cpu"))


def by_hand(sys_, b) -> list[str]:
    """The same question answered on the system itself: which trainable parameters get no .grad."""
    result, _ = sys_.train()(b, epoch=0)
    result.total.backward()
    return [n for n, p in sys_.named_parameters() if p.requires_grad and p.grad is None]


@pytest.mark.parametrize(
    "model, plugins, losses, expect",
    [
        (MODEL, None, LOSSES, []),
        ({**MODEL, "frame_weight": 0.0}, None, {"clip_triplet": LOSSES["clip_triplet"]}, ["model.frame."]),
        (MODEL, {"ral": {"msra": False}}, LOSSES, ["model.backbone.frame.pool."]),
    ],
    ids=["all_used", "frame_branch_off", "ral_csa_replaces_the_frame_scores"],
)
def test_the_probe_finds_what_a_step_leaves_out(model, plugins, losses, expect):
    b = batch()
    probed = unused_parameters(system(model, plugins, losses), b)
    assert probed == by_hand(system(model, plugins, losses), b)
    assert all(any(name.startswith(prefix) for prefix in expect) for name in probed)
    assert bool(probed) == bool(expect)


def test_the_probe_leaves_the_system_and_the_random_streams_as_they_were():
    sys_ = system()
    before = {k: v.clone() for k, v in sys_.state_dict().items()}
    torch.manual_seed(5)
    expected_draw = torch.rand(3)
    torch.manual_seed(5)
    assert unused_parameters(sys_, batch()) == []  # dropout draws inside the probe
    assert torch.equal(torch.rand(3), expected_draw)
    assert all(torch.equal(v, before[k]) for k, v in sys_.state_dict().items())
    assert all(p.grad is None for p in sys_.parameters())


def test_a_forward_that_fails_raises_and_still_restores_the_random_streams():
    b = batch()
    b.queries = b.queries[:, :, :3]  # wrong feature size
    sys_ = system()
    torch.manual_seed(7)
    expected = torch.rand(2)
    torch.manual_seed(7)
    with pytest.raises(RuntimeError):
        unused_parameters(sys_, b)
    assert torch.equal(torch.rand(2), expected)


def test_the_probe_batch_fits_the_datas_limits():
    small = probe_batch(video_dim=4, query_dim=3, num_clips=2, device=torch.device("cpu"), max_frames=4, max_query_len=2)
    assert small.frame_mask.sum(dim=1).tolist() == [4, 4, 3] and small.frames.shape == (3, 4, 4)
    assert small.query_mask.sum(dim=1).tolist() == [2, 2, 2, 2, 1] and small.queries.shape == (5, 2, 3)
    assert small.clips.shape == (3, 2, 4) and small.query_video.tolist() == [0, 0, 1, 2, 2]
