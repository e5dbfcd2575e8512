"""``loopformer export SYSTEM RUN -o PATH``: a loopformer run -> a checkpoint the authors' code loads.

The inverse of ``loopformer convert``, for TRM (SamsungSAILMontreal/TinyRecursiveModels), HRM
(sapientinc/HRM) and FPRM (nilskiKonjIzDunava/fprm): the weights as their ``pretrain.py`` saves them
(``torch.save(ACTLossHead(model).state_dict())``, keys ``_orig_mod.model.inner.<name>`` of a compiled
model, or ``model.inner.<name>`` with ``compiled=False`` for a ``DISABLE_COMPILE=1`` load) and the
``all_config.yaml`` their ``pretrain.py`` writes beside the ``step_N`` files (``arch:`` holds the model).

Each key of the weights is placed by the inverse of the converter's own key map: the same names
(``loopformer.convert.recursive`` / ``loopformer.convert.fprm``), the q / k rows of every head put back
in the authors' rotate-half order by inverting the converter's ``permute_qkv`` (computed from it, so the
two cannot drift apart). What the converter drops is filled as the authors' code initialises it: the Q
head's continue row (weight 0, bias -5; never read with ``no_ACT_continue``) and FPRM's weight-dropout
masks (all ones). A loopformer weight with no place in the authors' model (a norm gain, tied embeddings)
is an error naming it.

Every export is checked by the round trip before anything is written: the converter reads the exported
state and config back, and its weights must equal the run's bit for bit and its model fields the run's
(a field the authors' model cannot express, e.g. FPRM's ``conv_form: add``, is an error naming it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from loopformer.convert import converter
from loopformer.runs.layout import CheckpointError

COMPILED_PREFIX = "_orig_mod.model.inner."  # a torch.compile'd ACTLossHead, as pretrain.py saves it
PLAIN_PREFIX = "model.inner."
Q_CONTINUE_BIAS = -5.0  # the authors' q_head init: weight 0, bias -5 (TRM / HRM / FPRM)
CASTED_LINEARS = (
    "lm_head",
    "q_head",
    "qkv_proj",
    "o_proj",
    "gate_up_proj",
    "down_proj",
)  # FPRM's masked linears


@dataclass
class Exported:
    """An authors' checkpoint: the state dict (keys without prefix) and its ``all_config.yaml``."""

    system: str
    state: dict[str, Tensor]
    config: dict[str, Any]
    notes: list[str] = field(default_factory=list)

    def saved(self, compiled: bool = True) -> dict[str, Tensor]:
        """The state dict as ``pretrain.py`` saves it (prefixed)."""
        prefix = COMPILED_PREFIX if compiled else PLAIN_PREFIX
        return {prefix + k: v.detach().cpu().contiguous() for k, v in self.state.items()}


class _Weights:
    """The run's weights, taken key by key; leftovers are an error naming them."""

    def __init__(self, weights: dict[str, Tensor], system: str) -> None:
        self.weights, self.system, self.used = weights, system, set()

    def take(self, key: str) -> Tensor:
        if key not in self.weights:
            raise CheckpointError(
                f"export {self.system}: the run has no weight {key!r} the authors' model needs"
            )
        self.used.add(key)
        return self.weights[key]

    def finish(self) -> None:
        left = sorted(set(self.weights) - self.used)
        if left:
            raise CheckpointError(f"export {self.system}: {len(left)} loopformer weights have no place in the "
                                  f"authors' model: {left[:6]}{' ...' if len(left) > 6 else ''}")  # fmt: skip


def unpermute_rows(ours: Tensor, permute: Callable[[Tensor], Tensor]) -> Tensor:
    """The authors' tensor ``theirs`` with ``permute(theirs) == ours``, for a ``permute`` that reorders rows
    (the converter's ``permute_qkv``): the row order is read off ``permute`` applied to row numbers."""
    rows, cols = ours.shape
    index = torch.arange(rows, dtype=torch.float64).unsqueeze(1).expand(rows, cols).contiguous()
    order = permute(index)[:, 0].round().long()  # ours[i] = theirs[order[i]]
    if sorted(order.tolist()) != list(range(rows)):
        raise CheckpointError("the converter's q / k permutation is not a row permutation")
    theirs = torch.empty_like(ours)
    theirs[order] = ours
    return theirs


def _q_head(w: _Weights, weight: str, bias: str, rows: int) -> dict[str, Tensor]:
    """The authors' 2-row Q head (halt, continue) from loopformer's ``rows`` row(s)."""
    qw, qb = w.take(weight), w.take(bias)
    if rows == 2:
        return {"q_head.weight": qw, "q_head.bias": qb}
    pad_w = torch.zeros((1, qw.shape[1]), dtype=qw.dtype)
    pad_b = torch.full((1,), Q_CONTINUE_BIAS, dtype=qb.dtype)
    return {"q_head.weight": torch.cat([qw, pad_w]), "q_head.bias": torch.cat([qb, pad_b])}


