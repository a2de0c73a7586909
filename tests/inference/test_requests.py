"""`stemlm.inference.requests.IncrementalDecoder` decodes a short window a token, yet its pieces always join to the
full decode: for the byte-level BPE tokenizer and for a word-start-marker (SentencePiece-style) one, whose decode of
a window alone drops the window's first space."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from stemlm.data.tokenizer import default_tokenizer
from stemlm.inference.requests import IncrementalDecoder


def pieces(tokenizer, ids: list[int]) -> list[str]:
    decoder = IncrementalDecoder(tokenizer)
    return [decoder.push(i) for i in ids] + [decoder.flush()]


def test_the_pieces_join_to_the_full_decode_of_a_long_text():
    tok = default_tokenizer()
    ids = tok.encode("The capital of Spain is Madrid; ñandú 🙂 日本. " * 30).ids
    assert "".join(pieces(tok, ids)) == tok.decode(ids)


def test_a_word_start_marker_tokenizer_keeps_its_spaces():
    words = ["▁The", "▁capital", "▁of", "▁Spain", "▁is", "▁Mad", "rid", "."]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="."))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    ids = [0, 1, 2, 3, 4, 5, 6, 7, 1, 2]
    out = pieces(tok, ids)
    assert "".join(out) == tok.decode(ids) == "The capital of Spain is Madrid. capital of"
    assert out[1] == " capital"  # a window's decode alone would drop that space
