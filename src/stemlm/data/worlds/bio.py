"""The synthetic-biography world: invented people, their attributes, biographies and question-answer pairs.

In the style of "Physics of Language Models" parts 3.1 and 3.3 (Allen-Zhu and Li): every person has a
three-word name (first, middle, last: several tokens under any tokenizer) and five attributes drawn
uniformly and independently from the shipped lists in `assets/bio/world.json`:

    birth_date (12 months x 28 days x 50 years = 16,800 values), birth_city (30), university (20),
    field (20), employer (20)

From them this module makes

- biographies (`biography`): one sentence per attribute, each naming the person in full, from several
  templates per attribute, in a random sentence order (the paper's "multi5 + permute" augmentation);
- question-answer pairs (`qa_prompts`) on training and held-out phrasings; the experiment trains QA for one
  half of the people only and asks the other half (extraction: knowledge stored from biographies alone);
- probes of the biography sentences themselves (`bio_prompts`: memorisation);
- name-blind chance levels (`chance`) and the entropy of each attribute (`attribute_bits`), which the
  knowledge-capacity measure (bits per parameter, part 3.3) subtracts the model's loss from;
- CounterFact-style edit records (`edit_records`) whose portability probes ask every other attribute.

Every prompt ends right before its answer; the answer is " value" and the text continues with ".".
"""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources

from stemlm.data.worlds.facts import EditRecord, FactPrompt, PortabilityPrompt

ATTRIBUTES = ("birth_date", "birth_city", "university", "field", "employer")

# Biography sentence templates ("{n}" the full name); the value follows the prefix, then ".".
BIO_TEMPLATES: dict[str, list[str]] = {
    "birth_date": [
        "{n} was born on",
        "{n} came into the world on",
        "The birthday of {n} is",
        "{n} celebrates a birthday on",
    ],
    "birth_city": [
        "{n} was born in",
        "{n} grew up in the city of",
        "The hometown of {n} is",
        "{n} spent childhood years in",
    ],
    "university": ["{n} studied at", "{n} graduated from", "{n} received an education at", "{n} is an alumnus of"],
    "field": ["{n} majored in", "{n} earned a degree in", "{n} focused academic work on", "{n} specialised in"],
    "employer": ["{n} works for", "{n} is employed by", "{n} has a job at", "{n} earns a living at"],
}
# Question-answer phrasings: (trained, held out). The held-out ones are never in any training text.
QA_TEMPLATES: dict[str, tuple[list[str], list[str]]] = {
    "birth_date": (
        ["Question: When was {n} born? Answer:", "Question: What is the birth date of {n}? Answer:"],
        ["Question: On which day was {n} born? Answer:"],
    ),
    "birth_city": (
        ["Question: Where was {n} born? Answer:", "Question: What is the birth city of {n}? Answer:"],
        ["Question: Which city is the hometown of {n}? Answer:"],
    ),
    "university": (
        ["Question: Which university did {n} attend? Answer:", "Question: Where did {n} study? Answer:"],
        ["Question: What school did {n} graduate from? Answer:"],
    ),
    "field": (
        ["Question: What did {n} study? Answer:", "Question: What was the major of {n}? Answer:"],
        ["Question: Which subject did {n} specialise in? Answer:"],
    ),
    "employer": (
        ["Question: Which company does {n} work for? Answer:", "Question: Who employs {n}? Answer:"],
        ["Question: Where does {n} work? Answer:"],
    ),
}


@dataclass(frozen=True)
class Person:
    name: str
    attributes: tuple[tuple[str, str], ...]  # (attribute, value) in ATTRIBUTES order

    def get(self, attribute: str) -> str:
        return dict(self.attributes)[attribute]


@lru_cache(maxsize=1)
def world_lists() -> dict:
    text = resources.files("stemlm.assets").joinpath("bio/world.json").read_text(encoding="utf-8")
    return json.loads(text)


def attribute_values(attribute: str) -> list[str]:
    """Every possible value of an attribute (birth dates enumerated)."""
    w = world_lists()
    if attribute == "birth_date":
        y0, y1 = w["birth_years"]
        d0, d1 = w["birth_days"]
        return [f"{m} {d}, {y}" for y in range(y0, y1 + 1) for m in w["months"] for d in range(d0, d1 + 1)]
    key = {"birth_city": "birth_cities", "university": "universities", "field": "fields", "employer": "employers"}
    if attribute not in key:
        raise KeyError(f"unknown attribute {attribute!r}; known: {', '.join(ATTRIBUTES)}")
    return list(w[key[attribute]])


def attribute_bits(attribute: str) -> float:
    """log2 of the number of values: the entropy of a uniformly drawn attribute, in bits."""
    return math.log2(len(attribute_values(attribute)))


def make_people(n: int, seed: int = 0) -> list[Person]:
    """`n` people with distinct names and uniformly drawn attributes, reproducible from `seed`."""
    w = world_lists()
    rng = random.Random(seed)
    capacity = len(w["first_names"]) * len(w["middle_names"]) * len(w["last_names"])
    if not 2 <= n <= capacity // 4:
        raise ValueError(f"number of people must be in [2, {capacity // 4}], got {n}")
    names: set[str] = set()
    people = []
    values = {a: attribute_values(a) for a in ATTRIBUTES}
    while len(people) < n:
        name = f"{rng.choice(w['first_names'])} {rng.choice(w['middle_names'])} {rng.choice(w['last_names'])}"
        if name in names:
            continue
        names.add(name)
        people.append(Person(name, tuple((a, rng.choice(values[a])) for a in ATTRIBUTES)))
    return people


