"""Positional edits: swap the rows used at an entity's positions in one prompt, per call, model untouched.

A `PositionalEdit` names prompt positions, the source id expected at each, the rows to use there (a
`RowPlan`, see `stemlm.edit.spans`), the STEM layers whose table rows are swapped and whether the token
embedding rows are swapped too. It acts only through the model's `rows={"token": ...}` / `embed_rows` hooks, so the
shared model is never modified and concurrent requests can carry different edits.

    edit = make_edit(model, tok, prompt_ids, "Spain", "Germany")            # STEM rows, every STEM layer
    logits = edited_forward(model, ids, edit).logits                        # the function form
    with positional_edit(model, edit) as edited:                            # the context-manager form
        logits = edited(ids).logits
        new_ids = edited.generate(prompt_ids, max_new_tokens=8)             # KV cache: edit at prefill

With a KV cache the rows are substituted at prefill; later tokens read the edited keys and values from the
cache, so the effect persists through decoding (decode steps run without hooks). A hook applied to a
sequence that does not hold the source ids at the edited positions raises instead of editing the wrong
tokens, which is what would happen if it were passed to a decode step.

Edits act on the tables of the `token` family (stemlm.model.kinds.registry), whichever kind owns them; a kind
whose edits leave something unchanged says so in `Kind.edit_note` (`edit_note(model)`): `stem_ngram` models
swap the token rows U_l[t] only, the hashed n-gram rows of the edited positions stay those of the original ids.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer

from stemlm.choices import EDIT_ROWS, edit_row_kind
from stemlm.edit.spans import DEFAULT_PAD, RowPlan, align, entity_ids, locate, tokenizer_eot
from stemlm.errors import StemlmError
from stemlm.model.decoder import ModelOutput, StemLM
from stemlm.model.ffn import EMBED, EmbedRows, Rows, TableRows
from stemlm.model.kinds.registry import get_kind, key_layer

Hooks = Rows | None  # the forward's rows= mapping of an edit ("token" and / or "embed"); None: no edit


def edit_note(model: StemLM) -> str | None:
    """What a row edit of this model leaves unchanged (`Kind.edit_note`), or None."""
    return get_kind(model.config.ffn).edit_note if model.config.special_layers else None


@dataclass(frozen=True)
class PositionalEdit:
    positions: tuple[int, ...]  # prompt positions whose rows are replaced
    source_ids: tuple[int, ...]  # the token id expected at each of them
    plan: RowPlan  # what each position gets (target ids to average, () zero, None its own row)
    layers: tuple[int, ...]  # table layers whose rows are swapped (may be empty)
    embed: bool  # also swap the token-embedding rows


def table_layers(model: StemLM, layers: Sequence[int] | None) -> tuple[int, ...]:
    """The table keys (`StemLM.tables`) of the chosen layers' token tables, every one when None: a layer's own
    table and those of its side modules (value embeddings beside STEM), with a clear error for a model or a
    layer without one."""
    tables = model.token_tables()
    if not tables:
        raise StemlmError(
            f"this model has no STEM tables (ffn={model.config.ffn}); STEM row edits need a STEM checkpoint "
            "(embedding-row edits work on any model)"
        )
    if layers is None:
        return tuple(sorted(tables))
    layer_of = {key: key_layer(model.config, key) for key in tables}
    have = sorted(set(layer_of.values()))
    for i in layers:
        if i not in have:
            raise StemlmError(f"layer {i} is not a STEM layer; STEM layers: {', '.join(map(str, have))}")
    return tuple(sorted(key for key, layer in layer_of.items() if layer in layers))


def rows_to_parts(rows: str) -> tuple[bool, bool]:
    """(swap token-table rows, swap embedding rows) for a row kind."""
    rows = edit_row_kind(rows)
    if rows not in EDIT_ROWS:
        raise StemlmError(f"unknown row kind {rows!r}; choose one of {', '.join(EDIT_ROWS)}")
    return rows in ("tables", "both"), rows in ("embed", "both")


def make_edit(
    model: StemLM,
    tokenizer: Tokenizer,
    prompt_ids: Sequence[int],
    source: str,
    target: str,
    *,
    strategy: str = "auto",
    pad: str = DEFAULT_PAD,
    layers: Sequence[int] | None = None,
    rows: str = "tables",
) -> PositionalEdit:
    """An edit giving every occurrence of `source` in the prompt the rows of `target`."""
    stem, embed = rows_to_parts(rows)
    chosen = table_layers(model, layers) if stem else ()
    vocab = model.config.vocab_size
    positions, source_ids, plan = [], [], []
    for span in locate(tokenizer, prompt_ids, source, vocab):
        target_ids = entity_ids(tokenizer, target, spaced=span.spaced, vocab_size=vocab)
        plan += align(len(span.ids), target_ids, strategy, pad, tokenizer_eot(tokenizer))
        positions += span.positions
        source_ids += span.ids
    return PositionalEdit(tuple(positions), tuple(source_ids), tuple(plan), chosen, embed)


def replacement_rows(weight: torch.Tensor, source_ids: Sequence[int], plan: RowPlan) -> torch.Tensor:
    """[len(plan), width]: each position's new row from `weight` (a table or the embedding matrix)."""
    out = []
    for own, choice in zip(source_ids, plan, strict=True):
        if choice is None:
            out.append(weight[own])
        elif len(choice) == 0:
            out.append(torch.zeros_like(weight[0]))
        elif len(choice) == 1:
            out.append(weight[choice[0]])  # exactly the target's row, no float round trip
        else:
            out.append(weight[list(choice)].float().mean(0).to(weight.dtype))
    return torch.stack(out)


