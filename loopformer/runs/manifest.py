"""Checkpoint manifests: the size and SHA-256 of every file, written last into each checkpoint.

``manifest.json`` = ``{"format": 1, "files": {name: {"size": bytes, "sha256": hex}}}``. A checkpoint
verifies when the manifest parses, names only plain file names inside the folder, and every file
it lists exists with that size and hash. A checkpoint folder without a manifest (written before
manifests existed) verifies when its JSON files parse. ``verify_checkpoint`` returns the reason a
folder is unusable (never the contents of a file it could not parse), or None.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from loopformer.files import atomic_write_json

MANIFEST = "manifest.json"
REQUIRED = ("model.safetensors", "config.json")
_CHUNK = 1 << 20


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(folder: Path) -> None:
    """``folder/manifest.json`` for every regular file in ``folder`` (fsynced before it is written)."""
    files = {}
    for path in sorted(folder.iterdir()):
        if path.is_file() and path.name != MANIFEST:
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())
            files[path.name] = {"size": path.stat().st_size, "sha256": file_digest(path)}
    atomic_write_json(folder / MANIFEST, {"format": 1, "files": files}, root=folder, indent=1)


def _json_ok(path: Path) -> str | None:
    try:
        json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        return f"{path.name} is not valid UTF-8 JSON ({type(err).__name__})"
    return None


def verify_checkpoint(folder: Path, hashes: bool = True) -> str | None:
    """Why ``folder`` is not a usable checkpoint (None when it verifies); see the module docstring."""
    if not folder.is_dir():
        return "not a folder"
    for name in REQUIRED:
        if name == "model.safetensors" and any(folder.glob("shard-*.safetensors")):
            continue  # a sharded checkpoint (loopformer.runs.sharded): its weights are in the shards
        if not (folder / name).is_file():
            return f"{name} is missing"
    manifest = folder / MANIFEST
    if not manifest.is_file():
        for name in ("config.json", "state.json"):
            if (folder / name).is_file() and (why := _json_ok(folder / name)):
                return why
        return None
    try:
        data = json.loads(manifest.read_text(encoding="utf-8"))
        files = data["files"]
        entries = [(str(name), int(spec["size"]), str(spec["sha256"])) for name, spec in files.items()]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as err:
        return f"{MANIFEST} is corrupt ({type(err).__name__})"
    for name, size, digest in entries:
        if Path(name).name != name or name in ("", ".", ".."):
            return f"{MANIFEST} names {name!r}, which is not a file inside the checkpoint"
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        actual = path.stat().st_size
        if actual != size:
            return f"{name} has {actual} bytes, the manifest says {size} (truncated or replaced)"
        if hashes and file_digest(path) != digest:
            return f"{name} does not match its SHA-256 in the manifest (corrupt)"
    return None
