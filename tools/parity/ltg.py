"""Parity fixtures for Loop, Think & Generalize (github OSU-NLP-Group/Loop-Think-Generalize).

Imports ``gpt_utils_extrapolation.RecurrentGPT2Block`` (fixtures ``ltg_rdt``, ``ltg_rdt_inject``: the answer
read at the query's last token, ``pred_pos="inp_len"``; ``ltg_rdt_last``: ``pred_pos="last_token"``, the
scripts' default, position ``max_len - 1``, a pad position for shorter queries) and
``gpt_utils_systematicity.RecurrentGPT2Block`` (``ltg_rdt_learned``: the learned ``position_embedding`` added
once before the loop, a table of ``n_positions`` = T + 2 rows for a batch of T tokens, the loss of
``train_systematicity.train_model``: cross-entropy with label smoothing 0.1 at ``logits[:, -1]``, AdamW
weight decay 0.1; the model has no ``forward_adapative``) from a checkout of the reference (``--ref``),
builds each at a tiny size in float64 on CPU and saves, per fixture (``tests/fixtures/parity/ltg_*.safetensors``):
the reference state dict (``ref.*``), an input batch (right-padded with ``<pad>`` = 0, as the reference's
``custom_collate``), the logits of ``forward`` at a fixed loop count (eval mode), the final logits and
per-sample iteration counts of ``forward_adapative`` (the KL + entropy halting of
``inference_extrapolation_adaptive.py``, monitoring the fixture's ``pred_pos``), the training loss of one
step as ``train_extrapolation.train_model`` computes it (cross-entropy at the prediction position), the
per-parameter gradient norms, and the weights after one ``torch.optim.AdamW(model.parameters(), lr,
weight_decay)`` step (the optimiser ``train_model`` builds; its linear warm-up would make the first
step's learning rate 0, so the step is taken at the base rate).

Substitutions and fixture settings (also in each fixture's JSON):
- transformers 4.46.3, the ``GPT2Block`` API the reference is written against (``block(...)[0]``, causal
  mask inside the block); transformers 5 returns a tensor and builds the causal mask in ``GPT2Model``,
  which silently breaks the reference code. The script refuses other major versions.
- float64; dropout 0 (``embd_pdrop``, ``resid_pdrop``, ``attn_pdrop``) so that the training step is
  deterministic (the scripts' default attention / residual dropout 0.1 is loopformer's ``dropout``);
  ``c_scale`` 0.5 instead of the scripts' 0 (zero output projections would make every block the
  identity at this weight draw); the weights are then redrawn (``_redraw``, seeded) so that the loop
  moves the state and the halting rule sees a non-trivial trajectory.

Usage: ``python tools/parity/ltg.py --ref /path/to/Loop-Think-Generalize [--out DIR | --check]``
(``pip install transformers==4.46.3`` first, or put it on ``PYTHONPATH``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import main

from loopformer.convert.fixtures import save_fixture

COMMITS = {  # the stored versions the checkout was laid out from (search tool read_file)
    "gpt_utils_extrapolation.py": "1e9a4929b6984b308c22c28d69b74988730d663c",
    "train_extrapolation.py": "90a7291f69725d43f6908eb022de4712a7f34ae6",
    "inference_extrapolation_adaptive.py": "1e9a4929b6984b308c22c28d69b74988730d663c",
}
COMMITS_SYSTEMATICITY = {
    "gpt_utils_systematicity.py": "8229260e7b1e051e465d25736877c35780f57620",
    "train_systematicity.py": "8229260e7b1e051e465d25736877c35780f57620",
}
VOCAB, T, D, LAYERS, HEADS = 14, 8, 16, 2, 2
LENGTHS = [8, 5, 3, 6]
LR, WD, R_EVAL, R_TRAIN, R_MAX = 1e-3, 0.01, 3, 3, 8
WD_SYSTEMATICITY, LABEL_SMOOTHING = 0.1, 0.1  # train_systematicity.py: --weight_decay, CrossEntropyLoss


def _check_transformers() -> None:
    import transformers

    if not transformers.__version__.startswith("4."):
        raise SystemExit(
            f"transformers {transformers.__version__}: the reference needs the 4.x GPT2Block API "
            "(pip install transformers==4.46.3)"
        )


def _batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.zeros(len(LENGTHS), T, dtype=torch.long)
    for i, n in enumerate(LENGTHS):
        ids[i, :n] = torch.randint(1, VOCAB, (n,), generator=g)
    targets = torch.randint(1, VOCAB, (len(LENGTHS),), generator=g)
    return {
        "input_ids": ids,
        "attention_mask": (ids != 0).long(),
        "input_lengths": torch.tensor(LENGTHS),
        "targets": targets,
    }


def _redraw(model: torch.nn.Module) -> None:
    """Weights with a non-trivial loop trajectory at this size (the init's 0.02-std blocks barely move the
    state and the N(0, 1) tied embedding saturates the softmax): block matrices N(0, 0.3^2), biases
    N(0, 0.1^2), LayerNorm gains 1 + N(0, 0.1^2), token embedding scaled by 0.3. Seeded."""
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=p.dtype)
            if name == "token_embedding.weight":
                p.mul_(0.3)
            elif "ln_" in name and name.endswith("weight"):
                p.copy_(1 + 0.1 * noise)
            elif p.dim() >= 2:
                p.copy_(0.3 * noise)
            else:
                p.copy_(0.1 * noise)


def _adaptive(
    model, b: dict[str, torch.Tensor], pred_pos: str
) -> tuple[dict[str, torch.Tensor], float, float]:
    """forward_adapative with the thresholds of a fixed grid that give the most distinct halting counts
    (ties: the most samples halted before the cap, then the first in grid order). For ``last_token`` the
    first criterion is that the counts differ from those of ``inp_len`` at the same thresholds, so that
    the fixture tells the two monitored positions apart."""
    model.num_iterations = R_MAX

    def run(pos: str, kl: float, ent: float) -> dict[str, torch.Tensor]:
        ids, mask, lengths = b["input_ids"], b["attention_mask"], b["input_lengths"]
        return model.forward_adapative(
            ids, mask, lengths, pred_pos=pos, eps_kl=kl, entropy_thresh=ent, min_iters=1
        )

    best = None
    for ent in (1.0, 1.5, 2.0, 2.2, 2.4, 2.5, 2.6, 2.7, 3.0):
        for kl in (1e-4, 1e-3, 1e-2, 3e-2, 1e-1, 3e-1):
            out = run(pred_pos, kl, ent)
            used = out["iterations_used"]
            score: tuple[int, ...] = (len(set(used.tolist())), int((used < R_MAX).sum()))
            if pred_pos == "last_token":
                score = (int(not torch.equal(used, run("inp_len", kl, ent)["iterations_used"])), *score)
            if best is None or score > best[0]:
                best = (score, out, kl, ent)
    if best[0][-2] < 2 or (pred_pos == "last_token" and not best[0][0]):
        raise SystemExit("no threshold pair gives distinct halting counts; change the seed or the grid")
    return best[1], best[2], best[3]


def _gpt2_config(n_positions: int):
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=VOCAB,
        n_positions=n_positions,
        n_ctx=n_positions,
        n_embd=D,
        n_layer=LAYERS,
        n_head=HEADS,
        embd_pdrop=0.0,
        resid_pdrop=0.0,
        attn_pdrop=0.0,
        _attn_implementation="eager",
    )


def _predicted(logits: torch.Tensor, b: dict[str, torch.Tensor], pred_pos: str) -> torch.Tensor:
    """train_model's logits at the prediction position ([:, -1] for last_token, else the query's last)."""
    if pred_pos == "last_token":
        return logits[:, -1, :]
    idx = (b["input_lengths"] - 1).view(-1, 1, 1).expand(-1, 1, logits.size(-1))
    return logits.gather(1, idx).squeeze(1)


def _train_step(model, b, tensors, pred_pos: str, loss_fn, weight_decay: float) -> None:
    """One train_model step at R_TRAIN loops: the loss, every gradient norm, the weights after AdamW."""
    model.train()
    model.num_iterations = R_TRAIN
    logits = model(b["input_ids"], attention_mask=b["attention_mask"]).logits
    loss = loss_fn(_predicted(logits, b, pred_pos), b["targets"])
    loss.backward()
    tensors["train_loss"] = loss.detach().reshape(1)
    names = {id(p): n for n, p in model.named_parameters()}
    for p in model.parameters():
        tensors[f"grad_norm.{names[id(p)]}"] = p.grad.detach().norm().reshape(1)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=weight_decay)
    opt.step()
    tensors.update({f"step.{k}": v.detach().clone() for k, v in model.state_dict().items()})


def _start(model) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Redrawn weights, the batch, and the fixture's tensors so far (the state dict and the batch)."""
    _redraw(model)
    b = _batch()
    tensors = {f"ref.{k}": v.detach().clone() for k, v in model.state_dict().items()}
    tensors.update({f"batch.{k}": v for k, v in b.items()})
    return b, tensors


