"""loopformer: looped transformers that think until they converge.

One loop engine (``loopformer.loop``) runs every model family (``loopformer.models``)
on every task (``loopformer.tasks``); training and evaluation live in
``loopformer.train`` and ``loopformer.eval``; the ``loopformer`` command in ``loopformer.cli``.
"""

__version__ = "0.1.0"
