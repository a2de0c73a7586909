"""Fused projections for decoding, applied from outside: `fuse_for_decoding(model)` swaps modules, `unfuse` undoes it.

A module declares which of its bias-free projections take one input, as a class attribute: `fusable = (("q_proj",
"k_proj", "v_proj"), ("o_proj",))` for attention, `(("gate_proj", "up_proj"),)` for the SwiGLU kinds, and so on.
`fuse_for_decoding` replaces each declared linear with a `FusedLinear` holding the same Parameter (so state_dict
names, checkpoints and edits see the very weights they saw) and sharing a `FusedGroup` with the others of its
group; `stemlm.model.experts.Experts` becomes a `FusedExperts` the same way. The group keeps a `FusedCopy`, the
concatenation [W_1; W_2; ...] of its weights, and in a forward without grad the first member called on an input
computes the one product for all of them (one matrix-vector product a token instead of two or three, which is what
a decode step is made of); each other member called on that same input takes its part, and once every part is
taken nothing of it is kept. The model code calls `self.q_proj(x)` as ever and never knows.

On a CPU, a copy with at least as many outputs as inputs is stored transposed, [in, out] (`stored_transposed`),
and multiplied as x @ W^T: a matrix-vector product then streams whole rows of W^T into a short output vector,
where the [out, in] layout takes one short dot product per output. From memory, one thread, on two AMD EPYCs (one
AVX2, one AVX-512) the transposed layout ran 2.2-2.6x as fast for the tiny lm_head (8192 x 256), 1.9-2.2x for a
fused gate/up (1536 x 256), 1.5-1.8x for 768 x 256, 1.03-1.24x for a square matrix (256 and 960 wide) and
0.67-0.99x for the down projection (256 x 768, 960 x 2560), which therefore stays as it is; on an Intel Xeon
(AVX-512, AMX) every copy so stored ran 1.06-1.23x as fast and the down projection 1.00-1.05x
(`benchmarks/matvec_layout.py` prints these ratios on the machine at hand). A group of one linear (STEM's gate,
o_proj, the lm_head) gets a copy only when it is stored transposed; otherwise it has nothing to gain from one.

The copy costs the fused weights' memory once more. It stands in only in forwards without grad (a training step
needs the parameters' own graph) and while every weight is the one it was made from: same storage, same in-place
version, same device and dtype. A load, an edit or `.to()` changes one of these, and the stale copy is then dropped
for good (fuse again to refresh). Storage pointers can't be traced by torch.compile, so a compiled forward skips
that check and `drop_stale_copies` makes it before each compiled decoding step (`InferenceModel(compile=True)`,
stemlm.inference.inference_model); the compiled graph is guarded on each copy being there, and recompiles for the
plain projections when one is dropped. A linear that has hooks when fusing is left as it is (its hooks
stay where they were registered). Outputs equal the separate products to rounding (the GEMM blocks the columns
another way), not bitwise; tests/model/test_fusion.py and tests/inference/test_lean_decode.py check logits and
greedy tokens for every kind.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from stemlm.model.experts import Experts


def stored_transposed(out_features: int, in_features: int, device: torch.device) -> bool:
    """Whether a decoding copy of an [out, in] weight is kept as [in, out] (see the module docstring)."""
    return device.type == "cpu" and out_features >= in_features


def _sources(weights: Sequence[torch.Tensor | None]) -> tuple:
    return tuple([None if w is None else (w.data_ptr(), w._version, w.device, w.dtype) for w in weights])


@dataclass
class FusedCopy:
    """A group's weights concatenated along `dim` (transposed: the [in, out] transpose of the concatenation)."""

    weight: torch.Tensor
    sizes: list[int]  # each weight's share of the outputs, in order
    transposed: bool
    made_from: tuple  # (storage pointer, in-place version, device, dtype) of each weight when copied

    def product(self, x: torch.Tensor) -> torch.Tensor:
        return torch.matmul(x, self.weight) if self.transposed else F.linear(x, self.weight)


@dataclass(slots=True)
class _Product:
    """The latest input's product, split, until each member has taken its part (None once taken)."""

    input: torch.Tensor
    version: int | None  # the input's in-place version (None while compiling: not traceable)
    parts: list[torch.Tensor | None]
    left: int  # parts not taken yet


class FusedGroup:
    """Weights of one input, named as (module, attribute) pairs, and their decoding copy (None: dropped).

    Several threads may run forwards at once: a member takes a part only of the very input object it is called on,
    so a product another thread replaced is recomputed, never mixed up."""

    def __init__(self, weights: Sequence[tuple[nn.Module, str]], dim: int = 0, transpose: bool = False) -> None:
        self.weights = list(weights)
        self.pending: _Product | None = None
        tensors = self.tensors()
        with torch.no_grad():
            weight = torch.cat(tensors, dim)
            if transpose:
                weight = weight.t().contiguous()
        self.copy: FusedCopy | None = FusedCopy(weight, [w.shape[dim] for w in tensors], transpose, _sources(tensors))

    def tensors(self) -> list[torch.Tensor | None]:
        return [getattr(module, name, None) for module, name in self.weights]

    def stale(self) -> bool:
        return self.copy is not None and self.copy.made_from != _sources(self.tensors())

    def usable(self) -> FusedCopy | None:
        """The copy if it may stand in for the weights now (see the module docstring); a stale one is dropped."""
        if self.copy is None or torch.is_grad_enabled():
            return None
        if not torch.compiler.is_compiling() and self.stale():  # compiled: checked before the step
            self.copy = self.pending = None
        return self.copy

    def part(self, index: int, x: torch.Tensor) -> torch.Tensor | None:
        """Weight `index`'s product with x, from the one product of all of them; None: not to be fused now."""
        pending = self.pending
        if pending is not None and pending.input is x and not torch.is_grad_enabled():
            part = pending.parts[index]
            if part is not None and (pending.version is None or pending.version == x._version):
                pending.parts[index] = None
                pending.left -= 1
                if pending.left == 0 and self.pending is pending:
                    self.pending = None  # every part taken: keep nothing of this input
                return part
        copy = self.usable()
        if copy is None:
            return None
        if len(copy.sizes) == 1:
            return copy.product(x)
        parts: list[torch.Tensor | None] = list(copy.product(x).split(copy.sizes, dim=-1))
        part, parts[index] = parts[index], None
        version = None if torch.compiler.is_compiling() else x._version
        self.pending = _Product(x, version, parts, len(parts) - 1)
        return part


