"""Moment-coverage loss: hand loops, padding, the learnable temperature, its metric, its needs,
and a short run through the real platform (config validation + in-process training)."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from loss_helpers import make_batch

from prvrlab.losses.moment_coverage import MomentCoverageLoss, frame_attention
from prvrlab.models.base import ModelOutput, QueryEmbedding, VideoEmbedding
from prvrlab.models.factory import NeedsError, check_needs
from prvrlab.models.gmmformer import GMMFormer
from prvrlab.platform.config import ConfigError, load_raw, validate
from prvrlab.registry import BACKBONES
from device_under_test import DEVICE

REPO = Path(__file__).resolve().parents[2]


def output(vectors: torch.Tensor, frames: torch.Tensor, mask: torch.Tensor, branch: str = "frame") -> ModelOutput:
    """A model output carrying query vectors and per-frame tokens (as a pooled-frame backbone exposes them)."""
    video = VideoEmbedding(extra={"frame_tokens": frames, "frame_mask": mask})
    return ModelOutput(scores={}, query=QueryEmbedding(vectors={branch: vectors}), video=video)


def loop_attention(vectors, frames, mask, query_video, tau):
    """a_i(j) for the real frames j of query i's video, as {j: weight} per query."""

    def cos(a, b):
        dot = sum(x * y for x, y in zip(a, b))
        return dot / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))

    out = []
    for i, q in enumerate(vectors):
        v = query_video[i]
        real = [j for j in range(len(frames[v])) if mask[v][j]]
        e = {j: math.exp(cos(q, frames[v][j]) / tau) for j in real}
        z = sum(e.values())
        out.append({j: e[j] / z for j in real})
    return out


def loop_loss(vectors, frames, mask, query_video, tau):
    att = loop_attention(vectors, frames, mask, query_video, tau)
    overlaps = []
    for i in range(len(vectors)):
        for k in range(i + 1, len(vectors)):
            if query_video[i] == query_video[k]:
                overlaps.append(sum(att[i][j] * att[k][j] for j in att[i]))
    return sum(overlaps) / len(overlaps) if overlaps else 0.0


def random_case(seed: int = 0):
    g = torch.Generator(DEVICE).manual_seed(seed)
    query_video = [0, 0, 0, 1, 2, 2]  # video 1 has one query: no pair
    vectors = torch.randn(6, 5, generator=g)
    frames = torch.randn(3, 4, 5, generator=g)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    frames[~mask] = 100.0 * torch.randn(int((~mask).sum()), 5, generator=g)  # loud padding
    return vectors, frames, mask, query_video


