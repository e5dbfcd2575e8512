"""Export parity: loopformer runs written by ``loopformer export`` and run by the authors' own code.

    python tools/parity/export_authors.py --ref /path/to/TinyRecursiveModels [--out DIR] [--check]
    python tools/parity/export_authors.py --ref /path/to/HRM [--out DIR] [--check]

The checkout names the system (SamsungSAILMontreal/TinyRecursiveModels: TRM, sapientinc/HRM: HRM). In a
temporary working folder (relative paths, so a rerun writes the same bytes):

1. ``loopformer data generate sudoku --format hrm`` writes a 4x4 Sudoku set in the authors' folder format
   (``data/sudoku4``: 256 training and 50 test puzzles of 1-5 blanks, one blank puzzle identifier);
2. ``loopformer train`` trains a tiny run on it on the CPU (float32, one thread, 600 steps: about half the
   test puzzles solved, the Q head halting on some): ``export_trm``, the CPU recipe ``sudoku4_trm`` shrunk,
   without a puzzle embedding as every CPU TRM recipe; ``export_trm_puzzle``, the same with TRM's puzzle
   tokens (one identifier, two tokens of d_model); ``export_hrm``, an HRM with one puzzle token (HRM's
   layout: its ``create_model`` hands the table to its sign-SGD) and ``model.l_layers`` left at its
   default 0 (= n_layers);
3. ``loopformer export SYSTEM runs/<name> -o checkpoints/<name>/step_600`` writes the checkpoint and
   ``all_config.yaml``;
4. the authors' code does what their scripts do to build, load and evaluate it: ``PretrainConfig(**yaml)``
   of ``all_config.yaml`` (HRM's ``evaluate.py``; TRM's ``pretrain.py`` with ``load_checkpoint=PATH``),
   ``create_dataloader`` for the train and test splits of the data path, ``init_train_state`` (their
   ``create_model``: model class, ``ACTLossHead``, ``torch.compile``, and TRM's ``load_checkpoint``), HRM's
   ``evaluate.py`` load (``load_state_dict(..., assign=True)``, strict), then their ``evaluate`` loop on the
   test loader: ``initial_carry`` and loss-head calls until ``all_finish`` (``halt_max_steps`` = 8 steps).

Written per name: ``<name>/step_600`` and ``<name>/all_config.yaml`` (the export as ``loopformer export``
wrote it); ``<name>.safetensors``: the test puzzles as their loader yields them (``batch.*``) and, per step,
their ``authors.logits`` [S, N, T, V], ``authors.q_halt`` / ``authors.q_continue`` [S, N], their carry's
``authors.halted`` and the Q head's halting decision ``authors.halt`` (TRM ``q_halt > 0``, no_ACT_continue;
HRM ``q_halt > q_continue``); ``<name>.json``: the fields their ``PretrainConfig`` requires, the keys their
``create_model`` passes beside ``arch`` (so ``arch`` must not hold them), their model config's required
fields, how the load went, the largest difference to the loopformer run's own forward, the substitutions.

Substitutions (CPU; each fixture's ``substitutions``): flash-attn (HRM) -> SDPA; ``adam_atan2`` (a CUDA
kernel) -> its formula in a torch optimizer (``create_model`` builds it, nothing steps it); ``wandb`` /
``coolname`` / ``argdantic`` placeholders (imported, unused); ``torch.device("cuda")`` and
``map_location="cuda"`` on the CPU; ``torch.compile`` kept (its ``_orig_mod.`` keys), TorchDynamo disabled.
``tests/test_export_authors.py`` reads the fixtures without the authors' code.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from common import main, stub_module
from recursive import adam_atan2_step, install_stubs

from loopformer.convert.fixtures import save_fixture

STEPS = 600  # training steps of each tiny run: enough that its Q head halts on some test puzzles
N_TEST = 50  # test puzzles run through the authors' evaluation
DATA = "data/sudoku4"
GENERATE = ["-t", "min_blanks=1", "-t", "max_blanks=5"]  # easy puzzles: about half solved after STEPS
TRAIN = [f"data.train_path={DATA}", f"data.eval_path={DATA}", "data.train_size=0", "data.eval_size=0",
         f"train.steps={STEPS}", "train.batch_size=16", "train.warmup_steps=5", "train.max_segments=8",
         "train.eval_every=0", "train.checkpoint_every=0", "train.log_every=20", "train.progress=false",
         "train.threads=1", "device=cpu", "seed=0"]  # fmt: skip
SMALL = ["model.d_model=32", "model.n_heads=2", "model.loop.max_steps=2"]
PUZZLE = ["model.num_puzzle_ids=1", "model.puzzle_emb_dim=-1"]  # one identifier, a table d_model wide
RUNS: dict[str, dict[str, tuple[str, list[str]]]] = {
    "trm": {
        "export_trm": ("sudoku4_trm", [*SMALL, "model.n_inner=2"]),
        "export_trm_puzzle": ("sudoku4_trm", [*SMALL, "model.n_inner=2", *PUZZLE, "model.puzzle_emb_len=2"]),
    },
    "hrm": {  # no model.l_layers: its default 0 (= n_layers)
        "export_hrm": ("sudoku4_trm", ["model.name=hrm", "~model.n_inner", *SMALL, "model.n_layers=2",
                                       "model.l_cycles=2", *PUZZLE, "model.puzzle_emb_len=1",
                                       "train.q_learning=true"]),  # fmt: skip
    },
}
SUBSTITUTIONS = [
    "adam_atan2.AdamATan2 (a CUDA kernel) replaced by a torch.optim.Optimizer with its formula "
    "(tools/parity/recursive.py adam_atan2_step); create_model builds it, nothing here steps it",
    "wandb and coolname (pretrain.py) and argdantic (TRM puzzle_dataset.py): placeholder modules, imported "
    "and never used to build, load or evaluate",
    "CUDA -> CPU: pretrain.py's torch.device('cuda') and torch.load(map_location='cuda') (and evaluate.py's) "
    "run on the CPU; the DataLoader's pin_memory has no GPU to pin to",
    "data: TRM's PuzzleDatasetMetadata requires total_puzzles, which the HRM dataset.json that loopformer "
    "data generate --format hrm writes lacks: added (the number of puzzles) before training",
    "torch.compile(model) kept (the model and its _orig_mod. keys as compiled), TorchDynamo disabled: "
    "it runs eagerly",
]
FLASH = "flash_attn_func replaced by F.scaled_dot_product_attention (HRM models/layers.py; TRM uses SDPA)"


def system_of(root: Path) -> str:
    if (root / "models" / "recursive_reasoning" / "trm.py").is_file():
        return "trm"
    if (root / "models" / "hrm" / "hrm_act_v1.py").is_file():
        return "hrm"
    raise SystemExit(f"{root} is neither a TinyRecursiveModels nor an HRM checkout")


def commit_of(root: Path) -> str:
    done = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else "unknown"


# ----------------------------------------------------------------------------------------- loopformer side


def loopformer(*args: str) -> str:
    """One ``loopformer`` command, in this process (as a user types it)."""
    from click.testing import CliRunner

    from loopformer.cli import cli

    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    if result.exit_code != 0:
        raise SystemExit(f"loopformer {' '.join(args)} failed:\n{result.output}")
    return result.output


def make_runs(system: str) -> dict[str, tuple[Path, list[str]]]:
    """The data, the tiny runs and their exports in the working folder: name -> (checkpoint, export notes)."""
    for split, count, seed in (("train", 256, 0), ("test", N_TEST, 1)):
        loopformer("data", "generate", "sudoku", "--size", "4", "--count", str(count), "--seed", str(seed),
                   "-o", DATA, "--format", "hrm", "--split", split, *GENERATE)  # fmt: skip
        if system == "trm":
            add_total_puzzles(Path(DATA) / split)
    exports = {}
    for name, (recipe, overrides) in RUNS[system].items():
        loopformer("train", recipe, "-o", f"runs/{name}", *TRAIN, *overrides)
        ckpt = Path("checkpoints") / name / f"step_{STEPS}"
        said = loopformer("export", system, f"runs/{name}", "-o", str(ckpt))
        exports[name] = (ckpt, [line[6:] for line in said.splitlines() if line.startswith("note: ")])
    return exports


def add_total_puzzles(split: Path) -> None:
    """TRM's ``PuzzleDatasetMetadata`` requires ``total_puzzles`` (HRM's has no such field, and loopformer's
    ``--format hrm`` writes HRM's dataset.json): the number of puzzles, from the identifiers array."""
    meta = json.loads((split / "dataset.json").read_text())
    meta["total_puzzles"] = sum(len(np.load(split / f"{s}__puzzle_identifiers.npy")) for s in meta["sets"])
    (split / "dataset.json").write_text(json.dumps(meta, indent=2))


