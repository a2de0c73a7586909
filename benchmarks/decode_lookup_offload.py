"""What offloading costs each lookup kind: prefetched n-gram rows (`stem_ngram`, `engram`) vs memory values
fetched on demand (`memory`), at batch 1 decoding on the tiny preset.

For each kind a random model of the tiny preset is saved and loaded twice (tables resident; tables in host
memory behind a 20% hot-row cache per family), then both decode the same teacher-forced held-out text of the
embedded corpus in lockstep, one step each per round. Reported per kind: host/resident decode tokens/s
(median over `--reps` repetitions), the n-gram or memory cache hit rate, and for `memory` the share of the
host decode time spent waiting for on-demand value rows (the fetch sits on the critical path; prefetched
families only wait for what the prefetch did not hide). Logits must agree (atol 1e-5).

    OMP_NUM_THREADS=1 python benchmarks/decode_lookup_offload.py --decode 48 --reps 3

The last line is `RESULT stem_ngram_host_over_resident=… engram_host_over_resident=… memory_host_over_resident=…
memory_wait_share=…`.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from stemlm.checkpoint.folder import save_pretrained
from stemlm.data.corpus import embedded_texts
from stemlm.data.tokenizer import default_tokenizer
from stemlm.inference.offloaded import OffloadedLM
from stemlm.inference.requests import Request
from stemlm.model import build_model
from stemlm.model.presets import get_preset

KINDS = ("stem_ngram", "engram", "memory")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decode", type=int, default=48, help="timed decode steps per repetition")
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens prefilled before decoding")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--fraction", type=float, default=0.2, help="cache size, fraction of each family's rows")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    tok = default_tokenizer()
    stream = tok.encode("\n".join(embedded_texts("heldout")[:3])).ids
    per_rep = args.prompt + args.decode
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in KINDS:
            folder = save_pretrained(build_model(get_preset("tiny").replace(ffn=kind)).eval(), Path(tmp) / kind)
            lms = {
                "resident": OffloadedLM.load(folder, "resident"),
                "host": OffloadedLM.load(folder, "host", cache_fraction=args.fraction),
            }
            rates, engines = {name: [] for name in lms}, {name: lm.engine() for name, lm in lms.items()}
            for rep in range(args.reps):
                ids = stream[rep * per_rep : (rep + 1) * per_rep]
                state = {name: engine.prefill(Request(ids[: args.prompt])) for name, engine in engines.items()}
                seconds = dict.fromkeys(lms, 0.0)
                for k in range(args.prompt, len(ids)):
                    order = list(lms) if k % 2 == args.prompt % 2 else list(reversed(lms))
                    for name in order:
                        engine, cache = engines[name], state[name][1]
                        start = time.perf_counter()
                        state[name] = (engine.step(engine.feed([ids[k]], [ids[:k]]), cache)[0], cache)
                        seconds[name] += time.perf_counter() - start
                    torch.testing.assert_close(state["host"][0], state["resident"][0], atol=1e-5, rtol=0)
                for name in lms:
                    rates[name].append(args.decode / seconds[name])
            report = lms["host"].report()
            families = report.get("family_caches", {})
            hits = sum(f["hits"] for f in families.values())
            lookups = sum(f["hits"] + f["misses"] for f in families.values())
            host_seconds = args.reps * args.decode / statistics.median(rates["host"])
            results[kind] = {
                "host_over_resident": statistics.median(rates["host"]) / statistics.median(rates["resident"]),
                "family_hit_rate": hits / max(1, lookups),
                "wait_share": report.get("memory_on_demand_wait_s", 0.0) / host_seconds,
            }
            for lm in lms.values():
                lm.close()
            r = results[kind]
            print(
                f"{kind:<11} host/resident {r['host_over_resident']:.3f}  hit rate {r['family_hit_rate']:.3f}  "
                f"on-demand wait share {r['wait_share']:.3f}"
            )
    fields = [f"{k}_host_over_resident={results[k]['host_over_resident']:.3f}" for k in KINDS]
    fields.append(f"memory_wait_share={results['memory']['wait_share']:.3f}")
    print("RESULT " + " ".join(fields))


if __name__ == "__main__":
    main()
