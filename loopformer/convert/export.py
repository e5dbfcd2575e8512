"""``loopformer export SYSTEM RUN -o PATH``: a loopformer run -> a checkpoint the authors' code loads.

The inverse of ``loopformer convert``, for TRM (SamsungSAILMontreal/TinyRecursiveModels), HRM
(sapientinc/HRM) and FPRM (nilskiKonjIzDunava/fprm): the weights as their ``pretrain.py`` saves them
(``torch.save(ACTLossHead(model).state_dict())``, keys ``_orig_mod.model.inner.<name>`` of a compiled
model, or ``model.inner.<name>`` with ``compiled=False`` for a ``DISABLE_COMPILE=1`` load) and the
``all_config.yaml`` their ``pretrain.py`` writes beside the ``step_N`` files (``arch:`` holds the model).

Each key of the weights is placed by the converter's own key map run backwards, never by a second
table: the converter reads a stand-in of the authors' state dict (``reference_state``: meta tensors of the
shapes the exported ``all_config.yaml`` implies) and records for every loopformer weight the authors' key
and the transform it applied (``Converted.sources`` / ``transforms``); a row permutation (the q / k rows
of every head in loopformer's RoPE pair order, ``permute_qkv``) is inverted by reading it off the
transform itself (``unpermute_rows``), so the two cannot drift apart. What the converter drops is filled
as the authors' code initialises it: the Q head's continue row (weight 0, bias -5; never read with
``no_ACT_continue``) and FPRM's weight-dropout masks (all ones). A loopformer weight with no place in the
authors' model (a norm gain, tied embeddings) is an error naming it.

Every export is checked by the round trip before anything is written: the converter reads the exported
state and config back, and its weights must equal the run's bit for bit and its model fields the run's
(a field the authors' model cannot express, e.g. FPRM's ``conv_form: add``, is an error naming it).

``all_config.yaml`` holds every field the authors' ``PretrainConfig`` requires (``epochs`` included; HRM reads
``data_path``, TRM and FPRM ``data_paths``). A TRM / HRM ``arch`` leaves out what their ``create_model`` passes
from the data's ``dataset.json`` (seq_len, vocab_size, num_puzzle_identifiers: given twice, a TypeError); those
go under ``loopformer_data``, which their config ignores and ``loopformer convert`` reads, as it reads
``loopformer_data.run``: the run's experiment (data spec, held-out set, evaluation protocol and loops, training)
and which weights were exported, so ``export`` then ``convert`` gives back the run. ``forward_dtype`` is
the dtype the run trained in (``trained_dtype``: float32 unless it ran under bf16 autocast). Checked against
the authors' own classes by ``tools/parity/export_authors.py`` / ``tests/test_export_authors.py``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from loopformer.convert import converter
from loopformer.runs.checkpoint import CheckpointError

# all_config.yaml: the data the model was built for and, under its ``run`` key, the run's own experiment, which
# ``loopformer convert`` restores (the authors' code ignores the section)
DATA_KEY = "loopformer_data"
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


def _effective_fields(system: str, fields: dict[str, Any]) -> dict[str, Any]:
    """The run's model fields with the values their defaults stand for, as the converter reads them from the
    weights: HRM's ``l_layers`` 0 = ``n_layers``; ``puzzle_emb_dim`` -1 = ``d_model``, 0 = ``puzzle_emb_len``
    x ``d_model`` (TRM / HRM with a puzzle embedding)."""
    out = dict(fields)
    if system == "hrm" and not out.get("l_layers"):
        out["l_layers"] = out.get("n_layers")
    if system in ("trm", "hrm") and out.get("num_puzzle_ids") and out.get("puzzle_emb_dim") in (-1, 0):
        d = int(out["d_model"])
        out["puzzle_emb_dim"] = d if out["puzzle_emb_dim"] == -1 else int(out.get("puzzle_emb_len") or 0) * d
    return out


def _recursive_arch(system: str, f: dict[str, Any], cfg: Any, forward_dtype: str) -> dict[str, Any]:
    """``arch:`` of all_config.yaml. Never seq_len, vocab_size or num_puzzle_identifiers: the authors'
    ``create_model`` passes those from the data's metadata beside ``**arch`` (a TypeError when both do)."""
    tc, f = cfg.train, _effective_fields(system, f)
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
        "halt_max_steps": int(tc.max_segments),
        "halt_exploration_prob": float(tc.halt_exploration),
        "rms_norm_eps": float(f["norm_eps"]),
        "forward_dtype": forward_dtype,
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


