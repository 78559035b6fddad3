"""``--check --resume`` of a study on an object store reads it into a throwaway folder: the staging copy a
running driver on this host works in is left alone (it had been emptied, even when the check then refused)."""

from __future__ import annotations

from prvrlab.platform import storage
from prvrlab.platform.cli import main

from s3_helpers import s3_client, s3_endpoint
from search_helpers import tiny_spec


def test_check_resume_of_an_object_store_study_leaves_its_staging_copy(tmp_path, tiny_root, monkeypatch, capsys):
    monkeypatch.setenv("PRVRLAB_STAGING", str(tmp_path / "staging"))
    with s3_endpoint("bkt") as env:
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        path = tiny_spec(tmp_path, tiny_root, name="again", overrides={"tracking.storage_path": "s3://bkt/results"})
        s3_client(env).put_object(Bucket="bkt", Key="results/search/again/20250101-000000/tune/experiment_state-1.json",
                                  Body=b"{}")
        study = storage.Location("s3://bkt/results/search/again/20250101-000000")
        live = study.local / "trials" / "t0" / "files" / "best_model.pt"  # a running driver's working copy
        live.parent.mkdir(parents=True)
        live.write_bytes(b"weights")
        assert main(["search", str(path), "--check", "--resume"]) == 2  # no record of its state: refused
        assert "refusing to resume" in capsys.readouterr().err
        assert live.read_bytes() == b"weights"
        monkeypatch.setenv("PRVRLAB_TRUST_STUDY_STATE", "1")
        assert main(["search", str(path), "--check", "--resume"]) == 0
        assert "--resume would continue search 'again' from s3://bkt/results/search/again/20250101-000000" in capsys.readouterr().out
        assert live.read_bytes() == b"weights"
