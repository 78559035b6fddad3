"""Close this process's open MLflow runs KILLED from a detached process when a stop signal arrives.

``ray job stop`` sends SIGTERM and SIGKILLs the driver ``RAY_JOB_STOP_WAIT_TIME_S``
(3 s) later; schedulers (Slurm, Kubernetes) leave 30 s or so.  On a loaded machine
the driver's own MLflow writes can take longer than that, and a SIGKILLed driver
leaves its runs RUNNING.  So every run this process opens through
:class:`~prvrlab.platform.tracking.store.Tracker` is noted here, and at the first
stop signal :func:`close_in_background` starts a process in its own session that
closes the still-RUNNING ones KILLED with the reason, whatever happens to the
driver.  The driver's own closing (its final word) waits for that process first,
so the two never interleave.  :func:`exit_after` bounds how long a stopped driver
may take to wind down.

A driver killed without a stop signal (SIGKILL, the OOM killer) runs nothing.  A
process that calls :func:`guard_process` (the ``prvrlab`` command does) therefore
starts, with its first run, a *sentinel*: a small process in its own session and
outside the driver's process tree that polls the driver and, once the driver is
gone (or a zombie), closes KILLED the runs the driver's ledger file still lists open, and the
RUNNING runs its driver tags name in the stores the ledger lists (a run created in the instant
before the driver could list it).  The sentinel starts, and the store is listed, before the first
run is created.  The driver rewrites the ledger at each run it opens or closes and removes it at a
normal exit, which ends the sentinel.  The ledger also lists the local studies whose Tune state the
driver has not recorded yet (:func:`watch_study`): a sentinel whose driver died records it
(:mod:`prvrlab.platform.study_state`), which is what a later ``--resume`` checks before Tune unpickles it.
Only killing the sentinel too (a cgroup kill: a container whose main process
is the driver, Slurm's step teardown, a Kubernetes OOM kill) leaves runs
RUNNING; the next ``prvrlab train`` on the same host then closes them
(``drivers.close_dead_runs``).

The sentinel and the stop-signal closer check and close a driver's runs holding that driver's lock
(``drivers.driver_lock``), which ``Tracker.take_over`` holds too while it re-tags a dead driver's run
with the process taking it over: each either finishes first or finds the run driven by another process.

The helper processes start from ``/`` with the working directory kept off
``sys.path`` (nothing in the folder a command was started from is imported),
write nothing to the driver's stdout or stderr (a pipe reading them ends with
the driver), and give up on an unreachable tracking server after a bounded
number of retries.  Their bookkeeping (sentinel, ledger) is best-effort: a
failure there warns once and never fails the run it concerns.  The ledger
(its runs' tracking URIs, which may hold credentials) is readable by its owner
only.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from prvrlab.platform.tracking.drivers import PID_TAG, driver_lock, driver_tags, process_alive, start_time
from prvrlab.uris import file_store, redact_credentials, sqlite_file

_OPEN: dict[str, str] = {}  # run id -> tracking URI, the runs this process opened and has not closed
_STORES: set[tuple[str, str]] = set()  # (tracking URI, experiment id) where this process creates runs
_STUDIES: set[str] = set()  # local study folders whose Tune state the sentinel records if this process dies
_LOCK = threading.RLock()  # re-entrant: a stop signal's handler runs in the main thread, which may hold it
_SPAWN = threading.Lock()  # one sentinel start at a time
_CLOSER: subprocess.Popen | None = None
_STOPPING = threading.Event()
WAIT_S = 30.0  # how long the driver's own closing waits for the detached closer
STOP_GRACE_S = 30.0  # how long a stopped driver may take to wind down before it exits anyway
SENTINEL_ENV = "PRVRLAB_RUN_SENTINEL"  # "0": no sentinel (tests of the next-train fallback)
POLL_S = 1.0  # how often the sentinel looks at its driver
LEDGER_PREFIX = "prvrlab-open-runs-"  # the sentinel's ledger: <tmp>/prvrlab-open-runs-*.json
RECORD_WAIT_S = 90.0  # how long a resume waits for a dead driver's sentinel to record the study's state (its
# writers for up to 30 s, then up to 20 s for the folder to settle, plus hashing it)
LEDGER_FRESH_S = 30.0  # a dead driver's ledger touched this recently: its sentinel is still at work
_GUARD = {"on": False, "ledger": None, "sentinel": None, "warned": False}  # this process's sentinel, once started
HTTP_RETRIES, HTTP_TIMEOUT_S = "2", "10"  # the helpers' MLflow client against an unreachable server (unless set)


def guard_process() -> None:
    """Have a sentinel close this process's open runs if it dies without closing them (module docstring)."""
    _GUARD["on"] = os.environ.get(SENTINEL_ENV, "1") != "0"


