"""The loop engine: one iteration loop with three plug-in axes (solver, halting, gradient mode).

``run_loop(step, z0, cfg, ctx=(x,), readout=None, halt_fn=None, callback=None) -> LoopResult``;
see engine.py for the loop, state.py for its per-call state, config.py for ``LoopConfig`` and the
registries, solvers.py (picard, FPRM damped, Anderson, Broyden), halting.py (fixed, residual, LTG
KL+entropy, Graves ACT), grad.py (bptt, truncated, onestep, neumann, IFT), norms.py and samplers.py
(training loop counts). A new solver, halting rule or gradient mode is one class registered in
``SOLVERS``, ``HALTINGS`` or ``GRADS``, with its own ``Options`` (docs/extending.md).
"""

from loopformer.loop.config import LoopConfig, NoOptions, Registry

from loopformer.loop.solvers import SOLVERS, Solver  # isort: skip  (the axes register in this order)
from loopformer.loop.grad import GRADS, GradMode, ImplicitGradMode  # isort: skip
from loopformer.loop.halting import HALTINGS, Halting  # isort: skip
from loopformer.loop.engine import LoopResult, run_loop
from loopformer.loop.samplers import make_sampler

__all__ = [
    "GRADS",
    "HALTINGS",
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
