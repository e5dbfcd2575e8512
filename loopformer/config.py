"""Run configuration: nested dataclasses, YAML recipes and strict ``key=value`` overrides.

One source of truth. ``RunConfig`` nests ``ModelSpec`` (a model family name plus that family's
config fields, validated through ``loopformer.models.registry.make_config``), ``DataConfig``
(with ``CurriculumConfig``), ``TrainConfig``, ``EvalConfig`` and two loop-override tables applied
on top of the model's default ``LoopConfig``: ``loop_train`` and ``loop_eval`` (FPRM, SYSTEMS.md
section 1, trains its damped solver with gamma 0.9 and evaluates with 0.99).

Recipes are YAML files in ``recipes/``; a recipe may name a parent with ``base: other.yaml``
(merged key by key, the child wins). Command-line overrides are dotted paths, e.g.
``train.lr=3e-4 model.d_model=64 loop_train.max_steps=8``; each value is parsed with
``yaml.safe_load`` (numbers, bools, lists, null) and then coerced to the field's type.

Why plain dataclasses and a small strict loader rather than OmegaConf: the loader is ~200
lines, adds no dependency, and every error names the full dotted key and suggests the nearest
valid one (``difflib``), including inside the model family's own config and ``LoopConfig``,
whose fields are only known once the family name is resolved. The resolved config dumps to
YAML and JSON (``save_config``) and loads back to an equal object (``load_config_file``).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

CHECKPOINT_META_KEYS = ("family", "step")  # written next to the config in checkpoints
RECIPE_DIR = Path(__file__).resolve().parent / "recipes"  # shipped in the wheel; ./recipes links here


class ConfigError(ValueError):
    """A bad recipe or override: the message names the dotted key and the nearest valid one."""


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
    """Difficulty curriculum (Loop, Think & Generalize, SYSTEMS.md section 3).

    Train on examples with difficulty <= level; start at ``start``; advance by ``step`` when the
    exact-match accuracy on the current level (measured every ``check_every`` steps on up to
    ``sample`` examples from the held-out set, or recent training examples when ``source`` is
    "train" or the held-out set has none at that level) reaches ``threshold``.
    """

    enabled: bool = False
    start: float = 2.0
    step: float = 1.0
    max_level: float | None = None  # None: the largest difficulty in the training set
    threshold: float = 0.95
    check_every: int = 100
    sample: int = 256
    source: Literal["eval", "train"] = "eval"


@dataclass
class DataConfig:
    """Which task, its constructor options, and how the train / eval sets are produced.

    Each set (``loopformer.train.data.load_split``) comes from ``<split>_path`` when given: a folder
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
    train_path: str | None = None  # a file (task.load) or an HRM folder (load_hrm_folder) instead of generating
    eval_path: str | None = None
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)


@dataclass
class TrainConfig:
    """Optimisation, the training loop mode and logging / checkpoint cadence."""

    mode: Literal["simple", "deep_supervision"] = "simple"
    steps: int = 1000
    batch_size: int = 64
    # optimiser (AdamW) and schedule
    lr: float = 1e-3
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    optimizer: Literal["adamw", "adam_atan2"] = "adamw"  # adam_atan2: TRM / HRM (train/optim.py AdamATan2)
    decay_all: bool = False  # weight decay on every parameter, biases included (TRM / HRM)
    puzzle_emb_optimizer: Literal["same", "sign_sgd"] = "same"  # sign_sgd: TRM / HRM's sparse-embedding SignSGD
    puzzle_emb_lr: float = 1e-2  # sign-SGD rate of the puzzle embedding (TRM / HRM puzzle_emb_lr)
    puzzle_emb_weight_decay: float = 0.1  # its decoupled weight decay (puzzle_emb_weight_decay)
    warmup_steps: int = 100
    schedule: Literal["constant", "cosine"] = "constant"
    min_lr_ratio: float = 0.0  # cosine floor as a fraction of lr
    grad_clip: float = 1.0  # max global grad norm; 0 = off
    decay_embeddings: bool = True  # False: embeddings get no weight decay
    ema: float = 0.0  # EMA decay of the weights (0.999 in TRM / FPRM); 0 = off
    ema_warmup: bool = True  # decay_t = min(ema, (1 + t) / (10 + t)); False = TRM's plain EMA
    # losses
    loss: Literal["ce", "stablemax"] = "ce"
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
    halt_exploration: float = 0.1  # TRM: probability of forcing a random minimum segment count
    halt_on_converged: bool = False  # FPRM: a slot halts when its loop converged
    # logging, evaluation, checkpoints
    log_every: int = 10
    eval_every: int = 0  # 0: evaluate at the end only
    checkpoint_every: int = 0  # 0: checkpoint at the end only
    keep_checkpoints: int = 3
    resume: bool | str = False  # True: the run folder's latest checkpoint; str: a checkpoint folder
    overwrite: bool = False  # a fresh run into a folder holding a run replaces it (moved aside at the first checkpoint)
    max_state_norm: float = 1e6  # a larger mean state norm counts as divergence
    max_loss: float = 1e4  # a larger loss counts as divergence
    progress: bool = True  # rich progress bar
    tensorboard: bool = False
    threads: int = 0  # CPU threads; 0 = physical cores
    # multi-process (torchrun), see loopformer/train/dist.py
    strategy: Literal["ddp", "fsdp"] = "ddp"
    sync_halting: bool = False  # every rank leaves each loop on the same global step count (one all-reduce per step)
    find_unused_parameters: bool | None = None  # None: decided by a probe forward/backward of the real loss


