"""The side-by-side experiment: budget parsing, FLOP- and token-matched step plans against the accounting, report
rows and seed entries, and (slow) `--quick --seeds 2 --json` at a tiny budget, including reuse on a rerun."""

from __future__ import annotations

import json

import pytest

from stemlm.cli.main import build_parser
from stemlm.data.tokenizer import default_tokenizer
from stemlm.errors import StemlmError
from stemlm.experiments.compare import CompareConfig, model_configs, parse_budget, plan_steps, seed_entry
from stemlm.experiments.compare_report import ACC_TASKS, summarize_kind
from stemlm.experiments.contract import resolve_options
from stemlm.model.accounting import prefill_flops
from tests.experiments.compare_results import result_row

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
    return result_row(kind, acc=acc, flops=flops, table_lr=3e-2 if kind == "stem" else None, niah=0.5, spikes=1)


def test_summary_rows_and_seed_entry():
    rows = [summarize_kind(_fake("dense", 0.4, 2e15)), summarize_kind(_fake("stem", 0.6, 1e15))]
    assert rows[0]["mean_accuracy"] == pytest.approx(0.4) and rows[0]["roi_acc_per_pflop"] == pytest.approx(0.2)
    assert rows[1]["roi_acc_per_pflop"] == pytest.approx(0.6) and rows[1]["table_lr"] == 3e-2
    done = {"dense-3steps": _fake("dense", 0.4, 2e15), "stem-3steps": _fake("stem", 0.6, 1e15)}
    entry = seed_entry(7, {"flops": {"dense": 3, "stem": 3}}, done)
    assert entry["seed"] == 7 and entry["flops"]["stem"]["mean_accuracy"] == pytest.approx(0.6)
    assert entry["diff"]["flops"]["stem-dense"]["mean_accuracy"] == pytest.approx(0.2)
    assert entry["diff"]["flops"]["stem-dense"]["heldout_loss"] == 0.0


def test_quick_flags_lie_under_given_flags():
    from stemlm.experiments.compare import EXPERIMENT, QUICK

    cfg = resolve_options(EXPERIMENT, {"budget": "7", "kinds": ("dense", "stem"), "seeds": None}, quick=True)
    assert cfg.budget == "7" and cfg.seeds == QUICK["seeds"] and cfg.lr_sweep == () and cfg.kinds == ("dense", "stem")
    assert resolve_options(EXPERIMENT, {}) == CompareConfig()
    parser = build_parser()
    args = parser.parse_args(["experiment", "compare", "--lr-sweep", "none", "--set", "ple_dim=8", "--kinds", "a,b"])
    assert (args.lr_sweep, args.model_overrides, args.kinds, args.budget) == ((), ["ple_dim=8"], ("a", "b"), None)
    tokens = CompareConfig(budget="5000", kinds=("dense", "stem"), **SMALL)
    configs = model_configs(tokens, TOK)
    assert plan_steps(tokens, configs, "tokens") == {"dense": 5000, "stem": 5000}
    assert plan_steps(tokens, configs, "flops")["stem"] > 5000
    assert model_configs(CompareConfig(kinds=("dense_embed",), **SMALL), TOK)["dense_embed"].ffn == "dense"


@pytest.mark.slow
def test_quick_cli_end_to_end(tmp_path, capsys):
    # The check at an even smaller budget: 2 seeds, both matchings, summary with mean and t interval.
    from stemlm.cli.main import main

    out = tmp_path / "cmp"
    argv = ["experiment", "compare", "--quick", "--seeds", "2", "--kinds", "dense,stem", "--json", "--out", str(out)]
    argv += ["--budget", "3", "--corpus-chars", "20000", "--fact-repeats", "1", "--passkey-docs", "10"]
    argv += ["--eval-limit", "2", "--ppl-tokens", "300", "--niah-lengths", "80,96", "--niah-samples", "1"]
    argv += ["--hidden-size", "32", "--intermediate-size", "48", "--layers", "2", "--seq-len", "32"]
    argv += [
        "--batch-size",
        "4",
        "--workers",
        "1",
        "--set",
        "num_attention_heads=2",
        "--set",
        "max_position_embeddings=128",
    ]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert [s["seed"] for s in report["per_seed"]] == [0, 1] and set(report["steps"]) == {"flops", "tokens"}
    for match in ("flops", "tokens"):
        for kind in ("dense", "stem"):
            for path in (("heldout_loss",), ("mean_accuracy",), ("niah",), ("accuracy", ACC_TASKS[0])):
                values = [_get(s[match][kind], path) for s in report["per_seed"]]
                entry = _get(report["summary"][match][kind], path)
                assert entry["mean"] == pytest.approx(sum(values) / 2) and entry["n"] == 2
                assert entry["ci95"][0] <= entry["mean"] <= entry["ci95"][1]
        for s in report["per_seed"]:
            want = s[match]["stem"]["heldout_loss"] - s[match]["dense"]["heldout_loss"]
            assert s["diff"][match]["stem-dense"]["heldout_loss"] == pytest.approx(want)
    assert report["steps"]["tokens"] == {"dense": 3, "stem": 3}
    raw = json.loads((out / "seed1" / "runs" / f"stem-{report['steps']['flops']['stem']}steps.json").read_text())
    assert raw["fit"]["steps"] == report["steps"]["flops"]["stem"] and raw["seed"] == 1
    assert raw["train_flops"] == pytest.approx(raw["train_flops_per_token"] * raw["steps"] * 32 * 4)
    md = (out / "report.md").read_text()
    assert "## Matched training FLOPs" in md and "## Matched training tokens" in md
    assert "embedded held-out split, first 300 tokens, window 32" in md  # the table's one evaluation set, labelled
    dense0 = report["per_seed"][0]["flops"]["dense"]["heldout_loss"]
    assert f"{dense0:.3f}" in md
    for name in ("loss_vs_flops.png", "accuracy.png", "niah_dense.png", "niah_stem.png"):
        assert (out / name).is_file()
    assert json.loads((out / "results.json").read_text())["summary"] == report["summary"]
    assert main(argv) == 0  # every run is reused: the same numbers without training
    assert json.loads(capsys.readouterr().out)["per_seed"] == report["per_seed"]


def _get(d, path):
    for key in path:
        d = d[key]
    return d


def test_planned_flops_count_every_distinct_run_and_the_sweep():
    from stemlm.experiments.compare import planned_flops

    cfg = CompareConfig(budget="5000", kinds=("dense", "stem"), seeds=3, lr_sweep=(1e-3, 3e-3), **SMALL)
    configs = model_configs(cfg, TOK)
    plans = {"flops": plan_steps(cfg, configs, "flops"), "tokens": plan_steps(cfg, configs, "tokens")}
    step = {k: _training_flops_per_step(c, cfg) for k, c in configs.items()}
    runs = step["dense"] * 5000 + step["stem"] * (plans["flops"]["stem"] + 5000)  # dense is one run for both
    sweep = 2 * (step["dense"] * 5000 + step["stem"] * plans["flops"]["stem"])
    assert planned_flops(cfg, configs, plans) == pytest.approx(3 * runs + sweep, rel=1e-9)
