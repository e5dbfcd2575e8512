"""Attractor language model parity: loopformer's ``attractor`` against jacobfa/Attractor's ``Attractor``
(``attractor/models/attractor/attractor.py``; fixtures written by ``tools/parity/attractor_lm.py``, see
docs/fidelity.md). The reference's state dict goes through ``loopformer convert attractor`` into a float64
model, which must reproduce the reference's inference logits (Anderson solve), the solve's iterates and
residuals, the training loss, every gradient norm through the ``onestep`` IFT backward and one optimiser
step of ``muon_adamw`` (the reference's MuonAdamW) with the head's learning-rate scale and weight decay. No reference code is needed."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from loopformer.convert import build_converted, converter, load_state_dict, read_reference_config
from loopformer.convert.fixtures import FIXTURE_DIR, load_fixture, prefixed
from loopformer.loop import run_loop
from loopformer.runs.checkpoint import CheckpointError
from loopformer.train.losses import sequence_loss
from loopformer.train.optim import MuonAdamW, set_lr
from loopformer.train.setup import make_optimizer

LOGIT_ATOL, LOSS_RTOL, GRAD_RTOL, STEP_ATOL = 1e-5, 1e-6, 1e-5, 1e-6
NAMES = ["attractor_lm", "attractor_lm_stop"]  # 8 evaluations (ring wraps); adaptive stop + clipped J^T v


class Loaded:
    def __init__(self, name: str) -> None:
        self.tensors, self.meta = load_fixture(name)
        self.state = load_state_dict(FIXTURE_DIR / self.meta["checkpoint"])
        self.ref_config = read_reference_config(FIXTURE_DIR / self.meta["reference_config"])
        self.converted = converter("attractor")(self.state, self.ref_config)
        self.config, self.model = build_converted(self.converted, dtype=torch.float64)
        batch = prefixed(self.tensors, "batch")
        self.inputs, self.labels = batch["input_ids"].long(), batch["labels"].long()

    def loop(self, phase: str):
        return self.config.loop_config(self.model.config.loop, phase)

    def sources(self, ours: str) -> list[str]:
        return self.converted.sources[ours].split("|")

    def ref_tensor(self, prefix: str, ours: str) -> torch.Tensor:
        """The reference tensors our parameter came from, assembled as the converter assembles them."""
        parts = [self.tensors[f"{prefix}.{k}"] for k in self.sources(ours)]
        if ours == "gate_logit":
            return torch.stack(parts).reshape(self.model.gate_logit.shape)
        return torch.cat(parts, dim=0) if len(parts) > 1 else parts[0]


@pytest.fixture(scope="module", params=NAMES)
def fixture(request) -> Loaded:
    return Loaded(request.param)


def test_parity_attractor_lm_eval_logits(fixture: Loaded) -> None:
    """Inference (eval mode, Anderson from y0 = c, tied head of ln_f(y*)) gives the reference's logits."""
    f = fixture
    model = f.model.eval()
    with torch.no_grad():
        out = model(f.inputs, loop=f.loop("eval"))
    torch.testing.assert_close(out.logits, f.tensors["eval.logits"], rtol=0, atol=LOGIT_ATOL)
    iters = int(f.tensors["solver.iters"])
    assert out.loop.steps.tolist() == [iters] * f.inputs.shape[0]  # the same number of map evaluations


