"""Bad input to `stemlm train --nproc N`: refused by the launcher before any rank starts, in one line, exit 2.

Each case runs in-process (`tests/bad_input.refuse`: exit 2, one stderr line naming the problem, the workspace
unchanged) with the launcher's process start replaced by a failure, so a case that would start ranks fails the
test instead. The workspace (`tests/train/bad_run_workspace.py`) holds finished 2-step runs and a model folder.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import stemlm.train.parallel.workers
from tests.bad_input import refuse
from tests.train import bad_run_workspace
from tests.train.bad_run_workspace import BASE, FRESH, fill

NPROC = ["--nproc", "2"]
RESUME = ["train", "--resume", "{run}", "--steps", "4", "--no-progress", *NPROC]

CASES = [
    # (argv, a piece of the one line)
    ([*FRESH, *NPROC, "--tokenizer", "{nope}/tokenizer.json"], "tokenizer file not found"),
    ([*FRESH, *NPROC, "--init-from", "{nope}"], "nope"),
    ([*FRESH, *NPROC, "--init-from", "{ws}/afile"], "afile"),
    ([*BASE, *NPROC, "--out", "{model}"], "is a model checkpoint folder"),
    ([*BASE, *NPROC, "--out", "{ws}/afile"], "is a file"),
    ([*BASE, *NPROC, "--out", "{ws}/foreign"], "not a stemlm run"),
    ([*BASE, *NPROC, "--out", "{run}"], "already has checkpoints"),
    ([*FRESH, *NPROC, "--memory-snapshot"], "--memory-snapshot needs a CUDA device"),
    ([*FRESH, *NPROC, "--data", "{ws}/binary.dat"], "looks binary"),
    ([*FRESH, *NPROC, "--data", "{ws}/truncated.jsonl"], "truncated.jsonl line 2: invalid JSON"),
    ([*FRESH, *NPROC, "--data", "{nope}"], "nope"),
    ([*FRESH, *NPROC, "--tokenizer", "default"], "vocab_size"),  # ids past the model's 320 rows
    ([*FRESH, *NPROC, "--seq-len", "128"], "exceeds the model's max_position_embeddings 64"),
    ([*FRESH, *NPROC, "--dist-timeout", "1e-9"], "dist_timeout must lie in [1, 604800]"),
    ([*FRESH, *NPROC, "--dist-timeout", "1e300"], "dist_timeout must lie in [1, 604800]"),
    ([*FRESH, *NPROC, "--dist-timeout", "nan"], "dist_timeout must be a positive number"),
    ([*FRESH, *NPROC, "--dist-timeout", "0"], "dist_timeout must be a positive number"),
    ([*FRESH, "--nproc", "3"], "global batch size 4 does not split over 3 processes"),
    ([*FRESH, "--nproc", "0"], "--nproc and --nnodes must be at least 1"),
    ([*FRESH, "--nproc", "-2"], "--nproc and --nnodes must be at least 1"),
    ([*FRESH, *NPROC, "--nnodes", "0"], "--nproc and --nnodes must be at least 1"),
    ([*FRESH, "--parallel", "fsdp"], "--parallel fsdp needs --nproc N > 1"),
    ([*FRESH, "--parallel", "ddp"], "--parallel ddp needs --nproc N > 1"),
    ([*FRESH, *NPROC, "--rdzv-endpoint", "node0:29500"], "--rdzv-endpoint is for --nnodes > 1"),
    ([*FRESH, "--rdzv-endpoint", "node0:29500"], "--rdzv-endpoint is for --nnodes > 1"),
    ([*FRESH, "--nnodes", "2"], "--nnodes > 1 needs --rdzv-endpoint"),
    ([*FRESH, "--nnodes", "2", "--rdzv-endpoint", "garbage"], "is not HOST:PORT"),
    ([*FRESH, "--nnodes", "2", "--rdzv-endpoint", "node0:"], "is not HOST:PORT"),
    ([*FRESH, "--nnodes", "2", "--rdzv-endpoint", ":29500"], "is not HOST:PORT"),
    ([*FRESH, "--nnodes", "2", "--rdzv-endpoint", "node0:99999"], "is not HOST:PORT"),
    ([*FRESH, "--nnodes", "2", "--rdzv-endpoint", "node0:http"], "is not HOST:PORT"),
    ([*FRESH, "--nnodes", "2", "--rdzv-endpoint", "a b:29500"], "is not HOST:PORT"),
    ([*FRESH, "--nnodes", "2", "--rdzv-endpoint", "user@node0:29500"], "is not HOST:PORT"),
    ([*FRESH, *NPROC, "--allow-nonfinite"], "--allow-nonfinite applies to --resume"),
    ([*FRESH, *NPROC, "--warmup", "5"], "warmup (5) must be smaller than steps (2)"),
    (["train", "--resume", "{run}", "--no-progress", *NPROC], "is already at step 2 of 2"),
    ([*RESUME, "--set", "model.hidden_size=128"], "hidden_size: run 64, requested 128"),
    ([*RESUME, "--ffn", "dense"], "model config differs from the checkpoint"),
    ([*RESUME, "--seed", "7"], "was trained with --seed 0; it cannot resume with --seed 7"),
    ([*RESUME, "--recipe", "official"], "was trained with --recipe stemlm"),
    ([*RESUME, "--tokenizer", "default"], "tokenizer differs from the run's"),
    ([*RESUME, "--init-from", "{model}"], "--resume and --init-from cannot be combined"),
    ([*RESUME, "--data", "{ws}/truncated.jsonl"], "truncated.jsonl line 2: invalid JSON"),
    ([*RESUME[:-2], "--nproc", "3"], "global batch size 4 does not split over 3 processes"),
    (["train", "--resume", "{nope}", *NPROC], "does not exist"),
    (["train", "--resume", "{model}", *NPROC], "is not a training run folder"),
    (["train", "--resume", "{ws}/foreign", *NPROC], "is neither a checkpoint folder"),
]
if torch.cuda.is_available():
    CASES.append(([*FRESH, *NPROC, "--device", "cuda", "--memory-snapshot"], "is not valid"))
else:
    CASES.append(([*FRESH, *NPROC, "--device", "cuda"], "device cuda requested but torch sees no CUDA device"))


@pytest.fixture(scope="module")
def ws(tmp_path_factory, train_assets):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("STEMLM_CACHE", str(train_assets["cache"]))
        return bad_run_workspace.build(tmp_path_factory.mktemp("bad_launch"), train_assets)


@pytest.fixture(autouse=True)
def _no_ranks(monkeypatch):
    def started(*args, **kwargs):
        raise AssertionError("the launcher started ranks for a bad input")

    monkeypatch.setattr(stemlm.train.parallel.workers, "run_torchrun", started)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_NTASKS", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(("argv", "message"), CASES)
def test_refused_before_any_rank_starts(ws, train_assets, capsys, argv, message):
    refuse(fill(argv, ws, train_assets), message, capsys, ws)


def _copy_run(ws, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(ws / "run", run, symlinks=True)
    return run


@pytest.mark.parametrize(
    "entry", ["run_config.json", "metrics.jsonl", "loss.png", "launch.log", "checkpoints/latest.json"]
)
def test_resume_refuses_a_symlinked_run_file(ws, train_assets, tmp_path, capsys, entry):
    run = _copy_run(ws, tmp_path)
    outside = tmp_path / "outside.txt"
    outside.write_text("not the run's")
    link = run / entry
    link.unlink(missing_ok=True)
    link.symlink_to(outside)
    refuse(fill(["train", "--resume", str(run), "--steps", "4", *NPROC], ws, train_assets), entry, capsys, tmp_path)


def test_resume_refuses_a_symlinked_checkpoints_folder(ws, train_assets, tmp_path, capsys):
    run = _copy_run(ws, tmp_path)
    shutil.move(run / "checkpoints", tmp_path / "elsewhere")
    (run / "checkpoints").symlink_to(tmp_path / "elsewhere")
    argv = ["train", "--resume", str(run), "--steps", "4", *NPROC]
    refuse(fill(argv, ws, train_assets), "checkpoints is a symlink", capsys, tmp_path)


def test_a_pointer_out_of_the_run_is_refused(ws, train_assets, tmp_path, capsys):
    run = _copy_run(ws, tmp_path)
    other = _copy_run(ws, tmp_path / "other")
    pointer = run / "checkpoints" / "latest.json"
    pointer.write_text(json.dumps({"step": 2, "path": str(other / "checkpoints" / "step-000002")}))
    argv = ["train", "--resume", str(run), "--steps", "4", *NPROC]
    refuse(fill(argv, ws, train_assets), "not at a step folder", capsys, tmp_path)
    pointer.write_text(json.dumps({"step": 2, "path": "../../other/run/checkpoints/step-000002"}))
    refuse(fill(argv, ws, train_assets), "not at a step folder", capsys, tmp_path)


def test_fresh_run_into_a_folder_with_a_symlinked_config_is_refused(ws, train_assets, tmp_path, capsys):
    out = tmp_path / "new"
    out.mkdir()
    (tmp_path / "target.json").write_text("{}")
    (out / "run_config.json").symlink_to(tmp_path / "target.json")
    refuse(fill([*FRESH, *NPROC], ws, train_assets, out=out), "run_config.json is a symlink", capsys, tmp_path)


def test_more_local_ranks_than_gpus_is_refused(ws, train_assets, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    argv = [*BASE, "--out", "{out}", "--device", "cuda", *NPROC]
    refuse(fill(argv, ws, train_assets), "--nproc 2 starts 2 processes on this node but it has 1 GPUs", capsys, ws)


def test_the_batch_check_uses_the_resumed_runs_batch(ws, train_assets, capsys):
    # batch 4 (the run's) over 3 ranks: refused though no --batch-size is given
    argv = ["train", "--resume", "{run}", "--steps", "4", "--nproc", "3"]
    refuse(fill(argv, ws, train_assets), "global batch size 4", capsys, ws)


def test_rdzv_host_forms_that_are_accepted(monkeypatch):
    from stemlm.train.parallel.launch import check_launch_flags

    for endpoint in ("node0:29500", "10.0.0.1:1", "[::1]:29500", "node-0.cluster:65535"):
        check_launch_flags(2, 2, endpoint, None)  # no error
    check_launch_flags(1, 1, None, None)
    check_launch_flags(2, 1, None, "fsdp")


def test_a_run_is_finished_when_its_newest_checkpoint_is_its_last_step(ws, tmp_path):
    from stemlm.train.guard import run_finished

    assert run_finished(ws / "run")
    run = _copy_run(ws, tmp_path)
    state = run / "checkpoints" / "step-000002" / "trainer_state.json"
    data = json.loads(state.read_text())
    data["config"]["train"]["steps"] = 4  # stopped at step 2 of 4
    state.write_text(json.dumps(data))
    assert not run_finished(run)
    assert not run_finished(tmp_path / "no-run")
