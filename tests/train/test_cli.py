"""`stemlm train` / `python -m stemlm train`: a tiny end-to-end run, resume, and one-line errors with exit code 2.

Most calls go through `stemlm.cli.main.main([...])` in-process; one real subprocess checks the module entry
point. Run: `OMP_NUM_THREADS=1 python -m pytest tests/train/test_cli.py -q`.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import subprocess
import sys

import pytest
import torch

from stemlm.checkpoint.runs import load_checkpoint
from stemlm.cli.main import build_parser, main
from stemlm.flags import settings
from stemlm.model import build_model
from stemlm.model.config import ModelConfig
from stemlm.train import state as state_mod
from stemlm.train.config import SECTIONS, TrainConfig
from stemlm.train.setup import RunRequest, requested_model

MODEL = [
    "model.hidden_size=64",
    "model.num_hidden_layers=2",
    "model.intermediate_size=128",
    "model.num_attention_heads=4",
    "model.max_position_embeddings=64",
]


@pytest.fixture
def small(train_assets):
    """Arguments for a 4-step tiny run on the test corpus (append --out)."""
    return [
        "train",
        "--data",
        str(train_assets["data"]),
        "--tokenizer",
        str(train_assets["tokenizer"]),
        "--steps",
        "4",
        "--seq-len",
        "32",
        "--batch-size",
        "4",
        "--eval-batches",
        "2",
        "--threads",
        "1",
        "--no-progress",
        "--sample-tokens",
        "5",
        "--set",
        *MODEL,
        "train.eval_every=2",
    ]


def run_cli(args, capsys):
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_train_json_report_and_resume(tmp_path, small, capsys):
    threads = torch.get_num_threads()
    code, out, err = run_cli([*small, "--out", str(tmp_path / "run"), "--json"], capsys)
    assert code == 0, err
    report = json.loads(out)  # exactly one JSON object on stdout
    assert report["steps"] == 4 and report["heldout_loss"] > 0 and isinstance(report["sample"]["completion"], str)
    config = json.loads((tmp_path / "run" / "run_config.json").read_text())
    assert config["model"]["vocab_size"] == 320  # set from the 320-token tokenizer
    assert config["model"]["hidden_size"] == 64 and config["train"]["eval_every"] == 2
    model_config = ModelConfig.from_dict(config["model"])
    assert report["accounting"]["parameters_total"] == build_model(model_config, device="meta").num_parameters()
    assert torch.get_num_threads() == threads  # the CLI restores the caller's thread count
    model, tok = load_checkpoint(tmp_path / "run")  # the trainer checkpoint is a model checkpoint too
    assert tok is not None and model.config.to_hf_dict() == model_config.to_hf_dict()

    code, out, err = run_cli(
        ["train", "--resume", str(tmp_path / "run"), "--steps", "6", "--no-progress", "--sample-tokens", "0"], capsys
    )
    assert code == 0, err
    assert "run " in out and "held-out loss" in out
    steps = [
        json.loads(line)["step"]
        for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
        if '"train"' in line
    ]
    assert steps == [1, 2, 3, 4, 5, 6]


def one_line_error(code, out, err, fragment, after_progress=False):
    """Exit code 2 and the error as one line: the only stderr line, or the last one after eval lines."""
    assert code == 2
    lines = err.strip().splitlines()
    assert after_progress or len(lines) == 1, err
    assert lines[-1].startswith("stemlm train: error: ") and fragment in lines[-1], lines[-1]
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "extra, fragment",
    [
        (["--steps", "0"], "steps must be a positive integer, got 0"),
        (["--steps", "-5"], "steps must be a positive integer, got -5"),
        (["--lr", "-1"], "lr must be a positive number"),
        (["--warmup", "10"], "warmup (10) must be smaller than steps (4)"),
        (["--preset", "huge"], "unknown preset 'huge'"),
        (["--set", "model.hiden_size=3"], "unknown config key 'hiden_size'"),
        (["--set", "train.stepz=3"], "unknown training config key 'stepz'"),
        (["--set", "hidden_size=3"], "prefix the key with model. or train."),
        (["--set", "model.hidden_size=big"], "'hidden_size' expects"),
        (["--table-lr", "fast"], "--table-lr 'fast'"),
        (["--sample-tokens", "-1"], "--sample-tokens must be >= 0"),
        (["--threads", "0"], "threads must be a positive integer"),
        (["--batch-size", "100000"], "lower the batch size or seq_len, or add data"),
        (["--seq-len", "128"], "exceeds the model's max_position_embeddings 64"),
        (["--tokenizer", "no/such/tokenizer.json"], "tokenizer file not found"),
        (["--resume", "no/such/run"], "does not exist"),
        (["--init-from", "no/such/ckpt"], "does not exist"),
        (["--tables", "host", "--table-optim", "adamw"], "tables=host needs a row-sparse table optimizer"),
        (["--set", "train.sampling=shuffled"], "sampling must be one of auto, epoch, uniform"),
        (["--prefetch", "-1"], "prefetch must be a non-negative integer"),
    ],
)
def test_bad_arguments(tmp_path, small, capsys, extra, fragment):
    one_line_error(*run_cli([*small, "--out", str(tmp_path / "run"), *extra], capsys), fragment)
    assert not (tmp_path / "run").exists()


def test_host_tables_report(tmp_path, small, capsys):
    code, out, _ = run_cli(
        [*small, "--out", str(tmp_path / "run"), "--tables", "host", "--table-optim", "lazy_adamw"], capsys
    )
    assert code == 0
    # Both layers are STEM (tiny: "all"): two 320 x 128 fp32 tables, their two lazy_adamw moments and int64 row steps.
    table = 2 * 320 * 128 * 4
    saved = table + 2 * table + 2 * 320 * 8
    assert f"tables in host memory: {saved / 2**20:,.1f} MiB kept off the cpu ({table / 2**20:,.1f} MiB tables" in out
    assert "model GFLOP/s = " in out and " per CPU-second = " in out  # a CPU run: both clocks
    assert "the best plain matmul at the model's shapes, measured now in the same clock" in out


@pytest.mark.parametrize(
    "content, fragment",
    [(None, "data path not found"), ("", "is empty"), (b"\x00\x01binary", "looks binary")],
)
def test_bad_data_files(tmp_path, train_assets, capsys, content, fragment):
    path = tmp_path / "data.txt"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    args = ["train", "--data", str(path), "--tokenizer", str(train_assets["tokenizer"]), "--out", str(tmp_path / "r")]
    one_line_error(*run_cli(args, capsys), fragment)


def test_unwritable_run_folder(tmp_path, small, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("a regular file, so nothing can be created below it (works even as root)")
    one_line_error(*run_cli([*small, "--out", str(blocker / "run")], capsys), "cannot write the run folder")


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_run_folder(tmp_path, small, capsys):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        one_line_error(*run_cli([*small, "--out", str(folder / "run")], capsys), "cannot write the run folder")
    finally:
        folder.chmod(0o700)


def test_disk_full_while_saving(tmp_path, small, capsys, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(state_mod, "save_file", full)
    code, out, err = run_cli([*small, "--out", str(tmp_path / "run"), "--set", "train.eval_every=0"], capsys)
    one_line_error(code, out, err, "No space left on device", after_progress=True)
    assert not any(p.name.startswith(".step-") for p in (tmp_path / "run" / "checkpoints").iterdir())


def test_resume_with_other_model_or_tokenizer(tmp_path, small, capsys):
    assert run_cli([*small, "--out", str(tmp_path / "run"), "--sample-tokens", "0"], capsys)[0] == 0
    resume = ["train", "--resume", str(tmp_path / "run"), "--steps", "8"]
    one_line_error(*run_cli([*resume, "--set", "model.hidden_size=32"], capsys), "hidden_size: run 64, requested 32")
    one_line_error(*run_cli([*resume, "--ffn", "dense"], capsys), "ffn: run 'stem', requested 'dense'")
    one_line_error(*run_cli([*resume, "--tokenizer", "default"], capsys), "tokenizer differs from the run's")
    one_line_error(*run_cli([*resume, "--init-from", "x"], capsys), "cannot be combined")
    one_line_error(*run_cli([*small, "--out", str(tmp_path / "run")], capsys), "already has checkpoints")


def test_rerun_over_a_finished_run_with_its_reports_points_to_resume(tmp_path, small, capsys):
    run = tmp_path / "run"
    assert run_cli([*small, "--out", str(run), "--sample-tokens", "0"], capsys)[0] == 0
    assert run_cli(["analyze", str(run), "--only", "nearest"], capsys)[0] == 0  # writes RUN/analysis
    assert run_cli(["cache-sim", str(run), "--max-tokens", "200", "--fractions", "0.1"], capsys)[0] == 0
    before = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert {"analysis", "cache-sim"} <= {p.name for p in run.iterdir()}
    code, out, err = run_cli([*small, "--out", str(run)], capsys)
    one_line_error(code, out, err, f"continue it with --resume {run} --steps N (it finished its 4 steps; N > 4")
    assert {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_every_flag_has_help():
    missing = [a.dest for a in train_parser()._actions if not a.help]
    assert not missing


def train_parser():
    return next(a for a in build_parser()._actions if a.dest == "command").choices["train"]


@pytest.mark.parametrize("cls", [TrainConfig, RunRequest])
def test_every_setting_is_a_flag_in_its_section(cls):
    shown = [
        (g.title, [a for a in g._group_actions if a.help != argparse.SUPPRESS]) for g in train_parser()._action_groups
    ]
    groups = {title: {a.dest: a for a in actions} for title, actions in shown}  # an old name is a hidden flag
    for flag, f, spec in settings(cls):
        action = groups[SECTIONS[spec.section]][f.name]
        assert action.option_strings == [flag] and action.default is None, f.name


def test_flags_become_the_run_request():
    argv = [
        *("train", "--preset", "tiny-dense", "--ffn", "stem", "--ffn-layers", "1,3", "--fit-vocab", "--tokenizer"),
        *("gpt2", "--init-from", "ck", "--steps", "5", "--lr", "0.01", "--table-lr", "x3", "--compile", "--train"),
        *("tables", "--data", "a", "b", "--set", "model.hidden_size=32", "train.eval_every=2", "train.steps=9"),
        "--no-progress",
    ]
    request = RunRequest.from_args(build_parser().parse_args(argv))
    same = {"preset": "tiny-dense", "tokenizer": "gpt2", "init_from": "ck"}  # flags of both TrainConfig and the request
    assert request.changes == {
        **same,
        **{"eval_every": 2, "steps": 5, "lr": 0.01, "compile": True, "trainable": "tables", "data": ["a", "b"]},
        **{"table_lr": None, "table_lr_scale": 3.0},
    }
    assert request == RunRequest(
        request.changes,
        ffn="stem",
        ffn_layers="1,3",
        model_sets=["model.hidden_size=32"],
        fit_vocab=True,
        **same,
        progress=False,
    )


def test_stem_layers_is_the_old_name_of_ffn_layers():
    old, new = (
        RunRequest.from_args(build_parser().parse_args(["train", flag, "odd"]))
        for flag in ("--stem-layers", "--ffn-layers")
    )
    assert old == new and new.ffn_layers == "odd"
    assert requested_model(old, None)[0].ffn_layers == "odd"
    helped = train_parser().format_help()
    assert (
        "--ffn-layers SPEC" in helped and "(old name: --stem-layers)" in helped and "--stem-layers SPEC" not in helped
    )


def test_module_entry_point_reports_one_line_error(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "stemlm", "train", "--steps", "0", "--out", str(tmp_path / "r")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 2
    assert (
        proc.stderr.strip() == "stemlm train: error: invalid training config: steps must be a positive integer, got 0"
    )
    assert proc.stdout == ""
