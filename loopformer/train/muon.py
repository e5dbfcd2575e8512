"""``MuonAdamW``: Muon on the hidden weight matrices, AdamW on the rest (``train.optimizer: muon_adamw``).

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

import torch
from torch import Tensor, nn

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


def _as(value: float, dtype: torch.dtype) -> Tensor:
    """A scalar as the reference passes it: a float32 tensor cast to ``dtype``."""
    return torch.tensor(value, dtype=torch.float32).to(dtype)


def muon_update_(p: Tensor, grad: Tensor, m: Tensor, v: Tensor, group: dict, chunks: int) -> None:
    """One Muon step of ``p`` in place (momentum ``m``, second moments ``v``: ``chunks`` stacked)."""
    mom = _as(group["momentum"], grad.dtype)
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
    lr = _as(group["lr"] * max(1.0, rows / cols) ** 0.5, x.dtype)
    wd = _as(group["weight_decay"], x.dtype)
    mask = (x * p) >= 0
    p.sub_(lr * x + lr * wd * p * mask)


def adamw_update_(p: Tensor, state: dict, group: dict, t: float | None = None) -> None:
    """``torch.optim.AdamW``'s update of ``p`` (state ``step``, ``exp_avg``, ``exp_avg_sq``); ``t``: the step
    count after this step when the caller keeps it on the host (else it is read from the state)."""
    if not state:
        state["step"] = torch.zeros((), dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(p)
        state["exp_avg_sq"] = torch.zeros_like(p)
    (b1, b2), lr = group["betas"], group["lr"]
    if t is None:
        state["step"] += 1
        t = float(state["step"])
    m, v, g = state["exp_avg"], state["exp_avg_sq"], p.grad
    p.mul_(1 - lr * group["weight_decay"])
    m.lerp_(g, 1 - b1)
    v.lerp_(g.square(), 1 - b2)
    denom = (v / (1 - b2**t)).sqrt().add_(group["eps"])
    p.addcdiv_(m, denom, value=-lr / (1 - b1**t))


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
        self._init_states()
        saved = self._snapshot() if skip is not None else []
        for group in self.param_groups:
            if group["kind"] == "adamw":
                params = [p for p in group["params"] if p.grad is not None]
                states = [self.state[p] for p in params]
                for t, idx in self._steps.advance(params, states).items():
                    for i in idx:
                        adamw_update_(params[i], states[i], group, t)
                continue
            self.schedule_(group)
            for p, chunks in zip(group["params"], group["chunks"]):
                self._muon(p, group, chunks)
            group["t"] += 1
        for old, new in saved:  # a skipped step: every weight and moment keeps its value (on the device)
            torch.where(skip, old, new, out=new)

    def _init_states(self) -> None:
        """The state of every parameter this step updates for the first time (before any snapshot)."""
        for group in self.param_groups:
            for p, chunks in zip(group["params"], group.get("chunks", [1] * len(group["params"]))):
                state = self.state[p]
                if state:
                    continue
                if group["kind"] == "adamw":
                    if p.grad is not None:
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
        state = self.state[p]  # made by _init_states
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
