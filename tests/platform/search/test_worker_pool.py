"""Reused DDP worker pools (``resources.reuse_workers``): the spec switch, rank 0's report path, and
searches whose 2-worker trials share a pool — same results as a TorchTrainer per trial, crash retry."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import time

import pytest

from prvrlab.platform.config import ConfigError
from prvrlab.platform.search.spec import load_search_spec
from prvrlab.platform.search import workers
from prvrlab.platform.search.workers import POOL_LOG, PRELOAD, PoolSession, PoolWorker, pool_resources
from prvrlab.platform.train.session import Session

from search_helpers import metric_history, study_runs, tiny_spec
from train_helpers import small_raw


# ---------------------------------------------------------------- fast


def test_spec_switch_defaults_to_auto_and_names_the_key(tiny_root, tmp_path):
    assert load_search_spec(tiny_spec(tmp_path, tiny_root)).resources.reuse_workers is None  # decided at the start
    for value, want in [(True, True), (False, False), ("auto", None)]:
        spec = tiny_spec(tmp_path, tiny_root, name=f"s{value}", resources={"workers_per_trial": 2, "reuse_workers": value})
        assert load_search_spec(spec).resources.reuse_workers is want
    bad = tiny_spec(tmp_path, tiny_root, name="bad", resources={"workers_per_trial": 2, "reuse_workers": "yes"})
    with pytest.raises(ConfigError, match=r"resources\.reuse_workers: expected true, false or auto, got 'yes'"):
        load_search_spec(bad)


def test_a_study_says_whether_its_ranks_are_kept_across_trials(tmp_path):
    from prvrlab.platform.search.study import StudyContext

    def note(workers: int, reuse: bool) -> str:
        return StudyContext(kind="search", name="s", study_dir=str(tmp_path), base_raw={}, metric="val/sumr", mode="max",
                            workers=workers, cpus_per_worker=1.0, gpus_per_worker=0.0, tracking_uri="", experiment="e",
                            reuse_workers=reuse).ranks_note()

    assert note(1, False) == "" and note(1, True) == ""  # one worker: no DDP ranks to speak of
    assert note(2, True) == "; DDP ranks kept across trials"
    assert "resources.reuse_workers: true" in note(2, False) and "per trial" in note(2, False)


def test_shipped_multi_worker_cpu_specs_keep_their_ranks_across_trials():
    """The shipped specs whose trials are CPU DDP runs take the reused pools (a worker group per trial cost
    the tiny search 66 s against 6 s, with the same trial metrics: docs/performance.md, "Search overhead")."""
    from pathlib import Path

    import yaml

    multi = {}
    for path in sorted((Path(__file__).resolve().parents[3] / "search_spaces").glob("*.yaml")):
        res = yaml.safe_load(path.read_text()).get("resources", {})
        if res.get("workers_per_trial", 1) > 1 and not res.get("gpus_per_worker", 0):
            multi[path.name] = res.get("reuse_workers", False)
    assert multi and all(multi.values()), multi


def test_trial_placement_group_has_the_trial_actor_then_one_bundle_per_rank():
    cpu = pool_resources(3, 0.5, 0.0, 0.01)
    assert cpu.bundles == [{"CPU": 0.01}] + [{"CPU": 0.5}] * 3
    assert not cpu.head_bundle_is_empty
    one = pool_resources(1, 2.0, 0.0, 0.0)  # a one-rank pool: the trial actor rides in the rank's bundle
    assert one.head_bundle_is_empty and one.bundles == [{"CPU": 2.0}] and one.required_resources == {"CPU": 2.0}
    gpu = pool_resources(2, 1.0, 0.5, 0.01)
    assert gpu.bundles == [{"CPU": 0.01}, {"CPU": 1.0, "GPU": 0.5}, {"CPU": 1.0, "GPU": 0.5}]


def test_rank0_posts_numbered_checkpoint_copies_and_other_ranks_post_nothing(tmp_path):
    outbox: queue.Queue = queue.Queue()
    stage = tmp_path / "stage"
    stage.mkdir()
    rank0 = PoolSession(rank=0, world_size=2, resume=None, outbox=outbox, stage=stage)
    rank1 = PoolSession(rank=1, world_size=2, resume=str(tmp_path), outbox=outbox, stage=stage)
    with rank0.checkpoint_dir() as none, rank1.checkpoint_dir() as resume:
        assert none is None and resume == tmp_path
    for epoch in (1, 2):
        scratch = tmp_path / f"scratch{epoch}"
        scratch.mkdir()
        (scratch / "state.pt").write_text(f"epoch {epoch}")
        rank1.report({"epoch": epoch}, None)
        rank0.report({"epoch": epoch}, scratch)
        scratch.joinpath("state.pt").unlink()  # the loop's scratch folder goes away after report()
    rank0.report({"kind": "final"}, None)
    posted = [outbox.get_nowait() for _ in range(outbox.qsize())]
    assert [p[1] for p in posted] == [{"epoch": 1}, {"epoch": 2}, {"kind": "final"}]
    assert [p[2] for p in posted] == [str(stage / "00000"), str(stage / "00001"), None]
    assert [(stage / f"0000{i}" / "state.pt").read_text() for i in (0, 1)] == ["epoch 1", "epoch 2"]


def test_a_pool_rank_opens_the_collection_again_only_when_the_data_section_changes(tiny_root, tmp_path):
    import dataclasses

    from prvrlab.platform.config import validate

    data = validate(small_raw(tiny_root, tmp_path)).data
    worker, outbox = PoolWorker(), queue.Queue()
    worker.preloading.join()
    sessions = [
        PoolSession(rank=0, world_size=1, resume=None, outbox=outbox, stage=tmp_path, collections=worker.collection) for _ in range(3)
    ]
    first = sessions[0].open_collection(data)
    assert sessions[1].open_collection(dataclasses.replace(data)) is first  # an equal section: the same collection
    other = sessions[2].open_collection(dataclasses.replace(data, max_frames=data.max_frames // 2))
    assert other is not first and other.max_frames == data.max_frames // 2
    assert sessions[0].open_collection(data) is not first  # only the last trial's data is kept
    plain = Session()
    assert plain.open_collection(data) is not plain.open_collection(data)  # outside a pool: a fresh one per attempt


def test_a_fresh_rank_preloads_torch_ddp_and_every_component_in_the_background():
    probe = """