def test_parity_attractor_lm_solver_iterates_and_residuals(fixture: Loaded) -> None:
    """Every map input (y0 = c, f(y0), then the Anderson mixes, ring of m slots), the returned f(x_k), and the
    reference's residuals ``||f(x) - x|| / ||x||``; the engine's ``rel_l2`` (``/ ||f(x)||``) lies within the
    bounds that relation implies: r_ref in [r / (1 + r), r / (1 - r)]."""
    f = fixture
    model = f.model.eval()
    seen_in: list[torch.Tensor] = []
    seen_out: list[torch.Tensor] = []

    def step(z: torch.Tensor, *ctx: torch.Tensor) -> torch.Tensor:
        seen_in.append(z.clone())
        fz = model.step(z, *ctx)
        seen_out.append(fz.clone())
        return fz

    with torch.no_grad():
        ctx = model.embed(f.inputs)
        torch.testing.assert_close(
            ctx[0], f.tensors["solver.context"], rtol=0, atol=1e-6
        )  # RoPE table: see docs
        res = run_loop(step, model.init_state(ctx), f.loop("eval"), ctx=ctx)
    ref_in, ref_out = f.tensors["solver.inputs"], f.tensors["solver.outputs"]
    assert len(seen_in) == ref_in.shape[0]
    for t in range(len(seen_in)):
        torch.testing.assert_close(seen_in[t], ref_in[t], rtol=0, atol=1e-6, msg=f"map input {t}")
        torch.testing.assert_close(seen_out[t], ref_out[t], rtol=0, atol=1e-6, msg=f"map output {t}")
    torch.testing.assert_close(
        res.state, f.tensors["solver.y_star"], rtol=0, atol=1e-6
    )  # f(x_k), as returned
    ours = torch.stack([
        (o - i).flatten(1).norm(dim=1) / i.flatten(1).norm(dim=1).clamp_min(1e-9) for i, o in zip(seen_in, seen_out)
    ])  # fmt: skip
    ref_res = f.tensors["solver.residuals"]
    torch.testing.assert_close(ours, ref_res, rtol=1e-6, atol=1e-9)
    r = res.residuals.double()
    assert torch.all(ref_res >= r / (1 + r) - 1e-9) and torch.all(ref_res <= r / (1 - r) + 1e-9)
    tol = f.meta["config"]["tol"]
    if f.meta["config"]["min_iter"] < f.meta["config"]["max_iter"]:  # the adaptive stop: max over the batch
        assert bool((ref_res[-1] < tol).all()) and not bool((ref_res[-2] < tol).all())
        assert bool((r[-1] < tol).all()) and not bool((r[-2] < tol).all())


def test_parity_attractor_lm_train_loss_grads_and_step(fixture: Loaded) -> None:
    """Training step: token-mean cross-entropy, onestep IFT gradients (clipped J^T v in ``_stop``), then one
    ``muon_adamw`` step = the reference's ``MuonAdamW`` step: Muon on the backbone's matrices (c_q / c_k / c_v
    of our fused qkv apart) at the recorded optimiser step of the momentum warm-up and decay taper, AdamW
    on the rest (head at fp_lr_scale x lr, its matrices decayed by fp_wd). The fixture ran the reference's
    bfloat16 iteration in float64, so ours runs in float64 too (``muon_ns_dtype``)."""
    f = fixture
    model = f.model.train()
    out = model(f.inputs, loop=f.loop("train"))
    loss = sequence_loss(out.logits, f.labels, f.config.train.loss)  # every position labelled: = token mean
    torch.testing.assert_close(loss.double(), f.tensors["train.loss"].reshape(()), rtol=LOSS_RTOL, atol=0)
    out_loss = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), f.labels.flatten())
    out_loss.backward()  # in float64 (sequence_loss returns float32)
    for name, p in model.named_parameters():
        ref = math.sqrt(sum(float(f.tensors[f"grad_norm.{k}"]) ** 2 for k in f.sources(name)))
        torch.testing.assert_close(
            torch.linalg.vector_norm(p.grad), torch.tensor(ref, dtype=torch.float64), rtol=GRAD_RTOL, atol=1e-12,
            msg=name,
        )  # fmt: skip
    sched = f.meta["optimizer_schedule"]
    tc = dataclasses.replace(f.config.train, steps=sched["max_steps"], muon_ns_dtype="float64")
    assert tc.optimizer == "muon_adamw"
    optimizer = make_optimizer(model, tc)
    set_lr(optimizer, tc.lr)
    for g in optimizer.param_groups:
        if g["kind"] == "muon":
            g["t"] = sched["optimizer_step"]
            MuonAdamW.schedule_(g)
    keys = ("kind", "lr", "weight_decay", "momentum")
    ours = {n: tuple(g.get(k) for k in keys) for g in optimizer.param_groups for n in g["names"]}
    ref = {n: tuple(g.get(k) for k in keys) for g in f.meta["optimizer_groups"] for n in g["names"]}
    for name in ours:
        for src in f.sources(name):
            assert ours[name] == pytest.approx(ref[src]), (
                f"{name} ({src}): kind / lr / weight decay / momentum"
            )
    muon = {n for g in optimizer.param_groups if g["kind"] == "muon" for n in g["names"]}
    assert muon == {n for n, _ in model.named_parameters() if n.startswith("backbone.") and ".norm" not in n}
    optimizer.step()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), f.ref_tensor("step", name), rtol=0, atol=STEP_ATOL, msg=name)


