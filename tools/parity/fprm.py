"""FPRM parity fixtures from the authors' code (nilskiKonjIzDunava/fprm).

    python tools/parity/fprm.py --ref /path/to/fprm [--out tests/fixtures/parity/] [--check]

Builds the reference ``FixedPointReasoningModel_ACTV1`` (``models/fixed_point_reasoning/fprm.py``)
wrapped in its ``ACTLossHead`` (``models/losses.py``) at a tiny size on CPU in float64, for two
configurations shaped like the authors' task configs: ``fprm_sudoku`` (``config/cfg_pretrain_sudoku.yaml``:
2-D conv kernel 3 over a grid, no iterate norm) and ``fprm_maze`` (``config/cfg_pretrain_maze.yaml``:
causal 1-D conv kernel 4, ``norm_placement: output``). Each fixture holds:

- ``weights.*``: the inner model's state dict (weights randomised beyond the authors' init where
  their init would hide a mapping error: the Q-head weight, the puzzle table, the residual logits);
- ``batch.*``: inputs, labels (a few ignored positions), puzzle identifiers;
- ``train.*``: one deep-supervision training segment from its initial iterate ``train.y0``
  (``n_backwards_L`` damped steps with gradient): the iterate / residual / step-size / patience
  sequence, logits, Q logits, the loss ``masked_full_loss / batch`` as ``pretrain.train_batch``
  scales it, every parameter's gradient (``grad.*``) and norm (``grad_norm.*``), the halted flags;
- ``step.*``: the parameters after one AdamW step (``create_model._build_dense_optimizer``'s
  two groups) and the puzzle table after one ``CastedSparseEmbeddingSignSGD_Distributed`` step, at
  fixed learning rates;
- ``seg2.*``: the next segment with the updated weights: the reference carries each running
  sample's iterate *and* damped-solver state (step size, patience, best residual) and resets only
  the halted samples (``FixedPointOptimizer.reset``), drawing ``seg2.y0`` for them;
- ``eval.*``: the reference's full inference procedure (``pretrain.evaluate``): one damped step per
  forward call with the eval decay, until the whole batch's largest residual is below ``fp_thresh``
  (or every step size below 1e-3, or ``max_iter_eval`` calls): initial iterate, per-step residuals
  and step sizes, the number of steps, the final iterate and logits.

Substitutions (also written to each fixture's JSON):
- ``models/common.py`` and ``models/sparse_embedding.py`` are imported by the FPRM code but absent
  from the stored repository; they are taken from the TinyRecursiveModels checkout FPRM derives from
  (``$LOOPFORMER_TRM_REF``, default ``<ref>/../TinyRecursiveModels``).
- ``forward_dtype: float64`` and float64 default dtype (the authors run bfloat16 autocast on CUDA);
  for float64 inputs the reference's ``rms_norm`` and ``apply_rotary_pos_emb`` evaluate their
  formulas in float64 instead of casting to float32 (``_float64_precision``; the rotary tables keep
  their float32 values, as loopformer's do).
- No ``torch.compile`` (the model is built directly, not through ``create_model``); no flash-attn is
  needed (their ``Attention`` already calls ``F.scaled_dot_product_attention``).
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path
from typing import Any

import torch

Tensor = torch.Tensor
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import main  # noqa: E402

from loopformer.convert.fixtures import save_fixture  # noqa: E402

REPO = "nilskiKonjIzDunava/fprm"
COMMIT = "9e0ebf350df152aacbd40a228fe4693f22294644 (fprm_config.py, model_utils.py, config/*.yaml: 68e118cd6a4424033590844278965a71c5661d08)"
TRM_COMMIT = "e7b68717f0a6c4cbb4ce6fbef787b14f42083bd9"
LR, WEIGHT_DECAY, BETAS = 1e-3, 0.1, (0.9, 0.95)
PUZZLE_LR, PUZZLE_WEIGHT_DECAY = 1e-2, 0.1  # puzzle_emb_lr / puzzle_emb_weight_decay
B = 3

BASE: dict[str, Any] = dict(
    batch_size=B,
    vocab_size=6,
    num_puzzle_identifiers=4,
    puzzle_emb_ndim=16,
    puzzle_emb_len=2,
    H_cycles=1,
    L_cycles=3,
    n_backwards_L=3,
    H_layers=0,
    L_layers=2,
    hidden_size=16,
    num_heads=2,
    expansion=4,
    pos_encodings="rope",
    forward_dtype="float64",
    max_iter=3,
    max_iter_dist="det",
    max_iter_eval=80,
    residual_scale="input-independent",
    alpha_1_init=0.75,
    alpha_2_init=0.25,
    norm_type="pre-norm",
    fp_thresh=0.1,
    stepsize=1.0,
    stepsize_decay_train=0.9,
    stepsize_decay_eval=0.99,
    decay_patience=1,
    init_std=6.0,
    no_ACT_continue=True,
)
CONFIGS: dict[str, dict[str, Any]] = {
    "fprm_sudoku": dict(BASE, seq_len=16, conv_type="conv2d", conv_kernel_size=3, norm_placement="none"),
    "fprm_maze": dict(
        BASE, seq_len=12, L_layers=1, conv_type="conv1d", conv_kernel_size=4, norm_placement="output"
    ),
}
LOSS = dict(loss_type="stablemax_cross_entropy", q_loss_coeff=0.5, deep_supervision=True)


def _import_reference(root: Path) -> dict[str, Any]:
    trm = Path(os.environ.get("LOOPFORMER_TRM_REF", root.parent / "TinyRecursiveModels")).resolve()
    if not (root / "models" / "common.py").is_file():
        if not (trm / "models" / "common.py").is_file():
            raise SystemExit(
                f"{root}/models/common.py is missing and no TinyRecursiveModels checkout at {trm} "
                "(set LOOPFORMER_TRM_REF)"
            )
        sys.path.insert(1, str(trm))  # the namespace package `models` spans both checkouts
    import models.layers as layers
    import models.transformer as transformer
    from models.fixed_point_reasoning.fprm import FixedPointReasoningModel_ACTV1
    from models.losses import ACTLossHead
    from models.sparse_embedding import CastedSparseEmbeddingSignSGD_Distributed

    _float64_precision(layers, transformer)
    return {
        "model": FixedPointReasoningModel_ACTV1,
        "loss": ACTLossHead,
        "sign_sgd": CastedSparseEmbeddingSignSGD_Distributed,
        "trm": str(trm),
    }


def _float64_precision(layers: Any, transformer: Any) -> None:
    """Lift the reference's float32 casts for float64 inputs (same formulas, input precision).

    ``layers.rms_norm`` computes in float32 and ``layers.apply_rotary_pos_emb`` casts q and k to the
    float32 rotary tables: guards for bfloat16 training that would cap a float64 fixture at float32
    precision (Adam's first step amplifies that near-zero gradients). For float64 inputs the patched
    versions evaluate the same expressions in float64 (the tables keep their float32 values).
    """
    rms_norm, rotary = layers.rms_norm, layers.apply_rotary_pos_emb

    def rms_norm64(hidden_states: Tensor, variance_epsilon: float) -> Tensor:
        if hidden_states.dtype != torch.float64:
            return rms_norm(hidden_states, variance_epsilon)
        variance = hidden_states.square().mean(-1, keepdim=True)
        return hidden_states * torch.rsqrt(variance + variance_epsilon)

    def rotary64(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        if q.dtype != torch.float64:
            return rotary(q, k, cos, sin)
        cos, sin = cos.to(q.dtype).unsqueeze(-2), sin.to(q.dtype).unsqueeze(-2)
        return q * cos + layers.rotate_half(q) * sin, k * cos + layers.rotate_half(k) * sin

    layers.rms_norm = transformer.rms_norm = rms_norm64
    layers.apply_rotary_pos_emb = rotary64


class Recorder:
    """Wraps the reference's FixedPointOptimizer.reset / .step to copy what they return."""

    def __init__(self, opt: torch.nn.Module) -> None:
        self.resets: list[Tensor] = []
        self.steps: list[dict[str, Tensor]] = []
        reset, step = opt.reset, opt.step

        def rec_reset(*args: Any, **kw: Any) -> dict:
            state = reset(*args, **kw)
            self.resets.append(state["y"].detach().clone())
            return state

        def rec_step(state: dict, y: Tensor) -> dict:
            out = step(state, y)
            self.steps.append({k: v.detach().clone() for k, v in out.items()})
            return out

        opt.reset, opt.step = rec_reset, rec_step

    def sequence(self, prefix: str) -> dict[str, Tensor]:
        keys = ("y", "residues", "stepsize", "patience", "best_residues")
        return {f"{prefix}.{k}": torch.stack([s[k] for s in self.steps]) for k in keys}


def _batch(cfg: dict[str, Any], gen: torch.Generator) -> dict[str, Tensor]:
    T, V = cfg["seq_len"], cfg["vocab_size"]
    inputs = torch.randint(1, V, (B, T), generator=gen)
    labels = torch.randint(1, V, (B, T), generator=gen)
    labels[0, :3] = -100  # ignored positions
    labels[2, -2:] = -100
    ids = torch.tensor([1, 3, 0])  # distinct rows: the table's gradient norm is the rows' gradient norm
    return {"inputs": inputs, "labels": labels, "puzzle_identifiers": ids}


def _randomise(inner: torch.nn.Module, gen: torch.Generator) -> None:
    """Move the weights the authors' init leaves degenerate (zero / constant) off their init."""
    with torch.no_grad():
        d = inner.config.hidden_size
        inner.q_head.weight.copy_(torch.randn(inner.q_head.weight.shape, generator=gen) * 0.3)
        inner.q_head.bias.add_(torch.randn(2, generator=gen))
        inner.puzzle_emb.weights.copy_(torch.randn(inner.puzzle_emb.weights.shape, generator=gen) / d**0.5)
        for p in (inner.L_level.alpha_1_param, inner.L_level.alpha_2_param):
            p.add_(torch.randn(p.shape, generator=gen) * 0.3)


def _dense_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.requires_grad and not getattr(p, "_no_weight_decay", False)]
    no_decay = [p for p in model.parameters() if p.requires_grad and getattr(p, "_no_weight_decay", False)]
    groups = [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=LR, weight_decay=WEIGHT_DECAY, betas=BETAS)


