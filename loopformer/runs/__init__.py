"""Run storage: everything loopformer keeps on disk about a run, and loading a trained run back.

Modules, bottom up (each imports only those above it in this list, plus ``loopformer.config``, models,
tasks, ``loopformer.files`` and ``loopformer.numerics``; never training, evaluation or the commands):

- ``folder``: a run folder and its lock (``.loopformer.lock``: pid and host; a dead holder's lock is taken
  over), what counts as a run, the refusals that keep one run out of another's folder;
- ``outputs``: output folders a command owns (``eval -o``, ``compare -o``, ...): built aside and swapped in
  whole (``renameat2`` exchange), never through a link, never over another run or dataset;
- ``provenance``: ``provenance.json`` (versions, commit, command line; a record per resume);
- ``state``: the training-state skeleton (nested data split into JSON + a tensor table, RNG states);
- ``manifest``: the checksums of a checkpoint's files, verified before anything in it is used;
- ``plugin_record``: the user modules a run's model / task / loop plug-ins come from;
- ``sharded``: checkpoints written as shards by several processes, consolidated;
- ``checkpoint``: the checkpoint format (safetensors + JSON, written atomically, no pickle), the dtype
  checks of loading, ``latest`` / pruning;
- ``best``: the ``best`` pointer (``train.keep_best``);
- ``resume_checks``: what a resume refuses (another run's checkpoint, a changed training stream);
- ``hub``: a run shared through the Hugging Face Hub (``push``; a hub id resolved to a local folder);
- ``load``: a run's data splits and ``load_run``, a trained model ready to evaluate (read the folder ->
  read and validate its config -> build the model -> load the weights).

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
