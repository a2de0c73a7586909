"""The trainer on 2 gloo processes: same model as 1 process, checkpoints that reshard, failures that end the job.

The `runs` fixture trains every scenario once: 1-process references here, then one fork of 2 ranks running
`Trainer` (fits, then resumes of copied checkpoints). Tests compare the 2-rank outputs with the
1-process ones (losses, held-out losses, final weights, optimizer state), check the logged table traffic
against a count made here from the data, and run the real `stemlm train --nproc 2` command with a rank killed
mid-run and resumed. Run: `OMP_NUM_THREADS=1 python -m pytest tests/train/parallel/test_train_dist.py -q`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from stemlm.checkpoint.folder import read_state
from stemlm.checkpoint.runs import resolve_checkpoint
from stemlm.cli.main import build_parser, main
from stemlm.cli.train_launch import worker_argv
from stemlm.data import TokenDataset, load_corpus, load_tokenizer
from stemlm.data.prepare import prepare
from stemlm.errors import StemlmError
from stemlm.model import build_model
from stemlm.placement.table_optim import flatten_optimizer_state
from stemlm.train.config import TrainConfig
from stemlm.train.logging import read_metrics
from stemlm.train.trainer import Trainer

from .conftest import VOCAB, fork_ranks, free_port, model_config, train_config

TOL = 1e-5
# name -> (ffn, training overrides); grad_accum 2 exercises no_sync / set_requires_gradient_sync(False).
FITS = {
    "stem-ddp": ("stem", dict(parallel="ddp", table_optim="adamw", grad_accum=2, traffic_every=4)),
    "stem-fsdp": ("stem", dict(parallel="fsdp", table_optim="lazy_adamw")),
    "dense-ddp": ("dense", dict(parallel="ddp")),
    "dense-fsdp": ("dense", dict(parallel="fsdp", grad_accum=2)),
    # A `stemlm data prepare` folder: rank 0 opens it, each rank reads only its rows of the global batch.
    "stem-ddp-shards": ("stem", dict(parallel="ddp", grad_accum=2, data="shards")),
    # Memory levers under FSDP2: per-block activation checkpointing (applied before fully_shard), chunked loss.
    "stem-fsdp-memory": ("stem", dict(parallel="fsdp", activation_checkpointing=True, loss_chunk=24)),
    # The fused loss reads the lm_head weight inside the root module's forward, where FSDP2 has gathered it.
    "stem-fsdp-fused": ("stem", dict(parallel="fsdp", grad_accum=2, loss_chunk=24, fused_loss=True)),
}
# bf16 autocast; on 2 ranks FSDP2 also gathers the weights in bf16 (MixedPrecisionPolicy), so it is compared to
# the 1-process bf16 run at bf16 precision rather than at TOL.
BF16_FITS = {
    "dense-fsdp-bf16": ("dense", dict(parallel="fsdp", dtype="bf16", steps=3, eval_every=3, save_every=3)),
    "stem-ddp-bf16": ("stem", dict(parallel="ddp", dtype="bf16", steps=3, eval_every=3, save_every=3)),
}
# name -> (run folder whose step-3 checkpoint is resumed on 2 ranks, overrides)
RESUMES = {
    "stem-fsdp": ("two/stem-fsdp", {}),
    "stem-ddp-as-fsdp": ("two/stem-ddp", {"parallel": "fsdp"}),
    "one-stem-ddp": ("one/stem-ddp", {}),  # 1-process checkpoints
    "one-stem-fsdp": ("one/stem-fsdp", {}),
}


def train_records(run) -> list[dict]:
    return [r for r in read_metrics(run / "metrics.jsonl") if r["kind"] == "train"]


def losses(run, key="loss", kind="train") -> torch.Tensor:
    return torch.tensor([r[key] for r in read_metrics(run / "metrics.jsonl") if r["kind"] == kind])


def close(a, b, **kw) -> None:
    torch.testing.assert_close(a, b, rtol=0, atol=TOL, **kw)


def _layout_check(rank: int) -> dict:
    """Strided rows -> blocks -> strided rows on an odd vocabulary, against slices of the full tensor."""
    from stemlm.placement.row_sharded import ShardedTables
    from stemlm.train.parallel.checkpoint import block_range, blocks_to_strided, strided_to_blocks

    tables = ShardedTables(build_model(model_config("stem"), seed=0))
    full = torch.arange(VOCAB * 3, dtype=torch.float64).reshape(VOCAB, 3)
    local = full[rank::2]
    block = strided_to_blocks(local, tables)
    start, stop = block_range(VOCAB, 2, rank)
    return {"block": torch.equal(block, full[start:stop]), "back": torch.equal(blocks_to_strided(block, tables), local)}


def fit_config(assets, root, side: str, name: str) -> TrainConfig:
    overrides = dict({**FITS, **BF16_FITS}[name][1])
    if overrides.get("data") == "shards":
        overrides.update(data=[str(root / "shards")], tokenizer=None)
    return train_config(assets, root / side / name, **overrides)


def _worker(rank: int, world: int, port: int, root, assets) -> None:
    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    import torch.distributed as dist

    from stemlm.train.parallel.launch import destroy_distributed

    for name, (ffn, _) in {**FITS, **BF16_FITS}.items():
        Trainer(model_config(ffn), fit_config(assets, root, "two", name), progress=False).fit()
    for name, (source, overrides) in RESUMES.items():
        if rank == 0:
            shutil.copytree(root / source, root / "resumed" / name)
        dist.barrier()
        ckpt = root / "resumed" / name / "checkpoints" / "step-000003"
        Trainer.resume(ckpt, overrides=overrides, progress=False).fit()
    # A non-finite loss on rank 1 alone: both ranks must skip the update together (or the job would stall).
    poison = lambda step, loss: loss * float("nan") if step == 2 and rank == 1 else loss
    cfg = train_config(assets, root / "nan", steps=3, eval_every=0, save_every=0, parallel="fsdp")
    skipped = Trainer(model_config("stem"), cfg, fault_injection=poison, progress=False).fit()
    counts = {accum: _step_counts(assets, root, accum) for accum in (1, 3)}
    checks = {**_layout_check(rank), "skipped": skipped["skipped_steps"], "counts": counts}
    torch.save(checks, root / f"checks{rank}.pt")
    destroy_distributed()


COLLECTIVES = ("all_reduce", "all_to_all_single", "all_gather", "broadcast", "barrier")


def _step_counts(assets, root, accum: int) -> dict[str, int]:
    """Collectives called from Python and tensor value reads in one steady-state stem-ddp step (on this rank)."""
    import torch.distributed as dist

    cfg = train_config(assets, root / f"count{accum}", steps=3, grad_accum=accum, eval_every=0, save_every=0)
    trainer = Trainer(model_config("stem"), cfg, progress=False)
    trainer.train_step()
    host_counters = {id(s["step"]) for opt in trainer.optimizers for s in opt.state.values() if "step" in s}
    counts = {"collectives": 0, "reads": 0}
    originals = {name: getattr(dist, name) for name in COLLECTIVES}
    originals.update(item=torch.Tensor.item, tolist=torch.Tensor.tolist)
    patch = pytest.MonkeyPatch()
    for name in COLLECTIVES:

        def collective(*args, _name=name, **kwargs):
            counts["collectives"] += 1
            return originals[_name](*args, **kwargs)

        patch.setattr(dist, name, collective)
    for name in ("item", "tolist"):

        def read(self, *args, _name=name, **kwargs):
            counts["reads"] += id(self) not in host_counters  # AdamW's host step counters are not device reads
            return originals[_name](self, *args, **kwargs)

        patch.setattr(torch.Tensor, name, read)
    clip = trainer._clip_gradients

    def check_then_clip():  # the shards' gradients after every micro-batch's backward, before the update
        grads = [p.grad for p in trainer.tables.parameters()]
        counts["coalesced"] = all(g.is_coalesced() and g._nnz() <= g.shape[0] for g in grads)
        return clip()

    patch.setattr(trainer, "_clip_gradients", check_then_clip)
    try:
        trainer.train_step()
    finally:
        patch.undo()
    return counts


@pytest.fixture(scope="module")
def runs(dist_assets, tmp_path_factory):
    root = tmp_path_factory.mktemp("dist_runs")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("STEMLM_CACHE", str(dist_assets["cache"]))
        prepare(
            [dist_assets["data"]],
            load_tokenizer(dist_assets["tokenizer"]),
            root / "shards",
            heldout_fraction=0.3,
            progress=False,
        )
        for name, (ffn, _) in {**FITS, **BF16_FITS}.items():
            Trainer(model_config(ffn), fit_config(dist_assets, root, "one", name), progress=False).fit()
        # fork: the ranks inherit the imported modules (a fresh interpreter costs ~10 s on a loaded machine).
        fork_ranks(_worker, root, dist_assets)
    return root


@pytest.mark.dist
@pytest.mark.parametrize("name", list(FITS))
def test_two_ranks_train_the_one_process_model(runs, name):
    one, two = runs / "one" / name, runs / "two" / name
    assert [r["step"] for r in train_records(two)] == list(range(1, 7))  # rank 0 alone logs, once per step
    close(losses(two), losses(one))
    close(losses(two, "heldout_loss", "eval"), losses(one, "heldout_loss", "eval"))
    # The final checkpoint is a plain model folder with unsharded tables, equal to the 1-process one.
    got, want = read_state(two / "checkpoints" / "step-000006"), read_state(one / "checkpoints" / "step-000006")
    assert set(got) == set(want)
    for key, value in want.items():
        close(got[key], value, msg=key)
    init = build_model(model_config(FITS[name][0]), seed=0).state_dict()
    assert max((got[k] - v).abs().max().item() for k, v in init.items()) > 100 * TOL  # not vacuous
    state = json.loads((two / "checkpoints" / "step-000006" / "trainer_state.json").read_text())
    assert state["distributed"] == {
        "world_size": 2,
        "parallel": FITS[name][1]["parallel"],
        "format": "dcp-safetensors-v1",
    }
    assert json.loads((two / "run_config.json").read_text())["distributed"]["local_batch_size"] == 2


@pytest.mark.dist
@pytest.mark.parametrize("name", list(BF16_FITS))
def test_bf16_runs_train_the_one_process_model(runs, name):
    one, two = runs / "one" / name, runs / "two" / name
    torch.testing.assert_close(losses(two), losses(one), rtol=2e-2, atol=0)  # bf16 has 8 mantissa bits
    got, want = read_state(two / "checkpoints" / "step-000003"), read_state(one / "checkpoints" / "step-000003")
    assert all(v.dtype == torch.float32 for v in got.values())  # fp32 masters are what is saved
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=0, atol=2e-2, msg=key)


def expected_traffic(assets, step: int, grad_accum: int, width: int, row_bytes: int = 4) -> dict[str, int]:
    """Bytes sent between 2 ranks in one step, counted from the data: for each micro-batch the owner of each of a
    rank's unique ids that the other rank owns sends its row and gets its gradient back (float32, or bf16 under
    bf16 autocast: `row_bytes` per entry; `width` = summed table widths). The routing is planned on the host
    from the global batch's ids, so no request counts or ids travel."""
    train_texts, _ = load_corpus([str(assets["data"])])
    data = TokenDataset.from_texts(train_texts, load_tokenizer(assets["tokenizer"]))
    total = dict(rows=0, grads=0)
    for k in range(grad_accum):
        x, _ = data.sample_batch(4, 32, seed=0, step=step * grad_accum + k)
        asked = sum(int((x[r * 2 : r * 2 + 2].unique() % 2 != r).sum()) for r in range(2))
        total["rows"] += row_bytes * width * asked
        total["grads"] += row_bytes * width * asked
    return total


