"""The 9x9 FPRM vs TRM head-to-head's evaluation (issue 32): seeds, each model's own protocol, matched compute.

``experiments/sudoku9_cpu.py --phase eval --seeds 0,1,2`` calls :func:`evaluate_checkpoint` for every seed, budget
and model of ``AUTHORS`` and :func:`assemble` to gather the rows. One pass over the held-out set per checkpoint
gives everything, so no checkpoint is run twice:

- **FPRM** (``fprm_authors``, ``fprm_authors_jac``) runs its authors' evaluation loop (damped solver, decay
  0.997, patience 10, the whole batch of 250 stopping once its largest relative sup-norm residual is below
  0.1 or every step size is below 1e-3, cap 1000: nilskiKonjIzDunava/fprm ``pretrain.py`` ``evaluate``) with
  the step cap raised to 1024 and its prediction read at every step. Its own protocol is the prediction when
  the batch stops (or at step 1000); the matched-compute point at B blocks is each puzzle's prediction at
  min(B / 2 steps, the first step its own residual is below 0.1): per-sample fixed-point halting capped at
  B blocks (FPRM's Algorithm 1 halts per sample; loopformer's compaction makes that real compute).
- **TRM** (``trm_authors``) runs its 16 segments of 3 cycles as one loop of cycles without halting
  (SamsungSAILMontreal/TinyRecursiveModels evaluates all 16 segments; identical without gradient:
  tests/test_parity_trm.py), continued to 146 cycles. Its own protocol is the prediction after 48 cycles
  (672 blocks); the matched-compute point at B blocks is its prediction after floor(B / 14) cycles (a cycle is
  6 latent updates and 1 answer update of its 2-block net; it has no point at 8 blocks).

Every row keeps each puzzle's validity (the task's independent validator) so that :func:`paired_bootstrap`
can compare the models puzzle by puzzle. ``device`` (``--device`` of the driver) runs the pass on a GPU in float32
with TF32 off (:func:`strict_float32`); FPRM's random initial iterate then comes from a generator on that device.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import scipy.stats
import torch

from loopformer.eval.budget import steps_vs_difficulty
from loopformer.eval.evaluate import batch_tensors, iter_batches
from loopformer.runs import load_run
from loopformer.tasks.base import TokenDataset

BATCH = 250  # the earlier reruns' evaluation batch (the batch-wide halting rule depends on it)
FPRM_TRACE = 1024  # steps traced: 2,048 blocks
BLOCK_BUDGETS = [2**k for k in range(3, 12)]  # 8 .. 2,048 blocks per puzzle
BLANK_BINS = ((20, 29), (30, 39), (40, 49), (50, 60))


def budget_steps(per_step: int, blocks: int) -> int:
    """The loop steps that fit in ``blocks`` blocks per puzzle (0: not even one), for a model applying
    ``per_step`` blocks a step (``LoopedModel.blocks_per_step``: FPRM's 2 blocks; TRM's (6 latent + 1 answer) x
    2 blocks a cycle; HRM's 2 L + 1 H blocks)."""
    return blocks // per_step


def _bits(valid: np.ndarray) -> str:
    return "".join("1" if v else "0" for v in valid)


def _unbits(text: str) -> np.ndarray:
    return np.frombuffer(text.encode(), dtype=np.uint8) == ord("1")


def _score(task: Any, inputs: np.ndarray, preds: np.ndarray) -> np.ndarray:
    return np.asarray([task.check(x, y) for x, y in zip(inputs, preds)], dtype=bool)


@torch.no_grad()
def _trace_batch(run: Any, inputs: torch.Tensor, puzzle_ids: Any, loop: Any, keep: set[int], gen: Any) -> Any:
    """One engine call with ``loop``; the arg-max prediction after every step t in ``keep`` (uint8 [B, T]) and
    the model's output (its loop result holds the per-sample residual of every step)."""
    seen: dict[int, np.ndarray] = {}
    model = run.model
    ctx = model.embed(inputs, puzzle_ids)
    batch = inputs.shape[0]

    def callback(t: int, z: torch.Tensor, active: torch.Tensor) -> None:
        if t not in keep:
            return
        idx = active.long().reshape(-1)
        sub = (
            ctx
            if idx.numel() == batch
            else tuple(c[idx] if torch.is_tensor(c) and c.dim() and c.shape[0] == batch else c for c in ctx)
        )
        pred = seen[t - 1].copy() if t - 1 in seen else np.zeros(tuple(inputs.shape), dtype=np.uint8)
        pred[idx.cpu().numpy()] = model.readout(z, *sub).argmax(-1).cpu().numpy()
        seen[t] = pred

    out = model(inputs, loop=loop, puzzle_ids=puzzle_ids, callback=callback, generator=gen)
    return seen, out


def _first_converged(residuals: np.ndarray, tol: float) -> np.ndarray:
    """Per sample, the first step (1-based) whose residual is below ``tol``; a large value if none."""
    below = residuals < tol  # [T, B]; NaN compares False
    first = np.where(below.any(0), below.argmax(0) + 1, 10**9)
    return first


@torch.no_grad()
def trace_fprm(run: Any, data: TokenDataset, device: str = "cpu") -> dict[str, Any]:
    """The single FPRM pass (module docstring): the protocol's predictions, the per-sample capped predictions at
    every block budget, per-puzzle steps of both, and which puzzles converged."""
    cap = int(run.loop_eval.max_steps)  # the authors' protocol's cap: 1000
    loop = dataclasses.replace(run.loop_eval, max_steps=max(FPRM_TRACE, cap))
    tol = float(loop.tol)
    budgets = [budget_steps(run.model.blocks_per_step(), b) for b in BLOCK_BUDGETS]
    gen = torch.Generator(device=device).manual_seed(0)
    n = len(data)
    protocol = np.zeros(data.inputs.shape, dtype=np.uint8)
    capped = {b: np.zeros(data.inputs.shape, dtype=np.uint8) for b in budgets}
    protocol_steps = np.zeros(n, dtype=np.int64)
    capped_steps = {b: np.zeros(n, dtype=np.int64) for b in budgets}
    converged = np.zeros(n, dtype=bool)
    for index in iter_batches(data, BATCH):
        inputs, _, puzzle_ids = batch_tensors(data, index, device)
        keep = set(range(1, FPRM_TRACE + 1))
        seen, out = _trace_batch(run, inputs, puzzle_ids, loop, keep, gen)
        ran = int(out.loop.residuals.shape[0])
        res = out.loop.residuals.float().cpu().numpy()
        first = _first_converged(res, tol)
        stop = min(ran, cap)  # the batch stopped (all converged / all step sizes tiny) or the cap
        protocol[index] = seen[stop]
        protocol_steps[index] = stop
        converged[index] = res[stop - 1] < tol
        for b in budgets:
            at = np.minimum(np.minimum(first, b), ran)
            rows = np.stack([seen[int(t)][i] for i, t in enumerate(at)])
            capped[b][index] = rows
            capped_steps[b][index] = at
    return {
        "protocol": protocol,
        "protocol_steps": protocol_steps,
        "converged": converged,
        "capped": capped,
        "capped_steps": capped_steps,
    }


@torch.no_grad()
def trace_trm(
    run: Any, data: TokenDataset, device: str = "cpu", max_blocks: int = BLOCK_BUDGETS[-1]
) -> dict[str, Any]:
    """The single TRM (or HRM) pass: predictions after every budget's whole cycles up to ``max_blocks`` blocks per
    puzzle, and after the protocol's cycles (TRM's 48)."""
    protocol = int(run.loop_eval.max_steps)  # 48: 16 segments x 3 cycles as one loop
    per = run.model.blocks_per_step()
    budgets = sorted({budget_steps(per, b) for b in BLOCK_BUDGETS if b <= max_blocks} - {0} | {protocol})
    loop = dataclasses.replace(run.loop_eval, halting="fixed", max_steps=max(budgets), min_steps=0)
    if run.config.eval.segments != 1:
        raise ValueError(
            "the TRM head-to-head evaluates its 16 segments as one loop of 48 cycles (eval.segments 1)"
        )
    gen = torch.Generator(device=device).manual_seed(0)
    preds = {b: np.zeros(data.inputs.shape, dtype=np.uint8) for b in budgets}
    for index in iter_batches(data, BATCH):
        inputs, _, puzzle_ids = batch_tensors(data, index, device)
        seen, _ = _trace_batch(run, inputs, puzzle_ids, loop, set(budgets), gen)
        for b in budgets:
            preds[b][index] = seen[b]
    return {"cycles": preds, "protocol_cycles": protocol}


def _row(task: Any, data: TokenDataset, backtracks: np.ndarray, pred: np.ndarray, steps: np.ndarray,
         per_step: int) -> dict[str, Any]:  # fmt: skip
    valid = _score(task, data.inputs, pred)
    blanks = data.difficulty
    return {
        "valid": float(valid.mean()),
        "valid_bits": _bits(valid),
        "valid_30plus": float(valid[blanks >= 30].mean()),
        "by_blanks": {
            f"{lo}-{hi}": float(valid[(blanks >= lo) & (blanks <= hi)].mean()) for lo, hi in BLANK_BINS
        },
        "needs_search": float(valid[backtracks > 0].mean()) if (backtracks > 0).any() else None,
        "mean_steps": float(steps.mean()),
        "mean_blocks": float(steps.mean()) * per_step,
        "max_blocks": int(steps.max()) * per_step,
    }


def strict_float32() -> None:
    """Full float32 matrix products and convolutions on CUDA (PyTorch lets cuDNN use TF32 by default): the
    CPU-trained seeds ran in float32, and a GPU seed should differ from them by its random draws only."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def evaluate_checkpoint(
    name: str,
    family: str,
    path: Path,
    data: TokenDataset,
    backtracks: np.ndarray,
    extreme: list[str],
    device: str = "cpu",
    max_blocks: int = BLOCK_BUDGETS[-1],
) -> dict[str, Any]:
    """Every number of one checkpoint (module docstring), with the wall time of the pass, on ``device``. A model
    without halting (TRM, HRM) is traced to ``max_blocks`` blocks per puzzle (and its own protocol): the
    controls of issue 46 trace their TRM / HRM arms to 512 blocks, a third to a tenth of the cost."""
    if device != "cpu":
        strict_float32()
    run = load_run(path, use_ema=True, device=device)
    t0, c0 = time.perf_counter(), time.process_time()
    per = run.model.blocks_per_step()
    if family == "fprm":
        tr = trace_fprm(run, data, device)
        protocol = _row(run.task, data, backtracks, tr["protocol"], tr["protocol_steps"], per)
        protocol["converged"] = float(tr["converged"].mean())
        conv = tr["converged"]
        valid = _unbits(protocol["valid_bits"])
        protocol["valid_if_converged"] = float(valid[conv].mean()) if conv.any() else None
        protocol["valid_if_not"] = float(valid[~conv].mean()) if (~conv).any() else None
        stats = steps_vs_difficulty(data.difficulty, tr["capped_steps"][FPRM_TRACE].astype(float), valid)
        protocol["rho_steps_blanks_per_sample"] = stats.spearman_rho
        curve = []
        for blocks in BLOCK_BUDGETS:
            b = budget_steps(per, blocks)
            point = _row(run.task, data, backtracks, tr["capped"][b], tr["capped_steps"][b], per)
            curve.append({"budget_blocks": blocks, "steps": b, "mode": "per-sample halting, capped", **point})
    else:
        tr = trace_trm(run, data, device, max_blocks)
        cycles = np.full(len(data), tr["protocol_cycles"])
        protocol = _row(run.task, data, backtracks, tr["cycles"][tr["protocol_cycles"]], cycles, per)
        protocol["converged"] = None
        curve = []
        for blocks in BLOCK_BUDGETS:
            b = budget_steps(per, blocks)
            if b == 0 or blocks > max_blocks:
                continue
            steps = np.full(len(data), b)
            point = _row(run.task, data, backtracks, tr["cycles"][b], steps, per)
            curve.append({"budget_blocks": blocks, "steps": b, "mode": "exactly b cycles", **point})
    rows = []
    for text in extreme:
        grid = run.task.parse_grid(text)[None].astype(np.int64)
        one = TokenDataset(grid, grid.copy(), np.zeros(1))
        tr1 = trace_fprm(run, one, device) if family == "fprm" else trace_trm(run, one, device, max_blocks)
        pred = tr1["protocol"] if family == "fprm" else tr1["cycles"][tr1["protocol_cycles"]]
        rows.append({
            "valid": bool(run.task.check(grid[0], pred[0])),
            "steps": int(tr1["protocol_steps"][0]) if family == "fprm" else tr1["protocol_cycles"],
            "converged": bool(tr1["converged"][0]) if family == "fprm" else None,
        })  # fmt: skip
    return {
        "model": name,
        "step": run.step,
        "weights": run.weights,
        "parameters": run.model.num_parameters(),
        "blocks_per_step": per,
        "trace_blocks": max_blocks if family != "fprm" else BLOCK_BUDGETS[-1],
        "protocol": protocol,
        "curve": curve,
        "extreme": rows,
        "device": torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu",
        "eval_wall_s": round(time.perf_counter() - t0, 1),
        "eval_cpu_s": round(time.process_time() - c0, 1),
    }


def paired_bootstrap(a: np.ndarray, b: np.ndarray, draws: int = 10_000, seed: int = 0) -> dict[str, float]:
    """Mean of ``a - b`` over puzzles (each a per-puzzle score, e.g. the fraction of seeds that solved it) with a
    95% percentile interval from ``draws`` resamples of the puzzles, and the share of resamples <= 0."""
    rng = np.random.default_rng(seed)
    diff = a.astype(float) - b.astype(float)
    idx = rng.integers(0, len(diff), size=(draws, len(diff)))
    means = diff[idx].mean(1)
    return {
        "mean": float(diff.mean()),
        "low": float(np.percentile(means, 2.5)),
        "high": float(np.percentile(means, 97.5)),
        "p_le_0": float((means <= 0).mean()),
    }


def load_rows(runs: Path, seeds: list[int], names: list[str], minutes: list[int]) -> dict[str, Any]:
    """``{name: {minutes: {seed: row}}}`` of the saved ``eval-h2h-<M>min.json`` files."""
    out: dict[str, Any] = {}
    for name in names:
        for m in minutes:
            for s in seeds:
                path = runs / f"seed{s}" / name / f"eval-h2h-{m}min.json"
                if path.is_file():
                    out.setdefault(name, {}).setdefault(m, {})[s] = json.loads(path.read_text())
    return out


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _mean_range(values: list[float]) -> str:
    if not values:
        return "-"
    lo, hi = min(values), max(values)
    return f"{100 * np.mean(values):.1f}% ({100 * lo:.1f}-{100 * hi:.1f})"


def rows_from_summary(summary: dict[str, Any]) -> dict[str, Any]:
    """``{name: {minutes: {seed: row}}}`` rebuilt from an earlier ``results_h2h.json``'s ``summary``: each seed's
    own-protocol numbers, matched-compute curve and Sudoku-Extreme count, without the per-puzzle validity (the
    summary does not keep it), marked ``from_summary``. For seeds whose run folders (and saved rows) are gone:
    they count in the means, ranges and the sign test, not in the paired bootstrap."""
    out: dict[str, Any] = {}
    for m, entry in summary.items():
        for name, r in entry["models"].items():
            for i, seed in enumerate(r["seeds"]):
                keys = ("valid", "valid_30plus", "needs_search", "converged", "mean_blocks")
                out.setdefault(name, {}).setdefault(int(m), {})[int(seed)] = {
                    "model": name,
                    "seed": int(seed),
                    "minutes": int(m),
                    "step": r["step"],
                    "parameters": r["parameters"],
                    "from_summary": True,
                    "protocol": {k: r[k][i] for k in keys},
                    "curve": [{"budget_blocks": int(b), "valid": v[i]} for b, v in r["curve"].items()],
                    "extreme": [{"valid": k < r["extreme_valid"][i]} for k in range(2)],
                }
    return out


def with_partner_seeds(rows: dict[str, Any], name: str, partner: str) -> dict[str, Any]:
    """``rows`` of ``name`` and of ``partner`` at the (budget, seed) pairs ``name`` has: a comparison of a variant run
    on some seeds (the contraction term) against the model's rows on those seeds only, not on every seed the model
    has (which would move its means without a partner)."""
    own = rows.get(name, {})
    return {
        name: own,
        partner: {
            m: {s: r for s, r in by_seed.items() if s in own.get(m, {})}
            for m, by_seed in rows.get(partner, {}).items()
            if own.get(m)
        },
    }


def has_bits(row: dict[str, Any]) -> bool:
    """Whether a row keeps its per-puzzle validity (a scored row does; one rebuilt from a summary does not)."""
    return "valid_bits" in row["protocol"]


def sign_test(ahead: int, pairs: int) -> float:
    """One-sided sign test across seed pairs: P(at least ``ahead`` of ``pairs`` ahead | no difference)."""
    return float(scipy.stats.binomtest(ahead, pairs, 0.5, alternative="greater").pvalue) if pairs else 1.0


def seed_t_test(differences: list[float]) -> float | None:
    """Two-sided one-sample t-test of the per-seed-pair differences against 0 (None below two pairs, or when
    every difference is the same)."""
    d = np.asarray(differences, dtype=float)
    if len(d) < 2 or np.ptp(d) == 0:
        return None
    return float(scipy.stats.ttest_1samp(d, 0.0).pvalue)


def per_puzzle(rows: dict[int, Any], key: Any = None) -> np.ndarray:
    """The fraction of seeds that solved each puzzle (``key``: a curve point's budget, None = the protocol)."""
    bits = []
    for row in rows.values():
        if key is None:
            bits.append(_unbits(row["protocol"]["valid_bits"]))
        else:
            point = next((p for p in row["curve"] if p["budget_blocks"] == key), None)
            if point is None:
                return np.zeros(0)
            bits.append(_unbits(point["valid_bits"]))
    return np.mean(bits, axis=0)


def summarise(rows: dict[str, Any], fprm: str, trm: str) -> dict[str, Any]:
    """Per budget: each model's mean / range over seeds (own protocol and every matched-compute point) and the
    paired bootstrap of FPRM - TRM at the own protocols and at every block budget both models have."""
    out: dict[str, Any] = {}
    for m in sorted({m for name in rows for m in rows[name]}):
        entry: dict[str, Any] = {"models": {}}
        for name, by_minutes in rows.items():
            seeds = dict(sorted(by_minutes.get(m, {}).items()))  # the lists below follow "seeds"
            if not seeds:
                continue
            proto = [r["protocol"] for r in seeds.values()]
            entry["models"][name] = {
                "seeds": sorted(seeds),
                "parameters": next(iter(seeds.values()))["parameters"],
                "step": next(iter(seeds.values()))["step"],
                "valid": [p["valid"] for p in proto],
                "valid_30plus": [p["valid_30plus"] for p in proto],
                "needs_search": [p["needs_search"] for p in proto],
                "converged": [p["converged"] for p in proto],
                "mean_blocks": [p["mean_blocks"] for p in proto],
                "extreme_valid": [sum(e["valid"] for e in r["extreme"]) for r in seeds.values()],
                "curve": {
                    b: [
                        next(p["valid"] for p in r["curve"] if p["budget_blocks"] == b)
                        for r in seeds.values()
                    ]
                    for b in BLOCK_BUDGETS
                    if all(any(p["budget_blocks"] == b for p in r["curve"]) for r in seeds.values())
                },
            }
        a, b = rows.get(fprm, {}).get(m, {}), rows.get(trm, {}).get(m, {})
        if a and b:
            # the bootstrap needs per-puzzle validity: the seeds scored in both models with it
            common = sorted(set(a) & set(b))
            both = [s for s in common if has_bits(a[s]) and has_bits(b[s])]
            tests = {}
            if both:
                ab, bb = {s: a[s] for s in both}, {s: b[s] for s in both}
                tests["own protocols"] = paired_bootstrap(per_puzzle(ab), per_puzzle(bb))
                for blocks in BLOCK_BUDGETS:
                    pa, pb = per_puzzle(ab, blocks), per_puzzle(bb, blocks)
                    if len(pa) and len(pb):
                        tests[f"{blocks} blocks"] = paired_bootstrap(pa, pb)
            pairs = [(a[s]["protocol"]["valid"], b[s]["protocol"]["valid"]) for s in common]
            ahead = sum(x > y for x, y in pairs)
            entry["fprm_minus_trm"] = tests
            entry["bootstrap_seeds"] = both
            entry["seed_pairs_fprm_ahead"] = f"{ahead} of {len(pairs)}"
            entry["sign_test_p"] = sign_test(ahead, len(pairs))
            entry["seed_differences"] = {str(s): x - y for s, (x, y) in zip(common, pairs)}
            entry["seed_t_test_p"] = seed_t_test([x - y for x, y in pairs])
            points = []  # (seed, blocks, FPRM - TRM) at every matched budget both models have, every seed pair
            for s in common:
                cb = {p["budget_blocks"]: p["valid"] for p in b[s]["curve"]}
                points += [(s, p["budget_blocks"], p["valid"] - cb[p["budget_blocks"]])
                           for p in a[s]["curve"] if p["budget_blocks"] in cb]  # fmt: skip
            if points:
                low = min(points, key=lambda t: t[2])
                entry["matched_points_fprm_ahead"] = f"{sum(d > 0 for _, _, d in points)} of {len(points)}"
                entry["matched_smallest_lead"] = {"seed": low[0], "blocks": low[1], "lead": low[2]}
        out[str(m)] = entry
    return out


def markdown(summary: dict[str, Any], labels: dict[str, str], pair: tuple[str, str] = ("FPRM", "TRM")) -> str:
    """The head-to-head's tables: own protocols per budget (mean and range over seeds), the paired bootstrap, and
    accuracy at matched test-time compute. ``pair``: the names of the two compared models in the headers (the
    summary's first minus its second)."""
    a, b = pair
    head = (
        "| budget (min) | model | parameters | training steps | seeds | valid, own protocol: mean (range) | "
        ">= 30 blanks | needs search | converged | test-time blocks per puzzle | Sudoku-Extreme rows valid |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = [head]
    for m, entry in summary.items():
        for name, r in entry["models"].items():
            conv = [c for c in r["converged"] if c is not None]
            lines.append(
                f"| {m} | {labels.get(name, name)} | {r['parameters']:,} | {r['step']:,} | {len(r['seeds'])} | "
                f"{_mean_range(r['valid'])} | {_mean_range(r['valid_30plus'])} | "
                f"{_mean_range([x for x in r['needs_search'] if x is not None])} | "
                f"{_mean_range(conv) if conv else '-'} | {np.mean(r['mean_blocks']):,.0f} | "
                f"{sum(r['extreme_valid'])} of {2 * len(r['seeds'])} |\n"
            )
    text = "".join(lines)
    text += (
        f"\n{a} - {b} across seed pairs (own protocols; one-sided sign test), and puzzle by puzzle (the fraction "
        "of the bootstrap's seeds solving each puzzle; 10,000 paired bootstrap resamples of the 1,000 puzzles, "
        f"95% interval; only seeds whose rows keep per-puzzle validity):\n\n| budget (min) | seed pairs with {a} "
        f"ahead | {a} - {b} per seed pair (points) | sign test p | t-test p (pairs) | matched-compute points "
        f"(seed x budget) with {a} ahead | smallest lead |\n|---|---|---|---|---|---|---|\n"
    )
    for m, entry in summary.items():
        if "seed_pairs_fprm_ahead" in entry:
            diffs = ", ".join(f"seed {s} {100 * d:+.1f}" for s, d in entry["seed_differences"].items())
            t = entry.get("seed_t_test_p")
            text += (
                f"| {m} | {entry['seed_pairs_fprm_ahead']} | {diffs} | {entry['sign_test_p']:.3f} | "
                f"{'-' if t is None else f'{t:.2g}'} | {entry.get('matched_points_fprm_ahead', '-')} | "
                + (
                    f"{100 * low['lead']:+.1f} (seed {low['seed']}, {low['blocks']} blocks) |\n"
                    if (low := entry.get("matched_smallest_lead"))
                    else "- |\n"
                )
            )
    text += f"\n| budget (min) | bootstrap seeds | comparison | {a} - {b} | 95% interval | resamples <= 0 |\n"
    text += "|---|---|---|---|---|---|\n"
    for m, entry in summary.items():
        seeds = ", ".join(str(s) for s in entry.get("bootstrap_seeds", []))
        for what, t in entry.get("fprm_minus_trm", {}).items():
            text += (
                f"| {m} | {seeds} | {what} | {100 * t['mean']:+.1f} pts | {100 * t['low']:+.1f} .. "
                f"{100 * t['high']:+.1f} | {100 * t['p_le_0']:.1f}% |\n"
            )
    text += "\nValid accuracy at matched test-time compute (blocks per puzzle; mean over seeds, range):\n\n"
    text += "| budget (min) | model | " + " | ".join(str(b) for b in BLOCK_BUDGETS) + " |\n"
    text += "|---|---|" + "---|" * len(BLOCK_BUDGETS) + "\n"
    for m, entry in summary.items():
        for name, r in entry["models"].items():
            cells = [_mean_range(r["curve"][b]) if b in r["curve"] else "-" for b in BLOCK_BUDGETS]
            text += f"| {m} | {labels.get(name, name)} | " + " | ".join(cells) + " |\n"
    return text


def plot(
    summary: dict[str, Any],
    labels: dict[str, str],
    path: Path,
    pyplot: Any,
    save: Any,
    title: str = "FPRM vs TRM at equal training FLOPs",
) -> None:
    """One panel per budget: held-out valid accuracy vs test-time blocks per puzzle (log2), the mean over seeds
    with the seeds' range as a band, each model's own protocol as a star (at its mean blocks per puzzle)."""
    plt = pyplot()
    panels = list(summary.items())
    fig, axes = plt.subplots(1, len(panels), figsize=(max(6.4, 4.2 * len(panels)), 3.8), sharey=True, squeeze=False)
    for ax, (m, entry) in zip(axes[0], panels):
        for i, (name, r) in enumerate(entry["models"].items()):
            xs = sorted(r["curve"])
            ys = np.asarray([r["curve"][b] for b in xs])
            color = f"C{i}"
            ax.plot(
                xs,
                ys.mean(1),
                "-o",
                ms=3,
                color=color,
                label=f"{labels.get(name, name)} (n={len(r['seeds'])})",
            )
            ax.fill_between(xs, ys.min(1), ys.max(1), color=color, alpha=0.2, lw=0)
            ax.plot([np.mean(r["mean_blocks"])], [np.mean(r["valid"])], "*", ms=11, color=color)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("test-time blocks per puzzle")
        ax.set_title(f"{m} min of training (equal FLOPs)", fontsize=9)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("held-out valid accuracy (1,000 puzzles)")
    axes[0][0].set_ylim(-0.02, 1.02)
    axes[0][0].legend(fontsize=6, loc="lower right")
    fig.suptitle(f"9x9 Sudoku at CPU scale: {title}, by test-time compute\n(bands: the seeds' range; stars: each model's own protocol)",
                 fontsize=9)  # fmt: skip
    save(fig, path)


# -- the controls (issue 46): arms by budget, and the comparisons each control isolates ---------------------------


def curriculum_level(metrics: Path, step: int) -> float | None:
    """The training curriculum's level (blanks) at ``step``: the last ``level`` logged at or before it in the
    run's ``metrics.jsonl``; None when the run logs no level (no curriculum: the full 20-60-blank mix)."""
    if not metrics.is_file():
        return None
    level = None
    for line in metrics.read_text().splitlines():
        record = json.loads(line)
        if record.get("step", 0) > step:
            break
        level = record.get("level", level)
    return level


def arms_summary(rows: dict[str, Any], runs: Path) -> dict[str, Any]:
    """``{arm: {minutes: {...}}}``: each arm's seeds, own-protocol accuracy per seed, test-time blocks per puzzle
    and curriculum level at the checkpoint (from each seed's ``metrics.jsonl``)."""
    out: dict[str, Any] = {}
    for name, by_minutes in rows.items():
        for m, by_seed in sorted(by_minutes.items()):
            seeds = sorted(by_seed)
            out.setdefault(name, {})[str(m)] = {
                "seeds": seeds,
                "step": by_seed[seeds[0]]["step"],
                "parameters": by_seed[seeds[0]]["parameters"],
                "valid": [by_seed[s]["protocol"]["valid"] for s in seeds],
                "mean_blocks": [by_seed[s]["protocol"]["mean_blocks"] for s in seeds],
                "level": [
                    curriculum_level(runs / f"seed{s}" / name / "metrics.jsonl", by_seed[s]["step"]) for s in seeds
                ],
            }
    return out


def _levels(levels: list[float | None]) -> str:
    known = sorted({int(v) for v in levels if v is not None})
    if not known:
        return "none (20-60)"
    return "/".join(str(v) for v in known) + (" + none" if None in levels else "")


def arms_markdown(arms: dict[str, Any], labels: dict[str, str], minutes: list[int]) -> str:
    """Arms (rows) by training budget (columns): own-protocol valid accuracy, mean (range) over seeds, the seeds,
    the curriculum's level at the checkpoint, and test-time blocks per puzzle."""
    head = "| arm | " + " | ".join(f"{m} min: valid (range) [seeds] level, blocks" for m in minutes) + " |\n"
    text = head + "|---|" + "---|" * len(minutes) + "\n"
    for name, by_m in arms.items():
        cells = []
        for m in minutes:
            r = by_m.get(str(m))
            if r is None:
                cells.append("-")
                continue
            seeds = ",".join(str(s) for s in r["seeds"])
            cells.append(
                f"{_mean_range(r['valid'])} [{seeds}] {_levels(r['level'])}, {np.mean(r['mean_blocks']):,.0f}"
            )
        text += f"| {labels.get(name, name)} | " + " | ".join(cells) + " |\n"
    return text


def by_blanks_gap(a: dict[int, Any], b: dict[int, Any], blanks: np.ndarray) -> dict[str, Any]:
    """Where the gap between two arms' own-protocol accuracy lies, by blanks (the seeds both have; ``blanks``: the
    held-out puzzles' blank counts): per bin, each arm's mean accuracy and the bin's share of the whole gap (its
    accuracy difference weighted by its share of the puzzles)."""
    common = sorted(set(a) & set(b))
    if not common:
        return {}
    gap = float(np.mean([a[s]["protocol"]["valid"] - b[s]["protocol"]["valid"] for s in common]))
    bins: dict[str, Any] = {}
    for lo, hi in BLANK_BINS:
        key = f"{lo}-{hi}"
        va = float(np.mean([a[s]["protocol"]["by_blanks"][key] for s in common]))
        vb = float(np.mean([b[s]["protocol"]["by_blanks"][key] for s in common]))
        weight = float(((blanks >= lo) & (blanks <= hi)).mean())
        bins[key] = {"a": va, "b": vb, "share_of_gap": weight * (va - vb) / gap if gap else None}
    return {"seeds": common, "gap": gap, "bins": bins}
