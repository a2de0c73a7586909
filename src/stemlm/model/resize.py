"""Changing a built model's vocabulary size: every table, map and hash that `vocab_size` shapes follows it.

    resize_vocabulary(model, 128)        # model.config.vocab_size is 128 afterwards

What depends on `vocab_size` is read from the kinds themselves, not listed here: a layer's module is rebuilt from
the new config whenever one of its parameters or buffers changes shape (STEM / PLE / value tables [V, width],
n-gram tables sized by the next prime >= V, the hash-MoE id -> expert map), and keeps every other parameter
object as it is. A resized parameter keeps its first min(old, new) rows; added rows are drawn as the kind
initialises that parameter (`StemLM.init_specs`: `table_init` for token tables, a module's `init_stds`, ...).
`embed_tokens` and `lm_head` are resized the same way unless the caller already did (Hugging Face's
`resize_token_embeddings` resizes those two itself, with its mean-resizing) and stay tied when the config ties them.

Kinds whose ids are hashed (n-gram keys, hash-MoE routing) hash for the new vocabulary: their rows and experts
are kept but old tokens may meet other rows or experts, so such a model needs training after a resize (warned).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from stemlm.errors import StemlmError
from stemlm.model.decoder import StemLM, layer_modules
from stemlm.model.kinds.registry import Uniform, fill_value
from stemlm.model.ngram import ngram_hasher


def _state_shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    tensors = [*module.named_parameters(recurse=True), *module.named_buffers(recurse=True)]
    return {name: tuple(t.shape) for name, t in tensors}


def _resized(old: torch.Tensor, rows: int) -> torch.Tensor:
    """A [rows, ...] copy of `old` whose first min(old, rows) rows are old's; the rest are uninitialised."""
    new = torch.empty((rows, *old.shape[1:]), dtype=old.dtype, device=old.device)
    keep = min(rows, old.shape[0])
    new[:keep] = old[:keep]
    return new


def _rebuild(old: nn.Module, build, config, layer_idx: int) -> tuple[nn.Module, list[tuple[nn.Parameter, int]]]:
    """The module `build(config, layer_idx)` holding old's parameters (row-resized where the shape changed) and
    its own fresh buffers, in old's train/eval mode; also each grown parameter with its old row count (the caller
    initialises the added rows)."""
    with torch.device("meta"):
        new = build(config, layer_idx)
    device = next(old.parameters()).device
    new.to_empty(device=device).train(old.training)
    if hasattr(new, "reset_buffers"):
        new.reset_buffers(device)
    old_params = dict(old.named_parameters())
    grown = []
    for name, param in list(new.named_parameters()):
        source = old_params.get(name)
        if source is None:
            raise StemlmError(f"resizing layer {layer_idx}: the rebuilt module has a new parameter {name!r}")
        owner_name, _, attr = name.rpartition(".")
        owner = new.get_submodule(owner_name) if owner_name else new
        if source.shape == param.shape:
            setattr(owner, attr, source)
            continue
        if source.shape[1:] != param.shape[1:]:
            raise StemlmError(
                f"resizing layer {layer_idx}: {name} changes from {list(source.shape)} to {list(param.shape)}, "
                "not along its rows"
            )
        resized = nn.Parameter(_resized(source.detach(), param.shape[0]), requires_grad=source.requires_grad)
        setattr(owner, attr, resized)
        if resized.shape[0] > source.shape[0]:
            grown.append((resized, source.shape[0]))
    return new, grown


def _resize_module_rows(module: nn.Module, attr: str, rows: int, grown: list) -> None:
    param = getattr(module, attr)
    if param.shape[0] == rows:
        return
    resized = nn.Parameter(_resized(param.detach(), rows), requires_grad=param.requires_grad)
    setattr(module, attr, resized)
    if rows > param.shape[0]:
        grown.append((resized, param.shape[0]))


@torch.no_grad()
def resize_vocabulary(model: StemLM, vocab_size: int) -> StemLM:
    """Resize `model` in place to `vocab_size` token ids (see the module docstring); returns it."""
    old = model.config
    if vocab_size == old.vocab_size and model.model.embed_tokens.num_embeddings == vocab_size:
        return model
    config = old.replace(vocab_size=vocab_size)  # validates the new size with ModelConfig's checks
    grown: list[tuple[nn.Parameter, int]] = []
    hashed = set()
    for i, layer in enumerate(model.model.layers):
        for kind, side, module in list(layer_modules(config, layer, i)):  # its FFN module and side modules
            build = kind.build if side is None else kind.beside.build
            with torch.device("meta"):
                probe = build(config, i)
            if _state_shapes(probe) != _state_shapes(module):
                rebuilt, resized = _rebuild(module, build, config, i)
                layer.set_kind_module(side, rebuilt)
                grown += resized
            if kind.ngram is not None or kind.routes_by_id:
                hashed.add(kind.name)
    for i, layer in enumerate(model.model.layers):  # tables shared across layers: point at the owner's new table
        for kind, side, module in layer_modules(config, layer, i):
            for table in kind.tables:
                owner = table.owner_of(config, i)
                if owner != i:
                    held = model.model.layers[owner].kind_module(side)
                    object.__setattr__(module, table.attr, getattr(held, table.attr))
    embed = model.model.embed_tokens
    if embed.num_embeddings != vocab_size:
        _resize_module_rows(embed, "weight", vocab_size, grown)
        embed.num_embeddings = vocab_size
    if model.lm_head.out_features != vocab_size and not config.tie_word_embeddings:
        _resize_module_rows(model.lm_head, "weight", vocab_size, grown)
    model.lm_head.out_features = vocab_size
    model.config = config
    model.ngram_hasher = ngram_hasher(config)
    model.tie_weights()
    stds = {id(param): std for _, param, std in model.init_specs()}
    for param, start in grown:
        if id(param) not in stds:  # a tied lm_head, initialised as the embedding it is
            continue
        std = stds[id(param)]
        rows = param[start:]
        if (fill := fill_value(std)) is not None:
            rows.fill_(fill)
        elif isinstance(std, Uniform):
            rows.uniform_(-std.bound, std.bound)
        else:
            rows.normal_(0.0, std)
    if hashed:
        warnings.warn(
            f"ffn={','.join(sorted(hashed))} hashes token ids for the vocabulary size: after the resize old tokens "
            "may meet other n-gram rows or experts, so train the model again",
            stacklevel=2,
        )
    return model
