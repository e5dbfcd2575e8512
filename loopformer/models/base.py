"""The model contract: a model defines embed / init_state / step / readout, the engine loops.

``LoopedModel.forward`` is the only place a model meets the loop engine; no model writes its
own iteration loop. ``ModelConfig`` holds the fields every family shares; each family's
config dataclass extends it; ``config_from_dict`` builds one from plain values (JSON), refusing unknown
fields with the nearest name.

A model also speaks the Hugging Face idiom (the API of ``huggingface_hub.PyTorchModelHubMixin``, written
here so that importing a model never imports huggingface_hub): ``model.save_pretrained(folder)`` writes
``config.json`` (the class and its config) and ``model.safetensors``; ``FPRM.from_pretrained(folder or
owner/name)`` builds the model and loads them strictly; ``model.push_to_hub(owner/name)`` uploads them with
a model card. A trained run (a checkpoint with its run configuration, ``loopformer push``) loads with
``loopformer.load`` instead.
"""

from __future__ import annotations

import dataclasses
import difflib
import tempfile
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from loopformer.files import atomic_path, atomic_write_json, hub_library, read_json, resolve_source
from loopformer.loop import LoopConfig, LoopResult, run_loop

PRETRAINED_FILES = ("config.json", "model.safetensors")  # what save_pretrained writes and from_pretrained reads


@dataclass
class ModelConfig:
    """Fields shared by every model family."""

    vocab_size: int = 16
    seq_len: int = 81  # input length; positions beyond it are allowed when rope / no positions
    d_model: int = 128
    n_heads: int = 4
    n_layers: int = 2  # layers per looped block (or total for the plain transformer)
    expansion: float = 4.0  # SwiGLU width factor
    causal: bool = False
    rope: bool = True
    # a learned absolute position table added to the token embeddings (TRM / HRM ``pos_encodings: learned``);
    # independent of ``rope`` (set rope=false for learned positions only); needs inputs of length seq_len
    learned_positions: bool = False
    grid: tuple[int, int] | None = None  # token layout for 2-D convolutions (e.g. (9, 9) for Sudoku)
    num_puzzle_ids: int = 0  # size of a per-puzzle embedding table (TRM/HRM ARC), 0 = none
    puzzle_emb_len: int = 0  # tokens the puzzle embedding occupies (prepended); 0 = none
    tie_embeddings: bool = False
    q_head: bool = False  # a halting / Q logit read from the state (TRM, HRM, FPRM)
    loop: LoopConfig = field(default_factory=LoopConfig)  # the model's default loop (train and eval)

    def replace(self, **changes: object) -> ModelConfig:
        return dataclasses.replace(self, **changes)


