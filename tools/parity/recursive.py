"""Fixture builder shared by ``tools/parity/trm.py`` and ``tools/parity/hrm.py``.

TRM (SamsungSAILMontreal/TinyRecursiveModels) and HRM (sapientinc/HRM) share their layers
(``models/layers.py``), loss head (``models/losses.py: ACTLossHead``) and sparse puzzle embedding
(``models/sparse_embedding.py``). For a tiny model built from the reference code this writes:

- ``<name>_checkpoint.pt``: ``torch.save(loss_head.state_dict())``, the file ``pretrain.py:
  save_train_state`` writes (what ``loopformer convert`` reads);
- ``<name>.safetensors`` + ``.json``: the input batch, the logits and Q logits after every segment of
  the reference's evaluation procedure (``pretrain.py: evaluate``: eval mode, ``initial_carry``, call
  the loss head until every sequence halted, i.e. ``halt_max_steps`` segments), the first training
  segment's loss as ``pretrain.py: train_batch`` backpropagates it (``loss / global_batch_size``),
  every parameter's gradient norm (the puzzle embedding's as the sign-SGD optimiser sees it: the
  per-id sums of ``local_weights.grad``), and every tensor after one optimiser step.

Substitutions (CPU, float64; named in the fixture's ``substitutions``):
- ``models.layers.rms_norm`` upcasts to float32; here it computes the same formula in the input dtype.
- ``forward_dtype="float64"`` instead of bfloat16.
- ``adam_atan2.AdamATan2`` is a CUDA kernel; its update is written out below (``adam_atan2_step``,
  the formula of the package's own reference implementation in its tests).
- flash-attn (HRM ``models/layers.py``) is replaced by ``F.scaled_dot_product_attention`` on the
  [B, H, S, D] layout (TRM's code already uses it).
"""

from __future__ import annotations

import math
import sys
import types
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import yaml
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from common import TINY_OPT, git_commit

from loopformer.convert.fixtures import save_fixture

SUBSTITUTIONS = [
    "models.layers.rms_norm computes in the input dtype (float64) instead of upcasting to float32",
    "forward_dtype float64 instead of bfloat16",
    "adam_atan2.AdamATan2 (CUDA kernel) replaced by its formula: p*=1-lr*wd; m=lerp(m,g,1-b1); "
    "v=b2*v+(1-b2)*g^2; p-=lr/(1-b1^t)*atan2(m, sqrt(v)/sqrt(1-b2^t))",
    "flash_attn_func replaced by F.scaled_dot_product_attention (TRM already uses it)",
]


def rms_norm_in_dtype(hidden_states: Tensor, variance_epsilon: float) -> Tensor:
    variance = hidden_states.square().mean(-1, keepdim=True)
    return hidden_states * torch.rsqrt(variance + variance_epsilon)


def flash_attn_sdpa(q: Tensor, k: Tensor, v: Tensor, causal: bool = False) -> Tensor:
    """flash_attn_func's [B, S, H, D] interface on top of SDPA."""
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal
    )
    return out.transpose(1, 2)


def install_stubs() -> None:
    """Modules the reference imports but the fixture must not need (flash-attn: GPU only)."""
    for name in ("flash_attn_interface", "flash_attn"):
        mod = types.ModuleType(name)
        mod.flash_attn_func = flash_attn_sdpa  # type: ignore[attr-defined]
        sys.modules[name] = mod


def patch_rms_norm(*modules: types.ModuleType) -> None:
    for mod in modules:
        mod.rms_norm = rms_norm_in_dtype  # type: ignore[attr-defined]


def adam_atan2_step(p: Tensor, g: Tensor, state: dict, lr: float, wd: float, b1: float, b2: float) -> None:
    if not state:
        state.update(step=0, m=torch.zeros_like(p), v=torch.zeros_like(p))
    state["step"] += 1
    t = state["step"]
    p.mul_(1 - lr * wd)
    state["m"].lerp_(g, 1 - b1)
    state["v"].mul_(b2).addcmul_(g, g, value=1 - b2)
    p.add_(torch.atan2(state["m"], state["v"].sqrt() / math.sqrt(1 - b2**t)), alpha=-lr / (1 - b1**t))


