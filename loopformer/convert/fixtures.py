"""Parity fixtures: tensors in a safetensors file plus a JSON file of metadata beside it.

``tools/parity/<system>.py`` (run against a checkout of the authors' repository) writes
``tests/fixtures/parity/<name>.safetensors`` + ``<name>.json``; the ``tests/test_parity_*.py`` tests
read them back without the reference code. The JSON records the reference repository and commit,
the tiny configuration the reference model was built with, the substitutions the script made (e.g. a
GPU-only kernel replaced by its PyTorch equivalent) and the SHA-256 of the tensor file, so a rerun of
the script can be compared byte for byte (``python tools/parity/<system>.py --ref PATH --check``).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

from loopformer.files import atomic_path, atomic_write_json

FIXTURE_DIR = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "parity"


class FixtureError(RuntimeError):
    """A missing or inconsistent parity fixture; the message names the file."""


def sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def save_fixture(out_dir: str | Path, name: str, tensors: dict[str, Tensor], meta: dict[str, Any]) -> Path:
    """Write ``<out_dir>/<name>.safetensors`` (keys sorted, contiguous CPU copies) and ``<name>.json``.

    ``meta`` must be JSON-serialisable; ``sha256`` of the tensor file is added to it. Saving the same
    tensors and metadata twice gives byte-identical files.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.safetensors"
    table = {k: tensors[k].detach().to("cpu").contiguous().clone() for k in sorted(tensors)}
    with atomic_path(path) as tmp:
        save_file(table, str(tmp))
    record = dict(meta)
    record["sha256"] = sha256(path)
    record["tensors"] = {k: [str(v.dtype).replace("torch.", ""), list(v.shape)] for k, v in table.items()}
    atomic_write_json(out / f"{name}.json", record, indent=1, sort_keys=True, newline=True)
    return path


def load_fixture(
    name: str, fixture_dir: str | Path = FIXTURE_DIR
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """(tensors, metadata) of fixture ``name``; FixtureError when a file is missing or its hash differs."""
    folder = Path(fixture_dir)
    path, meta_path = folder / f"{name}.safetensors", folder / f"{name}.json"
    for p in (path, meta_path):
        if not p.is_file():
            raise FixtureError(f"parity fixture {p} does not exist (regenerate it with tools/parity/)")
    meta = json.loads(meta_path.read_text())
    if meta.get("sha256") != sha256(path):
        raise FixtureError(f"{path} does not match the sha256 recorded in {meta_path}")
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError) as err:
        raise FixtureError(f"{path} is corrupt: {err}") from None
    return tensors, meta


def prefixed(tensors: dict[str, Tensor], prefix: str) -> dict[str, Tensor]:
    """The entries of ``tensors`` under ``prefix.`` with the prefix removed."""
    p = prefix + "."
    return {k[len(p) :]: v for k, v in tensors.items() if k.startswith(p)}


def fixture_dtype(meta: dict[str, Any]) -> torch.dtype:
    return getattr(torch, meta.get("dtype", "float64"))
