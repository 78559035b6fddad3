"""A config that extends others: merge rules, unset, names, errors, and the shipped configs built this way."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from prvrlab.platform.config import EXTENDS_DEPTH, ConfigError, flatten, load_config, load_raw, validate

CONFIGS = Path(__file__).resolve().parents[2] / "configs"

PARENT = {
    "name": "parent",
    "model": {"name": "gmmformer", "hidden_size": 32, "sigmas": [0.5, 1.0, 5.0]},
    "losses": {
        "clip_triplet": {"loss": "triplet", "weight": 1.0, "branch": "clip", "margin": 0.1},
        "clip_nce": {"loss": "infonce", "weight": 0.02, "branch": "clip"},
    },
    "train": {"epochs": 2, "lr": 1e-3},
    "eval": {"final_splits": ["val"]},
}


def write(path: Path, raw: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(raw))
    return path


def test_a_child_merges_mappings_key_by_key_and_replaces_everything_else(tmp_path):
    write(tmp_path / "parent.yaml", PARENT)
    child = write(tmp_path / "child.yaml", {
        "extends": "parent.yaml",
        "model": {"sigmas": [1.0]},  # a list replaces the parent's list
        "losses": {"clip_nce": {"weight": 0.5}, "frame_nce": {"loss": "infonce", "weight": 0.1, "branch": "frame"}},
        "train": {"lr": 5e-4},
    })
    expected = copy.deepcopy(PARENT)
    expected["name"] = "child"  # never inherited: the file's stem
    expected["model"]["sigmas"] = [1.0]
    expected["losses"]["clip_nce"]["weight"] = 0.5
    expected["losses"]["frame_nce"] = {"loss": "infonce", "weight": 0.1, "branch": "frame"}
    expected["train"]["lr"] = 5e-4
    assert load_raw(child) == expected
    assert load_config(child).to_dict() == validate(expected).to_dict()


def test_a_child_keeps_its_own_name(tmp_path):
    write(tmp_path / "parent.yaml", PARENT)
    child = write(tmp_path / "child.yaml", {"extends": "parent.yaml", "name": "mine"})
    assert load_config(child).name == "mine"


def test_naming_another_backbone_or_loss_replaces_the_parents_mapping(tmp_path):
    write(tmp_path / "parent.yaml", PARENT)
    child = write(tmp_path / "child.yaml", {
        "extends": "parent.yaml",
        "model": {"name": "mssl", "hidden_size": 16},  # gmmformer's sigmas must not leak into mssl
        "losses": {"clip_nce": {"loss": "triplet", "branch": "clip"}},  # infonce's weight is not kept
    })
    raw = load_raw(child)
    assert raw["model"] == {"name": "mssl", "hidden_size": 16}
    assert raw["losses"]["clip_nce"] == {"loss": "triplet", "branch": "clip"}
    assert raw["losses"]["clip_triplet"] == PARENT["losses"]["clip_triplet"]
    assert load_config(child).backbone == "mssl"


def test_parents_merge_left_to_right_and_chains_resolve(tmp_path):
    write(tmp_path / "base" / "grand.yaml", PARENT)
    write(tmp_path / "base" / "parent.yaml", {"extends": "grand.yaml", "train": {"epochs": 3, "lr": 2e-3}})
    write(tmp_path / "parts" / "a.yaml", {"train": {"epochs": 4}, "eval": {"final_splits": ["val", "test"]}})
    write(tmp_path / "parts" / "b.yaml", {"train": {"epochs": 5}})
    child = write(tmp_path / "child.yaml", {"extends": ["base/parent.yaml", "parts/a.yaml", "parts/b.yaml"]})
    raw = load_raw(child)
    assert raw["train"] == {"epochs": 5, "lr": 2e-3}  # grand < parent < a < b
    assert raw["eval"] == {"final_splits": ["val", "test"]}
    assert raw["model"] == PARENT["model"]


def test_unset_removes_inherited_keys_before_the_child_merges(tmp_path):
    write(tmp_path / "parent.yaml", PARENT)
    child = write(tmp_path / "child.yaml", {
        "extends": "parent.yaml",
        "unset": ["losses.clip_nce", "model.sigmas"],
        "losses": {"clip_triplet": {"margin": 0.3}},
    })
    raw = load_raw(child)
    assert set(raw["losses"]) == {"clip_triplet"}
    assert raw["losses"]["clip_triplet"]["margin"] == 0.3
    assert "sigmas" not in raw["model"]
    assert load_config(child).model["sigmas"] == validate({**PARENT, "model": {"name": "gmmformer"}}).model["sigmas"]


@pytest.mark.parametrize(
    ("child", "message"),
    [
        ({"extends": "missing.yaml"}, r"child.yaml: extends: file not found: missing.yaml"),
        ({"extends": 3}, r"child.yaml: extends: expected a path to a config YAML, got 3"),
        ({"extends": []}, r"extends: expected a path to a config YAML or a list of them"),
        ({"unset": ["losses.clip_nce"]}, r"child.yaml: unset: only a config that extends another"),
        ({"extends": "parent.yaml", "unset": "losses.clip_nce"}, r"unset: expected a list of dotted keys"),
        ({"extends": "parent.yaml", "unset": ["losses.clip_nec"]},
         r"unset: losses.clip_nec: the parent config has no 'clip_nec' in losses \(did you mean 'clip_nce'\?\)"),
        ({"extends": "parent.yaml", "unset": ["train.lr.x"]}, r"unset: train.lr.x: the parent config has no 'x'"),
    ],
)
def test_bad_extends_and_unset_name_the_file_and_key(tmp_path, child, message):
    write(tmp_path / "parent.yaml", PARENT)
    path = write(tmp_path / "child.yaml", child)
    with pytest.raises(ConfigError, match=message):
        load_config(path)


def test_a_cycle_and_a_chain_too_deep_are_refused(tmp_path):
    write(tmp_path / "a.yaml", {"extends": "b.yaml", **PARENT})
    write(tmp_path / "b.yaml", {"extends": "a.yaml"})
    with pytest.raises(ConfigError, match=r"extends: a cycle: a.yaml -> b.yaml -> a.yaml"):
        load_config(tmp_path / "a.yaml")
    write(tmp_path / "c0.yaml", PARENT)
    for i in range(1, EXTENDS_DEPTH + 1):
        write(tmp_path / f"c{i}.yaml", {"extends": f"c{i - 1}.yaml"})
    load_config(tmp_path / f"c{EXTENDS_DEPTH - 1}.yaml")  # the deepest chain allowed
    with pytest.raises(ConfigError, match=f"more than {EXTENDS_DEPTH - 1} configs deep"):
        load_config(tmp_path / f"c{EXTENDS_DEPTH}.yaml")


def test_a_parent_is_only_read_as_yaml(tmp_path):
    """A parent with a Python tag is refused by the safe loader; nothing in it runs."""
    (tmp_path / "parent.yaml").write_text("model: !!python/object/apply:os.system ['touch pwned']\n")
    path = write(tmp_path / "child.yaml", {"extends": "parent.yaml"})
    with pytest.raises(ConfigError, match=r"parent.yaml: not valid YAML"):
        load_config(path)
    assert not (tmp_path / "pwned").exists()


def test_overrides_apply_after_the_merge_and_validate_refuses_an_unresolved_extends(tmp_path):
    write(tmp_path / "parent.yaml", PARENT)
    child = write(tmp_path / "child.yaml", {"extends": "parent.yaml", "train": {"lr": 5e-4}})
    assert load_config(child, {"train.lr": 1e-5}).train.lr == 1e-5
    with pytest.raises(ConfigError, match="extends/unset: resolved when a config file is loaded"):
        validate({"extends": "parent.yaml", **PARENT})


def test_a_search_spec_may_name_a_config_that_extends(tmp_path):
    from prvrlab.platform.search.spec import load_search_spec

    write(tmp_path / "parent.yaml", PARENT)
    write(tmp_path / "child.yaml", {"extends": "parent.yaml", "train": {"lr": 5e-4}})
    spec = write(tmp_path / "spec.yaml", {
        "name": "s", "base_config": "child.yaml", "budget": {"trials": 2},
        "space": {"losses.clip_nce.weight": {"loguniform": [0.01, 0.1]}},
    })
    loaded = load_search_spec(spec)
    assert loaded.base_raw["train"]["lr"] == 5e-4
    assert loaded.base_raw["name"] == "child"
    assert "extends" not in loaded.base_raw


# ---------------------------------------------------------------- the shipped configs built this way


def resolved(name: str) -> dict:
    """The config's flattened settings (its own ``published`` row left out: tests/platform/test_published.py)."""
    return without_published(flatten(load_config(CONFIGS / f"{name}.yaml").to_dict()))


