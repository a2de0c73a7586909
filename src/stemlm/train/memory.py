"""Training memory levers applied from outside the model: per-block activation checkpointing, and which loss path
a run takes.

    stemlm train --activation-checkpointing --loss-chunk 4096 ...

`checkpoint_blocks(model)` marks every decoder block with torch's composable `checkpoint`: a block's forward
runs without keeping its intermediate activations, and backward reruns it to get them. Only the block input
([B, T, hidden]) is kept per layer instead of attention and FFN intermediates (the [B, T, d_ff] products
dominate), for about one extra forward of compute. The composable form hooks the module instead of wrapping
it, so parameter names (the checkpoint format) do not change, and it composes with FSDP2 applied afterwards.
Recomputing is exact: the rerun block sees the same inputs and the STEM rows the lookup already fetched
(the `token` row provider indexes rows gathered before the forward, so no collective is repeated).
The chunked loss (`loss_chunk`) lives with the model's loss: `stemlm.model.loss`.

`resolve_loss(cfg, config)` settles `fused_loss=None` (the default) by the vocabulary: the fused lm_head +
cross-entropy (`stemlm.model.fused_loss`, chunks of `loss_chunk` tokens, `AUTO_LOSS_CHUNK` if unset) from
`FUSED_LOSS_MIN_VOCAB` tokens up, the plain path below. Measured on one CPU thread with the allocator setting of
`stemlm.train.allocator` (`benchmarks/train_step.py --vocab V`, docs/results.md "Close to the machine"): the
fused step is 0.99 of the plain one at V = 32768 (no gain) and 0.48-0.9 at V = 131072, where the plain path's
four [tokens, V] fp32 tensors are 1 GiB each and the fused loss's peak is 0.17 of the plain one's. Below the
threshold the plain path stays, so every run documented at V = 8192 or 49152 keeps its figures bitwise. An
explicit `fused_loss` (true or false) is kept, and the run's config records the resolved value.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from stemlm.model.config import ModelConfig
    from stemlm.train.config import TrainConfig

FUSED_LOSS_MIN_VOCAB = 65536  # from here up the default run takes the fused loss (see the module docstring)
AUTO_LOSS_CHUNK = 512  # tokens per chunk of the fused loss when the run sets no --loss-chunk


def default_loss_chunk(config: ModelConfig) -> int:
    """Tokens per loss chunk of a default run (no --loss-chunk, fused_loss unset): 0 (full logits) below
    `FUSED_LOSS_MIN_VOCAB`, else `AUTO_LOSS_CHUNK` (the fused loss); `stemlm info --memory` plans with it."""
    return AUTO_LOSS_CHUNK if config.vocab_size >= FUSED_LOSS_MIN_VOCAB else 0


def resolve_loss(cfg: TrainConfig, config: ModelConfig) -> TrainConfig:
    """`cfg` with `fused_loss` decided (None: by `config.vocab_size`) and, when fused, a `loss_chunk` > 0."""
    if cfg.fused_loss is not None:
        return cfg
    if not default_loss_chunk(config):
        return cfg.replace(fused_loss=False)
    return cfg.replace(fused_loss=True, loss_chunk=cfg.loss_chunk or AUTO_LOSS_CHUNK)


def checkpoint_blocks(model: nn.Module) -> nn.Module:
    """Apply activation checkpointing to each decoder block of `model` (in place); returns the model."""
    from torch.distributed._composable import checkpoint

    for layer in model.model.layers:
        checkpoint(layer)
    return model
