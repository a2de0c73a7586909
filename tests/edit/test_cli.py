"""`stemlm edit` and `stemlm eval edits` end to end on tiny checkpoints, including the one-line errors."""

from __future__ import annotations

import json

import pytest
import torch

from stemlm.checkpoint.folder import save_pretrained
from stemlm.checkpoint.runs import from_pretrained
from stemlm.cli.main import main

PROMPT = "Country: Spain. Capital:"


@pytest.fixture
def checkpoints(edit_model, fact_tokenizer, tmp_path):
    stem, dense = tmp_path / "stem", tmp_path / "dense"
    save_pretrained(edit_model(), stem, tokenizer=fact_tokenizer)
    save_pretrained(edit_model("dense"), dense, tokenizer=fact_tokenizer)
    return str(stem), str(dense)


def _json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_positional_edit_json(checkpoints, capsys):
    stem, _ = checkpoints
    out = _json(
        capsys,
        [
            "edit",
            stem,
            "--prompt",
            PROMPT,
            "--source",
            "Spain",
            "--target",
            "Germany",
            "--json",
            "--top-k",
            "3",
            "--max-new-tokens",
            "4",
        ],
    )
    assert out["mode"] == "positional" and out["layers"] == [1, 2] and len(out["positions"]) == 1
    for view in (out["before"], out["after"]):
        assert len(view["top_k"]) == 3 and all(0 <= t["prob"] <= 1 for t in view["top_k"])
    assert out["before"]["top_k"] != out["after"]["top_k"]


def test_text_output_shows_before_and_after(checkpoints, capsys):
    stem, _ = checkpoints
    assert main(["edit", stem, "--prompt", PROMPT, "--source", "Spain", "--target", "Germany"]) == 0
    out = capsys.readouterr().out
    assert "before:" in out and "after:" in out and "positional edit" in out


def test_global_edit_saved(checkpoints, capsys, tmp_path, fact_tokenizer):
    stem, _ = checkpoints
    out_dir = tmp_path / "edited"
    argv = ["edit", stem, "--source", "Spain", "--target", "Germany", "--save", str(out_dir)]
    # " Spain" is one token here, but the fact world's " Port of Spain" contains it: refused, nothing written.
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'ĠSpain' also in" in err and "Port of Spain" in err
    assert "--allow-shared-subwords" in err and not out_dir.exists()
    out = _json(capsys, [*argv, "--allow-shared-subwords", "--json"])
    assert out["mode"] == "global" and out["saved"] == str(out_dir) and out["before"] is None
    (changed,) = out["edit"]["changed_tokens"]
    assert changed["token"] == "ĠSpain" and "Port of Spain" in changed["shared_with"]
    original, edited = from_pretrained(stem), from_pretrained(out_dir)
    (s,), (g,) = fact_tokenizer.encode(" Spain").ids, fact_tokenizer.encode(" Germany").ids
    for layer in (1, 2):
        assert torch.equal(edited.token_tables()[layer].weight[s], original.token_tables()[layer].weight[g])
    saved = json.loads((out_dir / "edits.json").read_text())["edits"][0]
    assert saved["source"] == "Spain" and saved["changed_tokens"] == out["edit"]["changed_tokens"]


def test_global_edit_text_lists_changed_tokens(checkpoints, capsys, tmp_path):
    stem, _ = checkpoints
    argv = ["edit", stem, "--source", "Spain", "--target", "Germany", "--save", str(tmp_path / "e")]
    assert main([*argv, "--allow-shared-subwords", "--prompt", PROMPT]) == 0
    out = capsys.readouterr().out
    assert "rows changed: 'ĠSpain'" in out and "Port of Spain" in out