# ------------------------------------------------------------------------------------------- TRM / HRM


def _recursive_blocks(
    w: _Weights, level: str, ours: str, n: int, n_heads: int, rope: bool
) -> dict[str, Tensor]:
    from loopformer.convert import recursive as rec

    out: dict[str, Tensor] = {}
    for i in range(n):
        src, dst = f"{level}.layers.{i}", f"{ours}.layers.{i}"
        if f"{dst}.mix.mlp.gate_up.weight" in w.weights:  # TRM's mlp_t
            out[f"{src}.mlp_t.gate_up_proj.weight"] = w.take(f"{dst}.mix.mlp.gate_up.weight")
            out[f"{src}.mlp_t.down_proj.weight"] = w.take(f"{dst}.mix.mlp.down.weight")
        else:
            qkv = w.take(f"{dst}.mix.qkv.weight")
            out[f"{src}.self_attn.qkv_proj.weight"] = (
                unpermute_rows(qkv, lambda t: rec.permute_qkv(t, n_heads)) if rope else qkv
            )
            out[f"{src}.self_attn.o_proj.weight"] = w.take(f"{dst}.mix.proj.weight")
        out[f"{src}.mlp.gate_up_proj.weight"] = w.take(f"{dst}.mlp.gate_up.weight")
        out[f"{src}.mlp.down_proj.weight"] = w.take(f"{dst}.mlp.down.weight")
    return out


def _recursive_arch(system: str, f: dict[str, Any], cfg: Any) -> dict[str, Any]:
    tc = cfg.train
    arch: dict[str, Any] = {
        "name": "recursive_reasoning.trm@TinyRecursiveReasoningModel_ACTV1" if system == "trm"
        else "hrm.hrm_act_v1@HierarchicalReasoningModel_ACTV1",
        "H_cycles": int(f["loop"]["max_steps"]),
        "hidden_size": int(f["d_model"]),
        "num_heads": int(f["n_heads"]),
        "expansion": float(f["expansion"]),
        "pos_encodings": "rope" if f.get("rope", True) else "none",
        "puzzle_emb_ndim": int(f.get("puzzle_emb_dim") or 0) if f.get("num_puzzle_ids") else 0,
        "puzzle_emb_len": int(f.get("puzzle_emb_len") or 0),
        "num_puzzle_identifiers": int(f.get("num_puzzle_ids") or 0),
        "halt_max_steps": int(tc.max_segments),
        "halt_exploration_prob": float(tc.halt_exploration),
        "rms_norm_eps": float(f["norm_eps"]),
        "seq_len": int(f["seq_len"]),
        "vocab_size": int(f["vocab_size"]),
        "forward_dtype": "bfloat16",
        "loss": {"name": "losses@ACTLossHead",
                 "loss_type": "stablemax_cross_entropy" if tc.loss == "stablemax" else "softmax_cross_entropy"},
    }  # fmt: skip
    if system == "trm":
        arch.update(L_cycles=int(f["n_inner"]), L_layers=int(f["n_layers"]), H_layers=0,
                    mlp_t=f.get("mixer") == "mlp", no_ACT_continue=True)  # fmt: skip
    else:
        arch.update(L_cycles=int(f["l_cycles"]), H_layers=int(f["n_layers"]),
                    L_layers=int(f.get("l_layers") or f["n_layers"]))  # fmt: skip
    return arch


def _training(cfg: Any) -> dict[str, Any]:
    """The authors' top-level training keys (cfg_pretrain.yaml) for loopformer's ``train`` section."""
    tc, data = cfg.train, cfg.data
    return {
        "global_batch_size": int(tc.batch_size),
        "lr": float(tc.lr),
        "lr_min_ratio": float(tc.min_lr_ratio) if tc.schedule == "cosine" else 1.0,
        "lr_warmup_steps": int(tc.warmup_steps),
        "beta1": float(tc.betas[0]),
        "beta2": float(tc.betas[1]),
        "weight_decay": float(tc.weight_decay),
        "puzzle_emb_lr": float(tc.puzzle_emb_lr),
        "puzzle_emb_weight_decay": float(tc.puzzle_emb_weight_decay),
        "ema": bool(tc.ema > 0),
        "ema_rate": float(tc.ema) if tc.ema > 0 else 0.999,
        "seed": int(cfg.seed),
        "data_paths": [str(data.train_path or f"data/{data.task}")],  # the converter reads the task off it
    }


