"""Local MLflow store URIs: the file or folder an ``sqlite:///`` or ``file:`` URI names (tracking and reports),
and URL passwords masked wherever a URI is shown or uploaded.

One parser for the store checks, the run closer, the schema template and the reports (which import nothing from the platform).  It imports nothing but
the standard library: the detached run closer loads it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

SQLITE = "sqlite:///"


def sqlite_file(uri: str) -> Path | None:
    """The database file of ``sqlite:///<path>[?<query>]`` (the query, SQLAlchemy's connection
    arguments such as ``timeout``, is not part of the path); None for any other URI."""
    if not uri.startswith(SQLITE):
        return None
    return Path(uri[len(SQLITE) :].split("?", 1)[0])


def file_store(uri: str) -> Path | None:
    """The folder of ``file:<path>`` or ``file://<path>``; None for any other URI."""
    if not uri.startswith("file:"):
        return None
    return Path(uri[len("file:") :].removeprefix("//"))


_URL_PASSWORD = re.compile(r"(?P<head>[A-Za-z][A-Za-z0-9+.-]*://[^/@:\s]*):[^/\s]*@")  # to the authority's last @


def redact_credentials(text: str) -> str:
    """``scheme://user:password@host`` -> ``scheme://user:***@host`` wherever it occurs in ``text``: a
    tracking URI or object-store path given with its password is not shown to every reader of the store."""
    return _URL_PASSWORD.sub(r"\g<head>:***@", text)


def redact_nested(value: Any) -> Any:
    """``value`` (a config dict, list or string, nested) with :func:`redact_credentials` applied to every string."""
    if isinstance(value, str):
        return redact_credentials(value)
    if isinstance(value, dict):
        return {k: redact_nested(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact_nested(v) for v in value)
    return value
