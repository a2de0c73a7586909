"""Tests for the table optimizers, row-sparse gradients, mixed clipping and flat optimizer state.

Each optimizer is checked against an independent computation: torch's own AdamW, a fresh AdamW on a single
row, or a plain per-row loop. Run: `OMP_NUM_THREADS=1 python -m pytest tests/placement/test_table_optim.py -q`.
"""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from stemlm.errors import StemlmError
from stemlm.model import build_model
from stemlm.model.config import ModelConfig
from stemlm.placement.table_optim import (
    DenseAdamW,
    LazyAdamW,
    RowwiseAdagrad,
    clip_grad_norm_mixed,
    make_table_optimizer,
    use_sparse_table_grads,
)

V, D = 12, 5


def sparse_rows(ids: list[int], values: torch.Tensor, shape=(V, D)) -> torch.Tensor:
    """An uncoalesced sparse COO gradient, as nn.Embedding(sparse=True) produces (duplicate ids allowed)."""
    return torch.sparse_coo_tensor(torch.tensor([ids]), values, shape, check_invariants=False)


def all_rows_grad(dense: torch.Tensor) -> torch.Tensor:
    # Every row present, split in two duplicate halves so the optimizer has to sum duplicates.
    ids = list(range(dense.shape[0])) * 2
    return sparse_rows(ids, torch.cat([dense * 0.25, dense * 0.75]), dense.shape)


