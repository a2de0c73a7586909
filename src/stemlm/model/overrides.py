"""`key=value` overrides of any config dataclass, each value parsed by its field's annotation.

The one parser behind `--set model.<field>=V` / `train.<field>=V` (`ModelConfig.with_overrides`,
`TrainConfig.with_overrides`) and the experiments' flags and `--set <field>=V` (stemlm.experiments.contract); it
lives beside `ModelConfig`, the lowest config that uses it. A value is read by the field's declared type: `int`,
`float`, `bool` (true/false/1/0), `... | None` (also "none" or "null"), comma lists (`list[str]`,
`tuple[str, ...]`, `tuple[int, ...]`, `tuple[float, ...]`; "none" is an empty one), and `str | list[int]` (a
comma list of integers, else the text, as `ffn_layers` takes); any other annotation keeps the text. A value
that is not a string (a dict of typed values) is taken as it is; the dataclass's own validation runs on the
result.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from stemlm.errors import StemlmError

WORDS = {"bool": "true or false", "int": "an integer", "float": "a number", "None": "none"}
LISTS = {"list[str]": str, "tuple[str, ...]": str, "tuple[float, ...]": float, "list[int]": int, "tuple[int, ...]": int}
TUPLES = ("tuple[str, ...]", "tuple[float, ...]", "tuple[int, ...]")


def split_pairs(items: list[str], prefix: str = "") -> dict[str, str]:
    """`["a=1", "prefix.b=2"]` -> {"a": "1", "b": "2"}; an item without "=" is an error."""
    pairs = {}
    for item in items:
        if "=" not in item:
            raise StemlmError(f"override {item!r} is not of the form key=value")
        key, value = item.split("=", 1)
        pairs[key.strip().removeprefix(prefix)] = value
    return pairs


def split_sections(items: list[str], sections: tuple[str, ...], flag: str = "--set") -> dict[str, list[str]]:
    """`key=value` items routed by the prefix of their key ({"model": ["model.x=1"], "train": [...]}): one flag
    that reaches several configs; an item without "=" or a known prefix is an error naming the flag."""
    routed: dict[str, list[str]] = {section: [] for section in sections}
    forms = " or ".join(f"{section}.<field>=VALUE" for section in sections)
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise StemlmError(f"{flag} {item!r} is not of the form {forms}")
        section = key.split(".", 1)[0] if "." in key else None
        if section not in routed:
            prefixes = " or ".join(f"{section}." for section in sections)
            raise StemlmError(f"{flag} {item!r}: prefix the key with {prefixes} (e.g. {sections[0]}.{key}={value})")
        routed[section].append(item)
    return routed


def parse_value(raw: Any, annotation: str, key: str, label: str = "config key") -> Any:
    """`raw` (a command-line string) as a value of a field annotated `annotation` (e.g. "int | None")."""
    if not isinstance(raw, str):
        return raw
    text = raw.strip()
    kinds = [part.strip() for part in annotation.split("|")]
    if "None" in kinds and text.lower() in ("none", "null"):
        return None
    try:
        if "bool" in kinds:
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError
            return text.lower() in ("true", "1")
        if "int" in kinds:
            return int(text)
        if "float" in kinds:
            return float(text)
        listed = next((k for k in kinds if k in LISTS), None)
        if listed == "list[int]" and "str" in kinds and not text.replace(",", "").replace(" ", "").isdigit():
            return raw  # a spec such as "odd" or "every:2"
        if listed is not None:
            if text.lower() == "none":
                return () if listed in TUPLES else []
            items = [LISTS[listed](part.strip()) for part in text.split(",") if part.strip()]
            return tuple(items) if listed in TUPLES else items
    except ValueError:
        expected = " or ".join(WORDS.get(k, f"a comma list ({k})" if k in LISTS else k) for k in kinds)
        raise StemlmError(f"{label} {key!r} expects {expected}, got {raw!r}") from None
    return raw


def typed_overrides(
    cls: type,
    overrides: dict[str, Any] | list[str],
    *,
    prefix: str = "",
    label: str = "config key",
    fixed=(),
    aliases: dict[str, str] | None = None,
) -> dict[str, Any]:
    """{field: typed value} of `overrides` (`key=value` strings, or a dict) for the dataclass `cls`.

    `prefix` (e.g. "model.") may lead a key; `fixed` fields cannot be overridden; `aliases` maps a field's old
    name to its name (a renamed field keeps working); `label` names the config in the messages ("unknown {label}
    'x'; valid keys: ...", "{label} 'x' expects an integer, got 'y'")."""
    pairs = split_pairs(overrides, prefix) if isinstance(overrides, list) else overrides
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name not in fixed}
    changes = {}
    for old, raw in pairs.items():
        key = (aliases or {}).get(old, old)
        if key not in fields:
            raise StemlmError(f"unknown {label} {key!r}; valid keys: {', '.join(sorted(fields))}")
        changes[key] = parse_value(raw, str(fields[key].type), key, label)
    return changes


def apply_overrides(config, overrides: dict[str, Any] | list[str], **kw: Any):
    """A copy of the dataclass instance `config` with `overrides` applied (see `typed_overrides`)."""
    return dataclasses.replace(config, **typed_overrides(type(config), overrides, **kw))
