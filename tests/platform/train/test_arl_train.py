"""ARL through the platform: the uncertainty pass under 1 and 2 DDP workers, warm-up, metrics, checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml

from prvrlab.data.collection import open_collection
from prvrlab.data.dataset import train_loader
from prvrlab.models.component import EpochContext
from prvrlab.models.factory import build_model
from prvrlab.platform.config import validate
from prvrlab.platform.train.loop import all_reduce

from train_helpers import gloo_group, val_sumr_by_epoch

CONFIGS = Path(__file__).resolve().parents[3] / "configs"


def arl_raw(root: Path, tmp: Path, **plugin) -> dict:
    raw = yaml.safe_load((CONFIGS / "arl_synth.yaml").read_text())
    raw["data"] = {"root": str(root), "collection": "synth", "visual_feature": "synth_feat"}
    raw["model"].update(hidden_size=32, num_heads=2, dropout=0.0, ffn_size=64)
    raw["plugins"]["arl"].update(plugin)
    raw["train"] = {"epochs": 2, "batch_size": 16, "lr": 1e-3, "num_workers": 1, "seed": 0}
    raw["eval"] = {"final_splits": ["val"]}
    raw["tracking"] = {"uri": f"sqlite:///{tmp / 'mlflow.db'}", "experiment": "tests", "storage_path": str(tmp / "results")}
    return raw


def uncertainty_tables(raw: dict, rank: int, world: int) -> dict:
    """The plug-in's epoch-start tables on this rank's share, by id (a freshly seeded model)."""
    cfg = validate(raw)
    collection = open_collection(cfg.data)
    torch.manual_seed(0)
    model = build_model(cfg.model, cfg.plugins, video_dim=collection.video_dim, query_dim=collection.query_dim)

    per_rank = 16 // world  # as the trainer deals a batch of 16 out (global steps of 16 videos)

    def batches():
        loader, _ = train_loader(collection, "train", batch_size_per_rank=per_rank, rank=rank, world_size=world, shuffle=False)
        if rank == 1:  # videos of another rank's share seen again (as the sampler's wrap-around pads a short step)
            other, _ = train_loader(collection, "train", batch_size_per_rank=per_rank, rank=0, world_size=world, shuffle=False)
            return iter([*loader, next(iter(other))])
        return iter(loader)

    ctx = EpochContext(
        epoch=5, num_epochs=6, model=model, device=torch.device("cpu"), amp_dtype=None, rank=rank, world_size=world,
        train_batches=batches, all_reduce=all_reduce, process_group=dist.group.WORLD if world > 1 else None,
    )
    out = []
    for table in model.plugins["arl"].dataset_uncertainty(ctx):
        out.append({
            "query": {i: float(table.query[r]) for i, r in table.query_rows.items()},
            "frame": {i: table.frame[r].tolist() for i, r in table.video_rows.items()},
            "tau": [table.tau_s, table.tau_u],
        })
    return {"tables": out, "videos": collection.split("train").num_videos}


def _rank(rank: int, world: int, init_file: str, raw: dict, out_dir: str) -> None:
    torch.set_num_threads(1)
    with gloo_group(rank, world, init_file):
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(uncertainty_tables(raw, rank, world)))


@pytest.mark.slow
def test_uncertainty_is_the_same_with_one_and_two_workers(tiny_root, tmp_path):
    raw = arl_raw(tiny_root, tmp_path)
    single = uncertainty_tables(raw, 0, 1)
    mp.spawn(_rank, args=(2, str(tmp_path / "init"), raw, str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0] == ranks[1]  # every rank ends with the same values
    for one, two in zip(single["tables"], ranks[0]["tables"], strict=True):
        assert one["query"].keys() == two["query"].keys() and one["frame"].keys() == two["frame"].keys()
        assert len(one["frame"]) == single["videos"]
        for i, value in one["query"].items():
            assert two["query"][i] == pytest.approx(value, abs=1e-6)
        for i, values in one["frame"].items():
            assert two["frame"][i] == pytest.approx(values, abs=1e-6)
        assert two["tau"] == pytest.approx(one["tau"], abs=1e-6)


@pytest.mark.slow
def test_trains_switches_at_the_warmup_epoch_logs_metrics_and_checkpoints_both_encoders(tiny_root, tmp_path):
    from prvrlab.platform.train.driver import train

    result = train(validate(arl_raw(tiny_root, tmp_path, warmup_epochs=1)), use_ray=False, echo=None)
    warm, arl = result.history
    # epoch 0 (< E_w = 1): base losses only, nothing detected, no uncertainty pass
    assert "train/arl.tau_s" not in warm and "train/arl.precision_tv" not in warm
    assert warm["train/arl.ambiguous_tv"] == 0.0 and warm["train/ambiguity.frame"] == 0.0
    # epoch 1 (= E_w): thresholds by the rule for both encoders, detections, the text-frame objective
    assert {"train/arl.tau_s", "train/arl.tau_u", "train/arl.tau_s_1", "train/arl.tau_u_1"} <= set(arl)
    assert -1.0 <= arl["train/arl.tau_u"] <= arl["train/arl.tau_s"] <= 1.0
    assert arl["train/arl.ambiguous_tv"] > 0 and arl["train/ambiguity.frame"] > 0
    assert 0.0 <= arl["train/arl.precision_tv"] <= 1.0 and 0.0 < arl["train/arl.recall_tv"] <= 1.0
    saved = torch.load(result.run_dir / "best_model.pt", weights_only=True)
    assert any(k.startswith("plugins.arl.peer.") for k in saved["model"])
    # the paper's Fig. 4: s and u of positive vs unpaired pairs at the last epoch start, uploaded to MLflow
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    logged = {f.path for f in client.list_artifacts(result.run_id, "distributions")}
    assert logged == {"distributions/arl.similarity.json", "distributions/arl.uncertainty.json"}
    for name in ("similarity", "uncertainty"):
        record = json.loads((result.run_dir / "distributions" / f"arl.{name}.json").read_text())
        assert record["epoch"] == 2 and set(record["series"]) == {"positive", "unpaired"}
        assert all(sum(s["counts"]) == s["n"] > 0 for s in record["series"].values())
    assert json.loads((result.run_dir / "distributions" / "arl.similarity.json").read_text())["series"]["positive"]["mean"] \
        == pytest.approx(arl["train/arl.tau_s"], abs=1e-5)  # tau_s by the rule: the mean s of the positive pairs


@pytest.mark.slow
def test_learns_with_random_members_first_and_not_with_hardest_members_from_the_first_step(tiny_root, tmp_path):
    """The triplets' hardest members from the first step left ARL at chance (its loss fell, retrieval did not
    improve); random members first, as GMMFormer's triplet, let it learn (docs/arl.md)."""
    def sumr(start: int) -> list[float]:
        raw = arl_raw(tiny_root, tmp_path, warmup_epochs=1)
        raw["train"]["epochs"] = 4
        raw["losses"]["ambiguity"]["hard_negative_start_epoch"] = start
        return val_sumr_by_epoch(raw, tmp_path / f"start{start}")

    scheduled, hardest = sumr(5), sumr(0)
    assert scheduled[-1] > scheduled[0] + 10  # learns (163.7 -> 185.5 when written)
    assert max(hardest) < scheduled[-1] - 20  # 150.8, 141.1, 142.7, 141.1 when written
