"""`stemlm eval lm|niah` take the table flags of every checkpoint command (`stemlm.inference.load`): host / mmap
tables and compact rows give the results of resident tables holding the same (rounded) rows."""

from __future__ import annotations

import json

from stemlm.cli.main import main


def _json(capsys, argv) -> dict:
    assert main([str(a) for a in argv]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


def test_niah_and_lm_with_offloaded_compact_tables(tiny_ckpt, tmp_path, capsys):
    int8 = tmp_path / "int8"
    assert main(["convert", str(tiny_ckpt), "--table-dtype", "int8", "--out", str(int8)]) == 0
    niah = ["eval", "niah", "--lengths", "80", "--depths", "0,1", "--samples", "1", "--digits", "3", "--json"]
    rounded = _json(capsys, [*niah[:2], tiny_ckpt, *niah[2:], "--table-dtype", "int8", "--out", tmp_path / "a"])
    mapped = _json(capsys, [*niah[:2], int8, *niah[2:], "--tables", "mmap", "--cache-rows", 4, "--out", tmp_path / "b"])
    saved = [json.loads((tmp_path / d / "niah.json").read_text())["outputs"] for d in ("a", "b")]
    assert saved[0] == saved[1] and rounded["accuracy"] == mapped["accuracy"]
    lm = ["eval", "lm", "--tasks", "stemlm_facts_capital", "--limit", "3", "--json"]
    rounded = _json(capsys, [*lm[:2], tiny_ckpt, *lm[2:], "--table-dtype", "int8"])
    host = _json(capsys, [*lm[:2], tiny_ckpt, *lm[2:], "--tables", "host", "--table-dtype", "int8", "--cache-rows", 4])
    assert rounded["results"] == host["results"] and rounded["tasks"] == host["tasks"]
