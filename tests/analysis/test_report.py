"""The analyses as a library (stemlm.analysis.report), without the CLI: the chosen set follows the model, one
call writes every PNG and analysis.json, and the text names each analysis."""

from __future__ import annotations

import json

import pytest

from stemlm.analysis.report import AnalysisOptions, chosen_analyses, default_token, render_analysis, run_analyses
from stemlm.data.tokenizer import default_tokenizer
from stemlm.errors import StemlmError

from .conftest import TEXT


def test_chosen_analyses_follow_the_model(analysis_model):
    assert chosen_analyses(AnalysisOptions("x"), analysis_model()) == ["spread", "attribution", "nearest", "activated"]
    assert chosen_analyses(AnalysisOptions("x"), analysis_model("dense")) == ["nearest", "activated"]
    with pytest.raises(StemlmError, match="spread need a STEM checkpoint"):
        chosen_analyses(AnalysisOptions("x", only="spread"), analysis_model("dense"))
    with pytest.raises(StemlmError, match="unknown analysis 'bogus'"):
        chosen_analyses(AnalysisOptions("x", only="nearest,bogus"), analysis_model())


def test_run_analyses_writes_every_png_and_the_json(analysis_model, small_tokenizer, tmp_path):
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    model, options = analysis_model(), AnalysisOptions("ckpt", text=str(text), top_k=3)
    names = chosen_analyses(options, model)
    prompt_ids = small_tokenizer.encode(options.prompt).ids
    report = run_analyses(options, model, small_tokenizer, names, prompt_ids, tmp_path, tmp_path / "final")
    assert set(report["pngs"]) == set(names) and all((tmp_path / f"{n}.png").is_file() for n in names)
    written = json.loads((tmp_path / "analysis.json").read_text())
    assert written["pngs"]["nearest"] == str(tmp_path / "final" / "nearest.png")
    lines = render_analysis(report).splitlines()
    assert lines[0] == f"prompt: {options.prompt!r}" and any(line.startswith("nearest tokens to") for line in lines)


def test_the_default_query_is_a_whole_name_then_a_whole_word_then_a_name_never_a_trailing_sub_word():
    tok = default_tokenizer()  # " France", " city" are one token; " capital" is " cap" + "ital", " Spain" " Sp" + "ain"
    prompts = ("The city of France is", "The capital city of Spain is", "The capital of Spain is", "I saw Kyrgyzstan")
    picks = [default_token(tok, tok.encode(p).ids) for p in prompts]
    assert picks == [" France", " city", " Sp", " K"]
