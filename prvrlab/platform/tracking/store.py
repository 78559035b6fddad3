"""MLflow tracking: one writer, absolute URIs, runs always closed.

Only the driver process writes to the tracking store.  Runs are created and
closed explicitly through ``MlflowClient`` (no fluent global state), metrics
are sent in batches, and a run always ends FINISHED, FAILED or KILLED.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterable, Iterator

from prvrlab.checks import first_line, is_number
from prvrlab.platform.errors import ConfigError
from prvrlab.platform.failures import carries_interrupt
from prvrlab.platform.tracking import closer, template
from prvrlab.platform.tracking.drivers import driver_alive, driver_lock, driver_tags
from prvrlab.uris import redact_credentials, sqlite_file

PARAM_MAX = 6000  # characters of a param (or tag) value MLflow keeps: a longer one is cut to this
CUT_PARAMS_TAG = "prvrlab.cut_params"  # the keys of the params log_params had to cut, comma-separated
RUN_NAME_LIMIT = 250  # characters: MLflow's runs.name column (VARCHAR(250))
# MLflow 3's experiment kind: its UI shows a "custom_model_development" experiment as model training
# (runs table, metrics) rather than GenAI (traces); the value is one of the UI's ExperimentKind names.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
TRAINING_KIND = "custom_model_development"
STORE_URI_ATTR = "prvrlab_store_uri"  # set on an error a Tracker's client raised: the store's URI (see store_uri)
STOP_TAGS = ("prvrlab.status", "prvrlab.stop_reason")  # how a run ended; a reopened run drops them
SERVER_RETRY_S = 0.5  # between tries of a tracking server that refused the connection (Tracker's wait_s)
STUDY_SERVER_WAIT_S = 60.0  # a study's trial-time Tracker: the server answered when the study began


def artifact_location(uri: str, experiment: str) -> str | None:
    """``mlruns/<experiment>`` beside an SQLite store; MLflow's default is ``./mlruns`` of the working directory."""
    path = sqlite_file(uri)
    if path is None:
        return None
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in experiment)
    return (path.parent / "mlruns" / safe).as_uri()


GIT_COMMIT_ENV = "PRVRLAB_GIT_COMMIT"


