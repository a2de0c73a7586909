"""Refuse to build a model whose weights cannot fit: the exact parameter count of the config
(`stemlm.model.accounting`) times the element size, against the memory free on the target device.

    from stemlm.model.memory_check import check_fits
    check_fits(config, "cuda:0")      # StemlmError: "the model needs 52.0 GiB ... only 11.3 GiB is free on cuda:0"

`build_model` calls it before allocating, so a config within the size bounds of `ModelConfig` but too large for
the machine (a 4M-token vocabulary at width 65536) is one line, not an out-of-memory kill half-way through the
build. Only the weights are counted: what training adds (gradients, optimizer state, activations) comes later and
is the memory plan's business; a model that passes may still fail to train, never to be built.
"""

from __future__ import annotations

import os

import torch

from stemlm.errors import StemlmError
from stemlm.model.accounting import total_parameters
from stemlm.model.config import ModelConfig


def free_bytes(device: torch.device) -> int | None:
    """Memory free for new tensors on `device` (host: MemAvailable), or None when it cannot be told."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            return None
    return None  # mps and others: no portable query; the allocator's own error stands


def check_fits(config: ModelConfig, device: str | torch.device, element_bytes: int = 4) -> None:
    """Raise a one-line StemlmError when the weights of `config` exceed the free memory of `device`."""
    device = torch.device(device)
    if device.type == "meta":
        return
    params = total_parameters(config)
    need = params * element_bytes
    free = free_bytes(device)
    if free is not None and need > free:
        gib = 1024**3
        raise StemlmError(
            f"the model needs {need / gib:.1f} GiB for its {params:,} parameters ({element_bytes} bytes each) but "
            f"only {free / gib:.1f} GiB is free on {device}; use a smaller config"
        )
