"""Benchmark 14: the whole training step compiled vs eager on the CPU: what compiling costs, what it saves, and how
close each step comes to the machine's matmul rate (issues 33, 47).

One row per CPU recipe family (``RECIPES``): the CPU recipes ``sudoku4_fprm``, ``sudoku4_trm``,
``attractor_puzzle_sudoku4``, ``kg_depth_recurrent`` and ``lm_transformer`` at their own model size and batch, and
HRM (no CPU recipe: ``paper_sudoku_extreme_hrm`` at the CPU recipes' width, d 64, 4 heads, batch 64). Shrunk: the
data (256 generated training rows, 8 held out; the LM reads a tiny prepared corpus), and the recurrent recipe's
Poisson loop sampler (2-8 loops) is fixed at its mean, 4 loops (each count it draws is its own graph: the loop is
unrolled). Two trainers from the same weights, eager and ``compile: true`` (``loopformer.train.compiled``: forward
through the loop engine, loss, gradients, clipping, divergence check, optimiser and EMA in one inductor graph).

- *compile time*: the CPU time (this process and the C++ compiler it runs; ``compile_threads = 1``) of the compiled
  trainer's first ``WARMUP`` steps (tracing, C++ generation and compilation, any recompilation; a fresh inductor
  cache, and the process's one-time inductor start-up paid before the first family, ``inductor_first_use_s``) less
  those steps at the compiled rate; the wall time beside it, with the load average (this machine is shared);
- *step times*: the two trainers take interleaved steps, one thread, process CPU time per step; figure = eager /
  compiled (above 1: compiling helps), median of the per-round ratios;
- *warm cache*: a third trainer's first compiled step once the graph is in inductor's on-disk cache (a second run of
  the same recipe on the same machine: Dynamo traces again, the compiled code is read back), less one compiled step;
- *break-even*: compile CPU time / (eager - compiled step CPU time) steps, cold and warm, beside the recipe's own
  ``train.steps``.

``matmul_share.*`` (issue 47): at ``sudoku4_fprm``'s recipe size, a step's FLOPs (``torch.utils.flop_counter``'s
formulas: matmuls, convolutions) over its time, divided by the FLOP/s of the same dense calls alone: every call with
a FLOP formula in one eager step (shapes, strides and operator as the step made them) is recorded and replayed
back to back. As FLOPs are equal, the share is replay time / step time. Eager step, compiled step and replay are
interleaved; runs repeat until two agree within 10% (``bench_flops.stable_runs``). Where the rest goes: the
attention calls (CPU flash attention, which has no FLOP formula) replayed alone the same way, and the compiled
region's own time (the rest of the compiled step is the trainer's host work around it).
"""

from __future__ import annotations

import os
import resource
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import Result, paired_ratio, side_by_side, summary

# family -> (recipe, overrides beyond the shared ones); the CPU recipes as they are, the data shrunk
SMALL_DATA = ["~data.train_path", "~data.eval_path", "data.train_size=256", "data.eval_size=8"]
RECIPES: dict[str, tuple[str, list[str]]] = {
    "fprm": ("sudoku4_fprm", SMALL_DATA),
    "trm": ("sudoku4_trm", SMALL_DATA),
    "hrm": ("paper_sudoku_extreme_hrm", [
        *SMALL_DATA, "data.options={size: 4}", "data.train_generate={min_blanks: 4, max_blanks: 10}",
        "data.eval_generate={min_blanks: 4, max_blanks: 10}", "model.d_model=64", "model.n_heads=4",
        "model.puzzle_emb_dim=64", "train.batch_size=64", "train.max_segments=8", "bf16=false"]),
    "attractor_puzzle": ("attractor_puzzle_sudoku4", SMALL_DATA),
    "recurrent": ("kg_depth_recurrent", [
        *SMALL_DATA, "data.curriculum.enabled=false", "train.loop_sampler=fixed", "train.loop_sampler_options={n: 4}"]),
    "lm_transformer": ("lm_transformer", ["data.eval_size=8"]),
}  # fmt: skip
COMMON = ["train.eval_every=0", "train.checkpoint_every=0", "train.progress=false", "train.threads=1",
          "train.log_every=1000", "device=cpu"]  # fmt: skip