def build_one(name: str, inject: bool, out_dir: Path, pred_pos: str = "inp_len") -> str:
    from gpt_utils_extrapolation import RecurrentGPT2Block

    torch.manual_seed(0)
    model = RecurrentGPT2Block(
        _gpt2_config(T), R_EVAL, positional_embedding_type="none", input_injection=inject, c_scale=0.5
    ).double()
    b, tensors = _start(model)
    model.eval()
    with torch.no_grad():
        model.num_iterations = R_EVAL
        tensors["eval_logits"] = model(b["input_ids"], attention_mask=b["attention_mask"]).logits
        adaptive, kl, ent = _adaptive(model, b, pred_pos)
    tensors["adaptive_logits"] = adaptive["final_logits"]
    tensors["adaptive_iterations"] = adaptive["iterations_used"]
    _train_step(model, b, tensors, pred_pos, F.cross_entropy, WD)
    meta = {
        "repository": "OSU-NLP-Group/Loop-Think-Generalize",
        "commits": COMMITS,
        "model": "gpt_utils_extrapolation.RecurrentGPT2Block",
        "ref_config": {
            "num_heads": HEADS,
            "input_injection": inject,
            "dropout": 0.0,
            "c_scale": 0.5,
            "max_len": T,
            "dynamic_max": R_MAX,
            "pred_pos": pred_pos,
        },
        "tiny": {
            "vocab": VOCAB,
            "n_positions": T,
            "n_embd": D,
            "n_layer": LAYERS,
            "n_head": HEADS,
            "lengths": LENGTHS,
            "dtype": "float64",
        },
        "eval_loops": R_EVAL,
        "train_loops": R_TRAIN,
        "adaptive": {"max_loops": R_MAX, "eps_kl": kl, "entropy_thresh": ent, "pred_pos": pred_pos},
        "optimizer": {"name": "AdamW", "lr": LR, "weight_decay": WD, "betas": [0.9, 0.999], "eps": 1e-8},
        "train_pred_pos": pred_pos,
        "label_smoothing": 0.0,
        "substitutions": [
            "transformers 4.46.3 (the GPT2Block API the reference is written against)",
            "float64; dropout 0 (embd, resid, attn) for a deterministic training step",
            "c_scale 0.5 instead of the scripts' 0 (non-trivial blocks at this size)",
            "weights redrawn after construction (_redraw: seeded, non-trivial loop trajectory)",
            "one AdamW step at the base learning rate (the warm-up schedule's first step would be 0)",
        ],
    }
    save_fixture(out_dir, name, tensors, meta)
    return name


