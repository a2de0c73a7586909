"""The knowledge experiment's parts (FLOP matching, recall, data, report) and, marked slow, a whole tiny run."""

from __future__ import annotations

import json

import pytest

from stemlm.accounting import training_flops_per_token
from stemlm.cli.main import main
from stemlm.data import load_corpus
from stemlm.data.tokenizer import train_bpe
from stemlm.experiments.knowledge import (
    KnowledgeConfig,
    build_data,
    fact_recall,
    greedy_matches,
    markdown_table,
    matched_steps,
    model_configs,
    run_knowledge,
)
from stemlm.facts import fact_prompts, load_countries
from stemlm.generate import generate
from stemlm.model import build_model


def test_matched_steps_equalise_training_flops():
    cfg = KnowledgeConfig()
    configs = model_configs(cfg)
    steps = matched_steps(configs, cfg.seq_len, 250)
    dense, stem = (training_flops_per_token(configs[n], cfg.seq_len) for n in ("dense", "stem"))
    assert steps["dense"] == 250 and steps["stem"] > 250
    assert abs(steps["stem"] * stem - 250 * dense) <= stem / 2  # closest integer step count
    assert configs["stem"].special_layers == [1, 3] and configs["dense"].special_layers == []


def test_greedy_matches_agree_with_generation(tiny_config):
    model = build_model(tiny_config("stem"), seed=1).eval()
    prompts = [[5, 9, 11], [7, 3], [100, 101, 102, 103]]
    pairs = []
    for p in prompts:
        cont = generate(model, p, 3, greedy=True)
        pairs.append((p, cont))
        pairs.append((p, cont[:2] + [(cont[2] + 1) % 256]))  # last token wrong
    assert greedy_matches(model, pairs, batch_size=2) == [True, False] * 3


def test_fact_recall_on_a_model_that_knows_nothing(tiny_config):
    texts = [p.prompt + p.answer for p in fact_prompts("train", ("capital",))]
    tok = train_bpe(texts[:200], vocab_size=400)
    model = build_model(tiny_config("dense", vocab_size=512), seed=0).eval()
    result = fact_recall(model, tok, ("capital",))
    assert result["train"]["prompts"] == len(fact_prompts("train", ("capital",)))
    assert result["heldout"]["prompts"] == len(fact_prompts("heldout", ("capital",)))
    assert result["train"]["recall"] == result["train"]["capital"] < 0.05  # a random model recalls ~nothing


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


@pytest.mark.slow
def test_whole_tiny_experiment(tmp_path):
    cfg = KnowledgeConfig(
        out=str(tmp_path / "k"),
        dense_steps=4,
        fact_repeats=2,
        corpus_chars=30_000,
        vocab_size=1024,
        hidden_size=32,
        intermediate_size=64,
        edit_records=3,
        fluency_records=1,
        parallel=False,
    )
    results = run_knowledge(cfg, log=lambda m: None)
    assert set(results["edits"]["variants"]) == {"stem-stem", "stem-embed", "stem-both", "dense-embed"}
    assert (tmp_path / "k" / "results.md").read_text().startswith("# Knowledge experiment")
    saved = json.loads((tmp_path / "k" / "results.json").read_text())
    assert saved["steps"] == results["steps"] and saved["edits"]["records"] == 3
    assert saved["training"]["stem"]["steps"] == results["steps"]["stem"]


@pytest.mark.slow
def test_experiment_cli(tmp_path, capsys):
    argv = [
        "experiment",
        "knowledge",
        "--out",
        str(tmp_path / "k"),
        "--steps",
        "3",
        "--records",
        "2",
        "--no-diagnostics",
        "--serial",
        "--set",
        "fact_repeats=1",
        "--set",
        "corpus_chars=20000",
        "--set",
        "vocab_size=1024",
        "--set",
        "hidden_size=32",
        "--set",
        "intermediate_size=64",
    ]
    assert main(argv) == 0
    assert "| dense-embed |" in capsys.readouterr().out
    assert main(["experiment", "knowledge", "--set", "bogus=1"]) == 2
    assert "--set 'bogus=1'" in capsys.readouterr().err


def test_experiment_and_eval_groups_print_help_without_a_subcommand(capsys):
    assert main(["experiment"]) == 2
    assert "knowledge" in capsys.readouterr().out
    assert main(["eval"]) == 2
    assert "edits" in capsys.readouterr().out