@pytest.mark.dist
@pytest.mark.parametrize("name", ["stem-ddp", "stem-fsdp", "stem-ddp-bf16"])
def test_table_bytes_per_step_are_logged(runs, dist_assets, dist_cache, name):
    width = model_config("stem").intermediate_size  # one table layer (odd layers of 2)
    records = train_records(runs / "two" / name)
    overrides = {**FITS, **BF16_FITS}[name][1]
    row_bytes = 2 if overrides.get("dtype") == "bf16" else 4  # bf16 autocast: rows and gradients travel in bf16
    every, last = overrides.get("traffic_every", 10), records[-1]["step"]
    logged = [r for r in records if "table_bytes_sent" in r]  # every `traffic_every` steps and the last
    assert [r["step"] for r in logged] == [r["step"] for r in records if r["step"] % every == 0 or r["step"] == last]
    since = 0
    for record in logged:
        steps = range(since, record["step"])  # the 0-based steps since the previous traffic record
        expected = {"rows": 0, "grads": 0}
        for step in steps:
            for k, v in expected_traffic(dist_assets, step, overrides.get("grad_accum", 1), width, row_bytes).items():
                expected[k] += v
        assert {k: record[f"table_bytes_sent/{k}"] for k in expected} == expected
        assert record["table_bytes_sent"] == sum(expected.values())
        assert record["table_traffic_steps"] == len(steps)
        since = record["step"]
    assert "table_bytes_sent" not in train_records(runs / "two" / "dense-ddp")[0]


