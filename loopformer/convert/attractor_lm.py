"""``loopformer convert attractor`` for the Attractor language model -> an ``attractor`` run folder.

Reference: github jacobfa/Attractor, ``attractor/models/attractor/attractor.py`` (``Attractor``: keys
``transformer.wte``, ``transformer.prelude.N`` (backbone), ``transformer.core_block.N`` (the attractor
head, with ``raw_gamma_attn`` / ``raw_gamma_mlp``), ``transformer.ln_f``, ``lm_head``, the ``freqs_cis``
buffer) and ``config.py`` (``AttractorConfig``). ``loopformer.convert.attractor`` sends a state dict with
``transformer.wte.weight`` here. ``--config``: a JSON / YAML with ``model_config`` (the
``AttractorConfig`` fields, e.g. ``configs/attractor/attractor-small-140m.py``'s dict) and optionally
``train_config`` (the launch YAML: ``optim_config``, ``grad_clip``, ``world_batch_size``, ``max_tokens``),
or the flat model config. Missing fields take ``AttractorConfig``'s defaults; settings loopformer cannot
express (another block, norm or MLP class, biases, GQA, a logit soft-cap, ...) are an error naming them.

Mapping: ``c_q`` / ``c_k`` / ``c_v`` -> the fused ``mix.qkv`` (rows stacked; both codes rotate adjacent
channel pairs, so no permutation), ``c_proj`` -> ``mix.proj``, ``mlp.fc`` / ``mlp.proj`` -> ``mlp.up`` /
``mlp.down``, ``norm_1`` / ``norm_2`` -> ``norm1`` / ``norm2``, ``raw_gamma_attn`` / ``raw_gamma_mlp`` of
head block i -> ``gate_logit[i, 0]`` / ``[i, 1]``; ``freqs_cis`` is checked against loopformer's rotary
table and dropped. The loop: ``anderson_attractor`` (returns ``f(x_k)``), ``batch_residual`` halting
(``rel.max() < tol``), ``grad: neumann`` with one term and ``neumann_clip = adjoint_grad_clip``
(``backward_type: onestep``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from loopformer.convert import Converted, KeyMap
from loopformer.runs.layout import CheckpointError

SOURCE = "Attractor LM checkpoint"
# AttractorConfig / Config defaults (attractor/models/attractor/config.py, attractor/models/config.py)
DEFAULTS: dict[str, Any] = {
    "block_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": None,
    "bias": False,
    "qk_bias": False,
    "clip_qkv": None,
    "tie_embeddings": True,
    "block_class_name": "TransformerPreNormBlock",
    "norm_class_name": "LayerNorm",
    "norm_eps": 1e-5,
    "mlp_class_name": "BaseMLP",
    "nonlin_name": "GELU",
    "qk_norm": False,
    "logit_softcap": None,
    "mup_model_scaling_factor": 1,
    "randomize_positions_from": None,
    "rope_settings": {"use_rope": True, "rope_condense_ratio": 1, "rope_base": 50000},
    "init_strategy": "scaled",
    "init_orthogonal": False,
    "solver": "anderson",
    "max_iter": 12,
    "min_iter": 0,
    "tol": 1e-3,
    "anderson_m": 5,
    "anderson_beta": 1.0,
    "backward_type": "onestep",
    "adjoint_grad_clip": 1.0,
    "layer_scale_init": 0.25,
    "gamma_max": 1.0,
    "fp_lr_scale": 0.75,
    "fp_wd": 0.0,
}
# the one value of each setting loopformer reproduces
REQUIRED: dict[str, Any] = {
    "block_class_name": "TransformerPreNormBlock",
    "norm_class_name": "RMSNorm",
    "mlp_class_name": "BaseMLP",
    "nonlin_name": "ReLU2",
    "bias": False,
    "qk_bias": False,
    "clip_qkv": None,
    "logit_softcap": None,
    "mup_model_scaling_factor": 1,
    "randomize_positions_from": None,
    "solver": "anderson",
    "backward_type": "onestep",
}
BLOCK_KEYS = {"norm_1.weight": "norm1.weight", "norm_2.weight": "norm2.weight",
              "attn.c_proj.weight": "mix.proj.weight", "mlp.fc.weight": "mlp.up.weight",
              "mlp.proj.weight": "mlp.down.weight"}  # fmt: skip


def settings(ref: dict[str, Any]) -> dict[str, Any]:
    merged = dict(DEFAULTS)
    model = ref.get("model_config") if isinstance(ref.get("model_config"), dict) else ref
    merged.update({k: v for k, v in model.items() if k not in ("model_config", "train_config")})
    for key, value in REQUIRED.items():
        if merged[key] != value:
            raise CheckpointError(
                f"{SOURCE}: {key}={merged[key]!r} is not supported (loopformer reproduces {key}={value!r})"
            )
    rope = {**DEFAULTS["rope_settings"], **(merged.get("rope_settings") or {})}
    if not rope["use_rope"] or rope["rope_condense_ratio"] != 1:
        raise CheckpointError(f"{SOURCE}: rope_settings={rope} is not supported (RoPE without condensing)")
    merged["rope_base"] = float(rope["rope_base"])
    kv = merged["num_key_value_heads"]
    if kv is not None and kv != merged["num_attention_heads"]:
        raise CheckpointError(
            f"{SOURCE}: num_key_value_heads={kv} (grouped-query attention) is not supported"
        )
    if merged["layer_scale_init"] is None:
        raise CheckpointError(f"{SOURCE}: layer_scale_init=None (ungated head blocks) is not supported")
    return merged


def _scales(strategy: str, d: int) -> tuple[float, float]:
    """(embed_scale, logit_scale) of an init strategy (``attractor/utils/init.py: get_factor_table``)."""
    logit = {"llama-by-dim-ls", "noci-anagnostidis", "shaped", "deep-scale-simple", "deep-scale-full",
             "scaled-and-logit-scale"}  # fmt: skip
    embed = math.sqrt(d) if strategy in ("takase", "takase-scaled") else 1.0
    if strategy == "takase-scaled":
        return embed, math.sqrt(2 / 5) / math.sqrt(d)
    return embed, 1.0 / math.sqrt(d) if strategy in logit else 1.0


def _count(km: KeyMap, part: str) -> int:
    ids = {int(k.split(".")[2]) for k in km.keys_with(f"transformer.{part}.")}
    if ids != set(range(len(ids))):
        raise CheckpointError(f"{SOURCE}: transformer.{part} block indices {sorted(ids)} are not 0..n-1")
    return len(ids)


def model_section(km: KeyMap, s: dict[str, Any]) -> dict[str, Any]:
    vocab, d = km.peek("transformer.wte.weight").shape
    n_backbone, n_head = _count(km, "prelude"), _count(km, "core_block")
    for key, n in (("n_backbone_layers", n_backbone), ("n_fp_blocks", n_head)):
        if key in s and int(s[key]) != n:
            raise CheckpointError(f"{SOURCE}: {key}={s[key]} in the config, {n} blocks in the state dict")
    hidden = km.peek(
        "transformer.prelude.0.mlp.fc.weight" if n_backbone else "transformer.core_block.0.mlp.fc.weight"
    )
    embed_scale, logit_scale = _scales(str(s["init_strategy"]), int(d))
    return {
        "name": "attractor",
        "vocab_size": int(vocab),
        "seq_len": int(s["block_size"]),
        "d_model": int(d),
        "n_heads": int(s["num_attention_heads"]),
        "n_backbone": n_backbone,
        "n_layers": n_head,
        "expansion": hidden.shape[0] / d,
        "causal": True,
        "rope": True,
        "tie_embeddings": bool(s["tie_embeddings"]),
        "layer_scale_init": float(s["layer_scale_init"]),
        "gamma_max": float(s["gamma_max"] if s["gamma_max"] is not None else 1.0),
        "mlp": "relu2",
        "qk_norm": bool(s["qk_norm"]),
        "norm_eps": float(s["norm_eps"]),
        "rope_base": s["rope_base"],
        "embed_scale": embed_scale,
        "logit_scale": logit_scale,
        "init": "scaled_zero" if s["init_strategy"] == "scaled-zero" else "default",
        "init_orthogonal": bool(s["init_orthogonal"]),
    }


def loop_section(s: dict[str, Any], train: bool) -> dict[str, Any]:
    """``_solve_forward`` / ``anderson_solve`` (+ the ``onestep`` backward when training)."""
    loop = {
        "solver": "anderson_attractor",
        "anderson": {
            "m": int(s["anderson_m"]),
            "reg": 1e-4,  # anderson_solve's lam (the model never passes another)
            "reg_relative": False,
            "beta": float(s["anderson_beta"]),
        },
        "halting": "batch_residual",
        "tol": float(s["tol"]),
        "min_steps": min(int(s["min_iter"]), int(s["max_iter"])),
        "max_steps": int(s["max_iter"]),
    }
    if train:
        loop.update(grad="neumann", grad_steps=1, neumann={"clip": s["adjoint_grad_clip"]})
    return loop


def _muon_section(tc: dict[str, Any], opt: dict[str, Any]) -> dict[str, Any]:
    """``optimizer: MuonAdamW`` as ``train.optimizer: muon_adamw``: AdamW's decay is ``weight_decay`` when
    ``no_weight_decay_for_bias_and_norm_params`` (get_muon_param_groups_from_config), else 0."""
    adamw_wd = (
        float(opt.get("weight_decay", 0.1)) if tc.get("no_weight_decay_for_bias_and_norm_params") else 0.0
    )
    return {
        "optimizer": "muon_adamw",
        "weight_decay": adamw_wd,
        "decay_embeddings": adamw_wd > 0,
        "muon_lr": float(opt.get("muon_lr", 0.02)),
        "muon_momentum": float(opt.get("muon_momentum", 0.95)),
        "muon_weight_decay": float(opt.get("muon_wd", 0.2)),
        "muon_ns_steps": int(opt.get("muon_ns_steps", 5)),
        "muon_momentum_warmup_start": float(opt.get("muon_momentum_warmup_start", 0.85)),
        "muon_momentum_warmup_steps": int(opt.get("muon_momentum_warmup_steps", 300)),
    }


def train_section(ref: dict[str, Any], s: dict[str, Any], seq_len: int) -> dict[str, Any]:
    """The launch config's optimiser: ``MuonAdamW`` as ``muon_adamw``, else loopformer's AdamW."""
    tc = ref.get("train_config") if isinstance(ref.get("train_config"), dict) else {}
    opt = tc.get("optim_config", {})
    section: dict[str, Any] = {
        "lr": float(opt.get("lr", 3e-4)),
        "betas": [float(b) for b in opt.get("betas", (0.9, 0.95))],
        "eps": float(opt.get("eps", 1e-8)),
        "weight_decay": float(opt.get("muon_wd", 0.2)),  # the backbone's matrices (Muon's decay)
        "decay_embeddings": float(opt.get("weight_decay", 0.1)) > 0,  # AdamW groups: wte, norms
        "head_lr_scale": float(s["fp_lr_scale"]),
        "head_weight_decay": float(s["fp_wd"]),  # 0: the head's matrices are not decayed (_no_muon_wd)
        "grad_clip": float(tc.get("grad_clip", 1.0)),
        "warmup_steps": 0,
        "loss": "ce",
        **_schedule(tc, float(opt.get("lr", 3e-4))),
        "mode": "deep_supervision",
        "max_segments": 1,
    }
    if tc.get("optimizer", "AdamW") == "MuonAdamW":  # scripts/train.py + recpre/optim/muon_adamw.py
        section.update(_muon_section(tc, opt))
    if "world_batch_size" in tc:
        section["batch_size"] = int(tc["world_batch_size"])
        if "max_tokens" in tc:
            section["steps"] = max(1, int(float(tc["max_tokens"]) // (section["batch_size"] * seq_len)))
    return section


def _schedule(tc: dict[str, Any], lr: float) -> dict[str, Any]:
    """``lr_schedule`` trapezoid / constant (``cooldown_steps`` as a fraction of the run, ``warmup_steps`` 0)."""
    kind = tc.get("lr_schedule", "constant")
    if kind not in ("constant", "trapezoid") or float(tc.get("warmup_steps", 0)) != 0:
        raise CheckpointError(
            f"{SOURCE}: lr_schedule={kind!r} with warmup_steps={tc.get('warmup_steps')} is not supported "
            "(constant / trapezoid without warm-up)"
        )
    cool = float(tc.get("cooldown_steps", 0.0))
    if not 0 <= cool < 1:
        raise CheckpointError(f"{SOURCE}: cooldown_steps={cool} must be a fraction of the run in [0, 1)")
    return {
        "schedule": "trapezoid",
        "cooldown_fraction": cool,
        "min_lr_ratio": float(tc.get("min_lr", 0.0)) / lr,
    }


def _block(km: KeyMap, src: str, dst: str) -> None:
    for ref_key, ours in BLOCK_KEYS.items():
        km.put(f"{dst}.{ours}", f"{src}.{ref_key}")
    parts = [f"{src}.attn.c_{x}.weight" for x in "qkv"]
    km.out[f"{dst}.mix.qkv.weight"] = torch.cat([km.take(k) for k in parts], dim=0)
    km.sources[f"{dst}.mix.qkv.weight"] = "|".join(parts)


def map_weights(km: KeyMap, model: dict[str, Any]) -> None:
    for i in range(model["n_backbone"]):
        _block(km, f"transformer.prelude.{i}", f"backbone.{i}")
    gates = []
    for i in range(model["n_layers"]):
        _block(km, f"transformer.core_block.{i}", f"head_blocks.{i}")
        gates.append(
            torch.stack([km.take(f"transformer.core_block.{i}.raw_gamma_{x}") for x in ("attn", "mlp")])
        )
    km.out["gate_logit"] = torch.stack(gates)
    km.sources["gate_logit"] = "|".join(
        f"transformer.core_block.{i}.raw_gamma_{x}" for i in range(model["n_layers"]) for x in ("attn", "mlp")
    )
    km.put("embedding.tokens.weight", "transformer.wte.weight")
    head = km.take("lm_head.weight") if km.has("lm_head.weight") else None
    if (
        model["tie_embeddings"]
        and head is not None
        and not torch.equal(head, km.out["embedding.tokens.weight"])
    ):
        raise CheckpointError(
            f"{SOURCE}: tie_embeddings=True but lm_head.weight differs from transformer.wte.weight"
        )
    if head is None and not model["tie_embeddings"]:
        raise CheckpointError(f"{SOURCE}: missing key 'lm_head.weight' (tie_embeddings=False)")
    km.out["output.head.weight"] = km.out["embedding.tokens.weight"] if model["tie_embeddings"] else head
    km.sources["output.head.weight"] = (
        "transformer.wte.weight" if model["tie_embeddings"] else "lm_head.weight"
    )
    km.put("output.norm.weight", "transformer.ln_f.weight")
    if km.has("freqs_cis"):
        _check_rotary(km.take("freqs_cis"), model)


def _check_rotary(table: Tensor, model: dict[str, Any]) -> None:
    """The reference's ``freqs_cis`` [1, T, 1, Dh / 2, 2] (cos, sin) against loopformer's rotary table."""
    from loopformer.nn import Rotary

    head_dim = model["d_model"] // model["n_heads"]
    if table.dim() != 5 or table.shape[3] != head_dim // 2:
        raise CheckpointError(
            f"{SOURCE}: freqs_cis has shape {tuple(table.shape)}, expected [1, T, 1, {head_dim // 2}, 2]"
        )
    cos, sin = Rotary(head_dim, model["rope_base"]).cos_sin(
        table.shape[1], torch.device("cpu"), torch.float32
    )
    ours = torch.stack([cos, sin], dim=-1).to(table.dtype)
    if not torch.allclose(table[0, :, 0], ours, rtol=0, atol=1e-6):
        raise CheckpointError(
            f"{SOURCE}: freqs_cis is not the rotary table of rope_base {model['rope_base']}"
        )


def convert(state: dict[str, Tensor], ref: dict[str, Any]) -> Converted:
    km = KeyMap(state, SOURCE)
    s = settings(ref)
    model = model_section(km, s)
    map_weights(km, model)
    km.finish()
    run = {
        "model": model,
        "loop_train": loop_section(s, train=True),
        "loop_eval": loop_section(s, train=False),
        "train": train_section(ref, s, model["seq_len"]),
    }
    notes = [
        "Muon (the backbone's matrices) is replaced by AdamW at the launch config's AdamW rate, with Muon's weight decay",
        f"attractor head: learning rate x {s['fp_lr_scale']}, matrix weight decay {s['fp_wd']} (fp_lr_scale / fp_wd)",
        "the solve stops on the largest residual of the batch (batch_residual), normalised by ||f(x)|| (the reference: ||x||)",
    ]
    return Converted(run=run, weights=km.out, notes=notes, sources=km.sources)
