"""What the trainer builds from the run configuration before its first step (each a function of config
objects, also used by ``--plan``'s memory model).

- ``configure_process``: logging on ranks > 0, the global batch against the world size.
- ``build_data``: the task and its train / eval splits (``loopformer.runs.task_dataset``), unless given.
- ``task_model_defaults`` / ``build_run_model``: the model a recipe names, with the fields the
  task determines (vocabulary, sequence length, causality, puzzle ids, grid) filled in where the
  recipe leaves them unset; the fully resolved model config is written back into the run config.
- ``compile_on``: whether the run compiles (``compile: auto``: on CUDA); ``fast_cuda_settings``: TF32 and
  cuDNN autotuning on CUDA.
- ``make_optimizer``: the optimiser ``train`` names (``loopformer.train.optim.build_optimizer``);
  ``lr_for``: the step's learning rate from the schedule ``train`` names.
- ``micro_steps`` / ``check_loop``: gradient accumulation's micro-batches per step, and the training loops
  whose accumulated step could not equal the full batch's (``AccumulationError``, refused before any write;
  the accumulated step itself is ``loopformer.train.trainer.Trainer``'s).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from loopformer.config import ConfigError, RunConfig, TrainConfig, to_dict
from loopformer.loop import LoopConfig
from loopformer.loop.halting import HALTINGS
from loopformer.models.base import LoopedModel
from loopformer.runs import run_task, task_dataset
from loopformer.tasks.base import Task, TokenDataset, task_model_fields
from loopformer.train.dist import DistEnv
from loopformer.train.optim import build_optimizer, lr_at


def configure_process(tc: TrainConfig, env: DistEnv, device: torch.device) -> None:
    """Quiet ranks > 0, check the global batch divides over the ranks, set the CPU threads."""
    if env.enabled and not env.is_main:
        logging.getLogger("loopformer").setLevel(logging.WARNING)  # logs come from rank 0
    if env.enabled and tc.batch_size % env.world_size:
        raise ValueError(
            f"train.batch_size={tc.batch_size} (the global batch) must be divisible by the world size "
            f"{env.world_size}"
        )
    if device.type == "cpu":
        torch.set_flush_denormal(True)
        torch.set_num_threads(tc.threads or 1)  # auto: settled by set_cpu_threads once the model is built


def build_data(
    config: RunConfig,
    task: Task | None,
    train_data: TokenDataset | None,
    eval_data: TokenDataset | None,
    have_model: bool,
) -> tuple[Task | None, TokenDataset, TokenDataset | None]:
    """(task, train set, eval set): the given ones, else built from ``config.data``. A task is built
    unless both the training data and the model are given (nothing else needs it then)."""
    if task is None and (train_data is None or not have_model):
        task = run_task(config.data)
    train = train_data if train_data is not None else task_dataset(task, config.data, "train")
    held_out = eval_data if eval_data is not None else task_dataset(task, config.data, "eval")
    if len(train) == 0:
        raise ValueError("the training set is empty")
    return task, train, held_out


def compile_on(config: RunConfig, device: torch.device) -> bool:
    """Whether the run compiles: ``compile: true``, or ``auto`` on CUDA (on the CPU a compile costs minutes
    of a short run and gains little: docs/performance.md, ``step_compile`` rows)."""
    return config.compile is True or (config.compile == "auto" and device.type == "cuda")


def fast_cuda_settings(config: RunConfig, device: torch.device) -> None:
    """On CUDA: TF32 matmuls and convolutions for float32 work unless ``tf32: false`` (bf16 autocast runs its
    matmuls in bf16 anyway; ``false`` switches TF32 off, also where PyTorch's cuDNN default has it on) and
    cuDNN's autotuner (every shape of a training step is fixed: the carry is refilled in place, the loops are
    static). These are PyTorch's process-wide flags: the last trainer built in a process sets them."""
    if device.type != "cuda":
        return
    torch.backends.cuda.matmul.allow_tf32 = config.tf32
    torch.backends.cudnn.allow_tf32 = config.tf32
    torch.set_float32_matmul_precision("high" if config.tf32 else "highest")
    torch.backends.cudnn.benchmark = True


def make_optimizer(model: LoopedModel, tc: TrainConfig) -> torch.optim.Optimizer:
    """``loopformer.train.optim.build_optimizer`` as ``tc`` asks: AdamW, AdamATan2 or MuonAdamW, the weight-decay
    groups, and TRM / HRM's sign-SGD puzzle-embedding group (``train.puzzle_emb_optimizer=sign_sgd``)."""
    puzzle = (tc.puzzle_emb_lr, tc.puzzle_emb_weight_decay) if tc.puzzle_emb_optimizer == "sign_sgd" else None
    head = None
    if tc.head_lr_scale != 1.0 or tc.head_weight_decay is not None:  # the Attractor LM's fp_lr_scale / fp_wd
        head = (tc.head_lr_scale, tc.head_weight_decay)
    return build_optimizer(
        model,
        tc.lr,
        tc.weight_decay,
        tuple(tc.betas),
        tc.eps,
        tc.decay_embeddings,
        tc.optimizer,
        tc.decay_all,
        puzzle,
        head,
        muon_settings(tc) if tc.optimizer == "muon_adamw" else None,
    )


