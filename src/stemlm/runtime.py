"""Where and in what precision a command computes: `--device` and `--dtype` values resolved to torch objects.

One place for every command (train, generate, serve, eval, convert), so `auto`, a missing CUDA device and an
out-of-range `cuda:N` read the same everywhere. Where a model's lookup tables live (`--tables`) is a table
placement's business: `stemlm.placement.registry`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stemlm.errors import StemlmError

if TYPE_CHECKING:  # torch loads when a value is resolved, so importing this keeps a CLI parser light
    import torch


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
