"""The one `key=value` parser (stemlm.model.overrides): values read by the field annotation, one-line errors."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from stemlm.errors import StemlmError
from stemlm.model.overrides import apply_overrides, parse_value, typed_overrides


@dataclass
class Options:
    steps: int = 1
    lr: float | None = 0.1
    quick: bool = False
    name: str = "a"
    layers: str | list[int] = "odd"
    paths: list[str] = field(default_factory=list)
    lrs: tuple[float, ...] = ()
    arms: tuple[str, ...] = ()
    kind: str = "fixed"


@pytest.mark.parametrize(
    "raw, annotation, value",
    [
        (" 12 ", "int", 12),
        ("none", "float | None", None),
        ("NULL", "int | None", None),
        ("1", "bool", True),
        ("False", "bool", False),
        ("1,3", "str | list[int]", [1, 3]),
        ("every:2", "str | list[int]", "every:2"),
        ("a.txt, b.txt,", "list[str] | None", ["a.txt", "b.txt"]),
        ("1e-3,3e-3", "tuple[float, ...]", (1e-3, 3e-3)),
        ("dense, stem", "tuple[str, ...]", ("dense", "stem")),
        ("128,256", "tuple[int, ...]", (128, 256)),
        ("none", "tuple[float, ...]", ()),
        ("<|x|>", "str", "<|x|>"),
        (5, "str", 5),  # typed values pass as they are
    ],
)
def test_values_follow_the_annotation(raw, annotation, value):
    assert parse_value(raw, annotation, "k") == value


def test_apply_with_prefix_and_fixed_fields():
    options = apply_overrides(Options(), ["x.steps=3", "lr=none", "paths=p,q"], prefix="x.", fixed=("kind",))
    assert (options.steps, options.lr, options.paths) == (3, None, ["p", "q"])
    assert typed_overrides(Options, {"quick": "true", "lrs": (1.0,)}) == {"quick": True, "lrs": (1.0,)}


@pytest.mark.parametrize(
    "item, message",
    [
        ("steps", "override 'steps' is not of the form key=value"),
        ("kind=x", "unknown option 'kind'; valid keys: arms, layers, lr, lrs, name, paths, quick, steps$"),
        ("steps=two", "option 'steps' expects an integer, got 'two'"),
        ("lr=fast", "option 'lr' expects a number or none, got 'fast'"),
        ("quick=maybe", "expects true or false"),
        ("lrs=1,x", r"expects a comma list \(tuple\[float, ...\]\), got '1,x'"),
    ],
)
def test_errors_name_the_key_and_the_expected_type(item, message):
    with pytest.raises(StemlmError, match=message):
        typed_overrides(Options, [item], label="option", fixed=("kind",))


def test_one_flag_routes_items_to_their_config():
    from stemlm.model.overrides import split_sections

    routed = split_sections(["model.hidden_size=64", "train.steps=3", "model.ffn=moe"], ("model", "train"))
    assert routed == {"model": ["model.hidden_size=64", "model.ffn=moe"], "train": ["train.steps=3"]}
    with pytest.raises(StemlmError, match="'steps' is not of the form model.<field>=VALUE or train.<field>=VALUE"):
        split_sections(["steps"], ("model", "train"))
    with pytest.raises(StemlmError, match=r"'steps=3': prefix the key with model. or train. \(e.g. model.steps=3\)"):
        split_sections(["steps=3"], ("model", "train"))