def split_people(people: list[Person]) -> tuple[list[Person], list[Person]]:
    """(QA-trained half, held-out half): the first and second halves of the (already random) list."""
    half = len(people) // 2
    return people[:half], people[half:]


def biography(person: Person, rng: random.Random) -> str:
    """One biography: a random template per attribute, the sentences in a random order."""
    sentences = [f"{rng.choice(BIO_TEMPLATES[a]).format(n=person.name)} {v}." for a, v in person.attributes]
    rng.shuffle(sentences)
    return " ".join(sentences)


def qa_text(person: Person, rng: random.Random) -> str:
    """One QA document: every attribute asked once with a random trained phrasing, in a random order."""
    lines = [f"{rng.choice(QA_TEMPLATES[a][0]).format(n=person.name)} {v}." for a, v in person.attributes]
    rng.shuffle(lines)
    return "\n".join(lines)


def world_documents(
    people: list[Person], qa_people: list[Person], bios_per_person: int, qa_repeats: int, seed: int = 0
) -> list[str]:
    """Training documents, shuffled: `bios_per_person` biographies of everyone, `qa_repeats` QA documents of
    each person in `qa_people`."""
    rng = random.Random(seed)
    docs = [biography(p, rng) for p in people for _ in range(bios_per_person)]
    docs += [qa_text(p, rng) for p in qa_people for _ in range(qa_repeats)]
    rng.shuffle(docs)
    return docs


def bio_prompts(people: list[Person], templates_per_attribute: int | None = None) -> list[FactPrompt]:
    """Memorisation probes: every (person, attribute, biography template) sentence prefix."""
    out = []
    for p in people:
        for a, v in p.attributes:
            for t in BIO_TEMPLATES[a][:templates_per_attribute]:
                out.append(FactPrompt(p.name, a, t.format(n=p.name), f" {v}"))
    return out


def qa_prompts(people: list[Person], phrasing: str = "train") -> list[FactPrompt]:
    """QA probes on the trained ("train") or never-trained ("heldout") phrasings."""
    if phrasing not in ("train", "heldout"):
        raise ValueError(f"phrasing must be 'train' or 'heldout', got {phrasing!r}")
    k = 0 if phrasing == "train" else 1
    return [
        FactPrompt(p.name, a, t.format(n=p.name), f" {v}")
        for p in people
        for a, v in p.attributes
        for t in QA_TEMPLATES[a][k]
    ]


def chance(train_people: list[Person], eval_people: list[Person]) -> dict[str, float]:
    """Name-blind chance per attribute: the exact-match rate on `eval_people` of always answering the most
    frequent value among `train_people` (what a model that ignores the name can reach at best), and its mean."""
    out = {}
    for a in ATTRIBUTES:
        guess = Counter(p.get(a) for p in train_people).most_common(1)[0][0]
        out[a] = sum(p.get(a) == guess for p in eval_people) / len(eval_people)
    out["mean"] = sum(out[a] for a in ATTRIBUTES) / len(ATTRIBUTES)
    return out


def edit_records(people: list[Person], attribute: str = "birth_city", num_records: int | None = None, seed: int = 0):
    """Edit records: each person's rows replaced by another person's (with a different `attribute` value).

    The prompts are the biography templates (trained); paraphrases are the held-out QA phrasing; portability
    asks every other attribute on a biography template (the edited person should take on the target's)."""
    rng = random.Random(seed)
    records = []
    for p in people:
        others = [o for o in people if o.get(attribute) != p.get(attribute)]
        target = rng.choice(others)
        neighbors = rng.sample([o for o in others if o is not target], k=min(3, len(others) - 1))
        records.append(
            EditRecord(
                subject=p.name,
                target_subject=target.name,
                relation=attribute,
                prompt=BIO_TEMPLATES[attribute][0].format(n=p.name),
                true_target=f" {p.get(attribute)}",
                new_target=f" {target.get(attribute)}",
                train_prompts=[t.format(n=p.name) for t in BIO_TEMPLATES[attribute][1:]],
                paraphrase_prompts=[t.format(n=p.name) for t in QA_TEMPLATES[attribute][1]],
                neighborhood=[
                    FactPrompt(o.name, attribute, BIO_TEMPLATES[attribute][0].format(n=o.name), f" {o.get(attribute)}")
                    for o in neighbors
                ],
                portability=[
                    PortabilityPrompt(a, BIO_TEMPLATES[a][0].format(n=p.name), f" {p.get(a)}", f" {target.get(a)}")
                    for a in ATTRIBUTES
                    if a != attribute and p.get(a) != target.get(a)
                ],
                choices={a: len(attribute_values(a)) for a in ATTRIBUTES},
            )
        )
    rng.shuffle(records)
    return records[:num_records] if num_records else records
