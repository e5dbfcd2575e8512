"""loopformer performance benchmarks (issue 9): ``python -m benchmarks [--quick] [--only NAME]``.

Each module ``bench_*.py`` exposes ``run(quick: bool) -> list[Result]`` (``benchmarks.common.Result``);
``benchmarks.__main__`` runs them, writes ``benchmarks/results.json`` and renders
``docs/performance.md``. ``benchmarks/gpu.py`` is the separate CUDA benchmark at paper size;
``benchmarks/bench_generation.py`` also runs as a script (Sudoku and maze timings, its own JSON).
"""

BENCHMARKS = ("engine", "flops", "memory", "halting", "solvers", "compile", "generation", "data", "reference",
              "startup", "threads", "inference", "host_reads", "step_compile", "sync", "ift",
              "contraction", "size")
