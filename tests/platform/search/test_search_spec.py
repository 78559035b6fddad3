"""Search and ablation specs: validation before Ray starts, each error naming its key."""

from __future__ import annotations

import re
from pathlib import Path

import optuna
import pytest
import yaml

from prvrlab.platform.cli import main
from prvrlab.platform.config import ConfigError, load_config
from prvrlab.platform.search.spec import load_ablation_spec, load_search_spec, valid_keys

from train_helpers import small_raw

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def base(tmp_path, tiny_root) -> Path:
    path = tmp_path / "base.yaml"
    path.write_text(yaml.safe_dump(small_raw(tiny_root, tmp_path)))
    return path


def write_spec(tmp_path: Path, **fields) -> Path:
    spec = {"name": "s", "base_config": "base.yaml", "space": {"train.lr": {"loguniform": [1e-4, 1e-2]}}}
    spec.update(fields)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def test_defaults_and_fields(base, tmp_path):
    spec = load_search_spec(write_spec(tmp_path, budget={"trials": 4}, resources={"workers_per_trial": 1, "gpus_per_worker": 0.25}))
    assert (spec.metric, spec.mode, spec.trials, spec.sampler, spec.scheduler) == ("val/sumr", "max", 4, "tpe", "none")
    assert spec.resources.workers_per_trial == 1 and spec.resources.gpus_per_worker == 0.25
    ddp = load_search_spec(write_spec(tmp_path, resources={"workers_per_trial": 2, "gpus_per_worker": 1}))
    assert ddp.resources.workers_per_trial == 2 and ddp.resources.gpus_per_worker == 1
    assert spec.space[0].kind == "loguniform" and spec.space[0].args == (1e-4, 1e-2)


@pytest.mark.parametrize(
    "fields, needle",
    [
        ({"space": {"train.lrr": {"uniform": [0, 1]}}}, "'train.lrr' (did you mean 'train.lr'?)"),
        ({"space": {"losses.clip_nce.wieght": {"uniform": [0, 1]}}}, "'losses.clip_nce.wieght' (did you mean 'losses.clip_nce.weight'?)"),
        ({"space": {"train.lr": {"uniform": [0.1, 0.01]}}}, "space.train.lr.uniform: low must be < high"),
        ({"space": {"train.lr": {"loguniform": [0, 0.01]}}}, "space.train.lr.loguniform: a log range must be > 0"),
        ({"space": {"train.lr": {"choice": []}}}, "space.train.lr.choice: expected a non-empty list"),
        ({"space": {"train.lr": {"lognormal": [1, 2]}}}, "space.train.lr"),
        ({"space": {"train.epochs": {"int": [0, 3]}}}, "train.epochs = 0"),
        ({"space": {"losses.clip_nce.weight": {"uniform": [-1, 1]}}}, "losses.clip_nce.weight = -1"),
        ({"metric": "val/sumR"}, "metric: the trainer never reports 'val/sumR' (did you mean 'val/sumr'?)"),
        ({"mode": "maximum"}, "mode"),
        ({"scheduler": {"type": "ashaa"}}, "scheduler.type: unknown scheduler 'ashaa' (did you mean 'asha'?)"),
        ({"sampler": {"type": "tpee"}}, "sampler.type: unknown sampler 'tpee' (did you mean 'tpe'?)"),
        ({"overrides": {"train.epoch": 2}}, "overrides: unknown config key 'train.epoch' (did you mean 'train.epochs'?)"),
        ({"budgett": {"trials": 2}}, "unknown key 'budgett' (did you mean 'budget'?)"),
        ({"budget": {"trials": 0}}, "budget.trials"),
        ({"resources": {"workers_per_trial": 0}}, "resources.workers_per_trial"),
        ({"resources": {"gpus_per_worker": 1.5}}, "resources.gpus_per_worker"),
        ({"resources": {"workers_per_trial": 2, "gpus_per_worker": 0.5}}, "resources.gpus_per_worker: 0.5 with workers_per_trial: 2"),
        ({"base_config": "missing.yaml"}, "base_config: file not found: missing.yaml"),
        (
            {"space": {"losses.query_diverse.alpha": {"choice": [16.0], "when": {"losses.query_diverse.wait": 0}}}},
            "when: unknown config key 'losses.query_diverse.wait'",
        ),
        ({"sampler": {"type": "grid"}}, "the grid sampler needs 'grid' or 'choice' values"),
    ],
)
def test_bad_specs_name_the_key(base, tmp_path, fields, needle):
    with pytest.raises(ConfigError) as err:
        load_search_spec(write_spec(tmp_path, **fields))
    assert needle in str(err.value)
    assert "spec.yaml" in str(err.value)