def loopformer_forward(run: str, batch: dict[str, Tensor], steps: int) -> tuple[Tensor, Tensor]:
    """The run's own model (before export): chained forwards from the initial state, logits and halting
    decisions per step (``q_logits > 0``: TRM's halt logit, HRM's q_halt - q_continue)."""
    from loopformer.runs import load_run

    model = load_run(run, use_ema=True).model.eval()
    logits, halt, state = [], [], None
    with torch.no_grad():
        for _ in range(steps):
            out = model(batch["inputs"].long(), state=state, puzzle_ids=batch["puzzle_identifiers"].long())
            state = out.state
            logits.append(out.logits)
            halt.append(out.q_logits > 0)
    return torch.stack(logits), torch.stack(halt)


def run_model(run: str) -> dict[str, Any]:
    """The run's model fields as its config.yaml records them (HRM: l_layers 0, its default)."""
    fields = yaml.safe_load((Path(run) / "config.yaml").read_text())["model"]
    return {k: fields[k] for k in sorted(fields) if k != "loop"}


# ----------------------------------------------------------------------------------------- authors' side


class AdamATan2(torch.optim.Optimizer):
    """adam_atan2.AdamATan2's update (a CUDA kernel in the package), written out."""

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 1e-2) -> None:  # fmt: skip
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is not None:
                    adam_atan2_step(p, p.grad, self.state[p], group["lr"], group["weight_decay"], b1, b2)


