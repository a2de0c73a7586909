"""`stemlm train --profile` and `--memory-snapshot`: where a step's time and memory go, written into RUN/profile/.

`--profile` runs torch.profiler over a few steps after the first (which pays one-time costs: allocator growth,
lazy initialisation, compilation): one skipped, one warm-up, up to three recorded. Each rank writes a trace that
TensorBoard's profiler plugin and chrome://tracing / Perfetto open (`rank<r>.*.pt.trace.json`), and
`summary-rank<r>.txt`, the operators sorted by their own device time (CPU time on a CPU run).

`--memory-snapshot` records the CUDA caching allocator's history for the whole run and dumps it at the end to
`memory-rank<r>.pickle` (open it at https://pytorch.org/memory_viz): every allocation with its stack, which is
what shows whether activations, the optimizer state or the table shards fill a device. CPU memory has no such
history in torch, so it needs a CUDA device.

Neither changes the numbers: the profiler only observes (tests compare a profiled run's losses bitwise).
"""

from __future__ import annotations

from pathlib import Path

import torch

from stemlm.errors import StemlmError

PROFILE_DIR = "profile"
RECORDED_STEPS = 3


def profile_schedule(remaining: int) -> dict[str, int]:
    """torch.profiler.schedule arguments for a run with `remaining` steps: skip 1, warm up 1, record up to 3,
    shrinking (first the skip, then the warm-up) so that a short run still records at least one step."""
    wait = 1 if remaining >= 3 else 0
    warmup = 1 if remaining - wait >= 2 else 0
    return {"wait": wait, "warmup": warmup, "active": max(1, min(RECORDED_STEPS, remaining - wait - warmup))}


def check_profiling(memory_snapshot: bool, device: torch.device) -> None:
    """Refuse, before anything is written, what cannot be recorded on `device`."""
    if memory_snapshot and device.type != "cuda":
        raise StemlmError("--memory-snapshot needs a CUDA device (torch keeps no allocation history on CPU)")


class StepProfiler:
    """Context manager around the training loop; call `step()` after every optimizer step."""

    def __init__(self, run_dir: Path, rank: int, device: torch.device, remaining: int, *, trace: bool, memory: bool):
        check_profiling(memory, device)
        self.folder = Path(run_dir) / PROFILE_DIR
        self.rank, self.device, self.remaining = rank, device, remaining
        self.trace, self.memory = trace, memory
        self.profiler = None

    def __enter__(self) -> StepProfiler:
        if not (self.trace or self.memory):
            return self
        self.folder.mkdir(parents=True, exist_ok=True)
        if self.memory:
            torch.cuda.memory._record_memory_history(max_entries=100_000, device=self.device)
        if self.trace:
            from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.device.type == "cuda" else [])
            self.profiler = profile(
                activities=activities,
                schedule=schedule(**profile_schedule(self.remaining), repeat=1),
                on_trace_ready=self._written,
                record_shapes=True,
                profile_memory=True,
            )
            self._handler = tensorboard_trace_handler(str(self.folder), worker_name=f"rank{self.rank}")
            self.profiler.__enter__()
        return self

    def _written(self, prof) -> None:
        self._handler(prof)
        sort = "self_cuda_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=30)
        (self.folder / f"summary-rank{self.rank}.txt").write_text(table + "\n")

    def step(self) -> None:
        if self.profiler is not None:
            self.profiler.step()

    def __exit__(self, *exc) -> None:
        if self.profiler is not None:
            self.profiler.__exit__(*exc)
            self.profiler = None
        if self.memory:
            torch.cuda.memory._dump_snapshot(str(self.folder / f"memory-rank{self.rank}.pickle"))
            torch.cuda.memory._record_memory_history(enabled=None, device=self.device)
