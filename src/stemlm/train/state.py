"""Trainer checkpoints: model files plus optimizer state and counters, written atomically, read without pickle.

    RUN/checkpoints/step-000123/
        config.json, model.safetensors, tokenizer.json   the model-core format (stemlm.checkpoint.folder)
        optimizer.safetensors                            every optimizer state tensor, keyed
                                                         opt<k>.state.<param_index>.<name> (k: 0 backbone, 1 tables)
        trainer_state.json                               step, counters, spike window, RNG states (torch as
                                                         base64, numpy and python as lists), optimizer
                                                         param_groups, data position and digest
                                                         (resuming on other data is refused), resolved config
    RUN/checkpoints/latest.json                          {"step": 123, "path": "step-000123"}, replaced atomically

A checkpoint folder is built in a temporary sibling and renamed into place (`AtomicFolder`, which also records
each file's SHA-256 in `stemlm-manifest.json`), so a crash while saving leaves the previous checkpoints
intact; only then is `latest.json` replaced and older checkpoints beyond `keep_last` removed (never the one
just written, never a later step's folder). Only the newest checkpoint keeps
`optimizer.safetensors` (twice the model's size in fp32 moments, needed only to resume): older ones drop it
(and its manifest entry) once a newer save succeeded, unless `keep_optimizer_state="all"`. Any model-only
reader (`stemlm generate`, `stemlm.checkpoint.runs.load_checkpoint`) can open these folders because the model files are
the plain model-core format.
"""

from __future__ import annotations

import base64
import json
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from stemlm.checkpoint.folder import AtomicFolder, write_json, write_model_files
from stemlm.checkpoint.runs import CHECKPOINTS_DIR, LATEST_NAME, STEP_DIR
from stemlm.checkpoint.safe_write import MANIFEST_NAME, atomic_write_text, read_manifest, remove_leftovers
from stemlm.errors import StemlmError
from stemlm.placement.table_optim import flatten_optimizer_state, unflatten_optimizer_state

STATE_NAME = "trainer_state.json"
OPTIMIZER_NAME = "optimizer.safetensors"
STATE_FORMAT = "stemlm-trainer-state-v1"
TRAIN_PRODUCER = "stemlm train"  # names a trainer checkpoint in its manifest
SHARDED_OPTIMIZER_FILES = "dcp/shard-*-model-00002-of-00002.safetensors"  # a sharded checkpoint's optimizer state


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR / f"step-{step:06d}"


# ----- RNG states -----
def capture_rng() -> dict[str, Any]:
    """Global RNG states of python, numpy and torch (and CUDA when in use), as JSON-able values."""
    version, internal, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": [version, list(internal), gauss],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode("ascii"),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # Only the device this process computes on: a rank owns one GPU, and a resume may see fewer devices.
        state["cuda"] = [base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode("ascii")]
    return state


def restore_rng(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_bytes_tensor(state["torch"]))
    if state.get("cuda") and torch.cuda.is_available():
        # One state (this format), or one per visible device (older checkpoints): the current device's, else the
        # first, into the current device, so a resume with fewer visible GPUs never indexes past them.
        saved = state["cuda"]
        index = torch.cuda.current_device()
        torch.cuda.set_rng_state(_bytes_tensor(saved[index if index < len(saved) else 0]))


def _bytes_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


# ----- optimizer state -----
def optimizer_state(optimizers: list[torch.optim.Optimizer]) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """All optimizers' state tensors in one flat dict (`opt<k>.` prefixes) and their JSON metas."""
    tensors: dict[str, torch.Tensor] = {}
    metas = []
    for k, opt in enumerate(optimizers):
        flat, meta = flatten_optimizer_state(opt.state_dict())
        tensors.update({f"opt{k}.{name}": t.cpu() for name, t in flat.items()})
        metas.append({**meta, "class": _class_name(opt)})
    return tensors, metas


