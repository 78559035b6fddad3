"""Early stopping as the official loop counts it, and checkpoints written before the parity switches."""

from __future__ import annotations


import pytest
import torch

from prvrlab.data.collection import open_collection
from prvrlab.models.factory import build_model
from prvrlab.platform.config import validate
from prvrlab.platform.presets import BEFORE_FORMAT, PRE_PARITY, PRESETS, apply_preset, apply_switches, stored_behaviour
from prvrlab.platform.train.checkpoint_eval import evaluate_checkpoint
from prvrlab.platform.train.loop import Progress, TrainingLoop
from prvrlab.platform.train.session import LocalSession

from train_helpers import check_a_format_7_model, small_raw  # noqa: E402  (tests/platform is on the path: tests/conftest.py)


@pytest.mark.parametrize("rule, stops_after", [("official", 4), ("at_patience", 3)])
def test_early_stopping_counts_like_the_reference(tiny_root, tmp_path, rule, stops_after):
    """The reference stops when es_cnt > max_es_cnt: with patience 3, at the 4th epoch without improvement."""
    cfg = validate(small_raw(tiny_root, tmp_path, early_stop_patience=3, early_stop=rule))
    loop = TrainingLoop(cfg, session=LocalSession(tmp_path / "s"), run_dir=tmp_path / "run")
    stopped_at = None
    for bad in range(1, 8):
        loop.progress = Progress(epoch=bad, best_sumr=1.0, best_epoch=0, bad_epochs=bad)
        if loop.should_stop():
            stopped_at = bad
            break
    assert stopped_at == stops_after


def test_a_pre_parity_stored_config_keeps_the_behaviour_it_was_trained_with(tiny_root, tmp_path):
    raw = small_raw(tiny_root, tmp_path)
    raw["plugins"] = {"ral": {"msra": False}}
    upgraded = validate(apply_switches(raw, PRE_PARITY, keep_given=True))
    assert upgraded.model["window"] == "centred" and upgraded.model["window_length"] == "real"
    assert upgraded.data.last_bin == "inclusive" and upgraded.train.warmup == "shifted"
    assert upgraded.train.clip_grad == "global" and upgraded.train.early_stop == "at_patience"
    assert {k: upgraded.plugins["ral"][k] for k in PRE_PARITY["plugins.ral"]} == PRE_PARITY["plugins.ral"]
    explicit = dict(raw, model={**raw["model"], "window": "official"})
    assert validate(apply_switches(explicit, PRE_PARITY, keep_given=True)).model["window"] == "official"  # a stored value wins
    fresh = validate(raw)  # the same YAML today: the official behaviour
    assert fresh.model["window"] == "official" and fresh.data.last_bin == "official"


def test_old_checkpoints_evaluate_with_their_old_window(tiny_root, tmp_path):
    raw = small_raw(tiny_root, tmp_path)
    old_cfg = validate(apply_switches(raw, PRE_PARITY, keep_given=True))
    collection = open_collection(old_cfg.data)
    torch.manual_seed(0)
    model = build_model(old_cfg.model, old_cfg.plugins, video_dim=collection.video_dim, query_dim=collection.query_dim)
    old = tmp_path / "old.pt"
    torch.save({"model": model.state_dict(), "config": raw, "epoch": 0}, old)  # pre-format-2: keys absent
    new = tmp_path / "new.pt"
    torch.save({"model": model.state_dict(), "config": validate(raw).to_dict(), "epoch": 0, "format": 2}, new)
    from prvrlab.evaluation.retrieval import evaluate

    expected = evaluate(model, collection, "val", old_cfg.eval, device=torch.device("cpu")).ranks
    assert (evaluate_checkpoint(old, split="val").ranks == expected).all()
    assert not (evaluate_checkpoint(new, split="val").ranks == expected).all()  # official window: other scores


