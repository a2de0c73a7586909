"""How close a training run came to the machine: achieved model FLOP/s against a matmul peak, each in one clock.

`training_throughput(config, seq_len, tokens_per_s, cpu_tokens_per_s, micro_tokens, device, dtype)` relates the
run's model FLOP rate (training FLOPs per token from `stemlm.model.accounting`, i.e. 3 x the forward matmuls with
causal attention, times its tokens per second) to a peak measured in the same process: the best FLOP rate of
plain matmuls at the model's own shapes ([tokens of a micro-batch, in] x [in, out] for every distinct projection,
the LM head included), on the same device, dtype and threads. Each rate is taken twice, in the same two clocks
for the run and for the peak:

- wall time (`time.perf_counter`): what the run delivered, but a shared machine slows the run and the peak by
  different amounts (they are measured minutes apart), so the share moves with the load;
- process CPU time (`time.process_time`, CPU only; every thread of the process counts): FLOPs per CPU-second of the
  run against FLOPs per CPU-second of the matmuls, blind to time spent descheduled by other processes.

Each ratio is a model-FLOPs utilisation against what this machine's matmul kernels reach at these shapes, not
against a datasheet number (a CPU has none worth quoting). With N processes the peak is N x one process's (each
process's CPU rate is rank 0's, against one process's peak). `stemlm train` prints both in its final summary.
"""

from __future__ import annotations

import time

import torch

from stemlm.model.accounting import training_flops_per_token
from stemlm.model.config import ModelConfig


def matmul_shapes(config: ModelConfig, tokens: int) -> list[tuple[int, int, int]]:
    """Distinct (M, K, N) of the model's projections for a micro-batch of `tokens` positions."""
    d, f = config.hidden_size, config.intermediate_size
    q_width, kv_width = config.num_attention_heads * config.head_size, config.kv_heads * config.head_size
    shapes = [(d, q_width), (d, kv_width), (q_width, d), (d, f), (f, d), (d, config.vocab_size)]
    return sorted({(tokens, k, n) for k, n in shapes})


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak(
    shapes: list[tuple[int, int, int]], device: torch.device, dtype: torch.dtype = torch.float32, reps: int = 3
) -> dict[str, float]:
    """The best FLOP/s (2 M K N per matmul) over `shapes`, each timed `reps` times after one warm-up, in each
    clock: `{"wall": FLOPs per wall second, "cpu": FLOPs per CPU-second of this process}` (the fastest repetition
    per clock)."""
    best = {"wall": 0.0, "cpu": 0.0}
    gen = torch.Generator().manual_seed(0)
    for m, k, n in shapes:
        a = torch.randn(m, k, generator=gen).to(device, dtype)
        b = torch.randn(k, n, generator=gen).to(device, dtype)
        torch.matmul(a, b)
        _sync(device)
        fastest = {"wall": float("inf"), "cpu": float("inf")}
        for _ in range(reps):
            wall, cpu = time.perf_counter(), time.process_time()
            torch.matmul(a, b)
            _sync(device)
            cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
            fastest = {"wall": min(fastest["wall"], wall), "cpu": min(fastest["cpu"], cpu)}
        for clock, seconds in fastest.items():
            if seconds > 0:  # a CPU clock too coarse to see one matmul leaves that clock without a figure
                best[clock] = max(best[clock], 2 * m * k * n / seconds)
    return best


def training_throughput(
    config: ModelConfig,
    seq_len: int,
    tokens_per_s: float,
    cpu_tokens_per_s: float | None,
    micro_tokens: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    world_size: int = 1,
) -> dict[str, float]:
    """Model GFLOP/s at `tokens_per_s` (all ranks' tokens per wall second), the wall-clock matmul peak (GFLOP/s,
    x world_size) and their ratio; on a CPU with `cpu_tokens_per_s` (all ranks' tokens per CPU-second of rank 0)
    the same three per CPU-second of one process."""
    per_token = training_flops_per_token(config, seq_len)
    peak = matmul_peak(matmul_shapes(config, micro_tokens), device, dtype)
    out = {
        "model_gflops_per_s": per_token * tokens_per_s / 1e9,
        "matmul_peak_gflops_per_s": peak["wall"] * world_size / 1e9,
        "peak_share": per_token * tokens_per_s / (peak["wall"] * world_size),
    }
    if device.type == "cpu" and cpu_tokens_per_s and peak["cpu"]:  # a GPU's work does not show in CPU time
        achieved = per_token * cpu_tokens_per_s / world_size  # rank 0 trained 1 / world_size of the tokens
        out |= {
            "model_gflops_per_cpu_s": achieved / 1e9,
            "matmul_peak_gflops_per_cpu_s": peak["cpu"] / 1e9,
            "cpu_peak_share": achieved / peak["cpu"],
        }
    return out
