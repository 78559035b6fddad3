"""Which parameters get weight decay, for every backbone, a plug-in and a loss with a learnable scalar.

The references (BERT convention) decay every weight except biases and the
parameters whose names contain ``LayerNorm.weight`` / ``LayerNorm.bias``; a
LayerNorm named otherwise has its gain decayed: MamFusion's after each Mamba
mixer, GMMFormer v2's ``norm1`` / ``norm2`` of every attention layer, RAL's
``layer_norm`` and second text encoder's norms.  The expected no-decay names
are computed here by walking the modules and matching names, independently of
``optim.no_decay`` and ``decay_norm_gains``.
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
# GMMFormer v2: BertAttention's norm1 / norm2 (query encoder, each branch) and the cross-attention's (summary)
V2_NORM_GAIN = re.compile(r"(model\.)?(backbone\.)?(query|clip|frame)\.layers\.\d+\.(norm\d?_weight|ffn_norm\.weight|summary\.norm\d\.weight)")
# RAL: PIENet's layer_norm (any head's norm) and its second text encoder's BertAttention norms, not its input projection's
RAL_NORM_GAIN = re.compile(r"(model\.)?plugins\.ral\.((text|video)_gaussian\..*norm\.weight|words\.layers\.\d+\.(norm_weight|ffn_norm\.weight))")


def expected_no_decay(model: nn.Module, *, decayed_gains: tuple[re.Pattern, ...] = ()) -> set[str]:
    """Biases, LayerNorm module parameters, per-branch LayerNorm affines and 0-dim parameters, except the
    LayerNorm gains whose names match ``decayed_gains`` (those a reference's name filter misses)."""
    out = set()
    for module_name, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            full = f"{module_name}.{name}" if module_name else name
            if any(pattern.fullmatch(full) for pattern in decayed_gains):
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
    sizes = {"hidden_size": 32, "num_heads": 4}
    cfg = {"name": backbone, **{k: v for k, v in sizes.items() if k in BACKBONES.params(backbone)}}
    if losses:
        model: nn.Module = build_system(cfg, plugins, losses, **DIMS)
    else:
        model = build_model(cfg, plugins, **DIMS)
    gains = {"mamfusion": (MAMBA_NORM_GAIN,), "gmmformer_v2": (V2_NORM_GAIN,)}.get(backbone, ())
    gains += (RAL_NORM_GAIN,) if "ral" in plugins else ()
    no_decay = expected_no_decay(model, decayed_gains=gains)
    assert decayed_names(model) == {n for n, _ in model.named_parameters()} - no_decay
    if backbone == "gmmformer":  # the per-branch LayerNorm gains exist and are exempt
        assert any(re.search(r"\.norm\d?_weight$", n) for n in no_decay)
    if backbone == "gmmformer_v2":  # ... decayed, as the reference's norm1 / norm2
        assert not any(re.search(r"layers\.\d+\.norm\d?_weight$", n) for n in no_decay)
    if losses:
        assert "losses.losses.coverage.log_temperature" in no_decay


@pytest.mark.parametrize("backbone,plugins,losses", models())
def test_norm_named_parameters_outside_norm_modules_are_declared(backbone, plugins, losses):
    """The convention ``optim.no_decay`` relies on: a plain parameter holding a LayerNorm affine is
    named ``norm*`` and listed in its module's ``norm_parameters``."""
    sizes = {"hidden_size": 32, "num_heads": 4}  # where the constructor takes them
    model = build_model({"name": backbone, **{k: v for k, v in sizes.items() if k in BACKBONES.params(backbone)}}, plugins, **DIMS)
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
    assert "weight_token" in decayed  # the learned query token is a weight, not a norm gain (the reference's name)
    per_block = build_model({"name": "gmmformer_v2", "hidden_size": 32, "num_heads": 4, "weight_token": "per_block"}, **DIMS)
    assert {"clip.layers.0.summary.phi", "frame.layers.0.summary.phi"} <= decayed_names(per_block)
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


@pytest.mark.parametrize("where", ["backbone", "plugin"])
def test_gmmformer_v2_and_ral_decay_their_attention_layer_gains_only_when_asked(where):
    """model.norm_decay (gmmformer_v2) and plugins.ral.norm_decay (official: true) decay the gains named
    above, 10 in v2 (query encoder 2, each video branch 2 per-branch affines + the cross-attention's 2) and
    4 in RAL on v2 (its heads' 2, its text encoder layer's 2); false exempts them (BERT convention); each
    switch acts on its own modules only (RAL's text encoder is a copy of v2's query encoder)."""
    def build(flag: bool) -> nn.Module:
        model_cfg = {"name": "gmmformer_v2", "hidden_size": 32, "num_heads": 4, "norm_decay": flag or where == "plugin"}
        return build_model(model_cfg, {"ral": {"norm_decay": flag or where == "backbone"}}, **DIMS)

    official, exempt = build(True), build(False)
    pattern = V2_NORM_GAIN if where == "backbone" else RAL_NORM_GAIN
    gains = {n for n, _ in official.named_parameters() if pattern.fullmatch(n)}
    assert len(gains) == (10 if where == "backbone" else 4)
    assert gains <= decayed_names(official)
    assert not gains & decayed_names(exempt)
    assert decayed_names(official) - gains == decayed_names(exempt)
    other = RAL_NORM_GAIN if where == "backbone" else V2_NORM_GAIN
    assert decayed_names(exempt) == {n for n, _ in exempt.named_parameters()} - expected_no_decay(exempt, decayed_gains=(other,))