def export_recursive(system: str, cfg: Any, weights: dict[str, Tensor]) -> Exported:
    """TRM / HRM: the converter's ``map_weights`` run backwards."""
    f = cfg.model.fields
    w = _Weights(weights, system)
    state: dict[str, Tensor] = {"embed_tokens.embedding_weight": w.take("embedding.tokens.weight")}
    if f.get("num_puzzle_ids"):
        state["puzzle_emb.weights"] = w.take("embedding.puzzle_emb.weight")
    rope = bool(f.get("rope", True))
    if system == "trm":
        levels = (("L_level", "net", int(f["n_layers"])),)
        inits = ("y_init", "z_init")
    else:
        levels = (
            ("H_level", "H", int(f["n_layers"])),
            ("L_level", "L", int(f.get("l_layers") or f["n_layers"])),
        )
        inits = ("h_init", "l_init")
    for level, ours, n in levels:
        state.update(_recursive_blocks(w, level, ours, n, int(f["n_heads"]), rope))
    state["H_init"], state["L_init"] = w.take(inits[0]), w.take(inits[1])
    state["lm_head.weight"] = w.take("lm_head.weight")
    state.update(_q_head(w, "q_proj.weight", "q_proj.bias", 1 if system == "trm" else 2))
    w.finish()
    config = {"arch": _recursive_arch(system, f, cfg), **_training(cfg)}
    return Exported(system, state, config)


# ------------------------------------------------------------------------------------------- FPRM


def _fprm_arch(f: dict[str, Any], cfg: Any) -> dict[str, Any]:
    from loopformer.convert.fprm import NORMS

    if f.get("conv", "none") == "none":
        raise CheckpointError("export fprm: the model has no convolution; the authors' FPRM is exported with "
                              "its conv1d / conv2d only (model.conv=causal1d or grid2d)")  # fmt: skip
    if f.get("scalars") != "learned":
        raise CheckpointError("export fprm: model.scalars must be 'learned' (the authors' residual_scale "
                              "input-independent); fixed scalars are not exported")  # fmt: skip
    base = cfg.model_config().loop  # the resolved training and evaluation loops
    lt, le = cfg.loop_config(base, "train"), cfg.loop_config(base, "eval")
    lt_damped, le_damped = lt.options_for("damped"), le.options_for("damped")
    arch: dict[str, Any] = {
        "name": "fixed_point_reasoning.fprm@FixedPointReasoningModel_ACTV1",
        "hidden_size": int(f["d_model"]), "num_heads": int(f["n_heads"]), "expansion": float(f["expansion"]),
        "L_layers": int(f["n_layers"]), "H_layers": 0, "H_cycles": 1,
        "causal": bool(f.get("causal", False)), "pos_encodings": "rope" if f.get("rope", True) else "none",
        "norm_type": {v: k for k, v in NORMS.items()}[f["norm"]], "norm_placement": f.get("state_norm", "none"),
        "residual_scale": "input-independent", "alpha_1_init": float(f["a1_init"]),
        "alpha_2_init": float(f["a2_init"]), "init_std": float(f["init_std"]),
        "conv_type": "conv2d" if f["conv"] == "grid2d" else "conv1d", "conv_kernel_size": int(f["conv_kernel"]),
        "rms_norm_eps": float(f["norm_eps"]), "seq_len": int(f["seq_len"]), "vocab_size": int(f["vocab_size"]),
        "puzzle_emb_len": int(f.get("puzzle_emb_len") or 0),
        "puzzle_emb_ndim": int(f.get("puzzle_emb_dim") or 0) if f.get("num_puzzle_ids") else 0,
        "num_puzzle_identifiers": int(f.get("num_puzzle_ids") or 0),
        "n_backwards_L": int(lt.max_steps), "fp_thresh": float(le.tol), "decay_patience": int(le_damped.patience),
        "stepsize_decay_train": float(lt_damped.gamma), "stepsize_decay_eval": float(le_damped.gamma),
        "max_iter": int(cfg.train.max_segments), "max_iter_dist": "det", "max_iter_eval": int(le.max_steps),
        "halting_mechanism": "fixed_point", "no_ACT_continue": True, "mlp_t": False, "forward_dtype": "bfloat16",
        "loss": {"name": "losses@ACTLossHead", "q_loss_coeff": float(cfg.train.q_loss_weight),
                 "loss_type": "stablemax_cross_entropy" if cfg.train.loss == "stablemax" else "softmax_cross_entropy"},
    }  # fmt: skip
    return arch


