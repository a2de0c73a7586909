"""Entities as token spans, and how a source span takes a target entity's rows when their lengths differ.

An entity name inside a prompt usually follows a space ("Country: Spain."), and byte-level BPE folds that
space into the first token, so " Spain" is what appears in the prompt ids; at the very start of a text
("Spain's capital") the name has no leading space. `locate` tries the spaced form first, then the bare
one, and returns the form it found so the target is tokenized the same way.

A `RowPlan` says, for each source position, which rows replace its own: a tuple of target ids whose rows
are averaged (one id: that row exactly), `()` for a zero row, or `None` to keep the source's own row.
`align` builds it from the source length S and the target ids (length T) by one of the paper's strategies:

    one_to_one  S == T: position j gets target token j
    left_pad    S > T:  the target fills the LAST T positions, the first S - T are padding
    right_pad   S > T:  the target fills the FIRST T positions, the rest are padding
    copy        S > T:  target tokens repeated cyclically from the first position
    subset      S < T:  the LAST S target tokens (right-aligned, like left_pad: the final subject position,
                        which is the one the next tokens read the entity from, gets the target's final token)
    average     S < T:  the target split into S contiguous, near-equal groups; each position gets its
                        group's mean row (S == 1: the mean of all target rows)
    auto        one_to_one when S == T, copy when S > T, subset when S < T

Padding (`pad`, for left_pad / right_pad): "eot" uses the row of the `<|endoftext|>` token (an entity-free
row the model sees at every document boundary), "source" keeps the source's own row at padded positions,
"zero" a zero row (for a STEM layer: no FFN output at that position, a state the model never saw).

The defaults come from measurement (`stemlm experiment knowledge`, STEM rows only, four trained STEM models,
57 capital records whose source name is longer than the target's, 73 whose target is longer). Source longer:
copy flipped 0.98 / 0.97 / 0.97 / 0.98 of the facts; left_pad with "eot" 0.98 / 1.00 / 0.47 / 1.00, with
"source" 0.93 / 0.90 / 0.81 / 0.84, with "zero" 0.56 / 0.49 / 0.47 / 0.56; right_pad 0.86 / 0.97 / 0.39
("eot") and 0.39 ("source", fourth model). The third model saw `<|endoftext|>` once in training (its row
kept its init norm, 0.5 against 8.3) and "eot" then behaved exactly like "zero": the EOT row is only as good
as the training made it. Target longer: subset 0.92 / 0.90 / 0.86 / 0.85, average 0.63 / 0.80 / 0.55 / 0.88
(the mean of a few nearly orthogonal rows is short: norm 4.5 against 7.8 for single rows). So `auto` uses
copy and subset (the most robust, and copy needs no pad row), positional padding defaults to "eot" (best
whenever the model was trained on many documents) and global edits to "source" (`GLOBAL_DEFAULT_PAD`):
rewriting a padded token everywhere would also change every other name sharing it (" United" of " United
States").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenizers import Tokenizer

from stemlm.errors import StemlmError

STRATEGIES = ("auto", "one_to_one", "left_pad", "right_pad", "copy", "subset", "average")
PAD_ROWS = ("eot", "source", "zero")
PADDING_STRATEGIES = ("left_pad", "right_pad")  # the strategies that place pad rows (`align`)
DEFAULT_PAD = "eot"  # positional edits (see above)
GLOBAL_DEFAULT_PAD = "source"  # global edits: leaves tokens shared with other names alone
EOT_TOKEN = "<|endoftext|>"

RowChoice = tuple[int, ...] | None  # ids to average; () = zero row; None = keep the source's own row
RowPlan = tuple[RowChoice, ...]


@dataclass(frozen=True)
class Span:
    """Where an entity sits in a prompt: positions [start, end) holding `ids` (tokenized `spaced` or bare)."""

    start: int
    end: int
    ids: tuple[int, ...]
    spaced: bool

    @property
    def positions(self) -> range:
        return range(self.start, self.end)


def entity_ids(tokenizer: Tokenizer, entity: str, *, spaced: bool = True, vocab_size: int | None = None) -> list[int]:
    """The ids of `entity` as it reads inside a text (with a leading space when `spaced`), checked against
    the model's vocabulary."""
    name = entity.strip()
    if not name:
        raise StemlmError("empty entity name: pass the text of the entity, e.g. --source Spain")
    ids = tokenizer.encode((" " if spaced else "") + name, add_special_tokens=False).ids
    if not ids:
        raise StemlmError(f"the tokenizer maps entity {name!r} to no tokens")
    if vocab_size is not None and max(ids) >= vocab_size:
        raise StemlmError(
            f"entity {name!r} tokenizes to id {max(ids)}, beyond the model's vocabulary of {vocab_size}; "
            "this tokenizer does not belong to the model"
        )
    return ids


