"""``train.threads: 0`` (auto, issue 25): one CPU thread for small models, one per physical core for large ones,
``train.threads=N`` as given; the trainer sets and logs the count it chose."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from loopformer.config import TrainConfig
from loopformer.devices import SMALL_MODEL_PARAMETERS, cpu_threads, physical_cores, set_cpu_threads


def test_auto_gives_small_models_one_thread_and_large_ones_the_cores() -> None:
    auto = TrainConfig(threads=0)
    assert cpu_threads(auto.threads, 1, 100_000) == (1, "auto: a model below 2M parameters")
    threads, why = cpu_threads(auto.threads, 1, SMALL_MODEL_PARAMETERS)
    assert threads == physical_cores() and why == "auto: one per physical core"
    shared = cpu_threads(auto.threads, 2, SMALL_MODEL_PARAMETERS)[0]
    assert shared == max(1, physical_cores() // 2)
    assert cpu_threads(TrainConfig(threads=3).threads, 1, 100_000) == (3, "train.threads")


def test_set_cpu_threads_sets_and_logs_the_count(caplog: pytest.LogCaptureFixture) -> None:
    before = torch.get_num_threads()
    logger = logging.getLogger("loopformer")
    propagate, logger.propagate = logger.propagate, True
    try:
        with caplog.at_level(logging.INFO, logger="loopformer.train"):
            chosen = set_cpu_threads(TrainConfig(threads=0).threads, torch.device("cpu"), nn.Linear(10, 10))
        assert chosen == 1 and torch.get_num_threads() == 1
        assert (
            "CPU threads: 1 (auto: a model below 2M parameters; change with train.threads=N)" in caplog.text
        )
        set_cpu_threads(TrainConfig(threads=2).threads, torch.device("cpu"), nn.Linear(10, 10))
        assert torch.get_num_threads() == 2
    finally:
        logger.propagate = propagate
        torch.set_num_threads(before)
