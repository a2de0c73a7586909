"""Tests for vocabulary-row-sharded tables: one process (no process group) and 2 gloo processes.

The 2-process tests train a tiny STEM model with each rank taking half of the global batch and compare
losses, weights and optimizer state with a 1-process run on the whole batch, computed here independently
(plain model, its own tables, torch AdamW / LazyAdamW). Run:
`OMP_NUM_THREADS=1 python -m pytest tests/placement/test_row_sharded.py -q` (`-m "not dist"` skips spawns).
"""

from __future__ import annotations

import contextlib
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from stemlm.errors import StemlmError
from stemlm.model import build_model
from stemlm.model.config import ModelConfig
from stemlm.placement.comm import CommCounter, all_to_all_rows, exchange_counts
from stemlm.placement.row_sharded import ShardedTables
from stemlm.placement.table_optim import LazyAdamW, clip_grad_norm_mixed, make_table_optimizer, use_sparse_table_grads
from stemlm.train.parallel.launch import destroy_distributed, init_distributed

CONFIG = ModelConfig(
    vocab_size=61,
    hidden_size=32,
    intermediate_size=24,
    num_hidden_layers=4,
    num_attention_heads=2,
    max_position_embeddings=32,
    ffn="stem",
    ffn_layers="odd",
)
HP = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
STEPS, GLOBAL_BATCH, SEQ, MAX_ID, CLIP = 6, 4, 9, 40, 0.5  # ids < MAX_ID: rows 40..60 are never touched
# (table optimizer, backbone wrapping): a plain all_reduce average, DDP, FSDP2 (fully_shard per layer and root).
CASES = [("adamw", "manual"), ("lazy_adamw", "ddp"), ("lazy_adamw", "fsdp2")]
MICRO = {"manual": 1, "ddp": 2, "fsdp2": 1}  # DDP also accumulates over 2 micro-batches (no_sync on the first)


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, MAX_ID, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(100 + step))


def schedule(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))


def table_params(model):
    return {id(t.weight) for t in model.token_tables().values()}


def reference_run(optimizer_name: str):
    """One process, batch B, the model's own tables: losses, final state_dict and table optimizer state."""
    model = build_model(CONFIG, seed=0)
    if optimizer_name == "lazy_adamw":
        tables = use_sparse_table_grads(model)
        opt_t = LazyAdamW(tables, **HP)
    else:
        tables = [t.weight for t in model.token_tables().values()]
        opt_t = torch.optim.AdamW(tables, **HP, foreach=False)
    backbone = [p for p in model.parameters() if id(p) not in table_params(model)]
    opt_b = torch.optim.AdamW(backbone, **HP, foreach=False)
    scheds = [schedule(opt_b), schedule(opt_t)]
    losses = []
    for step in range(STEPS):
        ids = batch(step)
        loss = model(ids[:, :-1], labels=ids[:, 1:]).loss
        loss.backward()
        if optimizer_name == "lazy_adamw":
            clip_grad_norm_mixed(list(model.parameters()), CLIP)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        for opt in (opt_b, opt_t):
            opt.step()
            opt.zero_grad(set_to_none=True)
        for s in scheds:
            s.step()
        losses.append(loss.item())
    return losses, model.state_dict(), [opt_t.state[p] for p in tables]


def _train(rank: int, world: int, tmp: str, optimizer_name: str, wrap: str) -> None:
    model = build_model(CONFIG, seed=0)
    tables = ShardedTables(model)
    net = DistributedDataParallel(model) if wrap == "ddp" else model
    if wrap == "fsdp2":
        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt_b = torch.optim.AdamW(model.parameters(), **HP, foreach=False)
    opt_t = make_table_optimizer(optimizer_name, tables.parameters(), **HP)
    scheds = [schedule(opt_b), schedule(opt_t)]
    half = GLOBAL_BATCH // world
    losses, comm = [], []
    micro = MICRO[wrap]
    for step in range(STEPS):
        ids = batch(step)[rank * half : (rank + 1) * half]
        loss = 0.0
        for m, part in enumerate(ids.chunk(micro)):
            sync = net.no_sync() if wrap == "ddp" and m < micro - 1 else contextlib.nullcontext()
            with sync:
                rows = {"token": tables.lookup(part[:, :-1])}
                part_loss = net(part[:, :-1], labels=part[:, 1:], rows=rows).loss / micro
                part_loss.backward()
            loss = loss + part_loss.detach()
        if wrap == "manual":
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad.div_(world)
        clip_grad_norm_mixed(model.parameters(), CLIP, sharded_params=tables.parameters())
        for opt in (opt_b, opt_t):
            opt.step()
            opt.zero_grad(set_to_none=True)
        for s in scheds:
            s.step()
        global_loss = loss.clone()
        dist.all_reduce(global_loss)
        losses.append(global_loss.item() / world)
        comm.append(tables.comm.pop_step())
    opt_tensors, _ = tables.full_optimizer_state(opt_t)
    tables.unshard_into(model)
    state = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    torch.save(
        {"losses": losses, "state": state, "opt": opt_tensors, "comm": comm, "layers": tables.layers},
        f"{tmp}/{optimizer_name}-{wrap}-rank{rank}.pt",
    )


