"""Sharded checkpoints (torch.distributed.checkpoint in safetensors files): checked and read in one process.

    CKPT/                           written by `stemlm train --nproc N` (stemlm.train.parallel.checkpoint)
        config.json, tokenizer.json     the model-core files, small (rank 0)
        trainer_state.json              counters, RNG, optimizer param groups, data digest (rank 0)
        dcp/shard-0000k-model-00001-of-00001.safetensors
                                        rank k-1's pieces: keys `model/<HF name>` (weights; a table row block,
                                        an FSDP2 shard or, once, a replicated tensor) and `optim/opt<j>.state.…`
                                        (optimizer state); each piece's offset in its tensor is in the file's
                                        safetensors header (DCP's HuggingFaceStorageWriter)
        stemlm-manifest.json            SHA-256 of every file above

No file is ever unpickled: DCP's default format keeps its metadata in a pickled `.metadata` file, which a
loader would have to trust, so these checkpoints use DCP's safetensors storage instead, whose metadata is
the JSON header of each safetensors file (read by `HuggingFaceStorageReader`, which never unpickles). Before
any read, `sharded_metadata` checks that the folder holds exactly the `dcp/` files its manifest recorded,
each at its recorded size (a missing or extra file would silently drop or inject pieces), and that the
pieces of every tensor cover it exactly; `verify=True` also re-hashes them (`stemlm export` does).
`read_sharded_state` assembles full tensors on the CPU (DCP `no_dist` load): `stemlm export` writes them as
a model folder, `stemlm.checkpoint.folder.read_state` (every CKPT command) and a 1-process resume read them directly.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import torch

from stemlm.checkpoint.names import WEIGHTS_NAME
from stemlm.checkpoint.safe_write import read_manifest, sha256_file
from stemlm.errors import StemlmError

DCP_DIR = "dcp"
MODEL_PREFIX = "model/"
OPTIM_PREFIX = "optim/"
SUFFIX = ".safetensors"


def is_sharded(folder: str | Path) -> bool:
    """Whether `folder` is a sharded checkpoint (a `dcp/` folder and no model.safetensors)."""
    folder = Path(folder)
    return (folder / DCP_DIR).is_dir() and not (folder / WEIGHTS_NAME).exists()


def _check_files(folder: Path, verify: bool) -> None:
    manifest = read_manifest(folder)
    if manifest is None:
        raise StemlmError(f"{folder} has no readable stemlm-manifest.json; a sharded checkpoint cannot be checked")
    recorded = {name: entry for name, entry in manifest["files"].items() if name.startswith(f"{DCP_DIR}/")}
    present = {p.relative_to(folder).as_posix() for p in (folder / DCP_DIR).iterdir() if p.is_file()}
    if not recorded:
        raise StemlmError(f"{folder}: its manifest records no {DCP_DIR}/ files; not a sharded stemlm checkpoint")
    for name in sorted(recorded):
        entry = recorded[name]
        if name not in present:
            raise StemlmError(f"{folder} is missing {name} (recorded in its manifest); the checkpoint is incomplete")
        if not isinstance(entry, dict) or (folder / name).stat().st_size != entry.get("bytes"):
            raise StemlmError(f"{folder / name} does not have the size its manifest records; the file is damaged")
        if verify and sha256_file(folder / name) != entry.get("sha256"):
            raise StemlmError(f"{folder / name} does not match its SHA-256 in the manifest; the file is damaged")
    extra = sorted(present - set(recorded))
    if extra:
        raise StemlmError(f"{folder} holds {extra[0]}, which its manifest does not record; not reading it")


def sharded_metadata(folder: str | Path, *, verify: bool = False):
    """(reader, DCP metadata) of a sharded checkpoint, after the checks of the module docstring."""
    from safetensors import SafetensorError
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    folder = Path(folder)
    _check_files(folder, verify)
    reader = HuggingFaceStorageReader(str(folder / DCP_DIR))
    try:
        metadata = reader.read_metadata()
    except (SafetensorError, OSError, ValueError, KeyError, TypeError) as exc:
        raise StemlmError(f"{folder / DCP_DIR} is corrupt ({type(exc).__name__}: {exc})") from None
    for key, meta in metadata.state_dict_metadata.items():
        size = tuple(meta.size)
        covered = 0
        for chunk in meta.chunks:
            inside = all(o + s <= n for o, s, n in zip(chunk.offsets, chunk.sizes, size, strict=True))
            if not inside:
                raise StemlmError(f"{folder / DCP_DIR}: a piece of {key} lies outside its shape {list(size)}")
            covered += math.prod(chunk.sizes)
        if covered != math.prod(size):
            raise StemlmError(
                f"{folder / DCP_DIR}: the pieces of {key} hold {covered} of its {math.prod(size)} values; "
                "the checkpoint is incomplete"
            )
    return reader, metadata


def load_pieces(template: dict[str, torch.Tensor], reader) -> None:
    """DCP-load the saved values of `template`'s keys into its tensors, in this process alone."""
    import torch.distributed.checkpoint as dcp
    from safetensors import SafetensorError

    with warnings.catch_warnings():
        # torch warns that it "assumes the intent is to load in a single process" even when told so (2.13).
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        try:
            dcp.load(template, storage_reader=reader, no_dist=True)
        except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
            raise StemlmError(f"cannot read {reader.path} ({type(exc).__name__}: {exc})") from None


def read_sharded_state(folder: str | Path, *, verify: bool = False) -> dict[str, torch.Tensor]:
    """Every weight of a sharded checkpoint as a full CPU tensor, keyed by its HF name (model files' keys)."""
    reader, metadata = sharded_metadata(folder, verify=verify)
    template = {
        key: torch.empty(tuple(meta.size), dtype=meta.properties.dtype)
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith(MODEL_PREFIX)
    }
    if not template:
        raise StemlmError(f"{Path(folder) / DCP_DIR} holds no model weights")
    load_pieces(template, reader)
    return {key.removeprefix(MODEL_PREFIX): value for key, value in template.items()}
