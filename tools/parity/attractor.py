"""Parity fixtures for the Attractor puzzle model ("TRM-DEQ", github jacobfa/Attractor).

Imports ``experiments/attractor_puzzles/trm/trm_deq.py`` (``TRMDEQ``) and ``losses_deq.py``
(``ACTLossHeadDEQ``) from a checkout of the reference (``--ref``), builds a tiny model in float64 on CPU
and writes ``tests/fixtures/parity/attractor_puzzle*``: the state dict as ``train_trm_deq.py`` would
hold it (``<name>/step_1``) and its configuration (``<name>/all_config.yaml``: ``model_config`` +
``train_config``), the input batch, the logits and Q logits after every segment of the reference's
evaluation (``train_trm_deq._eval``: eval mode, ``initial_carry``, ``halt_max_steps`` segments), the
first training segment's loss as ``_train_step`` backpropagates it (``loss / global_batch_size``) with
its parts (lm loss, Q BCE, Jacobian regulariser), the Hutchinson probe ``v`` the regulariser drew, every
parameter's gradient norm, the inner solve's iterates, and every tensor after one optimiser step
(``_build_optimizers``: AdamW over every parameter + sign-SGD on the puzzle embedding, at the base rates).

Substitutions (also in each fixture's JSON):
- ``layers.rms_norm`` computes in the input dtype (float64) instead of upcasting to float32;
  ``forward_dtype`` float64 instead of bfloat16 (``tools/parity/recursive.py``, as for TRM).
- ``_anderson_solve`` runs in float32 whatever the model's dtype (the reference's own choice, not
  substituted): its iterates are rounded to float32, loopformer's solve runs in float64.
- two fixtures: ``attractor_puzzle`` (``deq_max_iter`` 3: the solve mixes the two warm-up iterates
  once) and ``attractor_puzzle_deq6`` (6: from the 4th evaluation on, the reference's history buffer,
  ``torch.roll`` over m slots read from the front, mixes never-written zero slots into the Anderson
  step; loopformer reproduces it with the ``anderson_trmdeq`` solver plug-in).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import yaml
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import TINY_OPT, main
from recursive import batch_for, evaluate, rms_norm_in_dtype, to_float64

from loopformer.convert.fixtures import save_fixture

COMMIT = "fcf045f9fb9d458f9e1574bd4036cd2fb63b3697"
SUBSTITUTIONS = [
    "layers.rms_norm computes in the input dtype (float64) instead of upcasting to float32",
    "forward_dtype float64 instead of bfloat16",
    "none for _anderson_solve: it runs in float32 as in the reference (loopformer's solve: float64)",
    "_train_step / _eval / the solver iterates are the reference's procedures written out at one segment",
]
TINY: dict[str, Any] = dict(
    batch_size=4,
    seq_len=16,
    vocab_size=6,
    num_puzzle_identifiers=3,
    puzzle_emb_ndim=16,
    puzzle_emb_len=2,
    H_cycles=2,
    L_cycles=2,
    H_layers=0,
    L_layers=2,
    hidden_size=16,
    expansion=4.0,
    num_heads=2,
    pos_encodings="rope",
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    halt_max_steps=2,
    halt_exploration_prob=0.1,
    forward_dtype="float64",
    mlp_t=False,
    no_ACT_continue=True,
    deq_inner=True,
    deq_max_iter=3,
    deq_min_iter=2,
    deq_tol=1e-12,
    deq_anderson_m=5,
    deq_anderson_beta=1.0,
    bptt_through=2,
    jacobian_reg_lambda=0.5,
    jacobian_reg_n_samples=1,
)
OPT = TINY_OPT


def _import(root: Path) -> tuple[Any, Any, Any]:
    import importlib

    pkg = "experiments.attractor_puzzles.trm"
    layers = importlib.import_module(f"{pkg}.layers")
    trm = importlib.import_module(f"{pkg}.trm")
    deq = importlib.import_module(f"{pkg}.trm_deq")
    for mod in (layers, trm, deq):
        mod.rms_norm = rms_norm_in_dtype  # type: ignore[attr-defined]
    losses = importlib.import_module(f"{pkg}.losses_deq")
    sparse = importlib.import_module(f"{pkg}.sparse_embedding")
    return deq, losses, sparse


def _train_step(head: Any, sparse: Any, batch: dict[str, Tensor]) -> dict[str, Tensor]:
    """train_trm_deq._train_step for one segment, recording the Jacobian probes and the inner iterates."""
    out: dict[str, Tensor] = {}
    probes: list[Tensor] = []
    randn_like = torch.randn_like

    def recording(t: Tensor, *a: Any, **kw: Any) -> Tensor:
        r = randn_like(t, *a, **kw)
        probes.append(r.detach().clone())
        return r

    head.train()
    carry = head.initial_carry(batch)
    torch.randn_like = recording  # type: ignore[assignment]
    try:
        carry, loss, metrics, _, _ = head(carry=carry, batch=batch, return_keys=[])
    finally:
        torch.randn_like = randn_like  # type: ignore[assignment]
    B = batch["inputs"].shape[0]
    ((1 / B) * loss).backward()
    d = TINY["hidden_size"]
    out["train.jacobian_probe"] = probes[-1] / d**0.5  # the differentiable cycle's v = randn / sqrt(d)
    out["train.loss"] = (loss / B).detach().reshape(1)
    out["train.lm_loss"] = (metrics["lm_loss"] / B).reshape(1)
    out["train.q_halt_loss"] = (metrics["q_halt_loss"] / B).reshape(1)
    out["train.jacobian_reg"] = metrics["jacobian_reg"].reshape(1)
    inner = head.model.inner
    for name, p in head.named_parameters():
        out[f"grad_norm.{name}"] = torch.linalg.vector_norm(p.grad).reshape(1)
    emb = inner.puzzle_emb
    ids, inv = emb.local_ids.unique(return_inverse=True)
    g = torch.zeros(ids.shape[0], emb.local_weights.shape[1], dtype=emb.local_weights.grad.dtype)
    g.scatter_add_(0, inv.unsqueeze(-1).expand(-1, g.shape[1]), emb.local_weights.grad)
    out["grad_norm.puzzle_emb"] = torch.linalg.vector_norm(g).reshape(1)
    sparse.CastedSparseEmbeddingSignSGD_Distributed(
        emb.buffers(), world_size=1, lr=OPT["puzzle_emb_lr"], weight_decay=OPT["puzzle_emb_weight_decay"]
    ).step()
    adamw = torch.optim.AdamW(
        head.parameters(),
        lr=OPT["lr"],
        weight_decay=OPT["weight_decay"],
        betas=(OPT["beta1"], OPT["beta2"]),
        fused=False,
    )
    adamw.step()
    for name, t in head.state_dict().items():
        if t.dtype.is_floating_point:
            out[f"step.{name}"] = t.detach().clone()
    return out


def _inner_iterates(deq: Any, head: Any, batch: dict[str, Tensor], cfg: dict[str, Any]) -> Tensor:
    """The solver iterates of the first inner solve (fresh carry): y0, then each returned candidate."""
    inner = head.model.inner
    x = inner._input_embeddings(batch["inputs"], batch["puzzle_identifiers"])
    B, L, d = x.shape
    z_h, z_l = inner.H_init.expand(B, L, d), inner.L_init.expand(B, L, d)
    seq = dict(cos_sin=inner.rotary_emb())
    seen: list[Tensor] = []

    def fmap(z: Tensor) -> Tensor:
        seen.append(z.detach().clone())
        return inner.L_level(z, z_h + x, **seq)

    with torch.no_grad():
        z_star, _ = deq._anderson_solve(
            fmap,
            z_l,
            max_iter=cfg["deq_max_iter"],
            tol=cfg["deq_tol"],
            min_iter=cfg["deq_min_iter"],
            m=cfg["deq_anderson_m"],
            beta=cfg["deq_anderson_beta"],
        )
    return torch.stack([*seen, z_star.to(seen[0].dtype)])


def build_one(ref_root: Path, out_dir: Path, name: str, cfg: dict[str, Any]) -> list[str]:
    deq, losses, sparse = _import(ref_root)
    torch.manual_seed(0)
    model = deq.TRMDEQ(dict(cfg))
    head = losses.ACTLossHeadDEQ(
        model, loss_type="stablemax_cross_entropy", jacobian_reg_lambda=cfg["jacobian_reg_lambda"]
    )
    head = to_float64(head)
    folder = out_dir / name
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({k: v.detach().clone() for k, v in head.state_dict().items()}, folder / "step_1")
    train_config = {
        "global_batch_size": cfg["batch_size"],
        "lr": OPT["lr"],
        "lr_min_ratio": 1.0,
        "lr_warmup_steps": 0,
        "beta1": OPT["beta1"],
        "beta2": OPT["beta2"],
        "weight_decay": OPT["weight_decay"],
        "puzzle_emb_lr": OPT["puzzle_emb_lr"],
        "puzzle_emb_weight_decay": OPT["puzzle_emb_weight_decay"],
        "ema": False,
        "data_dir": "data/sudoku-4x4-parity",
    }
    (folder / "all_config.yaml").write_text(
        yaml.safe_dump({"model_config": dict(cfg), "train_config": train_config}, sort_keys=True)
    )
    batch = batch_for(cfg, seed=1)
    tensors: dict[str, Tensor] = {f"batch.{k}": v.clone() for k, v in batch.items()}
    logits, q_halt, q_cont = evaluate(head, batch)
    tensors.update({"eval.logits": logits, "eval.q_halt": q_halt, "eval.q_continue": q_cont})
    tensors["solver.iterates"] = _inner_iterates(deq, head, batch, cfg)
    torch.manual_seed(2)  # the exploration and Jacobian-probe draws of the training segment
    tensors.update(_train_step(head, sparse, batch))
    meta = {
        "repository": "jacobfa/Attractor",
        "commit": COMMIT,
        "model": "experiments/attractor_puzzles/trm/trm_deq.py:TRMDEQ",
        "config": cfg,
        "optimizer": OPT,
        "substitutions": SUBSTITUTIONS,
        "checkpoint": f"{name}/step_1",
        "dtype": "float64",
    }
    save_fixture(out_dir, name, tensors, meta)
    return [f"{name}.safetensors", f"{name}.json", f"{name}/step_1", f"{name}/all_config.yaml"]


def build(ref_root: Path, out_dir: Path) -> list[str]:
    # deq_max_iter 3: both Anderson forms agree; 6: the reference's rolled history (zero slots) is in play
    return [
        *build_one(ref_root, out_dir, "attractor_puzzle", TINY),
        *build_one(
            ref_root, out_dir, "attractor_puzzle_deq6", {**TINY, "deq_max_iter": 6, "deq_min_iter": 4}
        ),
    ]


if __name__ == "__main__":
    main(build, __doc__.splitlines()[0])