def test_constructor_defaults_are_searchable(base, tmp_path):
    """A loss parameter absent from the base YAML (at its default) is still a valid key."""
    keys = valid_keys(load_config(base))
    assert "losses.query_diverse.alpha" in keys and "losses.clip_triplet.hard_negative_start_epoch" in keys
    spec = load_search_spec(write_spec(tmp_path, space={"losses.query_diverse.alpha": {"choice": [16.0, 32.0]}}))
    assert spec.space[0].key == "losses.query_diverse.alpha"


def test_conditional_parameter_is_sampled_only_when_its_condition_holds(base, tmp_path):
    space = {
        "losses.query_diverse.weight": {"choice": [0.0, 0.003]},
        "losses.query_diverse.delta": {"uniform": [0.1, 0.3], "when": {"losses.query_diverse.weight": 0.003}},
    }
    spec = load_search_spec(write_spec(tmp_path, space=space))
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    fn = spec.define_by_run()
    for _ in range(12):
        trial = study.ask()
        fn(trial)
        on = trial.params["losses.query_diverse.weight"] == 0.003
        assert ("losses.query_diverse.delta" in trial.params) == on
        study.tell(trial, 0.0)


def test_condition_must_come_after_its_key(base, tmp_path):
    space = {
        "losses.query_diverse.delta": {"uniform": [0.1, 0.3], "when": {"losses.query_diverse.weight": 0.003}},
        "losses.query_diverse.weight": {"choice": [0.0, 0.003]},
    }
    with pytest.raises(ConfigError, match="must be listed before"):
        load_search_spec(write_spec(tmp_path, space=space))


def test_grid_budget_is_the_grid_size(base, tmp_path):
    space = {"train.lr": {"grid": [1e-3, 1e-4]}, "losses.clip_nce.weight": {"choice": [0.01, 0.02, 0.05]}}
    spec = load_search_spec(write_spec(tmp_path, space=space, sampler={"type": "grid"}))
    assert spec.trials == 6 and spec.grid()["train.lr"] == [1e-3, 1e-4]


def test_ablation_spec_cells_and_errors(base, tmp_path):
    path = tmp_path / "abl.yaml"
    raw = {"name": "a", "base_config": "base.yaml", "variants": {"full": {}, "no_qd": {"losses.query_diverse.weight": 0}}, "seeds": [0, 1]}
    path.write_text(yaml.safe_dump(raw))
    spec = load_ablation_spec(path)
    assert spec.baseline == "full"
    assert list(spec.cells()) == ["full/seed0", "full/seed1", "no_qd/seed0", "no_qd/seed1"]
    assert spec.cells()["no_qd/seed1"] == {"losses.query_diverse.weight": 0, "train.seed": 1}
    raw["variants"]["bad"] = {"losses.query_divers.weight": 0}
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"variants.bad: unknown config key 'losses.query_divers.weight' \(did you mean"):
        load_ablation_spec(path)
    raw["variants"]["bad"] = {k: 0 for k in ("losses.clip_triplet.weight", "losses.frame_triplet.weight", "losses.clip_nce.weight", "losses.frame_nce.weight", "losses.query_diverse.weight")}
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match="variants.bad.*every weight is 0"):
        load_ablation_spec(path)


