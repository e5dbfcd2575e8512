"""``loopformer convert hrm``: an HRM checkpoint (sapientinc/HRM, or the HRM in TinyRecursiveModels)
-> a loopformer ``hrm`` run folder.

Key mapping and config discovery: ``loopformer.convert.recursive``. HRM specifics
(``models/hrm/hrm_act_v1.py``): ``H_level`` / ``L_level`` -> ``H`` / ``L``; ``H_cycles`` -> the loop's
``max_steps``, ``L_cycles`` -> ``l_cycles``, ``H_layers`` / ``L_layers`` -> ``n_layers`` / ``l_layers``;
``ceil(puzzle_emb_ndim / d)`` puzzle tokens; the Q head's two rows (halt, continue).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from loopformer.convert import Converted, KeyMap, strip_prefixes
from loopformer.convert.recursive import (
    PREFIXES,
    arch_settings,
    count_layers,
    embedding_shapes,
    map_weights,
    no_seq_len,
    reference_seq_len,
    run_config,
    train_section,
)


def model_section(km: KeyMap, arch: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    vocab, d, ndim, n_ids = embedding_shapes(km)
    seq_len = reference_seq_len(arch, ref)
    if seq_len is None:
        raise no_seq_len("HRM")
    if arch["pos_encodings"] != "rope":
        raise NotImplementedError(f"HRM pos_encodings={arch['pos_encodings']!r} is not supported (rope only)")
    return {
        "name": "hrm",
        "vocab_size": int(vocab),
        "seq_len": int(seq_len),
        "d_model": int(d),
        "n_heads": int(arch["num_heads"]),
        "n_layers": count_layers(km, "H_level.layers."),
        "l_layers": count_layers(km, "L_level.layers."),
        "expansion": float(arch["expansion"]),
        "l_cycles": int(arch["L_cycles"]),
        "num_puzzle_ids": int(n_ids),
        "puzzle_emb_len": -(ndim // -d),
        "puzzle_emb_dim": int(ndim),
        "norm_eps": float(arch["rms_norm_eps"]),
        "loop": {"max_steps": int(arch["H_cycles"])},
    }


def convert(state: dict[str, Tensor], ref: dict[str, Any]) -> Converted:
    km = KeyMap(strip_prefixes(state, PREFIXES), "HRM checkpoint")
    arch, train = arch_settings("hrm", ref)
    model = model_section(km, arch, ref)
    levels = (("H_level", "H", model["n_layers"]), ("L_level", "L", model["l_layers"]))
    map_weights(km, model, levels, ("h_init", "l_init"), rope=True, q_rows=None)
    km.finish()
    training = {**train_section(arch, train), "q_learning": True}
    run = run_config(model, arch, ref, training)
    return Converted(run=run, weights=km.out, sources=km.sources)
