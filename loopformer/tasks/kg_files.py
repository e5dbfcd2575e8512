"""Knowledge-graph query files as the Loop, Think & Generalize and Grokked-Transformers code write them.

Format (github OSU-NLP-Group/Loop-Think-Generalize, ``getNhopfact.py`` / ``create_dataset.py``; the
Grokked-Transformers ``composition.*`` folders use the same one): a folder holding ``vocab.json`` (a JSON
list of tokens; ``<pad>`` is put first when missing, as the reference's ``load_vocab`` does) and JSON lists
of records ``{"input_text": "<e_3><r_1><r_7>", "target_text": "<e_3><r_1><r_7><e_9></a>", "type": "3hop_test"}``
(``train.json``, ``test.json``, ``valid.json``, ...). Tokens are the ``<...>`` pieces of the strings
(the reference's ``re.compile(r'<[^>]+>')``), ids are their vocabulary positions, so a model converted
with ``loopformer convert ltg`` reads them unchanged.

Encoding: inputs right-padded with ``<pad>`` (id 0) to ``width`` (default: the longest query); the label is
the last token of ``target_text`` without ``</a>`` at the prediction position, IGNORE_INDEX elsewhere.
``pred_pos``: ``answer`` (default) puts it at the query's last token (the reference's ``pred_pos="inp_len"``);
``last`` at position ``width - 1``, a pad position for shorter queries (``pred_pos="last_token"``, the
default of ``train_extrapolation.py``, which pads to ``--max_len`` 50: set ``width: 50``;
``train_systematicity.py`` reads ``logits[:, -1]`` of each batch padded to its longest query, which is
``width`` = the longest query whenever a batch holds one). A model reading ``last`` should mask padding keys
as the reference does (``model.pad_mask: true``) and halt on that position (``model.halt_position: last``). ``difficulty`` is the hop count (tokens - 1); the
record's ``type`` is kept in ``meta["types"]``.

``check`` follows the relations through the atomic facts of the folder's ``train.json`` (records whose
query is one entity and one relation), so it judges a prediction without the stored label; a query
that needs a fact the training file does not hold cannot be judged and counts as wrong.

Task options: ``path`` (the folder), ``width`` (optional), ``pred_pos`` (``answer`` | ``last``). ``data.train_path`` / ``data.eval_path`` name
files inside the folder (``train.json``, ``test.json``) or any path; ``data.options.types`` keeps only
records of those types (e.g. ``["2hop_test", "3hop_test"]``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np

from loopformer.files import read_json
from loopformer.tasks.base import IGNORE_INDEX, Task, TaskDataError, TokenDataset

TOKEN = re.compile(r"<[^>]+>")
PAD, END = "<pad>", "</a>"
PRED_POS = ("answer", "last")


def _vocabulary(path: Path) -> list[str]:
    """vocab.json's tokens: a JSON list of distinct ``<...>`` strings (``<pad>`` put first when missing)."""
    tokens = read_json(path, TaskDataError)
    if not isinstance(tokens, list):
        raise TaskDataError(f"{path} must be a JSON list of token strings, got {type(tokens).__name__}")
    seen: dict[str, int] = {}
    for i, token in enumerate(tokens):
        if not isinstance(token, str):
            raise TaskDataError(f"{path}: entry {i} is {type(token).__name__}, not a token string")
        if not TOKEN.fullmatch(token):
            raise TaskDataError(f"{path}: entry {i} {token[:40]!r} is not one <...> token")
        if token in seen:
            raise TaskDataError(f"{path}: entry {i} {token!r} repeats entry {seen[token]}")
        seen[token] = i
    return tokens if PAD in seen else [PAD, *tokens]