def test_the_corrected_preset_switches_only_what_exists(tiny_root, tmp_path):
    raw = small_raw(tiny_root, tmp_path)
    raw["model"]["window"] = "official"
    corrected = validate(apply_preset(raw, "corrected"))
    assert corrected.model["window"] == "centred" and corrected.model["window_length"] == "real"  # a preset wins
    assert corrected.data.last_bin == "inclusive" and corrected.train.clip_grad == "global"
    assert corrected.data.normalize == "exact" and validate(raw).data.normalize == "official"
    mssl = dict(raw, model={"name": "mssl", "hidden_size": 32, "num_heads": 2}, losses={
        "clip_triplet": {"loss": "triplet", "branch": "clip"}, "pm": {"loss": "ral_pm", "weight": 0.0}})
    out = apply_preset(mssl, "corrected")
    assert "window" not in out["model"]  # MS-SL has no Gaussian window
    assert out["model"]["frame_training"] == "all_pairs" and "frame_training" not in apply_preset(raw, "corrected")["model"]
    assert out["losses"]["pm"]["formulation"] == "paper" and "formulation" not in out["losses"]["clip_triplet"]
    with pytest.raises(ValueError, match="did you mean 'corrected'"):
        apply_preset(raw, "corected")


def ral_raw(tiny_root, tmp_path) -> dict:
    raw = small_raw(tiny_root, tmp_path)
    raw["plugins"] = {"ral": {"csa": False}}
    raw["losses"] = {**raw["losses"], "pm": {"loss": "ral_pm", "weight": 0.001}, "da": {"loss": "ral_da", "weight": 0.001}}
    return raw


def check_an_old_format(tiny_root, tmp_path, *, key: str, trained_with: str, old_format: int, tweak=None) -> dict:
    """A RAL model trained with ``plugins.ral.<key>: trained_with`` saved as a file of ``old_format``, whose
    stored config lacks the key (it did not exist yet): evaluated as it was trained; the same file claimed
    as the next format (the key's current default) is refused. Returns the raw config."""
    from prvrlab.evaluation.retrieval import evaluate

    raw = ral_raw(tiny_root, tmp_path)
    trained = validate(apply_switches(raw, {"plugins.ral": {key: trained_with}}, keep_given=False))
    collection = open_collection(trained.data)
    torch.manual_seed(0)
    model = build_model(trained.model, trained.plugins, video_dim=collection.video_dim, query_dim=collection.query_dim)
    if tweak is not None:
        tweak(model)
    stored = validate(raw).to_dict()
    del stored["plugins"]["ral"][key]
    for fmt, name in ((old_format, "old.pt"), (old_format + 1, "new.pt")):
        torch.save({"model": model.state_dict(), "config": stored, "epoch": 1, "format": fmt}, tmp_path / name)
    expected = evaluate(model, collection, "val", trained.eval, device=torch.device("cpu")).ranks
    assert (evaluate_checkpoint(tmp_path / "old.pt", split="val").ranks == expected).all()
    with pytest.raises(Exception, match="weights do not fit"):
        evaluate_checkpoint(tmp_path / "new.pt", split="val")
    return raw


def test_a_format_3_checkpoint_keeps_the_paper_heads_and_all_pairs_frames(tiny_root, tmp_path):
    """Format 4 added plugins.ral.heads (official) and MS-SL's frame_training (official); a file written
    before stored neither key and was trained with the paper heads and all-pairs frame scores."""
    raw = check_an_old_format(tiny_root, tmp_path, key="heads", trained_with="paper", old_format=3)
    assert stored_behaviour(raw, 3)["plugins"]["ral"] == {
        "csa": False, "heads": "paper", "csa_padding": "masked", "word_encoder": "backbone", "word_positions": "own",
        "heads_padding": "masked", "text_heads_padding": "masked", "logvar_range": "clamped", "norm_decay": False}
    assert apply_preset(raw, "corrected")["plugins"]["ral"]["csa_padding"] == "masked"
    mssl = dict(raw, plugins={}, model={"name": "mssl", "hidden_size": 32, "num_heads": 2})
    assert stored_behaviour(mssl, 3)["model"]["frame_training"] == "all_pairs"
    assert stored_behaviour(mssl, 3)["data"]["normalize"] == "exact" and "normalize" not in stored_behaviour(mssl, 4)["data"]
    assert "frame_training" not in stored_behaviour(mssl, 4)["model"]
    assert stored_behaviour(dict(mssl, model={**mssl["model"], "frame_training": "official"}), 3)["model"]["frame_training"] == "official"


