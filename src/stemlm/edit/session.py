"""One edit as `stemlm edit` makes it: positional, global or inject, with the model's output before and after.

`EditOptions` holds the request (source or inject token, target, strategy, padding, layers, row kind, and where
to save a global edit); `run_edit(model, tokenizer, options)` makes the edit and returns the report the command
prints: for each side a greedy completion of the prompt and its top-k next tokens (`next_token_view`), the
changed tokens of a global edit and, with `save`, the saved checkpoint; `render_edit` is its text. A global edit
that also rewrites other words' sub-word tokens is saved only when `allow_shared_subwords` says so
(`stemlm.edit.shared_tokens.check_shared_subwords`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from stemlm.errors import StemlmError

EOT_TOKEN = "<|endoftext|>"
SHOWN_WORDS = 12  # words sharing a changed token, shown per token in text output


@dataclass
class EditOptions:
    target: str  # the entity whose rows are used instead
    source: str | None = None  # the entity in the text whose rows are replaced
    inject: str | None = None  # a new or rare token given the target's rows (global)
    prompt: str | None = None  # the text shown before and after (needed by a positional edit)
    strategy: str = "auto"  # length-mismatch strategy (stemlm.edit.spans.STRATEGIES)
    pad: str | None = None  # row at padded positions; None: the mode's default
    layers: str | None = None  # table layers to edit: a layer spec, or None / "all"
    rows: str | None = None  # stem, embed or both; None: stem (both for inject)
    save: str | None = None  # a global edit saved as a new checkpoint here
    force: bool = False  # let `save` replace an earlier edit save
    allow_shared_subwords: bool = False  # save even when the source's tokens occur in other words
    max_new_tokens: int = 8
    top_k: int = 5

    @classmethod
    def from_args(cls, args) -> EditOptions:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})

    @property
    def positional(self) -> bool:
        return self.save is None and self.inject is None

    def checked(self) -> EditOptions:
        """These options, or a one-line error for a request that cannot be made (before anything is loaded)."""
        from stemlm.edit.spans import check_distinct, check_pad

        if self.inject is None and self.source is None:
            raise StemlmError("pass --source ENTITY (the name in the text) or --inject TOKEN, with --target ENTITY")
        if self.inject is not None and self.source is not None:
            raise StemlmError("--inject and --source are exclusive: inject gives a token rows, --source edits a name")
        if self.top_k < 1 or self.max_new_tokens < 0:
            got = f"got {self.top_k}, {self.max_new_tokens}"
            raise StemlmError(f"--top-k must be >= 1 and --max-new-tokens >= 0 ({got})")
        if self.positional and self.prompt is None:
            raise StemlmError('a positional edit needs --prompt, e.g. --prompt "Country: Spain. Capital:"')
        if self.source is not None:
            check_distinct(self.source, self.target)
        check_pad(self.strategy, self.pad)
        return self


def load_for_edit(ckpt: str):
    """(model, tokenizer) of a CKPT argument; editing needs the tokenizer to find entity names."""
    from stemlm.checkpoint.runs import load_checkpoint

    return load_checkpoint(ckpt, need_tokenizer="editing (finding entity names)")


def save_sources(ckpt: str, save: str | None, force: bool) -> tuple:
    """The folders a save to `save` must never replace (CKPT and what it resolves to), the target checked now,
    before loading; () without a save."""
    if save is None:
        return ()
    from stemlm.checkpoint.runs import resolve_checkpoint
    from stemlm.checkpoint.safe_write import check_target
    from stemlm.edit.table_edits import EDIT_PRODUCER

    sources = (ckpt, resolve_checkpoint(ckpt))
    check_target(save, producer=EDIT_PRODUCER, force=force, sources=sources, flag="--save")
    return sources


def parse_layers(spec: str | None, model) -> list[int] | None:
    """The layers a `--layers` spec names (None, "all": every table layer)."""
    from stemlm.model.config import resolve_layer_spec

    if spec is None or spec.strip().lower() == "all":
        return None
    return resolve_layer_spec(spec, model.config.num_hidden_layers)


def next_token_view(model, tokenizer, prompt_ids, hooks, max_new_tokens: int, top_k: int) -> dict:
    """Greedy completion and the top-k next-token probabilities under `hooks` (applied at prefill)."""
    import torch

    from stemlm.edit.positional import greedy_generate

    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids]), rows=hooks).logits[0, -1]
    probs = logits.float().softmax(-1)
    top = torch.topk(probs, min(top_k, probs.numel()))
    eos = tokenizer.token_to_id(EOT_TOKEN)
    ids = greedy_generate(model, prompt_ids, max_new_tokens, prefill=hooks, eos_id=eos)
    return {
        "completion": tokenizer.decode(ids),
        "top_k": [
            {"token": tokenizer.decode([int(i)]), "id": int(i), "prob": float(p)}
            for p, i in zip(top.values, top.indices, strict=True)
        ],
    }


def run_edit(model, tokenizer, o: EditOptions, sources: tuple = ()) -> dict:
    """Make the edit `o` asks for and return the report (`sources`: folders a save must never replace)."""
    from stemlm.edit.positional import edit_hooks, edit_note, make_edit
    from stemlm.edit.shared_tokens import check_shared_subwords
    from stemlm.edit.spans import DEFAULT_PAD, GLOBAL_DEFAULT_PAD
    from stemlm.edit.table_edits import TableEditor

    layers = parse_layers(o.layers, model)
    rows = o.rows or ("both" if o.inject is not None else "tables")
    pad = o.pad or (DEFAULT_PAD if o.positional else GLOBAL_DEFAULT_PAD)
    report: dict = {
        "mode": "positional" if o.positional else "inject" if o.inject else "global",
        "target": o.target,
        "strategy": o.strategy,
        "pad": pad,
        "rows": rows,
    }
    prompt_ids = tokenizer.encode(o.prompt).ids if o.prompt is not None else None
    if prompt_ids is not None and not prompt_ids:
        raise StemlmError("the prompt encodes to no tokens; pass some text")

    def view(hooks=None) -> dict | None:
        if prompt_ids is None:
            return None
        return next_token_view(model, tokenizer, prompt_ids, hooks, o.max_new_tokens, o.top_k)

    if o.positional:
        edit = make_edit(
            model, tokenizer, prompt_ids, o.source, o.target, strategy=o.strategy, pad=pad, layers=layers, rows=rows
        )
        report.update(source=o.source, positions=list(edit.positions), layers=list(edit.layers))
        before, after = view(), view(edit_hooks(model, edit))
    else:
        before = view()
        editor = TableEditor(model, tokenizer)
        if o.inject is not None:
            record = editor.inject(o.inject, o.target, strategy=o.strategy, layers=layers, rows=rows)
            prompt_ids = tokenizer.encode(o.prompt).ids if o.prompt is not None else None  # new token now
        else:
            record = editor.edit(o.source, o.target, strategy=o.strategy, pad=pad, layers=layers, rows=rows)
        report["edit"] = record.description
        after = view()
        if o.save is not None:
            check_shared_subwords(record.description, o.allow_shared_subwords)
            report["saved"] = str(editor.save(o.save, force=o.force, sources=sources))
    report.update(prompt=o.prompt, before=before, after=after)
    if edit_note(model):
        report["note"] = edit_note(model)
    return report


def render_edit(report: dict) -> str:
    """The text `stemlm edit` prints on stdout for a `run_edit` report (the saved folder and the note go to
    stderr, printed by the command)."""
    edit = report.get("edit") or {}
    what = report.get("source") or edit.get("token") or edit.get("source")
    lines = [
        f"{report['mode']} edit: {what!r} -> rows of {report['target']!r} ({report['rows']}, {report['strategy']})"
    ]
    for name in ("before", "after"):
        view = report[name]
        if view is None:
            continue
        lines.append(f"{name:>6}: {report['prompt']}{view['completion']!r}")
        lines.append("        " + "  ".join(f"{t['token']!r} {t['prob']:.3f}" for t in view["top_k"]))
    for token in edit.get("changed_tokens", []):
        words = token["shared_with"]
        shown = ", ".join(words[:SHOWN_WORDS]) + (
            f", ... ({len(words)} in all; --json lists them)" if len(words) > SHOWN_WORDS else ""
        )
        lines.append(f"rows changed: {token['token']!r} (id {token['id']}); also in: {shown or 'no other word'}")
    return "\n".join(lines)
