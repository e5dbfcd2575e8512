"""Seeding: every random draw of a run is a function of (seed, global step[, rank]).

- ``seed_everything``: the global torch / numpy / python generators, once at the start of a run
  (before the model is built, so its initial weights are a function of the seed).
- ``seed_for``: a 32-bit seed for the stream (seed, step, salt[, rank]); the salts keep the
  per-step streams (initial states, halting exploration, Jacobian probes, curriculum samples)
  independent of each other.
- ``step_generator``: a ``torch.Generator`` on a device seeded by ``seed_for``.

Because nothing draws from a generator that outlives a step (the loop-count samplers in
``loopformer.loop.samplers`` are also seeded by the step), a resumed run replays exactly; the
global generators' states are saved in each checkpoint for whatever else draws from them.
"""

from __future__ import annotations

import random

import numpy as np
import torch

# salts that keep the per-step random streams independent
SALT_INIT, SALT_EXPLORE, SALT_JAC, SALT_CURRICULUM = 11, 13, 17, 19


def seed_everything(seed: int) -> None:
    """Seed torch (CPU and CUDA), numpy's global generator and python's ``random``."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def seed_for(seed: int, step: int, salt: int, rank: int | None = None) -> int:
    """A 32-bit seed for the random stream (seed, step, salt[, rank])."""
    entropy = [seed, step, salt] if rank is None else [seed, step, salt, rank]
    return int(np.random.SeedSequence(entropy).generate_state(1)[0])


def step_generator(
    device: torch.device, seed: int, step: int, salt: int, rank: int | None = None
) -> torch.Generator:
    """A generator on ``device`` for the stream (seed, step, salt[, rank])."""
    return torch.Generator(device=device).manual_seed(seed_for(seed, step, salt, rank))
