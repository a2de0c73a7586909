"""`--compile`: each decoder block compiled with `torch.compile`, in place, after activation checkpointing and
before FSDP2 (torchtitan's order), so parameter names and checkpoints do not change.

The STEM and dense forwards trace without graph breaks (tests/train/test_compile.py runs
`torch._dynamo.explain` on them): the model's host-side value checks of token ids and labels are skipped while
compiling (`stemlm.model.decoder._host_values`). Compiling per block keeps one graph per distinct block kind,
reused by every layer of that kind. `BACKEND` is inductor; the tests use a lighter one.
"""

from __future__ import annotations

from torch import nn

BACKEND = "inductor"


def compile_blocks(model: nn.Module, backend: str | None = None) -> nn.Module:
    """Compile every decoder block of `model` in place (`nn.Module.compile`); returns the model."""
    for layer in model.model.layers:
        layer.compile(backend=backend or BACKEND)
    return model
