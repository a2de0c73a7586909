"""The fused lm_head + cross-entropy: loss and gradients chunk by chunk, never a [tokens, V] tensor kept.

`fused_linear_cross_entropy(hidden, weight, labels, chunk)` equals `cross_entropy(hidden @ weight.T, labels)`
(`stemlm.model.loss`; mean over labels that are not -100) and gives gradients for `hidden` and `weight` (a tied
lm_head passes the embedding weight). The idea is Liger-Kernel's fused linear cross-entropy: the forward walks
the tokens `chunk` at a time, and for each chunk computes its logits, their log-sum-exp, the loss, and at once
the gradient of the mean loss, softmax minus one-hot over the count of labels, which it multiplies into the
chunk's rows of d(hidden) = g @ W and into d(weight) += g.T @ h. Backward only scales the two saved gradients
by the incoming scalar gradient. So autograd keeps [tokens, hidden] + [V, hidden] (fp32) instead of the logits,
the log-probs and their [tokens, V] zero-filled gradient; a chunk's [chunk, V] logits live only inside the loop,
and the head runs three matmuls per chunk instead of the four of `chunked_cross_entropy`'s recompute.

Numerics: fp32 softmax and loss as `F.cross_entropy` on fp32 logits; under autocast the three matmuls run in
the autocast dtype like the plain path's, while d(weight) sums the chunks in fp32. Without grad (evaluation) the
gradient work is skipped. The model picks this path with `forward(..., loss_chunk=N, fused_loss=True)`.

Buffers: the chunks' fp32 [chunk, V] logits (then exp, then gradient) are written into one workspace per thread
and device, kept across chunks and calls (it never leaves the forward, so autograd holds no reference to it), and
fp32 d(hidden) rows are multiplied straight into their slice. A fresh [chunk, V] tensor per chunk had been the
largest allocation of a step: at a large V above glibc's mmap threshold, so mapped and unmapped each time, one
page fault per 4 KiB (benchmarks/train_step.py counts them). The workspace stays allocated after the last call,
one [chunk, V] fp32 buffer per thread that ran the loss, until `release_workspace()`. Results are bitwise those
of fresh buffers (tests/model/test_fused_loss.py).
"""

from __future__ import annotations

import threading

import torch

from stemlm.model.loss import IGNORE_INDEX

_WORKSPACE = threading.local()  # .buffers: device -> the largest flat fp32 buffer asked for on it


def _workspace(rows: int, cols: int, device: torch.device) -> torch.Tensor:
    """An uninitialised fp32 [rows, cols] view of this thread's reusable buffer on `device` (grown when short)."""
    buffers = _WORKSPACE.__dict__.setdefault("buffers", {})
    flat = buffers.get(device)
    if flat is None or flat.numel() < rows * cols:
        buffers[device] = None  # the old buffer is freed before the larger one is allocated
        flat = buffers[device] = torch.empty(rows * cols, dtype=torch.float32, device=device)
    return flat[: rows * cols].view(rows, cols)


def release_workspace() -> None:
    """Free this thread's workspaces (they are allocated again by the next call), e.g. once training is done, or
    so that a measurement of the loss's peak memory counts its [chunk, V] buffer."""
    _WORKSPACE.__dict__.pop("buffers", None)


def _chunk_exp(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor):
    """One chunk's exp(logits - row max) [chunk, V] in fp32 (the matmul in the autocast dtype, if any), its row
    sums [chunk, 1], the per-token losses (0 where ignored) and the matmul's dtype (that of the gradient products).
    The exp lives in the thread's workspace: it is valid until the next chunk."""
    logits = _workspace(h.shape[0], weight.shape[0], h.device)
    if h.dtype == weight.dtype == torch.float32 and not torch.is_autocast_enabled(h.device.type):
        torch.mm(h, weight.t(), out=logits)
        dtype = torch.float32
    else:
        raw = torch.mm(h, weight.t())  # in autocast's (or the model's) dtype, as the plain path's lm_head
        logits.copy_(raw)
        dtype = raw.dtype
    target_logit = logits.gather(1, _safe(targets)[:, None])
    top = logits.amax(dim=1, keepdim=True)
    # log-sum-exp written out, in place, so that one exp over [chunk, V] serves the loss and the softmax alike
    exp = logits.sub_(top).exp_()
    sums = exp.sum(dim=1, keepdim=True)
    losses = torch.where(targets != IGNORE_INDEX, (top + sums.log() - target_logit).squeeze(1), 0.0)
    return exp, sums, losses, dtype


def _safe(targets: torch.Tensor) -> torch.Tensor:
    return torch.where(targets != IGNORE_INDEX, targets, 0)  # an in-range column for ignored rows (weight 0)


class FusedLinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of `hidden` [N, d] @ `weight` [V, d].T against `labels` [N], `chunk` tokens at a time."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, chunk, need_hidden, need_weight):
        count = (labels != IGNORE_INDEX).sum()
        total = hidden.new_zeros((), dtype=torch.float32)
        need_grad = need_hidden or need_weight
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if need_weight else None
        for start in range(0, hidden.shape[0], chunk):
            h, targets = hidden[start : start + chunk], labels[start : start + chunk]
            exp, sums, losses, dtype = _chunk_exp(h, weight, targets)
            total += losses.sum()
            if not need_grad:
                continue
            # d(mean loss)/d(logits) = (softmax - onehot) / count on the chunk's valid rows, 0 on ignored ones;
            # built in place over the chunk's exp, the only [chunk, V] fp32 buffer.
            scale = torch.where(targets != IGNORE_INDEX, 1.0 / count, 0.0)[:, None]
            g = exp.mul_(scale / sums).scatter_add_(1, _safe(targets)[:, None], -scale).to(dtype)
            if need_hidden and g.dtype == weight.dtype == grad_hidden.dtype:
                torch.mm(g, weight, out=grad_hidden[start : start + chunk])  # no [chunk, d] temporary
            elif need_hidden:
                grad_hidden[start : start + chunk] = torch.mm(g, weight)
            if need_weight and g.dtype == grad_weight.dtype == h.dtype:
                grad_weight.addmm_(g.t(), h)  # fp32 without autocast: accumulate in place, no [V, d] temporary
            elif need_weight:
                grad_weight += torch.mm(g.t(), h)  # the autocast dtype's product, summed over chunks in fp32
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        # As F.cross_entropy's mean: 0/0 = nan when every label is ignored.
        return total / count

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight = ctx.saved_tensors
        d_hidden = None if grad_hidden is None else grad_hidden * grad_output
        d_weight = None if grad_weight is None else (grad_weight * grad_output).to(ctx.weight_dtype)
        return d_hidden, d_weight, None, None, None, None


def fused_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int
) -> torch.Tensor:
    """`cross_entropy(hidden @ weight.T, labels)` over `hidden` [..., d], `labels` [...], fused and chunked."""
    flat, targets = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    grad = torch.is_grad_enabled()
    return FusedLinearCrossEntropy.apply(
        flat, weight, targets, chunk, grad and flat.requires_grad, grad and weight.requires_grad
    )