@dataclass
class EvalConfig:
    """Evaluation settings (used by loopformer.eval and the trainer's periodic evaluation)."""

    batch_size: int = 256
    max_examples: int = 0  # 0: the whole eval set
    use_ema: bool = True  # evaluate the EMA weights when the run keeps an EMA
    segments: int = 1  # chained forward calls carrying the state (TRM / HRM evaluate 16)
    check: bool = True  # also score with the task's independent validator


@dataclass
class RunConfig:
    """Everything a run needs; dumped to ``config.yaml`` / ``config.json`` in every run folder."""

    model: ModelSpec = field(default_factory=ModelSpec)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    loop_train: dict[str, Any] = field(default_factory=dict)  # LoopConfig fields for training
    loop_eval: dict[str, Any] = field(default_factory=dict)  # LoopConfig fields for evaluation
    out_dir: str = "runs/default"
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"
    bf16: bool = True  # bf16 autocast when running on CUDA; CPU always runs float32
    compile: bool = False  # torch.compile the model's step (the looped body)

    # -- derived objects ------------------------------------------------------------------------
    def model_config(self, **defaults: Any) -> Any:
        """The family's config object; ``defaults`` (e.g. from the task) apply where unset."""
        from loopformer.models.registry import make_config

        fields_ = {**defaults, **self.model.fields}
        try:
            return make_config(self.model.name, **_model_fields(self.model.name, fields_, "model"))
        except KeyError as err:
            raise ConfigError(str(err.args[0]) if err.args else str(err)) from None

    def loop_config(self, base: Any, phase: Literal["train", "eval"]) -> Any:
        """``base`` (the model's default LoopConfig) with this run's train / eval overrides."""
        overrides = self.loop_train if phase == "train" else self.loop_eval
        return _merge_fields(base, _loop_fields(overrides, f"loop_{phase}"), f"loop_{phase}")


# --------------------------------------------------------------------------------------------
# Strict conversion
# --------------------------------------------------------------------------------------------
def _suggest(key: str, options: Sequence[str], prefix: str = "") -> str:
    """'; did you mean 'prefix.nearest'?' or the list of valid names when nothing is close."""
    best = _nearest(key, options)
    if best is not None:
        return f"; did you mean {_join(prefix, best)!r}?"
    return f" (valid: {', '.join(sorted(options))})"


