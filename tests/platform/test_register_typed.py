"""``register`` refuses a hyperparameter without a type annotation, as docs/extending.md says (every
hyperparameter is keyword-only and typed): config values are checked against the annotation, so an
untyped one let any value through (``margin: "abc"``)."""

from __future__ import annotations

import pytest

from prvrlab.registry import LOSSES


def test_an_untyped_hyperparameter_is_refused_naming_it(monkeypatch):
    LOSSES.names()
    monkeypatch.setattr(LOSSES, "_items", dict(LOSSES._items))

    class Untyped:
        def __init__(self, *, margin=0.2, scale: float = 1.0) -> None:
            self.margin, self.scale = margin, scale

    with pytest.raises(TypeError, match="loss 'untyped_test': parameter 'margin' needs a type annotation"):
        LOSSES.register("untyped_test")(Untyped)
    assert "untyped_test" not in LOSSES._items


def test_typed_keyword_only_hyperparameters_register(monkeypatch):
    LOSSES.names()
    monkeypatch.setattr(LOSSES, "_items", dict(LOSSES._items))

    class Typed:
        def __init__(self, *, margin: float = 0.2) -> None:
            self.margin = margin

    assert LOSSES.register("typed_test")(Typed) is Typed and LOSSES._items["typed_test"] is Typed