def lambda_lr(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("duplicates", [False, True])
def test_lazy_adamw_equals_torch_adamw_when_every_row_is_touched(weight_decay, duplicates):
    w0 = torch.randn(V, D)
    ref, lazy = nn.Parameter(w0.clone()), nn.Parameter(w0.clone())
    hp = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay)
    opt_ref, opt_lazy = torch.optim.AdamW([ref], **hp), LazyAdamW([lazy], **hp)
    sched_ref, sched_lazy = lambda_lr(opt_ref), lambda_lr(opt_lazy)
    for _ in range(6):
        g = torch.randn(V, D)
        ref.grad = g.clone()
        lazy.grad = all_rows_grad(g) if duplicates else sparse_rows(list(range(V)), g.clone())
        opt_ref.step(), opt_lazy.step()
        sched_ref.step(), sched_lazy.step()
    if not duplicates:  # same operations in the same order as torch's single-tensor AdamW: bit-identical
        assert torch.equal(lazy.data, ref.data)
    torch.testing.assert_close(lazy.data, ref.data, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(opt_lazy.state[lazy]["exp_avg"], opt_ref.state[ref]["exp_avg"], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(opt_lazy.state[lazy]["exp_avg_sq"], opt_ref.state[ref]["exp_avg_sq"])
    assert opt_lazy.state[lazy]["step"].tolist() == [6] * V


def test_dense_adamw_accepts_sparse_grads_and_equals_torch_adamw():
    w0 = torch.randn(V, D)
    ref, dense = nn.Parameter(w0.clone()), nn.Parameter(w0.clone())
    opt_ref = torch.optim.AdamW([ref], lr=1e-2, weight_decay=0.1, foreach=False)
    opt = make_table_optimizer("adamw", [dense], lr=1e-2, betas=(0.9, 0.999), weight_decay=0.1)
    assert isinstance(opt, DenseAdamW)
    for _ in range(3):
        g = torch.zeros(V, D)
        g[[1, 4]] = torch.randn(2, D)
        ref.grad, dense.grad = g.clone(), sparse_rows([1, 4], g[[1, 4]])
        opt_ref.step(), opt.step()
    assert torch.equal(dense.data, ref.data)
    assert not torch.equal(dense.data[0], w0[0])  # dense AdamW decays rows that were never touched


@pytest.mark.parametrize("name", ["lazy_adamw", "rowwise_adagrad"])
def test_rows_never_seen_stay_bit_identical(name):
    w0 = torch.randn(V, D)
    p = nn.Parameter(w0.clone())
    opt = make_table_optimizer(name, [p], lr=1e-1, weight_decay=0.1)
    seen = [0, 3, 3, 7]
    for _ in range(4):
        p.grad = sparse_rows(seen, torch.randn(len(seen), D))
        opt.step()
    unseen = [r for r in range(V) if r not in seen]
    assert torch.equal(p.data[unseen], w0[unseen])
    assert not torch.equal(p.data[[0, 3, 7]], w0[[0, 3, 7]])
    for value in opt.state[p].values():
        assert not value[unseen].any()  # no moment / accumulator / step count for rows never seen


def test_lazy_adamw_bias_correction_is_per_row():
    # Row 5 is first touched at step 4: its update must equal a fresh AdamW's first step on that row alone.
    w0 = torch.randn(V, D)
    p = nn.Parameter(w0.clone())
    hp = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.05)
    opt = LazyAdamW([p], **hp)
    for _ in range(3):
        p.grad = sparse_rows([0, 1], torch.randn(2, D))
        opt.step()
    g5 = torch.randn(1, D)
    p.grad = sparse_rows([0, 5], torch.cat([torch.randn(1, D), g5]))
    opt.step()
    row = nn.Parameter(w0[5:6].clone())
    fresh = torch.optim.AdamW([row], **hp, foreach=False)
    row.grad = g5.clone()
    fresh.step()
    torch.testing.assert_close(p.data[5:6], row.data, rtol=1e-6, atol=1e-7)
    assert opt.state[p]["step"].tolist()[:6] == [4, 3, 0, 0, 0, 1]


def reference_rowwise_adagrad(w, grads, lr, eps, wd):
    """Plain per-row loop in float64: sum[r] += mean(g_r^2); w_r -= lr * g_r / (sqrt(sum[r]) + eps)."""
    w = [[float(x) for x in row] for row in w]
    acc = [0.0] * len(w)
    for ids, values in grads:
        summed: dict[int, list[float]] = {}
        for r, v in zip(ids, values.tolist(), strict=True):
            summed[r] = [a + b for a, b in zip(summed.get(r, [0.0] * len(v)), v, strict=True)]
        for r, g in summed.items():
            g = [gj + wd * wj for gj, wj in zip(g, w[r], strict=True)]
            acc[r] += sum(x * x for x in g) / len(g)
            scale = lr / (math.sqrt(acc[r]) + eps)
            w[r] = [wj - scale * gj for wj, gj in zip(w[r], g, strict=True)]
    return torch.tensor(w, dtype=torch.float64), torch.tensor(acc, dtype=torch.float64)


def test_rowwise_adagrad_matches_plain_reference():
    w0 = torch.randn(V, D, dtype=torch.float64)
    p = nn.Parameter(w0.clone())
    opt = RowwiseAdagrad([p], lr=0.3, eps=1e-8, weight_decay=0.01)
    grads = [([2, 2, 9, 0], torch.randn(4, D, dtype=torch.float64)) for _ in range(5)]
    for ids, values in grads:
        p.grad = torch.sparse_coo_tensor(torch.tensor([ids]), values, (V, D), check_invariants=False)
        opt.step()
    w_ref, acc_ref = reference_rowwise_adagrad(w0, grads, lr=0.3, eps=1e-8, wd=0.01)
    torch.testing.assert_close(p.data, w_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(opt.state[p]["sum"], acc_ref, rtol=1e-12, atol=1e-12)
    assert opt.state[p]["sum"].shape == (V,)  # one scalar per row


@pytest.mark.parametrize("name", ["adamw", "lazy_adamw", "rowwise_adagrad"])
def test_state_round_trip_through_safetensors_resumes_bit_exactly(name, tmp_path):
    torch.manual_seed(1)
    w0 = torch.randn(V, D)
    grads = [(torch.randint(0, V, (7,)).tolist(), torch.randn(7, D)) for _ in range(8)]

    def run(p, opt, sched, steps):
        for ids, values in steps:
            p.grad = sparse_rows(ids, values)
            opt.step()
            sched.step()

    p = nn.Parameter(w0.clone())
    opt = make_table_optimizer(name, [p], lr=1e-2, weight_decay=0.1)
    sched = lambda_lr(opt)
    run(p, opt, sched, grads)

    q = nn.Parameter(w0.clone())
    opt_q = make_table_optimizer(name, [q], lr=1e-2, weight_decay=0.1)
    sched_q = lambda_lr(opt_q)
    run(q, opt_q, sched_q, grads[:5])
    save_file(opt_q.state_tensors(), tmp_path / "optim.safetensors")
    meta, sched_state, saved_w = opt_q.state_meta(), sched_q.state_dict(), q.detach().clone()

    r = nn.Parameter(saved_w)
    opt_r = make_table_optimizer(name, [r], lr=1e-2, weight_decay=0.1)
    sched_r = lambda_lr(opt_r)
    opt_r.load_state_tensors(load_file(tmp_path / "optim.safetensors"), meta)
    sched_r.load_state_dict(sched_state)
    run(r, opt_r, sched_r, grads[5:])
    assert torch.equal(r.data, p.data)
    for key, value in opt.state[p].items():
        assert torch.equal(opt_r.state[r][key], value), key


def test_lazy_optimizer_rejects_dense_gradients_with_a_fix():
    p = nn.Parameter(torch.randn(V, D))
    p.grad = torch.randn(V, D)
    with pytest.raises(StemlmError, match="sparse = True"):
        LazyAdamW([p]).step()
    with pytest.raises(StemlmError, match="lazy_adamw"):
        make_table_optimizer("sgd", [p], lr=1.0)


def tiny_stem(vocab_size: int = 50) -> nn.Module:
    config = ModelConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=32,
        ffn="stem",
        ffn_layers="odd",
    )
    return build_model(config, seed=0)


def test_sparse_table_grads_accumulate_over_micro_batches_and_under_autocast():
    torch.manual_seed(2)
    ids = torch.randint(0, 50, (4, 9))
    dense_model, sparse_model = tiny_stem(), tiny_stem()
    (table,) = use_sparse_table_grads(sparse_model)
    dense_model(ids[:, :-1], labels=ids[:, 1:]).loss.backward()
    for half in (ids[:2], ids[2:]):  # two micro-batches, each loss halved: the mean over the full batch
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = sparse_model(half[:, :-1], labels=half[:, 1:]).loss / 2
        loss.backward()
    assert table.grad.layout == torch.sparse_coo and table.grad.dtype == torch.float32
    touched = torch.unique(ids[:, :-1])
    assert torch.equal(table.grad.coalesce().indices()[0], touched)
    dense_grad = dense_model.token_tables()[1].weight.grad
    assert not dense_grad[[r for r in range(50) if r not in touched.tolist()]].any()
    # bf16 autocast changes the numbers slightly; the sparsity pattern and scale must match the fp32 gradient.
    torch.testing.assert_close(table.grad.to_dense(), dense_grad, rtol=0.05, atol=2e-3)


def test_clip_grad_norm_mixed_matches_torch_on_densified_copies():
    torch.manual_seed(3)
    a, b = nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(V, D))
    a.grad = torch.randn(4, 3)
    b.grad = sparse_rows([1, 1, 6], torch.randn(3, D))  # row 1 twice: its entries add before squaring
    a2, b2 = nn.Parameter(a.data.clone()), nn.Parameter(b.data.clone())
    a2.grad, b2.grad = a.grad.clone(), b.grad.to_dense()
    expected = torch.sqrt(a2.grad.square().sum() + b2.grad.square().sum())
    norm = clip_grad_norm_mixed([a, b], max_norm=0.5)
    ref_norm = torch.nn.utils.clip_grad_norm_([a2, b2], max_norm=0.5)
    torch.testing.assert_close(norm, expected)
    torch.testing.assert_close(norm, ref_norm)
    torch.testing.assert_close(a.grad, a2.grad)
    torch.testing.assert_close(b.grad.to_dense(), b2.grad)
    assert b.grad.is_coalesced()
    big = clip_grad_norm_mixed([a, b], max_norm=100.0)  # below the limit: gradients unchanged
    torch.testing.assert_close(big, torch.tensor(0.5), rtol=1e-5, atol=0)
    torch.testing.assert_close(a.grad, a2.grad)