def unguard_process() -> None:
    """The end of a guarded command in a process that goes on (tests, notebooks): start no more sentinels,
    and end this one by removing its ledger when nothing is open (runs still open stay watched)."""
    _GUARD["on"] = False
    with _LOCK:
        if _GUARD["ledger"] is not None and not _OPEN:
            _GUARD["ledger"].unlink(missing_ok=True)
            _GUARD["ledger"] = _GUARD["sentinel"] = None


def _absolute(uri: str) -> str:
    """A relative store by its absolute path (the helpers start elsewhere)."""
    from prvrlab.platform.tracking.uri import resolve_tracking_uri

    return resolve_tracking_uri(uri, cwd=os.getcwd())


def opening(uri: str, experiment_id: str) -> None:
    """Before this process creates or reopens a run in ``experiment_id`` of store ``uri``: have its sentinel
    watching already (a guarded process) and the store in its ledger, so a kill in the instant between the
    run turning RUNNING and :func:`opened` listing it is still caught (the sentinel also closes the RUNNING
    runs its driver's tags name there)."""
    if _GUARD["on"]:
        _best_effort(_start_sentinel)
    with _LOCK:
        _STORES.add((_absolute(uri), str(experiment_id)))
        _best_effort(_write_ledger)


def opened(uri: str, run_id: str) -> None:
    """Note a run this process opened (or reopened); :func:`opening` came first."""
    uri = _absolute(uri)
    with _LOCK:
        _OPEN[run_id] = uri
        _best_effort(_write_ledger)


def closed(run_id: str) -> None:
    """Note a run this process closed."""
    with _LOCK:
        _OPEN.pop(run_id, None)
        _best_effort(_write_ledger)


def watch_study(study_dir: str | Path) -> None:
    """Have the sentinel record the Tune state of local study ``study_dir`` if this process dies before it
    records it itself (:func:`unwatch_study`); see :func:`watch`."""
    with _LOCK:
        _STUDIES.add(str(Path(study_dir).resolve()))
        _best_effort(_write_ledger)


def unwatch_study(study_dir: str | Path) -> None:
    """This process recorded the study's state itself."""
    with _LOCK:
        _STUDIES.discard(str(Path(study_dir).resolve()))
        _best_effort(_write_ledger)


def _ledgers() -> list[tuple[Path, dict]]:
    """This user's sentinel ledgers in the temporary folder and what they list (unreadable ones skipped)."""
    found = []
    for path in Path(tempfile.gettempdir()).glob(f"{LEDGER_PREFIX}*.json"):
        try:
            if path.lstat().st_uid != os.getuid() or path.is_symlink():
                continue
            found.append((path, json.loads(path.read_text(encoding="utf-8"))))
        except (OSError, ValueError):
            continue
    return found


def await_study_record(study_dir: str | Path, *, timeout_s: float = RECORD_WAIT_S) -> int | None:
    """Before a resume of local study ``study_dir``: the pid of a live driver running it (whose ledger lists
    it), else None once no sentinel of a dead driver is still recording its state (waited for up to
    ``timeout_s``)."""
    key = str(Path(study_dir).resolve())
    deadline = time.monotonic() + timeout_s
    while True:
        pending = False
        for path, listed in _ledgers():
            pid, start = listed.get("driver", (None, None))
            if key not in listed.get("studies", ()) or pid is None or int(pid) == os.getpid():
                continue
            if process_alive(int(pid), str(start)):
                return int(pid)
            try:  # a sentinel at work touches its ledger; an older one's sentinel died with its driver
                pending = pending or time.time() - path.stat().st_mtime < LEDGER_FRESH_S
            except OSError:  # done: the sentinel removed it
                pass
        if not pending or time.monotonic() > deadline:
            return None
        time.sleep(0.2)


