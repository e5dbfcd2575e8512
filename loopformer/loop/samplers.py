"""Training-time loop-count samplers, seeded by (seed, global_step).

Every draw uses a fresh ``numpy.random.Generator`` seeded from ``SeedSequence([seed, global_step])``,
so every DDP rank loops the same number of times (no stragglers) and a resumed run replays the
same counts.

- ``fixed``: always ``n`` (the training loop's ``max_steps`` unless given).
- ``poisson``: ``R ~ Poisson(mean)`` clipped to ``[low, high]`` (LTG dynamic recurrence,
  arXiv 2604.07822: Poisson(4) clipped to [2, 8]).
- ``lognormal_poisson``: Huginn (arXiv 2502.05171): ``tau ~ N(log(mean) - sigma^2 / 2, sigma)``,
  ``R = Poisson(exp(tau)) + 1`` clipped to ``[low, high]``.
The curriculum over task difficulty belongs to the trainer, not here. Each sampler declares the
options it takes from the training run when they are not given (``defaults``): ``fixed`` its
``n`` from the loop's ``max_steps``, the random ones their ``seed`` from the run's seed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np


def _rng(seed: int, global_step: int) -> np.random.Generator:
    if global_step < 0:
        raise ValueError(f"global_step must be >= 0, got {global_step}")
    return np.random.default_rng(np.random.SeedSequence([int(seed), int(global_step)]))


def _check_range(low: int, high: int) -> None:
    if low < 1 or high < low:
        raise ValueError(f"sampler needs 1 <= low <= high, got low={low}, high={high}")


@dataclass(frozen=True)
class FixedSampler:
    n: int = 4

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"fixed sampler needs n >= 1, got {self.n}")

    def sample(self, global_step: int) -> int:
        return self.n

    @property
    def constant_depth(self) -> int | None:
        """The loop count every step uses (None for samplers that vary it)."""
        return self.n

    @classmethod
    def defaults(cls, max_steps: int, seed: int) -> dict[str, int]:
        return {"n": max_steps}


@dataclass(frozen=True)
class PoissonSampler:
    mean: float = 4.0
    low: int = 2
    high: int = 8
    seed: int = 0

    @classmethod
    def defaults(cls, max_steps: int, seed: int) -> dict[str, int]:
        return {"seed": seed}

    def __post_init__(self) -> None:
        if not self.mean > 0:
            raise ValueError(f"poisson sampler needs mean > 0, got {self.mean}")
        _check_range(self.low, self.high)

    constant_depth = None  # the loop count varies from step to step

    def sample(self, global_step: int) -> int:
        r = int(_rng(self.seed, global_step).poisson(self.mean))
        return min(max(r, self.low), self.high)


@dataclass(frozen=True)
class LogNormalPoissonSampler:
    mean: float = 8.0
    sigma: float = 0.5
    low: int = 1
    high: int = 32
    seed: int = 0

    defaults = PoissonSampler.defaults
    constant_depth = None

    def __post_init__(self) -> None:
        if not self.mean > 0 or not self.sigma > 0:
            raise ValueError(f"lognormal_poisson needs mean > 0 and sigma > 0, got {self.mean}, {self.sigma}")
        _check_range(self.low, self.high)

    def sample(self, global_step: int) -> int:
        rng = _rng(self.seed, global_step)
        tau = rng.normal(math.log(self.mean) - 0.5 * self.sigma**2, self.sigma)
        r = int(rng.poisson(math.exp(tau))) + 1
        return min(max(r, self.low), self.high)


SAMPLERS = {"fixed": FixedSampler, "poisson": PoissonSampler, "lognormal_poisson": LogNormalPoissonSampler}
Sampler = FixedSampler | PoissonSampler | LogNormalPoissonSampler


def sampler_defaults(kind: str, max_steps: int, seed: int) -> dict[str, int]:
    """The options sampler ``kind`` takes from the training run when not given ({} for an unknown
    kind: ``make_sampler`` names the error)."""
    cls = SAMPLERS.get(kind)
    return {} if cls is None else cls.defaults(max_steps, seed)


def make_sampler(kind: str, **kw) -> Sampler:
    """Build a loop-count sampler: ``make_sampler("poisson", mean=4, low=2, high=8, seed=0).sample(step)``."""
    if kind not in SAMPLERS:
        raise ValueError(f"unknown sampler {kind!r}; choose one of {', '.join(map(repr, SAMPLERS))}")
    try:
        return SAMPLERS[kind](**kw)
    except TypeError as err:
        raise ValueError(f"bad arguments for sampler {kind!r}: {err}") from err


def training_sampler(kind: str, options: dict[str, Any], max_steps: int, seed: int) -> Sampler | None:
    """The loop-count sampler a training run uses (``train.loop_sampler`` / ``train.loop_sampler_options``):
    ``kind``'s defaults from the run (``sampler_defaults``) under the given ``options``; None for ``"none"``
    (the training loop config as is)."""
    if kind == "none":
        return None
    return make_sampler(kind, **{**sampler_defaults(kind, max_steps, seed), **options})
