"""Knowledge-graph multi-hop queries (arXiv 2604.07822, "Loop, Think, & Generalize").

Two tasks share one query format. A query is ``<head entity> <r1> ... <rk>`` and its answer is the
tail reached by following r1, then r2, ..., rk from the head.

Tokens (one vocabulary): entity e -> token e (0..E-1), relation r -> token E + r (E..E+R-1),
PAD -> token E + R; vocabulary E + R + 1. Queries are RIGHT-padded with PAD. A causal model reads
the answer at the LAST query token (the position of r_k): ``labels`` hold the tail entity there
and IGNORE_INDEX everywhere else. Right padding keeps a causal model's view of a query identical
to the unpadded query (the PADs come after the answer position), with or without positions.

* :class:`KGDepthTask` -- depth extrapolation: E entities, R relations, each relation a random
  bijection of the entities (E * R atomic facts: 2000 at 200 x 10). k-hop paths are split
  train / test by a keyed hash of the path, fixed by the task seed, so every ``generate`` call
  agrees on the split and test paths never occur in training; atomic facts (k = 1) are all
  training facts. Difficulty = k.
* :class:`KGSystematicTask` -- systematic generalisation as in "Grokked Transformers" (Wang et al.
  2024): each entity is the head of ``facts_per_entity`` atomic facts (distinct relations, random
  tails); inferred facts (h, r1, r2) -> t through a bridge b with (h, r1, b) and (b, r2, t).
  Entities are split ID / OOD (``ood_fraction``); an atomic fact is ID or OOD by its head. The
  training set holds ALL atomic facts plus inferred facts made of two ID atomic facts, sampled so
  that |train inferred| = inferred_ratio * |ID atomic facts| (the paper's phi); ``test_id`` = the
  other ID inferred facts (seen facts, compositions never trained); ``test_ood`` = inferred facts
  made of two OOD atomic facts (facts seen only atomically, never composed in training). Mixed
  ID/OOD compositions are in no split. Difficulty = hops (1 atomic, 2 inferred).

``check`` follows the relations through a dictionary of atomic facts, independently of the labels.
Files: ``.npz`` (``loopformer.tasks.formats``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from loopformer.tasks.base import IGNORE_INDEX, TaskDataError, TokenDataset, splitmix64
from loopformer.tasks.formats import NpzTask


class _KGQueryTask(NpzTask):
    """Shared query encoding, decoding and checking over a dictionary of atomic facts."""

    causal = True

    def _setup_vocab(self, num_entities: int, num_relations: int) -> None:
        if num_entities < 2 or num_relations < 1:
            raise TaskDataError(f"need >= 2 entities and >= 1 relation, got {num_entities}, {num_relations}")
        self.num_entities = num_entities
        self.num_relations = num_relations
        self.pad = num_entities + num_relations
        self.vocab_size = num_entities + num_relations + 1

    @property
    def facts(self) -> dict[tuple[int, int], int]:
        """Atomic facts as ``{(head entity, relation index): tail entity}``."""
        raise NotImplementedError

    def encode(
        self, heads: np.ndarray, relations: np.ndarray, tails: np.ndarray, width: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Queries of one hop count k (heads [N], relations [N, k], tails [N]) -> right-padded inputs, labels [N, width]."""
        n, k = relations.shape
        if width < k + 1:
            raise TaskDataError(f"width {width} cannot hold a {k}-hop query (needs {k + 1})")
        inputs = np.full((n, width), self.pad, dtype=np.int64)
        inputs[:, 0] = heads
        inputs[:, 1 : k + 1] = relations + self.num_entities
        labels = np.full((n, width), IGNORE_INDEX, dtype=np.int64)
        labels[:, k] = tails
        return inputs, labels

    def parse(self, inputs: np.ndarray) -> tuple[int, list[int]]:
        """One input row -> (head entity, relation indices); raises TaskDataError on a malformed query."""
        tokens = [int(t) for t in np.asarray(inputs).reshape(-1)]
        length = len(tokens)
        while length and tokens[length - 1] == self.pad:
            length -= 1
        if length < 2:
            raise TaskDataError(f"query {tokens} has no relation")
        head, rels = tokens[0], tokens[1:length]
        if not 0 <= head < self.num_entities:
            raise TaskDataError(
                f"query {tokens}: first token {head} is not an entity (0..{self.num_entities - 1})"
            )
        for t in rels:
            if not self.num_entities <= t < self.pad:
                raise TaskDataError(
                    f"query {tokens}: token {t} is not a relation ({self.num_entities}..{self.pad - 1})"
                )
        return head, [t - self.num_entities for t in rels]

    def answer_position(self, inputs: np.ndarray) -> int:
        return len(self.parse(inputs)[1])

    def follow(self, head: int, relations: list[int]) -> list[int]:
        """Entities visited: [head, after r1, ..., after rk], by looking up atomic facts one by one."""
        facts = self.facts
        path = [head]
        for r in relations:
            key = (path[-1], r)
            if key not in facts:
                raise TaskDataError(
                    f"no atomic fact ({path[-1]}, r{r}, ?): the query does not follow the graph"
                )
            path.append(facts[key])
        return path

    def check(self, inputs: np.ndarray, prediction: np.ndarray) -> bool:
        """The prediction at the last query token equals the tail reached by following the relations."""
        head, rels = self.parse(inputs)
        tail = self.follow(head, rels)[-1]
        return int(np.asarray(prediction).reshape(-1)[len(rels)]) == tail

    def difficulty(self, inputs: np.ndarray) -> float:
        return float(len(self.parse(inputs)[1]))

    def render(self, inputs: np.ndarray, prediction: np.ndarray | None = None) -> str:
        def name(t: int) -> str:
            if t == self.pad:
                return "_"
            if 0 <= t < self.num_entities:
                return f"e{t}"
            if self.num_entities <= t < self.pad:
                return f"r{t - self.num_entities}"
            return "?"

        text = " ".join(name(int(t)) for t in np.asarray(inputs).reshape(-1) if int(t) != self.pad)
        if prediction is not None:
            text += " -> " + name(int(np.asarray(prediction).reshape(-1)[self.answer_position(inputs)]))
        return text


