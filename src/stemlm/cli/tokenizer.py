"""`stemlm tokenizer`: train a byte-level BPE tokenizer, or show how a tokenizer splits a text.

    stemlm tokenizer train --out DIR                        # embedded corpus, train split, vocab 8192
    stemlm tokenizer train --data notes/ more.jsonl --vocab-size 16000 --out DIR --json
    stemlm tokenizer encode --tokenizer gpt2 "Hello world"  # -> 15496 995, then the pieces 'Hello' 'Ġworld'

`train` uses the train split of `load_corpus` (the same split the trainer uses, so held-out documents
never shape the vocabulary). The shipped default tokenizer is exactly
`stemlm tokenizer train --out src/stemlm/assets/tokenizer`.
"""

from __future__ import annotations

import time

from stemlm.cli.common import add_json_flag, print_json
from stemlm.data.corpus import DEFAULT_HELDOUT_FRACTION, DEFAULT_SEED


def register(subparsers) -> None:
    parser = subparsers.add_parser("tokenizer", help="train or try a byte-level BPE tokenizer")
    commands = parser.add_subparsers(dest="tokenizer_command", metavar="ACTION", required=True)

    train = commands.add_parser("train", help="train a byte-level BPE tokenizer and write DIR/tokenizer.json")
    train.add_argument(
        "--data", nargs="+", metavar="PATH", help="text/md/jsonl files or folders (default: embedded corpus)"
    )
    train.add_argument(
        "--vocab-size", type=int, default=8192, help="vocabulary size incl. <|endoftext|> (default 8192)"
    )
    train.add_argument("--min-frequency", type=int, default=2, help="minimum pair count for a merge (default 2)")
    train.add_argument(
        "--heldout-fraction",
        type=float,
        default=DEFAULT_HELDOUT_FRACTION,
        help=f"share of documents held out of training (default {DEFAULT_HELDOUT_FRACTION})",
    )
    train.add_argument(
        "--seed", type=int, default=DEFAULT_SEED, help=f"seed of the document split (default {DEFAULT_SEED})"
    )
    train.add_argument("--out", required=True, metavar="DIR", help="directory to write tokenizer.json into")
    train.add_argument("--force", action="store_true", help="replace DIR/tokenizer.json (never a checkpoint's)")
    add_json_flag(train)
    train.set_defaults(func=run_train)

    encode = commands.add_parser("encode", help="print the token ids (and pieces) of a text")
    encode.add_argument("text", help="the text to encode")
    encode.add_argument("--tokenizer", default="default", help="'default', 'gpt2' or a tokenizer.json / directory")
    add_json_flag(encode)
    encode.set_defaults(func=run_encode)


def run_train(args) -> int:
    from stemlm.data.sources import load_corpus
    from stemlm.data.tokenizer import check_tokenizer_target, eot_id, save_tokenizer, train_bpe

    start = time.perf_counter()
    check_tokenizer_target(args.out, force=args.force)  # before training, so a refusal costs nothing
    train_texts, _ = load_corpus(args.data, args.heldout_fraction, args.seed)
    tok = train_bpe(train_texts, vocab_size=args.vocab_size, min_frequency=args.min_frequency)
    path = save_tokenizer(tok, args.out, force=args.force)
    result = {
        "path": str(path),
        "vocab_size": tok.get_vocab_size(),
        "eot_id": eot_id(tok),
        "documents": len(train_texts),
        "characters": sum(len(t) for t in train_texts),
        "seconds": round(time.perf_counter() - start, 2),
    }
    if args.json:
        print_json(result)
    else:
        print(
            f"wrote {path}: vocab {result['vocab_size']}, trained on {result['documents']} documents "
            f"({result['characters'] / 1e6:.2f} M characters) in {result['seconds']} s"
        )
    return 0


def run_encode(args) -> int:
    from stemlm.data.tokenizer import get_tokenizer

    enc = get_tokenizer(args.tokenizer).encode(args.text, add_special_tokens=False)
    if args.json:
        print_json({"ids": enc.ids, "tokens": enc.tokens, "count": len(enc.ids)})
    else:
        print(" ".join(map(str, enc.ids)))
        print(" ".join(repr(piece) for piece in enc.tokens))  # byte-level pieces: Ġ marks a leading space
    return 0