@pytest.mark.parametrize("spec", sorted(p.name for p in (REPO / "search_spaces").glob("*.yaml")))
def test_shipped_specs_are_valid(spec):
    path = REPO / "search_spaces" / spec
    if spec.startswith("ablation"):
        loaded = load_ablation_spec(path)
        assert len(loaded.cells()) >= 2
    else:
        loaded = load_search_spec(path)
        assert loaded.space


def test_cli_bad_spec_exits_2_naming_the_key(base, tmp_path, capsys):
    path = write_spec(tmp_path, space={"train.lrr": {"uniform": [0.1, 0.2]}})
    assert main(["search", str(path)]) == 2
    assert "train.lrr" in capsys.readouterr().err
    assert main(["ablate", str(tmp_path / "nope.yaml")]) == 2


@pytest.mark.parametrize(
    "condition, holds_for",
    [
        ({">": 0}, {0.001, 0.003}),
        ({"!=": 0.001}, {0.0, 0.003}),
        ([0.0, 0.003], {0.0, 0.003}),
        (0.001, {0.001}),
    ],
)
def test_condition_operators(base, tmp_path, condition, holds_for):
    space = {
        "losses.query_diverse.weight": {"choice": [0.0, 0.001, 0.003]},
        "losses.query_diverse.delta": {"uniform": [0.1, 0.3], "when": {"losses.query_diverse.weight": condition}},
    }
    spec = load_search_spec(write_spec(tmp_path, space=space))
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    fn = spec.define_by_run()
    seen = set()
    for _ in range(20):
        trial = study.ask()
        fn(trial)
        weight = trial.params["losses.query_diverse.weight"]
        seen.add(weight)
        assert ("losses.query_diverse.delta" in trial.params) == (weight in holds_for)
        study.tell(trial, 0.0)
    assert seen == {0.0, 0.001, 0.003}


def test_bad_condition_operator_names_the_key(base, tmp_path):
    space = {
        "losses.query_diverse.weight": {"choice": [0.0, 0.003]},
        "losses.query_diverse.delta": {"uniform": [0.1, 0.3], "when": {"losses.query_diverse.weight": {"=>": 0}}},
    }
    with pytest.raises(ConfigError, match=r"space.losses.query_diverse.delta.when.losses.query_diverse.weight"):
        load_search_spec(write_spec(tmp_path, space=space))


@pytest.mark.parametrize(
    "condition, named, closest",
    [
        ("at_patiense", "'at_patiense'", "'at_patience'"),
        ({"==": "oficial"}, "'oficial'", "'official'"),
        ({"!=": "at-patience"}, "'at-patience'", "'at_patience'"),
        (["official", "at_patince"], "'at_patince'", "'at_patience'"),
        ({"not_in": ["oficial"]}, "'oficial'", "'official'"),
    ],
)
def test_a_condition_on_a_value_its_key_is_not_searched_over_names_the_closest(base, tmp_path, condition, named, closest):
    """A typo in a ``when`` value would make the condition hold never (or always): refused at load."""
    space = {
        "train.early_stop": {"choice": ["official", "at_patience"]},
        "train.early_stop_patience": {"int": [2, 4], "when": {"train.early_stop": condition}},
    }
    with pytest.raises(ConfigError) as err:
        load_search_spec(write_spec(tmp_path, space=space))
    message = str(err.value)
    assert "spec.yaml: space.train.early_stop_patience.when.train.early_stop:" in message
    assert f"{named} is not a value 'train.early_stop' is searched over (did you mean {closest}?)" in message
    assert "searched values: 'official', 'at_patience'" in message


@pytest.mark.parametrize("condition, wrong", [(0.03, 0.03), ({"in": [0.0, 0.0025]}, 0.0025), ({"==": -1}, -1)])
def test_a_numeric_condition_value_names_the_nearest_searched_value(base, tmp_path, condition, wrong):
    choices = [0.0, 0.003, 0.01]
    closest = min(choices, key=lambda c: abs(c - wrong))
    space = {
        "losses.query_diverse.weight": {"choice": choices},
        "losses.query_diverse.delta": {"uniform": [0.1, 0.3], "when": {"losses.query_diverse.weight": condition}},
    }
    with pytest.raises(ConfigError) as err:
        load_search_spec(write_spec(tmp_path, space=space))
    assert f"{wrong!r} is not a value 'losses.query_diverse.weight' is searched over (did you mean {closest!r}?)" in str(err.value)


