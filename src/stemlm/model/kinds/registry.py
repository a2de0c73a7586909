"""The kind registry: what the rest of stemlm needs from a per-layer kind, declared once by the kind itself.

A kind is what the layers in `ffn_layers` compute at the FFN position (every other layer is dense). Each kind
is one module of `stemlm.model.kinds` that defines `KIND = Kind(...)`: its nn.Module, its config fields and
checks, its lookup tables, its accounting and what else the library asks of it. `all_kinds()` finds the
modules with `pkgutil`, so adding a file adds a kind; nothing else lists kinds. docs/kinds.md is the recipe.

Lookup tables belong to a `Family`, which fixes how the library treats them (`FAMILIES`):

- `token`: rows keyed by the input token id, known before any compute, so offload prefetches them (one
  token-major provider and row cache for every layer); under `--nproc` they are row-sharded over the ranks
  (`stemlm.placement.row_sharded.ShardedTables`); `--tables host` trains them from host memory; positional and global
  edits swap them; `StemLM.token_tables()` lists them.
- `ngram`: rows keyed by hashed n-gram ids of the input ids (`stemlm.model.ngram`), the same ids in every layer,
  also prefetched (one provider and cache); replicated under `--nproc`; not edited.
- `memory`: rows keyed by ids that a layer's own top-k picks from the hidden state, so they are fetched on demand
  (one provider and cache per layer, on the forward's critical path); replicated under `--nproc`; not edited.

A kind may also run *beside* the layer's FFN kind (`Kind.beside`, a `Beside`): its side module (value embeddings'
mix alone, Engram's branch alone) sits at `model.layers.<i>.beside.<kind>` on the layers its own selection field
`<kind>_layers` names, whatever kind the layer's `mlp` is. Its tables are the kind's `tables`, read from the side
module.

`model(ids, rows={family: provider})` supplies rows from outside (offload, sharding, edits); a family without a
provider is read from the model's own tables. A provider is asked for rows by a table key (`table_key`): the
layer index for the tables of the layer's `mlp`, so a model without side modules keys its tables by layer as it
always did; a side module's tables are keyed past the layers (`layer + slot * num_hidden_layers`), so a layer's
two token tables (STEM's and a value table) never share a key.

Every table trains in the table optimizer group (row-sparse
optimizers switch it to sparse gradients) and takes `table_init` unless its module's `init_stds` says otherwise.
A module's `init_stds` names a normal's std, None (ones) or a `Uniform` for a parameter (`init_draws`).
"""

from __future__ import annotations

import importlib
import math
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from stemlm.errors import StemlmError

# A stemlm.model.config.ModelConfig. Not imported, not even for type checking: the config imports this module
# (and through it every kind) to learn the kinds' fields, so no kind module imports the config either.
Config = Any
Need = Callable[[bool, str], None]  # need(condition, message): raises "invalid config: <message>" when false


@dataclass(frozen=True)
class Family:
    """How the library treats the lookup tables of one family (see the module docstring)."""

    name: str
    keyed_by: str  # what a row id is
    prefetch: bool  # the ids are known before the forward runs (offload fetches them ahead)
    nproc: str  # "row-sharded" or "replicated" under `stemlm train --nproc`
    cache: str  # offload: "shared" (one token-major provider and cache for all layers) or "per-layer"
    editable: bool  # positional / global row edits act on it


FAMILIES = {
    "token": Family("token", "the input token id", True, "row-sharded", "shared", True),
    "ngram": Family("ngram", "hashed n-gram ids of the input ids", True, "replicated", "shared", False),
    "memory": Family("memory", "ids the layer's own top-k picks", False, "replicated", "per-layer", False),
}


# The bound of every integer size a kind declares (experts, rows, widths, heads): above any real model's, and
# checked before the config is used, so a hostile config.json cannot make the build allocate without end.
MAX_KIND_SIZE = 2**24