def _best_effort(step) -> None:
    """Run a bookkeeping ``step``; a failure (no process or file can be made) warns once, never fails a run."""
    try:
        step()
    except Exception as exc:  # noqa: BLE001 - the run itself is unaffected
        if not _GUARD["warned"]:
            _GUARD["warned"] = True
            print(f"prvrlab: warning: the run sentinel is not working ({type(exc).__name__}: {exc}); a run left "
                  "open by a killed driver is closed by the next prvrlab train instead", file=sys.stderr)


def _write_ledger() -> None:
    """The open runs to the sentinel's ledger: a private temporary file renamed over it (called holding
    ``_LOCK``)."""
    ledger = _GUARD["ledger"]
    if ledger is None:
        return
    fd, tmp = tempfile.mkstemp(dir=ledger.parent, prefix=ledger.name + ".")  # mode 0600
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump({
                "runs": dict(_OPEN), "stores": sorted(_STORES), "studies": sorted(_STUDIES),
                "driver": [os.getpid(), start_time(os.getpid())],
            }, fh)
        os.replace(tmp, ledger)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def helper_command(*args: str) -> dict:
    """``subprocess.Popen`` arguments for a helper process (``python -m prvrlab.platform.tracking.closer
    ARGS``): started from ``/``, the working directory off ``sys.path`` (``-P`` where Python has it) and
    this prvrlab's folder on ``PYTHONPATH``; MLflow's HTTP retries bounded unless the caller set them."""
    package_root = Path(__file__).resolve().parents[3]  # the folder that holds prvrlab/
    env = dict(os.environ)
    if package_root.name not in ("site-packages", "dist-packages"):  # an installed prvrlab needs no help (and a
        # site folder first on the path would put its packages before the standard library)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(package_root), env.get("PYTHONPATH", "")) if p)
    env.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", HTTP_RETRIES)
    env.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", HTTP_TIMEOUT_S)
    flags = ["-P"] if sys.version_info >= (3, 11) else []
    return {
        "args": [sys.executable, *flags, "-m", "prvrlab.platform.tracking.closer", *args],
        "cwd": "/",
        "env": env,
        "stdin": subprocess.DEVNULL,
        "start_new_session": True,  # outside the driver's process group: a group kill does not reach it
    }


def _start_sentinel() -> None:
    """Start the sentinel unless one is watching.  It forks away from the process started here, so it
    is no descendant of the driver: ``ray job stop`` signals the job's whole process tree, which would
    end it with the driver."""
    with _SPAWN:
        sentinel = _GUARD["sentinel"]
        if sentinel is not None and process_alive(*sentinel):
            return
        with _LOCK:
            if _GUARD["ledger"] is None:
                fd, name = tempfile.mkstemp(prefix=LEDGER_PREFIX, suffix=".json")
                os.close(fd)
                _GUARD["ledger"] = Path(name)
                atexit.register(_release_ledger)
            ledger = _GUARD["ledger"]
        pid = str(os.getpid())
        starter = subprocess.Popen(
            **helper_command("--watch", pid, start_time(os.getpid()), str(ledger)),
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )
        line = starter.stdout.readline()  # the sentinel's pid, from the process that forked it and exits
        starter.stdout.close()
        starter.wait()
        child = int(line) if line.strip().isdigit() else None
        _GUARD["sentinel"] = None if child is None else (child, start_time(child))


def _release_ledger() -> None:
    """At a normal exit with nothing open: remove the ledger, which ends the sentinel."""
    with _LOCK:
        ledger = _GUARD["ledger"]
        if ledger is not None and not _OPEN:
            ledger.unlink(missing_ok=True)


