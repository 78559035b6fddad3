"""New SQLite stores copied from an empty one, instead of MLflow migrating each from scratch.

MLflow builds a new SQLite store by creating its first tables and then running every schema migration
since (~60 with alembic): 4 s on an idle 2-core host, 12 s on a loaded one, for each new ``mlflow.db``
(a user's first command in a folder, each test of the suite).  :func:`seed` instead copies a store
migrated once per MLflow version and kept under ``mlflow-store`` in :func:`prvrlab.cache.cache_root`,
with its default experiment removed: MLflow adds experiment 0 to any store that lacks it when it opens
it, so experiment 0 gets the artifact location and creation time of the store's own first opening, as
in a store MLflow built itself.

The copy is written beside the new store and linked into place (``os.link``), so the store appears
whole and a store another process made meanwhile is never replaced.  The template is only used when
this user owns it and its folder and neither is writable by others, and when it still looks empty
(intact, schema version recorded, no experiment, no run); otherwise, or when anything fails, nothing is
copied and MLflow creates the store as before.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import sqlite3
import stat
import tempfile
import time
from pathlib import Path

from prvrlab.cache import cache_root
from prvrlab.uris import sqlite_file

FOLDER = "mlflow-store"


def template_path() -> Path:
    """Where the empty store of the installed MLflow version is kept."""
    from mlflow.version import VERSION

    return cache_root() / FOLDER / f"mlflow-{VERSION}.db"


def store_path(uri: str) -> Path | None:
    """The file of an ``sqlite:///`` store URI (None for any other URI, and for one with a query string,
    left to MLflow and SQLAlchemy)."""
    return None if "?" in uri else sqlite_file(uri)


def seed(uri: str) -> bool:
    """Create the missing SQLite store of ``uri`` as a copy of the empty template (made first if needed).

    True when this call created it; False when the URI is not SQLite, the store exists (or appeared
    meanwhile), or the template cannot be made or trusted (MLflow then creates the store itself)."""
    target = store_path(uri)
    if target is None or target.exists():
        return False
    try:
        template = _usable_template() or _build_template()
    except Exception:  # noqa: BLE001 - any failure leaves the store to MLflow, which reports its own errors
        return False
    if template is None:
        return False
    try:
        staged = target.parent / f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.seed"
        # the mode MLflow's own file would get (0666 less the umask), not mkstemp's 0600
        fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError:
        return False
    try:
        with os.fdopen(fd, "wb") as out, open(template, "rb") as src:
            shutil.copyfileobj(src, out)
        os.link(staged, target)  # fails when the store exists: never replaced
        return True
    except OSError:
        return False
    finally:
        with contextlib.suppress(OSError):
            os.unlink(staged)


def _trusted(path: Path) -> bool:
    """This user owns ``path`` and nobody else may write it."""
    st = path.stat()
    return st.st_uid == os.getuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _empty_store(path: Path) -> bool:
    """``path`` is an intact SQLite store (``quick_check``) with a recorded schema version and no
    experiment or run."""
    con = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        if con.execute("PRAGMA quick_check").fetchall() != [("ok",)]:
            return False
        revisions = con.execute("SELECT count(*) FROM alembic_version").fetchone()[0]
        experiments = con.execute("SELECT count(*) FROM experiments").fetchone()[0]
        runs = con.execute("SELECT count(*) FROM runs").fetchone()[0]
    except sqlite3.Error:
        return False
    finally:
        con.close()
    return revisions == 1 and experiments == 0 and runs == 0


def _usable_template() -> Path | None:
    """The template, when it exists and can be trusted (:func:`_trusted`, :func:`_empty_store`)."""
    path = template_path()
    try:
        ok = _trusted(path.parent) and _trusted(path) and _empty_store(path)
    except (OSError, sqlite3.Error):
        return None
    return path if ok else None


def _build_template() -> Path | None:
    """Migrate an empty store (MLflow's own creation), drop its default experiment and move it into place;
    the template's path, or None when its folder cannot be trusted."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    path = template_path()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if not _trusted(path.parent):
        return None
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".build-") as tmp:
        built = Path(tmp) / "store.db"
        store = SqlAlchemyStore(f"sqlite:///{built}", Path(tmp).as_uri())
        store.engine.dispose()
        con = sqlite3.connect(built)
        try:
            with con:
                con.execute("DELETE FROM experiments WHERE experiment_id = 0")
        finally:
            con.close()
        os.chmod(built, 0o600)
        os.replace(built, path)  # whole or not at all; two builders leave one of two equal files
    _prune(path)
    return path


def _prune(keep: Path) -> None:
    """Remove the templates of other MLflow versions and builds left by a killed process (over an hour old)."""
    old = time.time() - 3600
    for entry in keep.parent.iterdir():
        with contextlib.suppress(OSError):
            if entry.suffix == ".db" and entry.name.startswith("mlflow-") and entry != keep:
                entry.unlink()
            elif entry.name.startswith(".build-") and entry.stat().st_mtime < old:
                shutil.rmtree(entry)