import sys
from prvrlab.platform.search.workers import PRELOAD, PoolWorker
from prvrlab.registry import BACKBONES
before = [m for m in PRELOAD if m in sys.modules]
worker = PoolWorker()
worker.preloading.join()
print(before, [m for m in PRELOAD if m not in sys.modules], BACKBONES._loaded)
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split("\n")[-2]
    assert out == "[] [] True"  # nothing loaded at construction time, everything after the background import
    assert "torch._dynamo" in PRELOAD  # DDP's constructor imports it (~2.4 s on the reference machine)


def test_a_pool_rank_validates_a_config_as_validate_does(tiny_root, tmp_path):
    from prvrlab.platform.config import validate

    worker = PoolWorker()
    raw = small_raw(tiny_root, tmp_path)
    assert worker.resolve(raw) == (validate(raw), None)
    bad = {**raw, "model": {**raw["model"], "hiden_size": 8}}
    with pytest.raises(ConfigError) as err:
        validate(bad)
    assert worker.resolve(bad) == (None, str(err.value))
    assert "hiden_size" in str(err.value)


class _Rank:
    def __init__(self, answer):
        self.answer = answer
        self.resolve = self

    def remote(self, raw):
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


class _Pool:
    def __init__(self, answer):
        self.actors, self.down = [_Rank(answer)], False

    def shutdown(self):
        self.down = True


def test_validate_on_pool_raises_the_ranks_config_error_and_discards_a_pool_that_failed(monkeypatch, tiny_root, tmp_path):
    import ray

    monkeypatch.setattr(ray, "get", lambda ref: ref)
    ok = _Pool(("the config", None))
    monkeypatch.setattr(workers, "_POOL", ok)
    assert workers.validate_on_pool({"any": 1}) == "the config" and workers._POOL is ok
    monkeypatch.setattr(workers, "_POOL", _Pool((None, "model.hiden_size: unknown")))
    with pytest.raises(ConfigError, match="model.hiden_size: unknown"):
        workers.validate_on_pool({})
    assert workers._POOL is not None  # an invalid config leaves the pool up for the slot's next trial
    dead = _Pool(RuntimeError("the rank died"))
    monkeypatch.setattr(workers, "_POOL", dead)
    with pytest.raises(RuntimeError, match="the rank died"):
        workers.validate_on_pool({})
    assert workers._POOL is None and dead.down  # a dead rank: the next attempt builds a new pool


