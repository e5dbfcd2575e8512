"""Run storage: everything loopformer keeps on disk about a run, and loading a trained run back.

Modules, bottom up (each imports only those above it in this list, plus ``loopformer.config``, models,
tasks, ``loopformer.files`` and ``loopformer.numerics``; never training, evaluation or the commands):

- ``checkpoint``: checkpoints, one owner: the format (safetensors + JSON, written atomically, no pickle),
  the manifest verified before anything in it is used, the dtype checks of loading, ``latest`` / pruning,
  the ``best`` pointer (``train.keep_best``), sharded checkpoints written by several processes; the records
  run storage reads back, as dataclasses checked by the configuration's strict loader (``read_record``);
- ``folder``: the run folder, one owner: its lock (``.loopformer.lock``), what counts as a run, the
  refusals that keep one run out of another's folder, output folders built aside and swapped in whole
  (``staged_output``), provenance, data fingerprints, what a resume refuses, the summary;
- ``load``: a run's data splits and ``load_run``, a trained model ready to evaluate (read the folder ->
  read and validate its config -> build the model -> load the weights);
- ``hub``: a run shared through the Hugging Face Hub (``push``; a hub id resolved to a local folder).

The trainer hands storage what it saves (its ``state_dict()``s) and takes back what it restores; storage
never reads the trainer's attributes.

The public names (``load_run``, ``LoadedRun``, ``eval_dataset``, ``task_dataset``, ``load_split``,
``run_task``, ``training_depth``, ``checkpoint_label``) are imported on first use, so that
``import loopformer.runs.folder`` stays light.
"""

from __future__ import annotations

import importlib
from typing import Any

_FROM_LOAD = (
    "LoadedRun",
    "checkpoint_label",
    "eval_dataset",
    "load_run",
    "load_split",
    "run_task",
    "task_dataset",
    "training_depth",
)

__all__ = sorted(_FROM_LOAD)


def __getattr__(name: str) -> Any:
    if name in _FROM_LOAD:
        return getattr(importlib.import_module("loopformer.runs.load"), name)
    raise AttributeError(f"module 'loopformer.runs' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_FROM_LOAD))
