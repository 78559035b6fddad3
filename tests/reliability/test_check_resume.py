"""``--check --resume`` names the submission a resume would continue, or refuses as the resume would."""

from __future__ import annotations

from prvrlab.platform.cli import main
from prvrlab.platform.search.outcome import RunMap
from prvrlab.platform.search.spec import load_search_spec
from prvrlab.platform.search.study import record_state, spec_hash, study_root

from search_helpers import tiny_spec


def _submission(tmp_path, spec_path, stamp: str):
    study_dir = study_root(tmp_path / "results", "search", "again") / stamp
    (study_dir / "tune").mkdir(parents=True)
    (study_dir / "tune" / "experiment_state-1.json").write_text("{}")
    runs = RunMap(study_dir)
    runs.meta["spec_hash"] = spec_hash(load_search_spec(spec_path))
    runs.save()
    record_state(study_dir)
    return study_dir


def test_check_resume_names_the_latest_submission(tmp_path, tiny_root, capsys):
    path = tiny_spec(tmp_path, tiny_root, name="again")
    _submission(tmp_path, path, "20250101-000000")
    latest = _submission(tmp_path, path, "20250102-000000")
    assert main(["search", str(path), "--check", "--resume"]) == 0
    out = capsys.readouterr().out
    assert "valid search spec" in out and f"from {latest}" in out
    assert not (tmp_path / "mlflow.db").exists() and sorted(p.name for p in latest.parent.iterdir()) == [
        "20250101-000000", "20250102-000000"]  # nothing started: no new submission folder


def test_check_resume_refuses_what_the_resume_refuses(tmp_path, tiny_root, capsys):
    path = tiny_spec(tmp_path, tiny_root, name="again")
    assert main(["search", str(path), "--check", "--resume"]) == 2
    assert "nothing to resume" in capsys.readouterr().err
    _submission(tmp_path, path, "20250101-000000")
    tiny_spec(tmp_path, tiny_root, name="again", space={"train.lr": {"loguniform": [1e-4, 1e-3]}})
    assert main(["search", str(path), "--check", "--resume"]) == 2
    assert "different 'again' spec" in capsys.readouterr().err
    assert main(["search", str(path), "--check"]) == 0  # without --resume the new spec is valid
