"""Read a finished (or partial) search / ablation back from MLflow alone.

A study is one parent run (tag ``prvrlab.kind`` = ``search`` | ``ablation``)
with one child run per trial (``mlflow.parentRunId``).  Nothing here needs Ray
or the study folder: the tracking store is the only source, so a report can
be written on any machine that reaches it.

Two ways to name a study: the parent run id (or a trial's run id), or an
experiment name (its latest parent run, or the latest one of a given study
name; the CLI reads both from a spec file).  An unknown id / experiment / study
raises :class:`ReportError` naming it (the CLI turns it into exit code 2).
The tracking URI is always given, already resolved: nothing here reads a
config or a spec.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import shutil
import tempfile
import weakref
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import yaml

from prvrlab.checks import first_line
from prvrlab.evaluation.metrics import METRIC_KEYS
from prvrlab.files import leaves_folder
from prvrlab.registry import did_you_mean
from prvrlab.reports.errors import ReportError
from prvrlab.uris import sqlite_file

STUDY_KINDS = ("search", "ablation")
OK_STATUSES = ("finished", "early_stopped", "time_limited")  # prvrlab.status of a trial with usable metrics
TIME_LIMITED = "time_limited"  # a trial budget.time_limit_s stopped: its run ended KILLED, its reports count
TRAIN_PREFIX = "train/"  # per-epoch training metrics: train/<loss term>, train/<component>.<name>
NOT_SPLITS = ("best",)  # final/best/{sumr,epoch}: the best epoch's validation SumR, logged with final/<split>/*
CELL_HASH_TAG = "prvrlab.cell_hash."  # + cell, on an ablation's parent: that cell's config hash in its latest submission
RANKS_COLUMNS = ("query_id", "rank")  # what a ranks artifact must have (save_ranks also writes video_id, ratio)
DISTRIBUTIONS_DIR = "distributions"  # run artifacts <component>.<name>.json of binned series (docs/extending.md)


@dataclass
class TrialRun:
    """One child run: tags, params (flattened config), latest metrics and status."""

    run_id: str
    name: str
    run_status: str  # MLflow: FINISHED | FAILED | KILLED | RUNNING
    start_time: int
    tags: dict[str, str]
    params: dict[str, str]
    metrics: dict[str, float]

    @property
    def status(self) -> str:
        """prvrlab.status: finished | early_stopped | nonfinite | error | killed | resumed | running (a resumed
        trial whose run is open again is running)."""
        tag = self.tags.get("prvrlab.status")
        if self.run_status == "RUNNING" and tag in (None, "resumed"):
            return "running"
        return tag or self.run_status.lower()

    @property
    def ok(self) -> bool:
        """Metrics are usable (the trial ran to the end or was stopped early by the scheduler)."""
        return self.status in OK_STATUSES and (self.run_status == "FINISHED" or self.status == TIME_LIMITED)

    @property
    def failed(self) -> bool:
        return self.status in ("nonfinite", "error") or self.run_status == "FAILED"

    @property
    def variant(self) -> str | None:
        return self.tags.get("prvrlab.variant")

    @property
    def seed(self) -> int | None:
        value = self.tags.get("prvrlab.seed", self.params.get("train.seed"))
        return None if value is None else int(value)

    @property
    def trial_id(self) -> str:
        return self.tags.get("prvrlab.trial_id", self.run_id)

    @property
    def components(self) -> tuple[str, ...]:
        text = self.tags.get("components", "")
        return tuple(sorted(t for t in text.split(",") if t))

    @property
    def error(self) -> str:
        return self.tags.get("error", self.tags.get("prvrlab.stop_reason", ""))

    def published(self, split: str) -> tuple[str, dict[str, float]] | None:
        """``(source, {metric: value})`` of the run config's ``published`` result on ``split``, if any and
        reported on the collection the run read (:meth:`published_elsewhere`)."""
        if self.params.get("published.split") != split or self.published_elsewhere(split):
            return None
        values = {}
        for key in METRIC_KEYS:
            text = self.params.get(f"published.{key}")
            if text not in (None, "None"):
                values[key] = float(text)
        return (self.params.get("published.source", ""), values) if values else None

    def published_elsewhere(self, split: str) -> str | None:
        """A note when the config's published result on ``split`` was reported on another collection than the
        run's ``data.collection`` (then it is not compared); None otherwise."""
        theirs, ours = self.params.get("published.collection"), self.params.get("data.collection")
        if self.params.get("published.split") != split or theirs in (None, "None") or ours is None or theirs == ours:
            return None
        return (f"The published result ({self.params.get('published.source', '')}, {split}) is for collection "
                f"'{theirs}'; this run read '{ours}': not compared.")

    def final(self, split: str, metric: str) -> float | None:
        """``final/<split>/<metric>`` when logged and finite."""
        value = self.metrics.get(f"final/{split}/{metric}")
        return value if value is not None and math.isfinite(value) else None

    @property
    def component_metrics(self) -> dict[str, float]:
        """``<component>.<name>`` -> last-epoch value of every finite ``train/<component>.<name>`` metric
        (what losses and plug-ins report; plain loss terms ``train/<term>`` have no dot)."""
        out = {}
        for key, value in self.metrics.items():
            name = key[len(TRAIN_PREFIX) :]
            if key.startswith(TRAIN_PREFIX) and "." in name and math.isfinite(value):
                out[name] = value
        return out


