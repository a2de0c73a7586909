"""One edit through the library (stemlm.edit.session), as `stemlm edit` makes it: a positional edit changes the
view after and not before, the global one refuses shared sub-words unless allowed, and the text lists both sides."""

from __future__ import annotations

import pytest

from stemlm.cli.main import build_parser
from stemlm.edit.evaluate import edit_variants
from stemlm.edit.positional import rows_to_parts
from stemlm.edit.session import EditOptions, parse_layers, render_edit, run_edit
from stemlm.errors import StemlmError

PROMPT = "The capital of Spain is"


def test_positional_edit_report(edit_model, fact_tokenizer):
    model = edit_model()
    options = EditOptions("Germany", source="Spain", prompt=PROMPT, max_new_tokens=3, top_k=2)
    report = run_edit(model, fact_tokenizer, options)
    assert (report["mode"], report["rows"], report["pad"]) == ("positional", "tables", "eot")
    assert report["positions"] and len(report["before"]["top_k"]) == 2
    other = EditOptions("France", source="Spain", prompt=PROMPT, max_new_tokens=3, top_k=2)
    plain = run_edit(model, fact_tokenizer, other)
    assert plain["before"] == report["before"]  # the unedited view does not depend on the edit
    lines = render_edit(report).splitlines()
    assert lines[0] == "positional edit: 'Spain' -> rows of 'Germany' (tables, auto)"
    assert lines[1].startswith("before: The capital of Spain is") and lines[3].startswith(" after: ")


def test_inject_without_a_prompt_has_no_views(edit_model, fact_tokenizer):
    report = run_edit(edit_model(), fact_tokenizer, EditOptions("France", inject="Zorbia"))
    assert (report["mode"], report["rows"], report["before"], report["after"]) == ("inject", "both", None, None)


def test_layers_and_variants(edit_model):
    model = edit_model()
    assert parse_layers(None, model) is None and parse_layers("all", model) is None
    assert parse_layers("0,2", model) == [0, 2]
    assert edit_variants("auto", model) == ["tables", "embed", "both"]
    assert edit_variants("auto", edit_model("dense")) == ["embed"]
    with pytest.raises(StemlmError, match="unknown variant 'rows'"):
        edit_variants("stem,rows", model)


def test_variants_share_the_unedited_scores(edit_model, fact_tokenizer):
    from stemlm.data.worlds.facts import edit_records
    from stemlm.edit.evaluate import evaluate_edits, evaluate_variants

    model, records, logged = edit_model(), edit_records("capital", 3, seed=0), []
    settings = dict(fluency_tokens=0)
    results = evaluate_variants(model, fact_tokenizer, records, ["tables", "embed"], log=logged.append, **settings)
    assert list(results) == ["tables", "embed"] and len(logged) == 2
    assert results["embed"] == evaluate_edits(model, fact_tokenizer, records, rows="embed", **settings)


@pytest.mark.parametrize(
    "options, message",
    [
        (EditOptions("Germany"), "pass --source ENTITY"),
        (EditOptions("Germany", source="Spain", inject="Zorbia"), "exclusive"),
        (EditOptions("Germany", source="Spain", prompt="x", top_k=0), "--top-k must be >= 1"),
        (EditOptions("Germany", source="Spain"), "a positional edit needs --prompt"),
    ],
)
def test_requests_that_cannot_be_made_are_refused_before_loading(options, message):
    with pytest.raises(StemlmError, match=message):
        options.checked()


def test_checkpoint_edits_with_a_dense_control(edit_model, fact_tokenizer, tmp_path):
    from stemlm.checkpoint.folder import save_pretrained
    from stemlm.edit.evaluate import evaluate_checkpoint_edits

    save_pretrained(edit_model(), tmp_path / "stem", tokenizer=fact_tokenizer)
    save_pretrained(edit_model("dense"), tmp_path / "dense", tokenizer=fact_tokenizer)
    quiet = dict(log=lambda message: None, fluency_tokens=0)
    stem, dense = str(tmp_path / "stem"), str(tmp_path / "dense")
    results = evaluate_checkpoint_edits(stem, "capital", 2, seed=0, variants="tables", dense=dense, **quiet)
    assert (results["relation"], results["seed"], list(results["variants"])) == (
        "capital",
        0,
        ["tables", "dense-embed"],
    )
    with pytest.raises(StemlmError, match="--fluency-records must be >= 0"):
        evaluate_checkpoint_edits(str(tmp_path / "stem"), "capital", 2, seed=0, fluency_records=-1)


def test_rows_stem_is_the_old_name_of_tables(tiny_model):
    assert rows_to_parts("stem") == rows_to_parts("tables") == (True, False)
    assert edit_variants("stem,embed", tiny_model()) == ["tables", "embed"]
    args = build_parser().parse_args(
        ["edit", "ckpt", "--prompt", "p", "--source", "a", "--target", "b", "--rows", "stem"]
    )
    assert args.rows == "tables"
    with pytest.raises(StemlmError, match="unknown row kind 'bogus'"):
        rows_to_parts("bogus")
