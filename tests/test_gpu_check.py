"""tools/gpu_check.sh without CUDA: one line, exit status 2, nothing run or written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the script would run the check")
def test_gpu_check_exits_2_with_one_line_without_cuda(tmp_path) -> None:
    logs = tmp_path / "logs"
    proc = subprocess.run(["bash", str(REPO / "tools" / "gpu_check.sh"), str(logs)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    lines = [x for x in (proc.stdout + proc.stderr).splitlines() if x.strip()]
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert len(lines) == 1 and lines[0].startswith("gpu_check: no CUDA device"), lines
    assert not logs.exists()


def test_gpu_check_help_says_what_it_runs_and_its_budget(tmp_path) -> None:
    proc = subprocess.run(["bash", str(REPO / "tools" / "gpu_check.sh"), "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert "budget: 8 minutes" in text and "--full" in text and "summary.json" in text
    for part in ("device", "models", "train", "cli", "benchmark"):
        assert f"  {part}" in text, part
    limits = [int(x) for x in re.findall(r"\((\d+) s\)\s*$", text, flags=re.M)]
    assert sum(limits) <= 480, limits  # the parts' limits fit the 8 minutes


def test_gpu_benchmark_exits_2_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "gpu.py"), "--steps", "1"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr
