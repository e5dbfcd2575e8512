"""KL + entropy halting at the answer position (LTG reference: forward_adapative reads one position)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loopformer.loop import LoopConfig
from loopformer.models.recurrent import answer_mask
from loopformer.models.registry import build_model

PAD = 9


def _model(halt_position: str):
    torch.manual_seed(0)
    return (
        build_model(
            "recurrent",
            vocab_size=10,
            seq_len=6,
            d_model=16,
            n_heads=2,
            n_layers=1,
            causal=True,
            rope=False,
            injection="none",
            halt_position=halt_position,
            pad_id=PAD,
            out_init_scale=1.0,
        )
        .double()
        .eval()
    )


def _oracle_steps(model, inputs: torch.Tensor, kl_t: float, ent_t: float, cap: int) -> list[int]:
    """The reference's rule written out: after each loop t, read the answer position's distribution;
    halt at the first t (>= min_steps) with KL(p_t || p_{t-1}) < kl_t and H(p_t) < ent_t, else the cap."""
    e = model.embed(inputs)[0]
    pos = answer_mask(inputs, PAD).float().argmax(dim=1)
    rows = torch.arange(len(inputs))
    z = e
    prev = F.log_softmax(model.readout(z)[rows, pos], -1)
    steps = [cap] * len(inputs)
    for t in range(1, cap + 1):
        z = model.step(z, e)
        logp = F.log_softmax(model.readout(z)[rows, pos], -1)
        p = logp.exp()
        kl = (p * (logp - prev)).sum(-1)
        ent = -(p * logp).sum(-1)
        for i in range(len(inputs)):
            if steps[i] == cap and t < cap and t >= 2 and kl[i] < kl_t and ent[i] < ent_t:
                steps[i] = t
        prev = logp
    return steps


def test_answer_mask_is_the_last_non_pad_token() -> None:
    inputs = torch.tensor([[1, 2, 3, PAD, PAD, PAD], [4, 5, 6, 7, 8, 1], [2, 3, PAD, PAD, PAD, PAD]])
    assert answer_mask(inputs, PAD).float().argmax(1).tolist() == [2, 5, 1]


@torch.no_grad()
def test_halting_reads_only_the_answer_position() -> None:
    model = _model("answer")
    inputs = torch.tensor([[1, 2, 3, PAD, PAD, PAD], [4, 5, 6, 7, 8, 1], [2, 3, PAD, PAD, PAD, PAD]])
    # thresholds chosen from this model's trajectory so that samples halt at different loops
    kl_t, ent_t, cap = 5e-3, 2.5, 12
    loop = LoopConfig(
        halting="kl_entropy",
        plugins={"kl_entropy": {"kl_threshold": kl_t, "entropy_threshold": ent_t, "reduce": "max"}},
        max_steps=cap,
        min_steps=2,
        grad="bptt",
    )
    out = model(inputs, loop=loop)
    assert out.loop.steps.tolist() == _oracle_steps(model, inputs, kl_t, ent_t, cap)
    torch.testing.assert_close(out.logits, model.readout(out.state))  # logits of every position, not masked


def test_answer_position_needs_pad_id() -> None:
    with pytest.raises(ValueError, match="pad_id"):
        build_model("recurrent", halt_position="answer")
    with pytest.raises(ValueError, match="halt_position"):
        build_model("recurrent", halt_position="middle", pad_id=0)
