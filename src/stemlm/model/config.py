"""`ModelConfig`: the typed description of a stemlm decoder, with validation and (de)serialisation.

Shared fields use Hugging Face Llama names so a dense config.json reads as a Llama config. STEM-specific
fields: `ffn` is the FFN kind of the selected layers and `stem_layers` selects them (the name follows the
official STEM code); every other layer is a dense SwiGLU. `stem_layers` is an explicit list of indices or a
spec string resolved against `num_hidden_layers` (see `resolve_layer_spec`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

from stemlm.errors import StemlmError

FFN_KINDS = (
    "dense", "stem", "stem_gate", "moe", "hash_moe", "ple", "stem_ngram", "engram", "memory", "stem_adapter"
)  # fmt: skip
# Kinds whose layers own a token-indexed table (they need the input ids at every position).
TABLE_KINDS = ("stem", "stem_gate", "ple", "stem_ngram", "stem_adapter")
LAYER_SPECS = ("all", "all-but-first", "odd", "even", "half", "none")
MODEL_TYPE = "stemlm"
_POSITIVE_INTS = (
    "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads max_position_embeddings "
    "num_experts num_experts_per_tok ple_dim stem_ngram_heads engram_dim engram_heads engram_kernel memory_keys "
    "memory_topk memory_heads memory_key_dim"
).split()


def resolve_layer_spec(spec: str | list[int] | tuple[int, ...], num_layers: int) -> list[int]:
    """Turn a layer selection into sorted layer indices.

    Specs: `all`; `all-but-first` (the official STEM default); `odd` (1, 3, 5, ...); `even`; `half`
    (every second layer starting at 1, i.e. `odd`, the paper's best "1/2 layers" variant); `every:K` (layers
    K-1, 2K-1, ... so the last layer is included when K divides L); `none`; or a comma list "1,3,5".
    """
    if isinstance(spec, (list, tuple)):
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in spec):
            raise StemlmError(f"bad layer list {list(spec)!r}: entries must be integer layer indices")
        layers = list(spec)
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
            try:
                layers = [int(part) for part in text.replace(" ", "").split(",") if part]
            except ValueError:
                raise StemlmError(
                    f"bad layer spec {spec!r}: use a comma list of indices or one of {', '.join(LAYER_SPECS)}, every:K"
                ) from None
    for i in layers:
        if not 0 <= i < num_layers:
            raise StemlmError(
                f"layer index {i} is out of range for a model with {num_layers} layers (0..{num_layers - 1})"
            )
    if len(set(layers)) != len(layers):
        raise StemlmError(f"layer spec {spec!r} lists a layer twice")
    return sorted(layers)


@dataclass
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
    ffn: str = "stem"  # the FFN kind of the layers in stem_layers; all other layers are dense SwiGLU
    stem_layers: str | list[int] = "all-but-first"
    # --- token tables (stem, stem_gate, ple) ---
    table_init: str = "xavier"  # "xavier" (official: std sqrt(2/(V+d_ff))) or "normal" (std = table_init_std)
    table_init_std: float = 0.02
    # --- MoE / hash-MoE ---
    num_experts: int = 8
    num_experts_per_tok: int = 2  # top-k for moe (hash_moe always routes to exactly one expert)
    moe_intermediate_size: int | None = None  # None: intermediate_size // num_experts_per_tok (matched active FFN)
    moe_shared_expert: bool = False
    router_z_loss: bool = False
    hash_seed: int = 0
    # --- PLE (Gemma-3n style per-layer embedding next to a dense FFN) ---
    ple_dim: int = 256
    # --- n-gram keyed STEM, Engram, product-key memory (stemlm.model.ngram / engram / memory_layer) ---
    stem_ngram_orders: str = "2"  # n-gram orders added to U[t]: "2" (bigrams) or "2,3"
    stem_ngram_heads: int = 2  # hash heads per order, each with its own prime-sized table
    stem_ngram_rows: int | None = None  # rows per head (rounded up to a prime); None: vocab_size
    engram_orders: str = "2,3"
    engram_heads: int = 4
    engram_rows: int | None = None  # rows per head (rounded up to a prime); None: vocab_size
    engram_dim: int = 256  # width of the concatenated n-gram memory e_t (split evenly over orders x heads)
    engram_kernel: int = 4  # the short causal conv's kernel (its dilation is the largest order)
    memory_keys: int = 128  # sub-keys per half: memory_keys² value rows
    memory_topk: int = 16
    memory_heads: int = 4
    memory_key_dim: int = 64  # query width per head (two halves of memory_key_dim / 2)
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
    def expert_size(self) -> int:
        return self.moe_intermediate_size or max(1, self.intermediate_size // self.num_experts_per_tok)

    @property
    def special_layers(self) -> list[int]:
        """Indices of the layers whose FFN is `ffn` (empty for a dense model)."""
        return [] if self.ffn == "dense" else resolve_layer_spec(self.stem_layers, self.num_hidden_layers)

    def layer_ffn(self, layer_idx: int) -> str:
        return self.ffn if layer_idx in self.special_layers else "dense"

    # ----- validation -----
    def validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise StemlmError(f"invalid config: {msg}")

        if self.model_type != MODEL_TYPE:
            raise StemlmError(f"config is for model type {self.model_type!r}, not {MODEL_TYPE!r}")

        def positive_int(value: Any) -> bool:
            return isinstance(value, int) and not isinstance(value, bool) and value > 0

        for name in _POSITIVE_INTS:
            value = getattr(self, name)
            need(positive_int(value), f"{name} must be a positive integer, got {value!r}")
        for name in ("num_key_value_heads", "head_dim", "moe_intermediate_size"):
            value = getattr(self, name)
            need(value is None or positive_int(value), f"{name} must be a positive integer or None, got {value!r}")
        if self.rope_llama3 is not None:
            from stemlm.model.rope_scaling import check_llama3

            check_llama3(self.rope_llama3)
        for name in ("rope_theta", "rms_norm_eps", "initializer_range", "table_init_std"):
            value = getattr(self, name)
            need(
                isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0,
                f"{name} must be a positive number (finite), got {value!r}",
            )
        for name in ("tie_word_embeddings", "moe_shared_expert", "router_z_loss"):
            need(isinstance(getattr(self, name), bool), f"{name} must be true or false, got {getattr(self, name)!r}")
        need(
            isinstance(self.hash_seed, int) and not isinstance(self.hash_seed, bool),
            f"hash_seed must be an integer, got {self.hash_seed!r}",
        )
        need(self.ffn in FFN_KINDS, f"unknown ffn kind {self.ffn!r}; choose one of {', '.join(FFN_KINDS)}")
        need(
            self.head_dim is not None or self.hidden_size % self.num_attention_heads == 0,
            f"num_attention_heads={self.num_attention_heads} does not divide hidden_size={self.hidden_size} "
            "(set head_dim explicitly or change the head count)",
        )
        need(self.head_size % 2 == 0, f"head dimension {self.head_size} must be even for RoPE")
        need(
            self.num_attention_heads % self.kv_heads == 0,
            f"num_key_value_heads={self.kv_heads} must divide num_attention_heads={self.num_attention_heads}",
        )
        need(
            self.table_init in ("xavier", "normal"), f"table_init must be 'xavier' or 'normal', got {self.table_init!r}"
        )
        need(
            self.num_experts_per_tok <= self.num_experts,
            f"num_experts_per_tok={self.num_experts_per_tok} exceeds num_experts={self.num_experts}",
        )
        resolve_layer_spec(self.stem_layers, self.num_hidden_layers)
        self._validate_lookup_kinds(need)

    def _validate_lookup_kinds(self, need) -> None:
        for name in ("stem_ngram_orders", "engram_orders"):
            orders = str(getattr(self, name)).replace(" ", "").split(",")
            ok = all(o.isdigit() and int(o) >= 2 for o in orders) and len(set(orders)) == len(orders)
            need(
                ok,
                f"{name} must be a comma list of distinct n-gram orders >= 2 such as '2' or '2,3', got "
                f"{getattr(self, name)!r}",
            )
        for name in ("stem_ngram_rows", "engram_rows"):
            value = getattr(self, name)
            need(
                value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 0),
                f"{name} must be a positive integer or None, got {value!r}",
            )
        keys = len(str(self.engram_orders).split(",")) * self.engram_heads
        need(
            self.engram_dim % keys == 0,
            f"engram_dim={self.engram_dim} must divide evenly over orders x heads = {keys} hash heads",
        )
        need(self.memory_key_dim % 2 == 0, f"memory_key_dim={self.memory_key_dim} must be even (two halves)")
        need(
            self.memory_topk <= self.memory_keys,
            f"memory_topk={self.memory_topk} exceeds memory_keys={self.memory_keys}",
        )

    # ----- (de)serialisation -----
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if isinstance(d["stem_layers"], tuple):
            d["stem_layers"] = list(d["stem_layers"])
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
            resolved_stem_layers=self.special_layers,
        )
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        if "model_type" in d and d["model_type"] != MODEL_TYPE:
            raise StemlmError(f"config is for model type {d['model_type']!r}, not {MODEL_TYPE!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def with_overrides(self, overrides: dict[str, str] | list[str]) -> ModelConfig:
        """Apply `key=value` overrides (strings as typed on a command line), checking every key exists."""
        if isinstance(overrides, list):
            pairs = {}
            for item in overrides:
                if "=" not in item:
                    raise StemlmError(f"override {item!r} is not of the form key=value")
                key, value = item.split("=", 1)
                pairs[key.strip().removeprefix("model.")] = value
            overrides = pairs
        fields = {f.name: f for f in dataclasses.fields(self)}
        changes = {}
        for key, raw in overrides.items():
            if key not in fields or key == "model_type":
                raise StemlmError(
                    f"unknown config key {key!r}; valid keys: {', '.join(sorted(set(fields) - {'model_type'}))}"
                )
            changes[key] = _parse_value(raw, str(fields[key].type), key)
        return self.replace(**changes)

    def to_json(self) -> str:
        return json.dumps(self.to_hf_dict(), indent=2, sort_keys=True)


def _parse_value(raw: Any, annotation: str, key: str) -> Any:
    """Parse a command-line string by the field's declared type (`int | None` accepts "none")."""
    if not isinstance(raw, str):
        return raw
    text = raw.strip()
    kinds = [part.strip() for part in annotation.split("|")]
    if "None" in kinds and text.lower() in ("none", "null"):
        return None
    if key == "stem_layers":
        return [int(x) for x in text.split(",")] if text.replace(",", "").replace(" ", "").isdigit() else text
    try:
        if "bool" in kinds:
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError
            return text.lower() in ("true", "1")
        if "int" in kinds:
            return int(text)
        if "float" in kinds:
            return float(text)
    except ValueError:
        words = {"bool": "true or false", "int": "an integer", "float": "a number", "None": "none"}
        expected = " or ".join(words.get(k, k) for k in kinds)
        raise StemlmError(f"config key {key!r} expects {expected}, got {raw!r}") from None
    return text
