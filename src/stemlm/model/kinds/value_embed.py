"""`value_embed`: modded-nanogpt's value embeddings, token-indexed rows mixed into attention's value vectors.

In each selected layer, on the value vectors of attention (before it attends, and before the KV cache keeps them):

    v_t <- λ0 · v_t + λ1 · VE[t]         VE: [vocab_size, kv_heads · head_dim], t the input id; λ learned per layer

As the FFN kind (`ffn="value_embed"`, its layers in `ffn_layers`) the layer's FFN stays a dense SwiGLU. Beside
another FFN kind (`value_embed_layers`, e.g. STEM on the odd layers and value embeddings on "first:3,last:3") the
mix alone sits at `model.layers.<i>.beside.value_embed` (`ValueEmbedding`); both modules mix through
`mix_values`, one implementation. `value_embed_tables` = n shares the tables: the j-th selected layer uses table
j mod n (six layers and n = 3 give modded-nanogpt's 0 1 2 ... 0 1 2); None gives every layer its own. A shared
table is held by the first layer that uses it (`model.layers.<owner>.mlp.value_embedding.weight`, or
`...beside.value_embed.value_embedding.weight`); the others read it under the owner's key. VE is a
`token` table (stemlm.model.kinds.registry.FAMILIES), so it is prefetched when offloaded, row-sharded under
`--nproc`, trained row-sparsely and edited like a STEM table.

From KellerJordan/modded-nanogpt's `train_gpt.py` (the idea read there, written anew). Differences: λ start at
(1, 1), so a layer starts as its dense twin plus the row (modded-nanogpt starts at (0.5, 0.5)); VE takes
`table_init` like every token table; layers without a table stay plain (modded-nanogpt scales their v by λ0).
Accounting: the mix is elementwise (no FLOPs counted, as FlopCounterMode counts none); a token reads one row
per table, so a shared table's row counts once; the two λ per layer are `value_mix` parameters.

`value_embed_variant="reference"` is today's modded-nanogpt instead (its `GPT.forward`): five tables, one for each
of exactly five selected layers (modded-nanogpt's pattern [None, ve0, ve1, None, ..., None, ve2, ve3, ve4] over its
L layers is the selection `1,2,-3,-2,-1`), and per kv head a gate on the row:

    v_t <- λ0 · v_t + 2·sigmoid(W_g [x_t[:6], VE[t][:6]])_h · VE[t]_h     x_t: the layer's normalised attention input

W_g: [kv_heads, 12], zero at the start (every gate 1); λ0 one scalar per layer starting at 0.5 (modded-nanogpt's
sa_lambdas[0], which scales the whole qkv projection there). docs/kinds.md lists what still differs from the reference.
"""

from __future__ import annotations

import torch
from torch import nn

from stemlm.model.ffn import DenseFFN, TokenContext, lookup, token_table
from stemlm.model.kinds.registry import Beside, Config, Field, Fill, Kind, LayerCount, Table, table_key

NAME = "value_embed"
VARIANTS = ("stemlm", "reference")
REFERENCE_TABLES = 5  # modded-nanogpt's value_embeds: 5 tables
# The layers of modded-nanogpt's pattern [None, ve0, ve1, None, ..., None, ve2, ve3, ve4] (a layer spec)
REFERENCE_LAYERS = "1,2,-3,-2,-1"
GATE_CHANNELS = 6  # the reference gate reads the first 6 channels of the attention input and of the row
REFERENCE_LAMBDA_START = 0.5  # modded-nanogpt's sa_lambdas[0] at the start


def is_reference(config: Config) -> bool:
    return config.value_embed_variant == "reference"


def value_layers(config: Config) -> list[int]:
    """The layers with value embeddings: `ffn_layers` when it is the FFN kind, else `value_embed_layers`."""
    return config.special_layers if config.ffn == NAME else config.beside_layers(NAME)


def table_owner(config: Config, layer_idx: int) -> int:
    """The layer whose module holds the value table that `layer_idx` reads."""
    if is_reference(config):
        return layer_idx  # five distinct tables, none shared
    layers = value_layers(config)
    return layers[layers.index(layer_idx) % (config.value_embed_tables or len(layers))]


def mix_values(module: nn.Module, v: torch.Tensor, ctx: TokenContext, x: torch.Tensor) -> torch.Tensor:
    """v: [B, kv_heads, T, head_dim] -> λ0 · v + λ1 · VE[t], same shape (`module`: either module below; the
    reference variant's `value_gate` makes it λ0 · v + gate · VE[t]). x: the attention input [B, T, hidden]."""
    B, H, T, D = v.shape
    rows = lookup(module.value_embedding, ctx, module.table_key).to(v.dtype)  # [B, T, kv_heads · head_dim]
    lam = module.value_lambda.to(v.dtype)
    if not hasattr(module, "value_gate"):
        return lam[0] * v + lam[1] * rows.reshape(B, T, H, D).transpose(1, 2)
    gate_input = torch.cat([x[..., :GATE_CHANNELS].to(v.dtype), rows[..., :GATE_CHANNELS]], dim=-1)
    gate = 2 * torch.sigmoid(module.value_gate(gate_input))  # [B, T, kv_heads]: one gate per head
    return lam[0] * v + (gate[..., None] * rows.reshape(B, T, H, D)).transpose(1, 2)


