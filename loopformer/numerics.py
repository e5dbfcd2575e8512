"""Numerical-fault checks: a model with NaN / infinite weights, logits or states is never scored.

``check_weights_finite`` runs when a checkpoint is loaded (``loopformer.runs.checkpoint``);
``check_output`` after every evaluation forward (``loopformer.eval.evaluate``) and in ``solve``.
Each raises ``NumericalFaultError`` naming what is non-finite, so ``eval`` / ``solve`` exit with
status 1 and a clear message instead of reporting "0%" for a broken model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor


class NumericalFaultError(RuntimeError):
    """Non-finite (NaN / inf) weights, logits or loop states: the result would be meaningless."""


def nonfinite_names(tensors: Mapping[str, Tensor]) -> list[str]:
    """Names of floating-point tensors holding a NaN or an infinity."""
    return [
        name
        for name, t in tensors.items()
        if t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all())
    ]


def check_weights_finite(tensors: Mapping[str, Tensor], source: str) -> None:
    bad = nonfinite_names(tensors)
    if bad:
        more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
        raise NumericalFaultError(
            f"{source}: parameter {bad[0]!r}{more} holds NaN or infinite values (the run diverged?); "
            "refusing to evaluate it"
        )


def check_output(out: Any, where: str) -> None:
    """``out`` (a ``ModelOutput``): its logits and final loop state must be finite."""
    for name in ("logits", "state"):
        t = getattr(out, name, None)
        if (
            isinstance(t, Tensor)
            and t.is_floating_point()
            and t.numel()
            and not bool(torch.isfinite(t).all())
        ):
            raise NumericalFaultError(
                f"{where}: the model's {'logits' if name == 'logits' else 'loop state'} hold NaN or infinite "
                "values (diverged weights or an unstable loop); no result is reported"
            )
