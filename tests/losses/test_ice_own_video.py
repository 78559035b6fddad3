"""L_ice's ``own_video`` switch: ``ignore`` leaves a mined text's own-video moments (and a moment's own-video
texts) out of the pair mini-batch's negatives; ``negative`` (the default) keeps the paper's literal n_c batch.
Expectations are hand loops over the pairs."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from prvrlab.losses.infonce import infonce
from prvrlab.losses.triplet import TripletLoss
from prvrlab.models.base import ModelOutput, QueryEmbedding, VideoEmbedding
from prvrlab.platform.config import ConfigError, load_raw, validate
from prvrlab.registry import LOSSES

from loss_helpers import make_batch

REPO = Path(__file__).resolve().parents[2]
MARGIN, NCE = 0.2, 0.5
HARDEST = {"margin": MARGIN, "nce_weight": NCE, "hard_negative_start_epoch": 0}  # no random draw


def cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b / (a.norm() * b.norm()))


def hand_loss(texts, moments, ignore: list[list[bool]]) -> float:
    """Triplet (hardest allowed negative, both directions) + NCE * two-sided InfoNCE over the n x n pair
    matrix, diagonal positive, entries ``ignore[i][j]`` left out; every pair's moment distinct."""
    n = len(texts)
    s = [[cos(texts[i], moments[j]) for j in range(n)] for i in range(n)]
    d = [[float(texts[i] @ moments[j]) for j in range(n)] for i in range(n)]
    t2v = v2t = 0.0
    for i in range(n):
        negs = [s[i][j] for j in range(n) if j != i and not ignore[i][j]]
        if negs:
            t2v += max(0.0, MARGIN + max(negs) - s[i][i])
    for j in range(n):
        negs = [s[i][j] for i in range(n) if i != j and not ignore[i][j]]
        if negs:
            v2t += max(0.0, MARGIN + max(negs) - s[j][j])
    triplet = t2v / n + v2t / n
    rows = sum(math.log(sum(math.exp(d[i][j]) for j in range(n) if j == i or not ignore[i][j])) - d[i][i] for i in range(n))
    cols = sum(math.log(sum(math.exp(d[i][j]) for i in range(n) if i == j or not ignore[i][j])) - d[j][j] for j in range(n))
    return triplet + NCE * (rows / n + cols / n)


def case():
    """Three mined pairs: text rows 0, 1, 2 of a batch whose queries belong to videos 0, 1, 2, each paired
    with a moment of another video: text 0 (video 0) with a moment of video 1, text 1 (video 1) with one of
    video 2, text 2 (video 2) with one of video 0.  So text 0's own video holds pair 2's moment, and so on
    round the cycle."""
    g = torch.Generator().manual_seed(3)
    texts = torch.randn(3, 8, generator=g)
    moments = texts + 0.8 * torch.randn(3, 8, generator=g)
    text_row = torch.tensor([0, 1, 2])
    moment_video = torch.tensor([1, 2, 0])
    batch = make_batch([0, 1, 2], 3)
    aux = {"ice.pair_query": texts, "ice.pair_moment": moments, "ice.pair_text": text_row, "ice.pair_video": moment_video}
    own = [[int(batch.query_video[text_row[i]]) == int(moment_video[j]) and i != j for j in range(3)] for i in range(3)]
    return texts, moments, batch, aux, own


def output(aux) -> ModelOutput:
    return ModelOutput(scores={}, query=QueryEmbedding(), video=VideoEmbedding(), aux=aux)


def test_the_case_has_own_video_negatives():
    *_, own = case()
    assert own == [[False, False, True], [True, False, False], [False, True, False]]