QUICK = ["model.d_model=32", "model.n_heads=2", "train.batch_size=8", "data.train_size=16"]
FAMILIES_ENV = "LOOPFORMER_STEP_COMPILE_FAMILIES"  # e.g. "fprm,trm": those rows alone, the others kept by the merge
MERGE_BY_NAME = True
WARMUP = 3  # compiled steps counted as compiling (the first traces; a carry's second layout may trace again)
SHARE_TARGET = 0.6


def trainer(family: str, out_dir: Path, quick: bool, *extra: str) -> Any:
    """The family's trainer at the size this benchmark uses."""
    from benchmarks.paper_small import ROOT, token_file
    from loopformer.config import load_config
    from loopformer.train import Trainer

    recipe, over = RECIPES[family]
    if family.startswith("lm_"):
        over = [*over, f"data.options.path={token_file(out_dir.parent / 'tokens')}", "data.options.val_fraction=0.25"]
    if quick:
        over = [*over, *(q for q in QUICK if not (family.startswith("lm_") and q.startswith("data.")))]
    path = ROOT / "recipes" / f"{recipe}.yaml"
    return Trainer(load_config(path, [*COMMON, *over, *extra, f"out_dir={out_dir}"]))


def _stepper(tr: Any):
    def one() -> None:
        tr.meter.add(tr.train_step())
        tr.step += 1

    return one


