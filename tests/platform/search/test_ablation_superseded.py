"""An ablation resubmitted under its parent with another config: MLflow keeps a param's first value, so the
parent gets the changed params' values now as ``prvrlab.now.<param>`` tags and the latest study folder, and
every child run says whether a cell of the latest submission has its config (``prvrlab.superseded``), so the
MLflow UI can hide the earlier ones (``tags.prvrlab.superseded = 'false'``)."""

from __future__ import annotations

import pytest

from prvrlab.platform.search.ablation import ablate
from prvrlab.platform.search.spec import load_ablation_spec

from search_helpers import study_runs, tiny_spec

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def ray_shutdown():
    yield
    import ray

    ray.shutdown()


def test_superseded_cells_and_the_parent_now_tags(tiny_root, tmp_path):
    lines: list[str] = []

    def submit(epochs: int):
        path = tiny_spec(tmp_path, tiny_root, name="resub", overrides={"train.epochs": epochs, "eval.final_splits": []},
                         variants={"full": {}}, seeds=[0])
        return ablate(load_ablation_spec(path), echo=lines.append)

    first = submit(1)
    (row,) = [ln for ln in lines if ln.startswith("full ")]
    assert row.split()[2:] == ["—", "1"]  # one seed: no spread (it printed 0.00)
    (parent,), (child,) = study_runs(tmp_path)
    assert child.data.tags["prvrlab.superseded"] == "false"
    assert not any(k.startswith("prvrlab.now.") for k in parent.data.tags)
    second = submit(2)
    assert second.study_dir != first.study_dir
    (parent,), children = study_runs(tmp_path)
    by_epochs = {int(c.data.params["train.epochs"]): c for c in children}
    assert by_epochs[1].data.tags["prvrlab.superseded"] == "true"
    assert by_epochs[2].data.tags["prvrlab.superseded"] == "false"
    assert "'train.epochs': 1" in parent.data.params["spec.overrides"]  # MLflow keeps the first value
    assert "'train.epochs': 2" in parent.data.tags["prvrlab.now.spec.overrides"]
    assert parent.data.tags["prvrlab.study_dir"] == str(second.study_dir)
    submit(1)  # back to the first config: its run is current again, skipped as finished
    (parent,), children = study_runs(tmp_path)
    assert "prvrlab.now.spec.overrides" not in parent.data.tags  # the logged value is the current one again
    by_epochs = {int(c.data.params["train.epochs"]): c for c in children}
    assert len(children) == 2
    assert by_epochs[1].data.tags["prvrlab.superseded"] == "false"
    assert by_epochs[2].data.tags["prvrlab.superseded"] == "true"
