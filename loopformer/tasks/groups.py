"""Group word problems (state tracking): running products of permutations (arXiv 2606.18206; Merrill et al., arXiv 2404.08819).

A word is a sequence of group elements g_0, g_1, ..., g_{T-1}; the label at position i is the
running product p_i = g_i o g_{i-1} o ... o g_0, the state reached after applying g_0 first,
then g_1, and so on. Elements are permutations of {0..n-1} written as tuples ``s`` with
``s[x]`` the image of x, and composition is ``(a o b)[x] = a[b[x]]`` (apply b, then a); so
``p_i[x] = g_i[p_{i-1}[x]]``. Non-abelian groups (S3, A5, S5...) make the order matter;
A5 and S5 word problems are NC1-complete (Merrill et al., "The Illusion of State"), which is why
fixed-depth transformers fail at lengths beyond training and looped models are tested on them.

Groups: ``Z<n>`` (or ``C<n>``, cyclic: rotations of n points), ``D<n>`` (dihedral, symmetries of
the n-gon, 2n elements), ``S<n>`` (symmetric, n! elements, n <= 8), ``A<n>`` (alternating, even
permutations). Elements are listed in lexicographic order of their tuples, so the identity is
always element 0.

Tokens: element id e (0-based, in that order) is token e + 1; token 0 is PAD (vocabulary |G| + 1:
61 for A5, 121 for S5, as in FPRM). Labels use the same element tokens; PAD positions carry
IGNORE_INDEX. The task is causal: the label at i depends on inputs 0..i only. ``generate(..., pad_to=W)``
stores words at W positions (PAD after the word), as FPRM's training words are stored at the test length.
Difficulty is the word length. Files: ``.npz`` (``loopformer.tasks.formats.NpzTask``).
"""

from __future__ import annotations

import itertools
import re
from functools import cached_property
from typing import Any

import numpy as np

from loopformer.tasks.base import IGNORE_INDEX, TaskDataError, TokenDataset
from loopformer.tasks.formats import NpzTask

Perm = tuple[int, ...]

PAD = 0
MAX_SYMMETRIC_DEGREE = 8  # S8 has 40,320 elements; beyond that the element table is too large


def compose(a: Perm, b: Perm) -> Perm:
    """``a o b``: apply b first, then a, i.e. ``(a o b)[x] = a[b[x]]``."""
    return tuple(a[x] for x in b)


def inverse(a: Perm) -> Perm:
    out = [0] * len(a)
    for x, y in enumerate(a):
        out[y] = x
    return tuple(out)


def cycles(p: Perm) -> list[list[int]]:
    """The cycle decomposition of ``p``, fixed points included, each cycle from its smallest point."""
    seen = [False] * len(p)
    out = []
    for start in range(len(p)):
        cycle, x = [], start
        while not seen[x]:
            seen[x] = True
            cycle.append(x)
            x = p[x]
        if cycle:
            out.append(cycle)
    return out


def is_even(p: Perm) -> bool:
    """Parity from the cycle decomposition: a k-cycle is a product of k - 1 transpositions."""
    return sum(len(c) - 1 for c in cycles(p)) % 2 == 0


def cycle_notation(p: Perm) -> str:
    """Cycle notation with points numbered from 1, e.g. ``(1 2 3)(4 5)``; the identity is ``e``."""
    return "".join("(" + " ".join(str(x + 1) for x in c) + ")" for c in cycles(p) if len(c) > 1) or "e"


def _closure(generators: list[Perm], degree: int) -> list[Perm]:
    identity = tuple(range(degree))
    elements = {identity}
    frontier = [identity]
    while frontier:
        nxt = []
        for a in frontier:
            for g in generators:
                c = compose(g, a)
                if c not in elements:
                    elements.add(c)
                    nxt.append(c)
        frontier = nxt
    return sorted(elements)


def group_elements(name: str) -> list[Perm]:
    """The elements of the named group as permutation tuples, in lexicographic order."""
    match = re.fullmatch(r"([ZCDSA])(\d+)", name.strip().upper())
    if match is None:
        raise TaskDataError(f"unknown group {name!r}: expected Z<n>, C<n>, D<n>, S<n> or A<n> (e.g. 'S5')")
    kind, n = match.group(1), int(match.group(2))
    if n < 1:
        raise TaskDataError(f"group {name!r}: degree must be >= 1")
    if kind in "ZC":
        return sorted(tuple((x + k) % n for x in range(n)) for k in range(n))
    if kind == "D":
        if n < 3:
            raise TaskDataError(f"dihedral group {name!r} needs n >= 3")
        rotation = tuple((x + 1) % n for x in range(n))
        reflection = tuple((-x) % n for x in range(n))
        return _closure([rotation, reflection], n)
    if n > MAX_SYMMETRIC_DEGREE:
        raise TaskDataError(f"group {name!r}: degree {n} > {MAX_SYMMETRIC_DEGREE} is too large to enumerate")
    perms = list(itertools.permutations(range(n)))  # lexicographic
    if kind == "A":
        perms = [p for p in perms if is_even(p)]
    return perms


