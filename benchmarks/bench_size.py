"""The size of the house (issue 45): lines of the library and of each package, the code around it, and how many
of the library's modules training FPRM imports, so that the next change sees what it adds.

Lines are ``find loopformer -name '*.py' | xargs cat | wc -l`` (every line, docstrings and comments included);
the import count is ``import loopformer.train.trainer, loopformer.models.fprm`` in a fresh interpreter. The
targets are issue 45's: the library <= 25,000 lines, the library with ``tools/``, ``experiments/`` and
``benchmarks/`` <= 37,500, the trainer's import path <= 45 modules.

    python -m benchmarks --only size
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from benchmarks.common import Result

ROOT = Path(__file__).resolve().parent.parent
LIBRARY_TARGET = 25_000
AROUND_TARGET = 37_500
IMPORT_TARGET = 45
IMPORTS = (
    "import sys, loopformer.train.trainer, loopformer.models.fprm; "
    "print(len([m for m in sys.modules if m.startswith('loopformer')]))"
)


def lines(folder: Path) -> int:
    """Lines of every ``.py`` file under ``folder`` (``wc -l`` counts newlines)."""
    return sum(p.read_bytes().count(b"\n") for p in folder.rglob("*.py"))


def run(quick: bool) -> list[Result]:
    library = ROOT / "loopformer"
    packages = {p.name: lines(p) for p in sorted(library.iterdir()) if p.is_dir() and (p / "__init__.py").exists()}
    loose = sum(p.read_bytes().count(b"\n") for p in library.glob("*.py"))
    total = lines(library)
    around = {name: lines(ROOT / name) for name in ("tools", "experiments", "benchmarks")}
    modules = int(subprocess.run([sys.executable, "-c", IMPORTS], capture_output=True, text=True, check=True,
                                 cwd=ROOT).stdout.strip())  # fmt: skip
    return [
        Result("size", "size.library_lines", total, "lines", f"<= {LIBRARY_TARGET:,}", total <= LIBRARY_TARGET,
               "every line of loopformer/**/*.py", {"packages": packages, "top_level_modules": loose}),  # fmt: skip
        Result("size", "size.library_and_around_lines", total + sum(around.values()), "lines",
               f"<= {AROUND_TARGET:,}", total + sum(around.values()) <= AROUND_TARGET,
               "loopformer/ + tools/ + experiments/ + benchmarks/", around),  # fmt: skip
        Result("size", "size.trainer_import_modules", modules, "modules", f"<= {IMPORT_TARGET}",
               modules <= IMPORT_TARGET, "loopformer modules loaded by importing the trainer and FPRM"),  # fmt: skip
    ]
