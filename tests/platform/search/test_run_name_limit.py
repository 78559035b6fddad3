"""Run names fit MLflow's store: its runs.name column holds 250 characters (PostgreSQL and strict MySQL refuse a
longer name), and a search over many keys (the shipped TVR specs sample 12) had made 264-273-character names."""

from __future__ import annotations

from pathlib import Path

import yaml

from prvrlab.platform.search.names import MORE, NAME_LIMIT, SEP, ablation_run_name, search_run_name, short_keys
from prvrlab.platform.tracking.store import RUN_NAME_LIMIT, Tracker

REPO = Path(__file__).resolve().parents[3]


def long_draw(keys: list[str]) -> dict:
    return {k: 0.012345 + i * 1e-3 for i, k in enumerate(keys)}  # values that print in full: 0.012, 0.013 ...


def test_a_many_key_search_name_keeps_whole_values_and_says_more():
    keys = list(yaml.safe_load((REPO / "search_spaces" / "gmmformer_v2_tvr.yaml").read_text())["space"])
    assert len(keys) >= 10
    short = short_keys(keys)
    draw = long_draw(keys)
    full = "trial 12" + SEP + " ".join(f"{short[k]}=" + f"{v:.2g}" for k, v in draw.items())
    assert len(full) > NAME_LIMIT  # the case the limit is for
    name = search_run_name(12, draw, short)
    assert len(name) <= NAME_LIMIT and name.startswith("trial 12" + SEP) and name.endswith(" " + MORE)
    shown = name[len("trial 12" + SEP):-len(" " + MORE)].split(" ")
    assert shown == [f"{short[k]}={v:.2g}" for k, v in list(draw.items())[: len(shown)]]  # a prefix, each whole
    assert len(shown) >= 3
    # one more value would not have fitted
    nxt = list(draw.items())[len(shown)]
    assert len(name[: -len(MORE)] + f"{short[nxt[0]]}={nxt[1]:.2g} " + MORE) > NAME_LIMIT


def test_a_short_search_name_is_unchanged():
    short = short_keys(["train.lr", "losses.clip_nce.weight"])
    assert search_run_name(3, {"train.lr": 3e-4, "losses.clip_nce.weight": 0.05}, short) == "trial 3 · lr=3e-4 clip_nce.weight=0.05"


def test_a_first_value_too_long_leaves_only_the_number():
    name = search_run_name(7, {"model.name": "x" * 300}, {"model.name": "name"})
    assert name == "trial 7" + SEP + MORE


def test_an_ablation_name_keeps_its_seed():
    name = ablation_run_name("v" * 400, 11)
    assert len(name) <= NAME_LIMIT and name.endswith(MORE + SEP + "seed 11")
    assert ablation_run_name("full", 1) == "full · seed 1"


def test_the_tracker_cuts_any_name_to_the_store_column(tmp_path):
    tracker = Tracker(f"sqlite:///{tmp_path / 'mlflow.db'}", "names")
    run_id = tracker.start_run("n" * 400)
    name = tracker.client.get_run(run_id).info.run_name
    assert len(name) == RUN_NAME_LIMIT and name.endswith("…") and name.startswith("n" * 249)
    tracker.client.set_terminated(run_id)
