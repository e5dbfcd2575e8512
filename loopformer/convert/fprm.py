"""FPRM key mapping: a checkpoint of the authors' ``pretrain.py`` (nilskiKonjIzDunava/fprm) -> loopformer.

The reference model is ``FixedPointReasoningModel_ACTV1`` (``models/fixed_point_reasoning/fprm.py``)
inside ``ACTLossHead``, usually ``torch.compile``d, so its keys read
``_orig_mod.model.inner.<name>``. ``ref_config`` is the run's ``all_config.yaml`` (``arch:`` holds the
model fields) or an ``arch`` mapping itself; missing fields take the authors' defaults
(``models/config.py``, ``models/fixed_point_reasoning/fprm_config.py``).

Weights:

- ``embed_tokens.embedding_weight`` -> ``embedding.tokens.weight``; ``puzzle_emb.weights`` (a
  ``puzzle_emb_ndim``-wide table, zero-padded to ``puzzle_emb_len`` tokens) ->
  ``embedding.puzzle_emb.weight`` with ``puzzle_emb_dim = puzzle_emb_ndim``;
- ``L_level.layers.i.self_attn.qkv_proj`` -> ``layers.i.mix.qkv``, with the q and k rows of every
  head permuted: the authors rotate channel pairs ``(j, j + D/2)`` (``rotate_half``), loopformer
  pairs ``(2j, 2j + 1)``; a common permutation of q and k leaves every attention score unchanged;
- ``o_proj`` -> ``mix.proj``, ``mlp.gate_up_proj`` / ``down_proj`` -> ``mlp.gate_up`` / ``mlp.down``;
- ``L_level.conv`` -> ``conv.conv`` (``conv_form: replace``: the authors' ``h <- conv(h)``);
- ``L_level.alpha_1_param`` / ``alpha_2_param`` -> ``residual_logit_a1`` / ``_a2`` (logits for
  ``input-independent``; the raw values of ``fixed`` become logits);
- ``lm_head`` -> ``output.head`` (no final norm: ``head_norm: false``); ``q_head`` row 0 (the halt
  logit) -> ``q_linear``; row 1, the continue logit, is only used when ``no_ACT_continue`` is false,
  which this mapping rejects;
- every ``*.mask`` (weight-dropout masks) must be all ones.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from loopformer.convert import Converted, KeyMap, strip_prefixes
from loopformer.runs.layout import CheckpointError

SOURCE = "FPRM checkpoint"
# the authors' defaults (models/config.py ReasoningModelConfig, fprm_config.py FPRMConfig, config/arch/fprm.yaml)
DEFAULTS: dict[str, Any] = {
    "num_heads": 8,
    "expansion": 4,
    "puzzle_emb_len": 16,
    "pos_encodings": "rope",
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "causal": False,
    "mlp_t": False,
    "norm_type": "pre-norm",
    "norm_placement": "none",
    "residual_scale": "input-independent",
    "outer_only": False,
    "normalize_input_injection": False,
    "use_spec_norm_linear": False,
    "softmax_temp": 1.0,
    "conv_type": "conv1d",
    "conv_kernel_size": 4,
    "conv_bias": False,
    "fixed_init": False,
    "no_ACT_continue": True,
    "halting_mechanism": "fixed_point",
    "fp_thresh": 0.1,
    "stepsize": 1.0,
    "stepsize_decay_train": 0.9,
    "stepsize_decay_eval": 0.99,
    "decay_patience": 5,
    "eps": 1e-8,
    "init_std": 1.0,
    "additive_noise_std": 0.0,
    "n_backwards_L": 6,
    "max_iter": 1000,
    "max_iter_eval": None,
    "max_iter_dist": "expon",
    "alpha_1_init": 0.5,
    "alpha_2_init": 0.5,
}
# (field, required value, why loopformer cannot represent anything else)
UNSUPPORTED: tuple[tuple[str, Any, str], ...] = (
    ("mlp_t", False, "the MLP-over-tokens trunk"),
    ("outer_only", False, "outer-only residual scaling"),
    ("normalize_input_injection", False, "a normalised input injection"),
    ("use_spec_norm_linear", False, "spectrally normalised linear layers"),
    ("softmax_temp", 1.0, "an attention temperature"),
    ("conv_bias", False, "a convolution bias"),
    ("fixed_init", False, "a fixed initial-iterate vector"),
    ("no_ACT_continue", True, "the Q-continue head"),
    ("rope_theta", 10000.0, "another rotary base"),
    ("stepsize", 1.0, "an initial damping step other than 1"),
    ("eps", 1e-8, "another residual epsilon"),
    ("additive_noise_std", 0.0, "iterate noise"),
)
NORMS = {"pre-norm": "pre", "post-norm": "post", "peri-norm": "peri"}


def _arch(ref_config: dict[str, Any]) -> dict[str, Any]:
    arch = ref_config.get("arch", ref_config)
    if not isinstance(arch, dict):
        raise CheckpointError(
            f"{SOURCE}: the reference config's 'arch' must be a mapping, got {type(arch).__name__}"
        )
    return {**DEFAULTS, **{k: v for k, v in arch.items() if v is not None or k == "max_iter_eval"}}


def _check_supported(arch: dict[str, Any]) -> None:
    for key, value, what in UNSUPPORTED:
        if arch[key] != value:
            raise CheckpointError(f"{SOURCE}: arch.{key}={arch[key]!r} ({what}) has no loopformer equivalent")
    if arch["residual_scale"] not in ("input-independent", "fixed"):
        raise CheckpointError(
            f"{SOURCE}: arch.residual_scale={arch['residual_scale']!r} is not supported "
            "(loopformer maps 'input-independent' and 'fixed')"
        )
    if arch["pos_encodings"] not in ("rope", "none"):
        raise CheckpointError(f"{SOURCE}: arch.pos_encodings={arch['pos_encodings']!r} is not supported")
    if arch["norm_type"] not in NORMS:
        raise CheckpointError(f"{SOURCE}: arch.norm_type={arch['norm_type']!r} is not one of {sorted(NORMS)}")


def rope_permutation(head_dim: int) -> Tensor:
    """loopformer channel c of a head <- the authors' channel perm[c] (pairs (j, j+D/2) -> (2j, 2j+1))."""
    half = head_dim // 2
    return torch.tensor([c // 2 if c % 2 == 0 else half + c // 2 for c in range(head_dim)])


def permute_qkv(w: Tensor, n_heads: int) -> Tensor:
    """Reorder the q and k rows of a fused [3 d, d] projection head by head (v rows unchanged)."""
    d = w.shape[1]
    if w.shape[0] != 3 * d or d % n_heads:
        raise CheckpointError(f"{SOURCE}: qkv_proj of shape {tuple(w.shape)} does not fit {n_heads} heads")
    hd = d // n_heads
    perm = rope_permutation(hd)
    q, k, v = w.view(3, n_heads, hd, d).unbind(0)
    return torch.cat([q[:, perm].reshape(d, d), k[:, perm].reshape(d, d), v.reshape(d, d)], dim=0)


def _logit(t: Tensor) -> Tensor:
    return torch.log(t / (1 - t))


def _model_fields(arch: dict[str, Any], km: KeyMap, n_layers: int) -> dict[str, Any]:
    vocab, d = km.peek("embed_tokens.embedding_weight").shape
    conv = km.state.get("L_level.conv.weight")
    fields: dict[str, Any] = {
        "name": "fprm",
        "vocab_size": int(vocab),
        "d_model": int(d),
        "n_heads": int(arch["num_heads"]),
        "n_layers": n_layers,
        "expansion": float(arch["expansion"]),
        "causal": bool(arch["causal"]),
        "rope": arch["pos_encodings"] == "rope",
        "norm": NORMS[arch["norm_type"]],
        "scalars": "learned" if arch["residual_scale"] == "input-independent" else "fixed",
        "a1_init": float(arch["alpha_1_init"]),
        "a2_init": float(arch["alpha_2_init"]),
        "init_std": float(arch["init_std"]),
        "conv": "none" if conv is None else ("grid2d" if conv.dim() == 4 else "causal1d"),
        "conv_kernel": 0 if conv is None else int(conv.shape[-1]),
        "conv_form": "replace",
        "state_norm": arch["norm_placement"],
        "head_norm": False,
        "norm_eps": float(arch["rms_norm_eps"]),
        "norm_gain": False,
        "mlp_multiple": 256,
        "init": "lecun",
        "tied_eps": 1e-5,
        "decay_vectors": True,
        "q_head": True,
        "q_pool": "first",
    }
    if "seq_len" in arch:
        fields["seq_len"] = int(arch["seq_len"])
    if fields["conv"] == "grid2d":
        side = math.isqrt(int(arch.get("seq_len", 81)))
        if side * side != int(arch.get("seq_len", 81)):
            raise CheckpointError(
                f"{SOURCE}: a conv2d model needs a square seq_len, got {arch.get('seq_len')}"
            )
        fields["grid"] = [side, side]
    table = km.state.get("puzzle_emb.weights")
    if table is not None and table.shape[1] > 0:
        fields.update(
            num_puzzle_ids=int(table.shape[0]),
            puzzle_emb_len=int(arch["puzzle_emb_len"]) or -(-int(table.shape[1]) // int(d)),
            puzzle_emb_dim=int(table.shape[1]),
        )
    return fields


def _weights(km: KeyMap, fields: dict[str, Any], n_layers: int) -> dict[str, Tensor]:
    for key in km.keys_with(""):
        if key.endswith(".mask"):
            mask = km.take(key)
            if not bool((mask == 1).all()):
                raise CheckpointError(f"{SOURCE}: weight-dropout mask {key!r} is not all ones")
    w: dict[str, Tensor] = {
        "embedding.tokens.weight": km.take("embed_tokens.embedding_weight"),
        "output.head.weight": km.take("lm_head.weight"),
        "q_linear.weight": km.take("q_head.weight")[:1],
        "q_linear.bias": km.take("q_head.bias")[:1],
    }
    if "puzzle_emb_dim" in fields:
        w["embedding.puzzle_emb.weight"] = km.take("puzzle_emb.weights")
    elif km.has("puzzle_emb.weights"):
        km.take("puzzle_emb.weights")  # a zero-width table: nothing to carry over
    for i in range(n_layers):
        src, dst = f"L_level.layers.{i}.", f"layers.{i}."
        w[dst + "mix.qkv.weight"] = permute_qkv(km.take(src + "self_attn.qkv_proj.weight"), fields["n_heads"])
        w[dst + "mix.proj.weight"] = km.take(src + "self_attn.o_proj.weight")
        w[dst + "mlp.gate_up.weight"] = km.take(src + "mlp.gate_up_proj.weight")
        w[dst + "mlp.down.weight"] = km.take(src + "mlp.down_proj.weight")
    if fields["conv"] != "none":
        w["conv.conv.weight"] = km.take("L_level.conv.weight")
    for n in ("1", "2"):
        p = km.take(f"L_level.alpha_{n}_param")
        if fields["scalars"] == "fixed":
            p = _logit(p.expand(fields["d_model"]).clone())
        w[f"residual_logit_a{n}"] = p
    return w


def _loops(arch: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    common = {"solver": "damped", "tol": float(arch["fp_thresh"]), "residual_norm": "rel_sup"}

    def damped(gamma: Any) -> dict[str, Any]:
        return {"gamma": float(gamma), "patience": int(arch["decay_patience"]), "min_step": 1e-3}

    k = int(arch["n_backwards_L"])
    train = {
        **common,
        "damped": damped(arch["stepsize_decay_train"]),
        "halting": "fixed",
        "max_steps": k,
        "grad": "truncated",
        "grad_steps": k,
    }
    cap = arch["max_iter_eval"] if arch["max_iter_eval"] is not None else arch["max_iter"]
    evaluation = {
        **common,
        "damped": damped(arch["stepsize_decay_eval"]),
        "halting": "batch_residual",
        "max_steps": int(cap),
    }
    return train, evaluation


def convert(state: dict[str, Tensor], ref_config: dict[str, Any]) -> Converted:
    """The authors' FPRM state dict (+ its config) -> loopformer run config and FPRM weights."""
    arch = _arch(ref_config)
    _check_supported(arch)
    km = KeyMap(strip_prefixes(state, ("_orig_mod.", "model.", "inner.")), SOURCE)
    n_layers = len({k.split(".")[2] for k in km.keys_with("L_level.layers.")})
    if n_layers == 0 or not km.has("embed_tokens.embedding_weight"):
        raise CheckpointError(f"{SOURCE}: no FPRM trunk found (keys: {km.sample()})")
    fields = _model_fields(arch, km, n_layers)
    weights = _weights(km, fields, n_layers)
    km.finish()
    loop_train, loop_eval = _loops(arch)
    train: dict[str, Any] = {
        "mode": "deep_supervision",
        "loss": "stablemax",
        "q_loss_weight": 0.5,
        "grad_clip": 0.0,
    }
    if arch["max_iter_dist"] == "det":
        train["max_segments"] = int(arch["max_iter"])
    notes = [
        "the Q-continue row of q_head is dropped (no_ACT_continue: only the halt logit is trained)",
    ]
    if arch["max_iter_dist"] != "det":
        notes.append(f"max_iter_dist={arch['max_iter_dist']!r}: loopformer runs a fixed number of segments")
    return Converted(
        run={"model": fields, "train": train, "loop_train": loop_train, "loop_eval": loop_eval},
        weights=weights,
        notes=notes,
    )
