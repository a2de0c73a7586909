"""The embedded default corpus (Shakespeare's works and Jane Austen's novels) and the train / held-out split.

The corpus ships inside the package as `assets/corpus/corpus.jsonl.xz`, one JSON record per document
{"name", "source", "text"}, sorted by name; `scripts/build_corpus.py` rebuilds it byte for byte and
`assets/corpus/README.md` records provenance and licences. Splits are by whole document and depend only
on document names and a seed (never on file order), so every tool that splits the same documents with
the same settings agrees on which are held out.
"""

from __future__ import annotations

import hashlib
import json
import lzma
from collections import defaultdict
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

from stemlm.errors import StemlmError

CORPUS_ASSET = "corpus.jsonl.xz"
DEFAULT_HELDOUT_FRACTION = 0.1
DEFAULT_SEED = 0


@dataclass(frozen=True)
class Document:
    """One document: a stable `name` (used for splitting), its `source` group and the full `text`."""

    name: str
    source: str
    text: str


@lru_cache(maxsize=1)
def _embedded_records() -> tuple[Document, ...]:
    asset = resources.files("stemlm") / "assets" / "corpus" / CORPUS_ASSET
    try:
        raw = lzma.decompress(asset.read_bytes())
    except (FileNotFoundError, lzma.LZMAError) as exc:
        raise StemlmError(
            f"embedded corpus asset {CORPUS_ASSET} is missing or corrupt ({exc}); "
            "reinstall stemlm or rebuild it with `python scripts/build_corpus.py`"
        ) from exc
    return tuple(Document(**json.loads(line)) for line in raw.decode("utf-8").splitlines())


def load_embedded_corpus() -> list[Document]:
    """All documents of the embedded corpus, sorted by name (decompressed once per process)."""
    return list(_embedded_records())


def _name_hash(name: str, seed: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}\0{name}".encode()).digest()[:8], "big")


def split_documents(
    docs: list[Document], heldout_fraction: float = DEFAULT_HELDOUT_FRACTION, seed: int = DEFAULT_SEED
) -> tuple[list[Document], list[Document]]:
    """Split documents into (train, held-out) by name hash, separately within each `source`.

    Inside a source with n >= 2 documents, the round(heldout_fraction * n) documents with the smallest
    hash of (seed, name) are held out, at least one and never all of them; a source with a single
    document stays in train. Stratifying by source is what guarantees the default split holds out some
    Austen as well as some Shakespeare. Both lists keep the input order.
    """
    if not 0.0 <= heldout_fraction < 1.0:
        raise StemlmError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
    by_source: dict[str, list[Document]] = defaultdict(list)
    for doc in docs:
        by_source[doc.source].append(doc)
    heldout_names: set[str] = set()
    for group in by_source.values():
        if heldout_fraction == 0.0 or len(group) < 2:
            continue
        count = min(max(1, round(heldout_fraction * len(group))), len(group) - 1)
        ranked = sorted(group, key=lambda d: (_name_hash(d.name, seed), d.name))
        heldout_names.update(d.name for d in ranked[:count])
    train = [d for d in docs if d.name not in heldout_names]
    heldout = [d for d in docs if d.name in heldout_names]
    return train, heldout


def embedded_texts(
    split: str = "train", heldout_fraction: float = DEFAULT_HELDOUT_FRACTION, seed: int = DEFAULT_SEED
) -> list[str]:
    """The texts of one split ("train", "heldout" or "all") of the embedded corpus."""
    docs = load_embedded_corpus()
    if split == "all":
        return [d.text for d in docs]
    train, heldout = split_documents(docs, heldout_fraction, seed)
    if split == "train":
        return [d.text for d in train]
    if split == "heldout":
        return [d.text for d in heldout]
    raise StemlmError(f"unknown split {split!r}; choose 'train', 'heldout' or 'all'")
