"""Issue 16 before/after evidence: every case of the issue's "Why" has a test that fails on the code from
before the reliability work and passes on the current code.

    python tools/reliability_before_after.py                      # print the table
    python tools/reliability_before_after.py --write docs/reliability.md
    python tools/reliability_before_after.py --group "issue 24" --write docs/reliability.md
    python tools/reliability_before_after.py --group "issue 35" --write docs/reliability.md

``--group "issue 24"``: issue 24's resume / convert / output-swap cases (``CASES_24``), against main
before that work (``BEFORE_24``), written between the ``before-after-24`` markers; ``--group "issue 35"``:
issue 35's trust-boundary cases (``CASES_35``: paths, links, the library's own files, fingerprints,
unscorable data, resume and branch, the low cases) against ``BEFORE_35``, between ``before-after-35``.

It makes a temporary git worktree at ``--before`` (default: the parent of the first reliability commit,
"Run folders: lock file ..."), copies the current test files that hold the cases (they use only entry
points the old code has too: the ``loopformer`` CLI, ``loopformer.config``, the task loaders, files on
disk) into its ``tests/``, runs the cases' tests there with that worktree first on ``PYTHONPATH``, then
the same tests on the current checkout, and writes one row per case: the test, the outcome before with
the first line of the failure, the outcome now. A test that errors or is skipped is reported as such,
never counted as "fail before".
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# 5b98703: "FPRM parity: loopformer convert fprm -> run folder -> loopformer eval, through the CLI", the
# parent of 212e8c2 "Run folders: lock file ..." (the first commit of the issue-16 work; the CSV / numpy
# folder checks of a80b8e4 and 4e9254c came after it on main)
BEFORE = "5b98703"
COPIED = [
    "tests/conftest.py",
    "tests/reliability_common.py",
    "tests/test_reliability_cases.py",
    "tests/test_reliability_config.py",
    "tests/test_data_loading.py",
]
C = "tests/test_reliability_cases.py::"
G = "tests/test_reliability_config.py::"
D = "tests/test_data_loading.py::"
BAD = G + "test_bad_values_are_refused_when_the_config_is_built"
ARC = G + "test_wrong_arc_task_files_name_file_and_place"
KAGGLE = G + "test_wrong_kaggle_files_name_file_and_key"
NPY = C + "test_a_bad_numpy_folder_is_refused_before_training"
# (Why bullet, case, test node id)
CASES: list[tuple[int, str, str]] = [
    (
        1,
        "fresh train into a run folder deletes its checkpoints / metrics",
        C + "test_fresh_train_into_a_run_folder_deletes_nothing",
    ),
    (2, "two trainings into one folder at once", C + "test_two_trainings_into_one_folder_at_once"),
    (
        3,
        "resume from a corrupt latest checkpoint stops",
        C + "test_resume_falls_back_past_a_corrupt_latest_checkpoint",
    ),
    (4, "eval of NaN weights exits 0 with 0%", C + "test_eval_refuses_broken_weights[nan]"),
    (4, "eval of diverged weights exits 0 with 0%", C + "test_eval_refuses_broken_weights[diverged]"),
    (4, "solve --json of NaN weights returns padding tokens", C + "test_solve_json_refuses_nan_weights"),
    (
        4,
        "divergence names a NaN checkpoint 'last good'",
        C + "test_divergence_never_names_a_nan_checkpoint_good",
    ),
    (
        4,
        "divergence leaves two metrics records for one step",
        C + "test_divergence_leaves_one_metrics_record_per_step",
    ),
    (
        5,
        "absolute `latest` pointer sends eval's report into another run",
        C + "test_latest_pointer_with_an_absolute_path_keeps_eval_in_its_folder",
    ),
    (5, "config.json data path: its first line echoed (eval)", C + "test_a_config_data_path_is_never_echoed"),
    (
        5,
        "data file's first line echoed (loader)",
        G + "test_a_data_path_from_a_config_never_has_its_first_line_quoted",
    ),
    (6, "numpy folder: input token outside the task's vocabulary", NPY + "[input-token]"),
    (6, "numpy folder: label token outside the task's vocabulary", NPY + "[label-token]"),
    (6, "numpy folder: wrong sequence length", NPY + "[sequence-length]"),
    (6, "numpy folder: NaN inputs", NPY + "[nan-input]"),
    (6, "numpy folder: float inputs silently truncated (CLI)", NPY + "[float-input]"),
    (6, "numpy folder: float inputs (loader)", D + "test_float_inputs_are_an_error_not_truncated"),
    (
        6,
        "numpy folder (loader): bad token's row / column named, label-input agreement",
        D + "test_token_and_agreement_errors_name_row_and_column",
    ),
    (7, "eval.batch_size=0", BAD + "[eval.batch_size=0]"),
    (7, "eval.max_examples=-1", BAD + "[eval.max_examples=-1]"),
    (7, "model.d_model=0", BAD + "[model.d_model=0]"),
    (7, "model.n_heads=0", BAD + "[model.n_heads=0]"),
    (7, "unknown task options", BAD + "[data.options={no_such_option: 1}]"),
    (7, "device=cuda without CUDA", G + "test_device_cuda_without_cuda_is_refused"),
    (7, "train.threads=100000", BAD + "[train.threads=100000]"),
    (7, "train.lr=1e39", BAD + "[train.lr=1e39]"),
    (7, "negative weight decay", BAD + "[train.weight_decay=-0.1]"),
    (7, "negative clip", BAD + "[train.grad_clip=-1]"),
    (7, "duplicate YAML keys", G + "test_duplicate_yaml_keys_are_errors_naming_file_and_line"),
    (7, "10^6-alias YAML", G + "test_an_alias_bomb_is_refused_quickly"),
    (8, "non-UTF-8 CSV", D + "test_non_utf8_is_an_error_naming_the_line"),
    (8, "non-UTF-8 ARC file", ARC + "[non-utf8]"),
    (8, "non-UTF-8 recipe / config.json", G + "test_non_utf8_recipe_and_config_files_name_the_file"),
    (8, "ARC JSON: nested past the parser's depth", ARC + "[deep-nesting]"),
    (8, "ARC JSON: 'train' a number", ARC + "[train-int]"),
    (8, "ARC JSON: 'train' an object", ARC + "[train-object]"),
    (8, "ARC JSON: a bad grid cell", ARC + "[bad-cell]"),
    (8, "ARC JSON: not an object", ARC + "[not-an-object]"),
    (8, "Kaggle JSON: solutions file a list", KAGGLE + "[solutions-a-list]"),
    (8, "Kaggle JSON: solutions not a list of grids", KAGGLE + "[solutions-not-grids]"),
    (8, "Kaggle JSON: 'train' a number", KAGGLE + "[train-int]"),
    (8, "non-UTF-8 Kaggle JSON", G + "test_non_utf8_kaggle_files_name_the_file"),
    (8, "CSV rating nan", D + "test_non_finite_rating_is_an_error[nan]"),
    (8, "CSV rating inf", D + "test_non_finite_rating_is_an_error[inf]"),
    (8, "CSV last line cut inside the rating", D + "test_truncated_last_line_is_an_error"),
    (
        8,
        "file without newlines rejected in bounded memory",
        D + "test_file_without_newlines_is_rejected_in_bounded_memory",
    ),
    (
        9,
        "solve: contradictory givens",
        C + "test_solve_says_when_givens_contradict_each_other[contradictory]",
    ),
    (9, "solve: unsolvable givens", C + "test_solve_says_when_givens_contradict_each_other[unsolvable]"),
]


# Issue 24's resume / convert / output-swap cases, measured against main before that work (873c8e8,
# "experiments/sudoku9_cpu.py: --set KEY=VALUE ..."): their test files use only the CLI, the parity
# fixtures and ``loopformer.runs.outputs.staged_output``, all of which that commit has
BEFORE_24 = "873c8e8"
COPIED_24 = [
    "tests/conftest.py",
    "tests/reliability_common.py",
    "tests/test_reliability_resume.py",
    "tests/test_reliability_convert.py",
    "tests/test_reliability_output_swap.py",
    "tests/test_reliability_overwrite.py",
    "tests/test_reliability_output_folders.py",
    "tests/test_reliability_signals.py",
    "tests/test_reliability_inputs.py",
]
R = "tests/test_reliability_resume.py::"
O = "tests/test_reliability_overwrite.py::"
F = "tests/test_reliability_output_folders.py::"
S = "tests/test_reliability_signals.py::"
V = "tests/test_reliability_convert.py::"
W = "tests/test_reliability_output_swap.py::"
In = "tests/test_reliability_inputs.py::"
CASES_24: list[tuple[int, str, str]] = [
    (10, "resume from another run's checkpoint into this run", R + "test_resume_from_another_runs_checkpoint_into_this_run_is_refused"),
    (10, "resume from another run's checkpoint into a new folder: origin recorded",
     R + "test_resume_from_another_runs_checkpoint_into_a_new_folder_records_its_origin"),
    (10, "resume, only checkpoint truncated: silent restart", R + "test_resume_whose_only_checkpoint_is_corrupt_stops_naming_it[truncated]"),
    (10, "resume, only checkpoint overwritten: silent restart", R + "test_resume_whose_only_checkpoint_is_corrupt_stops_naming_it[garbage]"),
    (10, "resume with another seed", R + "test_resume_with_a_config_that_changes_the_stream_is_refused[seed=7]"),
    (10, "resume with another train_size", R + "test_resume_with_a_config_that_changes_the_stream_is_refused[data.train_size=24]"),
    (10, "resume with another train_seed", R + "test_resume_with_a_config_that_changes_the_stream_is_refused[data.train_seed=3]"),
    (10, "resume with another lr", R + "test_resume_with_a_config_that_changes_the_stream_is_refused[train.lr=0.01]"),
    (10, "resume with another batch size", R + "test_resume_with_a_config_that_changes_the_stream_is_refused[train.batch_size=4]"),
    (10, "resume with another model width", R + "test_resume_with_a_config_that_changes_the_stream_is_refused[model.d_model=32]"),
    (10, "resume with other generator options",
     R + "test_resume_with_a_config_that_changes_the_stream_is_refused[data.train_generate={min_blanks: 5, max_blanks: 8}]"),
    (10, "resume with another training mode", R + "test_resume_with_a_config_that_changes_the_stream_is_refused[train.mode=simple]"),
    (10, "--allow-config-change records the change", R + "test_allow_config_change_resumes_and_records_the_change"),
    (11, "convert without a reference config: silent defaults", V + "test_convert_without_a_reference_config_is_refused_unless_allow_defaults"),
    (11, "convert attractor model.pt: config.json beside it ignored",
     V + "test_convert_attractor_reads_the_config_beside_the_checkpoint_or_says_what_is_missing"),
    (11, "convert: suggested --set model.seq_len does not work", V + "test_the_set_an_error_suggests_makes_the_conversion_go_through[seq_len]"),
    (11, "convert: suggested --set data.task does not work", V + "test_the_set_an_error_suggests_makes_the_conversion_go_through[data_paths]"),
    (11, "converted TRM without sign-SGD puzzle embedding",
     V + "test_converted_trm_and_hrm_carry_the_sign_sgd_puzzle_embedding_optimiser[trm]"),
    (11, "converted HRM without sign-SGD puzzle embedding",
     V + "test_converted_trm_and_hrm_carry_the_sign_sgd_puzzle_embedding_optimiser[hrm]"),
    (11, "float64 checkpoint: initial states rounded to float32", V + "test_a_float64_checkpoint_keeps_float64_initial_states"),
    (12, "output swap: many renames, not one exchange", W + "test_the_swap_is_one_exchange_and_the_old_content_is_removed_after_it"),
    (12, "output swap: .replaced-* folders accumulate", W + "test_without_an_exchange_two_renames_and_nothing_left_behind"),
    (12, "train --overwrite moves the old run away entry by entry", O + "test_overwrite_replaces_the_whole_folder_in_one_exchange"),
    (12, "train --overwrite killed during the swap: a mixed folder",
     O + "test_a_kill_during_overwrite_leaves_the_old_run_or_the_new_one_whole[remove-old]"),
    (12, "eval / compare --overwrite removes a run lying deeper; train -o a parent of runs",
     F + "test_a_folder_holding_a_run_below_it_is_never_written_whole"),
    (12, "data generate replaces a run's metrics.jsonl; HRM split written in place",
     F + "test_data_generate_follows_the_run_folder_rules"),
    (12, "run: SIGTERM exits 1 with no resume command (and no --resume)",
     S + "test_run_stopped_by_a_signal_resumes_with_the_printed_command"),
    (13, "eval -s loop_eval.max_steps=10**12: internal error (allocation)",
     In + "test_eval_refuses_hostile_options_before_evaluating[-s loop_eval.max_steps=1000000000000]"),
    (13, "eval --max-steps 10**12: internal error", In + "test_eval_refuses_hostile_options_before_evaluating[--max-steps 1000000000000]"),
    (13, "eval --variant loop_eval.max_steps=0: refused only after the base evaluation",
     In + "test_eval_refuses_hostile_options_before_evaluating[--variant loop_eval.max_steps=0]"),
    (13, "eval --variant eval.segments=0 accepted", In + "test_eval_refuses_hostile_options_before_evaluating[--variant eval.segments=0]"),
    (13, "eval --auto-solver-slice 2 accepted", In + "test_eval_refuses_hostile_options_before_evaluating[--auto-solver --auto-solver-slice 2]"),
    (13, "eval -s K=1 -s K=2: the last silently wins",
     In + "test_eval_refuses_hostile_options_before_evaluating[-s loop_eval.max_steps=3 -s loop_eval.max_steps=4]"),
    (13, "eval -t min_blanks=abc: message without the key", In + "test_eval_refuses_hostile_options_before_evaluating[-t min_blanks=abc]"),
    (13, "train model.vocab_size=3: internal IndexError", In + "test_train_refuses_sizes_the_task_or_memory_cannot_hold[model.vocab_size=3]"),
    (13, "train model.seq_len=3: trains, records a wrong config", In + "test_train_refuses_sizes_the_task_or_memory_cannot_hold[model.seq_len=3]"),
    (13, "train data.options.box=3: internal TypeError", In + "test_train_refuses_sizes_the_task_or_memory_cannot_hold[data.options.box=3]"),
    (13, "train train.steps=1 train.steps=2: the last silently wins", In + "test_train_refuses_a_key_given_twice"),
    (13, "run run.budgets=[10**12]: internal error",
     In + "test_run_refuses_loop_counts_and_sizes_before_training[run.budgets=[1000000000000]-run.budgets 1000000000000]"),
    (13, "a 7x7 maze run evaluated on 9x9 mazes", In + "test_a_maze_run_is_not_evaluated_on_another_maze_size"),
    (13, "a float64 tensor in a float32 checkpoint: rounded silently",
     In + "test_a_checkpoint_mixing_dtypes_is_refused_not_rounded[float64-<lambda>-float64 in the checkpoint]"),
    (13, "push shares weights eval refuses (NaN)", In + "test_push_refuses_weights_eval_would_refuse"),
    (13, "eval -s loop_eval.tol=inf accepted", In + "test_eval_refuses_a_tolerance_that_is_not_a_positive_number[inf]"),
    (13, "push --revision '' accepted", In + "test_push_refuses_an_empty_revision_or_message[--revision-]"),
]  # fmt: skip
# Not in the table: tests whose commands (sweep, compare, consolidate) 873c8e8 does not have, so they
# fail there for that reason alone; against main before this work (b9ec86c) they fail for theirs:
# test_reliability_output_folders.py::test_sweep_refuses_a_folder_that_is_not_its_own_before_writing,
# test_reliability_lock.py::test_every_command_that_writes_a_folder_waits_for_its_lock,
# test_reliability_signals.py::test_sweep_stopped_by_a_signal_resumes_with_the_printed_command,
# test_reliability_write_limit.py::test_eval_compare_and_data_generate_past_the_limit_leave_the_old_output
# (docs/reliability.md, below the table)
# Issue 35's trust-boundary cases, measured against main before that work's second part (2deded7, "Loading a
# run is one straight path ..."; the first part, nothing a run folder names is imported, landed there): their
# test files use the CLI, files on disk, loopformer.config / runs.eval_dataset / runs.outputs.staged_output /
# runs.sharded.save_sharded / the task classes / loopformer.load / solve, all of which that commit has
BEFORE_35 = "2deded7"
COPIED_35 = [
    "tests/conftest.py",
    "tests/reliability_common.py",
    "tests/test_reliability_paths.py",
    "tests/test_reliability_links.py",
    "tests/test_reliability_records.py",
    "tests/test_reliability_fingerprints.py",
    "tests/test_reliability_scoring.py",
    "tests/test_reliability_branch.py",
    "tests/test_reliability_low_cases.py",
]
Pa = "tests/test_reliability_paths.py::"
Li = "tests/test_reliability_links.py::"
Re = "tests/test_reliability_records.py::"
Fi = "tests/test_reliability_fingerprints.py::"
Sc = "tests/test_reliability_scoring.py::"
Br = "tests/test_reliability_branch.py::"
Lo = "tests/test_reliability_low_cases.py::"
TRAIN_OUT = Pa + "test_train_out_is_the_folder_named_as_typed"
SWEEP_JSON = Re + "test_a_crafted_sweep_json_is_one_line_naming_the_field"
METRICS_JSON = Re + "test_a_crafted_report_metrics_json_is_one_line_naming_the_field"
SUMMARY_JSON = Re + "test_a_crafted_summary_json_is_one_line_naming_the_field"
LOCK = Re + "test_a_lock_file_naming_no_holder_never_blocks_nor_crashes"
CASES_35: list[tuple[int, str, str]] = [
    (14, "train -o 'exp #2' trained into ./exp", TRAIN_OUT + "[hash]"),
    (14, "train -o 0001 trained into ./1", TRAIN_OUT + "[leading-zeros]"),
    (14, "train -o 0x10 trained into ./16", TRAIN_OUT + "[hex]"),
    (14, "train -o 2024-01-01: a type error", TRAIN_OUT + "[date]"),
    (14, "train -o yes: a type error", TRAIN_OUT + "[yes]"),
    (14, "train -o with a newline: a space", TRAIN_OUT + "[newline]"),
    (14, "out_dir=0001 #x as an override: ./1", Pa + "test_an_out_dir_override_is_a_path_too"),
    (14, "sweep -o 's #1' trained into ./s", Pa + "test_sweep_out_is_the_folder_named_as_typed"),
    (15, "a linked compare/ in a sweep: the link's target emptied and refilled on a rerun",
     Li + "test_a_linked_compare_folder_in_a_sweep_is_refused_and_its_target_untouched"),
    (15, "compare follows sweep.json's report paths out of the sweep folder",
     Li + "test_report_paths_in_sweep_json_stay_inside_the_sweep_folder"),
    (15, "compare -o a dataset --overwrite replaced it; a failed compare left the folders it made",
     Li + "test_compare_out_never_replaces_a_dataset_and_leaves_no_folder_it_made"),
    (15, "consolidate --out another run / a dataset / a link; an earlier consolidation replaced silently",
     Li + "test_consolidate_out_follows_the_output_rules"),
    (15, "an error inside a staged output names the hidden staging folder",
     Li + "test_an_error_inside_a_staged_output_names_the_users_folder"),
    (15, "compare -o / eval -o a link --overwrite: its target emptied and refilled",
     Li + "test_an_output_folder_that_is_a_link_is_refused_and_its_target_untouched"),
    (16, "sweep.json: reports a number", SWEEP_JSON + "[reports-a-number]"),
    (16, "sweep.json: a point's name a number", SWEEP_JSON + "[name-a-number]"),
    (16, "sweep.json: a point without its report", SWEEP_JSON + "[no-report]"),
    (16, "sweep.json: a list", SWEEP_JSON + "[a-list]"),
    (16, "metrics.json: an accuracy a string", METRICS_JSON + "[accuracy-a-string]"),
    (16, "metrics.json: blocks a string", METRICS_JSON + "[blocks-a-string]"),
    (16, "metrics.json: a budget a string", METRICS_JSON + "[budget-a-string]"),
    (16, "metrics.json: results a list", METRICS_JSON + "[results-a-list]"),
    (16, "summary.json: steps a string", SUMMARY_JSON + "[steps-a-string]"),
    (16, "summary.json: checkpoint a number", SUMMARY_JSON + "[checkpoint-a-number]"),
    (16, "provenance.json: a record's step a string; records a number",
     Re + "test_a_crafted_provenance_json_is_one_line_naming_the_field"),
    (16, "lock file with a huge pid", LOCK + "[huge]"),
    (16, "lock file with a pid beyond pid_max", LOCK + "[beyond-pid-max]"),
    (16, "lock file naming pid 1: the folder held for ever", LOCK + "[init]"),
    (16, "sharded checkpoint: an alias naming a missing tensor", Re + "test_a_sharded_alias_naming_a_missing_tensor_is_one_line"),
    (16, "convert: an authors' state dict missing a key (a bare key name)",
     Re + "test_an_authors_state_dict_missing_a_key_names_it_as_missing"),
    (17, "resume after the training data file was regenerated", Fi + "test_a_resume_on_a_regenerated_data_file_is_refused"),
    (17, "compare: reports of two held-out sets as equals",
     Fi + "test_compare_refuses_reports_of_different_held_out_sets_unless_allowed"),
    (17, "compare: a sweep point without a report dropped silently; no task named",
     Fi + "test_compare_names_the_task_and_the_sweep_points_without_a_report"),
    (17, "sweep rerun with --max-steps keeps the old reports", Fi + "test_a_sweep_rerun_with_other_budgets_evaluates_again"),
    (17, "eval --variant eval.max_examples=4 evaluates every example", Fi + "test_eval_variant_honours_every_key_it_names"),
    (17, "training and held-out sets of one seed and generator options", Fi + "test_a_held_out_set_drawn_like_the_training_set_is_refused"),
    (18, "ARC test pairs without an output scored as solved", Sc + "test_held_out_rows_without_labels_are_left_out_and_counted"),
    (18, "one ARC task in the held-out subset and a training subset",
     Sc + "test_an_arc_task_in_the_held_out_subset_and_a_training_subset_is_refused"),
    (18, "data prepare without a test split suggests an evaluation path that fails",
     Sc + "test_data_prepare_without_a_test_split_says_how_to_evaluate"),
    (18, "data prepare of ARC: pairs without an output as all-zero labels",
     Sc + "test_data_prepare_of_arc_leaves_out_test_pairs_without_an_output"),
    (19, "a branch killed before its first checkpoint restarts from step 0",
     Br + "test_a_branch_killed_before_its_first_checkpoint_resumes_from_its_origin"),
    (19, "resuming a hard-linked copy appends to the original's files",
     Br + "test_resuming_a_hard_linked_copy_never_changes_the_originals_files"),
    (19, "a malformed provenance.json dropped on resume; a branch's history starts empty",
     Br + "test_provenance_history_is_kept_on_resume_and_a_branch_starts_with_its_origins"),
    (20, "train --plan --gpu-memory 0", Lo + "test_plan_with_no_gpu_memory_is_refused"),
    (20, "loopformer.load(use_ema='no') loads the EMA", Lo + "test_load_use_ema_must_be_a_boolean"),
    (20, "solve with a float array beyond int64: a numpy warning", Lo + "test_solve_with_a_float_array_beyond_any_integer_is_one_clear_error"),
    (20, "convert of a NaN checkpoint exits 0", Lo + "test_convert_of_a_nan_checkpoint_is_refused"),
    (20, "push racing a checkpoint rotation", Lo + "test_push_never_mixes_two_checkpoints_of_a_rotation"),
    (20, "consolidate racing a checkpoint rotation", Lo + "test_consolidate_never_mixes_two_checkpoints_of_a_rotation"),
    (20, "'Spearman rho nan' printed as a result", Lo + "test_an_undefined_rank_correlation_is_never_printed_as_a_result"),
]  # fmt: skip
# (cases, commit before, files copied into its worktree): one table each
GROUPS = [("issue 16", "CASES", "BEFORE", "COPIED"), ("issue 24", "CASES_24", "BEFORE_24", "COPIED_24"),
          ("issue 35", "CASES_35", "BEFORE_35", "COPIED_35")]  # fmt: skip


def git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


def run_tests(root: Path, ids: list[str], report: Path, timeout: int) -> dict[str, tuple[str, str]]:
    """{node id: (outcome, first line of the failure)} of ``ids`` run by pytest in ``root`` (its package
    first on PYTHONPATH); outcome is pass / fail / error / skip / missing."""
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    env.pop("LOOPFORMER_DEBUG", None)
    where = subprocess.run(
        [sys.executable, "-c", "import loopformer; print(loopformer.__file__)"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    if not Path(where).resolve().is_relative_to(root.resolve()):
        raise RuntimeError(f"the tests in {root} would import loopformer from {where}")
    cmd = [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-o", "addopts=",
           f"--timeout={timeout}", f"--junitxml={report}", *ids]  # fmt: skip
    subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    found: dict[str, tuple[str, str]] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        node = f"{module}.py::{case.get('name')}"
        outcome, reason = "pass", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "fail", "error": "error", "skipped": "skip"}[tag]
                reason = (el.get("message") or el.text or "").strip()
                if "Regex pattern did not match" in reason:  # pytest.raises(match=...): show what was raised
                    lines = [x.strip() for x in (el.text or "").splitlines()]
                    marks = ("Actual message:", "Input:")  # pytest >= 8.4 / older pytest
                    got = [
                        x.split(m, 1)[1].strip() for x in lines for m in marks if x.startswith("E") and m in x
                    ]
                    reason = "raised, but with the message " + (got[0] if got else "(not shown)")
                break
        found[node] = (outcome, reason)
    return {i: found.get(i, ("missing", "not collected")) for i in ids}


def one_line(text: str, width: int = 120) -> str:
    """The first non-empty line of ``text``, pytest's temporary folders cut from its paths, shortened."""
    line = next((x.strip() for x in text.splitlines() if x.strip()), "")
    line = re.sub(r"/tmp/pytest-of-[^/]+/pytest-\d+/[^/]+/", "", line)
    line = line.replace("|", "\\|").replace("`", "'")
    return line if len(line) <= width else line[: width - 3] + "..."


