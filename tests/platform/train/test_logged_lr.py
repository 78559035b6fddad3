"""The ``lr`` an epoch reports is the rate its last optimiser step used (it had been the next step's)."""

from __future__ import annotations

from prvrlab.platform.train.loop import run_local
from prvrlab.platform.train.optim import BertAdam

from train_helpers import small_raw


def test_epoch_lr_is_the_rate_of_its_last_step(tiny_root, tmp_path, monkeypatch):
    used: list[float] = []  # the rate of every step, read from the optimiser as it steps
    boundaries: list[int] = []  # how many steps had run at each epoch's report
    original = BertAdam.step

    def recording_step(self, *args, **kwargs):
        used.append(self.param_groups[0]["lr"])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(BertAdam, "step", recording_step)
    raw = small_raw(tiny_root, tmp_path, epochs=3, warmup_proportion=0.3)
    raw["eval"] = {"final_splits": ["val"]}

    def on_report(metrics, _checkpoint=None):
        if metrics.get("kind") == "epoch":
            boundaries.append(len(used))

    session = run_local(raw, tmp_path / "run", on_report=on_report)
    logged = [r["lr"] for r in session.reports if r.get("kind") == "epoch"]
    assert len(logged) == 3 and len(set(boundaries)) == 3 and boundaries[-1] == len(used)
    assert logged == [used[n - 1] for n in boundaries]
    assert logged[-1] > 0  # the schedule reaches 0 only after the last step