def test_negative_keeps_the_paper_n_c_batch_and_ignore_leaves_own_video_pairs_out():
    texts, moments, batch, aux, own = case()
    none = [[False] * 3 for _ in range(3)]
    literal = LOSSES.build("ice_corr", **HARDEST)
    masked = LOSSES.build("ice_corr", own_video="ignore", **HARDEST)
    assert literal.own_video == "negative"  # the default
    got_literal = float(literal(output(aux), batch, epoch=0))
    got_masked = float(masked(output(aux), batch, epoch=0))
    assert got_literal == pytest.approx(hand_loss(texts, moments, none), rel=1e-5)
    assert got_masked == pytest.approx(hand_loss(texts, moments, own), rel=1e-5)
    assert got_masked != pytest.approx(got_literal, rel=1e-3)


def test_ignore_needs_the_pairs_rows_and_videos():
    masked = LOSSES.build("ice_corr", own_video="ignore")
    assert set(masked.required_aux()) == {"ice.pair_query", "ice.pair_moment", "ice.pair_text", "ice.pair_video"}
    assert set(LOSSES.build("ice_corr").required_aux()) == {"ice.pair_query", "ice.pair_moment"}


def test_an_ignored_entry_gets_no_gradient_and_a_positive_is_never_ignored():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, generator=g, requires_grad=True)
    query_video = torch.tensor([0, 1, 1])
    ignore = torch.zeros(3, 4, dtype=torch.bool)
    ignore[0, 2] = ignore[1, 0] = ignore[1, 1] = True  # (1, 1) is query 1's positive: still counted
    infonce(logits, query_video, ignore=ignore).backward()
    assert float(logits.grad[0, 2]) == 0.0 and float(logits.grad[1, 0]) == 0.0
    assert float(logits.grad[1, 1]) != 0.0
    # by hand: rows over the kept entries (positives always kept), columns with positives over theirs
    x = logits.detach()
    keep = ~ignore | torch.nn.functional.one_hot(query_video, 4).bool()
    t2v = sum(math.log(sum(math.exp(float(x[i, j])) for j in range(4) if keep[i, j])) - float(x[i, query_video[i]]) for i in range(3))
    v2t = 0.0
    for v in (0, 1):  # the columns holding a positive
        mine = [i for i in range(3) if int(query_video[i]) == v]
        v2t += math.log(sum(math.exp(float(x[i, v])) for i in range(3) if keep[i, v])) - math.log(sum(math.exp(float(x[i, v])) for i in mine))
    assert float(infonce(x, query_video, ignore=ignore)) == pytest.approx(t2v / 3 + v2t / 2, rel=1e-6)
    with pytest.raises(ValueError, match="two_sided"):
        infonce(x, query_video, form="joint", ignore=ignore)


def test_the_triplet_never_draws_an_ignored_negative():
    sim = torch.tensor([[0.5, 0.9, 0.1], [0.2, 0.6, 0.8], [0.7, 0.3, 0.4]])
    query_video = torch.tensor([0, 1, 2])
    ignore = torch.tensor([[False, True, False], [False, False, True], [True, False, False]])
    loss = TripletLoss(margin=MARGIN, hard_negative_start_epoch=0, hard_pool_size=1)
    terms = loss.compute(sim, query_video, epoch=0, ignore=ignore)
    assert terms.t2v_negative.tolist() == [2, 0, 1]  # the hardest among the entries left
    uniform = TripletLoss(margin=MARGIN, hard_negative_start_epoch=5)  # epoch 0: uniform draws
    for seed in range(20):  # they avoid the ignored entries too
        torch.manual_seed(seed)
        drawn = uniform.compute(sim, query_video, epoch=0, ignore=ignore)
        assert not ignore[torch.arange(3), drawn.t2v_negative].any()
        assert not ignore.t()[torch.arange(3), drawn.v2t_negative].any()


def test_own_video_is_a_checked_config_key():
    raw = load_raw(REPO / "configs" / "ice_base_ice_synth.yaml")
    assert validate(raw).losses["ice_corr"]["own_video"] == "negative"
    raw["losses"]["ice_corr"]["own_video"] = "ignore"
    assert validate(raw).losses["ice_corr"]["own_video"] == "ignore"
    raw["losses"]["ice_corr"]["own_video"] = "ignored"
    with pytest.raises(ConfigError, match="own_video.*ignore"):
        validate(raw)
