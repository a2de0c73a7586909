"""The one registry of table placements: a placement is chosen here, from the `--tables` value, the purpose
(training or inference) and, in training, the world (one process or several ranks) and the model.

    choose("resident", "inference")            # ResidentTables ("resident" is another word for "device")
    choose("host", "train", distributed=True)  # HostShardedTables
    make_placement(cfg, model, world)          # a training run's tables (an instance)
    tables_values("train")                     # every --tables word training takes, synonyms included

Every command's `--tables` flag, every loader and the trainer read this registry, and nothing else names a
placement, so a new one is one module: a `Placement` subclass, then `register(cls)`. The built-in ones are
registered below; another package declares its own in the `stemlm.placement` entry-point group (registered when
this module loads, so the CLI offers them), and a script or a test may call `register` itself.
Tests: tests/placement/test_registry.py, tests/placement/test_toy_placement.py.
"""

from __future__ import annotations

import warnings
from typing import Any

from stemlm.errors import StemlmError
from stemlm.placement.base import INFERENCE, TRAIN, Placement
from stemlm.placement.host import HostTables
from stemlm.placement.host_sharded import HostShardedTables
from stemlm.placement.mmap import MmapTables
from stemlm.placement.resident import ResidentTables
from stemlm.placement.row_sharded import ShardedTables

PLACEMENTS: dict[str, type[Placement]] = {}  # by name, in registration order (the order of every listing)
ENTRY_POINT_GROUP = "stemlm.placement"  # another package's placements: `name = "module:Class"` entries


def register(cls: type[Placement]) -> type[Placement]:
    """Add `cls` (usable as a class decorator); a name or (value, purpose, world) already taken is refused."""
    if cls.name in PLACEMENTS:
        raise StemlmError(f"a table placement named {cls.name!r} is already registered")
    for other in PLACEMENTS.values():
        shared = {cls.tables, *cls.aliases} & {other.tables, *other.aliases}
        if shared and cls.tables != other.tables:  # a word names one --tables value, whoever declares it
            raise StemlmError(f"--tables {', '.join(sorted(shared))} of {cls.name!r} clash with {other.name!r}'s")
        # Inference has no world (one process), so a word has one inference placement; training one per world.
        both = cls.purposes & other.purposes
        if other.tables == cls.tables and (
            INFERENCE in both or (TRAIN in both and other.distributed == cls.distributed)
        ):
            raise StemlmError(f"{cls.name!r} and {other.name!r} would both answer --tables {cls.tables}")
    PLACEMENTS[cls.name] = cls
    return cls


def unregister(name: str) -> None:
    """Remove the placement `name` (a test's own, once it is done)."""
    if name not in PLACEMENTS:
        raise StemlmError(f"no table placement named {name!r} is registered")
    del PLACEMENTS[name]


def tables_values(purpose: str, *, aliases: bool = True) -> tuple[str, ...]:
    """The `--tables` values the placements of `purpose` answer to, then (`aliases`) their other words."""
    serving = [cls for cls in PLACEMENTS.values() if purpose in cls.purposes]
    values = tuple(dict.fromkeys(cls.tables for cls in serving))
    others = dict.fromkeys(alias for cls in serving for alias in cls.aliases if alias not in values)
    return (*values, *others) if aliases else values


def resolve(word: str, purpose: str) -> str:
    """The `--tables` value `word` names (an alias becomes its value), or a one-line error listing the choices."""
    for cls in PLACEMENTS.values():
        if purpose in cls.purposes and word in (cls.tables, *cls.aliases):
            return cls.tables
    also: dict[str, dict[str, None]] = {}
    for cls in PLACEMENTS.values():
        if purpose in cls.purposes:
            also.setdefault(cls.tables, {}).update(dict.fromkeys(cls.aliases))
    names = [f"{v} (or {', '.join(a)})" if a else v for v, a in also.items()]
    raise StemlmError(f"unknown table placement {word!r}; choose one of {', '.join(names)}")


def choose(word: str, purpose: str, *, distributed: bool = False) -> type[Placement]:
    """The placement of `purpose` that `--tables word` names (in training: for a world of several ranks or not)."""
    value = resolve(word, purpose)
    for cls in PLACEMENTS.values():
        if cls.tables == value and purpose in cls.purposes and (purpose != TRAIN or cls.distributed == distributed):
            return cls
    world = "several ranks" if distributed else "one process"
    raise StemlmError(f"--tables {word} has no {purpose} placement for a world of {world}")


def make_placement(cfg: Any, model: Any, world: Any) -> Placement:
    """A training run's tables: the placement `cfg.tables` names in `world`, applied to `model` (a model on the
    meta device too). A model without token tables has no rows to shard: with several ranks it trains resident."""
    if world.distributed and not model.token_tables():
        return ResidentTables()
    return choose(cfg.tables, TRAIN, distributed=world.distributed).for_training(model, world.device)


def needs_row_sparse_optimizer(word: str) -> bool:
    """Whether a training placement `--tables word` names can only step its tables with a row-sparse optimizer."""
    value = resolve(word, TRAIN)
    return any(cls.row_sparse_only for cls in PLACEMENTS.values() if cls.tables == value and TRAIN in cls.purposes)


def placement_named(name: str) -> type[Placement] | None:
    """The registered placement called `name` (a report's `placement` field), or None."""
    return PLACEMENTS.get(name)


def register_entry_points() -> list[str]:
    """Register the placements installed packages declare in the `stemlm.placement` entry-point group (as vLLM
    finds its plugins), so their `--tables` words are every command's choices from the start. A plugin that fails
    to load, is no `Placement` or clashes is left out with a warning naming it (one broken package must not stop
    every command); the warnings are returned too."""
    from importlib.metadata import entry_points

    problems = []
    for point in entry_points(group=ENTRY_POINT_GROUP):
        try:
            cls = point.load()
            if not (isinstance(cls, type) and issubclass(cls, Placement)):
                raise StemlmError("not a Placement subclass")
            if PLACEMENTS.get(cls.name) is not cls:
                register(cls)
        except Exception as exc:  # whatever the plugin's import raised
            problems.append(f"table placement plugin {point.name} ({point.value}) left out: {exc}")
            warnings.warn(problems[-1], stacklevel=2)
    return problems


for _builtin in (ResidentTables, HostTables, MmapTables, ShardedTables, HostShardedTables):
    register(_builtin)
register_entry_points()

__all__ = [
    "INFERENCE",
    "PLACEMENTS",
    "TRAIN",
    "choose",
    "make_placement",
    "needs_row_sparse_optimizer",
    "placement_named",
    "register",
    "register_entry_points",
    "resolve",
    "tables_values",
    "unregister",
]