def _nearest(key: str, options: Sequence[str], cutoff: float = 0.5) -> str | None:
    """The most similar option: difflib's ratio plus a bonus for a shared prefix ('lrate' -> 'lr')."""

    def score(option: str) -> float:
        shared = len(os.path.commonprefix([key, option]))
        return difflib.SequenceMatcher(None, key, option).ratio() + 0.5 * shared / max(len(key), len(option))

    scored = sorted(((score(o), o) for o in options), reverse=True)
    return scored[0][1] if scored and scored[0][0] >= cutoff else None


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def coerce(value: Any, tp: Any, path: str) -> Any:
    """``value`` converted to the annotation ``tp``; ConfigError naming ``path`` when it cannot be."""
    if tp is Any or tp is object:
        return value
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        # bool before str, numbers before str: try the non-str members first
        for member in sorted((a for a in args if a is not type(None)), key=lambda a: a is str):
            try:
                return coerce(value, member, path)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(f"{path}: {value!r} is not a {_type_name(tp)}")
    if origin is Literal:
        if value in args:
            return value
        close = difflib.get_close_matches(str(value), [str(a) for a in args], n=1, cutoff=0.4)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"{path}: {value!r} is not one of {list(args)}{hint}")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            value = to_dict(value)
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a table of {tp.__name__} fields, got {value!r}")
        return from_dict(tp, value, path)
    if origin in (tuple, list):
        if isinstance(value, str | bytes) or not isinstance(value, Sequence):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                raise ConfigError(f"{path}: expected {len(args)} values, got {len(value)}")
            return tuple(coerce(v, a, f"{path}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
        item = args[0] if args else Any
        items = [coerce(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a table, got {value!r}")
        return {str(k): v for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
        raise ConfigError(f"{path}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{path}: expected a number, got {value!r}")
        if isinstance(value, int | float):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads '3e-4' as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{path}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{path}: expected a string, got {value!r}")
    if isinstance(tp, type):
        if isinstance(value, tp):
            return value
        raise ConfigError(f"{path}: expected {tp.__name__}, got {value!r}")
    return value


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def from_dict(cls: type, data: Mapping[str, Any], path: str = "") -> Any:
    """Strictly build dataclass ``cls`` from ``data``: unknown keys and bad types are errors."""
    if cls is ModelSpec:
        return _model_spec(data, path)
    return cls(**_coerced_fields(cls, data, path))


def _coerced_fields(cls: type, data: Mapping[str, Any], path: str) -> dict[str, Any]:
    """``data`` checked against dataclass ``cls``'s fields (unknown keys suggest the nearest) and
    coerced to their types."""
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    out = {}
    for key, value in data.items():
        if key not in names:
            raise ConfigError(f"unknown config key {_join(path, key)!r}{_suggest(str(key), names, path)}")
        out[key] = coerce(value, hints[key], _join(path, key))
    return out


def _model_spec(data: Mapping[str, Any], path: str) -> ModelSpec:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: expected a table with a model 'name', got {data!r}")
    fields_ = {str(k): v for k, v in data.items() if k != "name"}
    if "fields" in fields_ and isinstance(fields_["fields"], Mapping):  # the dataclass' own layout
        fields_ = {**fields_.pop("fields"), **fields_}
    name = coerce(data.get("name", ModelSpec.name), str, _join(path, "name"))
    return ModelSpec(name=name, fields=fields_)


def _model_fields(name: str, fields_: Mapping[str, Any], path: str) -> dict[str, Any]:
    """Family config fields coerced to their types (nested LoopConfig tables included)."""
    from loopformer.models.registry import MODELS, model_classes

    if name not in MODELS:
        raise ConfigError(f"{_join(path, 'name')}: unknown model {name!r}{_suggest(name, list(MODELS))}")
    _, config_cls = model_classes(name)
    hints = _hints(config_cls)
    valid = [f.name for f in dataclasses.fields(config_cls)]
    out = {}
    for key, value in fields_.items():
        if key not in valid:
            raise ConfigError(
                f"unknown config key {_join(path, key)!r}: model {name!r} has no field {key!r}"
                f"{_suggest(key, valid, path)}"
            )
        tp = hints[key]
        if dataclasses.is_dataclass(tp) and isinstance(value, Mapping):
            # a nested table (e.g. model.loop) overrides the family's default, not the class default
            out[key] = _replace_fields(_field_default(config_cls, key), value, _join(path, key))
        else:
            out[key] = coerce(value, tp, _join(path, key))
    return out


def _field_default(cls: type, name: str) -> Any:
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _partial_fields(cls: type, data: Mapping[str, Any], path: str) -> dict[str, Any]:
    """``data`` coerced to ``cls``'s field types, where a table for a nested dataclass field stays a
    partial table (merged into the base by ``_merge_fields``); a class may map legacy flat keys
    into its nested tables (``LoopConfig.nest_legacy``: ``damp_gamma`` -> ``damped.gamma``)."""
    nest = getattr(cls, "nest_legacy", None)
    if nest is not None:
        try:
            data = nest(data)
        except ValueError as err:
            raise ConfigError(f"{path}: {err}") from None
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    out: dict[str, Any] = {}
    for key, value in data.items():
        if key not in names:
            known = names + list(getattr(cls, "legacy_names", {}))
            raise ConfigError(f"unknown config key {_join(path, key)!r}{_suggest(str(key), known, path)}")
        tp = hints[key]
        if dataclasses.is_dataclass(tp) and isinstance(value, Mapping):
            out[key] = _partial_fields(tp, value, _join(path, key))
        else:
            out[key] = coerce(value, tp, _join(path, key))
    return out


def _merge_fields(base: Any, changes: Mapping[str, Any], path: str) -> Any:
    """``base`` with coerced ``changes``; partial tables update nested dataclass fields."""
    merged = {
        k: _merge_fields(getattr(base, k), v, _join(path, k))
        if isinstance(v, Mapping) and dataclasses.is_dataclass(getattr(base, k))
        else v
        for k, v in changes.items()
    }
    try:
        return dataclasses.replace(base, **merged)
    except ValueError as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"{path}: {err}") from None


def _replace_fields(base: Any, changes: Mapping[str, Any], path: str) -> Any:
    """``base`` (a dataclass instance) with ``changes`` coerced to its field types."""
    return _merge_fields(base, _partial_fields(type(base), changes, path), path)


def _loop_fields(overrides: Mapping[str, Any], path: str) -> dict[str, Any]:
    from loopformer.loop import LoopConfig

    return _partial_fields(LoopConfig, overrides, path)


def to_dict(obj: Any) -> Any:
    """Plain YAML / JSON data (tuples become lists; ModelSpec is flattened next to its name)."""
    if isinstance(obj, ModelSpec):
        return {"name": obj.name, **{k: to_dict(v) for k, v in obj.fields.items()}}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {str(k): to_dict(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [to_dict(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return obj


def validate(cfg: RunConfig) -> RunConfig:
    """Check what depends on other modules: model family fields and loop override keys.

    Model fields are replaced by their coerced values (e.g. a nested ``loop`` table stays a
    table but its values get their LoopConfig types), so the dump round-trips.
    """
    fields_ = _model_fields(cfg.model.name, cfg.model.fields, "model")
    cfg.model.fields = {k: to_dict(v) for k, v in fields_.items()}
    cfg.loop_train = to_dict(_loop_fields(cfg.loop_train, "loop_train"))
    cfg.loop_eval = to_dict(_loop_fields(cfg.loop_eval, "loop_eval"))
    try:  # values the family / LoopConfig validate themselves (ranges, choices)
        base = cfg.model_config().loop
    except (ValueError, TypeError) as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(f"model: {err}") from None
    cfg.loop_config(base, "train")
    cfg.loop_config(base, "eval")
    t = cfg.train
    for key in ("steps", "batch_size", "max_segments", "log_every"):
        if getattr(t, key) < 1:
            raise ConfigError(f"train.{key} must be >= 1, got {getattr(t, key)}")
    for key in ("warmup_steps", "eval_every", "checkpoint_every", "keep_checkpoints", "threads"):
        if getattr(t, key) < 0:
            raise ConfigError(f"train.{key} must be >= 0, got {getattr(t, key)}")
    if not 0.0 <= t.ema < 1.0:
        raise ConfigError(f"train.ema must be in [0, 1), got {t.ema}")
    if t.lr <= 0:
        raise ConfigError(f"train.lr must be > 0, got {t.lr}")
    return cfg


# --------------------------------------------------------------------------------------------
# Recipes and overrides
# --------------------------------------------------------------------------------------------
def find_recipe(name: str | Path) -> Path:
    """A recipe path: as given, or ``<name>[.yaml]`` in ./recipes or the package's recipes (RECIPE_DIR)."""
    candidates = [Path(name)]
    stem = str(name) if str(name).endswith((".yaml", ".yml")) else f"{name}.yaml"
    candidates += [Path("recipes") / stem, RECIPE_DIR / stem]
    for path in candidates:
        if path.is_file():
            return path
    known = sorted(p.stem for p in RECIPE_DIR.glob("*.yaml")) if RECIPE_DIR.is_dir() else []
    raise ConfigError(f"no recipe {str(name)!r}{_suggest(Path(stem).stem, known) if known else ''}")


def _merge(base: dict[str, Any], child: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in child.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(dict(out[key]), value)
        else:
            out[key] = value
    return out


def read_recipe(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A recipe's raw table with its ``base:`` chain merged in (the child wins)."""
    path = find_recipe(path).resolve()
    if path in _seen:
        raise ConfigError(f"recipe base cycle: {' -> '.join(str(p) for p in (*_seen, path))}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"recipe {path} is not valid YAML: {err}") from None
    if not isinstance(data, Mapping):
        raise ConfigError(f"recipe {path} must be a table of config keys, got {type(data).__name__}")
    data = dict(data)
    parent = data.pop("base", None)
    if parent is not None:
        parent_path = Path(parent) if Path(parent).is_absolute() else path.parent / parent
        data = _merge(read_recipe(parent_path, (*_seen, path)), data)
    return data


def parse_override(text: str) -> tuple[list[str], Any]:
    """``'train.lr=3e-4'`` -> (['train', 'lr'], '3e-4' parsed by yaml.safe_load)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} is not of the form key=value (e.g. train.lr=3e-4)")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.split("."), value


def _check_path(parts: list[str]) -> None:
    """Errors early for keys that cannot exist in the schema (free tables accept any key)."""
    cls: Any = RunConfig
    walked = ""
    for part in parts:
        if cls is None:  # inside a free table (options, loop overrides, model fields)
            return
        if cls is ModelSpec:
            return  # family fields are checked once the name is known
        names = [f.name for f in dataclasses.fields(cls)]
        if part not in names:
            raise ConfigError(f"unknown config key {_join(walked, part)!r}{_suggest(part, names, walked)}")
        tp = _hints(cls)[part]
        walked = _join(walked, part)
        cls = tp if (dataclasses.is_dataclass(tp) and isinstance(tp, type)) else None
        if cls is None and part != parts[-1] and typing.get_origin(tp) is not dict and tp is not dict:
            raise ConfigError(f"config key {walked!r} is a value, not a table")


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Raw recipe table with dotted ``key=value`` overrides written in (validated paths)."""
    data = json.loads(json.dumps(data, default=list))  # deep copy of plain data
    for text in overrides:
        parts, value = parse_override(text)
        _check_path(parts)
        node = data
        for part in parts[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = {}
                node[part] = child
            node = child
        node[parts[-1]] = value
    return data


def build_config(data: Mapping[str, Any], overrides: Sequence[str] = (), check: bool = True) -> RunConfig:
    """RunConfig from a raw table plus overrides; ``check`` also validates model / loop keys."""
    cfg = from_dict(RunConfig, apply_overrides(dict(data), overrides))
    return validate(cfg) if check else cfg


def load_config(
    recipe: str | Path | None = None, overrides: Sequence[str] = (), check: bool = True
) -> RunConfig:
    """The run configuration of ``recipe`` (a path or a name in recipes/; None = defaults)."""
    data = read_recipe(recipe) if recipe is not None else {}
    return build_config(data, overrides, check)


def config_to_yaml(cfg: RunConfig) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def config_to_json(cfg: RunConfig, **extra: Any) -> str:
    return json.dumps({**to_dict(cfg), **extra}, indent=2)


def save_config(cfg: RunConfig, folder: str | Path) -> None:
    """Write ``config.yaml`` and ``config.json`` into ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.yaml").write_text(config_to_yaml(cfg))
    (folder / "config.json").write_text(config_to_json(cfg))


def load_config_file(path: str | Path, check: bool = True) -> RunConfig:
    """Load a dumped ``config.yaml`` / ``config.json`` (or a folder holding one)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json" if (path / "config.json").is_file() else path / "config.yaml"
    if not path.is_file():
        raise ConfigError(f"no config file at {path}")
    text = path.read_text()
    data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path} does not hold a config table")
    data = {k: v for k, v in data.items() if k not in CHECKPOINT_META_KEYS}
    return build_config(data, (), check)
