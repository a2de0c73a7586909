"""`stemlm.flags`: a field declared with `setting(...)` carries its flag; the declarations read back in field order,
defaults read without building the dataclass, and help that names defaults. The run's settings (`TrainConfig`,
`RunRequest`) are checked against their sections and choice sets."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest

from stemlm import choices
from stemlm.flags import UNSET, defaults, help_text, setting, settings
from stemlm.placement.registry import TRAIN, tables_values
from stemlm.train.config import SECTIONS, TrainConfig
from stemlm.train.setup import RunRequest


@dataclass
class Options:
    steps: int = setting(10, "steps (default {default}, at most {limit})", section="a", metavar="N")
    limit: int = 100  # no flag
    lrs: list[float] = setting([0.1], "lrs", name="--lr", append=True)
    quiet: bool = setting(False, "say less", const=True)

    def __post_init__(self) -> None:
        raise AssertionError("built")  # defaults and help must not build an instance


def test_settings_in_field_order_with_their_flag_names():
    found = [(flag, f.name, spec.section) for flag, f, spec in settings(Options)]
    assert found == [("--steps", "steps", "a"), ("--lr", "lrs", None), ("--quiet", "quiet", None)]
    specs = {f.name: spec for _, f, spec in settings(Options)}
    assert specs["quiet"].const is True and specs["steps"].const is UNSET and specs["lrs"].append


def test_defaults_and_help_without_an_instance():
    assert defaults(Options) == {"steps": 10, "limit": 100, "lrs": [0.1], "quiet": False}
    (_, f, spec), *_ = settings(Options)
    assert help_text(Options, f, spec) == "steps (default 10, at most 100)"


def test_a_list_default_is_copied_for_each_instance():
    @dataclass
    class Lists:
        items: list[str] = setting(["a"], "items", many=True)

    first, second = Lists(), Lists()
    first.items.append("b")
    assert second.items == ["a"] and Lists.__dataclass_fields__["items"].default is dataclasses.MISSING


@pytest.mark.parametrize("cls", [TrainConfig, RunRequest])
def test_every_run_setting_has_a_known_section_and_a_help_that_formats(cls):
    for _, f, spec in settings(cls):
        assert spec.section in SECTIONS, f.name
        assert help_text(cls, f, spec).strip() and "{" not in help_text(cls, f, spec), f.name


def test_the_run_settings_offer_the_choice_sets():
    offered = {f.name: spec.one_of for _, f, spec in settings(TrainConfig) if spec.one_of}
    assert offered == {
        "device": choices.DEVICES,
        "dtype": choices.COMPUTE_DTYPES,
        "sampling": choices.SAMPLING,
        "recipe": choices.RECIPES,
        "tables": tables_values(TRAIN),
        "trainable": choices.TRAINABLE,
        "parallel": choices.PARALLEL_MODES,
    }
    for name, values in offered.items():  # every offered value is one the config accepts
        for value in values:
            TrainConfig(**{name: value}, table_optim="adamw" if value == "official" else "rowwise_adagrad")


def test_flags_are_unique_across_the_run_settings():
    names = [flag for cls in (TrainConfig, RunRequest) for flag, _, _ in settings(cls)]
    assert len(names) == len(set(names))