def muon_settings(tc: TrainConfig) -> dict:
    """The ``muon`` settings of ``build_optimizer`` from ``train.muon_*``."""
    return {
        "lr": tc.lr if tc.muon_lr is None else tc.muon_lr,
        "momentum": tc.muon_momentum,
        "weight_decay": tc.muon_weight_decay,
        "taper_steps": tc.steps if tc.muon_weight_decay_taper else 0,
        "ns_steps": tc.muon_ns_steps,
        "beta2": tc.muon_beta2,
        "ns_dtype": tc.muon_ns_dtype,
        "momentum_warmup": (tc.muon_momentum_warmup_start, tc.muon_momentum_warmup_steps),
    }


def lr_for(step: int, tc: TrainConfig) -> float:
    """The learning rate of optimiser step ``step``: ``tc``'s warm-up, then constant or cosine."""
    return lr_at(step, tc.lr, tc.warmup_steps, tc.steps, tc.schedule, tc.min_lr_ratio, tc.cooldown_fraction)


def task_model_defaults(task: Task | None, train_data: TokenDataset) -> dict[str, Any]:
    """Model fields the task and its training data determine, used where the recipe leaves them unset."""
    out: dict[str, Any] = task_model_fields(task) if task is not None else {}
    out["seq_len"] = int(train_data.inputs.shape[1])
    if "vocab_size" not in out:
        out["vocab_size"] = int(max(train_data.inputs.max(), train_data.labels.max()) + 1)
    return out


def build_run_model(config: RunConfig, task: Task | None, train_data: TokenDataset) -> LoopedModel:
    """The recipe's model with the task's defaults; records the resolved fields in ``config.model``."""
    from loopformer.models.registry import build_model, model_classes

    _, config_cls = model_classes(config.model.name)
    valid = {f.name for f in dataclasses.fields(config_cls)}
    defaults = {k: v for k, v in task_model_defaults(task, train_data).items() if k in valid}
    if task is not None:  # the recipe's own sizes must hold the task's data (an embedding lookup fails else)
        from loopformer.config.checks import check_model_fields

        given = config.model.fields
        ids = int(max(train_data.inputs.max(), train_data.labels.max())) + 1 if "vocab_size" in given else 0
        check_model_fields(given, task, int(train_data.inputs.shape[1]), ids)
    if "num_puzzle_ids" in config.model.fields:  # the recipe decides the puzzle embedding: no task default
        defaults.pop("puzzle_emb_len", None)
    model_config = config.model_config(**defaults)
    # the run folder records the fully resolved model config
    config.model.fields = {
        f.name: to_dict(getattr(model_config, f.name)) for f in dataclasses.fields(model_config)
    }
    return build_model(config.model.name, config=model_config)


class AccumulationError(ConfigError):
    """A run asked for gradient accumulation that cannot equal its full-batch step."""


def micro_steps(tc: TrainConfig, world_size: int = 1) -> int:
    """The number of micro-batches ``k`` each rank runs per optimiser step (``train.grad_accum_steps``,
    or ``batch_size / world_size / train.micro_batch_size``); ConfigError when they do not divide."""
    if tc.batch_size % world_size:
        raise ConfigError(f"train.batch_size={tc.batch_size} cannot be split evenly over {world_size} ranks")
    local, k = tc.batch_size // world_size, tc.grad_accum_steps
    if k < 1 or tc.micro_batch_size < 0:
        raise ConfigError("train.grad_accum_steps must be >= 1 and train.micro_batch_size >= 0")
    if tc.micro_batch_size:
        if local % tc.micro_batch_size:
            raise ConfigError(
                f"train.micro_batch_size={tc.micro_batch_size} does not divide the {local} rows per rank "
                f"(train.batch_size={tc.batch_size} over {world_size} ranks)"
            )
        implied = local // tc.micro_batch_size
        if k not in (1, implied):
            raise ConfigError(
                f"train.grad_accum_steps={k} and train.micro_batch_size={tc.micro_batch_size} disagree: "
                f"{local} rows per rank in micro-batches of {tc.micro_batch_size} is {implied} micro-steps"
            )
        k = implied
    if local % k:
        raise ConfigError(
            f"train.grad_accum_steps={k} does not divide the {local} rows per rank "
            f"(train.batch_size={tc.batch_size} over {world_size} ranks)"
        )
    return k


def check_loop(loop: LoopConfig, k: int, rows: int) -> None:
    """AccumulationError for a halting rule whose decision couples rows that micro-batches of ``rows``
    rows would split (a batch-wide rule without a ``halt_group`` dividing ``rows``)."""
    g = loop.halt_group
    if k > 1 and HALTINGS.get(loop.halting).batch_stalls and not (0 < g and rows % g == 0):
        group = f"groups of loop_train.halt_group={g} rows" if g else "the whole batch"
        raise AccumulationError(
            f"train.grad_accum_steps={k}: the training loop's halting rule {loop.halting!r} is batch-wide "
            f"(every sample runs until the largest residual of {group} is below tol), which micro-batches "
            f"of {rows} rows would split, so the step would differ from the full batch; set "
            f"loop_train.halt_group to a divisor of {rows} (a group per micro-batch or smaller), train with "
            "a per-sample rule (loop_train.halting=residual) or without accumulation"
        )
