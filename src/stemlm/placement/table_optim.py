"""Optimizers for STEM token tables, row-sparse gradients, mixed-gradient clipping and flat optimizer state.

A STEM table holds V x d_ff parameters but a step touches only the rows of the batch's token ids. Three
table optimizers, all `torch.optim.Optimizer` subclasses (so `LambdaLR` drives their `param_groups`),
chosen by name with `make_table_optimizer(name, params, ...)`:

- `adamw`: torch AdamW over the whole table, the official STEM behaviour: every row is decayed and moved
  by its momentum every step. Sparse gradients are densified first, so it accepts either kind.
- `lazy_adamw`: AdamW applied only to the rows present in the step's (coalesced, i.e. deduplicated and
  summed) sparse gradient. The decoupled weight decay is applied to those rows only; a row never seen keeps
  its weights and moments bit-identical. Bias correction uses a per-row step count (int64 [V]): each row is
  an independent AdamW over the sub-sequence of steps that touched it, so a rare row's first update is a
  full bias-corrected step instead of the ~(1-beta1)/sqrt(1-beta2) fraction a global step count would give.
  With every row touched every step the per-row count equals the global one and the result equals `adamw`.
- `rowwise_adagrad`: FBGEMM's exact row-wise Adagrad: one accumulator per row, `sum[r] += mean_j g[r, j]^2`,
  `w[r] -= lr * g[r] / (sqrt(sum[r]) + eps)`, for touched rows only; `weight_decay` is L2 (added to the
  touched rows' gradient, FBGEMM's `L2` mode). Optimizer memory is V floats per table instead of 2 V d_ff.

The row-sparse optimizers need sparse COO gradients: `use_sparse_table_grads(model)` switches the model's
tables to `nn.Embedding(sparse=True)`; such gradients accumulate over micro-batches (by concatenation,
summed at the step) and work under autocast. `torch.nn.utils.clip_grad_norm_` rejects sparse gradients
(torch 2.13: no sparse `linalg_vector_norm`), hence `clip_grad_norm_mixed`, which takes the norms of all dense
pieces (dense gradients, coalesced sparse values, FSDP2 local shards) with one `torch._foreach_norm` per device
on CUDA (as `clip_grad_norm_(foreach=True)` does; on CPU, where torch would loop anyway, the former per-tensor sum
keeps runs bitwise unchanged) and scales the dense ones with one `torch._foreach_mul_` (bitwise `mul_` on CPU).

Multi-tensor paths: `fast_optimizer_impl(params)` picks torch AdamW's implementation by where the parameters
live, `fused` on CUDA, `foreach` elsewhere (on CPU the foreach AdamW gives bitwise the single-tensor result,
so the CPU numbers are unchanged; fused CPU AdamW rounds differently). `DenseAdamW` takes it; `LazyAdamW`
(`foreach=None`: by device, as torch decides) runs each group's elementwise moment and weight updates as
`torch._foreach_*` calls over all its tables' touched rows (row gathers and scatters stay per table); on CPU
torch runs those per tensor with the same kernels, so foreach and the per-table loop agree bitwise there.
`RowwiseAdagrad` does the same for its [rows, width] work (the L2 term, the scaled step); its accumulators are
[rows] vectors, updated one table at a time.

Checkpoint state: `flatten_optimizer_state(opt.state_dict())` gives `(tensors, meta)`: tensors keyed
`state.<param_index>.<name>` (safetensors-ready) and a JSON-able meta (param_groups and non-tensor state);
`unflatten_optimizer_state` inverts it for `opt.load_state_dict`. Every optimizer here also offers
`state_tensors()`, `state_meta()` and `load_state_tensors(tensors, meta)` built on those two functions.
Tests: `OMP_NUM_THREADS=1 python -m pytest tests/placement/test_table_optim.py -q`.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from stemlm.choices import TABLE_OPTIMIZERS
from stemlm.errors import StemlmError


# ----- flat optimizer state (safetensors tensors + JSON meta) -----
def flatten_optimizer_state(state_dict: dict) -> tuple[dict[str, torch.Tensor], dict]:
    """Split a torch optimizer `state_dict()` into `{"state.<i>.<name>": tensor}` and a JSON-able meta dict."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, object] = {}
    for index, entry in state_dict["state"].items():
        for name, value in entry.items():
            key = f"{index}.{name}"
            if isinstance(value, torch.Tensor):
                tensors[f"state.{key}"] = value.detach().contiguous()
            else:
                scalars[key] = _json_value(value, key)
    groups = [{k: _json_value(v, k) for k, v in group.items()} for group in state_dict["param_groups"]]
    return tensors, {"param_groups": groups, "state_scalars": scalars}


