"""Sharded asynchronous checkpoints: how long training is held up by a save, against the whole save.

Two gloo processes train a model whose STEM tables dominate (V 32768, d_ff 1024, STEM in layer 1 of 2: 33.6M
table parameters, `lazy_adamw` moments) for one step, then save through `Trainer.save` (the
pieces are copied to host memory, then written by a background thread) and wait for the checkpoint to be in
place. `blocking` is the time `save` held the training thread (block exchange + staging copy), `total` until
the folder was renamed into place with its manifest (the files hashed, fsynced). Per rank, median of
`--saves` saves; then the size of the checkpoint on disk.

Run: `OMP_NUM_THREADS=1 python benchmarks/dist_checkpoint.py [--saves 3] [--vocab 32768]` (~1 min)
Last line: `RESULT blocking_over_total=... blocking_s=... total_s=... checkpoint_mb=...`
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from stemlm.model.config import ModelConfig
from stemlm.train.config import TrainConfig

WORLD = 2


def config(vocab: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        ffn="stem",
        ffn_layers="odd",
    )


def _worker(rank: int, port: int, root: Path, saves: int, vocab: int) -> None:
    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    from stemlm.train.parallel.launch import destroy_distributed
    from stemlm.train.trainer import Trainer

    cfg = TrainConfig(
        steps=saves + 1,
        seq_len=64,
        batch_size=4,
        eval_every=0,
        save_every=0,
        save_minutes=0,
        keep_last=1,
        table_optim="lazy_adamw",
        out=str(root / "run"),
        device="cpu",
    )
    trainer = Trainer(config(vocab), cfg, progress=False)
    blocking, total = [], []
    for _ in range(saves):
        trainer.train_step()
        start = time.perf_counter()
        trainer.save()
        blocking.append(time.perf_counter() - start)
        trainer.saver.wait()
        total.append(time.perf_counter() - start)
    torch.save({"blocking": statistics.median(blocking), "total": statistics.median(total)}, root / f"r{rank}.pt")
    destroy_distributed()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--saves", type=int, default=3, help="saves timed, one training step before each (default 3)")
    parser.add_argument(
        "--vocab",
        type=int,
        default=32768,
        help="vocabulary: the tables' rows, at least the tokenizer's 8192 (default 32768)",
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp, socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        sock.close()
        root = Path(tmp)
        mp.start_processes(_worker, args=(port, root, args.saves, args.vocab), nprocs=WORLD, start_method="fork")
        results = [torch.load(root / f"r{rank}.pt") for rank in range(WORLD)]
        ckpt = max((root / "run" / "checkpoints").glob("step-*"))
        size = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file()) / 1e6
    for rank, r in enumerate(results):
        print(f"rank {rank}: save held training {r['blocking']:.3f} s of {r['total']:.3f} s until in place")
    blocking = max(r["blocking"] for r in results)
    total = max(r["total"] for r in results)
    print(
        f"RESULT blocking_over_total={blocking / total:.3f} blocking_s={blocking:.3f} total_s={total:.3f} "
        f"checkpoint_mb={size:.1f}"
    )


if __name__ == "__main__":
    main()
