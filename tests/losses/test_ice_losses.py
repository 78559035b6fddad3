"""L_ice, L_irm (L_neg, L_red) and L_tcp of papers/002 against hand loops; validation with the plug-in."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from prvrlab.losses.ice_corr import ICECorrelationLoss
from prvrlab.losses.ice_irm import IRMLoss
from prvrlab.losses.ice_tcp import TCPLoss
from prvrlab.models.base import ModelOutput, QueryEmbedding, VideoEmbedding
from prvrlab.platform.config import ConfigError, load_raw, validate
from tests.losses.loss_helpers import make_batch
from device_under_test import DEVICE

REPO = Path(__file__).resolve().parents[2]


def output(**aux) -> ModelOutput:
    return ModelOutput(scores={}, query=QueryEmbedding(), video=VideoEmbedding(), aux={f"ice.{k}": v for k, v in aux.items()})


def cos(a, b) -> float:
    return float(F.cosine_similarity(a, b, dim=0))


def pairs_by_hand(anchor: torch.Tensor, target: torch.Tensor, margin: float, nce_weight: float) -> float:
    """Hardest-negative triplet (both directions) + nce_weight * InfoNCE (both directions), diagonal positive."""
    n = anchor.shape[0]
    t2v = v2t = 0.0
    for i in range(n):
        hardest_target = max(cos(anchor[i], target[j]) for j in range(n) if j != i)
        t2v += max(0.0, margin + hardest_target - cos(anchor[i], target[i]))
        hardest_anchor = max(cos(anchor[j], target[i]) for j in range(n) if j != i)
        v2t += max(0.0, margin + hardest_anchor - cos(anchor[i], target[i]))
    dots = [[float(anchor[i] @ target[j]) for j in range(n)] for i in range(n)]
    lse = lambda xs: math.log(sum(math.exp(x) for x in xs))  # noqa: E731
    nce_t2v = sum(lse(dots[i]) - dots[i][i] for i in range(n)) / n
    nce_v2t = sum(lse([dots[i][j] for i in range(n)]) - dots[j][j] for j in range(n)) / n
    return t2v / n + v2t / n + nce_weight * (nce_t2v + nce_v2t)


def test_ice_corr_by_hand():
    torch.manual_seed(0)
    texts, moments = torch.randn(4, 6), torch.randn(4, 6)
    loss = ICECorrelationLoss(margin=0.3, nce_weight=0.5, hard_negative_start_epoch=0)
    got = loss(output(pair_query=texts, pair_moment=moments), make_batch([0], 1), epoch=0)
    assert float(got) == pytest.approx(pairs_by_hand(texts, moments, 0.3, 0.5), rel=1e-5)
    no_nce = ICECorrelationLoss(margin=0.3, nce_weight=0.0, hard_negative_start_epoch=0)
    assert float(no_nce(output(pair_query=texts, pair_moment=moments), make_batch([0], 1), epoch=0)) == pytest.approx(
        pairs_by_hand(texts, moments, 0.3, 0.0), rel=1e-5
    )


def test_ice_corr_without_pairs_is_an_attached_zero():
    loss = ICECorrelationLoss()
    for n in (0, 1):
        texts = torch.randn(n, 6, requires_grad=True)
        got = loss(output(pair_query=texts, pair_moment=torch.randn(n, 6)), make_batch([0], 1), epoch=0)
        assert float(got.detach()) == 0.0 and got.requires_grad
        got.backward()


def test_ice_corr_needs_the_plugin_part():
    with pytest.raises(ValueError, match="'ice' plug-in"):
        ICECorrelationLoss()(output(), make_batch([0], 1), epoch=0)
    with pytest.raises(ValueError, match="nce_weight"):
        ICECorrelationLoss(nce_weight=-1.0)
    with pytest.raises(ValueError, match="margin"):
        IRMLoss(margin=-0.1)


def irm_output(seed: int = 0, n: int = 3) -> tuple[ModelOutput, dict]:
    g = torch.Generator(DEVICE).manual_seed(seed)
    t = {k: torch.randn(n, 5, generator=g) for k in ("query", "key_moment", "redundant_video", "redundant_query")}
    return output(**t), t


def neg_by_hand(t: dict, margin: float, nce_weight: float) -> float:
    total_hinge = total_ce = 0.0
    n = t["query"].shape[0]
    for i in range(n):
        q, m = t["query"][i], t["key_moment"][i]
        rs = [t["redundant_video"][i], t["redundant_query"][i]]
        total_hinge += sum(max(0.0, margin + cos(q, r) - cos(q, m)) for r in rs)
        dots = [float(q @ m)] + [float(q @ r) for r in rs]
        total_ce += math.log(sum(math.exp(d) for d in dots)) - dots[0]
    return total_hinge / n + nce_weight * total_ce / n


def test_irm_neg_and_red_by_hand():
    out, t = irm_output()
    b = make_batch([0, 0, 0], 1)
    kw = dict(margin=0.2, nce_weight=0.3, hard_negative_start_epoch=0)
    neg = float(IRMLoss(red=False, **kw)(out, b, epoch=0))
    red = float(IRMLoss(neg=False, **kw)(out, b, epoch=0))
    both = float(IRMLoss(**kw)(out, b, epoch=0))
    assert neg == pytest.approx(neg_by_hand(t, 0.2, 0.3), rel=1e-5)
    assert red == pytest.approx(pairs_by_hand(t["redundant_query"], t["redundant_video"], 0.2, 0.3), rel=1e-5)
    assert both == pytest.approx(neg + red, rel=1e-6)


def grouped_pairs_by_hand(anchor, targets, column, margin: float, nce_weight: float) -> float:
    """Hardest-negative triplet + InfoNCE with ``targets`` (k, D) as columns and ``column[i]`` anchor i's
    positive: a column's positive score is the mean over its anchors, its InfoNCE positives all of them."""
    n, k = anchor.shape[0], targets.shape[0]
    c = [[cos(anchor[i], targets[j]) for j in range(k)] for i in range(n)]
    t2v = sum(max(0.0, margin + max(c[i][j] for j in range(k) if j != column[i]) - c[i][column[i]])
              for i in range(n) if k > 1)
    v2t = 0.0
    for j in range(k):
        mine = [i for i in range(n) if column[i] == j]
        others = [i for i in range(n) if column[i] != j]
        if mine and others:
            v2t += max(0.0, margin + max(c[i][j] for i in others) - sum(c[i][j] for i in mine) / len(mine))
    d = [[float(anchor[i] @ targets[j]) for j in range(k)] for i in range(n)]
    lse = lambda xs: math.log(sum(math.exp(x) for x in xs))  # noqa: E731
    nce_t2v = sum(lse(d[i]) - d[i][column[i]] for i in range(n)) / n
    nce_v2t = sum(lse([d[i][j] for i in range(n)]) - lse([d[i][j] for i in range(n) if column[i] == j])
                  for j in range(k)) / k
    return t2v / n + v2t / k + nce_weight * (nce_t2v + nce_v2t)


