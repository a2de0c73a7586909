"""`stemlm train --recipe official` refuses a kind the official rules do not cover: exit 2, one line, nothing written.

The rule itself, kind by kind, is tests/train/test_recipes.py's; this is the CLI contract (tests/bad_input.py)."""

from __future__ import annotations

import pytest

from tests.bad_input import refuse


@pytest.mark.parametrize(
    ("ffn", "names"), [("moe", "moe's router.weight, experts.gate_proj"), ("value_embed", "value_lambda")]
)
def test_train_refuses_a_kind_without_official_rules(tmp_path, train_assets, capsys, ffn, names):
    argv = ["train", "--recipe", "official", "--ffn", ffn, "--data", train_assets["data"], "--tokenizer"]
    argv += [train_assets["tokenizer"], "--steps", "1", "--out", tmp_path / "run", "--no-progress"]
    line = refuse(argv, "--recipe official has no init or optimizer rule for", capsys, tmp_path)
    assert names in line and line.endswith("use --recipe stemlm")