def test_a_format_4_checkpoint_keeps_rals_own_word_positions(tiny_root, tmp_path):
    """Format 5 added plugins.ral.word_positions (shared, the official layout); a format-4 file's second
    text encoder had a positional embedding of its own, which a shared model cannot hold: the file is
    evaluated as it was trained, and the same weights claimed as format 5 are refused (the two tables
    differ), not half-loaded."""

    def as_after_training(model) -> None:
        with torch.no_grad():
            model.plugins["ral"].words.pos.embedding.weight.add_(1.0)  # unlike the backbone's table

    raw = check_an_old_format(tiny_root, tmp_path, key="word_positions", trained_with="own", old_format=4,
                              tweak=as_after_training)
    assert stored_behaviour(raw, 4)["plugins"]["ral"]["word_positions"] == "own"
    assert "word_positions" not in stored_behaviour(raw, 5)["plugins"]["ral"]


@pytest.mark.parametrize(("new_format", "key", "official", "before"), [
    (6, "text_heads_padding", "official", "masked"),  # acts in training only: the file evaluates the same
    (7, "logvar_range", "official", "clamped"),  # training only
    (7, "norm_decay", True, False),  # the optimiser's groups only
])
def test_a_file_before_a_training_switch_means_prvrlabs_earlier_behaviour(new_format, key, official, before):
    """A format added a plugins.ral switch whose default is the official behaviour; a file of the format
    before stored no value and was trained with prvrlab's earlier one; a value the file stores wins; the
    corrected preset sets the earlier (prvrlab) behaviour."""
    raw = {"model": {"name": "gmmformer_v2"}, "plugins": {"ral": {"csa": False}}}
    assert stored_behaviour(raw, new_format - 1)["plugins"]["ral"][key] == before
    assert key not in stored_behaviour(raw, new_format)["plugins"]["ral"]
    given = {**raw, "plugins": {"ral": {key: official}}}
    assert stored_behaviour(given, new_format - 1)["plugins"]["ral"][key] == official
    assert apply_preset(raw, "corrected")["plugins"]["ral"][key] == before
    if key == "norm_decay":  # the backbone's switch of the same format and name
        assert stored_behaviour(raw, new_format - 1)["model"]["norm_decay"] is False
        assert "norm_decay" not in stored_behaviour(raw, new_format)["model"]
        assert apply_preset(raw, "corrected")["model"]["norm_decay"] is False
        assert "norm_decay" not in stored_behaviour({"model": {"name": "gmmformer"}}, new_format - 1)["model"]
        assert apply_preset({"model": {"name": "mamfusion"}}, "corrected")["model"]["mamba_norm_decay"] is False


@pytest.mark.parametrize("switches", [PRESETS["corrected"], PRE_PARITY, *BEFORE_FORMAT.values()],
                         ids=["corrected", "pre_parity", *(f"before_format_{f}" for f in BEFORE_FORMAT)])