def test_irm_red_counts_an_identical_redundant_video_feature_once_positive_for_both_its_queries():
    """Queries 0 and 2 of one video share a key moment, so r_v(0) == r_v(2): one column, not each other's
    negative (which held an aligned pair above 0 whatever the model did)."""
    _, t = irm_output(seed=3, n=4)
    r_v = t["redundant_video"].clone()
    r_v[2] = r_v[0]
    out = output(query=t["query"], key_moment=t["key_moment"], redundant_video=r_v, redundant_query=t["redundant_query"])
    kw = dict(margin=0.2, nce_weight=0.3, hard_negative_start_epoch=0)
    red = float(IRMLoss(neg=False, **kw)(out, make_batch([0, 1, 0, 2], 3), epoch=0))
    expected = grouped_pairs_by_hand(t["redundant_query"], r_v[[0, 1, 3]], [0, 1, 0, 2], 0.2, 0.3)
    assert red == pytest.approx(expected, rel=1e-5)
    assert red != pytest.approx(pairs_by_hand(t["redundant_query"], r_v, 0.2, 0.3), rel=1e-3)  # the old diagonal
    distinct = pairs_by_hand(t["redundant_query"], t["redundant_video"], 0.2, 0.3)
    assert grouped_pairs_by_hand(t["redundant_query"], t["redundant_video"], [0, 1, 2, 3], 0.2, 0.3) == pytest.approx(distinct)
    aligned = torch.eye(4)[:, :3] * 5  # r_q(i) = r_v(i) exactly, queries 0 and 3 with one r_v
    aligned[3] = aligned[0]
    perfect = output(query=t["query"], key_moment=t["key_moment"], redundant_video=aligned, redundant_query=aligned.clone())
    got = float(IRMLoss(neg=False, margin=0.2, nce_weight=0.0, hard_negative_start_epoch=0)(perfect, make_batch([0] * 4, 1), epoch=0))
    assert got == 0.0  # aligned pairs, margin met: nothing left (0.2 per duplicate before)


