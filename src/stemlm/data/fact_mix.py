"""Mixing the country fact world (`stemlm.data.worlds.facts`) into the training text of the embedded corpus.

`stemlm train` on the embedded corpus adds templated fact statements ("The capital of Spain is Madrid.", in the
training templates and the mix's extra phrasings, `MIX_TEMPLATES`) so
that the model it trains can learn some facts, which is what `stemlm edit` needs to show anything: a row swap
can only move a fact the model holds (at the default budget it has not learned them yet; see docs/results.md).
The statements of `relations` for the countries of `region` (a region name or a list of countries) are
repeated until they make up `fraction` of the training tokens (the corpus stays the rest) and shuffled into
documents that join the corpus's training documents. Held-out data is untouched: held-out loss stays
natural text.

    from stemlm.data.fact_mix import fact_texts
    docs = fact_texts(corpus_tokens, tokenizer, fraction=0.2, region="Europe", relations=["capital"], seed=0)
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

from stemlm.errors import StemlmError


def fact_repeats(corpus_tokens: int, tokens_per_repeat: int, fraction: float) -> int:
    """Repeats of the statements that make them `fraction` of corpus + facts (at least one)."""
    if not 0.0 < fraction < 1.0:
        raise StemlmError(f"fact fraction must lie in (0, 1), got {fraction}")
    return max(1, round(fraction / (1.0 - fraction) * corpus_tokens / tokens_per_repeat))


def fact_texts(
    corpus_tokens: int,
    tokenizer: Tokenizer,
    fraction: float,
    region: str | Sequence[str] | None,
    relations: Sequence[str],
    seed: int,
) -> list[str]:
    """Fact documents sized so that, beside `corpus_tokens` tokens of corpus, they are `fraction` of the tokens."""
    from stemlm.data.worlds.facts import fact_documents

    try:
        one = fact_documents(repeats=1, seed=seed, relations=tuple(relations), region=region, mix=True)
    except (KeyError, ValueError) as exc:  # an unknown relation or region names itself
        raise StemlmError(f"cannot build the fact mix: {exc.args[0]}") from None
    # A shard ends every document with a separator token: count it, so the fraction is of the real token stream.
    per_repeat = sum(len(e.ids) for e in tokenizer.encode_batch(one, add_special_tokens=False)) + len(one)
    repeats = fact_repeats(corpus_tokens, per_repeat, fraction)
    return fact_documents(repeats, seed=seed, relations=tuple(relations), region=region, mix=True)
