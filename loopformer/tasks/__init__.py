"""Tasks: generators with a difficulty knob, loaders for standard files, independent validators."""

from loopformer.tasks.base import IGNORE_INDEX, Task, TaskDataError, TokenDataset

__all__ = ["IGNORE_INDEX", "Task", "TaskDataError", "TokenDataset"]
