"""``loopformer translate SYSTEM KEY=VALUE ...``: the authors' config keys and commands in loopformer's terms.

A researcher coming from TinyRecursiveModels, HRM or the FPRM repository writes their overrides
(``arch.L_cycles=4 global_batch_size=384 lr=1e-4``, Hydra's ``+key`` / ``++key`` included, or a whole
``python pretrain.py arch=trm data_paths=[...] ...`` command line). Each is translated by
``loopformer convert``'s own mapping, not by a second table that could drift from it: the reference
configuration (the authors' defaults for SYSTEM, ``REFERENCE``) is converted with and without the key
changed, on a state dict of the shapes that configuration implies (meta tensors: no memory), and the
loopformer keys whose values move are the key's translation, printed with the values the user's setting
gives. A key that moves nothing is one the conversion does not read (``epochs``, ``eval_interval``,
``project_name``...); it is listed so, never dropped silently. Every value is checked before anything is
printed: each against the kind of the authors' default (``_check_kind``), then the translation must convert
and give a run configuration ``train`` accepts (``loopformer.convert.refusal``); when it does not, a
``ConfigError`` names the authors' key as typed, the first refused on its own (``global_batch_size=0 is
refused: train.batch_size must be >= 1, got 0``).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any

from loopformer.config import ConfigError
from loopformer.config.strict import coerce, excerpt
from loopformer.convert import REFUSALS, converter, flat, refusal
from loopformer.convert.export import reference_state
from loopformer.convert.recursive import TRAIN_DEFAULTS

# the authors' configuration each translation starts from: their arch defaults (loopformer.convert.recursive /
# fprm), the sizes of their Sudoku-Extreme config (config/arch/*.yaml), their cfg_pretrain.yaml training keys
REFERENCE: dict[str, dict[str, Any]] = {
    "trm": {"arch": {"hidden_size": 512, "L_layers": 2, "H_layers": 0, "H_cycles": 3, "L_cycles": 6, "num_heads": 8,
                     "expansion": 4, "pos_encodings": "rope", "puzzle_emb_ndim": 512, "puzzle_emb_len": 16,
                     "halt_max_steps": 16, "halt_exploration_prob": 0.1, "mlp_t": False, "seq_len": 81,
                     "vocab_size": 11, "num_puzzle_identifiers": 1},
            "data_paths": ["data/sudoku-extreme-1k-aug-1000"], **TRAIN_DEFAULTS},
    "hrm": {"arch": {"hidden_size": 512, "H_layers": 4, "L_layers": 4, "H_cycles": 2, "L_cycles": 2, "num_heads": 8,
                     "expansion": 4, "pos_encodings": "rope", "puzzle_emb_ndim": 512, "halt_max_steps": 16,
                     "halt_exploration_prob": 0.1, "seq_len": 81, "vocab_size": 11, "num_puzzle_identifiers": 1},
            "data_paths": ["data/sudoku-extreme-1k-aug-1000"], **TRAIN_DEFAULTS},
    "fprm": {"arch": {"hidden_size": 512, "L_layers": 2, "num_heads": 8, "expansion": 4, "conv_type": "conv2d",
                      "conv_kernel_size": 3, "seq_len": 81, "vocab_size": 11, "num_puzzle_identifiers": 1,
                      "puzzle_emb_ndim": 512, "max_iter": 16, "max_iter_dist": "det", "max_iter_eval": 35000,
                      "alpha_1_init": 0.75, "alpha_2_init": 0.25, "init_std": 6.0},
             "data_paths": ["data/sudoku-extreme-1k-aug-1000"]},
}  # fmt: skip
# other values tried for a string key, to see what it moves when the user's value is the reference's
ALTERNATIVES: dict[str, tuple[Any, ...]] = {
    "pos_encodings": ("rope", "none"), "norm_type": ("pre-norm", "post-norm"), "conv_type": ("conv1d", "conv2d"),
    "loss_type": ("stablemax_cross_entropy", "softmax_cross_entropy"), "max_iter_dist": ("det", "expon"),
    "norm_placement": ("none", "output"),
    "data_paths": (["data/sudoku-extreme-1k-aug-1000"], ["data/maze-30x30-hard-1k"]),
}  # fmt: skip
# words of a command line that are the program, not settings
PROGRAM_WORDS = ("python", "python3", "pretrain.py", "torchrun", "evaluate.py", "train.py")


@dataclass
class Translation:
    system: str
    overrides: dict[str, Any] = field(default_factory=dict)  # loopformer dotted key -> value
    sources: dict[str, list[str]] = field(default_factory=dict)  # authors' key -> loopformer keys it moves
    unread: list[str] = field(default_factory=list)  # authors' keys the conversion does not read
    skipped: list[str] = field(default_factory=list)  # program words, Hydra's config-group choices
    recipe: str | None = None  # the shipped paper recipe of SYSTEM on the converted task

    def command(self) -> str:
        """The ``loopformer train`` command line of the translation."""
        args = " ".join(f"{k}={_yaml(v)}" for k, v in self.overrides.items())
        return f"loopformer train {self.recipe or 'RECIPE'} {args}".rstrip()


def _yaml(value: Any) -> str:
    import json

    text = json.dumps(value) if isinstance(value, list | dict | bool) or value is None else str(value)
    return text if not any(c in text for c in " []{},") else f"'{text}'"


def converted_config(system: str, ref: dict[str, Any]) -> dict[str, Any]:
    """``loopformer convert``'s run configuration for the authors' configuration ``ref``, flattened."""
    run = converter(system)(reference_state(system, ref), copy.deepcopy(ref)).run
    return flat(run)


def refused(system: str, ref: dict[str, Any]) -> str | None:
    """Why converting the authors' configuration ``ref`` is refused, by the key mapping (a value it cannot
    use) or by ``train``'s checks of the run configuration it gives; None when it goes through."""
    try:
        err = refusal(system, reference_state(system, ref), ref)
    except REFUSALS as error:  # the shapes of the authors' model cannot be built from these sizes
        err = error
    if err is None or isinstance(err, ConfigError):
        return None if err is None else str(err)
    return f"the {system} model cannot be built with it ({type(err).__name__}: {err})"