def load_optimizer_state(
    optimizers: list[torch.optim.Optimizer], tensors: dict[str, torch.Tensor], metas: list[dict], where: Path
) -> None:
    """Load saved moments into `optimizers`, keeping their current hyperparameters (the config decides those)."""
    if len(metas) != len(optimizers):
        raise StemlmError(f"{where} holds {len(metas)} optimizer states but this run builds {len(optimizers)}")
    for k, (opt, meta) in enumerate(zip(optimizers, metas, strict=True)):
        if meta.get("class") != _class_name(opt):
            raise StemlmError(
                f"{where}: optimizer {k} was {meta.get('class')}, this run builds {_class_name(opt)} "
                "(was --table-optim changed?)"
            )
        names = [g.get("name") for g in opt.param_groups]
        saved = [g.get("name") for g in meta["param_groups"]]
        sizes, saved_sizes = (
            [len(g["params"]) for g in opt.param_groups],
            [len(g["params"]) for g in meta["param_groups"]],
        )
        if names != saved or sizes != saved_sizes:
            raise StemlmError(
                f"{where}: optimizer {k} has groups {list(zip(saved, saved_sizes, strict=True))}, this run builds "
                f"{list(zip(names, sizes, strict=True))}; the model or optimizer layout changed"
            )
        hyper = [{key: v for key, v in g.items() if key != "params"} for g in opt.param_groups]
        prefix = f"opt{k}."
        # Cloned into fresh, aligned memory rather than views into the file buffer (see Trainer._build_model).
        own = {name[len(prefix) :]: t.clone() for name, t in tensors.items() if name.startswith(prefix)}
        if not own and any(p.requires_grad for g in opt.param_groups for p in g["params"]):
            raise StemlmError(f"{where / OPTIMIZER_NAME} holds no state of optimizer {k}; it belongs to another run")
        saved_state = unflatten_optimizer_state(own, meta)
        for group, h in zip(saved_state["param_groups"], hyper, strict=True):
            group.update(h)  # before loading: torch places AdamW's step on the device when this run is `fused`
        try:
            opt.load_state_dict(saved_state)
        except (ValueError, KeyError, RuntimeError) as exc:
            raise StemlmError(f"{where}: optimizer {k} state does not fit this run ({exc})") from None
        _check_state_shapes(getattr(opt, "inner", opt), k, where)
        for group, h in zip(opt.param_groups, hyper, strict=True):
            group.update(h)


def _check_state_shapes(opt: torch.optim.Optimizer, k: int, where: Path) -> None:
    """Every loaded state entry must belong to a parameter of this run and match its shape (a moment: the
    parameter's shape; a row-wise statistic: its leading dims), with the same entries for every parameter; else
    the state is another model's (e.g. a dense run's in a STEM checkpoint) and would fail deep inside a step."""
    params = [p for g in opt.param_groups for p in g["params"]]
    names = None
    for key, entry in opt.state.items():
        if not isinstance(key, torch.Tensor):
            raise StemlmError(
                f"{where / OPTIMIZER_NAME}: optimizer {k} holds state for parameter {key}, which this run does not "
                "have; the optimizer state belongs to another model"
            )
        index = next(i for i, p in enumerate(params) if p is key)
        names = sorted(entry) if names is None else names
        if sorted(entry) != names:
            raise StemlmError(
                f"{where / OPTIMIZER_NAME}: optimizer {k} parameter {index} has state {sorted(entry)}, others "
                f"{names}; the optimizer state is incomplete or another model's"
            )
        for name, value in entry.items():
            if isinstance(value, torch.Tensor) and value.ndim and tuple(value.shape) != tuple(key.shape)[: value.ndim]:
                raise StemlmError(
                    f"{where / OPTIMIZER_NAME}: optimizer {k} state {name} of parameter {index} has shape "
                    f"{list(value.shape)}, the parameter {list(key.shape)}; the state belongs to another model"
                )


def _class_name(opt) -> str:
    # A host-table optimizer (stemlm.placement.host) wraps the table optimizer; checkpoints name the inner
    # one, so a run can resume with its tables on the device or on the host.
    return type(getattr(opt, "inner", opt)).__name__


