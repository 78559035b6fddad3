"""The extension seam: component parameters, hooks, needs, auxiliary encoders, metrics, resolved configs."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

import seam_components  # noqa: F401  (registers the test_* components)
from prvrlab.data.collection import open_collection
from prvrlab.data.dataset import train_loader
from prvrlab.models.factory import build_model, build_system
from prvrlab.platform.config import ConfigError, validate
from prvrlab.platform.search.spec import DefineByRun, SearchParam, reported_metrics
from prvrlab.platform.train.loop import TrainingLoop, run_local
from prvrlab.platform.train.optim import build_optimizer
from prvrlab.platform.train.session import LocalSession
from prvrlab.registry import BACKBONES

from train_helpers import gloo_group, rank_loop, small_raw, truly_relevant_by_hand


def seam_raw(root: Path, tmp: Path, **train) -> dict:
    raw = small_raw(root, tmp, **{"epochs": 2, **train})
    raw["losses"]["temp"] = {"loss": "test_tempered_nce", "weight": 0.5, "branch": "clip"}
    raw["losses"]["probe"] = {"loss": "test_epoch_probe", "weight": 1.0}
    return raw


def history(session: LocalSession) -> list[dict]:
    return [r for r in session.reports if r.get("kind") == "epoch"]


def temperature_of(state: dict) -> float:
    return float(state["losses"]["losses.temp.log_temperature"])


def test_loss_parameter_trains_hooks_run_and_metrics_are_logged(tiny_root, tmp_path):
    cfg = validate(seam_raw(tiny_root, tmp_path))
    session = run_local(cfg, tmp_path / "run")
    epochs = history(session)
    assert len(epochs) == 2

    # the learnable temperature is optimised (it starts at log T = 0) and reported every epoch
    best = torch.load(tmp_path / "run" / "best_model.pt", weights_only=True)
    assert "losses.temp.log_temperature" in best["losses"] and temperature_of(best) != 0.0
    temperatures = [e["train/temp.temperature"] for e in epochs]
    assert temperatures[0] != temperatures[1]

    # epoch hooks: one pass over the whole training split with per-frame embeddings, model in eval mode
    collection = open_collection(cfg.data)
    index = collection.split("train")
    loader, sampler = train_loader(collection, "train", batch_size_per_rank=16)
    real_frames = sum(int(b.frame_mask.sum()) for b in loader)
    truth = json.loads((tiny_root / "TextData" / "synthtrain.truth.json").read_text())
    in_order, _ = train_loader(collection, "train", batch_size_per_rank=16, shuffle=False)  # as the hooks see it
    relevant = sum(
        truly_relevant_by_hand(truth, q, v) for b in in_order for q in b.query_ids for v in b.video_ids
    )  # the ground truth reaches the hooks: pairs within each batch
    assert relevant > sum(len(b.query_ids) for b in loader)  # some unpaired pairs are relevant too
    for e in epochs:
        assert e["train/probe.truly_relevant"] == relevant
        assert e["train/probe.steps_with_truth"] == len(sampler)
        assert e["train/probe.videos"] == index.num_videos
        assert e["train/probe.frames"] == real_frames
        assert e["train/probe.steps"] == len(sampler)  # on_step_end after every optimiser step
        assert e["train/probe.frame_norm"] > 0
    assert epochs[0]["train/probe.frame_norm"] != epochs[1]["train/probe.frame_norm"]  # the current model each epoch

    # a distribution logged from a hook: binned, written as distributions/<component>.<name>.json
    lengths = [int(n) for b in in_order for n in b.frame_mask.sum(dim=1)]
    written = json.loads((tmp_path / "run" / "distributions" / "probe.frames.json").read_text())
    assert (written["component"], written["name"], written["epoch"]) == ("probe", "frames", 2)
    assert written["edges"] == [8.0 * i for i in range(9)]
    frames = written["series"]["all"]
    assert frames["counts"] == [sum(min(n // 8, 7) == b for n in lengths) for b in range(8)]
    assert frames["n"] == index.num_videos and frames["mean"] == pytest.approx(real_frames / index.num_videos)


def test_component_parameters_are_optimised_and_restored_from_a_checkpoint(tiny_root, tmp_path):
    cfg = validate(seam_raw(tiny_root, tmp_path, epochs=1))
    session = run_local(cfg, tmp_path / "run")
    saved = torch.load(session.root / "checkpoint_latest" / "state.pt", weights_only=True)
    assert temperature_of(saved) != 0.0

    loop = TrainingLoop(cfg, session=LocalSession(session.root), run_dir=tmp_path / "again")
    loop.setup()
    params = {id(p) for group in loop.optimizer.param_groups for p in group["params"]}
    assert id(loop.system.losses.losses["temp"].log_temperature) in params
    assert loop.system.losses.losses["temp"].log_temperature.item() == 0.0
    loop.restore()
    assert loop.system.losses.losses["temp"].log_temperature.item() == pytest.approx(temperature_of(saved))
    assert loop.progress.epoch == 0


def _ddp_rank(rank: int, world: int, init_file: str, raw: dict, out_dir: str) -> None:
    import seam_components  # noqa: F401  (spawned processes register the test components too)

    with gloo_group(rank, world, init_file):
        loop = rank_loop(raw, Path(out_dir), rank=rank, world=world)
        loop.run()
        result = {
            "log_t": loop.system.losses.losses["temp"].log_temperature.item(),
            "reports": [r for r in loop.session.reports if r.get("kind") == "epoch"],
        }
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


@pytest.mark.slow
def test_component_parameters_train_under_two_worker_ddp(tiny_root, tmp_path):
    raw = seam_raw(tiny_root, tmp_path, epochs=1, num_workers=2, torch_threads=1)
    mp.spawn(_ddp_rank, args=(2, str(tmp_path / "init"), raw, str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["log_t"] == ranks[1]["log_t"] != 0.0  # DDP-averaged gradients: identical on both ranks
    epoch0 = [r["reports"][0] for r in ranks]
    n_train = open_collection(validate(raw).data).split("train").num_videos
    for report in epoch0:  # the epoch-start pass covers the split once per rank (the sampler pads to equal shares)
        assert n_train <= report["train/probe.videos"] < n_train + 2
    assert epoch0[0]["train/temp.temperature"] == epoch0[1]["train/temp.temperature"]


def test_auxiliary_encoder_trains_is_checkpointed_and_contributes_to_retrieval(tiny_root, tmp_path):
    raw = small_raw(tiny_root, tmp_path)
    raw["plugins"] = {"test_twin": {"mix": 0.25}}
    cfg = validate(raw)
    collection = open_collection(cfg.data)
    dims = {"video_dim": collection.video_dim, "query_dim": collection.query_dim}
    torch.manual_seed(0)
    system = build_system(cfg.model, cfg.plugins, cfg.losses, **dims)
    twin = system.model.plugins["test_twin"].twin
    assert type(twin) is type(system.model.backbone) and twin is not system.model.backbone

    optimizer, _ = build_optimizer(system, lr=1e-3, weight_decay=0.01, total_steps=10, warmup_proportion=0.0)
    in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert all(id(p) in in_optimizer for p in twin.parameters())
    loader, _ = train_loader(collection, "train", batch_size_per_rank=8)
    batch = next(iter(loader))
    result, _ = system(batch, epoch=0)
    result.total.backward()
    assert all(p.grad is not None for p in twin.parameters() if p.requires_grad)
    assert any(k.startswith("plugins.test_twin.twin.") for k in system.model.state_dict())

    # retrieval: (1 - mix) * own + mix * twin, per branch
    model = system.model.eval()
    with torch.no_grad():
        video = model.encode_videos(batch.clips, batch.frames, batch.frame_mask)
        query = model.encode_queries(batch.queries, batch.query_mask)
        fused = model.fuse(model.score(query, video))
        own = model.backbone.score(query, video)
        other = twin.score(twin.encode_queries(batch.queries, batch.query_mask), twin.encode_videos(batch.clips, batch.frames, batch.frame_mask))
        expected = sum(w * (0.75 * own[b].sim + 0.25 * other[b].sim) for b, w in model.score_weights.items())
    torch.testing.assert_close(fused, expected)

    # a checkpoint of the model alone restores the twin (what evaluation loads)
    reloaded = build_model(cfg.model, cfg.plugins, **dims).eval()
    reloaded.load_state_dict(copy.deepcopy(model.state_dict()))
    with torch.no_grad():
        again = reloaded.fuse(reloaded.score(reloaded.encode_queries(batch.queries, batch.query_mask),
                                             reloaded.encode_videos(batch.clips, batch.frames, batch.frame_mask)))
    torch.testing.assert_close(again, fused)


def test_needs_a_backbone_cannot_meet_are_rejected_naming_both(tiny_root, tmp_path, monkeypatch):
    gmmformer = BACKBONES.get("gmmformer")
    monkeypatch.setattr(gmmformer, "provides", frozenset())
    with pytest.raises(ConfigError, match=r"losses\.probe: 'test_epoch_probe' needs frame_tokens.*backbone 'gmmformer'"):
        validate(seam_raw(tiny_root, tmp_path))
    raw = small_raw(tiny_root, tmp_path)
    raw["plugins"] = {"ral": {"msra": False}}
    with pytest.raises(ConfigError, match=r"plugins\.ral: 'ral' needs frame_tokens.*backbone 'gmmformer'"):
        validate(raw)
    raw = small_raw(tiny_root, tmp_path)
    raw["losses"]["probe"] = {"loss": "test_epoch_probe", "weight": 0.0}  # a switched-off term needs nothing
    validate(raw)


def test_resolved_config_carries_defaults_into_hash_params_and_conditions(tiny_root, tmp_path, monkeypatch):
    raw = small_raw(tiny_root, tmp_path)
    cfg = validate(raw)
    flat = cfg.flat()
    assert flat["model.num_gmm_blocks"] == 2 and flat["losses.clip_triplet.hard_negative_start_epoch"] is not None
    explicit = copy.deepcopy(raw)
    explicit["model"]["num_gmm_blocks"] = 2
    assert validate(explicit).fingerprint() == cfg.fingerprint()
    # a changed constructor default changes the hash (a finished ablation cell is no longer skipped)
    defaults = dict(BACKBONES.get("gmmformer").__init__.__kwdefaults__)
    monkeypatch.setattr(BACKBONES.get("gmmformer").__init__, "__kwdefaults__", {**defaults, "num_gmm_blocks": 3})
    changed = validate(raw)
    assert changed.model["num_gmm_blocks"] == 3 and changed.fingerprint() != cfg.fingerprint()
    monkeypatch.undo()

    class Trial:
        def __init__(self) -> None:
            self.asked: list[str] = []

        def suggest_float(self, key, low, high, log=False):
            self.asked.append(key)
            return low

    conditional = SearchParam(key="train.lr", kind="uniform", args=(1e-4, 1e-3), when={"model.num_gmm_blocks": 2})
    trial = Trial()
    DefineByRun((conditional,), cfg.flat())(trial)  # the condition reads a key left at its default
    assert trial.asked == ["train.lr"]


def test_declared_component_metrics_are_search_metrics(tiny_root, tmp_path):
    cfg = validate(seam_raw(tiny_root, tmp_path))
    metrics = reported_metrics(cfg)
    assert {"train/temp.temperature", "train/probe.videos", "train/probe.steps"} <= set(metrics)
    raw = small_raw(tiny_root, tmp_path)
    raw["plugins"] = {"ral": {}}
    raw["losses"]["ral_da"] = {"loss": "ral_da", "weight": 1e-4}
    raw["losses"]["ral_pm"] = {"loss": "ral_pm", "weight": 1e-3}
    assert "train/ral.sigma_query" in reported_metrics(validate(raw))


def test_checkpoints_without_loss_state_still_evaluate(tiny_root, tmp_path):
    from prvrlab.platform.train.checkpoint_eval import evaluate_checkpoint

    cfg = validate(small_raw(tiny_root, tmp_path))
    collection = open_collection(cfg.data)
    model = build_model(cfg.model, cfg.plugins, video_dim=collection.video_dim, query_dim=collection.query_dim)
    path = tmp_path / "old.pt"
    torch.save({"model": model.state_dict(), "config": cfg.to_dict(), "epoch": 0}, path)  # the pre-seam format
    assert evaluate_checkpoint(path, split="val").num_queries == collection.split("val").num_queries
    assert os.path.getsize(path) > 0
