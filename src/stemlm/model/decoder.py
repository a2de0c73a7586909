"""The stemlm decoder: Llama-style pre-norm blocks whose kind is chosen per layer by the config.

Module names mirror Hugging Face Llama (`model.embed_tokens`, `model.layers.{i}.self_attn.q_proj`,
`model.layers.{i}.mlp.gate_proj`, `model.norm`, `lm_head`), so parameter names are the checkpoint format.
Each layer's `mlp` is the module its kind builds (`stemlm.model.kinds`); a kind that acts on attention's values
(`Kind.acts_on_values`) gets them through its module's `mix_values(v, ctx, x)`. Kinds selected beside the FFN kind
(`ModelConfig.layer_sides`) put their side modules in `model.layers.{i}.beside.<kind>`: on attention's values
(value embeddings), added to the FFN output (the Engram branch) or to the residual stream before attention (the
reference Engram branch), as their `Kind.beside` declares.
The model is written for one device; offload, sharding and editing act through the forward's
`rows={family: provider}` mapping (see `stemlm.model.ffn.TokenContext`) or by wrapping it, never by flags
inside the layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from stemlm.errors import StemlmError
from stemlm.model.attention import Attention, KVCache, RMSNorm, RotaryEmbedding, build_attention_mask
from stemlm.model.config import ModelConfig
from stemlm.model.decoding_state import fill_lookup_context
from stemlm.model.ffn import EMBED, EmbedRows, Rows, TokenContext, checked_rows, token_table
from stemlm.model.fused_loss import fused_linear_cross_entropy
from stemlm.model.kinds.registry import FAMILIES, Uniform, fill_value, get_kind, init_draws, table_key
from stemlm.model.loss import chunked_cross_entropy, cross_entropy
from stemlm.model.memory_check import check_fits
from stemlm.model.ngram import ngram_hasher


@dataclass
class ModelOutput:
    logits: torch.Tensor | None  # [B, T, V]; None when the loss was computed in chunks (forward's loss_chunk)
    # Mean cross-entropy of logits[:, t] against labels[:, t] (labels are the already shifted targets, -100 =
    # ignored), without the aux loss; None without labels.
    loss: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None  # sum of MoE auxiliary losses (None for kinds without one)
    past_key_values: KVCache | None = None
    expert_counts: dict[int, torch.Tensor] = field(default_factory=dict)
    # Only when asked (forward's output_hidden_states / output_attentions), in Hugging Face's layout:
    hidden_states: tuple[torch.Tensor, ...] | None = None  # embeddings, layers 0..L-2 outputs, final-normed output
    attentions: tuple[torch.Tensor, ...] | None = None  # per layer [B, heads, T, past+T] (math attention)


@dataclass(frozen=True)
class ForwardOptions:
    """What a forward computes beyond the logits of every position (`StemLM.forward(options=...)`)."""

    # With labels: the loss `loss_chunk` tokens at a time (`stemlm.model.loss`), returning no logits (None);
    # `fused_loss` then takes the fused lm_head + cross-entropy (`stemlm.model.fused_loss`) instead of the
    # recomputing checkpoints.
    loss_chunk: int = 0
    fused_loss: bool = False
    # Hugging Face Llama's hidden_states / attentions (see `ModelOutput`); the weights come from `math_attention`,
    # so that forward's logits equal the default's to rounding, not bitwise.
    hidden_states: bool = False
    attentions: bool = False
    head: bool = True  # False: stop after the final norm (logits None; with hidden_states, HF's base model)
    # True (no labels): the logits of the last position only, [B, 1, V]: a prefill samples from nothing else, and
    # the head is 41% of the tiny model's FLOPs a token.
    last_logits: bool = False
    # False skips the range check of the ids (a reduction and a host read per call) for a caller that checked them
    # already: generation checks the prompt once and samples the rest from the logits, so in range by construction.
    check_ids: bool = True

    def __post_init__(self) -> None:
        if self.fused_loss and self.loss_chunk <= 0:
            raise StemlmError(f"fused_loss needs loss_chunk > 0 (tokens per chunk), got loss_chunk={self.loss_chunk}")


DEFAULT_OPTIONS = ForwardOptions()


def build_ffn(config: ModelConfig, layer_idx: int) -> nn.Module:
    """The module at `model.layers.<i>.mlp`: what the layer's kind builds (dense outside `ffn_layers`)."""
    return get_kind(config.layer_ffn(layer_idx)).build(config, layer_idx)


