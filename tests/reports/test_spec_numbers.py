"""A logged spec's numbers written without a dot (``3e-3``, a string to PyYAML) read as the spec loader reads
them: the report matched no trial's value and crashed on a ``>`` condition."""

from __future__ import annotations

import mlflow

from prvrlab.reports.report import Options, write_report
from prvrlab.reports.source import load_study, yaml_numbers

from report_helpers import md_rows

SPEC = """name: s
space:
  train.lr: {choice: [1e-4, 3e-4, 1e-3]}
  losses.query_diverse.weight: {choice: [0.0, 3e-3]}
  losses.query_diverse.delta: {uniform: [0.1, 0.3], when: {losses.query_diverse.weight: {">": 1e-3}}}
"""


def _search(tmp_path):
    """A finished search in a SQLite store whose parent holds SPEC as its spec artifact; SumR follows lr."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("e", artifact_location=(tmp_path / "art").as_uri())
    parent = client.create_run(exp, tags={"prvrlab.kind": "search", "prvrlab.study": "s"}).info.run_id
    client.log_param(parent, "spec.metric", "val/sumr")
    (tmp_path / "s.yaml").write_text(SPEC)
    client.log_artifact(parent, str(tmp_path / "s.yaml"), "spec")
    lrs, weights = [1e-4, 3e-4, 1e-3], [0.0, 0.003]
    for i in range(12):
        lr, weight = lrs[i % 3], weights[i % 2]
        params = {"train.lr": lr, "losses.query_diverse.weight": weight, "losses.query_diverse.delta": 0.2}
        sumr = 100.0 + 50 * (i % 3) + 0.1 * (i % 2)
        run = client.create_run(exp, tags={"mlflow.parentRunId": parent, "prvrlab.kind": "trial", "prvrlab.status": "finished",
                                           "prvrlab.trial_id": f"t{i}", "prvrlab.trial_number": str(i), "prvrlab.epoch_base": "1"})
        rid = run.info.run_id
        for key, value in params.items():
            client.log_param(rid, key, str(value))
        client.log_metric(rid, "val/sumr", sumr, step=1)
        for key, value in {"sumr": sumr, "r1": 1.0, "r5": 2.0, "r10": 3.0, "r100": sumr - 6}.items():
            client.log_metric(rid, f"final/val/{key}", value)
        client.set_terminated(rid, "FINISHED")
    client.set_terminated(parent, "FINISHED")
    return load_study(uri, parent)


def test_numbers_without_a_dot_are_numbers_as_the_spec_loader_reads_them():
    assert yaml_numbers({"choice": ["1e-3", "+2E5", "-.5e1", "7", "a1e3", "1e", "official"]}) == {
        "choice": [0.001, 200000.0, -5.0, 7, "a1e3", "1e", "official"]}
    assert yaml_numbers({"when": {"k": {">": "1e-3"}}}) == {"when": {"k": {">": 0.001}}}


def test_a_report_of_a_spec_written_with_exponents_rates_and_conditions_its_keys(tmp_path):
    study = _search(tmp_path)
    md = write_report(study, tmp_path / "out", Options(n_boot=50, split="val")).read_text()
    rows = md_rows(md, "## Parameter importances")[2:]
    assert rows[0][0] == "`train.lr`"  # it sets SumR; as strings its values matched no trial ("set in 0 of 12")
    assert "set in 0 of" not in md
    lr_rows = md_rows(md, "**train.lr**")[2:]
    assert [(r[0], r[1]) for r in lr_rows] == [("0.0001", "4"), ("0.0003", "4"), ("0.001", "4")]
    delta_rows = md_rows(md, "**losses.query_diverse.delta**")[2:]  # active where weight 3e-3 > 1e-3: 6 trials
    assert [r[1] for r in delta_rows] == ["6"]
