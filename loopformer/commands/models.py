"""``loopformer models``: every registered family's parameter count at paper size and CPU size.

Paper size comes from each model module's ``paper_config()`` (the papers' sizes, docs/fidelity.md); the CPU
size is the family's config-class defaults (what a recipe starts from). Per-puzzle embedding
tables are excluded, as the papers count. Models are built on the ``meta`` device (``meta_model``): no
weights are allocated (tests/test_models_count.py checks the counts against real models).
"""

from __future__ import annotations

import importlib
from typing import Any

import click

from loopformer.commands.common import json_option

DESCRIPTIONS = {
    "transformer": "plain transformer, one pass (baseline)",
    "recurrent": "recurrent-depth looped block (LTG, Huginn)",
    "fprm": "fixed-point reasoner, damped solver",
    "attractor": "backbone + attractor head, implicit gradient",
    "ut_act": "Universal Transformer with ACT halting",
    "trm": "tiny recursive model, deep supervision",
    "hrm": "hierarchical reasoning model",
    "attractor_puzzle": "Attractor puzzle model (TRM-DEQ): Anderson inner solve",
}


def meta_model(model_cls: type, config: Any) -> Any:
    """``model_cls(config)`` built on the ``meta`` device: shapes only, no memory and no initialisation cost
    (the 27M-parameter paper models count in milliseconds)."""
    import torch

    with torch.device("meta"):
        return model_cls(config)


def _count(model_cls: type, config: Any) -> int:
    return int(meta_model(model_cls, config).num_parameters())


def model_rows() -> list[dict[str, Any]]:
    """One row per registered family: name, class, paper and CPU parameter counts (or an error)."""
    from loopformer.models.registry import MODELS, model_classes

    rows = []
    for name, spec in MODELS.items():
        row: dict[str, Any] = {
            "name": name,
            "class": spec.split(":")[1],
            "paper": None,
            "cpu": None,
            "note": "",
        }
        try:
            model_cls, config_cls = model_classes(name)
            module = importlib.import_module(spec.split(":")[0])
            row["note"] = DESCRIPTIONS.get(name, "")
            if hasattr(module, "paper_config"):
                row["paper"] = _count(model_cls, module.paper_config())
            row["cpu"] = _count(model_cls, config_cls())
        except Exception as err:  # one broken family must not hide the others
            row["note"] = f"unavailable: {type(err).__name__}: {err}"
        rows.append(row)
    return rows


def _fmt(n: int | None) -> str:
    if n is None:
        return "-"
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}k"


@click.command("models")
@json_option("print JSON instead of a table")
def models(as_json: bool) -> None:
    """List every registered model family with its parameter count at paper size and at the default CPU size."""
    rows = model_rows()
    if as_json:
        import json

        click.echo(json.dumps(rows, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title="loopformer models (parameters, per-puzzle embeddings excluded)")
    table.add_column("name")
    table.add_column("class")
    table.add_column("paper size", justify="right")
    table.add_column("CPU default", justify="right")
    table.add_column("note")
    for r in rows:
        table.add_row(r["name"], r["class"], _fmt(r["paper"]), _fmt(r["cpu"]), r["note"])
    console = Console()
    if not console.is_terminal:
        console = Console(width=120)
    console.print(table)
