"""Shared checks of TRM / HRM parity fixtures (tools/parity/trm.py, hrm.py) against loopformer.

The fixture holds the reference's weights (as the checkpoint ``<name>/step_1`` its pretrain.py writes),
a batch, the logits / Q logits after every evaluation segment, the first training segment's loss,
every parameter's gradient norm and every tensor after one optimiser step. Here the checkpoint goes
through ``loopformer.convert`` into a float64 loopformer model, which must reproduce all of them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from loopformer.convert import build_converted, converter, load_state_dict, read_reference_config
from loopformer.convert.fixtures import FIXTURE_DIR, load_fixture, prefixed
from loopformer.convert.recursive import permute_qkv
from loopformer.train.losses import accuracy, q_halt_loss, q_learning_losses, sequence_loss
from loopformer.train.optim import build_optimizer, set_lr

LOGIT_ATOL, LOSS_RTOL, GRAD_RTOL, STEP_ATOL = 1e-5, 1e-6, 1e-5, 1e-6


class Loaded:
    def __init__(self, system: str, name: str) -> None:
        self.tensors, self.meta = load_fixture(name)
        state = load_state_dict(FIXTURE_DIR / self.meta["checkpoint"])
        ref_cfg = read_reference_config(FIXTURE_DIR / name / "all_config.yaml")
        self.converted = converter(system)(state, ref_cfg)
        self.config, self.model = build_converted(self.converted, dtype=torch.float64)
        batch = prefixed(self.tensors, "batch")
        self.inputs = batch["inputs"].long()
        self.labels = batch["labels"].long()
        self.puzzle_ids = batch["puzzle_identifiers"].long()
        self.ref_prefix = "model.inner."

    def ref_name(self, ours: str) -> str:
        return self.ref_prefix + self.converted.sources[ours]


def check_eval_logits(f: Loaded, q_of: str = "q_halt") -> None:
    """Reference evaluation (halt_max_steps segments from the initial carry) == chained forwards."""
    model = f.model.eval()
    ref_logits = f.tensors["eval.logits"]
    state = None
    with torch.no_grad():
        for s in range(ref_logits.shape[0]):
            out = model(f.inputs, state=state, puzzle_ids=f.puzzle_ids)
            state = out.state
            torch.testing.assert_close(out.logits, ref_logits[s], rtol=0, atol=LOGIT_ATOL, check_dtype=False)
            q = model.q_values(out.state) if hasattr(model, "q_values") else None
            if q is not None:
                torch.testing.assert_close(
                    q[:, 0], f.tensors["eval.q_halt"][s], rtol=0, atol=LOGIT_ATOL, check_dtype=False
                )
                torch.testing.assert_close(
                    q[:, 1], f.tensors["eval.q_continue"][s], rtol=0, atol=LOGIT_ATOL, check_dtype=False
                )
            else:
                torch.testing.assert_close(
                    out.q_logits, f.tensors["eval.q_halt"][s], rtol=0, atol=LOGIT_ATOL, check_dtype=False
                )
        # the converted run's evaluation loop: all segments as one loop (config loop_eval)
        loop_eval = f.config.loop_config(model.config.loop, "eval")
        assert loop_eval.max_steps == ref_logits.shape[0] * model.config.loop.max_steps
        out = model(f.inputs, loop=loop_eval, puzzle_ids=f.puzzle_ids)
        torch.testing.assert_close(out.logits, ref_logits[-1], rtol=0, atol=LOGIT_ATOL)


def train_loss(f: Loaded) -> tuple[Tensor, dict[str, Tensor]]:
    """The trainer's segment loss (Trainer._loss: task loss + q_loss_weight * Q BCE) on the fixture batch."""
    model, tc = f.model.train(), f.config.train
    out = model(f.inputs, puzzle_ids=f.puzzle_ids)
    task = sequence_loss(out.logits, f.labels, tc.loss)
    exact = accuracy(out.logits, f.labels).exact
    if not tc.q_learning:
        q = q_halt_loss(out.q_logits, exact)
        return task + tc.q_loss_weight * q, {"lm_loss": task, "q_halt_loss": q}
    # HRM (Trainer._q_learning): the continue target comes from one more segment without gradient
    with torch.no_grad():
        q_next = model.q_values(model(f.inputs, state=out.state.detach(), puzzle_ids=f.puzzle_ids).state)
    is_last = torch.full((f.inputs.shape[0],), 1 >= tc.max_segments)
    halt, cont = q_learning_losses(model.q_values(out.state), q_next, exact, is_last)
    parts = {"lm_loss": task, "q_halt_loss": halt, "q_continue_loss": cont}
    return task + tc.q_loss_weight * (halt + cont), parts


def check_loss_and_grads(f: Loaded, loss: Tensor, parts: dict[str, Tensor]) -> None:
    for key, value in parts.items():
        ref = f.tensors[f"train.{key}"].reshape(()).double()
        # the reference computes its Q BCE in float32 (q_halt_logits.to(torch.float32)) even in this float64
        # fixture; loopformer keeps a float64 run in float64 (so gradient accumulation is exact there) and
        # computes it in float32 for float32 / bf16 runs as the reference does: compared at float32 precision
        rtol, atol = (1e-5, 1e-8) if key.startswith("q_") else (LOSS_RTOL, 0.0)
        torch.testing.assert_close(value.double(), ref, rtol=rtol, atol=atol, msg=key)
    torch.testing.assert_close(
        loss.double(), f.tensors["train.loss"].reshape(()).double(), rtol=LOSS_RTOL, atol=0
    )
    loss.backward()
    for name, p in f.model.named_parameters():
        ref_key = "grad_norm.puzzle_emb" if "puzzle_emb" in name else f"grad_norm.{f.ref_name(name)}"
        ours = torch.linalg.vector_norm(p.grad)
        ref = f.tensors[ref_key].reshape(()).double()
        torch.testing.assert_close(ours, ref, rtol=GRAD_RTOL, atol=1e-12, msg=name)


def check_optimizer_step(f: Loaded) -> None:
    """One step of the paper's optimisers (AdamATan2 on every parameter, sign-SGD on the puzzle
    table) from the gradients of ``check_loss_and_grads`` equals the reference's step."""
    opt = f.meta["optimizer"]
    optimizer = build_optimizer(
        f.model,
        opt["lr"],
        opt["weight_decay"],
        (opt["beta1"], opt["beta2"]),
        kind="adam_atan2",
        decay_all=True,
        puzzle_emb=(opt["puzzle_emb_lr"], opt["puzzle_emb_weight_decay"]),
    )
    set_lr(optimizer, opt["lr"])
    optimizer.step()
    n_heads = f.config.model_config().n_heads
    for name, p in f.model.named_parameters():
        ref = f.tensors[f"step.{f.ref_name(name)}"]
        if name.endswith("mix.qkv.weight") and f.config.model_config().rope:
            ref = permute_qkv(ref, n_heads)
        if name.startswith("q_proj") and ref.shape[0] != p.shape[0]:  # TRM: the continue row is dropped
            ref = ref[: p.shape[0]]
        torch.testing.assert_close(p.detach(), ref, rtol=0, atol=STEP_ATOL, msg=name)
