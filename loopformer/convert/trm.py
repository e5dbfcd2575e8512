"""``loopformer convert trm``: a TinyRecursiveModels checkpoint -> a loopformer ``trm`` run folder.

Key mapping and config discovery: ``loopformer.convert.recursive``. TRM specifics
(``models/recursive_reasoning/trm.py``): one ``L_level`` net used for both updates; ``H_cycles`` ->
the loop's ``max_steps`` (T), ``L_cycles`` -> ``n_inner`` (n), ``L_layers`` -> ``n_layers``;
``puzzle_emb_len`` (16 by default) puzzle tokens; ``mlp_t`` -> ``mixer="mlp"``; the Q head's row 0.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from loopformer.convert import Converted, KeyMap, strip_prefixes
from loopformer.convert.recursive import (
    PREFIXES,
    arch_settings,
    count_layers,
    dataset_meta,
    eval_loop,
    map_block,
    task_section,
    train_section,
)


def model_section(km: KeyMap, arch: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    vocab, d = km.state["embed_tokens.embedding_weight"].shape
    ndim = km.state["puzzle_emb.weights"].shape[1] if km.has("puzzle_emb.weights") else 0
    n_ids = km.state["puzzle_emb.weights"].shape[0] if ndim else 0
    plen = (int(arch["puzzle_emb_len"]) or -(ndim // -d)) if ndim else 0
    mlp_t = km.has("L_level.layers.0.mlp_t.gate_up_proj.weight")
    seq_len = arch.get("seq_len") or dataset_meta(ref).get("seq_len")
    if seq_len is None and mlp_t:
        seq_len = km.state["L_level.layers.0.mlp_t.gate_up_proj.weight"].shape[1] - plen
    if seq_len is None:
        raise ValueError(
            "the TRM config gives no seq_len and the data path has no train/dataset.json; "
            "pass --set model.seq_len=N"
        )
    pos = arch["pos_encodings"]
    if pos not in ("rope", "none"):
        raise NotImplementedError(f"TRM pos_encodings={pos!r} is not supported (rope or none)")
    if not arch.get("no_ACT_continue", True):
        raise NotImplementedError(
            "TRM with no_ACT_continue=False (Q-learning continue target) is not supported"
        )
    return {
        "name": "trm",
        "vocab_size": int(vocab),
        "seq_len": int(seq_len),
        "d_model": int(d),
        "n_heads": int(arch["num_heads"]),
        "n_layers": count_layers(km, "L_level.layers."),
        "expansion": float(arch["expansion"]),
        "n_inner": int(arch["L_cycles"]),
        "mixer": "mlp" if mlp_t else "attention",
        "rope": pos == "rope",
        "num_puzzle_ids": int(n_ids),
        "puzzle_emb_len": int(plen),
        "puzzle_emb_dim": int(ndim),
        "norm_eps": float(arch["rms_norm_eps"]),
        "loop": {"max_steps": int(arch["H_cycles"])},
    }


def convert(state: dict[str, Tensor], ref: dict[str, Any]) -> Converted:
    km = KeyMap(strip_prefixes(state, PREFIXES), "TRM checkpoint")
    arch, train = arch_settings("trm", ref)
    model = model_section(km, arch, ref)
    km.put("embedding.tokens.weight", "embed_tokens.embedding_weight")
    if model["num_puzzle_ids"]:
        km.put("embedding.puzzle_emb.weight", "puzzle_emb.weights")
    for i in range(model["n_layers"]):
        map_block(km, f"L_level.layers.{i}", f"net.layers.{i}", model["n_heads"], model["rope"])
    km.put("y_init", "H_init")
    km.put("z_init", "L_init")
    km.put("lm_head.weight", "lm_head.weight")
    km.put("q_proj.weight", "q_head.weight", lambda t: t[:1].clone())
    km.put("q_proj.bias", "q_head.bias", lambda t: t[:1].clone())
    km.finish()
    run = {
        "model": model,
        "data": task_section(ref, model["seq_len"]),
        "train": train_section(arch, train),
        "eval": {"segments": 1, "batch_size": 64},
        "loop_eval": eval_loop(model, arch),
    }
    notes = ["q_head row 1 (q_continue) dropped: TRM's no_ACT_continue never uses it"]
    return Converted(run=run, weights=km.out, notes=notes, sources=km.sources)
