"""Settings that carry their flag: a dataclass field declared `name: type = setting(default, "help", ...)` holds
its help, its section, its choices and the shape of its command-line flag (in the field's metadata), so a
command's parser is built from the fields (`stemlm.cli.common.add_field_flags`) instead of repeating their names,
types and choices.

- the flag is `--field-name`, or `name=`; its value is parsed by the field's annotation
  (`stemlm.model.overrides.parse_value`), or by `parse=`; `one_of=` offers a closed set (`stemlm.choices`);
- `const=V` makes a switch that sets V, `append=True` a repeatable flag, `many=True` one that takes several values
  (both keep their text);
- `aliases=` are old names of the flag that keep working (hidden from the help, which names them once);
- `section=` names the group the flag is shown in (`stemlm.train.config.SECTIONS` for `stemlm train`);
- the help may name the field's default as `{default}` and another field's as `{<field>}` (`help_text`).

`given_fields(args, cls)` reads the fields a parsed command line gave. Used by `TrainConfig` and `RunRequest`
(`stemlm train`) and the experiments' options (stemlm.experiments.contract).
It declares only: argparse stays in the CLI.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

UNSET = object()  # no `const`: the flag takes a value


@dataclass(frozen=True)
class Setting:
    help: str
    section: str | None = None  # the help group; None: the command's own options
    name: str | None = None  # default: --<field name with dashes>
    metavar: str | None = None
    one_of: tuple | None = None  # the values offered (argparse's choices)
    const: Any = UNSET  # a switch that sets this value
    append: bool = False  # repeatable; the values form a list
    many: bool = False  # several values after one flag (nargs="+")
    parse: Callable[[str], Any] | None = None  # default: by the field's annotation
    aliases: tuple[str, ...] = ()  # old flag names that still work (a renamed setting)


def setting(
    default: Any,
    help: str,
    *,
    section: str | None = None,
    name: str | None = None,
    metavar: str | None = None,
    one_of: tuple | None = None,
    const: Any = UNSET,
    append: bool = False,
    many: bool = False,
    parse: Callable[[str], Any] | None = None,
    aliases: tuple[str, ...] = (),
) -> Any:
    """A dataclass field with this default whose metadata makes it a setting with a command-line flag (see the
    module docstring); a list default is copied for each instance."""
    metadata = {"setting": Setting(help, section, name, metavar, one_of, const, append, many, parse, aliases)}
    if isinstance(default, list):
        return dataclasses.field(default_factory=lambda: list(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def settings(cls: type) -> list[tuple[str, dataclasses.Field, Setting]]:
    """(flag, field, setting) of every field of the dataclass `cls` declared with `setting`, in field order."""
    found = []
    for f in dataclasses.fields(cls):
        spec = f.metadata.get("setting")
        if spec is not None:
            found.append((spec.name or "--" + f.name.replace("_", "-"), f, spec))
    return found


def given_fields(args: Any, cls: type) -> dict[str, Any]:
    """The fields of the dataclass `cls` a parsed command line gave (`args`, from flags built by
    `stemlm.cli.common.add_field_flags`, whose defaults are None): every value named as a field, unless None."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if getattr(args, f.name, None) is not None}


def defaults(cls: type) -> dict[str, Any]:
    """The dataclass's field defaults, read without building an instance (no validation, no imports)."""
    values = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            values[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            values[f.name] = f.default_factory()
    return values


def help_text(cls: type, f: dataclasses.Field, spec: Setting) -> str:
    """The setting's help with `{default}` (the field's default) and `{<field>}` (another field's) filled in."""
    values = defaults(cls)
    return spec.help.format(default=values.get(f.name), **values)
