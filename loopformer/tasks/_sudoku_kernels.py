"""Numba kernels of the Sudoku solver and generator (imported lazily by ``sudoku_solver``).

Candidates are bitmasks (bit d-1 = digit d) in an int64 array of cells.  ``propagate`` applies naked and
hidden singles to a fixed point; ``search`` is depth-first search on the first cell with the fewest
candidates (MRV), digits tried lowest first, counting refuted branches (``backtracks``).  The fixed point
of the singles rules does not depend on the order they are applied in, so the counts and solutions are a
function of the puzzle alone.

The generator's randomness is CPython's Mersenne Twister (``random.Random``) reproduced here word for
word: the caller passes ``random.Random(seed).getstate()`` and the kernel draws exactly what
``Random.shuffle`` would, so a seed gives the same puzzle as the pure-Python generator it replaces.
"""

from __future__ import annotations

import numba  # a dependency of loopformer (pyproject.toml); NUMBA_DISABLE_JIT=1 runs the kernels as plain Python
import numpy as np

_jit = numba.njit(cache=True, nogil=True)

_N = 624
_M = 397


@_jit
def _mt_twist(mt: np.ndarray) -> None:
    for k in range(_N):
        y = (mt[k] & 0x80000000) | (mt[(k + 1) % _N] & 0x7FFFFFFF)
        v = mt[(k + _M) % _N] ^ (y >> 1)
        if y & 1:
            v ^= 0x9908B0DF
        mt[k] = v


@_jit
def _mt_uint32(mt: np.ndarray) -> int:
    """Next 32-bit word; ``mt[624]`` holds the position (CPython's ``index``)."""
    i = mt[_N]
    if i >= _N:
        _mt_twist(mt)
        i = 0
    y = mt[i]
    mt[_N] = i + 1
    y ^= y >> 11
    y ^= (y << 7) & 0x9D2C5680
    y ^= (y << 15) & 0xEFC60000
    y ^= y >> 18
    return y & 0xFFFFFFFF


@_jit
def _randbelow(mt: np.ndarray, n: int) -> int:
    """CPython's ``Random._randbelow_with_getrandbits`` for 2 <= n < 2**32."""
    k = 0
    while (n >> k) != 0:
        k += 1
    r = _mt_uint32(mt) >> (32 - k)
    while r >= n:
        r = _mt_uint32(mt) >> (32 - k)
    return r


@_jit
def _shuffle(mt: np.ndarray, x: np.ndarray, length: int) -> None:
    """CPython's ``Random.shuffle`` on ``x[:length]``."""
    for i in range(length - 1, 0, -1):
        j = _randbelow(mt, i + 1)
        t = x[i]
        x[i] = x[j]
        x[j] = t


@_jit
def propagate(
    peers: np.ndarray, units: np.ndarray, full: int, cand: np.ndarray, queue: np.ndarray, qlen: int
) -> bool:
    """Naked and hidden singles to a fixed point; ``queue[:qlen]`` holds newly fixed cells.  False on a
    contradiction.  A cell enters the queue only when it becomes single, so ``cells`` slots suffice."""
    npeers = peers.shape[1]
    while True:
        while qlen > 0:
            qlen -= 1
            cell = queue[qlen]
            bit = cand[cell]
            for k in range(npeers):
                p = peers[cell, k]
                m = cand[p]
                if m & bit:
                    m ^= bit
                    if m == 0:
                        return False
                    cand[p] = m
                    if m & (m - 1) == 0:
                        queue[qlen] = p
                        qlen += 1
        for u in range(units.shape[0]):
            once = 0
            twice = 0
            for j in range(units.shape[1]):
                m = cand[units[u, j]]
                twice |= once & m
                once |= m
            if once != full:
                return False
            hidden = once & ~twice
            if hidden:
                for j in range(units.shape[1]):
                    c = units[u, j]
                    m = cand[c]
                    h = m & hidden
                    if h and m != h:
                        if h & (h - 1):
                            return False  # two digits that must both go in this one cell
                        cand[c] = h
                        queue[qlen] = c
                        qlen += 1
        if qlen == 0:
            return True


@_jit
def _mrv(cand: np.ndarray) -> int:
    """First cell with the fewest (>= 2) candidates, -1 when every cell is fixed."""
    best = -1
    best_count = 1 << 30
    for i in range(cand.shape[0]):
        m = cand[i]
        if m & (m - 1):
            k = 0
            while m:
                m &= m - 1
                k += 1
            if k < best_count:
                best = i
                best_count = k
                if k == 2:
                    break
    return best


