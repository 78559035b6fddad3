"""One driver at a time per study on a machine: a second ``--resume`` (or a resume of a study whose first
driver still runs) is refused naming the holder, instead of both drivers running the study together
(duplicate trials, one parent run tagged by the loser)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from prvrlab.platform.cli import main
from prvrlab.platform.search.spec import StudyError, load_search_spec
from prvrlab.platform.search.study import check_resume, study_location
from prvrlab.platform.study_state import _CLAIMS, claim_study, release_studies, study_lock

from search_helpers import recorded_study, tiny_spec

HOLD = "import sys; from pathlib import Path; from prvrlab.platform.study_state import claim_study; " \
       "claim_study(Path(sys.argv[1])); print('held', flush=True); sys.stdin.read()"


def _study(tmp_path, tiny_root):
    return recorded_study(tmp_path, tiny_root, "claim")


@pytest.fixture
def holder(tmp_path):
    """Start a process that holds a study's lock until killed: holder(study_dir) -> its Popen."""
    procs = []

    def start(study_dir):
        proc = subprocess.Popen([sys.executable, "-c", HOLD, str(study_dir)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
        assert proc.stdout.readline().strip() == b"held"
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()
    release_studies()


def test_a_resume_while_another_driver_holds_the_study_is_refused(tmp_path, tiny_root, capsys, holder):
    path, spec, study_dir = _study(tmp_path, tiny_root)
    proc = holder(study_dir)
    assert main(["search", str(path), "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"refusing to resume: {study_dir} is being run by another driver on this machine (pid {proc.pid})" in err
    location = study_location(str(tmp_path / "results"), "search", "claim")
    with pytest.raises(StudyError, match=f"being run by another driver on this machine \\(pid {proc.pid}\\)"):
        check_resume(spec, "search", echo=lambda _: None)  # --check --resume says the same
    proc.send_signal(signal.SIGKILL)  # a driver killed outright: the kernel lets its lock go
    proc.wait()
    assert claim_study(study_dir) is None and study_lock(study_dir) in _CLAIMS
    assert location.local.is_dir()


def test_a_process_reclaims_its_own_study_and_a_probe_holds_nothing(tmp_path, tiny_root):
    _, _, study_dir = _study(tmp_path, tiny_root)
    assert claim_study(study_dir, hold=False) is None and study_lock(study_dir) not in _CLAIMS
    assert claim_study(study_dir) is None and claim_study(study_dir) is None  # its own: no refusal
    assert oct(study_lock(study_dir).parent.stat().st_mode & 0o777) == "0o700"
    release_studies()
    assert not _CLAIMS


def test_a_new_study_is_claimed_by_its_driver_as_its_folder_is_made(tmp_path, tiny_root, holder):
    from prvrlab.platform.search.study import prepare_study

    path = tiny_spec(tmp_path, tiny_root, name="fresh")
    _, study_dir, resumed = prepare_study(load_search_spec(path), resume=False, kind="search", echo=lambda _: None)
    assert not resumed and study_lock(study_dir) in _CLAIMS
    release_studies()
