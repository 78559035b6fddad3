"""Checkpoints written before the backbones' encoders became SequenceEncoders keep loading.

``legacy_state_dict_keys.json`` holds the state-dict keys and shapes, in
state-dict order, of ``test_backbones.build(name, **overrides)`` as recorded
from the code before the change (the module attributes ``query_proj``,
``clip_blocks``, ``frame_pool``, ...).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from test_backbones import build, standard_batch

from prvrlab.models.base import rename_legacy_keys
from prvrlab.models.plugins.base import PluggedModel
from prvrlab.platform.presets import BEFORE_FORMAT
from prvrlab.registry import PLUGINS

LEGACY = json.loads((Path(__file__).with_name("legacy_state_dict_keys.json")).read_text())


def overrides(name: str) -> dict:
    """The recorded build overrides; files in the legacy layout predate checkpoint format 8, so each
    backbone is built with the model switches of ``BEFORE_FORMAT[8]`` (MS-SL's two query vectors,
    GMMFormer v2's output projections and one weight token per block); ``build`` drops the keys a
    backbone does not have."""
    return {**LEGACY[name]["overrides"], **BEFORE_FORMAT[8]["model"]}


def legacy_state_dict(model: torch.nn.Module, name: str) -> OrderedDict:
    """``model``'s tensors under the recorded legacy keys (matched by position: the module order is unchanged)."""
    recorded = LEGACY[name]["keys"]
    current = list(model.state_dict().values())
    assert [shape for _, shape in recorded] == [list(t.shape) for t in current]
    return OrderedDict((key, t) for (key, _), t in zip(recorded, current))


def scores(model, batch):
    model.eval()
    with torch.no_grad():
        out = model.score(
            model.encode_queries(batch.queries, batch.query_mask),
            model.encode_videos(batch.clips, batch.frames, batch.frame_mask),
            with_logits=True,
        )
    return {branch: (s.sim, s.logits) for branch, s in out.items()}


@pytest.mark.parametrize("name", sorted(LEGACY))
def test_legacy_keys_rename_onto_the_current_keys_and_shapes(name):
    model = build(name, **overrides(name))
    renamed = {key: shape for key, shape in LEGACY[name]["keys"]}
    rename_legacy_keys(renamed, "", model.legacy_keys)
    assert renamed == {key: list(t.shape) for key, t in model.state_dict().items()}


@pytest.mark.parametrize("name", sorted(LEGACY))
def test_legacy_checkpoint_loads_strictly_and_scores_the_same(name):
    torch.manual_seed(0)
    saved = build(name, **overrides(name))
    torch.manual_seed(1)
    fresh = build(name, **overrides(name))
    fresh.load_state_dict(legacy_state_dict(saved, name))  # strict
    for (key, a), b in zip(saved.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), key
    batch = standard_batch()
    torch.testing.assert_close(scores(fresh, batch), scores(saved, batch), rtol=0, atol=0)


def test_legacy_backbone_keys_load_inside_a_plugged_model():
    def plugged(seed: int) -> PluggedModel:
        torch.manual_seed(seed)
        backbone = build("gmmformer_v2", **overrides("gmmformer_v2"))
        return PluggedModel(backbone=backbone, plugins={"ral": PLUGINS.build("ral", hidden_size=16)})

    saved, fresh = plugged(0), plugged(1)
    blob = OrderedDict((f"backbone.{k}", t) for k, t in legacy_state_dict(saved.backbone, "gmmformer_v2").items())
    blob.update((k, t) for k, t in saved.state_dict().items() if not k.startswith("backbone."))
    fresh.load_state_dict(blob)  # strict
    for (key, a), b in zip(saved.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), key


def test_a_key_already_in_the_new_layout_is_not_overwritten():
    model = build("mssl", **overrides("mssl"))
    state = model.state_dict()
    legacy = legacy_state_dict(model, "mssl")
    legacy["clip.pos.norm.weight"] = state["clip.pos.norm.weight"]  # both layouts: ambiguous
    with pytest.raises(RuntimeError, match="Unexpected key.*clip_pos.norm.weight"):
        build("mssl", **overrides("mssl")).load_state_dict(legacy)


def test_weights_that_split_a_shared_tensor_are_refused():
    """Two keys naming one shared tensor (RAL's word encoder with the backbone's positional embedding)
    must hold equal values in the file: otherwise it came from a model where they were separate, and
    loading would silently keep the last one."""
    torch.manual_seed(0)
    backbone = build("gmmformer")
    plugin = PLUGINS.build("ral", hidden_size=16, msra=False, word_positions="shared")
    model = PluggedModel(backbone=backbone, plugins={"ral": plugin})
    state = model.state_dict()
    shared = ("backbone.query.pos.embedding.weight", "plugins.ral.words.pos.embedding.weight")
    assert state[shared[0]].data_ptr() == state[shared[1]].data_ptr()
    model.load_state_dict(state)  # one tensor twice: fine
    split = OrderedDict((k, v.clone()) for k, v in state.items())
    split[shared[1]] += 1.0
    for key in split:
        if key != shared[1]:
            split[key] += 0.5  # every other entry differs from the model's: a partial load would show
    kept = {k: v.clone() for k, v in state.items()}
    with pytest.raises(RuntimeError, match="one shared tensor") as error:
        model.load_state_dict(split)
    assert shared[0] in str(error.value) and shared[1] in str(error.value)
    assert all(torch.equal(v, kept[k]) for k, v in model.state_dict().items())  # nothing was loaded
    del split[shared[1]]
    with pytest.raises(RuntimeError, match="Missing key"):  # strict loading still names the key
        model.load_state_dict(split)
