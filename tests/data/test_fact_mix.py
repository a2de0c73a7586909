"""The fact-world mix of the default training data: its size, its content, and where the trainer uses it."""

from __future__ import annotations

import numpy as np
import pytest

from stemlm.checkpoint.runs import trained_fact_countries
from stemlm.data import TokenDataset, get_tokenizer
from stemlm.data.fact_mix import fact_repeats, interleave_lines, mixed_texts
from stemlm.data.worlds.facts import MIX_TEMPLATES, TEMPLATES, fact_prompts
from stemlm.errors import StemlmError
from stemlm.train import data as data_mod
from stemlm.train.config import FACT_COUNTRIES, TrainConfig

CORPUS = ["It is a truth universally acknowledged. " * 400] * 40  # ~130k tokens
VERSE = ["It is a truth universally acknowledged,\nthat a single man in possession\n" * 100] * 40  # short lines


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("STEMLM_CACHE", str(tmp_path / "cache"))


def fact_lines(texts: list[str]) -> list[str]:
    """The lines of `texts` that are not corpus text (every corpus line of CORPUS is the same sentence)."""
    return [line for text in texts for line in text.split("\n") if line and "universally" not in line]


@pytest.mark.parametrize("layout", ["batches", "lines", "documents"])
def test_fact_tokens_make_up_the_requested_fraction(layout):
    tok = get_tokenizer("default")
    corpus = TokenDataset.from_texts(CORPUS, tok)
    # The default run's 12 countries: one repeat of their statements is small beside the corpus, so whole repeats
    # can meet the fraction (all of Europe's, 10 phrasings each, is 9k tokens a repeat).
    texts = mixed_texts(
        CORPUS, tok, 0.25, list(FACT_COUNTRIES), ["capital"], 0, corpus_tokens=corpus.num_tokens, layout=layout
    )
    mixed = TokenDataset.from_texts(texts, tok)
    fact_tokens = mixed.num_tokens - corpus.num_tokens
    assert abs(fact_tokens / mixed.num_tokens - 0.25) < 0.01
    # Independent check of the content: every statement of those capitals, equally often.
    statements = [p.prompt + p.answer + "." for p in fact_prompts("train", ("capital",), FACT_COUNTRIES, mix=True)]
    lines = fact_lines(texts)
    repeats = len(lines) // len(statements)
    assert sorted(lines) == sorted(statements * repeats) and repeats > 1
    assert "The capital of Spain is Madrid." in lines and all("Chile" not in line for line in lines)
    assert len(texts) == len(CORPUS) + (0 if layout == "lines" else -(-len(lines) // 64))


def test_lines_layout_puts_facts_in_every_window():
    """Each statement a line of its own, spread evenly: every 128-token window of the mixed stream holds some
    fact tokens, and their share stays near the fraction (whole fact documents leave most windows without any)."""
    tok = get_tokenizer("default")
    corpus = TokenDataset.from_texts(VERSE, tok)
    texts = mixed_texts(
        VERSE, tok, 0.3, list(FACT_COUNTRIES), ["capital"], 0, corpus_tokens=corpus.num_tokens, layout="lines"
    )
    flags = []  # per token: 1 inside a fact statement
    for text in texts:
        for line in text.split("\n"):
            fact = "universally" not in line and "single man" not in line
            flags += [int(fact)] * len(tok.encode(line + "\n").ids)
    shares = [sum(flags[i : i + 128]) / 128 for i in range(0, len(flags) - 128, 128)]
    assert min(shares) > 0.1 and max(shares) < 0.5 and abs(sum(shares) / len(shares) - 0.3) < 0.03


def test_interleave_keeps_the_corpus_and_spreads_statements_by_characters():
    texts = ["a\nb\nc\nd", "e\nf\ng\nh"]
    out = interleave_lines(texts, ["S1", "S2", "S3", "S4"])
    assert [[x for x in t.split("\n") if not x.startswith("S")] for t in out] == [t.split("\n") for t in texts]
    assert out == ["a\nS1\nb\nc\nS2\nd", "e\nS3\nf\ng\nS4\nh"]  # one statement every 4 characters of 16
    assert interleave_lines(texts, []) == texts


def test_named_countries_select_the_statements():
    tok = get_tokenizer("default")
    texts = mixed_texts(["x"], tok, 0.3, ["Spain", "Germany"], ["capital"], 0, corpus_tokens=20_000, layout="lines")
    lines = set(texts[0].split("\n")) - {"x"}
    pair = fact_prompts("train", ("capital",), region=["Spain", "Germany"], mix=True)
    assert lines == {p.prompt + p.answer + "." for p in pair}
    assert "The capital of Germany is Berlin." in lines and "Germany has its capital in Berlin." in lines
    assert len(lines) == 2 * (len(TEMPLATES["capital"][0]) + len(MIX_TEMPLATES["capital"]))
    with pytest.raises(StemlmError, match="unknown country 'Atlantis'"):
        mixed_texts(["x"], tok, 0.2, ["Spain", "Atlantis"], ["capital"], 0, corpus_tokens=1000)
    with pytest.raises(StemlmError, match="fact layout must be one of batches, lines, documents"):
        mixed_texts(["x"], tok, 0.2, ["Spain"], ["capital"], 0, corpus_tokens=1000, layout="paragraphs")
    assert TrainConfig().fact_selection() == list(FACT_COUNTRIES)
    assert TrainConfig(fact_countries=[]).fact_selection() == "Europe"


def test_repeats_follow_the_fraction():
    assert fact_repeats(30_000, 1_000, 0.25) == 10  # 10k facts beside 30k corpus tokens
    assert fact_repeats(100, 1_000, 0.1) == 1  # at least one repeat
    with pytest.raises(StemlmError, match="fact fraction"):
        fact_repeats(100, 10, 1.0)


def test_region_and_fraction_are_checked():
    tok = get_tokenizer("default")
    with pytest.raises(StemlmError, match="no country in region 'Atlantis'"):
        mixed_texts(["x"], tok, 0.2, "Atlantis", ["capital"], 0, corpus_tokens=1000)
    with pytest.raises(StemlmError, match="fact_fraction must lie in"):
        TrainConfig(fact_fraction=1.0)


def test_trainer_mixes_facts_into_the_embedded_corpus_only(monkeypatch, tmp_path):
    import stemlm.data.sources as sources

    tok = get_tokenizer("default")
    texts = (["Call me Ishmael. " * 3000] * 3, ["Some years ago. " * 100])
    monkeypatch.setattr(sources, "load_corpus", lambda data=None: texts)  # stands in for the embedded corpus
    plain_train, plain_held = data_mod.load_datasets(TrainConfig(fact_fraction=0.0), tok)
    mixed_train, mixed_held = data_mod.load_datasets(TrainConfig(fact_fraction=0.2), tok)
    assert abs((mixed_train.num_tokens - plain_train.num_tokens) / mixed_train.num_tokens - 0.2) < 0.02
    assert np.array_equal(np.asarray(mixed_held.tokens), np.asarray(plain_held.tokens))  # held-out is text only
    # the default layout: the fact documents follow the corpus's tokens, and batches draw 20% of rows from them
    assert mixed_train.strata == (plain_train.num_tokens, 0.2) and plain_train.strata is None
    assert np.array_equal(np.asarray(mixed_train.tokens[: plain_train.num_tokens]), np.asarray(plain_train.tokens))
    lines, _ = data_mod.load_datasets(TrainConfig(fact_fraction=0.2, fact_layout="lines"), tok)
    assert lines.strata is None and lines.num_tokens == pytest.approx(mixed_train.num_tokens, rel=0.02)
    (tmp_path / "notes.txt").write_text("Some text of the user's own. " * 200)
    user = TrainConfig(fact_fraction=0.2, data=[str(tmp_path)])
    user_train, _ = data_mod.load_datasets(user, tok)
    assert user_train.num_tokens == plain_train.num_tokens  # --data is never mixed


def test_train_command_reports_fact_recall(monkeypatch, tmp_path, capsys):
    import json

    import stemlm.data.sources as sources
    from stemlm.cli.main import main

    texts = (["Call me Ishmael. " * 3000] * 3, ["Some years ago. " * 200])
    monkeypatch.setattr(sources, "load_corpus", lambda data=None: texts)  # stands in for the embedded corpus
    model = ["model.hidden_size=32", "model.num_hidden_layers=2", "model.intermediate_size=64"]
    argv = ["train", "--steps", "2", "--seq-len", "32", "--batch-size", "2", "--out", str(tmp_path / "run")]
    assert main([*argv, "--set", *model, "--sample-tokens", "0", "--no-progress", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    facts = report["facts"]
    assert facts["countries"] == list(FACT_COUNTRIES) and facts["relations"] == ["capital"]
    prompts = len(fact_prompts("train", ("capital",), region=FACT_COUNTRIES))
    assert prompts == 4 * len(FACT_COUNTRIES)
    assert facts["train_templates"]["prompts"] == prompts and 0 <= facts["train_templates"]["recall"] <= 1
    assert report["heldout_eval"]["window"] == 32 and report["run_dir_bytes"] > 0
    run_config = json.loads((tmp_path / "run" / "run_config.json").read_text())
    assert run_config["train"]["fact_fraction"] == TrainConfig().fact_fraction
    # `stemlm eval edits --countries auto` reads them back from the checkpoint
    assert trained_fact_countries(tmp_path / "run") == list(FACT_COUNTRIES)


def test_tokenizer_texts_hold_the_share_of_characters_and_no_held_out_phrasing():
    from stemlm.data.fact_mix import tokenizer_texts

    texts = tokenizer_texts(CORPUS, 0.5, list(FACT_COUNTRIES), ["capital"], 0)
    assert texts[: len(CORPUS)] == CORPUS
    facts = fact_lines(texts[len(CORPUS) :])
    share = sum(len(line) + 1 for line in facts) / sum(len(t) + 1 for t in texts)
    assert abs(share - 0.5) < 0.01
    trained = {p.prompt + p.answer + "." for p in fact_prompts("train", ("capital",), FACT_COUNTRIES, mix=True)}
    assert set(facts) == trained  # every training phrasing; held-out ones ("The seat of government of") never
    assert not any(t.split("{s}")[0] in line for t in TEMPLATES["capital"][1] for line in facts)