@_jit
def search(
    peers: np.ndarray,
    units: np.ndarray,
    full: int,
    root: np.ndarray,
    limit: int,
    solution: np.ndarray,
    mt: np.ndarray,
    shuffled: bool,
) -> tuple[int, int]:
    """Depth-first search from propagated candidates ``root``: (solutions found, up to ``limit``;
    refuted branches).  The first solution's masks go to ``solution``.  ``shuffled``: try each cell's
    digits in ``Random.shuffle`` order drawn from ``mt`` (the full-grid generator) instead of lowest first."""
    cells = root.shape[0]
    size = units.shape[1]
    stack = np.empty((cells + 1, cells), dtype=np.int64)
    options = np.empty((cells + 1, size), dtype=np.int64)
    n_opts = np.zeros(cells + 1, dtype=np.int64)
    next_opt = np.zeros(cells + 1, dtype=np.int64)
    cell_at = np.zeros(cells + 1, dtype=np.int64)
    queue = np.empty(cells, dtype=np.int64)
    found = 0
    backtracks = 0
    stack[0, :] = root
    depth = 0
    entering = True
    while depth >= 0:
        if entering:
            best = _mrv(stack[depth])
            if best < 0:
                if found == 0:
                    solution[:] = stack[depth]
                found += 1
                if found >= limit:
                    return found, backtracks
                depth -= 1
                entering = False
                continue
            m = stack[depth, best]
            k = 0
            while m:
                low = m & -m
                options[depth, k] = low
                k += 1
                m ^= low
            if shuffled:
                _shuffle(mt, options[depth], k)
            n_opts[depth] = k
            next_opt[depth] = 0
            cell_at[depth] = best
        j = next_opt[depth]
        if j >= n_opts[depth]:
            depth -= 1
            entering = False
            continue
        next_opt[depth] = j + 1
        child = stack[depth + 1]
        child[:] = stack[depth]
        best = cell_at[depth]
        child[best] = options[depth, j]
        queue[0] = best
        if propagate(peers, units, full, child, queue, 1):
            depth += 1
            entering = True
        else:
            backtracks += 1
            entering = False
    return found, backtracks


@_jit
def initial_candidates(
    peers: np.ndarray, units: np.ndarray, full: int, digits: np.ndarray, cand: np.ndarray
) -> bool:
    """Propagated candidates of ``digits`` (0 = blank) into ``cand``; False when the givens contradict."""
    cells = digits.shape[0]
    queue = np.empty(cells, dtype=np.int64)
    qlen = 0
    for cell in range(cells):
        d = digits[cell]
        if d:
            cand[cell] = 1 << (d - 1)
            queue[qlen] = cell
            qlen += 1
        else:
            cand[cell] = full
    for u in range(units.shape[0]):
        seen = 0
        for j in range(units.shape[1]):
            m = cand[units[u, j]]
            if m & (m - 1) == 0:
                if seen & m:
                    return False
                seen |= m
    return propagate(peers, units, full, cand, queue, qlen)


@_jit
def _peer_candidates(
    cell_units: np.ndarray, full: int, n_units: int, digits: np.ndarray, cand: np.ndarray
) -> None:
    """Givens' digits eliminated from their peers only (no propagation)."""
    used = np.zeros(n_units, dtype=np.int64)
    for cell in range(digits.shape[0]):
        d = digits[cell]
        if d:
            bit = 1 << (d - 1)
            for t in range(3):
                used[cell_units[cell, t]] |= bit
    for cell in range(digits.shape[0]):
        d = digits[cell]
        if d:
            cand[cell] = 1 << (d - 1)
        else:
            cand[cell] = full & ~(
                used[cell_units[cell, 0]] | used[cell_units[cell, 1]] | used[cell_units[cell, 2]]
            )


@_jit
def masks_to_digits(cand: np.ndarray, out: np.ndarray) -> None:
    for i in range(cand.shape[0]):
        m = cand[i]
        d = 0
        while m:
            m >>= 1
            d += 1
        out[i] = d


@_jit
def generate_one(
    peers: np.ndarray,
    units: np.ndarray,
    cell_units: np.ndarray,
    full: int,
    mt: np.ndarray,
    target_blanks: int,
    givens: np.ndarray,
    solution: np.ndarray,
) -> int:
    """One unique-solution puzzle into ``givens`` / ``solution`` (digits); returns its blank count.

    A random full grid (shuffled search on the empty grid), then clues removed in ``Random.shuffle``
    order until ``target_blanks``: removing clue v at cell c keeps the solution unique iff no solution
    puts another digit at c (one existence search); a clue whose peers exclude every other digit goes
    without search.  The count may fall short of the target (a minimal puzzle)."""
    cells = givens.shape[0]
    n_units = units.shape[0]
    root = np.full(cells, full, dtype=np.int64)
    grid = np.empty(cells, dtype=np.int64)
    search(peers, units, full, root, 1, grid, mt, True)
    masks_to_digits(grid, solution)
    givens[:] = solution
    order = np.arange(cells)
    _shuffle(mt, order, cells)
    cand = np.empty(cells, dtype=np.int64)
    queue = np.empty(cells, dtype=np.int64)
    scratch = np.empty(cells, dtype=np.int64)
    blanks = 0
    for cell in order:
        if blanks >= target_blanks:
            break
        v = givens[cell]
        givens[cell] = 0
        seen = 0
        for k in range(peers.shape[1]):
            d = givens[peers[cell, k]]
            if d:
                seen |= 1 << (d - 1)
        if full & ~seen != 1 << (v - 1):
            _peer_candidates(cell_units, full, n_units, givens, cand)
            cand[cell] &= ~(1 << (v - 1))
            if cand[cell]:
                qlen = 0
                for i in range(cells):
                    m = cand[i]
                    if givens[i] == 0 and m & (m - 1) == 0:
                        queue[qlen] = i
                        qlen += 1
                if propagate(peers, units, full, cand, queue, qlen):
                    if search(peers, units, full, cand, 1, scratch, mt, False)[0] > 0:
                        givens[cell] = v
                        continue
        blanks += 1
    return blanks
