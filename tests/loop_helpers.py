"""Shared oracles for the loop-engine tests: linear maps with a known spectrum (float64)."""

import torch

DT = torch.float64


def sym_map(d: int, eigs: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """W = Q diag(eigs) Q^T with a random orthogonal Q: spectral radius exactly max |eig|."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=DT))
    return q @ torch.diag(eigs.to(DT)) @ q.T
