"""``loopformer convert trm|hrm``: a TinyRecursiveModels or HRM checkpoint -> a loopformer ``trm`` / ``hrm`` run folder.

Both repositories save ``torch.save(ACTLossHead(model).state_dict())`` (``pretrain.py:
save_train_state``), keys ``[_orig_mod.]model.inner.<name>`` (``_orig_mod.`` when compiled), and write
``all_config.yaml`` (the pydantic ``PretrainConfig``: ``arch`` holds the model's settings) beside the
``step_N`` files; it is read when ``--config`` is not given. ``vocab_size``, ``num_puzzle_identifiers``
and ``puzzle_emb_ndim`` come from the weights' shapes; ``seq_len`` (not in the weights of an attention
model) from ``arch.seq_len``, the dataset's ``train/dataset.json`` under ``data_paths[0]`` or the task.

Reference -> loopformer tensors (``models/layers.py``):
- ``embed_tokens.embedding_weight`` -> ``embedding.tokens.weight``; ``puzzle_emb.weights`` (a buffer
  trained by sign-SGD) -> ``embedding.puzzle_emb.weight``; ``lm_head.weight`` -> ``lm_head.weight``.
- per block: ``self_attn.qkv_proj`` -> ``mix.qkv`` with each head's q / k rows permuted from TRM's
  rotate-half RoPE (pairs i, i + D/2) to loopformer's interleaved pairs (2i, 2i + 1), an exact
  re-labelling; ``self_attn.o_proj`` -> ``mix.proj``; ``mlp.gate_up_proj`` / ``down_proj`` ->
  ``mlp.gate_up`` / ``down``; TRM ``mlp_t.*`` -> ``mix.mlp.*``. The RMSNorms have no weights.
- ``H_init`` / ``L_init`` -> the (answer, latent) initial vectors; ``q_head`` (2 rows: halt,
  continue) -> TRM: row 0 (``no_ACT_continue``, the continue logit is never used), HRM: both rows.

TRM specifics (``models/recursive_reasoning/trm.py``): one ``L_level`` net used for both updates;
``H_cycles`` -> the loop's ``max_steps`` (T), ``L_cycles`` -> ``n_inner`` (n), ``L_layers`` -> ``n_layers``;
``puzzle_emb_len`` (16 by default) puzzle tokens; ``mlp_t`` -> ``mixer="mlp"``. HRM specifics (sapientinc/HRM
``models/hrm/hrm_act_v1.py``, or the HRM in TinyRecursiveModels): ``H_level`` / ``L_level`` -> ``H`` / ``L``;
``L_cycles`` -> ``l_cycles``, ``H_layers`` / ``L_layers`` -> ``n_layers`` / ``l_layers``;
``ceil(puzzle_emb_ndim / d)`` puzzle tokens.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from loopformer.convert import Converted, KeyMap, given, strip_prefixes
from loopformer.files import read_json
from loopformer.runs.checkpoint import CheckpointError

PREFIXES = ("_orig_mod.", "model.", "inner.")

# config/arch/trm.yaml, config/arch/hrm.yaml (TRM repository) and config/arch/hrm_v1.yaml (HRM)
ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "trm": {
        "H_cycles": 3,
        "L_cycles": 6,
        "num_heads": 8,
        "expansion": 4,
        "pos_encodings": "rope",
        "puzzle_emb_len": 16,
        "halt_max_steps": 16,
        "halt_exploration_prob": 0.1,
        "rms_norm_eps": 1e-5,
        "mlp_t": False,
        "no_ACT_continue": True,
        "loss": {"loss_type": "stablemax_cross_entropy"},
    },
    "hrm": {
        "H_cycles": 2,
        "L_cycles": 2,
        "num_heads": 8,
        "expansion": 4,
        "pos_encodings": "rope",
        "halt_max_steps": 16,
        "halt_exploration_prob": 0.1,
        "rms_norm_eps": 1e-5,
        "loss": {"loss_type": "stablemax_cross_entropy"},
    },
}
# cfg_pretrain.yaml of both repositories
TRAIN_DEFAULTS = {
    "global_batch_size": 768,
    "lr": 1e-4,
    "lr_min_ratio": 1.0,
    "lr_warmup_steps": 2000,
    "beta1": 0.9,
    "beta2": 0.95,
    "weight_decay": 0.1,
    "puzzle_emb_weight_decay": 0.1,
    "puzzle_emb_lr": 1e-2,
    "ema": False,
    "ema_rate": 0.999,
}


def arch_settings(system: str, ref: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(arch, training settings) with the reference defaults filled in."""
    arch_in = ref.get("arch", ref)
    if not isinstance(arch_in, dict):
        raise ValueError(f"the {system} config's 'arch' must be a mapping, got {arch_in!r}")
    arch = {**ARCH_DEFAULTS[system], **arch_in}
    train = {**TRAIN_DEFAULTS, **{k: v for k, v in ref.items() if k in TRAIN_DEFAULTS}}
    return arch, train


