"""DDP worker pools that live across a study's trials (``resources.reuse_workers: true``, or ``auto``, the
default, for CPU ranks on a one-node cluster: :func:`~prvrlab.platform.search.study.pooled_ranks`).

A multi-worker trial normally fits its own Ray Train ``TorchTrainer``: a
controller, a worker group and a process group started and torn down per
trial (~20 s here).  With ``reuse_workers`` each Tune trial actor (one per
concurrent trial slot, kept between trials by ``reuse_actors``) owns a
:class:`WorkerPool`: one long-lived Ray actor per DDP rank, placed in the
trial's placement-group bundles, with a gloo (CPU) or NCCL (GPU) process
group set up once.  A trial sends ``train_worker(loop_config, session)`` to
the pool's ranks; rank 0's reports come back through its actor and reach Tune
from the trial actor (checkpoints included, so a retried trial resumes).  DDP
is built per trial on the existing process group; the group stays up.
A one-worker trial's pool has one rank (no DDP, the same results as training
inside the trial actor); its trial actor's bundle is empty, so the rank keeps
the trial's whole CPUs (:func:`pool_resources`).

Spares: on a one-node cluster the driver starts one group of rank actors per
slot when a CPU study begins (:func:`start_spares`, no CPUs reserved: the
trial's placement group holds them), so their processes start and import
torch while Tune starts its trial actors; each trial actor adopts the first
group it claims instead of starting its own.  Spares are the driver's
actors, so an adopted rank follows its trial actor itself (it exits when
that actor has died) and the driver kills every spare at the study's end.

Failures: any error or stop of a trial while it trains (a rank's actor died,
an exception in the loop, Tune stopping the trial) kills the pool, so the next
trial of the slot builds a fresh one; Tune retries a dead-actor trial from
its checkpoint as with a TorchTrainer.  The pool's actors are owned by the
trial actor, so they end with it (search end, interrupt, trial-actor loss).
A trial whose placement group the cluster cannot hold stops the study after
``resources.placement_timeout_s`` with none running (:mod:`.placement`).

Packing (``resources.pack: k``): k trials train at once on 1/k of a worker
group's CPU share each (``spec.slots`` = concurrency x k Tune slots, each
with its own pool), so one trial's set-up, evaluation and reporting overlap
another's epochs.  Each packed trial keeps its own rank processes and process
group: torch's default RNG (dropout, initialisation), ``set_num_threads`` and
the loop's default-group collectives are per process, so k configurations as
threads of one rank actor (with ``dist.new_group`` per trial) could not give
the unpacked results without threading a generator and a group through every
component; k configurations in one pass would break Tune's one trial per
config (its own MLflow child run, checkpoints, retries).  CPU ranks only:
NCCL refuses two ranks of one group on one GPU.

Choices where Ray offers no ready-made piece: one rank per actor sees only its
own GPU (``local_rank`` 0), so ranks must not share a GPU (NCCL refuses it);
the resume checkpoint is read from the study folder, which multi-node studies
must put on shared storage anyway.

Rendezvous (:meth:`PoolWorker.rendezvous`): when rank 0's node IP is loopback (the local cluster's
default, :func:`~prvrlab.platform.runtime.ray_bind_address`: every rank is on this machine) the ranks
meet through a ``file://`` FileStore in a fresh private (0700) temp folder, so no TCP port is opened
for it, and gloo listens on the loopback interface (``GLOO_SOCKET_IFNAME``, unless set).  The trial
actor removes the folder once every rank has joined a gloo group (gloo reads the store only while its
ranks connect), after a failed join, or, for a group with NCCL (which uses the store again at a GPU
rank's first collective), when the pool is shut down (:meth:`WorkerPool.shutdown`).
Elsewhere (a multi-node cluster) they meet at ``tcp://<rank 0's node IP>:<port>``: torch's TCPStore
server then listens on every interface of rank 0's node for the pool's life (a torch limitation: it
takes no bind address), unauthenticated, as the TorchTrainer path's does.
"""

from __future__ import annotations

