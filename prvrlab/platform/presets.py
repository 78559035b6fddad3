"""Named sets of behaviour switches applied on top of a config.

``corrected`` holds prvrlab's corrected choices wherever its behaviour and the
official code's differ (docs/parity.md): the data and training sections' here, each
component's in its own ``corrected`` class attribute; the shipped dataset configs keep the
official behaviour, so ``prvrlab train configs/gmmformer_tvr.yaml --preset
corrected`` trains the same recipe with the corrections.  ``PRE_PARITY`` is the
behaviour a config meant before these switches existed, and ``BEFORE_FORMAT``
what it meant before each later checkpoint format (used to evaluate old
checkpoints as they were trained).

A switch applies only where it exists: ``model`` keys when the backbone has
the parameter, ``plugins.<name>`` keys when that plug-in is enabled,
``loss:<registered loss>`` keys on every term using that loss.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from typing import Any

from prvrlab.registry import BACKBONES, LOSSES, PLUGINS, did_you_mean

Switches = dict[str, dict[str, Any]]

# The platform's own sections of the ``corrected`` preset; each backbone, plug-in and loss declares its
# own values (its ``corrected`` class attribute), so a new component's correction needs no edit here.
CORRECTED_PLATFORM: Switches = {
    "data": {"last_bin": "inclusive", "normalize": "exact"},
    "train": {"warmup": "shifted", "clip_grad": "global", "early_stop": "at_patience"},
}


def corrected_switches() -> Switches:
    """The ``corrected`` preset: :data:`CORRECTED_PLATFORM` and every registered component's ``corrected``
    values (``model``: the backbones' together, one value per key; ``plugins.<name>``; ``loss:<name>``)."""
    out = copy.deepcopy(CORRECTED_PLATFORM)
    model: dict[str, Any] = {}
    for name in BACKBONES.names():
        for key, value in getattr(BACKBONES.get(name), "corrected", {}).items():
            if model.setdefault(key, value) != value:
                raise ValueError(f"backbone '{name}': corrected model.{key}={value!r}, another backbone has {model[key]!r}")
    out["model"] = model
    for prefix, registry in (("plugins.", PLUGINS), ("loss:", LOSSES)):
        for name in registry.names():
            values = getattr(registry.get(name), "corrected", {})
            if values:
                out[f"{prefix}{name}"] = dict(values)
    return out


class _Presets(Mapping[str, Switches]):
    """Preset name -> its switches, gathered from the components when looked up."""

    _MAKERS = {"corrected": corrected_switches}

    def __getitem__(self, name: str) -> Switches:
        return self._MAKERS[name]()

    def __iter__(self) -> Iterator[str]:
        return iter(self._MAKERS)

    def __len__(self) -> int:
        return len(self._MAKERS)


PRESETS: Mapping[str, Switches] = _Presets()

PRE_PARITY: Switches = {
    "model": {"window": "centred", "window_length": "real", "frame_padding": "masked"},
    "data": {"last_bin": "inclusive"},
    "train": {"warmup": "shifted", "clip_grad": "global", "early_stop": "at_patience"},
    "plugins.ral": {"mean_proxy": True, "csa_input": "raw", "unit_mean": False},
    "loss:ral_pm": {"formulation": "paper"},
    "loss:ral_da": {"formulation": "paper"},
}


# What a config stored in a checkpoint meant before a checkpoint format existed: a file of format
# f gets the switches of every key above f, oldest first (a value stored in the file wins).
BEFORE_FORMAT: dict[int, Switches] = {
    2: PRE_PARITY,
    4: {
        "model": {"frame_training": "all_pairs"},
        "plugins.ral": {"heads": "paper", "csa_padding": "masked", "word_encoder": "backbone"},
        "data": {"normalize": "exact"},
    },
    5: {"plugins.ral": {"word_positions": "own", "heads_padding": "masked"}},
    6: {"plugins.ral": {"text_heads_padding": "masked"}},
    7: {"model": {"norm_decay": False}, "plugins.ral": {"logvar_range": "clamped", "norm_decay": False}},
    8: {
        "model": {
            "query_pooling": "per_branch",
            # GMMFormer v2's layers as prvrlab built them before format 8 (docs/parity.md)
            "attention_output": "projected",
            "query_activation": "gelu",
            "ffn_dropout": False,
            "cross_attention_dropout": False,
            "weight_token": "per_block",
        }
    },
}


# Model values whose meaning a checkpoint format changed: in a file older than the format, the value
# (given, or the backbone's default) becomes the name its old meaning has now.  Format 8: ``window:
# official`` divides each row of the Gaussian window by its maximum, as the reference code does.
RENAMED_BEFORE_FORMAT: dict[int, dict[str, dict[Any, Any]]] = {
    8: {"window": {"official": "official_raw"}},
}


def stored_behaviour(raw: dict[str, Any], file_format: int) -> dict[str, Any]:
    """``raw`` (a checkpoint's stored config) with the switches of every format newer than the file's,
    and the model values whose meaning changed since (:data:`RENAMED_BEFORE_FORMAT`) renamed."""
    for introduced in sorted(BEFORE_FORMAT):
        if file_format < introduced:
            raw = apply_switches(raw, BEFORE_FORMAT[introduced], keep_given=True)
    for introduced, renames in sorted(RENAMED_BEFORE_FORMAT.items()):
        if file_format < introduced:
            raw = _rename_model_values(raw, renames)
    return raw


def _rename_model_values(raw: dict[str, Any], renames: dict[str, dict[Any, Any]]) -> dict[str, Any]:
    """A copy of ``raw`` whose ``model`` keys take their renamed values (the backbone's default where unset)."""
    model = raw.get("model") or {}
    if "name" not in model or model["name"] not in BACKBONES.names():
        return raw
    params = BACKBONES.params(model["name"])
    out = copy.deepcopy(raw)
    for key, names in renames.items():
        if key in params:
            value = model.get(key, params[key].default)
            if isinstance(value, str) and value in names:
                out["model"][key] = names[value]
    return out


def apply_switches(raw: dict[str, Any], switches: Switches, *, keep_given: bool) -> dict[str, Any]:
    """A copy of the raw config with ``switches`` set where they exist (``keep_given``: only where
    the config does not set the key itself)."""
    out = copy.deepcopy(raw)

    def put(section: dict[str, Any], values: dict[str, Any], allowed) -> None:
        for key, value in values.items():
            if key in allowed and not (keep_given and key in section):
                section[key] = value

    model = out.get("model") or {}
    if "name" in model:
        put(model, switches.get("model", {}), BACKBONES.params(model["name"]))
    for name in ("data", "train"):
        if switches.get(name):
            out[name] = out.get(name) or {}
            put(out[name], switches[name], switches[name])
    for plugin, params in (out.get("plugins") or {}).items():
        if f"plugins.{plugin}" in switches:
            out["plugins"][plugin] = params = dict(params or {})
            put(params, switches[f"plugins.{plugin}"], switches[f"plugins.{plugin}"])
    for term, spec in (out.get("losses") or {}).items():
        loss = spec.get("loss", term) if isinstance(spec, dict) else None
        if isinstance(spec, dict) and f"loss:{loss}" in switches:
            put(spec, switches[f"loss:{loss}"], LOSSES.params(loss))
    return out


def apply_preset(raw: dict[str, Any], name: str) -> dict[str, Any]:
    """``raw`` with the preset ``name`` applied; a ValueError names the closest preset."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset '{name}'{did_you_mean(name, PRESETS)}; presets: {', '.join(PRESETS)}")
    return apply_switches(raw, PRESETS[name], keep_given=False)
