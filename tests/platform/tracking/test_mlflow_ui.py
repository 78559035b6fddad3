"""What the MLflow UI shows on first open: training experiments, short run names, the dataset input."""

from __future__ import annotations

import json
import shutil

import pytest

from prvrlab.platform.search.names import ablation_run_name, compact, search_run_name, short_keys
from prvrlab.platform.tracking.store import EXPERIMENT_KIND_TAG, TRAINING_KIND, Tracker


def test_new_experiments_are_model_training_experiments(tmp_path):
    tracker = Tracker(f"sqlite:///{tmp_path / 'm.db'}", "exp")
    exp = tracker.client.get_experiment(tracker.experiment_id)
    assert exp.tags[EXPERIMENT_KIND_TAG] == "custom_model_development" == TRAINING_KIND


def test_an_existing_experiment_gets_the_kind_unless_it_has_one(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'm.db'}"
    client = MlflowClient(tracking_uri=uri)
    plain = client.create_experiment("old", artifact_location=(tmp_path / "a").as_uri())
    chosen = client.create_experiment("genai", artifact_location=(tmp_path / "b").as_uri(), tags={EXPERIMENT_KIND_TAG: "genai_development"})
    Tracker(uri, "old")
    Tracker(uri, "genai")
    assert client.get_experiment(plain).tags[EXPERIMENT_KIND_TAG] == TRAINING_KIND
    assert client.get_experiment(chosen).tags[EXPERIMENT_KIND_TAG] == "genai_development"  # the user's choice stays


def test_the_kind_is_one_the_installed_ui_knows():
    """The value must be one of the MLflow UI's experiment kinds (read from the installed JS bundle)."""
    import mlflow

    from pathlib import Path

    bundle = Path(mlflow.__file__).parent / "server" / "js" / "build" / "static" / "js"
    mains = list(bundle.glob("main.*.js"))
    if not mains:
        pytest.skip("this mlflow build ships no UI bundle")
    text = mains[0].read_text(errors="replace")
    assert EXPERIMENT_KIND_TAG in text and f'CUSTOM_MODEL_DEVELOPMENT="{TRAINING_KIND}"' in text


@pytest.mark.parametrize(
    "value, text",
    [(3e-4, "3e-4"), (7.2548e-4, "7.3e-4"), (0.0015, "1.5e-3"), (0.0619, "0.062"), (0.05, "0.05"), (0.2, "0.2"), (12.34, "12"), (123.4, "123"), (-2.5, "-2.5"),
     (0.0, "0"), (128, "128"), (True, "true"), ([0.5, 1.0], "[0.5,1]"), ("x", "x"), (2.5e6, "2.5e6")],
)
def test_compact_values(value, text):
    assert compact(value) == text


def test_short_keys_drop_the_section_unless_two_keys_would_read_the_same():
    keys = ["train.lr", "losses.clip_nce.weight", "losses.query_diverse.delta", "model.dropout", "train.dropout", "plugins.ral.k"]
    assert short_keys(keys) == {
        "train.lr": "lr",
        "losses.clip_nce.weight": "clip_nce.weight",
        "losses.query_diverse.delta": "query_diverse.delta",
        "model.dropout": "model.dropout",
        "train.dropout": "train.dropout",
        "plugins.ral.k": "ral.k",
    }


def test_search_and_ablation_run_names():
    short = short_keys(["train.lr", "losses.clip_nce.weight", "model.num_gmm_blocks"])
    config = {"train.lr": 3e-4, "losses.clip_nce.weight": 0.05, "model.num_gmm_blocks": 5}
    assert search_run_name(3, config, short) == "trial 3 · lr=3e-4 clip_nce.weight=0.05 num_gmm_blocks=5"
    assert search_run_name(1, {}, short) == "trial 1"
    assert ablation_run_name("no_query_diverse", 1) == "no_query_diverse · seed 1"


def test_study_context_names_its_child_runs(tmp_path):
    from prvrlab.platform.search.study import StudyContext

    common = dict(name="s", study_dir=str(tmp_path), base_raw={}, metric="val/sumr", mode="max", workers=1,
                  cpus_per_worker=1.0, gpus_per_worker=0.0, tracking_uri="", experiment="e")
    search = StudyContext(kind="search", short_keys={"train.lr": "lr"}, **common)
    assert search.run_name(1, {"train.lr": 1e-3}) == "trial 1 · lr=1e-3"
    ablation = StudyContext(kind="ablation", cells={"full/seed2": {}}, **common)
    assert ablation.run_name(5, {"cell": "full/seed2"}) == "full · seed 2"


def test_dataset_input_describes_the_collection(tiny_root, tmp_path):
    from prvrlab.data.config import DataConfig
    from prvrlab.platform.tracking.datasets import dataset_of

    data = DataConfig(root=str(tiny_root), collection="synth", visual_feature="synth_feat")
    dataset = dataset_of(data)
    tracker = Tracker(f"sqlite:///{tmp_path / 'm.db'}", "exp")
    run_id = tracker.start_run("r")
    tracker.log_dataset(run_id, dataset)
    (inp,) = tracker.client.get_run(run_id).inputs.dataset_inputs
    logged = inp.dataset
    assert logged.name == "synth" and json.loads(logged.source) == {"uri": str(tiny_root)}
    profile = json.loads(logged.profile)
    captions = {s: (tiny_root / "TextData" / f"synth{s}.caption.txt").read_text().splitlines() for s in ("train", "val", "test")}
    for split, lines in captions.items():
        assert profile["splits"][split] == {"videos": len({ln.split()[0].split("#")[0] for ln in lines}), "queries": len(lines)}
    assert profile["visual_feature"] == "synth_feat"
    # the digest follows the data: a changed caption file changes it, the same data gives the same digest
    assert dataset_of(data).digest == logged.digest and len(logged.digest) == 12
    copy = tmp_path / "copy"
    shutil.copytree(tiny_root, copy)
    moved = DataConfig(root=str(copy), collection="synth", visual_feature="synth_feat")
    assert dataset_of(moved).digest == logged.digest  # same content elsewhere: same digest
    caption = copy / "TextData" / "synthtrain.caption.txt"
    caption.write_text(caption.read_text().replace(" ", "  ", 1))
    assert dataset_of(moved).digest != logged.digest
