"""Reports of a real tiny ablation and search (run once through the platform), checked against MLflow."""

from __future__ import annotations

import shutil
import statistics
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from prvrlab.platform.cli import main
from prvrlab.reports.report import Options, figures_of, write_report
from prvrlab.reports.source import load_study

from report_helpers import md_rows

pytestmark = pytest.mark.slow
OPT = Options(n_boot=200, seed=0)
METRICS = ("r1", "r5", "r10", "r100", "sumr")


def _children(uri: str, parent: str):
    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(parent)
    return client, client.search_runs([run.info.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent}'")


def test_ablation_table_equals_mlflow(studies, tmp_path):
    md = write_report(load_study(studies["uri"], studies["ablation"]), tmp_path, OPT).read_text()
    rows = md_rows(md, "## Ablation (val)")
    header, body = rows[0], rows[2:]
    assert header == ["Variant", "query_diverse", "R@1", "R@5", "R@10", "R@100", "SumR", "ΔSumR", "Seeds"]
    assert [r[0] for r in body] == ["full (baseline)", "no_query_diverse"]
    assert body[0][1] == "✓" and body[1][1] == "–"

    _, children = _children(studies["uri"], studies["ablation"])
    values: dict[str, dict[str, list[float]]] = {}
    for c in children:
        assert c.data.tags["prvrlab.status"] == "finished"
        for m in METRICS:
            values.setdefault(c.data.tags["prvrlab.variant"], {}).setdefault(m, []).append(c.data.metrics[f"final/val/{m}"])
    for row, variant in zip(body, ("full", "no_query_diverse")):
        for i, m in enumerate(METRICS):
            xs = values[variant][m]
            assert row[2 + i] == f"{statistics.fmean(xs):.1f} ± {statistics.stdev(xs):.1f}"
        assert row[-1] == "2/2"
    delta = statistics.fmean(values["no_query_diverse"]["sumr"]) - statistics.fmean(values["full"]["sumr"])
    assert body[1][7].split()[0] == (f"{delta:+.1f}" if f"{abs(delta):.1f}" != "0.0" else "0.0")
    assert body[0][7] == "—"
    # confidence section: CI around the same SumR, a p-value for the variant
    conf = md_rows(md, "## Confidence (val")
    assert conf[2][1].startswith(f"{statistics.fmean(values['full']['sumr']):.1f} [")
    assert conf[3][7] not in ("—", "") and "(n=2, min 0.500)" in conf[3][9]
    assert conf[0][8] == "p (Holm)" and conf[3][8] == conf[3][7]  # one comparison: Holm changes nothing
    assert "## Moment/video-ratio breakdown (val)" in md
    full_sumr = statistics.fmean(values["full"]["sumr"])
    assert "Published (a made-up table, val): R@1 1.0 (baseline " in md
    assert f"SumR 56.0 (baseline {full_sumr - 56.0:+.1f})." in md


def test_report_is_byte_identical_when_rerun(studies, tmp_path):
    a = write_report(load_study(studies["uri"], studies["ablation"]), tmp_path / "a", OPT).read_bytes()
    b = write_report(load_study(studies["uri"], studies["ablation"]), tmp_path / "b", OPT).read_bytes()
    assert a == b
    s1 = write_report(load_study(studies["uri"], studies["search"]), tmp_path / "s1", OPT).read_bytes()
    s2 = write_report(load_study(studies["uri"], studies["search"]), tmp_path / "s2", OPT).read_bytes()
    assert s1 == s2


def test_cli_report_by_spec_logs_the_artifact(studies, tmp_path, capsys):
    out = tmp_path / "rep"
    code = main(["report", "--spec", str(studies["ablation_spec"]), "--out", str(out), "--bootstrap", "100"])
    assert code == 0 and (out / "report.md").is_file()
    n = len(list(out.glob("*.png")))
    assert f"wrote {out / 'report.md'} and " in capsys.readouterr().out
    assert n == len(figures_of(out / "report.md"))
    client = MlflowClient(tracking_uri=studies["uri"])
    names = {f.path for f in client.list_artifacts(studies["ablation"], "report")}
    assert "report/report.md" in names


@pytest.mark.parametrize(
    "args, named",
    [(["--run-id", "0123456789abcdef"], "0123456789abcdef"), (["--experiment", "no-such-exp"], "no-such-exp"),
     (["--spec", "missing_spec.yaml"], "missing_spec.yaml")],
)
def test_bad_input_exits_2_naming_it(studies, args, named, capsys):
    code = main(["report", *args, "--tracking-uri", studies["uri"], "--no-log"])
    err = capsys.readouterr().err
    assert code == 2 and named in err and err.count("\n") == 1


def test_failed_cell_is_shown(studies, tmp_path):
    from prvrlab.platform.tracking.store import Tracker

    db = tmp_path / "copy.db"
    shutil.copy(Path(studies["tmp"]) / "mlflow.db", db)
    uri = f"sqlite:///{db}"
    tracker = Tracker(uri, "tests")
    tags = {"prvrlab.kind": "trial", "prvrlab.variant": "broken", "prvrlab.seed": "0", "prvrlab.cell": "broken/seed0",
            "prvrlab.status": "error", "error": "RuntimeError: boom", "components": "backbone:gmmformer,loss:clip_triplet"}
    run = tracker.start_run("abl/broken/seed0", tags=tags, parent_run_id=studies["ablation"])
    tracker.end_run(run, "FAILED")
    md = write_report(load_study(uri, studies["ablation"]), tmp_path / "r", OPT).read_text()
    rows = md_rows(md, "## Ablation (val)")
    body = {r[0]: r for r in rows[2:]}
    sumr = rows[0].index("SumR")
    assert body["broken"][sumr] == "*failed*" and "1 error" in body["broken"][-1]
    assert body["full (baseline)"][sumr] != "*failed*"
    assert "## Failed, unfinished and missing runs" in md and "RuntimeError: boom" in md


def test_search_summary(studies, tmp_path):
    out = tmp_path / "s"
    md = write_report(load_study(studies["uri"], studies["search"]), out, OPT).read_text()
    _, children = _children(studies["uri"], studies["search"])
    assert len(children) == 3
    best = max(children, key=lambda c: (c.data.metrics["final/val/sumr"], c.data.tags["prvrlab.trial_id"]))
    summary = {r[0]: r[1] for r in md_rows(md, "## Best trial")[2:]}
    assert summary["Trial"] == f"`{best.data.tags['prvrlab.trial_id']}`"
    assert summary["val SumR"] == f"{best.data.metrics['final/val/sumr']:.1f}"
    assert summary["`train.lr`"] == f"{float(best.data.params['train.lr']):.4g}"
    assert summary["Published (a made-up table)"] == "R@1 1.0  R@5 2.0  R@10 3.0  R@100 50.0  SumR 56.0"
    published = {"r1": 1.0, "r5": 2.0, "r10": 3.0, "r100": 50.0, "sumr": 56.0}
    names = {"r1": "R@1", "r5": "R@5", "r10": "R@10", "r100": "R@100", "sumr": "SumR"}
    assert summary["This run − published"] == "  ".join(
        f"{names[m]} {best.data.metrics[f'final/val/{m}'] - v:+.1f}" for m, v in published.items())
    top = md_rows(md, "## Top trials")[2:]
    assert len(top) == 3 and [r[8] for r in top] == sorted([r[8] for r in top], key=float, reverse=True)
    imp = md_rows(md, "## Parameter importances")
    assert imp[2][0] == "`train.lr`" and imp[2][1] == "1.000"
    assert "Based on 3 trials only; treat as indicative." in md
    assert (out / "learning_curves.png").is_file() and (out / "sensitivity_train.lr.png").is_file()
    assert "## Sensitivity (val)" in md and "## Stopped early" in md


def test_profile_cli_prints_gallery_sizes(tiny_root, capsys):
    repo = Path(__file__).resolve().parents[2]
    code = main(["profile", str(repo / "configs" / "gmmformer_synth.yaml"), "--set", f"data.root={tiny_root}",
                 "--set", "model.hidden_size=32", "--set", "model.num_heads=2", "--gallery", "30", "60", "--queries", "3"])
    out = capsys.readouterr().out
    assert code == 0
    assert "| Database size | 30 | 60 |" in out and "Params (M)" in out and "FLOPs (G)" in out


def test_a_report_leaves_no_download_folder_behind(studies, tmp_path, monkeypatch):
    import gc
    import tempfile

    from prvrlab.reports.report import report

    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    made = []
    real = tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "mkdtemp", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    md = report(tracking_uri=studies["uri"], parent_id=studies["ablation"], out=tmp_path / "r", options=OPT,
                log_artifact=False).read_text()
    assert "## Moment/video-ratio breakdown (val)" in md  # built from downloaded rank artifacts
    assert made and all(Path(m).parent == scratch for m in made)
    assert list(scratch.iterdir()) == []

    study = load_study(studies["uri"], studies["ablation"])
    first = study.cache_dir()
    assert study.ranks(study.runs[0], "val") is not None and any(first.rglob("*.parquet"))
    study.close()
    assert not first.exists()
    with study:
        second = study.cache_dir()
        assert second != first and second.is_dir()
    assert not second.exists()
    third = load_study(studies["uri"], studies["ablation"]).cache_dir()
    gc.collect()
    assert not third.exists()  # an unreferenced study removes its folder


def test_profile_reads_feature_sizes_from_the_collection_or_the_synthetic_preset(tiny_root, tmp_path):
    """A config whose synthetic data is not written yet profiles with its preset's sizes (nothing is written);
    written data is read; a real collection without data or known sizes asks for them."""
    from prvrlab.data.synth import PRESETS
    from prvrlab.platform.config import load_config
    from prvrlab.data.errors import DataError
    from prvrlab.evaluation.profile import model_dims

    repo = Path(__file__).resolve().parents[2]
    missing = tmp_path / "not_written"
    cfg = load_config(repo / "configs" / "gmmformer_synth.yaml", overrides={"data.root": str(missing)})
    preset = PRESETS[cfg.data.synthesize]
    assert model_dims(cfg) == (preset.video_dim, preset.query_dim) and not missing.exists()
    written = load_config(repo / "configs" / "gmmformer_synth.yaml",
                          overrides={"data.root": str(tiny_root), "data.synthesize": "small"})  # the tiny data is there
    assert PRESETS["small"].video_dim != PRESETS["tiny"].video_dim
    assert model_dims(written) == (PRESETS["tiny"].video_dim, PRESETS["tiny"].query_dim)
    real = load_config(repo / "configs" / "gmmformer_synth.yaml",
                       overrides={"data.root": str(missing), "data.synthesize": None, "data.collection": "mine"})
    with pytest.raises(DataError, match="pass --video-dim and --query-dim"):
        model_dims(real)
