"""Search and ablation specs: YAML -> validated dataclasses, before Ray starts.

A search spec names a base config, fixed ``overrides``, the metric and mode,
the budget, resources, scheduler, sampler and a ``space`` that maps dotted
config keys to distributions::

    space:
      train.lr: {loguniform: [1.0e-4, 3.0e-3]}
      losses.query_diverse.alpha: {choice: [16, 32, 64], when: {losses.query_diverse.weight: {">": 0}}}

Every key is checked against the base config (including constructor
parameters left at their default) and every distribution end is pushed
through :func:`prvrlab.platform.config.validate`, so a typo or an impossible
value is one :class:`ConfigError` naming the key.  Nothing here imports a
concrete model or loss: the valid keys come from the registries.
"""

from __future__ import annotations

import difflib
import functools
import itertools
import math
import re
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from prvrlab.checks import is_number
from prvrlab.conditions import CONDITION_OPS, condition_holds
from prvrlab.evaluation.metrics import METRIC_KEYS
from prvrlab.platform.config import (
    DATA_DERIVED,
    PLUGIN_DERIVED,
    SECTIONS,
    TOP_LEVEL,
    ConfigError,
    ExperimentConfig,
    apply_overrides,
    find_next_to,
    load_raw,
    mlflow_key_problem,
    validate,
    validate_overrides,
)
from prvrlab.platform.tracking.store import PARAM_MAX
from prvrlab.registry import BACKBONES, LOSSES, PLUGINS, RegistryError, did_you_mean, did_you_mean_key

DISTRIBUTIONS = ("loguniform", "uniform", "int", "choice", "grid")
SCHEDULERS = ("none", "asha")
SAFE_NAME = re.compile(r"[A-Za-z0-9_.-]+")  # a study name is a folder under results/search/
SAMPLERS = ("tpe", "random", "grid")
INT_PROBE_LIMIT = 64  # an int range this small has every value validated up front
ORDER_OPS = (">", ">=", "<", "<=")
CELL_HASH_TAG = "prvrlab.cell_hash."  # + cell, on an ablation's parent: the config hash this cell has in its latest submission

SEARCH_KEYS = (
    "name", "base_config", "overrides", "metric", "mode", "budget", "concurrency",
    "resources", "scheduler", "sampler", "max_retries", "space",
)
ABLATION_KEYS = (
    "name", "base_config", "overrides", "metric", "mode", "baseline", "variants", "seeds",
    "concurrency", "resources", "max_retries",
)


class StudyError(RuntimeError):
    """A study that cannot run as asked (nothing to resume, no GPU for GPU trials...)."""


@dataclass(frozen=True)
class SearchParam:
    """One searched config key: a distribution and an optional condition."""

    key: str
    kind: str  # one of DISTRIBUTIONS
    args: tuple[Any, ...]  # (low, high) or the choices
    when: dict[str, Any] = field(default_factory=dict)

    def suggest(self, trial: Any) -> Any:
        """Sample this parameter from an ``optuna.Trial``."""
        if self.kind == "loguniform":
            return trial.suggest_float(self.key, self.args[0], self.args[1], log=True)
        if self.kind == "uniform":
            return trial.suggest_float(self.key, self.args[0], self.args[1])
        if self.kind == "int":
            return trial.suggest_int(self.key, self.args[0], self.args[1])
        return trial.suggest_categorical(self.key, list(self.args))

    def probe_values(self) -> list[Any]:
        """Values whose configs are validated up front (every value of a small int range or a
        choice, the ends of other ranges)."""
        if self.kind == "int" and self.args[1] - self.args[0] < INT_PROBE_LIMIT:
            return list(range(self.args[0], self.args[1] + 1))
        return list(self.args)


@dataclass(frozen=True)
class Resources:
    """Resources of one trial: DDP workers, CPUs and (fractional) GPUs each."""

    workers_per_trial: int = 1
    cpus_per_worker: float | None = None  # None: an equal share of the cluster
    gpus_per_worker: float = 0.0  # 0.25 packs four one-worker trials per GPU
    reuse_workers: bool | None = None  # keep each slot's ranks alive across trials;
    # None (``auto``): decided when the study starts (``study.pooled_ranks``)
    placement_timeout_s: float = 60.0  # a worker group waiting longer fails its trial (retryable); a trial Tune
    # cannot place for longer, with none running, stops the study (search.placement)
    pack: int = 1  # reused pools: k trials' worker groups share one group's CPUs (k x concurrency trials at a time)


@dataclass(frozen=True)
class StudySpec:
    """What search and ablation specs share."""

    path: Path
    name: str
    base_config: Path
    base_raw: dict[str, Any]  # base config with ``overrides`` applied
    overrides: dict[str, Any]
    metric: str
    mode: str
    concurrency: int
    resources: Resources
    max_retries: int

    @property
    def slots(self) -> int:
        """Trials running at once: ``concurrency`` worker-group shares, ``resources.pack`` trials in each."""
        return self.concurrency * self.resources.pack

    @functools.cached_property
    def base(self) -> ExperimentConfig:
        """The validated base config (with the spec's overrides), validated once."""
        return validate(self.base_raw)


