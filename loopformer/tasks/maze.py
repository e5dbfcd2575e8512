"""Mazes: shortest-path puzzles on an n x n grid (Maze-Hard, HRM's dataset builders, arXiv 2506.21734).

Characters: '#' wall, ' ' open, 'S' start, 'G' goal, 'o' path (labels only).  Tokens follow HRM/TRM
(charset ``"# SGo"`` -> 1..5, PAD 0, vocab 6).  The label is the input with one shortest S->G path
marked 'o' (S and G kept).  difficulty = shortest-path length in moves (= number of 'o' cells + 1);
the CSV's ``rating`` column holds it (Maze-Hard keeps mazes whose shortest path exceeds 110).

Generator: a random spanning tree (iterative randomised depth-first search, long winding corridors)
on the lattice of even coordinates (0, 2, ..., so an even n leaves the last row and column as wall),
then a fraction ``loops`` of the remaining lattice walls knocked through so that several routes exist
and the shortest one must be found rather than followed.  S is random, G is drawn among the open
cells at BFS distance >= ``min_path`` from S.

``check`` accepts any shortest path, not only the labelled one: the 'o' cells plus S and G must form
a 4-connected simple path from S to G through open cells, everything else unchanged, and its length
must equal the BFS distance computed here from the input alone.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from loopformer.tasks.base import (
    DIHEDRAL_INVERSE,
    Task,
    TaskDataError,
    TokenDataset,
    square_symmetry,
    sub_seed,
)
from loopformer.tasks.puzzle_csv import first_question, read_puzzle_csv, write_puzzle_csv

CHARSET = "# SGo"
MAX_SIZE = 100
WALL, OPEN, START, GOAL, PATH = 1, 2, 3, 4, 5


def bfs_distances(open_cells: np.ndarray, start: tuple[int, int]) -> np.ndarray:
    """4-neighbour BFS distances over a boolean passable grid; -1 where unreachable."""
    n_rows, n_cols = open_cells.shape
    dist = np.full(open_cells.shape, -1, dtype=np.int64)
    dist[start] = 0
    flat_open = open_cells.reshape(-1).tolist()
    flat_dist = dist.reshape(-1)
    queue = deque([start[0] * n_cols + start[1]])
    while queue:
        cell = queue.popleft()
        r, c = divmod(cell, n_cols)
        d = flat_dist[cell] + 1
        for nr, nc in ((r - 1, c), (r + 1, c), (r, c - 1), (r, c + 1)):
            if 0 <= nr < n_rows and 0 <= nc < n_cols:
                nxt = nr * n_cols + nc
                if flat_open[nxt] and flat_dist[nxt] < 0:
                    flat_dist[nxt] = d
                    queue.append(nxt)
    return dist


def _carve(n: int, rng: random.Random, loops: float) -> np.ndarray:
    """Boolean open grid: a DFS spanning tree on even coordinates plus a fraction of extra openings."""
    grid = np.zeros((n, n), dtype=bool)
    m = (n + 1) // 2  # lattice cells per side
    grid[0 : 2 * m - 1 : 2, 0 : 2 * m - 1 : 2] = True
    visited = [[False] * m for _ in range(m)]
    start = (rng.randrange(m), rng.randrange(m))
    stack = [start]
    visited[start[0]][start[1]] = True
    while stack:
        i, j = stack[-1]
        nbrs = [
            (a, b)
            for a, b in ((i - 1, j), (i + 1, j), (i, j - 1), (i, j + 1))
            if 0 <= a < m and 0 <= b < m and not visited[a][b]
        ]
        if not nbrs:
            stack.pop()
            continue
        a, b = nbrs[rng.randrange(len(nbrs))]
        visited[a][b] = True
        grid[i + a, j + b] = True  # the wall cell between (2i, 2j) and (2a, 2b)
        stack.append((a, b))
    if loops > 0:
        walls = [
            (r, c)
            for r in range(0, 2 * m - 1)
            for c in range(0, 2 * m - 1)
            if (r + c) % 2 == 1 and not grid[r, c]
        ]
        for r, c in rng.sample(walls, int(round(loops * len(walls)))):
            grid[r, c] = True
    return grid


class MazeTask(Task):
    """n x n maze; input has '#', ' ', 'S', 'G'; label marks one shortest path with 'o'."""

    name = "maze"
    causal = False
    vocab_size = 6

    def __init__(self, size: int = 30) -> None:
        if not 3 <= size <= MAX_SIZE:  # a larger maze takes minutes to generate (Maze-Hard's are 30 x 30)
            raise ValueError(f"maze size must be in [3, {MAX_SIZE}], got {size}")
        self.size = size
        self.seq_len = size * size

    # ---------------------------------------------------------------- conversions
    def parse_grid(self, text: str, what: str = "maze", allow_path: bool = True) -> np.ndarray:
        """size*size characters from '# SGo' -> tokens [T] (newlines are dropped, spaces are cells)."""
        chars = text.replace("\r", "").replace("\n", "")
        if len(chars) != self.seq_len:
            raise TaskDataError(f"{what} has {len(chars)} characters, expected {self.seq_len}")
        allowed = CHARSET if allow_path else CHARSET[:4]
        out = np.empty(self.seq_len, dtype=np.int64)
        for i, ch in enumerate(chars):
            k = allowed.find(ch)
            if k < 0:
                raise TaskDataError(
                    f"{what} has bad character {ch!r} at position {i} (allowed: {''.join(allowed)!r})"
                )
            out[i] = k + 1
        return out

    def format_grid(self, tokens: np.ndarray) -> str:
        arr = np.asarray(tokens).reshape(-1)
        if arr.shape != (self.seq_len,) or arr.min() < 1 or arr.max() > 5:
            raise TaskDataError(f"maze tokens must be {self.seq_len} values in 1..5")
        return "".join(CHARSET[t - 1] for t in arr.tolist())

    def _endpoints(self, grid: np.ndarray) -> tuple[tuple[int, int], tuple[int, int]] | None:
        starts, goals = np.argwhere(grid == START), np.argwhere(grid == GOAL)
        if len(starts) != 1 or len(goals) != 1:
            return None
        return (int(starts[0][0]), int(starts[0][1])), (int(goals[0][0]), int(goals[0][1]))

    def shortest_path_length(self, inputs: np.ndarray) -> int:
        """BFS distance S -> G in moves; -1 if G is unreachable or S / G are not unique."""
        grid = np.asarray(inputs).reshape(self.size, self.size)
        ends = self._endpoints(grid)
        if ends is None:
            return -1
        dist = bfs_distances(grid != WALL, ends[0])
        return int(dist[ends[1]])

    # ---------------------------------------------------------------- generation
    def _one(self, seed: int, min_path: int, loops: float) -> tuple[np.ndarray, np.ndarray, int]:
        rng = random.Random(seed)
        n = self.size
        for _attempt in range(100):
            open_cells = _carve(n, rng, loops)
            lattice = [(int(r), int(c)) for r, c in np.argwhere(open_cells)]
            start = lattice[rng.randrange(len(lattice))]
            dist = bfs_distances(open_cells, start)
            if dist.max() < min_path:
                # the far end of a longest path from a random cell: an approximate diameter endpoint
                far = np.unravel_index(int(np.argmax(dist)), dist.shape)
                start = (int(far[0]), int(far[1]))
                dist = bfs_distances(open_cells, start)
            far_cells = np.argwhere(dist >= min_path)
            if len(far_cells) == 0:
                continue
            goal_rc = far_cells[rng.randrange(len(far_cells))]
            goal = (int(goal_rc[0]), int(goal_rc[1]))
            grid = np.where(open_cells, OPEN, WALL).astype(np.int64)
            grid[start], grid[goal] = START, GOAL
            label = grid.copy()
            # walk back from G along strictly decreasing BFS distance (one shortest path)
            r, c = goal
            d = int(dist[goal])
            while d > 1:
                for nr, nc in ((r - 1, c), (r + 1, c), (r, c - 1), (r, c + 1)):
                    if 0 <= nr < n and 0 <= nc < n and dist[nr, nc] == d - 1:
                        r, c, d = nr, nc, d - 1
                        break
                label[r, c] = PATH
            return grid.reshape(-1), label.reshape(-1), int(dist[goal])
        raise ValueError(
            f"no {n}x{n} maze with a shortest path >= {min_path} in 100 attempts; lower min_path"
        )

    def generate(
        self, n: int, seed: int, min_path: int | None = None, loops: float = 0.05, progress: Any = None
    ) -> TokenDataset:
        """``n`` mazes, deterministic in ``seed``; shortest path >= ``min_path`` moves (default size^2 / 8,
        112 for 30x30, near Maze-Hard's > 110); ``loops`` = fraction of tree walls knocked through."""
        if min_path is None:
            min_path = max(1, self.seq_len // 8)
        if not 0.0 <= loops <= 1.0:
            raise ValueError(f"loops must be in [0, 1], got {loops}")
        inputs, labels, lengths = [], [], []
        seen: set[bytes] = set()
        for i in range(n):
            for attempt in range(20):
                x, y, length = self._one(sub_seed(seed, i, attempt), int(min_path), float(loops))
                key = x.astype(np.uint8).tobytes()
                if key not in seen:
                    break
            else:
                raise ValueError(f"could not find {n} distinct {self.size}x{self.size} mazes")
            seen.add(key)
            inputs.append(x)
            labels.append(y)
            lengths.append(length)
            if progress is not None:
                progress(1)
        meta = {
            "task": self.name,
            "size": self.size,
            "seed": seed,
            "min_path": int(min_path),
            "loops": loops,
            "difficulty": "shortest path length",
        }
        return TokenDataset(
            np.asarray(inputs, dtype=np.int64).reshape(n, self.seq_len),
            np.asarray(labels, dtype=np.int64).reshape(n, self.seq_len),
            np.asarray(lengths, dtype=np.float64),
            None,
            meta,
        )

    # ---------------------------------------------------------------- validity
    def check(self, inputs: np.ndarray, prediction: np.ndarray) -> bool:
        """Valid iff walls / S / G / other open cells are unchanged, 'o' only on open cells, and the 'o'
        cells with S and G form a simple 4-connected S->G path whose length is the BFS shortest distance."""
        x = np.asarray(inputs).reshape(-1)
        p = np.asarray(prediction).reshape(-1)
        if x.shape != (self.seq_len,) or p.shape != (self.seq_len,):
            return False
        if (x == PATH).any():
            return False  # inputs never carry a path
        changed = p != x
        if not ((x[changed] == OPEN) & (p[changed] == PATH)).all():
            return False
        grid = p.reshape(self.size, self.size)
        ends = self._endpoints(grid)
        if ends is None:
            return False
        start, goal = ends
        shortest = int(bfs_distances(x.reshape(self.size, self.size) != WALL, start)[goal])
        on_path = (grid == PATH) | (grid == START) | (grid == GOAL)
        if shortest < 0 or int(on_path.sum()) - 1 != shortest:
            return False
        # walk from S: every step must have exactly one unvisited path neighbour until G
        n = self.size
        prev, cur, steps = None, start, 0
        while cur != goal:
            r, c = cur
            nbrs = [
                (a, b)
                for a, b in ((r - 1, c), (r + 1, c), (r, c - 1), (r, c + 1))
                if 0 <= a < n and 0 <= b < n and on_path[a, b] and (a, b) != prev
            ]
            if len(nbrs) != 1:
                return False
            prev, cur = cur, nbrs[0]
            steps += 1
            if steps > shortest:
                return False
        return steps == shortest

    def difficulty(self, inputs: np.ndarray) -> float:
        """Shortest S -> G path length in moves."""
        return float(self.shortest_path_length(inputs))

    label_rule = "walls / S / G changed, a path off the open cells, or not one S and one G"

    def rows_agree(self, inputs: np.ndarray, labels: np.ndarray) -> np.ndarray:
        """Maze-Hard rows: the label keeps walls, S and G, marks the path on open cells only, and the input
        holds one S, one G and no path (shortest-path validity is ``check``'s, per row)."""
        q, a = inputs, labels
        ok = np.where(q == OPEN, (a == OPEN) | (a == PATH), a == q).all(axis=1)
        return ok & ((q == START).sum(1) == 1) & ((q == GOAL).sum(1) == 1) & ~(q == PATH).any(axis=1)

    # ---------------------------------------------------------------- augmentation
    def apply_transform(self, grid: np.ndarray, transform: int) -> np.ndarray:
        """Dihedral transform 0..7 (``square_symmetry``): rotate by 90 * (t % 4) degrees, then mirror left-right
        if t >= 4; a board [T] or [size, size], or rows [N, T] (each row its own board), in the same shape."""
        arr = np.asarray(grid)
        return square_symmetry(arr.reshape(-1, self.size, self.size), transform).reshape(arr.shape)

    def invert(self, grid: np.ndarray, transform: int) -> np.ndarray:
        return self.apply_transform(grid, DIHEDRAL_INVERSE[transform] if 0 <= transform < 8 else transform)

    def augment(self, grid: np.ndarray, rng: np.random.Generator) -> tuple[np.ndarray, int]:
        transform = int(rng.integers(8))
        return self.apply_transform(grid, transform), transform

    # ---------------------------------------------------------------- render
    def render(self, inputs: np.ndarray, prediction: np.ndarray | None = None, markup: bool = False) -> str:
        """The character grid (prediction if given) in a frame (``+--+`` above and below, ``|`` at the
        sides: a maze's open border cells are spaces, so its extent shows only with one); with rich markup
        walls are dim, the path cyan, S / G bold, and path cells placed on a wall or given cell red."""
        x = np.asarray(inputs).reshape(self.size, self.size)
        shown = x if prediction is None else np.asarray(prediction).reshape(self.size, self.size)
        lines = []
        for r in range(self.size):
            row = []
            for c in range(self.size):
                t = int(shown[r, c])
                ch = CHARSET[t - 1] if 1 <= t <= 5 else "?"
                if markup:
                    if t != x[r, c] and not (x[r, c] == OPEN and t == PATH):
                        ch = f"[bold red]{ch}[/bold red]" if ch != " " else "[on red] [/on red]"
                    elif t == WALL:
                        ch = "[dim]#[/dim]"
                    elif t == PATH:
                        ch = "[cyan]o[/cyan]"
                    elif t in (START, GOAL):
                        ch = f"[bold green]{ch}[/bold green]"
                row.append(ch)
            lines.append("|" + "".join(row) + "|")
        edge = "+" + "-" * self.size + "+"
        return "\n".join([edge, *lines, edge])

    # ---------------------------------------------------------------- files
    @staticmethod
    def infer_options(path: str | Path) -> dict[str, Any]:
        """Constructor options for a CSV: ``size`` from the first question's length."""
        q = first_question(path)
        side = int(round(len(q) ** 0.5))
        return {"size": side} if side * side == len(q) and side >= 3 else {}

    def load(self, path: str | Path, progress: Callable[[int], None] | None = None) -> TokenDataset:
        """Read a Maze-Hard CSV (``source,question,answer,rating``); every row is validated (length,
        characters, one S and one G, the answer a valid shortest path of the question); difficulty =
        rating (the BFS length when the rating is empty).  Errors name the file and line; ``progress(n_bytes)``
        is called as blocks are read (``read_puzzle_csv``)."""
        meta = {"task": self.name, "size": self.size}
        return read_puzzle_csv(path, self._parse_csv_row, self.seq_len, meta, progress=progress)

    def _parse_csv_row(self, where: str, question: str, answer: str) -> tuple[np.ndarray, np.ndarray, float]:
        q = self.parse_grid(question, f"{where}: question", allow_path=False)
        a = self.parse_grid(answer, f"{where}: answer")
        counts = ((q == START).sum(), (q == GOAL).sum())
        if counts != (1, 1):
            raise TaskDataError(
                f"{where}: question has {counts[0]} 'S' and {counts[1]} 'G', expected one each"
            )
        length = self.shortest_path_length(q)
        if length < 0:
            raise TaskDataError(f"{where}: G is unreachable from S")
        if not self.check(q, a):
            raise TaskDataError(
                f"{where}: answer inconsistent with question (not a shortest S->G path of length {length} "
                "over open cells, or walls / S / G changed)"
            )
        return q, a, float(length)

    def save(self, dataset: TokenDataset, path: str | Path) -> None:
        """Write a Maze-Hard CSV; rating = ``dataset.difficulty``."""
        write_puzzle_csv(dataset, path, self.seq_len, self.format_grid, f"loopformer-maze{self.size}")