def code_checkout() -> Path | None:
    """The git checkout the running ``prvrlab`` package is part of: the folder above the package when git
    tracks ``prvrlab/__init__.py`` there; None for an installed copy (also one in a virtual environment
    inside another repository, whose commit is not this code's)."""
    import prvrlab

    root = Path(prvrlab.__file__).resolve().parent.parent
    try:
        subprocess.run(
            ["git", "ls-files", "--error-unmatch", "prvrlab/__init__.py"],
            cwd=root, capture_output=True, timeout=10, check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return root


def git_commit(cwd: str | Path | None = None) -> str:
    """The commit of the code that runs, suffixed '-dirty' with local changes to tracked files, or 'unknown'.

    ``$PRVRLAB_GIT_COMMIT`` wins when set: the commit captured where the code was
    submitted (``ray job submit`` runs a copy of the working dir without ``.git``).  Without ``cwd``, the
    checkout the package runs from (:func:`code_checkout`), whatever folder the command was started in.
    """
    given = os.environ.get(GIT_COMMIT_ENV, "").strip()
    if given:
        return given
    if cwd is None:
        cwd = code_checkout()
        if cwd is None:
            return "unknown"
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return head + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _clean_value(value: Any) -> str:
    text = redact_credentials(str(value))
    return text if len(text) <= PARAM_MAX else text[: PARAM_MAX - 3] + "..."


@functools.lru_cache(maxsize=1)
def source_tags() -> dict[str, str]:
    """MLflow's own provenance tags for the UI's User and Source columns: this process's user and its
    command line (``prvrlab train configs/x.yaml --set train.lr=1e-3``: the config file and the
    overrides; passwords in URLs masked)."""
    import getpass
    import shlex

    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no login name (a container user without a passwd entry)
        user = "unknown"
    words = [Path(sys.argv[0]).name, *sys.argv[1:]] if sys.argv and sys.argv[0] else []
    return {"mlflow.user": user, "mlflow.source.type": "LOCAL", "mlflow.source.name": _clean_value(shlex.join(words))}


VERSION_TAG = "mlflow.source.git.commit"  # the MLflow UI's Version column


def commit_tags(tags: dict[str, str]) -> dict[str, str]:
    """``mlflow.source.git.commit`` (the UI's Version column) for tags carrying a known ``git_commit``."""
    commit = tags.get("git_commit", "unknown")
    return {} if commit == "unknown" else {VERSION_TAG: commit.removesuffix("-dirty")}


REDACTED_SUFFIXES = (".yaml", ".yml", ".json", ".jsonl", ".txt", ".log", ".md", ".tex", ".csv")
_REDACT_LIMIT = 64 * 2**20  # larger text files go up as they are


def _redacted_bytes(path: Path) -> bytes | None:
    """``path``'s bytes with URL passwords masked, or None where nothing changes (or it is not a text file
    this reads: another suffix, above 64 MiB).  Bytes that are not UTF-8 pass through unchanged."""
    if path.suffix.lower() not in REDACTED_SUFFIXES or path.stat().st_size > _REDACT_LIMIT:
        return None
    try:
        text = path.read_bytes().decode("utf-8", errors="surrogateescape")  # bytes: line endings kept as written
    except OSError:
        return None
    redacted = redact_credentials(text)
    return None if redacted == text else redacted.encode("utf-8", errors="surrogateescape")


def numeric_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """The finite numeric entries of a metrics dict (bools and strings dropped)."""
    out = {}
    for k, v in metrics.items():
        if is_number(v):
            out[k] = float(v)
    return out


@contextmanager
def store_errors(uri: str) -> Iterator[None]:
    """Turn a store that cannot be reached or written (bad scheme, read-only, missing folder)
    into one ConfigError naming the URI."""
    from mlflow.exceptions import MlflowException
    from sqlalchemy.exc import SQLAlchemyError

    try:
        yield
    except (MlflowException, SQLAlchemyError, OSError) as exc:
        raise ConfigError(f"tracking.uri {uri}: cannot use this MLflow store: {first_line(exc)}") from None


def _sqlite_problem(uri: str) -> str | None:
    """Why an SQLite store's file cannot be opened for writing (None: it can, or the URI is not SQLite).

    Checked before MLflow opens it: MLflow retries a file SQLite cannot open for about 100 s."""
    path = sqlite_file(uri)
    if path is None:
        return None
    if path.is_dir():
        return "the path is a folder"
    if path.exists():
        return None if os.access(path, os.R_OK | os.W_OK) else "the file is not readable and writable"
    import tempfile

    # a probe file, not the store: an empty store file would let another process start creating the
    # tables while MLflow does (a poller waiting for the file, a second command on a new store)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)  # as MLflow does for a new store
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}."):
            pass
    except OSError as exc:
        return f"the file cannot be created ({exc.strerror or type(exc).__name__})"
    return None


def _artifact_problem(location: str | None) -> str | None:
    """Why a local artifact location (a path or ``file:`` URI) cannot be written: its nearest existing folder
    is a file or not writable.  None when it can, or for a remote location (a server or bucket decides)."""
    import urllib.parse

    parts = urllib.parse.urlsplit(location or "")
    if not location or parts.scheme not in ("", "file"):
        return None
    path = Path(urllib.parse.unquote(parts.path) if parts.scheme == "file" else location).expanduser()
    while not path.exists():
        if path.parent == path:
            return None
        path = path.parent
    if not path.is_dir():
        return f"{path} is a file, not a folder"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"the folder {path} is not writable"
    return None


