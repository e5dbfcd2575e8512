"""``loopformer convert``: an official checkpoint of the authors' code -> a loopformer run folder.

One key mapping per system (``loopformer/convert/<system>.py``; TRM and HRM share ``recursive.py``) is
listed in ``CONVERTERS``. A mapping is a function ``convert(state, ref_config) -> Converted``: ``state`` is the
reference's flat state dict (tensors only), ``ref_config`` the reference's configuration (the YAML /
JSON its training script saved next to the checkpoint, ``{}`` when none is given). It returns the
loopformer run configuration (a nested dict, as a recipe) and the loopformer state dict. Every key of
``state`` must be used exactly once (``KeyMap`` tracks this): unknown keys are an error naming them,
and ``check_weights`` names loopformer parameters the mapping did not fill. ``CONVERTERS`` also names the
files the reference's training script writes beside a checkpoint (TRM and HRM: ``all_config.yaml``; the
Attractor: ``config.json`` / ``model_config.json`` / ``all_config.yaml``): the first found is read when no
``--config`` is given. With no configuration at all the
conversion is refused unless ``allow_defaults`` (``--allow-defaults``): the reference's defaults rarely
match a checkpoint (TRM ``mlp_t``: an evaluation loop of 48 steps instead of 12). ``--set`` overrides
are parsed before the mapping runs and are visible to it (``given``), so the ``--set model.seq_len=N`` /
``--set data.task=...`` an error suggests is what lets the conversion through. A checkpoint whose floating
tensors are all float64 gives a float64 model (initial states included): nothing is rounded to float32.

Checkpoints are read with ``torch.load(weights_only=True)`` (no arbitrary unpickling) or as
safetensors; the run folder is written by ``loopformer.runs.checkpoint.save_checkpoint`` (step 0), so
``loopformer eval``, ``solve`` and the analyses accept it.
"""

from __future__ import annotations

import copy
import importlib
import json
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from loopformer.config import ConfigError
from loopformer.config.strict import excerpt
from loopformer.files import atomic_write_text, read_json, regular_file
from loopformer.numerics import NumericalFaultError, nonfinite_names
from loopformer.runs.checkpoint import CheckpointError, check_storage

# system name -> (``module:function`` of its ``convert(state, ref_config) -> Converted``, the files holding the
# reference's configuration that its training script writes beside a checkpoint)
CONVERTERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "fprm": ("loopformer.convert.fprm:convert", ()),
    "trm": ("loopformer.convert.recursive:convert_trm", ("all_config.yaml",)),
    "hrm": ("loopformer.convert.recursive:convert_hrm", ("all_config.yaml",)),
    "ltg": ("loopformer.convert.ltg:convert", ()),
    # the Attractor LM's launch config / model config, TRM-DEQ's model_config.json, or a TRM-style all_config.yaml
    "attractor": ("loopformer.convert.attractor:convert", ("config.json", "model_config.json", "all_config.yaml")),
}


@dataclass
class Converted:
    run: dict[str, Any]  # loopformer RunConfig as a nested dict (a recipe)
    weights: dict[str, Tensor]  # loopformer state dict
    notes: list[str] = field(default_factory=list)  # what the mapping assumed (printed by the CLI)
    sources: dict[str, str] = field(default_factory=dict)  # loopformer key -> reference key it came from
    # loopformer key -> what the mapping applied to the reference tensor (absent: copied as it is); ``export``
    # runs the mapping backwards through these
    transforms: dict[str, Callable[[Tensor], Tensor]] = field(default_factory=dict)


