"""Config validation: unknown keys, types, values, components, overrides."""

from pathlib import Path

import pytest
import yaml

from prvrlab.platform.config import (
    ConfigError,
    apply_overrides,
    flatten,
    load_config,
    parse_override,
    validate,
)
from prvrlab.registry import BACKBONES, PLUGINS

from config_helpers import base

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_validate(path):
    cfg = load_config(path)
    stem = path.stem.rsplit("_", 1)[0]  # <backbone>[_<plugin>...][_<what else it adds>]_<collection>
    for plugin in cfg.plugins:
        stem = stem.removesuffix(f"_{plugin}")
    longer = [name for name in BACKBONES.names() if len(name) > len(cfg.backbone) and stem.startswith(name)]
    assert (cfg.backbone == stem or stem.startswith(f"{cfg.backbone}_")) and not longer, "name it <backbone>_..."
    rest = stem[len(cfg.backbone):].strip("_").split("_")  # what else it adds: no plug-in it does not enable
    assert not set(rest) & set(PLUGINS.names()), f"{path.name} names a plug-in it does not enable"
    assert sum(spec["weight"] for spec in cfg.losses.values()) > 0


def test_valid_config_round_trips_through_yaml():
    cfg = validate(base())
    again = validate(yaml.safe_load(cfg.to_yaml()))
    assert again.to_dict() == cfg.to_dict()
    assert again.fingerprint() == cfg.fingerprint()


@pytest.mark.parametrize(
    "override, needle",
    [
        ({"train.lrr": 1e-3}, "'train.lrr' (did you mean 'lr'?)"),
        ({"trian.lr": 1e-3}, "(did you mean 'train'?)"),
        ({"model.hiden_size": 64}, "'model.hiden_size'"),
        ({"losses.clip_triplet.margn": 0.2}, "did you mean 'margin'?"),
        ({"losses.clip_nce.loss": "infonse"}, "did you mean 'infonce'?"),
        ({"model.name": "gmmformr"}, "did you mean 'gmmformer'?"),
    ],
)
def test_unknown_keys_and_names_suggest_the_closest(override, needle):
    with pytest.raises(ConfigError) as err:
        validate(apply_overrides(base(), override))
    assert needle in str(err.value)


@pytest.mark.parametrize(
    "override, needle",
    [
        ({"train.epochs": "ten"}, "train.epochs: expected an integer"),
        ({"train.epochs": 0}, "train.epochs must be a finite number > 0"),
        ({"train.lr": -1.0}, "train.lr must be a finite number > 0"),
        ({"train.lr": float("inf")}, "train.lr must be a finite number > 0"),
        ({"train.use_gpu": "yes"}, "train.use_gpu: expected true/false"),
        ({"data.resident": "yes"}, "data.resident: expected true/false"),
        ({"data.pin_memory": "auto"}, "data.pin_memory: 'auto' is not bool | None"),
        ({"train.checkpoint_activations": 1}, "train.checkpoint_activations: expected true/false"),
        ({"train.amp": "bf17"}, "train.amp"),
        ({"train.host_allocator": "kep"}, "train.host_allocator: 'kep' is not one of 'keep', 'system' (did you mean 'keep'?)"),
        ({"train.warmup_proportion": 1.5}, "train.warmup_proportion"),
        ({"losses.clip_nce.weight": -0.1}, "losses.clip_nce.weight must be >= 0"),
        ({"model.hidden_size": 1.5}, "model.hidden_size: expected an integer"),
        ({"losses.clip_nce.branch": "clp"}, "losses.clip_nce.branch: 'clp' is not a branch of backbone 'gmmformer' (did you mean 'clip'?)"),
        ({"model.sigmas": [0.5, -1.0]}, "model:"),
        ({"model.dropout": 1.5}, "model:"),
        ({"train.lr": float("nan")}, "train.lr: expected a number, got NaN"),
    ],
)
def test_bad_values_name_the_key(override, needle):
    with pytest.raises(ConfigError) as err:
        validate(apply_overrides(base(), override))
    assert needle in str(err.value)


def test_all_zero_weights_rejected():
    raw = apply_overrides(base(), {"losses.clip_triplet.weight": 0, "losses.clip_nce.weight": 0})
    with pytest.raises(ConfigError, match="every weight is 0"):
        validate(raw)


def test_int_accepted_where_float_expected_and_yaml_exponent_strings():
    cfg = validate(apply_overrides(base(), {"train.lr": "1e-3", "losses.clip_nce.weight": 1}))
    assert cfg.train.lr == pytest.approx(1e-3)
    assert isinstance(cfg.losses["clip_nce"]["weight"], float)


