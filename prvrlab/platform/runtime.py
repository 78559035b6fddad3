"""Where a run executes: the project folder, absolute paths, the data, the Ray cluster.

Shared by training, searches and ablations (the driver side only).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Callable

from prvrlab.checks import first_line
from prvrlab.platform.config import ConfigError, ExperimentConfig
from prvrlab.platform.storage import normalize
from prvrlab.platform.tracking.uri import resolve_tracking_uri


def project_home() -> Path:
    """``$PRVRLAB_HOME`` or the current directory: where relative config paths point."""
    return Path(os.environ.get("PRVRLAB_HOME") or Path.cwd())


def project_relative(path: str | Path) -> str:
    """``path`` relative to the working dir, else to ``$PRVRLAB_HOME``, when inside one; else absolute.

    Under ``ray job submit`` the working dir is Ray's temporary copy of the
    submitted project, so a spec read from it is recorded as
    ``search_spaces/x.yaml`` instead of a path under ``runtime_resources/``.
    """
    resolved = Path(path).resolve()
    for base in (Path.cwd(), project_home()):
        try:
            return resolved.relative_to(base.resolve()).as_posix()
        except ValueError:
            continue
    return str(resolved)


def resolve_config_paths(cfg: ExperimentConfig, cwd: Path | None = None) -> ExperimentConfig:
    """A copy whose data root and storage path are absolute (workers chdir); a storage URI
    (``s3://``, ``gs://``) stays a URI, ``file://`` becomes a local path.

    Relative paths resolve against ``cwd``, else ``$PRVRLAB_HOME`` (set it
    under ``ray job submit``, whose driver runs in a temporary copy of the
    working dir), else the current directory.
    """
    base = (cwd or project_home()).resolve()
    data = dataclasses.replace(cfg.data, root=str((base / cfg.data.root).resolve()))
    if cfg.data.visual_feature is not None and Path(cfg.data.visual_feature).is_absolute():
        data = dataclasses.replace(data, visual_feature=str(Path(cfg.data.visual_feature)))
    tracking = dataclasses.replace(
        cfg.tracking,
        storage_path=normalize(cfg.tracking.storage_path, base),
        uri=resolve_tracking_uri(cfg.tracking.uri, base),
    )
    return dataclasses.replace(cfg, data=data, tracking=tracking)


def prepare_data(cfg: ExperimentConfig, *, progress: bool = True):
    """Write the synthetic collection if asked and missing; open and check the data.

    Returns the opened collection (so the caller knows the dimensions).
    Raises DataError naming the file when the data is missing or corrupt,
    a video has no frame or a feature is NaN/inf.
    """
    from prvrlab.data.collection import collection_root, open_collection
    from prvrlab.data.integrity import check_visual_features

    root = collection_root(cfg.data)
    if cfg.data.synthesize and not (root / "TextData").is_dir():
        from prvrlab.data.synth import synthesize

        synthesize(root, preset=cfg.data.synthesize, seed=cfg.data.synth_seed, progress=progress)
    elif cfg.data.synthesize:
        from prvrlab.data.synth import refresh_if_outdated

        if refresh_if_outdated(root) and progress:
            print(f"updated the synthetic collection at {root} to the current generator (same features)")
    collection = open_collection(cfg.data)
    if progress:
        for note in collection.notes:
            print(note)
    check_visual_features(collection.visual, progress=None if progress else False)
    for split in {cfg.data.train_split, cfg.data.val_split}:
        collection.split(split)
    return collection


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def ray_bind_address() -> str:
    """Where a locally started cluster listens: ``$PRVRLAB_RAY_BIND``, loopback by default.

    ``0.0.0.0`` keeps Ray's own choice (every interface, for nodes joining from
    other machines); another address is used as the node's IP.
    """
    return os.environ.get("PRVRLAB_RAY_BIND") or "127.0.0.1"


def _local_node_ip(bind: str) -> str | None:
    """The ``_node_ip_address`` for ``ray.init``; for loopback, make Ray keep it.

    Ray replaces a loopback node IP with the machine's address unless single-node
    mode is on (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, read when ray is imported),
    and its servers bind to every interface unless the node IP is 127.0.0.1.
    """
    from ray._private import ray_constants

    single_node = bind in LOOPBACK  # set both ways: an earlier loopback cluster of this process may have set it
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0" if single_node else "1"
    ray_constants.ENABLE_RAY_CLUSTER = not single_node
    if bind == "0.0.0.0":
        return None
    return "127.0.0.1" if single_node else bind


def ensure_ray(num_cpus: int | None = None, *, echo: Callable[[str], None] | None = None) -> None:
    """Join the cluster at ``$RAY_ADDRESS``, else start a private local one bound to :func:`ray_bind_address`.

    A cluster already running on the machine is joined only through ``$RAY_ADDRESS``;
    without it the command starts its own (``address="local"``), so Ray never
    auto-connects to a cluster found in its temp folder. Raises ConfigError when
    the cluster at ``$RAY_ADDRESS`` cannot be joined. ``echo``: where to say that
    a local cluster is being started (its start takes seconds, in silence otherwise).
    """
    import ray

    if ray.is_initialized():
        return
    with _keep_sigterm_handler():
        _init_ray(num_cpus, echo)


@contextlib.contextmanager
def _keep_sigterm_handler():
    """Put back the caller's SIGTERM handler, which ``ray.init`` replaces with its own.

    Ray's handler exits from inside the signal handler (the process then aborts
    and open MLflow runs stay RUNNING); the CLI's raises KeyboardInterrupt, so
    runs close as KILLED and Ray shuts down at exit.
    """
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if main_thread else None
    try:
        yield
    finally:
        if callable(previous):
            signal.signal(signal.SIGTERM, previous)


def _init_ray(num_cpus: int | None, echo: Callable[[str], None] | None = None) -> None:
    import ray

    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    address = os.environ.get("RAY_ADDRESS", "").strip()
    if address:
        print(f"joining the Ray cluster at {address}", file=sys.stderr, flush=True)
        _check_answers(address)  # ray.init would retry for ever, deaf to Ctrl-C and SIGTERM
        try:
            ray.init(
                address=address,
                log_to_driver=False,
                logging_level="ERROR",
                configure_logging=True,
            )
        except (ConnectionError, ValueError, RuntimeError) as exc:
            raise ConfigError(
                f"RAY_ADDRESS={address}: cannot join the Ray cluster ({first_line(exc)}){_token_hint()}"
            ) from None
    else:
        cpus = num_cpus or os.cpu_count()
        if echo is not None:
            echo(f"starting a local Ray cluster ({cpus} CPUs, on {ray_bind_address()}; RAY_ADDRESS joins a running one)")
        with daemons_in_own_session():
            ray.init(
                address="local",
                num_cpus=cpus,
                include_dashboard=False,
                log_to_driver=False,
                logging_level="ERROR",
                configure_logging=True,
                _node_ip_address=_local_node_ip(ray_bind_address()),
            )


@contextlib.contextmanager
def daemons_in_own_session():
    """Start the local cluster's daemons (GCS, raylet, log monitor, ...) in a session of their own.

    ``ray.init`` starts them in the command's process group, so a signal sent to the whole group
    (``timeout``, ``kill -- -PGID``, a scheduler that signals the job's process group) reached them too:
    they shut down while the command was still stopping its trials, Tune's teardown waited on them and
    the command hung until its 30 s guard, without a resume hint.  In their own session only the
    command gets the signal and stops as on a SIGTERM of its own; they still end with it (Ray's
    kernel fate-sharing kills them when the command's process dies) and at ``ray.shutdown()``, by pid.
    Ctrl-C was never theirs (Ray blocks SIGINT in them).  A signal to every process of a cgroup still
    reaches them (no session escapes it).  Only where Ray uses kernel fate-sharing
    (Linux): elsewhere its reaper process cleans up by process group, which must stay the command's.
    """
    try:
        from ray._private import services, utils
    except ImportError:  # another Ray layout: its daemons stay in the command's group
        yield
        return
    base = getattr(services, "ConsolePopen", None)
    if base is None or os.name != "posix" or not utils.detect_fate_sharing_support():
        yield
        return

    class OwnSession(base):
        def __init__(self, *args, **kwargs):
            kwargs.setdefault("start_new_session", True)
            super().__init__(*args, **kwargs)

    services.ConsolePopen = OwnSession
    try:
        yield
    finally:
        services.ConsolePopen = base


def _check_answers(address: str) -> None:
    silent = unreachable(address)
    if silent:
        raise ConfigError(f"RAY_ADDRESS={address}: cannot join the Ray cluster ({silent})")


def check_joinable() -> None:
    """ConfigError when ``$RAY_ADDRESS`` names a cluster nothing answers at: what :func:`ensure_ray` would
    refuse, checked before a study records anything (its folder, its parent run).  Nothing when Ray is
    already up in this process or no address is set."""
    import ray

    address = os.environ.get("RAY_ADDRESS", "").strip()
    if address and not ray.is_initialized():
        _check_answers(address)


def unreachable(address: str, *, timeout_s: float = 5.0) -> str | None:
    """Why nothing answers at a ``host:port`` (or ``ray://host:port``) Ray address: a TCP connection to it
    fails or times out; None when one opens, or for addresses Ray resolves itself (``auto``, ``local``)."""
    target = address.split("://", 1)[-1].rstrip("/")
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit():
        return None
    host = host.strip("[]") or "127.0.0.1"
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return None
    except OSError as exc:
        why = "no answer within {:g} s".format(timeout_s) if isinstance(exc, TimeoutError) else exc.strerror or str(exc)
        return f"nothing answers at {host}:{port}: {why}"


def _token_hint() -> str:
    """Where this machine holds a Ray token but ``RAY_AUTH_MODE`` is unset: the likely cause of a refused join."""
    token = os.environ.get("RAY_AUTH_TOKEN_PATH") or str(Path.home() / ".ray" / "auth_token")
    if "RAY_AUTH_MODE" in os.environ or not (os.environ.get("RAY_AUTH_TOKEN") or Path(token).is_file()):
        return ""
    return (f"; {token} exists: a cluster started with token authentication refuses this process unless "
            "RAY_AUTH_MODE=token is set, as for the ray commands")