def without_published(flat: dict) -> dict:
    return {k: v for k, v in flat.items() if not k.startswith("published.")}


@pytest.mark.parametrize("dataset", ["tvr", "activitynet", "charades"])
@pytest.mark.parametrize("backbone", ["ice_base", "gmmformer", "mssl"])
def test_ice_configs_are_their_backbone_plus_the_papers_ice_values(backbone, dataset):
    """Against the values written out here by hand (the paper's g = 8, threshold 0.4, 25% shuffled), with the
    triplet margin and hard-negative epoch of the backbone config's own first triplet term."""
    raw = load_raw(CONFIGS / f"{backbone}_{dataset}.yaml")
    triplet = next(t for t in raw["losses"].values() if t["loss"] == "triplet")
    margin, start = triplet["margin"], triplet["hard_negative_start_epoch"]
    branches = ({"moment_branch": "moment", "video_branch": "video"} if backbone == "ice_base"
                else {"moment_branch": "clip", "video_branch": "frame"})
    raw["name"] = f"{backbone}_ice_{dataset}"
    raw["plugins"] = {"ice": {"ice": True, "irm": True, "tcp": True, "threshold": 0.4, "groups": 8,
                              "shuffle_ratio": 0.25, "tcp_levels": "video" if backbone == "mssl" else "both",
                              **branches}}
    raw["losses"].update(
        ice_corr={"loss": "ice_corr", "weight": 1.0, "margin": margin, "nce_weight": 0.04,
                  "hard_negative_start_epoch": start},
        ice_irm={"loss": "ice_irm", "weight": 1.0, "neg": True, "red": True, "margin": margin,
                 "nce_weight": 0.04, "hard_negative_start_epoch": start},
        ice_tcp={"loss": "ice_tcp", "weight": 1.0},
    )
    assert resolved(f"{backbone}_ice_{dataset}") == without_published(flatten(validate(raw).to_dict()))