def evaluated_splits(runs: Sequence[TrialRun]) -> list[str]:
    """The splits (``eval.final_splits``) ``runs`` logged final metrics on, ``final/<split>/sumr``:
    ``final/best/sumr``, the best validation SumR the final round also logs, is no split."""
    names = {k.split("/")[1] for r in runs for k in r.metrics if k.count("/") == 2 and k.startswith("final/")
             and k.endswith("/sumr")}
    return sorted(names - set(NOT_SPLITS))


def check_split(runs: Sequence[TrialRun], split: str) -> None:
    """A ReportError when none of ``runs`` logged final metrics on ``split``, naming the splits they did
    and the closest one."""
    logged = evaluated_splits(runs)
    if split not in logged:
        raise ReportError(f"split '{split}': the runs logged no final {split} metrics (final/{split}/sumr); "
                          f"splits they logged: {', '.join(logged) or 'none'}{did_you_mean(split, logged)}")


@dataclass
class Study:
    """A parent run and its child runs, read from one tracking store.

    Artifacts it downloads (ranks, distributions, configs) go to one temporary folder, removed by
    :meth:`close`, on leaving a ``with`` block, or when the study is garbage-collected (at the latest
    at interpreter exit)."""

    tracking_uri: str
    parent_id: str
    kind: str  # search | ablation
    name: str
    experiment_id: str
    tags: dict[str, str]
    params: dict[str, str]
    spec: dict[str, Any]  # the spec file as logged (artifact spec/*.yaml), {} when absent
    runs: list[TrialRun]  # sorted by (variant, seed, trial id, run id)
    client: Any = field(repr=False, default=None)
    _cache: Path | None = field(repr=False, default=None)
    _remove_cache: Any = field(repr=False, default=None, compare=False)

    @property
    def metric(self) -> str:
        return self.params.get("spec.metric", self.spec.get("metric", "val/sumr"))

    @property
    def mode(self) -> str:
        return self.params.get("spec.mode", self.spec.get("mode", "max"))

    def of_latest_configs(self) -> tuple["Study", int]:
        """This study with only the runs of the cell configs its latest submission ran (an ablation parent's
        ``prvrlab.cell_hash.<cell>`` tags: a resubmission with another base config, ``--set`` or default keeps
        the same parent), and how many runs of other configs were left out; as it is without such tags (a
        search, or an ablation recorded before they were written).  A cell the spec no longer has keeps its runs."""
        wanted = {k[len(CELL_HASH_TAG):]: v for k, v in self.tags.items() if k.startswith(CELL_HASH_TAG)}
        if not wanted:
            return self, 0
        keep = [r for r in self.runs if wanted.get(r.tags.get("prvrlab.cell", ""), r.tags.get("config_hash")) == r.tags.get("config_hash")]
        return replace(self, runs=keep), len(self.runs) - len(keep)

    def cache_dir(self) -> Path:
        """The study's download folder, made on first use."""
        if self._cache is None:
            self._cache = Path(tempfile.mkdtemp(prefix="prvrlab-report-"))
            self._remove_cache = weakref.finalize(self, shutil.rmtree, str(self._cache), True)
        return self._cache

    def close(self) -> None:
        """Remove the download folder (a later download makes a new one)."""
        if self._remove_cache is not None:
            self._remove_cache()
        self._cache = self._remove_cache = None

    def __enter__(self) -> Study:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def ranks(self, run: TrialRun, split: str) -> dict[str, Any] | None:
        """Per-query ranks of ``run`` on ``split`` (:func:`run_ranks`), cached for the study."""
        return run_ranks(self.client, run.run_id, split, self.cache_dir())

    def distributions(self, run: TrialRun) -> dict[str, dict[str, Any]]:
        """``<component>.<name>`` -> the record of every ``distributions/*.json`` artifact of ``run``
        (binned series a component logged, ``prvrlab.models.component.histogram_record``); {} when none."""
        try:
            names = sorted(f.path for f in self.client.list_artifacts(run.run_id, DISTRIBUTIONS_DIR) if f.path.endswith(".json"))
        except Exception:
            return {}
        out = {}
        for name in (n for n in names if not leaves_folder(n)):  # a server's path never leaves the cache
            dst = run_cache(self.cache_dir(), run.run_id)
            local = dst / name
            if not local.is_file():
                dst.mkdir(parents=True, exist_ok=True)
                local = Path(self.client.download_artifacts(run.run_id, name, str(dst)))
            record = json.loads(local.read_text(encoding="utf-8"))
            if isinstance(record, dict) and isinstance(record.get("series"), dict) and "edges" in record:
                out[Path(name).stem] = record
        return out

    def history(self, run: TrialRun, key: str) -> list[tuple[int, float]]:
        """(epoch counted from 1, value) of a per-epoch metric, one value per epoch (the last logged), sorted.

        Runs logged before the ``prvrlab.epoch_base`` tag counted their steps from 0: shifted by one.
        """
        shift = 0 if run.tags.get("prvrlab.epoch_base") == "1" else 1
        points: dict[int, float] = {}
        for m in sorted(self.client.get_metric_history(run.run_id, key), key=lambda m: (m.step, m.timestamp)):
            points[int(m.step) + shift] = float(m.value)
        return sorted(points.items())


