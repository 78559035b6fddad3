"""``prvrlab eval`` on the device under test (``PRVRLAB_TEST_DEVICE``): a model trained there is evaluated
there by default, and its metrics are the CPU's (to the bit on the CPU; within one query's share on a GPU,
whose float32 products may order near-ties differently)."""

from __future__ import annotations

import pytest
import torch

from prvrlab.evaluation import retrieval
from prvrlab.platform.config import validate
from prvrlab.platform.train.checkpoint_eval import evaluate_checkpoint
from prvrlab.platform.train.loop import run_local

from device_under_test import DEVICE, as_a_program
from train_helpers import small_raw


@pytest.fixture(scope="module")
def run_dir(tiny_root, tmp_path_factory):
    """A 2-epoch in-process run on the device under test, with its config.yaml as the driver writes it."""
    tmp = tmp_path_factory.mktemp("eval_device")
    cfg = validate(small_raw(tiny_root, tmp, epochs=2, use_gpu=DEVICE.type == "cuda"))
    with as_a_program():
        run_local(cfg, tmp / "run")
    (tmp / "run" / "config.yaml").write_text(cfg.to_yaml())
    return tmp / "run"


@pytest.mark.parametrize("saved", ["best_model.pt", "local_session/checkpoint_latest"])
def test_a_saved_model_is_evaluated_where_it_trained(run_dir, monkeypatch, saved):
    seen = []
    real = retrieval.evaluate

    def spy(model, *args, **kwargs):
        seen.append((next(model.parameters()).device, kwargs["device"]))
        return real(model, *args, **kwargs)

    monkeypatch.setattr(retrieval, "evaluate", spy)
    with as_a_program():
        here = evaluate_checkpoint(run_dir / saved, split="val")  # default: where the run trained
        on_cpu = evaluate_checkpoint(run_dir / saved, split="val", device="cpu")
    assert [(p.type, torch.device(d).type) for p, d in seen] == [(DEVICE.type, DEVICE.type), ("cpu", "cpu")]
    assert here.num_queries == on_cpu.num_queries > 0
    if DEVICE.type == "cpu":
        assert (here.ranks == on_cpu.ranks).all() and here.metrics == on_cpu.metrics
    else:
        share = 100.0 / here.num_queries  # one query moving across a cut-off
        for key, value in on_cpu.metrics.items():
            assert here.metrics[key] == pytest.approx(value, abs=4 * share + 1e-6), key

