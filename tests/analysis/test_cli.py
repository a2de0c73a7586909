"""`stemlm analyze` end to end on tiny checkpoints: JSON, PNGs, dense handling, one-line errors."""

from __future__ import annotations

import json

import pytest

from stemlm.checkpoint.folder import save_pretrained
from stemlm.cli.main import main

from .conftest import TEXT


@pytest.fixture
def ckpts(analysis_model, small_tokenizer, tmp_path):
    stem, dense = tmp_path / "stem", tmp_path / "dense"
    save_pretrained(analysis_model(), stem, tokenizer=small_tokenizer)
    save_pretrained(analysis_model("dense"), dense, tokenizer=small_tokenizer)
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    return str(stem), str(dense), str(text)


def test_analyze_all_json_and_pngs(ckpts, capsys, tmp_path):
    stem, dense, text = ckpts
    out = tmp_path / "out"
    argv = ["analyze", stem, "--dense", dense, "--text", text, "--out", str(out), "--json", "--top-k", "3"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["pngs"]) == {"spread", "attribution", "nearest", "activated"}
    for png in report["pngs"].values():
        assert (out / png.split("/")[-1]).stat().st_size > 1000
    assert report["nearest"]["query"] == " capital" and "dense" in report["spread"]["baseline"]
    assert json.loads((out / "analysis.json").read_text()) == report


def test_analyze_dense_skips_stem_only(ckpts, capsys, tmp_path):
    _, dense, text = ckpts
    assert main(["analyze", dense, "--text", text, "--out", str(tmp_path / "d"), "--token", "France"]) == 0
    out = capsys.readouterr().out
    assert "nearest tokens to ' France'" in out and "angular spread" not in out
    assert main(["analyze", dense, "--only", "spread", "--out", str(tmp_path / "d2")]) == 2
    assert "need a STEM checkpoint" in capsys.readouterr().err
    assert main(["analyze", dense, "--only", "moons", "--out", str(tmp_path / "d2")]) == 2
    assert "unknown analysis" in capsys.readouterr().err
