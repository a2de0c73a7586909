"""The data layer: the embedded corpus, user data, byte-level BPE tokenizers and cached token shards.

Modules: `corpus` (embedded Shakespeare + Austen corpus, document split), `sources` (user files and
`load_corpus`), `tokenizer` (train/load/save, the shipped default and GPT-2), `shards` (token shards and
`TokenDataset`), `prepare` (`stemlm data prepare`: a corpus into memory-mapped shards), `manifest` (its
schema-checked manifest), `stream` (streaming them to training), `rdata` (the R reader used only to rebuild
the corpus). Names are loaded lazily, so `import stemlm.data` does not pull in tokenizers, numpy or torch:

    from stemlm.data import load_corpus, get_tokenizer, TokenDataset
"""

from stemlm._lazy import lazy_exports

_EXPORTS = {
    "Document": "stemlm.data.corpus",
    "load_embedded_corpus": "stemlm.data.corpus",
    "split_documents": "stemlm.data.corpus",
    "embedded_texts": "stemlm.data.corpus",
    "read_documents": "stemlm.data.sources",
    "read_texts": "stemlm.data.sources",
    "load_corpus": "stemlm.data.sources",
    "train_bpe": "stemlm.data.tokenizer",
    "load_tokenizer": "stemlm.data.tokenizer",
    "save_tokenizer": "stemlm.data.tokenizer",
    "default_tokenizer": "stemlm.data.tokenizer",
    "gpt2_tokenizer": "stemlm.data.tokenizer",
    "get_tokenizer": "stemlm.data.tokenizer",
    "eot_id": "stemlm.data.tokenizer",
    "EOT_TOKEN": "stemlm.data.tokenizer",
    "TokenDataset": "stemlm.data.shards",
    "build_shard": "stemlm.data.shards",
    "prepare": "stemlm.data.prepare",
    "open_prepared": "stemlm.data.stream",
    "is_prepared": "stemlm.data.manifest",
}

__getattr__, __all__ = lazy_exports(__name__, _EXPORTS)
