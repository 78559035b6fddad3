"""The ablation's ΔSumR and its tests pair the variant with the baseline seed by seed (fake in-memory studies)."""

from __future__ import annotations

import itertools

import numpy as np
from scipy import stats as sps

from prvrlab.reports.report import Doc, Options, ablation_report

from report_helpers import fake_run, fake_study, md_rows, sumr_per_query

OPT = Options(n_boot=200, seed=0)
N = 300


def _report(tmp_path, study) -> str:
    doc = Doc(tmp_path)
    ablation_report(doc, study, OPT)
    return doc.text()


def test_a_variant_equal_to_the_baseline_on_the_seeds_both_finished_is_not_different(tmp_path):
    rng = np.random.default_rng(0)
    b0, b1 = rng.integers(1, 60, N), rng.integers(1, 60, N)
    b2 = np.maximum(1, b0 // 4)  # the baseline's best seed: the variant failed on it
    runs = [fake_run("base", 0, b0), fake_run("base", 1, b1), fake_run("base", 2, b2),
            fake_run("var", 0, b0), fake_run("var", 1, b1), fake_run("var", 2, b2, status="error")]
    ranks = {r.run_id: x for r, x in zip(runs, (b0, b1, b2, b0, b1, b2))}
    md = _report(tmp_path, fake_study(runs, ranks, baseline="base", seeds=[0, 1, 2]))
    table = {r[0]: r for r in md_rows(md, "## Ablation (test)")}
    assert table["var"][6] == "0.0 ‡ †"
    assert "‡ ΔSumR on the seeds both finished, not on all the seeds of the variant or of the baseline: var (seeds 0, 1)." in md
    conf = md_rows(md, "## Confidence (test")
    var = conf[3]
    assert var[6] == "0.0 [0.0, 0.0] ‡" and var[7] == "1.000" and var[-1] == "no †"
    assert "‡ ΔSumR and p (queries) on the seeds both finished with ranks, not on all the seeds of the variant or of " \
           "the baseline: var (seeds 0, 1)." in md


def test_seeds_without_ranks_are_left_out_of_the_query_tests_and_named(tmp_path):
    rng = np.random.default_rng(1)
    base = [rng.integers(1, 60, N) for _ in range(3)]
    var = [np.maximum(1, b - rng.integers(0, 8, N)) for b in base]
    other = [rng.integers(1, 80, N) for _ in range(3)]
    runs = [*(fake_run("base", s, base[s]) for s in range(3)), *(fake_run("var", s, var[s]) for s in range(3)),
            fake_run("other", 0, other[0]), fake_run("other", 1, other[1], status="error"), fake_run("other", 2, other[2])]
    ranks = {"base-seed0": base[0], "base-seed1": base[1], **{f"var-seed{s}": var[s] for s in range(3)},
             "other-seed0": other[0], "other-seed2": other[2]}  # base seed 2 logged no ranks
    md = _report(tmp_path, fake_study(runs, ranks, baseline="base", seeds=[0, 1, 2]))

    table = {r[0]: r for r in md_rows(md, "## Ablation (test)")}
    sumr = {name: [sumr_per_query(x).mean() for x in xs] for name, xs in (("base", base), ("var", var), ("other", other))}
    var_delta = np.mean([sumr["var"][s] - sumr["base"][s] for s in range(3)])
    other_delta = np.mean([sumr["other"][s] - sumr["base"][s] for s in (0, 2)])
    assert table["var"][6].split()[0] == f"{var_delta:+.1f}" and "‡" not in table["var"][6]  # all three seeds paired
    assert table["other"][6].split()[:2] == [f"{other_delta:+.1f}", "‡"]
    assert "var (seeds" not in md.split("## Confidence")[0] and "other (seeds 0, 2)" in md

    conf = {r[0]: r for r in md_rows(md, "## Confidence (test")}
    # over queries: hits averaged over the seeds both finished with ranks (0, 1 for var; 0 for other)
    q_var = np.mean([sumr_per_query(var[s]) for s in (0, 1)], axis=0) - np.mean([sumr_per_query(base[s]) for s in (0, 1)], axis=0)
    q_other = sumr_per_query(other[0]) - sumr_per_query(base[0])
    assert conf["var"][6].startswith(f"{q_var.mean():+.1f} [") and conf["var"][6].endswith("‡")
    assert conf["other"][6].startswith(f"{q_other.mean():+.1f} [") and conf["other"][6].endswith("‡")
    assert conf["base (baseline)"][1].startswith(f"{np.mean(sumr['base'][:2]):.1f} [")  # its seeds with ranks
    assert "var (seeds 0, 1); other (seed 0)." in md
    assert "Finished without a ranks artifact (`ranks/ranks_test.parquet`), so left out of the intervals and the " \
           "tests over queries (the tests over seeds use their final metrics): base seed 2." in md


def test_a_variant_without_ranks_is_marked_untested_and_keeps_its_tests_over_seeds(tmp_path):
    rng = np.random.default_rng(3)
    base = [rng.integers(1, 60, N) for _ in range(2)]
    tested = [np.clip(b + rng.integers(-1, 2, N), 1, None) for b in base]
    bare = [np.maximum(1, b - rng.integers(0, 3, N)) for b in base]
    runs = [fake_run(name, s, x[s]) for name, x in (("base", base), ("tested", tested), ("bare", bare)) for s in (0, 1)]
    ranks = {f"{name}-seed{s}": x[s] for name, x in (("base", base), ("tested", tested)) for s in (0, 1)}
    md = _report(tmp_path, fake_study(runs, ranks, baseline="base", seeds=[0, 1]))

    table = {r[0]: r for r in md_rows(md, "## Ablation (test)")}
    assert table["bare"][6].endswith(" n.t.") and not table["tested"][6].endswith(" n.t.")
    legend = "n.t. = not tested over queries (no ranks on the seeds the variant shares with the baseline, or no query in common with its ranks)."
    assert md.count(legend) == 2  # the ablation legend and the confidence legend
    conf = {r[0]: r for r in md_rows(md, "## Confidence (test")}
    assert conf["bare"][-1] == "n.t." and conf["bare"][7] == "—"
    v = [sumr_per_query(x).mean() for x in bare]
    b = [sumr_per_query(x).mean() for x in base]
    d = np.subtract(v, b)
    exact = np.mean([abs(np.mean(np.multiply(s, d))) >= abs(d.mean()) - 1e-9 for s in itertools.product((1, -1), repeat=2)])
    assert conf["bare"][9] == f"{exact:.3f} (n=2, min 0.500)"
    assert conf["bare"][10] == f"{sps.ttest_rel(v, b).pvalue:.3f}"


def test_without_any_ranks_every_difference_is_marked_untested(tmp_path):
    rng = np.random.default_rng(4)
    runs = [fake_run(name, 0, rng.integers(1, 60, N)) for name in ("base", "a", "b")]
    md = _report(tmp_path, fake_study(runs, {}, baseline="base", seeds=[0]))
    body = md_rows(md, "## Ablation (test)")[2:]
    assert [r[6].endswith(" n.t.") for r in body] == [False, True, True]
    assert "n.t. = not tested over queries" in md and "## Confidence" not in md and "†" not in md


def test_a_fully_paired_table_has_no_seed_notes(tmp_path):
    rng = np.random.default_rng(5)
    ranks = {(name, s): rng.integers(1, 60, N) for name in ("base", "var") for s in (0, 1)}
    runs = [fake_run(name, s, x) for (name, s), x in ranks.items()]
    logged = {f"{name}-seed{s}": x for (name, s), x in ranks.items()}
    md = _report(tmp_path, fake_study(runs, logged, baseline="base", seeds=[0, 1]))
    conf = md.split("## Confidence")[1]
    assert "‡" not in md and "ranks artifact" not in md and "\n\n\n" not in conf


def test_a_variant_ranked_on_other_queries_is_not_tested_and_the_report_is_still_written(tmp_path):
    """A variant evaluated on other data (say a ``data.*`` override) shares no query id with the baseline:
    the report used to end in a traceback (``stats.align``); now that row is n.t. and named."""
    rng = np.random.default_rng(3)
    base, other, var = rng.integers(1, 60, N), rng.integers(1, 60, N), rng.integers(1, 60, N)
    runs = [fake_run("base", 0, base), fake_run("moved", 0, other), fake_run("var", 0, var)]
    study = fake_study(runs, {"base-seed0": base, "moved-seed0": other, "var-seed0": var}, baseline="base", seeds=[0])
    plain = study.ranks

    def ranks(run, split):
        x = plain(run, split)
        if run.run_id == "moved-seed0":
            x = {**x, "query_id": np.array([f"elsewhere{i:04d}" for i in range(N)])}
        return x

    study.ranks = ranks
    md = _report(tmp_path, study)
    conf = {r[0]: r for r in md_rows(md, "## Confidence (test")}
    assert conf["moved"][-1] == "n.t." and conf["moved"][6] == "—" and conf["moved"][7] == "—"
    assert conf["var"][6].startswith(f"{(sumr_per_query(var) - sumr_per_query(base)).mean():+.1f} [")  # still tested
    assert ("Evaluated on other test data than the baseline (no query in common, or a shared query with another "
            "ground-truth video), so not tested over queries: `moved`.") in md
    table = {r[0]: r for r in md_rows(md, "## Ablation (test)")}
    assert table["moved"][6].endswith(" n.t.") and not table["var"][6].endswith(" n.t.")


def test_a_variant_whose_shared_queries_have_other_ground_truth_is_not_tested(tmp_path):
    """Same query ids, other videos (say another synthetic data seed): pairing them query by query would
    compare different questions, so the row is n.t. and named, as ``prvrlab compare`` refuses such runs."""
    rng = np.random.default_rng(5)
    base, moved, same = (rng.integers(1, 60, N) for _ in range(3))
    runs = [fake_run("base", 0, base), fake_run("moved", 0, moved), fake_run("same", 0, same)]
    study = fake_study(runs, {"base-seed0": base, "moved-seed0": moved, "same-seed0": same}, baseline="base", seeds=[0])
    plain = study.ranks
    videos = np.array([f"v{i % 50:03d}" for i in range(N)])

    def ranks(run, split):
        x = plain(run, split)
        video = videos.copy()
        if run.run_id == "moved-seed0":
            video[7] = "elsewhere"  # one shared query with another ground-truth video
        return {**x, "video_id": video}

    study.ranks = ranks
    md = _report(tmp_path, study)
    conf = {r[0]: r for r in md_rows(md, "## Confidence (test")}
    assert conf["moved"][-1] == "n.t." and conf["moved"][6] == "—"
    assert conf["same"][6].startswith(f"{(sumr_per_query(same) - sumr_per_query(base)).mean():+.1f} [")
    assert "so not tested over queries: `moved`." in md


def test_the_seed_tests_are_reported_when_no_run_logged_ranks(tmp_path):
    """They rest on the final metrics only; the whole Confidence section had been left out without ranks."""
    from prvrlab.reports.tables import fmt_p

    rng = np.random.default_rng(5)
    runs = [fake_run(v, s, np.maximum(1, rng.integers(1, 40, N) - (8 if v == "b" else 0))) for v in ("base", "b") for s in range(5)]
    md = _report(tmp_path, fake_study(runs, {}, baseline="base", seeds=list(range(5))))  # no ranks for any run
    sumr = {(r.variant, r.seed): r.metrics["final/test/sumr"] for r in runs}
    deltas = np.array([sumr["b", s] - sumr["base", s] for s in range(5)])
    flips = [abs(np.mean(deltas * np.array(signs))) >= abs(deltas.mean()) - 1e-12
             for signs in itertools.product([1, -1], repeat=5)]
    exact = sum(flips) / len(flips)
    t_p = sps.ttest_rel(deltas, np.zeros(5)).pvalue
    row = next(r for r in md_rows(md, "## Confidence") if r[0] == "b")
    assert row[-3].startswith(f"{fmt_p(exact)} (n=5") and row[-2] == fmt_p(t_p)
    assert row[-1] == "n.t." and row[1] == "—"  # nothing over queries without ranks
