"""The knowledge experiment's parts (FLOP/token matching, recall, data, contrasts, report) and, marked slow, the
`--quick --seeds 2 --json` command at a tiny budget (per-seed entries, summary intervals, lr sweep)."""

from __future__ import annotations

import json

import pytest

from stemlm.cli.main import main
from stemlm.data import load_corpus
from stemlm.data.worlds.facts import fact_prompts, load_countries
from stemlm.errors import StemlmError
from stemlm.experiments.knowledge import (
    KnowledgeConfig,
    arm_plan,
    build_data,
    contrasts,
    matched_steps,
    model_configs,
)
from stemlm.experiments.knowledge_report import markdown_table
from stemlm.model.accounting import training_flops_per_token


def test_matched_steps_equalise_training_flops():
    cfg = KnowledgeConfig()
    configs = model_configs(cfg)
    steps = matched_steps(configs, cfg.seq_len, 250)
    dense, stem = (training_flops_per_token(configs[n], cfg.seq_len) for n in ("dense", "stem"))
    assert steps["dense"] == 250 and steps["stem"] > 250
    assert abs(steps["stem"] * stem - 250 * dense) <= stem / 2  # closest integer step count
    assert configs["stem"].special_layers == [1, 3] and configs["dense"].special_layers == []


def test_build_data_mixture_split_and_tokenizer(tmp_path):
    cfg = KnowledgeConfig(fact_repeats=10, corpus_chars=20_000, vocab_size=2048)
    tok, path = build_data(cfg, tmp_path)
    train, heldout = load_corpus([path])  # the trainer's own split of the file
    statements = [p.prompt + p.answer + "." for p in fact_prompts("train", ("capital",))]
    docs = train[0].split("<|endoftext|>")  # documents as the trainer separates them
    fact_docs = -(-10 * len(statements) // 64)  # 64 statements per fact document
    lines = "\n".join(docs[:fact_docs]).split("\n")
    assert sorted(lines) == sorted(statements * 10)  # every fact trained, 10 times
    assert not any(s in heldout[0] for s in statements[:50])  # the held-out tail is natural text only
    trained_corpus = len(train[0]) - len("<|endoftext|>".join(docs[:fact_docs]))
    assert abs(trained_corpus - 20_000) < 200 and len(heldout[0]) > 0.09 * (len(train[0]) + len(heldout[0]))
    assert tok.encode("a<|endoftext|>b").ids[1] == 0  # the separator is the EOT token itself
    single = sum(len(tok.encode(" " + c.name).ids) == 1 for c in load_countries() if " " not in c.name)
    assert single > 150  # names seen in the fact text become whole tokens


def test_markdown_table():
    table = markdown_table(["a", "b"], [[0.5, None], ["x", 3]])
    assert table.splitlines() == ["| a | b |", "|---|---|", "| 0.500 | - |", "| x | 3 |"]


def test_arm_plan_matches_flops_and_tokens():
    cfg = KnowledgeConfig(dense_steps=250)
    configs = model_configs(cfg)
    plan = arm_plan(cfg, configs)
    assert set(plan) == {"dense", "stem", "stem_tokens", "dense_embed"}
    flops = {n: training_flops_per_token(configs[p["kind"]], cfg.seq_len) * p["tokens"] for n, p in plan.items()}
    assert plan["stem"]["steps"] == matched_steps(configs, cfg.seq_len, 250)["stem"]
    assert abs(flops["stem"] - flops["dense"]) <= training_flops_per_token(configs["stem"], cfg.seq_len) * 1024 / 2
    assert plan["stem_tokens"]["tokens"] == plan["dense"]["tokens"] == plan["dense_embed"]["tokens"] == 250 * 16 * 64
    assert plan["dense_embed"]["overrides"] == {"embed_like_tables": True} and plan["dense_embed"]["kind"] == "dense"
    assert all(p["train_flops"] == pytest.approx(flops[n]) for n, p in plan.items())
    with pytest.raises(StemlmError, match="arms must include"):
        arm_plan(KnowledgeConfig(arms=("stem",)), configs)


def test_contrasts_are_paired_differences():
    def arm(loss, train, held):
        return {"heldout_loss": loss, "recall": {"train": {"recall": train}, "heldout": {"recall": held}}}

    arms = {"dense": arm(5.0, 0.2, 0.0), "stem": arm(4.5, 0.9, 0.1), "stem_tokens": arm(4.6, 0.8, 0.05)}
    diff = contrasts(arms)
    assert set(diff) == {"stem-dense@flops", "stem-dense@tokens"}  # no dense_embed arm: no such contrast
    assert diff["stem-dense@flops"] == pytest.approx({"heldout_loss": -0.5, "recall_train": 0.7, "recall_heldout": 0.1})
    assert diff["stem-dense@tokens"]["recall_train"] == pytest.approx(0.6)


TINY = [
    "--set", "fact_repeats=1", "--set", "corpus_chars=20000", "--set", "vocab_size=1024",
    "--set", "hidden_size=32", "--set", "intermediate_size=64", "--set", "seq_len=32", "--set", "batch_size=4",
]  # fmt: skip


@pytest.mark.slow
def test_quick_cli_json_has_per_seed_and_summary(tmp_path, capsys):
    # The check at an even smaller budget: 2 seeds, every metric per seed, mean and t interval per metric.
    out = tmp_path / "k"
    argv = ["experiment", "knowledge", "--quick", "--seeds", "2", "--json", "--out", str(out), "--steps", "3"]
    argv += ["--records", "2", "--serial", "--lr-sweep", "1e-3,1e-2", *TINY]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert [s["seed"] for s in result["per_seed"]] == [0, 1]
    for arm in ("dense", "stem", "stem_tokens", "dense_embed"):
        for path in (("heldout_loss",), ("recall", "heldout", "recall"), ("recall", "train", "recall")):
            values = [_get(s["arms"][arm], path) for s in result["per_seed"]]
            entry = _get(result["summary"]["arms"][arm], path)
            assert entry["mean"] == pytest.approx(sum(values) / 2) and entry["n"] == 2
            lo, hi = entry["ci95"]
            assert lo <= entry["mean"] <= hi
            half = 12.706205 * abs(values[0] - values[1]) / 2  # t(0.975, 1) * sd / sqrt(2), sd = |a - b| / sqrt 2
            assert hi - entry["mean"] == pytest.approx(half, rel=1e-6)
    for s in result["per_seed"]:
        d = s["diff"]["stem-dense@flops"]
        assert d["heldout_loss"] == pytest.approx(
            s["arms"]["stem"]["heldout_loss"] - s["arms"]["dense"]["heldout_loss"]
        )
        assert set(s["edits"]["variants"]) == {
            "stem-tables",
            "stem-embed",
            "stem-both",
            "dense-embed",
            "dense_embed-embed",
        }
    assert "edited" in result["summary"]["edits"]["variants"]["stem-tables"]["all_records"]["train"]["new_greedy"]
    sweep = result["sweep"]
    for family, trials in sweep["trials"].items():  # each family's chosen lr is its lowest held-out loss
        assert sweep["best"][family] == min(trials.values(), key=lambda t: t["heldout_loss"])["lr"]
    assert result["per_seed"][0]["arms"]["stem_tokens"]["lr"] == sweep["best"]["stem"]
    assert result["per_seed"][0]["arms"]["dense_embed"]["embed_lr"] == 10 * sweep["best"]["dense_embed"]
    saved = json.loads((out / "results.json").read_text())
    assert saved["summary"] == result["summary"]
    md = (out / "results.md").read_text()
    assert "## Matched training FLOPs" in md and "## Matched training tokens" in md and "## lr sweep" in md
    assert (out / "knowledge.png").is_file()
    assert main(["experiment", "knowledge", "--set", "bogus=1"]) == 2
    assert "unknown knowledge option 'bogus'; valid keys:" in capsys.readouterr().err


def _get(d, path):
    for key in path:
        d = d[key]
    return d


def test_experiment_and_eval_groups_print_help_without_a_subcommand(capsys):
    assert main(["experiment"]) == 2
    assert "knowledge" in capsys.readouterr().out
    assert main(["eval"]) == 2
    assert "edits" in capsys.readouterr().out


def test_planned_flops_count_every_arm_and_the_sweep():
    from stemlm.experiments.knowledge import planned_flops

    cfg = KnowledgeConfig(dense_steps=100, seeds=2, lr_sweep=(1e-3, 1e-2, 3e-2))
    configs = model_configs(cfg)
    per_token = {k: training_flops_per_token(c, cfg.seq_len) for k, c in configs.items()}
    tokens = 100 * cfg.batch_size * cfg.seq_len
    stem_flops = per_token["stem"] * matched_steps(configs, cfg.seq_len, 100)["stem"] * cfg.batch_size * cfg.seq_len
    seed = per_token["dense"] * tokens * 2 + stem_flops + per_token["stem"] * tokens  # dense, dense_embed, 2 STEM
    sweep = per_token["dense"] * tokens * 2 + stem_flops  # dense, dense_embed, stem (FLOP-matched) per lr
    assert planned_flops(cfg) == pytest.approx(2 * seed + 3 * sweep, rel=1e-9)
