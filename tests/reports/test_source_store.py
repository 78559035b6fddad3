"""A store MLflow refuses is one ReportError naming the URI, raised when the client is opened."""

from __future__ import annotations

import pytest

from prvrlab.reports.errors import ReportError
from prvrlab.reports.source import mlflow_client


def test_a_file_store_mlflow_refuses_is_one_report_error(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    uri = (tmp_path / "mlruns").as_uri()
    with pytest.raises(ReportError) as caught:
        mlflow_client(uri)
    message = str(caught.value)
    assert message.startswith(f"tracking store {uri}: cannot use it: ") and "\n" not in message


def test_a_usable_store_gives_a_client(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert [e.name for e in mlflow_client(uri).search_experiments()] == ["Default"]


def test_names_from_the_tracking_server_never_choose_a_path_outside_the_cache(tmp_path):
    from prvrlab.reports.errors import ReportError
    from prvrlab.files import leaves_folder
    from prvrlab.reports.source import run_cache, run_ranks

    assert run_cache(tmp_path, "0123abcdef4567890123abcdef456789") == tmp_path / "0123abcdef4567890123abcdef456789"
    for bad in ("../../home", "a/b", "", ".."):
        with pytest.raises(ReportError, match="not a plain name"):
            run_cache(tmp_path, bad)

    class NoCall:  # a client that must not be asked: the id is refused first
        def __getattr__(self, name):
            raise AssertionError(name)

    with pytest.raises(ReportError, match="not a plain name"):
        run_ranks(NoCall(), "../escape", "test", tmp_path)
    assert [n for n in ("distributions/a.json", "distributions/../../x.json", "/abs.json", "d//x.json") if not leaves_folder(n)] == [
        "distributions/a.json"
    ]