def layer_modules(config: ModelConfig, layer: DecoderLayer, layer_idx: int):
    """(kind, side kind name or None, module) for the layer's `mlp` and each of its side modules."""
    for n, name in enumerate(config.layer_kinds(layer_idx)):
        side = name if n else None
        yield get_kind(name), side, layer.kind_module(side)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = build_ffn(config, layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        sides = {name: get_kind(name).beside for name in config.layer_sides(layer_idx)}
        if sides:  # registered last and only when used, so a model without side kinds keeps its modules
            self.beside = nn.ModuleDict({name: side.build(config, layer_idx) for name, side in sides.items()})
        # Names, not modules: whatever replaces `mlp` or a side module later (conversion, loading) is what runs.
        self.acts_on_values = get_kind(config.layer_ffn(layer_idx)).acts_on_values
        residual = get_kind(config.layer_ffn(layer_idx)).acts_on_residual
        self.acts_on_residual = residual is not None and residual(config)
        self.value_sides = tuple(name for name, side in sides.items() if side.position(config) == "values")
        self.ffn_sides = tuple(name for name, side in sides.items() if side.position(config) == "ffn")
        self.residual_sides = tuple(name for name, side in sides.items() if side.position(config) == "residual")

    def kind_module(self, side: str | None) -> nn.Module:
        """The module of the layer's FFN kind (side None) or of the kind `side` beside it."""
        return self.mlp if side is None else self.beside[side]

    def set_kind_module(self, side: str | None, module: nn.Module) -> None:
        if side is None:
            self.mlp = module
        else:
            self.beside[side] = module

    def forward(self, x, rope, mask, cache: KVCache | None, ctx: TokenContext, weights=None) -> torch.Tensor:
        if self.acts_on_residual:
            x = x + self.mlp.residual_branch(x, ctx)
        for name in self.residual_sides:
            x = x + self.beside[name].residual_branch(x, ctx)
        attn_input = self.input_layernorm(x)
        values = partial(self._mix_values, ctx, attn_input) if self.acts_on_values or self.value_sides else None
        x = x + self.self_attn(attn_input, rope, mask, cache, values, weights)
        h = self.post_attention_layernorm(x)
        # A module that reads the residual stream (Gemma-3n's per-layer input gate reads the layer's output) says so
        y = self.mlp(h, ctx, x) if getattr(self.mlp, "reads_residual", False) else self.mlp(h, ctx)
        for name in self.ffn_sides:
            y = self.beside[name](h, ctx, y)
        return x + y

    def _mix_values(self, ctx: TokenContext, attn_input: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention's values [B, kv_heads, T, head_dim] through the FFN kind's mix, then each side module's (which
        may read the attention input [B, T, hidden], as modded-nanogpt's value gates do)."""
        if self.acts_on_values:
            v = self.mlp.mix_values(v, ctx, attn_input)
        for name in self.value_sides:
            v = self.beside[name].mix_values(v, ctx, attn_input)
        return v


class DecoderStack(nn.Module):
    """Embeddings, blocks and final norm: HF's `model.` prefix.

    `gradient_checkpointing` (off) makes `StemLM.forward` run each layer through `_gradient_checkpointing_func`
    while training; the names are those Hugging Face's `gradient_checkpointing_enable()` sets."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gradient_checkpointing = False
        self._gradient_checkpointing_func = partial(checkpoint, use_reentrant=False)
        self.embed_tokens = token_table(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_size, config.rope_theta, config.rope_llama3)
        for i, layer in enumerate(self.layers):
            for kind, side, module in layer_modules(config, layer, i):
                for table in kind.tables:
                    owner = table.owner_of(config, i)
                    if owner != i:
                        # A shared table: registered once, in its owner's module (one parameter name); this layer
                        # holds a plain reference, which follows the owner's module through .to(), loading, sharding.
                        held = self.layers[owner].kind_module(side)
                        object.__setattr__(module, table.attr, getattr(held, table.attr))


class StemLM(nn.Module):
    fusable = (("lm_head",),)  # a decoding copy where stored transposed (stemlm.model.fusion.fuse_for_decoding)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderStack(config)
        self.ngram_hasher = ngram_hasher(config)  # shared by every n-gram layer; None for other kinds
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    # ----- forward -----
    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: KVCache | None = None,
        use_cache: bool = False,
        rows: Rows | None = None,
        options: ForwardOptions = DEFAULT_OPTIONS,
    ) -> ModelOutput:
        """Logits for `input_ids` [B, T]. `labels` [B, T] are the targets of each position (not shifted here);
        `attention_mask` [B, past + T] marks real tokens with 1 (left padding); `past_key_values` continues a
        cache from an earlier call (`use_cache=True` starts one). `rows={family: provider}` supplies the rows of
        a table family from outside (offload, sharding, edits; `stemlm.model.kinds.registry.FAMILIES`), called
        as `provider(layer_idx, ids)`; families left out read the model's own tables. `rows["embed"]`, a
        provider `(input_ids) -> [B, T, hidden]`, supplies the input embeddings instead of `embed_tokens`
        (editing from outside); the lm_head is unaffected even when tied. `options` (`ForwardOptions`) asks for
        the chunked or fused loss, hidden states, attention weights, no head, or no id check."""
        check_ids, loss_chunk, fused_loss = options.check_ids, options.loss_chunk, options.fused_loss
        if check_ids:
            check_token_ids(input_ids, self.config.vocab_size)
        input_ids = input_ids.long()  # embedding and hash lookups need int64/int32; narrower ids are accepted
        B, T = input_ids.shape
        cache = (
            past_key_values if past_key_values is not None else (KVCache(len(self.model.layers)) if use_cache else None)
        )
        past_len = cache.length if cache is not None else 0
        if past_len + T > self.config.max_position_embeddings:
            raise StemlmError(
                f"sequence length {past_len + T} exceeds max_position_embeddings={self.config.max_position_embeddings}"
            )
        _check_optional_inputs(B, T, past_len, attention_mask, labels, position_ids, self.config.vocab_size)
        providers = checked_rows(rows)
        embed_rows = providers.pop(EMBED, None)
        x = self.model.embed_tokens(input_ids) if embed_rows is None else _embeddings_from(self, embed_rows, input_ids)
        if position_ids is None and attention_mask is None and cache is not None and not torch.compiler.is_compiling():
            # Decoding: the positions are past_len.. past_len + T, so cos/sin come from the table (bitwise equal)
            rope = self.model.rotary_emb.table(past_len, T, x.dtype)
        else:
            if position_ids is None:
                position_ids = default_position_ids(B, T, past_len, attention_mask, input_ids.device)
            rope = self.model.rotary_emb(position_ids, x.dtype)
        mask = build_attention_mask(T, past_len, attention_mask, input_ids.device)
        ctx = TokenContext(input_ids=input_ids, rows=providers, embeddings=x)
        fill_lookup_context(ctx, self.ngram_hasher, attention_mask, cache, past_len)
        hidden = [] if options.hidden_states else None
        weights = [] if options.attentions else None
        checkpointed = self.model.gradient_checkpointing and self.training
        for layer in self.model.layers:
            if hidden is not None:
                hidden.append(x)
            if checkpointed:
                x = self.model._gradient_checkpointing_func(layer.__call__, x, rope, mask, cache, ctx, weights)
            else:
                x = layer(x, rope, mask, cache, ctx, weights)
        x = self.model.norm(x)
        if hidden is not None:
            hidden.append(x)  # HF Llama's convention: the last layer's output is given after the final norm
        if not options.head:
            logits, loss = None, None
        elif labels is not None and loss_chunk > 0 and fused_loss:
            logits, loss = None, fused_linear_cross_entropy(x, self.lm_head.weight, labels, loss_chunk)
        elif labels is not None and loss_chunk > 0:
            logits, loss = None, chunked_cross_entropy(x, self.lm_head, labels, loss_chunk)
        else:
            logits = self.lm_head(x[:, -1:] if options.last_logits and labels is None else x)
            loss = cross_entropy(logits, labels) if labels is not None else None
        aux = torch.stack(ctx.aux_losses).sum() if ctx.aux_losses else None
        return ModelOutput(logits, loss, aux, cache, ctx.expert_counts, _tuple_or_none(hidden), _tuple_or_none(weights))

    # ----- parameters -----
    def tables(self, family: str) -> dict[int, nn.Module]:
        """Table key -> the lookup table of `family` held there, in key order: the layer index for a layer's `mlp`,
        past the layers for its side modules (`stemlm.model.kinds.registry.table_key`; `key_label` shows one). A
        table shared by several layers appears once, under its owner's key: the key its rows are asked for with."""
        if family not in FAMILIES:
            raise StemlmError(f"unknown table family {family!r}; families: {', '.join(FAMILIES)}")
        found = {}
        for i, layer in enumerate(self.model.layers):
            for kind, side, module in layer_modules(self.config, layer, i):
                for table in kind.tables:
                    if table.family == family and table.owner_of(self.config, i) == i:
                        found[table_key(self.config, i, side)] = getattr(module, table.attr)
        return dict(sorted(found.items()))

    def lookup_tables(self) -> dict[str, dict[int, nn.Module]]:
        """Family -> `tables(family)`, for the families this model has."""
        return {family: tables for family in FAMILIES if (tables := self.tables(family))}

    def token_tables(self) -> dict[int, nn.Embedding]:
        """Table key -> token table (the `token` family: STEM, STEM-gate, PLE, value tables, ... keyed by the input
        id), side modules' tables included."""
        return self.tables("token")

    def init_stds(self) -> dict[int, float]:
        """id(parameter) -> init std for the parameters whose module asks for its own (n-gram, memory kinds)."""
        stds = {}
        for module in self.modules():
            if module is not self and hasattr(module, "init_stds"):
                stds.update(module.init_stds())
        return stds

    def init_specs(self) -> list[tuple[str, torch.nn.Parameter, float | None]]:
        """(name, parameter, std) in the order `init_weights` draws them from its generator; std None: ones (a
        `registry.Fill`: that value).

        Lookup tables take `table_init`, norms ones, everything else N(0, initializer_range), unless a module's
        `init_stds()` names its own std for a parameter (None there: ones too; a `Uniform`: that uniform).

        stemlm.train.parallel.meta_init replays this order to initialise only one rank's shards to the same values."""
        std = self.config.initializer_range
        tables = {id(t.weight) for family in self.lookup_tables().values() for t in family.values()}
        own = self.init_stds()
        specs: list[tuple[str, torch.nn.Parameter, float | None]] = []
        for name, param in self.named_parameters():
            if id(param) in own:
                specs.append((name, param, own[id(param)]))
            elif id(param) in tables:
                if self.config.table_init == "xavier":
                    specs.append((name, param, math.sqrt(2.0 / (param.shape[0] + param.shape[1]))))
                else:
                    specs.append((name, param, self.config.table_init_std))
            elif name.endswith("norm.weight"):
                specs.append((name, param, None))
            else:
                specs.append((name, param, std))
        return specs

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Initialise every parameter: N(0, initializer_range) for projections and embeddings, ones for norms,
        and the token tables by `table_init` (official STEM: xavier-normal over the whole V x width table)."""
        generator = torch.Generator(device="cpu")
        generator.manual_seed(0 if seed is None else seed)
        for _, param, std in self.init_specs():
            if (fill := fill_value(std)) is not None:
                param.fill_(fill)
            else:
                _draw_init(param, std, generator)

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def reset_buffers(self, device: torch.device | str) -> None:
        """Recompute the derived, unsaved buffers (RoPE frequencies, hash maps) on `device`, e.g. after `to_empty`."""
        for module in self.modules():
            if module is not self and hasattr(module, "reset_buffers"):
                module.reset_buffers(device)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())  # parameters() yields a tied weight once


def _tuple_or_none(items: list | None) -> tuple | None:
    return None if items is None else tuple(items)


def _draw_init(param: torch.Tensor, std: float | Uniform, generator: torch.Generator) -> None:
    # Drawn on the CPU from one generator so a seed gives the same model on any device.
    draws = init_draws(torch.randn(param.shape, generator=generator, dtype=torch.float32), std)
    param.copy_(draws.to(param.dtype))


def _embeddings_from(model: StemLM, embed_rows: EmbedRows, input_ids: torch.Tensor) -> torch.Tensor:
    x = embed_rows(input_ids)
    expected = (*input_ids.shape, model.config.hidden_size)
    if tuple(x.shape) != expected:
        raise StemlmError(f"rows['embed'] returned shape {list(x.shape)}; expected {list(expected)} ([batch, seq, d])")
    return x.to(model.model.embed_tokens.weight.dtype)


def default_position_ids(B: int, T: int, past_len: int, attention_mask, device) -> torch.Tensor:
    if attention_mask is None:
        return torch.arange(past_len, past_len + T, device=device).expand(B, T)
    # Left padding: positions count real tokens only, as in HF generate.
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.clamp(min=0)[:, past_len : past_len + T]


def _host_values(t: torch.Tensor) -> bool:
    # Value checks read the tensor on the host: free for CPU tensors, a device sync for GPU ones, and a graph break
    # under torch.compile. So they run on CPU tensors outside compilation. The trainer's ids come from a tokenizer
    # no larger than vocab_size (checked when a run starts); elsewhere a bad id on a GPU is a device-side assert.
    return t.device.type == "cpu" and not torch.compiler.is_compiling()


def check_token_ids(input_ids: torch.Tensor, vocab_size: int) -> None:
    """Reject ids outside [0, vocab_size) with a message naming the id, instead of an IndexError/device assert."""
    if not isinstance(input_ids, torch.Tensor):
        raise StemlmError(f"input_ids must be a torch tensor, got {type(input_ids).__name__}")
    if input_ids.dtype == torch.bool or input_ids.dtype.is_floating_point or input_ids.dtype.is_complex:
        raise StemlmError(f"input_ids must be an integer tensor, got {input_ids.dtype}")
    if input_ids.dim() != 2:
        raise StemlmError(f"input_ids must have shape [batch, seq_len], got {list(input_ids.shape)}")
    if input_ids.numel() == 0:
        raise StemlmError("input_ids is empty")
    if not _host_values(input_ids):
        return
    lo, hi = int(input_ids.min()), int(input_ids.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise StemlmError(
            f"token id {bad} is out of range for vocab_size {vocab_size} (valid ids: 0..{vocab_size - 1})"
        )


def _check_optional_inputs(B, T, past_len, attention_mask, labels, position_ids, vocab_size: int) -> None:
    if attention_mask is not None and tuple(attention_mask.shape) != (B, past_len + T):
        raise StemlmError(
            f"attention_mask has shape {list(attention_mask.shape)}; expected [batch, cached + new tokens] = "
            f"{[B, past_len + T]} (include the cached positions when decoding with past_key_values)"
        )
    if position_ids is not None and tuple(position_ids.shape) not in ((B, T), (1, T)):
        raise StemlmError(f"position_ids has shape {list(position_ids.shape)}; expected {[B, T]}")
    if labels is not None:
        if tuple(labels.shape) != (B, T):
            raise StemlmError(f"labels has shape {list(labels.shape)}; expected the shape of input_ids {[B, T]}")
        bad = labels[(labels != -100) & ((labels < 0) | (labels >= vocab_size))] if _host_values(labels) else None
        if bad is not None and bad.numel():
            raise StemlmError(
                f"label {int(bad[0])} is out of range for vocab_size {vocab_size} (use -100 for ignored positions)"
            )


def build_model(config: ModelConfig, *, device: str | torch.device | None = None, seed: int = 0) -> StemLM:
    """Build and initialise a model; `device="meta"` gives a shape-only model for inspection (no memory).

    Modules are created on the meta device first so no time is spent on torch's default initialisation of
    weights that `init_weights` overwrites anyway.
    """
    with torch.device("meta"):
        model = StemLM(config)
    if str(device) == "meta":
        return model
    check_fits(config, device or "cpu")  # the weights' bytes against free memory, before any allocation
    model.to_empty(device=device or "cpu")
    model.tie_weights()
    model.reset_buffers(device or "cpu")
    model.init_weights(seed)
    return model


__all__ = ["ForwardOptions", "ModelOutput", "StemLM", "build_model", "check_token_ids"]
