"""LoopConfig: every knob of the loop engine in one validated dataclass.

Three plug-in axes (docs/architecture.md): ``solver`` (how the next iterate is formed),
``halting`` (when a sample stops) and ``grad`` (how gradients flow back through the loop). The
valid names are those registered in ``SOLVERS`` / ``HALTINGS`` / ``GRADS``. Each plug-in's
options are a frozen dataclass grouped under its name: ``LoopConfig(solver="damped",
damped=DampedOptions(gamma=0.99))`` or, in a recipe, ``loop_eval: {solver: damped, damped:
{gamma: 0.99}}``; options of plug-ins registered outside the package go in ``plugins``
(``plugins={"my_solver": {"alpha": 0.5}}``). The flat names of earlier versions (``damp_gamma``,
``anderson_m``, ``ift_tol``, ...; ``LEGACY_NAMES``) keep working as keywords, attributes and
config keys, and map to the grouped spelling.

Defaults follow the papers: damped solver gamma 0.9 / patience 5 / min step 1e-3 (FPRM,
arXiv 2505.18001, Algorithm 1); Anderson m 5, lambda 1e-4 (relative to the Gram matrix),
mixing 1.0 (Attractor); KL 1e-3 / entropy 3.0 nats (Loop-Think-Generalize); ACT eps 0.01 (Graves,
arXiv 1603.08983).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

# the axis modules first (each imports its companion module: quasi_newton, act, implicit)
from loopformer.loop.solvers import (  # isort: skip
    SOLVERS,
    AndersonOptions,
    BroydenOptions,
    DampedOptions,
    SafeAndersonOptions,
)
from loopformer.loop.halting import HALTING_ALIASES, HALTINGS, ACTOptions, KLEntropyOptions  # isort: skip
from loopformer.loop.grad import GRADS, IFTOptions, NeumannOptions  # isort: skip
from loopformer.loop.norms import RESIDUAL_NORMS
from loopformer.loop.registry import NoOptions

STATE_DTYPES: dict[str, Any] = {"auto": None, "float32": "float32", "bfloat16": "bfloat16"}
# LoopConfig.sync_every = -1 (auto, the default): on the CPU a host read costs nothing, so 1 (the per-step
# path); on a GPU every SYNC_EVERY_CUDA iterations: the largest k whose extra map evaluations (finished rows
# carried until the next read) stay within 10% on the benchmarked evaluation loops (benchmarks/bench_sync.py,
# the sync rows of docs/performance.md)
SYNC_AUTO = -1
SYNC_EVERY_CUDA = 4


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
    # options, grouped by the plug-in they belong to
    damped: DampedOptions = field(default_factory=DampedOptions)
    anderson: AndersonOptions = field(default_factory=AndersonOptions)
    safe_anderson: SafeAndersonOptions = field(default_factory=SafeAndersonOptions)
    broyden: BroydenOptions = field(default_factory=BroydenOptions)
    kl_entropy: KLEntropyOptions = field(default_factory=KLEntropyOptions)
    act: ACTOptions = field(default_factory=ACTOptions)
    neumann: NeumannOptions = field(default_factory=NeumannOptions)
    ift: IFTOptions = field(default_factory=IFTOptions)
    plugins: dict[str, Any] = field(default_factory=dict)  # options of plug-ins without a group above

    @property
    def torch_state_dtype(self) -> torch.dtype | None:
        """The ``torch.dtype`` the loop keeps its state in, None for ``auto``."""
        name = STATE_DTYPES[self.state_dtype]
        return None if name is None else getattr(torch, name)

    @property
    def low_precision_state(self) -> bool:
        """Whether the state (and the damped solver's scalars) live in bfloat16 arithmetic."""
        return self.state_dtype == "bfloat16"

    def options_for(self, cls: type) -> Any:
        """The typed options of plug-in class ``cls`` (its group, or its table in ``plugins``)."""
        options_cls = getattr(cls, "Options", NoOptions)
        if cls.name in GROUPS and GROUPS[cls.name] is options_cls:
            return getattr(self, cls.name)
        raw = self.plugins.get(cls.name, {})
        if isinstance(raw, options_cls):
            return raw
        if not isinstance(raw, Mapping):
            raise ValueError(
                f"LoopConfig.plugins.{cls.name} must be a table of {options_cls.__name__} fields"
            )
        try:
            return options_cls(**raw)
        except TypeError as err:
            raise ValueError(f"LoopConfig.plugins.{cls.name}: {err}") from None

    @classmethod
    def nest_legacy(cls, data: Mapping[str, Any]) -> dict[str, Any]:
        """A config table with flat legacy names (``damp_gamma``) moved into their groups
        (``{"damped": {"gamma": ...}}``); a field given both ways is an error."""
        out: dict[str, Any] = {k: v for k, v in data.items() if k not in LEGACY_NAMES}
        for key, value in data.items():
            if key not in LEGACY_NAMES:
                continue
            group, name = LEGACY_NAMES[key]
            table = out.get(group, {})
            if not isinstance(table, Mapping):
                raise ValueError(f"LoopConfig: {key!r} and {group!r} given together; use {group}.{name} only")
            if name in table:
                raise ValueError(f"LoopConfig: {key!r} and {group}.{name} both given; keep {group}.{name}")
            out[group] = {**table, name: value}
        return out

    def _validate(self) -> None:
        self.halting = HALTING_ALIASES.get(self.halting, self.halting)
        for name, registry in (("solver", SOLVERS), ("halting", HALTINGS), ("grad", GRADS)):
            if getattr(self, name) not in registry:  # registered, module:Class or from an entry point
                allowed = registry.names() + (tuple(HALTING_ALIASES) if name == "halting" else ())
                _choice(name, getattr(self, name), allowed)
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
        for name, options_cls in GROUPS.items():
            setattr(self, name, _group(name, getattr(self, name), options_cls))
        if not isinstance(self.plugins, Mapping):
            raise ValueError(f"LoopConfig.plugins must be a table of plug-in options, got {self.plugins!r}")
        for plugin in (SOLVERS.get(self.solver), HALTINGS.get(self.halting), GRADS.get(self.grad)):
            self.options_for(plugin)  # plug-in options are checked on construction too
            plugin.check_config(self)


_HINTS = typing.get_type_hints(LoopConfig)
GROUPS: dict[str, type] = {  # option group name (= plug-in name) -> its options class
    f.name: _HINTS[f.name] for f in dataclasses.fields(LoopConfig) if dataclasses.is_dataclass(_HINTS[f.name])
}
LEGACY_NAMES: dict[str, tuple[str, str]] = {
    flat: (group, name) for group, cls in GROUPS.items() for name, flat in cls.legacy_names.items()
}


def _choice(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"LoopConfig.{name}={value!r} is not one of {', '.join(map(repr, allowed))}")


def _integer(name: str, value: Any, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"LoopConfig.{name} must be an integer >= {low}, got {value!r}")


def _group(name: str, value: Any, options_cls: type) -> Any:
    if isinstance(value, options_cls):
        return value
    if isinstance(value, Mapping):
        try:
            return options_cls(**value)
        except TypeError as err:
            raise ValueError(f"LoopConfig.{name}: {err}") from None
    raise ValueError(
        f"LoopConfig.{name} must be a {options_cls.__name__} or a table of its fields, got {value!r}"
    )


def _legacy_property(group: str, name: str) -> property:
    def get(self: LoopConfig) -> Any:
        return getattr(getattr(self, group), name)

    def set_(self: LoopConfig, value: Any) -> None:
        setattr(self, group, dataclasses.replace(getattr(self, group), **{name: value}))

    return property(get, set_, doc=f"Flat alias of ``{group}.{name}``.")


def _init_with_legacy(self: LoopConfig, *args: Any, **kwargs: Any) -> None:
    """The dataclass __init__, plus the flat legacy keywords, then validation."""
    legacy = LoopConfig.nest_legacy({k: kwargs.pop(k) for k in list(kwargs) if k in LEGACY_NAMES})
    _dataclass_init(self, *args, **kwargs)
    for group, changes in legacy.items():
        current = getattr(self, group)
        if isinstance(current, Mapping):
            current = _group(group, current, GROUPS[group])
        setattr(self, group, dataclasses.replace(current, **changes))
    self._validate()


_dataclass_init = LoopConfig.__init__
LoopConfig.__init__ = _init_with_legacy  # type: ignore[method-assign]
for _flat, (_group_name, _name) in LEGACY_NAMES.items():
    if _flat not in GROUPS:
        setattr(LoopConfig, _flat, _legacy_property(_group_name, _name))
LoopConfig.legacy_names = LEGACY_NAMES  # type: ignore[attr-defined]  # for config-key suggestions
