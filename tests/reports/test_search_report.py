"""The search report on in-memory searches: importances with conditional keys, list and null values in the
sensitivity tables, and the searched value of a metric other than SumR."""

from __future__ import annotations

import math
import random
import statistics

from prvrlab.reports.report import Options, importances, write_report

from report_helpers import fake_run, fake_study, fake_search, md_rows, search_trial

OPT = Options(n_boot=20)
LR, WEIGHT, ALPHA = "train.lr", "losses.query_diverse.weight", "losses.query_diverse.alpha"
CONDITIONAL = {
    LR: {"loguniform": [1e-4, 1e-2]},
    WEIGHT: {"choice": [0.0, 0.01]},
    ALPHA: {"choice": [16.0, 32.0], "when": {WEIGHT: {">": 0}}},
}


def _driven_by_the_weight(n: int = 20) -> list[tuple[dict, float]]:
    """Trials whose SumR is 100 with the query-diverse loss off and 200 with it on (+ noise below 1): the weight
    alone decides it; alpha, set only where the weight is > 0, and lr do not matter."""
    rng = random.Random(0)
    trials = []
    for i in range(n):
        weight = [0.0, 0.01][i % 2]
        params = {LR: 10 ** rng.uniform(-4, -2), WEIGHT: weight}
        if weight > 0:
            params[ALPHA] = rng.choice([16.0, 32.0])
        trials.append((params, (200.0 if weight > 0 else 100.0) + rng.uniform(0, 1)))
    return trials


def _section(md: str, heading: str) -> str:
    start = md.index(heading)
    end = md.find("\n## ", start + 1)
    return md[start:] if end < 0 else md[start:end]


def test_importances_use_every_trial_and_leave_conditional_keys_out():
    trials = _driven_by_the_weight()
    imp = importances(CONDITIONAL, trials, 0)
    with_alpha = sum(1 for params, _ in trials if ALPHA in params)
    assert imp.trials == len(trials) and imp.left_out == {ALPHA: with_alpha}
    assert max(imp.values, key=imp.values.get) == WEIGHT and imp.values[WEIGHT] > 0.9
    # the same importances as a search that never had the conditional key
    unconditional = {k: v for k, v in CONDITIONAL.items() if k != ALPHA}
    alone = importances(unconditional, [({k: v for k, v in p.items() if k != ALPHA}, s) for p, s in trials], 0)
    assert imp.values.keys() == alone.values.keys()
    assert all(math.isclose(imp.values[k], alone.values[k]) for k in alone.values)


def test_the_report_rates_the_key_deciding_a_condition_first_and_says_what_it_left_out(tmp_path):
    trials = _driven_by_the_weight()
    # every config key is logged; alpha at the base config's value where its condition did not hold
    runs = [search_trial(i, {ALPHA: 16.0, **params}, {"final/val/sumr": sumr}) for i, (params, sumr) in enumerate(trials)]
    md = write_report(fake_search(runs, CONDITIONAL), tmp_path, OPT).read_text()
    rows = md_rows(md, "## Parameter importances")[2:]
    assert [r[0] for r in rows] == [f"`{WEIGHT}`", f"`{LR}`"]
    text = _section(md, "## Parameter importances")
    with_alpha = sum(1 for params, _ in trials if ALPHA in params)
    assert f"on {len(trials)} trials rebuilt from MLflow" in text
    assert f"`{ALPHA}` (set in {with_alpha} of {len(trials)} trials: sampled only when its `when` condition holds)" in text


SIGMAS = [[1.0, 3.0], [1.0, 5.0], [math.inf]]