def before_after(
    before: str, timeout: int, cases: list[tuple[int, str, str]] | None = None, copied: list[str] | None = None
) -> tuple[dict, dict, str, float]:
    cases, copied = (CASES if cases is None else cases), (COPIED if copied is None else copied)
    ids = list(dict.fromkeys(node for _, _, node in cases))
    commit = git("rev-parse", "--short", before)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lf-before-") as tmp:
        old = Path(tmp) / "before"
        git("worktree", "add", "--detach", str(old), commit)
        try:
            for rel in copied:
                shutil.copy2(REPO / rel, old / rel)
            then = run_tests(old, ids, Path(tmp) / "before.xml", timeout)
        finally:
            git("worktree", "remove", "--force", str(old))
        now = run_tests(REPO, ids, Path(tmp) / "now.xml", timeout)
    return then, now, commit, time.perf_counter() - t0


def markdown(
    then: dict, now: dict, commit: str, seconds: float, cases: list[tuple[int, str, str]] | None = None
) -> str:
    cases = CASES if cases is None else cases
    rows = ["| Why | case | test | before | now |", "|---:|---|---|---|---|"]
    good = 0
    for why, case, node in cases:
        b, reason = then[node]
        n, now_reason = now[node]
        good += b == "fail" and n == "pass"
        before_cell = f"{b}: {one_line(reason)}" if reason else b
        now_cell = n if n == "pass" else f"{n}: {one_line(now_reason)}"
        rows.append(f"| {why} | {case} | `{node.split('/')[-1]}` | {before_cell} | {now_cell} |")
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    head = (
        f"{good} of {len(cases)} cases fail before (commit {commit}) and pass now "
        f"({seconds:.0f} s for both runs, load average {load})."
    )
    return "\n".join([head, "", *rows])


