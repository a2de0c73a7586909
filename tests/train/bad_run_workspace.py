"""The workspace of the training bad-input suites: two finished 2-step runs, a model folder, bad files.

`build(root, assets)` trains a STEM run (root/run) and a dense one (root/dense) of the trainer tests' tiny model
on the small corpus (`tests/small_corpus.py`), and writes a model folder (root/model: the STEM run's last
checkpoint without trainer state), a binary file, a truncated jsonl file, a foreign folder and a plain file.
`FRESH` is the command line of a tiny new run into {out} (`BASE`: without --out); `fill(argv, ws, assets)`
expands the {placeholders}.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from stemlm.model.config import ModelConfig
from stemlm.train.config import TrainConfig
from stemlm.train.trainer import Trainer
from tests.small_corpus import SMALL_MODEL, TOKENIZER_VOCAB

MODEL = dict(vocab_size=TOKENIZER_VOCAB, **SMALL_MODEL)
MODEL_SETS = [f"model.{k}={v}" for k, v in MODEL.items() if k != "ffn_layers"]
RUN_FLAGS = ["--data", "{data}", "--tokenizer", "{tok}", "--seq-len", "32", "--batch-size", "4", "--device", "cpu"]
BASE = ["train", *RUN_FLAGS, "--steps", "2", "--no-progress", "--set", *MODEL_SETS]  # a tiny new run, no --out
FRESH = [*BASE, "--out", "{out}"]


def train_run(out: Path, assets: dict[str, Path], ffn: str) -> Path:
    cfg = TrainConfig(
        data=[str(assets["data"])],
        tokenizer=str(assets["tokenizer"]),
        seq_len=32,
        batch_size=4,
        steps=2,
        eval_every=0,
        eval_batches=1,
        out=str(out),
        device="cpu",
    )
    Trainer(ModelConfig(ffn=ffn, **MODEL), cfg, progress=False).fit()
    return out


def build(root: Path, assets: dict[str, Path]) -> Path:
    train_run(root / "run", assets, "stem")
    train_run(root / "dense", assets, "dense")
    model = root / "model"
    shutil.copytree(root / "run" / "checkpoints" / "step-000002", model)
    for name in ("trainer_state.json", "optimizer.safetensors", "stemlm-manifest.json"):
        (model / name).unlink()
    (root / "binary.dat").write_bytes(bytes(range(256)) * 8)
    (root / "truncated.jsonl").write_text('{"text": "The king"}\n{"text": "an unfinished')
    (root / "foreign").mkdir()
    (root / "foreign" / "notes.txt").write_text("mine")
    (root / "afile").write_text("a file")
    return root


def fill(argv: list[str], ws: Path, assets: dict[str, Path], out: Path | None = None) -> list[str]:
    names = {
        "ws": ws,
        "run": ws / "run",
        "dense": ws / "dense",
        "model": ws / "model",
        "nope": ws / "nope",
        "data": assets["data"],
        "tok": assets["tokenizer"],
        "out": out or ws / "new-run",
    }
    return [str(a).format(**names) for a in argv]