def _check_kind(key: str, value: Any, default: Any) -> None:
    """ConfigError naming ``key`` when ``value`` is not of the kind of the authors' default: true / false, or a
    number (finite where the default is an integer: a size, a count); ranges are train's checks."""
    where = f"{key}={excerpt(value)}: the authors' {key}"
    if isinstance(default, bool):
        coerce(value, bool, where)
    elif isinstance(default, int | float):
        number = coerce(value, float, where)
        if isinstance(default, int) and not math.isfinite(number):
            raise ConfigError(f"{where}: expected a finite number, got {excerpt(value)}")


def _set(ref: dict[str, Any], key: str, value: Any) -> None:
    node = ref
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value


def _get(ref: dict[str, Any], key: str) -> Any:
    node: Any = ref
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _other(key: str, value: Any) -> Any:
    """A value of ``key`` unlike ``value`` (to see what the key moves)."""
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return 2 * value + 1
    if isinstance(value, float):
        return 2 * value + 0.5
    options = ALTERNATIVES.get(key.split(".")[-1], ())
    return next((o for o in options if o != value), None)


def _number(value: Any) -> Any:
    """``"3e-4"`` (YAML 1.1 reads it as text, Python and Hydra as a number) -> 0.0003; anything else as is."""
    if isinstance(value, str):
        for kind in (int, float):
            try:
                return kind(value)
            except ValueError:
                pass
    return value


def recipe_for(system: str, overrides: dict[str, Any], base: dict[str, Any]) -> str | None:
    """The shipped paper recipe of ``system`` on the converted task (``paper_<task>_<system>``), if any."""
    from loopformer.config import RECIPE_DIR

    task = {"sudoku": "sudoku_extreme", "maze": "maze_hard", "arc": "arc1"}.get(str(base.get("data.task")))
    name = f"paper_{task}_{system}"
    return name if task and (RECIPE_DIR / f"{name}.yaml").is_file() else None


def parse_authors(words: list[str]) -> tuple[list[tuple[str, str, Any]], list[str]]:
    """Hydra-style words -> ([(mode '' | '+' | '++', key, value)], skipped words)."""
    from loopformer.config import parse_override

    parsed, skipped = [], []
    for word in words:
        if "=" not in word or word.split("=", 1)[0].strip() in ("arch", "data", "evaluators"):
            skipped.append(
                word
            )  # a program word or a Hydra config-group choice (arch=trm): SYSTEM decides it
            continue
        mode = "++" if word.startswith("++") else "+" if word.startswith("+") else ""
        parts, value = parse_override(word[len(mode) :])
        parsed.append((mode, ".".join(parts), _number(value)))
    return parsed, skipped


def translate(system: str, words: list[str]) -> Translation:
    """The loopformer overrides the authors' ``words`` amount to (see the module docstring)."""
    if system not in REFERENCE:
        raise KeyError(f"no translation for {system!r} (available: {', '.join(sorted(REFERENCE))})")
    parsed, skipped = parse_authors([w for w in words if w not in PROGRAM_WORDS])
    result = Translation(system, skipped=[w for w in words if w in PROGRAM_WORDS] + skipped)
    ref = copy.deepcopy(REFERENCE[system])
    for mode, key, value in parsed:
        if mode == "+" and _get(ref, key) is not None:
            raise ValueError(f"+{key}={excerpt(value)}: Hydra's + adds a key, but the authors' config already has {key} "
                             f"({excerpt(_get(ref, key))}); write it without + or with ++")  # fmt: skip
        _check_kind(key, value, _get(REFERENCE[system], key))
        _set(ref, key, value)
    if (why := refused(system, ref)) is not None:  # named by the key typed: the first refused on its own
        for _, key, value in parsed:
            alone = copy.deepcopy(REFERENCE[system])
            _set(alone, key, value)
            if (reason := refused(system, alone)) is not None:
                raise ConfigError(f"{key}={excerpt(value)} is refused: {reason}")
        typed = " ".join(f"{key}={excerpt(value)}" for _, key, value in parsed)
        raise ConfigError(f"{typed or system}: refused together: {why}")
    base = converted_config(system, ref)
    result.recipe = recipe_for(system, result.overrides, base)
    for _, key, value in parsed:
        probe = copy.deepcopy(ref)
        default = _get(REFERENCE[system], key)
        other = default if default is not None and default != value else _other(key, value)
        if other is None:
            result.unread.append(key)
            continue
        _set(probe, key, other)
        try:
            moved = converted_config(system, probe)
        except (ValueError, KeyError, NotImplementedError, RuntimeError):
            moved = {}
        keys = sorted(k for k in set(base) | set(moved) if base.get(k) != moved.get(k) and k in base)
        keys = [k for k in keys if k not in ("model.name",)]
        if not keys:
            result.unread.append(key)
            continue
        result.sources[key] = keys
        for k in keys:
            result.overrides[k] = base[k]
    return result


__all__ = ["REFERENCE", "Translation", "converted_config", "translate"]
