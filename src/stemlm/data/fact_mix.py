"""Mixing the country fact world (`stemlm.data.worlds.facts`) into the training text of the embedded corpus.

`stemlm train` on the embedded corpus adds templated fact statements ("The capital of Spain is Madrid.", in the
training templates and the mix's extra phrasings, `MIX_TEMPLATES`) so that the model it trains learns facts,
which is what `stemlm edit` needs to show anything: a row swap can only move a fact the model holds. The
statements of `relations` for the countries of `region` (a region name or a list of countries) are repeated
until they make up `fraction` of the training tokens (the corpus stays the rest). Held-out data is untouched:
held-out loss stays natural text.

Three layouts (`TrainConfig.fact_layout`, `stemlm.choices.FACT_LAYOUTS`):
- `batches` (the default): the statements shuffled into documents of 64 lines after the corpus documents, and
  every training batch drawn with its share of windows from them (`TokenDataset.strata`, set by
  `stemlm.train.data`): each batch's loss mixes facts and text in the same proportion (with windows drawn from
  anywhere a batch held mostly facts or mostly text, its loss swung, and the trainer's spike check fired on
  a healthy run: docs/results.md), and the corpus windows stay whole text.
- `lines`: each statement a line of its own, spread evenly through the corpus text by character offset, so
  every window holds about `fraction` fact tokens (the corpus then never reads uninterrupted).
- `documents`: the `batches` text with windows drawn from anywhere (runs made before 2026-12-06; their
  run_config.json has no `fact_layout` and resumes with this one).

    from stemlm.data.fact_mix import mixed_texts
    texts = mixed_texts(corpus_texts, tokenizer, fraction=0.3, region=["Spain", "Germany"], relations=["capital"],
                        seed=0, corpus_tokens=1_000_000, layout="batches")
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

from stemlm.choices import FACT_LAYOUTS
from stemlm.errors import StemlmError


def fact_repeats(corpus_tokens: int, tokens_per_repeat: int, fraction: float) -> int:
    """Repeats of the statements that make them `fraction` of corpus + facts (at least one)."""
    if not 0.0 < fraction < 1.0:
        raise StemlmError(f"fact fraction must lie in (0, 1), got {fraction}")
    return max(1, round(fraction / (1.0 - fraction) * corpus_tokens / tokens_per_repeat))


def fact_statements(
    corpus_tokens: int,
    tokenizer: Tokenizer,
    fraction: float,
    region: str | Sequence[str] | None,
    relations: Sequence[str],
    seed: int,
    layout: str = "lines",
) -> list[str]:
    """The shuffled statements (one per item) that, beside `corpus_tokens` tokens of corpus, are `fraction` of the
    tokens of `layout`'s text: each counted with the token that joins it to its neighbours (`lines`: its newline),
    or each document of one repeat counted as laid out, with its separator (`documents`, as runs before
    `fact_layout` counted them)."""
    from stemlm.data.worlds.facts import fact_documents, fact_prompts, shuffled_statements

    try:
        prompts = fact_prompts("train", tuple(relations), region, mix=True)
    except (KeyError, ValueError) as exc:  # an unknown relation or region names itself
        raise StemlmError(f"cannot build the fact mix: {exc.args[0]}") from None
    if layout == "lines":
        one = [p.prompt + p.answer + "." for p in prompts]
    else:
        one = fact_documents(repeats=1, seed=seed, relations=tuple(relations), region=region, mix=True)
    per_repeat = sum(len(e.ids) for e in tokenizer.encode_batch(one, add_special_tokens=False)) + len(one)
    return shuffled_statements(prompts, fact_repeats(corpus_tokens, per_repeat, fraction), seed)


def tokenizer_texts(
    corpus_texts: Sequence[str],
    fraction: float,
    region: str | Sequence[str] | None,
    relations: Sequence[str],
    seed: int,
) -> list[str]:
    """The text of `stemlm tokenizer train --fact-fraction`: the corpus and the fact statements (training phrasings
    only) in documents after it, repeated to `fraction` of the characters, as the run mixes them into its tokens
    (no tokenizer exists yet to count tokens with). BPE then merges the fact world's names whole, so an edit
    swaps one token's rows for one token's rows; for the default run's edit that did not pay (docs/results.md
    "The default run")."""
    from stemlm.data.worlds.facts import as_documents, fact_prompts, shuffled_statements

    prompts = fact_prompts("train", tuple(relations), region, mix=True)
    per_repeat = sum(len(p.prompt) + len(p.answer) + 2 for p in prompts)  # the statement, its "." and newline
    repeats = fact_repeats(sum(len(t) for t in corpus_texts), per_repeat, fraction)
    return [*corpus_texts, *as_documents(shuffled_statements(prompts, repeats, seed))]


def interleave_lines(texts: Sequence[str], statements: Sequence[str]) -> list[str]:
    """`texts` with `statements` inserted as lines of their own, evenly by character offset: statement k follows
    the first line whose end reaches (k + ½) / len(statements) of the text's characters. Documents keep their
    boundaries and their own lines in order."""
    total = sum(len(t) + 1 for t in texts)  # every line's newline (or the document's end) counted once
    step, k, offset, out = total / max(1, len(statements)), 0, 0, []
    for text in texts:
        lines = []
        for line in text.split("\n"):
            lines.append(line)
            offset += len(line) + 1
            while k < len(statements) and offset >= (k + 0.5) * step:
                lines.append(statements[k])
                k += 1
        out.append("\n".join(lines))
    return out


def mixed_texts(
    corpus_texts: Sequence[str],
    tokenizer: Tokenizer,
    fraction: float,
    region: str | Sequence[str] | None,
    relations: Sequence[str],
    seed: int,
    *,
    corpus_tokens: int,
    layout: str = "batches",
) -> list[str]:
    """The training texts: the corpus with the fact statements mixed in by `layout` (`FACT_LAYOUTS`), the
    statements `fraction` of the tokens beside the corpus's `corpus_tokens`."""
    if layout not in FACT_LAYOUTS:
        raise StemlmError(f"fact layout must be one of {', '.join(FACT_LAYOUTS)}, got {layout!r}")
    statements = fact_statements(corpus_tokens, tokenizer, fraction, region, relations, seed, layout)
    if layout == "lines":
        return interleave_lines(corpus_texts, statements)
    from stemlm.data.worlds.facts import as_documents

    return [*corpus_texts, *as_documents(statements)]