@dataclass(frozen=True)
class SearchSpec(StudySpec):
    """A validated hyperparameter search spec."""

    trials: int = 10
    time_limit_s: float | None = None
    scheduler: str = "none"
    grace_period: int = 1
    reduction_factor: float = 2.0
    sampler: str = "tpe"
    seed: int = 0
    space: tuple[SearchParam, ...] = ()

    def grid(self) -> dict[str, list[Any]]:
        """The full grid (grid sampler): key -> values."""
        return {p.key: list(p.args) for p in self.space}

    def define_by_run(self) -> "DefineByRun":
        """An Optuna define-by-run function: conditional keys are sampled only when their condition holds."""
        return DefineByRun(self.space, self.base.flat())


class DefineByRun:
    """Picklable define-by-run space (Tune saves the searcher with the experiment)."""

    def __init__(self, params: tuple[SearchParam, ...], base_flat: dict[str, Any]) -> None:
        self.params, self.base_flat = params, base_flat

    def __call__(self, trial: Any) -> None:
        """Suggest every parameter whose ``when`` holds for the values chosen so far (or the base config)."""
        chosen: dict[str, Any] = {}
        for p in self.params:
            if all(condition_holds(chosen.get(k, self.base_flat.get(k)), v) for k, v in p.when.items()):
                chosen[p.key] = p.suggest(trial)


def _check_condition(expected: Any, where: str, key_type: Any) -> None:
    if isinstance(expected, dict):
        if len(expected) != 1 or next(iter(expected)) not in CONDITION_OPS:
            raise ConfigError(
                f"{where}: a condition mapping takes exactly one of {', '.join(CONDITION_OPS)}, got {expected!r}"
            )
        ((op, value),) = expected.items()
        if op in ORDER_OPS and not is_number(value):
            raise ConfigError(f"{where}: '{op}' needs a number, got {value!r}")
        if op in ORDER_OPS and _base_types(key_type) - {int, float}:
            raise ConfigError(f"{where}: '{op}' compares numbers but the key is {key_type!r}")
        if op in ("in", "not_in") and not isinstance(value, list):
            raise ConfigError(f"{where}: '{op}' needs a list of values, got {value!r}")


def _named_values(expected: Any) -> list[Any]:
    """The values a ``when`` condition compares with for equality or membership (none for an order)."""
    if isinstance(expected, dict):
        ((op, value),) = expected.items()
        if op in ("in", "not_in"):
            return list(value)
        return [] if op in ORDER_OPS else [value]
    return list(expected) if isinstance(expected, list) else [expected]


def _closest_value(value: Any, allowed: tuple[Any, ...]) -> Any:
    """The allowed value nearest ``value``: by difference among numbers, else by spelling."""
    numbers = [c for c in allowed if is_number(c)]
    if is_number(value) and numbers:
        return min(numbers, key=lambda c: abs(c - value))
    return max(allowed, key=lambda c: difflib.SequenceMatcher(None, str(value), str(c)).ratio())


def _check_condition_values(expected: Any, where: str, condition_param: SearchParam) -> None:
    """Every value a condition names must be one its key is searched over (a ``choice`` / ``grid`` key):
    a condition on a value the key never takes would hold never (``==``, a value, ``in``) or always (``!=``,
    ``not_in``), whatever was meant."""
    allowed = condition_param.args
    for value in _named_values(expected):
        if not any(value == c for c in allowed):
            raise ConfigError(
                f"{where}: {value!r} is not a value '{condition_param.key}' is searched over "
                f"(did you mean {_closest_value(value, allowed)!r}?); searched values: {', '.join(repr(c) for c in allowed)}"
            )


INT_ENUMERATE_LIMIT = 100_000  # an int range this small is tried value by value against a condition


def _can_hold(param: SearchParam, expected: Any, unsampled: Any) -> bool:
    """Whether a value the searched ``param`` can take meets the condition ``expected`` (``unsampled``: the
    base value a conditional ``param`` keeps where it is not sampled).  A range is tried at its ends (an
    order test holds somewhere in it only if at one of them; equality is refused on a continuous range)."""
    values: list[Any] = [unsampled] if param.when else []
    if param.kind in ("choice", "grid"):
        values += list(param.args)
    elif param.kind == "int":
        low, high = int(param.args[0]), int(param.args[1])
        if high - low < INT_ENUMERATE_LIMIT:
            values += range(low, high + 1)
        elif isinstance(expected, dict) and next(iter(expected)) in ("!=", "not_in"):
            return True  # a few excluded values leave most of a range this wide
        else:
            values += [low, high, *(v for v in _named_values(expected) if is_number(v) and low <= v <= high)]
    else:
        values += list(param.args)
    return any(condition_holds(v, expected) for v in values)


