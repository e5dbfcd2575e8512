"""Helpers shared by the model test files (tests/test_models_*.py): a random token batch and a few
Adam steps on cross-entropy, asserting finite gradients at every step."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def random_batch(vocab: int, seq_len: int, B: int = 3, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, labels), both [B, seq_len] uniform tokens below ``vocab``, from one seeded generator."""
    g = torch.Generator().manual_seed(seed)
    inputs = torch.randint(0, vocab, (B, seq_len), generator=g)
    labels = torch.randint(0, vocab, (B, seq_len), generator=g)
    return inputs, labels


def train_losses(
    model: torch.nn.Module, inputs: torch.Tensor, labels: torch.Tensor, steps: int, aux_loss: bool = False
) -> list[float]:
    """Losses of ``steps`` Adam steps (lr 3e-3) on token cross-entropy (+ the model's ``aux_loss`` when
    asked); asserts every gradient is finite."""
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        out = model(inputs)
        loss = F.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]), labels.reshape(-1))
        if aux_loss:
            loss = loss + out.aux_loss
        opt.zero_grad()
        loss.backward()
        assert all(p.grad is None or torch.isfinite(p.grad).all() for p in model.parameters())
        opt.step()
        losses.append(loss.item())
    return losses
