"""Held-out perplexity and bytes per decoded token with the STEM tables stored as fp32, bf16 or row-wise int8.

A trained checkpoint is scored on the embedded corpus's held-out split (`stemlm.evaluation.perplexity`, windows
of `--seq-len`, the first `--max-tokens` tokens spread over the documents) once per table dtype: the model's
table rows are replaced by exactly the rows `stemlm.offload.compact.CompactProvider` serves for that dtype
(what `stemlm generate --tables host --table-dtype ...` computes with), everything else unchanged. Bytes per
decoded token: the table rows one token reads from the store (`stored_row_bytes`) and the whole decode step
(`stemlm.accounting.decode_bytes_per_token` with fp32 weights, the table rows at the stored size).

    stemlm train --out runs/tiny && python benchmarks/table_dtype.py --ckpt runs/tiny
    python benchmarks/table_dtype.py --ckpt runs/tiny --max-tokens 50000

Last line: `RESULT int8_ppl_change=…% bf16_ppl_change=…% int8_row_bytes=… fp32_row_bytes=…`.
"""

from __future__ import annotations

import argparse

import torch

from stemlm.accounting import decode_bytes_per_token
from stemlm.data.corpus import embedded_texts
from stemlm.evaluation.perplexity import evaluate_perplexity
from stemlm.offload.compact import TABLE_DTYPES, CompactProvider
from stemlm.offload.providers import ResidentProvider
from stemlm.runs import load_checkpoint


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt", required=True, help="a trained checkpoint or run folder")
    p.add_argument("--seq-len", type=int, default=256, help="scoring window (default 256)")
    p.add_argument("--max-tokens", type=int, default=20000, help="held-out tokens scored (default 20000)")
    p.add_argument("--threads", type=int, default=0, help="torch threads; 0 keeps torch's default")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = load_checkpoint(args.ckpt)
    model.eval()
    tables = model.stem_tables()
    original = {i: t.weight.detach().clone() for i, t in tables.items()}
    texts = embedded_texts("heldout")
    base = ResidentProvider(model)
    every = torch.arange(model.config.vocab_size)
    fp32_decode = decode_bytes_per_token(model.config, dtype_bytes=4)["weights"]
    results = {}
    for name in TABLE_DTYPES:
        provider = CompactProvider(base, name)
        rows = provider.gather(every)
        with torch.no_grad():
            for layer, table in tables.items():
                offset, width = provider.layer_slices[layer]
                table.weight.copy_(rows[:, offset : offset + width])
        ppl = evaluate_perplexity(model, tokenizer, texts, window=args.seq_len, max_tokens=args.max_tokens)
        decode = fp32_decode - base.row_bytes + provider.stored_row_bytes
        results[name] = (ppl.perplexity, provider.stored_row_bytes, decode)
    with torch.no_grad():
        for layer, table in tables.items():
            table.weight.copy_(original[layer])
    ref = results["fp32"][0]
    print(f"{args.ckpt}: held-out perplexity over {args.max_tokens} tokens, windows of {args.seq_len}")
    print(f"{'tables':<7} {'perplexity':>10} {'change':>8} {'row bytes/token':>16} {'decode bytes/token':>19}")
    for name, (ppl, row, decode) in results.items():
        print(f"{name:<7} {ppl:>10.3f} {100 * (ppl / ref - 1):>+7.3f}% {row:>16,} {decode:>19,}")
    change = {name: 100 * (results[name][0] / ref - 1) for name in results}
    print(
        f"RESULT int8_ppl_change={change['int8']:+.3f}% bf16_ppl_change={change['bf16']:+.3f}% "
        f"int8_row_bytes={results['int8'][1]} fp32_row_bytes={results['fp32'][1]}"
    )


if __name__ == "__main__":
    main()
