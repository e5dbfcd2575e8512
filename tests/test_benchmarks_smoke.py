"""Smoke test of the performance benchmarks (benchmarks/, issue 9) at their tiniest size (--quick).

Runs ``python -m benchmarks --quick`` once in-process into a temporary folder and checks every result
object (required fields, sane values, exact oracles where the figure is deterministic: saved-tensor
memory is counted exactly, so its targets must hold even at the tiniest size), the rendered page,
``--only`` merging, the side-by-side timing helpers and the GPU script's no-CUDA failure.

The default run leaves out the benchmarks that compile with torch.compile on the CPU (``COMPILING``:
minutes of inductor work that a loaded machine stretches past the per-test timeout); they run, with the
checks of their figures, under ``-m slow``.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:  # benchmarks/ is a top-level package of the repository, not of loopformer
    sys.path.insert(0, ROOT)

from benchmarks import BENCHMARKS  # noqa: E402
from benchmarks.__main__ import main, merge, provenance  # noqa: E402
from benchmarks.common import REQUIRED_FIELDS, paired_ratio, side_by_side  # noqa: E402

# the benchmarks that run torch.compile (inductor) on the CPU: only under -m slow
COMPILING = ("flops", "compile", "reference", "step_compile")
# the module fixture's run of the others (about 4 min of one loaded core) counts against the test that first
# asks for it: room for a machine several times busier than that
pytestmark = pytest.mark.timeout(1800)


def run_quick(folder: Path, names: list[str]) -> tuple:
    out, doc = folder / "results.json", folder / "performance.md"
    threads = torch.get_num_threads()
    try:
        status = main(["--quick", "--threads", "1", "--out", str(out), "--doc", str(doc),
                       *(arg for name in names for arg in ("--only", name))])  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    return status, json.loads(out.read_text()), doc.read_text(), out, doc


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    return run_quick(tmp_path_factory.mktemp("bench"), [b for b in BENCHMARKS if b not in COMPILING])


@pytest.fixture(scope="module")
def compile_run(tmp_path_factory):
    return run_quick(tmp_path_factory.mktemp("bench_compile"), list(COMPILING))


COUNT_UNITS = ("reads/step", "fraction", "iterations")


def by_name(results: list[dict]) -> dict[str, dict]:
    return {r["name"]: r for r in results}


def test_every_benchmark_ran_without_crashing(quick_run):
    status, results, _, _, _ = quick_run
    assert status == 0, [r for r in results if r["name"].endswith(".error")]
    assert {r["benchmark"] for r in results} == set(BENCHMARKS) - set(COMPILING)
    assert isinstance(results, list) and len(results) >= 14


@pytest.mark.slow
def test_every_compiling_benchmark_ran_without_crashing(compile_run):
    status, results, _, _, _ = compile_run
    assert status == 0, [r for r in results if r["name"].endswith(".error")]
    assert {r["benchmark"] for r in results} == set(COMPILING)
    test_result_objects_have_required_fields_and_sane_values(compile_run)


def test_result_objects_have_required_fields_and_sane_values(quick_run):
    _, results, _, _, _ = quick_run
    for r in results:
        for key in (*REQUIRED_FIELDS, "details", "reason"):
            assert key in r, (r["name"], key)
        assert r["met"] in (True, False, None)
        assert r["quick"] is True
        if r["value"] is not None:  # a count (host reads, extra map evaluations) may be 0; a ratio or a time not
            assert math.isfinite(r["value"]) and (r["value"] > 0 or r["unit"] in COUNT_UNITS and r["value"] == 0), r
        if r["met"] is False:
            assert r["reason"], f"{r['name']} missed its target without a reason"
        if r["target"] is None:
            assert r["met"] is None, r["name"]


def test_engine_and_hand_loop_compute_the_same_step(quick_run):
    res = by_name(quick_run[1])
    for solver in ("damped", "picard"):
        d = res[f"engine_overhead.{solver}"]["details"]
        assert d["loss_abs_diff"] < 1e-5 and d["grad_max_rel_diff"] < 1e-4
        assert res[f"engine_overhead.{solver}"]["value"] > 0


def test_memory_targets_hold_exactly(quick_run):
    res = by_name(quick_run[1])
    for mode in ("truncated", "truncated_adaptive", "onestep", "neumann", "ift"):
        r = res[f"memory_growth.{mode}"]
        assert r["met"] is True and r["value"] <= 1.15, r
    bptt = res["memory_growth.bptt"]
    assert bptt["met"] is True and bptt["value"] > 8  # 64 / 4 loops: linear growth
    saved = {int(k): v for k, v in bptt["details"]["saved_bytes"].items()}
    assert saved[4] < saved[16] < saved[64]


@pytest.mark.slow
def test_flops_and_compile_values(compile_run):
    res = by_name(compile_run[1])
    eff = res["arithmetic_efficiency.d32"]
    assert 0 < eff["value"] < 2 and eff["details"]["step_flops"] > 0
    assert eff["details"]["loss_abs_diff"] < 1e-5  # the compiled step computes the same loss
    assert 0 < res["compile_speedup.d32"]["value"] and 0 < res["arithmetic_efficiency.d32_compiled"]["value"]
    graphs = res["compile_graphs.max_per_function"]
    assert graphs["met"] is True and graphs["value"] == 1, graphs["reason"]
    comp = res["compile.speedup"]
    assert comp["value"] is not None or "failed" in comp["reason"]


def test_halting_and_solvers_values(quick_run):
    res = by_name(quick_run[1])
    halt = res["adaptive_halting.time_vs_fixed"]["details"]
    assert halt["evals"]["fixed"]["steps_mean"] == halt["max_steps"]
    assert 1 <= halt["evals"]["adaptive"]["steps_mean"] <= halt["max_steps"]
    for problem in ("linear_rho0.9", "linear_rho0.99", "fprm_sudoku4"):
        r = res[f"solvers.{problem}"]
        stats = r["details"]["solvers"]
        assert all(s["converged"] for k, s in stats.items() if k.startswith("loopformer."))
        if r["details"]["torchdeq"] is None:
            assert r["met"] is None and r["value"] is None
        else:
            assert r["value"] > 0 and any(k.startswith("torchdeq.") for k in stats)
    head = res["solvers.attractor_head_sudoku4"]  # the trained Attractor head (a 20-step model in --quick)
    assert head["details"]["tol"] == 3e-4 and "loopformer.safe_anderson" in head["details"]["solvers"]
    assert all(s["map_evals_per_sample"] >= 1 for s in head["details"]["solvers"].values())
    assert (head["value"] is None) == (head["details"]["torchdeq"] is None)
    for k, s in res["solvers.linear_rho0.9"]["details"]["solvers"].items():
        assert s["grad_rel_err"] < 0.05, (k, s)  # quick tol 1e-3 / (1 - 0.9)


def test_rendered_page_has_table_command_machine_and_targets(quick_run):
    _, results, page, _, _ = quick_run
    assert "| # | figure | value | unit | target | met |" in page
    assert "python -m benchmarks" in page and torch.__version__ in page and "CPU:" in page
    assert "Targets met:" in page and "benchmarks/gpu.py" in page
    for r in results:
        assert f"`{r['name']}`" in page


def test_only_merges_into_existing_results(quick_run):
    _, results, _, out, doc = quick_run
    status = main(["--quick", "--threads", "1", "--only", "memory", "--out", str(out), "--doc", str(doc)])
    assert status == 0
    merged = json.loads(out.read_text())
    assert sorted(r["name"] for r in merged) == sorted(r["name"] for r in results)
    doc.unlink()
    assert main(["--render-only", "--out", str(out), "--doc", str(doc)]) == 0
    assert all(f"`{r['name']}`" in doc.read_text() for r in merged)
    # the page names each run whose rows the merged file holds, with its row count and threads
    memory_rows = sum(r["benchmark"] == "memory" for r in merged)
    only = f"python -m benchmarks --quick --threads 1 --only memory --out {out} --doc {doc}"
    assert f"`{only}`: {memory_rows} row" in doc.read_text()
    only_default = " ".join(f"--only {b}" for b in BENCHMARKS if b not in COMPILING)
    first = f"python -m benchmarks --quick --threads 1 --out {out} --doc {doc} {only_default}"
    assert f"`{first}`: {len(merged) - memory_rows} row" in doc.read_text()
    assert provenance([{"command": "a", "threads": 1}, {"command": "b", "threads": 2}, {"command": "b", "threads": 2}]) == [
        ("b", 2, 2),
        ("a", 1, 1),
    ]
    assert merge(
        [{"benchmark": "engine", "name": "a"}], [{"benchmark": "memory", "name": "b"}], ["memory"]
    ) == [{"benchmark": "engine", "name": "a"}, {"benchmark": "memory", "name": "b"}]
    # a benchmark merged by name (threads: idle / loaded rows) keeps its rows it did not write again
    old = [{"benchmark": "threads", "name": "t.idle", "value": 1}, {"benchmark": "threads", "name": "t.loaded", "value": 2}]
    new = [{"benchmark": "threads", "name": "t.loaded", "value": 3}]
    assert merge(old, new, ["threads"], frozenset({"threads"})) == [old[0], new[0]]
    assert merge(old, new, ["threads"]) == new


def test_side_by_side_interleaves_and_pairs():
    calls: list[str] = []
    times = side_by_side(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, repeats=4, warmup=1
    )
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b", "b", "a"]  # warm-up, then rotating order
    assert [len(v) for v in times.values()] == [4, 4]
    assert paired_ratio({"x": [2.0, 9.0, 3.0], "y": [1.0, 3.0, 1.0]}, "x", "y") == 3.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on machines without CUDA")
def test_gpu_script_fails_clearly_without_cuda(capsys, tmp_path):
    from benchmarks import gpu

    with pytest.raises(SystemExit) as exc:
        gpu.main(["--out", str(tmp_path / "gpu.json")])
    assert exc.value.code == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "gpu.json").exists()
