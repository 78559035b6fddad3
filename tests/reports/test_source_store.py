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
