"""Where and in what precision a command computes: `--device` and `--dtype` values resolved to torch objects,
and where a model's lookup tables live (`--tables`).

One place for every command (train, generate, serve, eval, convert), so `auto`, a missing CUDA device and an
out-of-range `cuda:N` read the same everywhere. A table placement is one of `TABLE_PLACEMENTS`: `device` (the
tables are ordinary parameters on the compute device), `host` (host memory, rows gathered to the device) or
`mmap` (memory-mapped from the checkpoint file, inference only: training updates its rows in place).
`resident`, the inference commands' word for `device`, names the same placement everywhere.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stemlm.errors import StemlmError

if TYPE_CHECKING:  # torch loads when a value is resolved, so importing this keeps a CLI parser light
    import torch

DEVICE, HOST, MMAP = "device", "host", "mmap"
TABLE_PLACEMENTS = (DEVICE, HOST, MMAP)
TRAINING_PLACEMENTS = (DEVICE, HOST)
SYNONYMS = {"resident": DEVICE}


def table_placement(name: str, allowed: tuple[str, ...] = TABLE_PLACEMENTS) -> str:
    """The placement `name` names ("resident" is "device"), or a one-line error listing the `allowed` ones."""
    placement = SYNONYMS.get(name, name)
    if placement not in allowed:
        also = {v: k for k, v in SYNONYMS.items()}
        names = [f"{p} (or {also[p]})" if p in also else p for p in allowed]
        raise StemlmError(f"unknown table placement {name!r}; choose one of {', '.join(names)}")
    return placement


def placement_choices(allowed: tuple[str, ...]) -> tuple[str, ...]:
    """The `--tables` values that name the `allowed` placements, their synonyms included."""
    return allowed + tuple(k for k, v in SYNONYMS.items() if v in allowed)


def resolve_device(name: str) -> torch.device:
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise StemlmError("device cuda requested but torch sees no CUDA device; use --device cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    import torch

    # On the project's AVX2 CPU (no native bf16 matmul) a tiny-preset step under bf16 autocast measured ~13x
    # slower than fp32 (28.5 vs 2.2 CPU-seconds), so auto picks bf16 only on a CUDA device that supports it.
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    return torch.bfloat16 if name == "bf16" else torch.float32


def check_device(device: str | torch.device) -> torch.device:
    """The torch device a `--device` value names, or a one-line error (unknown name, CUDA absent or out of range)."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise StemlmError(f"unknown device {str(device)!r}; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise StemlmError(f"device {dev} requested but torch sees no CUDA device; use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise StemlmError(f"device {dev} does not exist ({torch.cuda.device_count()} CUDA devices visible)")
    return dev
