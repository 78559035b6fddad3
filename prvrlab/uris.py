"""Local MLflow store URIs: the file or folder an ``sqlite:///`` or ``file:`` URI names (tracking and reports).

One parser for the store checks, the run closer, the schema template and the reports (which import nothing from the platform).  It imports nothing but
the standard library: the detached run closer loads it.
"""

from __future__ import annotations

from pathlib import Path

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