class KeyMap:
    """The reference state dict, consumed key by key; leftovers are an error naming them.

    ``put(dst, src, transform)`` takes ``src``, stores ``transform(tensor)`` as loopformer key ``dst``
    in ``out`` and records where it came from in ``sources`` (and the transform in ``transforms``).
    """

    def __init__(self, state: dict[str, Tensor], source: str) -> None:
        self.state, self.source, self.used = state, source, set()
        self.out: dict[str, Tensor] = {}
        self.sources: dict[str, str] = {}
        self.transforms: dict[str, Callable[[Tensor], Tensor]] = {}

    def put(self, dst: str, src: str, transform: Callable[[Tensor], Tensor] | None = None) -> None:
        t = self.take(src)
        self.out[dst] = transform(t) if transform is not None else t
        self.sources[dst] = src
        if transform is not None:
            self.transforms[dst] = transform

    def converted(self, run: dict[str, Any], notes: Iterable[str] = ()) -> Converted:
        """The conversion: ``run`` and the weights put so far, with where each came from and how."""
        return Converted(run, self.out, list(notes), self.sources, self.transforms)

    def has(self, key: str) -> bool:
        return key in self.state

    def peek(self, key: str) -> Tensor:
        """The tensor ``key`` without using it up (to read a shape); CheckpointError naming it when missing."""
        if key not in self.state:
            raise CheckpointError(f"{self.source}: missing key {key!r} (keys present: {self.sample()})")
        return self.state[key]

    def take(self, key: str) -> Tensor:
        if key not in self.state:
            raise CheckpointError(f"{self.source}: missing key {key!r} (keys present: {self.sample()})")
        if key in self.used:
            raise CheckpointError(f"{self.source}: key {key!r} used twice by the mapping")
        self.used.add(key)
        return self.state[key]

    def keys_with(self, prefix: str) -> list[str]:
        return sorted(k for k in self.state if k.startswith(prefix))

    def sample(self, n: int = 8) -> str:
        keys = sorted(self.state)
        return ", ".join(keys[:n]) + (" ..." if len(keys) > n else "")

    def finish(self, ignore: Iterable[str] = ()) -> None:
        skip = set(ignore)
        left = sorted(k for k in self.state if k not in self.used and k not in skip)
        if left:
            raise CheckpointError(
                f"{self.source}: unknown keys the {len(left)}-key mapping does not use: {left[:12]}"
                f"{' ...' if len(left) > 12 else ''}"
            )


def strip_prefixes(state: dict[str, Tensor], prefixes: Iterable[str]) -> dict[str, Tensor]:
    """Remove any of ``prefixes`` (applied in order, repeatedly) from every key (``_orig_mod.``...)."""
    out = {}
    for key, value in state.items():
        changed = True
        while changed:
            changed = False
            for p in prefixes:
                if key.startswith(p):
                    key, changed = key[len(p) :], True
        out[key] = value
    return out


def load_state_dict(path: str | Path) -> dict[str, Tensor]:
    """A flat ``{name: tensor}`` from a torch checkpoint (``weights_only=True``, memory-mapped: a tensor is read
    when used, and each must hold the bytes its shape needs: ``check_storage``) or a safetensors file."""
    path = regular_file(path, CheckpointError, "checkpoint")
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except (SafetensorError, OSError) as err:
            raise CheckpointError(f"{path} is not a readable safetensors file: {err}") from None
    try:
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as err:  # a file of torch's legacy (not zip) format cannot be memory-mapped
            if "mmap" not in str(err):
                raise
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises UnpicklingError, RuntimeError, EOFError...: one clear message
        raise CheckpointError(
            f"{path} is not a PyTorch state dict loadable with weights_only=True "
            f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
        ) from None
    # {"model": {...}} / {"state_dict": {...}} / LTG's {"model_state_dict": {...}, "epoch": ..., ...} wrappers
    for wrapper in ("state_dict", "model", "model_state_dict"):
        if isinstance(obj, dict) and isinstance(obj.get(wrapper), dict):
            obj = obj[wrapper]
    if not isinstance(obj, dict) or not all(
        isinstance(k, str) and isinstance(v, Tensor) for k, v in obj.items()
    ):
        raise CheckpointError(f"{path} does not hold a flat state dict of tensors")
    check_storage(obj, str(path))
    return dict(obj)


def read_reference_config(path: str | Path | None) -> dict[str, Any]:
    """The reference's configuration file (YAML or JSON) as a dict; ``{}`` without one."""
    if path is None:
        return {}
    from loopformer.config.strict import load_yaml, read_text

    path = Path(path)
    what = "reference config"
    data = read_json(path, ConfigError) if path.suffix == ".json" else load_yaml(read_text(path, what), f"{what} {path}")
    if not isinstance(data, dict):
        raise ValueError(f"reference config {path} must be a mapping, got {type(data).__name__}")
    return data


# the loopformer config values given with ``--set`` (nested, as a recipe), visible to the key mappings
# while they run: a mapping that cannot tell a value (``model.seq_len``, ``data.task``) reads it here,
# so the ``--set`` its error message suggests is what makes the conversion go through
_GIVEN: ContextVar[dict[str, Any] | None] = ContextVar("loopformer_convert_given", default=None)


