"""Markdown tables for docs/results.md (FPRM section), read only from the JSON the fprm_* experiments wrote.

Every number in the results fragment comes from ``docs/figures/fprm_*/results.json``; this prints the
tables (``python experiments/fprm_report.py``) so the text cannot drift from the measurements.
Sections whose JSON is missing are skipped with a note.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
FIG = REPO / "docs" / "figures"


def _load(name: str) -> dict[str, Any] | None:
    path = FIG / name / "results.json"
    return json.loads(path.read_text()) if path.is_file() else None


def pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def num(x: float | None, fmt: str = ".2f") -> str:
    return "n/a" if x is None else format(x, fmt)


def pval(p: float | None) -> str:
    return "n/a" if p is None else f"{p:.2g}"


def sudoku_tables(d: dict[str, Any]) -> list[str]:
    r = d["results"]
    out = [
        "| model | parameters | train steps | GFLOP / step | train TFLOP | training-loop wall (s) | valid acc | exact acc "
        "| mean eval loops |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    fe_file = FIG / "fprm_sudoku" / "flops_end.json"
    fe_models = json.loads(fe_file.read_text())["models"] if fe_file.is_file() else {}
    for name in ("fprm", "transformer", "trm", "ut_act", "ut_act_matched"):
        if name not in r:
            continue
        e = r[name]
        tflops = f"{e['train_tflops']:.2f}"
        base = name.removesuffix("_matched")
        if (
            base in fe_models
            and fe_models[base]["flops_per_step_end"] > 1.05 * fe_models[base]["flops_per_step_start"]
        ):
            hi = fe_models[base]["flops_per_step_end"] * e["train_steps"] / 1e12
            tflops = f"{e['train_tflops']:.2f} ... {hi:.2f}"  # FLOPs per step grew while training
        out.append(
            f"| {name} | {e['parameters']:,} | {e['train_steps']} | {e['gflops_per_step']:.2f} "
            f"| {tflops} | {e['final_train_metrics']['time']:.0f} | {pct(e['valid_accuracy'])} "
            f"| {pct(e['exact_accuracy'])} | {e['mean_steps']:.2f} |"
        )
    fe_path = FIG / "fprm_sudoku" / "flops_end.json"
    if fe_path.is_file():
        fe = json.loads(fe_path.read_text())["models"]
        out += [
            "",
            "Compute check (`python experiments/fprm_flops_end.py`): FLOPs per training step counted at the start "
            "(the matching probe) and again after resuming each finished run for 3 steps.",
            "",
            "| model | GFLOP / step at start | GFLOP / step at end | loops / step at end | mean loops / step over "
            "training | total TFLOP (start x steps ... end x steps) | estimate: end x steps x mean loops / end loops |",
            "|---|---|---|---|---|---|---|",
        ]
        for name, v in fe.items():
            steps = r[name]["train_steps"] if name in r else 0
            mpath = FIG / "fprm_sudoku" / "train_metrics" / f"{name}.jsonl"
            loops = (
                [json.loads(x).get("loop_steps") for x in mpath.read_text().splitlines()]
                if mpath.is_file()
                else []
            )
            loops = [x for x in loops if x is not None]
            mean_loops = sum(loops) / len(loops) if loops else float("nan")
            est = v["flops_per_step_end"] * steps * mean_loops / v["loop_steps_end"] / 1e12
            out.append(
                f"| {name} | {v['flops_per_step_start'] / 1e9:.2f} | {v['flops_per_step_end'] / 1e9:.2f} "
                f"| {v['loop_steps_end']:.2f} | {mean_loops:.2f} | {v['flops_per_step_start'] * steps / 1e12:.2f} ... "
                f"{v['flops_per_step_end'] * steps / 1e12:.2f} | {est:.2f} |"
            )
    if "fprm" in r:
        f = r["fprm"]
        s = f["steps_vs_blanks"]
        out += [
            "",
            f"Steps vs blanks (FPRM, damped gamma 0.99): Spearman rho = {num(s['spearman_rho'], '.3f')}, "
            f"p = {pval(s['spearman_p'])}, n = {f['n']}.",
            "",
            "| blanks | puzzles | mean loops | valid acc |",
            "|---|---|---|---|",
        ]
        for b in s["buckets"]:
            out.append(
                f"| {b['low']:g} | {b['count']} | {b['mean_steps']:.2f} | {pct(b['valid_accuracy'])} |"
            )
        eh = f["easy_hard_steps"]
        out += [
            "",
            f"Easy (<= {eh['split_difficulty']:g} blanks) {eh['easy_mean_steps']:.2f} loops, "
            f"hard {eh['hard_mean_steps']:.2f} loops.",
            "",
            "| eval solver | cap | valid acc | mean loops | converged | oscillating | other not converged "
            "| valid among not converged | Spearman rho (p) |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        osc = f["oscillation"]
        s0 = f["steps_vs_blanks"]
        out.append(
            f"| damped gamma 0.99 | {f['eval_loop']['max_steps']} | {pct(f['valid_accuracy'])} "
            f"| {f['mean_steps']:.2f} | {osc['converged']}/{osc['n']} | {osc['oscillating']} "
            f"| {osc['not_converged_other']} | - | {num(s0['spearman_rho'], '.3f')} ({pval(s0['spearman_p'])}) |"
        )
        for label, c in f["solver_comparison"].items():
            o = c["oscillation"]
            out.append(
                f"| {label} | {c['max_steps']} | {pct(c['valid_accuracy'])} | {c['mean_steps']:.2f} "
                f"| {o['converged']}/{o['n']} | {o['oscillating']} | {o['not_converged_other']} "
                f"| {pct(c['valid_among_not_converged'])} "
                f"| {num(c['spearman_rho'], '.3f')} ({pval(c['spearman_p'])}) |"
            )
    return out


def grad_tables(d: dict[str, Any]) -> list[str]:
    out = [
        "| grad mode | steps | valid acc | token acc | final train loss | s / step | saved activations (MiB / step) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, e in d["results"].items():
        out.append(
            f"| {name} | {e['train_steps']} | {pct(e['valid_accuracy'])} | {pct(e['token_accuracy'])} "
            f"| {num(e['final_train_loss'], '.3f')} | {e['s_per_step']:.3f} | {e['saved_mib_per_step']:.2f} |"
        )
    return out


def signal_tables(d: dict[str, Any]) -> list[str]:
    n = d["analysis_loops"]
    out = [
        "| variant | R | valid acc | token acc at R | loops used | state RMS at R (init -> trained) "
        f"| state RMS at {n} (init -> trained) | rel. update at R (trained) | rel. update at {n} (trained) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, by_depth in d["results"].items():
        for depth, e in by_depth.items():
            R = int(depth)
            out.append(
                f"| {name} | {R} | {pct(e['valid_accuracy'])} | {pct(e['token_accuracy_at_R'])} | {e['loops_used']} "
                f"| {e['state_rms_init'][R - 1]:.3g} -> {e['state_rms_trained'][R - 1]:.3g} "
                f"| {e['state_rms_init'][-1]:.3g} -> {e['state_rms_trained'][-1]:.3g} "
                f"| {e['relative_update_trained'][R - 1]:.3g} | {e['relative_update_trained'][-1]:.3g} |"
            )
    return out


def maze_tables(d: dict[str, Any]) -> list[str]:
    r = d["results"]
    out = [
        "| model | parameters | train steps | train TFLOP | train wall (s) | valid acc | token acc | mean loops |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, e in r.items():
        out.append(
            f"| {name} | {e['parameters']:,} | {e['train_steps']} | {e['train_tflops']:.2f} "
            f"| {e['train_wall_time_s']:.0f} | {pct(e['valid_accuracy'])} | {pct(e['token_accuracy'])} "
            f"| {e['mean_steps']:.2f} |"
        )
    if "fprm" in r:
        f = r["fprm"]
        s = f["steps_vs_path_length"]
        p = f["picard"]
        out += [
            "",
            f"Steps vs shortest-path length (FPRM, damped): Spearman rho = {num(s['spearman_rho'], '.3f')}, "
            f"p = {pval(s['spearman_p'])}; Picard: valid {pct(p['valid_accuracy'])}, mean loops "
            f"{p['mean_steps']:.2f}, converged {p['oscillation']['converged']}/{p['oscillation']['n']}, "
            f"oscillating {p['oscillation']['oscillating']}.",
            "",
            "| path length | mazes | mean loops | valid acc |",
            "|---|---|---|---|",
        ]
        for b in s["buckets"]:
            rng = f"{b['low']:g}" if b["low"] == b["high"] else f"{b['low']:g}-{b['high']:g}"
            out.append(f"| {rng} | {b['count']} | {b['mean_steps']:.2f} | {pct(b['valid_accuracy'])} |")
    return out


def solver_tables(d: dict[str, Any]) -> list[str]:
    out = [
        f"Checkpoint `{d['checkpoint']}` ({d['weights']} weights), {d['n']} held-out puzzles, cap "
        f"{next(iter(d['results'].values()))['cap']} loops.",
        "",
        "| solver | tol | valid acc | mean loops | converged | oscillating | other not converged "
        "| valid among not converged | Spearman rho (p) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for e in d["results"].values():
        o = e["oscillation"]
        out.append(
            f"| {e['solver']} | {e['tol']:g} | {pct(e['valid_accuracy'])} | {e['mean_steps']:.2f} "
            f"| {o['converged']}/{o['n']} | {o['oscillating']} | {o['not_converged_other']} "
            f"| {pct(e['valid_among_not_converged'])} | {num(e['spearman_rho'], '.3f')} "
            f"({pval(e['spearman_p'])}) |"
        )
    out += [
        "",
        "Jacobian spectral radius of the step at the final iterate (damped gamma 0.99, tol 0.001):",
        "",
    ]
    for key, v in d["spectral_radius_at_final_iterate"].items():
        out.append(
            f"- {key}: n = {v['n']}, mean {v['mean']:.3f}, median {v['median']:.3f}, max {v['max']:.3f}, "
            f"fraction < 1: {pct(v['fraction_below_1'])}"
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    for title, name, fn in (
        ("Sudoku (item 2)", "fprm_sudoku", sudoku_tables),
        ("Damped vs Picard over tolerances (item 2)", "fprm_solvers", solver_tables),
        ("Gradient modes, 150 steps (item 4)", "fprm_grad_modes", grad_tables),
        ("Gradient modes, 400 steps (item 4)", "fprm_grad_modes_400", grad_tables),
        ("Signal propagation and training depth (item 1)", "fprm_signal_depth", signal_tables),
        ("Maze, 300 FPRM steps (item 3)", "fprm_maze", maze_tables),
        ("Maze, 800 FPRM steps (item 3)", "fprm_maze_800", maze_tables),
        ("Maze, 800 FPRM steps, the authors' FPRM (issue 12)", "fprm_maze_reference_800", maze_tables),
    ):
        d = _load(name)
        print(f"\n### {title}\n")
        if d is None:
            print(f"(no docs/figures/{name}/results.json yet)")
            continue
        print(f"Command: `{d['command']}`; wall time {d.get('wall_time_s', 'n/a')} s.\n")
        print("\n".join(fn(d)))


if __name__ == "__main__":
    main()