def test_attractor_lm_init_matches_the_reference() -> None:
    """``init: scaled_zero`` gives the reference's init: orthogonal matrices of the same norms, zero backbone
    output projections, head output projections truncated N(0, 2/(5d)) (their norms within sampling error)."""
    f = Loaded("attractor_lm")
    model_cfg = f.config.model_config()
    assert model_cfg.init == "scaled_zero" and model_cfg.init_orthogonal
    torch.manual_seed(0)
    model = type(f.model)(model_cfg)
    for name, p in model.named_parameters():
        if name == "output.head.weight":
            continue  # tied
        srcs = f.sources(name)
        ref = math.sqrt(sum(float(f.tensors[f"init_norm.{k}"]) ** 2 for k in srcs))
        ours = float(torch.linalg.vector_norm(p.detach()))
        head_out = name.startswith("head_blocks") and (".proj." in name or ".down." in name)
        if ref == 0.0:
            assert ours == 0.0, name
        else:
            assert ours == pytest.approx(ref, rel=0.15 if head_out else 1e-5), name


def test_attractor_lm_convert_cli_and_errors(tmp_path) -> None:
    from click.testing import CliRunner

    from loopformer.cli import cli
    from loopformer.runs import load_run

    f = Loaded("attractor_lm")
    folder = FIXTURE_DIR / "attractor_lm"
    res = CliRunner().invoke(
        cli,
        ["convert", "attractor", str(folder / "model.pt"), "--config", str(folder / "config.json"),
         "--out", str(tmp_path / "run")],
    )  # fmt: skip
    assert res.exit_code == 0, res.output
    run = load_run(tmp_path / "run")
    model = run.model.double().eval()
    with torch.no_grad():
        logits = model(f.inputs, loop=run.config.loop_config(model.config.loop, "eval")).logits
    torch.testing.assert_close(logits, f.tensors["eval.logits"], rtol=0, atol=LOGIT_ATOL)
    fn = converter("attractor")
    with pytest.raises(CheckpointError, match="transformer.extra"):
        fn({**f.state, "transformer.extra": torch.zeros(1)}, f.ref_config)
    missing = {k: v for k, v in f.state.items() if k != "transformer.core_block.1.raw_gamma_mlp"}
    with pytest.raises(CheckpointError, match="transformer.core_block.1.raw_gamma_mlp"):
        fn(missing, f.ref_config)
    bad = {"model_config": {**f.ref_config["model_config"], "nonlin_name": "GELU"}}
    with pytest.raises(CheckpointError, match="nonlin_name='GELU'"):
        fn(f.state, bad)


def test_paper_lm_attractor_recipe_size() -> None:
    """The 140M recipe builds the reference's architecture (byte-level: vocabulary 256 instead of 32768)."""
    from loopformer.config import RECIPE_DIR, build_config, read_recipe
    from loopformer.models.attractor import Attractor, lm_paper_config

    cfg = build_config(read_recipe(RECIPE_DIR / "paper_lm_attractor_140m.yaml"))
    mc = cfg.model_config().replace(
        vocab_size=256
    )  # the text task's bytes (the trainer sets it from the task)
    with torch.device("meta"):
        n_recipe = Attractor(mc).num_parameters()
        n_paper = Attractor(lm_paper_config()).num_parameters()
    d, layers = 1024, 8
    per_block = 4 * d * d + 2 * d * 4 * d + 2 * d
    assert n_paper == 32768 * d + layers * per_block + 2 * d + d  # + gates (2d) + final norm (d)
    assert n_recipe == n_paper - (32768 - 256) * d
    assert (mc.mlp, mc.qk_norm, mc.norm_eps, mc.rope_base, mc.init) == (
        "relu2",
        True,
        1e-5,
        50000.0,
        "scaled_zero",
    )
    assert (mc.n_backbone, mc.n_layers, mc.d_model, mc.n_heads) == (7, 1, 1024, 8)
    assert (cfg.train.head_lr_scale, cfg.train.head_weight_decay) == (0.5, 0.1)
    t = cfg.train  # launch_configs/attractor-small-140m.yaml + recpre/settings.py defaults
    assert (t.optimizer, t.lr, t.weight_decay, t.betas, t.eps) == (
        "muon_adamw",
        8e-3,
        0.0,
        (0.8, 0.95),
        1e-10,
    )
    assert (t.muon_lr, t.muon_momentum, t.muon_weight_decay, t.muon_ns_steps, t.muon_beta2) == (
        8e-3,
        0.95,
        0.2,
        5,
        0.95,
    )
    assert (t.muon_momentum_warmup_start, t.muon_momentum_warmup_steps, t.muon_ns_dtype) == (
        0.85,
        300,
        "bfloat16",
    )
    assert t.muon_weight_decay_taper
    assert (cfg.train.schedule, cfg.train.cooldown_fraction, cfg.train.warmup_steps) == ("trapezoid", 0.5, 0)
