"""LoopConfig: every knob of the loop engine in one validated dataclass.

Three plug-in axes (docs/architecture.md): ``solver`` (how the next iterate is formed),
``halting`` (when a sample stops) and ``grad`` (how gradients flow back through the loop).
Defaults follow the papers (SYSTEMS.md): damped solver gamma 0.9 / patience 5 / min step 1e-3
(FPRM, section 1, Algorithm 1); Anderson m 5, lambda 1e-4, mixing 1.0 (Attractor, section 2;
lambda is *relative* to the Gram matrix, see LESSONS.md); KL 1e-3 / entropy 3.0 nats (LTG,
section 3); ACT eps 0.01 (Graves, section 4).
"""

from __future__ import annotations

from dataclasses import dataclass

SOLVERS = ("picard", "damped", "anderson", "broyden")
HALTINGS = ("fixed", "residual", "kl_entropy", "act")
HALTING_ALIASES = {"never": "fixed"}
GRADS = ("bptt", "truncated", "onestep", "neumann", "ift")
RESIDUAL_NORMS = ("rel_l2", "rel_sup")
IFT_SOLVERS = ("picard", "anderson")
KL_REDUCES = ("max", "mean")


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"LoopConfig.{name}={value!r} is not one of {', '.join(map(repr, allowed))}")


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"LoopConfig.{name} must be > 0, got {value!r}")


@dataclass
class LoopConfig:
    """How ``run_loop`` iterates, halts and differentiates. Validated on construction."""

    solver: str = "picard"  # picard | damped | anderson | broyden
    halting: str = "fixed"  # fixed (exactly max_steps; alias "never") | residual | kl_entropy | act
    max_steps: int = 16  # hard cap on iterations (ACT: the last step always halts)
    min_steps: int = 0  # no halting (except divergence) before this many iterations
    tol: float = 1e-3  # residual halting threshold (FPRM eps; Attractor tol)
    residual_norm: str = "rel_l2"  # rel_l2 (DEQ / Attractor) | rel_sup (FPRM relative sup norm)
    # damped solver (FPRM Algorithm 1)
    damp_gamma: float = 0.9
    damp_patience: int = 5
    damp_min_step: float = 1e-3
    # Anderson acceleration (type II, relative regulariser)
    anderson_m: int = 5
    anderson_reg: float = 1e-4
    anderson_beta: float = 1.0
    anderson_reg_relative: bool = True  # False: TorchDEQ's absolute regulariser (stalls at tight tol)
    # limited-memory Broyden
    broyden_m: int = 16
    # LTG halting
    kl_threshold: float = 1e-3
    entropy_threshold: float = 3.0
    kl_reduce: str = "max"  # how per-position KL / entropy reduce to one number per sample
    # Graves ACT
    act_eps: float = 0.01
    # gradient mode
    grad: str = "bptt"  # bptt | truncated | onestep | neumann | ift
    grad_steps: int = 1  # truncated: differentiable final steps; neumann: number of J^T terms
    neumann_clip: float | None = None  # clip each J^T term to clip * ||v|| (Attractor "onestep")
    ift_solver: str = "anderson"  # adjoint solver for grad="ift": picard | anderson
    ift_tol: float = 1e-6
    ift_max_steps: int = 100
    # engine
    compaction: bool = True  # drop halted samples from the active batch (else torch.where masking)
    diverge_threshold: float = 1e4  # residual above this (or non-finite) stops a sample, not converged
    trace: bool = True  # record residuals / state norms every step (fixed halting may skip them)

    def __post_init__(self) -> None:
        self.halting = HALTING_ALIASES.get(self.halting, self.halting)
        _choice("solver", self.solver, SOLVERS)
        _choice("halting", self.halting, HALTINGS + tuple(HALTING_ALIASES))
        _choice("grad", self.grad, GRADS)
        _choice("residual_norm", self.residual_norm, RESIDUAL_NORMS)
        _choice("ift_solver", self.ift_solver, IFT_SOLVERS)
        _choice("kl_reduce", self.kl_reduce, KL_REDUCES)
        for name in ("max_steps", "damp_patience", "anderson_m", "broyden_m", "ift_max_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"LoopConfig.{name} must be an integer >= 1, got {value!r}")
        for name in ("min_steps", "grad_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"LoopConfig.{name} must be an integer >= 0, got {value!r}")
        if self.min_steps > self.max_steps:
            raise ValueError(
                f"LoopConfig.min_steps={self.min_steps} exceeds max_steps={self.max_steps}"
            )
        for name in ("tol", "damp_min_step", "anderson_reg", "anderson_beta", "kl_threshold",
                     "entropy_threshold", "act_eps", "ift_tol", "diverge_threshold"):
            _positive(name, getattr(self, name))
        if not 0 < self.damp_gamma < 1:
            raise ValueError(f"LoopConfig.damp_gamma must be in (0, 1), got {self.damp_gamma!r}")
        if not self.act_eps < 1:
            raise ValueError(f"LoopConfig.act_eps must be in (0, 1), got {self.act_eps!r}")
        if self.neumann_clip is not None:
            _positive("neumann_clip", self.neumann_clip)
        if self.grad == "truncated" and self.grad_steps < 1:
            raise ValueError("LoopConfig.grad='truncated' needs grad_steps >= 1 (differentiable final steps)")
        if self.halting == "act":
            if self.solver != "picard":
                raise ValueError(f"LoopConfig.halting='act' needs solver='picard', got {self.solver!r}")
            if self.grad != "bptt":
                raise ValueError(f"LoopConfig.halting='act' needs grad='bptt' (weights are learned), got {self.grad!r}")
            if self.min_steps:
                raise ValueError("LoopConfig.halting='act' does not support min_steps > 0 (Graves ACT has none)")