def watch(pid: int, start: str, ledger: Path, *, poll_s: float = POLL_S) -> int:
    """The sentinel: wait until driver ``pid`` is gone, then record the Tune state of the local studies its
    ``ledger`` lists (once the trial processes that wrote them are gone and each has stopped changing:
    :func:`~prvrlab.platform.study_state.record_settled`;
    the ledger stays until then, so a resume waits: :func:`await_study_record`) and close the runs it lists;
    end without doing anything when the ledger disappears (the driver's normal exit)."""
    while process_alive(pid, start):
        if not ledger.exists():
            return 0
        time.sleep(poll_s)
    try:
        listed = json.loads(ledger.read_text(encoding="utf-8"))
        runs, stores = dict(listed["runs"]), [tuple(store) for store in listed["stores"]]
        studies = [str(study) for study in listed.get("studies", ())]
    except (OSError, ValueError, KeyError, TypeError):
        ledger.unlink(missing_ok=True)
        return 0  # removed at the driver's exit, or never written
    driver = driver_tags(pid, start)
    try:
        if studies:
            from prvrlab.platform.study_state import record_settled

            for study in studies:
                try:  # touching the ledger while at work: a resume waits (await_study_record)
                    record_settled(Path(study), driver=driver, heartbeat=lambda: os.utime(ledger))
                except OSError:  # removed meanwhile: nothing to resume
                    pass
    finally:
        ledger.unlink(missing_ok=True)
    for uri, experiment_id in stores:  # runs created but not yet listed when the driver died
        runs.update(dict.fromkeys(_driven_runs(uri, experiment_id, driver), uri))
    if not runs:
        return 0
    reason = f"its driver (pid {pid}) died without closing it"  # killed outright, or exited with it open
    done = close_runs(runs, reason, driver=driver)
    if done:
        print(f"prvrlab: closed {len(done)} run(s) KILLED ({reason})", file=sys.stderr)
    return 0


def open_runs() -> dict[str, str]:
    """This process's open runs (run id -> tracking URI)."""
    with _LOCK:
        return dict(_OPEN)


def close_in_background(reason: str) -> subprocess.Popen | None:
    """Start a detached process that closes this process's open runs KILLED with ``reason``
    (once per process; returns it, or None when nothing is open or it already ran)."""
    global _CLOSER
    runs = open_runs()
    if _CLOSER is not None or not runs:
        return None
    fd, job = tempfile.mkstemp(prefix="prvrlab-close-", suffix=".json")
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        json.dump({"reason": reason, "runs": runs, "driver": driver_tags()}, fh)
    _CLOSER = subprocess.Popen(**helper_command(job), stdout=subprocess.DEVNULL)  # its stderr: the driver's log
    return _CLOSER


def wait_for_closer(timeout: float = WAIT_S) -> None:
    """Let a running detached closer finish before this process writes to its runs again."""
    proc = _CLOSER
    if proc is None or proc.returncode is not None:
        return
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"prvrlab: the run closer (pid {proc.pid}) is still working after {timeout:.0f} s; going on", file=sys.stderr)


def exit_after(seconds: float, code: int) -> threading.Timer:
    """Exit the process with ``code`` if it is still winding down ``seconds`` from now
    (a stopped driver must end even when Ray's shutdown hangs)."""

    def force() -> None:
        wait_for_closer()
        print(f"prvrlab: still stopping {seconds:.0f} s after the stop signal; exiting now", file=sys.stderr, flush=True)
        os._exit(code)

    timer = threading.Timer(seconds, force)
    timer.daemon = True
    timer.start()
    return timer


def stop_requested(reason: str, *, grace_s: float = STOP_GRACE_S, code: int = 143) -> bool:
    """At the first stop signal: close this process's open runs KILLED from a detached process and
    exit with ``code`` if winding down takes over ``grace_s``; whether this call was the first."""
    if _STOPPING.is_set():
        return False
    _STOPPING.set()
    exit_after(grace_s, code)  # first: whatever happens below, the process ends
    try:
        close_in_background(reason)
    except Exception as exc:  # noqa: BLE001 - the driver's own closing still runs
        print(f"prvrlab: could not start the run closer: {type(exc).__name__}: {exc}", file=sys.stderr)
    return True


def _store_exists(uri: str) -> bool:
    """Whether a local store is still there (a vanished one must not be re-created empty)."""
    database = sqlite_file(uri)
    if database is not None:
        return database.is_file()
    folder = file_store(uri)
    if folder is not None:
        return folder.exists()
    if "://" not in uri:
        return Path(uri).exists()
    return True