def _spec_stub(*, workers=2, reuse=True, gpus=0.0, concurrency=1, pack=1):
    from types import SimpleNamespace

    resources = SimpleNamespace(workers_per_trial=workers, reuse_workers=reuse, gpus_per_worker=gpus, pack=pack)
    return SimpleNamespace(resources=resources, slots=concurrency * pack)


def test_auto_pools_cpu_ranks_on_a_one_node_cluster(tiny_root, tmp_path, monkeypatch):
    """``reuse_workers: auto`` (the default): pools for CPU DDP trials on a one-node cluster where a trial fits
    now, this machine's or one joined through $RAY_ADDRESS (ray job submit); a worker group per trial elsewhere."""
    from prvrlab.platform.search.study import pooled_ranks

    monkeypatch.delenv("RAY_ADDRESS", raising=False)

    def decide(resources, cpus=8.0, gpus=0.0, nodes=1):
        spec = load_search_spec(tiny_spec(tmp_path, tiny_root, name="s", resources=resources))
        return pooled_ranks(spec, cpus, gpus, nodes=nodes)

    ddp = {"workers_per_trial": 2}
    assert decide(ddp) is True
    assert decide({"workers_per_trial": 1}) is False  # trains in the trial actor
    assert decide({"workers_per_trial": 1, "reuse_workers": True}) is True  # a one-rank pool, when asked for
    assert decide(ddp, nodes=2) is False  # nodes may leave: the per-trial placement timeout
    assert decide({**ddp, "gpus_per_worker": 1}, gpus=2.0) is False  # GPU pools are opt-in
    assert decide({**ddp, "cpus_per_worker": 4}) is False  # 8.01 CPUs: does not fit now, so it may wait
    assert decide({**ddp, "cpus_per_worker": 3}) is True
    assert decide({**ddp, "pack": 2}, nodes=3) is True  # packing needs the pools
    assert decide({**ddp, "reuse_workers": True}, nodes=2) is True and decide({**ddp, "reuse_workers": False}) is False
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # a cluster joined (ray job submit): the same rules
    assert decide(ddp) is True and decide({**ddp, "reuse_workers": False}) is False
    assert decide(ddp, nodes=2) is False and decide({**ddp, "cpus_per_worker": 4}) is False


def test_a_study_records_how_its_ranks_were_chosen_and_a_resume_keeps_it(tiny_root, tmp_path, monkeypatch):
    from prvrlab.platform.runtime import resolve_config_paths
    from prvrlab.platform.search import study as study_module
    from prvrlab.platform.search.outcome import RunMap

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(study_module, "cluster_size", lambda: (8.0, 0.0))
    nodes = [1]
    monkeypatch.setattr(study_module, "alive_nodes", lambda: nodes[0])
    spec = load_search_spec(tiny_spec(tmp_path, tiny_root, resources={"workers_per_trial": 2}))
    base = resolve_config_paths(spec.base)

    def study(folder: str):
        (tmp_path / folder).mkdir(exist_ok=True)
        return study_module.make_study(spec, "search", base, tmp_path / folder)

    first = study("first")
    assert first.reuse_workers is True and first.admission is None and first.ranks_note() == "; DDP ranks kept across trials"
    assert RunMap(tmp_path / "first").meta["pooled_ranks"] is True
    nodes[0] = 3  # where auto now gives a worker group per trial
    assert study("first").reuse_workers is True  # resumed: the way its trials started
    fresh = study("fresh")
    assert fresh.reuse_workers is False and fresh.admission is not None and "per trial" in fresh.ranks_note()
    assert RunMap(tmp_path / "fresh").meta["pooled_ranks"] is False


