"""How an experiment registers: one typed options dataclass whose fields carry their flags, and `run`.

Each experiment module exposes `EXPERIMENT = Experiment(...)`; `stemlm experiment <name>` is built from it
(stemlm.cli.experiment), so adding an experiment is writing its module and naming it in the CLI's list:

- `options`: a dataclass whose fields are the experiment's settings; a field declared `setting(default, "help")`
  becomes a command-line flag (`--field-name`, or `name=`), its value parsed by the field's annotation
  (`stemlm.flags`, the declaration `stemlm train`'s flags come from too), the help followed by the default and
  `--quick`'s value; `setting(..., const=V)` makes a switch that sets V, `setting(..., append=True)` a repeatable
  flag;
- `quick`: the values of `--quick`, a reduced budget for CI and first tries;
- `fixed`: with `settable`, `--set KEY=VALUE` reaches every field but these;
- `run(options, log)`: trains, evaluates, writes the results folder and returns the results; `log` is an
  `ExperimentLog`: `log(text)` writes a line to stderr, `log.bar(total, desc, unit)` a progress bar (one per
  level of the work: seeds, then the runs of a seed), drawn only by the rule of `stemlm.progress`;
  `json(options, results)` is what `--json` prints, `text(options, results)` what is printed otherwise, and
  `done(options, results)` an optional closing line for stderr.

`resolve_options` lays the values over each other in one order: defaults, `--quick`, `--set`, given flags.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stemlm.errors import StemlmError
from stemlm.flags import UNSET, Setting
from stemlm.model.overrides import typed_overrides


@dataclass(frozen=True)
class Experiment:
    name: str
    help: str
    description: str
    options: type
    run: Callable[[Any, ExperimentLog], dict]
    text: Callable[[Any, dict], str]
    json: Callable[[Any, dict], dict] = lambda options, results: results
    done: Callable[[Any, dict], str] | None = None
    quick: dict = field(default_factory=dict)
    settable: bool = False
    fixed: tuple[str, ...] = ()


class ExperimentLog:
    """An experiment's progress on stderr: lines (`log(text)`, written so a drawn bar stays whole) and nested bars
    (`with log.bar(total, desc, unit) as bar`: the outer one stays, inner ones clear when done); `progress`: the
    bars are wanted (`--no-progress` is not given), drawn only when stderr is a terminal."""

    def __init__(self, progress: bool = False) -> None:
        self.progress, self.depth = progress, 0

    def __call__(self, text: str) -> None:
        from stemlm.progress import write

        write(text)

    @contextlib.contextmanager
    def bar(self, total: int, desc: str, unit: str) -> Iterator[Any]:
        from stemlm.progress import bar

        with bar(total, progress=self.progress, desc=desc, unit=unit, position=self.depth, leave=not self.depth) as b:
            self.depth += 1
            try:
                yield b
            finally:
                self.depth -= 1


def shown(value: Any) -> str:
    """A default as typed on the command line: a comma list, or "none" for an empty one."""
    if isinstance(value, (tuple, list)):
        return ",".join(map(str, value)) or "none"
    return str(value)


def flag_help(experiment: Experiment, f: dataclasses.Field, spec: Setting) -> str:
    """The flag's help followed by the default and --quick's value (a switch shows neither)."""
    if spec.const is not UNSET:
        return spec.help
    default = getattr(experiment.options(), f.name)
    quick = f"; --quick: {shown(experiment.quick[f.name])}" if f.name in experiment.quick else ""
    return spec.help if spec.append else f"{spec.help} (default: {shown(default)}{quick})"


def resolve_options(experiment: Experiment, given: dict[str, Any], quick: bool = False, sets: list[str] = ()):
    """The options: defaults, then `--quick`'s values, then `--set KEY=VALUE` items, then the given flags (None:
    not given)."""
    values = dict(experiment.quick) if quick else {}
    label = f"{experiment.name} option"
    values.update(typed_overrides(experiment.options, list(sets), label=label, fixed=experiment.fixed))
    values.update({k: v for k, v in given.items() if v is not None})
    return experiment.options(**values)


def positive_lrs(text: str) -> tuple[float, ...]:
    """A comma list of learning rates (each > 0), or "none" for no sweep."""
    if text.strip().lower() == "none":
        return ()
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise StemlmError(f"{text!r} is not a comma-separated list of numbers (or 'none')") from None
    if not values or any(not v > 0 for v in values):
        raise StemlmError(f"{text!r}: learning rates must be positive (or 'none')")
    return values


def results_file(name: str) -> Callable[[Any, dict], str]:
    """A `text` that prints the results folder's `name` (e.g. results.md)."""
    return lambda options, results: Path(options.out, name).read_text()
