"""The FFN positions of `StemlmForCausalLM` in vLLM's layers: dense, STEM, n-gram STEM and Engram.

    dense       MergedColumnParallelLinear gate|up, SiluAndMul, RowParallelLinear down_proj
    stem        ColumnParallelLinear gate_proj, the table U_l [vocab, d_ff / tp] read by token id, RowParallelLinear
    stem_ngram  STEM's, with U_l[t] + Σ_k H_l[id_k] (H_l [rows, d_ff / tp], split along d_ff as U_l is)
    engram      the dense SwiGLU plus stemlm's Engram branch (its own module, `stemlm.model.kinds.engram`, replicated
                on every tensor-parallel rank), whose causal conv reads earlier positions' inputs from a slot store

Every table is split along d_ff like the gate's output, so the product needs nothing from other ranks (model.py).
A module takes the normalised hidden states [tokens, hidden] and the step's `Tokens` (the input ids; for the
n-gram kinds their hashed ids and the step's `Lookback`, stemlm.vllm.history).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear
from vllm.model_executor.model_loader.weight_utils import sharded_weight_loader
from vllm.model_executor.utils import set_weight_attrs

from stemlm.model.config import ModelConfig
from stemlm.model.ffn import TokenContext
from stemlm.model.kinds.engram import EngramBranch
from stemlm.model.ngram import ngram_hasher
from stemlm.vllm.history import Lookback, SlotStore


@dataclass(frozen=True)
class Tokens:
    """What a step tells the FFN positions about its tokens: the ids [N]; for the n-gram kinds the hashed n-gram
    ids ([N, K], or layer -> [N, K] for per-layer hashing) and where earlier positions are (`Lookback`)."""

    ids: torch.Tensor
    ngram_ids: torch.Tensor | dict[int, torch.Tensor] | None = None
    lookback: Lookback | None = None

    def context(self) -> TokenContext:
        """The step as stemlm's own modules read it: one sequence [1, N] (its n-gram ids given, so nothing of
        stemlm's decoding state is needed)."""
        ngram = self.ngram_ids
        ngram = {k: v[None] for k, v in ngram.items()} if isinstance(ngram, dict) else ngram[None]
        return TokenContext(input_ids=self.ids[None], ngram_ids=ngram)


class DenseMLP(nn.Module):
    """SwiGLU: down_proj(silu(gate_proj x) * up_proj x), gate and up one column-parallel product."""

    def __init__(self, hidden: int, ffn: int, prefix: str) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [ffn] * 2, bias=False, prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(ffn, hidden, bias=False, prefix=f"{prefix}.down_proj")
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor, tokens: Tokens) -> torch.Tensor:
        y, _ = self.gate_up_proj(x)
        y, _ = self.down_proj(self.act_fn(y))
        return y


class TokenTable(nn.Module):
    """A [vocab, width / tp] table read by token id: this rank's column slice of the checkpoint's table (loaded by
    narrowing dim 1), so the vocabulary stays whole on every rank and no rank asks another for a row."""

    def __init__(self, vocab: int, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, width // get_tensor_model_parallel_world_size()), False)
        set_weight_attrs(self.weight, {"weight_loader": sharded_weight_loader(1)})

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)  # a gather of the rows; through UVA when offloaded to the host


class StemMLP(nn.Module):
    """STEM: down_proj(silu(gate_proj x) * U[t]), U split along d_ff like gate_proj's output (see the module doc)."""

    def __init__(self, vocab: int, hidden: int, ffn: int, prefix: str) -> None:
        super().__init__()
        self.gate_proj = ColumnParallelLinear(hidden, ffn, bias=False, prefix=f"{prefix}.gate_proj")
        self.down_proj = RowParallelLinear(ffn, hidden, bias=False, prefix=f"{prefix}.down_proj")
        self.stem_embedding = TokenTable(vocab, ffn)

    def forward(self, x: torch.Tensor, tokens: Tokens) -> torch.Tensor:
        gate, _ = self.gate_proj(x)
        up = self.up_rows(tokens)  # this rank's d_ff slice of U[t]
        y, _ = self.down_proj(F.silu(gate) * up.to(gate.dtype))
        return y

    def up_rows(self, tokens: Tokens) -> torch.Tensor:
        return self.stem_embedding(tokens.ids)


class StemNgramMLP(StemMLP):
    """n-gram STEM: STEM's product with U[t] + Σ_k H[id_k(t)], H split along d_ff as U is."""

    def __init__(self, config: ModelConfig, prefix: str) -> None:
        super().__init__(config.vocab_size, config.hidden_size, config.intermediate_size, prefix)
        self.ngram_embedding = TokenTable(ngram_hasher(config).num_rows, config.intermediate_size)

    def up_rows(self, tokens: Tokens) -> torch.Tensor:
        return self.stem_embedding(tokens.ids) + self.ngram_embedding(tokens.ngram_ids).sum(dim=-2)


class EngramBranchStep(EngramBranch):
    """stemlm's Engram branch (its parameters, names and gate: `stemlm.model.kinds.engram`) over vLLM's flattened
    step: the gated value of `_gated_value`, then the causal dilated depthwise conv, whose inputs at earlier
    positions come from the step or from the slot store (stemlm.vllm.history)."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.conv_inputs: SlotStore | None = None  # made on first use, in the dtype the model runs in

    def branch(self, x: torch.Tensor, tokens: Tokens, out: torch.Tensor | None = None) -> torch.Tensor:
        """`out` + v_t + silu(conv(norm_c(v))_t) for the step's hidden states `x` [N, hidden], added in stemlm's
        order (`add_branch`; `residual_branch` when `out` is None)."""
        value = self._gated_value(x[None], tokens.context())[0]
        conv = F.silu(self.causal_conv(self.engram_conv_norm(value), tokens.lookback))
        return value + conv if out is None else out + value + conv

    def causal_conv(self, inputs: torch.Tensor, lookback: Lookback) -> torch.Tensor:
        if self.conv_inputs is None:
            self.conv_inputs = SlotStore((inputs.shape[-1],), inputs.dtype, 0.0)
        past = lookback.gather(inputs, self.conv_inputs)  # [N, context, d]: positions p-1 .. p-context
        self.conv_inputs.write(lookback.write, inputs)
        weight = self.engram_conv.weight[:, 0, :]  # [d, kernel]; tap k reads position p - (kernel - 1 - k)·dilation
        kernel = weight.shape[1]
        out = inputs * weight[:, kernel - 1]
        for m in range(1, kernel):
            out = out + past[:, m * self.dilation - 1] * weight[:, kernel - 1 - m]
        return out


class EngramMLP(DenseMLP):
    """The Engram FFN kind's module: the dense SwiGLU, with its branch's parameters registered beside gate/up/down
    (`mlp.engram_*`, the checkpoint's names). The decoder layer applies the branch (`step`), after the SwiGLU
    (stemlm's variant) or to the residual stream before attention (the reference variant), as it applies a branch
    running beside another kind (`beside.engram`)."""

    def __init__(self, config: ModelConfig, layer_idx: int, prefix: str) -> None:
        super().__init__(config.hidden_size, config.intermediate_size, prefix)
        step = EngramBranchStep(config, layer_idx)
        for name, module in step.named_children():  # registered here, so the names are the checkpoint's
            setattr(self, name, module)
        self._step = [step]  # a plain list: its modules are this module's, registered once

    @property
    def step(self) -> EngramBranchStep:
        return self._step[0]
