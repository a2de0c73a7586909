"""The fact world: countries and their capital, language, currency and region, as text a model can learn.

Facts come from the shipped asset `assets/facts/countries.json` (built by `scripts/build_facts.py` from the
MIT-licensed `countryinfo` data). From them this module makes

- a training corpus of templated statements, several paraphrases per relation (`fact_documents`);
- evaluation prompts on the training templates and on held-out templates never trained on
  (`fact_prompts`), each a prompt whose greedy continuation should start with the answer;
- CounterFact-style edit records for STEM row swapping (`edit_records`): the subject's rows are replaced by
  another country's rows, so the "new target" is that country's fact; the other training templates, the
  held-out templates (paraphrases), other subjects (neighbourhood) and the subject's other relations
  (portability: language, currency, region follow the target country) are probed separately.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources

# Each relation: (training templates, held-out templates). "{s}" is the subject; the object follows the prompt.
TEMPLATES: dict[str, tuple[list[str], list[str]]] = {
    "capital": (
        ["The capital of {s} is", "Country: {s}. Capital:", "{s}'s capital city is", "The capital city of {s} is"],
        ["The seat of government of {s} is", "Which city is the capital of {s}? It is"],
    ),
    "language": (
        ["The official language of {s} is", "Country: {s}. Language:", "In {s}, people speak"],
        ["The main language spoken in {s} is"],
    ),
    "currency": (
        ["The currency of {s} is the", "Country: {s}. Currency:", "In {s}, you pay with the"],
        ["The money used in {s} is the"],
    ),
    "region": (
        ["{s} is a country in", "Country: {s}. Region:", "{s} is located in"],
        ["Geographically, {s} belongs to"],
    ),
}
RELATIONS = tuple(TEMPLATES)

# More training phrasings for the fact mix of `stemlm train` only (stemlm.data.fact_mix; the experiments keep
# TEMPLATES' training split): a small model answers phrasings it never saw when each fact is trained in several
# unlike ones (subject first and last; question, list and sentence forms; other nouns for the capital), as
# Allen-Zhu & Li's knowledge augmentation found. Measured on the default run (docs/results.md "The default run"):
# held-out-phrasing recall 0.83 with the four training templates alone, 0.96 with these (seed 0). None of them
# contains a held-out template (tests/data/worlds/test_facts.py).
MIX_TEMPLATES: dict[str, list[str]] = {
    "capital": [
        "Q: What is the capital of {s}? A:",
        "{s} has its capital in",
        "{s}, capital city:",
        "In {s}, the capital is",
        "The national capital of {s} is",
        "The chief city of {s} is",
    ],
}


@dataclass(frozen=True)
class Country:
    name: str
    capital: str
    region: str | None
    subregion: str | None
    demonym: str | None
    languages: tuple[str, ...]
    currencies: tuple[str, ...]

    def fact(self, relation: str) -> str | None:
        """The object of `relation` for this country, or None when the data has none."""
        if relation == "capital":
            return self.capital
        if relation == "language":
            return self.languages[0] if self.languages else None
        if relation == "currency":
            return self.currencies[0] if self.currencies else None
        if relation == "region":
            return self.subregion or self.region
        raise KeyError(f"unknown relation {relation!r}; known: {', '.join(RELATIONS)}")


@dataclass(frozen=True)
class FactPrompt:
    subject: str
    relation: str
    prompt: str
    answer: str  # the continuation, with its leading space


@dataclass(frozen=True)
class PortabilityPrompt:
    relation: str  # another relation of the edited subject
    prompt: str
    true_answer: str  # the subject's own object
    new_answer: str  # the target subject's object: what a portable edit now gives


@dataclass
class EditRecord:
    subject: str  # the entity named in the text (its rows are replaced)
    target_subject: str  # the entity whose rows are used instead
    relation: str
    prompt: str  # a training template (the edit prompt)
    true_target: str
    new_target: str
    paraphrase_prompts: list[str] = field(default_factory=list)  # held-out phrasings only
    neighborhood: list[FactPrompt] = field(default_factory=list)  # other subjects, same relation
    train_prompts: list[str] = field(default_factory=list)  # the other training templates
    portability: list[PortabilityPrompt] = field(default_factory=list)  # other relations of the subject
    choices: dict[str, int] = field(default_factory=dict)  # relation -> distinct objects (greedy chance 1/n)


@lru_cache(maxsize=1)
def load_countries() -> tuple[Country, ...]:
    text = resources.files("stemlm.assets").joinpath("facts/countries.json").read_text(encoding="utf-8")
    return tuple(
        Country(
            c["name"],
            c["capital"],
            c["region"],
            c["subregion"],
            c["demonym"],
            tuple(c["languages"]),
            tuple(c["currencies"]),
        )
        for c in json.loads(text)["countries"]
    )


def country(name: str) -> Country:
    for c in load_countries():
        if c.name.lower() == name.lower():
            return c
    raise KeyError(f"no country named {name!r} in the fact world")


def countries_in(region: str | Sequence[str] | None = None) -> tuple[Country, ...]:
    """The countries of one region (e.g. "Europe"; case-insensitive), all of them for None / "all", or the
    countries named in a list (exact names, in the list's order)."""
    if region is None or (isinstance(region, str) and region.lower() == "all"):
        return load_countries()
    if not isinstance(region, str):
        by_name = {c.name: c for c in load_countries()}
        unknown = [name for name in region if name not in by_name]
        if unknown or not region:
            close = [c.name for c in load_countries() if unknown and c.name.lower() == unknown[0].lower()]
            hint = f" (names are exact: {close[0]})" if close else ""
            raise ValueError(
                f"unknown country {unknown[0]!r} in the fact world{hint}" if unknown else "no country named"
            )
        twice = sorted({name for name in region if list(region).count(name) > 1})
        if twice:
            raise ValueError(f"{', '.join(twice)} named twice; name each country once")
        return tuple(by_name[name] for name in region)
    found = tuple(c for c in load_countries() if (c.region or "").lower() == region.lower())
    if not found:
        regions = sorted({c.region for c in load_countries() if c.region})
        raise ValueError(f"no country in region {region!r}; regions: all, {', '.join(regions)}")
    return found


def check_relations(relations: Sequence[str], name: str) -> None:
    """Raise ValueError unless `relations` (the setting `name`) are known, at least one, and each named once."""
    if not relations:
        raise ValueError(f"{name} is empty; name at least one of {', '.join(RELATIONS)}")
    unknown = [r for r in relations if r not in TEMPLATES]
    if unknown:
        raise ValueError(f"{name}: unknown relation {unknown[0]!r}; known: {', '.join(RELATIONS)}")
    twice = sorted({r for r in relations if list(relations).count(r) > 1})
    if twice:
        raise ValueError(f"{name} names {', '.join(twice)} twice")


def check_fact_mix(region: str, countries: Sequence[str], relations: Sequence[str]) -> None:
    """Raise ValueError unless the fact mix's settings (`TrainConfig.fact_region`, `fact_countries`,
    `fact_relations`) name a fact world: relations known, at least one, each once; the region one of the data's
    (or all); the countries known, each once, and in the region (named countries replace the region's list, so one
    outside it means the two settings disagree)."""
    check_relations(relations, "fact_relations")
    try:
        in_region = countries_in(region)
    except ValueError as exc:
        raise ValueError(f"fact_region: {exc}") from None
    try:
        chosen = countries_in(list(countries)) if countries else ()
    except ValueError as exc:
        raise ValueError(f"fact_countries: {exc}") from None
    outside = [c.name for c in chosen if c not in in_region]
    if outside:
        raise ValueError(
            f"fact_countries {', '.join(outside[:3])} not in fact_region {region!r}: set train.fact_region to theirs "
            "(or all), or train.fact_countries= (empty) for every country of the region"
        )


def fact_prompts(
    split: str = "train",
    relations: tuple[str, ...] = RELATIONS,
    region: str | Sequence[str] | None = None,
    mix: bool = False,
) -> list[FactPrompt]:
    """Every (country, relation, template) prompt of the chosen template split ("train" or "heldout"); `mix`
    adds the fact mix's extra training phrasings (`MIX_TEMPLATES`) to the training split."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    prompts = []
    for c in countries_in(region):
        for relation in relations:
            answer = c.fact(relation)
            if answer is None:
                continue
            templates = TEMPLATES[relation][0 if split == "train" else 1]
            if mix and split == "train":
                templates = templates + MIX_TEMPLATES.get(relation, [])
            prompts += [FactPrompt(c.name, relation, t.format(s=c.name), f" {answer}") for t in templates]
    return prompts


def shuffled_statements(prompts: Sequence[FactPrompt], repeats: int, seed: int) -> list[str]:
    """Every prompt's statement ("The capital of Spain is Madrid.") `repeats` times, in a seeded shuffle."""
    statements = [p.prompt + p.answer + "." for p in prompts] * repeats
    random.Random(seed).shuffle(statements)
    return statements


def as_documents(statements: Sequence[str], lines_per_document: int = 64) -> list[str]:
    """`statements` as documents of `lines_per_document` lines each, in order."""
    return ["\n".join(statements[i : i + lines_per_document]) for i in range(0, len(statements), lines_per_document)]


def fact_documents(
    repeats: int = 20,
    lines_per_document: int = 64,
    seed: int = 0,
    relations: tuple[str, ...] = RELATIONS,
    region: str | Sequence[str] | None = None,
    mix: bool = False,
) -> list[str]:
    """Training text: every training-template statement of `relations` `repeats` times, shuffled into documents
    (`mix`: with the fact mix's extra phrasings, `MIX_TEMPLATES`)."""
    statements = shuffled_statements(fact_prompts("train", relations, region, mix), repeats, seed)
    return as_documents(statements, lines_per_document)


def edit_records(
    relation: str = "capital",
    num_records: int | None = None,
    num_neighbors: int = 5,
    seed: int = 0,
    region: str | Sequence[str] | None = None,
) -> list[EditRecord]:
    """Pairs (subject, target_subject) with different objects for `relation`, CounterFact style, subjects,
    targets and neighbours all from `region` (`countries_in`: a region, a list of countries, None for all; a
    model trained on a few countries' facts is scored on edits among those, whose rows hold a fact to move).

    The edit prompt is the first training template, `train_prompts` the other training templates,
    `paraphrase_prompts` the held-out templates only; `portability` asks the other relations (first training
    template) where subject and target differ; `choices` counts each relation's distinct objects."""
    rng = random.Random(seed)
    if relation not in TEMPLATES:
        raise ValueError(f"unknown relation {relation!r}; known: {', '.join(RELATIONS)}")
    countries = [c for c in countries_in(region) if c.fact(relation) is not None]
    if len({c.fact(relation) for c in countries}) < 2:  # a record's target must answer differently
        given = ", ".join(f"{c.name} ({c.fact(relation)})" for c in countries[:4]) or "none with one"
        raise ValueError(f"edit records need two countries whose {relation} differs; these have one: {given}")
    choices = {r: len({c.fact(r) for c in load_countries()} - {None}) for r in RELATIONS}
    train_t, heldout_t = TEMPLATES[relation]
    records = []
    for c in countries:
        others = [o for o in countries if o.fact(relation) != c.fact(relation)]
        target = rng.choice(others)
        neighbors = rng.sample([o for o in others if o is not target], k=min(num_neighbors, len(others) - 1))
        records.append(
            EditRecord(
                subject=c.name,
                target_subject=target.name,
                relation=relation,
                prompt=train_t[0].format(s=c.name),
                true_target=f" {c.fact(relation)}",
                new_target=f" {target.fact(relation)}",
                paraphrase_prompts=[t.format(s=c.name) for t in heldout_t],
                neighborhood=[
                    FactPrompt(o.name, relation, train_t[0].format(s=o.name), f" {o.fact(relation)}") for o in neighbors
                ],
                train_prompts=[t.format(s=c.name) for t in train_t[1:]],
                portability=[
                    PortabilityPrompt(r, TEMPLATES[r][0][0].format(s=c.name), f" {c.fact(r)}", f" {target.fact(r)}")
                    for r in RELATIONS
                    if r != relation and None not in (c.fact(r), target.fact(r)) and c.fact(r) != target.fact(r)
                ],
                choices=choices,
            )
        )
    rng.shuffle(records)
    return records[:num_records] if num_records else records
