"""Training losses: token cross-entropy, stablemax cross-entropy, Q-head BCE, Jacobian penalty.

- ``stablemax_cross_entropy``: TRM's stablemax (TRM, arXiv 2510.04871; used by FPRM, arXiv 2606.18206):
  ``s(x) = x + 1`` for ``x >= 0`` and ``1 / (1 - x)`` for ``x < 0``,
  ``log p_i = log s(x_i) - log sum_j s(x_j)``, computed in float64 as TRM does.
- ``sequence_loss``: per-sample mean over the positions that carry a label (``IGNORE_INDEX``
  elsewhere), then the batch mean (TRM divides each sample's token loss by its label count).
  ``label_smoothing`` eps: ``(1 - eps) nll + eps mean_c(-log p_c)``, PyTorch's ``cross_entropy``
  formula (Loop, Think & Generalize's systematicity script trains with 0.1).
- ``q_halt_loss``: BCE of the Q / halting logit against "the whole answer is exactly right"
  (TRM's ``q_halt``; FPRM weighs it 0.5).
- ``q_learning_losses``: HRM's Q-learning ACT head (its ``models/losses.py: ACTLossHead`` and
  ``models/hrm/hrm_act_v1.py``): BCE of ``q_halt`` against "exactly right" and BCE of ``q_continue``
  against ``sigmoid(q_halt')`` on a sample's last segment, ``sigmoid(max(q_halt', q_continue'))``
  otherwise, where ' marks the Q values after one more (no-grad) segment; batch means.
- ``jacobian_frobenius``: Hutchinson estimate of ``||J||_F^2`` at the final state,
  ``E_v ||v^T J||^2`` with ``v ~ N(0, I)``, per sample and divided by the state size (the DEQ
  Jacobian regulariser, Bai et al. arXiv 2106.14342; FPRM ships it off by default). Its extra step runs
  scaled-dot-product attention on PyTorch's math kernel: the fused CPU / CUDA kernels have no double
  backward, the math kernel's ops do, so the penalty trains attention models too.
The ACT ponder cost is the model's own ``ModelOutput.aux_loss``; the trainer weighs it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from loopformer.tasks.base import IGNORE_INDEX


def wide(x: Tensor) -> Tensor:
    """``x`` in float32, or kept in float64 when it is float64 (float64 runs stay float64 end to end)."""
    return x if x.dtype == torch.float64 else x.float()


def stablemax_log_probs(logits: Tensor, dim: int = -1) -> Tensor:
    """Log stablemax in float64: ``log s(x_i) - log sum_j s(x_j)``."""
    x = logits.to(torch.float64)
    s = torch.where(x >= 0, x + 1.0, 1.0 / (1.0 - torch.clamp(x, max=0.0)))
    return torch.log(s) - torch.log(s.sum(dim=dim, keepdim=True))


def token_losses(
    logits: Tensor, labels: Tensor, kind: str = "ce", label_smoothing: float = 0.0
) -> tuple[Tensor, Tensor]:
    """Per-position losses ``[B, T]`` (zero where ignored) and the label mask ``[B, T]``.

    ``kind``: "ce" (softmax cross-entropy in float32) or "stablemax" (float64); ``label_smoothing``
    in [0, 1) mixes in the uniform target as PyTorch's ``cross_entropy`` does.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing!r}")
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} do not match labels {tuple(labels.shape)} + [V]")
    mask = labels != IGNORE_INDEX
    safe = torch.where(mask, labels, torch.zeros_like(labels))
    if kind == "ce":
        logp = F.log_softmax(wide(logits), dim=-1)
    elif kind == "stablemax":
        logp = stablemax_log_probs(logits)
    else:
        raise ValueError(f"unknown loss {kind!r}; expected 'ce' or 'stablemax'")
    nll = -logp.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    if label_smoothing:
        nll = (1.0 - label_smoothing) * nll - label_smoothing * logp.mean(-1)
    return torch.where(mask, nll, torch.zeros_like(nll)), mask


def sequence_loss(logits: Tensor, labels: Tensor, kind: str = "ce", label_smoothing: float = 0.0) -> Tensor:
    """Mean over samples of each sample's mean token loss (float32 scalar; float64 for float64 logits)."""
    losses, mask = token_losses(logits, labels, kind, label_smoothing)
    per_sample = losses.sum(-1) / mask.sum(-1).clamp(min=1)
    return per_sample.mean().to(torch.float64 if logits.dtype == torch.float64 else torch.float32)