# ----- save / load -----
def save_checkpoint(
    run_dir: str | Path,
    step: int,
    model,
    tokenizer,
    optimizers: list[torch.optim.Optimizer],
    state: dict[str, Any],
    keep_last: int,
    keep_optimizer_state: str = "newest",
) -> Path:
    """Write RUN/checkpoints/step-<step>/ atomically, point latest.json at it, prune to `keep_last`.

    With `keep_optimizer_state="newest"` the optimizer state of every other checkpoint is then deleted."""
    target = checkpoint_dir(run_dir, step)
    tensors, metas = optimizer_state(optimizers)
    payload = {**state, "format": STATE_FORMAT, "step": step, "optimizers": metas, "rng": capture_rng()}
    with AtomicFolder(target, producer=TRAIN_PRODUCER, owned=True) as tmp:
        write_model_files(model, tmp, tokenizer)
        save_file(tensors, str(tmp / OPTIMIZER_NAME), metadata={"format": "pt"})
        write_json(tmp / STATE_NAME, payload)
    write_latest(Path(run_dir), step)
    prune_checkpoints(Path(run_dir), keep_last, written=step)
    if keep_optimizer_state == "newest":
        drop_optimizer_state(Path(run_dir), keep=target)
    return target


def drop_optimizer_state(run_dir: Path, keep: Path) -> None:
    """Delete optimizer.safetensors from every step folder but `keep` (their weights stay loadable).

    The folder's manifest loses the entry first, so `stemlm verify` still passes (a kill in between leaves
    the file merely unrecorded, never a recorded file missing)."""
    folder = run_dir / CHECKPOINTS_DIR
    # A sharded checkpoint's optimizer state is each rank's second DCP file (stemlm.train.parallel.checkpoint).
    paths = [*folder.glob(f"step-*/{OPTIMIZER_NAME}"), *folder.glob(f"step-*/{SHARDED_OPTIMIZER_FILES}")]
    for path in paths:
        ckpt = path.parent if path.name == OPTIMIZER_NAME else path.parent.parent
        if ckpt == keep:
            continue
        manifest = read_manifest(ckpt)
        name = path.relative_to(ckpt).as_posix()
        if manifest is not None and manifest["files"].pop(name, None) is not None:
            atomic_write_text(ckpt / MANIFEST_NAME, json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        path.unlink(missing_ok=True)


def write_latest(run_dir: Path, step: int) -> None:
    """Replace checkpoints/latest.json atomically (temp file, fsync, rename)."""
    text = json.dumps({"step": step, "path": checkpoint_dir(run_dir, step).name})
    atomic_write_text(run_dir / CHECKPOINTS_DIR / LATEST_NAME, text)


def prune_checkpoints(run_dir: Path, keep_last: int, written: int | None = None) -> None:
    """Keep the newest `keep_last` step folders up to the one just `written`; remove leftovers of killed saves.

    Folders past `written` are left alone: after a resume from an older step they belong to the abandoned
    branch (the live branch replaces them as it reaches them), and the folder just written is never removed.
    """
    folder = run_dir / CHECKPOINTS_DIR
    steps = sorted((int(m.group(1)), p) for p in folder.iterdir() if (m := STEP_DIR.match(p.name)) and p.is_dir())
    history = [(n, p) for n, p in steps if written is None or n <= written]
    for _, path in history[:-keep_last]:
        shutil.rmtree(path, ignore_errors=True)
    # An interrupted save's temp folder, an `.X.old` whose replacement is in place, a pointer's temp file.
    # An `.X.old` without X is the only copy left by a kill mid-swap (load_config names it): kept.
    old = [p.name for p in folder.glob(".step-*.old") if not (folder / p.name[1:].removesuffix(".old")).is_dir()]
    remove_leftovers(folder, [".step-*.tmp-*", f".{LATEST_NAME}.tmp-*"])
    for path in folder.glob(".step-*.old"):
        if path.name not in old:
            shutil.rmtree(path, ignore_errors=True)


# (key, type, description) every trainer_state.json must satisfy before the trainer trusts it.
STATE_FIELDS = [
    ("step", int, "a non-negative integer"),
    ("skipped_steps", int, "a non-negative integer"),
    ("loss_spikes", int, "a non-negative integer"),
    ("spike_window", list, "a list of numbers"),
    ("rng", dict, "an object"),
    ("optimizers", list, "a list"),
    ("config", dict, "an object"),
]


def read_state_json(ckpt: Path) -> dict[str, Any]:
    """The trainer_state.json of a trainer checkpoint folder, with actionable errors."""
    path = ckpt / STATE_NAME
    if not path.is_file():
        raise StemlmError(
            f"{ckpt} has no {STATE_NAME}: it is a model checkpoint, not a trainer checkpoint; "
            f"start from its weights with --init-from {ckpt}"
        )
    try:
        state = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise StemlmError(f"{path} is corrupt ({exc})") from None
    if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
        raise StemlmError(f"{path} is not a {STATE_FORMAT} file")
    return state


def read_resumable_state(ckpt: Path) -> dict[str, Any]:
    """`read_state_json` plus the type checks a resume relies on (a hand-edited file fails in one line)."""
    state = read_state_json(ckpt)
    path = ckpt / STATE_NAME
    for key, kind, what in STATE_FIELDS:
        value = state.get(key)
        if not isinstance(value, kind) or isinstance(value, bool) or (kind is int and value < 0):
            raise StemlmError(f"{path}: {key!r} must be {what}, got {value!r:.60}; the file was edited or damaged")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in state["spike_window"]):
        raise StemlmError(f"{path}: 'spike_window' must be a list of numbers; the file was edited or damaged")
    if not isinstance(state["config"].get("train"), dict):
        raise StemlmError(f"{path}: 'config' has no 'train' object; the file was edited or damaged")
    return state


