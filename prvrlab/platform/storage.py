"""Where runs and studies keep their files: a local folder or an object store, by URI.

``tracking.storage_path`` is a local path, ``file://``, ``s3://`` or ``gs://``
(``gcs://`` is read as ``gs://``). Object stores go through ``pyarrow.fs``, as
in Ray Train: credentials and endpoints come only from the usual environment
variables (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``
/ ``AWS_ENDPOINT_URL_S3``, ``GOOGLE_APPLICATION_CREDENTIALS``), never from a
config: a URI with a query (``?endpoint_override=``) is refused.

Ray Train and Tune get the URI itself as their ``storage_path`` (checkpoints,
Tune state). prvrlab's own files (``best_model.pt``, per-query ranks,
``config.yaml``, ``study.json``, outcomes) are written to a local staging
folder that mirrors the URI (``$PRVRLAB_STAGING/<scheme>/<bucket>/<path>``,
default ``<tmp>/prvrlab-staging-<uid>``, mode 0700) and pushed by whoever wrote
them: rank 0 after each new best model and after the final ranks, the driver
at the end of a run and every few seconds during a study. Drivers pull before
``--resume`` and before logging artifacts. For a local path the staging folder
is the folder itself and pushes and pulls do nothing.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import stat
import tempfile
import threading
import urllib.parse
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from prvrlab.checks import first_line
from prvrlab.files import leaves_folder, replace_atomically, special_kind
from prvrlab.platform.errors import ConfigError

KEY = "tracking.storage_path"
REMOTE_SCHEMES = {"s3": "s3", "gs": "gs", "gcs": "gs"}
NEVER_SYNCED = ("progress.json", "*.tmp", "*.part", "local_session")  # rewritten every second / half-written / scratch
WORKER_FILES = ("best_model.pt", "ranks_*.parquet")  # pushed by rank 0 itself
_URI = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$")
_MALFORMED = re.compile(r"^(s3|gs|gcs|file):(?!//)", re.IGNORECASE)  # s3:/bucket, gs:bucket: a URI missing a slash


def normalize(value: str | Path, base: Path | None = None, key: str = KEY) -> str:
    """A canonical storage location: an absolute local path, or ``s3://bucket/path`` / ``gs://bucket/path``.

    Raises ConfigError naming ``key`` for an unknown scheme, a missing bucket or
    a query string. Relative local paths resolve against ``base`` (default: as given).
    """
    text = str(value)
    match = _URI.match(text)
    if match is None and _MALFORMED.match(text):
        raise ConfigError(f"{key}: {text!r} is not a URI; write {text.split(':', 1)[0].lower()}://bucket/path")
    if match is None:
        return str(((base or Path()) / text).resolve()) if base is not None else text
    scheme, rest = match.group(1).lower(), match.group(2)
    if scheme == "file":
        parsed = urllib.parse.urlparse(text)
        if parsed.netloc not in ("", "localhost"):
            raise ConfigError(f"{key}: {text!r} names host {parsed.netloc!r}; file:// URIs are local (file:///abs/path)")
        return str(Path(urllib.parse.unquote(parsed.path)).resolve())
    if scheme not in REMOTE_SCHEMES:
        raise ConfigError(f"{key}: unknown scheme '{scheme}://' in {text!r}; use a local path, file://, s3:// or gs://")
    if "?" in rest or "#" in rest:
        raise ConfigError(
            f"{key}: {text!r} carries a query; endpoints and credentials come from the environment "
            "(AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, GOOGLE_APPLICATION_CREDENTIALS), not from configs"
        )
    bucket, _, path = rest.partition("/")
    if not bucket:
        raise ConfigError(f"{key}: {text!r} names no bucket")
    path = path.strip("/")
    if any(part in (".", "..") for part in (bucket, *path.split("/"))):  # the local staging copy mirrors the path
        raise ConfigError(f"{key}: {text!r} has a '.' or '..' segment; name the object-store path without them")
    return f"{REMOTE_SCHEMES[scheme]}://{bucket}" + (f"/{path}" if path else "")


def is_remote(value: str | Path) -> bool:
    """Whether ``value`` names an object store (``s3://``, ``gs://``, ``gcs://``)."""
    match = _URI.match(str(value))
    return match is not None and match.group(1).lower() in REMOTE_SCHEMES


def staging_root() -> Path:
    """``$PRVRLAB_STAGING`` or ``<tmp>/prvrlab-staging-<uid>``: created 0700, refused when not ours."""
    root = Path(os.environ.get("PRVRLAB_STAGING") or Path(tempfile.gettempdir()) / f"prvrlab-staging-{os.getuid()}")
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = root.lstat()
    if stat.S_ISLNK(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ConfigError(f"staging folder {root} is not a private folder of the current user; set PRVRLAB_STAGING")
    return root


def _excluded(rel: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatch(part, pat) for part in rel.split("/") for pat in patterns)


def _filesystem(uri: str):
    """(pyarrow filesystem, path inside it) of a remote ``uri``."""
    import pyarrow.fs as pafs

    return pafs.FileSystem.from_uri(uri)


@dataclass(frozen=True)
class Location:
    """A folder by canonical URI (see :func:`normalize`), with its local staging path."""

    uri: str

    @property
    def remote(self) -> bool:
        return is_remote(self.uri)

    @property
    def local(self) -> Path:
        """The folder itself (local storage) or its staging mirror (object store)."""
        if not self.remote:
            return Path(self.uri)
        scheme, rest = self.uri.split("://", 1)
        return staging_root() / scheme / rest

    @property
    def name(self) -> str:
        return self.uri.rstrip("/").rsplit("/", 1)[-1]

    def child(self, *parts: str) -> "Location":
        if not self.remote:
            return Location(str(Path(self.uri).joinpath(*parts)))
        return Location("/".join([self.uri.rstrip("/"), *(p.strip("/") for p in parts)]))

    def subdirs(self) -> list[str]:
        """Names of the folders directly inside (sorted; [] when it does not exist)."""
        if not self.remote:
            path = Path(self.uri)
            return sorted(d.name for d in path.iterdir() if d.is_dir()) if path.is_dir() else []
        import pyarrow.fs as pafs

        fs, path = _filesystem(self.uri)
        infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
        return sorted(i.base_name for i in infos if i.type == pafs.FileType.Directory and not leaves_folder(i.base_name))

    def has(self, rel: str) -> bool:
        """Whether ``rel`` (a file or folder below) exists."""
        if not self.remote:
            return (Path(self.uri) / rel).exists()
        import pyarrow.fs as pafs

        fs, path = _filesystem(self.child(rel).uri)
        return fs.get_file_info(path).type != pafs.FileType.NotFound

    def pull(self, exclude: tuple[str, ...] = (), include: tuple[str, ...] = ("*",), fresh: bool = False,
             into: Path | None = None) -> int:
        """Download the remote files below into :attr:`local` (or the folder ``into``); the number downloaded.

        ``exclude``: file or folder name patterns left out; ``include``: file name
        patterns taken; ``fresh``: empty the local copy first (nothing stale kept).
        """
        if not self.remote:
            return 0
        import pyarrow.fs as pafs

        root = self.local if into is None else Path(into)
        if fresh:
            shutil.rmtree(root, ignore_errors=True)
        fs, path = _filesystem(self.uri)
        infos = fs.get_file_info(pafs.FileSelector(path, recursive=True, allow_not_found=True))
        count = 0
        for info in infos:
            rel = info.path[len(path):].lstrip("/")
            if info.type != pafs.FileType.File or _excluded(rel, exclude + NEVER_SYNCED):
                continue
            if leaves_folder(rel):
                raise ConfigError(
                    f"{self.uri}: refusing to download the object {info.path!r}: its key leaves the folder "
                    "('..', '.' or empty segments); remove it from the bucket"
                )
            if not any(fnmatch.fnmatch(info.base_name, pat) for pat in include):
                continue
            target = root / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            replace_atomically(target, lambda tmp, source=info.path: _download(fs, source, tmp))
            count += 1
        return count

    def remove(self, rel: str) -> None:
        """Delete the file ``rel`` below, locally and (object store) remotely; missing is fine."""
        (self.local / rel).unlink(missing_ok=True)
        if self.remote:
            fs, path = _filesystem(self.child(rel).uri)
            try:
                fs.delete_file(path)
            except FileNotFoundError:
                pass


class Mirror:
    """Pushes a local folder's changed files to a remote URI (no-op for local storage).

    ``exclude``: file or folder name patterns never pushed (``NEVER_SYNCED`` always);
    ``last``: file name patterns pushed after the others (an index that names other files
    goes up after them, as it is written after them locally). A file is pushed again when
    its size or modification time changed.
    """

    def __init__(self, local: str | Path, uri: str | None, exclude: tuple[str, ...] = (), last: tuple[str, ...] = ()) -> None:
        self.local = Path(local)
        self.uri = uri if uri and is_remote(uri) else None
        self.exclude = tuple(exclude) + NEVER_SYNCED
        self.last = tuple(last)
        self._sent: dict[str, tuple[int, int]] = {}
        self._lock = threading.Lock()

    def push(self) -> int:
        """Upload what changed since the last push; the number of files uploaded."""
        if self.uri is None or not self.local.is_dir():
            return 0
        with self._lock:
            fs, root = _filesystem(self.uri)
            count = 0
            paths = sorted(self.local.rglob("*"), key=lambda p: (any(fnmatch.fnmatch(p.name, pat) for pat in self.last), p))
            for path in paths:
                rel = path.relative_to(self.local).as_posix()
                if not path.is_file() or path.is_symlink() or _excluded(rel, self.exclude):
                    continue
                info = path.stat()
                key = (info.st_size, info.st_mtime_ns)
                if self._sent.get(rel) == key:
                    continue
                with path.open("rb") as src, fs.open_output_stream(f"{root}/{rel}") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
                self._sent[rel] = key
                count += 1
            return count

    def every(self, seconds: float) -> "_Periodic":
        """A context manager pushing every ``seconds`` in a thread, and once more at exit."""
        return _Periodic(self, seconds)


class _Periodic:
    def __init__(self, mirror: Mirror, seconds: float) -> None:
        self.mirror, self.seconds = mirror, seconds
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _run(self) -> None:
        while not self._stop.wait(self.seconds):
            try:
                self.mirror.push()
            except OSError:  # a transient store error: the next round (or the exit push) tries again
                pass

    def __enter__(self) -> Mirror:
        self.mirror.push()
        if self.mirror.uri is not None:
            self._thread = threading.Thread(target=self._run, name="prvrlab-storage-sync", daemon=True)
            self._thread.start()
        return self.mirror

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.mirror.push()


def check(value: str, key: str = KEY, *, create: bool = True) -> None:
    """Check a folder (``tracking.storage_path``, or the option ``key``) is usable: create it (``create``;
    else its nearest existing folder is probed) and write (then delete) a probe file.

    Raises ConfigError naming the key, e.g. for a path under a regular file, a bucket that does not exist or
    an endpoint that cannot be reached.
    """
    if not is_remote(value):
        path = Path(value)
        try:
            if create:
                path.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=next(p for p in (path, *path.parents) if p.exists())):
                pass
        except OSError as exc:
            blocker = next((p for p in (path, *path.parents) if p.exists() and not p.is_dir()), None)
            why = f"{blocker} is a file" if blocker else exc.strerror or exc
            raise ConfigError(f"{key} {path}: not a writable folder ({why})") from None
        return
    probe = Location(value).child(f".prvrlab-probe-{uuid.uuid4().hex[:12]}")
    try:
        fs, path = _filesystem(probe.uri)
        with fs.open_output_stream(path) as out:
            out.write(b"")
        fs.delete_file(path)
    except Exception as exc:  # pyarrow raises OSError or ArrowInvalid/ArrowException subclasses
        raise ConfigError(f"{key} {value}: not writable ({first_line(exc)})") from None


def check_file(value: str, key: str) -> None:
    """Check a file can be written at ``value`` (a path, ``s3://`` or ``gs://``) before the work that makes it:
    not a folder, and its folder usable (:func:`check`, creating nothing). ConfigError naming ``key``."""
    uri = normalize(value, key=key)
    if is_remote(uri):
        folder = uri.rpartition("/")[0]
        if folder.endswith(":/"):
            raise ConfigError(f"{key}: {value!r} names a bucket, not a file")
    elif Path(uri).is_dir():
        raise ConfigError(f"{key} {value}: is a folder; give a file name in it")
    elif (kind := special_kind(uri)) is not None:  # writing replaces the path: a device or FIFO would become a file
        raise ConfigError(f"{key} {value}: is {kind}; give a regular file's name")
    else:
        folder = str(Path(uri).parent)
    check(folder, key, create=False)


def fetch(uri: str, key: str = KEY) -> Path:
    """A local copy of the remote file ``uri`` (in the staging folder), or ``uri`` itself when local.

    A remote file that is missing or cannot be read: ConfigError naming ``key``.
    """
    if not is_remote(uri):
        return Path(uri)
    location = Location(normalize(uri, key=key))
    target = location.local
    target.parent.mkdir(parents=True, exist_ok=True)

    try:
        fs, path = _filesystem(location.uri)
        return replace_atomically(target, lambda tmp: _download(fs, path, tmp))
    except Exception as exc:  # OSError, FileNotFoundError, pyarrow's ArrowException
        raise ConfigError(f"{key} {uri}: cannot be read ({first_line(exc)})") from None


def _download(fs, path: str, local: Path) -> None:
    """Copy the object store's file ``path`` (``fs``: its pyarrow filesystem) into the local file ``local``."""
    with fs.open_input_stream(path) as src, local.open("wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)


def write_file(value: str, key: str, write: Callable[[Path], object]) -> Path:
    """Write the file ``value`` (a path, ``s3://`` or ``gs://``; checked beforehand with :func:`check_file`):
    ``write(tmp)`` fills a temporary file that replaces the local file once whole
    (:func:`~prvrlab.files.replace_atomically`; for a remote file, its copy in the staging folder, then
    uploaded).  Returns the local file."""
    uri = normalize(value, key=key)
    target = Location(uri).local if is_remote(uri) else Path(uri)
    target.parent.mkdir(parents=True, exist_ok=True)
    replace_atomically(target, write)
    put(target, uri)
    return target


def put(local: str | Path, uri: str) -> None:
    """Upload the local file ``local`` to the remote file ``uri`` (nothing for a local ``uri``)."""
    if not is_remote(uri):
        return
    fs, path = _filesystem(normalize(uri))
    with Path(local).open("rb") as src, fs.open_output_stream(path) as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