def test_parse_override_uses_yaml_types():
    assert parse_override("train.lr=1.0e-3") == ("train.lr", 1.0e-3)
    assert parse_override("train.use_gpu=true") == ("train.use_gpu", True)
    assert parse_override("model.sigmas=[1, .inf]") == ("model.sigmas", [1, float("inf")])
    with pytest.raises(ConfigError):
        parse_override("train.lr")


def test_overrides_reach_nested_keys_and_new_loss_terms():
    raw = apply_overrides(base(), {"losses.qd.loss": "query_diverse", "losses.qd.weight": 0.5})
    cfg = validate(raw)
    assert cfg.losses["qd"]["weight"] == 0.5
    assert "losses.qd.weight" in cfg.flat()


def test_flatten():
    assert flatten({"a": {"b": 1, "c": {"d": [1, 2]}}, "e": {}}) == {"a.b": 1, "a.c.d": [1, 2], "e": {}}


def test_missing_and_bad_files_are_named(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed")
    with pytest.raises(ConfigError, match="bad.yaml"):
        load_config(bad)
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text(yaml.safe_dump(apply_overrides(base(), {"train.bogus": 1})))
    with pytest.raises(ConfigError, match=r"wrong.yaml: unknown key 'train.bogus'"):
        load_config(wrong)


def test_fingerprint_ignores_tracking_but_not_hyperparameters():
    a = validate(base())
    b = validate(apply_overrides(base(), {"tracking.experiment": "other"}))
    c = validate(apply_overrides(base(), {"train.lr": 1e-3}))
    assert a.fingerprint() == b.fingerprint() != c.fingerprint()


# ---------------------------------------------------------------- plug-ins


def _ral_raw(**plugin) -> dict:
    return {
        "name": "ral",
        "model": {"name": "gmmformer_v2", "hidden_size": 32, "num_heads": 2},
        "plugins": {"ral": plugin},
        "losses": {
            "clip_triplet": {"loss": "triplet", "weight": 1.0, "branch": "clip"},
            "ral_da": {"loss": "ral_da", "weight": 2.5e-4},
            "ral_pm": {"loss": "ral_pm", "weight": 4e-3},
        },
    }


def test_plugins_section_is_validated_and_dotted():
    cfg = validate(_ral_raw(num_proxies=4, support="single"))
    assert {k: cfg.plugins["ral"][k] for k in ("num_proxies", "support")} == {"num_proxies": 4, "support": "single"}
    assert cfg.plugins["ral"]["msra"] is True and cfg.flat()["plugins.ral.csa"] is True  # defaults resolved
    assert cfg.flat()["plugins.ral.num_proxies"] == 4
    assert validate(apply_overrides(_ral_raw(), {"plugins.ral.num_proxies": 2})).plugins["ral"]["num_proxies"] == 2
    assert cfg.fingerprint() != validate(_ral_raw(num_proxies=2)).fingerprint()


def test_plugins_default_empty_keeps_old_fingerprint():
    raw = _ral_raw()
    del raw["plugins"]
    raw["losses"] = {"clip_triplet": raw["losses"]["clip_triplet"]}
    cfg = validate(raw)
    assert cfg.plugins == {} and "plugins" not in cfg.flat()
    assert validate({**raw, "plugins": {}}).fingerprint() == cfg.fingerprint()


@pytest.mark.parametrize(
    "plugin, match",
    [
        ({"num_proxie": 4}, r"plugins\.ral\.num_proxie.*did you mean 'num_proxies'"),
        ({"support": "all"}, r"plugins\.ral\.support"),
        ({"num_proxies": 0}, r"plugins\.ral: num_proxies"),
        ({"hidden_size": 4}, r"plugins\.ral\.hidden_size"),
    ],
)
def test_bad_plugin_params_are_named(plugin, match):
    with pytest.raises(ConfigError, match=match):
        validate(_ral_raw(**plugin))


def test_unknown_plugin_suggests_the_closest():
    raw = _ral_raw()
    raw["plugins"] = {"rall": {}}
    with pytest.raises(ConfigError, match="did you mean 'ral'"):
        validate(raw)


def test_ral_on_a_backbone_without_frame_branch_is_rejected():
    raw = _ral_raw()
    raw["model"] = {"name": "ice_base", "hidden_size": 32, "num_heads": 2}
    raw["losses"]["clip_triplet"]["branch"] = "moment"
    with pytest.raises(ConfigError, match=r"plugins\.ral: .*ice_base.*no 'frame' branch"):
        validate(raw)


def test_ral_losses_need_msra_enabled():
    with pytest.raises(ConfigError, match=r"losses\.ral_da: .*plugins\.ral"):
        validate(_ral_raw(msra=False))
    raw = _ral_raw()
    del raw["plugins"]
    with pytest.raises(ConfigError, match=r"losses\.ral_da: .*enabled: none"):
        validate(raw)
    raw = _ral_raw(msra=False)
    raw["losses"]["ral_da"]["weight"] = 0.0
    raw["losses"]["ral_pm"]["weight"] = 0.0
    assert validate(raw).plugins["ral"]["msra"] is False


def test_plugin_tokens_are_generic():
    from prvrlab.platform.config import plugin_tokens

    assert plugin_tokens(validate(_ral_raw())) == ["ral.msra", "ral.csa"]
    raw = _ral_raw(msra=False)
    del raw["losses"]["ral_da"], raw["losses"]["ral_pm"]
    assert plugin_tokens(validate(raw)) == ["ral.csa"]


@pytest.mark.parametrize(
    "override, needle",
    [
        ({"train.seed": -1}, "train.seed must be an integer in [0, 2**64), got -1"),
        ({"train.seed": 2**64}, f"train.seed must be an integer in [0, 2**64), got {2**64}"),
        ({"train.weight_decay": float("inf")}, "train.weight_decay must be a finite number >= 0, got inf"),
        ({"train.weight_decay": -0.1}, "train.weight_decay must be a finite number >= 0, got -0.1"),
        ({"train.cpus_per_worker": float("inf")}, "train.cpus_per_worker must be a finite number > 0, got inf"),
        ({"train.cpus_per_worker": 0}, "train.cpus_per_worker must be a finite number > 0, got 0.0"),
        ({"train.grad_clip": float("inf")}, "train.grad_clip must be a finite number >= 0 (0 disables clipping), got inf"),
    ],
)
def test_impossible_train_values_are_refused_naming_the_key(override, needle):
    with pytest.raises(ConfigError) as err:
        validate(apply_overrides(base(), override))
    assert needle in str(err.value)


def test_impossible_train_values_name_the_set_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(base()))
    with pytest.raises(ConfigError, match=r"^--set train\.seed: must be an integer in \[0, 2\*\*64\), got -1$"):
        load_config(path, {"train.seed": -1})