@dataclass(frozen=True)
class Field:
    """One config field of a kind: a flat `ModelConfig` attribute and config.json key."""

    name: str
    type: str  # the annotation as a string: "int", "int | None", "float", "bool", "str"
    default: Any
    help: str
    positive: bool = False  # numbers: must be > 0 (None allowed when the type says so)

    def check(self, value: Any, need: Need) -> None:
        kinds = [part.strip() for part in self.type.split("|")]
        if value is None and "None" in kinds:
            return
        if "bool" in kinds:
            need(isinstance(value, bool), f"{self.name} must be true or false, got {value!r}")
        elif "int" in kinds:
            ok = isinstance(value, int) and not isinstance(value, bool) and (value > 0 or not self.positive)
            what = "a positive integer" if self.positive else "an integer"
            need(ok, f"{self.name} must be {what}{' or None' if 'None' in kinds else ''}, got {value!r}")
            if ok:
                need(abs(value) <= MAX_KIND_SIZE, f"{self.name}={value} exceeds the limit of {MAX_KIND_SIZE}")
        elif "float" in kinds:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (value > 0 or not self.positive)
            ok = ok and math.isfinite(value)
            need(ok, f"{self.name} must be a{' positive' if self.positive else ''} number, got {value!r}")


@dataclass(frozen=True)
class Fill:
    """An init that fills a parameter with one value instead of drawing it: a module's `init_stds()` may give one
    where a std goes (None there is Fill(1.0), ones). modded-nanogpt's λ start at 0.5, for example."""

    value: float


def fill_value(std: float | Fill | None) -> float | None:
    """The value an init spec (`StemLM.init_specs`) fills its parameter with; None where it draws N(0, std²)."""
    if std is None:
        return 1.0
    return std.value if isinstance(std, Fill) else None


@dataclass(frozen=True)
class Table:
    """A lookup table of a kind's module: `module.<attr>` (an nn.Embedding, or an nn.EmbeddingBag), in `family`.

    `owner(config, layer_idx)` names the layer whose module holds the table when layers share one (None: every
    layer holds its own). A sharing layer's module leaves `attr` unset; the decoder points it at the owner's
    table (unregistered, so the parameter keeps one name) and rows are asked for under the owner's index."""

    family: str
    attr: str
    owner: Callable[[Config, int], int] | None = None

    def owner_of(self, config: Config, layer_idx: int) -> int:
        return layer_idx if self.owner is None else self.owner(config, layer_idx)


@dataclass(frozen=True)
class Uniform:
    """An init U(-bound, bound), which a module's `init_stds` may name instead of a normal's std (a reference's
    own init, e.g. the product-key memory's keys and biases)."""

    bound: float


def init_draws(normal: torch.Tensor, spec: float | Uniform) -> torch.Tensor:
    """Standard-normal draws `normal` (changed in place) turned into draws of `spec`: a normal's std, or a
    `Uniform`, as bound · erf(z / √2), which is uniform on (-bound, bound) for a standard normal z. Every init
    draws normals from one generator (seeded init, `--nproc`'s meta init in row blocks), so a uniform init
    consumes the generator as a normal one does and both replay alike."""
    if isinstance(spec, Uniform):
        return torch.erf(normal.mul_(2**-0.5)).mul_(spec.bound)
    return normal.mul_(spec)


@dataclass(frozen=True)
class LayerCount:
    """One layer's FFN-position accounting (stemlm.model.accounting): parameters by component, the weight entries
    one token multiplies (2 FLOPs each), and the table entries one token reads."""

    params: dict[str, int]
    matmul: dict[str, int] = field(default_factory=dict)
    rows: int = 0
    inactive: int = 0  # parameters (not tables) a token does not use: the experts it is not routed to


