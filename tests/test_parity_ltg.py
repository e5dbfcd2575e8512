"""LTG parity: loopformer's ``recurrent`` (block="gpt2") against OSU-NLP-Group/Loop-Think-Generalize's
``RecurrentGPT2Block`` (fixtures written by ``tools/parity/ltg.py``; see docs/fidelity.md). No reference
code (and no transformers) is needed to run these tests."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loopformer.convert import build_converted, converter
from loopformer.convert.fixtures import load_fixture, prefixed
from loopformer.convert.ltg import BLOCK_KEYS
from loopformer.loop import LoopConfig
from loopformer.train.optim import build_optimizer, set_lr

NAMES = ["ltg_rdt", "ltg_rdt_inject"]
LOGIT_ATOL, LOSS_RTOL, GRAD_RTOL, STEP_ATOL = 1e-5, 1e-6, 1e-5, 1e-6


class Loaded:
    def __init__(self, name: str) -> None:
        self.tensors, self.meta = load_fixture(name)
        self.converted = converter("ltg")(prefixed(self.tensors, "ref"), self.meta["ref_config"])
        # the fixture turns GPT-2's attention / residual dropout off (tools/parity/ltg.py)
        self.config, self.model = build_converted(self.converted, ["model.dropout=0.0"], dtype=torch.float64)
        b = prefixed(self.tensors, "batch")
        self.inputs, self.targets, self.lengths = b["input_ids"], b["targets"], b["input_lengths"]
        self.real = b["attention_mask"].bool()  # the reference masks pad keys; compare real positions
        self.rows = torch.arange(len(self.inputs))

    def answer(self, logits: torch.Tensor) -> torch.Tensor:
        return logits[self.rows, self.lengths - 1]

    def ref_name(self, ours: str) -> tuple[str, bool]:
        """Reference state-dict key of a loopformer parameter, and whether it is a transposed Conv1D."""
        if ours.startswith("core."):
            _, i, rest = ours.split(".", 2)
            src, transpose = BLOCK_KEYS[rest]
            return f"blocks.{i}.{src}", transpose
        return {
            "embedding.tokens.weight": "token_embedding.weight",
            "output.norm.weight": "ln_f.weight",
            "output.norm.bias": "ln_f.bias",
        }[ours], False


def _fixed(n: int) -> LoopConfig:
    return LoopConfig(halting="fixed", max_steps=n, grad="bptt")


@pytest.mark.parametrize("name", NAMES)
def test_parity_ltg_eval_logits(name: str) -> None:
    f = Loaded(name)
    with torch.no_grad():
        out = f.model.eval()(f.inputs, loop=_fixed(f.meta["eval_loops"]))
    ref = f.tensors["eval_logits"]
    torch.testing.assert_close(out.logits[f.real], ref[f.real], rtol=0, atol=LOGIT_ATOL)


@pytest.mark.parametrize("name", NAMES)
def test_parity_ltg_kl_entropy_halting_at_the_answer(name: str) -> None:
    """forward_adapative: halt at the first loop t >= 2 with KL < eps and H < thresh at the answer."""
    f = Loaded(name)
    a = f.meta["adaptive"]
    loop = LoopConfig(
        halting="kl_entropy",
        kl_threshold=a["eps_kl"],
        entropy_threshold=a["entropy_thresh"],
        max_steps=a["max_loops"],
        min_steps=2,
        grad="bptt",
    )
    with torch.no_grad():
        out = f.model.eval()(f.inputs, loop=loop)
    assert out.loop.steps.tolist() == f.tensors["adaptive_iterations"].tolist()
    assert len(set(out.loop.steps.tolist())) >= 2  # the fixture exercises per-sample halting
    ref = f.tensors["adaptive_logits"]
    torch.testing.assert_close(out.logits[f.real], ref[f.real], rtol=0, atol=LOGIT_ATOL)


@pytest.mark.parametrize("name", NAMES)
def test_parity_ltg_train_loss_grads_and_step(name: str) -> None:
    f = Loaded(name)
    model = f.model.train()
    out = model(f.inputs, loop=_fixed(f.meta["train_loops"]))
    loss = F.cross_entropy(f.answer(out.logits), f.targets)  # the trainer's CE at the answer position
    torch.testing.assert_close(loss, f.tensors["train_loss"].reshape(()), rtol=LOSS_RTOL, atol=0)
    loss.backward()
    for ours, p in model.named_parameters():
        ref_key, _ = f.ref_name(ours)
        ref = f.tensors[f"grad_norm.{ref_key}"].reshape(())
        torch.testing.assert_close(p.grad.norm(), ref, rtol=GRAD_RTOL, atol=1e-12, msg=ours)
    opt = f.meta["optimizer"]
    optimizer = build_optimizer(
        model, opt["lr"], opt["weight_decay"], tuple(opt["betas"]), opt["eps"], decay_all=True
    )  # the reference decays every parameter
    set_lr(optimizer, opt["lr"])
    optimizer.step()
    for ours, p in model.named_parameters():
        ref_key, transpose = f.ref_name(ours)
        ref = f.tensors[f"step.{ref_key}"]
        torch.testing.assert_close(
            p.detach(), ref.t() if transpose else ref, rtol=0, atol=STEP_ATOL, msg=ours
        )


def test_ltg_convert_rejects_unknown_keys() -> None:
    from loopformer.train.checkpoint import CheckpointError

    tensors, meta = load_fixture("ltg_rdt")
    state = prefixed(tensors, "ref")
    state["blocks.0.extra.weight"] = torch.zeros(1)
    with pytest.raises(CheckpointError, match="blocks.0.extra.weight"):
        converter("ltg")(state, meta["ref_config"])