@pytest.mark.parametrize("name", ["lazy_adamw", "rowwise_adagrad"])
def test_row_sparse_foreach_equals_the_per_table_loop_bitwise(name):
    # Three tables of different widths, each touching other rows (duplicates included), weight decay on: the
    # multi-tensor path (CUDA's default) gives bitwise the loop's result on CPU, where torch runs foreach per tensor.
    gen = torch.Generator().manual_seed(5)
    shapes = [(V, D), (V, 3), (2 * V, 7)]
    w0 = [torch.randn(s, generator=gen) for s in shapes]
    runs = {}
    for foreach in (False, True):
        params = [nn.Parameter(w.clone()) for w in w0]
        opt = make_table_optimizer(name, params, lr=1e-2, weight_decay=0.1, foreach=foreach)
        step_gen = torch.Generator().manual_seed(6)
        for step in range(5):
            for p in params:
                ids = torch.randint(0, p.shape[0], (4 + step,), generator=step_gen).tolist()
                p.grad = sparse_rows(ids, torch.randn(len(ids), p.shape[1], generator=step_gen), tuple(p.shape))
            opt.step()
        runs[foreach] = [p.data.clone() for p in params] + [t.clone() for p in params for t in opt.state[p].values()]
    assert all(torch.equal(a, b) for a, b in zip(runs[False], runs[True], strict=True))
    assert not torch.equal(runs[True][0], w0[0])


