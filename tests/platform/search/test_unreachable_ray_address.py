"""A study whose ``$RAY_ADDRESS`` nothing answers at is refused before it records anything: one line, exit 2,
no study folder and no MLflow run (it left a FAILED parent and an empty submission folder)."""

from __future__ import annotations

import pytest

from prvrlab.platform.cli import main

from search_helpers import study_runs, tiny_spec


@pytest.mark.parametrize("command", ["search", "ablate"])
def test_a_study_at_an_address_nothing_answers_at_records_nothing(tiny_root, tmp_path, monkeypatch, capsys, command):
    import ray

    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    fields = {"variants": {"full": {}}, "seeds": [0]} if command == "ablate" else {}
    path = tiny_spec(tmp_path, tiny_root, name="nowhere", **fields)
    assert main([command, str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("prvrlab: error: RAY_ADDRESS=127.0.0.1:1: cannot join the Ray cluster (nothing answers at 127.0.0.1:1")
    assert not ray.is_initialized()
    assert not (tmp_path / "results").exists()
    if (tmp_path / "mlflow.db").exists():
        parents, children = study_runs(tmp_path)
        assert parents == [] and children == []
