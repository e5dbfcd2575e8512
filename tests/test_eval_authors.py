"""``eval.protocol: authors_trm_deq``: the Attractor puzzle authors' evaluation (github jacobfa/Attractor
``experiments/attractor_puzzles/trm/train_trm_deq.py`` ``_eval`` with ``trm_deq.py`` ``TRMDEQ.forward`` and
``losses_deq.py`` ``ACTLossHeadDEQ``), checked against the rule written out here on a tiny model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_train_utils import TinyConfig, TinyLooped, tiny_config, tiny_dataset

from loopformer.eval.authors import evaluate_authors_trm_deq
from loopformer.eval.evaluate import EvalComm
from loopformer.loop import LoopConfig
from loopformer.tasks.base import IGNORE_INDEX
from loopformer.train import Trainer

LOOP = LoopConfig(max_steps=2)


class FixedInit(TinyLooped):
    """TinyLooped with a deterministic initial state (TRM's fixed H_init / L_init buffers) and a Q head whose
    sign differs between examples and calls; records the training mode of every forward."""

    def __init__(self) -> None:
        super().__init__(TinyConfig(), seed=3)
        with torch.no_grad():
            self.q.bias.fill_(-0.15)  # a mix of halting and running examples
        self.modes: list[bool] = []

    def init_state(self, ctx, generator=None):
        return 0.5 * torch.tanh(ctx[0])

    def forward(self, *args, **kwargs):
        self.modes.append(self.training)
        return super().forward(*args, **kwargs)


def _written_out(model, data, batch_size, max_batches, calls, exploration, seed):
    """The reference's rule, one sample at a time where it can be: (evaluated, count, exact, steps, token sum);
    each block's exploration draws from a generator seeded by (seed, block)."""
    evaluated = count = exact = steps_total = 0
    tokens = 0.0
    n_batches = -(-len(data) // batch_size)
    if max_batches:
        n_batches = min(n_batches, max_batches)
    for b in range(n_batches):
        rows = np.arange(b * batch_size, min(len(data), (b + 1) * batch_size))
        g = torch.Generator().manual_seed(int(np.random.SeedSequence([seed, b]).generate_state(1)[0]))
        x = torch.as_tensor(data.inputs[rows])
        B = len(rows)
        with torch.no_grad():
            init = model.init_state(model.embed(x))
            carry_state = [None] * B
            carry_steps = [0] * B
            carry_halted = [True] * B  # initial_carry
            for _call in range(calls):
                state = torch.stack([init[i] if carry_halted[i] else carry_state[i] for i in range(B)])
                for i in range(B):
                    carry_steps[i] = 1 if carry_halted[i] else carry_steps[i] + 1
                out = model(x, loop=LOOP, state=state)
                q = out.q_logits.reshape(B)
                explore = torch.rand(B, generator=g) < exploration
                minimum = torch.randint(2, calls + 1, (B,), generator=g)
                for i in range(B):
                    carry_state[i] = out.state[i]
                    min_halt = int(minimum[i]) if bool(explore[i]) else 0
                    stop = carry_steps[i] >= calls or float(q[i]) > 0
                    carry_halted[i] = stop and carry_steps[i] >= min_halt
                if all(carry_halted):
                    break
        pred = out.logits.argmax(-1).numpy()
        for i, r in enumerate(rows):
            labelled = data.labels[r] != IGNORE_INDEX
            evaluated += 1
            if carry_halted[i] and labelled.any():  # metrics of the last call, halted samples only
                count += 1
                right = pred[i][labelled] == data.labels[r][labelled]
                exact += int(right.all())
                tokens += float(right.mean())
                steps_total += carry_steps[i]
    return evaluated, count, exact, steps_total, tokens


@pytest.mark.parametrize("exploration", [0.0, 0.5])
def test_authors_protocol_matches_the_rule_written_out(exploration: float) -> None:
    model, data = FixedInit(), tiny_dataset(40, seed=2)
    model.eval()
    got = evaluate_authors_trm_deq(
        model, None, data, loop=LOOP, batch_size=8, max_batches=4, calls=5, exploration=exploration, seed=7
    )
    assert set(model.modes) == {True}  # every call in training mode ...
    assert not model.training  # ... and the caller's mode restored
    model.modes.clear()
    evaluated, count, exact, steps, tokens = _written_out(model, data, 8, 4, 5, exploration, seed=7)
    assert (got.evaluated, got.count, got.exact, got.steps_sum) == (evaluated, count, exact, steps)
    assert got.token_fraction_sum == pytest.approx(tokens) and tokens > 0
    assert got.evaluated == 32  # the batch cap: 4 batches of 8 of the 40 rows
    assert 0 < got.count < got.evaluated  # some examples were restarted and are not counted
    summary = got.summary()
    assert summary["n"] == count and summary["exact_acc"] == pytest.approx(exact / count)
    assert summary["segments"] == pytest.approx(steps / count)


class _Rank(EvalComm):
    """Process ``rank`` of ``world`` as a distributed strategy deals the authors' blocks (sums left local)."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world

    def local_batches(self, n: int) -> np.ndarray:
        return np.arange(self.rank, n, self.world)


@pytest.mark.parametrize("world", [2, 3])
def test_several_processes_evaluate_the_same_first_rows_as_one(world: int) -> None:
    """The reference on W ranks evaluates the test set's first (cap x W) local batches (PuzzleDataset._iter_test
    deals each global window's slices); here the blocks are dealt round-robin and the cap counts all of them, so
    W processes give the one-process numbers exactly (the draws are per block, not per process)."""
    model, data = FixedInit(), tiny_dataset(60, seed=2)
    kw = dict(loop=LOOP, batch_size=8, max_batches=5, calls=5, exploration=0.5, seed=3)
    one = evaluate_authors_trm_deq(model, None, data, **kw)
    parts = [evaluate_authors_trm_deq(model, None, data, comm=_Rank(r, world), **kw) for r in range(world)]
    fields = ("evaluated", "count", "exact", "steps_sum", "calls_sum", "batches")
    assert [sum(getattr(p, f) for p in parts) for f in fields] == [getattr(one, f) for f in fields]
    assert one.evaluated == 40 and one.batches == 5  # the first 5 blocks of 8 rows, whatever the world size
    assert sum(p.token_fraction_sum for p in parts) == pytest.approx(one.token_fraction_sum)
    assert [p.batches for p in parts] == [len(range(r, 5, world)) for r in range(world)]


def test_all_halted_stops_the_batch_and_no_cap_evaluates_everything() -> None:
    model, data = FixedInit(), tiny_dataset(12, seed=4)
    with torch.no_grad():
        model.q.weight.zero_()
        model.q.bias.fill_(1.0)  # q > 0 everywhere: every sample halts at the first call
    got = evaluate_authors_trm_deq(model, None, data, loop=LOOP, batch_size=5, max_batches=0, calls=16,
                                   exploration=0.0)  # fmt: skip
    assert got.evaluated == got.count == 12 and got.batches == 3
    assert got.calls_sum == 3 and got.steps_sum == 12  # one call per batch
    with torch.no_grad():
        model.q.bias.fill_(-1.0)  # q < 0: every sample runs all 16 calls, all halt at the last one
    got = evaluate_authors_trm_deq(model, None, data, loop=LOOP, batch_size=5, max_batches=0, calls=16,
                                   exploration=0.0)  # fmt: skip
    assert got.count == 12 and got.calls_sum == 48 and got.steps_sum == 12 * 16


def test_a_model_without_a_q_head_is_refused() -> None:
    model = TinyLooped(TinyConfig(q_head=False))
    with pytest.raises(ValueError, match="q_logits"):
        evaluate_authors_trm_deq(model, None, tiny_dataset(4), loop=LOOP, batch_size=4)


@pytest.mark.parametrize("protocol", ["both", "authors_trm_deq"])
def test_trainer_reports_the_protocols(tmp_path, protocol: str) -> None:
    cfg = tiny_config(tmp_path, "train.steps=2", f"eval.protocol={protocol}", "eval.segments=4",
                      "eval.authors_max_batches=1", "eval.batch_size=4")  # fmt: skip
    tr = Trainer(cfg, model=FixedInit(), train_data=tiny_dataset(16), eval_data=tiny_dataset(12, seed=1))
    ev = tr.fit()["eval"]
    if protocol == "both":
        assert {"exact_acc", "authors_exact_acc", "authors_n", "authors_evaluated"} <= set(ev)
        assert ev["n"] == 12 and ev["authors_evaluated"] == 4  # clean: every row; authors': one batch of 4
    else:
        assert ev["protocol"] == "authors_trm_deq" and ev["evaluated"] == 4 and "authors_n" not in ev
