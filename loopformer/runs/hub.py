"""Sharing trained models through the Hugging Face Hub (``pip install 'loopformer[hub]'``).

``loopformer push RUN REPO_ID`` uploads what evaluation needs from the run's latest checkpoint:
``model.safetensors``, ``ema.safetensors`` (when the run keeps an EMA) and ``config.json`` (the resolved
run configuration), plus the run's ``summary.json`` and a model card ``README.md`` generated from it: Hub
metadata through ``huggingface_hub.ModelCardData`` / ``EvalResult`` (``license``, ``datasets`` when the run
read a Hub dataset's files, ``model-index`` with the held-out results), the task, accuracy, steps vs difficulty, the recipe and the model family's own paper.
A plug-in model's module, when it is one file of the user's, is pushed beside the weights and the card
says how to use it (on ``PYTHONPATH``, with ``--import``); a module from a package names what to install.
loopformer never imports a module because a downloaded model names it (docs/extending.md).  The optimiser / data-stream state is not
uploaded: a pushed model is for evaluation and sharing, resuming uses the run folder.

The uploaded repository is a checkpoint folder, so ``loopformer eval``, ``loopformer solve`` and
``loopformer.load`` accept a hub id (``owner/name``, or ``hf://owner/name``, optionally ``@revision``)
wherever they accept a run folder: ``resolve_source`` downloads it with ``snapshot_download`` (cached
by huggingface_hub; ``HF_HUB_OFFLINE=1`` reads the cache only).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from loopformer.files import atomic_copy, atomic_write_text, hub_library, parse_hub_id, read_json
from loopformer.files import resolve_source as resolve_hub_path

PUSHED_FILES = ("model.safetensors", "ema.safetensors", "config.json")

# arXiv ids of the systems implemented here; a model card cites its own family's paper only
PAPERS = {
    "fprm": ("Fixed-Point Reasoners: Stable and Adaptive Deep Looped Transformers", "2606.18206"),
    "attractor": ("Solve the Loop: Attractor Models for Language and Reasoning", "2605.12466"),
    "recurrent": (
        "Loop, Think, & Generalize: Implicit Reasoning in Recurrent-Depth Transformers",
        "2604.07822",
    ),
    "trm": ("Less is More: Recursive Reasoning with Tiny Networks", "2510.04871"),
    "hrm": ("Hierarchical Reasoning Model", "2506.21734"),
    "ut_act": ("Universal Transformers", "1807.03819"),
}
# the Hugging Face datasets a run's task files come from (`loopformer data prepare`), for the card's metadata
HUB_DATASETS = {"sudoku": "sapientinc/sudoku-extreme", "maze": "sapientinc/maze-30x30-hard-1k"}
DEFAULT_LICENSE = "mit"  # loopformer's own licence; `push --license` sets the model's


def resolve_source(path_or_id: str | Path, cache_dir: str | Path | None = None) -> Path:
    """A local run folder as it is; a pushed run's hub id downloaded (``loopformer.files.resolve_source``): its
    weights, config, summary, card and a shipped plug-in module (never imported: the user --imports it)."""
    return resolve_hub_path(path_or_id, [*PUSHED_FILES, "summary.json", "README.md", "*.py"], cache_dir)


# ------------------------------------------------------------------------------------------- model card


def _family_papers(family: str, name: str) -> list[tuple[str, str]]:
    """The paper of the model's own family (``attractor_puzzle``: the Attractor paper); none for a plain
    transformer or a plug-in family."""
    key = family or name
    return [PAPERS[k] for k in PAPERS if k == key or key.startswith(f"{k}_")]


def _metrics(summary: dict[str, Any]) -> list[tuple[str, str, float]]:
    """(label, Hub metric type, value) of the run's held-out evaluation: what the card's table and its
    ``model-index`` report."""
    rows: list[tuple[str, str, float]] = []
    ev = summary.get("eval") or {}
    for key, label, kind in (("valid_acc", "held-out accuracy (independent validator)", "accuracy"),
                             ("exact_acc", "exact match", "exact_match"), ("token_acc", "token accuracy", "accuracy"),
                             ("bits_per_byte", "held-out bits per byte", "bits_per_byte"),
                             ("loop_steps", "mean loop steps", "mean_loop_steps")):  # fmt: skip
        if isinstance(ev.get(key), int | float):
            rows.append((label, kind, float(ev[key])))
    for key, label, kind in (("heldout_accuracy", "held-out accuracy (independent validator)", "accuracy"),
                             ("baseline_accuracy", "baseline accuracy", "accuracy"),
                             ("mean_steps", "mean loop steps", "mean_loop_steps")):  # fmt: skip
        if isinstance(summary.get(key), int | float):
            rows.append((label, kind, float(summary[key])))
    return rows


def _dataset(data: dict[str, Any]) -> tuple[str | None, str]:
    """(the Hub dataset id of the run's training files, or None for generated data; a description)."""
    task = str(data.get("task", "?"))
    options = ", ".join(f"{k}={v}" for k, v in (data.get("options") or {}).items())
    if data.get("train_path") and task in HUB_DATASETS:
        return HUB_DATASETS[task], f"{task} ({HUB_DATASETS[task]}, {options})"
    return None, f"{task} generated by loopformer ({options or 'default options'})"


def _front_matter(
    config: dict[str, Any], summary: dict[str, Any], name: str, hub_id: str, license: str
) -> str:
    """The card's YAML metadata, built and validated by ``huggingface_hub``'s ``ModelCardData`` /
    ``EvalResult`` (what the Hub reads): licence, library, tags, the training dataset when it is one on the
    Hub, the evaluation as ``model-index``. Generated data names no Hub dataset: the results' dataset is
    the task's name and its description."""
    hub = hub_library()
    data = config.get("data", {})
    task = str(data.get("task", "?"))
    dataset_id, description = _dataset(data)
    looped = name != "transformer"
    results = [hub.EvalResult(
        task_type="text-generation" if task == "text" else "other", task_name=task,
        dataset_type=dataset_id or task, dataset_name=description, metric_type=kind, metric_name=label,
        metric_value=round(100 * v, 2) if kind in ("accuracy", "exact_match") else round(v, 4),
    ) for label, kind, v in _metrics(summary) if label != "baseline accuracy"]  # fmt: skip
    meta = hub.ModelCardData(
        license=license, library_name="loopformer", tags=[*(["looped-transformer"] if looped else []), name, task],
        datasets=[dataset_id] if dataset_id else None, model_name=hub_id.split("/")[-1] if results else None,
        eval_results=results or None,
    )  # fmt: skip
    return "---\n" + meta.to_yaml() + "\n---"


def _plugin_lines(plugins: list[str], hub_id: str, shipped: list[str]) -> list[str]:
    """What a downloader does to evaluate a plug-in model: loopformer never imports a module because a
    checkpoint names it (docs/extending.md), so the card says which to install or put on PYTHONPATH and
    to pass it with ``--import``."""
    if not plugins:
        return []
    imports = " ".join(f"--import {m}" for m in plugins)
    folder = hub_id.split("/")[-1]
    lines = ["## Plug-in code", "", f"This model's code is not part of loopformer: module(s) {', '.join(plugins)}. "
             "loopformer never imports a module because a checkpoint names it; you import it yourself."]  # fmt: skip
    if shipped:
        lines += [f"{', '.join(f'`{f}`' for f in shipped)} ship in this repository: download it and put it on "
                  "your `PYTHONPATH` (read the code first: importing it runs it).", "", "```bash",
                  f"huggingface-cli download {hub_id} --local-dir {folder}",
                  f"PYTHONPATH={folder} loopformer {imports} eval {hub_id}", "```", ""]  # fmt: skip
    missing = [m for m in plugins if f"{m.split('.')[0]}.py" not in shipped]
    for module in missing:
        dist = _distribution(module)
        how = (
            f"`pip install {dist}`"
            if dist
            else "the package that provides it (it is not a single file to ship)"
        )
        lines += [f"Module `{module}`: install {how}, then run `loopformer {imports} eval {hub_id}`.", ""]
    return lines


def _distribution(module: str) -> str | None:
    """The installed distribution that provides ``module`` (None: a local file or unknown)."""
    from importlib.metadata import packages_distributions

    dists = packages_distributions().get(module.split(".")[0]) or []
    return dists[0] if dists else None


def model_card(config: dict[str, Any], summary: dict[str, Any] | None, family: str, step: int,
               repo_id: str | None = None, license: str = DEFAULT_LICENSE, shipped: list[str] | None = None) -> str:  # fmt: skip
    """The README.md of a pushed model, from its config.json and summary.json: Hub metadata (licence,
    datasets, ``model-index`` with the evaluation's results), the results, the recipe, how to use it (a
    plug-in model: what to install or put on PYTHONPATH, and ``--import``), the family's paper. ``repo_id``
    (owner/name, the ``push`` target) fills the usage lines, else they name ``<owner>/<name>`` and say to
    replace it; ``shipped``: the plug-in files pushed beside the weights."""
    summary = summary or {}
    hub_id = repo_id or "<owner>/<name>"
    data, model = config.get("data", {}), config.get("model", {})
    task = data.get("task", "?")
    name = model.get("name", family)
    kind = "A transformer (no loop)" if name == "transformer" else f"A looped model ({name})"
    lines = [_front_matter(config, summary, name, hub_id, license), "", f"# {name} on {task}", "",
             f"{kind} trained with loopformer ({step} steps).", ""]  # fmt: skip
    rows = [(label, value) for label, _, value in _metrics(summary)]
    if rows:
        lines += ["## Results", ""]
        if summary.get("eval_label"):  # which checkpoint the numbers are of: "final (step N)"
            lines += [f"Evaluated: {summary['eval_label']}.", ""]
        lines += ["| metric | value |", "|---|---|"]
        lines += [f"| {k} | {v:.4f} |" for k, v in rows]
        lines.append("")
    best = summary.get("best")
    if isinstance(best, dict) and "label" in best:  # train.keep_best
        lines += [f"The run also kept its {best['label']}: eval_{best['metric']} {best['value']:.4f}.", ""]
    by_difficulty = summary.get("mean_steps_by_difficulty")
    if by_difficulty:
        lines += ["## Steps vs difficulty", "", "| difficulty | mean loop steps |", "|---|---|"]
        lines += [f"| {k} | {'-' if v is None else f'{v:.2f}'} |" for k, v in dict(by_difficulty).items()]
        lines.append("")
    params = summary.get("parameters")
    plugins = [str(m) for m in config.get("plugins") or []]
    imports = "".join(f" --import {m}" for m in plugins)
    lines += ["## Recipe", "", f"- model: `{name}` ({family}), {params if params is not None else '?'} parameters",
              f"- task: {_dataset(data)[1]}",
              f"- training: {config.get('train', {}).get('steps', '?')} steps, batch "
              f"{config.get('train', {}).get('batch_size', '?')}, lr {config.get('train', {}).get('lr', '?')}",
              f"- recipe / overrides: {summary.get('recipe', 'see config.json')} {summary.get('overrides', '')}".rstrip(),
              "", *_plugin_lines(plugins, hub_id, shipped or []),
              *([] if repo_id else ["Replace `<owner>/<name>` below with this model's hub id.", ""]),
              "```bash", "pip install 'loopformer[hub]'", f"loopformer{imports} eval {hub_id} --device auto",
              "```", "", "```python", "import loopformer", f"run = loopformer.load('{hub_id}')",
              "loopformer.solve(run, '<puzzle>')", "```", ""]  # fmt: skip
    papers = _family_papers(family, name)
    if papers:
        lines += ["## Cite", ""]
        lines += [f"- {title}, arXiv:{arxiv} (https://arxiv.org/abs/{arxiv})" for title, arxiv in papers]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------- push


def check_push(run: str | Path, repo_id: str) -> Path:
    """The checkpoint folder ``push`` would share, after the checks every command makes before any work:
    ``repo_id`` reads as owner/name, and the checkpoint's config parses and validates as ``train``
    validates it (``loopformer.config.checks.run_config_for``), then its weights load into the model as
    ``eval`` loads them (``load_checkpoint``: names, shapes, dtypes, finite values, EMA included), so a
    checkpoint ``eval`` would refuse is never shared."""
    from loopformer.config.checks import run_config_for
    from loopformer.runs.checkpoint import load_checkpoint, read_checkpoint_config, resolve_checkpoint

    if parse_hub_id(repo_id) is None:
        raise ValueError(f"repository id {repo_id!r}: expected owner/name")
    ckpt = resolve_checkpoint(run)
    stored, _, _ = read_checkpoint_config(ckpt)  # CheckpointError naming config.json when it does not parse
    run_config_for(stored, device="cpu")
    load_checkpoint(ckpt, use_ema=True, device="cpu")
    return ckpt


def _read_summary(path: Path) -> dict[str, Any]:
    """A run's ``summary.json`` checked against its record (``loopformer.runs.folder.Summary``);
    ValueError naming the file and the field otherwise."""
    from loopformer.runs.checkpoint import read_record
    from loopformer.runs.folder import Summary

    return read_record(path, Summary)


def ship_plugins(plugins: list[str], folder: Path) -> list[str]:
    """Copy each plug-in module that is one file of the user's (imported, not from an installed
    distribution) into ``folder`` as ``<module>.py``; returns the file names. Never imports anything: the
    modules are already imported (a checkpoint that names them does not load otherwise)."""
    import sys

    shipped = []
    for module in plugins:
        loaded = sys.modules.get(module)
        source = Path(getattr(loaded, "__file__", None) or "")
        if "." in module or source.suffix != ".py" or source.name == "__init__.py" or _distribution(module):
            continue  # a package or an installed distribution: the card names what to install
        folder.mkdir(parents=True, exist_ok=True)
        atomic_copy(source, folder / f"{module}.py", root=folder)
        shipped.append(f"{module}.py")
    return shipped


def stage_run(run: str | Path, folder: Path, repo_id: str | None = None,
              license: str = DEFAULT_LICENSE) -> dict[str, Any]:  # fmt: skip
    """Copy what a pushed model holds into ``folder`` (the model card names ``repo_id`` and ``license``; a
    plug-in module that is one file of the user's is copied beside the weights); returns {"checkpoint",
    "step", "family", "files"}. The checkpoint must still be the one it was when copying began (a training
    rotating its checkpoints meanwhile is a CheckpointError, never a mix of two steps)."""
    from loopformer.runs.checkpoint import manifest_bytes, resolve_checkpoint, unchanged_since

    ckpt = resolve_checkpoint(run)
    manifest = manifest_bytes(ckpt)
    try:
        staged = _stage(ckpt, run, folder, repo_id, license)
    except (OSError, ValueError) as err:
        unchanged_since(ckpt, manifest)
        raise err from None
    unchanged_since(ckpt, manifest)
    return staged


def _stage(ckpt: Path, run: str | Path, folder: Path, repo_id: str | None,
           license: str = DEFAULT_LICENSE) -> dict[str, Any]:  # fmt: skip
    from loopformer.runs.checkpoint import CheckpointError, read_checkpoint_config

    read_checkpoint_config(ckpt)  # config.json parses (CheckpointError naming it otherwise)
    raw = read_json(ckpt / "config.json", CheckpointError)
    files = []
    from loopformer.runs.checkpoint import is_sharded, save_weights, stored_weights

    if is_sharded(ckpt):  # every rank's shards, joined into the full weights files a download expects
        meta = {"family": str(raw.get("family", "")), "step": str(raw.get("step", 0))}
        for name, table in zip(("model.safetensors", "ema.safetensors"), stored_weights(ckpt), strict=True):
            if table is not None:
                save_weights(table, folder / name, meta, root=folder)
                files.append(name)
    for name in PUSHED_FILES:
        if (ckpt / name).is_file():
            atomic_copy(ckpt / name, folder / name, root=folder)
            files.append(name)
    run_dir = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt
    summary = None
    for candidate in (run_dir / "summary.json", run_dir.parent / "summary.json"):
        if candidate.is_file():
            summary = _read_summary(candidate)
            atomic_copy(candidate, folder / "summary.json", root=folder)
            files.append("summary.json")
            break
    shipped = ship_plugins([str(m) for m in raw.get("plugins") or []], folder)
    files += shipped
    card = model_card(
        raw, summary, str(raw.get("family", "")), int(raw.get("step", 0)), repo_id, license, shipped
    )
    atomic_write_text(folder / "README.md", card, root=folder)
    files.append("README.md")
    return {
        "checkpoint": str(ckpt),
        "step": int(raw.get("step", 0)),
        "family": raw.get("family"),
        "files": files,
    }


def push(run: str | Path, repo_id: str, private: bool = False, revision: str | None = None,
         message: str | None = None, token: str | None = None, api: Any = None,
         license: str = DEFAULT_LICENSE) -> dict[str, Any]:  # fmt: skip
    """Upload RUN's latest checkpoint + model card to ``repo_id`` (created when missing); returns what was sent.

    ``api``: an ``HfApi``-like object (``create_repo``, ``upload_folder``); default ``HfApi(token=token)``.
    """
    ckpt = check_push(run, repo_id)
    if api is None:
        api = hub_library().HfApi(token=token)
    with tempfile.TemporaryDirectory() as tmp:
        staged = stage_run(ckpt, Path(tmp), repo_id, license)
        api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        commit = api.upload_folder(folder_path=tmp, repo_id=repo_id, repo_type="model", revision=revision,
                                   commit_message=message or f"loopformer push: step {staged['step']}")  # fmt: skip
    return {**staged, "repo_id": repo_id, "commit": str(getattr(commit, "oid", commit) or "")}


def _command() -> Any:
    import click

    @click.command("push")
    @click.argument("run")
    @click.argument("repo_id")
    @click.option("--private", is_flag=True, help="create the repository private")
    @click.option("--revision", default=None, help="branch to push to (default: main)")
    @click.option("--message", "-m", default=None, help="commit message")
    @click.option("--to-folder", type=click.Path(path_type=Path), default=None,
                  help="write the files (model card included) to this folder instead of uploading")  # fmt: skip
    @click.option("--overwrite", is_flag=True,
                  help="replace what --to-folder holds (moved aside once the new files are complete)")  # fmt: skip
    @click.option("--license", "license_", default=DEFAULT_LICENSE, show_default=True,
                  help="the model's licence in the card's metadata (a Hub licence id: mit, apache-2.0, cc-by-4.0, ...)")  # fmt: skip
    def push_cmd(run: str, repo_id: str, private: bool, revision: str | None, message: str | None,
                 to_folder: Path | None, overwrite: bool = False, license_: str = DEFAULT_LICENSE) -> None:  # fmt: skip
        """Share RUN's latest checkpoint as hub model REPO_ID (owner/name) with a generated model card."""
        ckpt = check_push(run, repo_id)  # before a folder is claimed or anything sent; the checkpoint read once
        if revision is not None and (not revision.strip() or revision != revision.strip()):
            raise click.BadParameter(f"{revision!r} is not a branch name", param_hint="--revision")
        if message is not None and not message.strip():
            raise click.BadParameter("an empty commit message; leave --message out for the default",
                                     param_hint="--message")  # fmt: skip
        if to_folder is not None:
            from loopformer.runs.folder import staged_output

            with staged_output(to_folder, "push", overwrite, "--to-folder") as tmp:  # swapped in whole
                staged = stage_run(ckpt, tmp, repo_id if parse_hub_id(repo_id) else None, license_)
            click.echo(f"wrote {', '.join(staged['files'])} to {to_folder} (step {staged['step']})")
            return
        sent = push(run, repo_id, private=private, revision=revision, message=message, license=license_)
        click.echo(f"pushed {', '.join(sent['files'])} (step {sent['step']}) to {repo_id}; "
                   f"load it with: loopformer eval {repo_id}")  # fmt: skip

    return push_cmd


push_cmd = _command()
