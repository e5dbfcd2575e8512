"""tools/gpu_check.sh without CUDA: one line, exit status 2, nothing run or written."""

from __future__ import annotations

import subprocess
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
