"""``loopformer convert ltg``: a Loop, Think & Generalize checkpoint -> a loopformer ``recurrent`` run folder.

Reference: github OSU-NLP-Group/Loop-Think-Generalize, ``gpt_utils_extrapolation.py`` /
``gpt_utils_systematicity.py`` (``RecurrentGPT2Block``: Hugging Face ``GPT2Block`` layers looped
``num_iterations`` times, a final LayerNorm, a head tied to the token embedding; the systematicity model and
``--positional_embedding_type learned`` add a ``position_embedding`` table once before the loop), trained
by ``train_extrapolation.py`` / ``train_systematicity.py``, which save ``{"model_state_dict": ...}`` (``torch.compile``'s ``_orig_mod.``
prefix is stripped). The block maps to ``RecurrentConfig(block="gpt2")``; Hugging Face's ``Conv1D``
weights are stored ``[in, out]`` and are transposed into ``nn.Linear``'s ``[out, in]``.

``ref_config`` is the training script's arguments (``vars(args)`` as JSON / YAML; optional): ``num_heads``
(default 12, as the script), ``input_injection`` (-> ``injection="add"``, ``init="zeros"``, which is the
reference's "no injection before the first loop"), ``dropout`` (-> ``embed_dropout``), ``max_len``
(-> ``seq_len``, default 50; a position table's row count wins), ``recurrence`` / ``dynamic_max`` (the
evaluation loop count), ``pred_pos`` (``last_token``, the scripts' default and what the systematicity
script always reads, -> ``halt_position: last``; ``inp_len`` -> ``answer``). The reference masks padding
keys in every attention: ``pad_mask: true``. A learned ``position_embedding`` maps onto
``learned_positions`` (its first T rows for T tokens, as the reference); sinusoidal positions (the ``pe``
buffer) are refused (loopformer has no sinusoidal table; the paper's runs use none or learned).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from loopformer.convert import Converted, KeyMap, strip_prefixes
from loopformer.runs.checkpoint import CheckpointError

BLOCK_KEYS = {  # loopformer GPT2Block name -> (reference name, transpose Conv1D)
    "ln_1.weight": ("ln_1.weight", False),
    "ln_1.bias": ("ln_1.bias", False),
    "c_attn.weight": ("attn.c_attn.weight", True),
    "c_attn.bias": ("attn.c_attn.bias", False),
    "attn_proj.weight": ("attn.c_proj.weight", True),
    "attn_proj.bias": ("attn.c_proj.bias", False),
    "ln_2.weight": ("ln_2.weight", False),
    "ln_2.bias": ("ln_2.bias", False),
    "c_fc.weight": ("mlp.c_fc.weight", True),
    "c_fc.bias": ("mlp.c_fc.bias", False),
    "mlp_proj.weight": ("mlp.c_proj.weight", True),
    "mlp_proj.bias": ("mlp.c_proj.bias", False),
}
# buffers older transformers versions save with every GPT2Attention (the causal mask and its fill value)
BUFFERS = ("attn.bias", "attn.masked_bias")


def _n_layers(km: KeyMap) -> int:
    n = 0
    while km.has(f"blocks.{n}.ln_1.weight"):
        n += 1
    if n == 0:
        raise CheckpointError("ltg checkpoint: no blocks.0.* keys (is this a RecurrentGPT2Block state dict?)")
    return n


PRED_POS = {"last_token": "last", "inp_len": "answer"}


def _conv1d(t: Tensor) -> Tensor:
    """Hugging Face's ``Conv1D`` weight [in, out] as ``nn.Linear``'s [out, in]."""
    return t.t().contiguous()


def _halt_position(ref: dict[str, Any]) -> str:
    pred_pos = ref.get("pred_pos", "last_token")
    if pred_pos not in PRED_POS:
        raise CheckpointError(f"ltg config: pred_pos {pred_pos!r} is not one of {sorted(PRED_POS)}")
    return PRED_POS[pred_pos]


def model_section(km: KeyMap, ref: dict[str, Any]) -> dict[str, Any]:
    if km.has("pe"):
        raise NotImplementedError(
            "LTG checkpoints with sinusoidal positions (the 'pe' buffer) are not supported (none or learned are)"
        )
    learned = km.has("position_embedding.weight")
    for key in ("token_embedding.weight", "blocks.0.mlp.c_fc.weight"):
        if not km.has(key):
            raise CheckpointError(f"ltg checkpoint: missing key {key!r} (keys present: {km.sample()})")
    vocab, d = km.peek("token_embedding.weight").shape
    hidden = km.peek("blocks.0.mlp.c_fc.weight").shape[1]
    inject = bool(ref.get("input_injection", False))
    seq_len = int(km.peek("position_embedding.weight").shape[0]) if learned else int(ref.get("max_len", 50))
    return {
        "name": "recurrent",
        "block": "gpt2",
        "vocab_size": int(vocab),
        "seq_len": seq_len,
        "d_model": int(d),
        "n_heads": int(ref.get("num_heads", 12)),
        "n_layers": _n_layers(km),
        "expansion": hidden / d,
        "causal": True,
        "rope": False,
        "learned_positions": learned,
        "tie_embeddings": True,
        "injection": "add" if inject else "none",
        "init": "zeros" if inject else "embed",
        "dropout": 0.1,  # GPT2Config's resid_pdrop / attn_pdrop (the scripts leave them at the default)
        "embed_dropout": float(ref.get("dropout", 0.0)),
        "out_init_scale": float(ref.get("c_scale", 1.0 if learned else 0.0)),
        "halt_position": _halt_position(ref),
        "pad_id": 0,  # load_vocab puts <pad> first
        "pad_mask": True,  # the reference's attention_mask: padding keys get -10000
        "loop": {"max_steps": int(ref.get("dynamic_max", ref.get("recurrence", 8)))},
    }


def _data_hint(model: dict[str, Any]) -> str:
    if model["halt_position"] == "answer":
        return "answer"
    if model["learned_positions"]:  # train_systematicity.py: logits[:, -1] of the batch padded to its longest
        return "last (width: the longest query)"
    return f"last, width {model['seq_len']} (--max_len)"


def convert(state: dict[str, Tensor], ref: dict[str, Any]) -> Converted:
    km = KeyMap(strip_prefixes(state, ("_orig_mod.", "module.")), "ltg checkpoint")
    model = model_section(km, ref)
    for i in range(model["n_layers"]):
        for dst, (src, transpose) in BLOCK_KEYS.items():
            km.put(f"core.{i}.{dst}", f"blocks.{i}.{src}", _conv1d if transpose else None)
    km.put("embedding.tokens.weight", "token_embedding.weight")
    if model["learned_positions"]:
        km.put("embedding.positions.table", "position_embedding.weight")
    if km.has("lm_head.weight"):
        km.put("output.head.weight", "lm_head.weight")
    else:  # tied to the token embedding
        km.out["output.head.weight"] = km.out["embedding.tokens.weight"]
    km.put("output.norm.weight", "ln_f.weight")
    km.put("output.norm.bias", "ln_f.bias")
    km.finish(ignore=[k for k in km.state if k.endswith(BUFFERS)])
    run = {
        "model": model,
        "loop_eval": {"halting": "fixed", "max_steps": model["loop"]["max_steps"]},
    }
    where = {"last": "the last position of the padded query (--pred_pos last_token)",
             "answer": "the query's last token (--pred_pos inp_len)"}[model["halt_position"]]  # fmt: skip
    notes = [
        f"prediction position: {where}; evaluate with data.options.pred_pos {_data_hint(model)} (kg_files)",
        "GPT2Block attention/residual dropout 0.1 (GPT2Config default), embedding dropout from --dropout",
    ]
    return km.converted(run, notes)