def unflatten_optimizer_state(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    """Inverse of `flatten_optimizer_state`: the `state_dict` to pass to `optimizer.load_state_dict`."""
    state: dict[int, dict[str, object]] = {}
    for key, value in tensors.items():
        if not key.startswith("state."):
            raise StemlmError(f"optimizer state tensor {key!r} is not of the form state.<param_index>.<name>")
        index, name = key[len("state.") :].split(".", 1)
        state.setdefault(int(index), {})[name] = value
    for key, value in meta.get("state_scalars", {}).items():
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    groups = [dict(group) for group in meta["param_groups"]]
    for group in groups:
        if isinstance(group.get("betas"), list):
            group["betas"] = tuple(group["betas"])  # JSON turned the tuple into a list
    return {"state": state, "param_groups": groups}


def _json_value(value, key: str):
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, (tuple, list)):
        return [_json_value(v, key) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise StemlmError(f"optimizer state entry {key!r} of type {type(value).__name__} cannot be stored as JSON")


class FlatStateMixin:
    """`state_tensors()` / `state_meta()` / `load_state_tensors()` for any torch optimizer."""

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return flatten_optimizer_state(self.state_dict())[0]

    def state_meta(self) -> dict:
        return flatten_optimizer_state(self.state_dict())[1]

    def load_state_tensors(self, tensors: dict[str, torch.Tensor], meta: dict) -> None:
        self.load_state_dict(unflatten_optimizer_state(tensors, meta))


# ----- row-sparse gradients -----
def use_sparse_table_grads(model: nn.Module, sparse: bool = True) -> list[nn.Parameter]:
    """Make the model's lookup tables produce sparse COO gradients (or dense again); returns the table weights.

    Every family's tables (nn.Embedding, and the memory values' nn.EmbeddingBag) take `sparse=True`."""
    tables = [t for family in model.lookup_tables().values() for t in family.values()]
    for table in tables:
        table.sparse = sparse
    return [table.weight for table in tables]


def row_sparse_grad(param: torch.Tensor, optimizer: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The coalesced gradient of a 2-D table as (unique row ids [n], summed rows [n, width])."""
    grad = param.grad
    if grad.layout != torch.sparse_coo:
        raise StemlmError(
            f"{optimizer} needs row-sparse table gradients but got a dense one: set `table.sparse = True` "
            "(stemlm.placement.table_optim.use_sparse_table_grads(model)) or use the dense table optimizer 'adamw'"
        )
    if grad.sparse_dim() != 1 or param.dim() != 2:
        raise StemlmError(f"{optimizer} expects a 2-D table with a row-sparse gradient, got shape {list(param.shape)}")
    grad = grad.coalesce()
    return grad.indices()[0], grad.values()


def fast_optimizer_impl(params: Iterable[torch.Tensor]) -> dict[str, bool]:
    """torch AdamW's multi-tensor implementation for `params`: {"fused": True} on CUDA, else {"foreach": True}."""
    params = list(params)
    return {"fused": True} if params and all(p.device.type == "cuda" for p in params) else {"foreach": True}


def _row_state(state: dict, name: str, like: torch.Tensor) -> torch.Tensor:
    # load_state_dict leaves integer "step" tensors where they were loaded; keep them next to the parameter.
    if state[name].device != like.device:
        state[name] = state[name].to(like.device)
    return state[name]


# ----- optimizers -----
class DenseAdamW(FlatStateMixin, torch.optim.AdamW):
    """torch AdamW over whole tables (official STEM behaviour); sparse gradients are densified first."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and p.grad.layout == torch.sparse_coo:
                    p.grad = p.grad.to_dense()
        return super().step(closure)


class LazyAdamW(FlatStateMixin, torch.optim.Optimizer):
    """AdamW on the touched rows only, with per-row bias correction (see the module docstring)."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        foreach: bool | None = None,
    ) -> None:
        _check_hparams(lr, eps, weight_decay)
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise StemlmError(f"betas must lie in [0, 1), got {betas}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, foreach=foreach)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            params, idxs, grads, steps = [], [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                idx, g = row_sparse_grad(p, "lazy_adamw")
                if idx.numel() == 0:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros(p.shape[0], dtype=torch.int64, device=p.device)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                row_steps = _row_state(state, "step", p).index_select(0, idx) + 1
                state["step"].index_copy_(0, idx, row_steps)
                params.append(p), idxs.append(idx), grads.append(g.to(p.dtype)), steps.append(row_steps)
            if not params:
                continue
            w, m, v = ([t.index_select(0, i) for t, i in zip(ts, idxs, strict=True)] for ts in self._tensors(params))
            # Same operations, in the same order and precision, as torch's single-tensor AdamW, with the bias
            # corrections computed per row in float64 (torch computes its scalar ones in Python floats).
            step_size, bias_correction2_sqrt = [], []
            for p, row_steps in zip(params, steps, strict=True):
                s = row_steps.double()
                step_size.append((lr / (1 - beta1**s)).to(p.dtype)[:, None].neg())
                bias_correction2_sqrt.append((1 - beta2**s).sqrt().to(p.dtype)[:, None])
            foreach = group.get("foreach")
            if foreach is None:
                foreach = all(p.device.type == "cuda" for p in params)
            (_adamw_rows_foreach if foreach else _adamw_rows)(
                w, m, v, grads, step_size, bias_correction2_sqrt, lr=lr, wd=wd, beta1=beta1, beta2=beta2, eps=eps
            )
            for p, i, w_rows, m_rows, v_rows in zip(params, idxs, w, m, v, strict=True):
                p.index_copy_(0, i, w_rows)
                self.state[p]["exp_avg"].index_copy_(0, i, m_rows)
                self.state[p]["exp_avg_sq"].index_copy_(0, i, v_rows)
        return loss

    def _tensors(self, params: list[torch.Tensor]) -> tuple[list[torch.Tensor], ...]:
        """(parameters, first moments, second moments) of `params`, as three lists."""
        return params, [self.state[p]["exp_avg"] for p in params], [self.state[p]["exp_avg_sq"] for p in params]


def _adamw_rows(w, m, v, g, step_size, bc2_sqrt, *, lr, wd, beta1, beta2, eps) -> None:
    """In place on the gathered rows of each table: decoupled decay, moments, bias-corrected step."""
    for w_, m_, v_, g_, s_, b_ in zip(w, m, v, g, step_size, bc2_sqrt, strict=True):
        w_.mul_(1 - lr * wd)
        m_.lerp_(g_, 1 - beta1)
        v_.mul_(beta2).addcmul_(g_, g_, value=1 - beta2)
        denom = (v_.sqrt() / b_).add_(eps)
        w_.add_(m_.mul(s_).div_(denom))


def _adamw_rows_foreach(w, m, v, g, step_size, bc2_sqrt, *, lr, wd, beta1, beta2, eps) -> None:
    """`_adamw_rows` as multi-tensor calls: one kernel per operation over all tables (on CUDA)."""
    torch._foreach_mul_(w, 1 - lr * wd)
    torch._foreach_lerp_(m, g, 1 - beta1)
    torch._foreach_mul_(v, beta2)
    torch._foreach_addcmul_(v, g, g, value=1 - beta2)
    denom = torch._foreach_sqrt(v)
    torch._foreach_div_(denom, bc2_sqrt)
    torch._foreach_add_(denom, eps)
    update = torch._foreach_mul(m, step_size)
    torch._foreach_div_(update, denom)
    torch._foreach_add_(w, update)


class RowwiseAdagrad(FlatStateMixin, torch.optim.Optimizer):
    """FBGEMM-style exact row-wise Adagrad: one accumulator per row, touched rows only."""

    def __init__(
        self,
        params,
        lr: float = 1e-2,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        initial_accumulator_value: float = 0.0,
        foreach: bool | None = None,
    ) -> None:
        _check_hparams(lr, eps, weight_decay)
        defaults = dict(
            lr=lr,
            eps=eps,
            weight_decay=weight_decay,
            initial_accumulator_value=initial_accumulator_value,
            foreach=foreach,
        )
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            params, idxs, rows, grads = [], [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                idx, g = row_sparse_grad(p, "rowwise_adagrad")
                if idx.numel() == 0:
                    continue
                if not self.state[p]:
                    self.state[p]["sum"] = torch.full(
                        (p.shape[0],), group["initial_accumulator_value"], dtype=p.dtype, device=p.device
                    )
                params.append(p), idxs.append(idx), rows.append(p.index_select(0, idx)), grads.append(g.to(p.dtype))
            if not params:
                continue
            foreach = group.get("foreach")
            if foreach is None:
                foreach = all(p.device.type == "cuda" for p in params)
            # The [rows, width] work (L2 term, scaled step) as multi-tensor calls over all tables when `foreach`
            # (bitwise the loop on CPU); the per-row accumulators are [rows] vectors, one table at a time.
            if wd:
                grads = (
                    torch._foreach_add(grads, rows, alpha=wd)
                    if foreach
                    else [g.add(w, alpha=wd) for g, w in zip(grads, rows, strict=True)]
                )
            scales = []
            for p, idx, g in zip(params, idxs, grads, strict=True):
                acc = self.state[p]["sum"].index_select(0, idx).add_(g.square().mean(dim=1))
                self.state[p]["sum"].index_copy_(0, idx, acc)
                scales.append((lr / (acc.sqrt() + eps))[:, None])
            if foreach:
                torch._foreach_sub_(rows, torch._foreach_mul(grads, scales))
            else:
                for w, g, scale in zip(rows, grads, scales, strict=True):
                    w.sub_(g * scale)
            for p, idx, w in zip(params, idxs, rows, strict=True):
                p.index_copy_(0, idx, w)
        return loss


def _check_hparams(lr: float, eps: float, weight_decay: float) -> None:
    if lr < 0:
        raise StemlmError(f"learning rate must be >= 0, got {lr}")
    if eps <= 0:
        raise StemlmError(f"eps must be > 0, got {eps}")
    if weight_decay < 0:
        raise StemlmError(f"weight_decay must be >= 0, got {weight_decay}")


def make_table_optimizer(
    name: str,
    params: Iterable,
    *,
    lr: float,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    foreach: bool | None = None,
) -> torch.optim.Optimizer:
    """Build the table optimizer `name` (one of TABLE_OPTIMIZERS); `betas` is ignored by rowwise_adagrad.

    `foreach` None picks the multi-tensor path by device (`fast_optimizer_impl` for adamw; foreach on CUDA for
    the row-sparse ones); False forces the per-tensor loop, True the foreach one."""
    params = list(params)
    if name == "adamw":
        # fused on CUDA, foreach elsewhere (on CPU bitwise the single-tensor path that LazyAdamW mirrors).
        impl = fast_optimizer_impl(params) if foreach is None else {"foreach": foreach}
        return DenseAdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **impl)
    if name == "lazy_adamw":
        return LazyAdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=foreach)
    if name == "rowwise_adagrad":
        return RowwiseAdagrad(params, lr=lr, eps=eps, weight_decay=weight_decay, foreach=foreach)
    raise StemlmError(f"unknown table optimizer {name!r}; choose one of {', '.join(TABLE_OPTIMIZERS)}")


# ----- clipping -----
def _local_grad(p: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """The gradient entries this rank holds, and whether they are a shard of a DTensor (FSDP2) gradient."""
    grad = p.grad
    if grad.layout == torch.sparse_coo:
        p.grad = grad = grad.coalesce()  # duplicate rows must add before squaring
        return grad.values(), False
    if torch.distributed.is_available() and hasattr(grad, "placements"):
        from torch.distributed.tensor import DTensor

        if isinstance(grad, DTensor):
            return grad.to_local(), any(placement.is_shard() for placement in grad.placements)
    return grad, False


def _sum_of_squares(tensors: list[torch.Tensor], device: torch.device, foreach: bool | None = None) -> torch.Tensor:
    """Sum of squared entries of `tensors` in float32 on `device`. Multi-tensor (one `_foreach_norm` per device)
    where `foreach` says so, by default on CUDA; elsewhere a running sum of each tensor's squares, in order (the
    former arithmetic, which keeps CPU runs bitwise what they were: the two differ by rounding)."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    total = torch.zeros((), dtype=torch.float32, device=device)
    for where, group in by_device.items():
        if where.type == "cuda" if foreach is None else foreach:
            total = total + torch.stack(torch._foreach_norm(group, 2, dtype=torch.float32)).square().sum().to(device)
        else:
            for t in group:
                total = total + t.float().square().sum().to(device)
    return total


@torch.no_grad()
def clip_grad_norm_mixed(
    params: Iterable[torch.Tensor],
    max_norm: float,
    *,
    sharded_params: Iterable = (),
    group=None,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip dense, sparse and FSDP2 gradients together by their global L2 norm; returns the norm before clipping.

    Gradients in `params` count once (every rank holds the same one, e.g. a DDP-averaged backbone), except
    FSDP2's DTensor gradients with a Shard placement, which are shards; the squared norms of all shards and
    of `sharded_params` (each rank owning different rows, e.g. `ShardedTables.parameters()`) are summed over
    `group` (which must be the FSDP2 mesh's group too). Every rank must call it with the same arguments.
    Scales like `torch.nn.utils.clip_grad_norm_`: by min(1, max_norm / (norm + 1e-6)). Dense gradients are
    scaled with one `torch._foreach_mul_` per device and dtype; the norms are `torch._foreach_norm`s where
    `foreach` (default: on CUDA; see `_sum_of_squares`).
    """
    params = [p for p in params if p.grad is not None]
    sharded_params = list(sharded_params)
    any_shards = bool(sharded_params)  # decided by the arguments, identical on every rank
    sharded_params = [p for p in sharded_params if p.grad is not None]
    device = (params + sharded_params)[0].grad.device if params or sharded_params else torch.device("cpu")
    local = [_local_grad(p) for p in params]  # NCCL needs the all_reduce on the GPU: `device` is a gradient's
    replicated = [values for values, is_shard in local if not is_shard]
    shards = [_local_grad(p)[0] for p in sharded_params] + [values for values, is_shard in local if is_shard]
    any_shards = any_shards or bool(shards)  # FSDP2 shards: every rank holds its part of the same parameters
    replicated_sq, sharded_sq = _sum_of_squares(replicated, device, foreach), _sum_of_squares(shards, device, foreach)
    if any_shards and torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(sharded_sq, group=group)
    total = (replicated_sq + sharded_sq).sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    dense: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for p in params + sharded_params:
        values, _ = _local_grad(p)
        if p.grad.layout == torch.sparse_coo:
            g = p.grad  # rebuilt rather than scaled in place so it stays marked coalesced
            p.grad = torch.sparse_coo_tensor(
                g.indices(), values * coef.to(g.device, g.dtype), g.shape, is_coalesced=True, check_invariants=False
            )
        else:
            dense.setdefault((values.device, values.dtype), []).append(values)  # a DTensor's local shard: in place
    for (where, dtype), tensors in dense.items():
        torch._foreach_mul_(tensors, coef.to(where, dtype))
    return total