@pytest.mark.parametrize("backbone", ["mssl", "gmmformer"])
@pytest.mark.parametrize("dataset", ["tvr", "activitynet"])
def test_ral_configs_are_the_official_backbone_recipe_plus_ral(backbone, dataset):
    """Every value of <backbone>_<dataset>.yaml is kept; RAL adds its plug-in and the official code's weights."""
    base, ral = resolved(f"{backbone}_{dataset}"), resolved(f"{backbone}_ral_{dataset}")
    assert ral["name"] == f"{backbone}_ral_{dataset}"
    assert {k: v for k, v in ral.items() if k in base and k != "name"} == {k: v for k, v in base.items() if k not in ("name", "plugins")}
    assert ral["losses.ral_da.weight"] == 2.5e-4 and ral["losses.ral_pm.weight"] == 4.0e-3
    assert ral["plugins.ral.num_proxies"] == 6 and ral["plugins.ral.msra"] and ral["plugins.ral.csa"]
    official = resolved(f"gmmformer_v2_ral_{dataset}")  # the RAL settings of the official (v2) recipe
    for key in ral:
        if key.startswith(("plugins.ral.", "losses.ral_")):
            assert ral[key] == official[key], key


def test_a_term_naming_another_loss_replaces_a_parents_term_named_after_its_loss(tmp_path):
    parent = copy.deepcopy(PARENT)
    parent["losses"]["query_diverse"] = {"weight": 0.003, "branch": "clip", "alpha": 32.0, "delta": 0.2}  # loss: its name
    write(tmp_path / "parent.yaml", parent)
    term = {"loss": "infonce", "weight": 0.05, "branch": "clip"}
    child = write(tmp_path / "child.yaml", {"extends": "parent.yaml", "losses": {"query_diverse": term}})
    raw = load_raw(child)
    assert raw["losses"]["query_diverse"] == term  # query_diverse's alpha and delta are not infonce's
    assert raw["losses"]["clip_nce"] == PARENT["losses"]["clip_nce"]
    assert load_config(child).losses["query_diverse"]["loss"] == "infonce"


def test_a_term_naming_the_loss_its_parent_is_named_after_merges(tmp_path):
    parent = copy.deepcopy(PARENT)
    parent["losses"]["query_diverse"] = {"weight": 0.003, "branch": "clip", "alpha": 32.0, "delta": 0.2}
    write(tmp_path / "parent.yaml", parent)
    child = write(tmp_path / "child.yaml", {
        "extends": "parent.yaml",
        "losses": {"query_diverse": {"loss": "query_diverse", "delta": 0.3}, "clip_nce": {"weight": 0.5}},
    })
    raw = load_raw(child)
    expected = {**parent["losses"]["query_diverse"], "loss": "query_diverse", "delta": 0.3}
    assert raw["losses"]["query_diverse"] == expected  # the same loss: key by key
    assert raw["losses"]["clip_nce"] == {**PARENT["losses"]["clip_nce"], "weight": 0.5}  # no loss: named, kept
    assert load_config(child).losses["query_diverse"]["alpha"] == 32.0