import json
import math
import os
import queue
import shutil
import socket
import sys
import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from prvrlab.platform import rendezvous
from prvrlab.platform.rendezvous import is_loopback, loopback_interface, new_file_store, remove_store, store_folder
from prvrlab.platform.train.session import Session, process_group_backend

if TYPE_CHECKING:
    from prvrlab.platform.config import ExperimentConfig

FOLLOW_S = 2.0  # how often an adopted spare checks that its trial actor is alive
POLL_S = 0.5  # how often the trial actor looks for rank 0's reports and for failed ranks
PG_TIMEOUT = timedelta(minutes=30)  # collective timeout, Ray Train's default
STORE_PREFIX = rendezvous.STORE_PREFIX  # a loopback pool's FileStore folder name starts so
STAGE_DIR = "pool_reports"  # next to a trial's files: rank 0's checkpoints until Tune persists them
POOL_LOG = "pool.jsonl"  # next to a trial's files: one line per attempt (pool name, rank pids, build time, ...)
# What a rank imports before its first trial, while its trial actor still validates the trial's config:
# torch, the process group, DDP's torch._dynamo (~2.4 s here), the loop and every registered component.
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "prvrlab.platform.train.loop",
    "prvrlab.platform.train.optim",
    "prvrlab.models.factory",
    "prvrlab.data.dataset",
    "prvrlab.evaluation.retrieval",
)


def preload() -> None:
    """Import :data:`PRELOAD` and load every registry (a failure is left for the real import to raise)."""
    import importlib

    try:
        for name in PRELOAD:
            importlib.import_module(name)
        from prvrlab.registry import BACKBONES, LOSSES, PLUGINS

        for registry in (BACKBONES, LOSSES, PLUGINS):
            registry.names()
    except Exception:  # noqa: BLE001 - the same import fails again, with its traceback, where it is needed
        pass


def pool_resources(workers: int, cpus: float, gpus: float, trial_actor_cpu: float):
    """The trial's placement group: the trial actor's bundle, then one bundle per rank.  With
    ``trial_actor_cpu`` 0 the trial actor's bundle is empty: Tune then places the actor in the first
    rank's bundle without resources, so a one-rank pool keeps whole CPUs (Ray's shares above one are
    whole numbers: 0.01 for the actor would leave the rank one CPU of two)."""
    from ray import tune

    rank = {"CPU": cpus, **({"GPU": gpus} if gpus > 0 else {})}
    head = {"CPU": trial_actor_cpu} if trial_actor_cpu > 0 else {}
    return tune.PlacementGroupFactory([head] + [dict(rank) for _ in range(workers)])


class PoolSession(Session):
    """One rank's session inside a pool actor: resumes from ``resume``, rank 0 posts reports to ``outbox``,
    collections come from ``collections`` (the pool actor's, kept across trials)."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        resume: str | None,
        outbox: queue.Queue,
        stage: Path,
        collections: Callable[[Any], Any] | None = None,
    ) -> None:
        self.rank, self.world_size, self.local_rank = rank, world_size, 0
        self.resume, self.outbox, self.stage = resume, outbox, stage
        self.collections = collections
        self.sent = 0

    def open_collection(self, data_cfg: Any) -> Any:
        return self.collections(data_cfg) if self.collections is not None else super().open_collection(data_cfg)

    @contextmanager
    def checkpoint_dir(self) -> Iterator[Path | None]:
        yield Path(self.resume) if self.resume else None

    def report(self, metrics: dict[str, Any], checkpoint_dir: Path | None = None) -> None:
        """Rank 0: copy the checkpoint out of the loop's scratch folder, post (metrics, its folder)."""
        if self.rank != 0:
            return
        staged = None
        if checkpoint_dir is not None:
            staged = self.stage / f"{self.sent:05d}"
            shutil.rmtree(staged, ignore_errors=True)
            shutil.copytree(checkpoint_dir, staged)
        self.sent += 1
        self.outbox.put(("report", dict(metrics), str(staged) if staged else None))


