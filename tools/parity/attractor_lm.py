"""Parity fixtures for the Attractor language model (github jacobfa/Attractor, ``Attractor``).

Imports ``attractor/models/attractor/attractor.py`` (``Attractor``), ``config.py`` (``AttractorConfig``),
``solvers.py`` (``anderson_solve``) and ``recpre/optim/muon_adamw.py`` (``MuonAdamW``, ``get_muon_param_groups``) from a
checkout of the reference (``--ref``), builds a tiny model in float64 on CPU with the 140M config's
architecture and settings (``configs/attractor/attractor-small-140m.py``: RMSNorm eps 1e-5, ``BaseMLP`` +
``ReLU2``, qk-norm, no biases, tied embeddings, ``scaled-zero`` + orthogonal init, gates 0.75 / 0.75,
Anderson, ``onestep`` backward, ``fp_lr_scale`` 0.5, ``fp_wd`` 0.1) and writes
``tests/fixtures/parity/attractor_lm*``:

- ``<name>/model.pt``: the model's state dict (``torch.save(model.state_dict())``) and
  ``<name>/config.json``: ``model_config`` (the ``AttractorConfig`` fields) + ``train_config`` (the
  launch config's optimiser keys);
- ``<name>.safetensors`` + ``.json``: the reference's init (every parameter's norm right after
  construction, before the weights are perturbed so that no projection is zero), the input batch and
  labels, the logits of the reference's inference (eval mode, ``forward(return_logits=True)``: the
  Anderson solve from ``y0 = c`` and ``lm_head(ln_f(y*)) * logit_scale``), the solve's map inputs and
  outputs and per-sample residuals (``_rel_residual``), the training loss of one step (train mode,
  ``forward(labels=...)``), every parameter's gradient norm through the ``onestep`` IFT backward
  (``_IFTAttach``), and every tensor after one optimiser step.

Two fixtures: ``attractor_lm`` (8 map evaluations: ``min_iter = max_iter``, history m 3 so the ring wraps;
``adjoint_grad_clip`` None as at 140M) and ``attractor_lm_stop`` (the adaptive stop ``rel.max() < tol``
(tol 0.13, chosen > 30% away from every residual of the batch's sequence, so the two residual
normalisers cannot disagree about the step) after 3..24 evaluations, ``adjoint_grad_clip`` 0.05 so the clipping of ``J^T v`` is in play).

Substitutions (also in each fixture's JSON):
- ``Tensor.float()`` returns float64 tensors unchanged while the reference runs (its RMSNorm, RoPE,
  logits and the Anderson Gram solve upcast bf16 to float32; applied to float64 it would round).
- the optimiser step is the reference's ``MuonAdamW.step`` over ``get_muon_param_groups``, its group
  settings as ``scripts/train.py`` sets them at optimiser step ``SCHEDULE["optimizer_step"]`` of
  ``SCHEDULE["max_steps"]`` (Muon momentum warm-up, weight-decay taper), with the ``torch.compile``d
  ``muon_step`` / ``adamw_step`` run as their Python functions (``__wrapped__``) and ``Tensor.bfloat16()``
  keeping float64 tensors (the Newton-Schulz iteration runs in bfloat16 in the reference).
- attention: the reference's own CPU path (``flash_attention._sdpa_attention``, causal SDPA); no FA3.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import main

from loopformer.convert.fixtures import save_fixture

COMMIT = "fcf045f9fb9d458f9e1574bd4036cd2fb63b3697"
SUBSTITUTIONS = [
    "Tensor.float() keeps float64 tensors while the reference runs (RMSNorm, RoPE, logits and the Anderson "
    "Gram solve upcast to float32 in the reference; in float64 that would round)",
    "MuonAdamW.step runs its torch.compile'd muon_step / adamw_step as Python functions (__wrapped__), eager on CPU",
    "Tensor.bfloat16() keeps float64 tensors in the optimiser step (the reference's Newton-Schulz iteration and "
    "Muon update run in bfloat16; in float64 that would round)",
    "attention: the reference's CPU path (flash_attention._sdpa_attention, causal SDPA)",
]
TINY: dict[str, Any] = dict(
    name="attractor-parity-tiny",
    block_size=16,
    vocab_size=32,
    padding_multiple=8,
    n_embd=16,
    num_attention_heads=2,
    num_key_value_heads=2,
    intermediate_size=64,
    bias=False,
    tie_embeddings=True,
    block_class_name="TransformerPreNormBlock",
    norm_class_name="RMSNorm",
    norm_eps=1e-5,
    mlp_class_name="BaseMLP",
    nonlin_name="ReLU2",
    qk_norm=True,
    logit_softcap=None,
    n_backbone_layers=2,
    n_fp_blocks=2,
    solver="anderson",
    max_iter=8,
    min_iter=8,
    tol=3e-4,
    anderson_m=3,
    anderson_beta=1.0,
    backward_type="onestep",
    backward_max_iter=8,
    backward_min_iter=8,
    backward_tol=3e-4,
    adjoint_grad_clip=None,
    layer_scale_init=0.75,
    gamma_max=0.75,
    fp_lr_scale=0.5,
    fp_wd=0.1,
    init_strategy="scaled-zero",
    init_orthogonal=True,
)
STOP = {
    **TINY,
    "max_iter": 24,
    "min_iter": 3,
    "tol": 0.13,
    "backward_max_iter": 24,
    "adjoint_grad_clip": 0.05,
}
# the launch config's optimiser keys (launch_configs/attractor-small-140m.yaml), at a tiny rate
OPT: dict[str, Any] = {
    "lr": 1e-3,
    "weight_decay": 0.0,
    "betas": [0.8, 0.95],
    "eps": 1e-10,
    "muon_lr": 1e-3,
    "muon_momentum": 0.95,
    "muon_wd": 0.2,
    "muon_ns_steps": 5,
}
# scripts/train.py's per-step Muon settings (momentum warm-up from 0.85 over 300 steps, weight decay
# tapered to 0 over max_steps) at this optimiser step of a run of max_steps steps
SCHEDULE: dict[str, Any] = {
    "optimizer_step": 3,
    "max_steps": 10,
    "muon_momentum_warmup_start": 0.85,
    "muon_momentum_warmup_steps": 300,
}
BATCH, SEQ, PERTURB = 3, 12, 0.05


@contextlib.contextmanager
def float64_kept() -> Iterator[None]:
    original = torch.Tensor.float

    def keep(self: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return self if self.dtype == torch.float64 else original(self, *args, **kwargs)

    torch.Tensor.float = keep  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.float = original  # type: ignore[method-assign]


def _solve_trace(ref: Any, model: Any, input_ids: Tensor) -> dict[str, Tensor]:
    """The inference solve of ``Attractor._solve_forward`` with every map input / output recorded."""
    freqs = model.freqs_cis[:, : input_ids.shape[1]]
    seen_in: list[Tensor] = []
    seen_out: list[Tensor] = []
    with torch.no_grad():
        c = model._encode(input_ids, freqs, None)
        name, kw = model._solver_kwargs()

        def f(y: Tensor) -> Tensor:
            seen_in.append(y.detach().clone())
            out = model._f(y, c, freqs, None)
            seen_out.append(out.detach().clone())
            return out

        with model._deterministic_fp():
            y_star, info = ref.get_solver(name)(f, c.detach(), **kw)
    inputs, outputs = torch.stack(seen_in), torch.stack(seen_out)
    res = torch.stack([ref._rel_residual(o, i) for i, o in zip(inputs, outputs)])
    return {
        "solver.context": c,
        "solver.inputs": inputs,
        "solver.outputs": outputs,
        "solver.residuals": res,
        "solver.y_star": y_star,
        "solver.iters": torch.tensor([info["iters"]]),
    }


@contextlib.contextmanager
def eager_float64_muon(muon: Any) -> Iterator[None]:
    """``muon_adamw``'s compiled kernels as Python functions, ``Tensor.bfloat16()`` keeping float64."""
    kernels = {k: getattr(muon, k) for k in ("muon_step", "adamw_step")}
    original = torch.Tensor.bfloat16

    def keep(self: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        return self if self.dtype == torch.float64 else original(self, *args, **kwargs)

    for k, fn in kernels.items():
        setattr(muon, k, fn.__wrapped__)
    torch.Tensor.bfloat16 = keep  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.Tensor.bfloat16 = original  # type: ignore[method-assign]
        for k, fn in kernels.items():
            setattr(muon, k, fn)


def _scheduled(groups: list[dict[str, Any]]) -> None:
    """``scripts/train.py``'s settings of the Muon groups at optimiser step ``SCHEDULE["optimizer_step"]``."""
    t, total = SCHEDULE["optimizer_step"], SCHEDULE["max_steps"]
    start, warm = SCHEDULE["muon_momentum_warmup_start"], SCHEDULE["muon_momentum_warmup_steps"]
    for g in groups:
        if g["kind"] != "muon":
            continue
        if not g.get("pin_wd", False):
            g["weight_decay"] = max(0.0, OPT["muon_wd"] * (1 - t / total))
        g["momentum"] = start + min(t / warm, 1.0) * (OPT["muon_momentum"] - start)


def _optimizer_step(muon: Any, model: Any) -> tuple[dict[str, Tensor], list[dict[str, Any]]]:
    names = {id(p): n for n, p in model.named_parameters()}
    groups = muon.get_muon_param_groups(
        model.named_parameters(),
        adamw_lr=OPT["lr"],
        adamw_betas=tuple(OPT["betas"]),
        adamw_eps=OPT["eps"],
        adamw_wd=OPT["weight_decay"],
        muon_lr=OPT["muon_lr"],
        muon_momentum=OPT["muon_momentum"],
        muon_wd=OPT["muon_wd"],
        muon_ns_steps=OPT["muon_ns_steps"],
    )
    _scheduled(groups)
    with eager_float64_muon(muon):
        muon.MuonAdamW(groups).step()
    out = {
        f"step.{k}": v.detach().clone() for k, v in model.state_dict().items() if v.dtype.is_floating_point
    }
    record = [
        {
            "kind": g["kind"],
            "lr": g["lr"],
            "weight_decay": g["weight_decay"],
            **({"momentum": g["momentum"], "ns_steps": g["ns_steps"]} if g["kind"] == "muon" else {}),
            "names": sorted(names[id(p)] for p in g["params"]),
        }
        for g in groups
    ]
    return out, record


def build_one(out_dir: Path, name: str, cfg: dict[str, Any]) -> list[str]:
    config_mod = importlib.import_module("attractor.models.attractor.config")
    arch = importlib.import_module("attractor.models.attractor.attractor")
    solvers = importlib.import_module("attractor.models.attractor.solvers")
    muon = importlib.import_module("recpre.optim.muon_adamw")
    torch.manual_seed(0)
    model = arch.Attractor(config_mod.AttractorConfig(**cfg)).double()
    tensors: dict[str, Tensor] = {
        f"init_norm.{n}": torch.linalg.vector_norm(p.detach()).reshape(1) for n, p in model.named_parameters()
    }
    with torch.no_grad():  # trained-like weights: no zero projection, gates away from their init
        for n, p in model.named_parameters():
            p.add_(PERTURB * torch.randn_like(p))
            if "raw_gamma" in n:  # sigmoid'(13.8) ~ 1e-6 at the init: move them where they learn
                p.copy_(1.0 + torch.randn_like(p))
    folder = out_dir / name
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, folder / "model.pt")
    model_config = {k: v for k, v in cfg.items() if k != "name"}
    (folder / "config.json").write_text(
        json.dumps(
            {"model_config": model_config, "train_config": {"optimizer": "MuonAdamW", "optim_config": OPT}},
            indent=1,
            sort_keys=True,
        )
        + "\n"
    )
    g = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, cfg["vocab_size"], (BATCH, SEQ), generator=g)
    labels = torch.randint(0, cfg["vocab_size"], (BATCH, SEQ), generator=g)
    tensors.update({"batch.input_ids": input_ids, "batch.labels": labels})
    with float64_kept():
        model.eval()
        with torch.no_grad():
            tensors["eval.logits"] = model(input_ids, return_logits=True)["logits"]
        tensors.update(_solve_trace(solvers, model, input_ids))
        model.train()
        out = model(input_ids, labels=labels)
        out["loss"].backward()
        tensors["train.loss"] = out["loss"].detach().reshape(1)
        for n, p in model.named_parameters():
            tensors[f"grad_norm.{n}"] = torch.linalg.vector_norm(p.grad).reshape(1)
        step, groups = _optimizer_step(muon, model)
    tensors.update(step)
    meta = {
        "repository": "jacobfa/Attractor",
        "commit": COMMIT,
        "model": "attractor/models/attractor/attractor.py:Attractor",
        "config": model_config,
        "optimizer": OPT,
        "optimizer_groups": groups,
        "optimizer_schedule": SCHEDULE,
        "perturbation": PERTURB,
        "substitutions": SUBSTITUTIONS,
        "checkpoint": f"{name}/model.pt",
        "reference_config": f"{name}/config.json",
        "dtype": "float64",
    }
    save_fixture(out_dir, name, tensors, meta)
    return [f"{name}.safetensors", f"{name}.json", f"{name}/model.pt", f"{name}/config.json"]


def build(ref_root: Path, out_dir: Path) -> list[str]:
    return [*build_one(out_dir, "attractor_lm", TINY), *build_one(out_dir, "attractor_lm_stop", STOP)]


if __name__ == "__main__":
    main(build, __doc__.splitlines()[0])
