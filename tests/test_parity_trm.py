"""TRM parity: loopformer's ``trm`` against SamsungSAILMontreal/TinyRecursiveModels (fixtures written by
``tools/parity/trm.py``; see docs/fidelity.md). No reference code is needed to run these tests."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from parity_recursive import Loaded, check_eval_logits, check_loss_and_grads, check_optimizer_step, train_loss

from loopformer.cli import cli
from loopformer.convert.fixtures import FIXTURE_DIR

NAMES = ["trm_attn", "trm_mlp"]


@pytest.mark.parametrize("name", NAMES)
def test_parity_trm_eval_logits(name: str) -> None:
    check_eval_logits(Loaded("trm", name))


@pytest.mark.parametrize("name", NAMES)
def test_parity_trm_train_loss_grads_and_step(name: str) -> None:
    f = Loaded("trm", name)
    loss, parts = train_loss(f)
    check_loss_and_grads(f, loss, parts)
    check_optimizer_step(f)


def test_parity_trm_convert_then_eval_cli(tmp_path) -> None:
    out = tmp_path / "run"
    runner = CliRunner()
    res = runner.invoke(cli, ["convert", "trm", str(FIXTURE_DIR / "trm_attn" / "step_1"), "--out", str(out)])
    assert res.exit_code == 0, res.output
    res = runner.invoke(cli, ["eval", str(out), "--set", "data.eval_size=8"])
    assert res.exit_code == 0, res.output
    assert "held-out evaluation" in res.output


def test_parity_trm_converter_names_unknown_and_missing_keys(tmp_path) -> None:
    import pytest
    import torch

    from loopformer.convert import convert_checkpoint, load_state_dict
    from loopformer.runs.checkpoint import CheckpointError

    state = load_state_dict(FIXTURE_DIR / "trm_attn" / "step_1")
    config = FIXTURE_DIR / "trm_attn" / "all_config.yaml"
    extra = dict(state, **{"model.inner.bogus.weight": torch.zeros(2)})
    torch.save(extra, tmp_path / "extra.pt")
    with pytest.raises(CheckpointError, match="bogus.weight"):
        convert_checkpoint("trm", tmp_path / "extra.pt", tmp_path / "a", config)
    missing = {k: v for k, v in state.items() if not k.endswith("lm_head.weight")}
    torch.save(missing, tmp_path / "missing.pt")
    with pytest.raises(CheckpointError, match="missing key 'lm_head.weight'"):
        convert_checkpoint("trm", tmp_path / "missing.pt", tmp_path / "b", config)