@dataclass(frozen=True)
class Beside:
    """How a kind runs beside the layer's FFN kind, on the layers of its field `<kind>_layers` (default none).

    `build(config, layer_idx)` makes the side module at `model.layers.<i>.beside.<kind>`; it holds the attributes
    the kind's `tables` name. `acts_on` says where it enters the layer: "values" (its `mix_values(v, ctx, x)` runs on
    attention's values, as `Kind.acts_on_values`), "ffn" (its `forward(x, ctx, y)` returns the FFN output `y`
    plus its branch of the same normalised input `x`) or "residual" (its `residual_branch(x, ctx)` is added to the
    residual stream `x` before the layer's attention, as `Kind.acts_on_residual`); or a function of the config
    naming one of them (a kind whose variants enter at different places). `count` is the side module's
    accounting, in the kind's components. A side kind is refused on a model whose FFN kind is the same kind."""

    build: Callable[[Config, int], Any]
    count: Callable[[Config, int], LayerCount]
    acts_on: str | Callable[[Config], str]  # "values", "ffn" or "residual"

    def position(self, config: Config) -> str:
        """Where the side module enters the layers of `config`: "values", "ffn" or "residual"."""
        return self.acts_on if isinstance(self.acts_on, str) else self.acts_on(config)


@dataclass(frozen=True)
class Kind:
    name: str
    order: int  # position in kind lists (help texts, `--ffn` choices, `experiment compare --kinds`)
    summary: str  # one line: what the kind computes
    build: Callable[[Config, int], Any]  # (config, layer_idx) -> the nn.Module at `model.layers.<i>.mlp`
    count: Callable[[Config, int], LayerCount]  # accounting of one layer of this kind
    fields: tuple[Field, ...] = ()
    check: Callable[[Config, Need], None] | None = None  # cross-field checks (run for every config)
    tables: tuple[Table, ...] = ()
    components: tuple[str, ...] = ()  # accounting components it counts, in display order
    table_components: tuple[str, ...] = ()  # those of them that are lookup tables (read a row at a time)
    scalar_components: tuple[str, ...] = ()  # those used per token outside any matmul (no FLOPs counted)
    ngram: Callable[[Config], tuple[str, int, int | None]] | None = None  # (orders, heads, rows) of n-gram keys
    # The pad id of a config whose n-gram layers hash per layer, as the Engram demo (stemlm.model.ngram_layout);
    # None (or returning None): one hashing shared by every layer
    ngram_per_layer: Callable[[Config], int | None] | None = None
    acts_on_values: bool = False  # its module's `mix_values(v, ctx, x)` runs on attention's values (before the cache)
    # True for a config where its module's `residual_branch(x, ctx)` is added to the residual stream before the
    # layer's attention (its forward then computes the rest of the layer's FFN position alone)
    acts_on_residual: Callable[[Config], bool] | None = None
    # module parameters (or submodules) that keep learning under `--train tables`; a variant may lack one
    trains_with_tables: tuple[str, ...] = ()
    replaces_projection: bool = (
        False  # a table replaces one of the three SwiGLU projections (the paper's saving applies)
    )
    activation_elements: Callable[[Config], int] | None = None  # FFN values saved per token (memory plan)
    edit_note: str | None = None  # said with every row edit of such a model (what an edit does not change)
    resolved: Callable[[Config], dict[str, Any]] | None = None  # its None defaults resolved (config comparison)
    routes_by_id: bool = False  # reads `ctx.input_ids` without a table (hash layers: the id picks the expert)
    beside: Beside | None = None  # it can also run beside another kind's FFN (its side module), see `Beside`
    # stemlm's vLLM plugin (stemlm.vllm, docs/vllm.md): None where it serves the kind; otherwise why it does not
    # (what the kind needs of vLLM's step), said in one line when vLLM is asked to load such a model
    vllm_unserved: str | None = "the plugin has no vLLM module for it yet"
    # variant -> the config settings that variant needs beyond `<kind>_variant=<variant>` as the FFN kind of a model
    # (e.g. the layers a reference fixes); `stemlm experiment compare` sets them on the variant's arm
    variant_settings: dict[str, dict[str, Any]] = field(default_factory=dict, compare=False)

    @property
    def layers_field(self) -> str:
        """The config field selecting the layers it runs beside the FFN kind on (kinds with `beside`)."""
        return f"{self.name}_layers"

    def families(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(t.family for t in self.tables))

    def reads_input_ids(self) -> bool:
        """Whether the module needs the token ids, not only embeddings (Hugging Face's `inputs_embeds` alone).
        The prefetched families are exactly those whose row ids are computed from the input ids."""
        return self.routes_by_id or any(FAMILIES[t.family].prefetch for t in self.tables)


