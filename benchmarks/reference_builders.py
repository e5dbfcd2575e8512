"""Model pairs for the head-to-head benchmark (benchmarks/bench_reference.py): loopformer and the
authors' implementation at the same configuration, batch, loop counts and dtype (float32, CPU).

The authors' code is imported from a checkout at run time (nothing of it is copied here). Each
builder returns a ``Pair``: a training step (forward + backward + optimiser step) and an evaluation
batch for each side, with the configuration and the substitutions made to run the reference on CPU.
Shared shape (``SHAPE``): d 192, 4 heads, 9 x 9 = 81 tokens, vocab 11, batch 8; loopformer's
models are configured with their options that reproduce the authors' (gain-free RMSNorm, SwiGLU
widths rounded to 256, ...), so both sides hold the same parameters. Both sides use ``torch.optim.AdamW`` (the references' AdamATan2 is a
CUDA extension; their puzzle-embedding sign-SGD optimiser is not stepped, and loopformer's puzzle
table is left out of its optimiser to match).
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from loopformer.loop import LoopConfig
from loopformer.train.losses import accuracy, q_halt_loss, q_learning_losses, sequence_loss

LR, BETAS, WEIGHT_DECAY = 1e-4, (0.9, 0.95), 0.1


@dataclass(frozen=True)
class Settings:
    """How a pair runs. ``compile`` (``bench_reference --compile``): loopformer's step as
    ``train.compile: true`` compiles it (model.step), the reference's loss head as TinyRecursiveModels /
    HRM ``pretrain.py`` compile it (torch.compile(model)). ``device``: both sides' models and batch
    live there; the reference's calls run under ``torch.device(device)`` (its carries are created on
    the default device, as its ``pretrain.py`` sets it), and on CUDA every call ends with a
    synchronize so a timer sees the whole step."""

    compile: bool = False
    device: str = "cpu"


@dataclass(frozen=True)
class Shape:
    d: int
    heads: int
    grid: int
    batch: int
    vocab: int = 11

    @property
    def tokens(self) -> int:
        return self.grid * self.grid


SHAPE = Shape(d=192, heads=4, grid=9, batch=8)
QUICK_SHAPE = Shape(d=96, heads=2, grid=4, batch=2)  # 96: SwiGLU width 256 under both roundings


@dataclass
class Pair:
    ours_train: Callable[[], Any]
    ref_train: Callable[[], Any]
    ours_eval: Callable[[], Any]
    ref_eval: Callable[[], Any]
    config: dict[str, Any]
    substitutions: list[str] = field(default_factory=list)
    params: dict[str, int] = field(default_factory=dict)


def _batch(shape: Shape, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    B, T = shape.batch, shape.tokens
    return {
        "inputs": torch.randint(1, shape.vocab, (B, T), generator=g),
        "labels": torch.randint(2, shape.vocab, (B, T), generator=g),
        "puzzle_identifiers": torch.zeros(B, dtype=torch.int32),
    }


def _count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _adamw(params: list[torch.nn.Parameter]) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=LR, betas=BETAS, weight_decay=WEIGHT_DECAY)


def _import_path(root: Path, extra: list[Path] | None = None) -> None:
    """Put the checkout first on sys.path (its code imports ``models.*`` from its root)."""
    for p in [root, *(extra or [])][::-1]:
        sys.path.insert(0, str(p))


# ----------------------------------------------------------------------------------------------------
# loopformer's side: model forward through the engine, the trainer's losses, AdamW
# ----------------------------------------------------------------------------------------------------
def _ours(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    train_loop: LoopConfig,
    eval_loop: LoopConfig,
    aux_weight: float = 0.0,
    q_learning_segments: int = 0,
) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """loopformer's training step and evaluation batch on ``batch`` (already on the model's device).
    ``q_learning_segments`` > 0: HRM's Q-learning as ``train.q_learning`` runs it (the trainer's
    ``_q_learning``): Q-halt and Q-continue BCE, the target from one more segment without gradient,
    the last of every ``q_learning_segments`` segments bootstrapping from Q-halt alone."""
    inputs, labels = batch["inputs"], batch["labels"]
    params = [p for n, p in model.named_parameters() if "puzzle_emb" not in n]
    opt = _adamw(params)
    carry: dict[str, Any] = {"state": None, "segment": 0}

    def q_terms(out: Any) -> torch.Tensor:
        exact = accuracy(out.logits, labels).exact
        if not q_learning_segments:
            return q_halt_loss(out.q_logits, exact)
        q = model.q_values(out.state)
        with torch.no_grad():
            q_next = model.q_values(model(inputs, loop=train_loop, state=out.state.detach()).state)
        carry["segment"] = (carry["segment"] + 1) % q_learning_segments
        is_last = torch.full((inputs.shape[0],), carry["segment"] == 0, device=inputs.device)
        return sum(q_learning_losses(q, q_next, exact, is_last))

    def train() -> None:
        model.train()
        out = model(inputs, loop=train_loop, state=carry["state"])
        loss = sequence_loss(out.logits, labels, "stablemax")
        if out.q_logits is not None:
            loss = loss + 0.5 * q_terms(out)
        if aux_weight and out.aux_loss is not None:  # e.g. the Attractor puzzle model's Jacobian term
            loss = loss + aux_weight * out.aux_loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        carry["state"] = out.state.detach()  # deep supervision: the next segment continues from here

    def evaluate() -> None:
        model.eval()
        with torch.no_grad():
            out = model(inputs, loop=eval_loop)
            accuracy(out.logits, labels)

    return train, evaluate


def _ref_act(
    head: torch.nn.Module, batch: dict[str, torch.Tensor], set_iters: bool = False
) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """The authors' ``pretrain.train_batch`` / ``evaluate`` loops around their ``ACTLossHead``
    (called under ``torch.device(<batch's device>)``, see ``_on``)."""
    opt = _adamw([p for n, p in head.named_parameters() if p.requires_grad and "puzzle_emb" not in n])
    state: dict[str, Any] = {}

    def train() -> None:
        head.train()
        if set_iters:
            head.set_num_iters()
        if "carry" not in state:
            state["carry"] = head.initial_carry(batch)
        out = head(carry=state["carry"], batch=batch, return_keys=[])
        state["carry"], loss = out[0], out[1]
        (loss / batch["inputs"].shape[0]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def evaluate() -> None:
        head.eval()
        if set_iters:
            head.set_num_iters()
        with torch.no_grad():
            carry = head.initial_carry(batch)
            while True:
                out = head(carry=carry, batch=batch, return_keys=["logits"])
                carry, all_finish = out[0], out[-1]
                if all_finish:
                    break

    return train, evaluate


def _on(device: torch.device, fn: Callable[[], Any], default_device: bool = False) -> Callable[[], Any]:
    """``fn`` as a step on ``device``: optionally under ``torch.device(device)`` (the reference's
    factory calls), and on CUDA followed by a synchronize (so wall time covers the kernels). On the
    CPU, the default device already, ``fn`` itself: the ``torch.device`` context is a function mode
    that would add Python overhead to every operator of the reference's step."""
    if device.type == "cpu":
        return fn

    def step() -> Any:
        with device if default_device else contextlib.nullcontext():
            out = fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return out

    return step


# ----------------------------------------------------------------------------------------------------
# FPRM (nilskiKonjIzDunava/fprm)
# ----------------------------------------------------------------------------------------------------
FPRM_K, FPRM_EVAL_STEPS = 6, 16


def _pair(
    ours: Any,
    ref: Any,
    shape: Shape,
    train_loop: LoopConfig,
    eval_loop: LoopConfig,
    config: dict[str, Any],
    subs: list[str],
    set_iters: bool = False,
    aux_weight: float = 0.0,
    q_learning_segments: int = 0,
    settings: Settings = Settings(),
) -> Pair:
    """Both sides' training step and evaluation batch on one shared batch, with their parameter counts."""
    device = torch.device(settings.device)
    batch = {k: v.to(device) for k, v in _batch(shape).items()}
    params = {"loopformer": _count(ours), "reference": _count(ref)}
    ours.to(device)
    ref.to(device)
    if settings.compile:
        ours.step = torch.compile(ours.step)
        ref = torch.compile(ref)
    ours_train, ours_eval = _ours(ours, batch, train_loop, eval_loop, aux_weight, q_learning_segments)
    ref_train, ref_eval = _ref_act(ref, batch, set_iters=set_iters)
    return Pair(
        _on(device, ours_train), _on(device, ref_train, default_device=True),
        _on(device, ours_eval), _on(device, ref_eval, default_device=True),
        config, subs, params,
    )  # fmt: skip


def _segment_loops(cycles: int, segments: int) -> tuple[LoopConfig, LoopConfig]:
    """TRM / HRM: training runs one segment of ``cycles`` cycles (gradient through the last one),
    evaluation ``segments`` segments as one loop, no gradient."""
    train = LoopConfig(halting="fixed", max_steps=cycles, grad="truncated", grad_steps=1, trace=False)
    return train, LoopConfig(halting="fixed", max_steps=cycles * segments, grad="truncated", trace=False)


def build_fprm(root: Path, trm_root: Path | None, shape: Shape, settings: Settings = Settings()) -> Pair:
    from loopformer.models.fprm import FPRM, FPRMConfig

    subs = ["the reference's Attention already calls F.scaled_dot_product_attention (no flash-attn)"]
    extra = []
    if not (root / "models" / "common.py").is_file():
        if trm_root is None or not (trm_root / "models" / "common.py").is_file():
            raise FileNotFoundError(
                f"{root}/models/common.py is missing (absent from the stored repository); "
                "set LOOPFORMER_REF_TRM to a TinyRecursiveModels checkout to take it from there"
            )
        extra.append(trm_root)
        subs.append(
            "models/common.py and models/sparse_embedding.py (absent from the FPRM repository) come "
            "from the TinyRecursiveModels checkout FPRM derives from"
        )
    _import_path(root, extra)
    from models.fixed_point_reasoning.fprm import FixedPointReasoningModel_ACTV1
    from models.losses import ACTLossHead

    cfg = dict(
        batch_size=shape.batch, seq_len=shape.tokens, puzzle_emb_ndim=0, puzzle_emb_len=0,
        num_puzzle_identifiers=1, vocab_size=shape.vocab, H_cycles=1, L_cycles=FPRM_K,
        n_backwards_L=FPRM_K, H_layers=0, L_layers=2, hidden_size=shape.d, expansion=4,
        num_heads=shape.heads, pos_encodings="rope", forward_dtype="float32",
        halting_mechanism="fixed_point", max_iter=16, max_iter_dist="det", max_iter_eval=FPRM_EVAL_STEPS,
        fp_thresh=0.0, stepsize=1.0, stepsize_decay_train=0.9, stepsize_decay_eval=0.99, decay_patience=5,
        init_std=6.0, conv_type="conv2d", conv_kernel_size=3, residual_scale="input-independent",
        alpha_1_init=0.75, alpha_2_init=0.25, norm_type="pre-norm", norm_placement="none",
        no_ACT_continue=True, halt_max_steps=1, halt_exploration_prob=0.0,
    )  # fmt: skip
    ref = ACTLossHead(
        FixedPointReasoningModel_ACTV1(cfg), loss_type="stablemax_cross_entropy", q_loss_coeff=0.5
    )
    # loopformer's options that reproduce the authors' model (docs/fidelity.md, FPRM): the same
    # parameters and the same function, so the two sides do the same work
    ours = FPRM(
        FPRMConfig(
            vocab_size=shape.vocab, seq_len=shape.tokens, d_model=shape.d, n_heads=shape.heads, n_layers=2,
            grid=(shape.grid, shape.grid), conv="grid2d", q_head=True, q_pool="first", a1_init=0.75,
            a2_init=0.25, conv_form="replace", head_norm=False, norm_eps=1e-5, norm_gain=False,
            mlp_multiple=256, init="lecun", tied_eps=1e-5,
        )
    )  # fmt: skip
    damped = dict(solver="damped", halting="fixed", residual_norm="rel_sup", trace=False)
    train_loop = LoopConfig(**damped, plugins={"damped": {"gamma": 0.9, "patience": 5}}, max_steps=FPRM_K, grad="bptt")
    eval_loop = LoopConfig(**damped, plugins={"damped": {"gamma": 0.99, "patience": 5}}, max_steps=FPRM_EVAL_STEPS,
                           grad="bptt")
    subs.append("fp_thresh 0 so the reference's evaluation runs exactly max_iter_eval damped steps")
    config = {
        "training_step": f"one deep-supervision segment: {FPRM_K} damped steps (gamma 0.9), backprop "
        "through all of them, stablemax loss + 0.5 Q-head BCE, AdamW",
        "eval_batch": f"{FPRM_EVAL_STEPS} damped steps (gamma 0.99), no gradient; the reference takes "
        "one step per forward call (its evaluate loop)",
        "model": "pre-norm, 2 blocks, grid 2-D depthwise conv kernel 3, tied residual scaling a1 0.75 a2 0.25",
    }
    return _pair(ours, ref, shape, train_loop, eval_loop, config, subs, set_iters=True, settings=settings)


# ----------------------------------------------------------------------------------------------------
# TRM (SamsungSAILMontreal/TinyRecursiveModels) and HRM (sapientinc/HRM)
# ----------------------------------------------------------------------------------------------------
TRM_H, TRM_L, TRM_SEGMENTS = 3, 6, 8  # segments: the ACT cap (16 in the paper), also the eval length


def _trm_config(shape: Shape, emb_len: int) -> dict[str, Any]:
    """TinyRecursiveModels' ``TinyRecursiveReasoningModel_ACTV1`` config at ``shape`` (also TRM-DEQ's base)."""
    return dict(
        batch_size=shape.batch, seq_len=shape.tokens, puzzle_emb_ndim=shape.d, puzzle_emb_len=emb_len,
        num_puzzle_identifiers=1, vocab_size=shape.vocab, H_cycles=TRM_H, L_cycles=TRM_L, H_layers=0,
        L_layers=2, hidden_size=shape.d, expansion=4, num_heads=shape.heads, pos_encodings="rope",
        halt_max_steps=TRM_SEGMENTS, halt_exploration_prob=0.1, forward_dtype="float32", mlp_t=False,
        no_ACT_continue=True,
    )  # fmt: skip


def build_trm(root: Path, shape: Shape, quick: bool, settings: Settings = Settings()) -> Pair:
    from loopformer.models.trm import TRM, TRMConfig

    _import_path(root)
    from models.losses import ACTLossHead
    from models.recursive_reasoning.trm import TinyRecursiveReasoningModel_ACTV1

    emb_len = 2 if quick else 16
    cfg = _trm_config(shape, emb_len)
    ref = ACTLossHead(TinyRecursiveReasoningModel_ACTV1(cfg), loss_type="stablemax_cross_entropy")
    ours = TRM(
        TRMConfig(
            vocab_size=shape.vocab, seq_len=shape.tokens, d_model=shape.d, n_heads=shape.heads, n_layers=2,
            n_inner=TRM_L, num_puzzle_ids=1, puzzle_emb_len=emb_len, puzzle_emb_dim=shape.d, q_head=True,
        )
    )  # fmt: skip
    config = {
        "training_step": f"one deep-supervision segment: T = {TRM_H} cycles of n = {TRM_L} latent updates "
        "+ 1 answer update, the first T - 1 without gradient; stablemax loss + 0.5 Q-halt BCE, AdamW",
        "eval_batch": f"{TRM_SEGMENTS} segments ({TRM_H * TRM_SEGMENTS} cycles), no gradient",
        "model": f"post-norm, 2 layers, {emb_len} puzzle-embedding tokens",
    }
    subs = [
        "AdamATan2 (CUDA extension) -> torch.optim.AdamW on both sides; sparse puzzle-embedding "
        "sign-SGD not stepped",
        "the reference's Attention at this commit calls F.scaled_dot_product_attention (flash-attn import "
        "commented out upstream)",
    ]
    return _pair(ours, ref, shape, *_segment_loops(TRM_H, TRM_SEGMENTS), config, subs, settings=settings)


HRM_H, HRM_L, HRM_LAYERS, HRM_SEGMENTS = 2, 2, 4, 8  # segments as for TRM


def _flash_attn_shim() -> None:
    """``flash_attn_interface.flash_attn_func`` on [B, S, H, D] through F.scaled_dot_product_attention."""

    def flash_attn_func(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False
    ) -> torch.Tensor:
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal
        )
        return out.transpose(1, 2).contiguous()

    module = types.ModuleType("flash_attn_interface")
    module.flash_attn_func = flash_attn_func  # type: ignore[attr-defined]
    sys.modules.setdefault("flash_attn_interface", module)


def build_hrm(root: Path, shape: Shape, quick: bool, settings: Settings = Settings()) -> Pair:
    from loopformer.models.hrm import HRM, HRMConfig

    _flash_attn_shim()
    _import_path(root)
    from models.hrm.hrm_act_v1 import HierarchicalReasoningModel_ACTV1
    from models.losses import ACTLossHead

    emb_len = 1  # HRM: ceil(puzzle_emb_ndim / hidden_size) tokens
    layers = 2 if quick else HRM_LAYERS
    cfg = dict(
        batch_size=shape.batch, seq_len=shape.tokens, puzzle_emb_ndim=shape.d, num_puzzle_identifiers=1,
        vocab_size=shape.vocab, H_cycles=HRM_H, L_cycles=HRM_L, H_layers=layers, L_layers=layers,
        hidden_size=shape.d, expansion=4, num_heads=shape.heads, pos_encodings="rope",
        halt_max_steps=HRM_SEGMENTS, halt_exploration_prob=0.1, forward_dtype="float32",
    )  # fmt: skip
    ref = ACTLossHead(HierarchicalReasoningModel_ACTV1(cfg), loss_type="stablemax_cross_entropy")
    ours = HRM(
        HRMConfig(
            vocab_size=shape.vocab, seq_len=shape.tokens, d_model=shape.d, n_heads=shape.heads,
            n_layers=layers, l_cycles=HRM_L, num_puzzle_ids=1, puzzle_emb_len=emb_len, q_head=True,
        )
    )  # fmt: skip
    config = {
        "training_step": f"one segment: {HRM_H} H cycles x {HRM_L} L cycles, 1-step gradient; stablemax "
        "loss + 0.5 (Q-halt BCE + Q-continue BCE against a target from one more segment without gradient: "
        "HRM's ACT Q-learning, loopformer's train.q_learning), AdamW",
        "eval_batch": f"{HRM_SEGMENTS} segments, no gradient",
        "model": f"post-norm, {layers} + {layers} layers, 1 puzzle-embedding token",
    }
    subs = [
        "flash_attn_func -> F.scaled_dot_product_attention (a stand-in flash_attn_interface module)",
        "AdamATan2 (CUDA extension) -> torch.optim.AdamW on both sides; sparse puzzle-embedding "
        "sign-SGD not stepped",
    ]
    loops = _segment_loops(HRM_H, HRM_SEGMENTS)
    return _pair(ours, ref, shape, *loops, config, subs, q_learning_segments=HRM_SEGMENTS, settings=settings)


# ----------------------------------------------------------------------------------------------------
# Attractor puzzle model (jacobfa/Attractor, experiments/attractor_puzzles/trm/trm_deq.py: TRM-DEQ)
# ----------------------------------------------------------------------------------------------------
DEQ_ITERS, DEQ_MIN, BPTT_THROUGH, JAC_LAMBDA = 8, 4, 2, 1e-3  # TrainTRMDEQConfig's defaults


def build_attractor(root: Path, shape: Shape, quick: bool, settings: Settings = Settings()) -> Pair:
    """TRM-DEQ against ``attractor_puzzle`` built from the reference's own weights through
    ``loopformer convert attractor`` (so both sides start from the same parameters)."""
    from loopformer.convert import build_converted
    from loopformer.convert.attractor import convert

    _import_path(root)
    import importlib

    pkg = "experiments.attractor_puzzles.trm"
    deq = importlib.import_module(f"{pkg}.trm_deq")
    losses = importlib.import_module(f"{pkg}.losses_deq")
    emb_len = 2 if quick else 16
    cfg = dict(
        _trm_config(shape, emb_len), deq_inner=True, deq_max_iter=DEQ_ITERS, deq_min_iter=DEQ_MIN,
        deq_tol=1e-12, deq_anderson_m=5, deq_anderson_beta=1.0, bptt_through=BPTT_THROUGH,
        jacobian_reg_lambda=JAC_LAMBDA, jacobian_reg_n_samples=1,
    )  # fmt: skip
    ref = losses.ACTLossHeadDEQ(
        deq.TRMDEQ(dict(cfg)), loss_type="stablemax_cross_entropy", jacobian_reg_lambda=JAC_LAMBDA
    )
    state = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    converted = convert(state, {"model_config": cfg, "train_config": {"global_batch_size": shape.batch}})
    _, ours = build_converted(converted)
    config = {
        "training_step": f"one deep-supervision segment: T = {TRM_H} cycles, each an Anderson solve of the "
        f"latent (at most {DEQ_ITERS} map evaluations, m 5, no gradient) + {BPTT_THROUGH} phantom-gradient "
        "applications + 1 answer update, the first T - 1 cycles without gradient; stablemax loss + 0.5 "
        f"Q-halt BCE + {JAC_LAMBDA} x Hutchinson Jacobian term (1 probe), AdamW",
        "eval_batch": f"{TRM_SEGMENTS} segments, no gradient",
        "model": f"TRM-DEQ: post-norm, 2 layers, {emb_len} puzzle-embedding tokens; loopformer's "
        "attractor_puzzle built by loopformer convert attractor from the reference's weights",
    }
    subs = [
        "AdamATan2 (CUDA extension) -> torch.optim.AdamW on both sides; sparse puzzle-embedding "
        "sign-SGD not stepped",
        "deq_tol 1e-12 (default 1e-3) so no solve stops on its residual; both sides stop a solve when its "
        "float32 mixing system turns singular (the reference's except RuntimeError: break), here after 5-6 "
        "evaluations (docs/fidelity.md, Attractor puzzle model)",
    ]
    train_loop, eval_loop = _segment_loops(TRM_H, TRM_SEGMENTS)
    aux = float(converted.run["train"]["ponder_weight"])
    return _pair(ours, ref, shape, train_loop, eval_loop, config, subs, aux_weight=aux, settings=settings)
