"""`stemlm generate --compile`: the decoding steps through torch.compile give the ids of the eager, fused run
(slow: a compile takes tens of seconds on a CPU), and offloaded tables are refused in one line.

Run: `python -m pytest tests/cli/test_generate_compile.py -q -m "slow or not slow"`.
"""

from __future__ import annotations

import json

import pytest

from stemlm.checkpoint.folder import save_pretrained
from stemlm.cli.main import main
from tests.bad_input import refuse
from tests.conftest import make_tiny_model


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    folder = tmp_path_factory.mktemp("compile") / "ckpt"
    save_pretrained(make_tiny_model("stem", initializer_range=0.1, max_position_embeddings=40), folder)
    return folder


def ids(capsys, argv) -> list[int]:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)["token_ids"]


@pytest.mark.parametrize("tables", ["host", "mmap"])
def test_compile_with_offloaded_tables_is_refused(ckpt, capsys, tables):
    argv = ["generate", ckpt, "--ids", "5,17,3", "--compile", "--tables", tables]
    refuse(argv, "--compile needs --tables device", capsys, ckpt.parent)


@pytest.mark.slow
def test_compiled_decoding_gives_the_eager_ids(ckpt, capsys):
    argv = ["generate", str(ckpt), "--ids", "5,17,3,99,42", "--greedy", "--max-new-tokens", "12", "--json"]
    assert ids(capsys, [*argv, "--compile"]) == ids(capsys, argv)
