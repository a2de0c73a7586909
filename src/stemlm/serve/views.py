"""Second `StemLM` objects over the served model's tensors: a resident view of host tables, and copies for saving.

The playground never writes to the model it serves. Two things still need a model object other than it:

- `resident_view(lm)`: with `--tables host` the served model's tables are meta placeholders (rows come from
  the host provider through the row cache), but editing and analysis read `model.token_tables()` directly.
  On a CPU device the host tables already are in compute memory, so a second module tree that shares the
  backbone and points its tables at the provider's host matrices gives them that, with no copy.
- `editable_copy(model, layers, rows)`: a global edit writes rows in place. To save one without racing the
  requests that read the served model (copy-on-save), the edit goes into a module tree whose edited tables
  are clones and whose every other tensor is shared: the extra memory is the edited tables only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from stemlm.edit.positional import rows_to_parts, table_layers
from stemlm.errors import StemlmError
from stemlm.inference.offloaded import OffloadedLM
from stemlm.model.decoder import StemLM
from stemlm.offload.compact import CompactProvider
from stemlm.offload.families import table_families
from stemlm.offload.providers import HostProvider, table_parameter_names

EMBED_NAME = "model.embed_tokens.weight"


def _device(model: StemLM) -> torch.device:
    return next(p.device for p in model.parameters() if not p.is_meta)


def shared_copy(model: StemLM, replace: dict[str, torch.Tensor]) -> StemLM:
    """A new StemLM whose parameters are `model`'s own tensors, except the names in `replace`."""
    state = {**model.state_dict(keep_vars=True), **replace}
    with torch.device("meta"):
        copy = StemLM(model.config)
    copy.load_state_dict(state, strict=False, assign=True)
    copy.tie_weights()  # a replaced embedding must also be the copy's lm_head when tied
    copy.reset_buffers(_device(model))
    return copy.eval()


def resident_view(lm: OffloadedLM) -> StemLM:
    """The offloaded model with its tables read straight from the host providers (CPU device only): token
    tables, and the n-gram tables (shared or per layer) and memory values of the lookup kinds."""
    providers = lm.providers
    stores = list(providers.all().values())
    if not stores or not all(isinstance(p, (HostProvider, CompactProvider)) for p in stores):
        raise StemlmError(
            f"editing and analysis read the tables directly, which needs host tables, not "
            f"{lm.placement.name if stores else 'none'}; serve with --tables host or resident to edit"
        )
    if _device(lm.model).type != "cpu":
        raise StemlmError(
            "editing and analysis read the tables directly; with --tables host that needs --device cpu "
            "(or serve with --tables resident)"
        )
    if any(not isinstance(p, HostProvider) for p in providers.all().values()):
        raise StemlmError(
            "editing and analysis read the tables directly, which the compact (--table-dtype bf16/int8) host "
            "tables do not allow; serve with --table-dtype fp32 or --tables resident to edit"
        )
    families = table_families(lm.model)
    tables = {}
    for layer, name in families.get("token", {}).items():
        tables[name] = _host_table(providers.token, layer)
    for layer, name in families.get("ngram", {}).items():
        # Per-layer hashing (engram_variant=reference) keeps one store per layer; shared ids keep one for all.
        own = providers.ngram_layers.get(layer)
        tables[name] = _host_table(own if own is not None else providers.ngram, layer)
    for layer, name in families.get("memory", {}).items():
        tables[name] = _host_table(providers.memory[layer], layer)
    return shared_copy(lm.model, tables)


def _host_table(provider, layer: int) -> torch.Tensor:
    if provider.layout == "token":
        offset, width = provider.layer_slices[layer]
        return provider.matrix[:, offset : offset + width]  # a strided view, no copy
    return provider.tables[provider.layers.index(layer)]


def editable_copy(model: StemLM, layers: Sequence[int] | None, rows: str) -> StemLM:
    """A copy of `model` whose tables (and embedding, for row kinds with it) that `rows`/`layers` name are
    private clones, so a global edit may be written into it while `model` keeps serving."""
    stem, embed = rows_to_parts(rows)
    names = table_parameter_names(model)
    chosen = [names[i] for i in table_layers(model, layers)] if stem else []
    if embed:
        chosen.append(EMBED_NAME)
    state = model.state_dict(keep_vars=True)
    return shared_copy(model, {name: state[name].detach().clone() for name in chosen})
