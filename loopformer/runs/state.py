"""The training-state skeleton of a checkpoint: nested state <-> (JSON skeleton, tensor table), RNG states."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch import Tensor


# --------------------------------------------------------------------------------------------
# Nested state <-> (JSON skeleton, tensor table)
# --------------------------------------------------------------------------------------------
def flatten_state(obj: Any, tensors: dict[str, Tensor] | None = None, prefix: str = "s") -> tuple[Any, dict]:
    """Replace every tensor in ``obj`` by ``{"__tensor__": key}``; returns (skeleton, tensors)."""
    tensors = {} if tensors is None else tensors
    if isinstance(obj, Tensor):
        key = f"{prefix}"
        tensors[key] = obj.detach().to("cpu", copy=True).contiguous()
        return {"__tensor__": key}, tensors
    if isinstance(obj, np.ndarray):
        key = f"{prefix}"
        tensors[key] = torch.from_numpy(np.ascontiguousarray(obj).copy())
        return {"__ndarray__": key}, tensors
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            return {k: flatten_state(v, tensors, f"{prefix}.{k}")[0] for k, v in obj.items()}, tensors
        if all(isinstance(k, int) and not isinstance(k, bool) for k in obj):
            items = {str(k): flatten_state(v, tensors, f"{prefix}.{k}")[0] for k, v in obj.items()}
            return {"__intdict__": items}, tensors
        raise TypeError(f"cannot checkpoint a dict with keys {list(obj)[:5]} at {prefix}")
    if isinstance(obj, list | tuple):
        items = [flatten_state(v, tensors, f"{prefix}.{i}")[0] for i, v in enumerate(obj)]
        return (items if isinstance(obj, list) else {"__tuple__": items}), tensors
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj, tensors
    if isinstance(obj, np.integer | np.floating | np.bool_):
        return obj.item(), tensors
    raise TypeError(f"cannot checkpoint a {type(obj).__name__} at {prefix} (tensors, numbers, strings only)")


def unflatten_state(skeleton: Any, tensors: dict[str, Tensor]) -> Any:
    """Inverse of ``flatten_state``."""
    if isinstance(skeleton, dict):
        if set(skeleton) == {"__tensor__"}:
            return tensors[skeleton["__tensor__"]]
        if set(skeleton) == {"__ndarray__"}:
            return tensors[skeleton["__ndarray__"]].numpy()
        if set(skeleton) == {"__intdict__"}:
            return {int(k): unflatten_state(v, tensors) for k, v in skeleton["__intdict__"].items()}
        if set(skeleton) == {"__tuple__"}:
            return tuple(unflatten_state(v, tensors) for v in skeleton["__tuple__"])
        return {k: unflatten_state(v, tensors) for k, v in skeleton.items()}
    if isinstance(skeleton, list):
        return [unflatten_state(v, tensors) for v in skeleton]
    return skeleton


# --------------------------------------------------------------------------------------------
# RNG states
# --------------------------------------------------------------------------------------------
def rng_state() -> dict[str, Any]:
    """torch (CPU and every CUDA device), numpy and python RNG states as tensors / lists."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
        "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
    }
    if torch.cuda.is_available():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"].to(torch.uint8))
    n = state["numpy"]
    np.random.set_state(
        (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"])
    )
    p = state["python"]
    random.setstate((p["version"], tuple(p["internal"]), p["gauss_next"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([t.to(torch.uint8) for t in state["cuda"]])
