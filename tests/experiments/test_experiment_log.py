"""`ExperimentLog` (stemlm.experiments.contract): lines and nested bars on stderr, bars only on a terminal and
without --no-progress; `train_all` steps the run bar once per finished run and keeps the job order.
Run: `python -m pytest tests/experiments/test_experiment_log.py -q`."""

from __future__ import annotations

import sys

from stemlm.cli.main import build_parser
from stemlm.experiments import knowledge
from stemlm.experiments.contract import ExperimentLog


def two_seeds_of_three_runs(log: ExperimentLog) -> None:
    with log.bar(2, desc="seeds", unit="seed") as seeds:
        for seed in range(2):
            log(f"seed {seed}: training")
            with log.bar(3, desc="runs", unit="run") as runs:
                runs.update(3)
            seeds.update()


def test_nested_bars_on_a_terminal_the_inner_one_cleared(tty_stderr):
    two_seeds_of_three_runs(ExperimentLog(progress=True))
    err = tty_stderr.readouterr().err
    assert "seed 0: training\n" in err and "seed 1: training\n" in err
    assert "runs:   0%|          | 0/3" in err  # drawn below the seed bar
    assert err.rstrip("\n").split("\r")[-1].startswith("seeds: 100%")  # the outer bar stays; the inner was cleared


def test_only_the_lines_without_progress_or_a_terminal(tty_stderr, monkeypatch):
    two_seeds_of_three_runs(ExperimentLog(progress=False))
    assert tty_stderr.readouterr().err == "seed 0: training\nseed 1: training\n"
    monkeypatch.setattr(type(sys.stderr), "isatty", lambda self: False)
    two_seeds_of_three_runs(ExperimentLog(progress=True))
    assert tty_stderr.readouterr().err == "seed 0: training\nseed 1: training\n"


def test_train_all_steps_per_run_in_job_order(tty_stderr, monkeypatch):
    monkeypatch.setattr(knowledge, "train_in_worker", lambda name, *rest: {"name": name, "steps": len(rest)})
    jobs = [(name, {}, {}, "") for name in ("stem", "dense", "moe")]
    results = knowledge.train_all(jobs, 1, ExperimentLog(progress=True))
    assert list(results) == ["stem", "dense", "moe"] and results["moe"] == {"name": "moe", "steps": 3}
    assert tty_stderr.readouterr().err.rstrip("\n").split("\r")[-1].startswith("runs: 100%")


def test_every_experiment_takes_no_progress():
    parser = build_parser()
    for name in ("knowledge", "compare", "bio"):
        assert parser.parse_args(["experiment", name, "--no-progress"]).no_progress