@pytest.mark.dist
def test_two_rank_checkpoint_resumes_on_two_ranks_and_on_one(runs, dist_cache, tmp_path):
    uninterrupted = runs / "two" / "stem-fsdp"
    assert torch.equal(losses(runs / "resumed" / "stem-fsdp"), losses(uninterrupted))  # same N: bitwise
    shutil.copytree(uninterrupted, tmp_path / "run")
    trainer = Trainer.resume(tmp_path / "run" / "checkpoints" / "step-000003", progress=False)
    # The optimizer state DCP gathered onto one process equals the 1-process run's at the same step.
    reference = load_file(runs / "one" / "stem-fsdp" / "checkpoints" / "step-000003" / "optimizer.safetensors")
    for k, opt in enumerate(trainer.optimizers):
        for key, value in flatten_optimizer_state(opt.state_dict())[0].items():
            torch.testing.assert_close(value, reference[f"opt{k}.{key}"], rtol=1e-4, atol=1e-7, msg=key)
    trainer.fit()
    close(losses(tmp_path / "run"), losses(uninterrupted))
    got = read_state(tmp_path / "run" / "checkpoints" / "step-000006")
    for key, value in read_state(uninterrupted / "checkpoints" / "step-000006").items():
        close(got[key], value, msg=key)
    # A DDP checkpoint continued under FSDP2 (backbone state resharded by DCP).
    close(losses(runs / "resumed" / "stem-ddp-as-fsdp"), losses(runs / "two" / "stem-ddp"))


