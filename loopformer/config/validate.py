"""Checks of a built ``RunConfig`` (every value, with its dotted key) and the strict YAML reader.

``validate(cfg)`` runs when a config is built (``loopformer.config.build_config``): model family
fields and loop overrides are coerced and checked by their own classes, then every value here:
ranges (sizes >= 1, rates in [0, 1), finite non-negative weights, a sane learning rate), a held-out set
generated apart from the training set (not the same seed with the same generator options), the
model's shape (``d_model`` divisible by ``n_heads``), the device (``cuda`` needs a CUDA device),
CPU thread counts, the task's name and options (checked against the task's constructor and
``generate`` signatures without building the task), the loop sampler's options, and sizes that
cannot fit in memory (``loopformer.config.memory``).

``load_yaml(text, where)`` is ``yaml.safe_load`` with two more refusals: a duplicate key in a
mapping and documents whose aliases would expand past ``MAX_YAML_NODES`` nodes (a "billion
laughs" file), each a ``ConfigError`` naming the file and line.
"""

from __future__ import annotations

import inspect
import math
import os
from typing import Any

from loopformer.config.schema import RunConfig
from loopformer.config.strict import ConfigError, _loop_fields, _model_fields, to_dict

MAX_LR = 10.0


def _check_muon(t: Any) -> None:
    """``train.muon_*`` (read by ``optimizer: muon_adamw``; checked whatever the optimiser)."""
    if t.muon_lr is not None and not (math.isfinite(t.muon_lr) and 0 < t.muon_lr <= MAX_LR):
        raise ConfigError(
            f"train.muon_lr must be null or a finite number in (0, {MAX_LR:g}], got {t.muon_lr}"
        )
    for key in ("muon_momentum", "muon_beta2", "muon_momentum_warmup_start"):
        value = getattr(t, key)
        if not (math.isfinite(value) and 0 <= value < 1):
            raise ConfigError(f"train.{key} must be in [0, 1), got {value}")
    if not (math.isfinite(t.muon_weight_decay) and t.muon_weight_decay >= 0):
        raise ConfigError(f"train.muon_weight_decay must be a finite number >= 0, got {t.muon_weight_decay}")
    if isinstance(t.muon_ns_steps, bool) or not 1 <= t.muon_ns_steps <= 5:
        raise ConfigError(
            f"train.muon_ns_steps must be an integer in 1..5 (Polar Express steps), got {t.muon_ns_steps}"
        )
    if isinstance(t.muon_momentum_warmup_steps, bool) or t.muon_momentum_warmup_steps < 0:
        raise ConfigError(
            f"train.muon_momentum_warmup_steps must be >= 0, got {t.muon_momentum_warmup_steps}"
        )
    if t.optimizer == "muon_adamw" and t.strategy == "fsdp":
        raise ConfigError(
            "train.optimizer=muon_adamw needs whole matrices (Muon orthogonalises each); "
            "train.strategy=fsdp shards them: use train.strategy=ddp"
        )
    if t.optimizer == "muon_adamw" and (t.puzzle_emb_optimizer == "sign_sgd" or t.decay_all):
        raise ConfigError(
            "train.optimizer=muon_adamw takes neither train.puzzle_emb_optimizer=sign_sgd nor train.decay_all"
        )


# --------------------------------------------------------------------------------------------
# Values
# --------------------------------------------------------------------------------------------
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


