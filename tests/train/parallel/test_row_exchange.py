"""The table exchange planned on the host and issued ahead, on 2 gloo processes, against the collective plan.

One fork of 2 ranks checks, on this rank:
- `plan_on_host` (every rank's ids, no collective) equals `plan` (count and id exchange) field by field, for
  random batches, ranks holding different batch shapes, and ids that all belong to one owner (empty splits);
- a 6-step STEM run with grad_accum 3 (rows of micro-batch k+1 exchanged while k computes; host shards also
  gather ahead and update the host tables on a worker thread) ends bitwise equal to the same run with the
  exchange planned collectively and waited at once (today's synchronous path), for device and host shards;
- in that run the exchange of micro-batch k+1 is issued before micro-batch k's forward runs, and waited only
  when k+1's forward needs it;
- a step skipped for a non-finite loss on one rank leaves host shards (gathers ahead, update on the worker)
  bitwise equal to device shards.
Run: `OMP_NUM_THREADS=1 python -m pytest tests/train/parallel/test_row_exchange.py -q`.
"""

from __future__ import annotations

import os

import pytest
import torch

from .conftest import VOCAB, fork_ranks, model_config, records, train_config

RUN = dict(grad_accum=3, table_optim="lazy_adamw", eval_every=3, save_every=0)


def _plans_equal(tables, rank: int) -> list[bool]:
    gen = torch.Generator().manual_seed(7)
    cases = [[torch.randint(0, VOCAB, (2, 16), generator=gen) for _ in range(2)] for _ in range(3)]
    cases.append([torch.randint(0, VOCAB, (3, 5), generator=gen), torch.randint(0, VOCAB, (1, 5), generator=gen)])
    cases.append([torch.full((2, 4), 8) + 2 * torch.arange(4), torch.full((2, 4), 10)])  # even ids: owner 0 only
    out = []
    for all_ids in cases:
        got, want = tables.plan_on_host(all_ids), tables.plan(all_ids[rank])
        out.append(
            got.shape == want.shape
            and torch.equal(got.positions, want.positions)
            and got.send_counts == want.send_counts
            and got.recv_counts == want.recv_counts
            and torch.equal(got.local_rows, want.local_rows)
        )
    return out


def _synchronous(monkeypatch, rank: int) -> None:
    """Today's path: the collective plan of this rank's ids, the exchange waited at once."""
    from stemlm.placement.host_sharded import HostShardedTables
    from stemlm.placement.row_sharded import ShardedTables

    def start_window(self, window, dtype=None):
        ids = self.ids_for(window)[rank].to(self.compute_device)
        pending = self.start_lookup(self.plan(ids), dtype)
        pending.wait()
        return pending

    for cls in (ShardedTables, HostShardedTables):
        monkeypatch.setattr(cls, "start_window", start_window)
        monkeypatch.setattr(cls, "prefetch", lambda self, window: None)  # no gathers ahead


def _order(trainer) -> list[str]:
    """Events of two steps: steps started, exchanges issued / waited (by window) and forwards (by micro-batch)."""
    from stemlm.placement.row_sharded import PendingRows

    events = []
    patch = pytest.MonkeyPatch()
    start, wait = type(trainer.tables).start_window, PendingRows.wait
    accumulate = trainer._accumulate_gradients

    def logged_accumulate(step):
        events.append("step")
        return accumulate(step)

    def logged_start(self, window, dtype=None):
        events.append(f"issue {window % 3}")
        return start(self, window, dtype)

    def logged_wait(self):
        events.append("wait")
        return wait(self)

    patch.setattr(type(trainer.tables), "start_window", logged_start)
    patch.setattr(PendingRows, "wait", logged_wait)
    patch.setattr(trainer, "_accumulate_gradients", logged_accumulate)
    hook = trainer.model.register_forward_pre_hook(lambda *_: events.append("forward"))
    trainer.cfg = trainer.cfg.replace(steps=trainer.step + 3)  # two more steps, and one that will not run
    try:
        trainer.train_step()
        trainer.train_step()
        trainer.tables._drop_ahead()
    finally:
        hook.remove()
        patch.undo()
    return events