_KINDS: dict[str, Kind] = {}


def _found_kinds() -> list[Kind]:
    """The `KIND` of every module of this package but the registry (stemlm.hf.remote_code, which ships the kinds
    as flat files, replaces this function by name in its copy)."""
    import stemlm.model.kinds as package

    found = []
    for info in pkgutil.iter_modules(package.__path__):
        if info.name == "registry" or info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        kind = getattr(module, "KIND", None)
        if not isinstance(kind, Kind):
            raise StemlmError(f"{module.__name__} defines no KIND = Kind(...): every module there is a kind")
        found.append(kind)
    return found


def _discover() -> dict[str, Kind]:
    """Every kind, found once (`_found_kinds`) and checked."""
    if _KINDS:
        return _KINDS
    found = _found_kinds()
    for kind in found:
        unknown = [t.family for t in kind.tables if t.family not in FAMILIES]
        if unknown:
            raise StemlmError(f"kind {kind.name!r} declares tables of unknown families {unknown}")
    _KINDS.update((k.name, k) for k in sorted(found, key=lambda k: (k.order, k.name)))
    return _KINDS


def all_kinds() -> tuple[Kind, ...]:
    """Every registered kind, in `order`."""
    return tuple(_discover().values())


def kind_names() -> tuple[str, ...]:
    return tuple(_discover())


def get_kind(name: str) -> Kind:
    kinds = _discover()
    if name not in kinds:
        raise StemlmError(f"unknown ffn kind {name!r}; choose one of {', '.join(kinds)}")
    return kinds[name]


def beside_kinds() -> tuple[Kind, ...]:
    """The kinds that can run beside an FFN kind, in `order`; the i-th keys its tables at slot i + 1."""
    return tuple(k for k in all_kinds() if k.beside is not None)


def table_key(config: Config, layer_idx: int, side: str | None = None) -> int:
    """The key the rows of a table held at layer `layer_idx` are asked for with: the layer index for its `mlp`,
    `layer_idx + slot * num_hidden_layers` for the side module of kind `side` (slot 1, 2, ... in `beside_kinds`)."""
    if side is None:
        return layer_idx
    slot = 1 + [k.name for k in beside_kinds()].index(side)
    return layer_idx + slot * config.num_hidden_layers


def key_layer(config: Config, key: int) -> int:
    """The layer whose table `key` names (the inverse of `table_key` up to the module)."""
    return key % config.num_hidden_layers


def key_label(config: Config, key: int) -> str:
    """How a table key is shown: "layer 3", or "layer 3 value_embed" for a side module's table."""
    slot = key // config.num_hidden_layers
    side = "" if slot == 0 else f" {beside_kinds()[slot - 1].name}"
    return f"layer {key_layer(config, key)}{side}"


def kind_fields() -> list[Field]:
    """Every kind's config fields, in kind order; a field declared by two kinds must be declared alike. A kind
    that runs beside others adds its layer selection `<kind>_layers` (a layer spec, default "none")."""
    fields: dict[str, Field] = {}
    for kind in all_kinds():
        declared = kind.fields
        if kind.beside is not None:
            help_text = f"layers where {kind.name} runs beside the FFN kind (a layer spec, e.g. first:3,last:3)"
            declared = (*declared, Field(kind.layers_field, "str | list[int]", "none", help_text))
        for f in declared:
            if f.name in fields and fields[f.name] != f:
                raise StemlmError(f"config field {f.name!r} is declared differently by two kinds")
            fields.setdefault(f.name, f)
    return list(fields.values())


def ordered_union(groups) -> tuple[str, ...]:
    return tuple(dict.fromkeys(name for group in groups for name in group))
