"""Issue 11, item 7: bad inputs end with one line on stderr, exit 2, and nothing recorded."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from prvrlab.platform.cli import EXIT_BAD_INPUT, main
from prvrlab.platform.config import ConfigError
from prvrlab.platform.tracking.store import Tracker

from train_helpers import small_raw


def _config(tiny_root: Path, tmp: Path, **tracking) -> Path:
    raw = small_raw(tiny_root, tmp, epochs=1)
    raw["tracking"].update(tracking)
    path = tmp / "c.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [ln for ln in err.splitlines() if ln.strip() and " INFO mlflow." not in ln]  # MLflow creating a new db
    assert len(lines) == 1 and lines[0].startswith("prvrlab: error: "), err
    return lines[0]


def _no_run_folder(tmp: Path) -> None:
    results = tmp / "results"
    assert not results.exists() or not any(results.iterdir())


def test_non_utf8_config(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_bytes(b"name: caf\xe9\n")
    assert main(["train", str(cfg)]) == EXIT_BAD_INPUT
    line = _one_line(capsys)
    assert str(cfg) in line and "UTF-8" in line


@pytest.mark.parametrize("value", ["[1", "!!python/name:os.system", "{a: 1, a: 2}"])
def test_bad_yaml_in_set(tiny_root, tmp_path, capsys, value):
    cfg = _config(tiny_root, tmp_path)
    assert main(["train", str(cfg), "--set", f"train.lr={value}", "--no-ray"]) == EXIT_BAD_INPUT
    assert "--set train.lr" in _one_line(capsys)
    _no_run_folder(tmp_path)


def _unwritable_dir(tmp: Path) -> Path:
    """A folder nothing can be created in, as root too: a path under a regular file."""
    blocker = tmp / "blocker"
    blocker.write_text("a file, not a folder")
    return blocker / "store"


def test_unwritable_sqlite_store(tiny_root, tmp_path, capsys):
    uri = f"sqlite:///{_unwritable_dir(tmp_path) / 'mlflow.db'}"
    cfg = _config(tiny_root, tmp_path, uri=uri)
    assert main(["train", str(cfg), "--no-ray"]) == EXIT_BAD_INPUT
    assert uri in _one_line(capsys)
    _no_run_folder(tmp_path)


def test_read_only_sqlite_store_with_the_experiment(tiny_root, tmp_path, capsys):
    if os.geteuid() == 0:
        pytest.skip("root writes to a read-only file; the path-under-a-file case covers root")
    db = tmp_path / "ro" / "mlflow.db"
    db.parent.mkdir()
    uri = f"sqlite:///{db}"
    Tracker(uri, "tests")
    db.chmod(0o444)
    db.parent.chmod(0o555)
    try:
        cfg = _config(tiny_root, tmp_path, uri=uri)
        assert main(["train", str(cfg), "--no-ray"]) == EXIT_BAD_INPUT
        assert uri in _one_line(capsys)
        _no_run_folder(tmp_path)
        assert Tracker(uri, "tests").client.search_runs([Tracker(uri, "tests").experiment_id]) == []
    finally:
        db.parent.chmod(0o755)


def test_unwritable_results_folder(tiny_root, tmp_path, capsys):
    storage = _unwritable_dir(tmp_path)
    cfg = _config(tiny_root, tmp_path, storage_path=str(storage))
    assert main(["train", str(cfg), "--no-ray"]) == EXIT_BAD_INPUT
    line = _one_line(capsys)
    assert "tracking.storage_path" in line and str(storage) in line
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "tests")
    assert tracker.client.search_runs([tracker.experiment_id]) == []


def test_unknown_tracking_scheme(tiny_root, tmp_path, capsys):
    cfg = _config(tiny_root, tmp_path, uri="foo://bar")
    assert main(["train", str(cfg), "--no-ray"]) == EXIT_BAD_INPUT
    assert "foo://bar" in _one_line(capsys)
    _no_run_folder(tmp_path)


def _never(**kwargs):
    raise AssertionError("MLflow was asked to open the store")


@pytest.mark.parametrize("where", ["proc", "folder", "under_a_file"])
def test_an_sqlite_file_that_cannot_be_opened_fails_before_mlflow_opens_it(tmp_path, monkeypatch, where):
    """MLflow retries a file SQLite cannot open for about 100 s before it gives up."""
    path = {"proc": Path("/proc/mlflow.db"), "folder": tmp_path, "under_a_file": _unwritable_dir(tmp_path) / "mlflow.db"}[where]
    reason = {"proc": "cannot be created", "folder": "is a folder", "under_a_file": "cannot be created"}[where]
    uri = f"sqlite:///{path}"

    monkeypatch.setattr("mlflow.tracking.MlflowClient", _never)
    with pytest.raises(ConfigError, match=reason) as caught:
        Tracker(uri, "tests")
    assert uri in str(caught.value)


def test_a_tracking_server_nobody_answers_fails_before_mlflow_retries(monkeypatch):
    """MLflow retries a refused connection for minutes before it gives up."""
    port = _closed_port()
    monkeypatch.setattr("mlflow.tracking.MlflowClient", _never)
    _no_proxy(monkeypatch)
    uri = f"http://127.0.0.1:{port}"
    with pytest.raises(ConfigError, match=f"no server answers at 127.0.0.1:{port}") as caught:
        Tracker(uri, "tests")
    assert uri in str(caught.value)


def _closed_port() -> int:
    import socket

    with socket.socket() as sock:  # a port nothing listens on once closed
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _no_proxy(monkeypatch) -> None:
    for name in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)


def test_a_tracker_told_to_wait_reaches_a_server_that_comes_back(monkeypatch):
    """A server restarted while a study runs: a Tracker with ``wait_s`` tries again until it answers."""
    import socket
    import threading
    import time

    port = _closed_port()
    monkeypatch.setattr("mlflow.tracking.MlflowClient", _never)
    _no_proxy(monkeypatch)
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)

    def come_back() -> None:
        time.sleep(1.0)  # refused until then
        listener.bind(("127.0.0.1", port))
        listener.listen()

    starter = threading.Thread(target=come_back)
    t0 = time.monotonic()
    starter.start()
    try:
        with pytest.raises(AssertionError, match="MLflow was asked"):  # the check passed: MLflow is next
            Tracker(f"http://127.0.0.1:{port}", "tests", wait_s=30.0)
        assert time.monotonic() - t0 >= 1.0  # it did wait for the server
    finally:
        starter.join()
        listener.close()


def test_a_tracker_gives_up_on_a_server_that_stays_down_after_its_wait(monkeypatch):
    import time

    port = _closed_port()
    monkeypatch.setattr("mlflow.tracking.MlflowClient", _never)
    _no_proxy(monkeypatch)
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=f"no server answers at 127.0.0.1:{port}"):
        Tracker(f"http://127.0.0.1:{port}", "tests", wait_s=1.2)
    assert time.monotonic() - t0 >= 1.2


def test_a_studys_trial_time_tracker_waits_for_the_server(monkeypatch):
    """The driver's callback opens its Tracker when the first trial starts; the server answered when
    the study began, so a refusal then is a restart to wait out, not a wrong URI."""
    from prvrlab.platform.search.mlflow_callback import MlflowStudyCallback
    from prvrlab.platform.tracking import store

    seen = {}

    class Recorder:
        def __init__(self, uri, experiment, *, wait_s=0.0):
            seen.update(uri=uri, experiment=experiment, wait_s=wait_s)

    monkeypatch.setattr(store, "Tracker", Recorder)

    class Study:
        tracking_uri, experiment = "http://127.0.0.1:1", "e"

    MlflowStudyCallback(Study()).tracker
    assert seen == {"uri": "http://127.0.0.1:1", "experiment": "e", "wait_s": store.STUDY_SERVER_WAIT_S}
    assert store.STUDY_SERVER_WAIT_S > 0


def test_the_store_check_leaves_no_store_file_behind(tmp_path, monkeypatch):
    """MLflow creates the file and its tables together; an empty file first would let another process
    (a poller, a second command) find it and create the tables at the same time."""
    db = tmp_path / "new" / "mlflow.db"
    monkeypatch.setattr("mlflow.tracking.MlflowClient", _never)
    monkeypatch.setattr("prvrlab.platform.tracking.template.seed", lambda uri: False)  # MLflow makes the store
    with pytest.raises(AssertionError, match="MLflow was asked"):
        Tracker(f"sqlite:///{db}", "tests")  # the check passed: MLflow is next
    assert db.parent.is_dir() and list(db.parent.iterdir()) == []


def test_a_seeded_store_is_whole_before_mlflow_opens_it(tmp_path, monkeypatch):
    """The other way a new store appears: a whole copy of the empty template, never an empty file."""
    from prvrlab.platform.tracking import template

    db = tmp_path / "new" / "mlflow.db"
    monkeypatch.setattr("mlflow.tracking.MlflowClient", _never)
    with pytest.raises(AssertionError, match="MLflow was asked"):
        Tracker(f"sqlite:///{db}", "tests")
    assert [p.name for p in db.parent.iterdir()] == ["mlflow.db"]
    assert db.read_bytes() == template.template_path().read_bytes()


@pytest.mark.parametrize("command", [["compare", "run_a", "run_b"], ["report", "--run-id", "parent"]])
@pytest.mark.parametrize("seed", ["-1", "4294967296", "x"])
def test_a_resampling_seed_numpy_refuses_is_a_usage_error(command, seed, capsys):
    """--seed -1 or 2**32 had ended compare and report in a traceback (NumPy's and Optuna's refusals)."""
    from prvrlab.platform.cli import main

    with pytest.raises(SystemExit) as stop:
        main([*command, "--seed", seed])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "--seed: expected an integer in [0, 2**32)" in err and "Traceback" not in err