def _check_train(cfg: RunConfig, training: bool = True) -> None:
    t = cfg.train
    _at_least(t, "train", 1, "steps", "batch_size", "max_segments", "log_every")
    _at_least(t, "train", 0, "warmup_steps", "eval_every", "checkpoint_every", "keep_checkpoints", "threads")
    if not (math.isfinite(t.lr) and 0 < t.lr <= MAX_LR):
        raise ConfigError(f"train.lr must be a finite number in (0, {MAX_LR:g}], got {t.lr}")
    _finite(t, "train", 0.0, 1.0, "ema", "label_smoothing", open_high=True)
    _finite(t, "train", 0.0, 1.0, "min_lr_ratio", "halt_exploration", "cooldown_fraction")
    _finite(
        t,
        "train",
        0.0,
        math.inf,
        "weight_decay",
        "grad_clip",
        "q_loss_weight",
        "ponder_weight",
        "jacobian_weight",
        "puzzle_emb_weight_decay",
        open_high=True,
    )
    if not (math.isfinite(t.puzzle_emb_lr) and 0 < t.puzzle_emb_lr <= MAX_LR):
        raise ConfigError(
            f"train.puzzle_emb_lr must be a finite number in (0, {MAX_LR:g}], got {t.puzzle_emb_lr}"
        )
    if not (math.isfinite(t.head_lr_scale) and t.head_lr_scale > 0):
        raise ConfigError(f"train.head_lr_scale must be a finite number > 0, got {t.head_lr_scale}")
    if t.head_weight_decay is not None and not (
        math.isfinite(t.head_weight_decay) and t.head_weight_decay >= 0
    ):
        raise ConfigError(f"train.head_weight_decay must be >= 0 (or null), got {t.head_weight_decay}")
    _check_muon(t)
    _check_accumulation(t)
    if t.keep_best and not t.keep_best.isidentifier():
        raise ConfigError(
            f"train.keep_best must name an evaluation metric (e.g. exact_acc, valid_acc), got {t.keep_best!r}"
        )
    if t.keep_best.startswith("eval_"):
        raise ConfigError(
            f"train.keep_best names the metric without its log prefix: {t.keep_best[5:]!r}, not {t.keep_best!r}"
        )
    if not (math.isfinite(t.eps) and 0 < t.eps < 1):
        raise ConfigError(f"train.eps must be a finite number in (0, 1), got {t.eps}")
    for i, beta in enumerate(t.betas):
        if not (math.isfinite(beta) and 0 <= beta < 1):
            raise ConfigError(f"train.betas[{i}] must be in [0, 1), got {beta}")
    for key in ("max_state_norm", "max_loss"):
        value = getattr(t, key)
        if math.isnan(value) or value <= 0:
            raise ConfigError(f"train.{key} must be > 0, got {value}")
    cores = os.cpu_count() or 1
    if training and t.threads > cores:
        raise ConfigError(
            f"train.threads={t.threads} is more than the {cores} CPU cores of this machine "
            "(0 = one per physical core)"
        )


def _check_accumulation(t: Any) -> None:
    """train.grad_accum_steps / micro_batch_size against train.batch_size (the world size is checked
    when the trainer starts, ``loopformer.train.accumulate.micro_steps``)."""
    _at_least(t, "train", 1, "grad_accum_steps")
    _at_least(t, "train", 0, "micro_batch_size")
    if t.batch_size % t.grad_accum_steps:
        raise ConfigError(
            f"train.grad_accum_steps={t.grad_accum_steps} does not divide train.batch_size={t.batch_size}"
        )
    if t.micro_batch_size and t.batch_size % (t.micro_batch_size * t.grad_accum_steps):
        raise ConfigError(
            f"train.micro_batch_size={t.micro_batch_size} x train.grad_accum_steps={t.grad_accum_steps} "
            f"does not divide train.batch_size={t.batch_size}"
        )


def _check_sampler(cfg: RunConfig, loop: Any) -> None:
    from loopformer.loop.samplers import training_sampler

    try:
        training_sampler(cfg.train.loop_sampler, cfg.train.loop_sampler_options, loop.max_steps, cfg.seed)
    except (ValueError, TypeError) as err:
        raise ConfigError(f"train.loop_sampler / train.loop_sampler_options: {err}") from None


def _check_run(cfg: RunConfig, training: bool = True) -> None:
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
    e = cfg.eval
    _at_least(e, "eval", 1, "batch_size", "segments")
    _at_least(e, "eval", 0, "max_examples", "authors_max_batches")
    d, c = cfg.data, cfg.data.curriculum
    _at_least(d, "data", 0, "train_size", "eval_size", "train_seed", "eval_seed")
    _at_least(c, "data.curriculum", 1, "check_every", "sample")
    _at_least(c, "data.curriculum", 0, "max_steps")
    _finite(c, "data.curriculum", 0.0, 1.0, "threshold")
    if not (math.isfinite(c.step) and c.step > 0):
        raise ConfigError(f"data.curriculum.step must be > 0, got {c.step}")
    if training:
        _check_heldout_apart(d)


def _check_heldout_apart(d: Any) -> None:
    """A generated training set and a generated held-out set drawn with the same seed and the same generator
    options are the same puzzles (``task.generate(n, seed)`` rows are prefixes of each other): the model would
    be scored on what it trained on."""
    if d.train_path or d.eval_path or d.train_seed != d.eval_seed or d.train_generate != d.eval_generate:
        return
    raise ConfigError(
        f"data.train_seed and data.eval_seed are both {d.train_seed} with the same generator options "
        f"(data.train_generate = data.eval_generate): the held-out set would be the training set's first rows; "
        f"give data.eval_seed another value (or other data.eval_generate options, or a data.eval_path)"
    )


