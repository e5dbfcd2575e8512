"""The loop engine: one iteration loop with three plug-in axes (solver, halting, gradient mode).

``run_loop(step, z0, cfg, ctx=(x,), readout=None, halt_fn=None, callback=None) -> LoopResult``;
see engine.py for the loop, solvers.py (picard, FPRM damped, Anderson, Broyden), halting.py
(fixed, residual, LTG KL+entropy, Graves ACT), grad.py (onestep, neumann, IFT), norms.py and
samplers.py (training loop counts). Equations: SYSTEMS.md sections 1-4.
"""

from loopformer.loop.config import LoopConfig
from loopformer.loop.engine import LoopResult, run_loop
from loopformer.loop.samplers import make_sampler

__all__ = ["LoopConfig", "LoopResult", "make_sampler", "run_loop"]
