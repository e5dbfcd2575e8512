"""Evaluation and loop analyses; importing the package loads none of its modules (the trainer needs only
``evaluate`` and ``authors``, never scipy or matplotlib).

- ``evaluate``: the one evaluation path (``evaluate``: validator accuracy; ``evaluate_lm``: loss and bits
  per byte), predictions, ARC pass@k, ``EvalComm`` (how ranks share an evaluation).
- ``authors``: the Attractor puzzle authors' evaluation protocol (``eval.protocol``).
- ``budget``: test-time compute curves, steps vs difficulty.
- ``analysis``: logit lens, overthinking, signal propagation, the Jacobian's spectral radius.
- ``auto_solver``: ``loopformer eval --auto-solver``, the fastest solver at the trained accuracy.
- ``suite`` / ``report`` / ``plots``: the evaluation report (``ReportOptions``, ``run_suite``), its
  report.md and metrics.json, its figures.
- ``compare``: one table and overlay plots across reports, eval variants and sweeps.
"""