# ---------------------------------------------------------------- finding the parent run


def run_cache(cache: Path, run_id: str) -> Path:
    """``cache / run_id``, the folder a run's downloaded artifacts are kept in; a ReportError for a run id that
    is not a plain name (a tracking server's answer never chooses a path outside the cache)."""
    if not run_id or not all(c.isalnum() or c in "-_" for c in run_id):
        raise ReportError(f"run id {run_id!r} from the tracking server is not a plain name; refusing to cache its files")
    return cache / run_id


def ground_truth_difference(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> tuple[str, str, str] | None:
    """The first query both ranks tables hold whose ground-truth video differs (query, ``a``'s video, ``b``'s):
    the two runs were evaluated on different data; None when they agree or a table has no ``video_id``."""
    if "video_id" not in a or "video_id" not in b:
        return None
    b_video = dict(zip(b["query_id"], b["video_id"]))
    for query, video in zip(a["query_id"], a["video_id"]):
        if query in b_video and b_video[query] != video:
            return str(query), str(video), str(b_video[query])
    return None


def run_ranks(client: Any, run_id: str, split: str, cache: Path) -> dict[str, Any] | None:
    """Per-query ranks a run logged for ``split`` (artifact ``ranks/ranks_<split>.parquet``, downloaded once
    into ``cache``): {"query_id", "rank", "ratio"} arrays sorted by query id, or None without that artifact."""
    from prvrlab.evaluation.metrics import load_ranks

    dst = run_cache(cache, run_id)
    local = dst / "ranks" / f"ranks_{split}.parquet"
    if not local.is_file() and (dst / f"ranks_{split}.parquet").is_file():
        local = dst / f"ranks_{split}.parquet"
    if not local.is_file():
        try:
            names = {f.path for f in client.list_artifacts(run_id, "ranks")}
        except Exception:
            return None
        if f"ranks/ranks_{split}.parquet" not in names:
            return None
        dst.mkdir(parents=True, exist_ok=True)
        local = Path(client.download_artifacts(run_id, f"ranks/ranks_{split}.parquet", str(dst)))
    artifact = f"run '{run_id}': artifact ranks/ranks_{split}.parquet"
    try:
        table = load_ranks(local)
    except Exception as exc:  # noqa: BLE001 - pyarrow raises ArrowInvalid, OSError... for a file that is no Parquet
        raise ReportError(f"{artifact} cannot be read as a ranks table: {first_line(exc)}") from None
    missing = [c for c in RANKS_COLUMNS if c not in table.column_names]
    if missing:
        raise ReportError(f"{artifact} is not a ranks table: no column {', '.join(missing)} "
                          f"(columns: {', '.join(table.column_names) or 'none'})")
    nulls = [c for c in RANKS_COLUMNS if table.column(c).null_count]
    if nulls:
        raise ReportError(f"{artifact} is not a ranks table: column {nulls[0]} holds {table.column(nulls[0]).null_count} "
                          "null value(s)")
    try:
        qid = np.asarray(table.column("query_id").to_pylist(), dtype=object)
        order = np.argsort(qid.astype(str), kind="stable")
        out = {"query_id": qid[order].astype(str), "rank": np.asarray(table.column("rank").to_numpy(), dtype=np.int64)[order]}
        if "video_id" in table.column_names:
            out["video_id"] = np.asarray(table.column("video_id").to_pylist(), dtype=object)[order].astype(str)
        if "ratio" in table.column_names:
            out["ratio"] = np.asarray(table.column("ratio").to_numpy(), dtype=np.float64)[order]
    except (ValueError, TypeError, ArithmeticError) as exc:
        raise ReportError(f"{artifact} is not a ranks table: {first_line(exc)}") from None
    ids = out["query_id"]
    if ids.size and (ids[1:] == ids[:-1]).any():  # sorted: a repeat sits next to its twin
        raise ReportError(f"{artifact} ranks query {str(ids[1:][ids[1:] == ids[:-1]][0])!r} more than once")
    if out["rank"].size and out["rank"].min() < 1:
        raise ReportError(f"{artifact} holds rank {int(out['rank'].min())}; ranks start at 1")
    return out




def trial_run(r: Any) -> TrialRun:
    """A :class:`TrialRun` of an MLflow run entity (any prvrlab training run: a trial or a standalone one)."""
    return TrialRun(
        run_id=r.info.run_id,
        name=r.info.run_name or "",
        run_status=r.info.status,
        start_time=int(r.info.start_time or 0),
        tags=dict(r.data.tags),
        params=dict(r.data.params),
        metrics=dict(r.data.metrics),
    )


MLFLOW_TABLES = frozenset({"experiments", "runs", "metrics", "params", "tags"})


def _not_an_mlflow_database(database: Path) -> str | None:
    """Why the SQLite file ``database`` is no MLflow store, read without creating anything (MLflow would create
    its tables in any database it opens; ``mode=rw``, not ``ro``, so that SQLite can roll back the journal a
    killed writer left); None when it holds MLflow's tables."""
    import sqlite3

    try:
        with contextlib.closing(sqlite3.connect(f"{database.resolve().as_uri()}?mode=rw", uri=True)) as db:
            tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.Error as exc:
        return f"cannot be read as an SQLite database ({exc})"
    missing = sorted(MLFLOW_TABLES - tables)
    if missing:
        return "is empty" if not tables else f"is not an MLflow store (it lacks MLflow's tables {', '.join(missing)})"
    return None


def mlflow_client(uri: str, *, existing: bool = False):
    """A client of the store at ``uri``, opened now: a store MLflow refuses (a file store, an unreadable
    database) is one ReportError naming the URI, not a traceback at the first query.  ``existing``: an
    SQLite store whose file is missing is a ReportError too, raised before MLflow would create and
    initialise a new empty store there (a command that only reads runs leaves no store behind)."""
    import os

    database = sqlite_file(uri) if existing else None
    if database is not None and not database.is_file():
        what = "is a folder" if database.is_dir() else "does not exist"
        raise ReportError(f"tracking store {uri}: the database file {database} {what}")
    if database is not None:
        problem = _not_an_mlflow_database(database)
        if problem:
            raise ReportError(f"tracking store {uri}: the database file {database} {problem}")
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient
    from sqlalchemy.exc import SQLAlchemyError

    try:
        client = MlflowClient(tracking_uri=uri)
        client.search_experiments(max_results=1)
    except (MlflowException, SQLAlchemyError, OSError) as exc:
        reason = first_line(exc)
        raise ReportError(f"tracking store {uri}: cannot use it: {reason}") from None
    return client


def _latest_parent(client, experiment_ids: list[str], extra_filter: str = "") -> Any | None:
    found = []
    for kind in STUDY_KINDS:  # the filter language has no IN for tags
        filt = f"tags.`prvrlab.kind` = '{kind}'" + (f" and {extra_filter}" if extra_filter else "")
        found += client.search_runs(experiment_ids, filter_string=filt, order_by=["attributes.start_time DESC"], max_results=1)
    found.sort(key=lambda r: (-(r.info.start_time or 0), r.info.run_id))
    return found[0] if found else None


def _study_names(client, experiment_id: str) -> list[str]:
    """The names of the searches and ablations with a parent run in the experiment."""
    names = set()
    for kind in STUDY_KINDS:
        runs = client.search_runs([experiment_id], filter_string=f"tags.`prvrlab.kind` = '{kind}'", max_results=5000)
        names.update(r.data.tags.get("prvrlab.study", "") for r in runs)
    return sorted(n for n in names if n)


def find_parent(
    *,
    tracking_uri: str,
    run_id: str | None = None,
    experiment: str | None = None,
    study: str | None = None,
) -> str:
    """The parent run id of the study named by ``run_id`` or by ``experiment`` (and ``study``, its name there)."""
    if (run_id is None) == (experiment is None) or (study is not None and experiment is None):
        raise ReportError("name the study with exactly one of a run id or an experiment (and optionally a study name)")
    client = mlflow_client(tracking_uri, existing=True)
    if run_id is not None:
        from mlflow.exceptions import MlflowException

        try:
            run = client.get_run(run_id)
        except MlflowException:
            raise ReportError(f"unknown run id '{run_id}': no such run in the tracking store {tracking_uri}") from None
        kind = run.data.tags.get("prvrlab.kind")
        if kind == "trial" and run.data.tags.get("mlflow.parentRunId"):
            return run.data.tags["mlflow.parentRunId"]
        if kind not in STUDY_KINDS:
            raise ReportError(f"run '{run_id}' is not a search or ablation parent run (prvrlab.kind={kind!r})")
        return run_id
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        names = sorted(e.name for e in client.search_experiments())
        raise ReportError(
            f"unknown experiment '{experiment}' in the tracking store {tracking_uri}{did_you_mean(experiment, names)}; "
            f"experiments: {', '.join(names) or 'none'}"
        )
    if study is not None:
        run = _latest_parent(client, [exp.experiment_id], f"tags.`prvrlab.study` = '{study}'")
        if run is None:
            names = _study_names(client, exp.experiment_id)
            raise ReportError(
                f"no search or ablation named '{study}' in experiment '{experiment}' of the tracking store {tracking_uri}"
                f"{did_you_mean(study, names)}; its studies: {', '.join(names) or 'none'}"
            )
        return run.info.run_id
    run = _latest_parent(client, [exp.experiment_id])
    if run is None:
        raise ReportError(f"experiment '{experiment}' has no search or ablation parent run ({tracking_uri})")
    return run.info.run_id


# ---------------------------------------------------------------- loading


_YAML12_INT = re.compile(r"[-+]?[0-9]+")
_YAML12_FLOAT = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?")


def yaml_numbers(value: Any) -> Any:
    """``value`` with the strings YAML 1.2 reads as numbers read as numbers, in lists and mapping values: PyYAML
    reads ``3e-3`` (no dot) as the string '3e-3', which the spec loader takes as the number on numeric keys,
    so the report reads a logged spec's space and variants the same way (a string would match no trial's value)."""
    if isinstance(value, str):
        text = value.strip()
        if _YAML12_INT.fullmatch(text):
            return int(text)
        return float(text) if _YAML12_FLOAT.fullmatch(text) else value
    if isinstance(value, dict):
        return {k: yaml_numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [yaml_numbers(v) for v in value]
    return value


def _spec_artifact(client, run_id: str) -> dict[str, Any]:
    try:
        files = [f.path for f in client.list_artifacts(run_id, "spec") if f.path.endswith((".yaml", ".yml"))]
    except Exception:
        return {}
    if not files:
        return {}
    with tempfile.TemporaryDirectory(prefix="prvrlab-report-") as tmp:
        local = client.download_artifacts(run_id, sorted(files)[0], tmp)
        data = yaml.safe_load(Path(local).read_text())
    if not isinstance(data, dict):
        return {}
    return {k: yaml_numbers(v) if k in ("space", "variants") else v for k, v in data.items()}


def _sort_key(run: TrialRun) -> tuple:
    return (run.variant or "", run.seed if run.seed is not None else -1, run.trial_id, run.run_id)


def load_study(uri: str, parent_id: str) -> Study:
    """The parent run and every child run (all statuses) of a study."""
    client = mlflow_client(uri)
    parent = client.get_run(parent_id)
    kind = parent.data.tags.get("prvrlab.kind", "")
    if kind not in STUDY_KINDS:
        raise ReportError(f"run '{parent_id}' is not a search or ablation parent run (prvrlab.kind={kind!r})")
    exp_id = parent.info.experiment_id
    children = []
    token = None
    while True:
        page = client.search_runs(
            [exp_id], filter_string=f"tags.`mlflow.parentRunId` = '{parent_id}'", max_results=1000, page_token=token
        )
        children.extend(page)
        token = page.token
        if not token:
            break
    runs = [trial_run(r) for r in children]
    return Study(
        tracking_uri=uri,
        parent_id=parent_id,
        kind=kind,
        name=parent.data.tags.get("prvrlab.study", parent.info.run_name or parent_id),
        experiment_id=exp_id,
        tags=dict(parent.data.tags),
        params=dict(parent.data.params),
        spec=_spec_artifact(client, parent_id),
        runs=sorted(runs, key=_sort_key),
        client=client,
    )
