"""Analyses of the loop itself: logit lens, overthinking, signal propagation, Jacobian spectral radius.

- Logit lens (arXiv 2604.07822, "Loop, Think, & Generalize"): every intermediate state ``z_t`` is read
  through the model's own readout (final norm + head), through the engine's
  ``callback(t, z_active, active_idx)``; per loop: token / exact / validator accuracy and, for
  knowledge-graph queries, the rank of the bridge entity's logit (0 = top) at a chosen position.
- Overthinking (arXiv 2604.07822): the logit lens's logit margin (correct logit minus the best other
  logit) at the answer positions and its accuracy vs inference loops, run past the training depth
  (``logit_lens(..., train_depth=)`` marks it).
- Signal propagation (arXiv 2606.18206, FPRM's motivation): the state's RMS norm ``sqrt(mean z^2)`` and
  the update norm ``||z_{t+1} - z_t||`` (absolute and relative to ``||z_t||``) per loop.
- Spectral radius of ``J = d step / dz`` at the (approximate) fixed point by power iteration with
  Jacobian-vector products (``torch.func.jvp``) or vector-Jacobian products (``J^T`` has the same
  spectrum). arXiv 2606.18206 (Theorem 3): damping matters when eigenvalues leave the unit circle.
- The logit lens of a language model (a task without a validator): every loop's readout scored as a
  language model (bits per byte, token accuracy, logit margin per loop: ``LMLoopCurve``).

All per-loop readouts force the ``fixed`` halting rule by default, so every sample is read at every
loop; a sample that halts earlier under another rule keeps its last readout. ``segments`` (default 1)
chains that many engine calls of ``loops`` loops each, carrying the state as ``evaluate(segments=)``
does (``eval.segments``); the curves then cover ``segments * loops`` loops.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from loopformer.eval.budget import with_budget
from loopformer.eval.evaluate import batch_tensors, eval_mode, iter_batches, score_predictions
from loopformer.loop import LoopConfig
from loopformer.models.base import LoopedModel
from loopformer.tasks.base import IGNORE_INDEX, Task, TokenDataset

# A per-loop observer: (loop index t >= 1, full-batch state at loop t, full-batch logits at loop t)
LoopObserver = Callable[[int, Tensor, Tensor], None]


def _index_ctx(ctx: tuple[Tensor, ...], idx: Tensor, batch: int) -> tuple[Tensor, ...]:
    if idx.numel() == batch and bool((idx == torch.arange(batch, device=idx.device)).all()):
        return ctx
    return tuple(c[idx] if isinstance(c, Tensor) and c.dim() > 0 and c.shape[0] == batch else c for c in ctx)


@torch.no_grad()
def trace_loops(
    model: LoopedModel,
    inputs: Tensor,
    loop: LoopConfig,
    observe: LoopObserver,
    puzzle_ids: Tensor | None = None,
    generator: torch.Generator | None = None,
    z0: Tensor | None = None,
    read: bool = True,
    segments: int = 1,
) -> tuple[Tensor, Tensor]:
    """Run ``model`` on one batch and call ``observe(t, z_t, logits_t)`` after every loop t = 1, 2, ...

    ``segments`` chained engine calls carry the state (each runs ``loop``), as ``evaluate(segments=)``
    does (``eval.segments``: TRM / HRM evaluate 16); t counts on across segments. States and logits are
    full-batch: rows of samples that already halted keep their last value (within a segment; every
    segment restarts every row). With ``read=False`` no readout is taken and ``logits_t`` is passed as
    ``z_t``. Returns ``(z0, final logits)``: the last segment's.
    """
    if segments < 1:
        raise ValueError(f"segments must be >= 1, got {segments}")
    ctx = model.embed(inputs, puzzle_ids)
    if z0 is None:
        z0 = model.init_state(ctx, generator)
    batch = inputs.shape[0]
    current: dict[str, Any] = {"z": z0.clone(), "logits": None, "t": 0}

    def callback(t: int, z_active: Tensor, active_idx: Tensor) -> None:
        active_idx = active_idx.to(z_active.device).long().reshape(-1)
        z_full = current["z"]
        z_full[active_idx] = z_active.to(z_full.dtype)
        current["t"] += 1
        if not read:
            observe(current["t"], z_full, z_full)
            return
        logits_active = model.readout(z_active, *_index_ctx(ctx, active_idx, batch))
        if current["logits"] is None:
            if active_idx.numel() != batch:  # a sample halted before the first loop: its z0 readout
                current["logits"] = model.readout(z0, *ctx).to(logits_active.dtype)
            else:
                current["logits"] = torch.empty(
                    (batch, *logits_active.shape[1:]), dtype=logits_active.dtype, device=logits_active.device
                )
        current["logits"][active_idx] = logits_active
        observe(current["t"], z_full, current["logits"])

    state = z0
    for k in range(segments):
        if k:
            current["z"] = state.clone()
        out = model(inputs, loop=loop, state=state, puzzle_ids=puzzle_ids, callback=callback)
        state = out.state
    return z0, out.logits


def _fixed(model: LoopedModel, loop: LoopConfig | None, loops: int, halting: str) -> LoopConfig:
    base = loop if loop is not None else model.config.loop
    return with_budget(base, loops, "fixed" if halting == "fixed" else "capped")


# ------------------------------------------------------------------------------------------------
# logit lens and overthinking
# ------------------------------------------------------------------------------------------------


@dataclass
class LoopCurve:
    """Per-loop metrics (index 0 is loop 1)."""

    loops: list[int]
    token_accuracy: list[float]
    exact_accuracy: list[float]
    valid_accuracy: list[float]
    margin: list[float]  # mean (correct logit - best other logit) at the labelled positions
    bridge_rank: list[float] = field(default_factory=list)  # mean rank of the bridge token (0 = top)
    bridge_top1: list[float] = field(default_factory=list)
    train_depth: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

@dataclass
class LMLoopCurve:
    """Per-loop language-modelling metrics of the logit lens (index 0 is loop 1)."""

    loops: list[int]
    bits_per_byte: list[float]
    loss: list[float]  # nats per labelled token
    token_accuracy: list[float]
    margin: list[float]  # mean (correct logit - best other logit) at the labelled positions
    train_depth: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def logit_margin(logits: Tensor, labels: Tensor) -> Tensor:
    """Correct logit minus the best other logit at every labelled position; [B, T], nan elsewhere."""
    mask = labels != IGNORE_INDEX
    safe = labels.clamp_min(0)
    correct = logits.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    others = logits.scatter(-1, safe.unsqueeze(-1), float("-inf"))
    margin = correct - others.max(dim=-1).values
    return torch.where(mask, margin, torch.full_like(margin, float("nan")))


def token_rank(logits: Tensor, tokens: Tensor, positions: Tensor) -> Tensor:
    """Rank (0 = highest logit) of ``tokens[i]`` at position ``positions[i]`` of row i; [B] float."""
    rows = torch.arange(logits.shape[0], device=logits.device)
    at = logits[rows, positions]  # [B, V]
    target = at.gather(-1, tokens.unsqueeze(-1))
    return (at > target).sum(-1).to(torch.float64)


def _answer_positions(labels: np.ndarray) -> np.ndarray:
    """The last labelled position of each row (the answer position of a query task)."""
    mask = labels != IGNORE_INDEX
    if not mask.any(axis=1).all():
        raise ValueError("some rows have no labelled position to read the bridge token at")
    return mask.shape[1] - 1 - np.argmax(mask[:, ::-1], axis=1)


def _ratio(a: np.ndarray, b: np.ndarray | float) -> list[float]:
    """Elementwise a / b as floats, nan where b is 0."""
    b = np.broadcast_to(np.asarray(b, dtype=np.float64), a.shape)
    return [float(x / y) if y else float("nan") for x, y in zip(a, b)]


def _bridge_targets(
    task: Task | None,
    dataset: TokenDataset,
    bridge_tokens: np.ndarray | None,
    bridge_positions: np.ndarray | int | None,
) -> tuple[np.ndarray, np.ndarray] | None:
    """(bridge token [N] (-1 = none), position [N]) for the logit lens, or None when no row has one.

    Without ``bridge_tokens`` the task's ``bridges(inputs)`` is used; without ``bridge_positions``
    the last labelled position of each row."""
    if bridge_tokens is None and task is not None:
        bridge_tokens = task.bridges(dataset.inputs)
    if bridge_tokens is None:
        return None
    bridge_tokens = np.asarray(bridge_tokens, dtype=np.int64).reshape(-1)
    if len(bridge_tokens) != len(dataset):
        raise ValueError(f"bridge_tokens has {len(bridge_tokens)} entries for {len(dataset)} examples")
    if bridge_positions is None:
        positions = _answer_positions(dataset.labels)
    else:
        positions = np.array(np.broadcast_to(np.asarray(bridge_positions, dtype=np.int64), (len(dataset),)))
    return (bridge_tokens, positions) if (bridge_tokens >= 0).any() else None


class _LensTally:
    """The logit lens's per-loop sums over batches (index k is loop k + 1); for a language model (a task
    without a validator) the cross-entropy, summed in float64, instead of the validator's verdicts."""

    KEYS = ("right", "count", "exact", "valid", "margin", "margin_n", "rank", "top1", "bridge_n", "nll")

    def __init__(self, task: Task, loops: int) -> None:
        self.task, self.loops = task, loops
        self.lm = task is not None and not task.has_validator
        self.sums = {k: np.zeros(loops) for k in self.KEYS}
        self.n = 0

    def observer(
        self, x_np: np.ndarray, y_np: np.ndarray, labels: Tensor, bridge: tuple[Tensor, Tensor] | None
    ) -> LoopObserver:
        """The ``trace_loops`` observer of one batch; ``bridge``: its (tokens, positions) or None."""
        self.n += len(x_np)

        def observe(t: int, z: Tensor, logits: Tensor) -> None:
            if t <= self.loops:
                self.add(t - 1, x_np, y_np, labels, logits, bridge)

        return observe

    def add(
        self,
        k: int,
        x_np: np.ndarray,
        y_np: np.ndarray,
        labels: Tensor,
        logits: Tensor,
        bridge: tuple[Tensor, Tensor] | None,
    ) -> None:
        sums = self.sums
        if self.lm:
            logits = logits.double()
            mask = labels != IGNORE_INDEX
            sums["nll"][k] += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                    ignore_index=IGNORE_INDEX, reduction="sum"))  # fmt: skip
            sums["right"][k] += float(((logits.argmax(-1) == labels) & mask).sum())
            sums["count"][k] += float(mask.sum())
        else:
            pred = logits.argmax(-1).cpu().numpy()
            exact, valid, right, count = score_predictions(self.task, x_np, y_np, pred)
            sums["right"][k] += right.sum()
            sums["count"][k] += count.sum()
            sums["exact"][k] += exact.sum()
            sums["valid"][k] += valid.sum()
        m = logit_margin(logits.double(), labels)
        finite = ~torch.isnan(m)
        sums["margin"][k] += float(m[finite].sum())
        sums["margin_n"][k] += int(finite.sum())
        if bridge is None:
            return
        tokens, positions = bridge
        has_bridge = tokens >= 0
        if bool(has_bridge.any()):
            ranks = token_rank(logits, tokens.clamp_min(0), positions)[has_bridge]
            sums["rank"][k] += float(ranks.sum())
            sums["top1"][k] += float((ranks == 0).sum())
            sums["bridge_n"][k] += int(has_bridge.sum())

    def curve(self, train_depth: int | None, bridges: bool) -> LoopCurve | LMLoopCurve:
        sums = self.sums
        if self.lm:
            from loopformer.tasks.text import bits_per_byte

            loss, per_byte = _ratio(sums["nll"], sums["count"]), float(self.task.tokens_per_byte)
            return LMLoopCurve(loops=list(range(1, self.loops + 1)),
                               bits_per_byte=[bits_per_byte(x, per_byte) if math.isfinite(x) else float("nan") for x in loss],
                               loss=loss, token_accuracy=_ratio(sums["right"], sums["count"]),
                               margin=_ratio(sums["margin"], sums["margin_n"]), train_depth=train_depth)  # fmt: skip
        curve = LoopCurve(
            loops=list(range(1, self.loops + 1)),
            token_accuracy=_ratio(sums["right"], sums["count"]),
            exact_accuracy=_ratio(sums["exact"], self.n),
            valid_accuracy=_ratio(sums["valid"], self.n),
            margin=_ratio(sums["margin"], sums["margin_n"]),
            train_depth=train_depth,
        )
        if bridges:
            curve.bridge_rank = _ratio(sums["rank"], sums["bridge_n"])
            curve.bridge_top1 = _ratio(sums["top1"], sums["bridge_n"])
        return curve


