"""Where evaluation runs: ``--device auto|cpu|cuda|cuda:N`` of ``loopformer eval``, ``solve`` and ``run``,
and the ``device=`` argument of ``loopformer.load``.

``auto`` is CUDA when torch sees a GPU, else the CPU (what training does).  ``cuda:N`` must name a GPU
torch can see.  Precision follows the run: a run trained with ``bf16`` (``auto``: on CUDA; ``true``: on
every device, the CPU included) is evaluated under the same bf16 autocast (``loopformer.nn.autocast``).
"""

from __future__ import annotations

from typing import Any

import torch

DEVICE_HELP = "auto (CUDA when present, else CPU), cpu, cuda or cuda:N"


def resolve_device(spec: str | torch.device | None) -> torch.device:
    """``auto`` / None -> CUDA when available, else CPU; ``cpu``; ``cuda``; ``cuda:N`` (checked)."""
    if isinstance(spec, torch.device):
        spec = str(spec)
    if spec is not None and not isinstance(spec, str):
        raise ValueError(f"device {spec!r}: expected auto, cpu, cuda or cuda:N (a string or torch.device)")
    text = (spec or "auto").strip().lower()
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if text == "cpu":
        return torch.device("cpu")
    if text == "cuda" or text.startswith("cuda:"):
        index = text.partition(":")[2]
        if index and not index.isdigit():
            raise ValueError(f"device {spec!r}: expected cuda:N with N a GPU index")
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {spec!r}: CUDA is not available here (torch {torch.__version__}); use cpu or auto"
            )
        if index and int(index) >= torch.cuda.device_count():
            raise ValueError(f"device {spec!r}: only {torch.cuda.device_count()} GPU(s) visible")
        return torch.device(text)
    raise ValueError(f"device {spec!r}: expected {DEVICE_HELP}")


def device_option() -> Any:
    """The shared ``--device`` click option."""
    import click

    return click.option(
        "--device", default="auto", show_default=True, help=f"where to evaluate: {DEVICE_HELP}"
    )