def _segment(head: torch.nn.Module, carry: Any, batch: dict, rec: Recorder, prefix: str) -> tuple[Any, dict]:
    rec.steps.clear()
    carry, loss, _, _, outs, _ = head(return_keys=["logits", "q_halt_logits"], carry=carry, batch=batch)
    scaled = loss / B  # pretrain.train_batch: (1 / global_batch_size) * masked_loss
    scaled.backward()
    out = {
        f"{prefix}.loss": scaled.detach().reshape(1),
        f"{prefix}.logits": outs["logits"],
        f"{prefix}.q_logits": outs["q_halt_logits"].double(),
        f"{prefix}.halted": carry.halted.clone(),
        f"{prefix}.y0": rec.resets[-1],
        **rec.sequence(prefix),
    }
    inner = head.model.inner
    if prefix != "train":
        return carry, out
    for name, p in inner.named_parameters():
        if p.grad is not None:
            out[f"{prefix}.grad.{name}"] = p.grad.detach().clone()
            out[f"{prefix}.grad_norm.{name}"] = p.grad.detach().norm().reshape(1)
    local = inner.puzzle_emb.local_weights.grad
    out[f"{prefix}.grad.puzzle_emb.weights"] = local.detach().clone()
    out[f"{prefix}.grad_norm.puzzle_emb.weights"] = local.detach().norm().reshape(1)
    return carry, out