class GroupTask(NpzTask):
    """Running products of random words over a finite permutation group (causal).

    ``GroupTask(group="S5", length=32)``; ``generate(n, seed, length=128)`` makes longer test words.
    """

    causal = True

    def __init__(self, group: str = "S5", length: int = 32) -> None:
        if length < 1:
            raise TaskDataError(f"length must be >= 1, got {length}")
        self.group = group.strip().upper()
        self.elements: list[Perm] = group_elements(self.group)
        self.index: dict[Perm, int] = {p: i for i, p in enumerate(self.elements)}
        self.order = len(self.elements)
        self.name = "groups"
        self.vocab_size = self.order + 1
        self.seq_len = length

    @cached_property
    def table(self) -> np.ndarray:
        """Multiplication table: ``table[a, b]`` = id of ``elements[a] o elements[b]`` (b first)."""
        table = np.empty((self.order, self.order), dtype=np.int64)
        for i, a in enumerate(self.elements):
            for j, b in enumerate(self.elements):
                table[i, j] = self.index[compose(a, b)]
        return table

    def running_products(self, element_ids: np.ndarray) -> np.ndarray:
        """Element ids [N, T] -> running product ids [N, T] (vectorised over N with the table)."""
        element_ids = np.asarray(element_ids, dtype=np.int64)
        out = np.empty_like(element_ids)
        state = np.zeros(len(element_ids), dtype=np.int64)  # identity is element 0
        for i in range(element_ids.shape[1]):
            state = self.table[element_ids[:, i], state]
            out[:, i] = state
        return out

    def generate(
        self, n: int, seed: int, length: int | None = None, pad_to: int | None = None, **unused: Any
    ) -> TokenDataset:
        """``n`` words of ``length`` elements; ``pad_to`` > ``length`` appends PAD inputs (labels
        IGNORE_INDEX) up to that many positions, as FPRM's builder stores its training words at the
        test length (nilskiKonjIzDunava/fprm ``dataset/build_state_tracking_dataset.py`` ``build``:
        ``seq_len = k_eval_max``), so the model runs, and its fixed-point residual is measured, over
        the padding too. The words drawn do not depend on ``pad_to``."""
        if unused:
            raise TypeError(f"GroupTask.generate got unknown options {sorted(unused)}")
        length = self.seq_len if length is None else int(length)
        if length < 1 or n < 0:
            raise TaskDataError(f"need n >= 0 and length >= 1, got n={n}, length={length}")
        width = length if pad_to is None else int(pad_to)
        if width < length:
            raise TaskDataError(f"pad_to must be >= the word length {length}, got {pad_to}")
        rng = np.random.default_rng(seed)
        ids = rng.integers(0, self.order, size=(n, length), dtype=np.int64)
        inputs = np.full((n, width), PAD, dtype=np.int64)
        labels = np.full((n, width), IGNORE_INDEX, dtype=np.int64)
        inputs[:, :length] = ids + 1
        labels[:, :length] = self.running_products(ids) + 1
        return TokenDataset(
            inputs=inputs,
            labels=labels,
            difficulty=np.full(n, float(length)),
            meta={
                "task": self.name,
                "group": self.group,
                "order": self.order,
                "length": length,
                "width": width,
                "seed": seed,
            },
        )

    def prefix_correct(self, inputs: np.ndarray, prediction: np.ndarray) -> np.ndarray:
        """bool [T]: True at i when predictions 0..i are all the true running products.

        Recomputed by composing the permutations directly (no table). PAD input positions
        are skipped (they keep the previous value).
        """
        inputs = np.asarray(inputs).reshape(-1)
        prediction = np.asarray(prediction).reshape(-1)
        if inputs.shape != prediction.shape:
            raise TaskDataError(f"inputs {inputs.shape} and prediction {prediction.shape} differ in shape")
        state: Perm = tuple(range(len(self.elements[0])))
        ok = True
        out = np.zeros(len(inputs), dtype=bool)
        for i, (x, y) in enumerate(zip(inputs.tolist(), prediction.tolist())):
            if x != PAD:
                if not 1 <= x <= self.order:
                    raise TaskDataError(
                        f"group {self.group}: input token {x} at position {i} outside 1..{self.order}"
                    )
                state = compose(self.elements[x - 1], state)
                ok = ok and 1 <= y <= self.order and self.elements[y - 1] == state
            out[i] = ok
        return out

    def check(self, inputs: np.ndarray, prediction: np.ndarray) -> bool:
        """True when every non-PAD position predicts the running product (permutations composed directly)."""
        correct = self.prefix_correct(inputs, prediction)
        return bool(correct[-1]) if len(correct) else True

    def difficulty(self, inputs: np.ndarray) -> float:
        return float(np.count_nonzero(np.asarray(inputs) != PAD))

    def render(self, inputs: np.ndarray, prediction: np.ndarray | None = None) -> str:
        tokens = inputs if prediction is None else prediction
        return " ".join(
            "_"
            if int(t) == PAD
            else cycle_notation(self.elements[int(t) - 1])
            if 0 < int(t) <= self.order
            else "?"
            for t in np.asarray(tokens).reshape(-1)
        )