def suggest(name: str, options: Any) -> str:
    """"; did you mean 'x'?" for the option nearest to ``name``, or nothing."""
    close = difflib.get_close_matches(name, list(options), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _typed(hint: Any, value: Any) -> Any:
    """``value`` as JSON holds it (a table, a list) turned into the dataclass / tuple ``hint`` names."""
    for option in (hint, *typing.get_args(hint)):  # X | None: try each member
        if isinstance(value, Mapping) and dataclasses.is_dataclass(option):
            return option(**value)
        if isinstance(value, list) and typing.get_origin(option) is tuple:
            return tuple(value)
    return value


def config_from_dict(config_cls: type[ModelConfig], fields: Mapping[str, Any], where: str) -> ModelConfig:
    """``config_cls`` with ``fields`` set; a table becomes its field's dataclass (``loop``: a ``LoopConfig``,
    validated as it is built), a list a tuple; a field the class lacks is a KeyError naming ``where`` and the
    nearest field."""
    hints = typing.get_type_hints(config_cls)
    valid = {f.name for f in dataclasses.fields(config_cls)}
    for key in fields:
        if key not in valid:
            raise KeyError(f"{where} has no config field {key!r}{suggest(key, valid)}")
    return config_cls(**{key: _typed(hints[key], value) for key, value in fields.items()})


@dataclass
class ModelOutput:
    logits: Tensor  # [B, T, V]
    state: Tensor  # final state, the trainer's carry (detach before reusing it)
    loop: LoopResult | None  # the engine's trace (steps, residuals, converged...)
    q_logits: Tensor | None = None  # [B] halting / Q logit
    aux_loss: Tensor | None = None  # scalar added to the task loss (e.g. ACT ponder cost)


class LoopedModel(nn.Module):
    """Base class: subclasses implement embed, init_state, step and readout."""

    config: ModelConfig

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config

    # -- the four functions a family defines -------------------------------------------------
    def embed(self, inputs: Tensor, puzzle_ids: Tensor | None = None) -> tuple[Tensor, ...]:
        """Input tokens [B, T] -> batch-first context tensors passed to every step."""
        raise NotImplementedError

    def init_state(self, ctx: tuple[Tensor, ...], generator: torch.Generator | None = None) -> Tensor:
        """The initial iterate z0 [B, ...] for a fresh sample."""
        raise NotImplementedError

    def step(self, z: Tensor, *ctx: Tensor) -> Tensor:
        """One application of the looped body."""
        raise NotImplementedError

    def readout(self, z: Tensor, *ctx: Tensor) -> Tensor:
        """State -> logits [B, T, V] (also used by the logit lens on intermediate states)."""
        raise NotImplementedError

    # -- optional heads -------------------------------------------------------------------------
    def q_head(self, z: Tensor, *ctx: Tensor) -> Tensor | None:
        """Halting / Q logit [B] (TRM, HRM, FPRM); None when the model has none."""
        return None

    def halting_readout(self, z: Tensor, *ctx: Tensor) -> Tensor:
        """The logits the KL + entropy halting rule reads (default: ``readout``, every position).

        A model may restrict them, e.g. to the answer position (``RecurrentConfig.halt_position``)."""
        return self.readout(z, *ctx)

    def halt_prob(self, z: Tensor, *ctx: Tensor) -> Tensor:
        """ACT halting probability [B] or [B, T]; only models trained with ACT define it."""
        raise NotImplementedError(f"{type(self).__name__} has no ACT halting unit")

    def aux_loss(self, result: LoopResult) -> Tensor | None:
        """Extra training loss from the loop (e.g. ponder cost); None by default."""
        return None

    def training_draws(self, inputs: Tensor, generator: torch.Generator | None) -> dict[str, Tensor]:
        """The random tensors a training forward on ``inputs`` draws from its generator after ``init_state``, drawn
        ahead: ``forward``'s keyword arguments for a compiled step, which takes no generator (none by default)."""
        return {}

    # -- the engine call --------------------------------------------------------------------------
    def forward(
        self,
        inputs: Tensor,
        loop: LoopConfig | None = None,
        state: Tensor | None = None,
        puzzle_ids: Tensor | None = None,
        callback: Callable[[int, Tensor, Tensor], None] | None = None,
        generator: torch.Generator | None = None,
        solver_state: dict[str, Tensor] | None = None,
    ) -> ModelOutput:
        """One engine call from ``state`` (or ``init_state``); ``solver_state`` continues the solver's
        per-sample state of a previous call (``ModelOutput.loop.stats``, see ``run_loop``)."""
        cfg = loop if loop is not None else self.config.loop
        ctx = self.embed(inputs, puzzle_ids)
        z0 = state if state is not None else self.init_state(ctx, generator)
        own_halting_readout = type(self).halting_readout is not LoopedModel.halting_readout
        res = run_loop(
            self.step,
            z0,
            cfg,
            ctx=ctx,
            readout=self.halting_readout if cfg.halting == "kl_entropy" else None,
            halt_fn=self.halt_prob if cfg.halting == "act" else None,
            callback=callback,
            solver_state=solver_state,
        )
        reuse = res.logits is not None and not own_halting_readout
        logits = res.logits if reuse else self.readout(res.state, *ctx)
        return ModelOutput(
            logits=logits,
            state=res.state,
            loop=res,
            q_logits=self.q_head(res.state, *ctx),
            aux_loss=self.aux_loss(res),
        )

    def blocks_per_step(self) -> float:
        """Transformer blocks one loop step applies to a sample: the unit of test-time compute that ``compare``,
        ``eval`` reports and the head-to-head count (``evaluate`` multiplies each forward call's loop steps by
        it). A step of a looped stack of ``n_layers`` blocks by default; a model whose step applies its net
        more than once says so, and one whose step varies (an inner solve) reports what its latest forward
        call measured."""
        return int(self.config.n_layers)

    # -- the Hugging Face idiom ------------------------------------------------------------------------
    def save_pretrained(self, folder: str | Path) -> Path:
        """Write ``config.json`` (this class's name and its config) and ``model.safetensors`` (the weights, a
        tied tensor once) into ``folder``, each file atomically. A ``config.json`` that ``save_pretrained`` did
        not write (a run's checkpoint) is never replaced: ValueError."""
        from safetensors.torch import save_model

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        if (folder / "config.json").exists() and _pretrained_class(folder / "config.json") is None:
            raise ValueError(f"{folder} holds a config.json that save_pretrained did not write; choose another folder")
        with atomic_path(folder / "model.safetensors", root=folder) as tmp:
            save_model(getattr(self, "_orig_mod", self), str(tmp), metadata={"format": "pt"})
        config = {"model_class": type(self).__name__, "config": dataclasses.asdict(self.config)}
        atomic_write_json(folder / "config.json", config, root=folder, indent=2)
        return folder

    @classmethod
    def from_pretrained(cls, source: str | Path, *, revision: str | None = None, cache_dir: str | Path | None = None,
                        device: str | torch.device = "cpu") -> LoopedModel:  # fmt: skip
        """The model ``save_pretrained`` / ``push_to_hub`` wrote, from a local folder or a hub id (``owner/name``,
        ``@revision`` or ``revision=``; downloaded and cached by huggingface_hub), built from its config and
        loaded strictly, in eval mode. Called on the class that wrote it (``FPRM.from_pretrained``)."""
        from safetensors.torch import load_model

        if revision is not None:
            source = f"{source}@{revision}"
        folder = resolve_source(source, list(PRETRAINED_FILES), cache_dir, what="pretrained model folder")
        path = folder / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{folder}: no config.json (save_pretrained writes one)")
        saved = _pretrained_class(path)
        if saved is None:
            raise ValueError(f"{path} is not a save_pretrained config (a trained run's checkpoint loads with "
                             f"loopformer.load({str(source)!r}))")  # fmt: skip
        if saved != cls.__name__:
            raise TypeError(f"{folder} holds a {saved}; load it with {saved}.from_pretrained, not {cls.__name__}'s")
        config_cls = typing.get_type_hints(cls.__init__).get("config")
        if not (isinstance(config_cls, type) and issubclass(config_cls, ModelConfig)):
            raise TypeError(f"{cls.__name__}.__init__ does not take a config: ModelConfig")
        try:
            config = config_from_dict(config_cls, read_json(path)["config"], f"{path}: {cls.__name__}")
        except (TypeError, ValueError) as err:
            raise ValueError(f"{path}: {err}") from None
        model = cls(config)
        load_model(model, str(folder / "model.safetensors"), strict=True, device=str(device))
        return model.to(device).eval()

    def push_to_hub(self, repo_id: str, *, private: bool = False, revision: str | None = None,
                    commit_message: str | None = None, token: str | None = None, api: Any = None) -> str:  # fmt: skip
        """Upload ``save_pretrained``'s files and a model card (``huggingface_hub.ModelCard``) to ``repo_id``
        (created when missing); returns the commit id. ``api``: an ``HfApi``-like object (default
        ``HfApi(token=token)``)."""
        hub = hub_library()
        api = api if api is not None else hub.HfApi(token=token)
        name = type(self).__name__
        data = hub.ModelCardData(library_name="loopformer", tags=["loopformer", "looped-transformer", name.lower()])
        card = hub.ModelCard.from_template(data, model_id=repo_id, model_description=(
            f"A loopformer {name} ({self.num_parameters():,} parameters). Load it with "
            f"`{name}.from_pretrained({repo_id!r})` (`from loopformer.models.{type(self).__module__.rsplit('.', 1)[-1]}"
            f" import {name}`)."))  # fmt: skip
        with tempfile.TemporaryDirectory() as tmp:
            self.save_pretrained(tmp)
            card.save(str(Path(tmp) / "README.md"))
            api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
            commit = api.upload_folder(folder_path=tmp, repo_id=repo_id, repo_type="model", revision=revision,
                                       commit_message=commit_message or f"loopformer: {name}")  # fmt: skip
        return str(getattr(commit, "oid", commit) or "")

    def num_parameters(self, exclude_puzzle_embedding: bool = True) -> int:
        """Parameter count; the per-puzzle embedding table is excluded by default (as the papers count)."""
        skip = {id(p) for n, p in self.named_parameters() if exclude_puzzle_embedding and "puzzle_emb" in n}
        return sum(p.numel() for p in self.parameters() if id(p) not in skip)


def _pretrained_class(path: Path) -> str | None:
    """The class name a ``save_pretrained`` config.json records, None for any other config.json."""
    data = read_json(path)
    if isinstance(data, dict) and isinstance(data.get("model_class"), str) and isinstance(data.get("config"), dict):
        return data["model_class"]
    return None