def test_irm_both_terms_off_keeps_the_redundancy_features_in_the_graph():
    out, _ = irm_output()
    r_v = out.aux["ice.redundant_video"].requires_grad_()
    got = IRMLoss(neg=False, red=False)(out, make_batch([0, 0, 0], 1), epoch=0)
    got.backward()
    assert float(got) == 0.0 and r_v.grad is not None and float(r_v.grad.abs().sum()) == 0.0


def test_irm_neg_is_zero_when_the_key_moment_wins_by_the_margin():
    q = torch.tensor([[1.0, 0.0]])
    out = output(query=q, key_moment=q.clone(), redundant_video=torch.tensor([[0.0, 1.0]]), redundant_query=torch.tensor([[-1.0, 0.0]]))
    # cos(q, m) = 1, cos(q, r_v) = 0, cos(q, r_q) = -1: hinges max(0, 0.5 + 0 - 1) = max(0, 0.5 - 1 - 1) = 0
    assert float(IRMLoss(red=False, margin=0.5, nce_weight=0.0)(out, make_batch([0], 1), epoch=0)) == 0.0
    # with InfoNCE: log(e^1 + e^0 + e^-1) - 1
    got = IRMLoss(red=False, margin=0.5, nce_weight=1.0)(out, make_batch([0], 1), epoch=0)
    assert float(got) == pytest.approx(math.log(math.e + 1 + 1 / math.e) - 1, rel=1e-6)


def test_tcp_by_hand():
    torch.manual_seed(0)
    logits = torch.randn(7, 3)
    labels = torch.tensor([0, 1, 2, 0, 2, 1, 1])
    part = torch.tensor([0, 0, 1, 1, 1, 2, 3])
    nll = [-math.log(math.exp(float(logits[i, labels[i]])) / sum(math.exp(float(x)) for x in logits[i])) for i in range(7)]
    expected = (nll[0] + nll[1]) / 2 + (nll[2] + nll[3] + nll[4]) / 3 + nll[5] + nll[6]
    got = TCPLoss()(output(tcp_logits=logits, tcp_labels=labels, tcp_part=part), make_batch([0], 1), epoch=0)
    assert float(got) == pytest.approx(expected, rel=1e-6)
    # one group of one position: log(g) for uniform logits
    uniform = output(tcp_logits=torch.zeros(1, 8), tcp_labels=torch.tensor([3]), tcp_part=torch.tensor([0]))
    assert float(TCPLoss()(uniform, make_batch([0], 1), epoch=0)) == pytest.approx(math.log(8))


