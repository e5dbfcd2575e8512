"""HRM parity: loopformer's ``hrm`` against sapientinc/HRM (fixture written by ``tools/parity/hrm.py``;
see docs/fidelity.md). No reference code is needed to run these tests."""

from __future__ import annotations

import json

from click.testing import CliRunner
from parity_recursive import Loaded, check_eval_logits, check_loss_and_grads, check_optimizer_step, train_loss

from loopformer.cli import cli
from loopformer.convert.fixtures import FIXTURE_DIR


def test_parity_hrm_eval_logits() -> None:
    check_eval_logits(Loaded("hrm", "hrm"))


def test_parity_hrm_train_loss_grads_and_step() -> None:
    f = Loaded("hrm", "hrm")
    loss, parts = train_loss(f)
    assert set(parts) == {"lm_loss", "q_halt_loss", "q_continue_loss"}
    check_loss_and_grads(f, loss, parts)
    check_optimizer_step(f)


def test_parity_hrm_convert_writes_a_run_folder(tmp_path) -> None:
    out = tmp_path / "run"
    res = CliRunner().invoke(cli, ["convert", "hrm", str(FIXTURE_DIR / "hrm" / "step_1"), "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert (out / "checkpoints" / "step_00000000" / "model.safetensors").is_file()
    # no --config: the converter's find_config reads all_config.yaml beside the checkpoint
    record = json.loads((out / "converted.json").read_text())
    assert record["config"] == str((FIXTURE_DIR / "hrm" / "all_config.yaml").resolve())