def test_inject_saved_with_new_token(checkpoints, capsys, tmp_path):
    stem, _ = checkpoints
    out_dir = tmp_path / "injected"
    out = _json(
        capsys,
        [
            "edit",
            stem,
            "--inject",
            "Zorbia",
            "--target",
            "Chile",
            "--save",
            str(out_dir),
            "--prompt",
            "Country: Zorbia. Capital:",
            "--json",
        ],
    )
    assert out["mode"] == "inject" and out["edit"]["added_to_tokenizer"] and out["edit"]["rows"] == "both"
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(out_dir / "tokenizer.json"))
    assert out["edit"]["token_id"] in tok.encode("Country: Zorbia.").ids


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--prompt", PROMPT, "--source", "France", "--target", "Germany"], "does not occur in the prompt"),
        (["--prompt", PROMPT, "--source", "Spain", "--target", " "], "empty entity name"),
        (["--prompt", PROMPT, "--source", "Spain", "--target", "Germany", "--layers", "0"], "not a STEM layer"),
        (["--source", "Spain", "--target", "Germany"], "needs --prompt"),
        (["--prompt", PROMPT, "--target", "Germany"], "pass --source"),
        (["--prompt", PROMPT, "--source", "Spain", "--target", "Germany", "--top-k", "0"], "--top-k must be"),
    ],
)
def test_bad_input_is_one_line_error(checkpoints, capsys, extra, message):
    stem, _ = checkpoints
    assert main(["edit", stem, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and err.startswith("stemlm edit: error:")


def test_dense_checkpoint_is_refused_but_embedding_control_runs(checkpoints, capsys):
    _, dense = checkpoints
    assert main(["edit", dense, "--prompt", PROMPT, "--source", "Spain", "--target", "Germany"]) == 2
    assert "no STEM tables" in capsys.readouterr().err
    out = _json(
        capsys,
        ["edit", dense, "--prompt", PROMPT, "--source", "Spain", "--target", "Germany", "--rows", "embed", "--json"],
    )
    assert out["rows"] == "embed"


def test_eval_edits_json_with_dense_control(checkpoints, capsys, tmp_path):
    stem, dense = checkpoints
    out = _json(
        capsys,
        [
            "eval",
            "edits",
            stem,
            "--records",
            "2",
            "--fluency-tokens",
            "0",
            "--dense",
            dense,
            "--out",
            str(tmp_path / "r.json"),
            "--json",
        ],
    )
    assert set(out["variants"]) == {"tables", "embed", "both", "dense-embed"}
    for summary in out["variants"].values():
        train = summary["all_records"]["train"]["new_greedy"]
        assert summary["records"] == 2 and 0 <= summary["known"] <= 2 and 0.0 <= train["edited"] <= 1.0
        assert {"heldout", "locality_other", "locality_same"} <= set(summary["all_records"])
    assert json.loads((tmp_path / "r.json").read_text()) == out
    again = ["eval", "edits", stem, "--records", "1", "--fluency-tokens", "0", "--out", str(tmp_path / "r.json")]
    assert main([*again, "--force"]) == 0  # --force replaces an earlier result
    assert json.loads((tmp_path / "r.json").read_text())["variants"]["tables"]["records"] == 1


def test_eval_edits_table_and_errors(checkpoints, capsys):
    stem, dense = checkpoints
    assert main(["eval", "edits", dense, "--records", "1", "--fluency-tokens", "0"]) == 0
    table = capsys.readouterr().out
    assert table.startswith("| variant | known / records |") and "| embed | " in table
    assert "Cells: edited (unedited)" in table and "- known:" in table
    assert main(["eval", "edits", stem, "--relation", "moons"]) == 2
    assert "unknown relation" in capsys.readouterr().err
    assert main(["eval", "edits", dense, "--variants", "stem", "--records", "1"]) == 2
    assert "no STEM tables" in capsys.readouterr().err


def test_eval_edits_over_several_checkpoints_and_chosen_countries(
    checkpoints, edit_model, fact_tokenizer, tmp_path, capsys
):
    stem, _ = checkpoints
    other = tmp_path / "stem-seed1"
    save_pretrained(edit_model(seed=1), other, tokenizer=fact_tokenizer)
    argv = ["eval", "edits", stem, str(other), "--countries", "Spain,Germany,France", "--fluency-tokens", "0"]
    out = _json(capsys, [*argv, "--json"])
    assert [r["checkpoint"] for r in out["checkpoints"]] == [stem, str(other)]
    for one in out["checkpoints"]:
        assert one["countries"] == ["Spain", "Germany", "France"]
        assert all(v["records"] == 3 for v in one["variants"].values())
    for variant, summary in out["paraphrase_moved"].items():
        rates = [r["variants"][variant]["paraphrase_moved"]["rate"] for r in out["checkpoints"]]
        assert summary["rates"] == [r for r in rates if r is not None] and summary["n"] == len(summary["rates"])
        assert all(x is None or 0.0 <= x <= 1.0 for x in summary["ci95"])  # a rate's interval stays in [0, 1]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert f"{stem}:" in text and "paraphrases moved" in text
    assert main(["eval", "edits", stem, "--countries", "Spain,Atlantis"]) == 2
    assert "unknown country 'Atlantis'" in capsys.readouterr().err
