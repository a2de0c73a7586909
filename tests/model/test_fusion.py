"""Fusion from outside (`stemlm.model.fusion`): `fuse_for_decoding` swaps each projection a module declares fusable
for a `FusedLinear` over the same Parameter (experts: `FusedExperts`); logits equal the plain model's to rounding for
every kind, the state_dict keeps its names and tensors, a weight edited or replaced after fusing drops its group's
copy (the edited model then equals a plain one so edited, bitwise), a forward with grad takes the parameters' own
products, on a CPU the wide copies are kept transposed, and `unfuse` puts plain modules back.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from stemlm.model.config import FFN_KINDS
from stemlm.model.experts import Experts
from stemlm.model.fusion import (
    FusedCopy,
    FusedExperts,
    FusedLinear,
    fuse_for_decoding,
    fusion_groups,
    stored_transposed,
    unfuse,
)
from tests.conftest import make_tiny_model

IDS = torch.tensor([[5, 17, 3, 99, 42, 7]])


def declared(model: nn.Module) -> list[nn.Module]:
    """The modules `fuse_for_decoding` swaps: every linear a module declares fusable, and every Experts."""
    linears = [
        getattr(m, name)
        for m in model.modules()
        if not isinstance(m, Experts)
        for group in getattr(m, "fusable", ())
        for name in group
    ]
    return linears + [m for m in model.modules() if isinstance(m, Experts)]


def all_fused(model: nn.Module) -> bool:
    """Every declared projection runs from a live decoding copy (on a CPU every declared group of the tiny models
    gets one: the single ones, STEM's gate, o_proj and the lm_head, have at least as many outputs as inputs)."""
    return all(isinstance(m, FusedLinear | FusedExperts) and m.group.copy is not None for m in declared(model))


def logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


@pytest.mark.parametrize("kind", FFN_KINDS)
def test_fused_logits_equal_the_plain_ones_and_the_state_dict_is_unchanged(kind):
    plain, fused = make_tiny_model(kind), make_tiny_model(kind)
    before = fused.state_dict(keep_vars=True)
    fuse_for_decoding(fused)
    assert all_fused(fused)
    after = fused.state_dict(keep_vars=True)
    assert list(after) == list(before) == list(plain.state_dict())
    assert all(after[name] is before[name] for name in before)  # the same Parameter objects, not copies
    torch.testing.assert_close(logits(fused), logits(plain), atol=1e-6, rtol=0)
    assert all(group.pending is None for group in fusion_groups(fused))  # no product kept after the forward


@pytest.mark.parametrize("kind", FFN_KINDS)
def test_every_module_with_gate_and_up_of_one_input_declares_them(kind):
    for module in make_tiny_model(kind).modules():
        if hasattr(module, "gate_proj") and hasattr(module, "up_proj"):
            assert any({"gate_proj", "up_proj"} <= set(group) for group in module.fusable), type(module).__name__


def test_no_copy_is_hidden_in_a_module_dict():
    model = make_tiny_model("moe")
    fuse_for_decoding(model)
    assert not any("_fused" in vars(m) for m in model.modules())
    groups = fusion_groups(model)
    assert groups and all(isinstance(group.copy, FusedCopy) for group in groups)


def test_wide_copies_are_kept_transposed_on_a_cpu_and_a_narrow_single_linear_gets_none():
    model = make_tiny_model("stem")  # d = 64, d_ff = 128, V = 256; layer 1 is a STEM layer
    fuse_for_decoding(model)
    layer = model.model.layers[1]
    qkv = (model.config.num_attention_heads + 2 * model.config.kv_heads) * model.config.head_size
    copies = {
        "lm_head": model.lm_head.group.copy,
        "stem gate": layer.mlp.gate_proj.group.copy,
        "q/k/v": layer.self_attn.q_proj.group.copy,
        "o_proj": layer.self_attn.o_proj.group.copy,  # square: kept [in, out] too
    }
    shapes = {name: tuple(copy.weight.shape) for name, copy in copies.items()}
    assert shapes == {"lm_head": (64, 256), "stem gate": (64, 128), "q/k/v": (64, qkv), "o_proj": (64, 64)}
    assert all(copy.transposed for copy in copies.values())
    assert layer.self_attn.q_proj.group is layer.self_attn.v_proj.group  # one group, one product
    assert type(layer.mlp.down_proj) is nn.Linear  # no declared group
    assert not stored_transposed(64, 128, torch.device("cpu"))  # the down projection's shape: kept [out, in]
    assert not stored_transposed(8192, 256, torch.device("cuda"))  # the layout rule was measured on CPUs only
    linear = nn.Linear(128, 64, bias=False)
    holder = type("Holder", (nn.Module,), {"fusable": (("proj",),)})()
    holder.proj = linear
    fuse_for_decoding(holder)
    assert holder.proj is linear  # a narrow single linear has nothing to gain from a copy


@pytest.mark.parametrize(
    ("kind", "weight"),
    [
        ("dense", lambda model: model.model.layers[1].self_attn.v_proj.weight),
        ("dense", lambda model: model.model.layers[1].mlp.up_proj.weight),
        ("moe", lambda model: model.model.layers[1].mlp.experts.gate_proj),
        ("stem", lambda model: model.lm_head.weight),
    ],
)
def test_a_weight_edited_after_fusing_drops_its_copy_and_grad_takes_the_parameters(kind, weight):
    model = make_tiny_model(kind)
    fuse_for_decoding(model)
    model(IDS).logits.sum().backward()  # with grad: the parameters' own products, so they get gradients
    assert all(p.grad is not None for p in model.model.layers[1].parameters())
    live = len(fusion_groups(model))
    with torch.no_grad():
        weight(model).mul_(2.0)  # an in-place edit after fusing
    edited = logits(model)
    assert len(fusion_groups(model)) == live - 1  # the edited group's stale copy was dropped, the others kept
    fresh = make_tiny_model(kind)
    with torch.no_grad():
        weight(fresh).mul_(2.0)
    torch.testing.assert_close(edited, logits(fresh), atol=0, rtol=0)


def test_fusing_again_refreshes_a_dropped_copy_and_frees_the_old_one():
    model, edited = make_tiny_model("moe"), make_tiny_model("moe")
    fuse_for_decoding(model)
    old = model.model.layers[1].mlp.experts.group
    with torch.no_grad():
        for m in (model, edited):
            m.model.layers[1].mlp.experts.up_proj.mul_(2.0)
            m.model.layers[0].mlp.up_proj.weight.mul_(2.0)
    logits(model)  # drops the two stale copies
    fuse_for_decoding(model)
    assert all_fused(model) and old.copy is None
    torch.testing.assert_close(logits(model), logits(edited), atol=1e-6, rtol=0)


def test_a_weight_replaced_after_fusing_is_seen():
    model, other = make_tiny_model("dense"), make_tiny_model("dense", seed=1)
    fuse_for_decoding(model)
    model.load_state_dict(other.state_dict(), assign=True)  # new Parameter objects on the fused modules
    torch.testing.assert_close(logits(model), logits(other), atol=0, rtol=0)
    assert fusion_groups(model) == []  # every copy was made from the replaced weights: dropped


def test_parts_are_taken_from_one_product_and_a_new_input_gets_its_own():
    model = make_tiny_model("dense")
    fuse_for_decoding(model)
    attn = model.model.layers[0].self_attn
    x, y = torch.randn(1, 3, 64), torch.randn(1, 3, 64)
    with torch.no_grad():
        q = attn.q_proj(x)
        assert attn.q_proj.group.pending is not None  # k and v wait for their parts
        k_other = attn.k_proj(y)  # another input: a product of its own
        k, v = attn.k_proj(x), attn.v_proj(x)
    for got, linear, inp in ((q, attn.q_proj, x), (k, attn.k_proj, x), (v, attn.v_proj, x), (k_other, attn.k_proj, y)):
        torch.testing.assert_close(got, inp @ linear.weight.t(), atol=1e-6, rtol=0)


def test_a_linear_with_hooks_stays_plain_and_its_hook_sees_its_call():
    model, calls = make_tiny_model("dense"), []
    model.model.layers[0].mlp.up_proj.register_forward_hook(lambda m, i, o: calls.append(o.shape))
    fuse_for_decoding(model)
    mlp = model.model.layers[0].mlp
    assert type(mlp.gate_proj) is nn.Linear and type(mlp.up_proj) is nn.Linear
    logits(model)
    assert calls == [torch.Size([1, IDS.shape[1], model.config.intermediate_size])]


@pytest.mark.parametrize("kind", ["ple", "moe"])
def test_unfuse_puts_plain_modules_back_over_the_same_parameters(kind):
    model, plain = make_tiny_model(kind), make_tiny_model(kind)
    params = dict(model.named_parameters())
    fuse_for_decoding(model)
    unfuse(model)
    assert not any(isinstance(m, FusedLinear | FusedExperts) for m in model.modules())
    assert all(type(m) in (nn.Linear, Experts) for m in declared(model))
    assert dict(model.named_parameters()) == params
    torch.testing.assert_close(logits(model), logits(plain), atol=0, rtol=0)