class CpuTorch(types.ModuleType):
    """``torch`` as pretrain.py sees it on a machine without CUDA: ``device("cuda")`` and
    ``load(map_location="cuda")`` give the CPU; everything else is torch's."""

    def __init__(self) -> None:
        super().__init__("torch")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def device(spec: Any, *args: Any) -> torch.device:
        return torch.device("cpu") if str(spec).startswith("cuda") else torch.device(spec, *args)

    @staticmethod
    def load(f: Any, map_location: Any = None, **kwargs: Any) -> Any:
        cpu = map_location is None or str(map_location).startswith("cuda")
        return torch.load(f, map_location="cpu" if cpu else map_location, **kwargs)


def import_pretrain(system: str) -> types.ModuleType:
    """The authors' pretrain.py with the CPU stand-ins (and, for HRM, flash-attn -> SDPA)."""
    import torch._dynamo

    torch._dynamo.config.disable = True
    stub_module("wandb")
    stub_module("coolname")
    stub_module("adam_atan2", AdamATan2=AdamATan2)
    if system == "trm":
        stub_module("argdantic", ArgParser=None)  # puzzle_dataset.py imports it and never uses it
    else:
        install_stubs()
    import pretrain

    pretrain.torch = CpuTorch()  # type: ignore[attr-defined]
    return pretrain


