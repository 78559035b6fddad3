"""Experiment configuration: YAML -> validated, fully resolved, typed config.

Everything is checked once, at the edge, before Ray starts: unknown keys (with
the closest valid key suggested), wrong types, impossible values, unknown
component names, the keyword-only parameters of the chosen backbone, plug-ins
and losses, and what each loss and plug-in needs from the backbone.  The
result carries every constructor default filled in, so MLflow params, the
config hash, ablation skip-detection and search conditions all see the values
that actually run; workers receive this object and do not validate again.
Every value is addressable by a dotted key (``train.lr``, ``model.sigmas``,
``losses.clip_nce.weight``), which is what ``--set`` and search spaces use.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from prvrlab.checks import first_line
from prvrlab.files import leaves_folder
from prvrlab.allocator import HostAllocator
from prvrlab.data.config import DataConfig
from prvrlab.platform.errors import ConfigError  # noqa: F401 - raised here, imported from here by many
from prvrlab.registry import BACKBONES, DATA_DERIVED, LOSSES, PLUGIN_DERIVED, PLUGINS, RegistryError, closest, did_you_mean, did_you_mean_key


@dataclass
class TrainConfig:
    """Optimisation, early stopping and distribution."""

    epochs: int = 100
    batch_size: int = 128  # videos per step, over all workers (divisible by num_workers: an equal share each)
    lr: float = 2.5e-4
    weight_decay: float = 0.01
    warmup_proportion: float = 0.01
    warmup: Literal["official", "shifted"] = "official"  # warm-up multiplier s/W (reference) or min(1, (s+1)/W)
    grad_clip: float = 1.0  # 0: no clipping
    clip_grad: Literal["per_tensor", "global"] = "per_tensor"  # each tensor's norm (reference) or the global norm
    early_stop_patience: int = 10
    # stop once more than `patience` epochs passed without a better val SumR (reference: es_cnt > max_es_cnt),
    # or as soon as `patience` such epochs passed ("at_patience", one epoch earlier)
    early_stop: Literal["official", "at_patience"] = "official"
    num_workers: int = 1
    # what a DDP rank's losses span: the global batch (its ranks' encodings gathered: every query against
    # every video of the step, as one process trains) or only the rank's share (B / num_workers videos)
    ddp_batch: Literal["global", "local"] = "global"
    use_gpu: bool = False
    cpus_per_worker: float | None = None  # None: derived from the cluster's CPUs
    amp: Literal["none", "bf16", "fp16"] = "none"
    # recompute memory-heavy activations (modules declaring it) in the backward: same results, less memory
    checkpoint_activations: bool = False
    max_failures: int = 2
    torch_threads: int | None = None  # None: cpus_per_worker rounded up
    # host memory of the workers: keep freed memory for reuse (faster on CPU, higher peak RSS) or glibc's own
    host_allocator: HostAllocator = "keep"  # see prvrlab.allocator
    seed: int = 0

    def check(self) -> None:
        _positive(self, "epochs", "batch_size", "lr", "num_workers")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ConfigError(f"train.weight_decay must be a finite number >= 0, got {self.weight_decay!r}")
        if not 0 <= self.warmup_proportion < 1:
            raise ConfigError("train.warmup_proportion must be in [0, 1)")
        if not (math.isfinite(self.grad_clip) and self.grad_clip >= 0):
            raise ConfigError(f"train.grad_clip must be a finite number >= 0 (0 disables clipping), got {self.grad_clip!r}")
        if self.early_stop_patience < 1:
            raise ConfigError("train.early_stop_patience must be >= 1")
        if self.max_failures < 0:
            raise ConfigError("train.max_failures must be >= 0")
        if self.cpus_per_worker is not None and not (math.isfinite(self.cpus_per_worker) and self.cpus_per_worker > 0):
            raise ConfigError(f"train.cpus_per_worker must be a finite number > 0, got {self.cpus_per_worker!r}")
        if self.torch_threads is not None and self.torch_threads < 1:
            raise ConfigError("train.torch_threads must be >= 1")
        if not 0 <= self.seed < 2**64:  # what torch.manual_seed takes; the training sampler refuses a negative seed
            raise ConfigError(f"train.seed must be an integer in [0, 2**64), got {self.seed!r}")
        if self.batch_size % self.num_workers:
            raise ConfigError(
                f"train.batch_size ({self.batch_size}) must be divisible by train.num_workers ({self.num_workers}): "
                "each worker trains an equal share of every batch"
            )
        if self.amp == "fp16" and not self.use_gpu:
            raise ConfigError("train.amp: fp16 needs train.use_gpu=true; use bf16 on CPU")


@dataclass
class EvalConfig:
    """Evaluation batching (memory bound) and the splits evaluated at the end."""

    video_batch_size: int = 256  # videos encoded per forward (at most: fewer where memory asks, see evaluate())
    query_batch_size: int = 1024  # queries encoded per forward (at most: fewer where memory asks, see evaluate())
    score_chunk: int = 2048  # queries scored against all videos at once (at most, as video_batch_size)
    final_splits: list[str] = field(default_factory=lambda: ["val", "test"])  # unset: data.val_split, data.test_split

    def check(self) -> None:
        _positive(self, "video_batch_size", "query_batch_size", "score_chunk")


@dataclass
class TrackingConfig:
    """MLflow tracking and Ray storage."""

    uri: str | None = None  # default: $MLFLOW_TRACKING_URI or sqlite:///<cwd>/mlflow.db
    experiment: str = "prvrlab"
    run_name: str | None = None
    storage_path: str = "results"  # checkpoints and run files: a path (resolved to absolute), file://, s3:// or gs://

    def check(self) -> None:
        from prvrlab.platform.storage import normalize
        from prvrlab.platform.tracking.uri import check_tracking_uri

        if not self.experiment:
            raise ConfigError("tracking.experiment must not be empty")
        normalize(self.storage_path)  # unknown scheme, no bucket, a query: ConfigError naming the key
        check_tracking_uri(self.uri, "tracking.uri")


PUBLISHED_METRICS = ("r1", "r5", "r10", "r100", "sumr")  # = evaluation.metrics.METRIC_KEYS (which would load pyarrow here)
PUBLISHED_SUM_TOLERANCE = 0.25  # published R@K are rounded to 0.1: their sum may miss the printed SumR by 0.2


@dataclass
class PublishedConfig:
    """A published result the config reproduces (a paper's table row), in percent.

    It changes nothing in training: the run's final metrics on ``split`` are printed and logged
    beside it (``final/<split>/<metric>_vs_published``: the run's minus the published value), and it
    is not part of the config's fingerprint.  Empty (the default): no comparison."""

    source: str | None = None  # where the numbers are printed, e.g. "papers/002 Table 1, GMMFormer"
    split: str | None = None  # the split they were reported on (compared when eval.final_splits has it)
    collection: str | None = None  # the collection they were reported on: a run reading another is not compared
    r1: float | None = None
    r5: float | None = None
    r10: float | None = None
    r100: float | None = None
    sumr: float | None = None

    def metrics(self) -> dict[str, float]:
        """The published values given, by metric key (``r1`` ... ``sumr``)."""
        return {k: float(v) for k in PUBLISHED_METRICS if (v := getattr(self, k)) is not None}

    def check(self) -> None:
        given = self.metrics()
        if not given and self.source is None and self.split is None:
            return
        if not given:
            raise ConfigError(f"published: give at least one of {', '.join(PUBLISHED_METRICS)}")
        for key in ("source", "split"):
            if not (getattr(self, key) or "").strip():
                raise ConfigError(f"published.{key}: required with published metrics (where they are printed / "
                                  "the split they were reported on)")
        for key, value in given.items():
            top = 400.0 if key == "sumr" else 100.0
            if not (math.isfinite(value) and 0.0 <= value <= top):
                raise ConfigError(f"published.{key}: a percentage in [0, {top:g}], got {value!r}")
        recalls = [(k, given[k]) for k in PUBLISHED_METRICS[:-1] if k in given]
        for (a, va), (b, vb) in zip(recalls, recalls[1:]):
            if va > vb:
                raise ConfigError(f"published.{a}: {va:g} is above published.{b}: {vb:g}; R@K cannot fall as K grows")
        if len(recalls) == 4 and "sumr" in given:
            total = sum(v for _, v in recalls)
            if abs(total - given["sumr"]) > PUBLISHED_SUM_TOLERANCE:
                raise ConfigError(f"published.sumr: {given['sumr']:g}, but r1 + r5 + r10 + r100 = {total:.1f}")

    def other_collection(self, collection: str | None) -> bool:
        """Whether the numbers were reported on a collection other than ``collection`` (the run's
        ``data.collection``): then nothing is compared.  Unknown on either side: False."""
        return self.collection is not None and collection is not None and self.collection != collection

    def compare(self, final: dict[str, Any], *, collection: str | None = None) -> dict[str, float]:
        """The run's final metrics minus the published ones, ``{"<split>/<metric>_vs_published": delta}``,
        for the metrics both have (``final`` as the trainer reports it: ``"<split>/<metric>"`` keys); nothing
        for a run on another collection than the published one (``collection``: the run's)."""
        out = {}
        if self.other_collection(collection):
            return out
        for key, value in self.metrics().items():
            ours = final.get(f"{self.split}/{key}")
            if isinstance(ours, (int, float)):
                out[f"{self.split}/{key}_vs_published"] = float(ours) - value
        return out


SECTIONS: dict[str, type] = {
    "data": DataConfig,
    "train": TrainConfig,
    "eval": EvalConfig,
    "tracking": TrackingConfig,
    "published": PublishedConfig,
}
TOP_LEVEL = ("name", "data", "model", "plugins", "losses", "train", "eval", "tracking", "published")


@dataclass
class ExperimentConfig:
    """A validated experiment: data + backbone + losses + training."""

    name: str
    data: DataConfig
    model: dict[str, Any]  # {"name": backbone, **constructor params}
    losses: dict[str, dict[str, Any]]  # term -> {"loss": name, "weight": w, **params}
    train: TrainConfig
    eval: EvalConfig
    tracking: TrackingConfig
    plugins: dict[str, dict[str, Any]] = field(default_factory=dict)  # plug-in name -> constructor params
    published: PublishedConfig = field(default_factory=PublishedConfig)  # a result to compare with, not a setting

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dict (YAML/JSON serialisable)."""
        return {
            "name": self.name,
            "data": dataclasses.asdict(self.data),
            "model": copy.deepcopy(self.model),
            "plugins": copy.deepcopy(self.plugins),
            "losses": copy.deepcopy(self.losses),
            "train": dataclasses.asdict(self.train),
            "eval": dataclasses.asdict(self.eval),
            "tracking": dataclasses.asdict(self.tracking),
            "published": dataclasses.asdict(self.published),
        }

    def flat(self) -> dict[str, Any]:
        """Dotted key -> value (lists kept as values); no ``plugins`` / ``published`` entries when empty."""
        d = self.to_dict()
        if not d["plugins"]:
            d.pop("plugins")
        if all(v is None for v in d["published"].values()):
            d.pop("published")
        return flatten(d)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def fingerprint(self) -> str:
        """Stable hash of everything that affects results (tracking excluded)."""
        d = self.to_dict()
        d.pop("tracking")
        d.pop("published")
        d.pop("name")
        if not d["plugins"]:
            d.pop("plugins")  # configs without plug-ins keep the fingerprint they had before plug-ins existed
        _drop_hash_neutral(d["model"], BACKBONES, d["model"].get("name"))
        for name, params in d.get("plugins", {}).items():
            _drop_hash_neutral(params, PLUGINS, name)
        for spec in d["losses"].values():
            _drop_hash_neutral(spec, LOSSES, spec.get("loss"))
        blob = json.dumps(d, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    @property
    def backbone(self) -> str:
        return str(self.model["name"])


def _drop_hash_neutral(params: dict[str, Any], registry, name: Any) -> None:
    """Leave out of a fingerprint the parameters the component added later that hold their neutral value
    (its ``hash_neutral``: name -> the value that does what the component did before it had the
    parameter), so configs written before keep their hash: finished ablation cells are still found."""
    try:
        neutral = getattr(registry.get(str(name)), "hash_neutral", {})
    except RegistryError:
        return
    for key, value in neutral.items():
        if key in params and params[key] == value:
            params.pop(key)


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1}."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _positive(section: Any, *names: str) -> None:
    prefix = _section_name(section)
    for name in names:
        value = getattr(section, name)
        if not (value > 0 and math.isfinite(value)):
            raise ConfigError(f"{prefix}.{name} must be a finite number > 0, got {value!r}")


def _section_name(section: Any) -> str:
    for key, cls in SECTIONS.items():
        if isinstance(section, cls):
            return key
    return type(section).__name__


# ---------------------------------------------------------------- type coercion


def coerce(value: Any, annotation: Any, key: str) -> Any:
    """Check ``value`` against a type annotation, converting int -> float.

    Raises ConfigError naming ``key`` when the value does not fit.
    """
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if annotation is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg, key)
            except ConfigError:
                continue
        raise ConfigError(f"{key}: {value!r} is not {str(annotation).replace('typing.', '')}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(
                f"{key}: {value!r} is not one of {', '.join(map(repr, args))}"
                + (did_you_mean(str(value), [str(a) for a in args]) if isinstance(value, str) else "")
            )
        return value
    if origin in (list, tuple, typing.Sequence) or annotation in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        inner = args[0] if args else Any
        items = [coerce(v, inner, f"{key}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict or annotation is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        vt = args[1] if len(args) == 2 else Any
        return {str(k): coerce(v, vt, f"{key}.{k}") for k, v in value.items()}
    if annotation is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true/false, got {value!r}")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            if isinstance(value, str):
                try:
                    value = float(value)  # YAML reads '1e-3' as a string
                except ValueError:
                    raise ConfigError(f"{key}: expected a number, got {value!r}") from None
            else:
                raise ConfigError(f"{key}: expected a number, got {value!r}")
        value = float(value)
        if math.isnan(value):
            raise ConfigError(f"{key}: expected a number, got NaN")
        return value
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    return value


# ---------------------------------------------------------------- validation


def _check_int_range(value: Any, key: str) -> None:
    """An integer past 64 bits is no count, size or seed of a run (torch and numpy refused it later, in the run,
    naming no key); checked after a section's own checks, which may say more."""
    if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**64:
        raise ConfigError(f"{key}: {value!r} is out of range (a 64-bit integer)")


def _check_names(given: dict[Any, Any], where: str) -> None:
    """A ConfigError for a key that is not a string: YAML reads unquoted numbers, yes/no/on/off/true/false and
    null (~) as such (they had reached the key checks and ended in a TypeError traceback)."""
    for key in given:
        if not isinstance(key, str):
            raise ConfigError(
                f"{where or 'the config'}: the key {key!r} is read as {type(key).__name__}, not as a name (YAML reads "
                "unquoted numbers, yes/no/on/off/true/false and ~ as values: quote it)"
            )


def _check_keys(given: dict[str, Any], valid: typing.Iterable[str], where: str) -> None:
    _check_names(given, where)
    valid = list(valid)
    for key in given:
        if key not in valid:
            prefix = f"{where}." if where else ""
            raise ConfigError(
                f"unknown key '{prefix}{key}'{did_you_mean(key, valid)}; "
                f"valid keys{' in ' + where if where else ''}: {', '.join(valid)}"
            )


def _mapping(value: Any, where: str, example: str) -> dict[str, Any]:
    """``value`` as a mapping (``{}`` for None); otherwise a ConfigError naming ``where`` with an example."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a mapping (e.g. {where}: {example}), got {value!r}")
    return value


def _build_section(cls: type, raw: Any, where: str) -> Any:
    names = [f.name for f in dataclasses.fields(cls)]
    raw = _mapping(raw, where, f"{{{names[0]}: ...}}")
    hints = typing.get_type_hints(cls)
    _check_keys(raw, names, where)
    values = {k: coerce(v, hints[k], f"{where}.{k}") for k, v in raw.items()}
    section = cls(**values)
    try:
        section.check()
    except ConfigError:
        raise
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    for key, value in values.items():
        _check_int_range(value, f"{where}.{key}")
    return section


def _check_component(
    registry,
    name: Any,
    params: dict[str, Any],
    where: str,
    skip: tuple[str, ...],
    *,
    derived: tuple[str, ...] = DATA_DERIVED,
    base: str | None = None,
) -> dict[str, Any]:
    """Check ``params`` against the keyword-only constructor of ``registry``'s ``name``.

    ``where`` names the key holding the component name (``model.name``);
    ``base`` the section holding its parameters (default: ``where`` minus its
    last part); ``derived`` the parameters the platform fills in itself.
    """
    base = where.rsplit(".", 1)[0] if base is None else base
    if not isinstance(name, str):
        raise ConfigError(f"{where}: expected a registered {registry.kind} name, got {name!r}")
    try:
        known = registry.params(name)
    except RegistryError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    out: dict[str, Any] = {}
    settable = [p for p in known if p not in derived]
    _check_names(params, base)
    for key, value in params.items():
        if key not in settable:
            raise ConfigError(
                f"unknown key '{base}.{key}' for {registry.kind} '{name}'"
                f"{did_you_mean(key, list(settable) + list(skip))}; valid: {', '.join(list(skip) + settable)}"
            )
        out[key] = coerce(value, known[key].annotation, f"{base}.{key}")
        _check_int_range(out[key], f"{base}.{key}")
    for p in known.values():
        if p.name in out or p.name in derived:
            continue
        if p.required:
            raise ConfigError(f"{base}.{p.name} is required by {registry.kind} '{name}'")
        # the resolved config carries every default, typed as a user-given value would be
        out[p.name] = coerce(_plain(p.default), p.annotation, f"{base}.{p.name}")
    return out


def _plain(value: Any) -> Any:
    """A default as plain YAML/JSON data (tuples become lists), copied."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


def validate(raw: dict[str, Any]) -> ExperimentConfig:
    """Turn a raw nested mapping into an ExperimentConfig, or raise ConfigError."""
    if not isinstance(raw, dict):
        raise ConfigError("a config must be a mapping at the top level")
    if "extends" in raw or "unset" in raw:
        raise ConfigError("extends/unset: resolved when a config file is loaded; put them in the YAML file, "
                          "not in --set or a spec's overrides")
    _check_keys(raw, TOP_LEVEL, "")
    name = raw.get("name", "experiment")
    if not isinstance(name, str) or not name:
        raise ConfigError("name: expected a non-empty string")

    sections = {key: _build_section(cls, raw.get(key), key) for key, cls in SECTIONS.items()}
    if isinstance(raw.get("eval"), dict) and "final_splits" in raw["eval"]:
        _check_final_splits(sections["eval"].final_splits, sections["data"])
    else:  # by default the data section's validation and test splits, those it has (test_split: null: no test)
        data = sections["data"]
        sections["eval"] = dataclasses.replace(
            sections["eval"], final_splits=list(dict.fromkeys(s for s in (data.val_split, data.test_split) if s is not None)))
    _check_published_split(sections["published"], sections["data"])
    _check_synthesize(sections["data"])

    backbones = BACKBONES.names()
    example = raw["model"] if raw.get("model") in backbones else backbones[0]
    model_raw = _mapping(raw.get("model"), "model", f"{{name: {example}}}")
    if "name" not in model_raw:
        raise ConfigError(f"model.name is required; registered backbones: {', '.join(backbones)}")
    model_params = {k: v for k, v in model_raw.items() if k != "name"}
    model = {"name": model_raw["name"], **_check_component(BACKBONES, model_raw["name"], model_params, "model.name", ("name",))}
    _check_sequence_lengths(model, sections["data"])

    losses_raw = _mapping(raw.get("losses"), "losses", "{<term>: {loss: <loss>, weight: 1.0}}")
    if not losses_raw:
        raise ConfigError("losses: expected a mapping of term name -> {loss, weight, ...}")
    losses: dict[str, dict[str, Any]] = {}
    _check_names(losses_raw, "losses")
    for term, spec in losses_raw.items():
        where = f"losses.{term}"
        if not isinstance(spec, dict):
            raise ConfigError(f"{where}: expected a mapping with 'loss' and 'weight'")
        _check_term_name(str(term))
        loss_name = spec.get("loss", term)
        weight = coerce(spec.get("weight", 1.0), float, f"{where}.weight")
        if not (math.isfinite(weight) and weight >= 0):
            raise ConfigError(f"{where}.weight must be >= 0 and finite, got {weight}")
        params = {k: v for k, v in spec.items() if k not in ("loss", "weight")}
        if "loss" not in spec:
            _check_term_named_loss(str(term), [str(t) for t in losses_raw if t != term])
        checked = _check_component(LOSSES, loss_name, params, f"{where}.loss", ("loss", "weight"))
        losses[str(term)] = {"loss": loss_name, "weight": weight, **checked}
    if all(spec["weight"] == 0 for spec in losses.values()):
        raise ConfigError("losses: every weight is 0, nothing would be trained")

    plugins_raw = _mapping(raw.get("plugins"), "plugins", "{<plugin>: {<param>: <value>}}")
    plugins: dict[str, dict[str, Any]] = {}
    _check_names(plugins_raw, "plugins")
    for plugin_name, params in plugins_raw.items():
        where = f"plugins.{plugin_name}"
        if params is None:
            params = {}
        if not isinstance(params, dict):
            raise ConfigError(f"{where}: expected a mapping of parameters, got {params!r}")
        plugins[str(plugin_name)] = _check_component(
            PLUGINS, plugin_name, params, where, (), derived=PLUGIN_DERIVED, base=where
        )

    cfg = ExperimentConfig(name=name, model=model, losses=losses, plugins=plugins, **sections)
    _instantiate_check(cfg)
    return cfg


def _check_sequence_lengths(model: dict[str, Any], data: Any) -> None:
    """``data.max_frames`` / ``data.max_query_len`` (the longest video and query a batch holds) within the
    backbone's ``max_frames`` / ``max_query_len`` (its position tables' length), where it has them: a longer
    one would fail at the first batch that holds it, after the data was read and the workers started."""
    for key in ("max_frames", "max_query_len"):
        limit, wanted = model.get(key), getattr(data, key)
        if isinstance(limit, int) and not isinstance(limit, bool) and wanted > limit:
            raise ConfigError(
                f"data.{key}={wanted} exceeds model.{key}={limit} (the backbone's position table): "
                f"set model.{key} to at least {wanted}, or data.{key} to at most {limit}"
            )


MLFLOW_KEY = re.compile(r"[/\w.\- :]*")  # MLflow's rule for param, metric and tag keys
MLFLOW_KEY_MAX = 250


def mlflow_key_problem(key: str) -> str | None:
    """Why MLflow would refuse ``key`` as a param or metric key, or None: its characters, its length,
    or a '/' path that is not normal (an empty, '.' or '..' part)."""
    if not MLFLOW_KEY.fullmatch(key):
        return "MLflow keys may only contain letters, digits, '_', '-', '.', ' ', ':' and '/'"
    if len(key) > MLFLOW_KEY_MAX:
        return f"MLflow keys are at most {MLFLOW_KEY_MAX} characters"
    if leaves_folder(key):
        return "MLflow keys may not have an empty, '.' or '..' part between '/'"
    return None


def _check_term_name(term: str) -> None:
    """A loss term's name becomes part of MLflow keys (``losses.<term>.<param>``, ``train/<term>``): one
    MLflow cannot store, or with a '.' (a dotted key's separator), is refused naming ``losses.<term>``."""
    if not term or "." in term:
        raise ConfigError(f"losses.{term}: a loss term name must be non-empty and contain no '.'")
    for key in (f"train/{term}", f"losses.{term}.weight"):
        problem = mlflow_key_problem(key)
        if problem:
            raise ConfigError(f"losses.{term}: this loss term name cannot be recorded in MLflow (key '{key}'): {problem}")


def _check_term_named_loss(term: str, others: list[str]) -> None:
    """A loss term without ``loss:`` is named after its loss: an unknown one names ``losses.<term>``
    and suggests the closest registered loss or other term (a misspelt term adds a new one)."""
    names = LOSSES.names()
    if term not in names:
        raise ConfigError(
            f"losses.{term}: unknown loss '{term}'{did_you_mean(term, others + names)}; a term without "
            f"'loss:' is named after its loss; other terms: {', '.join(others) or 'none'}; "
            f"registered losses: {', '.join(names)}"
        )


def _check_synthesize(data: DataConfig) -> None:
    """``data.synthesize`` names a synthetic preset (checked now: it is only read when the root is missing)."""
    if data.synthesize is None:
        return
    from prvrlab.data.synth import preset_names

    names = preset_names()
    if data.synthesize not in names:
        raise ConfigError(
            f"data.synthesize: unknown synthetic preset {data.synthesize!r}{did_you_mean(data.synthesize, names)}; "
            f"presets: {', '.join(names)}"
        )


def _check_published_split(published: PublishedConfig, data: DataConfig) -> None:
    """The published result's split is one of the data section's (it is compared when
    ``eval.final_splits`` evaluates it, and skipped otherwise)."""
    known = _data_splits(data)
    if published.split is not None and published.split not in known:
        raise ConfigError(
            f"published.split: {published.split!r} is not a split of the data section ({', '.join(known)})"
            f"{did_you_mean(published.split, known)}; --set published=null drops the published result"
        )


def _data_splits(data: DataConfig) -> list[str]:
    """The data section's splits that are set (train, val, test)."""
    return [s for s in (data.train_split, data.val_split, data.test_split) if s is not None]


def _check_final_splits(splits: list[str], data: DataConfig) -> None:
    """Every split given in ``eval.final_splits`` is one of the data section's splits."""
    known = _data_splits(data)
    for i, split in enumerate(splits):
        if split not in known:
            raise ConfigError(
                f"eval.final_splits[{i}]: {split!r} is not a split of the data section"
                f"{did_you_mean(split, known)}; splits: {', '.join(known)} "
                "(data.train_split, data.val_split, data.test_split)"
            )


def spans_ranks(train: TrainConfig, workers: int | None = None) -> bool:
    """Whether a step's losses span the global batch gathered from several DDP ranks (``workers``: the ranks
    that train, ``train.num_workers`` unless given: one under ``--no-ray``)."""
    return (train.num_workers if workers is None else workers) > 1 and train.ddp_batch == "global"


# What building a component from validated values can raise: its own checks (ValueError, TypeError), and
# torch refusing sizes past what it can index (RuntimeError, OverflowError; MemoryError for a Python list)
BUILD_ERRORS = (ValueError, TypeError, RuntimeError, OverflowError, MemoryError)
MAX_PARAMETERS = 1 << 36  # ~69 billion: no PRVR model comes near; past it the sizes are a typo


def _instantiate_check(cfg: ExperimentConfig) -> None:
    """Build model and losses once on the meta device through the model factory, so that their
    own value checks, the plug-ins' backbone checks and every component's needs run now; then
    check every loss ``branch`` and plug-in output a loss reads."""
    from prvrlab.models.factory import build_backbone, build_system, check_needs, on_meta

    try:
        with on_meta():
            backbone = build_backbone(cfg.model, video_dim=8, query_dim=8)
    except BUILD_ERRORS as exc:
        raise ConfigError(f"model: {first_line(exc)}") from None
    size = sum(p.numel() for p in backbone.parameters())
    if size > MAX_PARAMETERS:
        raise ConfigError(
            f"model: {size:.3g} parameters, more than {MAX_PARAMETERS:.3g}: more than any training machine holds; "
            "check its sizes (hidden_size, ffn_size, the number of layers)"
        )
    branches = list(getattr(backbone, "score_weights", {}))
    for term, spec in cfg.losses.items():
        try:
            with on_meta():
                loss = LOSSES.build(spec["loss"], **{k: v for k, v in spec.items() if k not in ("loss", "weight")})
        except BUILD_ERRORS as exc:
            raise ConfigError(f"losses.{term}: {first_line(exc)}") from None
        branch = spec.get("branch")
        readable = branches + (list(backbone.batch_vector_names()) if type(loss).reads_query_vectors else [])
        if spec["weight"] > 0 and isinstance(branch, str) and branches and branch not in readable:
            raise ConfigError(
                f"losses.{term}.branch: '{branch}' is not a branch of backbone '{cfg.backbone}'"
                f"{did_you_mean(branch, readable)}; branches: {', '.join(readable)}"
            )
        try:
            check_needs(backbone, cfg.backbone, {f"losses.{term}": loss} if spec["weight"] > 0 else {})
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    try:
        with on_meta():
            system = build_system(
                cfg.model, cfg.plugins, cfg.losses, video_dim=8, query_dim=8, global_batch=spans_ranks(cfg.train)
            )
    except BUILD_ERRORS as exc:  # PluginError and NeedsError name plugins.<name> / losses.<term>
        raise ConfigError(first_line(exc)) from None
    provided = {f"{name}.{key}" for name, plugin in system.plugins().items() for key in plugin.aux_keys()}
    for term, spec in cfg.losses.items():
        missing = [key for key in system.losses.losses[term].required_aux() if key not in provided]
        if missing and spec["weight"] > 0:
            section = missing[0].split(".", 1)[0]
            if section in cfg.plugins:  # enabled, but a switch of it leaves that output out
                raise ConfigError(
                    f"losses.{term}: loss '{spec['loss']}' reads {', '.join(missing)} from the model output, which "
                    f"plugins.{section} does not produce with its parameters (a part of it switched off?); switch that "
                    f"part on or set losses.{term}.weight: 0"
                )
            raise ConfigError(
                f"losses.{term}: loss '{spec['loss']}' reads {', '.join(missing)} from the model output, "
                f"which no enabled plug-in produces; enable it under plugins.{section} "
                f"(enabled: {', '.join(cfg.plugins) or 'none'}) or set losses.{term}.weight: 0"
            )
    # a term at weight 0 counts: zeroing a loss is a deliberate ablation, leaving it out an oversight
    read = {key for term in cfg.losses for key in system.losses.losses[term].required_aux()}
    for name, plugin in system.plugins().items():
        for part, keys in plugin.trained_parts().items():
            if not read & {f"{name}.{key}" for key in keys}:
                readers = _aux_readers(name, keys)
                shown = ", ".join(keys[:3]) + (f", ... {len(keys)} in all" if len(keys) > 3 else "")
                raise ConfigError(
                    f"plugins.{name}.{part}: no loss term reads its training outputs ({shown}), so its "
                    "parameters would train on nothing; add a loss term that reads them"
                    + (f" (loss: {' or '.join(repr(r) for r in readers)})" if readers else "")
                    + f" or set plugins.{name}.{part}: false"
                )


def _aux_readers(plugin: str, keys: tuple[str, ...]) -> list[str]:
    """Registered losses that, built with their defaults, read one of ``plugin``'s training outputs."""
    from prvrlab.models.factory import on_meta

    wanted, found = {f"{plugin}.{key}" for key in keys}, []
    for name in LOSSES.names():
        try:
            with on_meta():
                loss = LOSSES.build(name)
        except Exception:  # noqa: BLE001 - a loss with required parameters is not offered
            continue
        if wanted & set(loss.required_aux()):
            found.append(name)
    return found


def _switch_tokens(registry, registered: str, label: str, params: dict[str, Any]) -> list[str]:
    """``label.part`` for every boolean parameter the component lists in ``switch_params`` that is on
    (defaults included), or ``label`` when it lists none."""
    known = registry.params(registered)
    switches = getattr(registry.get(registered), "switch_params", ())
    on = [key for key in switches if key in known and params.get(key, known[key].default) is True]
    return [f"{label}.{key}" for key in on] if switches else [label]


def plugin_tokens(cfg: ExperimentConfig) -> list[str]:
    """Enabled plug-in parts for tags, generically: ``name.part`` for every boolean
    parameter the plug-in lists in ``switch_params`` that is on (defaults included),
    or ``name`` when it lists none."""
    return [t for name, params in sorted(cfg.plugins.items()) for t in _switch_tokens(PLUGINS, name, name, params)]


def loss_tokens(cfg: ExperimentConfig) -> list[str]:
    """Loss terms of non-zero weight for tags, as :func:`plugin_tokens`: ``term.part`` for every boolean
    parameter the term's loss lists in ``switch_params`` that is on, or ``term`` when it lists none."""
    return [
        t for term, spec in cfg.losses.items() if spec["weight"] > 0 for t in _switch_tokens(LOSSES, spec["loss"], term, spec)
    ]


# ---------------------------------------------------------------- overrides


def parse_override(text: str) -> tuple[str, Any]:
    """'train.lr=1e-3' -> ('train.lr', 0.001); the value is parsed as YAML."""
    if "=" not in text:
        raise ConfigError(f"--set expects key=value, got {text!r}")
    key, value = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"--set expects key=value, got {text!r}")
    parsed = parse_yaml(value, f"--set {key}") if value.strip() else None
    if parsed is None and key in SECTIONS:  # None (empty, null, ~): every key of the section back to its default, silently
        raise ConfigError(f"--set {key}={value}: an empty value would reset the whole '{key}' section to its defaults; "
                          f"set its keys instead (--set {key}.<key>=<value>)")
    return key, parsed


def apply_overrides(raw: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Set dotted keys in a raw config (creating loss terms when needed)."""
    out = copy.deepcopy(raw)
    for dotted, value in overrides.items():
        parts = dotted.split(".")
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                if i == 0 and part not in TOP_LEVEL:
                    hint = did_you_mean(part, TOP_LEVEL) or f"; '{part}' is not a top-level key ({', '.join(TOP_LEVEL)})"
                    raise ConfigError(f"--set {dotted}: unknown key{hint}")
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"cannot set '{dotted}': '{'.'.join(parts[: i + 1])}' is not a mapping")
            node = child
        node[parts[-1]] = value
    return out


class UniqueKeyLoader(yaml.SafeLoader):
    """A SafeLoader that rejects a key repeated in one mapping (plain YAML keeps the last value)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                line = first.setdefault(key, -1)
            except TypeError:
                continue  # an unhashable key: the base class reports it
            if line >= 0:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first at line {line + 1})", key_node.start_mark
                )
            first[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


def yaml_problem(exc: yaml.YAMLError) -> str:
    """A YAML error on one line: ``line L, column C: problem``."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).replace("\n", " ")
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" if mark else problem


def parse_yaml(text: str, source: str) -> Any:
    """Parse user YAML with :class:`UniqueKeyLoader`; a one-line ConfigError naming ``source``."""
    try:
        return yaml.load(text, Loader=UniqueKeyLoader)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {yaml_problem(exc)}") from None


def read_yaml(path: Path) -> Any:
    """Read and parse a user's YAML file (config or spec); ConfigError naming the file and line."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ConfigError(f"{path}: line {line}: not UTF-8 text (byte 0x{data[exc.start]:02x})") from None
    return parse_yaml(text, str(path))


def _read_mapping(path: Path) -> dict[str, Any]:
    raw = read_yaml(path)
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return raw


def _closest_file(path: Path) -> str:
    """`` (did you mean '<folder>/<name>'?)`` for the closest YAML file beside a missing ``path``; else ``""``."""
    folder = path.parent
    try:
        names = [p.name for p in folder.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file()] if folder.is_dir() else []
    except OSError:
        return ""
    close = closest(path.name, names)
    return f" (did you mean '{folder / close}'?)" if close else ""


def load_raw(path: str | Path, what: str = "config file") -> dict[str, Any]:
    """Read a YAML mapping (a config, or a spec with ``what="spec file"``); one error naming the file when it is bad.

    A config's ``extends`` / ``unset`` are resolved here (:func:`resolve_extends`)."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"{what} {path} is a folder: give the YAML file in it")
    if not path.is_file():
        raise ConfigError(f"{what} not found: {path}{_closest_file(path)}")
    raw = _read_mapping(path)
    return resolve_extends(raw, path) if what == "config file" else raw


def find_next_to(owner: Path, value: Any, key: str, what: str = "an experiment YAML") -> Path:
    """The file ``value`` names, looked up next to ``owner`` and then in the current directory
    (absolute, resolved); a ConfigError naming ``owner`` and ``key`` otherwise."""
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{owner}: {key}: expected a path to {what}, got {value!r}")
    for candidate in (owner.parent / value, Path(value)):
        if candidate.is_file():
            return candidate.resolve()
    raise ConfigError(
        f"{owner}: {key}: file not found: {value} (looked next to {owner.name} and in the current directory)"
    )


EXTENDS_DEPTH = 8  # configs in one extends chain, the file itself included


def resolve_extends(raw: dict[str, Any], path: Path, chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A config with its ``extends`` resolved: the parent config(s) merged under this file's keys.

    ``extends: parent.yaml`` (or a list, merged left to right) names YAML files next to ``path`` or in
    the current directory; a parent may extend others (at most :data:`EXTENDS_DEPTH` deep, no cycle).
    Merging: a mapping merges key by key into the parent's, anything else (lists included) replaces
    the parent's value; a mapping whose ``name`` (``model``) or ``loss`` (a loss term; without ``loss:``
    the parent's term is named after its loss) differs from the parent's replaces it whole.  ``unset: [losses.clip_nce, plugins.ral]`` removes dotted keys from the
    merged parents first.  ``name`` is never inherited: without its own, a config is named after its
    file.  Only YAML is read (safe loader); nothing in a parent can run code."""
    path = path.resolve()
    chain = (*chain, path)
    if "extends" not in raw:
        if "unset" in raw:
            raise ConfigError(f"{path}: unset: only a config that extends another can unset keys")
        return raw
    if len(chain) >= EXTENDS_DEPTH:
        raise ConfigError(f"{chain[0]}: extends: more than {EXTENDS_DEPTH - 1} configs deep: "
                          + " -> ".join(p.name for p in chain))
    refs = raw["extends"] if isinstance(raw["extends"], list) else [raw["extends"]]
    if not refs:
        raise ConfigError(f"{path}: extends: expected a path to a config YAML or a list of them, got []")
    merged: dict[str, Any] = {}
    for ref in refs:
        parent = find_next_to(path, ref, "extends", "a config YAML")
        if parent in chain:
            raise ConfigError(f"{path}: extends: a cycle: " + " -> ".join(p.name for p in (*chain, parent)))
        resolved = resolve_extends(_read_mapping(parent), parent, chain)
        resolved.pop("name", None)
        merged = merge_config(merged, resolved)
    for dotted in _unset_keys(raw.get("unset", []), path):
        _remove_key(merged, dotted, path)
    merged = merge_config(merged, {k: v for k, v in raw.items() if k not in ("extends", "unset")})
    merged.setdefault("name", path.stem)
    return merged


def merge_config(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` merged into a copy of ``base`` by the rules of :func:`resolve_extends`."""
    return _merge(base, over, ())


def _merge(base: dict[str, Any], over: dict[str, Any], where: tuple[str, ...]) -> dict[str, Any]:
    """:func:`merge_config` of the mappings at the dotted path ``where`` (``()``: the top level)."""
    out = copy.deepcopy(base)
    for key, value in over.items():
        old = out.get(key)
        path = (*where, str(key))
        if isinstance(value, dict) and isinstance(old, dict) and not _replaces(old, value, path):
            out[key] = _merge(old, value, path)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _replaces(old: dict[str, Any], new: dict[str, Any], where: tuple[str, ...]) -> bool:
    """A mapping naming another component (backbone ``name``, loss term ``loss``) replaces the old one.

    A loss term's loss is its ``loss:`` or else its term name (``losses.<term>``): a child's term that
    names a loss replaces the parent's term of another loss, whether the parent wrote ``loss:`` or not.
    A ``published`` row with another ``source`` replaces the parent's whole row (its split, collection and
    metrics belong to the parent's table)."""
    if where == ("published",):
        return "source" in new and new["source"] != old.get("source")
    if len(where) == 2 and where[0] == "losses" and "loss" in new:
        return new["loss"] != old.get("loss", where[1])
    return any(k in old and k in new and old[k] != new[k] for k in ("name", "loss"))


def _unset_keys(value: Any, path: Path) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{path}: unset: expected a list of dotted keys (e.g. [losses.clip_nce]), got {value!r}")
    return value


def _remove_key(raw: dict[str, Any], dotted: str, path: Path) -> None:
    node: Any = raw
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        if not isinstance(node, dict) or part not in node:
            keys = list(node) if isinstance(node, dict) else []
            where = ".".join(parts[:i]) or "the top level"
            raise ConfigError(
                f"{path}: unset: {dotted}: the parent config has no '{part}' in {where}{did_you_mean(part, keys)}"
            )
        if i < len(parts) - 1:
            node = node[part]
    del node[parts[-1]]


def load_config(path: str | Path, overrides: dict[str, Any] | None = None, *, preset: str | None = None) -> ExperimentConfig:
    """Load a config file, apply a named preset (:mod:`prvrlab.platform.presets`), then the overrides; validate."""
    raw = load_raw(path)
    if preset is not None:
        from prvrlab.platform.presets import apply_preset

        try:
            raw = apply_preset(raw, preset)
        except ValueError as exc:
            raise ConfigError(f"--preset: {exc}") from None
    overrides = overrides or {}
    _check_set_section_keys(overrides)
    return validate_overrides(raw, overrides, str(path))


def validate_overrides(raw: dict[str, Any], overrides: dict[str, Any], source: str) -> ExperimentConfig:
    """Validate ``raw`` (read from ``source``) with the ``--set`` ``overrides`` applied; an error
    is prefixed with ``--set <key>`` when that key set the value it names, else with ``source``."""
    applied = apply_overrides(raw, overrides)
    try:
        return validate(applied)
    except ConfigError as exc:
        text = str(exc)
        culprit = _culprit(text, overrides, raw)
        if culprit:  # "--set train.epochs: must be ...", not "--set train.epochs: train.epochs must be ..."
            named = text.startswith(culprit) and text[len(culprit) : len(culprit) + 1] in (":", " ")
            rest = text[len(culprit) :].lstrip(": ") if named else text
            raise ConfigError(f"--set {culprit}: {rest}") from None
        raise ConfigError(f"{source}: {text}") from None


def _culprit(message: str, overrides: dict[str, Any], raw: dict[str, Any]) -> str | None:
    """The override behind a validation error: the one setting the key the message names (its
    leading key, or the quoted key of ``unknown key '...'``), or a parent of it; or one below it
    when ``raw`` lacks that key or the message names the override's next part (``model: dropout ...``)."""
    match = re.match(r"unknown key '([^']+)'|([\w.]+)", message)
    named = (match.group(1) or match.group(2)) if match else ""
    for key in overrides:
        if key == named or named.startswith(f"{key}."):
            return key
    below = [key for key in overrides if key.startswith(f"{named}.")]
    if below and not any(k == named or k.startswith(f"{named}.") for k in flatten(raw)):
        return below[0]
    return next(
        (key for key in below if re.search(rf"\b{re.escape(key[len(named) + 1:].split('.')[0])}\b", message)), None
    )


def _check_set_section_keys(overrides: dict[str, Any]) -> None:
    """A ConfigError naming ``--set`` and the full dotted key for a key it cannot set: ``extends`` /
    ``unset`` (resolved when the file is read) or an unknown section key."""
    for dotted in overrides:
        section, _, key = dotted.partition(".")
        if section in ("extends", "unset"):
            raise ConfigError(f"--set {dotted}: {section} cannot be set with --set; put it in the YAML file")
        if section in SECTIONS and key:
            names = [f"{section}.{f.name}" for f in dataclasses.fields(SECTIONS[section])]
            if dotted not in names:
                raise ConfigError(
                    f"--set {dotted}: unknown key{did_you_mean_key(dotted, names)}; valid keys in {section}: "
                    + ", ".join(n.partition(".")[2] for n in names)
                )
