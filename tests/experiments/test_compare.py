"""The side-by-side experiment: budget parsing, FLOP-matched step plans against the accounting, report rows
and table, and (slow) a whole tiny run end to end, including reuse of finished kinds on a rerun."""

from __future__ import annotations

import json

import pytest

from stemlm.accounting import prefill_flops
from stemlm.data.tokenizer import default_tokenizer
from stemlm.errors import StemlmError
from stemlm.experiments.compare import CompareConfig, model_configs, parse_budget, plan_steps, run_compare
from stemlm.experiments.compare_report import ACC_TASKS, markdown_table, summarize_kind

TOK = default_tokenizer()
SMALL = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=2,
    max_position_embeddings=128,
    seq_len=32,
    batch_size=4,
    ple_dim=8,
)


@pytest.mark.parametrize(
    "text,want",
    [
        ("300", ("steps", 300.0)),
        ("5e12", ("flops", 5e12)),
        ("2e9", ("flops", 2e9)),
        ("1e6steps", ("steps", 1e6)),
        ("100flops", ("flops", 100.0)),
        ("1_000", ("steps", 1000.0)),
    ],
)
def test_parse_budget(text, want):
    assert parse_budget(text) == want


@pytest.mark.parametrize("text", ["", "abc", "-5", "0", "nan"])
def test_bad_budget(text):
    with pytest.raises(StemlmError, match="budget"):
        parse_budget(text)


def _training_flops_per_step(config, cfg):
    # Independent of training_flops_per_token: 3 x the exact forward FLOPs of one batch.
    return 3 * prefill_flops(config, cfg.seq_len, batch_size=cfg.batch_size)


def test_flops_matched_steps_spend_the_budget():
    cfg = CompareConfig(budget="20000", **SMALL)
    configs = model_configs(cfg, TOK)
    steps = plan_steps(cfg, configs)
    assert steps["dense"] == 20000
    budget = 20000 * _training_flops_per_step(configs["dense"], cfg)
    for kind, config in configs.items():
        per_step = _training_flops_per_step(config, cfg)
        assert abs(steps[kind] * per_step - budget) <= per_step / 2  # the nearest whole number of steps
    assert steps["stem"] > steps["dense"] > steps["ple"]  # STEM drops an up-projection, PLE adds a branch


def test_flops_budget_and_active_matching():
    cfg = CompareConfig(budget="3e10", kinds=("stem", "moe"), **SMALL)
    configs = model_configs(cfg, TOK)
    steps = plan_steps(cfg, configs)
    for kind in configs:
        assert steps[kind] == round(3e10 / _training_flops_per_step(configs[kind], cfg))
    same = plan_steps(CompareConfig(budget="3e10", kinds=("stem", "moe"), match="active", **SMALL), configs)
    assert same == dict.fromkeys(configs, steps["stem"])  # the first kind is the reference without dense


def test_kind_errors():
    with pytest.raises(StemlmError, match="unknown kind"):
        model_configs(CompareConfig(kinds=("dense", "mamba"), **SMALL), TOK)
    with pytest.raises(StemlmError, match="twice"):
        model_configs(CompareConfig(kinds=("dense", "dense"), **SMALL), TOK)


def test_cli_bad_input_is_one_line_exit_2(tmp_path, capsys):
    from stemlm.cli.main import main

    out = str(tmp_path / "cmp")
    assert main(["experiment", "compare", "--kinds", "dense,mamba", "--out", out]) == 2
    assert capsys.readouterr().err.strip().startswith("stemlm experiment: error: unknown kind(s) mamba; choose from")
    assert main(["experiment", "compare", "--budget", "lots", "--out", out]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("stemlm experiment: error: --budget 'lots'") and "\n" not in err


def _fake(kind, acc, flops):
    return {
        "kind": kind,
        "params_total": 10,
        "params_active": 5,
        "train_flops_per_token": 1.0,
        "steps": 3,
        "train_flops": flops,
        "heldout": {"loss": 4.0, "bits_per_byte": 1.5},
        "tasks": {t: {"acc": acc} for t in ACC_TASKS},
        "niah": {"by_length": {"64": 0.5}, "accuracy": 0.5},
        "fit": {"loss_spikes": 1, "tokens_per_s": 1000.0},
    }


def test_summary_rows_and_table():
    rows = [summarize_kind(_fake("dense", 0.4, 2e15)), summarize_kind(_fake("stem", 0.6, 1e15))]
    assert rows[0]["mean_accuracy"] == pytest.approx(0.4) and rows[0]["roi_acc_per_pflop"] == pytest.approx(0.2)
    assert rows[1]["roi_acc_per_pflop"] == pytest.approx(0.6)
    table = markdown_table(rows).splitlines()
    assert len(table) == 4 and table[0].count("|") == table[2].count("|") == table[3].count("|")
    assert "| 3.00x |" in table[3] and "| 1.00x |" in table[2]  # ROI relative to dense


@pytest.mark.slow
def test_compare_end_to_end(tmp_path):
    cfg = CompareConfig(
        out=str(tmp_path / "cmp"),
        budget="3",
        corpus_chars=20_000,
        fact_repeats=1,
        passkey_docs=10,
        passkey_lengths=(100,),
        passkey_needles=(1,),
        eval_limit=2,
        ppl_tokens=300,
        niah_lengths=(80, 96),
        niah_depths=(0.0, 1.0),
        niah_samples=1,
        niah_digits=3,
        workers=1,
        **SMALL,
    )
    report = run_compare(cfg, log=lambda msg: None)
    out = tmp_path / "cmp"
    saved = json.loads((out / "results.json").read_text())
    assert [r["kind"] for r in saved["rows"]] == list(cfg.kinds)
    for kind, raw in zip(cfg.kinds, saved["kinds"], strict=True):
        assert raw["fit"]["steps"] == report["steps"][kind]
        assert raw["train_flops"] == pytest.approx(raw["train_flops_per_token"] * raw["steps"] * 32 * 4)
        assert set(raw["tasks"]) >= set(ACC_TASKS) and set(raw["niah"]["grid"]) == {"80", "96"}
        assert (out / f"niah_{kind}.png").is_file() and (out / "runs" / kind / "checkpoints").is_dir()
    for name in ("report.md", "loss_vs_flops.png", "accuracy.png"):
        assert (out / name).is_file()
    assert (out / "report.md").read_text().count("\n| ") == len(cfg.kinds) + 1
    again = run_compare(cfg, log=lambda msg: None)  # every kind is reused: same numbers, no training
    assert again["rows"] == report["rows"]
