"""`stemlm tokenizer`: train a byte-level BPE tokenizer, or show how a tokenizer splits a text.

    stemlm tokenizer train --out DIR                        # embedded corpus, train split, vocab 8192
    stemlm tokenizer train --data notes/ more.jsonl --vocab-size 16000 --out DIR --json
    stemlm tokenizer encode --tokenizer gpt2 "Hello world"  # -> 15496 995, then the pieces 'Hello' 'Ġworld'

`train` uses the train split of `load_corpus` (the same split the trainer uses, so held-out documents
never shape the vocabulary). `--fact-fraction 0.5` adds the default run's fact statements to the embedded corpus
in the share `stemlm train` mixes them in, so the fact world's names become whole tokens (measured for the
default run's edit in docs/results.md: it did not help). The shipped default tokenizer is exactly
`stemlm tokenizer train --out src/stemlm/assets/tokenizer`.
"""

from __future__ import annotations

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
    train.add_argument(
        "--fact-fraction",
        type=float,
        metavar="F",
        default=0.0,
        help="share of the characters that are the default run's fact statements, added to the embedded corpus as "
        "`stemlm train` mixes them in (default 0: none)",
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
    from stemlm.data.tokenizer import train_tokenizer
    from stemlm.errors import StemlmError
    from stemlm.train.config import TrainConfig

    run = TrainConfig()  # the default run, whose fact mix the tokenizer may learn beside the embedded corpus
    fraction = args.fact_fraction
    if not 0 <= fraction < 1:
        raise StemlmError(f"--fact-fraction must lie in [0, 1), got {fraction}")
    if fraction and args.data:
        raise StemlmError("--fact-fraction mixes facts into the embedded corpus only (as stemlm train); drop --data")
    result = train_tokenizer(
        args.data,
        args.out,
        args.vocab_size,
        args.min_frequency,
        args.heldout_fraction,
        args.seed,
        force=args.force,
        fact_fraction=fraction,
        fact_region=run.fact_selection(),
        fact_relations=tuple(run.fact_relations),
    )
    if args.json:
        print_json(result)
    else:
        print(
            f"wrote {result['path']}: vocab {result['vocab_size']}, trained on {result['documents']} documents "
            f"and {result['fact_documents']} of facts ({result['characters'] / 1e6:.2f} M characters) in "
            f"{result['seconds']} s"
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
