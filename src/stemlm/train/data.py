"""The data of a training run: its tokenizer and its (train, held-out) datasets, in one process or on N ranks.

`--data DIR` naming a folder written by `stemlm data prepare` streams its memory-mapped shards
(`stemlm.data.stream`: sampled without replacement per epoch, the folder's tokenizer unless `--tokenizer` says
otherwise, which must then match it). Anything else (text/jsonl files and folders, or the embedded corpus) is
read, split and tokenized into a cached shard as before (`stemlm.data.shards`). `cfg.sampling` picks how
training windows are drawn (`resolve_sampling`): prepared shards always per epoch without replacement; text
uniformly with replacement unless `sampling="epoch"` asks for the shards' per-epoch order (the default `auto`
keeps text uniform, so the published figures of the embedded corpus stay reproducible).

On N ranks (`load_datasets_distributed`) rank 0 alone reads the manifest or the text and builds the shards;
the others wait at a broadcast, then open rank 0's files (memory maps: no rank reads text or loads tokens).
A problem found by rank 0 is broadcast and raised on every rank, so no rank is left waiting.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from stemlm.checkpoint.folder import TOKENIZER_NAME
from stemlm.errors import StemlmError
from stemlm.train.config import TrainConfig, saved_defaults


def prepared_folder(cfg: TrainConfig) -> Path | None:
    """The prepared shard folder of `cfg.data`, or None for text data / the embedded corpus. A folder of shards
    whose manifest is gone is refused, not read as (empty) text."""
    from stemlm.data.manifest import is_prepared, refuse_orphan_shards

    for path in cfg.data or []:
        refuse_orphan_shards(path)
    if not cfg.data or not any(is_prepared(p) for p in cfg.data):
        return None
    if len(cfg.data) != 1:
        raise StemlmError("--data takes one prepared shard folder alone (prepare all inputs into one folder)")
    return Path(cfg.data[0])


def resolve_tokenizer(cfg: TrainConfig) -> Tokenizer:
    """`cfg.tokenizer`, else the --init-from checkpoint's, else the prepared folder's, else the default."""
    from stemlm.data import get_tokenizer
    from stemlm.data.stream import prepared_tokenizer

    if cfg.tokenizer is not None:
        return get_tokenizer(cfg.tokenizer)
    if cfg.init_from and (Path(cfg.init_from) / TOKENIZER_NAME).is_file():
        return get_tokenizer(Path(cfg.init_from) / TOKENIZER_NAME)
    folder = prepared_folder(cfg)
    return prepared_tokenizer(folder) if folder is not None else get_tokenizer("default")


def resolve_sampling(cfg: TrainConfig) -> str:
    """The window sampling of the run: "epoch" or "uniform" (`auto`: epoch for prepared shards, else uniform)."""
    prepared = prepared_folder(cfg) is not None
    if prepared and cfg.sampling == "uniform":
        raise StemlmError("prepared shards are sampled per epoch only; use sampling epoch (or auto) with them")
    if cfg.sampling == "auto":
        return "epoch" if prepared else "uniform"
    return cfg.sampling


def load_datasets(cfg: TrainConfig, tok: Tokenizer) -> tuple[Any, Any]:
    """(train, heldout or None) datasets of the run; held-out is dropped when too small for one window."""
    folder, sampling = prepared_folder(cfg), resolve_sampling(cfg)
    if folder is not None:
        from stemlm.data.stream import open_prepared

        train, heldout = open_prepared(folder, tok)
    else:
        from stemlm.data import TokenDataset, load_corpus

        train_texts, heldout_texts = load_corpus(cfg.data)
        train = TokenDataset.from_texts(train_texts, tok, separator=cfg.separator)
        if cfg.data is None and cfg.fact_fraction > 0:  # the embedded corpus gets the fact world mixed in
            from stemlm.data.fact_mix import mixed_texts

            texts = mixed_texts(
                train_texts,
                tok,
                cfg.fact_fraction,
                cfg.fact_selection(),
                cfg.fact_relations,
                cfg.seed,
                corpus_tokens=train.num_tokens,
                layout=cfg.fact_layout,
            )
            corpus_tokens, train = train.num_tokens, TokenDataset.from_texts(texts, tok, separator=cfg.separator)
            if cfg.fact_layout == "batches":  # the fact documents follow the corpus's tokens: a stratum each
                train.strata = (corpus_tokens, cfg.fact_fraction)
        heldout = TokenDataset.from_texts(heldout_texts, tok, separator=cfg.separator) if heldout_texts else None
        train.sampling = sampling
    if heldout is not None and heldout.num_tokens < cfg.seq_len + 1:
        heldout = None  # too small for one window: train without held-out evaluation
    return train, heldout


def load_datasets_distributed(cfg: TrainConfig, tok: Tokenizer, is_main: bool) -> tuple[Any, Any]:
    """`load_datasets` on rank 0, then the same files opened (not rebuilt) on the other ranks."""
    import torch.distributed as dist

    message: list[Any] = [None]
    if is_main:
        try:
            train, heldout = load_datasets(cfg, tok)
            paths = [d.path if d is not None else None for d in (train, heldout)]
            message = [{"paths": paths, "strata": getattr(train, "strata", None)}]
        except (StemlmError, OSError) as exc:
            message = [{"error": str(exc)}]
    dist.broadcast_object_list(message, src=0)
    if "error" in message[0]:
        raise StemlmError(message[0]["error"])
    if is_main:
        return train, heldout
    if prepared_folder(cfg) is not None:
        return load_datasets(cfg, tok)  # a manifest read and one memory map per shard: no corpus is read
    from stemlm.data import TokenDataset

    train_path, heldout_path = message[0]["paths"]
    train = TokenDataset.from_file(train_path)
    train.sampling = resolve_sampling(cfg)
    train.strata = tuple(message[0]["strata"]) if message[0]["strata"] else None
    return train, TokenDataset.from_file(heldout_path) if heldout_path else None


def training_token_ids(run: str | Path, tok: Tokenizer) -> set[int] | None:
    """The ids that occur in the training tokens of the run folder `run` when it trained on the embedded corpus
    (with its fact mix), rebuilt from its run_config.json by `load_datasets`: the cached shard on the machine that
    trained, else a few seconds of tokenizing. None where that is not known cheaply: no run_config.json (a bare
    checkpoint) or data of the user's (`--data`), which may be large or gone. `stemlm edit` warns with it about
    rows that never trained."""
    import json

    import numpy as np

    try:
        saved = json.loads((Path(run) / "run_config.json").read_text())["train"]
        cfg = TrainConfig.from_dict({**saved, **saved_defaults(saved)})
        if cfg.data is not None:
            return None
        train, _ = load_datasets(cfg, tok)
    except (OSError, ValueError, KeyError, TypeError, StemlmError):
        return None
    return set(np.unique(np.asarray(train.tokens)).tolist())


def untrained_note(ckpt: str | Path, tok: Tokenizer, entities: dict[str, str | None]) -> str | None:
    """What to warn about an edit of CKPT between `entities` (flag -> entity text, e.g. {"--target": "Germany"}):
    the entities with tokens that never occurred in the training data of CKPT's run (`training_token_ids`), whose
    rows therefore never trained; None when every token trained or the data is not known."""
    from stemlm.checkpoint.runs import resolve_checkpoint
    from stemlm.edit.spans import entity_ids

    checkpoint = resolve_checkpoint(ckpt)  # RUN/checkpoints/<step> of a run folder
    run = next((p for p in (Path(ckpt), checkpoint.parent.parent) if (p / "run_config.json").is_file()), None)
    seen = training_token_ids(run, tok) if run is not None else None
    if seen is None:
        return None
    unseen = []
    for flag, entity in entities.items():
        tokens = [tok.id_to_token(i) for i in entity_ids(tok, entity) if i not in seen] if entity else []
        if tokens:
            unseen.append(f"{flag} {entity!r} ({', '.join(map(repr, tokens))})")
    return (
        f"{' and '.join(unseen)}: never in the training data of {run}, so those rows are untrained" if unseen else None
    )
