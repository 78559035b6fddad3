"""Where a training worker reports to: Ray Train, or the calling process.

The worker function talks to a ``Session`` only, so the same code runs inside
a Ray Train worker group (``RaySession``) and in-process without any Ray
cluster (``LocalSession``, used by unit tests and for debugging).
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

def process_group_backend(use_gpu: bool) -> str:
    """The ``torch.distributed`` backend of a run's ranks.

    On GPUs NCCL alone would refuse the CPU tensors the loop reduces (epoch
    means, histograms) and would carry pickled objects (rank lists, the
    evaluation's embeddings) through GPU memory; so CUDA tensors go through
    NCCL and everything on the CPU through gloo.  CPU ranks: gloo.
    """
    return "cpu:gloo,cuda:nccl" if use_gpu else "gloo"


class Session:
    """What a worker needs from its runtime."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @contextmanager
    def checkpoint_dir(self) -> Iterator[Path | None]:
        """The folder of the latest checkpoint to resume from, or None."""
        yield None

    def report(self, metrics: dict[str, Any], checkpoint_dir: Path | None = None) -> None:
        """Report one round of metrics (all ranks, same number of times)."""
        raise NotImplementedError

    def open_collection(self, data_cfg: Any) -> Any:
        """The data collection ``data_cfg`` (a DataConfig) describes, opened for this attempt."""
        from prvrlab.data.collection import open_collection

        return open_collection(data_cfg)

    def progress_sink(self, run_dir: Path) -> Callable[[dict[str, Any]], None]:
        """Where rank 0 sends its in-epoch progress: ``<run_dir>/progress.json``, which the driver polls."""
        from prvrlab.platform.train.live import PROGRESS_FILE, FileProgress

        return FileProgress(Path(run_dir) / PROGRESS_FILE)


class LocalSession(Session):
    """In-process session: checkpoints copied to ``root``, reports (and progress) to callbacks."""

    def __init__(
        self,
        root: str | Path,
        on_report: Callable[[dict[str, Any]], None] | None = None,
        on_progress: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.on_report = on_report
        self.on_progress = on_progress
        self.reports: list[dict[str, Any]] = []

    @property
    def _latest(self) -> Path:
        return self.root / "checkpoint_latest"

    @contextmanager
    def checkpoint_dir(self) -> Iterator[Path | None]:
        yield self._latest if self._latest.is_dir() else None

    def report(self, metrics: dict[str, Any], checkpoint_dir: Path | None = None) -> None:
        if checkpoint_dir is not None:
            tmp = self.root / "checkpoint_tmp"
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(checkpoint_dir, tmp)
            shutil.rmtree(self._latest, ignore_errors=True)
            tmp.rename(self._latest)
        self.reports.append(dict(metrics))
        if self.on_report is not None:
            self.on_report(dict(metrics))

    def progress_sink(self, run_dir: Path) -> Callable[[dict[str, Any]], None]:
        """The ``on_progress`` callback (every step), else the progress file."""
        return self.on_progress or super().progress_sink(run_dir)


class RaySession(Session):
    """Session backed by ``ray.train`` inside a TorchTrainer worker."""

    def __init__(self) -> None:
        import ray.train

        ctx = ray.train.get_context()
        self.rank = ctx.get_world_rank()
        self.world_size = ctx.get_world_size()
        self.local_rank = ctx.get_local_rank()

    @contextmanager
    def checkpoint_dir(self) -> Iterator[Path | None]:
        import ray.train

        with _local_folder(ray.train.get_checkpoint()) as path:
            yield path

    def report(self, metrics: dict[str, Any], checkpoint_dir: Path | None = None) -> None:
        import ray.train

        ckpt = ray.train.Checkpoint.from_directory(str(checkpoint_dir)) if checkpoint_dir else None
        ray.train.report(metrics, checkpoint=ckpt)


class TuneSession(Session):
    """Session of a one-worker trial trained inside its Ray Tune trial actor.

    Reports go to ``ray.tune.report`` (after ``enrich``, which may fill in
    the searched metric), checkpoints are Tune's, so a retried trial resumes
    from its last epoch.
    """

    def __init__(self, enrich: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> None:
        self.enrich = enrich or (lambda metrics: metrics)

    @contextmanager
    def checkpoint_dir(self) -> Iterator[Path | None]:
        import ray.tune

        with _local_folder(ray.tune.get_checkpoint()) as path:
            yield path

    def report(self, metrics: dict[str, Any], checkpoint_dir: Path | None = None) -> None:
        import ray.tune

        ckpt = ray.tune.Checkpoint.from_directory(str(checkpoint_dir)) if checkpoint_dir else None
        ray.tune.report(self.enrich(dict(metrics)), checkpoint=ckpt)


SCRATCH_PREFIX = "prvrlab-ckpt-"
STALE_SCRATCH_S = 6 * 3600  # a dead process's scratch folder older than this is removed


@contextmanager
def _local_folder(checkpoint: Any) -> Iterator[Path | None]:
    """A Ray Train or Tune checkpoint's local folder while the block runs (None: no checkpoint)."""
    if checkpoint is None:
        yield None
        return
    with checkpoint.as_directory() as path:
        yield Path(path)


@contextmanager
def scratch_dir() -> Iterator[Path]:
    """A temporary folder removed afterwards, named ``prvrlab-ckpt-<pid>-*``.  A process killed inside
    the block (a trial stopped while it reports its checkpoint) cannot remove it, so the first call in
    each process removes such folders of processes that have ended (:func:`remove_stale_scratch`)."""
    path = Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-"))
    _sweep_once(str(path.parent))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@functools.lru_cache(maxsize=None)
def _sweep_once(parent: str) -> None:
    remove_stale_scratch(Path(parent))


def remove_stale_scratch(parent: Path, *, min_age_s: float = STALE_SCRATCH_S) -> list[Path]:
    """Remove the ``prvrlab-ckpt-<pid>-*`` folders in ``parent`` whose process no longer exists on this
    host and that were last changed over ``min_age_s`` ago (a folder shared with another host's or pid
    namespace's live process is that old only if the process stopped using it); returns them."""
    removed = []
    now = time.time()
    for path in parent.glob(f"{SCRATCH_PREFIX}*-*"):
        pid = path.name[len(SCRATCH_PREFIX):].split("-", 1)[0]
        try:
            if not pid.isdigit() or _alive(int(pid)) or now - path.stat().st_mtime < min_age_s:
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        pass
    return True
