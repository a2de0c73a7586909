"""The biography experiment: scoring against independent forwards, and a tiny end-to-end run through the CLI."""

from __future__ import annotations

import json
import math

import pytest
import torch

from stemlm.cli.main import main
from stemlm.data import train_bpe
from stemlm.data.worlds import bio
from stemlm.edit.positional import greedy_generate
from stemlm.experiments.bio import exact_match, knowledge_bits
from stemlm.model import build_model

TINY = [
    "--set",
    "hidden_size=32",
    "--set",
    "intermediate_size=64",
    "--set",
    "num_hidden_layers=2",
    "--set",
    "num_attention_heads=2",
    "--set",
    "vocab_size=400",
    "--set",
    "seq_len=32",
    "--set",
    "batch_size=2",
    "--set",
    "dense_steps=2",
    "--set",
    "people=8",
    "--set",
    "bios_per_person=1",
    "--set",
    "corpus_chars=2000",
]


@pytest.fixture(scope="module")
def world():
    people = bio.make_people(6, seed=0)
    docs = bio.world_documents(people, people[:3], bios_per_person=3, qa_repeats=1, seed=0)
    return people, train_bpe(docs, vocab_size=400)


def test_scores_match_independent_forwards(world, tiny_config):
    people, tok = world
    model = build_model(tiny_config("stem", vocab_size=400), seed=1).eval()
    bits = knowledge_bits(model, tok, people)
    prompts = bio.bio_prompts(people, templates_per_attribute=1)
    for a in bio.ATTRIBUTES:
        loss = 0.0
        for p in (p for p in prompts if p.relation == a):
            ids, answer = tok.encode(p.prompt).ids, tok.encode(p.answer).ids
            with torch.no_grad():
                logp = model(torch.tensor([ids + answer])).logits[0].log_softmax(-1)
            loss -= sum(float(logp[len(ids) - 1 + k, t]) for k, t in enumerate(answer))
        assert bits[a] == pytest.approx(max(0.0, len(people) * bio.attribute_bits(a) - loss / math.log(2)), abs=1e-3)
    qa = bio.qa_prompts(people[:2])
    got = exact_match(model, tok, qa)
    hits = []
    for p in qa:
        answer = tok.encode(p.answer).ids
        hits.append(greedy_generate(model, tok.encode(p.prompt).ids, len(answer)) == answer)
    assert got["n"] == len(qa) and got["acc"] == pytest.approx(sum(hits) / len(hits))


def test_bio_cli_two_seeds_json(tmp_path, capsys):
    out = tmp_path / "bio"
    assert main(["experiment", "bio", "--seeds", "2", "--serial", "--out", str(out), "--json", *TINY]) == 0
    result = json.loads(capsys.readouterr().out)
    assert len(result["per_seed"]) == 2 and [s["seed"] for s in result["per_seed"]] == [0, 1]
    for kind in ("dense", "stem"):
        seeds = [s[kind]["extraction"]["acc"] for s in result["per_seed"]]
        entry = result["summary"][kind]["extraction"]["acc"]
        assert entry["mean"] == pytest.approx(sum(seeds) / 2) and len(entry["ci95"]) == 2
        assert 0.0 <= result["summary"][kind]["memorisation"]["acc"]["mean"] <= 1.0
    assert result["summary"]["chance"]["mean"]["n"] == 2
    assert result["per_seed"][0]["stem"]["steps"] >= result["per_seed"][0]["dense"]["steps"]  # matched FLOPs
    assert json.loads((out / "results.json").read_text()) == result
    md = (out / "results.md").read_text()
    assert "**extraction**" in md and "chance" in md
    # A rerun with the same settings reuses both seeds (no training: identical per-seed results).
    assert main(["experiment", "bio", "--seeds", "2", "--out", str(out), "--json", *TINY]) == 0
    assert json.loads(capsys.readouterr().out)["per_seed"] == result["per_seed"]
    assert main(["experiment", "bio", "--out", str(out), *TINY, "--set", "people=10"]) == 2  # never overwrites
    assert "other settings" in capsys.readouterr().err
    assert main(["experiment", "bio", "--set", "people=x", "--out", str(tmp_path / "b")]) == 2
    assert "expects an integer" in capsys.readouterr().err
