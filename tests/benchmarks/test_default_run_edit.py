"""benchmarks/default_run_edit.py: a one-seed run of a small default-run model and its same-FLOPs dense control,
each edited and scored, with every figure of the summary traced back to the commands' own outputs."""

from __future__ import annotations

import json

import pytest

from tests.benchmarks.harness import load_benchmark, result_fields, run_benchmark

SMALL = "--steps 3 --seq-len 32 --batch-size 2 --eval-every 0 --eval-batches 1 --sample-tokens 4"
MODEL = ["model.hidden_size=32", "model.intermediate_size=64", "model.num_hidden_layers=2"]


@pytest.mark.slow
def test_one_seed_with_its_dense_control(tmp_path, monkeypatch):
    monkeypatch.setenv("STEMLM_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "runs"
    args = ["--seeds", "0", "--dense", "--train-args", SMALL, "--set", *MODEL, "--out", out]
    fields = result_fields(run_benchmark("default_run_edit.py", *args))
    summary = json.loads((out / "summary.json").read_text())
    stem, dense = summary["runs"]
    assert (stem["arm"], dense["arm"]) == ("stem", "dense") and set(dense["edit"]) == {"embed"}
    stem_report = json.loads((out / "stem-seed0" / "report.json").read_text())
    dense_report = json.loads((out / "dense-seed0" / "report.json").read_text())
    # the dense control trains at most the STEM run's FLOPs, and a step more would exceed them
    stem_flops = stem_report["accounting"]["training_flops_per_token"] * stem_report["tokens_seen"]
    per_step = dense_report["accounting"]["training_flops_per_token"] * 2 * 32
    assert dense_report["steps"] * per_step <= stem_flops < (dense_report["steps"] + 1) * per_step
    assert stem["heldout_loss"] == stem_report["heldout_loss"] and stem["spikes"] == stem_report["loss_spikes"]
    for rows in ("tables", "embed", "both"):
        edit = stem["edit"][rows]
        assert 0 <= edit["p"] <= 1 and 0 < edit["runner_up"] <= 1 and edit["ratio"] == edit["p"] / edit["runner_up"]
    moved = summary["eval_edits"]["stem/tables"]
    (count, known), rates = moved["counts"][0], moved["paraphrase_moved"]["rates"]
    assert rates == ([count / known] if known else [None])  # a 3-step model may know no paraphrase
    assert "dense/embed" in summary["eval_edits"]
    assert summary["stem_minus_dense"] == stem_report["heldout_loss"] - dense_report["heldout_loss"]
    assert fields["seeds"] == "1" and fields["tables_berlin"] in ("0/1", "1/1")
    # a second call reuses both runs (nothing retrained: the reports stay byte for byte)
    before = (out / "stem-seed0" / "report.json").read_bytes()
    run_benchmark("default_run_edit.py", *args)
    assert (out / "stem-seed0" / "report.json").read_bytes() == before


def test_the_edit_reads_the_answers_first_token():
    bench = load_benchmark("default_run_edit.py")
    assert bench.EDIT == ("The capital of Spain is", "Spain", "Germany", " Berlin")
    assert bench.ROWS == ("tables", "embed", "both")
