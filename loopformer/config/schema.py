"""The run configuration: nested dataclasses, each with the checks of its own fields.

``RunConfig`` holds ``ModelSpec`` (a model family and its fields), ``DataConfig`` with ``CurriculumConfig``,
``TrainConfig``, ``EvalConfig`` and the loops: ``loop_train`` / ``loop_eval`` / ``loop_periodic`` are
``Overlay[LoopConfig]``s, the keys a recipe sets over the model's default loop, resolved by
``RunConfig.loop_config`` (the one definition of the loop a phase runs). Tables become these classes through
``loopformer.config.strict``.

``validate(cfg)`` runs when a config is built (``loopformer.config.build_config``): the model family's
fields are coerced and checked by their own class, then every value by the dataclass that owns it (ranges
with the dotted key, a held-out set generated apart from the training set, the task's name and options, the
loop sampler's options), the model's shape (``d_model`` divisible by ``n_heads``), the device (``cuda``
needs a CUDA device), and sizes that cannot fit in memory (``loopformer.config.memory``).
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import os
import typing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any, Literal

from loopformer.config.strict import ConfigError, Overlay, Registered, coerce, hints, join, suggest, to_dict

if TYPE_CHECKING:  # resolved by loopformer.config.strict.hints: importing the configuration imports no torch
    from loopformer.loop import LoopConfig

MAX_LR = 10.0


def _at_least(obj: Any, prefix: str, low: float, *keys: str) -> None:
    for key in keys:
        value = getattr(obj, key)
        if not value >= low:
            raise ConfigError(f"{prefix}.{key} must be >= {low:g}, got {value}")


def _finite(obj: Any, prefix: str, low: float, high: float, *keys: str, open_high: bool = False) -> None:
    for key in keys:
        value = getattr(obj, key)
        if not (math.isfinite(value) and low <= value and (value < high if open_high else value <= high)):
            bracket = ")" if open_high else "]"
            raise ConfigError(
                f"{prefix}.{key} must be a finite number in [{low:g}, {high:g}{bracket}, got {value}"
            )


@dataclass
class ModelSpec:
    """A model family (``loopformer.models.registry.MODELS``) and fields of its config class.

    In YAML the fields sit next to ``name``: ``model: {name: fprm, d_model: 64}``. Fields not
    given (vocab_size, seq_len, causal, num_puzzle_ids, grid) are filled from the task by the
    trainer; the loop the model runs by default is ``model.loop`` (a ``LoopConfig`` table).
    """

    name: str = "fprm"
    # the family's fields, beside ``name`` in a table; checked against the family's config class by
    # ``RunConfig.model_config`` (``model_fields``)
    fields: dict[str, Any] = field(default_factory=dict, metadata={"beside": None})


@dataclass
class CurriculumConfig:
    """Difficulty curriculum (Loop, Think & Generalize, arXiv 2604.07822).

    Train on examples with difficulty <= level; start at ``start``; advance by ``step`` when the
    exact-match accuracy on the current level (measured every ``check_every`` steps on up to
    ``sample`` examples from the held-out set, or recent training examples when ``source`` is
    "train" or the held-out set has none at that level) reaches ``threshold``.
    ``restart_optimizer``: at every level-up the optimiser's state (moments, step counts) is reset
    and the learning-rate schedule (warm-up included) starts again, as the reference builds a new
    AdamW and a new warm-up schedule for every stage (OSU-NLP-Group/Loop-Think-Generalize
    ``train_extrapolation.py`` ``train_model``).
    The check scores the current weights as the run is evaluated (``loop_eval`` with
    ``eval.segments`` chained calls); ``max_steps`` > 0 caps the check's loop at that many steps
    (a cost bound for evaluation loops with a cap of thousands, e.g. FPRM's 1000).
    """

    enabled: bool = False
    start: float = 2.0
    step: float = 1.0
    max_level: float | None = None  # None: the largest difficulty in the training set
    threshold: float = 0.95
    check_every: int = 100
    sample: int = 256
    source: Literal["eval", "train"] = "eval"
    restart_optimizer: bool = False
    max_steps: int = 0  # > 0: the check's loop cap (0: loop_eval's own)

    def validate(self) -> None:
        _at_least(self, "data.curriculum", 1, "check_every", "sample")
        _at_least(self, "data.curriculum", 0, "max_steps")
        _finite(self, "data.curriculum", 0.0, 1.0, "threshold")
        if not (math.isfinite(self.step) and self.step > 0):
            raise ConfigError(f"data.curriculum.step must be > 0, got {self.step}")


@dataclass
class DataConfig:
    """Which task, its constructor options, and how the train / eval sets are produced.

    Each set (``loopformer.runs.load_split``) comes from ``<split>_path`` when given: a folder
    is read as the HRM / TRM on-disk format (``<path>/train`` for training, ``<path>/test`` for
    evaluation, or the split folder itself), a file with ``task.load``; every row is used and the
    size is ignored. Otherwise ``task.generate(<split>_size, <split>_seed, **<split>_generate)``:
    a size of 0 means "all rows" for tasks with a finite pool (ARC, the KG tasks) and gives no rows
    for tasks that generate on demand (then there is no held-out set; an empty training set is an
    error).
    """

    task: str = "sudoku"
    options: dict[str, Any] = field(default_factory=dict)  # get_task(task, **options)
    train_generate: dict[str, Any] = field(default_factory=dict)  # task.generate(n, seed, **these)
    eval_generate: dict[str, Any] = field(default_factory=dict)
    train_size: int = 1000  # 0: all rows (see above)
    eval_size: int = 200  # 0: all rows; none for generated tasks
    train_seed: int = 0
    eval_seed: int = 1
    train_path: str | None = (
        None  # a file (task.load) or an HRM folder (load_hrm_folder) instead of generating
    )
    eval_path: str | None = None
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)

    def validate(self, training: bool = True) -> None:
        """Sizes and seeds, the curriculum, the task's name and options (checked against the task's
        constructor and ``generate`` signatures without building the task) and, when training, a
        held-out set generated apart from the training set."""
        _at_least(self, "data", 0, "train_size", "eval_size", "train_seed", "eval_seed")
        self.curriculum.validate()
        if training:
            self._check_heldout_apart()
        from loopformer.tasks.registry import TASKS, known_task, task_class

        if not known_task(self.task):
            raise ConfigError(f"data.task: unknown task {self.task!r}{suggest(self.task, list(TASKS))}")
        cls = task_class(self.task)
        _check_options(cls.__init__, self.options, "data.options", f"task {self.task!r}")
        for key in ("train_generate", "eval_generate"):
            _check_options(cls.generate, getattr(self, key), f"data.{key}", f"{self.task!r}'s generate()",
                           skip=("self", "n", "seed"))  # fmt: skip

    def _check_heldout_apart(self) -> None:
        """A generated training set and a generated held-out set drawn with the same seed and the same
        generator options are the same puzzles (``task.generate(n, seed)`` rows are prefixes of each
        other): the model would be scored on what it trained on."""
        if self.train_path or self.eval_path or self.train_seed != self.eval_seed:
            return
        if self.train_generate != self.eval_generate:
            return
        raise ConfigError(
            f"data.train_seed and data.eval_seed are both {self.train_seed} with the same generator options "
            f"(data.train_generate = data.eval_generate): the held-out set would be the training set's first "
            f"rows; give data.eval_seed another value (or other data.eval_generate options, or a "
            f"data.eval_path)"
        )


@dataclass
class TrainConfig:
    """Optimisation, the training loop mode and logging / checkpoint cadence."""

    # a registered training mode (loopformer.train.modes.TRAINING_MODES): simple | deep_supervision | ...
    mode: Annotated[
        str, Registered("loopformer.train.modes:TRAINING_MODES", "loopformer.train.modes:TrainingMode")
    ] = "simple"
    steps: int = 1000
    batch_size: int = 64
    # optimiser (AdamW) and schedule
    lr: float = 1e-3
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    # adam_atan2: TRM / HRM (train/optim.py AdamATan2); muon_adamw: the Attractor LM's Muon on the hidden
    # matrices + AdamW on the rest (train/muon.py), the muon_* keys below (defaults: the reference's)
    optimizer: Literal["adamw", "adam_atan2", "muon_adamw"] = "adamw"
    muon_lr: float | None = None  # Muon's rate (muon_lr; None: train.lr), on train.schedule
    muon_momentum: float = 0.95
    muon_weight_decay: float = 0.2  # cautious decay (muon_wd), tapered linearly to 0 over train.steps
    muon_weight_decay_taper: bool = True
    muon_ns_steps: int = 5  # Polar Express steps, 1..5
    muon_beta2: float = 0.95  # second-moment EMA of the orthogonalised update
    muon_momentum_warmup_start: float = 0.85  # momentum warms up linearly from this value ...
    muon_momentum_warmup_steps: int = 300  # ... over these steps (0: none)
    muon_ns_dtype: Literal["bfloat16", "float32", "float64"] = "bfloat16"  # the iteration's precision
    decay_all: bool = False  # weight decay on every parameter, biases included (TRM / HRM)
    # sign_sgd: TRM / HRM's sparse-embedding SignSGD
    puzzle_emb_optimizer: Literal["same", "sign_sgd"] = "same"
    puzzle_emb_lr: float = 1e-2  # sign-SGD rate of the puzzle embedding (TRM / HRM puzzle_emb_lr)
    puzzle_emb_weight_decay: float = 0.1  # its decoupled weight decay (puzzle_emb_weight_decay)
    # the model's head group (head_parameter_prefixes(), the Attractor head): its rate is lr times
    # head_lr_scale, its matrices' weight decay head_weight_decay (None: train.weight_decay); the
    # Attractor LM's fp_lr_scale / fp_wd
    head_lr_scale: float = 1.0
    head_weight_decay: float | None = None
    warmup_steps: int = 100
    # trapezoid: constant, then linear to 0 over the last cooldown_fraction of the steps (Attractor LM)
    schedule: Literal["constant", "cosine", "trapezoid"] = "constant"
    min_lr_ratio: float = 0.0  # cosine / trapezoid floor as a fraction of lr
    cooldown_fraction: float = 0.0  # trapezoid: the share of train.steps that cools down
    grad_clip: float = 1.0  # max global grad norm; 0 = off
    decay_embeddings: bool = True  # False: embeddings get no weight decay
    ema: float = 0.0  # EMA decay of the weights (0.999 in TRM / FPRM); 0 = off
    ema_warmup: bool = True  # decay_t = min(ema, (1 + t) / (10 + t)); False = TRM's plain EMA
    # False: the EMA leaves the puzzle-embedding tables (*puzzle_emb*) out, so evaluation with the EMA
    # weights uses the live table: the references' EMA (their tables are buffers; TRM / HRM / FPRM /
    # Attractor models/ema.py EMAHelper averages named_parameters() only)
    ema_puzzle_embeddings: bool = True
    # always: the model trains in training mode (dropout on) at every step; first_epoch: only during the
    # first epoch (ceil(rows / batch_size) steps) of the run and of each curriculum stage, in eval mode
    # (dropout off) after it, as the Loop, Think & Generalize scripts leave it (train_model calls
    # model.train() once per stage; evaluate_model_test, run after every epoch, calls model.eval())
    dropout_schedule: Literal["always", "first_epoch"] = "always"
    # losses
    loss: Literal["ce", "stablemax"] = "ce"
    label_smoothing: float = 0.0  # in [0, 1): uniform-target mixing (LTG systematicity: 0.1)
    q_loss_weight: float = 0.5  # BCE of the Q / halting head (models with one)
    ponder_weight: float = 0.01  # times ModelOutput.aux_loss (ACT ponder cost)
    jacobian_weight: float = 0.0  # Hutchinson ||J||_F^2 at the final state; 0 = off
    # simple mode: loop count per step from a sampler seeded by the global step
    # loopformer.loop.make_sampler kind: fixed (n = loop_train.max_steps unless given; fixed halting) |
    # poisson | lognormal_poisson; "none": no sampler, the loop_train config as is (its own halting rule)
    loop_sampler: str = "fixed"
    loop_sampler_options: dict[str, Any] = field(default_factory=dict)
    # deep supervision: carried slots, one segment per step
    max_segments: int = 16
    halt_on_q: bool = False  # TRM: a slot halts when its Q logit > 0
    q_learning: bool = False  # HRM: Q-learning ACT loss (q_halt BCE + bootstrapped q_continue BCE)
    halt_exploration: float = 0.1  # TRM: probability of forcing a random minimum segment count
    halt_on_converged: bool = False  # FPRM: a slot halts when its loop converged
    # FPRM: the solver's per-sample state (damped: step size, patience, best residual) carries across a
    # slot's segments and restarts with its next example; with halt_on_converged a slot whose step size
    # fell below the solver's min_step halts too (deep_supervision only)
    carry_solver_state: bool = False
    # gradient accumulation (loopformer/train/accumulate.py): each rank's share of batch_size runs as
    # grad_accum_steps micro-batches (one forward + backward each, no gradient all-reduce but on the
    # last), then one optimiser step equal to the full-batch step. micro_batch_size (rows per forward
    # per rank; 0: unset) says the same the other way: grad_accum_steps = batch_size / ranks / micro
    grad_accum_steps: int = 1
    micro_batch_size: int = 0
    # logging, evaluation, checkpoints
    log_every: int = 10
    eval_every: int = 0  # 0: evaluate at the end only
    checkpoint_every: int = 0  # 0: checkpoint at the end only
    keep_checkpoints: int = 3
    # an eval metric (a key of the evaluation summary: exact_acc, valid_acc, token_acc, loss, ...): at every
    # evaluation the trainer runs (eval_every, and the final one) a new best value checkpoints that step and
    # points checkpoints/best at it (never pruned by keep_checkpoints); "" = off. keep_best_mode: max | min
    keep_best: str = ""
    keep_best_mode: Literal["max", "min"] = "max"
    resume: bool | str = False  # True: the run folder's latest checkpoint; str: a checkpoint folder
    overwrite: bool = (
        False  # a fresh run into a folder holding a run replaces it (moved aside at the first checkpoint)
    )
    # a resume whose config changes the training stream (seed, data, model, optimiser, ...: see
    # loopformer/runs/resume_checks.py) is refused unless this is true; the change is recorded in
    # <run>/config_changes.jsonl
    allow_config_change: bool = False
    max_state_norm: float = 1e6  # a larger mean state norm counts as divergence
    max_loss: float = 1e4  # a larger loss counts as divergence
    progress: bool = True  # rich progress bar
    tensorboard: bool = (
        False  # TensorBoard event files in <run>/tensorboard (pip install 'loopformer[tensorboard]')
    )
    wandb: bool = (
        False  # Weights & Biases tracking (pip install 'loopformer[wandb]'), see loopformer/train/tracking.py
    )
    wandb_project: str = "loopformer"
    wandb_mode: Literal["online", "offline", "disabled"] = "online"
    threads: int = 0  # CPU threads; 0 = auto: 1 for models below 2M parameters, else one per physical core
    # multi-process (torchrun), see loopformer/train/dist.py
    strategy: Literal["ddp", "fsdp"] = "ddp"
    # auto: sharded (every rank writes its shards, loopformer/runs/sharded.py) under FSDP, full otherwise
    checkpoint_format: Literal["auto", "full", "sharded"] = "auto"
    sync_halting: bool = (
        False  # every rank leaves each loop on the same global step count (one all-reduce per step)
    )
    find_unused_parameters: bool | None = None  # None: decided by a probe forward/backward of the real loss
    rendezvous_timeout_s: float = 300.0  # WORLD_SIZE > 1: how long a process waits for the others to join

    def validate(self, training: bool = True) -> None:
        """Ranges (sizes >= 1, rates in [0, 1), finite non-negative weights, a sane learning rate), the
        optimiser's options, accumulation against the batch, the kept metric's name, and CPU threads."""
        _at_least(self, "train", 1, "steps", "batch_size", "max_segments", "log_every")
        _at_least(self, "train", 0, "warmup_steps", "eval_every", "checkpoint_every", "keep_checkpoints",
                  "threads")  # fmt: skip
        if not (math.isfinite(self.lr) and 0 < self.lr <= MAX_LR):
            raise ConfigError(f"train.lr must be a finite number in (0, {MAX_LR:g}], got {self.lr}")
        _finite(self, "train", 0.0, 1.0, "ema", "label_smoothing", open_high=True)
        _finite(self, "train", 0.0, 1.0, "min_lr_ratio", "halt_exploration", "cooldown_fraction")
        _finite(self, "train", 0.0, math.inf, "weight_decay", "grad_clip", "q_loss_weight", "ponder_weight",
                "jacobian_weight", "puzzle_emb_weight_decay", open_high=True)  # fmt: skip
        if not (math.isfinite(self.puzzle_emb_lr) and 0 < self.puzzle_emb_lr <= MAX_LR):
            raise ConfigError(
                f"train.puzzle_emb_lr must be a finite number in (0, {MAX_LR:g}], got {self.puzzle_emb_lr}"
            )
        if not (math.isfinite(self.head_lr_scale) and self.head_lr_scale > 0):
            raise ConfigError(f"train.head_lr_scale must be a finite number > 0, got {self.head_lr_scale}")
        if self.head_weight_decay is not None and not (
            math.isfinite(self.head_weight_decay) and self.head_weight_decay >= 0
        ):
            raise ConfigError(f"train.head_weight_decay must be >= 0 (or null), got {self.head_weight_decay}")
        self._check_muon()
        self._check_accumulation()
        if self.keep_best and not self.keep_best.isidentifier():
            raise ConfigError(
                "train.keep_best must name an evaluation metric (e.g. exact_acc, valid_acc), "
                f"got {self.keep_best!r}"
            )
        if self.keep_best.startswith("eval_"):
            raise ConfigError(
                f"train.keep_best names the metric without its log prefix: {self.keep_best[5:]!r}, "
                f"not {self.keep_best!r}"
            )
        if not (math.isfinite(self.rendezvous_timeout_s) and self.rendezvous_timeout_s > 0):
            raise ConfigError(f"train.rendezvous_timeout_s must be a finite number > 0, got {self.rendezvous_timeout_s}")
        if not (math.isfinite(self.eps) and 0 < self.eps < 1):
            raise ConfigError(f"train.eps must be a finite number in (0, 1), got {self.eps}")
        for i, beta in enumerate(self.betas):
            if not (math.isfinite(beta) and 0 <= beta < 1):
                raise ConfigError(f"train.betas[{i}] must be in [0, 1), got {beta}")
        for key in ("max_state_norm", "max_loss"):
            value = getattr(self, key)
            if math.isnan(value) or value <= 0:
                raise ConfigError(f"train.{key} must be > 0, got {value}")
        cores = os.cpu_count() or 1
        if training and self.threads > cores:
            raise ConfigError(
                f"train.threads={self.threads} is more than the {cores} CPU cores of this machine "
                "(0 = one per physical core)"
            )

    def _check_muon(self) -> None:
        """``train.muon_*`` (read by ``optimizer: muon_adamw``; checked whatever the optimiser)."""
        if self.muon_lr is not None and not (math.isfinite(self.muon_lr) and 0 < self.muon_lr <= MAX_LR):
            raise ConfigError(
                f"train.muon_lr must be null or a finite number in (0, {MAX_LR:g}], got {self.muon_lr}"
            )
        for key in ("muon_momentum", "muon_beta2", "muon_momentum_warmup_start"):
            value = getattr(self, key)
            if not (math.isfinite(value) and 0 <= value < 1):
                raise ConfigError(f"train.{key} must be in [0, 1), got {value}")
        if not (math.isfinite(self.muon_weight_decay) and self.muon_weight_decay >= 0):
            raise ConfigError(
                f"train.muon_weight_decay must be a finite number >= 0, got {self.muon_weight_decay}"
            )
        if isinstance(self.muon_ns_steps, bool) or not 1 <= self.muon_ns_steps <= 5:
            raise ConfigError(
                "train.muon_ns_steps must be an integer in 1..5 (Polar Express steps), "
                f"got {self.muon_ns_steps}"
            )
        if isinstance(self.muon_momentum_warmup_steps, bool) or self.muon_momentum_warmup_steps < 0:
            raise ConfigError(
                f"train.muon_momentum_warmup_steps must be >= 0, got {self.muon_momentum_warmup_steps}"
            )
        if self.optimizer == "muon_adamw" and self.strategy == "fsdp":
            raise ConfigError(
                "train.optimizer=muon_adamw needs whole matrices (Muon orthogonalises each); "
                "train.strategy=fsdp shards them: use train.strategy=ddp"
            )
        if self.optimizer == "muon_adamw" and (self.puzzle_emb_optimizer == "sign_sgd" or self.decay_all):
            raise ConfigError(
                "train.optimizer=muon_adamw takes neither train.puzzle_emb_optimizer=sign_sgd nor "
                "train.decay_all"
            )

    def _check_accumulation(self) -> None:
        """train.grad_accum_steps / micro_batch_size against train.batch_size (the world size is checked
        when the trainer starts, ``loopformer.train.accumulate.micro_steps``)."""
        _at_least(self, "train", 1, "grad_accum_steps")
        _at_least(self, "train", 0, "micro_batch_size")
        if self.batch_size % self.grad_accum_steps:
            raise ConfigError(
                f"train.grad_accum_steps={self.grad_accum_steps} does not divide "
                f"train.batch_size={self.batch_size}"
            )
        if self.micro_batch_size and self.batch_size % (self.micro_batch_size * self.grad_accum_steps):
            raise ConfigError(
                f"train.micro_batch_size={self.micro_batch_size} x "
                f"train.grad_accum_steps={self.grad_accum_steps} does not divide train.batch_size={self.batch_size}"
            )


@dataclass
class EvalConfig:
    """Evaluation settings (used by loopformer.eval and the trainer's periodic evaluation)."""

    batch_size: int = 256
    max_examples: int = 0  # 0: the whole eval set
    use_ema: bool = True  # evaluate the EMA weights when the run keeps an EMA
    segments: int = 1  # chained forward calls carrying the state (TRM / HRM evaluate 16)
    check: bool = True  # also score with the task's independent validator
    # clean: loopformer.eval.evaluate (eval mode, eval.segments chained calls, every example scored);
    # authors_trm_deq: the Attractor puzzle authors' _eval (loopformer.eval.authors: training mode, Q halting
    # with train.halt_exploration, halted examples restarted within eval.segments calls, only those halted
    # at the last call counted, authors_max_batches batches); both: the clean metrics plus authors_* ones
    protocol: Literal["clean", "authors_trm_deq", "both"] = "clean"
    # authors_trm_deq: the first blocks of eval.batch_size rows, all processes together (0: all)
    authors_max_batches: int = 200

    def validate(self) -> None:
        _at_least(self, "eval", 1, "batch_size", "segments")
        _at_least(self, "eval", 0, "max_examples", "authors_max_batches")


@dataclass
class RunConfig:
    """Everything a run needs; dumped to ``config.yaml`` / ``config.json`` in every run folder."""

    model: ModelSpec = field(default_factory=ModelSpec)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    # the loops, each the LoopConfig keys it sets over the model's default loop (model.loop): loop_train for
    # training, loop_eval for evaluation (RunConfig.loop_config resolves them; the only place that does)
    loop_train: Overlay[LoopConfig] = field(default_factory=lambda: _loop_overlay())
    loop_eval: Overlay[LoopConfig] = field(default_factory=lambda: _loop_overlay())
    # applied over loop_eval for the trainer's own evaluations (every train.eval_every steps and the one at
    # the end of training, which also choose train.keep_best): a cheaper in-training protocol than loop_eval's
    # (FPRM: the authors evaluate in-run at cap 1000, their published numbers at cap 35000); {} = loop_eval
    # as is. `loopformer eval` always uses loop_eval.
    loop_periodic: Overlay[LoopConfig] = field(default_factory=lambda: _loop_overlay())
    out_dir: str = "runs/default"
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # bf16 autocast: auto = on CUDA (CPU runs float32); true = on every device, the CPU included; false = never
    bf16: bool | Literal["auto"] = "auto"
    # on CUDA, float32 matrix products and cuDNN convolutions in TF32 (about 1e-3 relative error, much faster);
    # false = full float32, e.g. to compare against a CPU run or a float32 reference (the CPU ignores it)
    tf32: bool = True
    # torch.compile the whole training step (loop, loss, optimiser: loopformer.train.compiled), or the looped
    # body where the whole step cannot be; auto = on CUDA, off on the CPU
    compile: bool | Literal["auto"] = False
    # torch.compile's mode for the whole step: reduce-overhead = CUDA graphs (every shape of a step is static)
    compile_mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = (
        "default"
    )

    # -- derived objects ------------------------------------------------------------------------
    def model_config(self, **defaults: Any) -> Any:
        """The family's config object; ``defaults`` (e.g. from the task) apply where unset."""
        from loopformer.models.registry import make_config

        fields_ = model_fields(self.model.name, {**defaults, **self.model.fields}, "model")
        try:
            return make_config(self.model.name, **fields_)
        except KeyError as err:
            raise ConfigError(str(err.args[0]) if err.args else str(err)) from None

    def loop_config(self, base: LoopConfig, phase: Literal["train", "eval", "periodic"]) -> LoopConfig:
        """The loop ``phase`` runs: ``base`` (the model's default LoopConfig) with this run's ``loop_<phase>``
        over it; "periodic": over the eval loop (the trainer's own evaluations). A training loop never reads
        the host unless the recipe asks (``LoopConfig.sync_every``: 0 unless ``loop_train`` sets it)."""
        if phase == "periodic":
            base = self.loop_config(base, "eval")
        overlay = {"train": self.loop_train, "eval": self.loop_eval, "periodic": self.loop_periodic}[phase]
        changes = overlay.changes
        if phase == "train" and "sync_every" not in changes:
            changes = {**changes, "sync_every": 0}
        return Overlay(type(base), changes).over(base, f"loop_{phase}")

def _loop_overlay() -> Overlay:
    """An empty ``Overlay[LoopConfig]``: the model's default loop as it is."""
    from loopformer.loop import LoopConfig

    return Overlay(LoopConfig)


def model_fields(name: str, fields_: typing.Mapping[str, Any], path: str) -> dict[str, Any]:
    """Family config fields coerced to their types; a table for a nested dataclass (``model.loop``) is
    applied over the family's default, not the class default."""
    from loopformer.models.registry import MODELS, known_model, model_classes

    if not known_model(name):
        raise ConfigError(f"{join(path, 'name')}: unknown model {name!r}{suggest(name, list(MODELS))}")
    _, config_cls = model_classes(name)
    valid = {f.name: f for f in dataclasses.fields(config_cls)}
    out = {}
    for key, value in fields_.items():
        if key not in valid:
            raise ConfigError(
                f"unknown config key {join(path, key)!r}: model {name!r} has no field {key!r}"
                f"{suggest(key, list(valid), path)}"
            )
        tp, where = hints(config_cls)[key], join(path, key)
        if dataclasses.is_dataclass(tp) and isinstance(value, typing.Mapping):
            f = valid[key]
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            out[key] = coerce(value, Overlay[tp], where).over(default, where)
        else:
            out[key] = coerce(value, tp, where)
    return out


def _check_run(cfg: RunConfig, training: bool) -> None:
    """The run's own keys: the seed, the run folder, the device (``cuda`` needs one when training)."""
    if not 0 <= cfg.seed < 2**63:
        raise ConfigError(f"seed must be in [0, 2**63), got {cfg.seed}")
    if not str(cfg.out_dir).strip():
        raise ConfigError("out_dir must not be empty")
    if training and cfg.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(
                "device=cuda, but no CUDA device is available here (use device=cpu or device=auto)"
            )


def _check_model(cfg: RunConfig) -> None:
    """The model family's config builds, and its shape is sane: sizes >= 1, ``d_model`` divisible by
    ``n_heads``, an even head width for rotary positions."""
    try:
        mc = cfg.model_config()
    except (ValueError, TypeError, ZeroDivisionError) as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"model: {err}") from None
    for key in ("vocab_size", "seq_len", "d_model", "n_heads", "n_layers"):
        value = getattr(mc, key, None)
        if isinstance(value, int) and value < 1:
            raise ConfigError(f"model.{key} must be >= 1, got {value}")
    for key in ("num_puzzle_ids", "puzzle_emb_len"):
        value = getattr(mc, key, None)
        if isinstance(value, int) and value < 0:
            raise ConfigError(f"model.{key} must be >= 0, got {value}")
    expansion = getattr(mc, "expansion", None)
    if isinstance(expansion, float) and not (math.isfinite(expansion) and expansion > 0):
        raise ConfigError(f"model.expansion must be a finite number > 0, got {expansion}")
    d_model, heads = getattr(mc, "d_model", None), getattr(mc, "n_heads", None)
    if isinstance(d_model, int) and isinstance(heads, int) and d_model % heads:
        raise ConfigError(f"model.d_model={d_model} must be divisible by model.n_heads={heads}")
    odd_heads = isinstance(d_model, int) and isinstance(heads, int) and (d_model // heads) % 2
    if getattr(mc, "rope", False) and odd_heads:
        raise ConfigError(
            f"model.d_model / model.n_heads = {d_model // heads} must be even for rotary positions "
            "(model.rope=true)"
        )


def _check_loops(cfg: RunConfig) -> None:
    """The training sampler's options, and a bf16 loop state only under bf16 autocast."""
    from loopformer.loop.samplers import training_sampler

    base = cfg.model_config().loop
    loops = {phase: cfg.loop_config(base, phase) for phase in ("train", "eval", "periodic")}
    try:
        training_sampler(cfg.train.loop_sampler, cfg.train.loop_sampler_options, loops["train"].max_steps,
                         cfg.seed)  # fmt: skip
    except (ValueError, TypeError) as err:
        raise ConfigError(f"train.loop_sampler / train.loop_sampler_options: {err}") from None
    for phase, loop in loops.items():
        if loop.state_dtype == "bfloat16" and cfg.bf16 is False:
            raise ConfigError(
                f"loop_{phase}.state_dtype=bfloat16 runs the looped body in bf16, which needs bf16 autocast: "
                "set bf16: true (or auto on CUDA)"
            )


def _check_prediction_position(cfg: RunConfig) -> None:
    """``kg_files``' label position and the recurrent model's monitored position must agree (LTG's pred_pos)."""
    pred_pos = cfg.data.options.get("pred_pos", "answer") if cfg.data.task == "kg_files" else None
    halt = cfg.model.fields.get("halt_position", "all") if cfg.model.name == "recurrent" else "all"
    if pred_pos is not None and halt != "all" and halt != pred_pos:
        raise ConfigError(
            f"model.halt_position={halt!r} monitors another position than data.options.pred_pos={pred_pos!r} "
            f"labels; set model.halt_position={pred_pos}"
        )


def _check_options(
    fn: Any, options: dict[str, Any], prefix: str, what: str, skip: tuple[str, ...] = ("self",)
) -> None:
    """Each of ``options`` names a parameter of ``fn`` (nearest suggested) and fits its annotation."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    names = [n for n, p in params.items() if n not in skip and p.kind is not inspect.Parameter.VAR_POSITIONAL]
    for key in options:
        if key not in names:
            raise ConfigError(
                f"unknown option {prefix}.{key}: {what} takes {', '.join(names) or 'no options'}"
                f"{suggest(key, names, prefix) if names else ''}"
            )
    check_option_types(fn, options, prefix)


SIMPLE_TYPES = (int, float, bool, str, type(None))


def _simple(tp: Any) -> bool:
    """An annotation ``coerce`` can check without knowing the task: scalars, Optional / unions,
    Literal, and tuples / lists of them."""
    import types

    if tp in SIMPLE_TYPES:
        return True
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return True
    return origin in (typing.Union, types.UnionType, tuple, list) and bool(args) and all(
        a is Ellipsis or _simple(a) for a in args
    )


def check_option_types(fn: Any, options: dict[str, Any], prefix: str) -> None:
    """Each option against the annotation of its parameter (``size: int`` refuses ``1.5`` or ``"abc"``,
    ``box: tuple[int, int] | None`` refuses ``3``), with its key; a scalar is stored as coerced
    (``4.0`` -> ``4``). Parameters without a simple annotation (``Any``, arrays) are left to the task."""
    try:
        types_ = typing.get_type_hints(fn)
    except Exception:  # an annotation that does not resolve: nothing to check by
        return
    for key, value in options.items():
        tp = types_.get(key)
        if tp is None or not _simple(tp):
            continue
        coerced = coerce(value, tp, f"{prefix}.{key}")
        if isinstance(coerced, SIMPLE_TYPES):
            options[key] = coerced


def validate(cfg: RunConfig, training: bool = True, device: str | None = None) -> RunConfig:
    """Check every value of ``cfg`` (see the module docstring); model fields are replaced by their
    coerced values (a nested ``loop`` table is written out whole, the family's default under it) so the
    dump round-trips.

    ``training=False`` checks a trained run's config for evaluation
    (``loopformer.config.checks.run_config_for``): the training machine's settings (``device``, ``train.threads``) are not held against this machine, and
    the memory bound (``loopformer.config.memory``) is evaluation's, on ``device`` (default ``cfg.device``)."""
    fields_ = model_fields(cfg.model.name, cfg.model.fields, "model")
    cfg.model.fields = {k: to_dict(v) for k, v in fields_.items()}
    _check_model(cfg)
    _check_loops(cfg)
    cfg.train.validate(training)
    _check_run(cfg, training)
    cfg.eval.validate()
    cfg.data.validate(training)
    _check_prediction_position(cfg)
    from loopformer.config.memory import check_memory

    check_memory(cfg, device, training)
    return cfg
