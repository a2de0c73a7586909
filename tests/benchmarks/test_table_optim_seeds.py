"""benchmarks/table_optim_seeds.py: the paired-by-seed summary, the argument checks, and a one-step run of two
optimizers whose records a second run reuses."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy import stats

from tests.benchmarks.harness import load_benchmark, result_fields, run_benchmark

bench = load_benchmark("table_optim_seeds.py")


def record(optim: str, seed: int, loss: float, recall: float) -> dict:
    return {"optim": optim, "seed": seed, "heldout_loss": loss, "recall_train": recall, "recall_heldout": recall / 2}


def test_paired_differences_and_t_interval():
    a = {0: 5.20, 1: 5.31, 2: 5.17}
    b = {0: 5.25, 1: 5.33, 2: 5.26}
    records = {("rowwise_adagrad", s): record("rowwise_adagrad", s, v, 0.5) for s, v in a.items()}
    records |= {("lazy_adamw", s): record("lazy_adamw", s, v, 0.25 * (s + 1)) for s, v in b.items()}
    out = bench.summarize(records, ["rowwise_adagrad", "lazy_adamw"], [0, 1, 2])
    paired = out["paired"]["lazy_adamw-rowwise_adagrad"]["heldout_loss"]
    diffs = np.array([b[s] - a[s] for s in (0, 1, 2)])
    half = stats.t.ppf(0.975, 2) * diffs.std(ddof=1) / math.sqrt(3)
    assert paired["per_seed"] == pytest.approx({s: d for s, d in zip((0, 1, 2), diffs, strict=True)})
    assert paired["mean"] == pytest.approx(diffs.mean())
    assert paired["ci95"] == pytest.approx([diffs.mean() - half, diffs.mean() + half])
    recall = out["paired"]["lazy_adamw-rowwise_adagrad"]["recall_train"]
    assert recall["mean"] == pytest.approx(np.mean([0.25 - 0.5, 0.5 - 0.5, 0.75 - 0.5]))
    assert out["per_optim"]["lazy_adamw"]["heldout_loss"]["mean"] == pytest.approx(np.mean(list(b.values())))
    assert out["best"] == "rowwise_adagrad"


def test_unpaired_seed_is_left_out_of_the_difference():
    records = {("rowwise_adagrad", s): record("rowwise_adagrad", s, 5.0 + s, 0.1) for s in (0, 1)}
    records[("adamw", 0)] = record("adamw", 0, 4.5, 0.1)
    out = bench.summarize(records, ["rowwise_adagrad", "adamw"], [0, 1])
    paired = out["paired"]["adamw-rowwise_adagrad"]["heldout_loss"]
    assert paired["n"] == 1 and paired["mean"] == pytest.approx(-0.5) and paired["ci95"] == [None, None]
    assert out["per_optim"]["rowwise_adagrad"]["heldout_loss"]["n"] == 2
    assert out["best"] == "adamw"


@pytest.mark.parametrize(
    "argv",
    [["--optims", "sgd"], ["--seeds", "0,x"], ["--seeds", "1,1"], ["--steps", "0"], ["--budget", "bio"]],
)
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as err:
        bench.parse_args(argv)
    assert err.value.code == 2
    assert "error:" in capsys.readouterr().err.strip().splitlines()[-1]  # one line naming the problem


def test_a_kept_run_of_another_budget_is_never_overwritten(tmp_path, capsys):
    kept = tmp_path / "main-rowwise_adagrad-seed0.json"
    kept.write_text('{"optim": "rowwise_adagrad", "seed": 0, "steps": 300}')
    with pytest.raises(SystemExit) as info:  # refused before any training starts
        bench.main(
            ["--budget", "main", "--optims", "rowwise_adagrad", "--seeds", "0", "--steps", "40", "--out", str(tmp_path)]
        )
    assert info.value.code == 2 and "300-step run" in capsys.readouterr().err
    assert kept.read_text() == '{"optim": "rowwise_adagrad", "seed": 0, "steps": 300}'


@pytest.mark.slow
def test_a_one_step_run_per_optimizer_then_its_records_reused(tmp_path):
    argv = ["--steps", "1", "--seeds", "0", "--optims", "rowwise_adagrad,lazy_adamw", "--out", tmp_path]
    first = run_benchmark("table_optim_seeds.py", *argv)
    fields = result_fields(first)
    assert fields["budget"] == "main" and fields["best"] in ("rowwise_adagrad", "lazy_adamw")
    means = {name: float(fields[f"{name}_mean"]) for name in ("rowwise_adagrad", "lazy_adamw")}
    difference = float(fields["lazy_adamw_minus_rowwise_adagrad"])
    assert difference == pytest.approx(means["lazy_adamw"] - means["rowwise_adagrad"], abs=2e-4)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [(r["optim"], r["steps"]) for r in summary["runs"]] == [("lazy_adamw", 1), ("rowwise_adagrad", 1)]
    again = run_benchmark("table_optim_seeds.py", *argv)  # nothing trains: both records are read back
    assert again.count("reused") == 2 and result_fields(again) == fields
