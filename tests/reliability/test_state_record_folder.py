"""``--resume`` trusts a record of the Tune state only in a folder of the user's own that nobody else can write."""

from __future__ import annotations

import hashlib

import pytest

from prvrlab.platform.search.spec import StudyError
from prvrlab.platform.search.study import record_state, state_record, verify_state

URI = "s3://lab/studies/search/guard/20250101-000000"


def _staged(tmp_path, monkeypatch):
    monkeypatch.setenv("PRVRLAB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("PRVRLAB_TRUST_STUDY_STATE", raising=False)
    study_dir = tmp_path / "staged"
    (study_dir / "tune").mkdir(parents=True)
    (study_dir / "tune" / "tuner.pkl").write_bytes(b"state")
    record_state(study_dir, URI)
    assert verify_state(study_dir, URI) is None
    return study_dir


def test_a_record_folder_others_can_write_is_refused(tmp_path, monkeypatch):
    study_dir = _staged(tmp_path, monkeypatch)
    record = state_record(study_dir, URI)
    record.parent.chmod(0o777)  # e.g. a PRVRLAB_CACHE_DIR shared with others: anyone could have written the record
    with pytest.raises(StudyError, match=f"refusing to resume: {record.parent} is writable by group or others"):
        verify_state(study_dir, URI)
    record.parent.chmod(0o700)
    record.chmod(0o666)
    with pytest.raises(StudyError, match=f"refusing to resume: {record} is writable by group or others"):
        verify_state(study_dir, URI)
    record.chmod(0o600)
    assert verify_state(study_dir, URI) is None


def test_a_record_planted_through_a_linked_folder_is_refused(tmp_path, monkeypatch):
    study_dir = _staged(tmp_path, monkeypatch)
    record = state_record(study_dir, URI)
    elsewhere = tmp_path / "theirs"
    record.parent.rename(elsewhere)
    (elsewhere / record.name).write_text(f"{hashlib.sha256(b'planted').hexdigest()}  tune/tuner.pkl\n")
    (study_dir / "tune" / "tuner.pkl").write_bytes(b"planted")
    record.parent.symlink_to(elsewhere)
    with pytest.raises(StudyError, match="is a symbolic link"):
        verify_state(study_dir, URI)
