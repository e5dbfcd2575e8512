"""The head-to-head benchmark harness (benchmarks/bench_reference.py): checkout discovery, the skip
message without a checkout, and (with checkouts, ``-m slow``) one quick pair per reference."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:  # benchmarks/ is a top-level package of the repository
    sys.path.insert(0, ROOT)

from benchmarks import bench_reference as br  # noqa: E402


def test_checkout_found_by_model_variable_or_folder(monkeypatch, tmp_path) -> None:
    for model in br.REFS:
        monkeypatch.delenv(f"LOOPFORMER_REF_{model.upper()}", raising=False)
    monkeypatch.delenv("LOOPFORMER_REFS", raising=False)
    assert br.find_reference("trm") is None
    (tmp_path / "TinyRecursiveModels").mkdir()
    monkeypatch.setenv("LOOPFORMER_REFS", str(tmp_path))
    assert br.find_reference("trm") == tmp_path / "TinyRecursiveModels"
    assert br.find_reference("hrm") is None
    monkeypatch.setenv("LOOPFORMER_REF_HRM", str(tmp_path / "missing"))
    assert br.find_reference("hrm") is None
    monkeypatch.setenv("LOOPFORMER_REF_HRM", str(tmp_path))
    assert br.find_reference("hrm") == tmp_path


def test_absent_checkout_is_skipped_with_a_message(monkeypatch) -> None:
    monkeypatch.delenv("LOOPFORMER_REF_TRM", raising=False)
    monkeypatch.delenv("LOOPFORMER_REFS", raising=False)
    (row,) = br.run_model("trm", quick=True)
    assert row.name == "vs_reference.trm" and row.value is None and row.met is None
    assert "LOOPFORMER_REF_TRM" in row.reason and "skipped" in row.reason
    assert row.details["commit"] == br.REFS["trm"]["commit"]


def test_bad_reference_folder_is_reported(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("LOOPFORMER_REF_TRM", str(tmp_path))  # no models/common.py there either
    with pytest.raises(RuntimeError, match="fprm pair failed.*models/common.py is missing"):
        br.run_model_at("fprm", tmp_path, quick=True)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["fprm", "trm", "hrm", "attractor"])
def test_quick_pair_runs_against_the_checkout(model: str) -> None:
    if br.find_reference(model) is None:
        pytest.skip(f"no {model} checkout (LOOPFORMER_REF_{model.upper()} / LOOPFORMER_REFS)")
    for module in ("einops", "pydantic"):  # the references' own imports: pip install -e ".[bench]"
        pytest.importorskip(module, reason=f"the reference code imports {module}: pip install -e '.[bench]'")
    rows = br.run_model(model, quick=True)
    assert [r.name for r in rows] == [f"vs_reference.{model}{s}" for s in ("", "_eval", "_floor")]
    for r in rows:
        assert r.value is not None and 0.05 < r.value < 20, r
    params = rows[0].details["params"]
    assert abs(params["loopformer"] - params["reference"]) / params["reference"] < 0.01  # same matrices
    flops = rows[2].details["flops"]
    assert flops["loopformer"] > 0 and flops["reference"] > 0
    if model != "attractor":  # same loop counts, same arithmetic: equal counted FLOPs per training step
        # (the Attractor pair's Anderson solves stop where each side's float32 mixing system turns
        # singular, so its map evaluations, and FLOPs, may differ)
        assert abs(flops["loopformer"] - flops["reference"]) / flops["reference"] < 0.02
    assert rows[2].value < rows[0].value * 1.5  # kernels alone take less than a whole step


def test_profile_step_reports_the_top_operators_per_step() -> None:
    a = torch.randn(64, 64)

    def step() -> None:
        (a @ a).relu_()

    prof = br.profile_step(step, steps=3, top=5)
    mm_ms, mm_calls = prof["top_ops_ms_calls"]["aten::mm"]
    assert mm_calls == 1.0 and 0 < mm_ms <= prof["total_ms"]
    assert prof["top_ops_ms_calls"]["aten::relu_"][1] == 1.0


def test_arithmetic_kernels_are_matmuls_attention_and_convolutions() -> None:
    for op in ("aten::mm", "aten::bmm", "aten::addmm", "aten::_scaled_dot_product_flash_attention_for_cpu",
               "aten::_scaled_dot_product_flash_attention_for_cpu_backward", "aten::convolution_backward",
               "aten::mkldnn_convolution"):  # fmt: skip
        assert br.is_arithmetic_kernel(op), op
    for op in ("aten::mul", "aten::silu", "aten::cat", "aten::copy_", "aten::matmul_backward_helper", "mm"):
        assert not br.is_arithmetic_kernel(op), op


def test_kernel_floor_is_the_kernel_time_over_the_other_steps_total() -> None:
    a = torch.randn(96, 96)
    b = torch.randn(96, 96, 8)

    def ours() -> None:
        (a @ a).relu_()

    def ref() -> None:  # the same matmul plus elementwise work
        c = a @ a
        for _ in range(20):
            c = (c * 1.0001).tanh()
        b.sum()

    floor = br.kernel_floor(ours, ref, steps=3)
    assert floor["flops"] == {"loopformer": 2 * 96**3, "reference": 2 * 96**3}
    ours_mm = floor["loopformer"]["top_ops_ms_calls"]["aten::mm"][0]
    assert floor["loopformer"]["arithmetic_ms"] == pytest.approx(ours_mm, abs=1e-3)
    assert floor["reference"]["arithmetic_ms"] < floor["reference"]["total_ms"]
    assert floor["floor"] == pytest.approx(
        floor["loopformer"]["arithmetic_ms"] / floor["reference"]["total_ms"]
    )
    assert 0 < floor["floor"] < 1


def test_reference_calls_run_under_the_pair_device_and_rows_name_it(tmp_path) -> None:
    from benchmarks import reference_builders as rb

    seen: list[str] = []

    def ref_step() -> None:  # the references create their carries with plain factory calls
        seen.append(torch.empty(1).device.type)

    rb._on(torch.device("meta"), ref_step, default_device=True)()
    assert seen == ["meta"]
    for default_device in (False, True):  # on the CPU no wrapper (and no function mode) at all
        assert rb._on(torch.device("cpu"), ref_step, default_device) is ref_step
    cpu = br._row("fprm", "train", 0.9, False, "r", {})
    gpu = br._row("fprm", "train", 0.9, None, "r", {}, device="cuda")
    gpu_eval = br._row("fprm", "eval", 0.9, None, "r", {}, device="cuda")
    assert (cpu.name, gpu.name, gpu_eval.name) == (
        "vs_reference.fprm",
        "vs_reference.fprm_cuda",
        "vs_reference.fprm_cuda_eval",
    )
    assert cpu.target is not None and gpu.target is None  # the targets are the CPU rows'
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="CUDA is not available"):
            br.main(["--model", "fprm", "--ref", str(tmp_path), "--device", "cuda"])