def test_worked_example():
    # one video, two orthogonal frames, each query on "its" frame, tau = 1:
    # a_0 = [e, 1] / (e + 1), a_1 = [1, e] / (e + 1), overlap = 2e / (e + 1)^2
    vectors = torch.tensor([[1.0, 0.0], [0.0, 3.0]])
    frames = torch.tensor([[[2.0, 0.0], [0.0, 1.0]]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss = MomentCoverageLoss(temperature=1.0, min_temperature=0.5)
    value = loss(output(vectors, frames, mask), make_batch([0, 0], 1), epoch=0)
    assert value.item() == pytest.approx(2 * math.e / (math.e + 1) ** 2, rel=1e-6)


def test_matches_loops_and_ignores_padding():
    vectors, frames, mask, query_video = random_case()
    loss = MomentCoverageLoss(temperature=0.3)
    value = loss(output(vectors, frames, mask), make_batch(query_video, 3), epoch=0)
    expected = loop_loss(vectors.tolist(), frames.tolist(), mask.tolist(), query_video, 0.3)
    assert value.item() == pytest.approx(expected, rel=1e-5)

    # the attention is exactly 0 on padding and matches the loop on real frames
    tau = torch.tensor(0.3)
    att = frame_attention(vectors, frames, mask, torch.tensor(query_video), tau)
    pad = ~mask[torch.tensor(query_video)]
    assert torch.all(att[pad] == 0)
    for i, row in enumerate(loop_attention(vectors.tolist(), frames.tolist(), mask.tolist(), query_video, 0.3)):
        for j, weight in row.items():
            assert att[i, j].item() == pytest.approx(weight, rel=1e-5)

    # other padding values change nothing, and padding frames receive no gradient
    other = frames.clone()
    other[~mask] = -7.0
    frames_grad = other.clone().requires_grad_(True)
    again = loss(output(vectors, frames_grad, mask), make_batch(query_video, 3), epoch=0)
    assert again.item() == pytest.approx(value.item(), rel=1e-6)
    again.backward()
    assert torch.all(frames_grad.grad[~mask] == 0) and torch.isfinite(frames_grad.grad).all()


def test_gradient_reaches_the_temperature():
    vectors, frames, mask, query_video = random_case(1)
    vectors.requires_grad_(True)
    loss = MomentCoverageLoss(temperature=0.2)
    loss(output(vectors, frames, mask), make_batch(query_video, 3), epoch=0).backward()
    grad = loss.log_temperature.grad
    assert grad is not None and math.isfinite(grad.item()) and grad.item() != 0.0
    assert torch.all(vectors.grad[3] == 0)  # the only query of video 1 is in no pair

    # finite differences on log(tau) agree with autograd
    eps = 1e-3
    with torch.no_grad():
        values = []
        for sign in (1, -1):
            probe = MomentCoverageLoss(temperature=0.2)
            probe.log_temperature += sign * eps
            values.append(probe(output(vectors, frames, mask), make_batch(query_video, 3), epoch=0).item())
    assert grad.item() == pytest.approx((values[0] - values[1]) / (2 * eps), rel=1e-2)


def test_temperature_floor():
    loss = MomentCoverageLoss(temperature=0.05, min_temperature=0.02)
    with torch.no_grad():
        loss.log_temperature.fill_(math.log(1e-4))
    assert loss.temperature().item() == pytest.approx(0.02)


def test_metric_is_logged_and_declared():
    vectors, frames, mask, query_video = random_case()
    loss = MomentCoverageLoss(temperature=0.25)
    assert loss.metric_names() == ("temperature",)
    loss(output(vectors, frames, mask), make_batch(query_video, 3), epoch=0)
    assert {k: float(v) for k, v in loss.pop_step_metrics().items()} == {"temperature": pytest.approx(0.25)}
    assert loss.pop_step_metrics() == {}  # popped once per step by the loop


def test_no_pair_gives_a_zero_with_a_graph():
    vectors = torch.randn(3, 4, requires_grad=True)
    frames, mask = torch.randn(3, 5, 4), torch.ones(3, 5, dtype=torch.bool)
    loss = MomentCoverageLoss()
    value = loss(output(vectors, frames, mask), make_batch([0, 1, 2], 3), epoch=0)
    assert value.item() == 0.0 and value.requires_grad
    value.backward()
    assert torch.equal(vectors.grad, torch.zeros(3, 4))
    assert loss.log_temperature.grad is not None and loss.log_temperature.grad.item() == 0.0


def test_video_without_real_frames_is_finite():
    vectors = torch.randn(2, 4, requires_grad=True)
    frames, mask = torch.randn(1, 3, 4), torch.zeros(1, 3, dtype=torch.bool)
    value = MomentCoverageLoss()(output(vectors, frames, mask), make_batch([0, 0], 1), epoch=0)
    value.backward()
    assert value.item() == 0.0 and torch.isfinite(vectors.grad).all()


def test_branch_selects_the_query_vector():
    vectors, frames, mask, query_video = random_case()
    batch = make_batch(query_video, 3)
    value = MomentCoverageLoss(branch="video")(output(vectors, frames, mask, "video"), batch, epoch=0)
    assert value.item() > 0
    with pytest.raises(ValueError, match="branch='frame'"):
        MomentCoverageLoss()(output(vectors, frames, mask, "video"), batch, epoch=0)


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"temperature": 0.0}, "temperature"),
        ({"temperature": -1.0}, "temperature"),
        ({"min_temperature": 0.0}, "min_temperature"),
        ({"temperature": 0.01, "min_temperature": 0.1}, "min_temperature"),
        ({"branch": ""}, "branch"),
    ],
)
def test_invalid_hyperparameters(kwargs, param):
    with pytest.raises(ValueError, match=param):
        MomentCoverageLoss(**kwargs)


