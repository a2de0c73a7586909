"""How close a training run came to the machine: achieved model FLOP/s against a matmul peak measured here.

`training_throughput(config, seq_len, tokens_per_s, tokens, device, dtype)` returns the achieved model FLOP/s
(training FLOPs per token from `stemlm.model.accounting`, i.e. 3 x the forward matmuls with causal attention, times
the run's tokens/s) and a peak measured in the same process: the best FLOP/s of plain matmuls at the model's
own shapes ([tokens of a micro-batch, in] x [in, out] for every distinct projection, the LM head included),
on the same device, dtype and threads. Their ratio is a model-FLOPs utilisation against what this machine's
matmul kernels reach at these shapes, not against a datasheet number (a CPU has none worth quoting, and a
shared one delivers less than it). With N processes the peak is N x one process's.
`stemlm train` prints it in its final summary.
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
) -> float:
    """The best FLOP/s (2 M K N per matmul) over `shapes`, each timed `reps` times after one warm-up."""
    best = 0.0
    gen = torch.Generator().manual_seed(0)
    for m, k, n in shapes:
        a = torch.randn(m, k, generator=gen).to(device, dtype)
        b = torch.randn(k, n, generator=gen).to(device, dtype)
        torch.matmul(a, b)
        _sync(device)
        fastest = float("inf")
        for _ in range(reps):
            start = time.perf_counter()
            torch.matmul(a, b)
            _sync(device)
            fastest = min(fastest, time.perf_counter() - start)
        best = max(best, 2 * m * k * n / fastest)
    return best


def training_throughput(
    config: ModelConfig,
    seq_len: int,
    tokens_per_s: float,
    tokens: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    world_size: int = 1,
) -> dict[str, float]:
    """Achieved model GFLOP/s, the matmul peak measured now (GFLOP/s, x world_size) and their ratio."""
    achieved = training_flops_per_token(config, seq_len) * tokens_per_s
    peak = matmul_peak(matmul_shapes(config, tokens), device, dtype) * world_size
    return {"model_gflops_per_s": achieved / 1e9, "matmul_peak_gflops_per_s": peak / 1e9, "peak_share": achieved / peak}