@pytest.mark.dist
@pytest.mark.parametrize("name", ["stem-ddp", "stem-fsdp"])
def test_one_process_checkpoint_resumes_on_two_ranks(runs, name):
    resumed = runs / "resumed" / f"one-{name}"
    close(losses(resumed), losses(runs / "one" / name))
    assert json.loads((resumed / "checkpoints" / "step-000006" / "trainer_state.json").read_text())["distributed"]


@pytest.mark.dist
def test_table_layout_conversion_on_uneven_shards(runs):
    for rank in range(2):
        checks = torch.load(runs / f"checks{rank}.pt")
        assert (checks["block"], checks["back"]) == (True, True)


@pytest.mark.dist
def test_a_non_finite_loss_on_one_rank_skips_the_step_on_all(runs):
    assert [torch.load(runs / f"checks{rank}.pt")["skipped"] for rank in range(2)] == [1, 1]
    records = train_records(runs / "nan")
    assert [r["skipped"] for r in records] == [False, True, False]
    assert records[1]["loss"] is None  # the global mean includes rank 1's NaN


@pytest.mark.dist
def test_collectives_and_reads_per_micro_batch_and_per_step(runs):
    for rank in range(2):
        counts = torch.load(runs / f"checks{rank}.pt")["counts"]
        per_micro = {k: (counts[3][k] - counts[1][k]) / 2 for k in ("collectives", "reads")}
        per_step = {k: counts[1][k] - per_micro[k] for k in ("collectives", "reads")}
        # Per micro-batch: the table exchange only (rows forward, gradients backward; planned on the host, so no
        # count or id exchange and no read). Per step: one all_reduce of every micro-batch's loss and finiteness,
        # one in the clip (the sharded tables' squared norm); a read of each. The table traffic is reduced and read
        # only every `traffic_every` steps (and at the last), not in this step 2 of 3.
        assert per_micro == {"collectives": 2, "reads": 0}, counts
        assert per_step == {"collectives": 2, "reads": 2}, counts
        assert counts[3]["coalesced"] and counts[1]["coalesced"]  # sparse table gradients, summed per row


# ----- the real command: a rank killed mid-run, then resumed -----
def cli_args(assets, out) -> list[str]:
    model = "hidden_size=64 intermediate_size=128 num_hidden_layers=2 num_attention_heads=4 num_key_value_heads=2"
    return [
        "train",
        *("--data", str(assets["data"]), "--tokenizer", str(assets["tokenizer"]), "--out", str(out)),
        *("--seq-len", "32", "--batch-size", "4", "--steps", "6", "--lr", "3e-3", "--save-every", "2"),
        *("--eval-every", "0", "--parallel", "fsdp", "--no-progress", "--sample-tokens", "0"),
        *("--set", *(f"model.{item}" for item in model.split()), "model.max_position_embeddings=64"),
    ]