class KGDepthTask(_KGQueryTask):
    """Depth extrapolation over random bijective relations (Loop, Think, & Generalize).

    ``generate(n, seed, hops=k)`` or ``(min_hops=a, max_hops=b)`` (k uniform per example), ``split``
    "train" | "test"; the row width is 1 + the largest k of the call unless ``pad_to`` is given. A hop
    count whose share exceeds the distinct paths it has (a small graph: 160 atomic facts at 40 x 4)
    gives all of them and the other hop counts take the rest (``fit_counts``), so a recipe's size holds
    on any graph with enough paths in all; a call that asks for more than every hop has is an error.
    """

    name = "kg_depth"

    def __init__(
        self,
        num_entities: int = 200,
        num_relations: int = 10,
        max_hops: int = 40,
        seed: int = 0,
        test_fraction: float = 0.05,
    ) -> None:
        self._setup_vocab(num_entities, num_relations)
        if max_hops < 1:
            raise TaskDataError(f"max_hops must be >= 1, got {max_hops}")
        if not 0.0 < test_fraction < 1.0:
            raise TaskDataError(f"test_fraction must be in (0, 1), got {test_fraction}")
        self.max_hops = max_hops
        self.seq_len = max_hops + 1  # the widest query; generate pads to its own widest query
        self.seed = seed
        self.test_fraction = test_fraction
        rng = np.random.default_rng([seed, 0x6B67])
        # relation r maps entity e to self.relation_table[r, e]; each row is a permutation
        self.relation_table = np.stack([rng.permutation(num_entities) for _ in range(num_relations)])
        self._facts: dict[tuple[int, int], int] | None = None

    @property
    def facts(self) -> dict[tuple[int, int], int]:
        if self._facts is None:
            self._facts = {
                (e, r): int(self.relation_table[r, e])
                for r in range(self.num_relations)
                for e in range(self.num_entities)
            }
        return self._facts

    def tails(self, heads: np.ndarray, relations: np.ndarray) -> np.ndarray:
        """Vectorised answers: apply relation tables column by column."""
        entity = np.asarray(heads, dtype=np.int64).copy()
        for i in range(relations.shape[1]):
            entity = self.relation_table[relations[:, i], entity]
        return entity

    def path_entities(self, inputs: np.ndarray) -> np.ndarray:
        """[N, W] inputs -> [N, W] entity reached after each query position (-1 past the query): logit-lens targets."""
        inputs = np.atleast_2d(inputs)
        out = np.full(inputs.shape, -1, dtype=np.int64)
        for i, row in enumerate(inputs):
            path = self.follow(*self.parse(row))
            out[i, : len(path)] = path
        return out

    def is_test_path(self, heads: np.ndarray, relations: np.ndarray) -> np.ndarray:
        """The fixed train/test split of k-hop paths (k >= 2): a keyed hash of (k, head, relations)."""
        n, k = relations.shape
        if k < 2:
            return np.zeros(n, dtype=bool)  # atomic facts are all training facts
        h = splitmix64(np.full(n, (self.seed * 1_000_003 + k) & 0xFFFFFFFFFFFF, dtype=np.uint64))
        h = splitmix64(h ^ np.asarray(heads, dtype=np.uint64))
        for i in range(k):
            h = splitmix64(h ^ (relations[:, i].astype(np.uint64) + np.uint64(1 << 32)))
        unit = (h >> np.uint64(11)).astype(np.float64) / float(1 << 53)
        return unit < self.test_fraction

    def _pool(self, k: int, split: str) -> tuple[np.ndarray, np.ndarray] | None:
        """Every k-hop path of ``split`` (heads [P], relations [P, k]) when the path space is small enough
        to enumerate (at most 2**21 paths), else None (a space that large holds more paths than a call asks)."""
        if k == 1 and split == "test":
            raise TaskDataError(
                "atomic facts (1 hop) are all training facts: the test split starts at 2 hops"
            )
        space = self.num_entities * self.num_relations**k
        if space > 1 << 21:
            return None
        index = np.arange(space, dtype=np.int64)
        relations = np.empty((space, k), dtype=np.int64)
        for i in range(k - 1, -1, -1):
            relations[:, i] = index % self.num_relations
            index //= self.num_relations
        keep = self.is_test_path(index, relations) == (split == "test")
        return index[keep], relations[keep]

    def path_count(self, k: int, split: str) -> int | None:
        """How many distinct k-hop paths ``split`` holds (None: too many to enumerate, over 2**21 in all)."""
        pool = self._pool(k, split)
        return None if pool is None else len(pool[0])

    def _sample_paths(
        self,
        n: int,
        k: int,
        split: str,
        rng: np.random.Generator,
        pool: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """n distinct k-hop paths from one split, uniformly at random (``pool``: the split's paths, enumerated)."""
        if pool is None:
            pool = self._pool(k, split)  # None again for a space too large to enumerate
        if pool is not None:
            heads, relations = pool
            if n > len(heads):
                raise TaskDataError(f"only {len(heads)} distinct {k}-hop {split} paths exist, {n} requested")
            pick = rng.choice(len(heads), size=n, replace=False)
            return heads[pick], relations[pick]
        heads_parts, rel_parts = [], []
        seen: set[bytes] = set()
        have = 0
        while have < n:
            m = max(64, 2 * (n - have))
            h = rng.integers(0, self.num_entities, size=m)
            r = rng.integers(0, self.num_relations, size=(m, k))
            keep = self.is_test_path(h, r) == (split == "test")
            for hi, ri in zip(h[keep], r[keep]):
                key = ri.tobytes() + int(hi).to_bytes(8, "little")
                if key in seen:
                    continue
                seen.add(key)
                heads_parts.append(hi)
                rel_parts.append(ri)
                have += 1
                if have == n:
                    break
        return np.asarray(heads_parts, dtype=np.int64), np.asarray(rel_parts, dtype=np.int64).reshape(n, k)

    @staticmethod
    def fit_counts(counts: np.ndarray, room: list[int | None], what: str) -> np.ndarray:
        """Per-hop counts with each hop capped at the paths it has (``room``; None: unlimited) and the rows
        that did not fit moved to the hops with room left, in hop order, evenly; unchanged when all fit."""
        cap = np.array([np.iinfo(np.int64).max if r is None else r for r in room], dtype=np.int64)
        counts = np.asarray(counts, dtype=np.int64)
        if (counts <= cap).all():
            return counts
        total = int(counts.sum())
        if all(r is not None for r in room) and int(cap.sum()) < total:
            raise TaskDataError(f"only {int(cap.sum())} distinct {what} paths exist, {total} requested")
        counts = np.minimum(counts, cap)
        missing = total - int(counts.sum())
        while missing > 0:
            open_hops = np.flatnonzero(counts < cap)
            give = np.minimum(cap[open_hops] - counts[open_hops], max(1, missing // len(open_hops)))
            give = np.minimum(give, np.maximum(missing - (np.cumsum(give) - give), 0))
            counts[open_hops] += give
            missing -= int(give.sum())
        return counts

    def generate(
        self,
        n: int,
        seed: int,
        hops: int | None = None,
        min_hops: int | None = None,
        max_hops: int | None = None,
        split: str = "train",
        pad_to: int | None = None,
    ) -> TokenDataset:
        if split not in ("train", "test"):
            raise TaskDataError(f"split must be 'train' or 'test', got {split!r}")
        if hops is not None:
            lo = hi = int(hops)
        else:
            lo = int(min_hops) if min_hops is not None else (1 if split == "train" else 2)
            hi = int(max_hops) if max_hops is not None else self.max_hops
        if not 1 <= lo <= hi <= self.max_hops:
            raise TaskDataError(f"hops must satisfy 1 <= {lo} <= {hi} <= max_hops={self.max_hops}")
        rng = np.random.default_rng([seed, 0x4B47])
        counts = (
            rng.multinomial(n, np.full(hi - lo + 1, 1.0 / (hi - lo + 1)))
            if n > 0
            else np.zeros(hi - lo + 1, int)
        )
        width = hi + 1 if pad_to is None else int(pad_to)
        pools = {k: self._pool(k, split) for k in range(lo, hi + 1)} if n > 0 else {}
        if pools:  # a hop with fewer distinct paths than its share gives them all; the others take the rest
            room = [None if pool is None else len(pool[0]) for pool in pools.values()]
            counts = self.fit_counts(
                counts, room, f"{lo}-{hi}-hop {split}" if lo < hi else f"{lo}-hop {split}"
            )
        inputs, labels, difficulty = [], [], []
        for k, count in zip(range(lo, hi + 1), counts):
            if count == 0:
                continue
            heads, rels = self._sample_paths(int(count), k, split, rng, pools.get(k))
            x, y = self.encode(heads, rels, self.tails(heads, rels), width)
            inputs.append(x)
            labels.append(y)
            difficulty.append(np.full(int(count), float(k)))
        return self._assemble(
            inputs,
            labels,
            difficulty,
            width,
            rng,
            {"split": split, "min_hops": lo, "max_hops": hi, "seed": seed},
        )

    def atomic_facts(self, width: int = 2) -> TokenDataset:
        """All E * R one-hop facts, ordered by relation then head entity."""
        heads = np.tile(np.arange(self.num_entities), self.num_relations)
        rels = np.repeat(np.arange(self.num_relations), self.num_entities)[:, None]
        x, y = self.encode(heads, rels, self.tails(heads, rels), width)
        return TokenDataset(x, y, np.ones(len(x)), meta=self._meta({"split": "atomic"}))

    def training_set(
        self, max_hops: int, paths_per_hop: int = 15000, seed: int = 0, pad_to: int | None = None
    ) -> TokenDataset:
        """The paper's training mix up to ``max_hops``: all atomic facts plus ``paths_per_hop`` train paths per k >= 2."""
        width = max_hops + 1 if pad_to is None else int(pad_to)
        parts = [self.atomic_facts(width)]
        for k in range(2, max_hops + 1):
            parts.append(self.generate(paths_per_hop, seed + 7919 * k, hops=k, split="train", pad_to=width))
        rng = np.random.default_rng([seed, 0x5453])
        return self._assemble(
            [p.inputs for p in parts],
            [p.labels for p in parts],
            [p.difficulty for p in parts],
            width,
            rng,
            {
                "split": "train",
                "min_hops": 1,
                "max_hops": max_hops,
                "paths_per_hop": paths_per_hop,
                "seed": seed,
            },
        )

    def _meta(self, extra: dict[str, Any]) -> dict[str, Any]:
        return {
            "task": self.name,
            "num_entities": self.num_entities,
            "num_relations": self.num_relations,
            "graph_seed": self.seed,
            "pad": self.pad,
            **extra,
        }

    def _assemble(
        self, inputs: list, labels: list, difficulty: list, width: int, rng: np.random.Generator, extra: dict
    ) -> TokenDataset:
        if not inputs:
            empty = np.zeros((0, width), dtype=np.int64)
            return TokenDataset(empty, empty.copy(), np.zeros(0), meta=self._meta(extra))
        x, y, d = np.concatenate(inputs), np.concatenate(labels), np.concatenate(difficulty)
        order = rng.permutation(len(x))
        return TokenDataset(x[order], y[order], d[order], meta=self._meta(extra))


SYSTEMATIC_SPLITS = ("train", "train_inferred", "atomic", "test_id", "test_ood")


class KGSystematicTask(_KGQueryTask):
    """Two-hop composition with ID / OOD entities (Grokked Transformers; Loop, Think, & Generalize).

    The graph and all splits are fixed by the constructor ``seed``; ``datasets()`` returns every
    split, ``generate(n, seed, split=...)`` a seeded subsample of one (``n <= 0``: all of it).
    Rows are 3 tokens wide: ``h r1 r2`` (inferred) or ``h r PAD`` (atomic).
    """

    name = "kg_systematic"
    seq_len = 3

    def __init__(
        self,
        num_entities: int = 2000,
        num_relations: int = 200,
        facts_per_entity: int = 20,
        inferred_ratio: float = 7.2,
        ood_fraction: float = 0.05,
        seed: int = 0,
    ) -> None:
        self._setup_vocab(num_entities, num_relations)
        if not 1 <= facts_per_entity <= num_relations:
            raise TaskDataError(
                f"facts_per_entity must be in 1..num_relations={num_relations}, got {facts_per_entity}"
            )
        if not 0.0 <= ood_fraction < 1.0 or inferred_ratio < 0:
            raise TaskDataError(
                f"need 0 <= ood_fraction < 1 and inferred_ratio >= 0, got {ood_fraction}, {inferred_ratio}"
            )
        self.facts_per_entity = facts_per_entity
        self.inferred_ratio = inferred_ratio
        self.ood_fraction = ood_fraction
        self.seed = seed
        rng = np.random.default_rng([seed, 0x5359])
        E, F = num_entities, facts_per_entity
        # atomic facts: entity h has F distinct relations with uniformly random tails
        self.atomic_heads = np.repeat(np.arange(E), F)
        self.atomic_relations = np.concatenate(
            [rng.choice(num_relations, F, replace=False) for _ in range(E)]
        )
        self.atomic_tails = rng.integers(0, E, size=E * F)
        self.ood_entities = np.sort(rng.choice(E, int(round(ood_fraction * E)), replace=False))
        self.is_ood = np.zeros(E, dtype=bool)
        self.is_ood[self.ood_entities] = True
        self._facts = {
            (int(h), int(r)): int(t)
            for h, r, t in zip(self.atomic_heads, self.atomic_relations, self.atomic_tails)
        }
        # inferred facts: fact a = (h, r1, b) then fact c = (b, r2, t) for every out-fact c of b
        out_facts = np.arange(E * F).reshape(E, F)  # out_facts[b] = indices of b's atomic facts
        first = np.repeat(np.arange(E * F), F)
        second = out_facts[self.atomic_tails].reshape(-1)
        bridge = self.atomic_tails[first]
        h = self.atomic_heads[first]
        id_mask = ~self.is_ood[h] & ~self.is_ood[bridge]
        ood_mask = self.is_ood[h] & self.is_ood[bridge]
        id_index = np.flatnonzero(id_mask)
        n_id_atomic = int(np.count_nonzero(~self.is_ood[self.atomic_heads]))
        n_train = int(round(inferred_ratio * n_id_atomic))
        if n_train > len(id_index):
            raise TaskDataError(
                f"inferred_ratio {inferred_ratio} needs {n_train} ID inferred facts but only {len(id_index)} exist; "
                f"raise facts_per_entity or lower the ratio"
            )
        id_index = rng.permutation(id_index)
        self._inferred = {"first": first, "second": second}
        self.split_index = {
            "train_inferred": np.sort(id_index[:n_train]),
            "test_id": np.sort(id_index[n_train:]),
            "test_ood": np.flatnonzero(ood_mask),
        }

    @property
    def facts(self) -> dict[tuple[int, int], int]:
        return self._facts

    def bridges(self, inputs: np.ndarray) -> np.ndarray:
        """[N, 3] inputs -> [N] bridge entity of each inferred query (-1 for atomic queries)."""
        inputs = np.atleast_2d(inputs)
        out = np.full(len(inputs), -1, dtype=np.int64)
        for i, row in enumerate(inputs):
            head, rels = self.parse(row)
            if len(rels) == 2:
                out[i] = self.follow(head, rels[:1])[-1]
        return out

    def _inferred_dataset(self, index: np.ndarray, split: str) -> TokenDataset:
        first, second = self._inferred["first"][index], self._inferred["second"][index]
        heads = self.atomic_heads[first]
        rels = np.stack([self.atomic_relations[first], self.atomic_relations[second]], axis=1)
        x, y = self.encode(heads, rels, self.atomic_tails[second], 3)
        meta = self._meta(split)
        # row-aligned (TokenDataset.subset keeps it so); bridges(inputs) recomputes it from the queries
        meta["bridge"] = self.atomic_tails[first].tolist()
        return TokenDataset(x, y, np.full(len(x), 2.0), meta=meta)

    def _atomic_dataset(self) -> TokenDataset:
        x, y = self.encode(self.atomic_heads, self.atomic_relations[:, None], self.atomic_tails, 3)
        meta = self._meta("atomic")
        meta["bridge"] = [-1] * len(x)
        return TokenDataset(x, y, np.ones(len(x)), meta=meta)

    def _meta(self, split: str) -> dict[str, Any]:
        return {
            "task": self.name,
            "split": split,
            "num_entities": self.num_entities,
            "num_relations": self.num_relations,
            "facts_per_entity": self.facts_per_entity,
            "inferred_ratio": self.inferred_ratio,
            "ood_fraction": self.ood_fraction,
            "graph_seed": self.seed,
            "pad": self.pad,
        }

    def dataset(self, split: str) -> TokenDataset:
        """One whole split: "atomic", "train_inferred", "train" (atomic + train_inferred), "test_id", "test_ood"."""
        if split == "atomic":
            return self._atomic_dataset()
        if split in self.split_index:
            return self._inferred_dataset(self.split_index[split], split)
        if split == "train":
            atomic, inferred = (
                self._atomic_dataset(),
                self._inferred_dataset(self.split_index["train_inferred"], "train"),
            )
            meta = dict(inferred.meta, bridge=atomic.meta["bridge"] + inferred.meta["bridge"])
            return TokenDataset(
                np.concatenate([atomic.inputs, inferred.inputs]),
                np.concatenate([atomic.labels, inferred.labels]),
                np.concatenate([atomic.difficulty, inferred.difficulty]),
                meta=meta,
            )
        raise TaskDataError(f"unknown split {split!r} (known: {', '.join(SYSTEMATIC_SPLITS)})")

    def datasets(self) -> dict[str, TokenDataset]:
        return {name: self.dataset(name) for name in SYSTEMATIC_SPLITS}

    def generate(self, n: int, seed: int, split: str = "train") -> TokenDataset:
        """A seeded random subsample of ``n`` rows of one split (all rows, shuffled, when n <= 0)."""
        full = self.dataset(split)
        rng = np.random.default_rng([seed, 0x4745])
        if n > len(full):
            raise TaskDataError(f"split {split!r} has {len(full)} rows, {n} requested")
        pick = rng.permutation(len(full)) if n <= 0 else rng.choice(len(full), size=n, replace=False)
        out = full.subset(pick)  # meta["bridge"] is row-aligned: subset picks its entries too
        out.meta["seed"] = seed
        return out
