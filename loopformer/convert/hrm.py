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
from loopformer.convert import recursive as rec

find_config = rec.find_config  # all_config.yaml beside the checkpoint (used when no --config is given)
CONFIG_NAMES = rec.CONFIG_NAMES


def model_section(km: KeyMap, arch: dict[str, Any], ref: dict[str, Any]) -> dict[str, Any]:
    vocab, d, ndim, n_ids = rec.embedding_shapes(km)
    seq_len = rec.reference_seq_len(arch, ref)
    if seq_len is None:
        raise rec.no_seq_len("HRM")
    if arch["pos_encodings"] != "rope":
        raise NotImplementedError(f"HRM pos_encodings={arch['pos_encodings']!r} is not supported (rope only)")
    return {
        "name": "hrm",
        **rec.model_fields(km, arch, seq_len, "H_level.layers.", -(ndim // -d)),
        "l_layers": rec.count_layers(km, "L_level.layers."),
        "l_cycles": int(arch["L_cycles"]),
    }


def convert(state: dict[str, Tensor], ref: dict[str, Any]) -> Converted:
    km = KeyMap(strip_prefixes(state, rec.PREFIXES), "HRM checkpoint")
    arch, train = rec.arch_settings("hrm", ref)
    model = model_section(km, arch, ref)
    levels = (("H_level", "H", model["n_layers"]), ("L_level", "L", model["l_layers"]))
    rec.map_weights(km, model, levels, ("h_init", "l_init"), rope=True, q_rows=None)
    km.finish()
    training = {**rec.train_section(arch, train), "q_learning": True}
    run = rec.run_config(model, arch, ref, training)
    return Converted(run=run, weights=km.out, sources=km.sources)