def run_stemlm(args: list[str], assets, **env) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "STEMLM_CACHE": str(assets["cache"]), **env}
    return subprocess.run(
        [sys.executable, "-m", "stemlm.cli.main", *args], capture_output=True, text=True, env=env, timeout=300
    )


@pytest.fixture(scope="module")
def killed(dist_assets, tmp_path_factory):
    run = tmp_path_factory.mktemp("killed") / "run"
    proc = run_stemlm([*cli_args(dist_assets, run), "--nproc", "2"], dist_assets, STEMLM_FAULT_EXIT="1:4")
    return run, proc


@pytest.mark.dist
@pytest.mark.slow
def test_killed_rank_ends_the_job_with_one_clear_line(killed):
    run, proc = killed
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "STEMLM_FAULT_EXIT: rank 1 exits before step 4" in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "stemlm train: error: distributed training failed: rank 1 of 2 exited with code 1; the other ranks were "
        f"stopped (full log: {run / 'launch.log'}); continue from the last checkpoint with: stemlm train --resume "
        f"{run} --nproc 2"
    )
    assert resolve_checkpoint(run).name == "step-000002"
    assert [r["step"] for r in train_records(run)][:2] == [1, 2]
    assert len(train_records(run)) <= 3  # rank 0 cannot finish step 4 without rank 1


def _cli_worker(rank: int, world: int, port: int, argv: list[str]) -> None:
    """One rank of `stemlm train` as torchrun starts it (its environment), in a forked process."""
    torch.set_num_threads(1)
    env = dict(RANK=rank, WORLD_SIZE=world, LOCAL_RANK=rank, LOCAL_WORLD_SIZE=world, MASTER_PORT=port)
    os.environ.update({k: str(v) for k, v in env.items()}, MASTER_ADDR="127.0.0.1")
    if main(argv) != 0:
        raise RuntimeError(f"rank {rank}: stemlm {' '.join(argv)} failed")


@pytest.mark.dist
@pytest.mark.slow
def test_resume_after_the_kill_matches_an_uninterrupted_run(killed, dist_assets, dist_cache, tmp_path):
    run, _ = killed
    # The workers' command of `stemlm train --resume RUN --nproc 2` (the launcher itself ran in the kill test).
    resume = ["train", "--resume", str(run), "--no-progress", "--json", "--sample-tokens", "0"]
    mp.start_processes(_cli_worker, args=(2, free_port(), resume), nprocs=2, start_method="fork")
    reference = cli_args(dist_assets, tmp_path / "ref")
    del reference[reference.index("--parallel") : reference.index("--parallel") + 2]  # one process: nothing to shard
    assert main(reference) == 0  # one process, uninterrupted
    assert [r["step"] for r in train_records(run)] == list(range(1, 7))
    close(losses(run), losses(tmp_path / "ref"))
    state = json.loads((run / "checkpoints" / "step-000006" / "trainer_state.json").read_text())
    assert state["distributed"]["parallel"] == "fsdp" and state["step"] == 6


# ----- single-process pieces -----
def test_worker_command_line_reproduces_the_flags():
    parser = build_parser()
    argv = [
        *("train", "--nproc", "2", "--steps", "5", "--lr", "0.003", "--data", "a.txt", "b", "--parallel", "fsdp"),
        *("--resume", "runs/x", "--dist-timeout", "60", "--table-lr", "x3"),
        *("--set", "model.hidden_size=32", "train.eval_every=2", "--no-progress", "--json", "--sample-prompt=-x y"),
    ]
    args = parser.parse_args(argv)
    worker = worker_argv(args)
    assert "--nproc" not in worker and worker[0] == "train"
    again = parser.parse_args(worker)
    ignore = {"nproc", "func", "train_parser"}
    assert {k: v for k, v in vars(again).items() if k not in ignore} == {
        k: v for k, v in vars(args).items() if k not in ignore
    }


def test_batch_that_does_not_split_fails_before_starting_processes(capsys):
    assert main(["train", "--nproc", "2", "--batch-size", "3"]) == 2
    err = capsys.readouterr().err
    assert "global batch size 3 does not split over 2 processes" in err and "starting" not in err
    with pytest.raises(StemlmError, match="parallel must be one of ddp, fsdp"):
        TrainConfig(parallel="tp")
