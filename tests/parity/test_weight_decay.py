"""Which parameters get weight decay, for every backbone, a plug-in and a loss with a learnable scalar.

The reference (BERT convention) decays every weight except biases and
LayerNorm gains/biases; the expected no-decay names are computed here by
walking the modules, independently of ``optim.no_decay``.
"""

import re

import pytest
from torch import nn

from prvrlab.models.factory import build_model, build_system
from prvrlab.platform.train.optim import param_groups
from prvrlab.registry import BACKBONES

NORM_GAIN = re.compile(r"norm\d*_(weight|bias)$")  # LayerNorm affines kept as plain parameters (K, D)
DIMS = {"video_dim": 12, "query_dim": 10}


MAMBA_NORM_GAIN = re.compile(r".*\.mamba\.norm\.weight$")  # MamFusion: nn.LayerNorm after Mamba, named "*_mamba.1"


def expected_no_decay(model: nn.Module, *, mamba_norm_decay: bool = False) -> set[str]:
    """Biases, LayerNorm module parameters, per-branch LayerNorm affines and 0-dim parameters; with
    ``mamba_norm_decay`` (MamFusion's reference: its name filter "LayerNorm.weight" misses the Mamba
    layers' LayerNorm), not the Mamba layers' LayerNorm gains."""
    out = set()
    for module_name, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            full = f"{module_name}.{name}" if module_name else name
            if mamba_norm_decay and MAMBA_NORM_GAIN.fullmatch(full):
                continue
            if name.endswith("bias") or isinstance(module, nn.LayerNorm) or NORM_GAIN.fullmatch(name) or p.dim() == 0:
                out.add(full)
    return out


def decayed_names(model: nn.Module, weight_decay: float = 0.01) -> set[str]:
    groups = param_groups(model, weight_decay)
    names = {id(p): n for n, p in model.named_parameters()}
    assert groups[0]["weight_decay"] == weight_decay and all(g["weight_decay"] == 0.0 for g in groups[1:])
    assert sum(len(g["params"]) for g in groups) == len(names)  # every parameter once
    return {names[id(p)] for p in groups[0]["params"]}


def models() -> list:
    cases = [pytest.param(name, {}, {}, id=name) for name in BACKBONES.names()]
    cases.append(pytest.param("gmmformer", {"ral": {}}, {}, id="gmmformer+ral"))
    coverage = {"coverage": {"loss": "moment_coverage", "weight": 1.0}}
    cases.append(pytest.param("gmmformer_v2", {}, coverage, id="gmmformer_v2+moment_coverage"))
    return cases


@pytest.mark.parametrize("backbone,plugins,losses", models())
def test_decay_group_is_everything_but_biases_and_norm_affines(backbone, plugins, losses):
    cfg = {"name": backbone, "hidden_size": 32, "num_heads": 4}
    if losses:
        model: nn.Module = build_system(cfg, plugins, losses, **DIMS)
    else:
        model = build_model(cfg, plugins, **DIMS)
    no_decay = expected_no_decay(model, mamba_norm_decay=backbone == "mamfusion")
    assert decayed_names(model) == {n for n, _ in model.named_parameters()} - no_decay
    if backbone.startswith("gmmformer"):  # the per-branch LayerNorm gains exist and are exempt
        assert any(re.search(r"\.norm\d?_weight$", n) for n in no_decay)
    if losses:
        assert "losses.losses.coverage.log_temperature" in no_decay


@pytest.mark.parametrize("backbone,plugins,losses", models())
def test_norm_named_parameters_outside_norm_modules_are_declared(backbone, plugins, losses):
    """The convention ``optim.no_decay`` relies on: a plain parameter holding a LayerNorm affine is
    named ``norm*`` and listed in its module's ``norm_parameters``."""
    model = build_model({"name": backbone, "hidden_size": 32, "num_heads": 4}, plugins, **DIMS)
    for module_name, module in model.named_modules():
        if isinstance(module, (nn.LayerNorm, nn.GroupNorm, nn.modules.batchnorm._BatchNorm)):
            continue
        declared = set(getattr(module, "norm_parameters", ()))
        for name, _ in module.named_parameters(recurse=False):
            if "norm" in name:
                assert name in declared, f"{module_name}.{name} looks like a norm affine but is not declared"


def test_non_norm_vectors_and_matrices_still_decay():
    model = build_model({"name": "gmmformer_v2", "hidden_size": 32, "num_heads": 4}, **DIMS)
    decayed = decayed_names(model)
    assert "clip.layers.0.summary.phi" in decayed  # the learned query token is a weight, not a norm gain
    assert "clip.layers.0.attention.qkv.weight" in decayed
    assert "clip.pos.embedding.weight" in decayed


def test_mamfusion_decays_its_mamba_layernorm_gains_only_when_asked():
    dims = {"name": "mamfusion", "hidden_size": 32, "num_heads": 4}
    official, exempt = (build_model({**dims, "mamba_norm_decay": flag}, {}, **DIMS) for flag in (True, False))
    gains = {n for n, _ in official.named_parameters() if MAMBA_NORM_GAIN.fullmatch(n)}
    assert len(gains) == 4  # clip and frame branches x 2 GMMBlocks
    assert gains <= decayed_names(official)
    assert not gains & decayed_names(exempt)
    assert decayed_names(official) - gains == decayed_names(exempt)
    assert decayed_names(exempt) == {n for n, _ in exempt.named_parameters()} - expected_no_decay(exempt)
