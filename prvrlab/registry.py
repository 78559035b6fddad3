"""Name-based registries for backbones, losses and plug-ins.

A component registers itself under a literal name with a decorator::

    @LOSSES.register("triplet")
    class TripletLoss(Loss):
        def __init__(self, *, margin: float = 0.1) -> None: ...

The platform (config validation, trainer, search, reports) only ever looks
components up by that name, so adding one means adding one file.  Modules in
``prvrlab.models``, ``prvrlab.losses`` and ``prvrlab.models.plugins`` are imported on first lookup, which
is what makes a new file self-registering.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import pkgutil
import typing
from dataclasses import dataclass
from typing import Any, Callable, Generic, TypeVar

T = TypeVar("T")


class RegistryError(KeyError):
    """An unknown component name or a bad constructor argument."""

    def __str__(self) -> str:  # KeyError quotes its message; we do not want that
        return str(self.args[0]) if self.args else ""


def closest(name: str, candidates: typing.Iterable[str]) -> str | None:
    """The candidate most similar to ``name`` (or None when nothing is close)."""
    match = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.5)
    return match[0] if match else None


def did_you_mean(name: str, candidates: typing.Iterable[str]) -> str:
    """A ' (did you mean 'x'?)' suffix, or '' when nothing is close."""
    best = closest(name, candidates)
    return f" (did you mean '{best}'?)" if best else ""


def closest_key(key: str, candidates: typing.Iterable[str]) -> str | None:
    """The dotted candidate most similar to dotted ``key``: its last part against the last parts of the
    candidates under the same prefix (a shared ``train.`` alone makes no key similar), or the whole key
    when no candidate has its prefix (a misspelt section or term); None when nothing is close."""
    candidates = list(candidates)
    prefix, _, leaf = key.rpartition(".")
    siblings = {c.rpartition(".")[2]: c for c in candidates if c.rpartition(".")[0] == prefix}
    if siblings:  # of the close ones, one the key begins (train.batch: batch_size before ddp_batch)
        close = difflib.get_close_matches(leaf, list(siblings), n=3, cutoff=0.5)
        best = next((c for c in close if c.startswith(leaf)), close[0] if close else None)
        return siblings[best] if best else None
    return closest(key, candidates)


def did_you_mean_key(key: str, candidates: typing.Iterable[str]) -> str:
    """:func:`did_you_mean` for dotted keys, by :func:`closest_key`."""
    best = closest_key(key, candidates)
    return f" (did you mean '{best}'?)" if best else ""


@dataclass(frozen=True)
class ConstructorParam:
    """One keyword-only constructor parameter of a registered component."""

    name: str
    annotation: Any
    default: Any
    required: bool


class Registry(Generic[T]):
    """A mapping from literal names to component classes (or factories)."""

    def __init__(self, kind: str, package: str) -> None:
        self.kind = kind
        self._package = package
        self._items: dict[str, Callable[..., T]] = {}
        self._loaded = False

    def register(self, name: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
        """Class decorator registering ``cls`` under ``name``."""

        def deco(cls: Callable[..., T]) -> Callable[..., T]:
            existing = self._items.get(name)
            if existing is not None and existing is not cls:
                raise RegistryError(f"{self.kind} '{name}' is registered twice")
            _check_keyword_only(cls, f"{self.kind} '{name}'")
            self._items[name] = cls
            cls.registered_name = name  # type: ignore[attr-defined]
            return cls

        return deco

    def _load(self) -> None:
        if self._loaded:
            return
        self._loaded = True
        pkg = importlib.import_module(self._package)
        for info in pkgutil.iter_modules(pkg.__path__):
            if not info.name.startswith("_"):
                importlib.import_module(f"{self._package}.{info.name}")

    def names(self) -> list[str]:
        """All registered names, sorted."""
        self._load()
        return sorted(self._items)

    def get(self, name: str) -> Callable[..., T]:
        """The class registered as ``name``; a clear error when unknown."""
        self._load()
        try:
            return self._items[name]
        except KeyError:
            raise RegistryError(
                f"unknown {self.kind} '{name}'{did_you_mean(name, self._items)}; "
                f"registered: {', '.join(sorted(self._items))}"
            ) from None

    def params(self, name: str) -> dict[str, ConstructorParam]:
        """The keyword-only constructor parameters of ``name``."""
        return constructor_params(self.get(name))

    def build(self, name: str, **kwargs: Any) -> T:
        """Instantiate ``name`` with keyword arguments, checking their names."""
        cls = self.get(name)
        known = constructor_params(cls)
        for key in kwargs:
            if key not in known:
                raise RegistryError(
                    f"{self.kind} '{name}' has no parameter '{key}'"
                    f"{did_you_mean(key, known)}"
                )
        return cls(**kwargs)


def _check_keyword_only(cls: Callable[..., Any], what: str) -> None:
    sig = inspect.signature(cls)
    for p in sig.parameters.values():
        if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
            raise TypeError(f"{what}: constructor must not take *args/**kwargs")
        if p.kind is not p.KEYWORD_ONLY:
            raise TypeError(f"{what}: parameter '{p.name}' must be keyword-only")
        if p.annotation is p.empty:  # a config value is checked against it: without one, anything passes
            raise TypeError(f"{what}: parameter '{p.name}' needs a type annotation (config values are checked against it)")


def constructor_params(cls: Callable[..., Any]) -> dict[str, ConstructorParam]:
    """Keyword-only parameters of a constructor with resolved type hints."""
    init = cls.__init__ if inspect.isclass(cls) else cls
    try:
        hints = typing.get_type_hints(init)
    except Exception:  # pragma: no cover - unresolvable annotations
        hints = {}
    out: dict[str, ConstructorParam] = {}
    for p in inspect.signature(cls).parameters.values():
        required = p.default is inspect.Parameter.empty
        out[p.name] = ConstructorParam(
            name=p.name,
            annotation=hints.get(p.name, Any),
            default=None if required else p.default,
            required=required,
        )
    return out


BACKBONES: Registry[Any] = Registry("backbone", "prvrlab.models")
LOSSES: Registry[Any] = Registry("loss", "prvrlab.losses")
PLUGINS: Registry[Any] = Registry("plugin", "prvrlab.models.plugins")

# Constructor arguments the platform derives (never set in a config).
DATA_DERIVED = ("video_dim", "query_dim")  # backbones: from the data
PLUGIN_DERIVED = ("hidden_size",)  # plug-ins: from the backbone
