"""Reading a JSON file a user gave: one function for every loader, so each refuses a bad file the same way.

``read_json(path, error)`` returns the parsed value or raises ``error`` (the caller's exception type:
``TaskDataError`` for data files, ``ValueError`` for run summaries) with one line naming the file and
what is wrong (not UTF-8 and at which byte, invalid JSON and where, nested too deeply, unreadable),
never quoting the file's contents. Imports nothing of loopformer, so any module may use it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def read_json(
    path: Path,
    error: type[Exception] = ValueError,
    object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None,
) -> Any:
    """The parsed UTF-8 JSON file ``path``; ``error`` naming the file and position otherwise."""
    try:
        return json.loads(path.read_bytes().decode("utf-8"), object_pairs_hook=object_pairs_hook)
    except UnicodeDecodeError as err:
        raise error(f"{path}: not UTF-8 text (byte {err.start})") from None
    except json.JSONDecodeError as err:
        raise error(f"{path}: not valid JSON (line {err.lineno}, column {err.colno}: {err.msg})") from None
    except RecursionError:
        raise error(f"{path}: JSON nested too deeply") from None
    except OSError as err:
        raise error(f"{path}: cannot read ({err.strerror or type(err).__name__})") from None


__all__ = ["read_json"]
