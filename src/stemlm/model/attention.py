"""The shared decoder parts: RMSNorm, rotary position embeddings, grouped-query attention and the KV cache.

Attention runs `scaled_dot_product_attention`; `math_attention` is the same formula written out, used only when
a caller asks for the attention weights (Hugging Face's `output_attentions`).

Numerics follow Hugging Face Llama (norm in fp32, `rotate_half` RoPE with fp32 frequencies) so a dense
stemlm checkpoint gives the same logits as `transformers.LlamaForCausalLM` (tested to 1e-5 in fp32).

For decoding (`stemlm.inference`), two things are prepared once instead of every step:
`Attention.fusable` declares q/k/v one projection (`stemlm.model.fusion.fuse_for_decoding`: one matrix-vector
product a token instead of three, used only without grad and while the weights are unchanged), and
`RotaryEmbedding.table(start, length)` slices cos/sin from a table computed once for the positions asked so far
(the same elementwise arithmetic as `forward`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from stemlm.model.decoding_state import DecodingState

if TYPE_CHECKING:  # annotations only: the config imports the kinds, and a kind (engram) imports RMSNorm from here
    from stemlm.model.config import ModelConfig


class RMSNorm(nn.Module):
    """x / rms(x) · weight, computed in fp32 for fp32 and half inputs (bf16's mean of squares loses too much) and in
    fp64 for fp64 ones, so an fp64 check through a norm is exact rather than fp32-accurate. The weight multiplies in
    that precision too and the product is rounded once, as torch's `nn.RMSNorm` does for half inputs (rounding the
    normalised x first and again after the weight differs from it by an ulp). `eps` None: the machine epsilon of
    the dtype it computes in, as torch's `nn.RMSNorm(eps=None)` does (the Engram demo's query and key norms: fp32's
    for half inputs, whose norm torch computes in fp32 too)."""

    def __init__(self, dim: int, eps: float | None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float64 if dtype == torch.float64 else torch.float32)
        eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return (self.weight.to(x.dtype) * x).to(torch.promote_types(self.weight.dtype, dtype))


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions, computed on the fly in fp32 (no length cap beyond the config's maximum)."""

    def __init__(self, head_dim: int, theta: float, llama3: dict | None = None) -> None:
        super().__init__()
        self.head_dim, self.theta, self.llama3 = head_dim, theta, llama3
        self.register_buffer("inv_freq", torch.empty(head_dim // 2), persistent=False)
        self.reset_buffers(self.inv_freq.device)

    def reset_buffers(self, device: torch.device | str) -> None:
        # Computed on the CPU, then moved: on the meta device this arithmetic would import torch._dynamo (seconds).
        exponent = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device="cpu").float() / self.head_dim
        inv_freq = 1.0 / (self.theta**exponent)
        if self.llama3 is not None:  # Llama 3 checkpoints (stemlm.model.rope_scaling)
            from stemlm.model.rope_scaling import llama3_inv_freq

            inv_freq = llama3_inv_freq(inv_freq, self.llama3)
        self.inv_freq = inv_freq.to(device)
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None  # `table`'s cos, sin [positions, head_dim], fp32

    def _apply(self, fn, recurse: bool = True):
        # `model.to(torch.bfloat16)` casts every floating buffer; bf16 frequencies put RoPE angles off by whole
        # radians at positions in the thousands, so the frequencies are recomputed in fp32 wherever they went.
        super()._apply(fn, recurse)
        if self.inv_freq.dtype != torch.float32 and not self.inv_freq.is_meta:
            self.reset_buffers(self.inv_freq.device)
        self._table = None  # rebuilt where the frequencies now live
        return self

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # position_ids: [B, T] -> cos, sin: [B, T, head_dim]
        return tuple(t.to(dtype) for t in self._cos_sin(position_ids))

    def _cos_sin(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.float()
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def table(self, start: int, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [1, length, head_dim] of positions start.. start + length - 1, sliced from a table that grows
        (doubling) to cover the positions asked for: a decoding step reads its row instead of computing it."""
        end = start + length
        if self._table is None or self._table[0].shape[0] < end:
            size = max(end, 2 * self._table[0].shape[0] if self._table is not None else 0)
            self._table = self._cos_sin(torch.arange(size, device=self.inv_freq.device)[None])
            self._table = (self._table[0][0], self._table[1][0])
        cos, sin = self._table
        return cos[None, start:end].to(dtype), sin[None, start:end].to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, H, T, hd]; cos/sin: [B, T, hd] broadcast over heads
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + _rotate_half(x) * sin


class KVCache:
    """Per-layer keys and values of the tokens seen so far, for incremental decoding.

    Each layer's keys and values sit in a preallocated [B, kv_heads, capacity, head_dim] buffer written in place
    (a decode step copies only its new position; `torch.cat` per step had copied the whole cache, 11% of tiny
    decode self-time); `update` returns views of the filled prefix. `capacity` is a hint (generation knows
    prompt + new tokens); past it a buffer doubles, so any use stays amortised O(1) per token.
    `crop(length)` forgets everything after `length` positions (the buffers are reused). `state` holds what the
    lookup kinds carry per cached position beside the keys and values (`stemlm.model.decoding_state`).
    """

    def __init__(self, num_layers: int, capacity: int = 0, state: DecodingState | None = None) -> None:
        self.capacity = capacity
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.lengths = [0] * num_layers
        self.state = DecodingState() if state is None else state

    @property
    def length(self) -> int:
        return self.lengths[0]

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        start = self.lengths[layer_idx]
        end = start + k.shape[2]
        buf = self.keys[layer_idx]
        if buf is None or end > buf.shape[2] or buf.shape[:2] != k.shape[:2] or buf.dtype != k.dtype:
            grown = max(end, self.capacity, 2 * buf.shape[2] if buf is not None else 0)
            self.keys[layer_idx] = self._grow(buf, k, grown, start)
            self.values[layer_idx] = self._grow(self.values[layer_idx], v, grown, start)
        self.keys[layer_idx][:, :, start:end] = k
        self.values[layer_idx][:, :, start:end] = v
        self.lengths[layer_idx] = end
        return self.keys[layer_idx][:, :, :end], self.values[layer_idx][:, :, :end]

    @staticmethod
    def _grow(old: torch.Tensor | None, like: torch.Tensor, capacity: int, keep: int) -> torch.Tensor:
        new = like.new_empty((*like.shape[:2], capacity, like.shape[3]))
        if old is not None and keep:
            new[:, :, :keep] = old[:, :, :keep]
        return new

    def crop(self, length: int) -> None:
        """Drop everything after the first `length` positions (e.g. to re-run a prompt with another edit)."""
        self.lengths = [min(n, length) for n in self.lengths]


# `enable_gqa` (torch >= 2.5): SDPA shares each key/value head among its query heads instead of attending to
# repeated copies. On CPU its outputs equal repeat_interleave's bitwise and its gradients to 1e-6 (the k/v gradient
# is summed over the query heads in another order): tests/model/test_attention.py. torch 2.4 repeats k/v.
SDPA_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


class Attention(nn.Module):
    """Grouped-query self-attention with RoPE through `scaled_dot_product_attention`."""

    # q/k/v as one product for decoding, o_proj alone a copy where stored transposed (stemlm.model.fusion)
    fusable = (("q_proj", "k_proj", "v_proj"), ("o_proj",))

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_attention_heads, config.kv_heads, config.head_size
        d = config.hidden_size
        self.q_proj = nn.Linear(d, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, d, bias=False)

    def _output(self, y: torch.Tensor) -> torch.Tensor:
        B, _, T, _ = y.shape
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor | None,
        cache: KVCache | None,
        values: Callable[[torch.Tensor], torch.Tensor] | None = None,
        weights: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """`values`, when given, maps this call's value vectors [B, kv_heads, T, head_dim] to the ones attended to
        and cached (a kind acting on attention's values, `Kind.acts_on_values`). `weights`, when given, receives
        this layer's attention weights [B, heads, T, past+T], computed by `math_attention` instead of SDPA."""
        B, T, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if values is not None:
            v = values(v)
        cos, sin = rope
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v)
        # mask None with T > 1 means a fresh causal prefill; a single new token attends to everything cached.
        is_causal = bool(mask is None and T > 1)  # a plain bool for SDPA under torch.export
        if weights is not None:
            y, w = math_attention(q, k, v, mask, is_causal)
            weights.append(w)
            return self._output(y)
        gqa = {}
        if self.num_kv_heads != self.num_heads:
            if SDPA_GQA:
                gqa = {"enable_gqa": True}
            else:
                repeat = self.num_heads // self.num_kv_heads
                k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, **gqa)
        return self._output(y)


def math_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, is_causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """SDPA written out (HF's eager attention: softmax in fp32), for callers that want the weights.

    q [B, H, T, hd], k/v [B, kv_heads, S, hd], `mask` and `is_causal` as SDPA takes them. Returns the output
    [B, H, T, hd] and the weights [B, H, T, S]; the output equals SDPA's to rounding, not bitwise."""
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if is_causal:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    w = scores.softmax(dim=-1, dtype=torch.float32).to(q.dtype)
    return w @ v, w


def build_attention_mask(
    query_len: int, past_len: int, attention_mask: torch.Tensor | None, device: torch.device
) -> torch.Tensor | None:
    """Boolean [B or 1, 1, T, past+T] mask (True = attend), or None when plain causal attention suffices.

    `attention_mask` is the usual [B, past+T] padding mask (1 = real token).
    """
    if attention_mask is None and (past_len == 0 or query_len == 1):
        return None
    total = past_len + query_len
    rows = torch.arange(past_len, total, device=device)[:, None]
    cols = torch.arange(total, device=device)[None, :]
    mask = (cols <= rows)[None, None]
    if attention_mask is not None:
        mask = mask & attention_mask[:, None, None, :total].bool()
        # A fully padded query row would give NaN; let it see itself (its output is ignored anyway).
        mask = mask | (cols == rows)[None, None]
    return mask
