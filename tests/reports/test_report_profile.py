"""``report --profile``: the efficiency section measures each variant's logged config through the injected
``Options.measure`` (the reports never build a model: they read MLflow and artifacts only)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_layering import imported_modules

from prvrlab.evaluation.profile import ProfileResult
from prvrlab.platform.config import validate
from prvrlab.reports.errors import ReportError
from prvrlab.reports.profile import profile_table
from prvrlab.reports.report import Options, load_study, write_report

REPORTS = Path(__file__).resolve().parents[2] / "prvrlab" / "reports"
MODEL_BUILDERS = ("prvrlab.models", "prvrlab.losses", "prvrlab.evaluation.profile")


@pytest.mark.parametrize("path", sorted(REPORTS.glob("*.py")), ids=lambda p: p.name)
def test_no_report_module_imports_a_model_builder(path):
    bad = {m for m in imported_modules(path) if any(m == b or m.startswith(b + ".") for b in MODEL_BUILDERS)}
    assert not bad, f"{path.name} imports {sorted(bad)}"


def _result(name: str, params: int) -> ProfileResult:
    return ProfileResult(name, params, 2.5e9, 1.25e9, {10: 1.5, 20: 3.0}, 4.0, None, "cpu", 3)


def test_the_efficiency_section_measures_each_variants_logged_config(studies, tmp_path):
    calls = []

    def measure(cfg, *, name, device, galleries=None):
        calls.append((name, cfg, device, galleries))
        return _result(name, 1_000_000 * (len(calls)))

    opt = Options(n_boot=50, profile=True, galleries=[10, 20], read_config=validate, measure=measure)
    with load_study(studies["uri"], studies["ablation"]) as study:
        text = write_report(study, tmp_path / "out", opt).read_text(encoding="utf-8")
    names = [c[0] for c in calls]
    assert sorted(names) == ["full", "no_query_diverse"]
    weights = {name: cfg.losses["query_diverse"]["weight"] for name, cfg, _, _ in calls}
    assert weights["no_query_diverse"] == 0 and weights["full"] > 0  # each variant's own config, validated
    assert {(d, g) for _, _, d, g in calls} == {("cpu", (10, 20))}
    section = text.split("## Efficiency", 1)[1]
    cost = section.split("Runtime", 1)[0]  # the first table: model cost
    rows = {line.split("|")[1].strip(): line for line in cost.splitlines() if line.startswith("| ")}
    for i, name in enumerate(names, start=1):  # Params (M) of the result measured i-th
        assert rows[name].split("|")[2].strip() == f"{i:.2f}"
    assert "3 threads" in section


def test_the_measure_gets_its_own_gallery_default_when_none_is_asked(studies, tmp_path):
    seen = []

    def measure(cfg, *, name, device, **kw):
        seen.append(kw)
        return _result(name, 1)

    opt = Options(n_boot=50, profile=True, read_config=validate, measure=measure)
    with load_study(studies["uri"], studies["search"]) as study:
        write_report(study, tmp_path / "out", opt)
    assert seen == [{}]  # the best trial only, and no gallery sizes forced on it


def test_a_profile_without_a_measure_is_refused_by_name(studies, tmp_path):
    opt = Options(n_boot=50, profile=True, read_config=validate)
    with load_study(studies["uri"], studies["search"]) as study, pytest.raises(ReportError, match="Options.measure"):
        write_report(study, tmp_path / "out", opt)


def test_the_table_lists_every_gallery_size_and_the_thread_counts():
    text = profile_table([_result("a", 2_000_000), ProfileResult("b", 500_000, 1e9, 5e8, {20: 7.0, 40: 9.0}, 1.0, 12.5, "cuda", 1)])
    header = next(line for line in text.splitlines() if line.startswith("| Database size"))
    assert [c.strip() for c in header.split("|")[2:-1]] == ["10", "20", "40"]
    assert "Online FLOPs / query @ 40 (G)" in text and "(CUDA peak 12.5)" in text
    assert "cpu, cuda, 1 / 3 threads" in text