def _add_mix(module: nn.Module, config: Config, layer_idx: int, side: str | None) -> None:
    """Give `module` its value table (unless another layer owns it: the decoder points `value_embedding` at the
    owner's) and its λ, registered after whatever the module already has (the parameter order is the init order)."""
    owner = table_owner(config, layer_idx)
    module.table_key = table_key(config, owner, side)
    if owner == layer_idx:
        module.value_embedding = token_table(config.vocab_size, config.kv_heads * config.head_size)
    if is_reference(config):
        module.value_gate = nn.Linear(2 * GATE_CHANNELS, config.kv_heads, bias=False)
        module.value_lambda = nn.Parameter(torch.empty(1))  # λ0 (the gate replaces λ1)
    else:
        module.value_lambda = nn.Parameter(torch.empty(2))  # (λ0, λ1)


def _mix_stds(module: nn.Module) -> dict[int, float | Fill | None]:
    """λ start at ones (None); the reference's as modded-nanogpt's: λ0 at 0.5 (its sa_lambdas[0]), the gate weights
    at zero (std 0: every gate starts at 2·sigmoid(0) = 1)."""
    gate = getattr(module, "value_gate", None)
    if gate is None:
        return {id(module.value_lambda): None}
    return {id(module.value_lambda): Fill(REFERENCE_LAMBDA_START), id(gate.weight): 0.0}


class ValueEmbedFFN(DenseFFN):
    """The FFN kind: a dense SwiGLU at the FFN position (its forward), and `mix_values`, which the layer's attention
    calls."""

    def __init__(self, config: Config, layer_idx: int) -> None:
        super().__init__(config.hidden_size, config.intermediate_size)
        _add_mix(self, config, layer_idx, side=None)

    def init_stds(self) -> dict[int, float | None]:
        return _mix_stds(self)

    def mix_values(self, v: torch.Tensor, ctx: TokenContext, x: torch.Tensor) -> torch.Tensor:
        return mix_values(self, v, ctx, x)


class ValueEmbedding(nn.Module):
    """Beside another FFN kind: the mix alone, at `model.layers.<i>.beside.value_embed`."""

    def __init__(self, config: Config, layer_idx: int) -> None:
        super().__init__()
        _add_mix(self, config, layer_idx, side=NAME)

    def init_stds(self) -> dict[int, float | None]:
        return _mix_stds(self)

    def mix_values(self, v: torch.Tensor, ctx: TokenContext, x: torch.Tensor) -> torch.Tensor:
        return mix_values(self, v, ctx, x)


def count_mix(config: Config, layer_idx: int) -> LayerCount:
    """The mix alone: two λ (the reference: one λ and the gate's [kv_heads, 12] matmul), and the table with one
    row read per token where this layer owns it."""
    width = config.kv_heads * config.head_size
    owner = table_owner(config, layer_idx) == layer_idx
    tables = {"value_tables": config.vocab_size * width} if owner else {}
    if is_reference(config):
        gate = 2 * GATE_CHANNELS * config.kv_heads
        return LayerCount({"value_mix": 1, "value_gate": gate, **tables}, {"value_gate": gate}, width)
    return LayerCount({"value_mix": 2, **tables}, {}, width if owner else 0)


def count(config: Config, layer_idx: int) -> LayerCount:
    d, f = config.hidden_size, config.intermediate_size
    mix = count_mix(config, layer_idx)
    return LayerCount({"ffn_dense": 3 * d * f, **mix.params}, {"ffn_dense": 3 * d * f}, mix.rows)


def check(config: Config, need) -> None:
    field = "ffn_layers" if config.ffn == NAME else "value_embed_layers"
    layers = len(value_layers(config))
    variant = config.value_embed_variant
    need(variant in VARIANTS, f"value_embed_variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
    if variant == "reference" and (config.ffn == NAME or layers):
        need(
            layers == REFERENCE_TABLES,
            f"value_embed_variant=reference has {REFERENCE_TABLES} tables, one per layer: {field} selects {layers} "
            f"layers (modded-nanogpt's are {REFERENCE_LAYERS})",
        )
        need(config.value_embed_tables is None, "value_embed_tables applies to value_embed_variant=stemlm only")
        width = config.kv_heads * config.head_size
        need(
            min(config.hidden_size, width) >= GATE_CHANNELS,
            f"value_embed_variant=reference gates on {GATE_CHANNELS} channels of hidden_size and kv_heads·head_dim",
        )
    if config.value_embed_tables is not None and (config.ffn == NAME or layers):
        need(
            config.value_embed_tables <= layers,
            f"value_embed_tables={config.value_embed_tables} exceeds the {layers} layers in {field}",
        )


KIND = Kind(
    name=NAME,
    order=100,
    summary="value embeddings (modded-nanogpt): attention's v <- λ0·v + λ1·VE[t], beside a dense FFN",
    build=ValueEmbedFFN,
    count=count,
    fields=(
        Field(
            "value_embed_tables",
            "int | None",
            None,
            "distinct value tables: the j-th selected layer uses table j mod n; None: one per layer",
            positive=True,
        ),
        Field(
            "value_embed_variant",
            "str",
            "stemlm",
            "stemlm: v <- λ0·v + λ1·VE[t]; reference: today's modded-nanogpt (5 tables, per-head sigmoid gates)",
        ),
    ),
    check=check,
    tables=(Table("token", "value_embedding", owner=table_owner),),
    components=("ffn_dense", "value_tables", "value_mix", "value_gate"),
    table_components=("value_tables",),
    scalar_components=("value_mix",),
    acts_on_values=True,
    trains_with_tables=("value_lambda", "value_gate"),  # value_gate: the reference variant's
    beside=Beside(build=ValueEmbedding, count=count_mix, acts_on="values"),
    vllm_unserved=(
        "fits vLLM's step (token-indexed rows mixed into attention's values before the KV cache keeps "
        "them) but has no module there yet"
    ),
    variant_settings={"reference": {"ffn_layers": REFERENCE_LAYERS}},  # five tables on exactly these layers
)
