"""One small registry per plug-in axis (solvers, halting rules, gradient modes).

A plug-in is a class with a ``name`` and an ``Options`` dataclass (its typed options, grouped in
``LoopConfig`` under that name); ``REGISTRY.register`` adds it, ``REGISTRY.get(name)`` finds it
and the valid names of a ``LoopConfig`` field are ``REGISTRY.names()``. Nothing else in the
engine knows which plug-ins exist (docs/architecture.md, "Extending loopformer").
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

T = TypeVar("T", bound=type)


@dataclass(frozen=True)
class NoOptions:
    """The options of a plug-in that has none."""

    legacy_names: ClassVar[dict[str, str]] = {}


class Registry(Generic[T]):
    """name -> plug-in class for one axis; names are kept in registration order."""

    def __init__(self, kind: str, base: type) -> None:
        self.kind = kind
        self.base = base
        self._classes: dict[str, Any] = {}

    def register(self, cls: T | None = None, *, replace: bool = False) -> Any:
        """Register ``cls`` under ``cls.name`` (usable as a decorator); a taken name is an error
        unless ``replace=True``."""

        def add(c: T) -> T:
            if not (isinstance(c, type) and issubclass(c, self.base)):
                raise TypeError(f"a {self.kind} plug-in must subclass {self.base.__name__}, got {c!r}")
            name = getattr(c, "name", None)
            if not isinstance(name, str) or not name.isidentifier():
                raise ValueError(
                    f"{self.kind} plug-in {c.__name__} needs a class attribute name = '<identifier>'"
                )
            if name in self._classes and not replace and self._classes[name] is not c:
                raise ValueError(
                    f"{self.kind} {name!r} is already registered ({self._classes[name].__name__}); "
                    "pass replace=True to override it"
                )
            self._classes[name] = c
            return c

        return add if cls is None else add(cls)

    def unregister(self, name: str) -> None:
        """Remove a plug-in (tests that register temporary ones clean up with this)."""
        self._classes.pop(name, None)

    def get(self, name: str) -> Any:
        try:
            return self._classes[name]
        except KeyError:
            raise ValueError(
                f"unknown {self.kind} {name!r}; choose one of {', '.join(map(repr, self._classes))}"
            ) from None

    def names(self) -> tuple[str, ...]:
        return tuple(self._classes)

    def select(self, keep: Callable[[Any], bool]) -> tuple[str, ...]:
        """Names of the plug-ins whose class satisfies ``keep`` (e.g. solvers usable for IFT)."""
        return tuple(n for n, c in self._classes.items() if keep(c))

    def __contains__(self, name: object) -> bool:
        return name in self._classes

    def __iter__(self) -> Iterator[str]:
        return iter(self._classes)
