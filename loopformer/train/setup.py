"""What the trainer builds before its first step: device, data splits, model and loop sampler.

- ``resolve_device``: ``device: auto`` picks CUDA when there is one.
- ``configure_process``: logging on ranks > 0, the global batch against the world size.
- ``build_data``: the task and its train / eval splits (``loopformer.runs.task_dataset``), unless given.
- ``prepare_model``: the given or the recipe's model on the device; ``compile_on``: whether the run compiles
  (``compile: auto``: on CUDA); ``fast_cuda_settings``: TF32 and cuDNN autotuning on CUDA.
- ``make_optimizer``: the optimiser ``train`` names (``loopformer.train.optim.build_optimizer``).
- ``lr_for``: the step's learning rate from the schedule ``train`` names.
- ``make_curriculum``: the difficulty curriculum of ``data.curriculum`` (None when off).
- ``task_model_defaults`` / ``build_run_model``: the model a recipe names, with the fields the
  task determines (vocabulary, sequence length, causality, puzzle ids, grid) filled in where the
  recipe leaves them unset; the fully resolved model config is written back into the run config.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from loopformer.config import ConfigError, CurriculumConfig, RunConfig, TrainConfig, to_dict
from loopformer.models.base import LoopedModel
from loopformer.runs import run_task, task_dataset
from loopformer.tasks.base import Task, TokenDataset, task_model_fields
from loopformer.train.data import Curriculum
from loopformer.train.dist import DistEnv
from loopformer.train.optim import build_optimizer, lr_at


def resolve_device(name: str) -> torch.device:
    """``auto`` -> CUDA when available, else CPU; ``cuda`` without CUDA raises."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device='cuda' was asked for but CUDA is not available")
    return torch.device(name)


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


# train.threads: 0 (auto) gives models below this many parameters one CPU thread: at the CPU recipes' sizes
# (the default job: 0.11M parameters) a second thread made a training step 54x slower on the loaded 2-core
# development machine (1.3 s vs 69 s per step, load average ~14; benchmarks/bench_threads.py,
# docs/performance.md); with tensors this small there is little for a second thread to gain even when idle
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


def prepare_model(
    config: RunConfig,
    model: LoopedModel | None,
    task: Task | None,
    train_data: TokenDataset,
    device: torch.device,
) -> LoopedModel:
    """``model`` (or the recipe's, ``build_run_model``) on ``device`` (``compile``: the trainer compiles the
    whole step, or the looped body, once the optimiser exists: ``Trainer.__init__``)."""
    if model is None:
        model = build_run_model(config, task, train_data)
    return model.to(device)


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


def make_curriculum(cc: CurriculumConfig, train_data: TokenDataset) -> Curriculum | None:
    """The difficulty curriculum over the training set's difficulty (None when ``enabled`` is off)."""
    if not cc.enabled:
        return None
    if train_data.streamed:
        raise ConfigError(
            "data.curriculum: the training set is streamed (read a batch at a time), so there are no rows "
            "to order by difficulty; turn the curriculum off"
        )
    return Curriculum(
        train_data.difficulty, cc.start, cc.step, cc.max_level, cc.threshold, cc.restart_optimizer
    )


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
