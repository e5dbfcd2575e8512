"""The benchmarks' cached trained model (benchmarks/bench_halting.py ``trained_model``): a run left unfinished
in the cache by a killed benchmark is trained anew, not a crash on the next run (RunFolderError before)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks import bench_halting


def test_an_unfinished_cached_run_is_trained_anew(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from loopformer.train import Trainer

    monkeypatch.setattr(bench_halting, "CACHE", tmp_path)
    threads = torch.get_num_threads()
    model, cfg, trained_now, _ = bench_halting.trained_model(True)  # the first run: trains and caches
    assert trained_now
    folder = Path(cfg.out_dir)
    stale = bench_halting.run_config(True)
    stale.out_dir = str(folder)
    (folder / "summary.json").unlink()  # as a kill before the end leaves it: a run folder without its summary
    with pytest.raises(Exception, match="already holds a training run"):
        Trainer(stale)  # what the cache used to do with it
    torch.set_num_threads(threads)
    again, cfg2, trained_again, _ = bench_halting.trained_model(True)
    assert trained_again and (folder / "summary.json").is_file()
    assert cfg2.model == cfg.model and cfg2.train.steps == cfg.train.steps
    for (k, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), k  # seeded: the same model as the first training