def batch_for(cfg: dict[str, Any], seed: int) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    B, T, V = cfg["batch_size"], cfg["seq_len"], cfg["vocab_size"]
    inputs = torch.randint(1, V, (B, T), generator=g, dtype=torch.int32)
    labels = torch.randint(1, V, (B, T), generator=g, dtype=torch.int32)
    labels[:, : T // 4] = -100  # some positions carry no label
    labels[0] = inputs[0]  # one row right after a copy, so exact-match targets vary
    labels[0, : T // 4] = -100
    ids = torch.arange(B, dtype=torch.int32) % cfg["num_puzzle_identifiers"]
    return {"inputs": inputs, "labels": labels, "puzzle_identifiers": ids}


def evaluate(head: torch.nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """pretrain.py evaluate: segments until all_finish; logits / q_halt / q_continue per segment."""
    head.eval()
    logits, q_halt, q_cont = [], [], []
    with torch.inference_mode():
        carry = head.initial_carry(batch)
        while True:
            carry, _, _, preds, all_finish = head(
                carry=carry, batch=batch, return_keys=["logits", "q_halt_logits", "q_continue_logits"]
            )
            logits.append(preds["logits"])
            q_halt.append(preds["q_halt_logits"])
            q_cont.append(preds["q_continue_logits"])
            if all_finish:
                break
    return torch.stack(logits), torch.stack(q_halt), torch.stack(q_cont)


def train_step(head: torch.nn.Module, batch: dict[str, Tensor], opt: dict[str, float]) -> dict[str, Tensor]:
    """pretrain.py train_batch for one segment: loss / B backward, sign-SGD + AdamATan2 step."""
    from models.sparse_embedding import CastedSparseEmbeddingSignSGD_Distributed

    head.train()
    out: dict[str, Tensor] = {}
    carry = head.initial_carry(batch)
    carry, loss, metrics, _, _ = head(carry=carry, batch=batch, return_keys=[])
    B = batch["inputs"].shape[0]
    ((1 / B) * loss).backward()
    out["train.loss"] = (loss / B).detach().reshape(1)
    out["train.lm_loss"] = (metrics["lm_loss"] / B).reshape(1)
    out["train.q_halt_loss"] = (metrics["q_halt_loss"] / B).reshape(1)
    if "q_continue_loss" in metrics:
        out["train.q_continue_loss"] = (metrics["q_continue_loss"] / B).reshape(1)
    out["train.halted"] = carry.halted.to(torch.int64)
    inner = head.model.inner
    for name, p in head.named_parameters():
        out[f"grad_norm.{name}"] = torch.linalg.vector_norm(p.grad).reshape(1)
    if hasattr(inner, "puzzle_emb"):
        emb = inner.puzzle_emb
        ids, inv = emb.local_ids.unique(return_inverse=True)
        g = torch.zeros(ids.shape[0], emb.local_weights.shape[1], dtype=emb.local_weights.grad.dtype)
        g.scatter_add_(0, inv.unsqueeze(-1).expand(-1, g.shape[1]), emb.local_weights.grad)
        out["grad_norm.puzzle_emb"] = torch.linalg.vector_norm(g).reshape(1)
        sgd = CastedSparseEmbeddingSignSGD_Distributed(
            emb.buffers(), world_size=1, lr=opt["puzzle_emb_lr"], weight_decay=opt["puzzle_emb_weight_decay"]
        )
        sgd.step()
    with torch.no_grad():
        for p in head.parameters():
            adam_atan2_step(p, p.grad, {}, opt["lr"], opt["weight_decay"], opt["beta1"], opt["beta2"])
    for name, t in head.state_dict().items():
        if t.dtype.is_floating_point:
            out[f"step.{name}"] = t.detach().clone()
    return out


def to_float64(head: torch.nn.Module) -> torch.nn.Module:
    """``head.double()``, then a fresh leaf ``local_weights`` (converting the buffer made it a non-leaf
    whose ``.grad`` is never filled; the reference creates it as a float leaf with requires_grad)."""
    head = head.double()
    inner = head.model.inner
    if hasattr(inner, "puzzle_emb"):
        lw = inner.puzzle_emb.local_weights
        inner.puzzle_emb.local_weights = torch.nn.Buffer(
            torch.zeros(lw.shape, dtype=torch.float64, requires_grad=True), persistent=False
        )
    return head


# the shape of the tiny TRM and HRM fixture models (each script adds its cycles, layers and positions)
TINY = dict(
    batch_size=4,
    seq_len=16,
    vocab_size=6,
    num_puzzle_identifiers=3,
    hidden_size=16,
    expansion=4,
    num_heads=2,
    halt_max_steps=3,
    halt_exploration_prob=0.5,
    forward_dtype="float64",
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
)


def build_reference_fixtures(
    root: Path, out: Path, repo: str, system: str, module: str, cls: str, configs: dict[str, tuple[int, dict]]
) -> list[str]:
    """For every ``name: (seed, cfg)``: the reference's ``models.<module>.<cls>(cfg)`` built after
    ``torch.manual_seed(seed)``, in its ``ACTLossHead`` (stablemax) in float64 -> that fixture's files."""
    import importlib

    install_stubs()
    layers = importlib.import_module("models.layers")
    losses = importlib.import_module("models.losses")
    model_module = importlib.import_module(f"models.{module}")
    patch_rms_norm(layers, model_module)
    meta = {
        "repo": repo,
        "commit": git_commit(root),
        "model": f"models/{module.replace('.', '/')}.py: {cls}",
        "system": system,
        "model_name": f"{module}@{cls}",
    }
    written = []
    for name, (seed, cfg) in configs.items():
        torch.manual_seed(seed)
        model = getattr(model_module, cls)(cfg)
        head = to_float64(losses.ACTLossHead(model, loss_type="stablemax_cross_entropy"))
        written += build_fixture(head, cfg, out, name, meta, TINY_OPT)
    return written


def build_fixture(
    head: torch.nn.Module,
    cfg: dict[str, Any],
    out_dir: Path,
    name: str,
    meta: dict[str, Any],
    opt: dict[str, float],
) -> list[str]:
    folder = out_dir / name  # the reference's layout: checkpoints/<run>/step_N + all_config.yaml
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().clone() for k, v in head.state_dict().items()}
    ckpt = folder / "step_1"
    torch.save(state, ckpt)
    (folder / "all_config.yaml").write_text(yaml.safe_dump(pretrain_config(cfg, opt, meta), sort_keys=True))
    batch = batch_for(cfg, seed=1)
    tensors: dict[str, Tensor] = {f"batch.{k}": v.clone() for k, v in batch.items()}
    logits, q_halt, q_cont = evaluate(head, batch)
    tensors.update({"eval.logits": logits, "eval.q_halt": q_halt, "eval.q_continue": q_cont})
    torch.manual_seed(2)  # the exploration draws of the training segment
    tensors.update(train_step(head, batch, opt))
    save_fixture(
        out_dir,
        name,
        tensors,
        {
            **meta,
            "config": cfg,
            "optimizer": opt,
            "substitutions": SUBSTITUTIONS,
            "checkpoint": f"{name}/step_1",
            "dtype": "float64",
        },
    )
    return [f"{name}.safetensors", f"{name}.json", f"{name}/step_1", f"{name}/all_config.yaml"]


def pretrain_config(cfg: dict[str, Any], opt: dict[str, float], meta: dict[str, Any]) -> dict[str, Any]:
    """The fields of pretrain.py's PretrainConfig dump (all_config.yaml) for this tiny model. ``arch``
    also records seq_len / vocab_size / num_puzzle_identifiers (pretrain.py takes them from the data)."""
    arch = {k: v for k, v in cfg.items() if k != "batch_size"}
    arch.update(
        name=meta["model_name"], loss={"name": "losses@ACTLossHead", "loss_type": "stablemax_cross_entropy"}
    )
    return {
        "arch": arch,
        "data_paths": ["data/sudoku-4x4-parity"],
        "global_batch_size": cfg["batch_size"],
        "epochs": 1,
        "lr": opt["lr"],
        "lr_min_ratio": 1.0,
        "lr_warmup_steps": 0,
        "beta1": opt["beta1"],
        "beta2": opt["beta2"],
        "weight_decay": opt["weight_decay"],
        "puzzle_emb_lr": opt["puzzle_emb_lr"],
        "puzzle_emb_weight_decay": opt["puzzle_emb_weight_decay"],
        "seed": 0,
        "ema": False,
        "ema_rate": 0.999,
    }
