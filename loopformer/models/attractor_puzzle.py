"""Attractor puzzle model ("TRM-DEQ"): TRM whose inner latent recursion is an Anderson solve.

The Attractor paper's puzzle results (Fein-Ashley and Rashidinejad, arXiv 2605.12466: Sudoku-Extreme
91.4%, Maze-Hard 93.1% at 27M parameters) come from this model, not from the backbone + attractor
head of ``loopformer.models.attractor``. Reference: github jacobfa/Attractor,
``experiments/attractor_puzzles/trm/trm_deq.py`` (``TRMDEQ_Inner``, ``_InnerDEQ``,
``_anderson_solve``), trained by ``train_trm_deq.py`` with the loss head of ``losses_deq.py``.

One *step* of the outer loop (one of TRM's ``H_cycles``, the first ``H_cycles - 1`` without
gradient: ``LoopConfig(halting="fixed", max_steps=3, grad="truncated", grad_steps=1)``) is

    z_L* = solve  z_L = net(z_L, z_H + x)        # reference: _InnerDEQ, fmap(z) = L_level(z, ctx)
    z_L  = net^K(z_L*)                           # K = bptt_through, with gradient ("phantom")
    z_H  = net(z_H, z_L)                         # the explicit answer update, as TRM

where ``net`` is TRM's reasoning module (post-norm blocks with additive injection, shared by both
updates, ``loopformer.models.trm.ReasoningModule``). Everything around it is TRM: the state stacks
``(z_H, z_L)``, the readout is ``lm_head(z_H)`` on the token positions, the Q head reads ``z_H`` at
position 0, deep supervision / ACT segments and the halting head are the trainer's
``deep_supervision`` mode (up to 16 segments, halt on q > 0 with exploration 0.1, 16 segments at
evaluation).

- Inner solve: ``run_loop`` without gradient on ``f(z) = net(z, z_H + x)`` from the carried ``z_L``,
  with ``inner_loop`` (default: the ``anderson_trmdeq`` solver plug-in, the reference's Anderson with
  its rolled history buffer, ``loopformer.models.attractor_solvers``; ``deq_solver: anderson`` is
  the engine's own, which keeps the true last iterates; m 5, mixing 1.0, absolute regulariser 1e-4 as
  the reference's ``1e-4 * eye``, residual ``||f(z) - z|| / ||f(z)||`` below ``deq_tol`` 1e-3 after
  ``deq_min_iter`` 4 of at most ``deq_max_iter`` 8 map evaluations). The reference counts map
  evaluations and returns the iterate whose residual it checked; the engine counts iterations and
  returns the next iterate, so ``max_steps = deq_max_iter - 1`` and ``min_steps = deq_min_iter - 1``
  reproduce the reference's iterate with fixed counts (docs/fidelity.md lists the differences).
- Gradient through the last solver iterates: K = ``bptt_through`` (2) further applications of
  ``f`` from the detached solution, by a second ``run_loop`` (Picard, fixed K steps, BPTT). As in
  the reference their *value* is kept (``net^K(z*)``, not ``z*``), also in the no-gradient cycles.
- Jacobian regulariser (Bai, Koltun and Kolter 2021; reference ``_InnerDEQ.forward``): at the
  returned ``z_L`` of the differentiable cycle, ``mean((J^T v)^2)`` with ``v ~ N(0, 1/d)``, ``J``
  the Jacobian of ``f`` (``torch.func.vjp``: the reference's double backward in a form ``torch.compile`` traces;
  the probes drawn ahead, ``training_draws``, in a compiled step), averaged over ``jacobian_samples``
  probes. It is ``ModelOutput.aux_loss``, weighted by ``train.ponder_weight``: the reference adds
  ``lambda * jac`` to a loss it sums over the batch and divides by the global batch, so the weight
  here is ``lambda / global_batch`` (1e-3 / 768 in the paper recipes). Computed in training mode
  only, like the reference, under the math attention kernel (the fused kernels have no double
  backward; the reference forces it the same way).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from loopformer.loop import LoopConfig, LoopResult, run_loop
from loopformer.models import attractor_solvers  # noqa: F401  (registers the anderson_trmdeq solver)
from loopformer.models.base import ModelOutput
from loopformer.models.trm import TRM, TRMConfig


def _outer_loop() -> LoopConfig:
    return LoopConfig(halting="fixed", max_steps=3, grad="truncated", grad_steps=1)


@dataclass
class AttractorPuzzleConfig(TRMConfig):
    """TRM's fields plus the DEQ knobs, named as the reference's ``TRMDEQConfig``."""

    n_layers: int = 2
    deq_solver: str = (
        "anderson_trmdeq"  # the reference's Anderson (attractor_solvers.py) or any engine solver
    )
    deq_max_iter: int = 8  # reference: map evaluations of the forward solve
    deq_min_iter: int = 4
    deq_tol: float = 1e-3
    deq_anderson_m: int = 5
    deq_anderson_beta: float = 1.0
    deq_anderson_reg: float = 1e-4
    deq_anderson_reg_relative: bool = False  # the reference adds 1e-4 * I to the raw Gram matrix
    deq_halting: str = "residual"  # residual (per sample) | fixed (always deq_max_iter evaluations)
    bptt_through: int = 2  # K differentiable applications of f after the solve (1 = IFT one-step)
    jacobian_samples: int = 1  # Hutchinson probes of the Jacobian regulariser (0 = off)
    loop: LoopConfig = field(default_factory=_outer_loop)

    def inner_loop(self) -> LoopConfig:
        """The engine configuration of the inner solve (reference counts -> engine counts)."""
        if self.deq_max_iter < 2:
            raise ValueError(
                f"deq_max_iter must be >= 2 (the reference's two warm-up evaluations), got {self.deq_max_iter}"
            )
        steps = self.deq_max_iter - 1
        solver: dict = {}
        if self.deq_solver == "anderson":
            solver = dict(
                plugins={
                    "anderson": {
                        "m": self.deq_anderson_m,
                        "beta": self.deq_anderson_beta,
                        "reg": self.deq_anderson_reg,
                        "reg_relative": self.deq_anderson_reg_relative,
                    }
                }
            )
        elif self.deq_solver == "anderson_trmdeq":
            solver = dict(
                plugins={
                    "anderson_trmdeq": {
                        "m": self.deq_anderson_m,
                        "reg": self.deq_anderson_reg,
                        "beta": self.deq_anderson_beta,
                    }
                }
            )
        return LoopConfig(
            solver=self.deq_solver,
            halting=self.deq_halting,
            max_steps=steps,
            min_steps=min(max(self.deq_min_iter - 1, 0), steps),
            tol=self.deq_tol,
            residual_norm="rel_l2",
            grad="bptt",  # run without gradient (the model wraps it in no_grad)
            **solver,
        )


class AttractorPuzzle(TRM):
    """TRM-DEQ on the one engine (see the module docstring)."""

    config: AttractorPuzzleConfig

    def __init__(self, config: AttractorPuzzleConfig) -> None:
        super().__init__(config)
        if config.bptt_through < 1:
            raise ValueError(f"bptt_through must be >= 1, got {config.bptt_through}")
        if config.jacobian_samples < 0:
            raise ValueError(f"jacobian_samples must be >= 0, got {config.jacobian_samples}")
        self.solve_loop = config.inner_loop()
        # in training the inner solve never asks the host whether it converged: its few iterations (at most
        # deq_max_iter - 1) run on the device with the converged rows frozen (LoopConfig.sync_every; the same
        # results), so a training step needs no host read
        self.solve_loop_train = dataclasses.replace(self.solve_loop, sync_every=0)
        self.phantom_loop = LoopConfig(
            solver="picard", halting="fixed", max_steps=config.bptt_through, grad="bptt", trace=False
        )
        self._jac: Tensor | None = None
        self._probes: Tensor | None = None  # this forward's Jacobian probes (training_draws)
        self.last_inner: LoopResult | None = None  # the latest inner solve (steps, residuals)
        self.inner_steps: list[Tensor] = []  # map evaluations per row of each inner solve of the latest eval forward
        self.jacobian_probe: Tensor | None = None  # tests: a fixed probe v instead of a random one

    # -- the inner solve ------------------------------------------------------------------------
    def solve_latent(self, latent: Tensor, injection: Tensor) -> Tensor:
        """``net^K(z*)`` with ``z* = solve z = net(z, injection)`` from ``latent``."""
        loop = self.solve_loop_train if self.training else self.solve_loop
        with torch.no_grad():
            res = run_loop(self.net, latent.detach(), loop, ctx=(injection,))
        self.last_inner = res
        if not self.training:  # what blocks_per_step reports: the evaluations this solve made, per row
            self.inner_steps.append(res.steps)
        out = run_loop(self.net, res.state.detach(), self.phantom_loop, ctx=(injection,))
        z = out.state
        if torch.is_grad_enabled() and self.training and self.config.jacobian_samples > 0:
            self._jac = self.jacobian_term(z, injection)
        return z

    def jacobian_term(self, z: Tensor, injection: Tensor) -> Tensor:
        """``mean((J^T v)^2)`` at ``z`` (reference ``_InnerDEQ``), differentiable in the parameters and the injection.
        ``J^T v`` by ``torch.func.vjp`` of the net at the detached ``z``: the reference's double backward
        (``autograd.grad(..., create_graph=True)`` at ``z.detach().requires_grad_()``) written as a function
        transform, which ``torch.compile`` traces into the training step's graph (the same value and gradient:
        tests/test_attractor_puzzle.py, float64)."""
        if self.jacobian_probe is not None:
            probes = [self.jacobian_probe]
        else:
            probes = self._probes if self._probes is not None else self.draw_probes(z.shape, None, z.device)
        # the math kernel: the fused (flash) attention kernels have no double backward
        with torch.enable_grad(), sdpa_kernel(SDPBackend.MATH):
            _, vjp = torch.func.vjp(lambda t: self.net(t, injection), z.detach())
            wide = torch.promote_types(z.dtype, torch.float32)  # bfloat16 squared in float32
            total = sum(vjp(v.to(z.dtype))[0].to(wide).pow(2).mean() for v in probes)
        return total / len(probes)

    def draw_probes(self, shape: torch.Size | tuple[int, ...], generator: torch.Generator | None,
                    device: torch.device) -> Tensor:  # fmt: skip
        """The Jacobian term's ``jacobian_samples`` probes ``v ~ N(0, 1/d)`` of ``shape`` (float32), drawn in turn."""
        draw = [torch.randn(shape, generator=generator, device=device) for _ in range(self.config.jacobian_samples)]
        return torch.stack(draw) / math.sqrt(shape[-1])

    def training_draws(self, inputs: Tensor, generator: torch.Generator | None) -> dict[str, Tensor]:
        c = self.config
        if not (self.training and c.jacobian_samples > 0 and self.jacobian_probe is None):
            return {}
        return {"probes": self.draw_probes((inputs.shape[0], inputs.shape[1] + c.puzzle_emb_len, c.d_model),
                                           generator, inputs.device)}  # fmt: skip

    # -- the model contract ---------------------------------------------------------------------
    def step(self, z: Tensor, *ctx: Tensor) -> Tensor:
        x = ctx[0]
        y, latent = z[:, 0], z[:, 1]
        latent = self.solve_latent(latent, y + x)
        y = self.net(y, latent)
        return torch.stack((y, latent), dim=1)

    def aux_loss(self, result: LoopResult) -> Tensor | None:
        return self._jac

    def blocks_per_step(self) -> float:
        """Blocks an outer step applies, as measured: the inner solve's map evaluations (the engine's steps per
        row, averaged over the latest evaluation forward's solves), the K phantom applications and the
        answer update, each through the ``n_layers``-block net; the solve at its cap before any."""
        inner = float(torch.cat(self.inner_steps).double().mean()) if self.inner_steps else self.solve_loop.max_steps
        return (inner + self.config.bptt_through + 1) * self.config.n_layers

    def forward(
        self, inputs: Tensor, *args, generator: torch.Generator | None = None, probes: Tensor | None = None,
        **kwargs,
    ) -> ModelOutput:  # fmt: skip
        """``probes``: the Jacobian term's, drawn ahead (``training_draws``; a compiled step), else drawn here."""
        if probes is None and torch.is_grad_enabled():
            probes = self.training_draws(inputs, generator).get("probes")
        self._jac, self._probes, self.inner_steps = None, probes, []
        try:
            return super().forward(inputs, *args, generator=generator, **kwargs)
        finally:  # nothing of this forward kept (a compiled step would return the term held here)
            self._jac, self._probes = None, None


def paper_config() -> AttractorPuzzleConfig:
    """TRM-DEQ at the paper's 27M size (reference ``train_trm_deq.py`` defaults): d 512, 8 heads,
    8 layers, expansion 4, H_cycles 3, Sudoku vocabulary 11 and 81 cells, 16 puzzle-embedding
    tokens holding one 512-value row (one puzzle identifier)."""
    return AttractorPuzzleConfig(
        vocab_size=11,
        seq_len=81,
        d_model=512,
        n_heads=8,
        n_layers=8,
        expansion=4.0,
        num_puzzle_ids=1,
        puzzle_emb_len=16,
        puzzle_emb_dim=512,
    )
