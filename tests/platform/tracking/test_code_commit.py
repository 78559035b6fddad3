"""The recorded commit is that of the checkout prvrlab runs from, not of the folder a command was started in."""

from __future__ import annotations

import subprocess
from pathlib import Path

import prvrlab
from prvrlab.platform.tracking import store
from prvrlab.platform.tracking.store import code_checkout, git_commit

REPO = Path(__file__).resolve().parents[3]


def _repo_with_a_commit(path: Path) -> str:
    """A git repository at ``path`` with one commit of its own; returns that commit."""
    path.mkdir(parents=True, exist_ok=True)
    run = lambda *args: subprocess.run(["git", *args], cwd=path, capture_output=True, text=True, check=True)  # noqa: E731
    run("init", "-q")
    (path / "notes.txt").write_text("another project\n")
    run("add", "notes.txt")
    run("-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-q", "-m", "other")
    return run("rev-parse", "HEAD").stdout.strip()


def test_a_command_started_in_another_repository_records_prvrlabs_commit(tmp_path, monkeypatch):
    monkeypatch.delenv("PRVRLAB_GIT_COMMIT", raising=False)
    other = _repo_with_a_commit(tmp_path / "user_project")
    monkeypatch.chdir(tmp_path / "user_project")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    assert code_checkout() == REPO
    commit = git_commit()
    assert commit.split("-")[0] == head != other


def test_an_installed_copy_inside_another_repository_records_unknown(tmp_path, monkeypatch):
    """A package in a virtual environment inside a user's repository: that repository's commit is not prvrlab's."""
    monkeypatch.delenv("PRVRLAB_GIT_COMMIT", raising=False)
    _repo_with_a_commit(tmp_path / "user_project")
    site = tmp_path / "user_project" / ".venv" / "lib" / "site-packages" / "prvrlab"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("")
    monkeypatch.setattr(prvrlab, "__file__", str(site / "__init__.py"))
    monkeypatch.chdir(tmp_path / "user_project")
    assert code_checkout() is None
    assert git_commit() == "unknown"
    monkeypatch.setenv(store.GIT_COMMIT_ENV, "abc123")
    assert git_commit() == "abc123"  # the submitted commit still wins