def test_order_conditions_and_keys_not_searched_are_not_checked_against_values(base, tmp_path):
    """``>`` compares with a threshold, not a value; a base-config key has no searched values to check against."""
    space = {
        "losses.query_diverse.weight": {"choice": [0.0, 0.003]},
        "losses.query_diverse.delta": {"uniform": [0.1, 0.3], "when": {"losses.query_diverse.weight": {">": 0.001}}},
        "losses.query_diverse.alpha": {"choice": [16.0, 32.0], "when": {"train.early_stop": "official"}},
    }
    spec = load_search_spec(write_spec(tmp_path, space=space))
    assert [p.key for p in spec.space] == list(space)


def test_a_batch_the_trials_workers_cannot_share_equally_is_refused_at_load(base, tmp_path):
    """Trials train with train.num_workers = resources.workers_per_trial: the base's batch size and every
    searched one must divide by it (the base alone, with one worker, validated)."""
    odd = {"overrides": {"train.batch_size": 15}}
    assert load_search_spec(write_spec(tmp_path, **odd)).resources.workers_per_trial == 1
    with pytest.raises(ConfigError, match=r"resources.workers_per_trial: 2: .*train.batch_size \(15\) must be divisible by train.num_workers \(2\)"):
        load_search_spec(write_spec(tmp_path, **odd, resources={"workers_per_trial": 2}))
    searched = {"space": {"train.batch_size": {"choice": [16, 15]}}, "resources": {"workers_per_trial": 2}}
    with pytest.raises(ConfigError, match=r"space.train.batch_size.*divisible by train.num_workers \(2\)"):
        load_search_spec(write_spec(tmp_path, **searched))
    spec = load_search_spec(write_spec(tmp_path, space={"train.batch_size": {"choice": [16, 32]}}, resources={"workers_per_trial": 2}))
    assert spec.resources.workers_per_trial == 2


def test_variant_names_mlflow_cannot_store_are_refused_at_load_and_by_check(base, tmp_path, capsys):
    """A variant's name is a param key (variant.<name>) and metric key (variant/<name>/mean) of the
    parent run: one MLflow refuses fails the spec (ablate --check exits 2 naming it), never the parent run."""
    from mlflow.exceptions import MlflowException
    from mlflow.utils.validation import MAX_ENTITY_KEY_LENGTH, _validate_metric_name, _validate_param_name

    def refused(name: str) -> bool:
        try:
            _validate_param_name(f"variant.{name}")
            _validate_metric_name(f"variant/{name}/mean")
        except MlflowException:
            return True
        return len(f"variant/{name}/mean") > MAX_ENTITY_KEY_LENGTH

    path = tmp_path / "abl.yaml"
    for name in ("qd+off", ".", "..", "v" * 240, "qd off:1", "no-qd_2", "..."):
        path.write_text(yaml.safe_dump({"name": "a", "base_config": "base.yaml", "variants": {"full": {}, name: {}}}))
        if refused(name):
            with pytest.raises(ConfigError, match=f"^{re.escape(f'{path}: variants.{name}: ')}"):
                load_ablation_spec(path)
            assert main(["ablate", str(path), "--check"]) == 2
            err = capsys.readouterr().err.strip()
            assert err.startswith(f"prvrlab: error: {path}: variants.{name}: ") and "\n" not in err
        else:
            assert name in load_ablation_spec(path).variants