def test_tcp_ignores_padding_slots_labelled_minus_one():
    """The plug-in hands over every slot, padding labelled -1: those neither add to a part's sum nor to its count."""
    torch.manual_seed(1)
    logits = torch.randn(9, 3, requires_grad=True)
    labels = torch.tensor([0, -1, 1, 2, -1, -1, 1, -1, 0])
    part = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 3])
    nll = [float(-torch.log_softmax(logits[i].detach(), 0)[labels[i]]) if labels[i] >= 0 else None for i in range(9)]
    expected = (nll[0] + nll[2]) / 2 + nll[3] + nll[6] + nll[8]
    got = TCPLoss()(output(tcp_logits=logits, tcp_labels=labels, tcp_part=part), make_batch([0], 1), epoch=0)
    assert float(got) == pytest.approx(expected, rel=1e-6)
    got.backward()
    assert logits.grad[labels < 0].abs().sum() == 0 and logits.grad[labels >= 0].abs().sum() > 0
    poisoned = logits.detach().clone()
    poisoned[labels < 0] = 1e4  # whatever a padding slot's logits are
    again = TCPLoss()(output(tcp_logits=poisoned, tcp_labels=labels, tcp_part=part), make_batch([0], 1), epoch=0)
    assert float(again) == pytest.approx(expected, rel=1e-6)


# ---------------------------------------------------------------- validation


def synth_raw(name: str = "ice_base_ice_synth") -> dict:
    return load_raw(REPO / "configs" / f"{name}.yaml")


def test_shipped_config_resolves_the_defaults():
    cfg = validate(synth_raw())
    assert cfg.plugins["ice"]["threshold"] == 0.4 and cfg.plugins["ice"]["groups"] == 8
    assert cfg.losses["ice_tcp"]["weight"] == 1.0 and cfg.losses["ice_irm"]["neg"] is True


def test_losses_without_the_plugin_part_are_refused():
    raw = synth_raw()
    raw["plugins"]["ice"]["tcp"] = False
    with pytest.raises(ConfigError, match=r"losses\.ice_tcp.*plugins\.ice"):
        validate(raw)
    raw["losses"]["ice_tcp"]["weight"] = 0  # the Table 3 way of switching a module off
    validate(raw)


def test_plugin_on_a_backbone_with_other_branch_names_names_the_key():
    raw = synth_raw("gmmformer_ice_synth")
    del raw["plugins"]["ice"]["moment_branch"]
    with pytest.raises(ConfigError, match=r"plugins\.ice: moment_branch: backbone 'gmmformer' has no 'moment' branch"):
        validate(raw)
    raw = synth_raw()
    raw["plugins"]["ice"]["threshold"] = 1.2
    with pytest.raises(ConfigError, match=r"plugins\.ice: threshold must be in \[-1, 1\)"):
        validate(raw)


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> Path:
    from prvrlab.data.synth import synthesize

    root = tmp_path_factory.mktemp("ice_synth")
    synthesize(root, preset="tiny", seed=0, progress=False)
    return root


@pytest.mark.slow
def test_trains_through_the_platform_and_logs_the_mining(tiny_data, tmp_path):
    pytest.importorskip("mlflow")  # the run is recorded in MLflow (absent from the GPU image)
    from prvrlab.platform.train.driver import train

    raw = synth_raw()
    raw["data"] = {"root": str(tiny_data), "collection": "synth", "visual_feature": "synth_feat"}
    raw["model"].update(hidden_size=32, num_heads=2, dropout=0.0, ffn_size=64)
    raw["train"] = {"epochs": 1, "batch_size": 16, "lr": 1e-3, "num_workers": 1, "seed": 0}
    raw["eval"] = {"final_splits": ["val"]}
    raw["tracking"] = {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "experiment": "tests", "storage_path": str(tmp_path / "results")}
    result = train(validate(raw), use_ray=False, echo=None)
    (epoch,) = result.history
    for key in ("train/ice_corr", "train/ice_irm", "train/ice_tcp", "train/ice.tcp_accuracy"):
        assert key in epoch and math.isfinite(epoch[key])
    assert epoch["train/ice.mined"] > 0 and epoch["train/ice.mined_total"] >= epoch["train/ice.mined"]
    assert 0.0 <= epoch["train/ice.precision"] <= 1.0 and 0.0 < epoch["train/ice.precision_chance"] < 1.0
    saved = torch.load(result.run_dir / "best_model.pt", weights_only=True)
    assert {"plugins.ice.redundancy.weight", "plugins.ice.video_classifier.weight"} <= set(saved["model"])
