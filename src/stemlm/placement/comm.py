"""Row exchanges between ranks (all_to_all over dim 0) and the byte counter that logs table traffic.

`all_to_all_rows(x, send_counts, recv_counts, ...)` sends the first `send_counts[0]` rows of `x` to rank 0,
the next `send_counts[1]` to rank 1, and so on, and returns the rows received, grouped by source rank. It is
`torch.distributed.all_to_all_single` with uneven splits, which both backends implement: NCCL on GPU and
gloo on CPU (verified on torch 2.13, including empty splits; gloo lacks other collectives, e.g. reduce_scatter,
but not this one). The device is the tensors' own, so the same code serves both. Without an initialised
process group (or with one rank) the exchange is the identity.

`CommCounter` records, per kind of message, the bytes this rank sends to and receives from OTHER ranks (the
part an all_to_all keeps on the rank itself is a local copy and is not counted). The trainer logs
`counter.pop_step()` once per optimizer step.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist


class CommCounter:
    """Bytes sent / received per message kind: since the last `pop_step()` and since creation."""

    def __init__(self) -> None:
        self.step_sent: dict[str, int] = defaultdict(int)
        self.step_recv: dict[str, int] = defaultdict(int)
        self.total_sent = 0
        self.total_recv = 0

    def record(self, kind: str, sent: int, recv: int) -> None:
        self.step_sent[kind] += sent
        self.step_recv[kind] += recv
        self.total_sent += sent
        self.total_recv += recv

    def pop_step(self) -> dict[str, int]:
        """`{"table_bytes_sent": .., "table_bytes_recv": .., "table_bytes_sent/<kind>": ..}`; then resets."""
        out = {"table_bytes_sent": sum(self.step_sent.values()), "table_bytes_recv": sum(self.step_recv.values())}
        out.update({f"table_bytes_sent/{kind}": n for kind, n in sorted(self.step_sent.items())})
        self.step_sent.clear()
        self.step_recv.clear()
        return out


def group_rank_size(group=None) -> tuple[int, int]:
    """(rank, world size) in `group`; (0, 1) when torch.distributed is not initialised."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def exchange_counts(send_counts: torch.Tensor, group=None, counter: CommCounter | None = None) -> torch.Tensor:
    """Given how many rows this rank will send to each rank ([world] int64), return how many it will receive."""
    rank, world = group_rank_size(group)
    if world == 1:
        return send_counts.clone()
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    if counter is not None:
        nbytes = (world - 1) * send_counts.element_size()
        counter.record("counts", nbytes, nbytes)
    return recv_counts


def all_to_all_rows(
    x: torch.Tensor,
    send_counts: list[int],
    recv_counts: list[int],
    group=None,
    counter: CommCounter | None = None,
    kind: str = "rows",
) -> torch.Tensor:
    """Send row blocks of `x` ([sum(send_counts), ...]) to each rank; return the [sum(recv_counts), ...] received."""
    out, work = all_to_all_rows_async(x, send_counts, recv_counts, group, counter, kind)
    if work is not None:
        work.wait()
    return out


def all_to_all_rows_async(
    x: torch.Tensor,
    send_counts: list[int],
    recv_counts: list[int],
    group=None,
    counter: CommCounter | None = None,
    kind: str = "rows",
):
    """`all_to_all_rows` issued without waiting: (output buffer, work handle or None with one rank).

    The output holds the received rows only after `work.wait()` (on NCCL that makes the current stream wait,
    no host sync; on gloo it blocks until the exchange is done). Keep `x` alive until then.
    """
    rank, world = group_rank_size(group)
    if world == 1:
        return x.clone(), None
    x = x.contiguous()
    out = x.new_empty((sum(recv_counts), *x.shape[1:]))
    work = dist.all_to_all_single(
        out, x, output_split_sizes=recv_counts, input_split_sizes=send_counts, group=group, async_op=True
    )
    if counter is not None:
        counter.record(kind, *traffic_bytes(x, send_counts, recv_counts, rank))
    return out, work


def traffic_bytes(x: torch.Tensor, send_counts: list[int], recv_counts: list[int], rank: int) -> tuple[int, int]:
    """(bytes sent to, received from other ranks) by an all_to_all of `x`'s rows; the own block is a local copy."""
    row_bytes = x.element_size() * math.prod(x.shape[1:])
    return (sum(send_counts) - send_counts[rank]) * row_bytes, (sum(recv_counts) - recv_counts[rank]) * row_bytes
