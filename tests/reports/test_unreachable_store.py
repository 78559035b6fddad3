"""report and compare against a tracking server that does not answer: one line naming the option and the
address, exit 2, at once (they had waited through MLflow's retries: 4 minutes for compare)."""

from __future__ import annotations

import socket
import time

import pytest

from prvrlab.platform.cli import EXIT_BAD_INPUT, main


@pytest.fixture
def dead_uri():
    with socket.socket() as s:  # a port nothing listens on once the socket is closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("argv", [["compare", "a1", "b2"], ["report", "--run-id", "a1"], ["report", "--experiment", "x"]])
def test_one_line_at_once(argv, dead_uri, capsys, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    start = time.monotonic()
    assert main([*argv, "--tracking-uri", dead_uri]) == EXIT_BAD_INPUT
    assert time.monotonic() - start < 20
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--tracking-uri" in err[0] and "no server answers at 127.0.0.1:" in err[0], err


def test_from_the_environment_it_names_the_variable(dead_uri, capsys, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", dead_uri)
    assert main(["compare", "a1", "b2"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert "MLFLOW_TRACKING_URI" in err and "no server answers" in err
