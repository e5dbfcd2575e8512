"""Loading a stored tensor into a model's tensor must not change its values (``dtype_problem``).

``loopformer.train.checkpoint.check_weights`` asks it about every tensor of a checkpoint: a float64 tensor
in a checkpoint whose other tensors are float32 (the model is then built in float32) would be rounded
silently by ``load_state_dict``; an integer tensor where the model has a float one is no checkpoint of
that model.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_problem(name: str, stored: Tensor, target: Tensor) -> str | None:
    """Why loading ``stored`` into ``target`` would change its values, or None: an integer or boolean
    tensor for a floating one (or back), or a float rounded to a narrower one (a float64 tensor in a
    float32 model). Widening (bf16 -> float32) is exact and allowed."""
    if stored.dtype == target.dtype:
        return None
    if stored.is_floating_point() != target.is_floating_point() or stored.is_complex() != target.is_complex():
        return f"parameter {name!r} is {_name(stored.dtype)} in the checkpoint but {_name(target.dtype)} in the model"
    if stored.is_floating_point() and torch.finfo(stored.dtype).bits > torch.finfo(target.dtype).bits:
        return (
            f"parameter {name!r} is {_name(stored.dtype)} in the checkpoint but the model is "
            f"{_name(target.dtype)} (as the checkpoint's other tensors): loading would round it; store every "
            "floating tensor in one dtype"
        )
    return None