def _base_types(annotation: Any) -> set[Any]:
    """The non-None types an annotation allows (``{Any}`` when unknown or not a plain type)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        out: set[Any] = set()
        for arg in typing.get_args(annotation):
            if arg is not type(None):
                out |= _base_types(arg)
        return out
    return {annotation} if annotation in (int, float, bool, str) else {Any}


def _as_number(value: Any, annotation: Any) -> Any:
    """A string naming a number (PyYAML reads ``3e-3``, without a dot, as the string '3e-3') as that number
    where ``annotation`` is a numeric key's; anything else unchanged."""
    kinds = _base_types(annotation)
    if not isinstance(value, str) or not kinds or not kinds <= {int, float}:
        return value
    if kinds == {int}:
        try:
            return int(value.strip())  # exactly: a float would round integers above 2^53
        except ValueError:
            pass
    try:
        number = float(value)
    except ValueError:
        return value
    return int(number) if kinds == {int} and number.is_integer() else number


def _condition_numbers(expected: Any, annotation: Any) -> Any:
    """A ``when`` condition with its values read by :func:`_as_number`."""
    if isinstance(expected, dict):
        return {op: _condition_numbers(value, annotation) for op, value in expected.items()}
    if isinstance(expected, list):
        return [_as_number(value, annotation) for value in expected]
    return _as_number(expected, annotation)


def key_annotation(cfg: ExperimentConfig, key: str) -> Any:
    """The declared type of a dotted config key: a section field or a registered constructor
    parameter (``Any`` when unknown)."""
    parts = key.split(".")
    try:
        if len(parts) == 2 and parts[0] in SECTIONS:
            return typing.get_type_hints(SECTIONS[parts[0]]).get(parts[1], Any)
        if len(parts) == 2 and parts[0] == "model":
            param = BACKBONES.params(cfg.backbone).get(parts[1])
        elif len(parts) == 3 and parts[0] == "plugins":
            param = PLUGINS.params(parts[1]).get(parts[2])
        elif len(parts) == 3 and parts[0] == "losses":
            if parts[2] == "weight":
                return float
            param = LOSSES.params(cfg.losses[parts[1]]["loss"]).get(parts[2])
        else:
            return Any
    except (RegistryError, KeyError):
        return Any
    return param.annotation if param is not None else Any


def is_integer_key(cfg: ExperimentConfig, key: str) -> bool:
    """Whether ``key`` only takes integers (``int`` or ``int | None``)."""
    return _base_types(key_annotation(cfg, key)) == {int}


@dataclass(frozen=True)
class AblationSpec(StudySpec):
    """A validated ablation spec: variants x seeds."""

    baseline: str = ""
    variants: dict[str, dict[str, Any]] = field(default_factory=dict)
    seeds: tuple[int, ...] = (0,)

    def cells(self) -> dict[str, dict[str, Any]]:
        """Cell key ('<variant>/seed<k>') -> overrides, baseline first."""
        out: dict[str, dict[str, Any]] = {}
        order = [self.baseline] + [v for v in self.variants if v != self.baseline]
        for variant, seed in itertools.product(order, self.seeds):
            out[f"{variant}/seed{seed}"] = {**self.variants[variant], "train.seed": seed}
        return out

    def cell_labels(self, cell: str) -> tuple[str, int]:
        """'<variant>/seed<k>' -> (variant, k)."""
        variant, seed = cell.rsplit("/seed", 1)
        return variant, int(seed)


# ---------------------------------------------------------------- key checks


def valid_keys(cfg: ExperimentConfig) -> list[str]:
    """Every settable dotted key of ``cfg``, including constructor parameters at their default."""
    keys = dict.fromkeys(cfg.flat())
    keys.update(dict.fromkeys(f"published.{f.name}" for f in fields(cfg.published)))
    for name in BACKBONES.params(cfg.backbone):
        if name not in DATA_DERIVED:
            keys[f"model.{name}"] = None
    for plugin in cfg.plugins:
        for name in PLUGINS.params(plugin):
            if name not in PLUGIN_DERIVED:
                keys[f"plugins.{plugin}.{name}"] = None
    for term, spec in cfg.losses.items():
        for name in LOSSES.params(spec["loss"]):
            keys[f"losses.{term}.{name}"] = None
        keys[f"losses.{term}.weight"] = None
    return list(keys)


def reported_metrics(cfg: ExperimentConfig) -> list[str]:
    """The metrics the training loop reports for ``cfg`` (what a spec may optimise): validation
    R@K, losses, and every metric an enabled component declares (``train/<component>.<name>``)."""
    from prvrlab.models.factory import build_system, declared_metrics, on_meta

    out = [f"val/{m}" for m in METRIC_KEYS] + ["train/loss", "best/sumr"]
    out += [f"train/{term}" for term, spec in cfg.losses.items() if spec["weight"] > 0]
    with on_meta():
        system = build_system(cfg.model, cfg.plugins, cfg.losses, video_dim=8, query_dim=8)
    return out + declared_metrics(system)