def _epochs(cfg: Any) -> tuple[int, str | None]:
    """The run's length in the authors' ``epochs`` (their pretrain.py: total steps = epochs x groups x mean
    examples per group / global batch; loopformer's sets are one example per group): steps x batch / train
    rows, rounded up; 1 with a note when the training set's size is not in the config (data.train_size 0)."""
    tc, rows = cfg.train, int(cfg.data.train_size or 0)
    if rows <= 0 and cfg.data.train_path:  # all rows of an HRM / TRM folder: its dataset.json counts them
        from loopformer.convert.recursive import dataset_meta

        meta = dataset_meta({"data_path": str(cfg.data.train_path)})
        rows = int(meta.get("total_groups", 0) * meta.get("mean_puzzle_examples", 0))
    if rows > 0:
        return max(1, math.ceil(int(tc.steps) * int(tc.batch_size) / rows)), None
    return 1, "epochs: 1 (the run's config does not give its training set's size; their evaluate ignores it)"


def _training(cfg: Any, system: str) -> tuple[dict[str, Any], list[str]]:
    """The authors' top-level training keys (cfg_pretrain.yaml) for loopformer's ``train`` section: every
    field their ``PretrainConfig`` requires (HRM reads one ``data_path``, TRM and FPRM ``data_paths``)."""
    tc, data = cfg.train, cfg.data
    epochs, note = _epochs(cfg)
    path = str(data.train_path or f"data/{data.task}")  # the converter reads the task off it
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
        "data_path" if system == "hrm" else "data_paths": path if system == "hrm" else [path],
        "epochs": epochs,
    }, [note] if note else []


def trained_dtype(cfg: Any, checkpoint: str | Path | None = None) -> tuple[str, str]:
    """(the dtype the run's forward trained in, why): ``bfloat16`` under bf16 autocast (``bf16: true``, or
    ``auto`` on CUDA as the provenance record of the training that reached ``checkpoint`` says), ``float32``
    otherwise; a run with ``bf16: auto`` and no record of its device (a converted run) keeps the authors'
    default ``bfloat16``."""
    if cfg.bf16 is True or cfg.bf16 is False:
        return ("bfloat16" if cfg.bf16 else "float32"), f"bf16: {str(cfg.bf16).lower()}"
    device = None
    if checkpoint is not None:
        from loopformer.runs.folder import read_records, record_for_step, run_at_or_above

        folder = run_at_or_above(checkpoint)
        digits = "".join(c for c in Path(checkpoint).name if c.isdigit())
        if folder is not None:
            record = record_for_step(folder, int(digits)) if digits else (read_records(folder) or [None])[-1]
            device = (record or {}).get("device")
    if device is None and cfg.device != "auto":
        device = cfg.device
    if device is None:
        return "bfloat16", "bf16: auto and no record of the training device: the authors' default bfloat16"
    on_cuda = str(device).startswith("cuda")
    return ("bfloat16" if on_cuda else "float32"), f"bf16: auto, trained on {device}"


def _data_metadata(f: dict[str, Any]) -> dict[str, int]:
    """What the authors' code reads from the data (``train/dataset.json`` under the data path), as the run's
    model was built for it: read back by ``loopformer convert`` (seq_len), ignored by their PretrainConfig.
    Their data always holds the blank identifier 0, so at least one puzzle identifier."""
    return {"seq_len": int(f["seq_len"]), "vocab_size": int(f["vocab_size"]),
            "num_puzzle_identifiers": max(1, int(f.get("num_puzzle_ids") or 0))}  # fmt: skip


