"""The search report's confidence table when the best trial logged no ranks (a fake in-memory study)."""

from __future__ import annotations

import numpy as np

from prvrlab.reports.report import Options, write_report

from report_helpers import fake_run, fake_study, md_rows, sumr_per_query

N = 200


def test_the_reference_is_named_when_the_best_trial_has_no_ranks(tmp_path):
    rng = np.random.default_rng(2)
    ranks = {"t0": rng.integers(1, 8, N), "t1": rng.integers(1, 30, N), "t2": rng.integers(1, 60, N)}
    runs = [fake_run(name, 0, x, split="val") for name, x in ranks.items()]
    logged = {f"{name}-seed0": x for name, x in ranks.items() if name != "t0"}  # the best trial logged none
    md = write_report(fake_study(runs, logged, baseline="", seeds=[0], kind="search"), tmp_path, Options(n_boot=100)).read_text()
    assert md_rows(md, "## Best trial")[2][:2] == ["Trial", "`t0-seed0`"]
    conf = md_rows(md, "## Confidence (val")
    assert conf[0][6] == "ΔSumR vs reference [95% CI]"
    assert [r[0] for r in conf[2:]] == ["`t1-seed0` (reference)", "`t2-seed0`"]
    assert conf[3][6].startswith(f"{(sumr_per_query(ranks['t2']) - sumr_per_query(ranks['t1'])).mean():+.1f} [")
    assert "each trial against the reference `t1-seed0`, the best trial with ranks (the best, `t0-seed0`, logged none)," in md
    assert "Left out, no ranks artifact (`ranks/ranks_val.parquet`): `t0-seed0` (the best)." in md
    assert "(best)" not in md.split("## Confidence")[1]


def _search_report(tmp_path, seed: int, change) -> tuple[dict, str]:
    """Three trials' random val ranks (t0 the best), each run's ranks dict passed through ``change(run_id, x)``:
    (the ranks, the report's markdown)."""
    rng = np.random.default_rng(seed)
    ranks = {"t0": rng.integers(1, 8, N), "t1": rng.integers(1, 30, N), "t2": rng.integers(1, 60, N)}
    runs = [fake_run(name, 0, x, split="val") for name, x in ranks.items()]
    study = fake_study(runs, {f"{name}-seed0": x for name, x in ranks.items()}, baseline="", seeds=[0], kind="search")
    plain = study.ranks
    study.ranks = lambda run, split: change(run.run_id, plain(run, split))
    return ranks, write_report(study, tmp_path, Options(n_boot=100)).read_text()


def test_a_trial_ranked_on_other_queries_is_not_tested_against_the_best(tmp_path):
    def moved(run_id, x):
        return {**x, "query_id": np.array([f"other{i}" for i in range(N)])} if run_id == "t1-seed0" else x

    ranks, md = _search_report(tmp_path, 4, moved)
    conf = {r[0]: r for r in md_rows(md, "## Confidence (val")}
    assert conf["`t1-seed0`"][6:8] == ["—", "—"]
    assert conf["`t2-seed0`"][6].startswith(f"{(sumr_per_query(ranks['t2']) - sumr_per_query(ranks['t0'])).mean():+.1f} [")
    assert ("Evaluated on other val data than the best trial (no query in common, or a shared query with another "
            "ground-truth video), so not tested over queries: `t1-seed0`.") in md


def test_a_trial_whose_shared_queries_have_other_ground_truth_is_not_tested(tmp_path):
    def with_videos(run_id, x):
        video = np.array([f"v{i % 40}" for i in range(N)])
        if run_id == "t2-seed0":
            video[0] = "elsewhere"
        return {**x, "video_id": video}

    _, md = _search_report(tmp_path, 6, with_videos)
    conf = {r[0]: r for r in md_rows(md, "## Confidence (val")}
    assert conf["`t2-seed0`"][6:8] == ["—", "—"] and conf["`t1-seed0`"][6] != "—"
    assert "so not tested over queries: `t2-seed0`." in md
