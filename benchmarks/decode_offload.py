"""Decode throughput with STEM tables resident vs in host memory behind the hot-row cache, at several sizes.

A model of the chosen preset (random weights: speed and hit rate do not depend on them) is saved to a
temporary checkpoint and loaded twice: tables resident on the device, and tables in host memory with a
device cache of each size (fractions of the vocabulary). Every configuration decodes the same real id
stream, teacher-forced: the embedded corpus's held-out text tokenized with the default tokenizer, so hit
rates are those of real text. The caches are warm-started with token counts of the train split (as a
server would be), every configuration then decodes `--warmup` untimed tokens of other text (kernels warm),
and times `--decode` steps after a `--prompt` token prefill.
Each of `--reps` repetitions decodes new text with all configurations in lockstep (one step each, in a
rotating order, so load from other processes hits all alike); the median decode tokens/s is reported, with
its ratio to resident and the hit rate over the timed repetitions (prefills included); every step's logits
must be equal across configurations.

Then, for each table dtype (`--table-dtypes`, default fp32,bf16,int8; `stemlm.offload.compact`), through the
same loader the CLI uses (`stemlm.inference.load`, host tables, 20% cache): the held-out perplexity
(`stemlm.evaluation.perplexity`, windows of `--ppl-window`, `--ppl-tokens` tokens of the held-out split) and
its change against fp32 rows; the bytes of table rows read from the host store per decoded token (misses
x stored row bytes, measured over the timed decode stream with warm caches); a token's stored row bytes;
and the bytes a whole decode step reads (`stemlm.model.accounting`, fp32 weights, the rows at their stored size).
With `--ckpt` (a trained checkpoint or run folder) the model is that checkpoint; without it the preset's
random weights, whose perplexity change means nothing.

    OMP_NUM_THREADS=2 python benchmarks/decode_offload.py                 # tiny preset, fp32, CPU
    python benchmarks/decode_offload.py --decode 64 --reps 2              # quicker
    python benchmarks/decode_offload.py --ckpt runs/tiny --reps 1         # a trained model: perplexity figures
    python benchmarks/decode_offload.py --device cuda --preset paper-350m --set vocab_size=8192

The last line is `RESULT host_cache20_over_resident=… hit_rate_cache20=… int8_ppl_change=…% bf16_ppl_change=…%
fp32_bytes_per_token=… int8_bytes_per_token=…` (the 20% cache, LFU; bytes: host rows read per decoded token).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections import Counter

import torch

from stemlm.checkpoint.folder import load_config, save_pretrained
from stemlm.checkpoint.runs import resolve_checkpoint
from stemlm.data.corpus import embedded_texts
from stemlm.data.tokenizer import default_tokenizer
from stemlm.evaluation.perplexity import evaluate_perplexity, load_eval
from stemlm.inference.load import InferenceOptions
from stemlm.inference.offloaded import OffloadedLM, forced_decode
from stemlm.inference.requests import Request
from stemlm.model import build_model
from stemlm.model.accounting import decode_bytes_per_token
from stemlm.model.presets import get_preset

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--preset",
        default="tiny",
        help="model preset (default tiny: V 8192, STEM in every layer; tiny-odd: layers 1 and 3)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override, e.g. --set vocab_size=8192 (repeatable)",
    )
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (default: cuda when available)")
    p.add_argument("--dtype", choices=list(DTYPES), help="weights and tables (default fp32 on CPU, bf16 on CUDA)")
    p.add_argument(
        "--fractions",
        default="0,0.05,0.1,0.2",
        help="cache sizes as fractions of the vocabulary (default 0,0.05,0.1,0.2; must include 0.2)",
    )
    p.add_argument("--policy", default="lfu", choices=("lfu", "lru"), help="cache policy (default lfu)")
    p.add_argument("--prompt", type=int, default=64, help="prompt tokens prefilled before timing (default 64)")
    p.add_argument("--decode", type=int, default=256, help="timed decoding steps (default 256)")
    p.add_argument("--warmup", type=int, default=128, help="untimed decoding steps first (default 128)")
    p.add_argument(
        "--warm-chars",
        type=int,
        default=2_000_000,
        help="warm-start the caches with token counts of this many characters of the train split "
        "(default 2,000,000; 0 = cold caches)",
    )
    p.add_argument("--sync", action="store_true", help="fetch rows on the compute thread (no prefetch worker)")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions per configuration (default 3)")
    p.add_argument("--ckpt", help="a trained checkpoint or run folder (default: the preset with random weights)")
    p.add_argument("--table-dtypes", default="fp32,bf16,int8", help="table dtypes compared (default fp32,bf16,int8)")
    p.add_argument("--ppl-tokens", type=int, default=10000, help="held-out tokens scored per dtype (default 10000)")
    p.add_argument("--ppl-window", type=int, default=256, help="perplexity window (default 256)")
    return p.parse_args(argv)


def warm_counts(chars: int, vocab: int) -> list[int] | None:
    """Token counts of the first `chars` characters of the train split (spread over its documents)."""
    if chars <= 0:
        return None
    texts = embedded_texts("train")
    counts = Counter(
        t for e in default_tokenizer().encode_batch([x[: chars // len(texts)] for x in texts]) for t in e.ids
    )
    return [counts.get(t, 0) for t in range(vocab)]


def id_stream(n: int) -> list[int]:
    tok = default_tokenizer()
    ids: list[int] = []
    for text in embedded_texts("heldout"):
        ids += tok.encode(text[: 20 * n]).ids  # a prefix of each document is plenty
        if len(ids) >= n:
            break
    if len(ids) < n:
        sys.exit(f"held-out text has only {len(ids)} tokens, {n} needed")
    return ids[:n]


def time_decode(runs: dict[str, OffloadedLM], prompt: list[int], decode: list[int]) -> dict[str, float]:
    """Seconds each configuration spends decoding `decode` after prefilling `prompt` (untimed).

    The configurations advance in lockstep, one step each in a rotating order, so a burst of load from other
    processes lands on all of them alike; each timed step ends with the argmax a sampler would read (the
    device->host sync of real decoding). Every configuration's logits must equal the first one's."""
    engines = {name: lm.engine() for name, lm in runs.items()}
    state = {name: engine.prefill(Request(prompt)) for name, engine in engines.items()}
    seconds = dict.fromkeys(runs, 0.0)
    names = list(runs)
    for step, token in enumerate(decode):
        reference, before = None, [prompt + decode[:step]]
        for name in names[step % len(names) :] + names[: step % len(names)]:
            engine, (_, kv) = engines[name], state[name]
            start = time.perf_counter()
            logits = engine.step(engine.feed([token], before), kv)[0]
            int(torch.argmax(logits))
            seconds[name] += time.perf_counter() - start
            state[name] = (logits, kv)
            if reference is None:
                reference = logits
            elif not torch.equal(logits, reference):
                sys.exit(
                    f"{name}: logits differ from the other configurations' by {(logits - reference).abs().max():.3g}"
                )
    return seconds


def table_dtypes(folder, args, device, dtype, counts, warm, timed, segment, config) -> dict[str, dict]:
    """Per table dtype: held-out perplexity, host bytes read per decoded token, stored row and step bytes."""
    texts = embedded_texts("heldout")
    compute = "bf16" if dtype == torch.bfloat16 else "fp32"
    fp32_step = decode_bytes_per_token(config, dtype_bytes=4)["weights"]
    out = {}
    for name in args.table_dtypes.split(","):
        options = InferenceOptions(
            tables="host",
            table_dtype=name,
            cache_fraction=0.2,
            cache_policy=args.policy,
            device=str(device),
            dtype=compute,
        )
        with load_eval(folder, options) as lm:
            ppl = evaluate_perplexity(
                lm.model, lm.tokenizer, texts, window=args.ppl_window, max_tokens=args.ppl_tokens
            ).perplexity
            fp32_row = lm.offloaded.provider.row_width * 4
        with OffloadedLM.load(
            folder, "host", cache_fraction=0.2, policy=args.policy, device=device, warm_counts=counts, table_dtype=name
        ) as lm:
            forced_decode(lm.model, warm[:1], warm[1:segment], rows=lm.rows)  # warm the cache like the speed runs
            provider, misses, decoded, engine = lm.provider, 0, 0, lm.engine()
            for start in range(0, len(timed), segment):
                piece = timed[start : start + segment]
                _, kv = engine.prefill(Request(piece[: args.prompt]))
                before = lm.stats().misses
                for k in range(args.prompt, len(piece)):
                    engine.step(engine.feed([piece[k]], [piece[:k]]), kv)
                misses += lm.stats().misses - before
                decoded += len(piece) - args.prompt
            row = provider.stored_row_bytes if hasattr(provider, "stored_row_bytes") else provider.row_bytes
        out[name] = {"ppl": ppl, "host": misses * row / decoded, "row": row, "step": fp32_step - fp32_row + row}
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else "cpu"
        if args.device == "auto"
        else args.device
    )
    dtype = DTYPES[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    fractions = [float(f) for f in args.fractions.split(",")]
    if 0.2 not in fractions:
        sys.exit("--fractions must include 0.2 (the RESULT line reports it)")
    config = load_config(resolve_checkpoint(args.ckpt)) if args.ckpt else get_preset(args.preset)
    config = config.with_overrides(args.overrides) if not args.ckpt else config
    segment = args.prompt + args.decode
    if segment > config.max_position_embeddings:
        sys.exit(f"--prompt + --decode exceed max_position_embeddings={config.max_position_embeddings}")
    stream = id_stream(args.warmup + args.reps * segment)
    if max(stream) >= config.vocab_size:
        sys.exit(f"the default tokenizer's ids exceed vocab_size {config.vocab_size}; add --set vocab_size=8192")
    warm, timed = stream[: args.warmup], stream[args.warmup :]
    print(
        f"{args.ckpt or args.preset}: {config.num_hidden_layers} layers, d {config.hidden_size}, "
        f"d_ff {config.intermediate_size}, V {config.vocab_size}, tables in layers {config.special_layers}; "
        f"{device}, {dtype}",
        file=sys.stderr,
    )

    with tempfile.TemporaryDirectory() as tmp:
        if args.ckpt:
            tmp = str(resolve_checkpoint(args.ckpt))
        else:
            save_pretrained(build_model(config, seed=0).to(dtype), tmp)
        runs = {"resident": OffloadedLM.load(tmp, "resident", device=device)}
        counts = warm_counts(args.warm_chars, config.vocab_size)
        for f in fractions:
            runs[f"host+cache{f:g}"] = OffloadedLM.load(
                tmp,
                "host",
                cache_fraction=f,
                policy=args.policy,
                device=device,
                warm_counts=counts,
                background=not args.sync,
            )
        for lm in runs.values():  # warm-up: kernels, allocator, the caches' first misses
            for start in range(0, len(warm), segment):
                piece = warm[start : start + segment]
                forced_decode(lm.model, piece[:1], piece[1:], rows=lm.rows)
        counted = {name: (lm.stats().hits, lm.stats().unique_ids) for name, lm in runs.items() if lm.stats()}
        speeds = {name: [] for name in runs}
        for rep in range(args.reps):  # every repetition decodes new text
            start = rep * segment
            seconds = time_decode(
                runs, timed[start : start + args.prompt], timed[start + args.prompt : start + segment]
            )
            for name, value in seconds.items():
                speeds[name].append(args.decode / value)
        hit_rates = {}
        for name, (hits, lookups) in counted.items():
            s = runs[name].stats()
            hit_rates[name] = (s.hits - hits) / max(1, s.unique_ids - lookups)
        for lm in runs.values():
            lm.close()
        compact = table_dtypes(tmp, args, device, dtype, counts, warm, timed, segment, config)

    base = statistics.median(speeds["resident"])
    print(f"{'configuration':<20}{'tokens/s':>10}{'ratio':>8}{'hit rate':>10}  (median of {args.reps})")
    for name, values in speeds.items():
        rate = statistics.median(values)
        hit = f"{100 * hit_rates[name]:.1f}%" if name in hit_rates else "-"
        print(f"{name:<20}{rate:>10.1f}{rate / base:>8.3f}{hit:>10}")
    print(f"\n{'tables':<7}{'perplexity':>11}{'change':>9}{'host B/token':>14}{'row B':>8}{'step B/token':>14}")
    for name, r in compact.items():
        change = 100 * (r["ppl"] / compact["fp32"]["ppl"] - 1) if "fp32" in compact else float("nan")
        r["change"] = change
        print(f"{name:<7}{r['ppl']:>11.3f}{change:>+8.3f}%{r['host']:>14,.0f}{r['row']:>8,}{r['step']:>14,}")
    print("(host B/token: table bytes read from the host store per decoded token at the 20% cache; row B: one token's")
    print(" rows as stored; step B/token: all weights a decode step reads, the rows at their stored size)")
    key = "host+cache0.2"
    extra = "".join(f" {n}_ppl_change={r['change']:+.3f}%" for n, r in compact.items() if n != "fp32")
    extra += "".join(f" {n}_bytes_per_token={r['host']:.0f}" for n, r in compact.items())
    print(
        f"RESULT host_cache20_over_resident={statistics.median(speeds[key]) / base:.3f} "
        f"hit_rate_cache20={hit_rates[key]:.3f}{extra}"
    )


if __name__ == "__main__":
    main()
