"""``python -m benchmarks``: run the performance benchmarks, write results.json, render docs/performance.md.

    python -m benchmarks                      # every benchmark at CPU size (a few minutes)
    python -m benchmarks --quick              # the tiniest sizes (the smoke test; seconds)
    python -m benchmarks --only solvers       # one benchmark (repeatable); merges into results.json
    python -m benchmarks --render-only        # re-render docs/performance.md from results.json

Defaults: full runs write ``benchmarks/results.json`` and ``docs/performance.md``; ``--quick`` runs
write under ``benchmarks/.cache/quick/`` unless ``--out`` / ``--doc`` say otherwise, so a smoke
test never overwrites the real numbers. ``--threads auto`` uses one thread per physical core, or one
thread when the machine is already busier than its core count (OpenMP threads then stall each
other, see the threads benchmark). A benchmark that crashes is recorded (met = false, the error as
the reason) and the exit status is 1.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from benchmarks import BENCHMARKS
from benchmarks.common import Result, machine
from benchmarks.render import render

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "benchmarks" / "results.json"
DEFAULT_DOC = ROOT / "docs" / "performance.md"
QUICK_DIR = ROOT / "benchmarks" / ".cache" / "quick"


def choose_threads(spec: str) -> int:
    if spec != "auto":
        n = int(spec)
        if n < 1:
            raise SystemExit(f"--threads must be >= 1 or 'auto', got {spec}")
        return n
    from loopformer.devices import physical_cores

    cores = physical_cores()
    busy = os.getloadavg()[0] > (os.cpu_count() or 1)
    return 1 if busy else cores


def run_one(name: str, quick: bool) -> tuple[list[dict[str, Any]], bool, float]:
    """Run one benchmark module; returns (result dicts, ok, seconds)."""
    start = time.perf_counter()
    try:
        module = importlib.import_module(f"benchmarks.bench_{name}")
        results: list[Result] = module.run(quick=quick)
        ok = True
    except Exception as err:
        traceback.print_exc()
        results = [
            Result(name, f"{name}.error", None, "", None, False, f"crashed: {type(err).__name__}: {err}")
        ]
        ok = False
    seconds = time.perf_counter() - start
    dicts = [r.to_dict(quick) for r in results]
    for d in dicts:
        d["details"]["benchmark_seconds"] = round(seconds, 2)
    return dicts, ok, seconds


def merge(
    old: list[dict[str, Any]],
    new: list[dict[str, Any]],
    ran: list[str],
    by_name: frozenset[str] = frozenset(),
) -> list[dict[str, Any]]:
    """``new`` with the rows of ``old`` whose benchmark did not run; for a benchmark in ``by_name`` (its
    module sets ``MERGE_BY_NAME``: rows labelled by the machine's state, e.g. idle / loaded) only the
    rows it wrote again are replaced."""
    fresh = {r.get("name") for r in new}
    kept = [
        r for r in old
        if r.get("benchmark") not in ran or (r.get("benchmark") in by_name and r.get("name") not in fresh)
    ]  # fmt: skip
    order = {name: i for i, name in enumerate(BENCHMARKS)}
    return sorted(kept + new, key=lambda r: order.get(r.get("benchmark"), len(order)))


def provenance(results: list[dict[str, Any]]) -> list[tuple[str, int | None, int]]:
    """(command, torch threads, rows) for each run whose rows are in ``results`` (merged results
    hold rows of several runs), most rows first."""
    counts: dict[tuple[str, int | None], int] = {}
    for r in results:
        key = (r.get("command") or "python -m benchmarks", r.get("threads"))
        counts[key] = counts.get(key, 0) + 1
    return [(c, t, n) for (c, t), n in sorted(counts.items(), key=lambda kv: -kv[1])]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiniest sizes (the smoke test)")
    parser.add_argument(
        "--only",
        action="append",
        choices=BENCHMARKS,
        metavar="NAME",
        help=f"run only this benchmark (repeatable): {', '.join(BENCHMARKS)}",
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="results JSON (default benchmarks/results.json)"
    )
    parser.add_argument(
        "--doc", type=Path, default=None, help="markdown report (default docs/performance.md)"
    )
    parser.add_argument("--threads", default="auto", help="torch CPU threads: a number or 'auto'")
    parser.add_argument(
        "--render-only", action="store_true", help="re-render the report from the results file, run nothing"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = args.out or (QUICK_DIR / "results.json" if args.quick else DEFAULT_OUT)
    doc = args.doc or (QUICK_DIR / "performance.md" if args.quick else DEFAULT_DOC)
    names = list(dict.fromkeys(args.only)) if args.only else list(BENCHMARKS)
    torch.set_flush_denormal(True)
    torch.set_num_threads(choose_threads(args.threads))
    info = machine()
    command = ("python -m benchmarks " + " ".join(argv if argv is not None else sys.argv[1:])).strip()
    if args.render_only:
        if not out.is_file():
            raise SystemExit(f"--render-only: no results file {out}; run the benchmarks first")
        results = json.loads(out.read_text())
        info["runs"] = provenance(results)
        doc.parent.mkdir(parents=True, exist_ok=True)
        doc.write_text(render(results, info))
        print(f"[benchmarks] rendered {doc} from {out}")
        return 0

    new: list[dict[str, Any]] = []
    all_ok = True
    threads = torch.get_num_threads()
    for name in names:
        print(f"[benchmarks] {name} ...", flush=True)
        dicts, ok, seconds = run_one(name, args.quick)
        torch.set_num_threads(threads)  # a benchmark (or the trainer) may change it
        all_ok &= ok
        for d in dicts:
            d["command"], d["threads"] = command, threads
        new.extend(dicts)
        for d in dicts:
            value = "n/a" if d["value"] is None else f"{d['value']:.4g}"
            print(
                f"  {d['name']}: {value} {d['unit']} target {d['target']} met {d['met']}"
                + (f" ({d['reason']})" if d["reason"] and d["met"] is False else ""),
                flush=True,
            )
        print(f"  ({seconds:.1f} s)", flush=True)

    old: list[dict[str, Any]] = []
    if args.only and out.is_file():
        try:
            loaded = json.loads(out.read_text())
            old = loaded if isinstance(loaded, list) else []
        except json.JSONDecodeError:
            old = []
    by_name = frozenset(
        n for n in names if getattr(importlib.import_module(f"benchmarks.bench_{n}"), "MERGE_BY_NAME", False)
    )
    results = merge(old, new, names, by_name)
    info["runs"] = provenance(results)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(render(results, info))
    print(f"[benchmarks] wrote {out} and {doc}")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
