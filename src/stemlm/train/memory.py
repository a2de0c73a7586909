"""Training memory levers applied from outside the model: per-block activation checkpointing.

    stemlm train --activation-checkpointing --loss-chunk 4096 ...

`checkpoint_blocks(model)` marks every decoder block with torch's composable `checkpoint`: a block's forward
runs without keeping its intermediate activations, and backward reruns it to get them. Only the block input
([B, T, hidden]) is kept per layer instead of attention and FFN intermediates (the [B, T, d_ff] products
dominate), for about one extra forward of compute. The composable form hooks the module instead of wrapping
it, so parameter names (the checkpoint format) do not change, and it composes with FSDP2 applied afterwards.
Recomputing is exact: the rerun block sees the same inputs and the STEM rows the lookup already fetched
(the `token` row provider indexes rows gathered before the forward, so no collective is repeated).
The chunked loss (`loss_chunk`) lives with the model's loss: `stemlm.model.loss`.
"""

from __future__ import annotations

from torch import nn


def checkpoint_blocks(model: nn.Module) -> nn.Module:
    """Apply activation checkpointing to each decoder block of `model` (in place); returns the model."""
    from torch.distributed._composable import checkpoint

    for layer in model.model.layers:
        checkpoint(layer)
    return model
