"""Sharing trained models through the Hugging Face Hub (``pip install 'loopformer[hub]'``).

``loopformer push RUN REPO_ID`` uploads what evaluation needs from the run's latest checkpoint:
``model.safetensors``, ``ema.safetensors`` (when the run keeps an EMA) and ``config.json`` (the resolved
run configuration), plus the run's ``summary.json`` and a model card ``README.md`` generated from it (task,
accuracy, steps vs difficulty, the recipe, the papers to cite).  The optimiser / data-stream state is not
uploaded: a pushed model is for evaluation and sharing, resuming uses the run folder.

The uploaded repository is a checkpoint folder, so ``loopformer eval``, ``loopformer solve`` and
``loopformer.load`` accept a hub id (``owner/name``, or ``hf://owner/name``, optionally ``@revision``)
wherever they accept a run folder: ``resolve_source`` downloads it with ``snapshot_download`` (cached
by huggingface_hub; ``HF_HUB_OFFLINE=1`` reads the cache only).
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path
from typing import Any

from loopformer.files import atomic_copy, atomic_write_text

HUB_ID = re.compile(r"^(?:hf://)?(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<rev>[\w./-]+))?$")
PUSHED_FILES = ("model.safetensors", "ema.safetensors", "config.json")

# arXiv ids of the systems implemented here, cited on every model card and in CITATION.cff
PAPERS = {
    "fprm": ("Fixed-Point Reasoners: Stable and Adaptive Deep Looped Transformers", "2606.18206"),
    "attractor": ("Solve the Loop: Attractor Models for Language and Reasoning", "2605.12466"),
    "recurrent": (
        "Loop, Think, & Generalize: Implicit Reasoning in Recurrent-Depth Transformers",
        "2604.07822",
    ),
    "trm": ("Less is More: Recursive Reasoning with Tiny Networks", "2510.04871"),
    "hrm": ("Hierarchical Reasoning Model", "2506.21734"),
}


def _hub() -> Any:
    try:
        import huggingface_hub
    except ImportError:
        raise RuntimeError(
            "sharing through the Hugging Face Hub needs huggingface_hub: pip install 'loopformer[hub]'"
        ) from None
    return huggingface_hub


def parse_hub_id(text: str) -> tuple[str, str | None] | None:
    """(repo_id, revision) when ``text`` reads as a hub id, else None."""
    match = HUB_ID.match(str(text))
    return (match["repo"], match["rev"]) if match else None


def resolve_source(path_or_id: str | Path, cache_dir: str | Path | None = None) -> Path:
    """A local path as it is; an existing-nowhere ``owner/name`` is downloaded from the hub (cached)."""
    path = Path(path_or_id)
    if path.exists():
        return path
    parsed = parse_hub_id(str(path_or_id))
    local_looking = str(path_or_id).startswith(("./", "../", "/", "~")) or Path(path.parts[0]).is_dir()
    if parsed is None or local_looking:
        return path  # let the checkpoint loader report the missing folder
    repo_id, revision = parsed
    try:
        hub = _hub()
    except RuntimeError:
        raise FileNotFoundError(
            f"{path_or_id}: no such run folder (to read it as a hub id, pip install 'loopformer[hub]')"
        ) from None
    try:
        local = hub.snapshot_download(repo_id, revision=revision, cache_dir=cache_dir, allow_patterns=[
            *PUSHED_FILES, "summary.json", "README.md"])  # fmt: skip
    except Exception as err:  # the hub's own errors (offline, not found, gated): one clear line
        raise FileNotFoundError(
            f"{path_or_id!r} is neither a local run folder nor a downloadable hub model: {type(err).__name__}: {err}"
        ) from None
    return Path(local)


# ------------------------------------------------------------------------------------------- model card


def _family_papers(family: str, name: str) -> list[tuple[str, str]]:
    key = family or name
    out = [PAPERS[k] for k in PAPERS if k in key]
    return out or list(PAPERS.values())


def model_card(config: dict[str, Any], summary: dict[str, Any] | None, family: str, step: int,
               repo_id: str | None = None) -> str:  # fmt: skip
    """The README.md of a pushed model, from its config.json and summary.json; ``repo_id`` (owner/name, the
    ``push`` target) fills the usage lines, else they name ``<owner>/<name>`` and say to replace it."""
    summary = summary or {}
    hub_id = repo_id or "<owner>/<name>"
    data, model = config.get("data", {}), config.get("model", {})
    task = data.get("task", "?")
    name = model.get("name", family)
    lines = ["---", "library_name: loopformer", "tags:", "- looped-transformer", f"- {name}", f"- {task}", "---", "",
             f"# {name} on {task}", "",
             f"A looped transformer trained with loopformer ({step} steps).", ""]  # fmt: skip
    rows = []
    ev = summary.get("eval") or {}
    for key, label in (("valid_acc", "held-out accuracy (independent validator)"), ("exact_acc", "exact match"),
                       ("token_acc", "token accuracy"), ("loop_steps", "mean loop steps")):  # fmt: skip
        if key in ev:
            rows.append((label, ev[key]))
    for key, label in (("heldout_accuracy", "held-out accuracy (independent validator)"),
                       ("baseline_accuracy", "baseline accuracy"), ("mean_steps", "mean loop steps")):  # fmt: skip
        if summary.get(key) is not None:
            rows.append((label, summary[key]))
    if rows:
        lines += ["## Results", ""]
        if summary.get("eval_label"):  # which checkpoint the numbers are of: "final (step N)"
            lines += [f"Evaluated: {summary['eval_label']}.", ""]
        lines += ["| metric | value |", "|---|---|"]
        lines += [f"| {k} | {v:.4f} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in rows]
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
    lines += ["## Recipe", "", f"- model: `{name}` ({family}), {params if params is not None else '?'} parameters",
              f"- task: `{task}` {data.get('options', {})}",
              f"- training: {config.get('train', {}).get('steps', '?')} steps, batch "
              f"{config.get('train', {}).get('batch_size', '?')}, lr {config.get('train', {}).get('lr', '?')}",
              f"- recipe / overrides: {summary.get('recipe', 'see config.json')} {summary.get('overrides', '')}".rstrip(),
              "", *([] if repo_id else ["Replace `<owner>/<name>` below with this model's hub id.", ""]),
              "```bash", "pip install 'loopformer[hub]'", f"loopformer eval {hub_id} --device auto",
              "```", "", "```python", "import loopformer", f"run = loopformer.load('{hub_id}')",
              "loopformer.solve(run, '<puzzle>')", "```", "", "## Cite", ""]  # fmt: skip
    lines += [
        f"- {title}, arXiv:{arxiv} (https://arxiv.org/abs/{arxiv})"
        for title, arxiv in _family_papers(family, name)
    ]
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
    """A run's ``summary.json`` checked against its schema (``loopformer.runs.records.SUMMARY``);
    ValueError naming the file and the field (never quoting it) otherwise."""
    from loopformer.files import read_record
    from loopformer.runs.records import SUMMARY

    return read_record(path, SUMMARY)


def stage_run(run: str | Path, folder: Path, repo_id: str | None = None) -> dict[str, Any]:
    """Copy what a pushed model holds into ``folder`` (the model card names ``repo_id``); returns
    {"checkpoint", "step", "family", "files"}. The checkpoint must still be the one it was when copying
    began (a training rotating its checkpoints meanwhile is a CheckpointError, never a mix of two steps)."""
    from loopformer.runs.checkpoint import resolve_checkpoint
    from loopformer.runs.sharded import _manifest_bytes, _still_there

    ckpt = resolve_checkpoint(run)
    manifest = _manifest_bytes(ckpt)
    try:
        staged = _stage(ckpt, run, folder, repo_id)
    except (OSError, ValueError) as err:
        _still_there(ckpt, manifest)
        raise err from None
    _still_there(ckpt, manifest)
    return staged


def _stage(ckpt: Path, run: str | Path, folder: Path, repo_id: str | None) -> dict[str, Any]:
    from loopformer.runs.checkpoint import read_checkpoint_config

    read_checkpoint_config(ckpt)  # config.json parses (CheckpointError naming it otherwise)
    raw = json.loads((ckpt / "config.json").read_text(encoding="utf-8"))
    files = []
    from loopformer.runs.sharded import is_sharded, stored_weights

    if is_sharded(ckpt):  # every rank's shards, joined into the full weights files a download expects
        from loopformer.runs.layout import save_weights

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
    card = model_card(raw, summary, str(raw.get("family", "")), int(raw.get("step", 0)), repo_id)
    atomic_write_text(folder / "README.md", card, root=folder)
    files.append("README.md")
    return {
        "checkpoint": str(ckpt),
        "step": int(raw.get("step", 0)),
        "family": raw.get("family"),
        "files": files,
    }


def push(run: str | Path, repo_id: str, private: bool = False, revision: str | None = None,
         message: str | None = None, token: str | None = None, api: Any = None) -> dict[str, Any]:  # fmt: skip
    """Upload RUN's latest checkpoint + model card to ``repo_id`` (created when missing); returns what was sent.

    ``api``: an ``HfApi``-like object (``create_repo``, ``upload_folder``); default ``HfApi(token=token)``.
    """
    ckpt = check_push(run, repo_id)
    if api is None:
        api = _hub().HfApi(token=token)
    with tempfile.TemporaryDirectory() as tmp:
        staged = stage_run(ckpt, Path(tmp), repo_id)
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
    def push_cmd(run: str, repo_id: str, private: bool, revision: str | None, message: str | None,
                 to_folder: Path | None, overwrite: bool = False) -> None:  # fmt: skip
        """Share RUN's latest checkpoint as hub model REPO_ID (owner/name) with a generated model card."""
        ckpt = check_push(run, repo_id)  # before a folder is claimed or anything sent; the checkpoint read once
        if revision is not None and (not revision.strip() or revision != revision.strip()):
            raise click.BadParameter(f"{revision!r} is not a branch name", param_hint="--revision")
        if message is not None and not message.strip():
            raise click.BadParameter("an empty commit message; leave --message out for the default",
                                     param_hint="--message")  # fmt: skip
        if to_folder is not None:
            from loopformer.runs.outputs import staged_output

            with staged_output(to_folder, "push", overwrite, "--to-folder") as tmp:  # swapped in whole
                staged = stage_run(ckpt, tmp, repo_id if parse_hub_id(repo_id) else None)
            click.echo(f"wrote {', '.join(staged['files'])} to {to_folder} (step {staged['step']})")
            return
        sent = push(run, repo_id, private=private, revision=revision, message=message)
        click.echo(f"pushed {', '.join(sent['files'])} (step {sent['step']}) to {repo_id}; "
                   f"load it with: loopformer eval {repo_id}")  # fmt: skip

    return push_cmd


push_cmd = _command()
