"""Table bytes per step: the vocabulary-row-sharded tables against the official d_ff-split all-to-all.

Two gloo processes train the `tiny` preset (V 8192, d_ff 768, STEM in layers 1 and 3) with `ShardedTables`
and `lazy_adamw` on a global batch of B x S Zipfian token ids (exponent 1), each rank taking half. The bytes
each rank sends to the other are measured by the tables' `CommCounter` (ids, rows forward, row gradients
backward, split counts). The official scheme splits every table along d_ff over the P ranks, all-gathers the
ids (int64) and all-to-alls the looked-up activations forward and their gradients backward: per rank and step
`(P-1) * b * S * 8 + L_stem * 2 * (P-1)/P * b * S * d_ff * e` bytes (b = local batch, e = element bytes, the
same fp32 rows as here), computed analytically. Row-sharded traffic grows with the unique ids instead.

Run: `OMP_NUM_THREADS=1 python benchmarks/table_comm.py [--batch 8 --seq 256 --steps 3]` (~1 min)
Last line: `RESULT sharded_over_official_bytes=...`
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from table_optim import zipf_ids

from stemlm.dist.sharded_tables import ShardedTables
from stemlm.model import build_model
from stemlm.presets import get_preset
from stemlm.train.table_optim import make_table_optimizer

WORLD = 2


def official_bytes_per_rank(local_batch: int, seq: int, d_ff: int, stem_layers: int, elem_bytes: int) -> int:
    tokens = local_batch * seq
    ids = (WORLD - 1) * tokens * 8
    activations = stem_layers * 2 * (WORLD - 1) * tokens * d_ff * elem_bytes // WORLD
    return ids + activations


def worker(rank: int, tmp: str, batch: int, seq: int, steps: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=WORLD)
    model = build_model(get_preset("tiny"), seed=0)
    tables = ShardedTables(model)
    opt = make_table_optimizer("lazy_adamw", tables.parameters(), lr=1e-3)
    local = batch // WORLD
    sent, unique, seconds = [], [], []
    for step in range(steps):
        ids = zipf_ids((batch, seq + 1), model.config.vocab_size, 1.0, torch.Generator().manual_seed(step))
        ids = ids[rank * local : (rank + 1) * local]
        start = time.perf_counter()
        inputs = ids[:, :-1]
        model(inputs, labels=ids[:, 1:], table_rows=tables.lookup(inputs)).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - start)
        sent.append(tables.comm.pop_step())
        unique.append(inputs.unique().numel())
    torch.save(
        {
            "sent": sent,
            "unique": unique,
            "seconds": seconds,
            "layers": len(tables.layers),
            "d_ff": model.config.intermediate_size,
            "elem": tables.shard(tables.layers[0]).element_size(),
        },
        f"{tmp}/rank{rank}.pt",
    )
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences), split over 2 ranks")
    parser.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=3, help="training steps measured")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(tmp, args.batch, args.seq, args.steps), nprocs=WORLD)
        results = [torch.load(f"{tmp}/rank{r}.pt") for r in range(WORLD)]
    first = results[0]
    official = official_bytes_per_rank(args.batch // WORLD, args.seq, first["d_ff"], first["layers"], first["elem"])
    sharded = statistics.mean(step["table_bytes_sent"] for r in results for step in r["sent"])
    tokens = args.batch // WORLD * args.seq
    print(
        f"{WORLD} gloo ranks, {args.batch // WORLD}x{args.seq} tokens per rank, {first['layers']} tables of width "
        f"{first['d_ff']}, fp32 rows"
    )
    for r, res in enumerate(results):
        kinds = {k.split("/")[1]: v for k, v in res["sent"][-1].items() if "/" in k}
        mean_sent = statistics.mean(s["table_bytes_sent"] for s in res["sent"])
        print(
            f"  rank {r}: unique ids/step {statistics.mean(res['unique']):.0f} of {tokens}, "
            f"bytes sent/step {mean_sent:,.0f} (last step {kinds}), "
            f"step {statistics.median(res['seconds']):.2f} s"
        )
    print(f"sharded: {sharded:,.0f} B/rank/step; official d_ff split (analytic): {official:,.0f} B/rank/step")
    print(f"RESULT sharded_over_official_bytes={sharded / official:.3f}")


if __name__ == "__main__":
    main()
