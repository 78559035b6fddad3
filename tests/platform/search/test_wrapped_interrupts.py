"""A stop (Ctrl-C, or SIGTERM through the CLI) that other code wrapped still closes the study's parent run KILLED.

Python 3.11 wraps an interrupt raised while a class is created (a lazy import, here standing in for one
inside Ray's set-up) in ``RuntimeError: Error calling __set_name__``."""

from __future__ import annotations

import pytest

from prvrlab.platform.search import ablation, tuning
from prvrlab.platform.search.spec import load_ablation_spec, load_search_spec

from search_helpers import study_runs, tiny_spec


class _StopsWhenNamed:
    def __set_name__(self, owner, name):
        raise KeyboardInterrupt


def _interrupted_import() -> None:
    type("LiteralExpr", (), {"data_type": _StopsWhenNamed()})


@pytest.mark.parametrize("kind", ["search", "ablation"])
def test_a_wrapped_interrupt_closes_the_parent_killed(tiny_root, tmp_path, monkeypatch, kind):
    module = tuning if kind == "search" else ablation
    monkeypatch.setattr(module, "prepare_environment", _interrupted_import)
    if kind == "search":
        run = lambda: tuning.search(load_search_spec(tiny_spec(tmp_path, tiny_root)), echo=None)  # noqa: E731
    else:
        path = tiny_spec(tmp_path, tiny_root, name="abl", variants={"full": {}}, seeds=[0])
        run = lambda: ablation.ablate(load_ablation_spec(path), echo=None)  # noqa: E731
    with pytest.raises(KeyboardInterrupt):
        run()
    parents, children = study_runs(tmp_path)
    assert [p.info.status for p in parents] == ["KILLED"] and children == []
