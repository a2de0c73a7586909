"""The playground's Edit panel: a positional edit per request, before/after outputs, and saving a global edit.

An edit names its source either as entity text (every occurrence in the prompt, `stemlm.edit.make_edit`) or
as a token span [start, end) picked by clicking tokens in the page; the span form builds the same
`PositionalEdit` for exactly those positions (the adapter below). `compare` runs the prompt unedited and
edited: the top-k next-token probabilities of each (with the other side's probability of the same token)
and a continuation of each sampled with the same settings and seed, so the only difference is the edit.
Edits act through the model's row hooks, per call: the served model is never written to.

`save_global_edit` writes the edit as a global one into `views.editable_copy` of the model (copy-on-save:
only the edited tables are cloned) and saves that as a new checkpoint with `TableEditor.save`, under the
CLI's policy (`stemlm.edit.shared_tokens.check_shared_subwords`): an edit whose changed tokens other words
share is refused, before anything is written, unless the request sets `allow_shared_subwords`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from stemlm.edit import DEFAULT_PAD, PositionalEdit, TableEditor, align, entity_ids, make_edit
from stemlm.edit.positional import edit_hooks, rows_to_parts, table_layers
from stemlm.edit.shared_tokens import check_shared_subwords
from stemlm.edit.spans import GLOBAL_DEFAULT_PAD, tokenizer_eot
from stemlm.errors import StemlmError
from stemlm.inference.engine import Engine
from stemlm.inference.inference_model import InferenceModel
from stemlm.inference.requests import Request
from stemlm.inference.sampling import SamplingParams
from stemlm.model.decoder import StemLM
from stemlm.model.ffn import Rows
from stemlm.serve.views import editable_copy


@dataclass(frozen=True)
class EditSpec:
    target: str
    source: str | None = None  # entity text: every occurrence in the prompt
    span: tuple[int, int] | None = None  # or token positions [start, end) picked in the page
    strategy: str = "auto"
    pad: str | None = None  # None: the editing module's default (positional and global edits differ)
    layers: tuple[int, ...] | None = None  # STEM layers whose rows are swapped; None = all
    rows: str = "tables"  # tables | embed | both (stemlm.choices.EDIT_ROWS)


def span_edit(model: StemLM, tokenizer: Tokenizer, ids: Sequence[int], spec: EditSpec) -> PositionalEdit:
    """The edit of exactly the positions `spec.span` (a span picked by hand, not searched for by name)."""
    start, end = spec.span
    if not 0 <= start < end <= len(ids):
        raise StemlmError(f"span [{start}, {end}) is not a token range of the {len(ids)}-token prompt; pick again")
    stem, embed = rows_to_parts(spec.rows)
    layers = table_layers(model, spec.layers) if stem else ()
    source = tuple(int(i) for i in ids[start:end])
    # A span whose first token carries the leading space (" Spain") takes the target in its spaced form too.
    spaced = tokenizer.decode([source[0]]).startswith(" ")
    target = entity_ids(tokenizer, spec.target, spaced=spaced, vocab_size=model.config.vocab_size)
    plan = align(len(source), target, spec.strategy, spec.pad or DEFAULT_PAD, tokenizer_eot(tokenizer))
    return PositionalEdit(tuple(range(start, end)), source, plan, layers, embed)


def build_edit(model: StemLM, tokenizer: Tokenizer, ids: Sequence[int], spec: EditSpec) -> PositionalEdit:
    if spec.source is not None and spec.source.strip() == spec.target.strip():
        raise StemlmError(f"source and target are both {spec.target.strip()!r}: the edit would change nothing")
    if spec.layers is not None and not spec.layers and spec.rows != "embed":
        raise StemlmError("no STEM layer chosen: tick at least one layer (or swap embedding rows only)")
    if spec.span is not None:
        return span_edit(model, tokenizer, ids, spec)
    if spec.source is None:
        raise StemlmError("no source: type the source entity or click its tokens in the prompt")
    return make_edit(
        model,
        tokenizer,
        ids,
        spec.source,
        spec.target,
        strategy=spec.strategy,
        pad=spec.pad or DEFAULT_PAD,
        layers=spec.layers,
        rows=spec.rows,
    )


def _top(probs: torch.Tensor, other: torch.Tensor, k: int, tokenizer: Tokenizer) -> list[dict]:
    values, indices = torch.topk(probs, min(k, probs.numel()))
    return [
        {"id": int(i), "token": tokenizer.decode([int(i)]), "prob": float(p), "other_prob": float(other[i])}
        for p, i in zip(values, indices, strict=True)
    ]


def _continuation(model: InferenceModel, ids, rows: Rows | None, tokenizer: Tokenizer, params: SamplingParams) -> dict:
    # The edit is applied at prefill only: decode steps read the edited prompt from the KV cache.
    new = Engine(model).generate(Request(ids, params, edit_rows=rows))
    return {"ids": new, "text": tokenizer.decode(new)}


@torch.no_grad()
def compare(
    model: InferenceModel,
    tokenizer: Tokenizer,
    ids: Sequence[int],
    edit: PositionalEdit,
    *,
    top_k: int,
    params: SamplingParams,
) -> dict:
    """Unedited and edited: top-k next-token probabilities and a continuation (sampled with `params`, the same
    seed), side by side. `model`: the view of the served model whose tables the edit reads, as served."""
    batch = torch.tensor([list(ids)], device=model.device)
    rows = edit_hooks(model.module, edit)
    before = model(batch).logits[0, -1].float().softmax(-1)
    after = model(batch, rows=rows).logits[0, -1].float().softmax(-1)
    return {
        "positions": list(edit.positions),
        "layers": list(edit.layers),
        "embed": edit.embed,
        "before": {
            "top": _top(before, after, top_k, tokenizer),
            **_continuation(model, ids, None, tokenizer, params),
        },
        "after": {
            "top": _top(after, before, top_k, tokenizer),
            **_continuation(model, ids, rows or None, tokenizer, params),
        },
        "max_abs_prob_change": float((after - before).abs().max()),
    }


def source_text(tokenizer: Tokenizer, ids: Sequence[int], spec: EditSpec) -> str:
    """The source entity of a global edit: the typed text, or the text of the picked span."""
    if spec.span is not None:
        start, end = spec.span
        if not 0 <= start < end <= len(ids):
            raise StemlmError(f"span [{start}, {end}) is not a token range of the {len(ids)}-token prompt")
        return tokenizer.decode(list(ids[start:end])).strip()
    if spec.source is None:
        raise StemlmError("no source: type the source entity or click its tokens in the prompt")
    return spec.source


ALLOW_SHARED_HINT = "confirm to save anyway (allow_shared_subwords: true), or keep the edit positional (Apply edit)"


def save_global_edit(
    model: StemLM, tokenizer: Tokenizer, source: str, spec: EditSpec, directory: Path, *, allow_shared: bool = False
) -> dict:
    """Write ` source` -> ` target` as a global edit into a private copy of the model; save it to `directory`
    unless other words share its changed tokens and `allow_shared` is off (`SharedSubwords`, nothing written)."""
    if spec.layers is not None and not spec.layers and spec.rows != "embed":
        raise StemlmError("no STEM layer chosen: tick at least one layer (or swap embedding rows only)")
    copy = editable_copy(model, spec.layers, spec.rows)
    editor = TableEditor(copy, tokenizer)
    pad = spec.pad or GLOBAL_DEFAULT_PAD
    record = editor.edit(source, spec.target, strategy=spec.strategy, pad=pad, layers=spec.layers, rows=spec.rows)
    check_shared_subwords(record.description, allow_shared, ALLOW_SHARED_HINT)
    editor.save(directory)
    return record.description
