"""`ModelConfig`: the typed description of a stemlm decoder, with validation and (de)serialisation.

Shared fields use Hugging Face Llama names so a dense config.json reads as a Llama config. STEM-specific
fields: `ffn` is the kind of the selected layers and `ffn_layers` selects them; every other layer is a dense SwiGLU.
`ffn_layers` is an explicit list of indices or a spec string resolved against `num_hidden_layers` (see
`resolve_layer_spec`). It was called `stem_layers` (the official STEM code's name) before it selected the layers of
any kind; `RENAMED_FIELDS` keeps the old name working in config.json files, dicts and `--set` overrides.

The kinds' own fields (`num_experts`, `engram_dim`, ...) are declared by the kinds (`stemlm.model.kinds`) and
added here as flat fields after the shared ones, so attributes and config.json keys are flat as they always
were: `ModelConfig(ffn="engram", engram_dim=128)`. `FFN_KINDS` and `TABLE_KINDS` come from the registry.

Kinds compose per layer: a kind that can run beside an FFN kind (`Kind.beside`: value embeddings, the Engram
branch) has its own layer selection `<kind>_layers`, so `ModelConfig(ffn="stem", ffn_layers="odd",
value_embed_layers="first:3,last:3")` is STEM on the odd layers and value embeddings on the first and last three
(`layer_sides(i)` lists a layer's side kinds).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

from stemlm.errors import StemlmError
from stemlm.model.kinds.registry import all_kinds, beside_kinds, get_kind, kind_fields, kind_names
from stemlm.model.overrides import apply_overrides

FFN_KINDS = kind_names()
# Kinds whose layers own a token-indexed table (they need the input ids at every position).
TABLE_KINDS = tuple(k.name for k in all_kinds() if "token" in k.families())
LAYER_SPECS = ("all", "all-but-first", "odd", "even", "half", "none")
MODEL_TYPE = "stemlm"
# Old field name -> its name: read from config.json files and dicts written before the rename (`renamed_fields`)
# and accepted by `--set` overrides.
RENAMED_FIELDS = {"stem_layers": "ffn_layers"}
# Upper bounds of every size, checked before anything is built from them (or a layer list is resolved): a
# config.json asking for 10**9 layers is one line, not an out-of-memory kill. Each is far above any published
# model (the largest have ~128 layers, hidden 16384, a 256k vocabulary); sizes of the kinds' own fields are bounded
# by `stemlm.model.kinds.registry.MAX_KIND_SIZE`. What a config within them would take is compared with free
# memory before a real build (`stemlm.model.memory_check`).
SIZE_LIMITS = {
    "vocab_size": 2**22,
    "hidden_size": 2**16,
    "intermediate_size": 2**18,
    "num_hidden_layers": 1024,
    "num_attention_heads": 1024,
    "max_position_embeddings": 2**24,
    "num_key_value_heads": 1024,
    "head_dim": 2048,
}
_POSITIVE_INTS = (
    "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads max_position_embeddings"
).split()


def renamed_fields(d: dict[str, Any]) -> dict[str, Any]:
    """`d` with each old field name (`RENAMED_FIELDS`) under its new name; both names with different values is an
    error (which one was meant is unknown)."""
    out = dict(d)
    for old, new in RENAMED_FIELDS.items():
        if old not in out:
            continue
        value = out.pop(old)
        if new in out and out[new] != value:
            raise StemlmError(
                f"config gives both {old}={value!r} and {new}={out[new]!r}; {old} is the old name of {new}"
            )
        out[new] = value
    return out


def resolve_layer_spec(spec: str | list[int] | tuple[int, ...], num_layers: int) -> list[int]:
    """Turn a layer selection into sorted layer indices.

    Specs: `all`; `all-but-first` (the official STEM default); `odd` (1, 3, 5, ...); `even`; `half`
    (every second layer starting at 1, i.e. `odd`, the paper's best "1/2 layers" variant); `every:K` (layers
    K-1, 2K-1, ... so the last layer is included when K divides L); `none`; or a comma list whose entries are
    indices (negative ones count from the end: -1 is the last layer), `first:K` or `last:K`, e.g. "1,3,5" or
    "first:3,last:3" (= "0,1,2,-3,-2,-1", modded-nanogpt's value-embedding layers).
    """
    if isinstance(spec, (list, tuple)):
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in spec):
            raise StemlmError(f"bad layer list {list(spec)!r}: entries must be integer layer indices")
        if len(spec) > num_layers:
            raise StemlmError(f"layer list has {len(spec)} entries for a model with {num_layers} layers")
        layers = [_index(i, num_layers) for i in spec]
    else:
        text = str(spec).strip().lower()
        if text in ("all",):
            layers = list(range(num_layers))
        elif text == "all-but-first":
            layers = list(range(1, num_layers))
        elif text in ("odd", "half"):
            layers = list(range(1, num_layers, 2))
        elif text == "even":
            layers = list(range(0, num_layers, 2))
        elif text in ("none", ""):
            layers = []
        elif text.startswith("every:"):
            try:
                k = int(text.split(":", 1)[1])
            except ValueError:
                raise StemlmError(f"bad layer spec {spec!r}: every:K needs an integer K") from None
            if k < 1:
                raise StemlmError(f"bad layer spec {spec!r}: K must be >= 1")
            layers = list(range(k - 1, num_layers, k))
        else:
            layers = [
                i for part in text.replace(" ", "").split(",") if part for i in _spec_part(spec, part, num_layers)
            ]
    for i in layers:
        if not 0 <= i < num_layers:
            raise StemlmError(
                f"layer index {i} is out of range for a model with {num_layers} layers (0..{num_layers - 1})"
            )
    if len(set(layers)) != len(layers):
        raise StemlmError(f"layer spec {spec!r} lists a layer twice")
    return sorted(layers)


def _index(i: int, num_layers: int) -> int:
    """A layer index (negative: from the end) as 0..L-1; out of range is an error naming the index as given."""
    if not -num_layers <= i < num_layers:
        raise StemlmError(
            f"layer index {i} is out of range for a model with {num_layers} layers (0..{num_layers - 1}, or "
            f"-{num_layers}..-1 from the end)"
        )
    return i + num_layers if i < 0 else i


def _spec_part(spec, part: str, num_layers: int) -> list[int]:
    """One entry of a comma list: an index (negative: from the end), `first:K` or `last:K`."""
    end, _, count = part.partition(":") if part.startswith(("first:", "last:")) else ("", "", part)
    try:
        n = int(count)
    except ValueError:
        raise StemlmError(
            f"bad layer spec {spec!r}: use a comma list of indices, first:K, last:K or one of "
            f"{', '.join(LAYER_SPECS)}, every:K"
        ) from None
    if not end:
        return [_index(n, num_layers)]
    if not 0 <= n <= num_layers:
        raise StemlmError(f"bad layer spec {spec!r}: {part} asks for {n} of {num_layers} layers")
    return list(range(n)) if end == "first" else list(range(num_layers - n, num_layers))


def with_kind_fields(cls: type) -> type:
    """Add every kind's fields (stemlm.model.kinds) to the class body, after its own fields and before `model_type`."""
    annotations = cls.__dict__["__annotations__"]
    last = annotations.pop("model_type")
    for f in kind_fields():
        if f.name in annotations:
            raise StemlmError(f"a kind declares config field {f.name!r}, which ModelConfig already has")
        annotations[f.name] = f.type
        setattr(cls, f.name, f.default)
    annotations["model_type"] = last
    return cls


@dataclass
@with_kind_fields
class ModelConfig:
    # --- shared decoder fields (Hugging Face Llama names) ---
    vocab_size: int = 8192
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int | None = None  # None: multi-head attention (= num_attention_heads)
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0
    rope_llama3: dict | None = None  # Llama-3 RoPE scaling (stemlm.model.rope_scaling); None: plain RoPE
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    # --- FFN selection ---
    ffn: str = "stem"  # the FFN kind of the layers in ffn_layers; all other layers are dense SwiGLU
    ffn_layers: str | list[int] = "all-but-first"
    # --- lookup tables (every kind's) ---
    table_init: str = "xavier"  # "xavier" (official: std sqrt(2/(V+d_ff))) or "normal" (std = table_init_std)
    table_init_std: float = 0.02
    hash_seed: int = 0  # seed of every hashed lookup (hash-MoE's token -> expert map, the n-gram keys)
    # --- the kinds' own fields are inserted here (with_kind_fields) ---
    model_type: str = field(default=MODEL_TYPE)

    def __post_init__(self) -> None:
        self.validate()

    # ----- derived quantities -----
    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def special_layers(self) -> list[int]:
        """Indices of the layers whose FFN is `ffn` (empty for a dense model)."""
        return [] if self.ffn == "dense" else resolve_layer_spec(self.ffn_layers, self.num_hidden_layers)

    def layer_ffn(self, layer_idx: int) -> str:
        return self.ffn if layer_idx in self.special_layers else "dense"

    def beside_layers(self, kind: str) -> list[int]:
        """The layers where `kind` runs beside the FFN kind (its field `<kind>_layers`)."""
        return resolve_layer_spec(getattr(self, get_kind(kind).layers_field), self.num_hidden_layers)

    def layer_kinds(self, layer_idx: int) -> tuple[str, ...]:
        """The FFN kind of layer `layer_idx`, then the kinds beside it."""
        return (self.layer_ffn(layer_idx), *self.layer_sides(layer_idx))

    def layer_sides(self, layer_idx: int) -> tuple[str, ...]:
        """The kinds running beside the FFN kind in layer `layer_idx`, in kind order."""
        return tuple(k.name for k in beside_kinds() if layer_idx in self.beside_layers(k.name))

    # ----- validation -----
    def validate(self) -> None:
        """Raise a one-line StemlmError for the first problem: another model type, then a field out of range
        (`check_values`: sizes bounded before anything is built from them), then shapes that do not fit together
        and the kinds' own checks (`check_structure`)."""
        if self.model_type != MODEL_TYPE:
            raise StemlmError(f"config is for model type {self.model_type!r}, not {MODEL_TYPE!r}")
        check_values(self)
        check_structure(self)

    # ----- (de)serialisation -----
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for name in ("ffn_layers", *(k.layers_field for k in beside_kinds())):
            if isinstance(d[name], tuple):
                d[name] = list(d[name])
        return d

    def to_hf_dict(self) -> dict[str, Any]:
        """config.json content: our fields plus the Llama fields HF expects (so a dense folder loads as Llama)."""
        d = self.to_dict()
        d.update(
            num_key_value_heads=self.kv_heads,
            head_dim=self.head_size,
            hidden_act="silu",
            attention_bias=False,
            mlp_bias=False,
            architectures=["StemlmForCausalLM"],
            resolved_ffn_layers=self.special_layers,
        )
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        if "model_type" in d and d["model_type"] != MODEL_TYPE:
            raise StemlmError(f"config is for model type {d['model_type']!r}, not {MODEL_TYPE!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in renamed_fields(d).items() if k in names})

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def with_overrides(self, overrides: dict[str, str] | list[str]) -> ModelConfig:
        """Apply `key=value` overrides (strings as typed on a command line), checking every key exists."""
        return apply_overrides(
            self, overrides, prefix="model.", label="config key", fixed=("model_type",), aliases=RENAMED_FIELDS
        )

    def to_json(self) -> str:
        return json.dumps(self.to_hf_dict(), indent=2, sort_keys=True)


def need(cond: bool, msg: str) -> None:
    """A check of `ModelConfig.validate` (and of the kinds' `check`): raise "invalid config: <msg>" unless `cond`."""
    if not cond:
        raise StemlmError(f"invalid config: {msg}")


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def check_values(config: ModelConfig) -> None:
    """Every field alone: sizes positive and within `SIZE_LIMITS`, the kinds' fields as they declare, numbers finite."""
    for name in _POSITIVE_INTS:
        value = getattr(config, name)
        need(_positive_int(value), f"{name} must be a positive integer, got {value!r}")
    for name in ("num_key_value_heads", "head_dim"):
        value = getattr(config, name)
        need(value is None or _positive_int(value), f"{name} must be a positive integer or None, got {value!r}")
    for name, limit in SIZE_LIMITS.items():
        value = getattr(config, name)
        need(value is None or value <= limit, f"{name}={value} exceeds the limit of {limit}")
    for f in kind_fields():  # sizes bounded before the layer spec (or anything else) is built from them
        f.check(getattr(config, f.name), need)
    if config.rope_llama3 is not None:
        from stemlm.model.rope_scaling import check_llama3

        check_llama3(config.rope_llama3)
    for name in ("rope_theta", "rms_norm_eps", "initializer_range", "table_init_std"):
        value = getattr(config, name)
        need(
            isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0,
            f"{name} must be a positive number (finite), got {value!r}",
        )
    need(
        isinstance(config.tie_word_embeddings, bool),
        f"tie_word_embeddings must be true or false, got {config.tie_word_embeddings!r}",
    )
    need(
        isinstance(config.hash_seed, int) and not isinstance(config.hash_seed, bool),
        f"hash_seed must be an integer, got {config.hash_seed!r}",
    )


def check_structure(config: ModelConfig) -> None:
    """The fields together: a known kind, heads that divide the width, layer specs that resolve, and every kind's
    own checks (whichever kind is selected, as config.json is read)."""
    need(config.ffn in FFN_KINDS, f"unknown ffn kind {config.ffn!r}; choose one of {', '.join(FFN_KINDS)}")
    need(
        config.head_dim is not None or config.hidden_size % config.num_attention_heads == 0,
        f"num_attention_heads={config.num_attention_heads} does not divide hidden_size={config.hidden_size} "
        "(set head_dim explicitly or change the head count)",
    )
    need(config.head_size % 2 == 0, f"head dimension {config.head_size} must be even for RoPE")
    need(
        config.num_attention_heads % config.kv_heads == 0,
        f"num_key_value_heads={config.kv_heads} must divide num_attention_heads={config.num_attention_heads}",
    )
    need(
        config.table_init in ("xavier", "normal"),
        f"table_init must be 'xavier' or 'normal', got {config.table_init!r}",
    )
    resolve_layer_spec(config.ffn_layers, config.num_hidden_layers)
    for kind in beside_kinds():
        side = config.beside_layers(kind.name)
        need(
            not side or config.ffn != kind.name or not config.special_layers,
            f"{kind.layers_field} adds {kind.name} beside the FFN kind, which is {kind.name} already: "
            f"select its layers with ffn_layers alone",
        )
    for kind in all_kinds():
        if kind.check is not None:
            kind.check(config, need)
