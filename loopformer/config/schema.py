"""The run configuration's schema: nested dataclasses (see ``loopformer.config``, which re-exports them)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal


@dataclass(frozen=True)
class Registered:
    """``Annotated[str, Registered("module:NAME")]``: the value must be a key of the registry dict
    ``NAME`` in ``module`` (imported when a value is checked, by ``loopformer.config.coerce``), so
    plug-ins registered outside the package are valid values and the list of choices is the registry's."""

    registry: str
    base: str = ""  # "module:Class" every plug-in of the registry subclasses (for module:Class values)

    def names(self) -> list[str]:
        module, attr = self.registry.split(":")
        return list(getattr(importlib.import_module(module), attr))

    def check(self, value: Any, path: str, choose: Any) -> Any:
        """``value`` when it is a registered name (``choose(names)`` checks that) or a ``module:Class`` path
        to a subclass of ``base``, which is imported and registered under that path."""
        from loopformer.plugins import is_class_path, load_entry_points, resolve_class

        if is_class_path(value) and self.base:
            module, attr = self.registry.split(":")
            registry = getattr(importlib.import_module(module), attr)
            base_module, base_name = self.base.split(":")
            base = getattr(importlib.import_module(base_module), base_name)
            registry.setdefault(value, resolve_class(value, base, path))
            return value
        if isinstance(value, str) and value not in self.names():
            load_entry_points()
        return choose(self.names())


# --------------------------------------------------------------------------------------------
# The schema
# --------------------------------------------------------------------------------------------
@dataclass
class ModelSpec:
    """A model family (``loopformer.models.registry.MODELS``) and fields of its config class.

    In YAML the fields sit next to ``name``: ``model: {name: fprm, d_model: 64}``. Fields not
    given (vocab_size, seq_len, causal, num_puzzle_ids, grid) are filled from the task by the
    trainer; the loop the model runs by default is ``model.loop`` (a ``LoopConfig`` table).
    """

    name: str = "fprm"
    fields: dict[str, Any] = field(default_factory=dict)


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


@dataclass
class RunConfig:
    """Everything a run needs; dumped to ``config.yaml`` / ``config.json`` in every run folder."""

    model: ModelSpec = field(default_factory=ModelSpec)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    loop_train: dict[str, Any] = field(default_factory=dict)  # LoopConfig fields for training
    loop_eval: dict[str, Any] = field(default_factory=dict)  # LoopConfig fields for evaluation
    # LoopConfig fields applied over loop_eval for the trainer's own evaluations (every train.eval_every
    # steps and the one at the end of training, which also choose train.keep_best): a cheaper in-training
    # protocol than loop_eval's (FPRM: the authors evaluate in-run at cap 1000, their published numbers at
    # cap 35000); {} = loop_eval as is. `loopformer eval` always uses loop_eval.
    loop_periodic: dict[str, Any] = field(default_factory=dict)
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
        from loopformer.config.strict import ConfigError, _model_fields
        from loopformer.models.registry import make_config

        fields_ = {**defaults, **self.model.fields}
        try:
            return make_config(self.model.name, **_model_fields(self.model.name, fields_, "model"))
        except KeyError as err:
            raise ConfigError(str(err.args[0]) if err.args else str(err)) from None

    def loop_config(self, base: Any, phase: Literal["train", "eval", "periodic"]) -> Any:
        """``base`` (the model's default LoopConfig) with this run's train / eval overrides; "periodic":
        the eval loop with ``loop_periodic`` on top (the trainer's own evaluations)."""
        from loopformer.config.strict import _loop_fields, _merge_fields

        if phase == "periodic":
            base = self.loop_config(base, "eval")
        overrides = {"train": self.loop_train, "eval": self.loop_eval, "periodic": self.loop_periodic}[phase]
        fields_ = _loop_fields(overrides, f"loop_{phase}")
        if (
            phase == "train"
        ):  # a training loop never reads the host unless the recipe asks (LoopConfig.sync_every)
            fields_.setdefault("sync_every", 0)
        return _merge_fields(base, fields_, f"loop_{phase}")
