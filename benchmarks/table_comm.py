"""Table bytes per step: the vocabulary-row-sharded tables against the official d_ff-split all-to-all.

Two gloo processes train the `tiny` preset (V 8192, d_ff 768, STEM in every layer) with `ShardedTables`
and `lazy_adamw` on a global batch of B x S Zipfian token ids (exponent 1), each rank taking half. The bytes
each rank sends to the other are measured by the tables' `CommCounter` (ids, rows forward, row gradients
backward, split counts). The official scheme splits every table along d_ff over the P ranks, all-gathers the
ids (int64) and all-to-alls the looked-up activations forward and their gradients backward: per rank and step
`(P-1) * b * S * 8 + L_stem * 2 * (P-1)/P * b * S * d_ff * e` bytes (b = local batch, e = element bytes, the
same fp32 rows as here), computed analytically. Row-sharded traffic grows with the unique ids instead.

Run: `OMP_NUM_THREADS=1 python benchmarks/table_comm.py [--batch 8 --seq 256 --steps 3]` (~1 min)
Last line: `RESULT sharded_over_official_bytes=...`

`--exchange`: the trainer's step with the exchange planned on the host and issued a micro-batch ahead ("after",
today's code) against the previous path ("before": the collective plan, i.e. a count all_to_all, an id
all_to_all and a read of the counts per micro-batch, the rows exchanged when the forward asks for them and, with
`--tables host` shards, the table update on the trainer's thread and no gathers ahead). Two `Trainer`s
per placement (tiny preset, lazy_adamw, the default corpus) run their real `train_step()` round-robin on the same 2
gloo ranks after warm-up; one extra step of each counts the collectives called from Python and the tensor reads
(`item` / `tolist`). Last line: `RESULT device_after_over_before=... host_after_over_before=...
collectives_per_step_before=... collectives_per_step_after=...` (median step-time ratios, < 1 = faster now).
    OMP_NUM_THREADS=1 python benchmarks/table_comm.py --exchange [--grad-accum 4 --reps 6] [--device cuda]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from table_optim import zipf_ids

from stemlm.model import build_model
from stemlm.model.presets import get_preset
from stemlm.placement.row_sharded import ShardedTables
from stemlm.placement.table_optim import make_table_optimizer

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
        model(inputs, labels=ids[:, 1:], rows={"token": tables.lookup(inputs)}).loss.backward()
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


COLLECTIVES = ("all_reduce", "all_to_all_single", "all_gather", "broadcast", "barrier")


def as_before(trainer) -> None:
    """Put one trainer back on the previous exchange path (see the module docstring)."""
    tables = trainer.tables

    def start_window(window: int, dtype=None):
        ids = tables.ids_for(window)[tables.rank]
        pending = tables.start_lookup(tables.plan(ids), dtype)  # collective plan, with its read of the counts
        pending.wait()
        return pending

    tables.start_window, tables.prefetch = start_window, lambda window: None
    if hasattr(tables, "_ahead_hook"):  # device shards: no exchange issued after the table update
        tables._ahead_hook.remove()
    if hasattr(trainer.optimizers[-1], "inner"):  # host shards: the update on the trainer's thread
        trainer.optimizers[-1] = trainer.optimizers[-1].inner


def counted_step(trainer) -> tuple[int, int]:
    """(collectives, tensor reads) of one train_step on this rank."""
    import pytest

    host_steps = {
        id(s["step"]) for opt in trainer.optimizers for s in getattr(opt, "inner", opt).state.values() if "step" in s
    }
    counts = [0, 0]
    patch = pytest.MonkeyPatch()
    for name in COLLECTIVES:
        original = getattr(dist, name)

        def collective(*a, _original=original, **kw):
            counts[0] += 1
            return _original(*a, **kw)

        patch.setattr(dist, name, collective)
    for name in ("item", "tolist"):
        original = getattr(torch.Tensor, name)

        def read(self, *a, _original=original, **kw):
            counts[1] += id(self) not in host_steps  # AdamW-style host step counters are no device reads
            return _original(self, *a, **kw)

        patch.setattr(torch.Tensor, name, read)
    try:
        trainer.train_step()
    finally:
        patch.undo()
    return counts[0], counts[1]


def exchange_worker(rank: int, port: int, tmp: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1")
    os.environ["MASTER_PORT"] = str(port)
    from stemlm.train.config import TrainConfig
    from stemlm.train.trainer import Trainer

    cfg = TrainConfig(
        steps=args.warmup + args.reps + 2,
        batch_size=args.batch,
        seq_len=args.seq,
        grad_accum=args.grad_accum,
        table_optim="lazy_adamw",
        eval_every=0,
        save_every=0,
        device=args.device,
        dtype="bf16" if args.device == "cuda" else "fp32",
    )
    trainers = {}
    for tables in args.tables.split(","):
        for mode in ("before", "after"):
            out = f"{tmp}/{tables}-{mode}"
            trainers[f"{tables}-{mode}"] = trainer = Trainer(
                get_preset("tiny"), cfg.replace(out=out, tables=tables), progress=False
            )
            if mode == "before":
                as_before(trainer)
    for trainer in trainers.values():
        for _ in range(args.warmup):
            trainer.train_step()
    counts = {name: counted_step(trainer) for name, trainer in trainers.items()}
    names, seconds = list(trainers), {name: [] for name in trainers}
    for rep in range(args.reps):
        for k in range(len(names)):  # rotate the order, so no trainer always runs first
            name = names[(rep + k) % len(names)]
            start = time.perf_counter()
            trainers[name].train_step()
            seconds[name].append(time.perf_counter() - start)
    for name, trainer in trainers.items():
        if name.startswith("host-after"):
            trainer.tables.close()
    torch.save({"counts": counts, "seconds": seconds}, f"{tmp}/exchange{rank}.pt")
    dist.destroy_process_group()


def exchange_main(args: argparse.Namespace) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(exchange_worker, args=(port, tmp, args), nprocs=WORLD)
        results = [torch.load(f"{tmp}/exchange{r}.pt") for r in range(WORLD)]
    backend = "NCCL ranks on 2 GPUs, bf16" if args.device == "cuda" else "gloo ranks x 1 thread"
    print(
        f"{WORLD} {backend}, tiny preset, global batch {args.batch}x{args.seq}, grad_accum "
        f"{args.grad_accum}, lazy_adamw; {args.reps} round-robin steps after {args.warmup}; load average "
        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    )
    ratios = {}
    for name in results[0]["counts"]:
        # A step ends in collectives, so the ranks' step times agree; the slower rank's time is the step's.
        steps = [max(pair) for pair in zip(*(r["seconds"][name] for r in results), strict=True)]
        median = statistics.median(steps)
        collectives, reads = results[0]["counts"][name]
        print(
            f"  {name:<14} median step {median * 1e3:8.1f} ms (min {min(steps) * 1e3:.1f}, max "
            f"{max(steps) * 1e3:.1f}); per step {collectives} collectives, {reads} tensor reads (rank 0)"
        )
        ratios[name] = median
    out = [f"{t}_after_over_before={ratios[f'{t}-after'] / ratios[f'{t}-before']:.3f}" for t in args.tables.split(",")]
    first = args.tables.split(",")[0]
    before, after = results[0]["counts"][f"{first}-before"][0], results[0]["counts"][f"{first}-after"][0]
    print(f"RESULT {' '.join(out)} collectives_per_step_before={before} collectives_per_step_after={after}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences), split over 2 ranks")
    parser.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--steps", type=int, default=3, help="training steps measured")
    parser.add_argument("--exchange", action="store_true", help="time the trainer's exchange now vs before")
    parser.add_argument("--grad-accum", type=int, default=4, help="--exchange: micro-batches per step")
    parser.add_argument("--tables", default="device,host", help="--exchange: placements, comma-separated")
    parser.add_argument("--warmup", type=int, default=2, help="--exchange: untimed steps per trainer first")
    parser.add_argument("--reps", type=int, default=6, help="--exchange: timed steps per trainer")
    parser.add_argument("--device", default="cpu", help="--exchange: cpu (gloo) or cuda (NCCL, bf16; 2 GPUs)")
    args = parser.parse_args(argv)
    if args.exchange:
        exchange_main(args)
        return
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
