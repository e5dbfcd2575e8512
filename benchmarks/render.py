"""Render results.json into docs/performance.md: the command, the machine, the table, the targets
met or missed (with the reason), per-benchmark details and how to run the GPU benchmark."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from benchmarks.common import fmt

NOTES = Path(__file__).resolve().with_name("notes.md")  # hand-written analysis, appended verbatim

METHODS = {
    "engine": (
        "1. Engine overhead",
        "A training step (forward + backward) of FPRM through `LoopedModel.forward -> run_loop` vs a "
        "minimal hand-written loop of the same math over `model.step` (same weights, batch and initial "
        "iterate; n iterations, the first n - k without gradient, truncated backprop through the last k). "
        "Losses and gradients of the two are checked equal before timing. `damped` is FPRM's Algorithm 1 "
        "(the hand loop computes the same per-sample residual and patience rule); `picard` is z <- f(z).",
    ),
    "flops": (
        "2. Arithmetic efficiency and graph breaks",
        "FLOPs of the damped FPRM training step counted by `torch.utils.flop_counter.FlopCounterMode` "
        "(matmuls, attention, convolutions), divided by its time, as a fraction of a float32 1024 x 1024 "
        "matmul's FLOP/s measured interleaved with it (eager step, compiled step, matmul in rotating "
        "order), at d 128 (batch 16) and the paper's FPRM size d 512 (8 heads, 81 tokens; batch 4). "
        "With one thread the clock is the process's CPU time. Runs repeat until two consecutive runs "
        "agree within 10%. `compile_graphs` counts Dynamo's graphs of the step, the solver update and "
        "the whole looped forward (`torch._dynamo.explain`).",
    ),
    "memory": (
        "3. Memory vs loops",
        "Bytes autograd saves for backward (`torch.autograd.graph.saved_tensors_hooks`, each storage "
        "counted once) in an FPRM forward at 4, 16 and 64 loops. `truncated` / `neumann` use k = 4; "
        "`truncated_adaptive` takes the engine's adaptive-halting path (ring buffer + replay of the last k steps).",
    ),
    "halting": (
        "4. Adaptive halting",
        "A briefly trained FPRM (4x4 Sudoku, cached under benchmarks/.cache) evaluated on 4..10-blank "
        "held-out puzzles with per-sample residual halting + compaction, the same halting with masking "
        "instead of compaction, and the fixed maximum (64) steps. The halting tolerance is calibrated on a "
        "separate set to match the fixed run's accuracy within one point.",
    ),
    "solvers": (
        "5. Solvers vs TorchDEQ",
        "Forward solve to tolerance (gradient tracking on, IFT backward attached) on linear maps with "
        "spectral radius 0.9 / 0.99 (float64, d 128, batch 8, tol 1e-3 and 1e-6), on the trained FPRM's "
        "fixed points (float32, tol 1e-4) and on a trained Attractor head's (recipes/attractor_sudoku4.yaml "
        "trained 600 steps, float32, the model's tol 3e-4; both models cached under benchmarks/.cache). Map evaluations per sample count every row the map was given "
        "(loopformer evaluates only the samples still running; TorchDEQ the whole batch), including the "
        "step recomputed for the implicit gradient. IFT gradient error against the closed form, with "
        "loopformer's backward iterations (max over samples). Ratio = loopformer's fastest solver / "
        "TorchDEQ's fastest (process CPU time with one thread); loopformer's IFT at its defaults "
        "(safe_anderson backward, tol auto: 1e-9 on the float64 maps, cap 200).",
    ),
    "compile": (
        "6. torch.compile and threads",
        "The damped training step eager vs with `model.step` compiled, and with 1 thread vs one per "
        "physical core.",
    ),
    "generation": (
        "7. Sudoku generation",
        "Wall seconds for 10,000 distinct unique-solution 9x9 Sudokus (`SudokuTask.generate`, seed 0, one "
        "worker process per CPU), the compiled kernels loaded before the clock starts; uniqueness of the "
        "first 1,000 re-checked.",
    ),
    "data": (
        "8. Data loading",
        "`SudokuTask.load` on a 1M-row CSV in Sudoku-Extreme's format (rows: the two real puzzles, solved "
        "and relabelled by random validity-preserving transforms), every row validated, best of 2 runs; "
        "the per-row path (csv module + the task's row parser) on a 20,000-row slice beside it. Then "
        "`load_hrm_folder` opening the same rows prepared as an HRM / TRM numpy folder (memory-mapped "
        "`.npy`, checks, int64 arrays), best of 3. The first int64 copy of a large array pays the page "
        "faults, so wall time depends strongly on the machine's load (recorded beside each figure).",
    ),
    "reference": (
        "9. loopformer vs the authors' code",
        "Time per training step (forward + backward + AdamW step, one deep-supervision segment) and per "
        "evaluation batch of loopformer vs the authors' implementation, imported from a checkout at run "
        "time (`LOOPFORMER_REF_<MODEL>` or `LOOPFORMER_REFS`), at the same configuration, batch, loop "
        "counts and dtype (float32, CPU), interleaved in rotating order, each pair in its own process. "
        "Ratio = loopformer / reference (< 1: loopformer faster). Configurations and the substitutions "
        "made to run the references on CPU are listed per model.",
    ),
    "startup": (
        "10. Command start-up",
        "User CPU seconds of `python -m loopformer --help`, `python -m loopformer recipes`, `python -m "
        "loopformer train sudoku4_trm --print-config` and the default job's first training step, each in a "
        "fresh process (`resource.getrusage(RUSAGE_CHILDREN)` around each), interleaved, median of the "
        "repeats; the load average before and after is in the details. Targets: under 1 CPU-second for "
        "`--help` and `recipes` (neither imports torch, scipy or matplotlib: tests/test_startup.py); under 2 "
        "for `--print-config` (the configuration is read and checked before the trainer is imported; the "
        "checks load the model, loop and task registries, so torch: about 1.8 s of it here). The first "
        "step is informational (torch.optim's optimizer imports Dynamo, the Sudoku generator numba).",
    ),
    "threads": (
        "11. CPU threads for the CPU recipes",
        "Seconds per training step of the default job (FPRM, 4x4 Sudoku) and `sudoku4_trm` at "
        "`train.threads=1` vs `2`, interleaved rounds, from each run's own step clock (steps 2..8); "
        "ratio = 2 threads / 1 thread (above 1: two threads slower). Measured on the machine as loaded "
        "as it was (load average in the details).",
    ),
    "inference": (
        "12. Inference at equal accuracy vs the authors' evaluation",
        "A trained FPRM evaluated on the same held-out puzzles two ways: the FPRM authors' evaluation (damped "
        "solver, batch-wide halting at residual 0.1, rel. sup norm; loopformer's `batch_residual` emulation, not "
        "their code) vs loopformer's per-sample halting with the solver and tolerance `--auto-solver`'s search "
        "picks on other puzzles (the fastest by measured time at >= the authors' accuracy there). "
        "`inference.fprm_vs_reference.seed<N>`: the 9x9 FPRMs of the FPRM vs TRM head-to-head (runs/sudoku9/"
        "seed<N>, 60 CPU-minutes, made by experiments/sudoku9_cpu.py) under their authors' protocol (gamma 0.997, "
        "patience 10, cap 1000, 250 a batch), 250 timed puzzles, 100 for the search; "
        "`inference.fprm_vs_reference_sudoku4`: the halting benchmark's 4x4 FPRM, 256 timed, 128 for the "
        "search. Ratio = wall time loopformer / authors, median "
        "of interleaved pairs; runs repeat until two agree within 10%.",
    ),
    "step_compile": (
        "14. The whole step compiled on the CPU: compile time, break-even, share of the matmul rate",
        "One row per CPU recipe family (benchmarks/bench_step_compile.py: the CPU recipes at their model size and "
        "batch, 256 generated training rows; HRM, which has no CPU recipe, is `paper_sudoku_extreme_hrm` at d 64, "
        "batch 64, 4x4 Sudoku; `kg_depth_recurrent` at a fixed 4 loops instead of its Poisson draw of 2-8). Eager vs "
        "`compile=true` trainers from the same weights: compile CPU seconds (the first 3 compiled steps, tracing and "
        "C++ compilation in this process, a fresh inductor cache, less 3 steps at the compiled rate; the wall time "
        "and load beside it), then interleaved steps (process CPU time, one thread). Break-even = compile CPU s / "
        "(eager - compiled) step, beside the recipe's `train.steps`; warm cache: a new compiled trainer's first step "
        "once the graph is in inductor's on-disk cache (a second run of the recipe on the machine). `matmul_share.*`: at `sudoku4_fprm`'s size, "
        "the step's FLOP/s over the FLOP/s of the same dense calls (every matmul / convolution of one eager step, "
        "recorded with its arguments and replayed alone), eager, compiled and replay interleaved; runs repeat until "
        "two agree within 10%.",
    ),
    "contraction": (
        "17. The contraction term's cost (loopformer's addition)",
        "A training step of the 9x9 head-to-head's FPRM (`experiments/sudoku9_cpu.py`: `fprm_authors`) with "
        "`train.jacobian_weight` (`fprm_authors_jac`) / without: same weights (seed 0's shipped 60-minute EMA "
        "weights), seed and batches, curriculum off, one thread, process CPU time of interleaved steps. Beside it "
        "the FLOPs ratio of one step each and each side's mean loop iterations a step (equal: the time ratio is "
        "the term's alone).",
    ),
}


def _met(m: Any) -> str:
    return {True: "yes", False: "**no**", None: "-"}.get(m, str(m))


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{1000 * seconds:.1f}"


def _details(r: dict[str, Any]) -> list[str]:
    d = r.get("details", {})
    name = r["name"]
    lines: list[str] = []
    times = d.get("times")
    parts = ", ".join(f"{k} {_ms(v['median_s'])} ms" for k, v in (times or {}).items())
    if r["benchmark"] == "contraction" and times:
        lines.append(f"- `{name}`: median step times {parts} (batch {d.get('batch_size')}, {d.get('weights')})")
        lines.append(
            f"  GFLOP a step {d.get('gflop_per_step')} (ratio {d.get('flops_ratio')}); mean loop iterations a "
            f"step {d.get('loop_steps_mean')}"
        )
    if r["benchmark"] == "step_compile" and "break_even_steps" in d:
        be, bw = d["break_even_steps"], d.get("break_even_steps_warm_cache")
        warm = "-" if "compile_warm_cpu_s" not in d else f"{d['compile_warm_cpu_s']:.0f} / {'never' if bw is None else f'{bw:,}'}"
        lines.append(
            f"| {name.split('.', 1)[1]} | {d['recipe']} | {d.get('d_model')} | {d['batch_size']} | {d['graphs']} | "
            f"{d['compile_cpu_s']:.0f} | {d['compile_s']:.0f} ({d['load_average_while_compiling']}) | "
            f"{_ms(times['eager']['median_s'])} | {_ms(times['compiled']['median_s'])} | {r['value']:.2f} | "
            f"{'never' if be is None else f'{be:,}'} | {d['recipe_steps']:,} | {warm} |"
        )
        return lines
    if r["benchmark"] == "step_compile" and "dense_calls" in d:
        gf = d["gflops_per_s"]
        lines.append(
            f"- `{name}`: {d['recipe']}, {d['step_flops'] / 1e9:.2f} GFLOP a step; eager {gf['eager']:.1f}, compiled "
            f"{gf['compiled']:.1f}, the same dense calls alone {gf['dense_calls']:.1f} GFLOP/s ({d['clock']}); "
            f"dense calls {d['dense_calls']}; runs "
            + ", ".join(f"eager {x['eager']:.3f} / compiled {x['compiled']:.3f}" for x in d["runs"])
            + f" (stable within 10%: {d['stable_within_10pct']})"
        )
        if "attention_calls" in d:
            t = d["times"]
            lines.append(
                f"  compiled step {_ms(t['compiled']['median_s'])} ms: the compiled region "
                f"{_ms(d['compiled_graph_call_median_s'])} ms (host work around it the rest), the dense calls alone "
                f"{_ms(t['dense_calls']['median_s'])} ms, the attention calls alone {_ms(t['attention_calls']['median_s'])}"
                f" ms ({d['attention_calls']}, not in the FLOP count)"
            )
        return lines
    if r["benchmark"] in ("engine", "compile", "flops") and times:
        lines.append(f"- `{name}`: median times {parts}")
        if "loss_abs_diff" in d:
            lines.append(
                f"  (loss difference {d['loss_abs_diff']:.1e}"
                + (
                    f", gradient rel. difference {d['grad_max_rel_diff']:.1e})"
                    if "grad_max_rel_diff" in d
                    else ")"
                )
            )
        if r["benchmark"] == "engine" and "engine" in times and "hand" in times:
            # (paired ratio - 1) x hand time: the engine's extra time per iteration
            per_iter = (r["value"] - 1) * times["hand"]["median_s"] / d["size"]["loops"]
            lines.append(
                f"  size {d['size']}, {d.get('params')} parameters; "
                f"engine overhead per iteration {1e3 * per_iter:.2f} ms"
            )
        if r["benchmark"] == "flops":
            lines.append(
                f"  step {d['step_flops'] / 1e9:.2f} GFLOP at {d['step_gflops_per_s']:.1f} GFLOP/s eager, "
                f"{d.get('step_compiled_gflops_per_s', float('nan')):.1f} compiled; matmul n={d['matmul_n']} "
                f"at {d['matmul_gflops_per_s']:.1f} GFLOP/s ({d.get('clock', 'wall time')}); runs "
                + ", ".join(f"{x['eager']:.3f}" for x in d.get("runs", []))
                + f" (stable within 10%: {d.get('stable_within_10pct')})"
            )
        if "compile_s" in d:
            lines.append(f"  backend {d['backend']}, compile + first two steps {d['compile_s']:.1f} s")
    elif r["benchmark"] == "compile" and "error" in d:
        lines.append(f"- `{name}`: failed: {d['error']}")
    elif r["benchmark"] == "memory" and "saved_bytes" in d:
        mem = d["saved_bytes"]
        cells = " | ".join(f"{int(mem[k]) / 2**20:.2f}" for k in sorted(mem, key=int))
        lines.append(f"| {name.split('.', 1)[1]} | {cells} | {r['value']:.3f} |")
    elif r["benchmark"] == "halting" and "evals" in d:
        lines.append(
            f"- tolerance {d['tol']} (calibrated), {d['n_eval']} held-out puzzles, cap {d['max_steps']} steps, "
            f"model trained {d['train_steps']} steps ({d['train_seconds']:.0f} s)"
        )
        lines.append("")
        lines.append("| variant | exact acc | token acc | steps mean | min | max | median time (ms) |")
        lines.append("|---|---|---|---|---|---|---|")
        for k, ev in d["evals"].items():
            t = times.get(k, {}).get("median_s") if times else None
            lines.append(
                f"| {k} | {ev['exact_acc']:.3f} | {ev['token_acc']:.3f} | {ev['steps_mean']:.1f} | "
                f"{ev['steps_min']} | {ev['steps_max']} | {_ms(t)} |"
            )
        sb = d.get("steps_by_blanks", {})
        if sb:
            lines.append("")
            lines.append(
                "Mean steps by number of blanks: " + ", ".join(f"{k}: {v:.1f}" for k, v in sb.items())
            )
    elif r["benchmark"] == "generation" and "count" in d:
        lines.append(
            f"- `{name}`: {d['count']} puzzles in {d['seconds']} s ({d['per_second']} / s, "
            f"{d['workers']} workers, load {d['load_average_1min']}); distinct {d['distinct_fraction']}, "
            f"unique {d['verified_unique']}, blanks {d['blanks_min']}-{d['blanks_max']} "
            f"(mean {d['blanks_mean']}), backtracks mean {d['backtracks_mean']} / max {d['backtracks_max']}; "
            f"kernel compile or cache load {d.get('compile_or_cache_load_s')} s"
        )
    elif r["benchmark"] == "data":
        extra = ""
        if "per_row_path_rows_per_s" in d:
            extra = (
                f", {d['file_MiB']} MiB in {d['seconds']} s ({d.get('cpu_seconds')} CPU s); per-row path {d['per_row_path_rows_per_s']:.0f} rows/s "
                f"({d['speedup_vs_per_row_path']}x slower)"
            )
        lines.append(
            f"- `{name}`: {fmt(r['value'], r['unit'])} at {d['rows']} rows{extra}; load average {d.get('load_average_1min')}"
        )
    elif r["benchmark"] == "reference" and "train" in d:
        lines.append(
            f"- **{name}** vs {d['repo']} @ {d['commit']}: training step "
            f"{1e3 * d['train']['loopformer_median_s']:.1f} ms vs {1e3 * d['train']['reference_median_s']:.1f} ms "
            f"(ratio {d['train']['ratio']:.3f}, runs {[round(x, 3) for x in d['train']['runs']]}); evaluation "
            f"batch {1e3 * d['eval']['loopformer_median_s']:.1f} ms vs {1e3 * d['eval']['reference_median_s']:.1f} ms "
            f"(ratio {d['eval']['ratio']:.3f}); {d['clock']}, {d['threads']} thread(s)"
        )
        lines.append(
            f"  shape {d['shape']}; parameters loopformer {d['params']['loopformer']:,}, reference "
            f"{d['params']['reference']:,}; " + "; ".join(f"{k}: {v}" for k, v in d["config"].items())
        )
        lines.append("  substitutions: " + "; ".join(d["substitutions"]))
    elif r["benchmark"] == "reference" and r["name"].endswith("_floor"):
        lines.append(f"- `{name}`: {r['reason']}")
    elif r["benchmark"] == "reference" and r["value"] is None:
        lines.append(f"- `{name}`: {r['reason']}")
    elif r["benchmark"] == "inference" and "evals" in d:
        lines.append(
            f"- `{name}`: {d['reference']}; {d['model']}; {d['n_timed']} timed puzzles, batch {d['batch_size']}, "
            f"{d['threads']} thread(s); runs {[round(x, 3) for x in d['runs']]} at load {d['run_load_averages']}"
        )
        lines.append("")
        lines.append("| setting | solver | halting | tol | exact acc | map evals / sample | median time (ms) |")
        lines.append("|---|---|---|---|---|---|---|")
        for key, loop in (("authors", d["authors_loop"]), ("loopformer", d["loopformer_loop"])):
            ev, t = d["evals"][key], d["times"].get(key, {}).get("median_s")
            lines.append(
                f"| {key} | {loop['solver']} | {loop['halting']} | {loop['tol']:g} | {ev['exact_acc']:.3f} | "
                f"{ev['map_evals_per_sample']:.2f} | {_ms(t)} |"
            )
        s = d["search"]
        lines.append("")
        lines.append(
            f"Search ({s['n']} other puzzles, seed {s['seed']}): authors' {s['authors']['exact_acc']:.3f} in "
            f"{s['authors']['map_evals_per_sample']:.2f} map evals; candidates meeting it: "
            + ", ".join(f"{c['label']} {c['map_evals']:.2f}" for c in s["candidates"] if c["qualifies"])
            + f"; chosen {s['chosen']['label']}."
        )
        lines.append("")
    elif r["benchmark"] == "solvers" and "seeds" in d:
        lines.append(
            f"**{name}** (d {d['d']}, batch {d['batch']}): Broyden's map evaluations per sample, and the distance "
            "||z - z*|| / ||z*|| at the stop and after exactly K map evaluations (K = TorchDEQ's forward count):"
        )
        lines.append("")
        lines.append("| seed | loopformer evals | TorchDEQ evals | ratio | distance at stop (lf / TorchDEQ) | K "
                     "| distance at K (lf / TorchDEQ) |")  # fmt: skip
        lines.append("|---|---|---|---|---|---|---|")
        for seed, row in d["seeds"].items():
            lf, tdq, at_k = row["loopformer"], row["torchdeq"], row["distance_at_k"]
            lines.append(
                f"| {seed} | {lf['map_evals']:g} | {tdq['map_evals']:g} | {row['ratio']:.3f} | {lf['distance']:.1e} / "
                f"{tdq['distance']:.1e} | {row['k']} | {at_k['loopformer']:.1e} / {at_k['torchdeq']:.1e} |"
            )
        lines.append("")
    elif r["benchmark"] == "solvers" and "solvers" in d:
        lines.append(f"**{d['problem']}** (tol {d['tol']}):")
        lines.append("")
        lines.append(
            "| solver | iterations | map evals / sample | converged | median time (ms) | gradient rel. error "
            "| IFT backward steps |"
        )
        lines.append("|---|---|---|---|---|---|---|")
        for k, s in d["solvers"].items():
            ge = s.get("grad_rel_err")
            evals = s.get("map_evals_per_sample")
            lines.append(
                f"| {k} | {s['iterations']} | {'-' if evals is None else f'{evals:g}'} | {s['converged']} | "
                f"{_ms(s.get('median_s'))} | {'-' if ge is None else f'{ge:.1e}'} | {s.get('ift_steps_max', '-')} |"
            )
        lines.append("")
    return lines


def _runs_lines(info: dict[str, Any], quick: bool) -> list[str]:
    """Which commands produced the rows (a merged results file holds several runs' rows)."""
    lines = ["- rows from these runs:" + (" (quick sizes)" if quick else "")]
    for command, threads, rows in info["runs"]:
        lines.append(
            f"  - `{command}`: {rows} row{'s' if rows != 1 else ''}, torch threads {threads if threads is not None else 'not recorded'}"
        )
    return lines


def render(results: list[dict[str, Any]], info: dict[str, Any]) -> str:
    quick = any(r.get("quick") for r in results)
    out = [
        "# Performance",
        "",
        "Generated by `python -m benchmarks` (benchmarks/render.py); rerun it rather than editing this page.",
        "",
        "## How to run",
        "",
        "```",
        "python -m benchmarks                 # everything at CPU size: writes benchmarks/results.json and this page",
        "python -m benchmarks --only solvers  # one benchmark (engine, flops, memory, halting, solvers, compile, generation, data, reference, startup, threads, inference)",
        "LOOPFORMER_REFS=/path/to/checkouts python -m benchmarks --only reference   # vs the authors' code",
        "python -m benchmarks --quick         # tiniest sizes (what tests/test_benchmarks_smoke.py runs)",
        "pip install -c constraints.txt torchdeq==0.1.0   # for the TorchDEQ comparison (else it is skipped)",
        "python benchmarks/gpu.py             # CUDA: the paper recipes' compiled step, throughput, MFU, memory",
        "```",
        "",
        "Every figure is a ratio of variants measured side by side in one run: repetitions are interleaved "
        "(the order rotates every round) and the figure is the median of the per-round ratios, so load "
        "spikes on this shared machine hit both sides of a ratio. Absolute times are in "
        "`benchmarks/results.json`.",
        "",
        "## Machine",
        "",
        *_runs_lines(info, quick),
        f"- rendered: {time.strftime('%Y-%m-%d %H:%M:%S')}",
        f"- CPU: {info['cpu']} ({info['logical_cpus']} logical CPUs; the machine that rendered this page, rows may "
        "come from earlier runs)",
        f"- torch {info['torch']}, Python {info['python']}, CUDA available: {info['cuda']}",
        f"- load average when rendered: {', '.join(map(str, info['load_average']))}",
        "",
        "## Results",
        "",
        "| # | figure | value | unit | target | met | reason / note | load |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(results, 1):
        reason = (r.get("reason") or "").replace("|", "/")
        out.append(
            f"| {i} | `{r['name']}` | {fmt(r['value'], r['unit'])} | {r['unit']} | {r['target'] or '-'} | "
            f"{_met(r['met'])} | {reason} | {r.get('load_average', '')} |"
        )
    met = [r for r in results if r["met"] is True]
    missed = [r for r in results if r["met"] is False]
    out += [
        "",
        f"Targets met: {len(met)}; missed: {len(missed)}; informational or skipped: "
        f"{len(results) - len(met) - len(missed)}.",
        "",
    ]
    if missed:
        out.append("Missed:")
        out.append("")
        for r in missed:
            out.append(
                f"- `{r['name']}` = {fmt(r['value'], r['unit'])} (target {r['target']}): {r['reason']}"
            )
        out.append("")

    out += ["## Details", ""]
    for bench, (title, method) in METHODS.items():
        rows = [r for r in results if r["benchmark"] == bench]
        if not rows:
            continue
        out += [f"### {title}", "", method, ""]
        if bench == "step_compile":
            out += [
                "| family | recipe | d | batch | graphs | compile (CPU s) | compile (wall s, load) | eager (ms) | "
                "compiled (ms) | eager / compiled | break-even steps | recipe steps | warm cache: compile (CPU s) / "
                "break-even |",
                "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
            ]
        if bench == "memory":
            loops = rows[0]["details"].get("loops", [4, 16, 64])
            out += [
                "| gradient mode | " + " | ".join(f"MiB at {n} loops" for n in loops) + " | growth |",
                "|---|" + "---|" * len(loops) + "---|",
            ]
        if bench == "step_compile":  # the table's rows first, then the matmul-share lines below it
            rows = sorted(rows, key=lambda r: "break_even_steps" not in r.get("details", {}))
        for i, r in enumerate(rows):
            in_table = "break_even_steps" in r.get("details", {})
            if bench == "step_compile" and i and not in_table and "break_even_steps" in rows[i - 1].get("details", {}):
                out.append("")  # the table ends
            out += _details(r)
        out.append("")

    out += [
        "## GPU benchmark",
        "",
        "`benchmarks/gpu.py` times the paper recipes' real training step (`Trainer.train_step`, paper size, batch "
        "768, bf16 autocast, the whole step compiled) on CUDA in phases, each printed as it ends: the compile time "
        "(the first step), the warm-up, the timed steps (tokens/s), the FLOPs of one step (MFU against the card's "
        "bf16 dense peak: 989 TFLOP/s for an H100 / H200; `--peak-tflops` for others) and the peak memory beside "
        "`--plan`'s estimate; `--max-seconds` bounds it and its JSON (`benchmarks/gpu.json`) holds whatever was "
        "measured. It has not run on a GPU since issue 47 (none was lent); `--device cpu --tiny` runs its phases "
        "on the CPU for its tests. Without CUDA (and no `--device cpu`) it exits with status 2 and a one-line "
        "message.",
        "",
        "```",
        "python benchmarks/gpu.py --steps 50 --max-seconds 600   # or: python -m benchmarks.gpu",
        "```",
        "",
        "What one GPU holds for each paper recipe (`loopformer train RECIPE --plan`, gradient accumulation) "
        "and the GPU check script (`tools/gpu_check.sh`: the CUDA suite, this benchmark; not yet run, no GPU "
        "was lent): [gpu.md](gpu.md).",
        "",
    ]
    if NOTES.is_file():
        out += [NOTES.read_text().rstrip(), ""]
    return "\n".join(out)
