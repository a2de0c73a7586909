"""Fused projections for decoding: several bias-free projections of one input run as one matrix product.

`fuse(module, linears)` keeps the concatenation [W_1; W_2; ...] of the linears' weights on `module`, and
`project(module, linears, x)` returns their outputs (W_1 x, W_2 x, ...), from that one product when it may stand
in for them, else from each linear. Attention fuses q/k/v, the SwiGLU kinds gate/up (`stemlm.model.ffn.GateUp`),
the experts their stacked gate/up (`stemlm.model.experts`): one matrix-vector product a token instead of two or
three, which is what a decode step is made of. `StemLM.fuse_for_decoding` applies it at load for inference.

On a CPU, a copy with at least as many outputs as inputs is stored transposed, [in, out] (`stored_transposed`),
and multiplied as x @ W^T: a matrix-vector product then streams whole rows of W^T into a short output vector,
where the [out, in] layout takes one short dot product per output. From memory, one thread, on two AMD EPYCs (one
AVX2, one AVX-512) the transposed layout ran 2.2-2.6x as fast for the tiny lm_head (8192 x 256), 1.9-2.2x for a
fused gate/up (1536 x 256), 1.5-1.8x for 768 x 256, 1.03-1.24x for a square matrix (256 and 960 wide) and
0.67-0.99x for the down projection (256 x 768, 960 x 2560), which therefore stays as it is; on an Intel Xeon
(AVX-512, AMX) every copy so stored ran 1.06-1.23x as fast and the down projection 1.00-1.05x
(`benchmarks/matvec_layout.py` prints these ratios on the machine at hand). A single linear gets a copy only when
it is stored transposed (STEM's gate, o_proj, the lm_head: `fuse_single`); otherwise it has nothing to gain from
one.

The fused weight is a copy beside the parameters (their names and storage stay the checkpoint's, so what is
saved is unchanged; the copy costs the fused weights' memory once more). It stands in only in forwards without
grad (a training step needs the parameters' own graph), while no forward hook sits on the linears (a hook must
see its call), and while every weight is the one it was made from: same storage, same in-place version, same
device and dtype. A load, an edit or `.to()` changes one of these, and the stale copy is then dropped for good
(fuse again to refresh). Storage pointers can't be traced by torch.compile, so a compiled forward skips that check
and `drop_stale_copies` makes it before each compiled decoding step (`stemlm.inference.load.compile_decoding`); the
compiled graph is guarded on each copy being there, and recompiles for the plain projections when one is dropped.
Outputs equal the separate products to rounding (the GEMM blocks the columns another way), not bitwise;
tests/inference/test_lean_decode.py checks greedy tokens and logits for every kind.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

FUSED = "_fused"  # on the owning module: (weight, split sizes, sources, transposed, the weights' names) or None


def _sources(weights: Sequence[torch.Tensor]) -> tuple:
    return tuple((w.data_ptr(), w._version, w.device, w.dtype) for w in weights)


def stored_transposed(out_features: int, in_features: int, device: torch.device) -> bool:
    """Whether a decoding copy of an [out, in] weight is kept as [in, out] (see the module docstring)."""
    return device.type == "cpu" and out_features >= in_features


def fuse_weights(module: nn.Module, weights: Sequence[torch.Tensor], dim: int = 0, transposed: bool = False) -> None:
    """Keep `weights` concatenated along `dim` on `module` (transposed: as the [in, out] transpose of the
    concatenation of [out, in] weights along dim 0), for `fused_weight`."""
    names = {id(p): name for name, p in module.named_parameters()}  # to find the weights again: drop_stale_copies
    with torch.no_grad():
        weight = torch.cat(tuple(weights), dim)
        if transposed:
            weight = weight.t().contiguous()
        sizes = [w.shape[dim] for w in weights]
        module.__dict__[FUSED] = (weight, sizes, _sources(weights), transposed, [names[id(w)] for w in weights])


def fused_weight(
    module: nn.Module, weights: Sequence[torch.Tensor], hooked: Sequence[nn.Module]
) -> tuple[torch.Tensor, list[int]] | None:
    """The fused weight and its split sizes if it may stand in for `weights` now (see the module docstring)."""
    fused = module.__dict__.get(FUSED)
    if fused is None or torch.is_grad_enabled():
        return None
    if any(m._forward_hooks or m._forward_pre_hooks for m in hooked):
        return None
    if torch.compiler.is_compiling():  # storage pointers can't be traced: checked before the step (drop_stale_copies)
        return fused[0], fused[1]
    if fused[2] != _sources(weights):
        module.__dict__[FUSED] = None  # stale: the separate weights from now on
        return None
    return fused[0], fused[1]


def fused_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of `model` (itself included) that hold a fused copy now."""
    return [m for m in model.modules() if m.__dict__.get(FUSED) is not None]


def drop_stale_copies(modules: Sequence[nn.Module]) -> None:
    """Drop the fused copy of each of `modules` whose weights changed since it was made: the check `fused_weight`
    makes in an eager forward, made outside a compiled one (`stemlm.inference.load.compile_decoding`)."""
    for module in modules:
        fused = module.__dict__.get(FUSED)
        if fused is None:
            continue
        try:
            weights = [module.get_parameter(name) for name in fused[4]]
        except AttributeError:  # a weight was removed or replaced by a plain tensor
            weights = None
        if weights is None or fused[2] != _sources(weights):
            module.__dict__[FUSED] = None


def _transposed(module: nn.Module) -> bool:
    return module.__dict__[FUSED][3]


def is_fused(module: nn.Module) -> bool:
    return module.__dict__.get(FUSED) is not None


def fuse(module: nn.Module, linears: Sequence[nn.Linear]) -> None:
    weights = [m.weight for m in linears]
    out_features = sum(w.shape[0] for w in weights)
    fuse_weights(module, weights, transposed=stored_transposed(out_features, weights[0].shape[1], weights[0].device))


def fuse_single(module: nn.Module, linear: nn.Linear) -> None:
    """A decoding copy of one linear's weight, kept only where it is stored transposed (`project` uses it)."""
    if stored_transposed(*linear.weight.shape, linear.weight.device):
        fuse(module, (linear,))


def project(module: nn.Module, linears: Sequence[nn.Linear], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(linear(x) for each linear), as one product with `module`'s fused weight when it may stand in."""
    fused = fused_weight(module, [m.weight for m in linears], linears)
    if fused is None:
        return tuple(m(x) for m in linears)
    weight, sizes = fused
    y = torch.matmul(x, weight) if _transposed(module) else F.linear(x, weight)
    return y.split(sizes, dim=-1) if len(sizes) > 1 else (y,)