def rope_permutation(head_dim: int) -> Tensor:
    """Index ``perm`` with ``ours[p] = theirs[perm[p]]``: rotate-half pairs (j, j + D/2) -> interleaved pairs
    (2j, 2j + 1); a common permutation of q and k leaves every attention score unchanged (TRM, HRM, FPRM)."""
    half = head_dim // 2
    return torch.tensor([p // 2 + (p % 2) * half for p in range(head_dim)])


def permute_qkv(w: Tensor, n_heads: int) -> Tensor:
    """qkv rows [q heads | k heads | v heads] with each q / k head's rows put in RoPE pair order."""
    if w.shape[0] % (3 * n_heads):
        raise CheckpointError(f"qkv_proj of shape {tuple(w.shape)} does not fit {n_heads} heads")
    head_dim = w.shape[0] // 3 // n_heads
    perm = rope_permutation(head_dim)
    rows = torch.arange(w.shape[0]).view(3, n_heads, head_dim)
    rows[:2] = rows[:2][..., perm]
    return w[rows.reshape(-1)]


def map_block(km: KeyMap, src: str, dst: str, n_heads: int, rope: bool) -> None:
    if km.has(f"{src}.mlp_t.gate_up_proj.weight"):
        km.put(f"{dst}.mix.mlp.gate_up.weight", f"{src}.mlp_t.gate_up_proj.weight")
        km.put(f"{dst}.mix.mlp.down.weight", f"{src}.mlp_t.down_proj.weight")
    else:
        qkv = km.peek(f"{src}.self_attn.qkv_proj.weight")
        if qkv.shape[0] % 3:
            raise CheckpointError(
                f"{src}.self_attn.qkv_proj.weight: grouped-query attention is not supported"
            )
        km.put(
            f"{dst}.mix.qkv.weight",
            f"{src}.self_attn.qkv_proj.weight",
            (lambda w: permute_qkv(w, n_heads)) if rope else None,
        )
        km.put(f"{dst}.mix.proj.weight", f"{src}.self_attn.o_proj.weight")
    km.put(f"{dst}.mlp.gate_up.weight", f"{src}.mlp.gate_up_proj.weight")
    km.put(f"{dst}.mlp.down.weight", f"{src}.mlp.down_proj.weight")


def map_weights(
    km: KeyMap,
    model: dict[str, Any],
    levels: tuple[tuple[str, str, int], ...],
    inits: tuple[str, str],
    rope: bool,
    q_rows: int | None,
) -> None:
    """The TRM / HRM key map: the token (and puzzle) embeddings; the blocks of every ``(reference
    level, loopformer net, layers)``; ``H_init`` / ``L_init`` -> ``inits``; the head; the Q head
    (its first ``q_rows`` rows, all when None)."""
    km.put("embedding.tokens.weight", "embed_tokens.embedding_weight")
    if model["num_puzzle_ids"]:
        km.put("embedding.puzzle_emb.weight", "puzzle_emb.weights")
    for level, ours, n in levels:
        for i in range(n):
            map_block(km, f"{level}.layers.{i}", f"{ours}.layers.{i}", model["n_heads"], rope)
    km.put(inits[0], "H_init")
    km.put(inits[1], "L_init")
    km.put("lm_head.weight", "lm_head.weight")
    rows = None if q_rows is None else (lambda t: t[:q_rows].clone())
    km.put("q_proj.weight", "q_head.weight", rows)
    km.put("q_proj.bias", "q_head.bias", rows)


def embedding_shapes(km: KeyMap) -> tuple[int, int, int, int]:
    """(vocab size, d_model, puzzle_emb_ndim, num_puzzle_identifiers) from the weights' shapes."""
    vocab, d = km.peek("embed_tokens.embedding_weight").shape
    ndim = km.peek("puzzle_emb.weights").shape[1] if km.has("puzzle_emb.weights") else 0
    n_ids = km.peek("puzzle_emb.weights").shape[0] if ndim else 0
    return int(vocab), int(d), int(ndim), int(n_ids)


def reference_seq_len(arch: dict[str, Any], ref: dict[str, Any]) -> int | None:
    """``arch.seq_len``, else ``loopformer_data.seq_len`` (``loopformer export`` writes it outside ``arch``),
    else the dataset's ``train/dataset.json``; None when none has it."""
    exported = ref.get("loopformer_data") if isinstance(ref.get("loopformer_data"), dict) else {}
    seq_len = arch.get("seq_len") or given("model.seq_len") or exported.get("seq_len")
    return seq_len or dataset_meta(ref).get("seq_len")


def no_seq_len(system: str) -> ValueError:
    return ValueError(
        f"the {system} config gives no seq_len and the data path has no train/dataset.json; "
        "pass --set model.seq_len=N"
    )


def model_fields(
    km: KeyMap, arch: dict[str, Any], seq_len: int, layers: str, puzzle_emb_len: int
) -> dict[str, Any]:
    """The model fields TRM and HRM share: sizes from the weights' shapes and ``arch``, ``n_layers``
    counted under the ``layers`` prefix, ``H_cycles`` as the loop's ``max_steps``."""
    vocab, d, ndim, n_ids = embedding_shapes(km)
    return {
        "vocab_size": vocab,
        "seq_len": int(seq_len),
        "d_model": d,
        "n_heads": int(arch["num_heads"]),
        "n_layers": count_layers(km, layers),
        "expansion": float(arch["expansion"]),
        "num_puzzle_ids": n_ids,
        "puzzle_emb_len": int(puzzle_emb_len),
        "puzzle_emb_dim": ndim,
        "norm_eps": float(arch["rms_norm_eps"]),
        "loop": {"max_steps": int(arch["H_cycles"])},
    }


def count_layers(km: KeyMap, prefix: str) -> int:
    ids = {int(k[len(prefix) :].split(".")[0]) for k in km.keys_with(prefix)}
    if not ids or ids != set(range(len(ids))):
        raise CheckpointError(f"{km.source}: no (or non-contiguous) layers under {prefix!r}: {sorted(ids)}")
    return len(ids)


def dataset_meta(ref: dict[str, Any]) -> dict[str, Any]:
    paths = ref.get("data_paths") or ([ref["data_path"]] if ref.get("data_path") else [])
    if not paths:
        return {}
    meta = Path(paths[0]) / "train" / "dataset.json"
    return read_json(meta) if meta.exists() else {}


def task_section(ref: dict[str, Any], seq_len: int) -> dict[str, Any]:
    """loopformer ``data`` section: the task named by the reference's data path."""
    paths = ref.get("data_paths") or ([ref["data_path"]] if ref.get("data_path") else [])
    name = str(paths[0]) if paths else ""
    side = math.isqrt(seq_len)
    lowered = name.lower()
    if "arc" in lowered:
        data: dict[str, Any] = {"task": "arc"}
    elif "maze" in lowered:
        data = {"task": "maze", "options": {"size": side}}
    elif "sudoku" in lowered or (not name and side * side == seq_len):
        data = {"task": "sudoku", "options": {"size": side}, "eval_size": 64}
    elif given("data.task"):  # --set data.task=...: the run's data section comes from the overrides
        data = {"task": given("data.task")}
    else:
        raise ValueError(
            f"cannot tell the task from data path {name!r}; pass --set data.task=... (and data.eval_path)"
        )
    if name and (Path(name) / "test").is_dir():
        data["eval_path"] = str(Path(name) / "test")
    return data


def eval_loop(model: dict[str, Any], arch: dict[str, Any]) -> dict[str, Any]:
    """The reference evaluates ``halt_max_steps`` segments of ``H_cycles`` cycles each from the initial
    state, never halting early (``pretrain.py: evaluate``); under no gradient that is one loop of
    ``halt_max_steps * H_cycles`` steps (tested against the fixtures), which every loopformer evaluation
    path runs (``eval.segments`` is honoured by the trainer's evaluation only)."""
    return {"halting": "fixed", "max_steps": int(model["loop"]["max_steps"]) * int(arch["halt_max_steps"])}


def run_config(
    model: dict[str, Any], arch: dict[str, Any], ref: dict[str, Any], train: dict[str, Any]
) -> dict[str, Any]:
    """The converted run: the model, the task named by the reference's data path, ``train``, and the
    reference's evaluation as ``loop_eval``."""
    run = {
        "model": model,
        "data": task_section(ref, model["seq_len"]),
        "train": train,
        "eval": {"segments": 1, "batch_size": 64},
        "loop_eval": eval_loop(model, arch),
    }
    if arch.get("forward_dtype", "bfloat16") in ("float32", "float64"):
        run["bf16"] = False  # full precision stays full precision (export writes float32 back)
    return run


def train_section(arch: dict[str, Any], train: dict[str, Any]) -> dict[str, Any]:
    loss = arch.get("loss", {}).get("loss_type", "stablemax_cross_entropy")
    return {
        "mode": "deep_supervision",
        "batch_size": int(train["global_batch_size"]),
        "lr": float(train["lr"]),
        "weight_decay": float(train["weight_decay"]),
        "betas": [float(train["beta1"]), float(train["beta2"])],
        "warmup_steps": int(train["lr_warmup_steps"]),
        "schedule": "constant" if float(train["lr_min_ratio"]) == 1.0 else "cosine",
        "min_lr_ratio": float(train["lr_min_ratio"]),
        "grad_clip": 0.0,
        "optimizer": "adam_atan2",
        "decay_all": True,
        # the authors' CastedSparseEmbeddingSignSGD_Distributed on the puzzle-embedding table
        "puzzle_emb_optimizer": "sign_sgd",
        "puzzle_emb_lr": float(train["puzzle_emb_lr"]),
        "puzzle_emb_weight_decay": float(train["puzzle_emb_weight_decay"]),
        "ema": float(train["ema_rate"]) if train["ema"] else 0.0,
        "ema_warmup": False,
        "loss": "stablemax" if loss == "stablemax_cross_entropy" else "ce",
        "q_loss_weight": 0.5,
        "max_segments": int(arch["halt_max_steps"]),
        "halt_on_q": True,
        "halt_exploration": float(arch["halt_exploration_prob"]),
    }


# ------------------------------------------------------------------------------------------- TRM


def trm_model_section(km: KeyMap, arch: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    vocab, d, ndim, n_ids = embedding_shapes(km)
    plen = (int(arch["puzzle_emb_len"]) or -(ndim // -d)) if ndim else 0
    mlp_t = km.has("L_level.layers.0.mlp_t.gate_up_proj.weight")
    seq_len = reference_seq_len(arch, ref)
    if seq_len is None and mlp_t:
        seq_len = km.peek("L_level.layers.0.mlp_t.gate_up_proj.weight").shape[1] - plen
    if seq_len is None:
        raise no_seq_len("TRM")
    pos = arch["pos_encodings"]
    if pos not in ("rope", "none"):
        raise NotImplementedError(f"TRM pos_encodings={pos!r} is not supported (rope or none)")
    if not arch.get("no_ACT_continue", True):
        raise NotImplementedError(
            "TRM with no_ACT_continue=False (Q-learning continue target) is not supported"
        )
    return {
        "name": "trm",
        **model_fields(km, arch, seq_len, "L_level.layers.", plen),
        "n_inner": int(arch["L_cycles"]),
        "mixer": "mlp" if mlp_t else "attention",
        "rope": pos == "rope",
    }


def map_trm_weights(km: KeyMap, model: dict[str, Any]) -> None:
    """TRM's one ``L_level`` net -> ``net``, ``H_init`` / ``L_init`` -> ``y_init`` / ``z_init``, the
    Q head's row 0 (also TRM-DEQ's, ``loopformer.convert.attractor``)."""
    levels = (("L_level", "net", model["n_layers"]),)
    map_weights(km, model, levels, ("y_init", "z_init"), model["rope"], q_rows=1)


def convert_trm(state: dict[str, Tensor], ref: dict[str, Any]) -> Converted:
    km = KeyMap(strip_prefixes(state, PREFIXES), "TRM checkpoint")
    arch, train = arch_settings("trm", ref)
    model = trm_model_section(km, arch, ref)
    map_trm_weights(km, model)
    km.finish()
    run = run_config(model, arch, ref, train_section(arch, train))
    notes = ["q_head row 1 (q_continue) dropped: TRM's no_ACT_continue never uses it"]
    return km.converted(run, notes)


# ------------------------------------------------------------------------------------------- HRM


def hrm_model_section(km: KeyMap, arch: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    vocab, d, ndim, n_ids = embedding_shapes(km)
    seq_len = reference_seq_len(arch, ref)
    if seq_len is None:
        raise no_seq_len("HRM")
    if arch["pos_encodings"] != "rope":
        raise NotImplementedError(f"HRM pos_encodings={arch['pos_encodings']!r} is not supported (rope only)")
    return {
        "name": "hrm",
        **model_fields(km, arch, seq_len, "H_level.layers.", -(ndim // -d)),
        "l_layers": count_layers(km, "L_level.layers."),
        "l_cycles": int(arch["L_cycles"]),
    }


def convert_hrm(state: dict[str, Tensor], ref: dict[str, Any]) -> Converted:
    km = KeyMap(strip_prefixes(state, PREFIXES), "HRM checkpoint")
    arch, train = arch_settings("hrm", ref)
    model = hrm_model_section(km, arch, ref)
    levels = (("H_level", "H", model["n_layers"]), ("L_level", "L", model["l_layers"]))
    map_weights(km, model, levels, ("h_init", "l_init"), rope=True, q_rows=None)
    km.finish()
    training = {**train_section(arch, train), "q_learning": True}
    run = run_config(model, arch, ref, training)
    return km.converted(run)
