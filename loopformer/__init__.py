"""loopformer: looped transformers that think until they converge.

One loop engine (``loopformer.loop``) runs every model family (``loopformer.models``)
on every task (``loopformer.tasks``); training and evaluation live in
``loopformer.train`` and ``loopformer.eval``; the ``loopformer`` command in ``loopformer.cli``;
``loopformer.load`` / ``loopformer.solve`` (``loopformer.api``) for trained models.
"""

from typing import Any

__version__ = "0.1.0"
__all__ = ["Solution", "load", "solve"]


def __getattr__(name: str) -> Any:
    """``loopformer.load`` / ``loopformer.solve`` / ``loopformer.Solution`` (``loopformer.api``), imported on
    first use so that ``import loopformer`` stays light."""
    if name in __all__:
        from loopformer import api

        return getattr(api, name)
    raise AttributeError(f"module 'loopformer' has no attribute {name!r}")