class PoolWorker:
    """One DDP rank that outlives trials (a threaded Ray actor: ``run`` and ``next_report`` overlap)."""

    def __init__(self, *, omp_threads: int | None = None) -> None:
        if omp_threads is not None:  # a spare (no CPUs reserved: Ray set 1): what a rank of its trial's CPUs gets
            os.environ["OMP_NUM_THREADS"] = str(omp_threads)  # read when torch loads, below; it slows training if low
        self.outbox: queue.Queue = queue.Queue()
        self.rank, self.world_size = 0, 1
        self.opened: tuple[Any, Any] | None = None  # (DataConfig, its Collection): the last trial's data
        self.store: str | None = None  # rank 0 of a loopback pool: its FileStore's folder (rendezvous)
        self.claimed = threading.Lock()  # a spare goes to one trial actor
        # imports start now, in the background; join and run wait for them (one importing thread at a time)
        self.preloading = threading.Thread(target=preload, name="prvrlab-preload", daemon=True)
        self.preloading.start()

    def claim(self) -> str | None:
        """Hand this spare to the first trial actor that asks: this rank's Ray node id; None to any later one."""
        if not self.claimed.acquire(blocking=False):
            return None
        import ray

        return ray.get_runtime_context().get_node_id()

    def follow(self, owner_pid: int) -> None:
        """Exit once the process ``owner_pid`` (the trial actor that adopted this spare, on this node) has
        ended, as an actor it had started would: the driver owns a spare, so Ray would keep it and its
        trial's loop running.  A pid, not the actor's handle: loading a handle imports the trial actor's
        class, Ray Tune with pandas and pyarrow (~1.5 CPU-s per rank, while its first trial waits).
        A pid this process cannot see (the caller, alive, in another pid namespace) is not followed:
        the driver still kills every spare at the study's end."""
        start = _started(owner_pid)
        if start != "":
            threading.Thread(
                target=_follow, args=(owner_pid, start, self.drop_store), name="prvrlab-follow", daemon=True
            ).start()

    def collection(self, data_cfg: Any) -> Any:
        """The collection of ``data_cfg``, opened again only when it differs from the last trial's
        (a search's trials mostly share one data section; opening indexes and checks every file)."""
        from prvrlab.data.collection import open_collection

        if self.opened is None or self.opened[0] != data_cfg:  # configs are never mutated after validation
            self.opened = None  # the old one is released before the new one is opened
            self.opened = (data_cfg, open_collection(data_cfg))
        return self.opened[1]

    def resolve(self, raw: dict[str, Any]) -> tuple[Any, str | None]:
        """``(validated ExperimentConfig, None)``, or ``(None, the ConfigError's message)``."""
        self.preloading.join()
        from prvrlab.platform.config import ConfigError, validate

        try:
            return validate(raw), None
        except ConfigError as exc:
            return None, str(exc)

    def rendezvous(self) -> str:
        """Rank 0: where the pool's ranks meet (``init_method``).  On a node bound to loopback (every rank
        is on this machine): a FileStore in a fresh private (0700) folder, no TCP listener; the pool's
        owner removes the folder (:meth:`WorkerPool.ready`, :meth:`WorkerPool.shutdown`).  Elsewhere: ``tcp://`` at this node's IP
        and a free port, where torch's TCPStore server listens on every interface (it takes no bind
        address), for the process group's life."""
        import ray

        host = ray.util.get_node_ip_address()
        if is_loopback(host):
            self.store, init_method = new_file_store()
            return init_method
        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return f"tcp://{host}:{port}"

    def join(self, *, rank: int, world_size: int, init_method: str, backend: str) -> int:
        """Join the pool's process group (blocks until every rank joined); returns the pid."""
        self.preloading.join()
        import torch.distributed as dist

        folder = store_folder(init_method)
        if folder is not None:  # a loopback rendezvous: every rank on this machine, gloo on the loopback interface
            if not os.path.isdir(folder):  # not rank 0's machine: fail now rather than wait out PG_TIMEOUT
                raise RuntimeError(f"the pool's rendezvous folder {folder} is not on this rank's machine")
            if not os.environ.get("GLOO_SOCKET_IFNAME"):
                interface = loopback_interface()
                if interface is not None:
                    os.environ["GLOO_SOCKET_IFNAME"] = interface  # read when the gloo group is created, below
        self.rank, self.world_size = rank, world_size
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, timeout=PG_TIMEOUT)
        return os.getpid()

    def drop_store(self) -> None:
        """Remove the rendezvous folder this rank made, if any (its trial actor ended without removing it)."""
        remove_store(self.store)
        self.store = None

    def run(self, loop_config: dict[str, Any], resume: str | None, stage: str) -> None:
        """One trial on this rank; rank 0 posts ``("done",)`` when the loop returns or raises."""
        self.preloading.join()
        from prvrlab.platform.train.loop import train_worker

        session = PoolSession(
            rank=self.rank, world_size=self.world_size, resume=resume, outbox=self.outbox, stage=Path(stage),
            collections=self.collection,
        )
        try:
            train_worker(loop_config, session)
        finally:
            if self.rank == 0:
                self.outbox.put(("done",))

    def next_report(self, timeout: float) -> tuple | None:
        """Rank 0's next posted item, or None after ``timeout`` seconds."""
        try:
            return self.outbox.get(timeout=timeout)
        except queue.Empty:
            return None