class FusedLinear(nn.Linear):
    """A bias-free linear over the same Parameter as the one it replaces, whose output without grad is its part of
    its group's one product (`FusedGroup.part`); with grad, or once the copy is dropped, the plain product."""

    def __init__(self, linear: nn.Linear, group: FusedGroup, index: int) -> None:
        super().__init__(linear.in_features, linear.out_features, bias=False, device="meta")
        self.weight = linear.weight
        self.group, self.index = group, index
        group.weights[index] = (self, "weight")  # read from here on: a Parameter assigned to it later is seen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.group.part(self.index, x)
        return F.linear(x, self.weight) if y is None else y


class FusedExperts(Experts):
    """`Experts` over the same Parameters, each expert's gate and up run as one product without grad: the copy
    stacks [gate_e; up_e] per expert, [E, 2 * expert_size, d]."""

    def __init__(self, experts: Experts) -> None:
        num_experts, expert_size, hidden_size = experts.gate_proj.shape
        with torch.device("meta"):
            super().__init__(num_experts, hidden_size, expert_size)
        for name, param in experts.named_parameters(recurse=False):
            setattr(self, name, param)
        (names,) = Experts.fusable
        self.group = FusedGroup([(self, name) for name in names], dim=1)

    def gate_up(self, e: int, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        copy = self.group.usable()
        if copy is None:
            return super().gate_up(e, x)
        return (x @ copy.weight[e].t()).split(copy.sizes, dim=-1)


def _release(module: nn.Module) -> None:
    """Free the copy of a fused module being replaced (it and its group refer to each other: no prompt refcount)."""
    if isinstance(module, FusedLinear | FusedExperts):
        module.group.copy = module.group.pending = None


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


def _fuse_linears(module: nn.Module, names: Sequence[str]) -> None:
    linears = [getattr(module, name) for name in names]
    if any(linear.bias is not None for linear in linears):
        raise ValueError(f"{type(module).__name__}.fusable names a linear with a bias: {names}")
    if any(_hooked(linear) for linear in linears):
        return
    weight = linears[0].weight
    transpose = stored_transposed(sum(linear.out_features for linear in linears), weight.shape[1], weight.device)
    if len(linears) == 1 and not transpose:
        return
    group = FusedGroup([(linear, "weight") for linear in linears], transpose=transpose)
    for index, (name, linear) in enumerate(zip(names, linears, strict=True)):
        _release(linear)
        setattr(module, name, FusedLinear(linear, group, index))


def fuse_for_decoding(model: nn.Module) -> None:
    """Fuse every group of projections `model`'s modules declare (`fusable`) for inference, refreshing any copy
    made before: each layer's q/k/v, the FFN's gate/up where the kind has both, the experts' gate/up; on a CPU the
    single linears stored transposed (STEM's gate, o_proj, the lm_head) get a copy too."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, Experts) and not _hooked(child):
                _release(child)
                setattr(module, name, FusedExperts(child))
        if not isinstance(module, Experts):
            for names in getattr(module, "fusable", ()):
                _fuse_linears(module, names)


def unfuse(model: nn.Module) -> None:
    """Put plain modules back over the same Parameters (what `fuse_for_decoding` swapped), dropping the copies."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, FusedLinear):
                plain = nn.Linear(child.in_features, child.out_features, bias=False, device="meta")
                plain.weight = child.weight
            elif isinstance(child, FusedExperts):
                with torch.device("meta"):
                    plain = Experts(child.num_experts, child.gate_proj.shape[2], child.gate_proj.shape[1])
                for param_name, param in child.named_parameters(recurse=False):
                    setattr(plain, param_name, param)
            else:
                continue
            _release(child)
            setattr(module, name, plain)


def fusion_groups(model: nn.Module) -> list[FusedGroup]:
    """The groups of `model`'s fused modules that hold a copy now."""
    groups = {id(m.group): m.group for m in model.modules() if isinstance(m, FusedLinear | FusedExperts)}
    return [group for group in groups.values() if group.copy is not None]


def drop_stale_copies(groups: Sequence[FusedGroup]) -> None:
    """Drop the copy of each of `groups` whose weights changed since it was made: the check an eager forward
    makes, made outside a compiled one (`stemlm.inference.inference_model.InferenceModel(compile=True)`)."""
    for group in groups:
        if group.stale():
            group.copy = group.pending = None
