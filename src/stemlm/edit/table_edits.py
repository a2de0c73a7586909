"""Global edits and knowledge injection: table rows rewritten in place, reversibly, and saved as a checkpoint.

A global edit gives the source entity's token ids the target's rows everywhere (every text, no span), in the
chosen STEM layers and optionally the token embedding. Every write returns an `UndoRecord` holding the exact
rows it overwrote; undoing records in reverse order restores the tables bit for bit, so edits compose:

    editor = TableEditor(model, tokenizer)
    editor.edit("Spain", "Germany")                  # " Spain" now reads Germany's rows in every STEM layer
    editor.inject("Zorbia", "France")                # a new token (added to the tokenizer if the vocab has room)
    editor.save("runs/edited")                       # a normal checkpoint + edits.json describing the edits
    editor.undo_all()                                # tables exactly as before

Caveat of global edits: a token id shared with other names (" United" in " United Kingdom" and " United
States") changes for all of them; a tokenizer that keeps entity names whole avoids this (see the
knowledge experiment). Each record's description therefore lists `changed_tokens`: every token whose rows
it rewrote and the other words containing it (`stemlm.edit.shared_tokens`), saved with it in edits.json.
With tied embeddings an embedding-row edit also moves the lm_head row of the token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer

from stemlm.checkpoint.folder import AtomicFolder, write_json, write_model_files
from stemlm.edit.positional import Hooks, hooks_of, replacement_rows, rows_to_parts, table_layers
from stemlm.edit.shared_tokens import changed_token_ids, describe_shared
from stemlm.edit.spans import GLOBAL_DEFAULT_PAD, RowPlan, align, entity_ids, tokenizer_eot
from stemlm.errors import StemlmError
from stemlm.model.decoder import StemLM
from stemlm.model.kinds.registry import key_label

EDIT_PRODUCER = "stemlm edit --save"  # names an edit save in its manifest
EDITS_NAME = "edits.json"


@dataclass
class UndoRecord:
    """The rows one global edit overwrote: (parameter, ids, old rows) per touched matrix, plus a description."""

    writes: list[tuple[torch.nn.Parameter, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    description: dict = field(default_factory=dict)


def _targets(model: StemLM, layers: Sequence[int] | None, rows: str) -> list[tuple[str, torch.nn.Parameter]]:
    stem, embed = rows_to_parts(rows)
    keys = table_layers(model, layers) if stem else ()
    named = [(key_label(model.config, key), model.token_tables()[key].weight) for key in keys]
    if embed:
        named.append(("embed_tokens", model.model.embed_tokens.weight))
    return named


@torch.no_grad()
def apply_global_edit(
    model: StemLM,
    source_ids: Sequence[int],
    plan: RowPlan,
    *,
    layers: Sequence[int] | None = None,
    rows: str = "tables",
    description: dict | None = None,
) -> UndoRecord:
    """Write the plan's rows over the source ids' rows; every new row is computed before any is written,
    so a plan may read rows it also overwrites (a swap)."""
    if len(source_ids) != len(plan):
        raise StemlmError(f"plan has {len(plan)} entries for {len(source_ids)} source tokens")
    if len(set(source_ids)) != len(source_ids):
        raise StemlmError(f"source ids {list(source_ids)} repeat a token; a global edit needs distinct source tokens")
    record = UndoRecord(description=dict(description or {}))
    staged = []
    for _, weight in _targets(model, layers, rows):
        ids = torch.tensor(source_ids, dtype=torch.long, device=weight.device)
        staged.append((weight, ids, replacement_rows(weight, source_ids, plan)))
    for weight, ids, new in staged:
        record.writes.append((weight, ids, weight[ids].clone()))
        weight[ids] = new
    return record


def global_edit_hooks(
    model: StemLM,
    source_ids: Sequence[int],
    plan: RowPlan,
    *,
    layers: Sequence[int] | None = None,
    rows: str = "tables",
) -> Hooks:
    """The same global edit as a per-call `rows=` mapping (token tables, input embeddings): every occurrence of a
    source id reads its new row, the model is untouched. Used to evaluate global edits without writing the tables."""
    stem, embed = rows_to_parts(rows)
    chosen = table_layers(model, layers) if stem else ()
    tables = model.token_tables()

    def swap(weight: torch.Tensor, input_ids: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        new, out = replacement_rows(weight, source_ids, plan).to(base.dtype), base.clone()
        for k, source_id in enumerate(source_ids):
            out[input_ids == source_id] = new[k]
        return out

    def table_rows(layer_idx: int, input_ids: torch.Tensor) -> torch.Tensor:
        base = tables[layer_idx](input_ids)
        return swap(tables[layer_idx].weight, input_ids, base) if layer_idx in chosen else base

    def embed_rows(input_ids: torch.Tensor) -> torch.Tensor:
        weight = model.model.embed_tokens.weight
        return swap(weight, input_ids, model.model.embed_tokens(input_ids))

    return hooks_of(table_rows if chosen else None, embed_rows if embed else None)


@torch.no_grad()
def undo(record: UndoRecord) -> None:
    """Put back the rows `record` overwrote (undo records newest first when edits overlap)."""
    for weight, ids, old in reversed(record.writes):
        weight[ids] = old


def new_token_id(model: StemLM, tokenizer: Tokenizer, token: str) -> tuple[int, bool]:
    """(id of ` token`, whether it was added): an existing single token is reused; otherwise the token is
    added to the tokenizer when the model's vocabulary has an unused row for it."""
    text = " " + token.strip()
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    if len(ids) == 1:
        return ids[0], False
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size >= model.config.vocab_size:
        raise StemlmError(
            f"{token!r} is {len(ids)} tokens and the model's vocabulary ({model.config.vocab_size}) has no unused row "
            "to add it as one; inject into an existing rare single token instead"
        )
    tokenizer.add_tokens([AddedToken(text, normalized=False, single_word=True)])
    new_id = tokenizer.token_to_id(text)
    if new_id is None or new_id >= model.config.vocab_size:
        raise StemlmError(f"could not add {token!r} to the tokenizer within the model's vocabulary")
    return new_id, True