def _check_model(cfg: RunConfig) -> None:
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
    if (
        getattr(mc, "rope", False)
        and isinstance(d_model, int)
        and isinstance(heads, int)
        and (d_model // heads) % 2
    ):
        raise ConfigError(
            f"model.d_model / model.n_heads = {d_model // heads} must be even for rotary positions "
            "(model.rope=true)"
        )


def _check_task(cfg: RunConfig) -> None:
    from loopformer.tasks.registry import TASKS, known_task, task_class

    d = cfg.data
    if not known_task(d.task):
        from loopformer.config.strict import _suggest

        raise ConfigError(f"data.task: unknown task {d.task!r}{_suggest(d.task, list(TASKS))}")
    cls = task_class(d.task)
    _check_options(cls.__init__, d.options, "data.options", f"task {d.task!r}")
    for key in ("train_generate", "eval_generate"):
        _check_options(
            cls.generate,
            getattr(d, key),
            f"data.{key}",
            f"{d.task!r}'s generate()",
            skip=("self", "n", "seed"),
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
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    names = [n for n, p in params.items() if n not in skip and p.kind is not inspect.Parameter.VAR_POSITIONAL]
    for key in options:
        if key not in names:
            from loopformer.config.strict import _suggest

            raise ConfigError(
                f"unknown option {prefix}.{key}: {what} takes {', '.join(names) or 'no options'}"
                f"{_suggest(key, names, prefix) if names else ''}"
            )
    _check_option_types(fn, options, prefix)


SIMPLE_TYPES = (int, float, bool, str, type(None))


def _simple(tp: Any) -> bool:
    """An annotation ``coerce`` can check without knowing the task: scalars, Optional / unions,
    Literal, and tuples / lists of them."""
    import types
    import typing

    if tp in SIMPLE_TYPES:
        return True
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return True
    return origin in (typing.Union, types.UnionType, tuple, list) and bool(args) and all(
        a is Ellipsis or _simple(a) for a in args
    )


def _check_option_types(fn: Any, options: dict[str, Any], prefix: str) -> None:
    """Each option against the annotation of its parameter (``size: int`` refuses ``1.5`` or ``"abc"``,
    ``box: tuple[int, int] | None`` refuses ``3``), with its key; a scalar is stored as coerced
    (``4.0`` -> ``4``). Parameters without a simple annotation (``Any``, arrays) are left to the task."""
    import typing

    from loopformer.config.strict import coerce

    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # an annotation that does not resolve: nothing to check by
        return
    for key, value in options.items():
        tp = hints.get(key)
        if tp is None or not _simple(tp):
            continue
        coerced = coerce(value, tp, f"{prefix}.{key}")
        if isinstance(coerced, SIMPLE_TYPES):
            options[key] = coerced


def validate(cfg: RunConfig, training: bool = True, device: str | None = None) -> RunConfig:
    """Check every value of ``cfg`` (see the module docstring); model fields are replaced by their
    coerced values (a nested ``loop`` table stays a table with LoopConfig types) so the dump round-trips.

    ``training=False`` checks a trained run's config for evaluation (``loopformer.config.checks``): the
    training machine's settings (``device``, ``train.threads``) are not held against this machine, and
    the memory bound (``loopformer.config.memory``) is evaluation's, on ``device`` (default ``cfg.device``)."""
    fields_ = _model_fields(cfg.model.name, cfg.model.fields, "model")
    cfg.model.fields = {k: to_dict(v) for k, v in fields_.items()}
    cfg.loop_train = to_dict(_loop_fields(cfg.loop_train, "loop_train"))
    cfg.loop_eval = to_dict(_loop_fields(cfg.loop_eval, "loop_eval"))
    cfg.loop_periodic = to_dict(_loop_fields(cfg.loop_periodic, "loop_periodic"))
    _check_model(cfg)
    base = cfg.model_config().loop
    loops = {phase: cfg.loop_config(base, phase) for phase in ("train", "eval", "periodic")}
    _check_sampler(cfg, loops["train"])
    for phase, loop in loops.items():
        if loop.state_dtype == "bfloat16" and cfg.bf16 is False:
            raise ConfigError(
                f"loop_{phase}.state_dtype=bfloat16 runs the looped body in bf16, which needs bf16 autocast: "
                "set bf16: true (or auto on CUDA)"
            )
    _check_train(cfg, training)
    _check_run(cfg, training)
    _check_task(cfg)
    _check_prediction_position(cfg)
    from loopformer.config.memory import check_memory

    check_memory(cfg, device, training)
    return cfg