def unknown_key(key: str, cfg: ExperimentConfig, keys: list[str]) -> str:
    """Why ``key`` is not a key of ``cfg``: a parameter of a registered plug-in or loss term the config does not
    enable (``train --set`` would enable it; a spec's space cannot), else the closest valid key."""
    parts = key.split(".")
    if len(parts) == 3 and parts[0] == "plugins" and parts[1] in PLUGINS.names() and parts[1] not in cfg.plugins:
        if parts[2] in PLUGINS.params(parts[1]) and parts[2] not in PLUGIN_DERIVED:
            return (f"unknown config key '{key}': plug-in '{parts[1]}' is not enabled in the base config, and a "
                    f"spec sets only the keys its base config has; use a base config that enables it (one that "
                    f"extends this one with plugins: {{{parts[1]}: {{}}}})")
    hint = did_you_mean_key(key, keys)
    if not hint and len(parts) == 3 and parts[0] == "losses" and parts[1] not in cfg.losses:
        return (f"unknown config key '{key}': the base config has no loss term '{parts[1]}' "
                f"(its terms: {', '.join(cfg.losses) or 'none'}), and a spec sets only the keys its base config has")
    prefix = key.rpartition(".")[0]
    siblings = [k.rpartition(".")[2] for k in keys if k.rpartition(".")[0] == prefix] if prefix else []
    if not hint and siblings:  # nothing close: the keys it could have meant
        return f"unknown config key '{key}'; keys in {prefix}: {', '.join(siblings)}"
    return f"unknown config key '{key}'{hint}"


def check_override_keys(overrides: dict[str, Any], cfg: ExperimentConfig, where: str) -> None:
    """Every dotted key must exist in ``cfg``: an unknown one names the closest valid key, or else the
    error validating it gives (as ``train --set`` would: an unknown plug-in or loss with its closest)."""
    keys = valid_keys(cfg)
    for key, value in overrides.items():
        head = str(key).split(".", 1)[0]
        if head in (*SEARCH_KEYS, *ABLATION_KEYS) and head not in ("name", "overrides") and isinstance(key, str) and key not in keys:
            raise ConfigError(f"{where}: '{head}' is a key of the spec file, not of the config: set it in the spec")
        if not isinstance(key, str) or key not in keys:
            message = unknown_key(str(key), cfg, keys)
            if message == f"unknown config key '{key}'" and isinstance(key, str):  # no closest key to name
                validate_with(cfg.to_dict(), {key: value}, where)
            raise ConfigError(f"{where}: {message}")


def validate_with(raw: dict[str, Any], overrides: dict[str, Any], where: str) -> ExperimentConfig:
    """Validate ``raw`` with ``overrides`` applied; errors are prefixed with ``where``."""
    try:
        return validate(apply_overrides(raw, overrides))
    except ConfigError as exc:
        text = str(exc)
        raise ConfigError(text if text.startswith(f"{where}:") else f"{where}: {text}") from None


# ---------------------------------------------------------------- loading