@contextlib.contextmanager
def model_cfg_recorded(pretrain: types.ModuleType, arch_name: str) -> Iterator[dict[str, Any]]:
    """Within: pretrain.py's ``load_model_class`` keeps the dict ``create_model`` builds the model from."""
    captured: dict[str, Any] = {}
    real = pretrain.load_model_class

    def recording(identifier: str, *args: Any) -> Any:
        cls = real(identifier, *args)
        if identifier != arch_name:
            return cls

        def build(config_dict: dict[str, Any]) -> Any:
            captured.update(config_dict)
            return cls(config_dict)

        return build

    pretrain.load_model_class = recording
    try:
        yield captured
    finally:
        pretrain.load_model_class = real


def authors_build_and_load(
    system: str, pretrain: types.ModuleType, ckpt: Path
) -> tuple[Any, Any, dict[str, Any]]:
    """What their scripts do to build and load: (the loss head, the test loader, a record of the load)."""
    with open(ckpt.parent / "all_config.yaml") as f:
        config = pretrain.PretrainConfig(**yaml.safe_load(f))
    record: dict[str, Any] = {}
    if system == "trm":
        config.load_checkpoint = str(ckpt)  # pretrain.py load_checkpoint=PATH
    else:
        config.checkpoint_path = str(ckpt.parent)  # evaluate.py checkpoint=PATH
    kw = dict(epochs_per_iter=1, global_batch_size=config.global_batch_size, rank=0, world_size=1)
    _, train_metadata = pretrain.create_dataloader(config, "train", test_set_mode=False, **kw)
    eval_loader, _ = pretrain.create_dataloader(config, "test", test_set_mode=True, **kw)
    saved = torch.load(ckpt, map_location="cpu")
    with model_cfg_recorded(pretrain, config.arch.name) as captured:
        if system == "trm":
            try:
                state = pretrain.init_train_state(config, train_metadata, rank=0, world_size=1)
                record["load"] = "load_checkpoint as written (strict)"
            except AttributeError as err:  # load_checkpoint reads model.model.puzzle_emb before loading
                record["load_checkpoint_error"] = f"{type(err).__name__}: {err}"
                config.load_checkpoint = None
                state = pretrain.init_train_state(config, train_metadata, rank=0, world_size=1)
                state.model.load_state_dict(saved, assign=True)  # load_checkpoint's last statement
                record["load"] = "load_checkpoint's load_state_dict(state_dict, assign=True) (strict)"
        else:
            state = pretrain.init_train_state(config, train_metadata, world_size=1)
            try:  # evaluate.py: the compiled keys first, then without the _orig_mod. prefix
                state.model.load_state_dict(saved, assign=True)
                record["load"] = "evaluate.py load_state_dict, compiled keys (strict)"
            except Exception:
                plain = {k.removeprefix("_orig_mod."): v for k, v in saved.items()}
                state.model.load_state_dict(plain, assign=True)
                record["load"] = "evaluate.py load_state_dict, keys without _orig_mod. (strict)"
    record["keys_loaded"] = len(saved)
    arch = dict(config.arch.__pydantic_extra__)
    model_config = type(state.model.model.config)
    fields = pretrain.PretrainConfig.model_fields
    record.update(
        pretrain_config_required=sorted(n for n, f in fields.items() if f.is_required()),
        pretrain_config_fields=sorted(fields),
        create_model_supplies=sorted(set(captured) - set(arch)),
        model_config=f"{model_config.__module__}.{model_config.__name__}",
        model_config_required=sorted(n for n, f in model_config.model_fields.items() if f.is_required()),
        forward_dtype=str(state.model.model.config.forward_dtype),
        model_cfg={k: captured[k] for k in sorted(captured)},
        train_metadata=train_metadata.model_dump(),
    )
    return state.model, eval_loader, record


