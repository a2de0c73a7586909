"""The bad-input suite: every subcommand given bad input exits 2 with exactly one stderr line naming the problem, and
changes nothing on disk (the whole workspace, folders included, is hashed before and after each case).

The cases (`tests/cli/bad_input_cases.py`) run in-process through `stemlm.cli.main.main(argv)` on a tiny workspace
built once: a STEM and a dense checkpoint with the default tokenizer, a run folder, a checkpoint whose tokenizer
does not fit its rows, a damaged one, files and folders to be refused as outputs. Placeholders in an argv: {ck}
{dense} {run} {ws} {nope} {file} {full} {bin} {text} {tokdir} {smalltok} {corrupt} {legacy} {outdir} {factrun} (a
run that mixed in one country's facts). API cases at the end assert StemlmError. The newest surfaces (`eval edits`,
the fact-world settings, `experiment compare --variants`) are tried argument by argument and in the combinations
that must agree.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from stemlm.checkpoint.folder import save_pretrained
from stemlm.cli.main import main
from stemlm.data.tokenizer import default_tokenizer, save_tokenizer, train_bpe
from stemlm.errors import StemlmError
from stemlm.model import build_model
from stemlm.model.config import ModelConfig
from tests.bad_input import refuse, tree
from tests.cli.bad_input_cases import CASES
from tests.sharded import write_sharded


def tiny(ffn: str = "stem", vocab: int = 8192) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=64,
        ffn=ffn,
        ffn_layers="1",
    )


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("bad_inputs")
    tok = default_tokenizer()
    save_pretrained(build_model(tiny()), root / "ck", tokenizer=tok)
    save_pretrained(build_model(tiny("dense")), root / "dense" / "model", tokenizer=tok)
    save_pretrained(build_model(tiny()), root / "run" / "checkpoints" / "step-000001", tokenizer=tok)
    (root / "run" / "run_config.json").write_text("{}")
    small = train_bpe([(root / "ck" / "config.json").read_text() * 20], vocab_size=300)
    save_pretrained(build_model(tiny()), root / "smalltok", tokenizer=small)
    save_pretrained(build_model(tiny()), root / "corrupt", tokenizer=tok)
    weights = root / "corrupt" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4096] + b"\xff" * 4096)
    shutil.copytree(root / "ck", root / "legacy")
    (root / "legacy" / "stemlm-manifest.json").unlink()
    (root / "file.txt").write_text("a file\n")
    (root / "full").mkdir()
    (root / "full" / "notes.txt").write_text("the user's notes\n")
    (root / "binary.bin").write_bytes(bytes(range(256)) * 64)
    (root / "text.txt").write_text("The king of Spain spoke to the queen of France. " * 40)
    save_tokenizer(tok, root / "tokdir")
    (root / "outdir").mkdir()  # an empty folder: a fine output, so failures must leave it empty
    # Sharded checkpoints (as `stemlm train --nproc N` writes them), intact and damaged four ways.
    for name in ("sharded", "shardmiss", "shardflip", "shardextra", "shardtrunc"):
        write_sharded(build_model(tiny()), root / name, tok)
    (root / "shardmiss" / "dcp" / "shard-00001-model-00001-of-00002.safetensors").unlink()
    flip = root / "shardflip" / "dcp" / "shard-00001-model-00002-of-00002.safetensors"
    data = bytearray(flip.read_bytes())
    data[-100:] = bytes(255 - b for b in data[-100:])  # tensor bytes: the header still parses
    flip.write_bytes(bytes(data))
    shutil.copy(flip, root / "shardextra" / "dcp" / "shard-00003-model-00001-of-00001.safetensors")
    trunc = root / "shardtrunc" / "dcp" / "shard-00001-model-00002-of-00002.safetensors"
    trunc.write_bytes(trunc.read_bytes()[:-64])
    # A run whose trainer state says it mixed in the facts of one country (what `eval edits --countries auto` reads).
    save_pretrained(build_model(tiny()), root / "factrun" / "checkpoints" / "step-000001", tokenizer=tok)
    (root / "factrun" / "run_config.json").write_text("{}")
    train = {"data": None, "fact_fraction": 0.8, "fact_region": "Europe", "fact_countries": ["Spain"]}
    state = {"step": 1, "config": {"train": train}}
    (root / "factrun" / "checkpoints" / "step-000001" / "trainer_state.json").write_text(json.dumps(state))
    (root / "cwd").mkdir()
    return root


def fill(argv: list[str], ws: Path) -> list[str]:
    names = dict(
        ck=ws / "ck",
        dense=ws / "dense" / "model",
        run=ws / "run",
        ws=ws,
        nope=ws / "does-not-exist",
        file=ws / "file.txt",
        full=ws / "full",
        bin=ws / "binary.bin",
        text=ws / "text.txt",
        tokdir=ws / "tokdir",
        smalltok=ws / "smalltok",
        corrupt=ws / "corrupt",
        legacy=ws / "legacy",
        outdir=ws / "outdir",
        sharded=ws / "sharded",
        shardmiss=ws / "shardmiss",
        shardflip=ws / "shardflip",
        shardextra=ws / "shardextra",
        shardtrunc=ws / "shardtrunc",
        factrun=ws / "factrun",
    )
    return [a.format(**{k: str(v) for k, v in names.items()}) for a in argv]


@pytest.mark.parametrize("argv, message", CASES, ids=[" ".join(c[0])[:60] for c in CASES])
def test_bad_input_is_one_line_exit_2_and_nothing_changes(ws, capsys, monkeypatch, argv, message):
    if "cuda" in argv and torch.cuda.is_available():
        pytest.skip("a machine with CUDA")
    monkeypatch.chdir(ws / "cwd")  # commands with a default output folder would write here
    monkeypatch.setenv("STEMLM_CACHE", str(ws / "cwd" / ".cache"))
    refuse(fill(argv, ws), message, capsys, ws)


def test_the_suite_covers_every_subcommand():
    from stemlm.cli.main import SUBCOMMANDS

    assert len(CASES) >= 100
    assert set(SUBCOMMANDS) <= {argv[0] for argv, _ in CASES}


def test_a_missing_extra_is_one_line_naming_it(ws, capsys, monkeypatch):
    for module in [m for m in sys.modules if m == "lm_eval" or m.startswith("lm_eval.")]:
        monkeypatch.delitem(sys.modules, module)
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval -> ImportError, as when not installed
    assert main(["eval", "lm", str(ws / "ck")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == ["stemlm eval: error: this needs lm-eval: pip install 'stemlm[eval]'"]


# ----- the same problems through the Python API: StemlmError, never a bare exception -----
def _api_cases(ws: Path):
    from stemlm.checkpoint.runs import load_checkpoint
    from stemlm.convert.driver import convert_checkpoint
    from stemlm.edit.evaluate import evaluate_checkpoint_edits
    from stemlm.experiments.compare import CompareConfig, run_command
    from stemlm.experiments.contract import ExperimentLog
    from stemlm.inference.generate import generate
    from stemlm.train.config import TrainConfig

    model, log = build_model(tiny()), ExperimentLog()
    return [
        lambda: ModelConfig(rope_theta=float("inf")),
        lambda: ModelConfig(hidden_size=0),
        lambda: TrainConfig(seq_len=0),
        lambda: TrainConfig(lr=float("nan")),
        lambda: TrainConfig(max_skipped=-1),
        lambda: save_pretrained(model, ws / "full"),
        lambda: save_pretrained(model, ws / "file.txt", force=True),
        lambda: convert_checkpoint(ws / "dense" / "model", "odd", ws / "dense", force=True),
        lambda: load_checkpoint(ws / "smalltok"),
        lambda: load_checkpoint(ws / "nope"),
        lambda: generate(model, [1, 2], 3, temperature=float("nan")),
        lambda: generate(model, [1, 2], 3, temperature=float("inf")),
        lambda: TrainConfig(fact_relations=[]),
        lambda: TrainConfig(fact_region="Mars"),
        lambda: TrainConfig(fact_countries=["Spain", "Spain"]),
        lambda: evaluate_checkpoint_edits(str(ws / "ck"), "capital", 2, seed=0, countries="Spain,Spain"),
        lambda: evaluate_checkpoint_edits(str(ws / "ck"), "capital", 2, seed=0, countries="Spain"),
        lambda: run_command(CompareConfig(kinds=("dense",), variants=("reference",), out=str(ws / "x")), log),
        lambda: run_command(CompareConfig(kinds=("engram",), model_overrides=["engram_variant=reference"]), log),
    ]


API_CASES = 19


def test_the_api_case_count():
    assert len(_api_cases(Path("."))) == API_CASES


@pytest.mark.parametrize("index", range(API_CASES))
def test_api_bad_input_raises_stemlm_error(ws, index):
    before = tree(ws)
    with pytest.raises(StemlmError):
        _api_cases(ws)[index]()
    assert tree(ws) == before


def test_corrupt_json_state_in_a_run_is_one_line(ws, capsys, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(ws / "run", run)
    ckpt = run / "checkpoints" / "step-000001"
    state = {"format": "stemlm-trainer-state-v1", "step": "seven", "config": {}}
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    before = tree(tmp_path)
    assert main(["train", "--resume", str(run)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "'step' must be a non-negative integer" in lines[0], lines
    assert tree(tmp_path) == before
    assert os.path.isdir(ckpt)
