"""Which other words a global edit touches: the vocabulary tokens whose rows it rewrites, and the words sharing them.

A global edit rewrites table rows of token ids, not of a name. When the source name is several sub-word
tokens (" Spain" = "ĠSp" + "ain" in the shipped tokenizer), every other word built from one of those tokens
reads the new rows too (" Britain" ends in "ain"). `shared_words` finds those words in a reference word list:
every distinct word of the embedded corpus (the text the default model was trained on) plus every name of the
fact world (countries, capitals, languages, currencies), each tokenized the way it reads inside a sentence
(with its leading space), so a user can see what a saved edit changes before it is saved.

    changed = changed_token_ids(source_ids, plan)            # ids whose rows the plan rewrites
    words = shared_words(tokenizer, changed, exclude="Spain")  # {id: ["Britain", ...]}

`check_shared_subwords` is the one saving policy of `stemlm edit --save` and the playground's save: an edit
whose changed tokens other words share is refused (`SharedSubwords`, carrying the tokens and words) unless
the caller opted in (`--allow-shared-subwords`, the API's `allow_shared_subwords`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache

from tokenizers import Tokenizer

from stemlm.edit.spans import RowPlan
from stemlm.errors import StemlmError

# How the CLI's user opts in: the end of the refusal message unless the caller names its own.
CLI_OPT_IN = "pass --allow-shared-subwords to save anyway (--json lists every word), or edit positionally (no --save)"
WORD = re.compile(r"[^\W\d_]+(?:['’-][^\W\d_]+)*")  # letters, with inner apostrophes / hyphens ("o'clock")


def changed_token_ids(source_ids: Sequence[int], plan: RowPlan) -> list[int]:
    """The source ids whose rows the plan replaces (a `None` entry keeps the source's own row)."""
    return [sid for sid, choice in zip(source_ids, plan, strict=True) if choice is not None]


@lru_cache(maxsize=1)
def reference_words() -> tuple[str, ...]:
    """Distinct words of the embedded corpus and every name of the fact world, sorted."""
    from stemlm.data import load_embedded_corpus
    from stemlm.data.worlds.facts import load_countries

    words: set[str] = set()
    for doc in load_embedded_corpus():
        words.update(WORD.findall(doc.text))
    for c in load_countries():
        words.update(n for n in (c.name, c.capital, c.demonym, *c.languages, *c.currencies) if n)
    return tuple(sorted(words))


def shared_words(
    tokenizer: Tokenizer, token_ids: Sequence[int], exclude: str = "", words: Sequence[str] | None = None
) -> dict[int, list[str]]:
    """For each token id, the reference words (other than `exclude`) whose spaced tokenization contains it."""
    wanted = set(token_ids)
    found: dict[int, list[str]] = {tid: [] for tid in token_ids}
    candidates = [w for w in (reference_words() if words is None else words) if w != exclude.strip()]
    encodings = tokenizer.encode_batch([" " + w for w in candidates], add_special_tokens=False)
    for word, enc in zip(candidates, encodings, strict=True):
        for tid in wanted.intersection(enc.ids):
            found[tid].append(word)
    return found


def describe_shared(tokenizer: Tokenizer, token_ids: Sequence[int], exclude: str) -> list[dict]:
    """[{"id", "token", "shared_with": [words]}] for each changed token (JSON-able, stored in edits.json)."""
    words = shared_words(tokenizer, token_ids, exclude)
    return [{"id": tid, "token": tokenizer.id_to_token(tid), "shared_with": words[tid]} for tid in token_ids]


class SharedSubwords(StemlmError):
    """A global edit refused because other words share its changed tokens; `changed_tokens` lists them all."""

    def __init__(self, message: str, changed_tokens: list[dict]) -> None:
        super().__init__(message)
        self.changed_tokens = changed_tokens


def check_shared_subwords(description: dict, allowed: bool, how_to_allow: str = CLI_OPT_IN) -> None:
    """Refuse to save a global edit that also rewrites other words' sub-word tokens unless `allowed`.

    `description` is the edit's (`TableEditor` records: its `changed_tokens` come from `describe_shared`);
    `how_to_allow` ends the one-line message with the caller's opt-in (the CLI flag by default).
    """
    changed = description["changed_tokens"]
    shared = [t for t in changed if t["shared_with"]]
    if shared and not allowed:
        what = "; ".join(
            f"{t['token']!r} also in {len(t['shared_with'])} words ({', '.join(t['shared_with'][:4])}"
            + (", ..." if len(t["shared_with"]) > 4 else "")
            + ")"
            for t in shared
        )
        raise SharedSubwords(
            f"a saved (global) edit rewrites these tokens' rows in every text: {what}; {how_to_allow}", changed
        )
