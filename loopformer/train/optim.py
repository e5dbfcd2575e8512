"""Optimiser, learning-rate schedule and weight EMA.

- ``build_optimizer``: AdamW with two parameter groups. No weight decay on: tensors with fewer
  than two dimensions (biases, norm gains, per-channel residual scalars and gates: FPRM's
  ``a = sigmoid(p)`` parameters, arXiv 2606.18206), parameters of normalisation modules,
  the names a model lists in ``no_weight_decay()`` (optional; exact names or module prefixes),
  and embeddings when ``decay_embeddings`` is False. A model whose ``decay_vectors`` attribute is
  True has its one-dimensional parameters (biases) decayed as well. ``head=(lr_scale, weight_decay)``
  moves the parameters under the model's ``head_parameter_prefixes()`` into their own groups at
  ``lr_scale`` times the rate (a group's ``lr_mult``, which ``set_lr`` keeps), the head's matrices
  decayed by ``weight_decay`` (None: as the other groups; also when ``train.weight_decay`` is 0): the Attractor LM's ``fp_lr_scale`` /
  ``fp_wd`` (github jacobfa/Attractor ``recpre/optim/muon_adamw.py: get_muon_param_groups``).
- ``AdamATan2``: Adam with ``atan2`` in place of the division (Everett et al., arXiv 2407.05872), in
  the form of the ``adam-atan2`` package TRM and HRM train with (a CUDA kernel; here plain PyTorch):
  ``p <- p (1 - lr wd)``, ``m <- b1 m + (1 - b1) g``, ``v <- b2 v + (1 - b2) g^2``,
  ``p <- p - lr / (1 - b1^t) * atan2(m, sqrt(v) / sqrt(1 - b2^t))`` (no epsilon, decoupled decay
  on every parameter). Parameter groups flagged ``sign_sgd`` take TRM / HRM's sparse-embedding
  update instead (``CastedSparseEmbeddingSignSGD_Distributed``): on the rows the batch used,
  ``p <- p (1 - lr wd) - lr sign(g)``; rows it did not use are left alone (no decay). A group's
  ``lr_scale`` multiplies the scheduled rate (TRM's ``puzzle_emb_lr`` follows the same warm-up).
- ``lr_at``: linear warm-up then constant (FPRM: constant after 2000 warm-up steps) or cosine
  down to ``min_lr_ratio * lr``, or ``trapezoid``: constant, then linear to 0 over the last
  ``cooldown_fraction`` of the steps, floored at ``min_lr_ratio * lr`` (the Attractor LM's
  ``lr_schedule: trapezoid``, github jacobfa/Attractor ``recpre/schedulers/base.py: LRScheduler.get_lr``).
  A pure function of the step, so the schedule's only state is
  the step counter the checkpoint already holds.
- ``clip_grad_norm``: global-norm clipping returning the pre-clip norm as a device tensor (for divergence
  checks decided on the device); ``skip_step``: the ``found_inf`` with which an optimiser step leaves every
  weight as it was (the trainer's divergence check, no host read).
- ``EMA``: exponential moving average of the weights (TRM / FPRM use 0.999), with a
  ``state_dict`` of plain tensors (saved to ``ema.safetensors``) and ``applied(model)`` to
  evaluate with the averaged weights; ``puzzle_embeddings=False`` keeps the puzzle-embedding
  tables out of it (the references' EMA: their tables are buffers).
- ``MuonAdamW`` (``kind="muon_adamw"``): the Attractor LM's Muon + AdamW, below.

``MuonAdamW``: Muon on the hidden weight matrices, AdamW on the rest (``train.optimizer: muon_adamw``).

The Attractor LM's optimiser (github jacobfa/Attractor ``recpre/optim/muon_adamw.py``: ``MuonAdamW``,
``get_muon_param_groups``; schedule from ``scripts/train.py``), reimplemented and parity-tested against
that code (``tests/test_parity_attractor_lm.py``). Not ``torch.optim.Muon`` (torch 2.13): its rate rule
``sqrt(max(1, A / B))`` is the reference's, but it uses one Newton-Schulz coefficient triple for every step
(3.4445, -4.7750, 2.0315) and plain decoupled weight decay, while the reference's update has three parts
that change the step: per-step Polar Express coefficients, a second-moment normalisation of the
orthogonalised update, and cautious weight decay.

Muon step of one matrix ``W`` (``r x c``; a fused ``qkv`` projection is three matrices, as the
reference's separate ``c_q`` / ``c_k`` / ``c_v``) with gradient ``G``:

- momentum ``M <- mu M + (1 - mu) G`` and Nesterov ``U = (1 - mu) G + mu M``;
- ``X = U / (1.02 ||U||_F + 1e-6)`` in ``ns_dtype`` (bfloat16 as the reference), then ``ns_steps``
  (<= 5) odd-polynomial steps ``X <- a X + (b A + c A^2) X`` with ``A = X X^T`` (``X (b A + c A^2)``,
  ``A = X^T X`` when ``r > c``) and the Polar Express coefficients (Amsel et al., arXiv 2505.16932),
  approximating the polar factor ``U V^T``;
- second moment of ``X`` per row (``r >= c``) or per column: ``s = mean(X^2)`` along the longer side,
  ``v <- beta2 v + (1 - beta2) s`` (no bias correction), ``X <- X / sqrt(v)`` rescaled to the
  Frobenius norm it had;
- ``W <- W - lr' X - lr' wd W * [X * W >= 0]`` (cautious decay: only where the update and the
  weight agree in sign), ``lr' = lr sqrt(max(1, r / c))``.

Scalars enter the update as the reference's do (float32 tensors cast to the update's dtype, so in
bfloat16 ``lr'``, ``wd`` and ``beta2`` are rounded to bfloat16). AdamW groups: ``p <- p (1 - lr wd)``,
bias-corrected moments, ``p <- p - lr m_hat / (sqrt(v_hat) + eps)`` (``torch.optim.AdamW``'s update).

Schedule (``scripts/train.py``), from the optimiser's own step counter ``t`` (0 at the first step;
kept in the group, so a checkpoint resumes it): momentum ``mu_t = mu0 + min(t / T_w, 1) (mu - mu0)``
and weight decay ``wd_t = wd max(0, 1 - t / T)`` on the Muon groups.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

_NORM_TYPES: tuple[type[nn.Module], ...] = (nn.LayerNorm, nn.GroupNorm, nn.BatchNorm1d, nn.RMSNorm)


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, _NORM_TYPES) or type(module).__name__.lower().endswith("norm")


def _listed(name: str, listed: set[str]) -> bool:
    return any(name == n or name.startswith(n + ".") or name.endswith("." + n) for n in listed)


def parameter_groups(model: nn.Module, weight_decay: float, decay_embeddings: bool = True) -> list[dict]:
    """``[{'params': decayed, 'weight_decay': wd, 'names': [...]}, {... 0.0 ...}]`` (empty groups dropped)."""
    listed_fn = getattr(model, "no_weight_decay", None)
    listed = set(listed_fn()) if callable(listed_fn) else set()
    vectors = bool(getattr(model, "decay_vectors", False))  # the model decays its biases too (FPRM authors)
    no_decay_ids: set[int] = set()
    for module_name, module in model.named_modules():
        own = list(module.named_parameters(recurse=False))
        if _is_norm(module) or (not decay_embeddings and isinstance(module, nn.Embedding)):
            no_decay_ids.update(id(p) for _, p in own)
        for pname, p in own:
            full = f"{module_name}.{pname}" if module_name else pname
            if (p.ndim < 2 and not vectors) or _listed(full, listed):
                no_decay_ids.add(id(p))
    decay, no_decay = ([], []), ([], [])
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        target = no_decay if id(p) in no_decay_ids else decay
        target[0].append(p)
        target[1].append(name)
    groups = [
        {"params": decay[0], "names": decay[1], "weight_decay": weight_decay, "decayed": True},
        {"params": no_decay[0], "names": no_decay[1], "weight_decay": 0.0, "decayed": False},
    ]
    return [g for g in groups if g["params"]]


class AdamATan2(torch.optim.Optimizer):
    """AdamATan2 (TRM / HRM's optimiser) with optional sign-SGD groups; see the module docstring.

    Groups may set ``sign_sgd=True`` (sparse-embedding rows) and ``lr_scale`` (their rate relative
    to the scheduled one). State per parameter: ``step`` (a float tensor on the CPU, as the package keeps
    it), ``exp_avg``, ``exp_avg_sq``; sign-SGD groups keep none. The update runs over each group's
    parameters at once (``torch._foreach_*``: a few kernels per group plus ``atan2`` per tensor, where a
    per-parameter loop ran ~8 kernels per tensor), the bias corrections from a host copy of each step
    count (so no value is read from the device). ``found_inf`` (a 0-dim device tensor, set by the trainer's
    divergence check, ``skip_step``): where it is non-zero the step leaves every weight and moment as it was.
    """

    def __init__(
        self,
        params: list[dict] | list[Tensor],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 1e-2,
    ) -> None:
        if lr < 0 or weight_decay < 0 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(
                f"invalid AdamATan2 settings: lr {lr}, betas {betas}, weight_decay {weight_decay}"
            )
        super().__init__(
            params,
            {
                "lr": lr,
                "betas": tuple(betas),
                "weight_decay": weight_decay,
                "sign_sgd": False,
                "lr_scale": 1.0,
            },
        )
        self.found_inf: Tensor | None = None
        self._steps = HostSteps()

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._steps = HostSteps()

    def reread_step_counts(self) -> None:
        """Read the step counts from the state again at the next step: they were moved or changed outside
        ``step`` (a compiled step keeps them as tensors on the parameters' device)."""
        self._steps = HostSteps()

    @torch.no_grad()
    def step(self, closure: object = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("AdamATan2.step takes no closure")
        skip = None if self.found_inf is None else self.found_inf.bool()
        for group in self.param_groups:
            lr, wd = group["lr"] * group["lr_scale"], group["weight_decay"]
            params = [p for p in group["params"] if p.grad is not None]
            if any(p.grad.is_sparse for p in params):
                raise ValueError("AdamATan2 needs dense gradients")
            if group["sign_sgd"]:
                for p in params:
                    sign_sgd_rows_(p, p.grad, lr, wd, skip)
            elif params:
                self._adam_atan2(params, lr, wd, group["betas"], skip)

    def _adam_atan2(
        self, params: list[Tensor], lr: float, wd: float, betas: tuple[float, float], skip: Tensor | None
    ) -> None:
        states = [self.state[p] for p in params]
        for p, state in zip(params, states):
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        # group the parameters by their step count (one in practice): each subgroup shares its scalars
        for t, idx in self._steps.advance(params, states).items():
            ps = [params[i] for i in idx]
            adam_(ps, [p.grad for p in ps], [states[i]["exp_avg"] for i in idx],
                  [states[i]["exp_avg_sq"] for i in idx], lr, t, betas, wd, None, skip)  # fmt: skip


def adam_(
    params: list[Tensor], grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
    lr: float | Tensor, t: float | Tensor, betas: tuple[float, float], weight_decay: float | Tensor,
    eps: float | None, skip: Tensor | None = None,
) -> None:  # fmt: skip
    """One Adam step of ``params`` in place, over every tensor at once (``torch._foreach_*``): ``torch.optim.AdamW``'s
    ``p <- p (1 - lr wd) - lr / (1 - b1^t) m / (sqrt(v / (1 - b2^t)) + eps)``, or with ``eps`` None AdamATan2's
    ``atan2(m, sqrt(v / (1 - b2^t)))`` in place of the quotient. The one Adam update of every optimiser here, eager
    and compiled: ``lr``, ``weight_decay`` and the step count after this step ``t`` are numbers (eager) or 0-dim
    tensors (a compiled step: a new value does not recompile). ``skip`` (a 0-dim bool tensor): where true, every
    tensor keeps its value."""
    b1, b2 = betas
    olds = (params, exp_avgs, exp_avg_sqs)
    ps, ms, vs = olds if skip is None else (torch._foreach_mul(x, 1.0) for x in olds)  # a skip: work on copies
    torch._foreach_mul_(ps, 1 - lr * weight_decay)
    torch._foreach_lerp_(ms, grads, 1 - b1)
    torch._foreach_mul_(vs, b2)
    torch._foreach_addcmul_(vs, grads, grads, value=1 - b2)
    denom = torch._foreach_sqrt(vs)
    torch._foreach_div_(denom, (1 - b2**t) ** 0.5)
    if eps is None:
        steps = [torch.atan2(m, d) for m, d in zip(ms, denom)]
    else:
        torch._foreach_add_(denom, eps)
        steps = torch._foreach_div(ms, denom)
    torch._foreach_mul_(steps, -lr / (1 - b1**t))
    torch._foreach_add_(ps, steps)
    if skip is not None:
        for old_list, new_list in zip(olds, (ps, ms, vs)):
            for old, new in zip(old_list, new_list):
                old.copy_(torch.where(skip, old, new))


def sign_sgd_rows_(
    p: Tensor, grad: Tensor, lr: float | Tensor, weight_decay: float, skip: Tensor | None = None
) -> None:
    """TRM / HRM's sparse-embedding step on the rows with a gradient: decay them, step by ``-lr sign(g)``.
    The rows are chosen with ``torch.where`` over the whole table (no host read to find them); ``skip``
    (a 0-dim bool tensor) leaves every row as it is."""
    rows = grad.reshape(grad.shape[0], -1).ne(0).any(-1) if grad.dim() > 1 else grad.ne(0)
    if skip is not None:
        rows = rows & ~skip
    stepped = p * (1 - lr * weight_decay) - lr * grad.sign()  # lr: a number, or a 0-dim tensor (compiled)
    p.copy_(torch.where(rows.view(-1, *([1] * (p.dim() - 1))), stepped, p))


class AdamWSignSGD(torch.optim.AdamW):
    """PyTorch's AdamW, except that groups flagged ``sign_sgd`` take the sparse-embedding sign-SGD
    step (``sign_sgd_rows_`` at ``lr * lr_scale``): FPRM's optimisers (``create_model.py`` in
    nilskiKonjIzDunava/fprm: AdamW for the weights, ``CastedSparseEmbeddingSignSGD_Distributed`` for
    the puzzle table). AdamW skips those parameters (their gradient is hidden during its step)."""

    @torch.no_grad()
    def step(self, closure: object = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("AdamWSignSGD.step takes no closure")
        hidden: list[tuple[Tensor, Tensor]] = []
        found = getattr(self, "found_inf", None)
        skip = None if found is None else found.bool()
        for group in self.param_groups:
            if not group.get("sign_sgd"):
                continue
            lr = group["lr"] * group.get("lr_scale", 1.0)
            for p in group["params"]:
                if p.grad is not None:
                    sign_sgd_rows_(p, p.grad, lr, group["weight_decay"], skip)
                    hidden.append((p, p.grad))
                    p.grad = None
        try:
            super().step()
        finally:
            for p, grad in hidden:
                p.grad = grad


def skip_step(optimizer: torch.optim.Optimizer, skip: Tensor | None) -> None:
    """Make the next ``optimizer.step()`` leave every weight and its state unchanged where ``skip`` (a 0-dim
    device tensor) is true, decided on the device as mixed-precision scalers do: ``found_inf`` of the fused
    AdamW kernel and of this module's optimisers. None: always step."""
    optimizer.found_inf = None if skip is None else skip.to(torch.float32)  # type: ignore[attr-defined]


def build_optimizer(
    model: nn.Module,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    decay_embeddings: bool = True,
    kind: str = "adamw",
    decay_all: bool = False,
    puzzle_emb: tuple[float, float] | None = None,
    head: tuple[float, float | None] | None = None,
    muon: dict | None = None,
) -> torch.optim.Optimizer:
    """AdamW (``kind="adamw"``, PyTorch's fused kernel, deterministic) or ``AdamATan2`` over ``parameter_groups``.

    ``decay_all``: one decayed group of every parameter (TRM / HRM pass ``model.parameters()`` to
    one optimiser). ``puzzle_emb=(lr, weight_decay)``: parameters named ``*puzzle_emb*`` get their own
    sign-SGD group at that rate (TRM / HRM's sparse-embedding optimiser with ``kind="adam_atan2"``;
    FPRM's with ``kind="adamw"``: ``AdamWSignSGD``). ``kind="muon_adamw"``: ``muon.MuonAdamW`` with the
    settings ``muon`` (``muon.muon_adamw``), the weight-decay and head groups as for AdamW.
    """
    groups = parameter_groups(model, weight_decay, decay_embeddings)
    if decay_all:
        params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = [
            {"params": [p for _, p in params], "names": [n for n, _ in params], "weight_decay": weight_decay,
             "decayed": True}
        ]  # fmt: skip
    if puzzle_emb is not None:
        groups = split_puzzle_group(groups, model, lr, puzzle_emb)
    if head is not None:
        groups = split_head_groups(groups, model, lr, head)
    groups = [g for g in groups if g["params"]]
    if not groups:
        raise ValueError(f"{type(model).__name__} has no trainable parameters")
    if kind == "muon_adamw":
        if muon is None or puzzle_emb is not None:
            raise ValueError("muon_adamw needs its Muon settings and takes no sign-SGD puzzle group")
        return muon_adamw(model, groups, lr, betas, eps, muon)
    if kind == "adamw":
        cls = AdamWSignSGD if puzzle_emb is not None else torch.optim.AdamW
        # the fused kernel (CPU and CUDA): one pass over every tensor, and found_inf skips a step on the device
        return cls(groups, lr=lr, betas=betas, eps=eps, fused=True)
    if kind == "adam_atan2":
        return AdamATan2(groups, lr=lr, betas=betas, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {kind!r}; expected 'adamw', 'adam_atan2' or 'muon_adamw'")


def split_puzzle_group(
    groups: list[dict], model: nn.Module, lr: float, puzzle: tuple[float, float]
) -> list[dict]:
    """Move ``*puzzle_emb*`` parameters out of ``groups`` into one sign-SGD group."""
    names = {id(p): n for n, p in model.named_parameters()}
    emb = [p for g in groups for p in g["params"] if "puzzle_emb" in names[id(p)]]
    if not emb:
        raise ValueError(f"{type(model).__name__} has no puzzle embedding for the sign-SGD optimiser")
    ids = {id(p) for p in emb}
    out = [
        {
            **g,
            "params": [p for p in g["params"] if id(p) not in ids],
            "names": [n for n, p in zip(g["names"], g["params"]) if id(p) not in ids],
        }
        for g in groups
    ]
    scale = puzzle[0] / lr if lr > 0 else 0.0
    out.append(
        {
            "params": emb,
            "names": [names[id(p)] for p in emb],
            "weight_decay": puzzle[1],
            "sign_sgd": True,
            "lr_scale": scale,
        }
    )
    return out


def split_head_groups(
    groups: list[dict], model: nn.Module, lr: float, head: tuple[float, float | None]
) -> list[dict]:
    """Move the head's parameters (``model.head_parameter_prefixes()``) of each group into a copy of
    that group at ``lr_mult = head[0]``; decayed matrices take weight decay ``head[1]`` unless None."""
    prefixes_fn = getattr(model, "head_parameter_prefixes", None)
    if not callable(prefixes_fn):
        raise ValueError(
            f"{type(model).__name__} defines no head_parameter_prefixes(): train.head_lr_scale / "
            "train.head_weight_decay need a model with an attractor head"
        )
    prefixes = set(prefixes_fn())
    scale, head_wd = head
    out: list[dict] = []
    for g in groups:
        inside = [_listed(n, prefixes) or n in prefixes for n in g["names"]]
        rest = {**g, "params": [p for p, i in zip(g["params"], inside) if not i]}
        rest["names"] = [n for n, i in zip(g["names"], inside) if not i]
        moved = {**g, "params": [p for p, i in zip(g["params"], inside) if i], "lr_mult": scale}
        moved["names"] = [n for n, i in zip(g["names"], inside) if i]
        moved["lr"] = lr * scale
        if head_wd is not None and g.get(
            "decayed", g["weight_decay"] > 0
        ):  # even when train.weight_decay is 0
            moved["weight_decay"] = head_wd
        out += [rest, moved]
    return out


def lr_at(
    step: int,
    lr: float,
    warmup_steps: int,
    total_steps: int,
    schedule: str = "constant",
    min_lr_ratio: float = 0.0,
    cooldown_fraction: float = 0.0,
) -> float:
    """Learning rate for optimiser step ``step`` (0-based): warm-up, then constant, cosine or trapezoid."""
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant":
        return lr
    if schedule == "trapezoid":
        cool = int(cooldown_fraction * total_steps)
        if cool > 0 and step > total_steps - cool:
            return max(lr * (total_steps - step) / cool, min_lr_ratio * lr)
        return lr
    if schedule == "cosine":
        span = max(1, total_steps - warmup_steps)
        progress = min(1.0, (step - warmup_steps) / span)
        return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
    raise ValueError(f"unknown schedule {schedule!r}; expected 'constant', 'cosine' or 'trapezoid'")


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every group's scheduled rate times its ``lr_mult`` (``AdamATan2`` groups apply their own
    ``lr_scale`` on top)."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_mult", 1.0)


def clip_grad_norm(parameters: list[Tensor], max_norm: float) -> Tensor:
    """Global gradient norm before clipping (a 0-dim tensor on the gradients' device: no host read); clips in
    place when ``max_norm > 0`` (the scale ``min(1, max_norm / (norm + 1e-6))`` applied on the device)."""
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return torch.zeros(())
    if max_norm > 0:
        return torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
    return torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)


PUZZLE_EMBEDDING = "puzzle_emb"  # the name part of the puzzle-embedding tables (sign-SGD group, counts)


class EMA:
    """Exponential moving average of a model's parameters: ``s <- d * s + (1 - d) * p``.

    ``d = decay``, or with ``warmup`` ``d_t = min(decay, (1 + t) / (10 + t))`` at optimiser step
    ``t``, so short (CPU-sized) runs do not evaluate weights that are still mostly the random
    init (0.999^150 = 0.86); TRM's code uses the plain form (``warmup=False``).

    ``puzzle_embeddings=False`` leaves the puzzle-embedding tables (parameters named ``*puzzle_emb*``)
    out of the average: ``applied`` / ``copy_to`` and checkpoints loaded with their EMA weights then
    use the live table. This is the references' behaviour: their tables are buffers
    (``CastedSparseEmbedding.weights``, ``models/sparse_embedding.py`` in TinyRecursiveModels, HRM,
    FPRM and the Attractor puzzle code) and ``EMAHelper.register`` / ``ema_copy`` (``models/ema.py``)
    average ``named_parameters()`` only.
    """

    def __init__(
        self, model: nn.Module, decay: float, warmup: bool = False, puzzle_embeddings: bool = True
    ) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"EMA decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.warmup = warmup
        self.puzzle_embeddings = puzzle_embeddings
        self.shadow: dict[str, Tensor] = {
            name: p.detach().clone()
            for name, p in model.named_parameters()
            if p.dtype.is_floating_point and (puzzle_embeddings or PUZZLE_EMBEDDING not in name)
        }

    def decay_at(self, step: int | None) -> float:
        if not self.warmup or step is None:
            return self.decay
        return min(self.decay, (1.0 + step) / (10.0 + step))

    @torch.no_grad()
    def update(self, model: nn.Module, step: int | None = None, skip: Tensor | None = None) -> None:
        """One EMA update after optimiser step ``step`` (0-based; used by the warm-up), over every tensor at
        once (``torch._foreach_*``). ``skip`` (a 0-dim bool device tensor, the step's divergence check): where
        true, the average stays as it was, decided on the device."""
        weight = 1.0 - self.decay_at(step)
        pairs = [(self.shadow[n], p.detach()) for n, p in model.named_parameters() if n in self.shadow]
        if not pairs:
            return
        shadows, params = [s for s, _ in pairs], [p for _, p in pairs]
        if skip is None:
            torch._foreach_lerp_(shadows, params, weight)
            return
        self.update_weighted(model, torch.full((), weight, dtype=torch.float64, device=skip.device), skip)

    @torch.no_grad()
    def update_weighted(self, model: nn.Module, weight: Tensor, skip: Tensor) -> None:
        """``s <- s + (w keep) (p - s)`` with the weight ``w = 1 - decay`` a 0-dim tensor (a compiled step:
        no recompilation when the warm-up changes it): exactly ``s`` when the step is skipped (the weights it
        was skipped for are finite)."""
        pairs = [(self.shadow[n], p.detach()) for n, p in model.named_parameters() if n in self.shadow]
        shadows, params = [s for s, _ in pairs], [p for _, p in pairs]
        diffs = torch._foreach_sub(params, shadows)
        torch._foreach_mul_(diffs, (~skip).to(weight.dtype) * weight)
        torch._foreach_add_(shadows, diffs)

    def state_dict(self) -> dict[str, Tensor]:
        return dict(self.shadow)

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        missing = sorted(set(self.shadow) - set(state))
        unexpected = sorted(set(state) - set(self.shadow))
        if missing or unexpected:
            raise ValueError(
                f"EMA state does not match the model: missing {missing}, unexpected {unexpected}"
            )
        for name, value in state.items():
            if value.shape != self.shadow[name].shape:
                raise ValueError(
                    f"EMA tensor {name!r} has shape {tuple(value.shape)}, model has {tuple(self.shadow[name].shape)}"
                )
            self.shadow[name].copy_(value)

    @torch.no_grad()
    def copy_to(self, model: nn.Module) -> None:
        for name, p in model.named_parameters():
            if name in self.shadow:
                p.copy_(self.shadow[name])

    @contextlib.contextmanager
    def applied(self, model: nn.Module) -> Iterator[nn.Module]:
        """Temporarily load the averaged weights into ``model`` (restored on exit)."""
        backup = {name: p.detach().clone() for name, p in model.named_parameters() if name in self.shadow}
        self.copy_to(model)
        try:
            yield model
        finally:
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if name in backup:
                        p.copy_(backup[name])


# --------------------------------------------------------------------------------------------
# MuonAdamW (train.optimizer: muon_adamw)
# --------------------------------------------------------------------------------------------
# Polar Express coefficients (a, b, c) for 5 steps (arXiv 2505.16932), the reference's POLAR_COEFFS
POLAR_EXPRESS: tuple[tuple[float, float, float], ...] = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}


def polar_express(g: Tensor, steps: int = 5, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """Approximate polar factor ``U V^T`` of each matrix in ``g`` (``..., r, c``), computed in ``dtype``."""
    if not 1 <= steps <= len(POLAR_EXPRESS):
        raise ValueError(f"Polar Express has 1..{len(POLAR_EXPRESS)} steps, got {steps}")
    x = g.to(dtype)
    x = x / (x.norm(dim=(-2, -1), keepdim=True) * 1.02 + 1e-6)
    tall = g.size(-2) > g.size(-1)
    for a, b, c in POLAR_EXPRESS[:steps]:
        if tall:
            gram = x.mT @ x
            x = a * x + x @ (b * gram + c * (gram @ gram))
        else:
            gram = x @ x.mT
            x = a * x + (b * gram + c * (gram @ gram)) @ x
    return x


def _as(value: float | Tensor, dtype: torch.dtype) -> Tensor:
    """A scalar as the reference passes it: a float32 tensor cast to ``dtype`` (a tensor: float64 from the host)."""
    return (value if isinstance(value, Tensor) else torch.tensor(value)).to(torch.float32).to(dtype)


def muon_update_(
    p: Tensor, grad: Tensor, m: Tensor, v: Tensor, group: dict, chunks: int,
    step: tuple[float | Tensor, float | Tensor, float | Tensor] | None = None,
) -> None:  # fmt: skip
    """One Muon step of ``p`` in place (momentum ``m``, second moments ``v``: ``chunks`` stacked); ``step``: this
    step's (lr, momentum, weight decay), 0-dim float64 tensors in a compiled step (default: the group's)."""
    lr, momentum, weight_decay = step if step is not None else (group["lr"], group["momentum"], group["weight_decay"])
    mom = _as(momentum, grad.dtype)
    m.lerp_(grad, 1 - mom)
    u = grad.lerp(m, mom).reshape(chunks, p.shape[0] // chunks, *p.shape[1:])
    rows, cols = u.shape[-2], u.shape[-1]
    x = polar_express(u, group["ns_steps"], NS_DTYPES[group["ns_dtype"]])
    side = -1 if rows >= cols else -2
    acc = torch.promote_types(x.dtype, torch.float32)
    sq = x.to(acc).square().mean(dim=side, keepdim=True)
    n = x.size(side)
    before = (sq.sum(dim=(-2, -1), keepdim=True) * n).sqrt()
    v.lerp_(sq.to(v.dtype), 1 - _as(group["beta2"], x.dtype))
    scale = v.clamp_min(1e-10).rsqrt()
    after = ((sq * n) * scale.to(acc).square()).sum(dim=(-2, -1), keepdim=True).sqrt()
    x = (x * (scale * (before / after.clamp_min(1e-10))).to(x.dtype)).reshape(p.shape)
    lr = _as(lr * max(1.0, rows / cols) ** 0.5, x.dtype)
    wd = _as(weight_decay, x.dtype)
    mask = (x * p) >= 0
    p.sub_(lr * x + lr * wd * p * mask)


class MuonAdamW(torch.optim.Optimizer):
    """Muon groups (``kind='muon'``) and AdamW groups (``kind='adamw'``); see the module docstring.

    Muon groups hold ``momentum``, ``beta2``, ``ns_steps``, ``ns_dtype`` (a key of ``NS_DTYPES``),
    ``chunks`` (per parameter: how many matrices its rows stack), and the schedule ``base_momentum``,
    ``momentum_warmup`` (start, steps), ``base_weight_decay``, ``taper_steps`` (0: no taper) and the
    counter ``t``. State per Muon parameter: ``momentum_buffer``, ``row_var`` (the second moments).
    """

    def __init__(self, groups: list[dict]) -> None:
        for g in groups:
            if g.get("kind") not in ("muon", "adamw"):
                raise ValueError(f"MuonAdamW group kind must be 'muon' or 'adamw', got {g.get('kind')!r}")
        super().__init__(groups, {})
        self.found_inf: Tensor | None = None  # the trainer's divergence check: non-zero skips the step
        self._steps = HostSteps()

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._steps = HostSteps()

    def reread_step_counts(self) -> None:
        """See ``AdamATan2.reread_step_counts``."""
        self._steps = HostSteps()

    @staticmethod
    def schedule_(group: dict) -> None:
        """Set a Muon group's momentum and weight decay for its step ``t`` (``scripts/train.py``)."""
        t = group["t"]
        start, warm = group["momentum_warmup"]
        frac = min(t / warm, 1.0) if warm > 0 else 1.0
        group["momentum"] = (
            start + frac * (group["base_momentum"] - start) if warm > 0 else group["base_momentum"]
        )
        wd, total = group["base_weight_decay"], group["taper_steps"]
        group["weight_decay"] = max(0.0, wd * (1 - t / total)) if total > 0 and wd > 0 else wd

    @torch.no_grad()
    def step(self, closure: object = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("MuonAdamW.step takes no closure")
        skip = None if self.found_inf is None else self.found_inf.bool()
        self.init_states()
        saved = self._snapshot() if skip is not None else []
        self.advance_schedules()
        for group in self.param_groups:
            if group["kind"] == "adamw":
                params = [p for p in group["params"] if p.grad is not None]
                states = [self.state[p] for p in params]
                for t, idx in self._steps.advance(params, states).items():
                    ps = [params[i] for i in idx]
                    adam_(ps, [p.grad for p in ps], [states[i]["exp_avg"] for i in idx],
                          [states[i]["exp_avg_sq"] for i in idx], group["lr"], t, group["betas"],
                          group["weight_decay"], group["eps"])  # fmt: skip
                continue
            for p, chunks in zip(group["params"], group["chunks"]):
                self._muon(p, group, chunks)
        for old, new in saved:  # a skipped step: every weight and moment keeps its value (on the device)
            torch.where(skip, old, new, out=new)

    def advance_schedules(self) -> list[float]:
        """Set each Muon group's momentum and weight decay for this step and count the step (``schedule_``);
        ``[momentum, weight decay]`` of each Muon group in turn (a compiled step takes them as tensors)."""
        out = []
        for group in self.param_groups:
            if group["kind"] == "muon":
                self.schedule_(group)
                group["t"] += 1
                out += [group["momentum"], group["weight_decay"]]
        return out

    def init_states(self, every: bool = False) -> None:
        """The state of every parameter this step updates for the first time (before any snapshot); ``every``:
        of the AdamW groups' parameters without a gradient too (a compiled step keeps no ``.grad``)."""
        for group in self.param_groups:
            for p, chunks in zip(group["params"], group.get("chunks", [1] * len(group["params"]))):
                state = self.state[p]
                if state:
                    continue
                if group["kind"] == "adamw":
                    if p.grad is not None or every:
                        state["step"] = torch.zeros((), dtype=torch.float32)
                        state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                    continue
                rows, cols = p.shape[-2] // chunks, p.shape[-1]
                state["momentum_buffer"] = torch.zeros_like(p)
                lead = (chunks, *p.shape[:-2])
                shape = (*lead, rows, 1) if rows >= cols else (*lead, 1, cols)
                state["row_var"] = torch.zeros(shape, dtype=p.dtype, device=p.device)

    def _snapshot(self) -> list[tuple[Tensor, Tensor]]:
        """(copy, tensor) of every weight and state tensor this step may change (the step counts excepted)."""
        out = []
        for group in self.param_groups:
            for p in group["params"]:
                if group["kind"] == "adamw" and p.grad is None:
                    continue
                tensors = [p, *(v for k, v in self.state[p].items() if k != "step" and isinstance(v, Tensor))]
                out += [(t.clone(), t) for t in tensors]
        return out

    def _muon(self, p: Tensor, group: dict, chunks: int) -> None:
        state = self.state[p]  # made by init_states
        grad = p.grad if p.grad is not None else torch.zeros_like(p)  # the reference: None as zeros
        muon_update_(p, grad, state["momentum_buffer"], state["row_var"], group, chunks)


def muon_chunks(name: str, p: Tensor) -> int:
    """How many matrices ``p``'s rows stack: 3 for a fused ``qkv`` projection (loopformer.nn's attention,
    the reference's separate ``c_q`` / ``c_k`` / ``c_v``), else 1."""
    return 3 if name.endswith("qkv.weight") and p.ndim == 2 and p.shape[0] % 3 == 0 else 1


def muon_eligible(model: nn.Module, exclude: set[str]) -> set[str]:
    """Names of the parameters the reference puts in Muon groups: two or more dimensions, not an
    embedding, not the output head (``output.*``, the reference's ``lm_head``), not a norm's, and not
    under a prefix in ``exclude`` (the attractor head, the model's ``no_weight_decay()`` list)."""
    embedded = {
        f"{mn}.{pn}" if mn else pn
        for mn, mod in model.named_modules()
        if isinstance(mod, nn.Embedding) or type(mod).__name__.lower().endswith("norm")
        for pn, _ in mod.named_parameters(recurse=False)
    }
    out = set()
    for name, p in model.named_parameters():
        under = any(name == e or name.startswith(e + ".") for e in exclude)
        if (
            p.requires_grad
            and p.ndim >= 2
            and name not in embedded
            and not name.startswith("output.")
            and not under
        ):
            out.add(name)
    return out


def muon_adamw(
    model: nn.Module, groups: list[dict], lr: float, betas: tuple[float, float], eps: float, muon: dict
) -> MuonAdamW:
    """``MuonAdamW`` from AdamW parameter groups (``optim.parameter_groups``, head groups split off):
    the Muon-eligible parameters of the groups without an ``lr_mult`` move into one Muon group.

    ``muon``: ``lr``, ``momentum``, ``weight_decay``, ``ns_steps``, ``beta2``, ``ns_dtype``,
    ``momentum_warmup`` (start, steps), ``taper_steps``.
    """
    exclude = set(getattr(model, "head_parameter_prefixes", lambda: set())())
    listed = getattr(model, "no_weight_decay", None)
    exclude |= set(listed()) if callable(listed) else set()
    eligible = muon_eligible(model, exclude)
    names = {id(p): n for n, p in model.named_parameters()}
    moved = [p for g in groups if "lr_mult" not in g for p in g["params"] if names[id(p)] in eligible]
    ids = {id(p) for p in moved}
    out = [
        {**g, "kind": "adamw", "betas": tuple(betas), "eps": eps, "lr": g.get("lr", lr),
         "params": [p for p in g["params"] if id(p) not in ids],
         "names": [n for n, p in zip(g["names"], g["params"]) if id(p) not in ids]}
        for g in groups
    ]  # fmt: skip
    out = [g for g in out if g["params"]]
    if moved:
        out.append({
            "kind": "muon", "params": moved, "names": [names[id(p)] for p in moved],
            "chunks": [muon_chunks(names[id(p)], p) for p in moved],
            "lr": muon["lr"], "lr_mult": muon["lr"] / lr, "momentum": muon["momentum"],
            "base_momentum": muon["momentum"], "momentum_warmup": tuple(muon["momentum_warmup"]),
            "weight_decay": muon["weight_decay"], "base_weight_decay": muon["weight_decay"],
            "taper_steps": muon["taper_steps"], "beta2": muon["beta2"], "ns_steps": muon["ns_steps"],
            "ns_dtype": muon["ns_dtype"], "t": 0,
        })  # fmt: skip
    return MuonAdamW(out)


class HostSteps:
    """An optimiser's per-parameter step counts, kept on the host beside the ``step`` tensors of its state
    (read once, when a parameter is first seen after construction or ``load_state_dict``), so that the bias
    corrections never read a value back from the device."""

    def __init__(self) -> None:
        self.count: dict[int, float] = {}

    def advance(self, params: list[Tensor], states: list[dict]) -> dict[float, list[int]]:
        """Count one more step for every parameter; ``{step count: indices into params}``."""
        groups: dict[float, list[int]] = {}
        for i, (p, state) in enumerate(zip(params, states)):
            t = self.count.get(id(p))
            if t is None:
                t = float(state["step"])  # once per parameter (a tensor on the CPU: no device read)
            t += 1.0
            self.count[id(p)] = t
            state["step"] += 1
            groups.setdefault(t, []).append(i)
        return groups


# --------------------------------------------------------------------------------------------
# The update of a compiled step: every per-step value a tensor
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class TensorGroup:
    """One parameter group as a compiled step updates it (``tensor_groups``): the positions of its parameters in
    the optimiser's list, their state tensors, its constant settings; the per-step values enter as tensors."""

    kind: str  # adam | atan2 | sign_sgd | muon
    index: tuple[int, ...]
    state: tuple[tuple[Tensor, ...], ...]  # per parameter: (exp_avg, exp_avg_sq, step) | (momentum_buffer, row_var)
    rate: float  # the group's multiple of the scheduled rate (lr_mult, lr_scale)
    settings: dict[str, Any]  # betas, eps, weight_decay | beta2, ns_steps, ns_dtype; chunks per parameter
    muon: int = -1  # this Muon group's (momentum, weight decay) at muon, muon + 1 of the per-step values


def tensor_groups(opt: torch.optim.Optimizer, params: list[Tensor]) -> list[TensorGroup]:
    """``opt``'s groups (AdamW, AdamWSignSGD, AdamATan2, MuonAdamW) as a compiled step reads them, made on the host:
    missing state created, step counts float32 on the parameters' device, each parameter's position in ``params``
    (the list the step differentiates: its gradients come in that order). A compiled region reads these, never
    ``param_groups``: Dynamo guards every value it reads there, and the rate changes every step of a warm-up."""
    if isinstance(opt, MuonAdamW):
        opt.init_states(every=True)
    position = {id(p): i for i, p in enumerate(params)}
    missing = [i for i, p in enumerate(p for g in opt.param_groups for p in g["params"]) if id(p) not in position]
    if missing:
        raise ValueError(f"tensor_groups: the optimiser's parameters {missing[:5]} are not among the {len(params)} given")
    out, muon = [], 0
    for group in opt.param_groups:
        kind = "sign_sgd" if group.get("sign_sgd") else group.get("kind", "atan2" if isinstance(opt, AdamATan2) else "adam")
        kind = "adam" if kind == "adamw" else kind
        params, state = group["params"], []
        for p in params if kind in ("adam", "atan2") else ():
            st = opt.state[p]
            if not st:
                st["exp_avg"], st["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                st["step"] = torch.zeros((), dtype=torch.float32)
            st["step"] = st["step"].to(device=p.device, dtype=torch.float32)
            state.append((st["exp_avg"], st["exp_avg_sq"], st["step"]))
        state += [(opt.state[p]["momentum_buffer"], opt.state[p]["row_var"]) for p in params if kind == "muon"]
        keys = ("betas", "eps", "weight_decay", "beta2", "ns_steps", "ns_dtype", "chunks")
        out.append(TensorGroup(kind, tuple(position[id(p)] for p in params), tuple(state),
                               group.get("lr_mult", 1.0) * group.get("lr_scale", 1.0),
                               {k: group[k] for k in keys if k in group}, muon if kind == "muon" else -1))  # fmt: skip
        muon += 2 * (kind == "muon")
    if isinstance(opt, AdamATan2 | MuonAdamW):
        opt.reread_step_counts()  # the eager step re-reads the (moved) counts if it runs again
    return out


def tensor_update_(
    groups: list[TensorGroup], params: list[Tensor], grads: list[Tensor | None], lr: Tensor, muon: Tensor,
    skip: Tensor,
) -> None:  # fmt: skip
    """The optimiser step of ``tensor_groups`` in a compiled region, with the same updates as the eager step
    (``adam_``, ``sign_sgd_rows_``, ``muon_update_``): ``grads[i]`` of ``params[i]`` (None: no gradient), the
    scheduled rate ``lr`` and the Muon groups' (momentum, weight decay) ``muon`` as float64 tensors; where ``skip``,
    every tensor keeps its value. Each step count advances unless skipped."""
    keep = ~skip
    for group in groups:
        rate, s = lr * group.rate, group.settings
        for j, i in enumerate(group.index):
            p, g = params[i], grads[i]
            if group.kind == "sign_sgd":
                if g is not None:
                    sign_sgd_rows_(p, g, rate, s["weight_decay"], skip)
            elif group.kind == "muon":
                m, v = group.state[j]
                olds = [t.clone() for t in (p, m, v)]
                muon_update_(p, torch.zeros_like(p) if g is None else g, m, v, s, s["chunks"][j],
                             (rate, muon[group.muon], muon[group.muon + 1]))  # fmt: skip
                for old, new in zip(olds, (p, m, v)):
                    new.copy_(torch.where(skip, old, new))
            elif g is not None:
                m, v, t = group.state[j]
                t.add_(keep.to(t.dtype))
                eps = s["eps"] if group.kind == "adam" else None
                # the count is float32 (exact to 2^24; a float64 0-dim input loses its in-place update under AOT
                # autograd, torch 2.13), its bias corrections in the parameter's precision where that is wider
                wide = t.to(torch.promote_types(p.dtype, t.dtype))
                adam_([p], [g], [m], [v], rate, wide, s["betas"], s["weight_decay"], eps, skip)