def cpu_seconds() -> float:
    """CPU seconds of this process and its finished children (the C++ compiler: inductor compiles in this process
    with ``compile_threads = 1``, see ``run``)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def inductor_start_up() -> float:
    """Wall seconds of compiling a trivial function: inductor's one-time imports and C++ toolchain checks, paid by the
    first compilation in a process (kept out of the first family's compile time)."""
    import torch
    from torch._inductor.utils import fresh_cache

    start = time.perf_counter()
    with fresh_cache():
        torch.compile(lambda x: (x * 2).sum())(torch.ones(4))
    return time.perf_counter() - start


def warm_cache_first_step(family: str, tmp: Path, quick: bool) -> float:
    """CPU seconds of a new compiled trainer's first step once the family's graph is in inductor's on-disk cache (a
    second run of the same recipe on the same machine): Dynamo traces again, the compiled code is read back."""
    import torch._dynamo

    torch._dynamo.reset()
    again = trainer(family, tmp / "again", quick, "compile=true")
    try:
        cpu = cpu_seconds()
        _stepper(again)()
        return cpu_seconds() - cpu
    finally:
        again.folder.close()
        torch._dynamo.reset()


class DenseCalls:
    """Every call with a FLOP formula (``torch.utils.flop_counter.flop_registry``) in a region, recorded with copies
    of its arguments so it can be replayed alone: the step's dense work on its own shapes."""

    def __init__(self, select: Any = None) -> None:
        self.calls: list[tuple[Any, list[Any], dict[str, Any]]] = []
        self.flops = 0
        self.select = select  # op name -> bool: record these calls instead (their FLOPs are not summed)

    def record(self, fn: Any) -> DenseCalls:
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils.flop_counter import flop_registry

        owner = self

        class Record(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                formula = flop_registry.get(func._overloadpacket)
                if owner.select is not None and owner.select(str(func._overloadpacket)):
                    owner.calls.append((func, [a.detach().clone() if hasattr(a, "detach") else a for a in args], kwargs))
                elif owner.select is None and formula is not None:
                    owner.flops += int(formula(*args, **kwargs, out_val=out))
                    owner.calls.append((func, [a.detach().clone() if hasattr(a, "detach") else a for a in args],
                                        kwargs))  # fmt: skip
                return out

        with Record():
            fn()
        return self

    def replay(self) -> None:
        for func, args, kwargs in self.calls:
            func(*args, **kwargs)

    def ops(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for func, _, _ in self.calls:
            out[str(func._overloadpacket)] = out.get(str(func._overloadpacket), 0) + 1
        return out


def matmul_share(eager: Any, compiled: Any, quick: bool) -> list[Result]:
    """The eager and the compiled step's FLOP/s over the FLOP/s of the same dense calls alone (module docstring)."""
    from statistics import median

    from torch.utils.flop_counter import FlopCounterMode

    from benchmarks.bench_flops import AGREE, stable_runs

    step_e, step_c = _stepper(eager), _stepper(compiled)
    dense = DenseCalls().record(step_e)
    attention = DenseCalls(lambda op: "attention" in op).record(step_e)  # no FLOP formula on the CPU: not counted
    with FlopCounterMode(display=False) as counter:
        step_e()
    flops = int(counter.get_total_flops())
    graph = compiled.compiled
    inside: list[float] = []
    fn = graph.fn

    def timed_graph(*args: Any) -> Any:  # the compiled region's own CPU time (the rest of the step is host work)
        start = time.process_time()
        try:
            return fn(*args)
        finally:
            inside.append(time.process_time() - start)

    graph.fn = timed_graph
    variants = {"eager": step_e, "compiled": step_c, "dense_calls": dense.replay, "attention_calls": attention.replay}

    def figures(times: dict[str, list[float]]) -> dict[str, float]:
        rows = list(zip(times["eager"], times["compiled"], times["dense_calls"]))
        return {"eager": median(d / e for e, _, d in rows), "compiled": median(d / c for _, c, d in rows)}

    runs, times = stable_runs(variants, figures, repeats=2 if quick else 5, budget_s=60 if quick else 600)
    graph.fn = fn
    last = runs[-1]
    stable = len(runs) >= 2 and all(abs(last[k] / runs[-2][k] - 1) <= AGREE for k in last)
    med = summary(times)
    details = {
        "recipe": "sudoku4_fprm" + (" (quick size)" if quick else ""), "clock": "process CPU time", "threads": 1,
        "step_flops": flops, "dense_call_flops": dense.flops, "dense_calls": dense.ops(),
        "gflops_per_s": {k: round(flops / med[k]["median_s"] / 1e9, 2) for k in ("eager", "compiled", "dense_calls")},
        "runs": runs, "stable_within_10pct": stable, "times": med, "compiled_whole": compiled.compiled is not None,
        "attention_calls": attention.ops(), "compiled_graph_call_median_s": round(median(inside), 6),
    }  # fmt: skip
    unstable = "" if stable else f"; runs did not agree within 10% ({runs})"
    gf = details["gflops_per_s"]
    say = (f"{flops / 1e9:.2f} GFLOP a step: eager {gf['eager']:.1f}, compiled {gf['compiled']:.1f}, the same dense "
           f"calls alone {gf['dense_calls']:.1f} GFLOP/s")  # fmt: skip
    target = None if quick else f">= {SHARE_TARGET}"
    met = None if quick else bool(last["compiled"] >= SHARE_TARGET and stable)
    return [
        Result("step_compile", "step_compile.matmul_share.fprm_compiled", last["compiled"], "fraction", target, met,
               f"compiled step's FLOP/s / the same dense calls' FLOP/s; {say}{unstable}", details),
        Result("step_compile", "step_compile.matmul_share.fprm_eager", last["eager"], "fraction", None, None,
               f"informational: the eager step's share{unstable}", {"runs": runs}),
    ]  # fmt: skip


def _family(name: str, tmp: Path, quick: bool, start_up_s: float | None) -> list[Result]:
    import torch
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eager = trainer(name, tmp / "eager", quick)
    compiled = trainer(name, tmp / "compiled", quick, "compile=true")
    compiled.model.load_state_dict(eager.model.state_dict())
    if eager.ema is not None:
        compiled.ema.load_state_dict(eager.ema.state_dict())
    tc = eager.config.train
    details: dict[str, Any] = {"recipe": RECIPES[name][0], "threads": torch.get_num_threads(),
                               "batch_size": tc.batch_size, "d_model": eager.config.model.fields.get("d_model"),
                               "parameters": eager.model.num_parameters(), "recipe_steps": tc.steps}  # fmt: skip
    if start_up_s is not None:
        details["inductor_first_use_s"] = round(start_up_s, 1)
    rows: list[Result] = []
    try:
        start, cpu = time.perf_counter(), cpu_seconds()
        for _ in range(WARMUP):
            _stepper(compiled)()
        details["warmup_s"] = round(time.perf_counter() - start, 1)
        details["warmup_cpu_s"] = round(cpu_seconds() - cpu, 1)
        details["load_average_while_compiling"] = round(os.getloadavg()[0], 2)
        details["graphs"] = int(counters["stats"]["unique_graphs"])
        details["compiled_whole"] = compiled.compiled is not None
        times = side_by_side({"eager": _stepper(eager), "compiled": _stepper(compiled)}, repeats=2 if quick else 5,
                             warmup=1, clock=time.process_time)  # fmt: skip
        if name == "fprm":
            rows += matmul_share(eager, compiled, quick)
        details["warm_cache_first_step_cpu_s"] = round(warm_cache_first_step(name, tmp, quick), 1)
    finally:
        eager.folder.close()
        compiled.folder.close()
    details["times"] = summary(times)
    ratio = paired_ratio(times, "eager", "compiled")
    what = "whole step" if details["compiled_whole"] else "looped body only"
    # the trade: compiling costs the warm-up's time beyond its steps at the compiled rate, and each later step
    # saves (eager - compiled); the break-even step count is their ratio (none when compiling is slower)
    eager_s, compiled_s = details["times"]["eager"]["median_s"], details["times"]["compiled"]["median_s"]
    details["compile_s"] = round(details["warmup_s"] - WARMUP * compiled_s, 1)  # wall: the machine's load in it
    details["compile_cpu_s"] = round(details["warmup_cpu_s"] - WARMUP * compiled_s, 1)
    details["compile_warm_cpu_s"] = round(details["warm_cache_first_step_cpu_s"] - compiled_s, 1)
    saved = eager_s - compiled_s
    details["break_even_steps"] = round(details["compile_cpu_s"] / saved) if saved > 0 else None
    details["break_even_steps_warm_cache"] = round(details["compile_warm_cpu_s"] / saved) if saved > 0 else None
    pays = (f"pays after {details['break_even_steps']:,} steps (the recipe trains {tc.steps:,})" if saved > 0
            else "never pays (compiled is slower)")  # fmt: skip
    row = Result("step_compile", f"step_compile.{name}", ratio, "x", None, None,
                 f"informational: eager / compiled ({what}, inductor) step CPU time, {details['recipe']}; compiling "
                 f"took {details['compile_cpu_s']:.0f} CPU s ({details['compile_s']:.0f} s of wall time at load "
                 f"{details['load_average_while_compiling']}; {details['graphs']} graph(s)) and {pays}",
                 details)  # fmt: skip
    return [row, *rows]


def run(quick: bool = False, families: tuple[str, ...] | None = None) -> list[Result]:
    import torch
    import torch._inductor.config
    from torch._inductor.utils import fresh_cache

    torch.set_num_threads(1)
    # code generation and the C++ compiler in this process, one at a time: its CPU time is all counted (a pool of
    # compile workers would hide theirs), and one core is what the figures are for
    torch._inductor.config.compile_threads = 1
    out: list[Result] = []
    chosen = tuple(f for f in os.environ.get(FAMILIES_ENV, "").split(",") if f)
    unknown = sorted(set(chosen) - set(RECIPES))
    if unknown:
        raise ValueError(f"{FAMILIES_ENV}: unknown families {unknown}; choose from {', '.join(RECIPES)}")
    names = families or chosen or (("fprm",) if quick else tuple(RECIPES))
    start_up: float | None = inductor_start_up()
    for name in names:
        # a fresh inductor cache for each family: its whole compile time is paid, none read from an earlier run
        with tempfile.TemporaryDirectory() as tmp, fresh_cache():
            try:
                out += _family(name, Path(tmp), quick, start_up)
            except Exception as err:  # a compile failure is a finding, recorded with its message
                first = str(err).strip().splitlines()[0] if str(err).strip() else ""
                out.append(Result("step_compile", f"step_compile.{name}", None, "x", None, False,
                                  f"failed: {type(err).__name__}: {first}"))  # fmt: skip
        start_up = None
    return out