def test_needs_frame_tokens_and_query_groups_for_training_only():
    loss = MomentCoverageLoss()
    assert loss.needs(training=True) == {"frame_tokens", "query_groups"}
    assert loss.needs(training=False) == frozenset()


def test_check_needs_names_the_term_and_the_backbone():
    stub = SimpleNamespace(provides=frozenset())
    with pytest.raises(NeedsError) as err:
        check_needs(stub, "frameless", {"losses.coverage": MomentCoverageLoss()})
    message = str(err.value)
    assert "losses.coverage" in message and "'moment_coverage'" in message
    assert "frame_tokens" in message and "'frameless'" in message


def synth_raw(**coverage) -> dict:
    raw = load_raw(REPO / "configs" / "gmmformer_synth.yaml")
    raw["losses"]["coverage"] = {"loss": "moment_coverage", "weight": 0.01, **coverage}
    return raw


def test_config_validation_resolves_and_rejects(monkeypatch):
    cfg = validate(synth_raw())
    assert cfg.losses["coverage"] == {
        "loss": "moment_coverage",
        "weight": 0.01,
        "branch": "frame",
        "temperature": 0.1,
        "min_temperature": 0.01,
    }
    with pytest.raises(ConfigError, match="losses.coverage.branch: 'moment' is not a branch"):
        validate(synth_raw(branch="moment"))
    with pytest.raises(ConfigError, match="losses.coverage: temperature must be"):
        validate(synth_raw(temperature=-1.0))

    # a backbone that provides no per-frame tokens (registered for this test only)
    BACKBONES.names()  # load the registry before swapping in a copy
    monkeypatch.setattr(BACKBONES, "_items", dict(BACKBONES._items))

    @BACKBONES.register("frameless_test")
    class Frameless(GMMFormer):
        provides = frozenset()

    raw = synth_raw()
    raw["model"]["name"] = "frameless_test"
    with pytest.raises(ConfigError) as err:
        validate(raw)
    assert str(err.value) == (
        "losses.coverage: 'moment_coverage' needs frame_tokens (per-frame video embeddings (Nv, Lf, D) with "
        "their mask: VideoEmbedding.frame_tokens()), which backbone 'frameless_test' does not provide; "
        "it provides: query_groups"
    )


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> Path:
    from prvrlab.data.synth import synthesize

    root = tmp_path_factory.mktemp("coverage_synth")
    synthesize(root, preset="tiny", seed=0, progress=False)
    return root


def test_trains_through_the_platform(tiny_data, tmp_path):
    pytest.importorskip("mlflow")  # the run is recorded in MLflow (absent from the GPU image)
    from prvrlab.platform.train.driver import train

    raw = synth_raw(temperature=0.2)
    raw["name"] = "coverage"
    raw["data"] = {"root": str(tiny_data), "collection": "synth", "visual_feature": "synth_feat"}
    raw["model"].update(hidden_size=32, num_heads=2, dropout=0.0)
    raw["train"] = {"epochs": 1, "batch_size": 16, "lr": 1e-3, "num_workers": 1, "seed": 0}
    raw["eval"] = {"final_splits": ["val"]}
    raw["tracking"] = {
        "uri": f"sqlite:///{tmp_path / 'mlflow.db'}",
        "experiment": "tests",
        "storage_path": str(tmp_path / "results"),
    }
    result = train(validate(raw), use_ray=False, echo=None)
    (epoch,) = result.history
    assert "train/coverage" in epoch and 0.0 < epoch["train/coverage"] < 1.0
    assert "train/coverage.temperature" in epoch
    saved = torch.load(result.run_dir / "best_model.pt", weights_only=True)
    learned = saved["losses"]["losses.coverage.log_temperature"].item()
    assert learned != pytest.approx(math.log(0.2), abs=1e-6)  # the temperature was optimised
    assert epoch["train/coverage.temperature"] != pytest.approx(0.2, abs=1e-7)