def _started(pid: int) -> str | None:
    """When process ``pid`` started (its /proc start time, so that a reused pid is told apart); "" when it
    has ended (or is a zombie), None where there is no /proc (its liveness alone is checked)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return ""
    except PermissionError:  # another user's: alive
        pass
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return "" if Path("/proc/self/stat").exists() else None
    except OSError:
        return None
    return "" if fields[0] in ("Z", "X") else fields[19]  # state; starttime (field 22 of stat)


def _follow(pid: int, start: str | None, cleanup: Callable[[], None] | None = None) -> None:
    """Once ``pid`` has ended: ``cleanup()`` (rank 0: the rendezvous folder its trial actor would have
    removed), then this actor asks Ray to kill it (an intended exit; a process that just exits is
    reported on the driver's console as a worker that died of a system error), and exits by itself
    if it is still alive a while later."""
    while _started(pid) == start:
        time.sleep(FOLLOW_S)
    try:
        if cleanup is not None:
            cleanup()
        import ray

        ray.kill(ray.get_runtime_context().current_actor, no_restart=True)
        time.sleep(5 * FOLLOW_S)
    finally:
        os._exit(1)


RANK_OPTIONS = {"max_concurrency": 2}  # a rank's Ray actor options besides its resources (run and next_report overlap)


class WorkerPool:
    """``workers`` :class:`PoolWorker` actors joined in one process group, in the caller's placement group.

    The actors start (and preload) at construction, or are ``actors`` (adopted spares);
    :meth:`ready` joins them in the process group."""

    def __init__(self, *, workers: int, cpus: float, gpus: float, name: str, actors: list[Any] | None = None) -> None:
        import ray
        from ray.util import get_current_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.start = time.perf_counter()
        self.key, self.name, self.trials = (workers, cpus, gpus), name, 0
        self.pids: list[int] = []
        self.init_method = ""  # where the ranks met (ready)
        self.store: str | None = None  # a loopback rendezvous's FileStore folder while it is kept (ready, shutdown)
        self.build_s = 0.0
        self.adopted = actors is not None
        if actors is not None:
            self.actors = list(actors)
            return
        group = get_current_placement_group()
        first = group.bundle_count - workers if group is not None else 0  # 1: bundle 0 is the trial actor's; 0: it has none
        remote = ray.remote(PoolWorker)
        self.actors = []
        for rank in range(workers):
            options: dict[str, Any] = {"num_cpus": cpus, "num_gpus": gpus, "name": f"{name}-rank{rank}", **RANK_OPTIONS}
            if group is not None:
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=first + rank)
            self.actors.append(remote.options(**options).remote())

    def ready(self) -> None:
        """Join every rank in the process group (once); raises when that fails (the caller discards the pool)."""
        import ray

        if self.pids:
            return
        workers, _, gpus = self.key
        self.init_method = ray.get(self.actors[0].rendezvous.remote())
        self.store = store_folder(self.init_method)
        backend = process_group_backend(gpus > 0)
        joins = [
            a.join.remote(rank=r, world_size=workers, init_method=self.init_method, backend=backend)
            for r, a in enumerate(self.actors)
        ]
        try:
            self.pids = ray.get(joins)
        except BaseException:
            self.remove_store()  # a new folder for the next try: FileStore must not find this group's file
            raise
        if backend == "gloo":  # connected: gloo is done with the store (NCCL reads it at its first collective)
            self.remove_store()  # nothing is left behind when the ranks end with their trial actor (Ray kills both)
        self.build_s = time.perf_counter() - self.start  # actors started + process group joined

    def train(self, loop_config: dict[str, Any], resume: str | None, stage: Path, report: Callable[[dict[str, Any], str | None], None]) -> None:
        """Run one trial on every rank; ``report(metrics, checkpoint folder or None)`` for each of rank 0's
        rounds, in order, from this thread.  Raises what a rank raised (a dead actor included)."""
        import ray

        stage.mkdir(parents=True, exist_ok=True)
        runs = [a.run.remote(loop_config, resume, str(stage)) for a in self.actors]
        while True:
            item = ray.get(self.actors[0].next_report.remote(POLL_S))
            if item is None:
                done, _ = ray.wait(runs, num_returns=len(runs), timeout=0)
                ray.get(done)  # a rank that failed (or died) ends the trial now, not at rank 0's next collective
                continue
            if item[0] == "done":
                ray.get(runs)
                return
            _, metrics, staged = item
            report(metrics, staged)
            if staged:
                shutil.rmtree(staged, ignore_errors=True)

    def shutdown(self) -> None:
        """Kill every rank's actor (the process group goes with them) and remove the rendezvous folder."""
        import ray

        try:
            for actor in self.actors:
                ray.kill(actor, no_restart=True)
            self.actors = []
        finally:
            self.remove_store()

    def remove_store(self) -> None:
        """Remove the loopback rendezvous's FileStore folder (rank 0 made it on this machine), if any."""
        remove_store(self.store)
        self.store = None


_POOL: WorkerPool | None = None  # the pool of this trial actor (one per concurrent trial slot)
_BUILT = 0  # pools built in this process (names stay unique while a killed pool's names are released)
_SPARES: list[list[Any]] = []  # the driver's spare rank groups offered to this trial actor (start_spares)


def start_spares(groups: int, workers: int, cpus: float) -> list[list[Any]]:
    """``groups`` groups of ``workers`` CPU ranks of ``cpus`` each, started now without a CPU reservation (an
    adopting trial's placement group holds their CPUs): only for a one-node cluster, where that is the same
    node.  Ray gives an actor without CPUs OMP_NUM_THREADS=1; each spare sets what Ray gives an actor of
    ``cpus`` (their floor, at least 1) before it imports torch: with 1, a one-rank pool's 2-thread training
    took 15-20% longer here (docs/performance.md, session 45)."""
    import ray

    remote = ray.remote(PoolWorker).options(num_cpus=0, **RANK_OPTIONS)
    threads = max(1, math.floor(cpus))
    return [[remote.remote(omp_threads=threads) for _ in range(workers)] for _ in range(groups)]


def stop_spares(groups: list[list[Any]]) -> None:
    """Kill every spare, adopted or not (the study has ended)."""
    import ray

    for actor in (a for group in groups for a in group):
        try:
            ray.kill(actor, no_restart=True)
        except Exception:  # noqa: BLE001 - already gone
            pass


def offer(groups: list[list[Any]]) -> None:
    """The driver's spares this trial actor may adopt when it needs a pool (once per process)."""
    global _SPARES
    if groups and not _SPARES:
        _SPARES = [list(group) for group in groups]


def _adopt(workers: int) -> list[Any] | None:
    """The first spare group of ``workers`` ranks this trial actor claims, on the node its placement group
    reserved for them (a group elsewhere is killed: nothing holds its CPUs there); None when there is none."""
    import ray
    from ray.exceptions import RayActorError
    from ray.util import get_current_placement_group, placement_group_table

    group = get_current_placement_group()
    nodes = set(placement_group_table(group)["bundles_to_node_id"].values()) if group is not None else None
    while _SPARES:
        actors = _SPARES.pop(0)
        try:
            node = ray.get(actors[0].claim.remote()) if len(actors) == workers else None
        except RayActorError:
            continue
        if node is None:  # another trial actor's
            continue
        if nodes is not None and nodes != {node}:
            stop_spares([actors])
            continue
        ray.get([a.follow.remote(os.getpid()) for a in actors])
        return actors
    return None


def _acquire(workers: int, cpus: float, gpus: float, *, ready: bool = True) -> WorkerPool:
    """This slot's pool, started on first use or after the last one was discarded; joined unless ``ready`` is False."""
    global _POOL, _BUILT
    if _POOL is not None and _POOL.key != (workers, cpus, gpus):
        discard()
    if _POOL is None:
        import ray

        _BUILT += 1
        slot = ray.get_runtime_context().get_actor_id() or "driver"
        actors = _adopt(workers) if _SPARES and gpus == 0 else None
        _POOL = WorkerPool(workers=workers, cpus=cpus, gpus=gpus, name=f"prvrlab-pool-{slot[:12]}-{_BUILT}", actors=actors)
    if ready:
        try:
            _POOL.ready()
        except BaseException:
            discard()
            raise
    return _POOL


def prestart(workers: int, cpus: float, gpus: float) -> None:
    """Start this slot's pool without waiting: its ranks boot and import while the trial actor
    validates the trial's config (the first trial of a slot would wait for both in turn)."""
    _acquire(workers, cpus, gpus, ready=False)


def validate_on_pool(raw: dict[str, Any]) -> ExperimentConfig:
    """``validate(raw)`` on this slot's pool's rank 0, where torch and the components are loaded anyway,
    so that the trial actor never imports them; raises ConfigError as ``validate`` does."""
    import ray

    from prvrlab.platform.config import ConfigError

    if _POOL is None:
        raise RuntimeError("validate_on_pool needs a started pool (prestart)")
    try:
        cfg, error = ray.get(_POOL.actors[0].resolve.remote(raw))
    except BaseException:
        discard()
        raise
    if error is not None:
        raise ConfigError(error)
    return cfg


def discard() -> None:
    """Kill this slot's pool (after a failed or stopped trial); the next trial builds a new one."""
    global _POOL
    pool, _POOL = _POOL, None
    if pool is not None:
        pool.shutdown()


def train_on_pool(
    loop_config: dict[str, Any], *, workers: int, cpus: float, gpus: float, enrich: Callable[[dict[str, Any]], dict[str, Any]]
) -> None:
    """Train one trial (inside its Tune trial actor) on this slot's pool; reports go to ``ray.tune.report``
    after ``enrich``; the pool is discarded unless the trial ran to its end."""
    from ray import tune

    pool = _acquire(workers, cpus, gpus)
    trial_dir = Path(loop_config["run_dir"]).parent
    stage = trial_dir / STAGE_DIR
    record = {
        "pool": pool.name,
        "pids": pool.pids,
        "trials_before": pool.trials,
        "build_s": 0.0 if pool.trials else pool.build_s,
        "adopted": pool.adopted,  # the driver's spares (build_s: from their adoption)
        "cpus": cpus,  # each rank's CPUs (its torch threads: their ceiling)
        "actor_torch": "torch" in sys.modules,  # the trial actor loaded torch (it needs not: its ranks validate)
    }
    with (trial_dir / POOL_LOG).open("a") as fh:
        fh.write(json.dumps(record) + "\n")
    pool.trials += 1

    def report(metrics: dict[str, Any], staged: str | None) -> None:
        checkpoint = tune.Checkpoint.from_directory(staged) if staged else None
        tune.report(enrich(metrics), checkpoint=checkpoint)

    ended = False
    try:
        checkpoint = tune.get_checkpoint()
        if checkpoint is None:
            pool.train(loop_config, None, stage, report)
        else:
            with checkpoint.as_directory() as resume:
                pool.train(loop_config, str(resume), stage, report)
        ended = True
    finally:
        if not ended:  # a failed, dead or stopped rank leaves the group unusable
            discard()
        shutil.rmtree(stage, ignore_errors=True)
