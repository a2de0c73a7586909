"""The experiment contract (stemlm.experiments.contract): flags come from the options' field metadata, values lie
over each other as defaults < --quick < --set < flags, and every registered experiment builds its subcommand."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from stemlm.cli.experiment import EXPERIMENTS
from stemlm.cli.main import build_parser
from stemlm.errors import StemlmError
from stemlm.experiments.contract import Experiment, flag_help, positive_lrs, resolve_options
from stemlm.flags import given_fields, setting, settings


@dataclass
class Options:
    out: str = setting("runs/x", "output folder")
    steps: int = setting(10, "steps", name="--budget", metavar="N")
    serial: bool = setting(False, "one at a time", const=True)
    lrs: tuple[float, ...] = setting((0.1,), "lrs", parse=positive_lrs)
    width: int = 8  # no flag: reached by --set only


EXAMPLE = Experiment("x", "h", "d", Options, run=lambda o, log: {}, text=lambda o, r: "", quick={"steps": 2})


def test_flags_and_their_help():
    assert [name for name, _, _ in settings(Options)] == ["--out", "--budget", "--serial", "--lrs"]
    specs = {name: (f, spec) for name, f, spec in settings(Options)}
    assert flag_help(EXAMPLE, *specs["--budget"]) == "steps (default: 10; --quick: 2)"
    assert flag_help(EXAMPLE, *specs["--serial"]) == "one at a time"


def test_values_lie_in_one_order():
    assert resolve_options(EXAMPLE, {}) == Options()
    assert resolve_options(EXAMPLE, {"steps": None}, quick=True).steps == 2
    assert resolve_options(EXAMPLE, {}, quick=True, sets=["steps=5", "width=3"]) == Options(steps=5, width=3)
    assert resolve_options(EXAMPLE, {"steps": 7}, quick=True, sets=["steps=5"]).steps == 7
    with pytest.raises(StemlmError, match="unknown x option 'depth'"):
        resolve_options(EXAMPLE, {}, sets=["depth=1"])


def test_learning_rate_lists():
    assert positive_lrs("none") == () and positive_lrs("1e-3, 3e-3") == (1e-3, 3e-3)
    with pytest.raises(StemlmError, match="must be positive"):
        positive_lrs("0,1")


@pytest.mark.parametrize("module", EXPERIMENTS)
def test_every_experiment_builds_its_subcommand(module):
    import importlib

    experiment = importlib.import_module(module).EXPERIMENT
    args = build_parser().parse_args(["experiment", experiment.name, *(["--quick"] if experiment.quick else [])])
    assert args.func.args == (experiment,)
    assert all(getattr(args, f.name) is None for _, f, _ in settings(experiment.options))
    assert given_fields(args, experiment.options) == {}  # nothing given: the options' defaults (and --quick) decide