def export_fprm(system: str, cfg: Any, weights: dict[str, Tensor]) -> Exported:
    """FPRM: the converter's ``_weights`` run backwards, with the all-ones weight-dropout masks."""
    from loopformer.convert.fprm import permute_qkv

    f = cfg.model.fields
    arch = _fprm_arch(f, cfg)
    w = _Weights(weights, system)
    state: dict[str, Tensor] = {"embed_tokens.embedding_weight": w.take("embedding.tokens.weight"),
                                "lm_head.weight": w.take("output.head.weight")}  # fmt: skip
    state.update(_q_head(w, "q_linear.weight", "q_linear.bias", 1))
    if f.get("num_puzzle_ids"):
        state["puzzle_emb.weights"] = w.take("embedding.puzzle_emb.weight")
    n_heads = int(f["n_heads"])
    for i in range(int(f["n_layers"])):
        src, dst = f"L_level.layers.{i}.", f"layers.{i}."
        state[src + "self_attn.qkv_proj.weight"] = unpermute_rows(w.take(dst + "mix.qkv.weight"),
                                                                  lambda t: permute_qkv(t, n_heads))  # fmt: skip
        state[src + "self_attn.o_proj.weight"] = w.take(dst + "mix.proj.weight")
        state[src + "mlp.gate_up_proj.weight"] = w.take(dst + "mlp.gate_up.weight")
        state[src + "mlp.down_proj.weight"] = w.take(dst + "mlp.down.weight")
    state["L_level.conv.weight"] = w.take("conv.conv.weight")
    state["L_level.alpha_1_param"] = w.take("residual_logit_a1")
    state["L_level.alpha_2_param"] = w.take("residual_logit_a2")
    w.finish()
    for key in [k for k in state if k.endswith(".weight") and k.split(".")[-2] in CASTED_LINEARS]:
        state[key[: -len("weight")] + "mask"] = torch.ones_like(state[key])
    train = _training(cfg)
    return Exported(system, state, {"arch": arch, **train})


EXPORTERS: dict[str, Callable[[str, Any, dict[str, Tensor]], Exported]] = {
    "trm": export_recursive, "hrm": export_recursive, "fprm": export_fprm,
}  # fmt: skip
FAMILY = {"trm": "trm", "hrm": "hrm", "fprm": "fprm"}  # the loopformer model family each system exports


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, int | float) and isinstance(b, int | float) and not isinstance(a, bool):
        return float(a) == float(b)
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def check_round_trip(exported: Exported, cfg: Any, weights: dict[str, Tensor]) -> None:
    """The converter reads ``exported`` back: the same weights bit for bit, the same model fields
    (CheckpointError naming the first difference)."""
    converted = converter(exported.system)(exported.saved(compiled=True), exported.config)
    if set(converted.weights) != set(weights):
        raise CheckpointError(f"export {exported.system}: the round trip gives other weights "
                              f"({sorted(set(converted.weights) ^ set(weights))[:6]})")  # fmt: skip
    for key, value in weights.items():
        if not torch.equal(converted.weights[key], value):
            raise CheckpointError(f"export {exported.system}: weight {key!r} changes in the round trip")
    fields = cfg.model.fields
    for key, value in converted.run["model"].items():
        if key == "name":
            continue
        mine = fields.get(key)
        if key == "loop":
            mine = {k: (mine or {}).get(k) for k in value}
        if not _same(mine, value):
            raise CheckpointError(f"export {exported.system}: the authors' model has model.{key}={value!r} where "
                                  f"this run has {mine!r}; it cannot be exported as it is")  # fmt: skip


def export_weights(system: str, cfg: Any, weights: dict[str, Tensor]) -> Exported:
    """The authors' checkpoint of a run (its ``RunConfig`` and weights), checked by the round trip."""
    if system not in EXPORTERS:
        raise KeyError(f"no export for {system!r} (available: {', '.join(sorted(EXPORTERS))})")
    if cfg.model.name != FAMILY[system]:
        raise ValueError(f"export {system}: the run's model is {cfg.model.name!r}, not {FAMILY[system]!r}")
    weights = {k: v.detach().cpu() for k, v in weights.items()}
    exported = EXPORTERS[system](system, cfg, weights)
    check_round_trip(exported, cfg, weights)
    return exported


def write_export(exported: Exported, path: str | Path, compiled: bool = True) -> tuple[Path, Path]:
    """``torch.save`` of the state dict at ``path`` and ``all_config.yaml`` beside it, each written atomically."""
    import yaml

    from loopformer.files import atomic_path, atomic_write_text

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        torch.save(exported.saved(compiled), tmp)
    config = path.parent / "all_config.yaml"
    atomic_write_text(config, yaml.safe_dump(exported.config, sort_keys=False), root=path.parent)
    return path, config


__all__ = ["EXPORTERS", "Exported", "check_round_trip", "export_weights", "unpermute_rows", "write_export"]