def test_every_switch_names_an_existing_key_and_value(switches):
    """A misspelt switch would silently do nothing: every key exists somewhere and every value is allowed."""
    import dataclasses
    import typing

    from prvrlab.data.config import DataConfig
    from prvrlab.platform.config import TrainConfig
    from prvrlab.registry import BACKBONES, LOSSES, PLUGINS

    def allowed(annotation, value) -> bool:
        choices = typing.get_args(annotation) if typing.get_origin(annotation) is typing.Literal else None
        return choices is None or value in choices

    for section, values in switches.items():
        for key, value in values.items():
            if section in ("data", "train"):
                fields = {f.name: f for f in dataclasses.fields(DataConfig if section == "data" else TrainConfig)}
                hints = typing.get_type_hints(DataConfig if section == "data" else TrainConfig)
                assert key in fields and allowed(hints[key], value), f"{section}.{key}={value!r}"
                continue
            if section == "model":
                owners = [BACKBONES.params(n)[key] for n in BACKBONES.names() if key in BACKBONES.params(n)]
            elif section.startswith("plugins."):
                params = PLUGINS.params(section.split(".", 1)[1])
                owners = [params[key]] if key in params else []
            else:
                params = LOSSES.params(section.split(":", 1)[1])
                owners = [params[key]] if key in params else []
            assert owners, f"{section}: no component has {key!r}"
            assert any(allowed(p.annotation, value) for p in owners), f"{section}.{key}={value!r}"


def test_a_file_before_format_8_keeps_the_gaussian_windows_it_was_trained_with(tiny_root, tmp_path):
    """Format 8 made ``window: official`` divide each window row by its maximum (the reference); a file
    written before holds ``official`` (or nothing) and was trained without the division: it is evaluated
    with ``official_raw``; ``centred`` and backbones without windows are left alone; the renamed value is
    one the backbones accept."""
    import typing

    from prvrlab.platform.presets import RENAMED_BEFORE_FORMAT
    from prvrlab.platform.train.checkpoint_eval import checkpoint_config
    from prvrlab.registry import BACKBONES

    raw = small_raw(tiny_root, tmp_path)
    stored = validate(raw).to_dict()
    assert stored["model"]["window"] == "official"
    assert checkpoint_config({"config": stored, "format": 7}, "old.pt").model["window"] == "official_raw"
    assert checkpoint_config({"config": stored, "format": 8}, "new.pt").model["window"] == "official"
    unset = {**stored, "model": {k: v for k, v in stored["model"].items() if k != "window"}}
    assert checkpoint_config({"config": unset, "format": 1}, "old.pt").model["window"] == "centred"  # PRE_PARITY
    assert stored_behaviour(unset, 7)["model"]["window"] == "official_raw"  # the backbone's default then
    centred = {**stored, "model": {**stored["model"], "window": "centred"}}
    assert stored_behaviour(centred, 7)["model"]["window"] == "centred"
    assert "window" not in stored_behaviour({"model": {"name": "mssl"}}, 7)["model"]
    for renames in RENAMED_BEFORE_FORMAT.values():
        for key, names in renames.items():
            owners = [BACKBONES.params(n)[key] for n in BACKBONES.names() if key in BACKBONES.params(n)]
            assert owners and all(set(names.values()) <= set(typing.get_args(p.annotation)) for p in owners)
    from prvrlab.models.gmm import GaussianAttention

    outputs = {}
    for window in ("official", "official_raw"):
        torch.manual_seed(0)
        attn = GaussianAttention(hidden_size=8, num_heads=2, sigmas=(0.1,), window=window, window_length="padded")
        for p in attn.parameters():
            torch.nn.init.normal_(p, std=0.5)
        outputs[window] = attn.eval()(torch.randn(1, 32, 8, generator=torch.Generator().manual_seed(1)))
    assert not torch.allclose(outputs["official"], outputs["official_raw"], atol=1e-2)  # same weights, other windows


def test_a_format_7_mssl_checkpoint_keeps_its_two_query_vectors(tiny_root, tmp_path):
    """Format 8 made MS-SL pool one query vector for both branches (the reference's Linear(D, 1)); a file
    written before stored no query_pooling and holds a Linear(D, 2) head: evaluated as it was trained;
    the same weights claimed as format 8 are refused, not half-loaded."""
    check_a_format_7_model(tiny_root, tmp_path, "mssl", {"query_pooling": "per_branch"}, {"query_pooling": "shared"})
    assert stored_behaviour({"model": {"name": "mssl"}}, 7)["model"]["query_pooling"] == "per_branch"
    assert "query_pooling" not in stored_behaviour({"model": {"name": "mssl"}}, 8)["model"]
