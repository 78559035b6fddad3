"""``--resume`` refuses planted or foreign Tune state and another spec's study (issue 11, items 8 and 9)."""

from __future__ import annotations

import hashlib
import os
import pickle

import pytest

from prvrlab.platform.cli import main
from prvrlab.platform.search.spec import StudyError
from prvrlab.platform.search.study import forget_state, record_state, state_record, verify_state

from search_helpers import recorded_study, tiny_spec


class Planted:
    """A pickle that creates a marker file when loaded."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _study(tmp_path, tiny_root, **fields):
    """A spec and a fake earlier submission folder with recorded Tune state."""
    path, _, study_dir = recorded_study(tmp_path, tiny_root, "guard", **fields)
    verify_state(study_dir)
    return path, study_dir


def test_planted_pickle_is_refused_before_unpickling(tmp_path, tiny_root, capsys):
    path, study_dir = _study(tmp_path, tiny_root)
    marker = tmp_path / "pwned"
    (study_dir / "tune" / "tuner.pkl").write_bytes(pickle.dumps(Planted(str(marker))))
    assert main(["search", str(path), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "tuner.pkl" in err and "refusing to resume" in err
    assert not marker.exists()


def test_modified_state_or_missing_checksums_are_refused(tmp_path, tiny_root, capsys, monkeypatch):
    path, study_dir = _study(tmp_path, tiny_root)
    original = (study_dir / "tune" / "experiment_state-1.json").read_text()
    (study_dir / "tune" / "experiment_state-1.json").write_text('{"x": 1}')
    assert main(["search", str(path), "--resume"]) == 2
    assert "experiment_state-1.json was modified" in capsys.readouterr().err
    (study_dir / "tune" / "experiment_state-1.json").write_text(original)
    assert verify_state(study_dir) is None  # back to what the driver recorded
    (study_dir / "state.sha256").unlink()  # no record at all: a driver killed with its sentinel, or a foreign study
    forget_state(study_dir)  # (a run forgets its private record when it starts: a killed one's sentinel records it)
    monkeypatch.delenv("PRVRLAB_TRUST_STUDY_STATE", raising=False)
    with pytest.raises(StudyError, match=r"no record of .*Tune state.*PRVRLAB_TRUST_STUDY_STATE=1"):
        verify_state(study_dir)
    monkeypatch.setenv("PRVRLAB_TRUST_STUDY_STATE", "1")
    assert "trusting it" in verify_state(study_dir)  # the user's call, and said
    os.chmod(study_dir / "tune", 0o777)
    with pytest.raises(StudyError, match="writable by group or others"):
        verify_state(study_dir)


@pytest.mark.parametrize("where", ["", "tune", "tune/experiment_state-1.json"])
def test_world_writable_study_is_refused(tmp_path, tiny_root, capsys, where):
    path, study_dir = _study(tmp_path, tiny_root)
    target = study_dir / where
    os.chmod(target, target.stat().st_mode | 0o002)
    assert main(["search", str(path), "--resume"]) == 2
    assert "writable by group or others" in capsys.readouterr().err


def test_resume_with_another_spec_of_the_same_name_is_refused(tmp_path, tiny_root, capsys):
    path, _ = _study(tmp_path, tiny_root)
    tiny_spec(tmp_path, tiny_root, name="guard", space={"train.lr": {"loguniform": [1e-4, 1e-3]}})
    assert main(["search", str(path), "--resume"]) == 2
    assert "different 'guard' spec" in capsys.readouterr().err


def test_checksums_rewritten_beside_planted_state_are_refused_by_the_private_record(tmp_path, tiny_root, capsys):
    path, study_dir = _study(tmp_path, tiny_root)
    marker = tmp_path / "pwned"
    (study_dir / "tune" / "tuner.pkl").write_bytes(pickle.dumps(Planted(str(marker))))
    sums = study_dir / "state.sha256"  # whoever planted the pickle also rewrote the folder's checksums
    sums.write_text(sums.read_text() + f"{hashlib.sha256((study_dir / 'tune' / 'tuner.pkl').read_bytes()).hexdigest()}  tune/tuner.pkl\n")
    assert main(["search", str(path), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "tuner.pkl was added" in err and str(state_record(study_dir)) in err
    assert not marker.exists()


def test_an_object_store_study_resumes_only_on_this_users_record_of_its_state(tmp_path, monkeypatch):
    uri = "s3://lab/studies/search/guard/20250101-000000"
    study_dir = tmp_path / "staged"  # the pulled copy: ours, whatever the bucket held
    (study_dir / "tune").mkdir(parents=True)
    (study_dir / "tune" / "tuner.pkl").write_bytes(b"state")
    (study_dir / "state.sha256").write_text(  # the bucket's own checksums vouch for nothing
        f"{hashlib.sha256(b'state').hexdigest()}  tune/tuner.pkl\n"
    )
    monkeypatch.delenv("PRVRLAB_TRUST_STUDY_STATE", raising=False)
    with pytest.raises(StudyError, match=r"no record of s3://lab/studies/search/guard/20250101-000000's Tune state .*PRVRLAB_TRUST_STUDY_STATE=1"):
        verify_state(study_dir, uri)
    monkeypatch.setenv("PRVRLAB_TRUST_STUDY_STATE", "1")
    assert "trusting it" in verify_state(study_dir, uri)
    monkeypatch.delenv("PRVRLAB_TRUST_STUDY_STATE")
    record_state(study_dir, uri)  # what this user's driver recorded when the study ran here
    assert verify_state(study_dir, uri) is None
    assert state_record(study_dir, uri) != state_record(study_dir)  # keyed by the URI, not the staging folder
    assert oct(state_record(study_dir, uri).parent.stat().st_mode & 0o777) == "0o700"
    (study_dir / "tune" / "tuner.pkl").write_bytes(b"planted")
    (study_dir / "state.sha256").write_text(f"{hashlib.sha256(b'planted').hexdigest()}  tune/tuner.pkl\n")
    with pytest.raises(StudyError, match="tuner.pkl was modified"):
        verify_state(study_dir, uri)
    forget_state(study_dir, uri)
    assert not state_record(study_dir, uri).exists()


def test_a_copied_study_that_vouches_for_its_own_planted_state_is_refused(tmp_path, tiny_root, capsys, monkeypatch):
    """A folder from elsewhere (cp, tar, git: owned by the user) with a planted pickle and a state.sha256 that
    lists it: this user never recorded that state, so nothing is unpickled."""
    path, study_dir = _study(tmp_path, tiny_root)
    marker = tmp_path / "pwned"
    (study_dir / "tune" / "tuner.pkl").write_bytes(pickle.dumps(Planted(str(marker))))
    sums = study_dir / "state.sha256"
    sums.write_text(sums.read_text() + f"{hashlib.sha256((study_dir / 'tune' / 'tuner.pkl').read_bytes()).hexdigest()}  tune/tuner.pkl\n")
    forget_state(study_dir)  # no private record: the study did not run here
    monkeypatch.delenv("PRVRLAB_TRUST_STUDY_STATE", raising=False)
    assert main(["search", str(path), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "no record of" in err and "PRVRLAB_TRUST_STUDY_STATE=1" in err
    assert not marker.exists()


def test_a_killed_drivers_sentinel_records_the_state_it_left_and_a_resume_waits_for_it(tmp_path, tiny_root):
    """The sentinel of a driver killed outright records the local study's settled state (then resuming it
    passes the check); while it is at work a resume waits, and a live driver's study is not resumed."""
    import json
    import subprocess
    import sys
    import tempfile
    import threading
    import time
    from pathlib import Path

    from prvrlab.platform.tracking import closer
    from prvrlab.platform.tracking.drivers import start_time

    _, study_dir = _study(tmp_path, tiny_root)
    forget_state(study_dir)  # the killed driver recorded nothing
    (study_dir / "tune" / "experiment_state-1.json").write_text('{"trials": 2}')  # what Tune wrote last
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()

    def ledger(driver) -> str:
        fd, name = tempfile.mkstemp(prefix=closer.LEDGER_PREFIX, suffix=".json")
        with os.fdopen(fd, "w") as fh:
            json.dump({"runs": {}, "stores": [], "studies": [str(study_dir.resolve())], "driver": driver}, fh)
        return name

    assert closer.watch(dead.pid, "gone", Path(ledger([dead.pid, "gone"])), poll_s=0.01) == 0
    assert verify_state(study_dir) is None  # recorded by the sentinel: the state as the driver left it
    assert state_record(study_dir).is_file()

    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        busy = ledger([alive.pid, start_time(alive.pid)])
        assert closer.await_study_record(study_dir, timeout_s=1.0) == alive.pid
        with pytest.raises(StudyError, match=f"being run by a live driver \\(pid {alive.pid}\\)"):
            verify_state(study_dir)
        os.unlink(busy)
    finally:
        alive.kill()
        alive.wait()

    working = ledger([dead.pid, "gone"])  # a dead driver's sentinel still recording (its ledger fresh)
    removed = threading.Timer(0.5, os.unlink, (working,))
    removed.start()
    t0 = time.monotonic()
    assert closer.await_study_record(study_dir, timeout_s=10.0) is None
    assert time.monotonic() - t0 >= 0.4 and not os.path.exists(working)
    stale = ledger([dead.pid, "gone"])  # a ledger whose sentinel died with its driver: not waited for
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    try:
        assert closer.await_study_record(study_dir, timeout_s=10.0) is None
    finally:
        os.unlink(stale)