def find_all(haystack: Sequence[int], needle: Sequence[int]) -> list[int]:
    """Start positions of every (non-overlapping) occurrence of `needle` in `haystack`."""
    n, starts, i = len(needle), [], 0
    while n and i + n <= len(haystack):
        if list(haystack[i : i + n]) == list(needle):
            starts.append(i)
            i += n
        else:
            i += 1
    return starts


def locate(tokenizer: Tokenizer, prompt_ids: Sequence[int], entity: str, vocab_size: int | None = None) -> list[Span]:
    """Every occurrence of `entity` in the prompt ids: the spaced form (" Spain") if it occurs, else the bare one."""
    prompt_ids = [int(i) for i in prompt_ids]
    for spaced in (True, False):
        ids = entity_ids(tokenizer, entity, spaced=spaced, vocab_size=vocab_size)
        starts = find_all(prompt_ids, ids)
        if starts:
            return [Span(s, s + len(ids), tuple(ids), spaced) for s in starts]
    shown = tokenizer.decode(prompt_ids)
    raise StemlmError(
        f"source {entity.strip()!r} does not occur in the prompt {shown!r} as a whole token sequence "
        "(check spelling and case; a name glued to other letters tokenizes differently)"
    )


def check_pad(strategy: str, pad: str | None) -> None:
    """A `--pad` row only with a strategy that pads (`stemlm edit` and `eval edits` alike)."""
    if pad is not None and strategy not in PADDING_STRATEGIES:
        raise StemlmError(f"--pad {pad} applies to --strategy {' or '.join(PADDING_STRATEGIES)}, not {strategy}")


def align(
    source_len: int,
    target_ids: Sequence[int],
    strategy: str = "auto",
    pad: str = DEFAULT_PAD,
    eot_id: int | None = None,
) -> RowPlan:
    """The rows each of `source_len` positions takes from the target (see the module docstring)."""
    if strategy not in STRATEGIES:
        raise StemlmError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")
    if pad not in PAD_ROWS:
        raise StemlmError(f"unknown pad row {pad!r}; choose one of {', '.join(PAD_ROWS)}")
    target = tuple(int(t) for t in target_ids)
    S, T = source_len, len(target)
    if S < 1 or T < 1:
        raise StemlmError(f"source and target need at least one token each (got {S} and {T})")
    if strategy == "auto":
        strategy = "one_to_one" if S == T else "copy" if S > T else "subset"
    if strategy == "one_to_one":
        _need(S == T, strategy, S, T, "equal lengths; use --strategy auto to pick a mismatch strategy")
        return tuple((t,) for t in target)
    if strategy in ("left_pad", "right_pad", "copy"):
        _need(S >= T, strategy, S, T, "a source at least as long as the target; use subset or average")
        if strategy == "copy":
            return tuple((target[j % T],) for j in range(S))
        pads = (_pad_row(pad, eot_id),) * (S - T)
        rows = tuple((t,) for t in target)
        return pads + rows if strategy == "left_pad" else rows + pads
    _need(S <= T, strategy, S, T, "a target at least as long as the source; use left_pad, right_pad or copy")
    if strategy == "subset":
        return tuple((t,) for t in target[T - S :])
    bounds = [round(k * T / S) for k in range(S + 1)]  # contiguous groups whose sizes differ by at most one
    return tuple(target[bounds[k] : bounds[k + 1]] for k in range(S))


def _need(ok: bool, strategy: str, S: int, T: int, what: str) -> None:
    if not ok:
        raise StemlmError(f"strategy {strategy} needs {what} (source has {S} tokens, target {T})")


def _pad_row(pad: str, eot_id: int | None) -> RowChoice:
    if pad == "source":
        return None
    if pad == "zero":
        return ()
    if eot_id is None:
        raise StemlmError(f"pad row 'eot' needs a tokenizer with a {EOT_TOKEN} token; use --pad source or zero")
    return (eot_id,)


def tokenizer_eot(tokenizer: Tokenizer) -> int | None:
    return tokenizer.token_to_id(EOT_TOKEN)


def check_distinct(source: str, target: str) -> None:
    """An edit of an entity into itself changes nothing; say so instead of reporting a no-op as an edit."""
    if source.strip() == target.strip():
        raise StemlmError(f"source and target are the same entity ({target.strip()!r}); the edit would change nothing")
