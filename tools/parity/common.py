"""Shared helpers for the parity fixture scripts (``tools/parity/<system>.py``).

- ``reference_path(path)``: put a reference checkout first on ``sys.path`` (its top-level packages,
  e.g. ``models``, are imported by name), after checking it exists.
- ``stub_module(name, **attrs)``: a placeholder module for an import the reference makes at module
  level but the fixture does not use (e.g. ``wandb``); using an attribute that was not given fails.
- ``TINY_OPT``: the optimiser settings the TRM, HRM and TRM-DEQ fixtures share.
- ``main(build, name)``: the command line every script shares: ``--ref PATH --out DIR`` writes the
  fixtures; ``--check`` writes them to a temporary folder and compares SHA-256 hashes with the files
  in ``--out`` (exit status 1 on any difference), which is how bit-identical regeneration is tested.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
import types
from collections.abc import Callable
from pathlib import Path

import torch

DEFAULT_OUT = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "parity"
# the optimiser settings of the TRM / HRM / TRM-DEQ fixtures (pretrain.py's names)
TINY_OPT = {
    "lr": 1e-3,
    "weight_decay": 0.1,
    "beta1": 0.9,
    "beta2": 0.95,
    "puzzle_emb_lr": 1e-2,
    "puzzle_emb_weight_decay": 0.1,
}


def reference_path(path: str | Path) -> Path:
    root = Path(path).resolve()
    if not root.is_dir():
        raise SystemExit(f"reference checkout {root} does not exist")
    sys.path.insert(0, str(root))
    return root


def stub_module(name: str, **attrs: object) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)

    def missing(attr: str) -> object:
        raise AttributeError(f"{name}.{attr} is stubbed out by the parity fixture script")

    mod.__getattr__ = missing  # type: ignore[method-assign]
    sys.modules[name] = mod
    return mod


def git_commit(root: Path) -> str:
    head = root / ".git" / "HEAD"
    if not head.is_file():
        return "unknown"
    ref = head.read_text().strip()
    if ref.startswith("ref: "):
        target = root / ".git" / ref[5:]
        return target.read_text().strip() if target.is_file() else "unknown"
    return ref


def digest(folder: Path, names: list[str]) -> dict[str, str]:
    return {n: hashlib.sha256((folder / n).read_bytes()).hexdigest() for n in names if (folder / n).is_file()}


def main(build: Callable[[Path, Path], list[str]], description: str) -> None:
    """``build(ref_root, out_dir) -> written file names``; parses --ref / --out / --check."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--ref", required=True, help="checkout of the reference repository")
    parser.add_argument(
        "--out", default=str(DEFAULT_OUT), help="fixture folder (default tests/fixtures/parity)"
    )
    parser.add_argument(
        "--check", action="store_true", help="regenerate into a temporary folder and compare hashes"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)  # reductions in one fixed order: bit-identical reruns
    root = reference_path(args.ref)
    out = Path(args.out)
    if not args.check:
        for name in build(root, out):
            print(f"wrote {out / name}")
        return
    with tempfile.TemporaryDirectory() as tmp:
        names = build(root, Path(tmp))
        fresh, committed = digest(Path(tmp), names), digest(out, names)
    bad = [n for n in names if fresh.get(n) != committed.get(n)]
    for n in names:
        print(f"{'OK  ' if n not in bad else 'DIFF'} {n} {fresh.get(n, '-')[:16]}")
    if bad:
        raise SystemExit(f"{len(bad)} fixture file(s) differ from {out}: {bad}")
    print(f"all {len(names)} fixture files regenerate bit-identically")
