"""Training on a resident split (``data.resident``) is training on the streamed one, to the bit."""

from __future__ import annotations

import torch

from prvrlab.platform.config import validate
from prvrlab.platform.train.loop import run_local

from train_helpers import small_raw


def _reports(root, tmp, resident: bool) -> list[dict]:
    raw = small_raw(root, tmp, epochs=3)
    raw["model"]["dropout"] = 0.2  # the random stream matters: dropout draws from it every step
    raw["data"].update({"resident": resident, "loader_workers": 1})
    session = run_local(validate(raw), tmp / ("resident" if resident else "streamed"))
    return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in session.reports if r.get("kind") in ("epoch", "final")]


def test_a_resident_split_trains_as_the_streamed_one(tiny_root, tmp_path):
    torch.manual_seed(123)  # run_local seeds from the config: what came before must not matter
    streamed = _reports(tiny_root, tmp_path, resident=False)
    torch.manual_seed(456)
    resident = _reports(tiny_root, tmp_path, resident=True)
    assert [r["kind"] for r in resident] == ["epoch"] * 3 + ["final"]
    assert streamed[0]["train/loss"] > streamed[2]["train/loss"]  # it learns
    assert resident == streamed