@pytest.mark.parametrize("batch_size, workers", [(65, 2), (1, 2), (16, 3), (128, 5)])
def test_a_batch_size_the_workers_cannot_share_equally_is_refused(batch_size, workers):
    assert batch_size % workers  # each worker would train batch_size // workers: not the batch_size logged
    with pytest.raises(ConfigError) as err:
        validate(apply_overrides(base(), {"train.batch_size": batch_size, "train.num_workers": workers}))
    assert str(err.value).startswith(
        f"train.batch_size ({batch_size}) must be divisible by train.num_workers ({workers})"
    ), err.value


@pytest.mark.parametrize("batch_size, workers", [(64, 2), (2, 2), (15, 3), (7, 1)])
def test_a_batch_size_the_workers_share_equally_is_accepted(batch_size, workers):
    cfg = validate(apply_overrides(base(), {"train.batch_size": batch_size, "train.num_workers": workers}))
    assert (cfg.train.batch_size // cfg.train.num_workers) * cfg.train.num_workers == batch_size


def _mlflow_refuses(key: str, *, metric: bool = False) -> bool:
    """Whether MLflow's own check refuses ``key`` as a param (or metric) key, or its length limit does."""
    from mlflow.exceptions import MlflowException
    from mlflow.utils.validation import MAX_ENTITY_KEY_LENGTH, _validate_metric_name, _validate_param_name

    try:
        (_validate_metric_name if metric else _validate_param_name)(key)
    except MlflowException:
        return True
    return len(key) > MAX_ENTITY_KEY_LENGTH


def test_loss_term_names_mlflow_cannot_store_or_dotted_are_refused_naming_the_term():
    """A term's name is part of the run's param keys (losses.<term>.*) and metric keys (train/<term>):
    one MLflow would refuse, or with a '.', fails validation (train --check), not the run it creates."""
    for term in ("clip+nce", "clip.nce", "a//b", "t" * 240, "x y", "a/b", "t:1", "clip_nce2"):
        raw = base()
        raw["losses"][term] = {"loss": "infonce", "weight": 0.5, "branch": "clip"}
        keys = [f"losses.{term}.{k}" for k in ("loss", "weight", "branch")]
        refused = "." in term or any(_mlflow_refuses(k) for k in keys) or _mlflow_refuses(f"train/{term}", metric=True)
        if refused:
            with pytest.raises(ConfigError) as err:
                validate(raw)
            assert str(err.value).startswith(f"losses.{term}: "), err.value
        else:
            flat = validate(raw).flat()
            assert set(keys) <= set(flat) and not any(_mlflow_refuses(k) for k in flat)
