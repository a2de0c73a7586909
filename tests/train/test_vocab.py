"""The requested model is what trains: a preset or explicit vocab_size is never resized silently (`--fit-vocab`
asks for it), and the document separator can be any special token of the tokenizer (`--separator`).

Run: `OMP_NUM_THREADS=1 python -m pytest tests/train/test_vocab.py -q`.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from stemlm.data import TokenDataset, train_bpe
from stemlm.data.tokenizer import separator_id
from stemlm.errors import StemlmError
from stemlm.model.presets import get_preset
from stemlm.train.config import check_vocab
from tests.train.test_cli import MODEL, one_line_error, run_cli

TEXTS = ["the cat sat on the mat. " * 20, "a dog ran in the park. " * 20, "birds sing at dawn. " * 20]


@pytest.fixture(scope="module")
def tok():
    tok = train_bpe(TEXTS, vocab_size=300)
    assert 256 < tok.get_vocab_size() <= 320  # fitted vocab_size 320
    return tok


def test_named_preset_is_not_resized(tok):
    with pytest.raises(StemlmError) as err:
        check_vocab(get_preset("paper-1b"), tok, requested="preset paper-1b", vocab_set=False, fit=False)
    message = str(err.value)
    assert "preset paper-1b has vocab_size 128256" in message and "--fit-vocab" in message
    assert f"tokenizer has {tok.get_vocab_size()} tokens" in message


def test_fit_and_explicit_sizes(tok):
    preset = get_preset("tiny")
    assert check_vocab(preset, tok, requested="preset tiny", vocab_set=False, fit=True).vocab_size == 320
    exact = preset.replace(vocab_size=320)
    assert check_vocab(exact, tok, requested="preset tiny", vocab_set=False, fit=False) is exact
    padded = preset.replace(vocab_size=512)  # an explicit size that holds every id is kept as asked
    assert check_vocab(padded, tok, requested="model.vocab_size", vocab_set=True, fit=False).vocab_size == 512
    with pytest.raises(StemlmError, match=f"vocab_size 256 but the tokenizer has {tok.get_vocab_size()} tokens"):
        check_vocab(preset.replace(vocab_size=256), tok, requested="model.vocab_size", vocab_set=True, fit=False)


def _args(train_assets, tmp_path, *extra):
    return [
        "train", "--data", str(train_assets["data"]), "--tokenizer", str(train_assets["tokenizer"]),
        "--steps", "1", "--seq-len", "32", "--batch-size", "2", "--eval-batches", "1", "--threads", "1",
        "--no-progress", "--sample-tokens", "0", "--out", str(tmp_path / "run"), "--set", *MODEL, *extra,
    ]  # fmt: skip


def test_cli_preset_mismatch_is_an_error_unless_fit(tmp_path, train_assets, capsys):
    one_line_error(
        *run_cli(_args(train_assets, tmp_path, "--preset", "tiny"), capsys),
        "preset tiny has vocab_size 8192 but the tokenizer has 320 tokens",
    )
    assert not (tmp_path / "run").exists()
    code, _, err = run_cli(_args(train_assets, tmp_path, "--preset", "tiny", "--fit-vocab"), capsys)
    assert code == 0, err
    assert json.loads((tmp_path / "run" / "run_config.json").read_text())["model"]["vocab_size"] == 320


def test_custom_separator(tmp_path):
    llama_like = train_bpe(TEXTS, vocab_size=300, special_tokens=("<|begin_of_text|>", "<|end_of_text|>"))
    with pytest.raises(StemlmError, match=r"no <\|endoftext\|> token.*--separator.*<\|end_of_text\|>"):
        TokenDataset.from_texts(TEXTS, llama_like, cache_dir=tmp_path)
    data = TokenDataset.from_texts(TEXTS, llama_like, cache_dir=tmp_path, separator="<|end_of_text|>")
    sep = separator_id(llama_like, "<|end_of_text|>")
    expected = [i for text in TEXTS for i in [*llama_like.encode(text).ids, sep]]
    assert sep == 1 and np.array_equal(np.asarray(data.tokens), expected)


def test_cli_unknown_separator(tmp_path, train_assets, capsys):
    one_line_error(*run_cli(_args(train_assets, tmp_path, "--separator", "<|eot_id|>"), capsys), "no <|eot_id|> token")