def logit_lens(
    model: LoopedModel,
    task: Task,
    dataset: TokenDataset,
    loops: int,
    loop: LoopConfig | None = None,
    halting: str = "fixed",
    bridge_tokens: np.ndarray | None = None,
    bridge_positions: np.ndarray | int | None = None,
    batch_size: int = 64,
    max_batches: int | None = None,
    device: torch.device | str | None = None,
    train_depth: int | None = None,
    seed: int = 0,
    segments: int = 1,
) -> LoopCurve | LMLoopCurve:
    """Read out every loop state through the model's head: per-loop accuracies and logit margins; for a
    task without a validator (a language model) an ``LMLoopCurve``: every loop's readout scored as a
    language model (cross-entropy summed in float64, as bits per byte), token accuracy and margin.

    ``bridge_tokens`` ([N], -1 = skip that row) adds the bridge token's rank per loop, read at
    ``bridge_positions`` (default: the last labelled position). When no tokens are given, the task's
    ``bridges(inputs)`` (knowledge-graph queries; None for other tasks) is used.
    """
    if loops < 1 or segments < 1:
        raise ValueError(f"loops and segments must be >= 1, got {loops} and {segments}")
    tally = _LensTally(task, loops * segments)
    with eval_mode(model, device) as device:
        cfg = _fixed(model, loop, loops, halting)
        bridges = None if tally.lm else _bridge_targets(task, dataset, bridge_tokens, bridge_positions)
        generator = torch.Generator(device=device).manual_seed(seed)
        for index in iter_batches(dataset, batch_size, max_batches):
            inputs, labels, puzzle_ids = batch_tensors(dataset, index, device)
            bridge = None
            if bridges is not None:
                bridge = tuple(torch.as_tensor(b[index], device=device) for b in bridges)
            observe = tally.observer(dataset.inputs[index], dataset.labels[index], labels, bridge)
            trace_loops(model, inputs, cfg, observe, puzzle_ids, generator, segments=segments)
    return tally.curve(train_depth, bridges is not None)


