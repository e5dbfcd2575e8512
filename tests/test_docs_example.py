"""docs/example.md runs top to bottom (its ```python cells in order, one namespace, a fresh folder), and
the plot functions return Figures without touching the matplotlib backend."""

from __future__ import annotations

import re
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "example.md"


def test_example_runs_top_to_bottom(tmp_path, monkeypatch, capsys) -> None:
    import matplotlib

    backend = matplotlib.get_backend()
    cells = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert len(cells) >= 4
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    for i, cell in enumerate(cells):
        exec(compile(cell, f"{DOC.name} cell {i + 1}", "exec"), namespace)
    out = capsys.readouterr().out
    assert "answer:" in out and "valid" in out
    from matplotlib.figure import Figure

    assert isinstance(namespace["figure"], Figure)
    assert (tmp_path / "runs" / "example" / "steps_vs_difficulty.png").read_bytes()[:4] == b"\x89PNG"
    assert matplotlib.get_backend() == backend  # nothing switched it
    assert "matplotlib.pyplot" not in sys.modules or backend == matplotlib.get_backend()