def build_learned(name: str, out_dir: Path) -> str:
    """gpt_utils_systematicity.RecurrentGPT2Block: learned positions, fixed R, the answer at logits[:, -1]."""
    from gpt_utils_systematicity import RecurrentGPT2Block

    n_positions = T + 2  # a table longer than the batch: the reference adds its first T rows
    torch.manual_seed(0)
    model = RecurrentGPT2Block(_gpt2_config(n_positions), R_EVAL).double()
    b, tensors = _start(model)
    model.eval()
    with torch.no_grad():
        model.num_iterations = R_EVAL  # evaluate_model_test at --recurrence
        tensors["eval_logits"] = model(b["input_ids"], attention_mask=b["attention_mask"]).logits
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=LABEL_SMOOTHING)
    _train_step(model, b, tensors, "last_token", criterion, WD_SYSTEMATICITY)
    meta = {
        "repository": "OSU-NLP-Group/Loop-Think-Generalize",
        "commits": COMMITS_SYSTEMATICITY,
        "model": "gpt_utils_systematicity.RecurrentGPT2Block",
        "ref_config": {"num_heads": HEADS, "recurrence": R_EVAL, "dropout": 0.0},
        "tiny": {
            "vocab": VOCAB,
            "n_positions": n_positions,
            "n_embd": D,
            "n_layer": LAYERS,
            "n_head": HEADS,
            "lengths": LENGTHS,
            "dtype": "float64",
        },
        "eval_loops": R_EVAL,
        "train_loops": R_TRAIN,
        "optimizer": {
            "name": "AdamW",
            "lr": LR,
            "weight_decay": WD_SYSTEMATICITY,
            "betas": [0.9, 0.999],
            "eps": 1e-8,
        },
        "train_pred_pos": "last_token",
        "label_smoothing": LABEL_SMOOTHING,
        "substitutions": [
            "transformers 4.46.3 (the GPT2Block API the reference is written against)",
            "float64; dropout 0 (embd, resid, attn) for a deterministic training step",
            "weights redrawn after construction (_redraw: seeded, non-trivial loop trajectory)",
            "one AdamW step at the base learning rate (the warm-up schedule's first step would be 0)",
        ],
    }
    save_fixture(out_dir, name, tensors, meta)
    return name


def build(ref_root: Path, out_dir: Path) -> list[str]:
    _check_transformers()
    torch.set_default_dtype(torch.float64)
    try:
        names = [
            build_one("ltg_rdt", False, out_dir),
            build_one("ltg_rdt_inject", True, out_dir),
            build_one("ltg_rdt_last", False, out_dir, pred_pos="last_token"),
            build_learned("ltg_rdt_learned", out_dir),
        ]
    finally:
        torch.set_default_dtype(torch.float32)
    return [f"{n}.{ext}" for n in names for ext in ("safetensors", "json")]


if __name__ == "__main__":
    main(build, __doc__.splitlines()[0])