def _checkpoint(rank: int, tmp: str) -> dict[str, bool]:
    """DCP save/load of the local shards + optimizer state, and the gather/slice path of the optimizer state."""
    model = build_model(CONFIG, seed=0)
    tables = ShardedTables(model)
    opt = LazyAdamW(tables.parameters(), **HP)

    def train_step(step):
        ids = batch(step)[rank * 2 : rank * 2 + 2]
        model(ids[:, :-1], labels=ids[:, 1:], rows={"token": tables.lookup(ids[:, :-1])}).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for step in range(2):
        train_step(step)
    saved = {k: v.clone() for k, v in tables.local_state(opt).items()}
    dcp.save(tables.local_state(opt), checkpoint_id=f"{tmp}/dcp")
    train_step(2)
    moved = any(not torch.equal(v, saved[k]) for k, v in tables.local_state(opt).items())
    template = {k: torch.empty_like(v) for k, v in tables.local_state(opt).items()}
    dcp.load(template, checkpoint_id=f"{tmp}/dcp")
    tables.load_local_state(template, opt)
    restored = all(torch.equal(v, saved[k]) for k, v in tables.local_state(opt).items())
    full, meta = tables.full_optimizer_state(opt)
    fresh = LazyAdamW(tables.parameters(), **HP)
    tables.load_full_optimizer_state(fresh, full, meta)
    resliced = all(torch.equal(fresh.state[p][k], opt.state[p][k]) for p in tables.parameters() for k in opt.state[p])
    return {
        "moved": moved,
        "restored": restored,
        "resliced": resliced,
        "full_rows": all(v.shape[0] == CONFIG.vocab_size for k, v in full.items()),
    }


def _empty_split_exchange(rank: int) -> dict:
    # Rank 1 sends nothing to rank 0 and rank 0 sends nothing to itself: empty splits on gloo.
    counter = CommCounter()
    send = [0, 3] if rank == 0 else [0, 2]
    x = torch.arange(sum(send) * 2, dtype=torch.float32).reshape(-1, 2) + 100 * rank
    recv = exchange_counts(torch.tensor(send), counter=counter).tolist()
    out = all_to_all_rows(x, send, recv, counter=counter)
    return {"recv": recv, "out": out, "bytes": counter.pop_step()}