def close_runs(runs: dict[str, str], reason: str, *, driver: dict[str, str] | None = None) -> list[str]:
    """Close KILLED with ``reason`` those of ``runs`` (id -> URI) that are still RUNNING; their ids.
    ``driver`` (its ``drivers.driver_tags``): only the runs that process still drives (a run another
    driver reopened since, e.g. ``--resume`` right after a kill, is left alone), checked and closed
    holding that driver's lock (``drivers.driver_lock``), which a process taking a run over holds too."""
    if driver is None:
        return _close_runs(runs, reason, driver)
    with driver_lock(driver):
        return _close_runs(runs, reason, driver)


def _close_runs(runs: dict[str, str], reason: str, driver: dict[str, str] | None) -> list[str]:
    """:func:`close_runs` (holding the driver's lock where it has one)."""
    from mlflow.entities import RunTag
    from mlflow.tracking import MlflowClient

    done = []
    by_uri: dict[str, list[str]] = {}
    for run_id, uri in runs.items():
        by_uri.setdefault(uri, []).append(run_id)
    for uri, ids in by_uri.items():
        if not _store_exists(uri):
            continue
        client = MlflowClient(tracking_uri=uri)
        for run_id in ids:
            try:
                run = client.get_run(run_id)
                if run.info.status != "RUNNING" or not _driven_by(run.data.tags, driver):
                    continue
                # the reason first: whoever sees the run KILLED also sees why
                client.log_batch(run_id, tags=[RunTag("prvrlab.status", "killed"), RunTag("prvrlab.stop_reason", reason)])
                client.set_terminated(run_id, status="KILLED")
            except Exception as exc:  # noqa: BLE001 - the other runs are still closed
                print(f"prvrlab: could not close run {run_id}: {type(exc).__name__}: {exc}", file=sys.stderr)
                continue
            done.append(run_id)
    return done


def _driven_runs(uri: str, experiment_id: str, driver: dict[str, str]) -> list[str]:
    """The RUNNING runs of ``experiment_id`` in store ``uri`` tagged with ``driver``'s pid (:func:`close_runs`
    checks the rest of its tags)."""
    from mlflow.tracking import MlflowClient

    if not _store_exists(uri):
        return []
    try:
        found = MlflowClient(tracking_uri=uri).search_runs(
            [experiment_id], filter_string=f"attributes.status = 'RUNNING' and tags.`{PID_TAG}` = '{driver[PID_TAG]}'",
            max_results=1000,
        )
    except Exception as exc:  # noqa: BLE001 - the listed runs are still closed
        print(f"prvrlab: could not search {redact_credentials(uri)} for the driver's runs: {type(exc).__name__}: "
              f"{redact_credentials(str(exc))}", file=sys.stderr)
        return []
    return [run.info.run_id for run in found]


def _driven_by(tags: dict[str, str], driver: dict[str, str] | None) -> bool:
    """Whether a run's driver tags name ``driver`` (None, or a run without them: yes)."""
    if driver is None or not all(key in tags for key in driver):
        return True
    return all(tags[key] == value for key, value in driver.items())


def main(argv: list[str] | None = None) -> int:
    """``python -m prvrlab.platform.tracking.closer JOB.json``: close the job's runs, remove the file;
    ``... --watch PID START LEDGER``: the sentinel (:func:`watch`)."""
    args = list(argv if argv is not None else sys.argv[1:])
    if args[:1] == ["--watch"]:
        pid, start, ledger = args[1:]
        child = os.fork()
        if child:  # the starter: say the sentinel's pid and leave it an orphan of no one's tree
            print(child, flush=True)
            os._exit(0)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)  # the driver's streams are not held open after it ends
        os.dup2(devnull, 2)
        os.close(devnull)
        return watch(int(pid), start, Path(ledger))
    (job,) = args
    path = Path(job)
    spec = json.loads(path.read_text(encoding="utf-8"))
    try:
        done = close_runs(dict(spec["runs"]), str(spec["reason"]), driver=spec.get("driver"))
    except Exception as exc:  # noqa: BLE001 - reported, nothing else can be done here
        print(f"prvrlab: could not close the stopped driver's runs: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        path.unlink(missing_ok=True)
    if done:
        print(f"prvrlab: closed {len(done)} run(s) KILLED ({spec['reason']})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