class TableEditor:
    """Global edits and injections on one model, kept on an undo stack, savable as a new checkpoint."""

    def __init__(self, model: StemLM, tokenizer: Tokenizer) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.records: list[UndoRecord] = []

    def edit(
        self,
        source: str,
        target: str,
        *,
        strategy: str = "auto",
        pad: str = GLOBAL_DEFAULT_PAD,
        layers: Sequence[int] | None = None,
        rows: str = "tables",
    ) -> UndoRecord:
        """Give ` source` the rows of ` target` (spaced forms: how the names read inside a text)."""
        vocab = self.model.config.vocab_size
        source_ids = entity_ids(self.tokenizer, source, vocab_size=vocab)
        target_ids = entity_ids(self.tokenizer, target, vocab_size=vocab)
        plan = align(len(source_ids), target_ids, strategy, pad, tokenizer_eot(self.tokenizer))
        info = dict(
            kind="edit",
            source=source,
            target=target,
            strategy=strategy,
            pad=pad,
            rows=rows,
            layers=list(layers) if layers is not None else "all",
            source_ids=source_ids,
            target_ids=target_ids,
            changed_tokens=describe_shared(self.tokenizer, changed_token_ids(source_ids, plan), source),
        )
        return self._push(apply_global_edit(self.model, source_ids, plan, layers=layers, rows=rows, description=info))

    def inject(
        self,
        token: str,
        target: str,
        *,
        strategy: str = "auto",
        layers: Sequence[int] | None = None,
        rows: str = "both",
    ) -> UndoRecord:
        """Give a new or rare single token the rows of `target`, so the model treats it as that entity."""
        token_id, added = new_token_id(self.model, self.tokenizer, token)
        target_ids = entity_ids(self.tokenizer, target, vocab_size=self.model.config.vocab_size)
        plan = align(1, target_ids, strategy, GLOBAL_DEFAULT_PAD, tokenizer_eot(self.tokenizer))
        info = dict(
            kind="inject",
            token=token,
            token_id=token_id,
            added_to_tokenizer=added,
            target=target,
            strategy=strategy,
            rows=rows,
            layers=list(layers) if layers is not None else "all",
            target_ids=target_ids,
            changed_tokens=describe_shared(self.tokenizer, [token_id], token),
        )
        return self._push(apply_global_edit(self.model, [token_id], plan, layers=layers, rows=rows, description=info))

    def _push(self, record: UndoRecord) -> UndoRecord:
        self.records.append(record)
        return record

    def undo(self) -> UndoRecord:
        """Revert the newest edit (tokens added to the tokenizer stay; their rows are restored)."""
        if not self.records:
            raise StemlmError("nothing to undo")
        record = self.records.pop()
        undo(record)
        return record

    def undo_all(self) -> None:
        while self.records:
            self.undo()

    def save(self, directory: str | Path, *, force: bool = False, sources: tuple = ()) -> Path:
        """Write the edited model, its tokenizer and `edits.json` (the applied edits, oldest first) atomically.

        An existing non-empty `directory` is refused unless `force` and it holds an earlier edit save;
        `sources` (the edited checkpoint) are never replaced (`stemlm.checkpoint.safe_write.check_target`).
        """
        with AtomicFolder(directory, producer=EDIT_PRODUCER, force=force, sources=sources, flag="--save") as tmp:
            write_model_files(self.model, tmp, self.tokenizer)
            write_json(tmp / EDITS_NAME, {"edits": [r.description for r in self.records]})
        return Path(directory)