def _evaluate(head: torch.nn.Module, batch: dict, rec: Recorder) -> dict[str, Tensor]:
    """pretrain.evaluate: fresh carry, forward calls until every sequence halted."""
    head.eval()
    head.model.set_num_iters()
    rec.steps.clear()
    with torch.no_grad():
        carry = head.model.initial_carry(batch)
        calls = 0
        while True:
            carry, _, _, _, outs, all_finish = head(return_keys=["logits"], carry=carry, batch=batch)
            calls += 1
            if all_finish:
                break
    seq = rec.sequence("eval")
    return {
        "eval.y0": rec.resets[0],  # every call resets (the running rows keep their iterate): the first is y0
        "eval.residues": seq["eval.residues"],
        "eval.stepsize": seq["eval.stepsize"],
        "eval.y_final": carry.inner_carry.z_L_state["y"].clone(),
        "eval.logits": outs["logits"],
        "eval.steps": torch.tensor([calls]),
    }


def build_one(ref: dict[str, Any], name: str, cfg: dict[str, Any], seed: int) -> tuple[dict, dict]:
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    head = ref["loss"](ref["model"](dict(cfg)), **LOSS)
    inner = head.model.inner
    _randomise(inner, gen)
    batch = _batch(cfg, gen)
    # CastedLinear's weight-dropout masks (all ones: weight_dropout 0) are left out to keep the files small
    weights = {k: v.detach().clone() for k, v in inner.state_dict().items() if not k.endswith(".mask")}
    tensors: dict[str, Tensor] = {f"weights.{k}": v for k, v in weights.items()}
    tensors.update({f"batch.{k}": v for k, v in batch.items()})

    # the full inference procedure, on the initial weights (a copy: no state leaks into training)
    evaluated = copy.deepcopy(head)
    tensors.update(_evaluate(evaluated, batch, Recorder(evaluated.model.inner.L_optimizer)))
    rec = Recorder(inner.L_optimizer)

    head.train()
    head.model.set_num_iters()
    carry = head.model.initial_carry(batch)
    carry, seg1 = _segment(head, carry, batch, rec, "train")
    tensors.update(seg1)
    opt = _dense_optimizer(head)
    opt.step()
    opt.zero_grad(set_to_none=True)
    sparse = ref["sign_sgd"](
        inner.puzzle_emb.buffers(), world_size=1, lr=PUZZLE_LR, weight_decay=PUZZLE_WEIGHT_DECAY
    )  # create_model.py: CastedSparseEmbeddingSignSGD_Distributed over the puzzle table's buffers
    sparse.step()
    inner.puzzle_emb.local_weights.grad = None
    tensors.update({f"step.{k}": p.detach().clone() for k, p in inner.named_parameters()})
    tensors["step.puzzle_emb.weights"] = inner.puzzle_emb.weights.detach().clone()
    _, seg2 = _segment(head, carry, batch, rec, "seg2")
    tensors.update(seg2)
    meta = {
        "repository": REPO,
        "commit": COMMIT,
        "dtype": "float64",
        "reference_config": {**cfg, "loss": LOSS},
        "optimizer": {
            "name": "AdamW",
            "lr": LR,
            "weight_decay": WEIGHT_DECAY,
            "betas": list(BETAS),
            "puzzle_emb_lr": PUZZLE_LR,
            "puzzle_emb_weight_decay": PUZZLE_WEIGHT_DECAY,
        },
        "substitutions": [
            f"models/common.py, models/sparse_embedding.py from TinyRecursiveModels @ {TRM_COMMIT} "
            "(imported by FPRM, absent from the stored FPRM repository)",
            "forward_dtype float64 and float64 default dtype instead of bfloat16 autocast on CUDA; "
            "models/layers.py rms_norm and apply_rotary_pos_emb evaluate their formulas in float64 for "
            "float64 inputs instead of casting to float32 (the rotary tables keep their float32 values)",
            "no torch.compile; no flash-attn needed (the reference calls F.scaled_dot_product_attention)",
        ],
    }
    return tensors, meta


def build(root: Path, out: Path) -> list[str]:
    torch.set_default_dtype(torch.float64)
    ref = _import_reference(root)
    names = []
    for i, (name, cfg) in enumerate(CONFIGS.items()):
        tensors, meta = build_one(ref, name, cfg, seed=100 + i)
        save_fixture(out, name, tensors, meta)
        names += [f"{name}.safetensors", f"{name}.json"]
    return names


if __name__ == "__main__":
    main(build, __doc__.splitlines()[0])