@dataclass
class Accuracy:
    token_correct: Tensor  # [B] correct labelled positions
    token_count: Tensor  # [B] labelled positions
    exact: Tensor  # [B] bool: every labelled position right

    @property
    def token_acc(self) -> float:
        return int(self.token_correct.sum()) / max(int(self.token_count.sum()), 1)

    @property
    def exact_acc(self) -> float:
        return int(self.exact.sum()) / self.exact.numel() if self.exact.numel() else 0.0

    @classmethod
    def cat(cls, accs: list[Accuracy]) -> Accuracy:
        """The micro-batches' accuracies as one, in batch order (gradient accumulation)."""
        if len(accs) == 1:
            return accs[0]
        return cls(*(torch.cat([getattr(a, f) for a in accs]) for f in ("token_correct", "token_count", "exact")))

    def rates(self) -> tuple[Tensor, Tensor]:
        """(token accuracy, exact accuracy) as 0-dim device tensors (no host read)."""
        tokens = self.token_correct.sum() / self.token_count.sum().clamp(min=1)
        exact = (
            self.exact.float().mean() if self.exact.numel() else self.exact.new_zeros((), dtype=torch.float32)
        )
        return tokens.float(), exact


def accuracy(logits: Tensor, labels: Tensor) -> Accuracy:
    """Argmax accuracy against the labels (IGNORE_INDEX positions skipped)."""
    with torch.no_grad():
        mask = labels != IGNORE_INDEX
        correct = (logits.argmax(-1) == labels) & mask
        token_correct = correct.sum(-1)
        token_count = mask.sum(-1)
        return Accuracy(token_correct, token_count, token_correct == token_count)


def q_halt_loss(q_logits: Tensor, exact: Tensor) -> Tensor:
    """BCE-with-logits of the Q / halting head against ``exact`` (answer fully right), batch mean."""
    return F.binary_cross_entropy_with_logits(
        wide(q_logits).reshape(-1), exact.to(wide(q_logits).dtype).reshape(-1)
    )


def q_learning_losses(q: Tensor, q_next: Tensor, exact: Tensor, is_last: Tensor) -> tuple[Tensor, Tensor]:
    """(q_halt BCE, q_continue BCE) of HRM's Q-learning; ``q`` / ``q_next`` are ``[B, 2]`` (halt, continue)."""
    q, q_next = wide(q), wide(q_next.detach())
    target = torch.sigmoid(torch.where(is_last.reshape(-1), q_next[:, 0], q_next.max(dim=-1).values))
    halt = F.binary_cross_entropy_with_logits(q[:, 0], exact.to(q.dtype).reshape(-1))
    return halt, F.binary_cross_entropy_with_logits(q[:, 1], target)


def jacobian_frobenius(
    step: Callable[..., Tensor],
    z: Tensor,
    ctx: tuple[Tensor, ...] = (),
    generator: torch.Generator | None = None,
    n_samples: int = 1,
    probes: Sequence[Tensor] | None = None,
) -> Tensor:
    """Hutchinson estimate of ``||dF/dz||_F^2 / dim`` at ``z``, averaged over the batch.

    ``z`` is detached and re-entered, so the penalty trains the step's parameters (and ctx)
    only; the graph is kept (``create_graph``) so it can be backpropagated. ``probes``: the
    ``n_samples`` vectors ``v`` to use instead of drawing them (gradient accumulation draws them
    once for the whole batch and hands each micro-batch its rows, ``loopformer.train.accumulate``).
    """
    z = z.detach().requires_grad_(True)
    with sdpa_kernel([SDPBackend.MATH]):  # double backward: the math kernel's ops have it, the fused ones not
        fz = step(z, *ctx)
    per_sample_dim = z[0].numel() if z.dim() > 1 else 1
    total = z.new_zeros(())
    for i in range(n_samples):
        gen_device = generator.device if generator is not None else fz.device
        if probes is not None:
            v = probes[i].to(device=fz.device, dtype=fz.dtype)
        else:
            v = torch.randn(fz.shape, generator=generator, device=gen_device, dtype=fz.dtype).to(fz.device)
        (vj,) = torch.autograd.grad(fz, z, v, create_graph=True)
        total = total + wide(vj).pow(2).sum() / (z.shape[0] * per_sample_dim)
    return total / n_samples
