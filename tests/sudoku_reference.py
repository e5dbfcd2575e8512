"""The pure-Python Sudoku solver and generator that loopformer used before its Numba kernels, kept as
the test oracle: the compiled kernels must reproduce its solutions, backtrack counts and generated
puzzles exactly (tests/test_sudoku_solver.py)."""

from __future__ import annotations

import random
from collections.abc import Iterable

from loopformer.tasks.sudoku_solver import SudokuGeometry


def _propagate(geo: SudokuGeometry, cand: list[int], queue: list[int]) -> bool:
    """Naked and hidden singles to a fixed point; ``queue`` holds newly fixed cells. False on contradiction."""
    peers, units, full = geo.peers, geo.units, geo.full
    while True:
        while queue:
            cell = queue.pop()
            bit = cand[cell]
            for p in peers[cell]:
                m = cand[p]
                if m & bit:
                    m ^= bit
                    if not m:
                        return False
                    cand[p] = m
                    if not m & (m - 1):
                        queue.append(p)
        for unit in units:
            once = twice = 0
            for c in unit:
                m = cand[c]
                twice |= once & m
                once |= m
            if once != full:
                return False
            hidden = once & ~twice
            if hidden:
                for c in unit:
                    m = cand[c]
                    h = m & hidden
                    if h and m != h:
                        if h & (h - 1):
                            return False  # two digits that must both go in this one cell
                        cand[c] = h
                        queue.append(c)
        if not queue:
            return True


def _bits(mask: int) -> list[int]:
    out = []
    while mask:
        low = mask & -mask
        out.append(low)
        mask ^= low
    return out


class _Search:
    """Depth-first search with MRV; collects up to ``limit`` solutions and counts refuted branches."""

    def __init__(self, geo: SudokuGeometry, limit: int, rng: random.Random | None = None) -> None:
        self.geo, self.limit, self.rng = geo, limit, rng
        self.solutions: list[list[int]] = []
        self.backtracks = 0

    def run(self, cand: list[int]) -> None:
        best, best_count = -1, 1 << 30
        for i, m in enumerate(cand):
            if m & (m - 1):
                k = m.bit_count()
                if k < best_count:
                    best, best_count = i, k
                    if k == 2:
                        break
        if best < 0:
            self.solutions.append(cand)
            return
        options = _bits(cand[best])
        if self.rng is not None:
            self.rng.shuffle(options)
        for bit in options:
            child = cand[:]
            child[best] = bit
            if _propagate(self.geo, child, [best]):
                self.run(child)
                if len(self.solutions) >= self.limit:
                    return
            else:
                self.backtracks += 1


def _initial_candidates(geo: SudokuGeometry, digits: Iterable[int]) -> list[int] | None:
    """Candidate masks from digits (0 = blank); None when the givens contradict each other."""
    cand, queue = [], []
    for cell, d in enumerate(digits):
        if d:
            cand.append(1 << (d - 1))
            queue.append(cell)
        else:
            cand.append(geo.full)
    # explicit duplicate check: propagation alone would also catch it, but only via emptied peers
    for unit in geo.units:
        seen = 0
        for c in unit:
            m = cand[c]
            if not m & (m - 1):
                if seen & m:
                    return None
                seen |= m
    if not _propagate(geo, cand, queue):
        return None
    return cand


def _peer_candidates(geo: SudokuGeometry, digits: list[int]) -> list[int]:
    """Candidates of consistent givens after eliminating only the givens' digits from their peers
    (no propagation): cheap, and enough to start ``_propagate`` with the blank naked singles queued."""
    used = [0] * len(geo.units)
    cell_units = geo.cell_units
    for cell, d in enumerate(digits):
        if d:
            bit = 1 << (d - 1)
            a, b, c = cell_units[cell]
            used[a] |= bit
            used[b] |= bit
            used[c] |= bit
    full = geo.full
    out = []
    for cell, d in enumerate(digits):
        if d:
            out.append(1 << (d - 1))
        else:
            a, b, c = cell_units[cell]
            out.append(full & ~(used[a] | used[b] | used[c]))
    return out


def _masks_to_digits(cand: list[int]) -> list[int]:
    return [m.bit_length() for m in cand]


def _generate_one(geo: SudokuGeometry, seed: int, target_blanks: int) -> tuple[list[int], list[int], int]:
    """One unique-solution puzzle: (givens digits, solution digits, blanks); blanks may fall short of target."""
    rng = random.Random(seed)
    search = _Search(geo, 1, rng)
    search.run([geo.full] * geo.cells)
    solution = _masks_to_digits(search.solutions[0])
    givens = solution[:]
    order = list(range(geo.cells))
    rng.shuffle(order)
    full, peers = geo.full, geo.peers
    blanks = 0
    for cell in order:
        if blanks >= target_blanks:
            break
        v = givens[cell]
        givens[cell] = 0
        seen = 0
        for p in peers[cell]:
            d = givens[p]
            if d:
                seen |= 1 << (d - 1)
        if full & ~seen != 1 << (v - 1):
            # unique iff no solution puts another digit at this cell
            cand = _peer_candidates(geo, givens)
            cand[cell] &= ~(1 << (v - 1))
            alt = cand[cell]
            if alt and _propagate(
                geo, cand, [i for i, m in enumerate(cand) if not givens[i] and not m & (m - 1)]
            ):
                probe = _Search(geo, 1)
                probe.run(cand)
                if probe.solutions:
                    givens[cell] = v
                    continue
        blanks += 1
    return givens, solution, blanks


def _generate_worker(
    args: tuple[int, tuple[int, int], int, int, int, int],
) -> tuple[list[int], list[int], int, int]:
    size, box, sub_seed, min_blanks, max_blanks, min_backtracks = args
    geo = SudokuGeometry(size, box)
    rng = random.Random(sub_seed)
    for _attempt in range(200):
        target = rng.randint(min_blanks, max_blanks)
        givens, solution, blanks = _generate_one(geo, rng.getrandbits(63), target)
        if blanks < min_blanks:
            continue
        search = _Search(geo, 2)
        search.run(_initial_candidates(geo, givens))  # type: ignore[arg-type]
        if search.backtracks < min_backtracks:
            continue
        return givens, solution, blanks, search.backtracks
    raise ValueError(
        f"could not reach min_blanks={min_blanks} / min_backtracks={min_backtracks} on a {size}x{size} "
        "sudoku in 200 attempts; lower the requirement"
    )