def test_choice_and_condition_values_written_without_a_dot_are_numbers(base, tmp_path):
    """PyYAML reads 3e-3 (no dot) as the string '3e-3': a numeric key's choices and conditions take the
    number (a '>' condition had compared the string with 0 and ended the search after --check passed)."""
    path = tmp_path / "spec.yaml"
    path.write_text(
        "name: s\nbase_config: base.yaml\nsampler: {type: random, seed: 0}\nspace:\n"
        "  train.epochs: {choice: [1e0, 2]}\n"
        "  losses.query_diverse.weight: {choice: [0, 3e-3]}\n"
        "  losses.query_diverse.delta: {uniform: [0.1, 0.3], when: {losses.query_diverse.weight: {'>': 0}}}\n"
        "  losses.query_diverse.alpha: {choice: [16, 32], when: {losses.query_diverse.weight: 3e-3}}\n"
    )
    assert yaml.safe_load(path.read_text())["space"]["losses.query_diverse.weight"]["choice"][1] == "3e-3"
    spec = load_search_spec(path)
    params = {p.key: p for p in spec.space}
    assert params["losses.query_diverse.weight"].args == (0, 0.003)
    assert params["train.epochs"].args == (1, 2) and all(type(v) is int for v in params["train.epochs"].args)
    assert params["losses.query_diverse.alpha"].when == {"losses.query_diverse.weight": 0.003}
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    fn = spec.define_by_run()
    for _ in range(10):
        trial = study.ask()
        fn(trial)
        on = trial.params["losses.query_diverse.weight"] > 0
        assert ("losses.query_diverse.delta" in trial.params) == on == ("losses.query_diverse.alpha" in trial.params)
        study.tell(trial, 0.0)
    words = tmp_path / "words.yaml"  # a string key keeps its strings
    words.write_text("name: s\nbase_config: base.yaml\nspace:\n  model.window: {choice: [official, centred]}\n")
    assert load_search_spec(words).space[0].args == ("official", "centred")


def test_an_override_of_a_key_every_trial_samples_is_refused(base, tmp_path):
    """Every trial samples train.lr, so a value from overrides or --set would never be used (it had been
    accepted silently); a conditional key may keep one: its trials take it where the condition fails."""
    path = write_spec(tmp_path, overrides={"train.lr": 5e-4})
    with pytest.raises(ConfigError, match=r"space.train.lr: also set by overrides \(0.0005\), a value no trial"):
        load_search_spec(path)
    with pytest.raises(ConfigError, match=r"space.train.lr: also set by --set \(0.5\)"):
        load_search_spec(write_spec(tmp_path), extra_overrides={"train.lr": 0.5})
    space = {
        "losses.query_diverse.weight": {"choice": [0.0, 0.003]},
        "losses.query_diverse.delta": {"uniform": [0.1, 0.3], "when": {"losses.query_diverse.weight": 0.003}},
    }
    spec = load_search_spec(write_spec(tmp_path, space=space), extra_overrides={"losses.query_diverse.delta": 0.25})
    assert spec.overrides["losses.query_diverse.delta"] == 0.25


def test_an_ablation_refuses_seeds_past_train_seeds_range_and_a_variant_seed(base, tmp_path):
    path = tmp_path / "abl.yaml"
    raw = {"name": "a", "base_config": "base.yaml", "variants": {"full": {}}, "seeds": [0, 2**64]}
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"seeds\[1\]: must be below 2\*\*64"):
        load_ablation_spec(path)
    raw = {"name": "a", "base_config": "base.yaml", "variants": {"full": {}, "other": {"train.seed": 5}}, "seeds": [0]}
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"variants.other: train.seed: every variant runs each of the spec's seeds"):
        load_ablation_spec(path)


def test_a_grid_budget_past_the_grid_is_refused(base, tmp_path):
    """The grid sampler runs its points again past the grid (Optuna only warns, in study.log)."""
    space = {"train.lr": {"grid": [1e-3, 1e-4]}, "losses.clip_nce.weight": {"choice": [0.01, 0.02, 0.05]}}
    with pytest.raises(ConfigError, match=r"budget.trials: 9 is more than the grid's 6 points"):
        load_search_spec(write_spec(tmp_path, space=space, sampler={"type": "grid"}, budget={"trials": 9}))
    assert load_search_spec(write_spec(tmp_path, space=space, sampler={"type": "grid"}, budget={"trials": 4})).trials == 4


