"""The `arl` loss (Eqs. 8-12, Table 6) against hand loops, margins, empty sets, cross-model, validation."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml

from prvrlab.losses.arl import ARLLoss
from prvrlab.losses.triplet import TripletLoss
from prvrlab.models.base import ModelOutput, QueryEmbedding, VideoEmbedding
from prvrlab.platform.config import ConfigError, validate
from prvrlab.registry import LOSSES

from loss_helpers import make_batch
from device_under_test import DEVICE

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
HARDEST = {"hard_negative_start_epoch": 0}  # triplets on each set's hardest member from the first epoch, as the hand loop


def aux_for(frame_sim, frame_mask, video_sets, frame_sets, frame_on=True, encoder=0, aux=None):
    """The plug-in outputs the loss reads (encoder ``encoder``), k_hat from the real frames."""
    k_hat = frame_sim.detach().masked_fill(~frame_mask[None], float("-inf")).argmax(dim=2)
    aux = dict(aux or {})
    aux.update({"arl.frame_mask": frame_mask, "arl.frame_on": torch.tensor(frame_on)})
    aux.update({f"arl.frame_sim{encoder}": frame_sim, f"arl.best_frame{encoder}": k_hat,
                f"arl.video_sets{encoder}": video_sets, f"arl.frame_sets{encoder}": frame_sets})
    return aux


def output(aux) -> ModelOutput:
    return ModelOutput(scores={}, query=QueryEmbedding(), video=VideoEmbedding(), aux=aux)


def case(seed: int, query_video: list[int], lengths: list[int], p: float = 0.4):
    g = torch.Generator(DEVICE).manual_seed(seed)
    nq, nv, lf = len(query_video), len(lengths), max(lengths)
    frame_sim = torch.rand(nq, nv, lf, generator=g) * 2 - 1
    frame_mask = torch.arange(lf)[None] < torch.tensor(lengths)[:, None]
    video_sets = torch.rand(nq, nv, generator=g) < p
    frame_sets = (torch.rand(nq, nv, lf, generator=g) < p) & frame_mask[None]
    return frame_sim, frame_mask, video_sets, frame_sets


# ------------------------------------------------------------------ the hand loop


def nce_term(pos: float, amb: list[float], neg: list[float], usage: str) -> float:
    if usage == "ignore":
        amb = []
    denominator = math.exp(pos) + sum(math.exp(x) for x in amb + neg)
    if usage == "positive":  # supervised contrastive: mean over the positives of -log(e^p / denominator)
        return sum(-math.log(math.exp(x) / denominator) for x in [pos] + amb) / (1 + len(amb))
    return -math.log((math.exp(pos) + sum(math.exp(x) for x in amb)) / denominator)


def trip_term(pos: float, amb: list[float], neg: list[float], m: float, ma: float, usage: str) -> float:
    out = max(0.0, m + max(neg) - pos) if neg else 0.0
    if usage == "ours" and amb:
        out += max(0.0, ma + max(amb) - pos)
    return out


def split(cands: list[tuple[float, bool]]):
    return [x for x, a in cands if a], [x for x, a in cands if not a]


def hand_loss(frame_sim, frame_mask, video_sets, frame_sets, query_video, *, lam, m, ma, usage, frame_on=True):
    sf, mask = frame_sim.tolist(), frame_mask.tolist()
    nq, nv = len(sf), len(sf[0])
    k_hat = [[max((k for k in range(len(mask[j])) if mask[j][k]), key=lambda k: sf[i][j][k]) for j in range(nv)]
             for i in range(nq)]
    s = [[sf[i][j][k_hat[i][j]] for j in range(nv)] for i in range(nq)]
    video = frame = 0.0
    for i in range(nq):
        j = query_video[i]
        pos = s[i][j]
        rows = [  # t2v over unpaired videos, v2t over queries of other videos
            split([(s[i][v], bool(video_sets[i, v])) for v in range(nv) if v != j]),
            split([(s[q][j], bool(video_sets[q, j])) for q in range(nq) if query_video[q] != j]),
        ]
        video += sum(lam * nce_term(pos, a, n, usage) + trip_term(pos, a, n, m, ma, usage) for a, n in rows)
        k = k_hat[i][j]
        rows = [  # t2f over the own video's other real frames, f2t over queries not sharing the anchor frame
            split([(sf[i][j][f], bool(frame_sets[i, j, f])) for f in range(len(mask[j])) if mask[j][f] and f != k]),
            split([(sf[q][j][k], bool(frame_sets[q, j, k])) for q in range(nq)
                   if not (query_video[q] == j and k_hat[q][j] == k)]),
        ]
        frame += sum(lam * nce_term(pos, a, n, usage) + trip_term(pos, a, n, m, ma, usage) for a, n in rows)
    return (video + (frame if frame_on else 0.0)) / nq


@pytest.mark.parametrize("usage", ["ours", "positive", "ignore"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_the_hand_loop(usage, seed):
    query_video = [0, 0, 1, 2, 2, 2, 3]
    frame_sim, frame_mask, video_sets, frame_sets = case(seed, query_video, [4, 2, 1, 3])
    loss = LOSSES.build("arl", lambda_nce=0.3, margin=0.4, ambiguous_margin=0.15, ambiguous=usage, **HARDEST)
    got = loss(output(aux_for(frame_sim, frame_mask, video_sets, frame_sets)), make_batch(query_video, 4), epoch=0)
    expected = hand_loss(frame_sim, frame_mask, video_sets, frame_sets, query_video, lam=0.3, m=0.4, ma=0.15, usage=usage)
    assert float(got) == pytest.approx(expected, rel=1e-5)


def test_a_worked_example():
    # 2 queries, 2 videos of one frame: s = [[0.5, 0.3], [0.2, 0.6]]; q0 finds V1 ambiguous, nothing else
    frame_sim = torch.tensor([[[0.5], [0.3]], [[0.2], [0.6]]])
    mask = torch.ones(2, 1, dtype=torch.bool)
    video_sets = torch.tensor([[False, True], [False, False]])
    loss = LOSSES.build("arl", lambda_nce=1.0, margin=0.2, ambiguous_margin=0.1, **HARDEST)
    got = loss(output(aux_for(frame_sim, mask, video_sets, torch.zeros(2, 2, 1, dtype=torch.bool), frame_on=False)),
               make_batch([0, 1], 2), epoch=0)
    # q0: t2v = 0 (its only unpaired video is in the numerator); v2t(V0) over q1: -log(e^.5 / (e^.5 + e^.2));
    #     triplets: ambiguous V1 [0.1 + 0.3 - 0.5]_+ = 0, negative q1 for V0 [0.2 + 0.2 - 0.5]_+ = 0
    # q1: t2v -log(e^.6 / (e^.6 + e^.2)); v2t(V1) over q0, ambiguous: 0; triplets: V0 negative [0.2+0.2-0.6]_+ = 0,
    #     q0 ambiguous for V1 [0.1 + 0.3 - 0.6]_+ = 0
    expected = (math.log(1 + math.exp(-0.3)) + math.log(1 + math.exp(-0.4))) / 2
    assert float(got) == pytest.approx(expected, rel=1e-6)


def test_empty_sets_are_the_base_losses_whatever_the_usage():
    query_video = [0, 1, 1, 2]
    frame_sim, frame_mask, _, _ = case(5, query_video, [3, 3, 2])
    none_v = torch.zeros(4, 3, dtype=torch.bool)
    none_f = torch.zeros(4, 3, 3, dtype=torch.bool)
    values = []
    for usage in ("ours", "positive", "ignore"):
        loss = LOSSES.build("arl", ambiguous=usage, **HARDEST)
        values.append(float(loss(output(aux_for(frame_sim, frame_mask, none_v, none_f)), make_batch(query_video, 3), epoch=0)))
    assert values[0] == pytest.approx(values[1]) == pytest.approx(values[2])
    base = hand_loss(frame_sim, frame_mask, none_v, none_f, query_video, lam=0.02, m=0.2, ma=0.1, usage="ignore")
    assert values[0] == pytest.approx(base, rel=1e-5)


def test_ambiguous_members_are_pushed_as_negatives_ignored_or_pulled_as_positives():
    query_video = [0, 1, 2]
    frame_sim, frame_mask, _, _ = case(7, query_video, [2, 2, 2])
    frame_sim.requires_grad_(True)
    ambiguous = torch.zeros(3, 3, dtype=torch.bool)
    ambiguous[0, 1] = True  # (q0, V1) only

    def grad_of_pair(usage: str, video_sets) -> torch.Tensor:
        loss = LOSSES.build("arl", ambiguous=usage, lambda_nce=1.0, margin=0.9, ambiguous_margin=0.5, **HARDEST)
        frame_sim.grad = None
        aux = aux_for(frame_sim, frame_mask, video_sets, torch.zeros(3, 3, 2, dtype=torch.bool), frame_on=False)
        loss(output(aux), make_batch(query_video, 3), epoch=0).backward()
        assert torch.isfinite(frame_sim.grad).all()
        return frame_sim.grad[0, 1].clone()  # d loss / d s^f(q0, V1, .)

    k = int(frame_sim.detach()[0, 1].argmax())
    assert float(grad_of_pair("ours", torch.zeros_like(ambiguous))[k]) > 0  # a negative: descent pushes it down
    assert torch.equal(grad_of_pair("ignore", ambiguous), torch.zeros(2))  # masked out of every term
    assert float(grad_of_pair("positive", ambiguous)[k]) < 0  # a positive: descent pulls it up


def test_frame_term_only_when_the_plugin_switches_it_on():
    query_video = [0, 0, 1]
    frame_sim, frame_mask, video_sets, frame_sets = case(3, query_video, [3, 2])
    loss = LOSSES.build("arl", **HARDEST)
    batch = make_batch(query_video, 2)
    off = loss(output(aux_for(frame_sim, frame_mask, video_sets, frame_sets, frame_on=False)), batch, epoch=0)
    assert float(loss.pop_step_metrics()["frame"]) == 0.0
    on = loss(output(aux_for(frame_sim, frame_mask, video_sets, frame_sets, frame_on=True)), batch, epoch=0)
    metrics = {k: float(v) for k, v in loss.pop_step_metrics().items()}  # 0-d tensors where the loss lives
    assert metrics["frame"] > 0 and float(on) == pytest.approx(float(off) + metrics["frame"])
    assert metrics["video"] == pytest.approx(float(off))


def test_cross_model_sums_both_encoders_with_their_own_sets():
    query_video = [0, 1, 1, 2]
    a = case(11, query_video, [3, 1, 2])
    b = case(12, query_video, [3, 1, 2])
    loss = LOSSES.build("arl", **HARDEST)
    batch = make_batch(query_video, 3)
    both = loss(output(aux_for(*b, encoder=1, aux=aux_for(*a))), batch, epoch=0)
    first = loss(output(aux_for(*a)), batch, epoch=0)
    second = loss(output(aux_for(*b)), batch, epoch=0)
    assert float(both) == pytest.approx(float(first) + float(second))


def test_before_the_hard_negative_epoch_each_set_gives_a_drawn_member():
    """One query of V0 (s = 0.5), ambiguous V1 (0.48) and V2 (0.0), negatives V3 (0.45) and V4 (0.1); m = 0.2,
    m_a = 0.1, no NCE, no other query (v2t empty). Hardest: [0.2 + 0.45 - 0.5]_+ + [0.1 + 0.48 - 0.5]_+ = 0.23;
    drawn: the negative hinge 0.15 or 0, the ambiguous one 0.08 or 0, each pair of members as likely."""
    frame_sim = torch.tensor([[[0.5], [0.48], [0.0], [0.45], [0.1]]])  # (1, 5, 1)
    mask = torch.ones(5, 1, dtype=torch.bool)
    video_sets = torch.tensor([[False, True, True, False, False]])
    aux = aux_for(frame_sim, mask, video_sets, torch.zeros(1, 5, 1, dtype=torch.bool), frame_on=False)
    loss = LOSSES.build("arl", lambda_nce=0.0, margin=0.2, ambiguous_margin=0.1, hard_negative_start_epoch=2)
    batch = make_batch([0], 5)
    assert float(loss(output(aux), batch, epoch=2)) == pytest.approx(0.23)
    drawn = []
    for seed in range(60):
        torch.manual_seed(seed)
        drawn.append(round(float(loss(output(aux), batch, epoch=1)), 6))
    assert set(drawn) == {0.0, 0.08, 0.15, 0.23}
    assert ARLLoss().hard_negative_start_epoch == TripletLoss().hard_negative_start_epoch == 20  # one default


def test_margins_are_validated_at_config_time():
    with pytest.raises(ValueError, match=r"ambiguous_margin \(0\.2\) must be < margin \(0\.2\)"):
        ARLLoss(margin=0.2, ambiguous_margin=0.2)
    for kwargs, name in [({"lambda_nce": -1}, "lambda_nce"), ({"ambiguous": "negative"}, "ambiguous"), ({"margin": -0.1}, "margin"),
                         ({"hard_negative_start_epoch": -1}, "hard_negative_start_epoch")]:
        with pytest.raises(ValueError, match=name):
            ARLLoss(**kwargs)
    raw = yaml.safe_load((CONFIGS / "arl_synth.yaml").read_text())
    raw["data"]["synthesize"] = None
    raw["losses"]["ambiguity"]["ambiguous_margin"] = 0.3
    with pytest.raises(ConfigError, match=r"losses\.ambiguity.*ambiguous_margin \(0\.3\) must be < margin"):
        validate(raw)


def test_the_loss_needs_the_plugin_and_may_not_share_its_name():
    raw = yaml.safe_load((CONFIGS / "arl_synth.yaml").read_text())
    raw["data"]["synthesize"] = None
    no_plugin = {**raw, "plugins": {}}
    with pytest.raises(ConfigError, match=r"arl\.frame_mask.*plugins\.arl"):
        validate(no_plugin)
    clash = {**raw, "losses": {"arl": raw["losses"]["ambiguity"]}}
    with pytest.raises(ConfigError, match=r"losses\.arl: a loss term may not share its name with the plug-in 'arl'"):
        validate(clash)
    cfg = validate(raw)
    assert cfg.plugins["arl"]["tau_s_mode"] == "rule" and cfg.losses["ambiguity"]["ambiguous"] == "ours"