def _fprm_arch(system: str, f: dict[str, Any], cfg: Any, forward_dtype: str) -> dict[str, Any]:
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
        "halting_mechanism": "fixed_point", "no_ACT_continue": True, "mlp_t": False,
        "forward_dtype": forward_dtype,
        "loss": {"name": "losses@ACTLossHead", "q_loss_coeff": float(cfg.train.q_loss_weight),
                 "loss_type": "stablemax_cross_entropy" if cfg.train.loss == "stablemax" else "softmax_cross_entropy"},
    }  # fmt: skip
    return arch


# system -> the ``arch`` section of its all_config.yaml for a run (the loopformer model family is the system's)
EXPORTERS: dict[str, Callable[[str, dict[str, Any], Any, str], dict[str, Any]]] = {
    "trm": _recursive_arch, "hrm": _recursive_arch, "fprm": _fprm_arch,
}  # fmt: skip


def reference_state(system: str, ref: dict[str, Any]) -> dict[str, Tensor]:
    """Meta tensors of the shapes the authors' model has for ``ref`` (as their pretrain.py names them)."""
    a = {**ref.get(DATA_KEY, {}), **ref["arch"]}  # TRM / HRM: the data's sizes beside arch (loopformer_data)
    d, vocab = int(a["hidden_size"]), int(a["vocab_size"])
    inter = -(-round(float(a.get("expansion", 4)) * d * 2 / 3) // 256) * 256  # their _find_multiple(.., 256)

    def meta(*shape: int) -> Tensor:
        return torch.empty(shape, device="meta", dtype=torch.float32)

    def blocks(level: str, n: int, mlp_t: bool = False) -> dict[str, Tensor]:
        out = {}
        for i in range(n):
            p = f"{level}.layers.{i}."
            if mlp_t:
                length = int(a["seq_len"]) + int(a.get("puzzle_emb_len") or 0)
                inner = -(-round(float(a.get("expansion", 4)) * length * 2 / 3) // 256) * 256
                out.update({p + "mlp_t.gate_up_proj.weight": meta(2 * inner, length),
                            p + "mlp_t.down_proj.weight": meta(length, inner)})  # fmt: skip
            else:
                out.update({p + "self_attn.qkv_proj.weight": meta(3 * d, d),
                            p + "self_attn.o_proj.weight": meta(d, d)})  # fmt: skip
            out.update({p + "mlp.gate_up_proj.weight": meta(2 * inter, d),
                        p + "mlp.down_proj.weight": meta(d, inter)})  # fmt: skip
        return out

    state = {"embed_tokens.embedding_weight": meta(vocab, d), "lm_head.weight": meta(vocab, d),
             "q_head.weight": meta(2, d), "q_head.bias": meta(2)}  # fmt: skip
    if int(a.get("puzzle_emb_ndim") or 0):
        state["puzzle_emb.weights"] = meta(int(a["num_puzzle_identifiers"]), int(a["puzzle_emb_ndim"]))
    if system == "fprm":
        state.update(blocks("L_level", int(a["L_layers"])))
        k = int(a["conv_kernel_size"])
        conv = meta(d, 1, k, k) if a["conv_type"] == "conv2d" else meta(d, 1, k)
        state.update(
            {"L_level.conv.weight": conv, "L_level.alpha_1_param": meta(d), "L_level.alpha_2_param": meta(d)}
        )
        return state
    state.update({"H_init": meta(d), "L_init": meta(d)})
    if system == "hrm":
        state.update(blocks("H_level", int(a["H_layers"])))
    state.update(blocks("L_level", int(a["L_layers"]), bool(a.get("mlp_t"))))
    return state


def authors_state(system: str, config: dict[str, Any], weights: dict[str, Tensor]) -> dict[str, Tensor]:
    """The authors' state dict of ``weights`` for their configuration ``config``: the converter's key map run
    backwards (module docstring)."""
    shapes = reference_state(system, config)
    probe = converter(system)(shapes, copy.deepcopy(config))
    left = sorted(set(weights) - set(probe.sources))
    if left:
        raise CheckpointError(f"export {system}: {len(left)} loopformer weights have no place in the "
                              f"authors' model: {left[:6]}{' ...' if len(left) > 6 else ''}")  # fmt: skip
    state: dict[str, Tensor] = {}
    for ours, theirs in probe.sources.items():
        if ours not in weights:
            raise CheckpointError(f"export {system}: the run has no weight {ours!r} the authors' model needs")
        t, transform, rows = weights[ours], probe.transforms.get(ours), shapes[theirs].shape[0]
        if transform is not None and theirs.startswith("q_head.") and rows > t.shape[0]:
            # the rows the converter drops: the authors' init (weight 0, bias -5), never read with no_ACT_continue
            fill = Q_CONTINUE_BIAS if theirs.endswith(".bias") else 0.0
            t = torch.cat([t, torch.full((rows - t.shape[0], *t.shape[1:]), fill, dtype=t.dtype)])
        elif transform is not None:
            t = unpermute_rows(t, transform)
        state[theirs] = t
    if system == "fprm":  # the weight-dropout masks of the authors' masked linears: all ones
        for key in [k for k in state if k.endswith(".weight") and k.split(".")[-2] in CASTED_LINEARS]:
            state[key[: -len("weight")] + "mask"] = torch.ones_like(state[key])
    return state


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
    fields = _effective_fields(exported.system, cfg.model.fields)
    for key, value in converted.run["model"].items():
        if key == "name":
            continue
        mine = fields.get(key)
        if key == "loop":
            mine = {k: (mine or {}).get(k) for k in value}
        if not _same(mine, value):
            raise CheckpointError(f"export {exported.system}: the authors' model has model.{key}={value!r} where "
                                  f"this run has {mine!r}; it cannot be exported as it is")  # fmt: skip


def export_weights(system: str, cfg: Any, weights: dict[str, Tensor], checkpoint: str | Path | None = None,
                   label: str = "model") -> Exported:  # fmt: skip
    """The authors' checkpoint of a run (its ``RunConfig`` and weights, ``label``: ``ema`` or ``model``), checked by
    the round trip; ``checkpoint`` (the run's checkpoint folder) tells ``trained_dtype`` the device it trained on.
    ``DATA_KEY``'s ``run`` carries the run's experiment (every config section but the run folder: data spec and
    held-out set, evaluation protocol and loops, training) and which weights were exported, for ``loopformer
    convert``."""
    from loopformer.config import to_dict

    if system not in EXPORTERS:
        raise KeyError(f"no export for {system!r} (available: {', '.join(sorted(EXPORTERS))})")
    if cfg.model.name != system:
        raise ValueError(f"export {system}: the run's model is {cfg.model.name!r}, not {system!r}")
    weights = {k: v.detach().cpu() for k, v in weights.items()}
    forward_dtype, why = trained_dtype(cfg, checkpoint)
    train, notes = _training(cfg, system)
    config = {"arch": EXPORTERS[system](system, cfg.model.fields, cfg, forward_dtype), **train}
    experiment = {k: v for k, v in to_dict(cfg).items() if k != "out_dir"}
    config[DATA_KEY] = {**(_data_metadata(cfg.model.fields) if system in ("trm", "hrm") else {}), "run": {
        "config": experiment, "weights": label, "checkpoint": None if checkpoint is None else str(checkpoint)}}
    if system in ("trm", "hrm"):
        if not config["arch"]["puzzle_emb_ndim"]:  # their code reads model.model.puzzle_emb unconditionally
            notes.append("no puzzle embedding: " + (
                "TRM's load_checkpoint reads model.model.puzzle_emb before loading (AttributeError); load with "
                "model.load_state_dict(torch.load(PATH), assign=True)" if system == "trm" else
                "HRM's create_model gives model.model.puzzle_emb to its sign-SGD (AttributeError)"))  # fmt: skip
        if system == "hrm" and forward_dtype == "float32":
            notes.append("HRM's flash-attn runs float16 / bfloat16 only: float32 needs SDPA in its place")
    exported = Exported(system, authors_state(system, config, weights), config, [
        f"arch.forward_dtype: {forward_dtype} ({why})", *notes])
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


__all__ = ["DATA_KEY", "EXPORTERS", "Exported", "authors_state", "check_round_trip", "export_weights", "reference_state",
           "trained_dtype", "unpermute_rows", "write_export"]
