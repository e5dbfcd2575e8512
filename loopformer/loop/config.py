"""LoopConfig: every knob of the loop engine in one validated dataclass, and the registries it names
plug-ins from.

Three plug-in axes (docs/architecture.md): ``solver`` (how the next iterate is formed), ``halting`` (when a
sample stops) and ``grad`` (how gradients flow back through the loop). Each axis is a ``Registry`` of classes
(``SOLVERS`` in solvers.py, ``HALTINGS`` in halting.py, ``GRADS`` in grad.py); a plug-in is one class
registered under its ``name``, with its typed options in its own frozen ``Options`` dataclass. LoopConfig
imports no plug-in: it checks its names against the registries (``AXES``, filled as each axis module makes
its registry) and keeps the options of plug-ins by name in ``plugins`` (a table or an ``Options`` instance
each, typed by the registered class). In a recipe a plug-in's table sits beside the other keys, ``loop_eval: {solver: damped,
damped: {gamma: 0.99}}``; in Python ``LoopConfig(solver="damped", plugins={"damped": {"gamma": 0.99}})``;
``cfg.options_for("damped")`` gives the typed options (the table given, else the class's defaults). The
plug-ins a config runs (its solver, halting rule and gradient mode) always have their options in ``plugins``,
so a dumped config records every option it ran with; another plug-in's options are kept where they differ from
its defaults (one canonical form: equal loops compare equal).

Defaults follow the papers; each plug-in's ``Options`` says where its own come from.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch

from loopformer.loop.norms import RESIDUAL_NORMS

T = TypeVar("T", bound=type)

STATE_DTYPES: dict[str, Any] = {"auto": None, "float32": "float32", "bfloat16": "bfloat16"}
# LoopConfig.sync_every = -1 (auto, the default): on the CPU a host read costs nothing, so 1 (the per-step
# path); on a GPU every SYNC_EVERY_CUDA iterations: the largest k whose extra map evaluations (finished rows
# carried until the next read) stay within 10% on the benchmarked evaluation loops (benchmarks/bench_sync.py,
# the sync rows of docs/performance.md)
SYNC_AUTO = -1
SYNC_EVERY_CUDA = 4


# --------------------------------------------------------------------------------------------
# The registries
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NoOptions:
    """The options of a plug-in that has none."""


class Registry(Generic[T]):
    """name -> plug-in class for one axis; names are kept in registration order.

    ``register`` adds a class under its ``name`` (a taken name is an error unless ``replace=True``);
    ``get(name)`` finds it; a ``module:Class`` name is accepted wherever a registered name is
    (``LoopConfig(solver="mypkg.solvers:Relaxed")``): the module is imported and the class kept under that
    name; a name not registered yet is looked up again after the ``loopformer.plugins`` entry points are
    loaded. ``aliases`` are other spellings of registered names (``never`` for ``fixed``).
    """

    def __init__(self, kind: str, base: type, aliases: Mapping[str, str] | None = None) -> None:
        self.kind = kind
        self.base = base
        self.aliases = dict(aliases or {})
        self._classes: dict[str, Any] = {}
        self._paths: dict[str, Any] = {}  # "module:Class" names already resolved
        AXES[kind] = self

    def register(self, cls: T | None = None, *, replace: bool = False) -> Any:
        """Register ``cls`` under ``cls.name`` (usable as a decorator)."""

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

    def canonical(self, name: Any) -> Any:
        """The registered spelling of ``name`` (an alias resolved)."""
        return self.aliases.get(name, name) if isinstance(name, str) else name

    def get(self, name: str) -> Any:
        name = self.canonical(name)
        if name in self:
            return self._classes.get(name) or self._paths[name]
        raise ValueError(
            f"unknown {self.kind} {name!r}; choose one of {', '.join(map(repr, self._classes))} "
            "(or a module:Class path)"
        )

    def names(self) -> tuple[str, ...]:
        return tuple(self._classes)

    def items(self) -> Iterator[tuple[str, Any]]:
        return iter(tuple(self._classes.items()))

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


# axis -> its registry ("solver": SOLVERS, "halting": HALTINGS, "grad": GRADS), filled by Registry() as
# solvers.py, halting.py and grad.py are imported (loopformer.loop imports them all)
AXES: dict[str, Registry] = {}
AXIS_NAMES = ("solver", "halting", "grad")


def plugin_class(name: str) -> Any:
    """The plug-in registered as ``name`` on any axis; ValueError naming every plug-in when there is none."""
    for registry in AXES.values():
        if name in registry:
            return registry.get(name)
    known = ", ".join(repr(n) for r in AXES.values() for n in r.names())
    raise ValueError(f"no plug-in is registered as {name!r} (plug-ins: {known})")


def plugin_options(table: Mapping[str, Any] | None = None) -> dict[str, type]:
    """{name: Options class} of every registered plug-in that takes options: the keys a loop table may hold
    beside LoopConfig's fields. The ``module:Class`` plug-ins ``table`` names are imported first, so their
    options count too."""
    from loopformer.plugins import is_class_path

    for axis in AXIS_NAMES:
        value = (table or {}).get(axis)
        if axis in AXES and is_class_path(value):
            AXES[axis].get(value)  # imports the module:Class plug-in and registers it under its name
    return {
        name: cls.Options
        for registry in AXES.values()
        for name, cls in registry.items()
        if getattr(cls, "Options", NoOptions) is not NoOptions
    }


def plugin_defaults() -> dict[str, Any]:
    """Every registered plug-in's default options, by name: what a stored loop table of an earlier version
    that lists a plug-in's options means where this version's omits them."""
    return {name: options_cls() for name, options_cls in plugin_options().items()}


# --------------------------------------------------------------------------------------------
# The configuration
# --------------------------------------------------------------------------------------------
@dataclass
class LoopConfig:
    """How ``run_loop`` iterates, halts and differentiates. Validated on construction."""

    solver: str = "picard"  # a name in SOLVERS: picard | damped | anderson | broyden | ...
    halting: str = "fixed"  # a name in HALTINGS: fixed (alias "never") | residual | kl_entropy | act | ...
    max_steps: int = 16  # hard cap on iterations (ACT: the last step always halts)
    min_steps: int = 0  # no halting (except divergence) before this many iterations
    tol: float = 1e-3  # residual halting threshold (FPRM eps; Attractor tol)
    residual_norm: str = "rel_l2"  # rel_l2 (DEQ / Attractor) | rel_sup (FPRM relative sup norm)
    grad: str = "bptt"  # a name in GRADS: bptt | truncated | onestep | neumann | ift | ...
    grad_steps: int = 1  # truncated: differentiable final steps; neumann: number of J^T terms
    compaction: bool = True  # drop halted samples from the active batch (else torch.where masking)
    diverge_threshold: float = 1e4  # residual above this (or non-finite) stops a sample, not converged
    # False: no divergence stop at all (a sample iterates on whatever its residual, and a non-finite state
    # reaches the loss, where the trainer stops the run): the FPRM / TRM / HRM references' training segments
    # and TRM-DEQ's inner solve run their steps with no such test
    stop_diverged: bool = True
    trace: bool = True  # record residuals / state norms every step (fixed halting may skip them)
    # how often the host asks whether every sample halted: 1 = after every iteration (exact early exit and
    # compaction at once); k > 1 = halting is decided on the device, finished rows are frozen with torch.where
    # and the host reads once every k iterations (then drops the finished rows with compaction); 0 = never:
    # the loop runs to max_steps without a host read (training loops: RunConfig.loop_config sets 0 for
    # loop_train unless a recipe says otherwise); -1 = auto: 1 on the CPU, SYNC_EVERY_CUDA on a GPU.
    # Results are identical for every k (tests/test_loop_sync.py).
    sync_every: int = SYNC_AUTO
    # the loop state's precision (STATE_DTYPES): auto = as the model gives it (float32 under bf16 autocast);
    # bfloat16 = the FPRM reference's (nilskiKonjIzDunava/fprm FixedPointOptimizer): the iterate, the
    # injected context and every step's output are cast to bf16, the residual and the damped solver's step
    # size / best residual are computed in bf16 (its decay factor rounded to bf16: 0.996 and 0.997 both
    # become 0.99609375); needs bf16 autocast (bf16: true) for the body's matmuls
    state_dtype: str = "auto"
    # rows per group of a batch-wide halting rule (batch_residual): the rule decides per group of this many
    # consecutive rows of the batch (0: the whole batch). The Attractor LM's solver stops on its 32-sequence
    # micro-batch (github jacobfa/Attractor launch_configs/attractor-small-140m.yaml micro_batch_size 32);
    # groups that do not straddle micro-batches let gradient accumulation equal the full batch
    halt_group: int = 0
    # the options of plug-ins, by name (each typed by its registered class's Options); in a table they sit
    # beside the fields above (loopformer.config reads them through this metadata)
    plugins: dict[str, Any] = field(default_factory=dict, metadata={"beside": plugin_options})

    @property
    def torch_state_dtype(self) -> torch.dtype | None:
        """The ``torch.dtype`` the loop keeps its state in, None for ``auto``."""
        name = STATE_DTYPES[self.state_dtype]
        return None if name is None else getattr(torch, name)

    @property
    def low_precision_state(self) -> bool:
        """Whether the state (and the damped solver's scalars) live in bfloat16 arithmetic."""
        return self.state_dtype == "bfloat16"

    def options_for(self, plugin: type | str) -> Any:
        """The typed options of a plug-in (its class or its registered name): its table in ``plugins``, else
        its ``Options`` defaults."""
        cls = plugin_class(plugin) if isinstance(plugin, str) else plugin
        value = self.plugins.get(cls.name)
        return getattr(cls, "Options", NoOptions)() if value is None else value

    def __post_init__(self) -> None:
        chosen = []
        for axis in AXIS_NAMES:
            registry = AXES[axis]
            value = registry.canonical(getattr(self, axis))
            if value not in registry:  # registered, module:Class or from an entry point
                _choice(axis, value, registry.names() + tuple(registry.aliases))
            setattr(self, axis, value)
            chosen.append(registry.get(value))
        _choice("residual_norm", self.residual_norm, RESIDUAL_NORMS)
        _choice("state_dtype", self.state_dtype, tuple(STATE_DTYPES))
        _integer("max_steps", self.max_steps, 1)
        _integer("min_steps", self.min_steps, 0)
        _integer("grad_steps", self.grad_steps, 0)
        _integer("halt_group", self.halt_group, 0)
        _integer("sync_every", self.sync_every, SYNC_AUTO)
        if not isinstance(self.stop_diverged, bool):
            raise ValueError(f"LoopConfig.stop_diverged must be true or false, got {self.stop_diverged!r}")
        if self.min_steps > self.max_steps:
            raise ValueError(f"LoopConfig.min_steps={self.min_steps} exceeds max_steps={self.max_steps}")
        for name in ("tol", "diverge_threshold"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"LoopConfig.{name} must be a number > 0, got {value!r}")
        if not math.isfinite(self.tol):  # an infinite tolerance halts every sample before its first step
            raise ValueError(f"LoopConfig.tol must be finite, got {self.tol!r}")
        self.plugins = _typed_plugins(self.plugins, chosen)
        for plugin in chosen:
            plugin.check_config(self)


def _typed_plugins(given: Any, chosen: list[Any]) -> dict[str, Any]:
    """``given`` (plug-in name -> table or Options) typed by each plug-in's Options class, in one canonical
    form so that equal loops compare equal: the ``chosen`` plug-ins' options always (their defaults when not
    given), another plug-in's only when they differ from its defaults."""
    if not isinstance(given, Mapping):
        raise ValueError(f"LoopConfig.plugins must be a table of plug-in options, got {given!r}")
    out = {}
    for name, value in given.items():
        options_cls = getattr(plugin_class(name), "Options", NoOptions)
        if options_cls is NoOptions:
            raise ValueError(f"LoopConfig.{name}: plug-in {name!r} takes no options")
        if isinstance(value, Mapping):
            try:
                value = options_cls(**value)
            except TypeError as err:
                raise ValueError(f"LoopConfig.{name}: {err}") from None
        elif not isinstance(value, options_cls):
            raise ValueError(
                f"LoopConfig.{name} must be a {options_cls.__name__} or a table of its fields, got {value!r}"
            )
        out[name] = value
    names = {plugin.name for plugin in chosen if getattr(plugin, "Options", NoOptions) is not NoOptions}
    for plugin in chosen:
        if plugin.name in names and plugin.name not in out:
            out[plugin.name] = plugin.Options()
    return {name: value for name, value in out.items() if name in names or value != type(value)()}


def option_error(plugin: str, key: str, message: str) -> ValueError:
    """``LoopConfig.<plugin>.<key> <message>``: an Options class's refusal, named as a recipe writes the
    key."""
    return ValueError(f"LoopConfig.{plugin}.{key} {message}")


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"LoopConfig.{name}={value!r} is not one of {', '.join(map(repr, allowed))}")


def _integer(name: str, value: Any, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"LoopConfig.{name} must be an integer >= {low}, got {value!r}")


__all__ = [
    "AXES",
    "STATE_DTYPES",
    "SYNC_AUTO",
    "SYNC_EVERY_CUDA",
    "LoopConfig",
    "NoOptions",
    "Registry",
    "plugin_class",
    "plugin_defaults",
    "option_error",
    "plugin_options",
]
