"""The language-model loss: cross-entropy of the lm_head's logits, whole or in chunks of tokens.

`cross_entropy(logits, labels)` is the plain form: fp32 logits [N, V], mean over the labels that are not -100.
`chunked_cross_entropy(hidden, head, labels, chunk)` gives the same value (up to summation order, ~1e-7
relative) without ever holding the [N, V] logits: each chunk of `chunk` tokens runs head + cross-entropy under
`torch.utils.checkpoint`, so autograd keeps only the chunk's input and recomputes its logits in backward, one
chunk at a time. For paper-1b (V = 128,256) a 16k-token micro-batch would keep 8 GiB of fp32 logits plus the
bf16 copy; chunks of 4096 keep 2 GiB transiently. The model picks this path with `forward(..., loss_chunk=N)`.
`stemlm.model.fused_loss` is the fused alternative (`fused_loss=True`): gradients formed in the forward pass,
three head matmuls per chunk instead of four.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

IGNORE_INDEX = -100


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of fp32 `logits` [..., V] against `labels` [...] (-100 = ignored)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX)


def _chunk_loss_sum(hidden: torch.Tensor, head: nn.Module, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(hidden).float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_cross_entropy(hidden: torch.Tensor, head: nn.Module, labels: torch.Tensor, chunk: int) -> torch.Tensor:
    """`cross_entropy(head(hidden), labels)` computed `chunk` tokens at a time, logits recomputed in backward."""
    flat, targets = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, flat.shape[0], chunk):
        part = slice(start, start + chunk)
        total = total + checkpoint(_chunk_loss_sum, flat[part], head, targets[part], use_reentrant=False)
    # As F.cross_entropy's mean: divided by the count of non-ignored labels (0/0 = nan when all are ignored).
    return total / (targets != IGNORE_INDEX).sum()