def _worker(rank: int, world: int, port: int, root, assets) -> None:
    torch.set_num_threads(1)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    from stemlm.train.parallel.launch import destroy_distributed
    from stemlm.train.trainer import Trainer

    out = {}
    for tables in ("device", "host"):
        for mode in ("ahead", "sync"):
            with pytest.MonkeyPatch.context() as patch:
                if mode == "sync":
                    _synchronous(patch, rank)
                cfg = train_config(assets, root / f"{tables}-{mode}", tables=tables, dist_timeout=60, **RUN)
                trainer = Trainer(model_config("stem"), cfg, progress=False)
                trainer.fit()
                out[f"{tables}-{mode}"] = {k: v.detach().clone() for k, v in trainer.tables.shards.items()}
                if mode == "ahead":
                    out[f"{tables}-order"] = _order(trainer)
                if tables == "device" and mode == "ahead":
                    out["plans"] = _plans_equal(trainer.tables, rank)
                if tables == "host":
                    trainer.tables.close()  # (finish() would also leave the process group)
    # A non-finite loss on rank 1 in step 2: the step is skipped on both ranks (no update queued), and the gathers
    # ahead still serve the right rows afterwards.
    poison = lambda step, loss: loss * float("nan") if step == 2 and rank == 1 else loss  # noqa: E731
    for tables in ("device", "host"):
        cfg = train_config(assets, root / f"{tables}-nan", tables=tables, dist_timeout=60, **{**RUN, "steps": 4})
        trainer = Trainer(model_config("stem"), cfg, fault_injection=poison, progress=False)
        trainer.fit()
        out[f"{tables}-nan"] = {k: v.detach().clone() for k, v in trainer.tables.shards.items()}
        if tables == "host":
            trainer.tables.close()
    torch.save(out, root / f"rank{rank}.pt")
    destroy_distributed()


@pytest.fixture(scope="module")
def runs(dist_assets, tmp_path_factory):
    root = tmp_path_factory.mktemp("row_exchange")
    fork_ranks(_worker, root, dist_assets)
    return root


@pytest.mark.dist
def test_host_plan_equals_the_collective_plan(runs):
    for rank in range(2):
        assert torch.load(runs / f"rank{rank}.pt")["plans"] == [True] * 5


@pytest.mark.dist
@pytest.mark.parametrize("tables", ["device", "host"])
def test_exchange_ahead_is_bitwise_the_synchronous_one(runs, tables):
    ahead, sync = records(runs / f"{tables}-ahead"), records(runs / f"{tables}-sync")
    assert len(ahead) == 8 and ahead == sync  # 6 train + 2 eval records, exact floats
    assert ahead == records(runs / "device-sync")  # host shards train as device shards
    assert ahead[0][1] != ahead[5][1]  # training moved
    for rank in range(2):
        out = torch.load(runs / f"rank{rank}.pt")
        for key, shard in out[f"{tables}-sync"].items():
            assert torch.equal(out[f"{tables}-ahead"][key], shard)


@pytest.mark.dist
def test_a_skipped_step_with_host_shards_ahead(runs):
    host, device = records(runs / "host-nan"), records(runs / "device-nan")
    assert host == device
    assert [r[1] is None for r in host if r[0] == "train"] == [False, True, False, False]
    for rank in range(2):
        out = torch.load(runs / f"rank{rank}.pt")
        for key, shard in out["device-nan"].items():
            assert torch.equal(out["host-nan"][key], shard)


@pytest.mark.dist
@pytest.mark.parametrize("tables", ["device", "host"])
def test_next_micro_batch_is_exchanged_before_it_is_needed(runs, tables):
    step = ["issue 1", "forward", "issue 2", "forward", "forward"]  # k+1 issued before k's forward
    # Device shards: the next step's first exchange is issued by the table update (before the backbone steps) and
    # waited in that step; not after the run's last step. Host shards issue it when the step starts (their worker
    # gathered its rows behind the update).
    after_update = ["issue 0"] if tables == "device" else []
    expected = ["step", "issue 0", *step, *after_update, "step", *([] if after_update else ["issue 0"]), *step]
    expected += after_update
    for rank in range(2):
        order = torch.load(runs / f"rank{rank}.pt")[f"{tables}-order"]
        assert [e for e in order if e != "wait"] == expected
        assert order[2] == "wait" and order.count("wait") == 6 + len(after_update)  # the last one: _drop_ahead