def _mapping(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a mapping, got {value!r}")
    return value


def _number(value: Any, where: str, *, integer: bool = False, minimum: float | None = None, strict: bool = False) -> Any:
    if isinstance(value, str):
        try:
            value = float(value)  # YAML reads '1e-3' as a string
        except ValueError:
            pass
    if not is_number(value) or (integer and not float(value).is_integer()):
        raise ConfigError(f"{where}: expected {'an integer' if integer else 'a number'}, got {value!r}")
    if minimum is not None and (value <= minimum if strict else value < minimum):
        raise ConfigError(f"{where}: must be {'>' if strict else '>='} {minimum:g}, got {value!r}")
    return int(value) if integer else value


def _check_recordable(where: str, key: str, value: Any) -> None:
    """A parent-run param the report reads back whole (``space.*``, ``variant.*``, ``spec.overrides``):
    refused when MLflow would have to cut its text."""
    size = len(str(value))
    if size > PARAM_MAX:
        raise ConfigError(
            f"{where}: its text ({size:,} characters) exceeds MLflow's {PARAM_MAX:,}-character limit for the parent "
            f"run's param '{key}', which the report reads back whole; shorten it"
        )


def _check_keys(raw: dict[str, Any], valid: tuple[str, ...], where: str) -> None:
    for key in raw:
        if key not in valid:
            raise ConfigError(f"{where}: unknown key '{key}'{did_you_mean(str(key), valid)}; valid: {', '.join(valid)}")


_KIND_KEYS = {"search": "space", "ablate": "variants"}  # the command that runs a spec -> the key only its specs have


def _read_spec(path: str | Path, command: str) -> tuple[Path, dict[str, Any]]:
    """The spec file's raw mapping; a spec of the other kind, or an experiment config, is pointed to its command."""
    path = Path(path)
    raw = load_raw(path, what="spec file")
    for other, key in _KIND_KEYS.items():
        if other != command and key in raw and _KIND_KEYS[command] not in raw:
            raise ConfigError(f"{path}: this is a spec for 'prvrlab {other}' (it has '{key}'); run it with 'prvrlab {other} {path}'")
    config_keys = [str(k) for k in raw if k in (*TOP_LEVEL, "extends", "unset") and k != "name"]
    if config_keys and "base_config" not in raw:
        raise ConfigError(
            f"{path}: this looks like an experiment config ({', '.join(config_keys)}), not a spec; "
            f"train it with 'prvrlab train {path}', or name it as base_config in a spec"
        )
    return path, raw


def _common(path: Path, raw: dict[str, Any], extra_overrides: dict[str, Any] | None) -> dict[str, Any]:
    """Fields every spec has; ``extra_overrides`` (--set) are applied after the spec's own."""
    name = raw.get("name", path.stem)
    if not isinstance(name, str) or not SAFE_NAME.fullmatch(name) or name in (".", ".."):
        raise ConfigError(
            f"{path}: name: {name!r} is not a plain folder name; use letters, digits, '_', '.' and '-' "
            "(not '.' or '..')"
        )
    base_path = find_next_to(path, raw.get("base_config"), "base_config")
    base_raw = load_raw(base_path)
    spec_overrides, extra = _mapping(raw.get("overrides"), f"{path}: overrides"), extra_overrides or {}
    overrides = {**spec_overrides, **extra}
    try:
        plain = validate(base_raw)
    except ConfigError as exc:
        raise ConfigError(f"{path}: base_config {base_path}: {exc}") from None
    check_override_keys(spec_overrides, plain, f"{path}: overrides")
    _check_recordable(f"{path}: overrides", "spec.overrides", overrides)
    for key, value in extra.items():
        check_override_keys({key: value}, plain, f"--set {key}")
    try:
        base_raw = apply_overrides(base_raw, spec_overrides)
    except ConfigError as exc:
        raise ConfigError(f"{path}: overrides: {exc}") from None
    base = validate_overrides(base_raw, extra, f"{path}: overrides")
    base_raw = apply_overrides(base_raw, extra)

    metric = raw.get("metric", "val/sumr")
    metrics = reported_metrics(base)
    if metric not in metrics:
        raise ConfigError(
            f"{path}: metric: the trainer never reports '{metric}'{did_you_mean(str(metric), metrics)}; "
            f"reported: {', '.join(metrics)}"
        )
    mode = raw.get("mode", "max")
    if mode not in ("max", "min"):
        raise ConfigError(f"{path}: mode: expected 'max' or 'min', got {mode!r}")

    res_raw = _mapping(raw.get("resources"), f"{path}: resources")
    _check_keys(
        res_raw, ("workers_per_trial", "cpus_per_worker", "gpus_per_worker", "reuse_workers", "placement_timeout_s", "pack"), f"{path}: resources"
    )
    workers = _number(res_raw.get("workers_per_trial", base.train.num_workers), f"{path}: resources.workers_per_trial", integer=True, minimum=1)
    if workers != base.train.num_workers:  # every trial trains with train.num_workers = workers_per_trial
        validate_with(base_raw, {"train.num_workers": workers}, f"{path}: resources.workers_per_trial: {workers}")
    cpus = res_raw.get("cpus_per_worker", base.train.cpus_per_worker)
    if cpus is not None:
        cpus = float(_number(cpus, f"{path}: resources.cpus_per_worker", minimum=0, strict=True))
    gpus = float(_number(res_raw.get("gpus_per_worker", 1.0 if base.train.use_gpu else 0.0), f"{path}: resources.gpus_per_worker", minimum=0))
    if gpus > 1 and not float(gpus).is_integer():
        raise ConfigError(f"{path}: resources.gpus_per_worker: a fraction must be below 1, got {gpus!r}")
    if workers > 1 and 0 < gpus < 1:
        raise ConfigError(
            f"{path}: resources.gpus_per_worker: {gpus:g} with workers_per_trial: {workers} could put two ranks of one "
            "trial on one GPU, which NCCL refuses; give DDP trials whole GPUs (gpus_per_worker: 1), or pack "
            "one-worker trials with the fraction"
        )
    reuse = res_raw.get("reuse_workers", "auto")
    if reuse == "auto":
        reuse = None
    elif not isinstance(reuse, bool):
        raise ConfigError(f"{path}: resources.reuse_workers: expected true, false or auto, got {reuse!r}")
    pack = _number(res_raw.get("pack", 1), f"{path}: resources.pack", integer=True, minimum=1)
    if pack > 1 and (reuse is False or workers < 2):
        raise ConfigError(f"{path}: resources.pack: {pack} needs reused pools (resources.reuse_workers: true or auto) and workers_per_trial > 1")
    if pack > 1 and gpus > 0:
        raise ConfigError(
            f"{path}: resources.pack: {pack} packs CPU ranks only (NCCL refuses two ranks of a group on one GPU); "
            "pack one-worker trials on a GPU with a gpus_per_worker fraction"
        )
    timeout = float(_number(res_raw.get("placement_timeout_s", 60.0), f"{path}: resources.placement_timeout_s", minimum=0, strict=True))
    return {
        "path": path.resolve(),
        "name": name,
        "base_config": base_path,
        "base_raw": base_raw,
        "overrides": overrides,
        "metric": metric,
        "mode": mode,
        "concurrency": _number(raw.get("concurrency", 1), f"{path}: concurrency", integer=True, minimum=1),
        "resources": Resources(workers, cpus, gpus, reuse_workers=reuse, placement_timeout_s=timeout, pack=pack),
        "max_retries": _number(raw.get("max_retries", base.train.max_failures), f"{path}: max_retries", integer=True, minimum=0),
    }


def _param(path: Path, key: str, raw: Any, base_raw: dict[str, Any], keys: list[str], base: ExperimentConfig) -> SearchParam:
    where = f"{path}: space.{key}"
    if key not in keys:
        raise ConfigError(f"{path}: space: {unknown_key(key, base, keys)}")
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a mapping like {{loguniform: [low, high]}}, got {raw!r}")
    when = {k: _condition_numbers(v, key_annotation(base, str(k))) for k, v in _mapping(raw.get("when"), f"{where}.when").items()}
    kinds = [k for k in raw if k != "when"]
    if len(kinds) != 1 or kinds[0] not in DISTRIBUTIONS:
        bad = next((k for k in kinds if k not in DISTRIBUTIONS), None)
        hint = did_you_mean(str(bad), DISTRIBUTIONS) if bad else ""
        raise ConfigError(f"{where}: expected exactly one of {', '.join(DISTRIBUTIONS)} (plus optional 'when'), got {kinds}{hint}")
    kind = kinds[0]
    args = raw[kind]
    if kind in ("uniform", "loguniform") and is_integer_key(base, key):
        raise ConfigError(f"{where}.{kind}: '{key}' is an integer key; sample it with {{int: [low, high]}} or a choice")
    if kind in ("choice", "grid"):
        if not isinstance(args, list) or not args:
            raise ConfigError(f"{where}.{kind}: expected a non-empty list of values, got {args!r}")
        args = tuple(_as_number(value, key_annotation(base, key)) for value in args)
    else:
        if not isinstance(args, list) or len(args) != 2:
            raise ConfigError(f"{where}.{kind}: expected [low, high], got {args!r}")
        lo = _number(args[0], f"{where}.{kind}[0]", integer=kind == "int")
        hi = _number(args[1], f"{where}.{kind}[1]", integer=kind == "int")
        if lo >= hi:
            raise ConfigError(f"{where}.{kind}: low must be < high, got [{lo!r}, {hi!r}]")
        if kind == "loguniform" and lo <= 0:
            raise ConfigError(f"{where}.loguniform: a log range must be > 0, got [{lo!r}, {hi!r}]")
        args = (lo, hi)
    for cond_key, expected in when.items():
        if cond_key == key or (cond_key not in keys):
            raise ConfigError(f"{where}.when: {unknown_key(str(cond_key), base, keys)}")
        _check_condition(expected, f"{where}.when.{cond_key}", key_annotation(base, cond_key))
    param = SearchParam(key=key, kind=kind, args=args, when=dict(when))
    for value in param.probe_values():
        validate_with(base_raw, {key: value}, f"{where} = {value!r}")
    return param


def _component_of(key: str, flat: dict[str, Any]) -> type | None:
    """The registered class behind ``losses.<term>.<param>`` / ``plugins.<name>.<param>``, else None."""
    parts = key.split(".")
    if len(parts) != 3:
        return None
    if parts[0] == "losses" and flat.get(f"losses.{parts[1]}.loss") in LOSSES.names():
        return LOSSES.get(flat[f"losses.{parts[1]}.loss"])
    if parts[0] == "plugins" and parts[1] in PLUGINS.names():
        return PLUGINS.get(parts[1])
    return None


def _check_effective(path: Path, params: list[SearchParam], flat: dict[str, Any]) -> None:
    """Refuse a searched key its component reads only under another value of a key beside it
    (``Component.applies_when``): fixed elsewhere, or searched without a ``when`` on it."""
    searched = {p.key for p in params}
    for param in params:
        component = _component_of(param.key, flat)
        prefix, _, name = param.key.rpartition(".")
        for other, values in getattr(component, "applies_when", {}).get(name, {}).items():
            other_key = f"{prefix}.{other}"
            allowed = " or ".join(repr(v) for v in values)
            drawn_when = other_key in param.when and any(condition_holds(v, param.when[other_key]) for v in values)
            if other_key in searched and not drawn_when:
                raise ConfigError(
                    f"{path}: space.{param.key}: acts only when {other_key} is {allowed}, which is searched too; "
                    f"give it when: {{{other_key}: {values[0]!r}}} so it is drawn only then"
                )
            if other_key not in searched and flat.get(other_key) not in values:
                raise ConfigError(
                    f"{path}: space.{param.key}: has no effect: it acts only when {other_key} is {allowed}, and "
                    f"{other_key} is {flat.get(other_key)!r} in every trial; set {other_key}: {values[0]!r} in "
                    "the spec's overrides, or leave the key out"
                )


def _as_trials(common: dict[str, Any]) -> dict[str, Any]:
    """The base config as the trials train it: with ``train.num_workers`` = ``resources.workers_per_trial``."""
    return apply_overrides(common["base_raw"], {"train.num_workers": common["resources"].workers_per_trial})


def _check_overridden(path: Path, params: list[SearchParam], spec_overrides: dict[str, Any], extra: dict[str, Any]) -> None:
    """A key every trial samples (no ``when``) that ``overrides`` or ``--set`` also sets: that value would never
    be used.  A conditional key may have one (the value its trials take where the condition does not hold)."""
    for param in params:
        if param.when:
            continue
        for where, given in (("--set", extra), ("overrides", spec_overrides)):
            if param.key in given:
                raise ConfigError(
                    f"{path}: space.{param.key}: also set by {where} ({given[param.key]!r}), a value no trial would "
                    f"use: every trial samples {param.key}; remove it from {where} or from space"
                )


def load_search_spec(path: str | Path, extra_overrides: dict[str, Any] | None = None) -> SearchSpec:
    """Read and validate a search spec; raises ConfigError naming the file and key."""
    path, raw = _read_spec(path, "search")
    _check_keys(raw, SEARCH_KEYS, str(path))
    common = _common(path, raw, extra_overrides)
    base = validate(common["base_raw"])
    keys = valid_keys(base)
    trial_raw = _as_trials(common)

    space_raw = _mapping(raw.get("space"), f"{path}: space")
    if not space_raw:
        raise ConfigError(f"{path}: space: expected at least one searched key")
    params: list[SearchParam] = []
    flat = base.flat()  # what a key not searched is in every trial, as the sampler reads it (DefineByRun)
    for key, value in space_raw.items():
        _check_recordable(f"{path}: space.{key}", f"space.{key}", value)
        param = _param(path, str(key), value, trial_raw, keys, base)
        for cond_key, expected in param.when.items():
            if cond_key in space_raw and cond_key not in [p.key for p in params]:
                raise ConfigError(f"{path}: space.{key}.when: '{cond_key}' must be listed before '{key}'")
            searched = next((p for p in params if p.key == cond_key), None)
            where = f"{path}: space.{key}.when.{cond_key}"
            if searched is not None and searched.kind in ("choice", "grid"):
                _check_condition_values(expected, where, searched)
            elif searched is not None and searched.kind in ("uniform", "loguniform") and _named_values(expected):
                raise ConfigError(
                    f"{where}: '{cond_key}' is drawn from a continuous range, which an equality or membership test "
                    "(almost) never matches or always does; compare it with >, >=, < or <="
                )
            if searched is not None and not _can_hold(searched, expected, flat.get(cond_key)):
                unsampled = f" (or {flat.get(cond_key)!r} where it is not sampled)" if searched.when else ""
                raise ConfigError(
                    f"{where}: never holds: '{cond_key}' is searched over {searched.kind} {list(searched.args)}{unsampled}, "
                    f"and no value of it meets {expected!r}, so '{key}' would never be sampled"
                )
            elif searched is None and not condition_holds(flat.get(cond_key), expected):
                raise ConfigError(
                    f"{where}: never holds: '{cond_key}' is not searched and is {flat.get(cond_key)!r} in every trial, "
                    f"so '{key}' would never be sampled"
                )
        params.append(param)
    _check_overridden(path, params, _mapping(raw.get("overrides"), f"{path}: overrides"), extra_overrides or {})
    _check_effective(path, params, flat)

    budget = _mapping(raw.get("budget"), f"{path}: budget")
    _check_keys(budget, ("trials", "time_limit_s"), f"{path}: budget")
    sched = _mapping(raw.get("scheduler"), f"{path}: scheduler")
    _check_keys(sched, ("type", "grace_period", "reduction_factor"), f"{path}: scheduler")
    sched_type = sched.get("type", "none")
    if sched_type not in SCHEDULERS:
        raise ConfigError(f"{path}: scheduler.type: unknown scheduler {sched_type!r}{did_you_mean(str(sched_type), SCHEDULERS)}; known: {', '.join(SCHEDULERS)}")
    samp = _mapping(raw.get("sampler"), f"{path}: sampler")
    _check_keys(samp, ("type", "seed"), f"{path}: sampler")
    samp_type = samp.get("type", "tpe")
    if samp_type not in SAMPLERS:
        raise ConfigError(f"{path}: sampler.type: unknown sampler {samp_type!r}{did_you_mean(str(samp_type), SAMPLERS)}; known: {', '.join(SAMPLERS)}")

    grid_size = None
    if samp_type == "grid":
        for p in params:
            if p.kind not in ("grid", "choice"):
                raise ConfigError(f"{path}: space.{p.key}: the grid sampler needs 'grid' or 'choice' values, got '{p.kind}'")
            if p.when:
                raise ConfigError(f"{path}: space.{p.key}.when: conditional keys are not supported by the grid sampler")
        grid_size = math.prod(len(p.args) for p in params)
    trials = budget.get("trials", grid_size if grid_size is not None else 10)
    if grid_size is not None and _number(trials, f"{path}: budget.trials", integer=True, minimum=1) > grid_size:
        raise ConfigError(
            f"{path}: budget.trials: {trials} is more than the grid's {grid_size} points; the grid sampler would run "
            f"points again: leave budget.trials out (it defaults to the grid's size) or use a sampler that draws"
        )
    time_limit = budget.get("time_limit_s")
    epochs = base.train.epochs
    grace = _number(sched.get("grace_period", 1), f"{path}: scheduler.grace_period", integer=True, minimum=1)
    if sched_type == "asha" and grace > epochs:
        raise ConfigError(f"{path}: scheduler.grace_period: {grace} is more than train.epochs ({epochs})")
    return SearchSpec(
        **common,
        trials=_number(trials, f"{path}: budget.trials", integer=True, minimum=1),
        time_limit_s=None if time_limit is None else float(_number(time_limit, f"{path}: budget.time_limit_s", minimum=0, strict=True)),
        scheduler=sched_type,
        grace_period=grace,
        reduction_factor=float(_number(sched.get("reduction_factor", 2), f"{path}: scheduler.reduction_factor", minimum=1, strict=True)),
        sampler=samp_type,
        seed=_number(samp.get("seed", 0), f"{path}: sampler.seed", integer=True, minimum=0),
        space=tuple(params),
    )


def _refuse_seed(overrides: dict[str, Any], where: str) -> None:
    """An ablation's cells take their seeds from its ``seeds`` list (:meth:`AblationSpec.cells`): a
    ``train.seed`` set anywhere else would be ignored."""
    if "train.seed" in overrides:
        raise ConfigError(f"{where}: train.seed: every variant runs each of the spec's seeds; list them in seeds")


def load_ablation_spec(path: str | Path, extra_overrides: dict[str, Any] | None = None) -> AblationSpec:
    """Read and validate an ablation spec; every variant x seed config is validated now."""
    path, raw = _read_spec(path, "ablate")
    _check_keys(raw, ABLATION_KEYS, str(path))
    common = _common(path, raw, extra_overrides)
    _refuse_seed(extra_overrides or {}, f"{path}: --set")
    _refuse_seed(_mapping(raw.get("overrides"), f"{path}: overrides"), f"{path}: overrides")
    base = validate(common["base_raw"])
    variants_raw = _mapping(raw.get("variants"), f"{path}: variants")
    if not variants_raw:
        raise ConfigError(f"{path}: variants: expected at least one named variant")
    variants: dict[str, dict[str, Any]] = {}
    for name, overrides in variants_raw.items():
        where = f"{path}: variants.{name}"
        if not isinstance(name, str) or not name or "/" in name:
            raise ConfigError(f"{where}: a variant name must be a non-empty string without '/'")
        for key in (f"variant.{name}", f"variant/{name}/mean"):  # the parent run's param and metric keys
            problem = mlflow_key_problem(key)
            if problem:
                raise ConfigError(f"{where}: this variant name cannot be recorded in MLflow (key '{key}'): {problem}")
        _check_recordable(where, f"variant.{name}", overrides)
        overrides = _mapping(overrides, where)
        _refuse_seed(overrides, where)
        check_override_keys(overrides, base, where)
        validate_with(_as_trials(common), overrides, where)
        variants[name] = dict(overrides)
    baseline = raw.get("baseline", next(iter(variants)))
    if baseline not in variants:
        raise ConfigError(f"{path}: baseline: '{baseline}' is not a variant{did_you_mean(str(baseline), variants)}")
    seeds_raw = raw.get("seeds", [base.train.seed])
    if not isinstance(seeds_raw, list) or not seeds_raw:
        raise ConfigError(f"{path}: seeds: expected a non-empty list of integers, got {seeds_raw!r}")
    seeds = tuple(_number(s, f"{path}: seeds[{i}]", integer=True, minimum=0) for i, s in enumerate(seeds_raw))
    for i, seed in enumerate(seeds):
        if seed >= 2**64:  # train.seed's range (the cells had failed after the study folder was made)
            raise ConfigError(f"{path}: seeds[{i}]: must be below 2**64 (train.seed's range), got {seed!r}")
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"{path}: seeds: repeated seed in {list(seeds)}")
    longest = max(seeds, key=lambda s: len(str(s)))
    for name in variants:  # the parent's tag per cell '<variant>/seed<k>': the longest seed gives the longest key
        key = f"{CELL_HASH_TAG}{name}/seed{longest}"
        problem = mlflow_key_problem(key)
        if problem:
            raise ConfigError(f"{path}: variants.{name}: this variant name cannot be recorded in MLflow (key '{key}'): {problem}")
    return AblationSpec(**common, baseline=baseline, variants=variants, seeds=seeds)

