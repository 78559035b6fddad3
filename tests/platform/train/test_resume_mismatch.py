"""A checkpoint that does not fit the run resuming from it is refused with one message naming the file and the part."""

from __future__ import annotations

import pytest
import torch

from prvrlab.platform.config import validate
from prvrlab.platform.train.loop import run_local

from train_helpers import small_raw


@pytest.fixture
def trained(tiny_root, tmp_path):
    """A finished 1-epoch run in ``tmp_path / 'run'``, its recovery checkpoint, and the raw config."""
    raw = small_raw(tiny_root, tmp_path, epochs=1)
    run_local(validate(raw), tmp_path / "run")
    (state,) = (tmp_path / "run" / "local_session").glob("checkpoint_latest/state.pt")
    return raw, state


def test_other_model_weights_name_the_checkpoint_and_the_weights(trained, tmp_path):
    raw, state = trained
    raw["model"]["hidden_size"] = 48  # other shapes than the checkpoint's
    with pytest.raises(RuntimeError, match=r"cannot resume from .*state\.pt: loading its model weights failed") as caught:
        run_local(validate(raw), tmp_path / "run")
    assert str(state) in str(caught.value) and "start a new run" in str(caught.value)
    assert "\n" not in str(caught.value)  # one line, not torch's list of every tensor


def test_optimiser_groups_of_another_layout_name_the_optimiser_state(trained, tmp_path):
    raw, state = trained
    saved = torch.load(state, weights_only=True)
    groups = saved["optimizer"]["param_groups"]
    moved = groups[0]["params"].pop()  # a parameter moved between decay groups, as an older prvrlab wrote them
    groups[-1]["params"].append(moved)
    torch.save(saved, state)
    with pytest.raises(RuntimeError, match=r"loading its optimiser state failed \(ValueError: .*\); it was written by"):
        run_local(validate(raw), tmp_path / "run")


def test_a_fitting_checkpoint_still_resumes(trained, tmp_path):
    raw, _ = trained
    session = run_local(validate(raw), tmp_path / "run")  # nothing left to train: the final round only
    assert [r["kind"] for r in session.reports] == ["final"]
