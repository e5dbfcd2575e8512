"""``loopformer convert attractor``: an Attractor puzzle checkpoint (TRM-DEQ) -> an ``attractor_puzzle`` run folder.

Reference: github jacobfa/Attractor, ``experiments/attractor_puzzles/trm/trm_deq.py`` (``TRMDEQ``), trained
by ``train_trm_deq.py``, which saves ``{"model_state": ACTLossHeadDEQ.state_dict(), "model_config": ...,
"train_config": ...}`` (pass the state dict; ``--config`` a JSON / YAML with ``model_config`` and
``train_config``, or the flat ``model_config.json`` the script writes). TRM-DEQ keeps TRM's module names
(``embed_tokens``, ``L_level.layers.N``, ``H_init`` / ``L_init``, ``lm_head``, ``q_head``, ``puzzle_emb``),
so the key mapping is TRM's (``loopformer.convert.recursive``); the DEQ fields come from the model config:
``deq_max_iter`` / ``deq_min_iter`` / ``deq_tol`` / ``deq_anderson_m`` / ``deq_anderson_beta`` /
``bptt_through`` and, when ``jacobian_reg_lambda > 0``, ``jacobian_samples``; the regulariser's weight
``lambda / global_batch_size`` becomes ``train.ponder_weight``. The optimiser is AdamW over every
parameter (``_build_optimizers``) plus sign-SGD on the puzzle embedding.

A state dict of the Attractor *language model* (``attractor/models/attractor/attractor.py``, keys
``transformer.wte.weight``, ...) goes to ``loopformer.convert.attractor_lm`` instead.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from loopformer.convert import Converted, KeyMap, strip_prefixes
from loopformer.convert.recursive import (
    PREFIXES,
    TRAIN_DEFAULTS,
    map_trm_weights,
    task_section,
    trm_model_section,
)
from loopformer.convert.recursive import train_section as recursive_train_section

# TrainTRMDEQConfig defaults (train_trm_deq.py)
DEFAULTS: dict[str, Any] = {
    "H_cycles": 3,
    "L_cycles": 6,
    "num_heads": 8,
    "expansion": 4.0,
    "pos_encodings": "rope",
    "halt_max_steps": 16,
    "halt_exploration_prob": 0.1,
    "puzzle_emb_len": 16,
    "no_ACT_continue": True,
    "rms_norm_eps": 1e-5,
    "deq_max_iter": 8,
    "deq_min_iter": 4,
    "deq_tol": 1e-3,
    "deq_anderson_m": 5,
    "deq_anderson_beta": 1.0,
    "bptt_through": 2,
    "jacobian_reg_lambda": 1e-3,
    "jacobian_reg_n_samples": 1,
    **TRAIN_DEFAULTS,  # TRM's cfg_pretrain.yaml values, but for these three
    "weight_decay": 1.0,
    "puzzle_emb_weight_decay": 1.0,
    "ema": True,
    "loss_type": "stablemax_cross_entropy",
}


def settings(ref: dict[str, Any]) -> dict[str, Any]:
    """Reference settings: defaults < train_config < model_config (or a flat dict)."""
    merged = dict(DEFAULTS)
    for part in ("train_config", "model_config"):
        if isinstance(ref.get(part), dict):
            merged.update(ref[part])
    merged.update({k: v for k, v in ref.items() if k not in ("train_config", "model_config")})
    return merged


def model_section(km: KeyMap, s: dict[str, Any]) -> dict[str, Any]:
    model = trm_model_section(km, s, {})
    lam = float(s["jacobian_reg_lambda"])
    model.update(
        name="attractor_puzzle",
        deq_max_iter=int(s["deq_max_iter"]),
        deq_min_iter=int(s["deq_min_iter"]),
        deq_tol=float(s["deq_tol"]),
        deq_anderson_m=int(s["deq_anderson_m"]),
        deq_anderson_beta=float(s["deq_anderson_beta"]),
        deq_anderson_reg=1e-4,
        deq_anderson_reg_relative=False,
        bptt_through=int(s["bptt_through"]),
        jacobian_samples=int(s["jacobian_reg_n_samples"]) if lam > 0 else 0,
    )
    model.pop("n_inner", None)  # TRM-DEQ's inner loop is the solve (L_cycles is informational only)
    return model


def train_section(s: dict[str, Any]) -> dict[str, Any]:
    """TRM's training section (``loopformer.convert.recursive.train_section``) with TRM-DEQ's
    AdamW, sign-SGD puzzle embedding and the Jacobian regulariser as ``ponder_weight``."""
    section = recursive_train_section({**s, "loss": {"loss_type": s["loss_type"]}}, s)
    section.update(
        optimizer="adamw",
        puzzle_emb_optimizer="sign_sgd",
        ponder_weight=float(s["jacobian_reg_lambda"]) / section["batch_size"],
    )
    return section


def convert(state: dict[str, Tensor], ref: dict[str, Any]) -> Converted:
    lm_state = strip_prefixes(state, ("_orig_mod.", "module."))
    if "transformer.wte.weight" in lm_state:  # the language model (attractor/models/attractor)
        from loopformer.convert import attractor_lm

        return attractor_lm.convert(lm_state, ref)
    km = KeyMap(strip_prefixes(state, PREFIXES), "Attractor TRM-DEQ checkpoint")
    s = settings(ref)
    model = model_section(km, s)
    map_trm_weights(km, model)
    km.finish()
    data_ref = {"data_path": s.get("data_dir", "")} if s.get("data_dir") else {}
    run = {
        "model": model,
        "data": task_section(data_ref, model["seq_len"]),
        "train": train_section(s),
        "eval": {"segments": int(s["halt_max_steps"]), "batch_size": 64},
        "bf16": s.get("forward_dtype", "bfloat16") == "bfloat16",
    }
    notes = [
        "q_head row 1 (q_continue) dropped: no_ACT_continue never uses it",
        f"Jacobian regulariser weight train.ponder_weight = lambda / global batch = {run['train']['ponder_weight']:.3g}",
    ]
    return km.converted(run, notes)