def given(key: str) -> Any:
    """The value of the dotted loopformer config ``key`` given with ``--set`` (None when not given)."""
    node: Any = _GIVEN.get() or {}
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def parse_given(overrides: Iterable[str]) -> dict[str, Any]:
    """``--set`` overrides as a nested dict (ConfigError naming a malformed one)."""
    from loopformer.config import apply_overrides

    return apply_overrides({}, list(overrides))


# what a key mapping, or train's checks of the run configuration it gives, raise for a value they refuse
REFUSALS = (ValueError, TypeError, ArithmeticError, RuntimeError, KeyError, NotImplementedError)


def refusal(system: str, state: dict[str, Tensor], ref: dict[str, Any], overrides: Iterable[str] = ()) -> Exception | None:
    """Why converting the authors' configuration ``ref`` with ``state`` (meta tensors suffice) is refused, by
    the key mapping or by ``train``'s checks of the run configuration it gives (``build_config``); None when it
    goes through. ``translate`` checks every value it writes so."""
    from loopformer.config import build_config

    try:
        build_config(converter(system)(state, copy.deepcopy(ref)).run, list(overrides))
    except REFUSALS as err:
        return err
    return None


def refused_key(system: str, state: dict[str, Tensor], ref: dict[str, Any], overrides: Iterable[str] = ()) -> str | None:
    """The dotted key of the authors' configuration ``ref`` whose value the conversion refuses: the first
    without which (the mapping's default in its place) it goes through; None when there is none."""
    meta = {k: v.to("meta") for k, v in state.items()}
    for key in flat(ref):
        probe = copy.deepcopy(ref)
        *parents, last = key.split(".")
        node = probe
        for part in parents:
            node = node[part]
        del node[last]
        if refusal(system, meta, probe, overrides) is None:
            return key
    return None


