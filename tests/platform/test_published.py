"""A config's ``published`` result: checked at the edge, kept out of the fingerprint, compared at the end of
training (console and MLflow) and by ``prvrlab eval``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from prvrlab.platform.cli import main
from prvrlab.platform.config import PUBLISHED_SUM_TOLERANCE, ConfigError, apply_overrides, load_config, validate
from prvrlab.platform.tracking.store import Tracker

from train_helpers import small_raw

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
GMMFORMER_TVR = {"source": "papers/002 Table 1, GMMFormer", "split": "val",
                 "r1": 13.9, "r5": 33.3, "r10": 44.5, "r100": 84.9, "sumr": 176.6}


def base(**published) -> dict:
    raw = {
        "model": {"name": "gmmformer", "hidden_size": 32},
        "losses": {"clip_triplet": {"loss": "triplet", "weight": 1.0, "branch": "clip"}},
        "eval": {"final_splits": ["val"]},
    }
    if published:
        raw["published"] = published
    return raw


def test_a_published_result_is_kept_and_left_out_of_the_fingerprint():
    plain, with_result = validate(base()), validate(base(**GMMFORMER_TVR))
    assert with_result.published.metrics() == {k: GMMFORMER_TVR[k] for k in ("r1", "r5", "r10", "r100", "sumr")}
    assert with_result.fingerprint() == plain.fingerprint()  # it changes nothing that runs
    assert not any(k.startswith("published.") for k in plain.flat())  # no empty params in MLflow
    assert with_result.flat()["published.sumr"] == 176.6 and with_result.flat()["published.split"] == "val"
    partial = validate(base(source="a table with R@1 only", split="val", r1=2.5))
    assert partial.published.metrics() == {"r1": 2.5}


@pytest.mark.parametrize(
    ("published", "message"),
    [
        ({"source": "x", "split": "val"}, r"published: give at least one of r1, r5, r10, r100, sumr"),
        ({"split": "val", "sumr": 100.0}, r"published.source: required"),
        ({"source": "x", "sumr": 100.0}, r"published.split: required"),
        ({"source": "x", "split": "val", "r1": 101.0}, r"published.r1: a percentage in \[0, 100\]"),
        ({"source": "x", "split": "val", "sumr": -1.0}, r"published.sumr: a percentage in \[0, 400\]"),
        ({"source": "x", "split": "val", "r5": 30.0, "r10": 20.0}, r"published.r5: 30 is above published.r10: 20"),
        ({**GMMFORMER_TVR, "sumr": 177.6}, r"published.sumr: 177.6, but r1 \+ r5 \+ r10 \+ r100 = 176.6"),
        ({**GMMFORMER_TVR, "split": "tset"}, r"published.split: 'tset' is not a split of the data section "
                                              r"\(train, val, test\) \(did you mean 'test'\?\); --set published=null drops"),
        ({**GMMFORMER_TVR, "recall": 1.0}, r"unknown key 'published.recall'"),
    ],
)
def test_a_bad_published_result_names_the_key(published, message):
    raw = base(**published)
    with pytest.raises(ConfigError, match=message):
        validate(raw)


def test_rounded_published_recalls_may_miss_their_sum_by_the_tolerance():
    """GMMFormer's Charades row prints 2.1 + 7.8 + 12.5 + 50.6 = 73.0 beside SumR 72.9."""
    validate(base(source="x", split="val", r1=2.1, r5=7.8, r10=12.5, r100=50.6, sumr=72.9))
    over = round(73.0 + PUBLISHED_SUM_TOLERANCE + 0.05, 2)
    with pytest.raises(ConfigError, match="published.sumr"):
        validate(base(source="x", split="val", r1=2.1, r5=7.8, r10=12.5, r100=50.6, sumr=over))


def test_a_published_split_that_is_not_evaluated_at_the_end_is_not_compared_and_null_drops_it(tmp_path):
    """Leaving the published split out of eval.final_splits is a user's choice, not an error."""
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(base(**{**GMMFORMER_TVR, "split": "test"})))
    cfg = load_config(path)  # eval.final_splits: [val]
    assert cfg.published.compare({"val/sumr": 100.0}) == {}
    assert load_config(path, {"published": None}).published.metrics() == {}


def test_compare_subtracts_the_published_value_for_the_metrics_both_have():
    published = validate(base(source="x", split="val", r1=10.0, sumr=150.0)).published
    final = {"val/r1": 12.5, "val/r5": 30.0, "val/sumr": 140.25, "test/r1": 99.0}
    assert published.compare(final) == {"val/r1_vs_published": 2.5, "val/sumr_vs_published": -9.75}
    assert published.compare({"test/r1": 1.0}) == {}
    assert validate(base()).published.compare(final) == {}


def test_every_shipped_dataset_config_compares_on_its_reported_split():
    """A published row on the split the config treats as the reported test set (test when it has one)."""
    for path in sorted(CONFIGS.glob("*.yaml")):
        if path.stem.rsplit("_", 1)[-1] not in ("tvr", "activitynet", "charades"):
            continue
        cfg = load_config(path)
        if path.stem == "arl_charades":  # the ARL paper reports TVR and ActivityNet only
            assert not cfg.published.metrics()
            continue
        assert set(cfg.published.metrics()) == {"r1", "r5", "r10", "r100", "sumr"}, path.name
        assert cfg.published.split == ("test" if cfg.data.test_split else "val"), path.name
        assert cfg.published.source.startswith(("papers/", "MS-SL (", "GMMFormer (")), path.name


def test_train_and_eval_print_and_log_the_difference_to_the_published_result(tiny_root, tmp_path, capsys):
    published = {"source": "a made-up table", "split": "val", "r1": 1.0, "r5": 2.0, "r10": 3.0, "r100": 50.0, "sumr": 56.0}
    raw = apply_overrides(small_raw(tiny_root, tmp_path, epochs=1), {"eval.final_splits": ["val", "test"]})
    raw["published"] = published
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    assert main(["train", str(cfg), "--no-ray"]) == 0
    out = capsys.readouterr().out
    tracker = Tracker(raw["tracking"]["uri"], raw["tracking"]["experiment"])
    (run,) = tracker.client.search_runs([tracker.experiment_id])
    logged = run.data.metrics
    for k in ("r1", "r5", "r10", "r100", "sumr"):
        assert logged[f"final/val/{k}_vs_published"] == pytest.approx(logged[f"final/val/{k}"] - published[k])
        assert f"final/test/{k}_vs_published" not in logged
    assert run.data.params["published.source"] == "a made-up table"
    assert "published (a made-up table; val): R@1 1.0  R@5 2.0  R@10 3.0  R@100 50.0  SumR 56.0" in out
    delta = logged["final/val/sumr"] - 56.0
    assert re.search(rf"this run - published: .*SumR {re.escape(f'{delta:+.1f}')}$", out, re.M), out

    (best,) = (tmp_path / "results").glob("*/files/best_model.pt")
    assert main(["eval", str(best), "--split", "val", "--json"]) == 0
    out = capsys.readouterr().out
    metrics = json.loads(out[out.index("{"):])["metrics"]
    assert f"R@100 {metrics['r100'] - 50.0:+.1f}  SumR {metrics['sumr'] - 56.0:+.1f}" in out
    assert main(["eval", str(best), "--split", "test"]) == 0
    assert "published" not in capsys.readouterr().out  # reported on val