BEGIN, END = "<!-- before-after:begin -->", "<!-- before-after:end -->"
MARKERS = {"issue 16": (BEGIN, END), "issue 24": ("<!-- before-after-24:begin -->", "<!-- before-after-24:end -->"),
           "issue 35": ("<!-- before-after-35:begin -->", "<!-- before-after-35:end -->")}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default=None, help="the commit before the work (default: each group's own)")
    parser.add_argument("--group", choices=[g[0] for g in GROUPS], default=GROUPS[0][0],
                        help="which cases: issue 16's (the default), issue 24's (resume, convert, output swap) or "
                             "issue 35's (trust boundaries)")
    parser.add_argument("--write", type=Path, help="replace the table between the markers in this file")
    parser.add_argument("--timeout", type=int, default=300, help="per-test timeout in seconds")
    args = parser.parse_args()
    _, cases_name, before_name, copied_name = next(g for g in GROUPS if g[0] == args.group)
    cases, copied = globals()[cases_name], globals()[copied_name]
    before = args.before or globals()[before_name]
    then, now, commit, seconds = before_after(before, args.timeout, cases, copied)
    table = markdown(then, now, commit, seconds, cases)
    if args.write:
        text = args.write.read_text()
        begin, end_mark = MARKERS[args.group]
        start, end = text.index(begin) + len(begin), text.index(end_mark)
        args.write.write_text(text[:start] + "\n" + table + "\n" + text[end:])
    print(table)
    bad = [node for _, _, node in cases if not (then[node][0] == "fail" and now[node][0] == "pass")]
    if bad:
        print(f"\nnot fail-before / pass-now: {bad}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