def read_trainer_state(ckpt: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(JSON state, optimizer tensors) of a trainer checkpoint folder."""
    state = read_state_json(ckpt)
    if not (ckpt / OPTIMIZER_NAME).exists():
        raise StemlmError(
            f"{ckpt} holds no optimizer state to resume from: only a run's newest checkpoint keeps it (train with "
            f"--set train.keep_optimizer_state=all to keep it in every one); resume from the newest checkpoint, "
            f"or start from these weights with --init-from {ckpt}"
        )
    try:
        tensors = load_file(str(ckpt / OPTIMIZER_NAME))
    except (SafetensorError, OSError) as exc:
        raise StemlmError(f"{ckpt / OPTIMIZER_NAME} is missing or corrupt ({exc})") from None
    return state, tensors


# ----- the identity of the training data -----
def data_digest(train) -> str | None:
    """What the run trains on, cheaply: a prepared folder's manifest digest (it holds every shard's sha256), or
    raw text's token-shard content key (sha256 of tokenizer, separator and every training document: the file
    name `stemlm.data.shards` gives it). Nothing is re-read or re-hashed. None for a dataset of another kind."""
    from stemlm.data.stream import is_prepared, manifest_digest

    path = getattr(train, "path", None)
    if path is None:
        return None
    path = Path(path)
    if path.is_dir() and is_prepared(path):
        return f"shards:{manifest_digest(path)}"
    if path.name.endswith(".bin"):
        return f"text:{path.name.split('.')[0]}"
    return None


def check_same_data(saved: str | None, current: str | None, ckpt: Path) -> None:
    """Refuse to resume a run on other data than its checkpoint was trained on (when both are known)."""
    if saved is None or current is None or saved == current:
        return
    raise StemlmError(
        f"{ckpt} was trained on other data (digest {saved}) than this run reads now ({current}): the resumed run "
        "would not continue the same one. Resume with the run's --data, or start a new run from these weights "
        f"with --init-from {ckpt}"
    )