def _server_problem(uri: str, timeout_s: float = 10.0, wait_s: float = 0.0) -> str | None:
    """Why a tracking server cannot be reached (None: it can, the URI is not http(s), or a proxy is set for it).

    Checked before MLflow connects: MLflow retries a refused connection for minutes.  ``wait_s``: keep
    trying a server that refuses or drops the connection for that long (a server being restarted)
    before giving up; 0 tries once."""
    import socket
    import urllib.parse
    import urllib.request

    parts = urllib.parse.urlsplit(uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    if urllib.request.getproxies() and not urllib.request.proxy_bypass(parts.hostname):
        return None  # reached through a proxy: MLflow's own request decides
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError as exc:  # a port out of range
        return str(exc)
    deadline = time.monotonic() + max(0.0, wait_s)
    while True:
        try:
            with socket.create_connection((parts.hostname, port), timeout=timeout_s):
                return None
        except OSError as exc:
            if time.monotonic() >= deadline:
                return f"no server answers at {parts.hostname}:{port} ({exc.strerror or exc})"
        time.sleep(min(SERVER_RETRY_S, max(0.0, deadline - time.monotonic())))


def check_server(uri: str, key: str) -> str:
    """``uri``, after checking that a tracking server it names answers: ConfigError naming ``key`` when
    none does (MLflow itself retries a refused connection for minutes before it fails)."""
    problem = _server_problem(uri)
    if problem:
        raise ConfigError(f"{key}: tracking store {uri}: {problem}")
    return uri


def store_uri(exc: BaseException) -> str | None:
    """The URI of the store whose :class:`Tracker` client raised ``exc`` (the innermost one where several
    were involved); None for an error no Tracker's client raised."""
    return getattr(exc, STORE_URI_ATTR, None)


class _StoreClient:
    """An ``MlflowClient`` whose methods mark the errors they raise with the store's URI (:func:`store_uri`),
    so that a store error reaching the command line can name its store without reading stack frames."""

    def __init__(self, client: Any, uri: str) -> None:
        self._client, self._uri = client, uri

    def __getattr__(self, name: str) -> Any:
        if name in ("_client", "_uri") or name.startswith("__"):  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        value = getattr(self._client, name)
        if not callable(value):
            return value

        @functools.wraps(value)
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return value(*args, **kwargs)
            except Exception as exc:
                if store_uri(exc) is None:  # an inner store's mark stays
                    try:
                        setattr(exc, STORE_URI_ATTR, self._uri)
                    except AttributeError:  # an exception type without attributes: left unmarked
                        pass
                raise

        return call


def best_point(final: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """The final round's ``best/sumr`` and ``best/epoch``, and the step to log them at: the best epoch's, where
    its epoch report logged the same values (at step 0 they added a point before epoch 1 to both curves)."""
    best = {k: final[k] for k in ("best/sumr", "best/epoch") if k in final}
    return best, int(best.get("best/epoch", 0))


class Tracker:
    """A thin MLflow writer bound to one tracking URI and experiment.

    Opening it creates or finds the experiment, marked as a model-training
    experiment (``mlflow.experimentKind``; an experiment that has no kind yet
    gets it, one a user set is left alone); a store that cannot be used
    raises ConfigError naming the URI.  ``wait_s``: how long a tracking server that refuses the
    connection is tried again before that error (0: at once, for a command's start, where a wrong
    URI should fail fast; a study's trial-time writer waits out a server restart).
    """

    def __init__(self, uri: str, experiment: str, *, wait_s: float = 0.0) -> None:
        from mlflow.tracking import MlflowClient

        self.uri = uri
        problem = _sqlite_problem(uri) or _server_problem(uri, wait_s=wait_s)
        if problem:
            raise ConfigError(f"tracking.uri {uri}: cannot use this MLflow store: {problem}")
        template.seed(uri)  # a new SQLite store: a copy of an empty one, not MLflow's ~60 migrations
        with store_errors(uri):
            self.client = _StoreClient(MlflowClient(tracking_uri=uri), uri)
            exp = self.client.get_experiment_by_name(experiment)
            if exp is None:
                try:
                    self.experiment_id = self.client.create_experiment(
                        experiment,
                        artifact_location=artifact_location(uri, experiment),
                        tags={EXPERIMENT_KIND_TAG: TRAINING_KIND},
                    )
                except Exception:  # noqa: BLE001 - made meanwhile by another command on the same store?
                    exp = self.client.get_experiment_by_name(experiment)
                    if exp is None:
                        raise
            if exp is not None:
                if exp.lifecycle_stage == "deleted":  # MLflow names the store's state, not the experiment
                    raise ConfigError(
                        f"tracking.experiment {experiment!r}: deleted in the MLflow store {uri} (id {exp.experiment_id}); "
                        f"restore it (MLFLOW_TRACKING_URI={uri} mlflow experiments restore --experiment-id {exp.experiment_id}) or name another"
                    )
                self.experiment_id = exp.experiment_id
                if EXPERIMENT_KIND_TAG not in exp.tags:
                    self.client.set_experiment_tag(self.experiment_id, EXPERIMENT_KIND_TAG, TRAINING_KIND)
            location = exp.artifact_location if exp is not None else artifact_location(uri, experiment)
        problem = _artifact_problem(location)
        if problem:  # found before any work: MLflow itself fails only at a run's first artifact, after training
            raise ConfigError(f"tracking.experiment {experiment!r}: its artifact location {location} cannot be written: {problem}")

    def start_run(self, name: str, *, tags: dict[str, str] | None = None, parent_run_id: str | None = None) -> str:
        """Create a RUNNING run named ``name`` (cut to :data:`RUN_NAME_LIMIT` characters) and return its id."""
        if len(name) > RUN_NAME_LIMIT:  # MLflow's runs.name column; PostgreSQL and strict MySQL refuse more
            name = name[: RUN_NAME_LIMIT - 1] + "…"
        all_tags = {**driver_tags(), **source_tags(), **commit_tags(tags or {}), **(tags or {})}  # driver: closers close only its own
        all_tags = {k: _clean_value(v) for k, v in all_tags.items()}
        if parent_run_id:
            all_tags["mlflow.parentRunId"] = parent_run_id
        closer.opening(self.uri, self.experiment_id)
        run = self.client.create_run(self.experiment_id, run_name=name, tags=all_tags)
        closer.opened(self.uri, run.info.run_id)
        return run.info.run_id

    def take_over(self, run_id: str):
        """Make this process the driver of ``run_id``; returns the run as it was (``mlflow.entities.Run``).

        When its recorded driver on this host is dead, this waits for that driver's sentinel or stop
        closer to be done with its runs (``drivers.driver_lock``) and reads the run again: the closers
        check the driver tags under the same lock, so they never close a run taken over here, and what
        is returned is what they left."""
        from mlflow.entities import RunTag

        before = self.client.get_run(run_id)
        mine = [RunTag(k, v) for k, v in driver_tags().items()]
        if driver_alive(before.data.tags) is not False:
            self.client.log_batch(run_id, tags=mine)
            return before
        with driver_lock(before.data.tags):
            before = self.client.get_run(run_id)
            self.client.log_batch(run_id, tags=mine)
        return before

    def close_abandoned(self, run_id: str, tags: dict[str, str], *, retag_killed: bool = False) -> bool:
        """Take over a run its driver left (:meth:`take_over`) and close it KILLED with ``tags`` (the stop
        reason); one a dead driver's closer closed meanwhile is left as it is, or only given ``tags`` when
        ``retag_killed``.  Whether it was closed here."""
        status = self.take_over(run_id).info.status
        if status == "RUNNING" or (retag_killed and status == "KILLED"):
            self.set_tags(run_id, tags)
        if status != "RUNNING":
            return False
        self.end_run(run_id, "KILLED")
        return True

    def reopen_run(self, run_id: str):
        """Set a closed run RUNNING again (a resumed study), without the tags that described its stop;
        returns the run as it was (``mlflow.entities.Run``)."""
        before = self.take_over(run_id)  # first: a dead driver's closers then leave it alone
        closer.opening(self.uri, before.info.experiment_id)
        self.client.update_run(run_id, status="RUNNING")
        for stale in STOP_TAGS:
            if stale in before.data.tags:
                self.client.delete_tag(run_id, stale)
        closer.opened(self.uri, run_id)
        return before

    @staticmethod
    def param_text(value: Any) -> str:
        """A param's value as :meth:`log_params` stores it."""
        return _clean_value(value)

    def log_params(self, run_id: str, params: dict[str, Any]) -> None:
        """Log ``params``; a value longer than MLflow keeps (:data:`PARAM_MAX`) is cut, and the run's
        ``CUT_PARAMS_TAG`` names every key cut (with this call's)."""
        from mlflow.entities import Param

        items = [Param(k, _clean_value(v)) for k, v in sorted(params.items())]
        for i in range(0, len(items), 100):
            self.client.log_batch(run_id, params=items[i : i + 100])
        cut = [p.key for p in items if len(p.value) == PARAM_MAX and len(redact_credentials(str(params[p.key]))) > PARAM_MAX]
        if cut:
            earlier = self.client.get_run(run_id).data.tags.get(CUT_PARAMS_TAG, "")
            self.set_tags(run_id, {CUT_PARAMS_TAG: ",".join(sorted({*filter(None, earlier.split(",")), *cut}))})

    def log_metrics(self, run_id: str, metrics: dict[str, Any], step: int | None = None) -> None:
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        items = [Metric(k, v, stamp, step or 0) for k, v in sorted(numeric_metrics(metrics).items())]
        for i in range(0, len(items), 500):
            self.client.log_batch(run_id, metrics=items[i : i + 500])

    def set_tags(self, run_id: str, tags: dict[str, Any]) -> None:
        from mlflow.entities import RunTag

        closer.wait_for_closer()  # a stopped driver's final word comes after the detached closer's
        self.client.log_batch(run_id, tags=[RunTag(k, _clean_value(v)) for k, v in tags.items()])

    def log_dataset(self, run_id: str, dataset, context: str = "training") -> None:
        """Record an MLflow dataset (``mlflow.data.Dataset``) as an input of the run, as ``mlflow.log_input`` does."""
        from mlflow.entities import DatasetInput, InputTag
        from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

        tags = [InputTag(key=MLFLOW_DATASET_CONTEXT, value=context)]
        self.client.log_inputs(run_id, datasets=[DatasetInput(dataset=dataset._to_mlflow_entity(), tags=tags)])

    def log_artifacts(self, run_id: str, paths: Iterable[Path], artifact_path: str | None = None) -> None:
        """Upload files (a folder: every file under it, at its relative place); a text file naming a URL with
        its password (a config's ``tracking.uri``, a spec, a traceback) goes up as a copy with the password
        masked (:func:`redact_credentials`), and the local file keeps what the user gave."""
        for path in paths:
            if path.is_dir():
                for file in sorted(f for f in path.rglob("*") if f.is_file()):
                    rel = file.parent.relative_to(path).as_posix()
                    inner = "/".join(p for p in (artifact_path, "" if rel == "." else rel) if p) or None
                    self._log_file(run_id, file, inner)
            elif path.exists():
                self._log_file(run_id, path, artifact_path)

    def _log_file(self, run_id: str, path: Path, artifact_path: str | None) -> None:
        redacted = _redacted_bytes(path)
        if redacted is None:
            self.client.log_artifact(run_id, str(path), artifact_path)
            return
        with tempfile.TemporaryDirectory(prefix="prvrlab-redacted-") as tmp:
            copy = Path(tmp) / path.name
            copy.write_bytes(redacted)
            self.client.log_artifact(run_id, str(copy), artifact_path)

    def end_run(self, run_id: str, status: str) -> None:
        """Close a run as FINISHED, FAILED or KILLED."""
        if status not in ("FINISHED", "FAILED", "KILLED"):
            raise ValueError(f"bad run status {status!r}")
        closer.wait_for_closer()
        self.client.set_terminated(run_id, status=status)
        closer.closed(run_id)

    def end_stopped(
        self, run_id: str, exc: BaseException, *, failed_tags: dict[str, Any], killed_tags: dict[str, Any] | None = None
    ) -> str | None:
        """End a run that ``exc`` stopped while it was being set up: KILLED, tagged ``killed_tags``, when
        ``exc`` carries an interrupt (the run is reopened on ``--resume``), else FAILED, tagged
        ``failed_tags``.  ``exc`` stays the error to report, so a store that fails again only warns on
        stderr.  Returns the status the run ended with, or None where it could not be ended."""
        killed = carries_interrupt(exc)
        status, tags = ("KILLED", killed_tags or {}) if killed else ("FAILED", failed_tags)
        if tags:
            try:
                self.set_tags(run_id, tags)
            except Exception as again:  # noqa: BLE001 - ending the run matters more than its tags
                print(f"prvrlab: warning: could not tag run {run_id} with how it ended: {redact_credentials(str(again))}", file=sys.stderr)
        try:
            self.end_run(run_id, status)
        except Exception as again:  # noqa: BLE001 - as above
            print(f"prvrlab: warning: could not end run {run_id}: {redact_credentials(str(again))}", file=sys.stderr)
            return None
        return status