def authors_evaluate(system: str, model: Any, eval_loader: Any) -> dict[str, Tensor]:
    """pretrain.py ``evaluate``: per test batch, ``initial_carry`` and loss-head calls until ``all_finish``;
    the real rows of each batch (the last is padded to the global batch), steps stacked first."""
    model.eval()
    rows: dict[str, list[Tensor]] = {}
    keys = ["logits", "q_halt_logits", "q_continue_logits"]
    with torch.inference_mode():
        for _set_name, batch, real in eval_loader:
            carry = model.initial_carry(batch)
            steps: dict[str, list[Tensor]] = {
                k: [] for k in ("logits", "q_halt", "q_continue", "halted", "halt")
            }
            while True:
                carry, _, _, preds, all_finish = model(carry=carry, batch=batch, return_keys=keys)
                q_halt, q_cont = preds["q_halt_logits"], preds["q_continue_logits"]
                steps["logits"].append(preds["logits"])
                steps["q_halt"].append(q_halt)
                steps["q_continue"].append(q_cont)
                steps["halted"].append(carry.halted.clone())
                steps["halt"].append(q_halt > 0 if system == "trm" else q_halt > q_cont)
                if all_finish:
                    break
            for k, v in steps.items():
                rows.setdefault(f"authors.{k}", []).append(torch.stack(v)[:, :real])
            for k in ("inputs", "labels", "puzzle_identifiers"):
                rows.setdefault(f"batch.{k}", []).append(batch[k][:real])
    return {k: torch.cat(v, dim=1 if k.startswith("authors.") else 0) for k, v in rows.items()}


# ----------------------------------------------------------------------------------------- fixtures


def build(root: Path, out: Path) -> list[str]:
    system = system_of(root)
    out = out.resolve()
    written: list[str] = []
    here = Path.cwd()
    with tempfile.TemporaryDirectory() as work:
        os.chdir(work)
        try:
            exports = make_runs(system)
            pretrain = import_pretrain(system)
            for name, (ckpt, notes) in exports.items():
                written += fixture(system, pretrain, root, out, name, ckpt, notes)
        finally:
            os.chdir(here)
    return written


def fixture(system: str, pretrain: types.ModuleType, root: Path, out: Path, name: str, ckpt: Path,
            notes: list[str]) -> list[str]:  # fmt: skip
    model, eval_loader, record = authors_build_and_load(system, pretrain, ckpt)
    tensors = authors_evaluate(system, model, eval_loader)
    del eval_loader  # its persistent worker
    theirs = tensors["authors.logits"]
    batch = {k.removeprefix("batch."): v for k, v in tensors.items() if k.startswith("batch.")}
    ours, our_halt = loopformer_forward(f"runs/{name}", batch, theirs.shape[0])
    folder = out / name
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    shutil.copyfile(ckpt, folder / ckpt.name)
    shutil.copyfile(ckpt.parent / "all_config.yaml", folder / "all_config.yaml")
    recipe, overrides = RUNS[system][name]
    meta = {
        "repo": "SamsungSAILMontreal/TinyRecursiveModels" if system == "trm" else "sapientinc/HRM",
        "commit": commit_of(root),
        "system": system,
        "checkpoint": f"{name}/{ckpt.name}",
        "dtype": "float32",
        "run": {"recipe": recipe, "overrides": [*TRAIN, *overrides], "data": DATA, "test_puzzles": N_TEST,
                "model": run_model(f"runs/{name}")},  # fmt: skip
        "export_notes": notes,
        "authors": record,
        "at_generation": {  # the authors' model against the run's own forward (before export)
            "max_abs_logit_diff": float((theirs - ours).abs().max()),
            "argmax_agreement": float((theirs.argmax(-1) == ours.argmax(-1)).double().mean()),
            "halting_decisions_equal": int((tensors["authors.halt"] == our_halt).sum()),
            "halting_decisions": int(our_halt.numel()),
            "halting_decisions_true": int(our_halt.sum()),
        },
        "substitutions": SUBSTITUTIONS + ([FLASH] if system == "hrm" else []),
    }
    save_fixture(out, name, tensors, meta)
    print(f"{name}: {meta['at_generation']}; authors' load: {record['load']}")
    return [f"{name}.safetensors", f"{name}.json", f"{name}/{ckpt.name}", f"{name}/all_config.yaml"]


if __name__ == "__main__":
    main(build, __doc__.splitlines()[0])
