"""Where the tracking store is: the URI a config, option or environment gives, checked and made absolute.

A leaf of the platform (the config check, the run closer and the store all read it without importing
each other); MLflow is not imported here.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from prvrlab.platform.errors import ConfigError
from prvrlab.uris import SQLITE, file_store

DEFAULT_DB = "mlflow.db"
_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def check_tracking_uri(uri: str | None, key: str) -> None:
    """Refuse a path without a scheme as tracking URI (MLflow would open it as its retired file store):
    ConfigError naming ``key`` (the config key, option or environment variable it came from)."""
    if uri and not _SCHEME.match(uri):
        raise ConfigError(
            f"{key}: '{uri}' is a file path; use sqlite:///<absolute path> for a SQLite file "
            "(or http(s)://host:port for a server)"
        )


def resolve_tracking_uri(uri: str | None = None, cwd: str | Path | None = None, key: str = "tracking.uri") -> str:
    """An absolute tracking URI.

    ``None`` means ``$MLFLOW_TRACKING_URI`` or an SQLite file ``mlflow.db`` in
    ``$PRVRLAB_HOME`` or else the working directory.  Relative SQLite and file paths are made absolute
    so that Ray workers and ``ray job submit`` (which change directory) reach
    the same store.  A path without a scheme is refused (:func:`check_tracking_uri`; ``key`` names
    where ``uri`` came from).
    """
    base = Path(cwd or os.environ.get("PRVRLAB_HOME") or os.getcwd()).resolve()
    if not uri:
        uri, key = os.environ.get("MLFLOW_TRACKING_URI"), "$MLFLOW_TRACKING_URI"
    check_tracking_uri(uri, key)
    uri = uri or f"{SQLITE}{base / DEFAULT_DB}"
    if uri.startswith(SQLITE):
        path = uri[len(SQLITE) :]  # with its query string, if any
        return uri if path.startswith("/") else f"{SQLITE}{(base / path).resolve()}"
    folder = file_store(uri)
    return uri if folder is None else "file://" + str((base / folder).resolve())
