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
    assert report["nearest"]["query"] == " France" and "dense" in report["spread"]["baseline"]
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


def test_analyze_progress_steps_per_analysis_unless_no_progress(ckpts, tty_stderr, tmp_path):
    stem, _, text = ckpts
    argv = ["analyze", stem, "--text", text, "--only", "nearest,activated", "--json"]
    assert main([*argv, "--out", str(tmp_path / "a")]) == 0
    shown = tty_stderr.readouterr().err.strip().split("\r")
    assert any("analyze:  50%" in line and "1/2" in line and "activated" in line for line in shown), shown
    assert "2/2" in shown[-1] and shown[-1].startswith("analyze: 100%")
    assert main([*argv, "--out", str(tmp_path / "b"), "--no-progress"]) == 0
    assert tty_stderr.readouterr().err == ""
    assert (
        json.loads((tmp_path / "a" / "analysis.json").read_text())["activated"]
        == json.loads((tmp_path / "b" / "analysis.json").read_text())["activated"]
    )


def test_analyze_bad_dense_fails_before_the_progress_bar(ckpts, capsys, tmp_path):
    stem, _, text = ckpts
    assert main(["analyze", stem, "--text", text, "--dense", str(tmp_path / "nope"), "--out", str(tmp_path / "o")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "does not exist" in lines[0], lines
