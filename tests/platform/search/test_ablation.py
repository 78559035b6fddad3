"""Ablation: variants x seeds as trials, tags, and skipping finished cells on resubmission."""

from __future__ import annotations

import pytest

from prvrlab.platform.search.ablation import ablate
from prvrlab.platform.search.spec import load_ablation_spec

from search_helpers import study_runs, tiny_spec

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def ray_shutdown():
    yield
    import ray

    ray.shutdown()


def test_two_variants_two_seeds_then_resubmit_skips_everything(tiny_root, tmp_path, capsys):
    variants = {"full": {}, "no_query_diverse": {"losses.query_diverse.weight": 0}}
    path = tiny_spec(tmp_path, tiny_root, name="abl", variants=variants, seeds=[0, 1], concurrency=2)
    spec = load_ablation_spec(path)
    result = ablate(spec, echo=print)
    assert result.counts == {"finished": 4, "failed": 0, "missing": 0}
    console = capsys.readouterr()
    out = console.out
    assert "no_query_diverse" in out and "mean" in out
    # Ray's and Tune's log lines go to the study's log, not to the console
    (log,) = (tmp_path / "results" / "ablation" / "abl").glob("*/study.log")
    assert "ray." in log.read_text(), log.read_text()[:2000]
    noise = [ln for ln in (console.out + console.err).splitlines() if "snapshotting" in ln or " WARNING " in ln or "(raylet)" in ln]
    assert not noise, noise

    parents, children = study_runs(tmp_path)
    (parent,) = parents
    assert parent.info.status == "FINISHED" and parent.data.tags["prvrlab.kind"] == "ablation"
    assert len(children) == 4
    cells = {(c.data.tags["prvrlab.variant"], c.data.tags["prvrlab.seed"]) for c in children}
    assert cells == {(v, s) for v in variants for s in ("0", "1")}
    for child in children:
        tags = child.data.tags
        assert child.info.status == "FINISHED" and tags["mlflow.parentRunId"] == parent.info.run_id
        assert child.data.params["train.seed"] == tags["prvrlab.seed"]
        assert ("loss:query_diverse" in tags["components"]) == (tags["prvrlab.variant"] == "full")
        assert "backbone:gmmformer" in tags["components"] and len(tags["config_hash"]) == 16
        assert child.info.run_name == f"{tags['prvrlab.variant']} · seed {tags['prvrlab.seed']}"
    hashes = {c.data.tags["config_hash"] for c in children}
    assert len(hashes) == 4
    assert "variant/full/mean" in parent.data.metrics

    again = ablate(load_ablation_spec(path), echo=print)
    assert again.counts == {"finished": 4, "failed": 0, "missing": 0}
    assert "4 already finished" in capsys.readouterr().out
    parents, children = study_runs(tmp_path)
    assert len(children) == 4 and len(parents) == 1  # no new runs, same parent
    assert parents[0].info.status == "FINISHED"


def test_a_resubmission_with_another_config_does_not_mix_its_runs_into_the_summary_or_the_report(tiny_root, tmp_path):
    """One spec name keeps one parent: after a submission with 2 epochs, one with 1 epoch again skips its
    finished cell, and its summary, parent metrics and report count only the 1-epoch run (they showed the
    newer 2-epoch run's figures, the spec's overrides still saying 1)."""
    from prvrlab.reports.report import Options, write_report
    from prvrlab.reports.source import load_study
    from prvrlab.reports.tables import fmt

    def submit(epochs: int, lines: list[str]):
        path = tiny_spec(tmp_path, tiny_root, name="configs", overrides={"train.epochs": epochs, "eval.final_splits": []},
                         variants={"full": {}}, seeds=[0])
        return ablate(load_ablation_spec(path), echo=lines.append)

    first, second, third = [], [], []
    submit(1, first)
    submit(2, second)
    assert submit(1, third).counts == {"finished": 1, "failed": 0, "missing": 0}
    assert "1 already finished" in "\n".join(third)
    parents, children = study_runs(tmp_path)
    (parent,) = parents
    by_epochs = {int(c.data.params["train.epochs"]): c for c in children}
    assert sorted(by_epochs) == [1, 2]
    one, two = by_epochs[1].data.metrics["final/val/sumr"], by_epochs[2].data.metrics["final/val/sumr"]
    assert one != two
    (row,) = [ln for ln in third if ln.startswith("full ")]
    assert float(row.split()[1]) == pytest.approx(one, abs=0.005)  # the console's mean: the 1-epoch run's
    assert parent.data.metrics["variant/full/mean"] == pytest.approx(one)
    assert parent.data.tags["prvrlab.cell_hash.full/seed0"] == by_epochs[1].data.tags["config_hash"]

    md = write_report(load_study(f"sqlite:///{tmp_path / 'mlflow.db'}", parent.info.run_id), tmp_path / "report",
                      Options(n_boot=50, split="val")).read_text()
    assert "1 of earlier configurations of these cells left out" in md
    table = [ln for ln in md.splitlines() if ln.startswith("| full (baseline)")]
    assert table and f"| {fmt(one)} |" in table[0].replace("**", ""), table
