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
from loopformer.convert import recursive as rec

find_config = rec.find_config  # all_config.yaml beside the checkpoint (used when no --config is given)
CONFIG_NAMES = rec.CONFIG_NAMES


def model_section(km: KeyMap, arch: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    vocab, d, ndim, n_ids = rec.embedding_shapes(km)
    plen = (int(arch["puzzle_emb_len"]) or -(ndim // -d)) if ndim else 0
    mlp_t = km.has("L_level.layers.0.mlp_t.gate_up_proj.weight")
    seq_len = rec.reference_seq_len(arch, ref)
    if seq_len is None and mlp_t:
        seq_len = km.peek("L_level.layers.0.mlp_t.gate_up_proj.weight").shape[1] - plen
    if seq_len is None:
        raise rec.no_seq_len("TRM")
    pos = arch["pos_encodings"]
    if pos not in ("rope", "none"):
        raise NotImplementedError(f"TRM pos_encodings={pos!r} is not supported (rope or none)")
    if not arch.get("no_ACT_continue", True):
        raise NotImplementedError(
            "TRM with no_ACT_continue=False (Q-learning continue target) is not supported"
        )
    return {
        "name": "trm",
        **rec.model_fields(km, arch, seq_len, "L_level.layers.", plen),
        "n_inner": int(arch["L_cycles"]),
        "mixer": "mlp" if mlp_t else "attention",
        "rope": pos == "rope",
    }


def map_trm_weights(km: KeyMap, model: dict[str, Any]) -> None:
    """TRM's one ``L_level`` net -> ``net``, ``H_init`` / ``L_init`` -> ``y_init`` / ``z_init``, the
    Q head's row 0 (also TRM-DEQ's, ``loopformer.convert.attractor``)."""
    levels = (("L_level", "net", model["n_layers"]),)
    rec.map_weights(km, model, levels, ("y_init", "z_init"), model["rope"], q_rows=1)


def convert(state: dict[str, Tensor], ref: dict[str, Any]) -> Converted:
    km = KeyMap(strip_prefixes(state, rec.PREFIXES), "TRM checkpoint")
    arch, train = rec.arch_settings("trm", ref)
    model = model_section(km, arch, ref)
    map_trm_weights(km, model)
    km.finish()
    run = rec.run_config(model, arch, ref, rec.train_section(arch, train))
    notes = ["q_head row 1 (q_continue) dropped: TRM's no_ACT_continue never uses it"]
    return Converted(run=run, weights=km.out, notes=notes, sources=km.sources)
