"""`write_small_corpus(root)`: six ~12k-character documents of the embedded corpus plus a 320-token BPE.

Shared by the trainer and distributed-trainer fixtures, so both train on the same small user corpus.
"""

from __future__ import annotations

from pathlib import Path

from stemlm.data import load_embedded_corpus, save_tokenizer, train_bpe

TOKENIZER_VOCAB = 320
DOC_CHARS = 12_000


# the 2-layer, hidden-64 model the trainer tests train on this corpus (tests/train/conftest.py, parallel/conftest.py)
SMALL_MODEL = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    ffn_layers="odd",
)


def write_small_corpus(root: Path) -> dict[str, Path]:
    """Write the documents under root/data and the tokenizer under root/tok; token shards go to root/cache."""
    data = root / "data"
    data.mkdir()
    docs = load_embedded_corpus()
    # Documents spread over the corpus (both sources); their first characters are often front matter, so skip it.
    picked = [docs[i] for i in range(0, len(docs), max(1, len(docs) // 6))][:6]
    texts = [d.text[5_000 : 5_000 + DOC_CHARS] for d in picked]
    for i, text in enumerate(texts):
        (data / f"doc{i}.txt").write_text(text)
    tokenizer = save_tokenizer(train_bpe(texts, vocab_size=TOKENIZER_VOCAB), root / "tok")
    return {"data": data, "tokenizer": tokenizer, "cache": root / "cache"}