# ------------------------------------------------------------------------------------------------
# signal propagation
# ------------------------------------------------------------------------------------------------


@dataclass
class SignalCurve:
    """Per-loop means over samples (index 0 is loop 1; ``state_rms0`` is the initial iterate's)."""

    loops: list[int]
    state_rms: list[float]
    update_norm: list[float]  # ||z_t - z_{t-1}||_2 per sample
    relative_update: list[float]  # ||z_t - z_{t-1}|| / ||z_{t-1}||
    state_rms0: float

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def rms(z: Tensor) -> Tensor:
    """Per-sample root-mean-square over every non-batch dimension; [B]."""
    return z.flatten(1).double().pow(2).mean(dim=1).sqrt()


@torch.no_grad()
def signal_propagation(
    model: LoopedModel,
    dataset: TokenDataset,
    loops: int,
    loop: LoopConfig | None = None,
    batch_size: int = 64,
    max_batches: int | None = 1,
    device: torch.device | str | None = None,
    seed: int = 0,
    segments: int = 1,
) -> SignalCurve:
    """State RMS norm and update norm per loop, over ``segments`` chained segments of ``loops`` fixed loops."""
    if loops < 1 or segments < 1:
        raise ValueError(f"loops and segments must be >= 1, got {loops} and {segments}")
    cfg_loops, loops = loops, loops * segments
    sums = {k: np.zeros(loops) for k in ("rms", "upd", "rel")}
    n_total, rms0 = 0, 0.0
    with eval_mode(model, device) as device:
        cfg = _fixed(model, loop, cfg_loops, "fixed")
        generator = torch.Generator(device=device).manual_seed(seed)
        for index in iter_batches(dataset, batch_size, max_batches):
            inputs, _, puzzle_ids = batch_tensors(dataset, index, device)
            prev: dict[str, Tensor] = {}

            def observe(t: int, z: Tensor, logits: Tensor, prev: dict[str, Tensor] = prev) -> None:
                if t > loops:
                    return
                k = t - 1
                d = (z - prev["z"]).flatten(1).double()
                sums["rms"][k] += float(rms(z).sum())
                sums["upd"][k] += float(d.norm(dim=1).sum())
                sums["rel"][k] += float(
                    (d.norm(dim=1) / prev["z"].flatten(1).double().norm(dim=1).clamp_min(1e-30)).sum()
                )
                prev["z"] = z.clone()

            ctx = model.embed(inputs, puzzle_ids)
            z0 = model.init_state(ctx, generator)
            prev["z"] = z0.clone()
            rms0 += float(rms(z0).sum())
            n_total += inputs.shape[0]
            trace_loops(model, inputs, cfg, observe, puzzle_ids, z0=z0, read=False, segments=segments)
    return SignalCurve(
        loops=list(range(1, loops + 1)),
        state_rms=[float(x / n_total) for x in sums["rms"]],
        update_norm=[float(x / n_total) for x in sums["upd"]],
        relative_update=[float(x / n_total) for x in sums["rel"]],
        state_rms0=rms0 / n_total,
    )