def test_dense_table_adamw_is_foreach_on_cpu_and_fused_on_cuda():
    from types import SimpleNamespace

    from stemlm.placement.table_optim import fast_optimizer_impl

    opt = make_table_optimizer("adamw", [nn.Parameter(torch.zeros(V, D))], lr=1e-2)
    assert opt.param_groups[0]["foreach"] is True and not opt.param_groups[0]["fused"]
    assert fast_optimizer_impl([SimpleNamespace(device=torch.device("cuda"))]) == {"fused": True}
    mixed = [SimpleNamespace(device=torch.device("cuda")), SimpleNamespace(device=torch.device("cpu"))]
    assert fast_optimizer_impl(mixed) == {"foreach": True}  # e.g. host tables next to a CUDA backbone


@pytest.mark.parametrize("foreach", [None, True])
def test_clip_grad_norm_mixed_over_dtypes_matches_torch(foreach):
    # fp32 and bf16 dense gradients (one _foreach_mul_ per dtype) and a sparse one; the norm by the CPU default's
    # per-tensor sum and by the multi-tensor _foreach_norm (CUDA's default).
    torch.manual_seed(4)
    params = [nn.Parameter(torch.randn(6, 3)), nn.Parameter(torch.randn(8).bfloat16()), nn.Parameter(torch.randn(V, D))]
    params[0].grad, params[1].grad = torch.randn(6, 3), torch.randn(8).bfloat16()
    params[2].grad = sparse_rows([2, 9, 2], torch.randn(3, D))
    copies = [nn.Parameter(p.data.clone()) for p in params]
    for c, p in zip(copies, params, strict=True):
        c.grad = p.grad.to_dense() if p.grad.is_sparse else p.grad.clone()
    expected = torch.sqrt(sum(c.grad.float().square().sum() for c in copies))
    norm = clip_grad_norm_mixed(params, max_norm=0.3, foreach=foreach)
    torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)
    coef = 0.3 / (float(expected) + 1e-6)
    for c, p in zip(copies, params, strict=True):
        got = p.grad.to_dense() if p.grad.is_sparse else p.grad
        torch.testing.assert_close(got, (c.grad.float() * coef).to(c.grad.dtype))


def test_clip_on_cpu_is_bitwise_the_per_tensor_arithmetic():
    # The CPU default keeps the former arithmetic exactly: a running float32 sum of each gradient's squares.
    gen = torch.Generator().manual_seed(8)
    params = [nn.Parameter(torch.zeros(n, 7)) for n in (3, 50, 11)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 3
    grads = [p.grad.clone() for p in params]
    total = torch.zeros(())
    for g in grads:
        total = total + g.square().sum()
    norm = clip_grad_norm_mixed(params, max_norm=1.0)
    assert torch.equal(norm, total.sqrt())
    coef = (1.0 / (total.sqrt() + 1e-6)).clamp(max=1.0)
    assert all(torch.equal(p.grad, g * coef) for p, g in zip(params, grads, strict=True))
