"""The loop engine: one iteration loop with three plug-in axes (solver, halting, gradient mode).

``run_loop(step, z0, cfg, ctx=(x,), readout=None, halt_fn=None, callback=None) -> LoopResult``;
see engine.py for the loop, state.py for its per-call state, solvers.py / quasi_newton.py
(picard, FPRM damped, Anderson, Broyden), halting.py / act.py (fixed, residual, LTG KL+entropy,
Graves ACT), grad.py / implicit.py (bptt, truncated, onestep, neumann, IFT), norms.py and
samplers.py (training loop counts). A new solver, halting rule or gradient mode is one class
registered in ``SOLVERS``, ``HALTINGS`` or ``GRADS`` (docs/extending.md).
"""

from loopformer.loop.config import GROUPS, LEGACY_NAMES, LoopConfig
from loopformer.loop.engine import LoopResult, run_loop
from loopformer.loop.grad import GRADS, GradMode
from loopformer.loop.halting import HALTINGS, Halting
from loopformer.loop.implicit import ImplicitGradMode
from loopformer.loop.registry import NoOptions, Registry
from loopformer.loop.samplers import make_sampler
from loopformer.loop.solvers import SOLVERS, Solver

__all__ = [
    "GRADS",
    "GROUPS",
    "HALTINGS",
    "LEGACY_NAMES",
    "SOLVERS",
    "GradMode",
    "Halting",
    "ImplicitGradMode",
    "LoopConfig",
    "LoopResult",
    "NoOptions",
    "Registry",
    "Solver",
    "make_sampler",
    "run_loop",
]