# ------------------------------------------------------------------------------------------------
# the spectral radius of the step's Jacobian
# ------------------------------------------------------------------------------------------------


def spectral_radius(
    f: Callable[[Tensor], Tensor],
    z: Tensor,
    iters: int = 200,
    tol: float = 1e-6,
    method: str = "jvp",
    generator: torch.Generator | None = None,
    per_sample: bool = True,
) -> Tensor:
    """Spectral radius of ``J = df/dz`` at ``z`` by power iteration; [B] (per sample) or a scalar.

    ``f`` must act on each sample independently (true of a transformer step), so ``J`` is block
    diagonal and every sample is its own power iteration. ``method``: ``jvp`` iterates ``v <- J v``
    (``torch.func.jvp``), ``vjp`` iterates ``v <- J^T v`` (autograd; same spectrum). The estimate is
    the geometric mean of the growth ``||J v|| / ||v||`` over the second half of the iterations, which
    also converges when the dominant eigenvalues are a complex pair. Stops early once two successive
    windowed estimates agree to ``tol`` (relative).
    """
    if method not in ("jvp", "vjp"):
        raise ValueError(f"unknown method {method!r} (jvp | vjp)")
    z = z.detach()
    batch = z.shape[0] if per_sample else 1
    v = torch.randn(z.shape, generator=generator, dtype=z.dtype, device=z.device)

    def norms(x: Tensor) -> Tensor:
        flat = x.reshape(batch, -1)
        return flat.norm(dim=1).clamp_min(torch.finfo(x.dtype).tiny)

    def shape_b(n: Tensor) -> Tensor:
        return n.reshape(batch, *([1] * (z.dim() - (1 if per_sample else 0))))

    v = v / shape_b(norms(v))
    if method == "vjp":
        with torch.enable_grad():
            z_req = z.clone().requires_grad_(True)
            fz = f(z_req)

        def apply(u: Tensor) -> Tensor:
            (g,) = torch.autograd.grad(fz, z_req, u, retain_graph=True)
            return g
    else:

        def apply(u: Tensor) -> Tensor:
            return torch.func.jvp(f, (z,), (u,))[1]

    logs: list[Tensor] = []
    estimate = None
    for k in range(iters):
        w = apply(v).detach()
        g = norms(w)
        logs.append(g.log())
        v = w / shape_b(g)
        if k >= 9 and (k + 1) % 5 == 0:
            window = torch.stack(logs[len(logs) // 2 :])
            new = window.mean(0).exp()
            if estimate is not None and bool(
                ((new - estimate).abs() <= tol * estimate.abs().clamp_min(1e-12)).all()
            ):
                estimate = new
                break
            estimate = new
    if estimate is None:
        estimate = torch.stack(logs[len(logs) // 2 :]).mean(0).exp()
    return estimate if per_sample else estimate.reshape(())


@torch.no_grad()
def spectral_radius_at_fixed_point(
    model: LoopedModel,
    inputs: Tensor,
    loop: LoopConfig | None = None,
    puzzle_ids: Tensor | None = None,
    iters: int = 100,
    tol: float = 1e-4,
    method: str = "vjp",
    seed: int = 0,
) -> Tensor:
    """Run the model's loop to its final (approximately fixed) state, then the spectral radius of the
    step's Jacobian there, per sample [B]."""
    with eval_mode(model) as device:
        inputs = inputs.to(device)
        generator = torch.Generator(device=device).manual_seed(seed)
        ctx = tuple(c.detach() if isinstance(c, Tensor) else c for c in model.embed(inputs, puzzle_ids))
        z0 = model.init_state(ctx, generator)
        out = model(inputs, loop=loop, state=z0, puzzle_ids=puzzle_ids)
        z_star = out.state.detach()

        def f(z: Tensor) -> Tensor:
            return model.step(z, *ctx)

        return spectral_radius(f, z_star, iters=iters, tol=tol, method=method, generator=generator)


def spectral_radius_summary(radii: Tensor) -> dict[str, float]:
    r = radii.detach().double().cpu().numpy()
    return {
        "mean": float(r.mean()),
        "median": float(np.median(r)),
        "max": float(r.max()),
        "fraction_below_1": float((r < 1).mean()),
    }