def _check_applies(edit: PositionalEdit, input_ids: torch.Tensor) -> torch.Tensor:
    positions = torch.tensor(edit.positions, device=input_ids.device)
    expected = torch.tensor(edit.source_ids, device=input_ids.device)
    if input_ids.shape[1] <= int(positions.max()) or not bool((input_ids[:, positions] == expected).all()):
        raise StemlmError(
            "positional edit applied to a sequence without the source tokens at the edited positions; "
            "apply it to the prompt (the prefill), not to decode steps or another text"
        )
    return positions


def _substitute(base: torch.Tensor, positions: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    out = base.clone()
    out[:, positions] = new.to(base.dtype)
    return out


def table_rows_hook(model: StemLM, edit: PositionalEdit) -> TableRows | None:
    """The `token` row provider of the edit (None when it swaps no STEM rows)."""
    if not edit.layers:
        return None
    tables = model.token_tables()

    def rows(layer_idx: int, input_ids: torch.Tensor) -> torch.Tensor:
        base = tables[layer_idx](input_ids)
        if layer_idx not in edit.layers:
            return base
        positions = _check_applies(edit, input_ids)
        return _substitute(base, positions, replacement_rows(tables[layer_idx].weight, edit.source_ids, edit.plan))

    return rows


def embed_rows_hook(model: StemLM, edit: PositionalEdit) -> EmbedRows | None:
    """The `embed_rows` callable of the edit (None when it leaves the embeddings alone)."""
    if not edit.embed:
        return None
    embed = model.model.embed_tokens

    def rows(input_ids: torch.Tensor) -> torch.Tensor:
        positions = _check_applies(edit, input_ids)
        return _substitute(embed(input_ids), positions, replacement_rows(embed.weight, edit.source_ids, edit.plan))

    return rows


def batch_hooks(model: StemLM, edits: Sequence[PositionalEdit | None]) -> Hooks:
    """Hooks for a batch whose row b carries its own edit `edits[b]` (None: unedited), e.g. different
    prompts scored in one forward; each row is checked and substituted exactly as a single edit would be."""
    tables = model.token_tables()

    def apply(b_rows: torch.Tensor, input_ids: torch.Tensor, weight_of, wanted) -> torch.Tensor:
        if input_ids.shape[0] != len(edits):
            raise StemlmError(f"batch of {input_ids.shape[0]} rows but {len(edits)} edits; give one per row")
        out = None
        for b, edit in enumerate(edits):
            if edit is None or not wanted(edit):
                continue
            out = b_rows.clone() if out is None else out
            positions = _check_applies(edit, input_ids[b : b + 1])
            out[b, positions] = replacement_rows(weight_of(), edit.source_ids, edit.plan).to(out.dtype)
        return b_rows if out is None else out

    def table_rows(layer_idx: int, input_ids: torch.Tensor) -> torch.Tensor:
        table = tables[layer_idx]
        return apply(table(input_ids), input_ids, lambda: table.weight, lambda e: layer_idx in e.layers)

    def embed_rows(input_ids: torch.Tensor) -> torch.Tensor:
        embed = model.model.embed_tokens
        return apply(embed(input_ids), input_ids, lambda: embed.weight, lambda e: e.embed)

    real = [e for e in edits if e is not None]
    tables_edited, embeddings_edited = any(e.layers for e in real), any(e.embed for e in real)
    return hooks_of(table_rows if tables_edited else None, embed_rows if embeddings_edited else None)


def token_rows(provider: TableRows | None) -> Rows | None:
    """The forward's `rows=` mapping of a `token` row provider (None: no mapping)."""
    return None if provider is None else {"token": provider}


def hooks_of(table_rows: TableRows | None, embed_rows: EmbedRows | None) -> Hooks:
    """The forward's `rows=` mapping of a token-table provider and an input-embedding provider (None: neither)."""
    rows = {family: p for family, p in (("token", table_rows), (EMBED, embed_rows)) if p is not None}
    return rows or None


def edited_forward(model: StemLM, input_ids: torch.Tensor, edit: PositionalEdit | None, **kwargs) -> ModelOutput:
    """`model(input_ids, **kwargs)` with the edit's rows at its positions (no edit: a plain forward)."""
    return model(input_ids, rows=edit_hooks(model, edit), **kwargs)


def greedy_generate(
    model: StemLM,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    *,
    prefill: Hooks = None,
    decode: Hooks = None,
    eos_id: int | None = None,
) -> list[int]:
    """Greedy continuation with a KV cache (the decoding engine): `decode` hooks on every forward, `prefill` hooks
    over them on the prompt's (a positional edit uses prefill only; a global edit, which applies to every
    occurrence, uses both)."""
    from stemlm.inference.generate import generate

    return generate(model, prompt_ids, max_new_tokens, greedy=True, eos_id=eos_id, rows=decode, prefill_rows=prefill)


def edit_hooks(model: StemLM, edit: PositionalEdit | None) -> Hooks:
    if edit is None:
        return None
    return hooks_of(table_rows_hook(model, edit), embed_rows_hook(model, edit))


def generate_edited(
    model: StemLM,
    prompt_ids: Sequence[int],
    edit: PositionalEdit | None,
    max_new_tokens: int,
    eos_id: int | None = None,
) -> list[int]:
    """Greedy continuation of the prompt with the edit applied at prefill; decoding reads it from the KV cache."""
    return greedy_generate(model, prompt_ids, max_new_tokens, prefill=edit_hooks(model, edit), eos_id=eos_id)


class EditedModel:
    """A per-call view of a model with one positional edit; the model itself is shared and never modified."""

    def __init__(self, model: StemLM, edit: PositionalEdit | None) -> None:
        self.model, self.edit = model, edit

    def __call__(self, input_ids: torch.Tensor, **kwargs) -> ModelOutput:
        return edited_forward(self.model, input_ids, self.edit, **kwargs)

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, eos_id: int | None = None) -> list[int]:
        return generate_edited(self.model, prompt_ids, self.edit, max_new_tokens, eos_id)


@contextmanager
def positional_edit(model: StemLM, edit: PositionalEdit | None) -> Iterator[EditedModel]:
    """`with positional_edit(model, edit) as edited:` calls through `edited` carry the edit; nothing to undo."""
    yield EditedModel(model, edit)
