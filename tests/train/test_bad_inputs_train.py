"""Bad input to `stemlm train` in one process: a refused run or resume is one line, exit 2, and writes nothing.

The resume cases here are a changed fact mix, the ones a launcher cannot see without reading weights (NaN / Inf
in a checkpoint, another model's optimizer state), the symlinks of a run folder, a pointer leading out of the run,
and the refusals that used to rewrite run_config.json first. Workspace: `tests/train/bad_run_workspace.py`.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from stemlm.train.logging import read_metrics
from tests.bad_input import refuse
from tests.train import bad_run_workspace
from tests.train.bad_run_workspace import FRESH, fill

STEP = "checkpoints/step-000002"


@pytest.fixture(scope="module")
def ws(tmp_path_factory, train_assets):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("STEMLM_CACHE", str(train_assets["cache"]))
        return bad_run_workspace.build(tmp_path_factory.mktemp("bad_train"), train_assets)


def copy_run(ws, tmp_path, name="run"):
    run = tmp_path / name
    shutil.copytree(ws / name, run, symlinks=True)
    return run


def resume(run, *extra):
    return ["train", "--resume", str(run), "--steps", "4", "--no-progress", "--sample-tokens", "0", *extra]


CASES = [
    (["train", "--resume", "{run}", "--no-progress"], "is already at step 2 of 2"),
    (["train", "--resume", "{run}", "--steps", "4", "--seed", "3"], "was trained with --seed 0"),
    (["train", "--resume", "{run}", "--steps", "4", "--set", "model.hidden_size=32"], "hidden_size: run 64"),
    (["train", "--resume", "{run}", "--steps", "4", "--recipe", "official"], "was trained with --recipe stemlm"),
    (["train", "--resume", "{run}", "--steps", "4", "--tokenizer", "default"], "tokenizer differs from the run's"),
    (["train", "--resume", "{run}", "--steps", "4", "--table-optim", "lazy_adamw"], "was RowwiseAdagrad"),
    (["train", "--resume", "{run}", "--steps", "4", "--data", "{ws}/binary.dat"], "looks binary"),
    # a changed fact mix is named (it used to be blamed on --data); this run trains on --data, where it does nothing
    (["train", "--resume", "{run}", "--steps", "4", "--set", "train.fact_fraction=0.3"], "fact_fraction has no effect"),
    (["train", "--resume", "{run}", "--steps", "4", "--set", "train.fact_countries=Spain"], "the fact world is mixed"),
    ([*FRESH, "--set", "train.fact_region=all"], "train.fact_region has no effect with --data"),
    ([*FRESH, "--parallel", "fsdp"], "--parallel fsdp needs --nproc N > 1"),
    ([*FRESH, "--rdzv-endpoint", "node0:29500"], "--rdzv-endpoint is for --nnodes > 1"),
    ([*FRESH, "--allow-nonfinite"], "--allow-nonfinite applies to --resume"),
    ([*FRESH, "--dist-timeout", "1e-9"], "dist_timeout must lie in [1, 604800]"),
]


@pytest.mark.parametrize(("argv", "message"), CASES)
def test_refused_in_one_process(ws, train_assets, capsys, argv, message):
    refuse(fill(argv, ws, train_assets), message, capsys, ws)


def _poison(run, value):
    path = run / STEP / "model.safetensors"
    tensors = load_file(str(path))
    name = sorted(tensors)[0]
    tensors[name].view(-1)[3] = value
    save_file(tensors, str(path), metadata={"format": "pt"})
    return name


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_weights_are_refused_on_resume(ws, tmp_path, capsys, value):
    run = copy_run(ws, tmp_path)
    name = _poison(run, value)
    line = refuse(resume(run), f"tensor {name} holds NaN or Inf", capsys, tmp_path)
    assert "--allow-nonfinite" in line


def test_allow_nonfinite_resumes_anyway(ws, tmp_path, capsys):
    from stemlm.cli.main import main

    run = copy_run(ws, tmp_path)
    _poison(run, float("nan"))
    assert main(resume(run, "--allow-nonfinite", "--json")) == 0
    assert max(r["step"] for r in read_metrics(run / "metrics.jsonl")) == 4


def test_a_dense_runs_optimizer_state_in_a_stem_checkpoint_is_one_line(ws, tmp_path, capsys):
    run = copy_run(ws, tmp_path)
    shutil.copy(ws / "dense" / STEP / "optimizer.safetensors", run / STEP / "optimizer.safetensors")
    refuse(resume(run), "belongs to another", capsys, tmp_path)


def test_an_optimizer_state_of_other_shapes_is_one_line(ws, tmp_path, capsys):
    run = copy_run(ws, tmp_path)
    path = run / STEP / "optimizer.safetensors"
    tensors = load_file(str(path))
    name = next(k for k, v in sorted(tensors.items()) if k.endswith("exp_avg") and v.ndim == 2)
    tensors[name] = torch.zeros(tensors[name].shape[0] + 1, tensors[name].shape[1])
    save_file(tensors, str(path), metadata={"format": "pt"})
    refuse(resume(run), "the state belongs to another model", capsys, tmp_path)


def test_a_missing_optimizer_state_is_one_line(ws, tmp_path, capsys):
    run = copy_run(ws, tmp_path)
    (run / STEP / "optimizer.safetensors").unlink()
    refuse(resume(run), "holds no optimizer state to resume from", capsys, tmp_path)


@pytest.mark.parametrize(
    "entry", ["run_config.json", "metrics.jsonl", "loss.png", "tensorboard", "checkpoints/latest.json", STEP]
)
def test_resume_refuses_symlinks_in_the_run(ws, tmp_path, capsys, entry):
    run = copy_run(ws, tmp_path)
    link = run / entry
    moved = tmp_path / "outside" / entry.replace("/", "_")
    moved.parent.mkdir(exist_ok=True)
    shutil.move(link, moved)
    link.symlink_to(moved)
    refuse(resume(run), f"{entry} is a symlink", capsys, tmp_path)


@pytest.mark.parametrize("entry", ["run_config.json", "metrics.jsonl", "loss.png", "checkpoints"])
def test_a_new_run_refuses_symlinks_in_its_folder(ws, train_assets, tmp_path, capsys, entry):
    out = tmp_path / "new"
    out.mkdir()
    target = tmp_path / "precious"
    target.mkdir() if entry == "checkpoints" else target.write_text("keep me")
    (out / entry).symlink_to(target)
    refuse(fill(FRESH, ws, train_assets, out=out), f"{entry} is a symlink", capsys, tmp_path)


@pytest.mark.parametrize("path", ["/tmp", "../../../elsewhere/step-000002", "step-000002/../../x", "sub/step-000002"])
def test_a_pointer_out_of_the_run_is_one_line(ws, tmp_path, capsys, path):
    run = copy_run(ws, tmp_path)
    (run / "checkpoints" / "latest.json").write_text(json.dumps({"step": 2, "path": path}))
    refuse(resume(run), "not at a step folder", capsys, tmp_path)


def test_a_refused_resume_leaves_run_config_as_it_was(ws, tmp_path, capsys):
    # A resume refused only after the model is built (the weights check) has written nothing either.
    run = copy_run(ws, tmp_path)
    _poison(run, float("nan"))
    before = (run / "run_config.json").read_bytes()
    refuse(resume(run, "--eval-every", "1"), "holds NaN or Inf", capsys, tmp_path)
    assert (run / "run_config.json").read_bytes() == before


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("train.fact_fraction=0.3", "; it cannot resume with fact_fraction=0.3 (the fact statements"),
        ("train.fact_countries=Spain,France", "it cannot resume with fact_countries=['Spain', 'France']"),
        ("train.fact_region=all", "it cannot resume with fact_region='all'"),
    ],
)
def test_a_changed_fact_mix_is_named_on_resume(ws, tmp_path, capsys, setting, message):
    # The run as if it had trained on the embedded corpus with its fact mix (the trainer state says so).
    run = copy_run(ws, tmp_path)
    path = run / STEP / "trainer_state.json"
    state = json.loads(path.read_text())
    state["config"]["train"]["data"] = None
    path.write_text(json.dumps(state))
    line = refuse(resume(run, "--set", setting), message, capsys, tmp_path)
    assert "--data" not in line
