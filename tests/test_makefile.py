"""The Makefile's setup writes the package's bytecode even where PYTHONDONTWRITEBYTECODE is set."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def _venv(tmp_path: Path) -> Path:
    """A stand-in virtual environment: this interpreter, and a ``prvrlab`` stamp newer than pyproject.toml
    (so make does not build a real one)."""
    (tmp_path / "pyproject.toml").touch()
    (tmp_path / "venv" / "bin").mkdir(parents=True)
    (tmp_path / "venv" / "bin" / "python").symlink_to(sys.executable)
    stamp = tmp_path / "venv" / "bin" / "prvrlab"
    stamp.touch()
    later = (tmp_path / "pyproject.toml").stat().st_mtime + 60
    os.utime(stamp, (later, later))
    return tmp_path / "venv"


def _make(tmp_path: Path, venv: Path, *targets: str, dry: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    cmd = ["make", "-s", "-C", str(tmp_path), "-f", str(ROOT / "Makefile"), f"VENV={venv}", *(["-n"] if dry else []), *targets]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)


def test_setup_writes_bytecode_despite_pythondontwritebytecode(tmp_path):
    package = tmp_path / "prvrlab"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("X = 1\n")
    (package / "sub" / "mod.py").write_text("Y = 2\n")
    venv = _venv(tmp_path)
    done = _make(tmp_path, venv, "setup")
    assert done.returncode == 0, done.stderr
    for source in (package / "__init__.py", package / "sub" / "mod.py"):
        compiled = Path(importlib.util.cache_from_source(str(source)))
        assert compiled.is_file(), f"{compiled} not written"


def test_test_target_compiles_before_pytest(tmp_path):
    venv = _venv(tmp_path)
    lines = _make(tmp_path, venv, "test", dry=True).stdout.splitlines()
    compile_at = next(i for i, line in enumerate(lines) if "compileall" in line and "prvrlab" in line)
    pytest_at = next(i for i, line in enumerate(lines) if "-m pytest" in line)
    assert compile_at < pytest_at


def test_a_file_that_does_not_compile_is_a_note_not_a_failure(tmp_path):
    package = tmp_path / "prvrlab"
    package.mkdir()
    (package / "__init__.py").write_text("X = 1\n")
    (package / "broken.py").write_text("def f(:\n")
    venv = _venv(tmp_path)
    done = _make(tmp_path, venv, "setup")
    assert done.returncode == 0, done.stderr
    assert "broken.py" in done.stdout
    assert "some of prvrlab's bytecode was not written" in done.stdout
    assert Path(importlib.util.cache_from_source(str(package / "__init__.py"))).is_file()