def test_conditions_that_never_hold_or_test_a_continuous_key_for_equality_are_refused(base, tmp_path):
    """Both had passed --check and left the conditional key unsampled in every trial."""
    continuous = {
        "train.lr": {"loguniform": [1e-4, 1e-2]},
        "losses.query_diverse.delta": {"uniform": [0.1, 0.3], "when": {"train.lr": 0.0005}},
    }
    with pytest.raises(ConfigError, match=r"when.train.lr: 'train.lr' is drawn from a continuous range"):
        load_search_spec(write_spec(tmp_path, space=continuous))
    ordered = {**continuous, "losses.query_diverse.delta": {"uniform": [0.1, 0.3], "when": {"train.lr": {">": 1e-3}}}}
    assert len(load_search_spec(write_spec(tmp_path, space=ordered)).space) == 2
    never = {"losses.query_diverse.delta": {"uniform": [0.1, 0.3], "when": {"train.epochs": 99}}}
    with pytest.raises(ConfigError, match=r"when.train.epochs: never holds: 'train.epochs' is not searched and is 8"):
        load_search_spec(write_spec(tmp_path, space=never))
    holds = {"losses.query_diverse.delta": {"uniform": [0.1, 0.3], "when": {"train.epochs": 8}}}
    assert load_search_spec(write_spec(tmp_path, space=holds)).space[0].when == {"train.epochs": 8}


def test_an_ablation_refuses_train_seed_in_its_overrides_or_set(base, tmp_path):
    path = tmp_path / "abl.yaml"
    raw = {"name": "a", "base_config": "base.yaml", "variants": {"full": {}}, "seeds": [0, 1], "overrides": {"train.seed": 7}}
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"overrides: train.seed: every variant runs each of the spec's seeds"):
        load_ablation_spec(path)
    del raw["overrides"]
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"--set: train.seed"):
        load_ablation_spec(path, extra_overrides={"train.seed": 7})


def test_a_quoted_integer_above_2_53_on_an_int_key_is_read_exactly():
    """It had gone through float: '9007199254740993' became 9007199254740992."""
    from typing import Optional

    from prvrlab.platform.search.spec import _as_number

    assert _as_number("9007199254740993", int) == 9007199254740993
    assert _as_number(" 12 ", Optional[int]) == 12
    assert _as_number("1e3", int) == 1000 and isinstance(_as_number("1e3", int), int)
    assert _as_number("3e-3", float) == 0.003 and _as_number("x", int) == "x"


def test_a_key_of_a_plugin_the_base_config_does_not_enable_says_so(tmp_path):
    """It had read "unknown config key 'plugins.ral.num_proxies' (did you mean 'train.num_workers'?)", while
    ``train --set`` of the same key enables the plug-in."""
    base = Path(__file__).resolve().parents[3] / "configs" / "gmmformer_synth.yaml"
    expected = ("unknown config key 'plugins.ral.num_proxies': plug-in 'ral' is not enabled in the base config, and a "
                "spec sets only the keys its base config has; use a base config that enables it (one that extends "
                "this one with plugins: {ral: {}})")
    for where, fields in (("space", {"space": {"plugins.ral.num_proxies": {"choice": [4, 6]}}}),
                          ("overrides", {"overrides": {"plugins.ral.num_proxies": 4},
                                         "space": {"train.lr": {"loguniform": [1e-4, 1e-3]}}})):
        path = tmp_path / f"{where}.yaml"
        path.write_text(yaml.safe_dump({"name": where, "base_config": str(base), "budget": {"trials": 2}, **fields}))
        with pytest.raises(ConfigError) as caught:
            load_search_spec(path)
        assert str(caught.value) == f"{path}: {where}: {expected}"
    ral = Path(__file__).resolve().parents[3] / "configs" / "gmmformer_ral_synth.yaml"
    path = tmp_path / "ral.yaml"
    path.write_text(yaml.safe_dump({"name": "ral", "base_config": str(ral), "budget": {"trials": 2},
                                    "space": {"plugins.ral.num_proxies": {"choice": [4, 6]}}}))
    assert load_search_spec(path).space[0].key == "plugins.ral.num_proxies"
