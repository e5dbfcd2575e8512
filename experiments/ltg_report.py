"""Markdown tables for docs/results.md (LTG section), read from the JSON the LTG / state-tracking scripts wrote.

Usage: ``python experiments/ltg_report.py`` prints one table per experiment whose JSON exists under
docs/figures/ (so every number in the results page can be traced to a file a command wrote).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FIG = Path(__file__).resolve().parents[1] / "docs" / "figures"


def _load(name: str) -> dict[str, Any] | None:
    path = FIG / name / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def depth(d: dict[str, Any]) -> str:
    m = d["models"]
    lines = [
        "| model | params | train wall (s) | steps | curriculum level reached (step) |",
        "|---|---|---|---|---|",
    ]
    for name in ("fixed", "poisson", "transformer"):
        e = m[name]
        adv = ", ".join(f"{a['level'] + 1:g}@{a['step']:g}" for a in e["curriculum_advances"]) or "-"
        lines.append(
            f"| {e['label']} | {e['parameters']:,} | {e['train_wall_time_s']:.0f} | {e['train_steps']} | "
            f"{e['curriculum_level']:g} ({adv}) |"
        )
    lines += [
        "",
        "| k | transformer | fixed R=4: at R=4 | best (R) | at R=16 | Poisson: at R=8 | best (R) | at R=16 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in d["table"]:
        lines.append(
            f"| {r['k']}{' *' if r['k'] > d['k_train'] else ''} | {pct(r['transformer'])} | {pct(r['fixed_at_train_R'])} | "
            f"{pct(r['fixed_best'])} ({r['fixed_best_R']}) | {pct(r['fixed_at_max_R'])} | {pct(r['poisson_at_train_R'])} | "
            f"{pct(r['poisson_best'])} ({r['poisson_best_R']}) | {pct(r['poisson_at_max_R'])} |"
        )
    lines.append("")
    lines.append("Accuracy (%) on held-out k-hop paths; * = deeper than any training query.")
    return "\n".join(lines)


def overthinking(d: dict[str, Any]) -> str:
    lines = [
        "| model | k | best R | acc at best | margin at best | peak-margin R | peak margin | "
        f"acc at R={d['max_loops']} | margin at R={d['max_loops']} |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for m in d["models"].values():
        for k, s in m["per_hop"].items():
            lines.append(
                f"| {m['label']} | {k} | {s['best_R']} | {pct(s['best_accuracy'])} | {s['margin_at_best']:.2f} | "
                f"{s['peak_margin_R']} | {s['peak_margin']:.2f} | {pct(s['final_accuracy'])} | "
                f"{s['final_margin']:.2f} |"
            )
    return "\n".join(lines)


def halting(d: dict[str, Any]) -> str:
    out = []
    for m in d["models"].values():
        ph = m["per_hop"]
        rules = [r for r in next(iter(ph.values())) if r.startswith(("kl_entropy", "residual"))]
        head = (
            "| k | fixed best (R) | fixed R=16 | "
            + " | ".join(f"{r}: acc / loops" for r in rules)
            + " | KL+H: R_eq, saving |"
        )
        lines = [f"**{m['label']}**", "", head, "|" + "---|" * (4 + len(rules))]
        for k, row in ph.items():
            kl = row["kl_entropy"]
            save = (
                "-"
                if kl["saving_vs_equal_fixed"] is None
                else f"{kl['R_equal_accuracy']}, {100 * kl['saving_vs_equal_fixed']:.0f}%"
            )
            lines.append(
                f"| {k} | {pct(row['fixed_best_accuracy'])} ({row['fixed_best_R']}) | {pct(row['fixed_cap_accuracy'])} | "
                + " | ".join(f"{pct(row[r]['accuracy'])} / {row[r]['mean_loops']:.2f}" for r in rules)
                + f" | {save} |"
            )
        for scope, title in (
            ("overall", "Pooled over all k"),
            ("overall_in_distribution", "Pooled over k <= 4"),
        ):
            lines.append("")
            lines.append(f"{title}: " + "; ".join(_pooled(r, m[scope][r]) for r in rules))
        out.append("\n".join(lines))
    return "\n\n".join(out)


def _pooled(rule: str, o: dict[str, Any]) -> str:
    saving = "-" if o["saving_vs_equal_fixed"] is None else f"{100 * o['saving_vs_equal_fixed']:.0f}%"
    return (
        f"{rule} {pct(o['accuracy'])}% in {o['mean_loops']:.2f} loops (cheapest fixed R matching it: "
        f"{o['R_equal_accuracy']}, saving {saving}; vs R=16: {100 * o['saving_vs_cap']:.0f}%)"
    )


def state(d: dict[str, Any]) -> str:
    rows = d["table"]
    keys = [k for k in rows[0] if k.startswith("len")]
    lines = [
        "| model | loops | mean loops | " + " | ".join(f"prefix {k[3:]}" for k in keys) + " |",
        "|" + "---|" * (3 + len(keys)),
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['loops']} | {r['mean_loops']:.1f} | "
            + " | ".join(pct(r[k]) for k in keys)
            + " |"
        )
    return "\n".join(lines)


def grokking(d: dict[str, Any]) -> str:
    lines = ["| model | steps | wall (s) | train inferred | ID | OOD |", "|---|---|---|---|---|---|"]
    for label, m in d["models"].items():
        cv = m["curves"]
        lines.append(
            f"| {label} | {m['steps']} | {m['wall_time_s']:.0f} | {pct(cv['train_inferred'][-1])} | "
            f"{pct(cv['test_id'][-1])} | {pct(cv['test_ood'][-1])} |"
        )
    lines += [
        "",
        "| model | split | loop | accuracy | bridge top-1 | bridge mean rank |",
        "|---|---|---|---|---|---|",
    ]
    for label, m in d["models"].items():
        for split, lens in m["logit_lens"].items():
            for i, t in enumerate(lens["loops"]):
                lines.append(
                    f"| {label} | {split} | {t} | {pct(lens['valid_accuracy'][i])} | {pct(lens['bridge_top1'][i])} | "
                    f"{lens['bridge_rank'][i]:.1f} |"
                )
    return "\n".join(lines)


def main() -> None:
    for name, fn in (
        ("ltg_depth", depth),
        ("ltg_overthinking", overthinking),
        ("ltg_halting", halting),
        ("ltg_grokking", grokking),
        ("state_tracking", state),
    ):
        d = _load(name)
        if d is not None:
            print(f"### {name}\n\n{fn(d)}\n")


if __name__ == "__main__":
    main()
