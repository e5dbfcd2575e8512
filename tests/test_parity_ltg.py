"""LTG parity: loopformer's ``recurrent`` (block="gpt2") against OSU-NLP-Group/Loop-Think-Generalize's
``RecurrentGPT2Block`` (fixtures written by ``tools/parity/ltg.py``; see docs/fidelity.md): the extrapolation
model with the answer at the query's last token (``ltg_rdt``, ``ltg_rdt_inject``) or at the padded batch's
last position (``ltg_rdt_last``, the scripts' default ``pred_pos last_token``), and the systematicity model
with learned positions (``ltg_rdt_learned``). No reference code (and no transformers) is needed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loopformer.convert import build_converted, converter
from loopformer.convert.fixtures import load_fixture, prefixed
from loopformer.convert.ltg import BLOCK_KEYS
from loopformer.loop import LoopConfig
from loopformer.tasks.base import IGNORE_INDEX
from loopformer.train.losses import sequence_loss
from loopformer.train.optim import build_optimizer, set_lr

NAMES = ["ltg_rdt", "ltg_rdt_inject", "ltg_rdt_last", "ltg_rdt_learned"]
ADAPTIVE = ["ltg_rdt", "ltg_rdt_inject", "ltg_rdt_last"]  # the systematicity model has no forward_adapative
LOGIT_ATOL, LOSS_RTOL, GRAD_RTOL, STEP_ATOL = 1e-5, 1e-6, 1e-5, 1e-6


class Loaded:
    def __init__(self, name: str) -> None:
        self.tensors, self.meta = load_fixture(name)
        self.converted = converter("ltg")(prefixed(self.tensors, "ref"), self.meta["ref_config"])
        # the fixture turns GPT-2's attention / residual dropout off (tools/parity/ltg.py)
        self.config, self.model = build_converted(self.converted, ["model.dropout=0.0"], dtype=torch.float64)
        b = prefixed(self.tensors, "batch")
        self.inputs, self.targets, self.lengths = b["input_ids"], b["targets"], b["input_lengths"]
        self.rows = torch.arange(len(self.inputs))

    def labels(self) -> torch.Tensor:
        """[B, T] labels as ``kg_files`` lays them out: the target at the prediction position
        (``pred_pos: last`` -> T - 1, ``answer`` -> the query's last token), IGNORE_INDEX elsewhere."""
        labels = torch.full_like(self.inputs, IGNORE_INDEX)
        last = self.meta["train_pred_pos"] == "last_token"
        cols = torch.full_like(self.lengths, self.inputs.shape[1] - 1) if last else self.lengths - 1
        labels[self.rows, cols] = self.targets
        return labels

    def ref_name(self, ours: str) -> tuple[str, bool]:
        """Reference state-dict key of a loopformer parameter, and whether it is a transposed Conv1D."""
        if ours.startswith("core."):
            _, i, rest = ours.split(".", 2)
            src, transpose = BLOCK_KEYS[rest]
            return f"blocks.{i}.{src}", transpose
        return {
            "embedding.tokens.weight": "token_embedding.weight",
            "embedding.positions.table": "position_embedding.weight",
            "output.norm.weight": "ln_f.weight",
            "output.norm.bias": "ln_f.bias",
        }[ours], False


def _fixed(n: int) -> LoopConfig:
    return LoopConfig(halting="fixed", max_steps=n, grad="bptt")


@pytest.mark.parametrize("name", NAMES)
def test_parity_ltg_eval_logits(name: str) -> None:
    f = Loaded(name)
    with torch.no_grad():
        out = f.model.eval()(f.inputs, loop=_fixed(f.meta["eval_loops"]))
    # every position, pads included: pad_mask masks padding keys as the reference's attention_mask
    torch.testing.assert_close(out.logits, f.tensors["eval_logits"], rtol=0, atol=LOGIT_ATOL)


def test_ltg_convert_maps_pred_pos_and_positions() -> None:
    """The converter follows the fixture's prediction position and maps the position table."""
    assert Loaded("ltg_rdt").model.config.halt_position == "answer"  # pred_pos inp_len
    assert Loaded("ltg_rdt_last").model.config.halt_position == "last"  # pred_pos last_token
    learned = Loaded("ltg_rdt_learned")  # no pred_pos argument: the systematicity script reads [:, -1]
    assert learned.model.config.halt_position == "last" and learned.model.config.learned_positions
    table = learned.model.embedding.positions.table
    assert table.shape[0] == learned.meta["tiny"]["n_positions"] > learned.inputs.shape[1]
    torch.testing.assert_close(
        table.detach(), learned.tensors["ref.position_embedding.weight"], rtol=0, atol=0
    )


@pytest.mark.parametrize("name", ADAPTIVE)
def test_parity_ltg_kl_entropy_halting_at_the_answer(name: str) -> None:
    """forward_adapative: halt at the first loop t >= 2 with KL < eps and H < thresh at the monitored
    position (the query's last token for pred_pos inp_len, position T - 1 for last_token)."""
    f = Loaded(name)
    a = f.meta["adaptive"]
    loop = LoopConfig(
        halting="kl_entropy",
        plugins={"kl_entropy": {"kl_threshold": a["eps_kl"], "entropy_threshold": a["entropy_thresh"]}},
        max_steps=a["max_loops"],
        min_steps=2,
        grad="bptt",
    )
    with torch.no_grad():
        out = f.model.eval()(f.inputs, loop=loop)
    assert out.loop.steps.tolist() == f.tensors["adaptive_iterations"].tolist()
    assert len(set(out.loop.steps.tolist())) >= 2  # the fixture exercises per-sample halting
    torch.testing.assert_close(out.logits, f.tensors["adaptive_logits"], rtol=0, atol=LOGIT_ATOL)
    if f.meta["adaptive"]["pred_pos"] == "last_token":  # the fixture tells the monitored positions apart
        _, other = build_converted(
            f.converted, ["model.dropout=0.0", "model.halt_position=answer"], dtype=torch.float64
        )
        with torch.no_grad():
            steps = other.eval()(f.inputs, loop=loop).loop.steps.tolist()
        assert steps != f.tensors["adaptive_iterations"].tolist()


@pytest.mark.parametrize("name", NAMES)
def test_parity_ltg_train_loss_grads_and_step(name: str) -> None:
    f = Loaded(name)
    model = f.model.train()
    out = model(f.inputs, loop=_fixed(f.meta["train_loops"]))
    # cross-entropy on kg_files' label layout (label smoothing 0.1 for the systematicity fixture), in
    # float64; the trainer's sequence_loss (float32 softmax) gives the same value within float32
    labels, smoothing = f.labels(), f.meta["label_smoothing"]
    ref_loss = f.tensors["train_loss"].reshape(())
    trainer_loss = sequence_loss(out.logits.detach(), labels, "ce", smoothing).double()
    torch.testing.assert_close(trainer_loss, ref_loss, rtol=LOSS_RTOL, atol=0)
    loss = F.cross_entropy(
        out.logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, label_smoothing=smoothing
    )
    torch.testing.assert_close(loss, ref_loss, rtol=LOSS_RTOL, atol=0)
    loss.backward()
    for ours, p in model.named_parameters():
        ref_key, _ = f.ref_name(ours)
        ref = f.tensors[f"grad_norm.{ref_key}"].reshape(())
        torch.testing.assert_close(p.grad.norm(), ref, rtol=GRAD_RTOL, atol=1e-12, msg=ours)
    opt = f.meta["optimizer"]
    optimizer = build_optimizer(
        model, opt["lr"], opt["weight_decay"], tuple(opt["betas"]), opt["eps"], decay_all=True
    )  # the reference decays every parameter
    set_lr(optimizer, opt["lr"])
    optimizer.step()
    for ours, p in model.named_parameters():
        ref_key, transpose = f.ref_name(ours)
        ref = f.tensors[f"step.{ref_key}"]
        torch.testing.assert_close(
            p.detach(), ref.t() if transpose else ref, rtol=0, atol=STEP_ATOL, msg=ours
        )


def test_ltg_convert_rejects_unknown_keys() -> None:
    from loopformer.runs.checkpoint import CheckpointError

    tensors, meta = load_fixture("ltg_rdt")
    state = prefixed(tensors, "ref")
    state["blocks.0.extra.weight"] = torch.zeros(1)
    with pytest.raises(CheckpointError, match="blocks.0.extra.weight"):
        converter("ltg")(state, meta["ref_config"])


def test_ltg_convert_cli_writes_a_learned_position_run(tmp_path) -> None:
    """``loopformer convert ltg`` on the systematicity checkpoint (train_systematicity.py's layout); the run
    folder's model has the reference's position table."""
    import json

    import yaml
    from click.testing import CliRunner
    from safetensors.torch import load_file

    from loopformer.cli import cli

    tensors, meta = load_fixture("ltg_rdt_learned")
    ckpt = tmp_path / "checkpoint_epoch_1.pt"
    torch.save({"epoch": 0, "model_state_dict": prefixed(tensors, "ref")}, ckpt)
    (tmp_path / "args.json").write_text(json.dumps(meta["ref_config"]))
    out = tmp_path / "run"
    res = CliRunner().invoke(
        cli, ["convert", "ltg", str(ckpt), "--config", str(tmp_path / "args.json"), "--out", str(out)]
    )
    assert res.exit_code == 0, res.output
    model = yaml.safe_load((out / "config.yaml").read_text())["model"]
    assert model["learned_positions"] is True and model["seq_len"] == meta["tiny"]["n_positions"]
    assert model["halt_position"] == "last" and model["pad_mask"] is True
    weights = load_file(next(out.glob("checkpoints/*/model.safetensors")))
    ref = tensors["ref.position_embedding.weight"]
    torch.testing.assert_close(
        weights["embedding.positions.table"], ref.to(weights["embedding.positions.table"].dtype)
    )


def test_ltg_converted_run_reads_the_references_answers_from_kg_files(tmp_path) -> None:
    """End to end at the reference's prediction position: the systematicity checkpoint converted by the
    CLI, evaluated on a ``kg_files`` folder holding the fixture's batch (``pred_pos: last``, width 8), gets
    every answer the reference reads at ``logits[:, -1]`` (stored as the labels); ``solve`` agrees."""
    import json

    from click.testing import CliRunner

    import loopformer
    from loopformer.cli import cli
    from loopformer.eval.evaluate import evaluate
    from loopformer.runs import eval_dataset

    tensors, meta = load_fixture("ltg_rdt_learned")
    torch.save({"model_state_dict": prefixed(tensors, "ref")}, tmp_path / "ck.pt")
    (tmp_path / "args.json").write_text(json.dumps(meta["ref_config"]))
    folder = tmp_path / "kg"
    folder.mkdir()
    vocab = [f"<t_{i}>" for i in range(1, meta["tiny"]["vocab"])]  # <pad> is put first: ids unchanged
    (folder / "vocab.json").write_text(json.dumps(vocab))
    answers = tensors["eval_logits"][:, -1].argmax(-1)
    records = []
    for row, n, answer in zip(tensors["batch.input_ids"], tensors["batch.input_lengths"], answers):
        text = "".join(f"<t_{int(t)}>" for t in row[:n])
        records.append({"input_text": text, "target_text": f"{text}<t_{int(answer)}></a>", "type": "x"})
    (folder / "test.json").write_text(json.dumps(records))
    (folder / "train.json").write_text(json.dumps(records))  # solve's validator reads the atomic facts here
    width = tensors["batch.input_ids"].shape[1]
    sets = [f"data.options.path={folder}", "data.task=kg_files", "data.options.pred_pos=last",
            f"data.options.width={width}", "data.eval_path=test.json", "data.train_path=test.json"]  # fmt: skip
    args = ["convert", "ltg", str(tmp_path / "ck.pt"), "--config", str(tmp_path / "args.json")]
    res = CliRunner().invoke(
        cli, [*args, "--out", str(tmp_path / "run"), *[x for s in sets for x in ("--set", s)]]
    )
    assert res.exit_code == 0, res.output
    run = loopformer.load(tmp_path / "run", device="cpu")
    data = eval_dataset(run.task, run.config)
    assert run.loop_eval.max_steps == meta["eval_loops"] and (data.labels[:, -1] == answers.numpy()).all()
    result = evaluate(run.model, run.task, data, loop=run.loop_eval, check=False)
    assert result.exact_accuracy == 1.0  # every row's answer is the reference's
    sol = loopformer.solve(run, data.inputs[1])  # a 5-token query: the answer at the pad position 7
    assert int(sol.tokens[-1]) == int(answers[1]) and sol.steps == meta["eval_loops"]
