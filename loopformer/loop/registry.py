"""One small registry per plug-in axis (solvers, halting rules, gradient modes).

A plug-in is a class with a ``name`` and an ``Options`` dataclass (its typed options, grouped in
``LoopConfig`` under that name); ``REGISTRY.register`` adds it, ``REGISTRY.get(name)`` finds it
and the valid names of a ``LoopConfig`` field are ``REGISTRY.names()``. Nothing else in the
engine knows which plug-ins exist (docs/extending.md). A ``module:Class`` name is accepted wherever a
registered name is (``LoopConfig(solver="mypkg.solvers:Relaxed")``): ``get`` imports the module and keeps
the class under that name; a name not registered yet is looked up again after the ``loopformer.plugins``
entry points are loaded (``loopformer.plugins``).
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
        self._paths: dict[str, Any] = {}  # "module:Class" names already resolved

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
        cls = self._classes.pop(name, None)
        self._paths = {path: c for path, c in self._paths.items() if c is not cls and path != name}

    def get(self, name: str) -> Any:
        if name in self:
            return self._classes.get(name) or self._paths[name]
        raise ValueError(
            f"unknown {self.kind} {name!r}; choose one of {', '.join(map(repr, self._classes))} "
            "(or a module:Class path)"
        )

    def names(self) -> tuple[str, ...]:
        return tuple(self._classes)

    def select(self, keep: Callable[[Any], bool]) -> tuple[str, ...]:
        """Names of the plug-ins whose class satisfies ``keep`` (e.g. solvers usable for IFT)."""
        return tuple(n for n, c in self._classes.items() if keep(c))

    def __contains__(self, name: object) -> bool:
        """Registered, a ``module:Class`` path (imported here: ``PluginError`` when it cannot be), or
        registered by a ``loopformer.plugins`` entry point."""
        from loopformer.plugins import is_class_path, load_entry_points, resolve_class

        if name in self._classes or name in self._paths:
            return True
        if is_class_path(name):
            cls = resolve_class(str(name), self.base, self.kind)
            if getattr(cls, "name", None) not in self._classes:
                self.register(cls)
            self._paths[str(name)] = cls
            return True
        return isinstance(name, str) and bool(load_entry_points()) and name in self._classes

    def __iter__(self) -> Iterator[str]:
        return iter(self._classes)
