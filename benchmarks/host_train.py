"""Train-step time with the STEM tables in host memory (`--tables host`) against resident tables.

Two `stemlm.train.Trainer`s on the tiny shape (same seed, same row-sparse table optimizer) run their real
`train_step()` round-robin in one process, after warm-up steps, so that machine load hits both alike; medians
are reported. `overlap` is the share of the host-side work (row gathers and the host optimizer step, on the
worker thread) that ran while the trainer was busy with something else, i.e. did not make it wait. On CUDA the
host buffers are pinned and the gathers copy on a side stream.

    python benchmarks/host_train.py                                  # tiny, fp32, CPU
    python benchmarks/host_train.py --threads 1 --clock cpu --reps 20
    python benchmarks/host_train.py --device cuda --dtype bf16 --reps 30

Last line: `RESULT host_over_resident=… overlap=…` (time ratio, > 1 = host slower).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from stemlm.choices import ROW_SPARSE_OPTIMIZERS
from stemlm.model.presets import get_preset
from stemlm.train.config import TrainConfig
from stemlm.train.trainer import Trainer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny", help="model preset (default tiny)")
    p.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    p.add_argument("--seq", type=int, default=256, help="tokens per sequence (default 256)")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step (default 1)")
    p.add_argument("--table-optim", choices=ROW_SPARSE_OPTIMIZERS, default="rowwise_adagrad", help="table optimizer")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="autocast dtype (default fp32)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per trainer first (default 2)")
    p.add_argument("--reps", type=int, default=10, help="timed steps per trainer, round-robin (default 10)")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads; 0 keeps torch's default")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="wall (default) or process CPU time")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.clock == "cpu":
        clock = time.process_time
    elif device.type == "cuda":
        clock = lambda: (torch.cuda.synchronize(), time.perf_counter())[1]  # noqa: E731
    else:
        clock = time.perf_counter
    config = get_preset(args.preset)
    cfg = TrainConfig(
        steps=args.warmup + args.reps + 1,
        batch_size=args.batch,
        seq_len=args.seq,
        grad_accum=args.grad_accum,
        table_optim=args.table_optim,
        device=args.device,
        dtype=args.dtype,
        eval_every=0,
    )
    times: dict[str, list[float]] = {"resident": [], "host": []}
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {
            "resident": Trainer(config, cfg.replace(out=f"{tmp}/resident"), progress=False),
            "host": Trainer(config, cfg.replace(out=f"{tmp}/host", tables="host"), progress=False),
        }
        for trainer in trainers.values():
            for _ in range(args.warmup):
                trainer.train_step()
        host = trainers["host"].tables
        host.sync()
        host.work_s = host.wait_s = 0.0
        names = list(trainers)
        for rep in range(args.reps):
            for k in range(len(names)):
                name = names[(rep + k) % len(names)]
                start = clock()
                trainers[name].train_step()
                times[name].append(clock() - start)
        host.sync()  # the last update's wait is counted too
        summary = host.summary(trainers["host"].optimizers)
    median = {name: statistics.median(ts) for name, ts in times.items()}
    ratio = median["host"] / median["resident"]
    print(
        f"{args.preset}, batch {args.batch}x{args.seq} x{args.grad_accum}, {args.dtype} on {device}, "
        f"threads={torch.get_num_threads()}, {args.table_optim}, {args.reps} reps after {args.warmup}, "
        f"{args.clock} clock"
    )
    for name, ts in times.items():
        print(f"{name:<9} median {median[name] * 1e3:8.1f} ms  min {min(ts) * 1e3:8.1f}  max {max(ts) * 1e3:8.1f}")
    print(
        f"host worker: {host.work_s * 1e3 / args.reps:.1f} ms/step of gathers + updates, trainer waited "
        f"{host.wait_s * 1e3 / args.reps:.1f} ms/step; kept off the device: "
        f"{summary['device_bytes_saved'] / 2**20:.1f} MiB"
    )
    print(f"RESULT host_over_resident={ratio:.3f} overlap={summary['host_overlap']:.3f}")


if __name__ == "__main__":
    main()
