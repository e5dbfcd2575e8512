"""Signal propagation at initialisation: state RMS over many loops (arXiv 2606.18206).

FPRM's claim: a looped pre-norm block without residual scaling lets activations grow without
bound, post-norm keeps them bounded (at the price of poor signal propagation), and pre-norm with
FPRM's tied residual scaling (``h <- a2 h + b2 x``, ``h <- a1 h + b1 S(RMSNorm(h))``) keeps them
bounded for any 0 < a1, a2 < 1.

Three variants with identical weights (same seed, same construction order), the same input
embedding ``x`` and the same initial state ``h0`` (truncated normal, std 1), looped by the engine
(``run_loop``, Picard, fixed halting, no gradient):
- ``pre-norm``: ``h <- Block_pre(h + x)`` (``RecurrentDepth``, additive re-injection, unscaled);
- ``post-norm``: ``h <- Block_post(h + x)``;
- ``fprm a1/a2``: ``FPRM.step`` with fixed scalars, for several (a1, a2).

Also recorded: the mean cosine similarity between the final states of different tokens (1 means
every token carries the same vector: the signal about the input has collapsed).

Usage: ``python experiments/signal_propagation.py --out docs/figures [--loops 1000]`` writes
``signal_propagation.png`` and ``signal_propagation.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from loopformer.loop import LoopConfig, run_loop
from loopformer.models.base import LoopedModel
from loopformer.models.fprm import FPRM, FPRMConfig
from loopformer.models.recurrent import RecurrentConfig, RecurrentDepth
from loopformer.nn import trunc_normal_state

FPRM_SCALARS = ((0.1, 0.9), (0.5, 0.5), (0.75, 0.25), (0.95, 0.95))


def build_variants(
    d_model: int = 32, n_heads: int = 2, n_layers: int = 2, seq_len: int = 16, vocab: int = 11, seed: int = 0,
    fprm_scalars: tuple[tuple[float, float], ...] = FPRM_SCALARS,
) -> dict[str, LoopedModel]:
    common = dict(vocab_size=vocab, seq_len=seq_len, d_model=d_model, n_heads=n_heads, n_layers=n_layers)
    variants: dict[str, LoopedModel] = {}
    for norm in ("pre", "post"):
        torch.manual_seed(seed)
        cfg = RecurrentConfig(**common, injection="add", norm=norm, out_init_scale=1.0)  # type: ignore[arg-type]
        variants[f"{norm}-norm"] = RecurrentDepth(cfg)
    for a1, a2 in fprm_scalars:
        torch.manual_seed(seed)
        cfg = FPRMConfig(**common, scalars="fixed", a1_init=a1, a2_init=a2)  # type: ignore[arg-type]
        variants[f"fprm a1={a1} a2={a2}"] = FPRM(cfg)
    return variants


@torch.no_grad()
def state_rms_over_loops(
    model: LoopedModel, inputs: torch.Tensor, loops: int, seed: int = 0
) -> tuple[list[float], float]:
    """RMS of the whole state after each of ``loops`` engine steps, and the final mean token cosine."""
    model.eval()
    ctx = model.embed(inputs)
    x = ctx[0]
    h0 = trunc_normal_state(tuple(x.shape), 1.0, dtype=x.dtype, generator=torch.Generator().manual_seed(seed))
    rms: list[float] = []

    def record(t: int, z: torch.Tensor, active: torch.Tensor) -> None:
        rms.append(float(z.pow(2).mean().sqrt()))

    cfg = LoopConfig(solver="picard", halting="fixed", max_steps=loops, grad="bptt", diverge_threshold=1e30)
    res = run_loop(model.step, h0, cfg, ctx=ctx, callback=record)
    z = torch.nn.functional.normalize(res.state, dim=-1)
    cos = z @ z.transpose(1, 2)  # [B, T, T]
    T = cos.shape[-1]
    mean_cos = float((cos.sum((1, 2)) - T).mean() / (T * (T - 1)))
    return rms, mean_cos


def run(loops: int = 1000, seed: int = 0, batch: int = 4, **sizes: int) -> dict[str, dict[str, object]]:
    variants = build_variants(seed=seed, **sizes)
    any_model = next(iter(variants.values()))
    cfg = any_model.config
    inputs = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=torch.Generator().manual_seed(seed))
    out: dict[str, dict[str, object]] = {}
    for name, model in variants.items():
        rms, cos = state_rms_over_loops(model, inputs, loops, seed)
        out[name] = {"rms": rms, "final_token_cosine": cos}
    return out


def plot(results: dict[str, dict[str, object]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, r in results.items():
        rms = r["rms"]
        style = "-" if name.startswith("fprm") else "--"
        ax.plot(range(1, len(rms) + 1), rms, style, label=name, linewidth=1.5)  # type: ignore[arg-type]
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("loop")
    ax.set_ylabel("state RMS")
    ax.set_title("Looped block at initialisation: state RMS vs loops")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("docs/figures"))
    parser.add_argument("--loops", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--d-model", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = run(loops=args.loops, seed=args.seed, d_model=args.d_model)
    args.out.mkdir(parents=True, exist_ok=True)
    plot(results, args.out / "signal_propagation.png")
    summary = {
        name: {
            "rms_at_1": r["rms"][0],  # type: ignore[index]
            "rms_at_10": r["rms"][9],  # type: ignore[index]
            "rms_at_100": r["rms"][99] if args.loops >= 100 else None,  # type: ignore[index]
            f"rms_at_{args.loops}": r["rms"][-1],  # type: ignore[index]
            "max_rms": max(r["rms"]),  # type: ignore[arg-type]
            "final_token_cosine": r["final_token_cosine"],
        }
        for name, r in results.items()
    }
    curves = {name: [float(f"{v:.5g}") for v in r["rms"]] for name, r in results.items()}  # type: ignore[union-attr]
    payload = {"loops": args.loops, "seed": args.seed, "d_model": args.d_model, "summary": summary, "rms": curves}
    (args.out / "signal_propagation.json").write_text(json.dumps(payload, indent=1) + "\n")
    for name, s in summary.items():
        print(f"{name:24s} " + " ".join(f"{k}={v:.4g}" for k, v in s.items() if v is not None))


if __name__ == "__main__":
    main()
