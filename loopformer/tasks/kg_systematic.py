"""Knowledge-graph systematic generalisation: two-hop composition with ID / OOD entities.

The task is described in ``loopformer.tasks.kg`` (it shares the query encoding, decoding and
checking of ``_KGQueryTask`` with ``KGDepthTask``); it lives in its own module so that each task
module stays small.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from loopformer.tasks.base import TaskDataError, TokenDataset
from loopformer.tasks.kg import _KGQueryTask

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
        # row-aligned when created; after subset() use bridges(inputs), which recomputes it
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
        out = full.subset(pick)
        out.meta["bridge"] = [full.meta["bridge"][i] for i in pick]
        out.meta["seed"] = seed
        return out