def test_a_search_over_list_values_groups_them_as_written(tmp_path):
    space = {"model.sigmas": {"choice": SIGMAS}}
    values = [SIGMAS[i % 3] for i in range(6)]
    sumr = [100.0 + 7 * i for i in range(6)]
    runs = [search_trial(i, {"model.sigmas": v}, {"final/val/sumr": s}) for i, (v, s) in enumerate(zip(values, sumr))]
    md = write_report(fake_search(runs, space), tmp_path, OPT).read_text()
    body = md_rows(md, "**model.sigmas**")[2:]
    assert [r[0] for r in body] == ["[1.0, 3.0]", "[1.0, 5.0]", "[inf]"]  # as MLflow logged them, in order
    for row, sigma in zip(body, SIGMAS):
        mine = [s for v, s in zip(values, sumr) if v == sigma]
        assert row[1] == str(len(mine)) and row[-1] == f"{statistics.fmean(mine):.1f}"
    best = max(range(6), key=lambda i: sumr[i])
    assert {r[0]: r[1] for r in md_rows(md, "## Best trial")[2:]}["`model.sigmas`"] == str(values[best])
    assert md_rows(md, "## Parameter importances")[2:] == [["`model.sigmas`", "1.000"]]


def test_an_ablation_over_list_values_has_a_sensitivity_table(tmp_path):
    ranks = {"a": [1, 2, 7, 30, 200], "b": [1, 1, 3, 9, 50], "c": [4, 8, 20, 90, 300]}
    logged = {"a": "[1.0, 3.0]", "b": "[1.0, 5.0]", "c": "[inf]"}
    runs = []
    for variant, r in ranks.items():
        for seed in (0, 1):
            run = fake_run(variant, seed, r[: 4 + seed])
            run.params["model.sigmas"] = logged[variant]
            runs.append(run)
    study = fake_study(runs, {}, baseline="a", seeds=[0, 1])
    study.spec["variants"] = {v: {"model.sigmas": sigma} for v, sigma in zip(ranks, SIGMAS)}
    md = write_report(study, tmp_path, OPT).read_text()
    body = md_rows(md, "**model.sigmas**")[2:]
    assert [r[0] for r in body] == list(logged.values())
    for row, variant in zip(body, ranks):
        sumr = [run.metrics["final/test/sumr"] for run in runs if run.variant == variant]
        assert row[1] == "2" and row[-1] == f"{statistics.fmean(sumr):.1f}"


def test_a_null_value_is_a_row_and_an_inactive_conditional_key_is_not(tmp_path):
    space = {"model.ffn_size": {"choice": [None, 256, 512]}, WEIGHT: {"choice": [0.0, 0.01]},
             ALPHA: {"choice": [16.0, 32.0], "when": {WEIGHT: {">": 0}}}}
    ffn = [None, 256, 512, None, 256, 512]
    weight = [0.0, 0.01] * 3
    sumr = [(150.0 if f is None else 100.0) + i for i, f in enumerate(ffn)]
    runs = [search_trial(i, {"model.ffn_size": f, WEIGHT: w, ALPHA: 32.0}, {"final/val/sumr": s})
            for i, (f, w, s) in enumerate(zip(ffn, weight, sumr))]
    md = write_report(fake_search(runs, space), tmp_path, OPT).read_text()
    body = {r[0]: r for r in md_rows(md, "**model.ffn_size**")[2:]}
    assert list(body) == ["256", "512", "None"]
    for value, row in body.items():
        mine = [s for f, s in zip(ffn, sumr) if str(f) == value]
        assert row[1] == str(len(mine)) and row[-1] == f"{statistics.fmean(mine):.1f}"
    best_mean = max(statistics.fmean([s for f, s in zip(ffn, sumr) if f == v]) for v in (None, 256, 512))
    assert f"| None | 2 | — | — | — | — | **{best_mean:.1f}** |" in md
    # alpha only where its condition held: the trials with the weight on, none as a 'None' row
    alpha = md_rows(md, f"**{ALPHA}**")[2:]
    assert [r[:2] for r in alpha] == [["32", str(sum(1 for w in weight if w > 0))]]