def test_spares_only_for_cpu_studies_on_reused_pools_on_a_one_node_cluster(monkeypatch):
    import ray

    from prvrlab.platform.search import study as study_module

    started = []
    monkeypatch.setattr(workers, "start_spares", lambda groups, ranks, cpus: started.append((groups, ranks)) or [["spare"] * ranks] * groups)
    monkeypatch.setattr(workers, "stop_spares", lambda groups: started.append(("stopped", len(groups))))
    nodes = [{"Alive": True}]
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    for stub, trials in [
        (_spec_stub(workers=1, reuse=False), 3),  # one worker, no pool: trains in the trial actor
        (_spec_stub(reuse=False), 3),  # a TorchTrainer per trial
        (_spec_stub(gpus=0.5), 3),  # a spare sees no GPU
        (_spec_stub(), 0),  # nothing to run
    ]:
        with study_module.spare_ranks(stub, trials, cpus=1.0) as spares:
            assert spares == []
    nodes.append({"Alive": True})  # two nodes: a spare could sit where no trial holds CPUs
    with study_module.spare_ranks(_spec_stub(), 3, cpus=1.0) as spares:
        assert spares == []
    nodes[1]["Alive"] = False  # a dead node does not count
    assert started == []
    with study_module.spare_ranks(_spec_stub(concurrency=2, pack=2), 3, cpus=0.5) as spares:  # min(4 slots, 3 trials) groups
        assert len(spares) == 3 and all(len(group) == 2 for group in spares)
    assert started == [(3, 2), ("stopped", 3)]
    with study_module.spare_ranks(_spec_stub(workers=1), 3, cpus=2.0) as spares:  # a one-rank pool: its rank imports early too
        assert spares == [["spare"]]
    assert started[2:] == [(1, 1), ("stopped", 1)]


