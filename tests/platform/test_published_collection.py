"""A config's published row is compared only with a run on the collection it was reported on
(``published.collection``): a TVR recipe run on the synthetic data says so in one line, everywhere the
row would be shown, instead of printing differences to another dataset's numbers."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from prvrlab.platform.cli import _published_lines, main
from prvrlab.platform.config import PublishedConfig, load_config
from prvrlab.platform.tracking.store import Tracker
from prvrlab.reports.compare import compare_runs
from prvrlab.reports.report import published_pairs
from prvrlab.reports.source import TrialRun

from train_helpers import small_raw

ROW = {"source": "Table X", "split": "val", "r1": 1.0, "r5": 2.0, "r10": 3.0, "r100": 50.0, "sumr": 56.0}
FINAL = {"val/r1": 4.0, "val/r5": 6.0, "val/r10": 9.0, "val/r100": 70.0, "val/sumr": 89.0}
CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_compare_is_empty_only_for_another_named_collection():
    expected = {f"val/{k}_vs_published": FINAL[f"val/{k}"] - v for k, v in ROW.items() if k not in ("source", "split")}
    assert PublishedConfig(**ROW, collection="tvr").compare(FINAL, collection="synth") == {}
    assert PublishedConfig(**ROW, collection="tvr").compare(FINAL, collection="tvr") == expected
    assert PublishedConfig(**ROW).compare(FINAL, collection="synth") == expected  # no collection named: compared
    assert PublishedConfig(**ROW, collection="tvr").compare(FINAL) == expected  # the run's collection unknown


def test_the_console_says_why_there_is_no_comparison():
    (line,) = _published_lines(PublishedConfig(**ROW, collection="tvr"), FINAL, "synth")
    assert line == "published (Table X; val) is for collection 'tvr', this run read 'synth': not compared"
    same = _published_lines(PublishedConfig(**ROW, collection="tvr"), FINAL, "tvr")
    assert same[0].startswith("published (Table X; val):") and same[1].startswith("this run - published:")
    assert _published_lines(PublishedConfig(**ROW, collection="tvr"), {"test/sumr": 1.0}, "synth") == []  # split not run


def _run(params: dict[str, str]) -> TrialRun:
    return TrialRun(run_id="a" * 32, name="r", run_status="FINISHED", start_time=0, tags={}, params=params,
                    metrics={"final/val/sumr": 89.0})


def test_a_report_shows_the_note_instead_of_the_row():
    params = {f"published.{k}": str(v) for k, v in ROW.items()} | {"published.collection": "tvr"}
    elsewhere = _run(params | {"data.collection": "synth"})
    assert elsewhere.published("val") is None
    assert published_pairs(elsewhere, "val") == [
        ("Published", "The published result (Table X, val) is for collection 'tvr'; this run read 'synth': not compared.")]
    same = _run(params | {"data.collection": "tvr"})
    assert same.published("val") == ("Table X", {k: v for k, v in ROW.items() if k not in ("source", "split")})
    assert same.published_elsewhere("val") is None and elsewhere.published_elsewhere("test") is None
    assert [name for name, _ in published_pairs(same, "val")] == ["Published (Table X)", "This run − published"]


def test_every_shipped_published_row_names_its_configs_collection():
    named = 0
    for path in sorted(CONFIGS.glob("*.yaml")):
        cfg = load_config(str(path), [])
        if cfg.published.metrics():
            assert cfg.published.collection == cfg.data.collection, path.name
            named += 1
    assert named >= 30


@pytest.fixture(scope="module")
def runs_elsewhere(tiny_root, tmp_path_factory):
    """Two 1-epoch runs on the synthetic collection, the first with a row published for 'tvr'."""
    tmp = tmp_path_factory.mktemp("published_elsewhere")
    ids, outputs = [], []
    for seed in (0, 1):
        raw = small_raw(tiny_root, tmp, epochs=1, seed=seed)
        if seed == 0:
            raw["published"] = ROW | {"collection": "tvr"}
        path = tmp / f"c{seed}.yaml"
        path.write_text(yaml.safe_dump(raw))
        outputs.append(path)
        assert main(["train", str(path), "--no-ray"]) == 0
        tracker = Tracker(raw["tracking"]["uri"], "tests")
        (latest,) = tracker.client.search_runs([tracker.experiment_id], order_by=["attributes.start_time DESC"], max_results=1)
        ids.append(latest.info.run_id)
    return {"uri": raw["tracking"]["uri"], "ids": ids, "tracker": tracker}


def test_a_run_on_another_collection_logs_no_differences_and_compare_notes_it(runs_elsewhere):
    uri, ids = runs_elsewhere["uri"], runs_elsewhere["ids"]
    run = runs_elsewhere["tracker"].client.get_run(ids[0])
    assert run.data.params["published.collection"] == "tvr" and run.data.params["data.collection"] == "synth"
    assert "final/val/sumr" in run.data.metrics
    assert not [k for k in run.data.metrics if k.endswith("_vs_published")]
    md = compare_runs(uri, ids, split="val", n_boot=20, seed=0)
    assert "Published (" not in md
    assert f"`{ids[0][:8]}` " in md and "is for collection 'tvr'; this run read 'synth': not compared." in md


def test_a_childs_own_row_replaces_the_parents_whole(tmp_path):
    parent = tmp_path / "parent.yaml"
    parent.write_text(yaml.safe_dump({"extends": str(CONFIGS / "gmmformer_tvr.yaml")}))
    own = {"source": "my table", "split": "test", "r1": 1.0}
    child = tmp_path / "child.yaml"
    child.write_text(yaml.safe_dump({"extends": "parent.yaml", "data": {"collection": "mine"}, "published": own}))
    published = load_config(str(child), []).published
    assert (published.source, published.collection, published.r5, published.r1) == ("my table", None, None, 1.0)
    same = tmp_path / "same.yaml"  # the parent's row, one field changed: still the parent's row
    same.write_text(yaml.safe_dump({"extends": "parent.yaml", "published": {"collection": "tvr_v2"}}))
    kept = load_config(str(same), []).published
    assert kept.collection == "tvr_v2" and kept.r1 == load_config(str(CONFIGS / "gmmformer_tvr.yaml"), []).published.r1
