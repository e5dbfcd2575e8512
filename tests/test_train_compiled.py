"""Issue 33: the whole training step compiles (loopformer.train.compiled): one graph, no graph break, for a
paper-recipe family at a small size on the CPU (``fullgraph=True``), and the compiled step equals the eager
one within float tolerance. Dynamo's ``eager`` backend captures the same graph as inductor without generating
C++ (seconds instead of minutes on this machine); the inductor run is ``slow``."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from loopformer.config import load_config
from loopformer.train.compiled import CompiledStep, why_not_whole

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.paper_small import small_trainer


def _batch(tr):
    batch = tr.mode.batch(tr.step)
    if batch.state is None:
        batch.state = tr.initial_states(batch)
    return batch


@pytest.mark.parametrize("family", ["trm", pytest.param("fprm", marks=pytest.mark.slow)])
def test_the_training_step_of_a_paper_family_is_one_graph(family: str, tmp_path: Path) -> None:
    """``torch._dynamo.explain`` of the whole step (forward through the loop engine, stablemax loss, Q loss,
    torch.autograd.grad, clipping, divergence check, AdamATan2 / AdamW + sign-SGD puzzle rows, EMA), then
    ``torch.compile(fullgraph=True)`` of it, which raises on any graph break."""
    tr = small_trainer(family, tmp_path / "run", "compile=true")
    try:
        assert isinstance(tr.compiled, CompiledStep)
        batch = _batch(tr)
        args = tr.compiled.arguments(batch, 1e-3, 0, 1e-3)
        explained = torch._dynamo.explain(tr.compiled.step)(*args)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
        torch._dynamo.reset()
        full = torch.compile(tr.compiled.step, fullgraph=True, backend="eager")  # raises on any graph break
        out = full(*args)
        assert torch.isfinite(out["loss"]) and out["state"].shape == batch.state.shape
    finally:
        tr.folder.close()
        torch._dynamo.reset()


@pytest.mark.parametrize("family", ["trm", pytest.param("fprm", marks=pytest.mark.slow)])
def test_the_compiled_step_equals_the_eager_step(family: str, tmp_path: Path) -> None:
    """Three steps compiled (dynamo's eager backend) vs eager from the same start: the same losses, weights
    and EMA within float32 tolerance (the bias corrections are float32 on the device when compiled)."""
    eager = small_trainer(family, tmp_path / "eager")
    compiled = small_trainer(family, tmp_path / "compiled", "compile=true")
    compiled.compiled = CompiledStep(compiled, backend="eager")
    compiled.model.load_state_dict(eager.model.state_dict())
    if eager.ema is not None:
        compiled.ema.load_state_dict(eager.ema.state_dict())
    try:
        for _ in range(3):
            a, b = eager.train_step(), compiled.train_step()
            eager.step += 1
            compiled.step += 1
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3)
        for (name, p), q in zip(eager.model.named_parameters(), compiled.model.parameters()):
            torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-5, msg=name)
        for name, s in eager.ema.shadow.items():
            torch.testing.assert_close(compiled.ema.shadow[name], s, rtol=1e-4, atol=1e-5, msg=name)
    finally:
        eager.folder.close()
        compiled.folder.close()
        torch._dynamo.reset()


def test_compile_auto_is_off_on_the_cpu_and_the_paper_recipes_ask_for_it(tmp_path: Path) -> None:
    tr = small_trainer("trm", tmp_path / "run")  # the recipe's compile: auto
    tr.folder.close()
    assert tr.config.compile == "auto" and tr.compiled is None
    for name in ("paper_sudoku_extreme_fprm", "paper_sudoku_extreme_trm", "paper_maze_hard_fprm"):
        assert load_config(name).compile == "auto"


def test_what_is_not_compiled_whole_says_why(tmp_path: Path) -> None:
    tr = small_trainer("trm", tmp_path / "run", "train.grad_accum_steps=2")
    tr.folder.close()
    assert why_not_whole(tr) == "gradient accumulation"
    tr = small_trainer("trm", tmp_path / "jac", "train.jacobian_weight=0.1")
    tr.folder.close()
    assert "jacobian_weight" in why_not_whole(tr)


@pytest.mark.slow
def test_the_whole_step_compiles_with_inductor(tmp_path: Path) -> None:
    """The real backend (C++ code generation on the CPU; minutes here): the step runs and trains."""
    tr = small_trainer("trm", tmp_path / "run", "compile=true")
    try:
        losses = []
        for _ in range(4):
            losses.append(tr.train_step()["loss"])
            tr.step += 1
        assert all(torch.isfinite(torch.tensor(losses)))
        assert tr.compiled is not None  # no fallback to the looped body
    finally:
        tr.folder.close()
        torch._dynamo.reset()


# every family whose whole step compiles: (family, extra overrides, relative tolerance); trm runs by default, the
# rest are slow. The Attractor puzzle model compiles whole and trains, but its compiled and eager
# runs part in float64 (ATTRACTOR_OPEN). The LM with MuonAdamW's
# Newton-Schulz iteration in float64 (the recipe's bfloat16 rounds a 1e-16 difference to 1e-3); its AdamW groups
# agree to ~1e-10 after 12 steps, not to float64 rounding (not found why). The LTG model at a fixed loop count (each
# count a sampler draws is its own graph: the loop is unrolled) and without dropout (a compiled graph draws its masks
# apart from the eager run's: the two first steps' gradients then differ in sign in places).
ATTRACTOR_OPEN = ("issue 47, open: in float64 the compiled and eager losses agree for 3 steps, then part by 2e-7 at step 4 "
                  "(the authors' Anderson inner solve) or 2e-5 at step 3 (model.deq_solver=picard); not found why")
FAMILIES = [
    ("trm", [], 1e-9),
    pytest.param("fprm", [], 1e-9, marks=pytest.mark.slow),
    pytest.param("hrm", [], 1e-9, marks=pytest.mark.slow),
    pytest.param("attractor_puzzle", ["model.jacobian_samples=2"], 1e-9,  # the CPU recipe's Jacobian term
                 marks=[pytest.mark.slow, pytest.mark.xfail(reason=ATTRACTOR_OPEN, strict=False)]),
    pytest.param("ltg_recurrent", ["train.loop_sampler=fixed", "~train.loop_sampler_options", "model.dropout=0"], 1e-9,
                 marks=pytest.mark.slow),
    pytest.param("lm_transformer", ["train.muon_ns_dtype=float64"], 1e-7, marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("family", "extra", "rel"), FAMILIES)
def test_a_compiled_training_runs_through_its_warm_up_without_recompiling(
    family: str, extra: list, rel: float, tmp_path: Path
) -> None:
    """12 compiled steps inside a 20-step warm-up (the rate changes every step; so do the step, the EMA weight
    and MuonAdamW's momentum): at most one recompilation (dynamo's graph count), no fallback, and every step's
    loss, the weights and the EMA equal the eager run's. In float64 (the default dtype while the trainers are
    built; no bf16 autocast): in float32 a halting decision or a sign-SGD row flips on a rounding difference within a few steps
    and the runs part (TRM: step 7), so the comparison is made where rounding cannot decide it. ``aot_eager``:
    Dynamo and AOT autograd as inductor sees them, without generating C++ (``..._with_inductor``: the real
    backend)."""
    over = ["train.warmup_steps=20", "train.ema_warmup=true", "bf16=false", "loop_train.state_dtype=auto",
            "loop_eval.state_dtype=auto", *extra]
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        eager = small_trainer(family, tmp_path / "eager", *over)
        compiled = small_trainer(family, tmp_path / "compiled", "compile=true", *over)
    finally:
        torch.set_default_dtype(before)
    assert next(compiled.model.parameters()).dtype == torch.float64
    compiled.compiled = CompiledStep(compiled, backend="aot_eager")
    compiled.model.load_state_dict(eager.model.state_dict())
    if eager.ema is not None:
        compiled.ema.load_state_dict(eager.ema.state_dict())
    torch._dynamo.reset()
    counters.clear()
    try:
        lrs = []
        for _ in range(12):
            a, b = eager.train_step(), compiled.train_step()
            assert compiled.compiled is not None, "fell back to the eager step"
            eager.step += 1
            compiled.step += 1
            lrs.append(b["lr"])
            assert float(b["loss"]) == pytest.approx(float(a["loss"]), rel=rel, abs=1e-12), eager.step
        assert len(set(lrs)) == 12  # the warm-up: a new rate every step
        assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
        for (name, p), q in zip(eager.model.named_parameters(), compiled.model.parameters()):
            torch.testing.assert_close(q, p, rtol=10 * rel, atol=rel, msg=name)
        for name, s in (eager.ema.shadow if eager.ema is not None else {}).items():
            torch.testing.assert_close(compiled.ema.shadow[name], s, rtol=10 * rel, atol=rel, msg=name)
    finally:
        eager.folder.close()
        compiled.folder.close()
        torch._dynamo.reset()


def test_an_eager_evaluation_between_compiled_steps_does_not_recompile(tmp_path: Path) -> None:
    """An evaluation (eager) fills the model's caches, e.g. the rotary tables; the compiled step must not have
    guarded on them (it did: the first trace saw the table missing, the second call recompiled)."""
    tr = small_trainer("sudoku4_trm", tmp_path / "run", "compile=true")  # attention with rotary positions
    tr.compiled = CompiledStep(tr, backend="eager")
    rotary = next(m for m in tr.model.modules() if type(m).__name__ == "Rotary")
    torch._dynamo.reset()
    counters.clear()
    try:
        for i in range(3):
            tr.meter.add(tr.train_step())
            tr.step += 1
            if i == 0:
                tr.evaluate()
                assert rotary._cache, "the evaluation did not fill the rotary tables"
        assert tr.compiled is not None and counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])
    finally:
        tr.folder.close()
        torch._dynamo.reset()


def test_the_recompile_limit_falls_back_to_the_eager_step(tmp_path: Path, monkeypatch, caplog) -> None:
    """A recompile-limit failure (``FailOnRecompileLimitHit``: fullgraph's hard failure, not a dynamo exception)
    falls back like any compile failure: logged once with its reason, the run steps eagerly with the optimiser's
    state as the compiled steps left it. A new clipping norm after the first step (a constant of the graph)
    recompiles; a limit of 1 makes that recompilation fail."""
    tr = small_trainer("trm", tmp_path / "run", "compile=true", "train.warmup_steps=20")
    tr.compiled = CompiledStep(tr, backend="eager")
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 1)
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)  # the fallback's looped body, uncompiled here
    torch._dynamo.reset()
    try:
        with caplog.at_level("WARNING", logger="loopformer"):
            losses = []
            for _ in range(3):
                losses.append(tr.train_step()["loss"])
                tr.step += 1
                tr.config.train.grad_clip += 0.5
        assert tr.compiled is None and all(math.isfinite(v) for v in losses)
        said = [r.getMessage() for r in caplog.records if "torch.compile of the whole step failed" in r.getMessage()]
        assert len(said) == 1 and "FailOnRecompileLimitHit" in said[0], said
        opt = tr.optimizer
        counts = {float(st["step"]) for st in opt.state.values() if "step" in st}
        assert counts == {3.0}, counts  # one compiled step, then two eager ones, each counted once
    finally:
        tr.folder.close()
        torch._dynamo.reset()