class KGFilesTask(Task):
    name = "kg_files"
    causal = True

    def __init__(
        self, path: str | Path, width: int = 0, types: list[str] | None = None, pred_pos: str = "answer"
    ) -> None:
        if pred_pos not in PRED_POS:
            raise TaskDataError(f"kg_files: pred_pos {pred_pos!r} is not one of {PRED_POS}")
        if isinstance(width, bool) or not isinstance(width, int) or width < 0:
            raise TaskDataError(f"kg_files: width must be an integer >= 0 (0 = the longest query), got {width!r}")
        if types is not None and (not isinstance(types, list) or not all(isinstance(t, str) for t in types)):
            raise TaskDataError(f"kg_files: types must be a list of record types (strings), got {types!r}")
        self.pred_pos = pred_pos
        self.root = Path(path)
        if not self.root.is_dir():
            raise TaskDataError(f"kg_files: {self.root} is not a folder (expected vocab.json and train.json inside)")
        tokens = _vocabulary(self.root / "vocab.json")
        self.tokens = tokens
        self.vocab = {t: i for i, t in enumerate(tokens)}
        self.vocab_size = len(tokens)
        self.pad = self.vocab[PAD]
        self.width = int(width)
        self.seq_len = self.width
        self.types = set(types) if types else None
        self._facts: dict[tuple[int, int], int] | None = None

    # -- reading ---------------------------------------------------------------------------------
    def _ids(self, text: str, where: str) -> list[int]:
        pieces = TOKEN.findall(text)
        unknown = [p for p in pieces if p not in self.vocab]
        if unknown or not pieces:
            raise TaskDataError(
                f"{where}: {'unknown tokens ' + str(unknown[:5]) if unknown else 'no <...> tokens'}"
            )
        return [self.vocab[p] for p in pieces]

    def records(self, path: str | Path, numbered: bool = False) -> list[Any]:
        """(query ids, answer id, type) per record of ``path`` (a name inside the folder or a path); with
        ``numbered``, (record number in the file, query ids, answer id, type)."""
        file = Path(path) if Path(path).exists() else self.root / path
        data = read_json(file, TaskDataError)
        if not isinstance(data, list):
            raise TaskDataError(f"{file} must hold a JSON list of records, got {type(data).__name__}")
        out = []
        for i, rec in enumerate(data):
            where = f"{file} record {i}"
            if not isinstance(rec, dict) or "input_text" not in rec or "target_text" not in rec:
                raise TaskDataError(f"{where}: needs 'input_text' and 'target_text'")
            for key in ("input_text", "target_text", "type"):
                if key in rec and not isinstance(rec[key], str):
                    raise TaskDataError(f"{where}: {key!r} is {type(rec[key]).__name__}, not a string")
            kind = rec.get("type", "")
            if self.types is not None and kind not in self.types:
                continue
            query, answer = self._record(rec["input_text"], rec["target_text"], where)
            out.append((i, query, answer, kind) if numbered else (query, answer, kind))
        return out

    def _record(self, input_text: str, target_text: str, where: str) -> tuple[list[int], int]:
        """(query ids, answer id) of one record: a query of an entity and relations, no ``<pad>`` in it, and
        a target that is the answer alone or the query followed by the answer (``</a>`` after it optional)."""
        query = self._ids(input_text, where)
        if len(query) < 2:
            raise TaskDataError(f"{where}: input_text has {len(query)} token; a query is an entity and relations")
        if self.pad in query:
            raise TaskDataError(f"{where}: input_text holds {PAD}, which only pads rows")
        target = TOKEN.findall(target_text)
        if target and target[-1] == END:
            target = target[:-1]
        if not target:
            raise TaskDataError(f"{where}: target_text has no answer token")
        answer = self._ids(target[-1], where)[0]
        if len(target) > 1 and self._ids("".join(target[:-1]), where) != query:
            raise TaskDataError(f"{where}: target_text neither is the answer alone nor continues input_text")
        if answer == self.pad:
            raise TaskDataError(f"{where}: the answer is {PAD}")
        return query, answer

    def load(self, path: str | Path) -> TokenDataset:
        numbered = self.records(path, numbered=True)
        if not numbered:
            raise TaskDataError(
                f"{path}: no records" + (f" of types {sorted(self.types)}" if self.types else "")
            )
        recs = [(q, a, k) for _, q, a, k in numbered]
        width = self.width or max(len(q) for q, _, _ in recs)
        inputs = np.full((len(recs), width), self.pad, dtype=np.int64)
        labels = np.full((len(recs), width), IGNORE_INDEX, dtype=np.int64)
        for i, (query, answer, _) in enumerate(recs):
            if len(query) > width:
                raise TaskDataError(
                    f"{path} record {numbered[i][0]}: {len(query)} tokens do not fit width {width}"
                )
            inputs[i, : len(query)] = query
            labels[i, self._pos(len(query), width)] = answer
        hops = np.array([len(q) - 1 for q, _, _ in recs], dtype=np.float64)
        return TokenDataset(
            inputs,
            labels,
            hops,
            None,
            {"task": self.name, "source": str(path), "types": [k for _, _, k in recs]},
        )

    def generate(self, n: int, seed: int, **difficulty: Any) -> TokenDataset:
        raise TaskDataError("kg_files reads the reference's JSON files: set data.train_path / data.eval_path")

    # -- truth -----------------------------------------------------------------------------------
    @property
    def facts(self) -> dict[tuple[int, int], int]:
        """Atomic facts ``{(head, relation): tail}`` from the folder's ``train.json``."""
        if self._facts is None:
            keep, self.types = self.types, None
            try:
                recs = self.records("train.json")
            finally:
                self.types = keep
            self._facts = {(q[0], q[1]): a for q, a, _ in recs if len(q) == 2}
        return self._facts

    def _pos(self, query_len: int, width: int) -> int:
        """The prediction position of a query of ``query_len`` tokens in a row of ``width``."""
        return width - 1 if self.pred_pos == "last" else query_len - 1

    def _query(self, inputs: np.ndarray) -> list[int]:
        row = [int(t) for t in np.asarray(inputs).reshape(-1)]
        while row and row[-1] == self.pad:
            row.pop()
        if len(row) < 2:
            raise TaskDataError(f"query {row} has no relation")
        return row

    def check(self, inputs: np.ndarray, prediction: np.ndarray) -> bool:
        query = self._query(inputs)
        entity = query[0]
        for rel in query[1:]:
            if (entity, rel) not in self.facts:
                return False
            entity = self.facts[(entity, rel)]
        return self._answer(inputs, prediction) == entity

    def _answer(self, inputs: np.ndarray, prediction: np.ndarray) -> int:
        """The predicted token at the prediction position of the row ``inputs``."""
        width = np.asarray(inputs).reshape(-1).size
        return int(np.asarray(prediction).reshape(-1)[self._pos(len(self._query(inputs)), width)])

    def difficulty(self, inputs: np.ndarray) -> float:
        return float(len(self._query(inputs)) - 1)

    def render(self, inputs: np.ndarray, prediction: np.ndarray | None = None) -> str:
        query = self._query(inputs)
        text = "".join(self.tokens[t] for t in query)
        if prediction is not None:
            text += " -> " + self.tokens[self._answer(inputs, prediction)]
        return text

    def save(self, dataset: TokenDataset, path: str | Path) -> None:
        """Write ``dataset`` back in the reference's record format (``type`` from ``meta['types']``)."""
        types = dataset.meta.get("types") or [""] * len(dataset)
        out = []
        for row, lab, kind in zip(dataset.inputs, dataset.labels, types):
            query = self._query(row)
            answer = int(lab[self._pos(len(query), len(row))])
            text = "".join(self.tokens[t] for t in query)
            out.append({"input_text": text, "target_text": text + self.tokens[answer] + END, "type": kind})
        from loopformer.files import atomic_write_json

        atomic_write_json(path, out)