def test_an_ablation_variant_setting_null_is_a_row(tmp_path):
    ranks = {"x": [1, 2, 3, 50], "y": [5, 9, 40, 200], "z": [2, 6, 11, 101]}
    logged = {"x": "None", "y": "256", "z": "512"}
    runs = []
    for variant, r in ranks.items():
        run = fake_run(variant, 0, r)
        run.params["model.ffn_size"] = logged[variant]
        runs.append(run)
    study = fake_study(runs, {}, baseline="x", seeds=[0])
    study.spec["variants"] = {"x": {"model.ffn_size": None}, "y": {"model.ffn_size": 256}, "z": {"model.ffn_size": 512}}
    md = write_report(study, tmp_path, OPT).read_text()
    body = {r[0]: r[-1] for r in md_rows(md, "**model.ffn_size**")[2:]}
    assert body == {logged[v]: f"{run.metrics['final/test/sumr']:.1f}" for v, run in zip(ranks, runs)}
    assert list(body) == ["256", "512", "None"]  # numbers by value, then the null


def test_the_searched_value_of_a_metric_is_the_best_of_every_report_as_the_search_ranks(tmp_path):
    """val/r1: the finished trial's best-SumR model has R@1 11 but it reported 15 at epoch 1; the early-stopped
    one reported 13. The search (tuning.best_trial, the best of every report) picks the first."""
    history = {("run00", "val/r1"): [(1, 15.0), (2, 11.0)], ("run01", "val/r1"): [(1, 13.0)]}
    finished = search_trial(0, {LR: 1e-3}, {"final/val/r1": 11.0, "final/val/sumr": 120.0})
    stopped = search_trial(1, {LR: 2e-3}, {}, status="early_stopped")
    study = fake_search([finished, stopped], {LR: {"loguniform": [1e-4, 1e-2]}}, metric="val/r1", history=history)
    md = write_report(study, tmp_path, OPT).read_text()
    searched = {run.run_id: max([v for _, v in history[(run.run_id, "val/r1")]]
                                + ([run.metrics["final/val/r1"]] if "final/val/r1" in run.metrics else []))
                for run in (finished, stopped)}
    summary = {r[0]: r[1] for r in md_rows(md, "## Best trial")[2:]}
    assert summary["Trial"] == "`t00`" and summary["val/r1"] == f"{searched['run00']:.2f}"
    top = md_rows(md, "## Top trials")[2:]
    assert [(r[1], r[-1]) for r in top] == [("`t00`", f"{searched['run00']:.2f}"), ("`t01`", f"{searched['run01']:.2f}")]
    assert "val/r1: the searched value, the best the trial reported over its epochs and its final evaluation" in md


def test_a_tie_goes_to_the_trial_the_search_named_best_then_to_start_order(tmp_path):
    """The search keeps the first of tied trials in start order and tags the parent with it; trial ids are
    random, so ranking ties by id named another trial (and its config) than best_config.yaml."""
    from prvrlab.reports.report import rank_trials

    runs = [search_trial(i, {LR: 1e-3 * (i + 1)}, {"final/val/sumr": sumr}) for i, sumr in enumerate([150.0, 180.0, 180.0, 180.0])]
    for run, number in zip(runs, [4, 3, 1, 2]):  # t02 started first, then t03, t01
        run.tags["prvrlab.trial_number"] = str(number)
    study = fake_search(runs, {LR: {"loguniform": [1e-4, 1e-2]}})
    scored = [(r, r.metrics["final/val/sumr"]) for r in runs]
    assert [r.trial_id for r, _ in rank_trials(study, scored)] == ["t02", "t03", "t01", "t00"]
    study.tags["prvrlab.best_trial"] = "t03"
    assert [r.trial_id for r, _ in rank_trials(study, scored)] == ["t03", "t02", "t01", "t00"]
    best = md_rows(write_report(study, tmp_path, OPT).read_text(), "## Best trial")
    assert ["Trial", "`t03`"] in best