def _worker(rank: int, world: int, tmp: str, port: int) -> None:
    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    info = init_distributed(device="cpu")  # the torchrun environment path
    results = {"info": (info.rank, info.world_size, info.backend), "exchange": _empty_split_exchange(rank)}
    for optimizer_name, wrap in CASES:
        _train(rank, world, tmp, optimizer_name, wrap)
    results["checkpoint"] = _checkpoint(rank, tmp)
    torch.save(results, f"{tmp}/misc-rank{rank}.pt")
    destroy_distributed()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Run every 2-process scenario in one spawn (process start-up dominates); returns the results folder."""
    tmp = tmp_path_factory.mktemp("two_ranks")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    # fork: the children inherit the imported torch and stemlm instead of importing them again (~10 s each on
    # a loaded machine); safe because the test session runs torch on one thread (tests/conftest.py).
    mp.start_processes(_worker, args=(2, str(tmp), port), nprocs=2, start_method="fork")
    return tmp


def expected_bytes(step: int, rank: int, width_total: int, micro: int) -> dict[str, int]:
    """Independent count of what `rank` sends to the other rank of 2 in one step (int32 ids, fp32 rows)."""
    ids = batch(step)[:, :-1]
    total = {"counts": 0, "ids": 0, "rows": 0, "grads": 0}
    mine_all, other_all = ids[rank * 2 : rank * 2 + 2], ids[(1 - rank) * 2 : (1 - rank) * 2 + 2]
    for mine, other in zip(mine_all.chunk(micro), other_all.chunk(micro), strict=True):
        asked = int((mine.unique() % 2 != rank).sum())  # my unique ids the other rank owns
        served = int((other.unique() % 2 == rank).sum())  # the other rank's unique ids that I own
        for kind, n in (
            ("counts", 8),
            ("ids", 4 * asked),
            ("rows", 4 * width_total * served),
            ("grads", 4 * width_total * asked),
        ):
            total[kind] += n
    return total


@pytest.mark.dist
@pytest.mark.parametrize("optimizer_name,wrap", CASES)
def test_two_rank_sharded_training_matches_one_process(two_ranks, optimizer_name, wrap):
    ref_losses, ref_state, ref_opt = reference_run(optimizer_name)
    got = [torch.load(two_ranks / f"{optimizer_name}-{wrap}-rank{r}.pt") for r in range(2)]
    for r in range(2):
        torch.testing.assert_close(torch.tensor(got[r]["losses"]), torch.tensor(ref_losses), rtol=0, atol=1e-5)
        for name, value in ref_state.items():
            torch.testing.assert_close(got[r]["state"][name], value, rtol=0, atol=1e-5, msg=name)
    init = build_model(CONFIG, seed=0).state_dict()
    moved = max((got[0]["state"][name] - value).abs().max().item() for name, value in init.items())
    assert moved > 100 * 1e-5  # the weights moved far more than the tolerance: the comparison is not vacuous
    for layer in got[0]["layers"]:
        name = f"model.layers.{layer}.mlp.stem_embedding.weight"
        untouched = got[0]["state"][name][MAX_ID:]
        if optimizer_name == "lazy_adamw":
            assert torch.equal(untouched, init[name][MAX_ID:])  # never-seen rows bit-identical
        else:
            assert not torch.equal(untouched, init[name][MAX_ID:])  # dense AdamW decays them
    # The gathered row-sharded optimizer state equals the 1-process optimizer's state.
    for index, ref in enumerate(ref_opt):
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(got[0]["opt"][f"state.{index}.{key}"], ref[key], rtol=1e-4, atol=1e-7)
        torch.testing.assert_close(
            got[0]["opt"][f"state.{index}.step"], ref["step"].to(got[0]["opt"][f"state.{index}.step"].dtype)
        )
    width_total = CONFIG.intermediate_size * len(got[0]["layers"])
    for r in range(2):
        for step, logged in enumerate(got[r]["comm"]):
            expected = expected_bytes(step, r, width_total, MICRO[wrap])
            assert {k: logged[f"table_bytes_sent/{k}"] for k in expected} == expected
            assert logged["table_bytes_sent"] == sum(expected.values())


@pytest.mark.dist
def test_two_rank_checkpoint_round_trips_and_exchange(two_ranks):
    for r in range(2):
        misc = torch.load(two_ranks / f"misc-rank{r}.pt")
        assert misc["info"] == (r, 2, "gloo")
        assert misc["checkpoint"] == {"moved": True, "restored": True, "resliced": True, "full_rows": True}
    ex0, ex1 = (torch.load(two_ranks / f"misc-rank{r}.pt")["exchange"] for r in range(2))
    assert ex0["recv"] == [0, 0] and ex1["recv"] == [3, 2]
    assert ex0["out"].shape == (0, 2)
    rows0 = torch.arange(6.0).reshape(3, 2)
    rows1 = torch.arange(4.0).reshape(2, 2) + 100
    assert torch.equal(ex1["out"], torch.cat([rows0, rows1]))
    assert ex0["bytes"] == {
        "table_bytes_sent": 8 + 3 * 8,
        "table_bytes_recv": 8,
        "table_bytes_sent/counts": 8,
        "table_bytes_sent/rows": 3 * 8,
    }
    assert ex1["bytes"]["table_bytes_sent"] == 8 and ex1["bytes"]["table_bytes_recv"] == 8 + 3 * 8


def test_world_of_one_matches_the_model_own_tables():
    ids = batch(0)
    ref = build_model(CONFIG, seed=0)
    use_sparse_table_grads(ref)
    model = build_model(CONFIG, seed=0)
    tables = ShardedTables(model)
    assert not any(id(p) in {id(s) for s in tables.parameters()} for p in model.parameters())
    loss_ref = ref(ids[:, :-1], labels=ids[:, 1:]).loss
    loss = model(ids[:, :-1], labels=ids[:, 1:], rows={"token": tables.lookup(ids[:, :-1])}).loss
    assert torch.equal(loss, loss_ref)
    loss_ref.backward()
    loss.backward()
    for layer, table in ref.token_tables().items():
        # Same sums in another order (per unique row first, then coalesced): equal up to rounding.
        got, want = tables.shard(layer).grad.coalesce(), table.weight.grad.coalesce()
        assert torch.equal(got.indices(), want.indices())
        torch.testing.assert_close(got.values(), want.values(), rtol=1e-6, atol=1e-9)
    assert tables.comm.pop_step()["table_bytes_sent"] == 0  # one rank: nothing leaves the process


def test_released_tables_explain_how_to_call_the_model():
    model = build_model(CONFIG, seed=0)
    tables = ShardedTables(model)
    ids = batch(0)
    with pytest.raises(StemlmError, match="rows=.'token': sharded_tables.lookup"):
        model(ids)
    with pytest.raises(StemlmError, match="exact input_ids"):
        model(ids, rows={"token": tables.lookup(ids[:, :-1])})
    assert not any("stem_embedding" in name for name in model.state_dict())
    tables.unshard_into(model)
    ref = build_model(CONFIG, seed=0)
    assert torch.equal(model(ids).logits, ref(ids).logits)
    assert set(model.state_dict()) == set(ref.state_dict())