def test_what_a_trial_actor_loads_does_not_import_torch():
    probe = """
import sys
import prvrlab.platform.search.study, prvrlab.platform.search.workers, prvrlab.platform.config, prvrlab.data
print(sorted(m for m in ("torch", "prvrlab.models.factory") if m in sys.modules))
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split("\n")[-2]
    assert out == "[]"


# ---------------------------------------------------------------- searches on Ray


@pytest.fixture(scope="module")
def ray_shutdown():
    yield
    import ray

    ray.shutdown()


def _pool_lines(study_dir, trial_id):
    return [json.loads(line) for line in (study_dir / "trials" / trial_id / POOL_LOG).read_text().splitlines()]


def _by_lr(children):
    return {round(float(c.data.params["train.lr"]), 8): c for c in children}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
def test_a_spare_goes_to_one_claimant_and_exits_when_its_adopter_dies(ray_shutdown):
    import ray

    from prvrlab.platform.runtime import ensure_ray

    ensure_ray()

    @ray.remote(num_cpus=0)
    class Owner:
        def pid(self) -> int:
            return os.getpid()

    (group,) = workers.start_spares(1, 2, 2.5)
    try:
        # Ray gives a zero-CPU actor OMP_NUM_THREADS=1; a spare takes what a rank of 2.5 CPUs would get
        assert ray.get(group[1].__ray_call__.remote(lambda _: os.environ.get("OMP_NUM_THREADS"))) == "2"
        node = ray.get(group[0].claim.remote())
        assert node == ray.get_runtime_context().get_node_id()  # one node: the driver's
        assert ray.get(group[0].claim.remote()) is None  # a second trial actor does not get it
        owner, bystander = Owner.remote(), Owner.remote()
        owner_pid, bystander_pid = ray.get([owner.pid.remote(), bystander.pid.remote()])
        ray.get(group[0].follow.remote(owner_pid))
        ray.get(group[1].follow.remote(bystander_pid))
        ray.kill(owner)
        assert _dies(group[0]), "the spare outlived the trial actor that adopted it"
        assert "killed by `ray.kill`" in _DEATHS[-1], "a follower's exit must be an intended one, not a 'system error'"
        assert ray.get(group[1].claim.remote()) is not None  # its bystander lives: this one stays
        ended = subprocess.Popen([sys.executable, "-c", "pass"])
        ended.wait()
        ray.get(group[1].follow.remote(ended.pid))  # a pid it cannot see (another pid namespace, here: gone): not followed
        time.sleep(2 * workers.FOLLOW_S)
        assert ray.get(group[1].claim.remote()) is None  # alive (claimed above)
    finally:
        workers.stop_spares([group])
    assert _dies(group[1]), "stop_spares left a spare alive"  # ray.kill is asynchronous: a call may still land first


_DEATHS: list[str] = []  # what the calls found by _dies said of the actor's death


def _dies(actor, within_s: float = 30.0) -> bool:
    """Whether ``actor`` is found dead (a call raises ActorDiedError) within ``within_s``."""
    import ray
    from ray.exceptions import ActorDiedError

    deadline = time.time() + within_s
    while time.time() < deadline:
        try:
            ray.get(actor.claim.remote(), timeout=5)
        except ActorDiedError as exc:
            _DEATHS.append(str(exc))
            return True
        time.sleep(0.5)
    return False


@pytest.mark.slow
def test_reused_pool_gives_the_per_trial_trainers_results(tiny_root, tmp_path, ray_shutdown):
    from prvrlab.platform.search.tuning import search

    plain_dir = tmp_path / "plain"
    plain_dir.mkdir()
    _, children, lines = _two_pooled_trials(tmp_path, tiny_root, {"workers_per_trial": 2, "reuse_workers": True})
    assert all(len(attempts) == 1 and len(attempts[0]["pids"]) == 2 for attempts in lines.values())
    (first, _), (second, _) = sorted(((lr, a[0]["trials_before"]) for lr, a in lines.items()), key=lambda x: x[1])
    assert lines[second][0]["pids"] == lines[first][0]["pids"]  # the same two ranks trained both trials
    assert [lines[lr][0]["trials_before"] for lr in (first, second)] == [0, 1]
    assert lines[first][0]["build_s"] > 0 and lines[second][0]["build_s"] == 0
    assert lines[first][0]["adopted"]  # a one-node CPU study: the driver's spare ranks, started before Tune's trial actor
    assert not any(a["actor_torch"] for attempts in lines.values() for a in attempts)  # the ranks validated

    # the reference: the config that ran on the reused pool, alone on a TorchTrainer of its own
    plain = search(load_search_spec(
        tiny_spec(plain_dir, tiny_root, name="plain", resources={"workers_per_trial": 2, "reuse_workers": False}, space={"train.lr": {"grid": [second]}}, budget={"trials": 1}, sampler={"type": "grid", "seed": 0}),
        {"train.epochs": 1},
    ), echo=None)
    assert plain.counts["finished"] == 1, plain.counts
    (reference,) = study_runs(plain_dir)[1]
    assert not (plain.study_dir / "trials" / reference.data.tags["prvrlab.trial_id"] / POOL_LOG).exists()
    _same_trial_metrics(children[second], reference)


def _two_pooled_trials(tmp_path, tiny_root, resources: dict) -> tuple:
    """A 1-epoch grid search of lr 1e-3 and 2e-3 under ``tmp_path/pooled``: (its result, lr -> child run,
    lr -> the trial's pool.jsonl lines)."""
    from prvrlab.platform.search.tuning import search

    pooled_dir = tmp_path / "pooled"
    pooled_dir.mkdir()
    pooled = search(load_search_spec(
        tiny_spec(pooled_dir, tiny_root, name="pooled", resources=resources, space={"train.lr": {"grid": [1e-3, 2e-3]}},
                  sampler={"type": "grid", "seed": 0}, budget={"trials": 2}),
        {"train.epochs": 1},
    ), echo=None)
    assert pooled.counts["finished"] == 2, pooled.counts
    children = _by_lr(study_runs(pooled_dir)[1])
    lines = {lr: _pool_lines(pooled.study_dir, c.data.tags["prvrlab.trial_id"]) for lr, c in children.items()}
    return pooled, children, lines


def _same_trial_metrics(got_run, want_run) -> None:
    """The two MLflow runs' training, validation and final metrics agree (fp32: 1e-5)."""
    got, want = got_run.data.metrics, want_run.data.metrics
    compared = sorted(k for k in want if k.startswith(("train/", "val/", "final/")) and not k.startswith("final/time/"))
    assert "train/loss" in compared and "final/val/sumr" in compared
    assert {k: got[k] for k in compared} == pytest.approx({k: want[k] for k in compared}, rel=1e-5, abs=1e-6)


@pytest.mark.slow
def test_one_worker_trials_on_a_one_rank_pool_give_the_in_actor_results(tiny_root, tmp_path, ray_shutdown):
    """``reuse_workers: true`` puts one-worker CPU trials on a one-rank pool (a spare started with the study,
    holding the trial's whole CPUs): the metrics of the same config trained inside its trial actor."""
    import ray

    from prvrlab.platform.search.tuning import search

    plain_dir = tmp_path / "plain"
    plain_dir.mkdir()
    grid = {"sampler": {"type": "grid", "seed": 0}}
    _, children, lines = _two_pooled_trials(tmp_path, tiny_root, {"workers_per_trial": 1, "reuse_workers": True})
    assert all(len(attempts) == 1 and len(attempts[0]["pids"]) == 1 for attempts in lines.values())
    assert len({attempts[0]["pids"][0] for attempts in lines.values()}) == 1  # one rank trained both
    cluster_cpus = float(int(ray.cluster_resources()["CPU"]))
    assert all(attempts[0]["cpus"] == cluster_cpus for attempts in lines.values())  # not one CPU less for the actor
    assert any(attempts[0]["adopted"] for attempts in lines.values())
    assert not any(a["actor_torch"] for attempts in lines.values() for a in attempts)  # the rank validated

    plain = search(load_search_spec(
        tiny_spec(plain_dir, tiny_root, name="plain", resources={"workers_per_trial": 1, "reuse_workers": False}, space={"train.lr": {"grid": [2e-3]}}, budget={"trials": 1}, **grid),
        {"train.epochs": 1},
    ), echo=None)
    assert plain.counts["finished"] == 1, plain.counts
    (reference,) = study_runs(plain_dir)[1]
    assert not (plain.study_dir / "trials" / reference.data.tags["prvrlab.trial_id"] / POOL_LOG).exists()
    _same_trial_metrics(children[2e-3], reference)


@pytest.mark.slow
def test_dead_rank_retries_the_trial_on_a_new_pool_and_search_end_kills_it(tiny_root, tmp_path, monkeypatch, ray_shutdown):
    from prvrlab.platform.search.tuning import search

    marker = tmp_path / "crashed"
    monkeypatch.setenv("PRVRLAB_FAULT_EPOCH", "0")  # rank 0's process exits after epoch 1's report
    monkeypatch.setenv("PRVRLAB_FAULT_MARKER", str(marker))
    path = tiny_spec(tmp_path, tiny_root, name="crash", budget={"trials": 1}, resources={"workers_per_trial": 2, "reuse_workers": True})
    result = search(load_search_spec(path), echo=None)
    assert marker.exists(), "the injected crash did not happen"
    assert result.counts["finished"] == 1, result.counts
    (child,) = study_runs(tmp_path)[1]
    assert child.data.tags["prvrlab.last_failure"].startswith("worker died: ")
    assert [m.step for m in metric_history(tmp_path, child.info.run_id, "val/sumr")] == [1, 2]  # resumed, not restarted
    crashed, retried = _pool_lines(result.study_dir, child.data.tags["prvrlab.trial_id"])
    assert set(crashed["pids"]).isdisjoint(retried["pids"]) and retried["build_s"] > 0  # a fresh pool
    assert crashed["adopted"] and not retried["adopted"]  # the one spare group went to the first attempt
    deadline = time.time() + 30
    pids = crashed["pids"] + retried["pids"]
    while any(_alive(p) for p in pids) and time.time() < deadline:
        time.sleep(0.5)
    assert not any(_alive(p) for p in pids), "the pools' ranks outlived the search"


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="start tokens come from /proc")
def test_a_followed_process_is_told_apart_once_ended_reaped_or_not():
    """``_started``: a start token for a live process (the same on every call), "" once it has ended,
    whether its parent has reaped it yet (zombie) or not."""
    assert workers._started(os.getpid()) == workers._started(os.getpid()) not in ("", None)
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    alive = workers._started(child.pid)
    assert alive not in ("", None)
    child.stdin.close()
    deadline = time.time() + 30
    while workers._started(child.pid) == alive and time.time() < deadline:  # exited, not yet reaped: a zombie
        time.sleep(0.05)
    assert workers._started(child.pid) == ""
    child.wait()
    assert workers._started(child.pid) == ""