def flat(table: Any, prefix: str = "") -> dict[str, Any]:
    """A nested table's leaves by dotted key (``{"arch": {"H_cycles": 3}}`` -> ``{"arch.H_cycles": 3}``)."""
    if not isinstance(table, dict):
        return {prefix: table}
    out: dict[str, Any] = {}
    for k, v in table.items():
        out.update(flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def converter(system: str) -> Callable[[dict[str, Tensor], dict[str, Any]], Converted]:
    if system not in CONVERTERS:
        raise KeyError(f"no converter for {system!r} (known: {', '.join(sorted(CONVERTERS))})")
    module, function = CONVERTERS[system][0].split(":")
    return getattr(importlib.import_module(module), function)


def find_config(system: str, checkpoint: str | Path) -> Path | None:
    """The first of ``system``'s configuration files beside ``checkpoint`` (None when there is none)."""
    folder = Path(checkpoint).resolve().parent
    return next((folder / n for n in CONVERTERS[system][1] if (folder / n).is_file()), None)


def build_converted(
    converted: Converted, overrides: Iterable[str] = (), dtype: torch.dtype | None = None
) -> tuple[Any, Any]:
    """(RunConfig, model with the converted weights loaded); CheckpointError naming missing keys.
    ``dtype``: convert the model first (e.g. float64 for the parity tests)."""
    from loopformer.config import build_config
    from loopformer.models.registry import build_model
    from loopformer.runs.checkpoint import check_weights

    config = build_config(converted.run, list(overrides))
    model = build_model(config.model.name, config=config.model_config())
    floats = [v.dtype for v in converted.weights.values() if v.is_floating_point()]
    if dtype is None and floats and all(d == torch.float64 for d in floats):
        dtype = torch.float64  # a float64 checkpoint stays float64 (its initial states included)
    if dtype is not None:
        model = model.to(dtype)
    weights = {
        k: v.to(model.state_dict()[k].dtype) if k in model.state_dict() else v
        for k, v in converted.weights.items()
    }
    check_weights(weights, model, f"converted {config.model.name} weights")
    model.load_state_dict(weights, strict=True)
    return config, model


def restore_experiment(converted: Converted, ref: dict[str, Any]) -> None:
    """A checkpoint ``loopformer export`` wrote carries its run's experiment (``loopformer_data.run``: every config
    section but the run folder, and which weights): the converted run takes it whole, so its data spec, held-out
    set, evaluation protocol and training are the original's, with the model fields the weights give over the
    original's. Nothing changes for the authors' own checkpoints."""
    from loopformer.config.recipes import merge

    data = ref.get("loopformer_data")
    record = data.get("run") if isinstance(data, dict) else None
    if not isinstance(record, dict) or not isinstance(record.get("config"), dict):
        return
    converted.run = merge(record["config"], {"model": converted.run["model"]}, "loopformer_data.run")
    converted.notes.append(f"the experiment of {record.get('checkpoint') or 'the exported run'} restored: its data, "
                           f"held-out set, evaluation and training settings ({record.get('weights', '?')} weights)")  # fmt: skip


def convert_checkpoint(
    system: str,
    checkpoint: str | Path,
    out_dir: str | Path,
    config_file: str | Path | None = None,
    overrides: Iterable[str] = (),
    write_to: str | Path | None = None,
    allow_defaults: bool = False,
) -> tuple[Path, Converted]:
    """Convert ``checkpoint`` of ``system`` into the run folder ``out_dir``; returns (checkpoint folder, Converted).

    ``write_to``: the folder the files go to when it is not ``out_dir`` (the staging folder of
    ``loopformer convert``, swapped into ``out_dir`` afterwards); the config still names ``out_dir``.
    ``overrides`` (``--set``) are parsed first and visible to the mapping (``given``). Without
    ``config_file`` (nor one found beside the checkpoint) the conversion is refused
    (``CheckpointError``) unless ``allow_defaults``.
    """
    from loopformer.config import save_config
    from loopformer.runs.checkpoint import save_checkpoint

    fn = converter(system)
    overrides = list(overrides)
    given_values = parse_given(overrides)  # before the mapping: its errors suggest --set KEY=VALUE
    state = load_state_dict(checkpoint)
    bad = nonfinite_names(state)
    if bad:  # a run folder of NaN weights would be refused by eval / solve anyway: never write one
        more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
        raise NumericalFaultError(
            f"{checkpoint}: tensor {bad[0]!r}{more} holds NaN or infinite values (the training diverged?); "
            f"refusing to convert it"
        )
    if config_file is None:
        config_file = find_config(system, checkpoint)
    if config_file is None and not allow_defaults:
        beside = CONVERTERS[system][1]
        looked = f" (looked for {', '.join(beside)} beside it)" if beside else ""
        raise CheckpointError(
            f"convert {system}: no reference configuration for {checkpoint}{looked}; without it the "
            f"architecture, loop and training settings would be the reference's defaults, which differ from "
            f"most checkpoints' (e.g. TRM's evaluation loop length). Pass --config FILE (the training "
            f"script's config), or --allow-defaults to convert with the defaults (listed in the notes)"
        )
    ref = read_reference_config(config_file)
    token = _GIVEN.set(given_values)
    try:
        try:
            converted = fn(state, copy.deepcopy(ref))
            restore_experiment(converted, ref)  # the run's data, held-out set and protocol, where export kept them
            converted.run["out_dir"] = str(out_dir)
            config, model = build_converted(converted, overrides)
        except CheckpointError as err:  # the mapping names the system ("TRM checkpoint"): name the file too
            raise CheckpointError(f"{checkpoint}: {err}") from None
        except REFUSALS as err:  # the value refused, by the name the reference's config file gives it
            key = None if config_file is None else refused_key(system, state, ref, overrides)
            if key is None:
                raise
            value = excerpt(flat(ref)[key])
            raise ConfigError(f"{config_file}: {key}: {value} is refused ({err})") from None
    except (CheckpointError, ValueError, NotImplementedError) as err:
        if config_file is not None:
            raise
        # a setting the mapping refuses is then the reference's default, not the checkpoint's: say so
        raise CheckpointError(
            f"{err} (converted without a reference configuration, so this is the reference's default "
            f"setting, not necessarily the checkpoint's: pass --config FILE)"
        ) from None
    finally:
        _GIVEN.reset(token)
    if config_file is None:
        converted.notes.append(f"no reference config: the {system} reference's defaults were assumed (--allow-defaults)")
    out = Path(out_dir) if write_to is None else Path(write_to)
    out.mkdir(parents=True, exist_ok=True)
    save_config(config, out)
    folder = save_checkpoint(out / "checkpoints", 0, model, config)
    atomic_write_text(
        out / "converted.json",
        json.dumps(
            {
                "system": system,
                "source": str(checkpoint),
                "config": None if config_file is None else str(config_file),
                "notes": converted.notes,
            },
            indent=1,
        )
        + "\n",
        root=out,
    )
    return folder, converted
