"""Losses against float64 hand computations and closed forms."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from loopformer.tasks.base import IGNORE_INDEX
from loopformer.train.losses import (
    accuracy,
    jacobian_frobenius,
    q_halt_loss,
    sequence_loss,
    stablemax_log_probs,
    token_losses,
)


def _stablemax_by_hand(row: list[float]) -> list[float]:
    s = [x + 1.0 if x >= 0 else 1.0 / (1.0 - x) for x in row]
    total = math.fsum(s)
    return [math.log(v) - math.log(total) for v in s]


def test_stablemax_matches_a_float64_hand_computation() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.0, -3.5], [0.25, 0.25, -0.5, 10.0]], dtype=torch.float32)
    got = stablemax_log_probs(logits)
    assert got.dtype == torch.float64
    for row, out in zip(logits.tolist(), got.tolist()):
        for a, b in zip(_stablemax_by_hand(row), out):
            assert abs(a - b) < 1e-12
    assert torch.allclose(got.exp().sum(-1), torch.ones(2, dtype=torch.float64))
    # x = -3.5: s = 1 / 4.5 exactly
    assert abs(math.exp(got[0, 3]) * (3 + 1 + 1 / 2 + 1 / 4.5) - 1 / 4.5) < 1e-12


def test_stablemax_cross_entropy_ignores_unlabelled_positions_and_averages_per_sample() -> None:
    logits = torch.tensor([[[1.0, -2.0, 0.5], [0.0, 3.0, -1.0]], [[-1.0, -1.0, 2.0], [4.0, 0.0, 0.0]]])
    labels = torch.tensor([[0, IGNORE_INDEX], [2, 1]])
    losses, mask = token_losses(logits, labels, "stablemax")
    assert mask.tolist() == [[True, False], [True, True]] and losses[0, 1] == 0
    by_hand = [
        -_stablemax_by_hand([1.0, -2.0, 0.5])[0],
        (-_stablemax_by_hand([-1.0, -1.0, 2.0])[2] - _stablemax_by_hand([4.0, 0.0, 0.0])[1]) / 2,
    ]
    assert abs(float(sequence_loss(logits, labels, "stablemax")) - sum(by_hand) / 2) < 1e-6


def test_ce_matches_torch_cross_entropy() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 7, generator=g)
    labels = torch.randint(0, 7, (3, 5), generator=g)
    labels[1, :2] = IGNORE_INDEX
    losses, mask = token_losses(logits, labels, "ce")
    reference = F.cross_entropy(
        logits.reshape(-1, 7), labels.reshape(-1), reduction="none", ignore_index=IGNORE_INDEX
    )
    assert torch.allclose(losses.reshape(-1), reference, atol=1e-6)
    per_sample = reference.reshape(3, 5).sum(1) / mask.sum(1)
    assert torch.allclose(sequence_loss(logits, labels), per_sample.mean(), atol=1e-6)


def test_accuracy_and_q_halt_target_is_exact_answer() -> None:
    logits = torch.zeros(2, 3, 4)
    logits[0, :, 1] = 1  # predicts 1 1 1
    logits[1, :, 2] = 1  # predicts 2 2 2
    labels = torch.tensor([[1, 1, IGNORE_INDEX], [2, 0, 2]])
    acc = accuracy(logits, labels)
    assert acc.exact.tolist() == [True, False] and acc.token_acc == 4 / 5 and acc.exact_acc == 0.5
    q = torch.tensor([0.3, -1.2])
    expected = -(math.log(torch.sigmoid(q[0])) + math.log(1 - torch.sigmoid(q[1]))) / 2
    assert abs(float(q_halt_loss(q, acc.exact)) - expected) < 1e-6


def test_hutchinson_jacobian_estimate_matches_the_frobenius_norm_of_a_linear_map() -> None:
    g = torch.Generator().manual_seed(1)
    W = torch.randn(6, 6, generator=g, dtype=torch.float64) * 0.5
    W.requires_grad_(True)
    z = torch.randn(3, 6, generator=g, dtype=torch.float64)

    def step(z_: torch.Tensor) -> torch.Tensor:
        return z_ @ W.T

    est = jacobian_frobenius(step, z, (), torch.Generator().manual_seed(2), n_samples=4000)
    exact = float((W.detach() ** 2).sum()) / 6
    assert abs(float(est.detach()) - exact) / exact < 0.05
    est.backward()  # differentiable in the step's parameters: d/dW ||W||_F^2 / 6 = 2 W / 6 on average
    assert torch.allclose(W.grad, 2 * W.detach() / 6, atol=0.1)


def test_jacobian_penalty_of_an_attention_model_equals_the_explicit_jacobian_and_trains() -> None:
    # FPRM with attention (scaled-dot-product attention has no double backward in its fused kernels): the
    # penalty with a given probe v equals ||v^T J||^2 / (B dim) from the explicit float64 Jacobian, and its
    # gradient reaches the attention weights (double backward through the math kernel)
    from loopformer.models import build_model

    torch.manual_seed(0)
    model = build_model("fprm", vocab_size=5, seq_len=4, d_model=8, n_heads=2, n_layers=1).double()
    inputs = torch.randint(0, 5, (2, 4))
    ctx = model.embed(inputs)
    z = torch.randn(2, 4, 8, dtype=torch.float64)
    v = torch.randn(2, 4, 8, dtype=torch.float64)
    est = jacobian_frobenius(model.step, z, ctx, probes=[v])
    J = torch.autograd.functional.jacobian(
        lambda t: model.step(t, *[c.detach() for c in ctx]), z
    )  # [B,T,d,B,T,d]
    vJ = torch.einsum("btd,btdcse->cse", v, J)
    assert torch.allclose(est, vJ.pow(2).sum() / (2 * 4 * 8), rtol=1e-10, atol=0)
    est.backward()
    attention = [p for n, p in model.named_parameters() if ".mix." in n]  # qkv and output projections
    assert attention and all(p.grad is not None and p.grad.abs().sum() > 0 for p in attention)
