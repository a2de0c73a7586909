"""Table providers: where the token tables live, behind one narrow interface that reads token-major rows.

A provider knows the table layers (ascending), their widths and dtype, and answers one question:
`gather(ids) -> [N, row_width]`, the rows of `ids` (an int64 CPU tensor) in every table layer, concatenated
in layer order ("token-major"). `layer_slices` says which columns belong to which layer. That is all the
cache and the engine use, so another backend (e.g. FBGEMM's table-batched embeddings) can slot in.

- `ResidentProvider`: the model's own tables on the compute device (the baseline; the engine then lets the
  model look rows up itself).
- `HostProvider`: tables in host memory; layout "token" stores one [V, W] matrix so a token's rows for all
  layers are one contiguous read, layout "layer" keeps one [V, w] per layer. The tables themselves are never
  pinned: they are no DMA source (a gather copies the rows into a staging buffer, and that buffer, pinned
  when CUDA is present, is what the device copy reads), and pinned allocations are page-locked and rounded
  up by the caching host allocator (a 21 GB table would lock 32 GiB).
- `MmapProvider`: tables memory-mapped straight from the safetensors files (larger than RAM is fine); the
  header is parsed here (8-byte little-endian length, JSON with dtype / shape / data_offsets), no pickle.

`stemlm.placement.load.load_offloaded_model(dir, "host" | "mmap")` builds the model on the meta device,
checks every weights file's header (a truncated or missing file is named before any weight is read), loads
everything but the tables onto the device and leaves each table parameter a meta placeholder, so the tables
never occupy device memory.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError, safe_open

from stemlm.checkpoint.runs import fill_model
from stemlm.errors import StemlmError
from stemlm.model.decoder import StemLM

# safetensors dtype -> (numpy storage dtype, torch dtype); bf16 is stored as uint16 and reinterpreted.
SAFETENSORS_DTYPES = {
    "F64": (np.float64, torch.float64),
    "F32": (np.float32, torch.float32),
    "F16": (np.float16, torch.float16),
    "BF16": (np.uint16, torch.bfloat16),
    "I8": (np.int8, torch.int8),  # the codes of int8 tables (stemlm.checkpoint.table_storage), read with their scales
}
ROW_BLOCK = 4096  # rows copied per block when loading tables into RAM (bounds the temporary memory)


@dataclass(frozen=True)
class TensorEntry:
    path: Path
    dtype: str
    shape: tuple[int, ...]
    offset: int  # absolute byte offset of the data in the file
    nbytes: int


def read_safetensors_header(path: str | Path) -> dict[str, TensorEntry]:
    """Parse a safetensors header and check every tensor's byte range lies inside the file."""
    path = Path(path)
    if not path.is_file():
        raise StemlmError(f"table file {path} does not exist")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise StemlmError(f"{path} is truncated: {size} bytes, too short for a safetensors header")
        (header_len,) = struct.unpack("<Q", head)
        if 8 + header_len > size:
            raise StemlmError(f"{path} is truncated: header claims {header_len} bytes, the file has {size}")
        try:
            header = json.loads(f.read(header_len))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise StemlmError(f"{path} has a corrupt safetensors header ({exc})") from None
    if not isinstance(header, dict):
        raise StemlmError(f"{path} has a corrupt safetensors header (not a JSON object)")
    entries = {}
    data_start = 8 + header_len
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], tuple(int(x) for x in info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise StemlmError(f"{path}: header entry {name!r} is malformed") from None
        if data_start + end > size:
            raise StemlmError(
                f"{path} is truncated: tensor {name} needs bytes up to {data_start + end}, the file has {size}"
            )
        entries[name] = TensorEntry(path, dtype, shape, data_start + begin, end - begin)
    return entries


def memmap_entry(entry: TensorEntry) -> np.memmap:
    """A read-only numpy view of one tensor's bytes (no read happens until rows are indexed)."""
    if entry.dtype not in SAFETENSORS_DTYPES:
        raise StemlmError(f"{entry.path}: table dtype {entry.dtype} is not supported (use F32, F16, BF16 or I8)")
    np_dtype = SAFETENSORS_DTYPES[entry.dtype][0]
    if entry.nbytes != int(np.prod(entry.shape)) * np.dtype(np_dtype).itemsize:
        raise StemlmError(f"{entry.path}: header says {entry.nbytes} bytes for {entry.dtype} {list(entry.shape)}")
    return np.memmap(entry.path, dtype=np_dtype, mode="r", offset=entry.offset, shape=entry.shape)


def _as_torch(array: np.ndarray, dtype_name: str) -> torch.Tensor:
    if not array.flags.writeable:  # a slice of the read-only map: copy (torch refuses read-only arrays)
        array = np.array(array)
    return torch.from_numpy(np.ascontiguousarray(array)).view(SAFETENSORS_DTYPES[dtype_name][1])


class TableProvider:
    """Base: table layers, widths and dtype; subclasses implement `gather`."""

    def __init__(self, vocab_size: int, layers: list[int], widths: list[int], dtype: torch.dtype) -> None:
        if not layers:
            raise StemlmError("this model has no token tables to provide (no layer's kind has a `token` table)")
        self.vocab_size, self.layers, self.widths, self.dtype = vocab_size, tuple(layers), tuple(widths), dtype
        offsets = np.cumsum([0, *widths]).tolist()
        self.layer_slices = {layer: (offsets[k], widths[k]) for k, layer in enumerate(layers)}
        self.row_width = offsets[-1]
        self.pin = False

    @property
    def row_bytes(self) -> int:
        return self.row_width * torch.empty((), dtype=self.dtype).element_size()

    @property
    def table_bytes(self) -> int:
        return self.vocab_size * self.row_bytes

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _output(self, n: int) -> torch.Tensor:
        return torch.empty(n, self.row_width, dtype=self.dtype, pin_memory=self.pin)


class ResidentProvider(TableProvider):
    """The model's own tables, wherever the model put them (normally the compute device)."""

    def __init__(self, model) -> None:
        tables = model.token_tables()
        layers = sorted(tables)
        weights = [tables[i].weight for i in layers]
        dtype = weights[0].dtype if weights else torch.float32
        super().__init__(model.config.vocab_size, layers, [w.shape[1] for w in weights], dtype)
        self.weights = weights

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.to(self.weights[0].device)
        return torch.cat([w.detach().index_select(0, ids) for w in self.weights], dim=1)


class HostProvider(TableProvider):
    """Tables in host memory: one token-major [V, W] matrix (layout "token") or one [V, w] per layer ("layer").

    `tables` maps layer -> a CPU tensor or a `TensorEntry` of a safetensors file; entries are read block by
    block straight into the final buffer, so loading never holds two copies of a table. `pin` pins the
    staging buffer each `gather` returns (the source of the host->device copy), never the tables.
    """

    def __init__(
        self,
        tables: dict[int, torch.Tensor | TensorEntry],
        layout: str = "token",
        pin: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        if layout not in ("token", "layer"):
            raise StemlmError(f"unknown host table layout {layout!r}; choose 'token' or 'layer'")
        layers = sorted(tables)
        sources = [memmap_entry(t) if isinstance(t, TensorEntry) else t for t in (tables[i] for i in layers)]
        names = [t.dtype if isinstance(t, TensorEntry) else None for t in (tables[i] for i in layers)]
        stored = [t.dtype if n is None else SAFETENSORS_DTYPES[n][1] for t, n in zip(sources, names, strict=True)]
        vocab = sources[0].shape[0] if sources else 0
        super().__init__(vocab, layers, [t.shape[1] for t in sources], dtype or (stored or [torch.float32])[0])
        self.layout, self.pin = layout, pin
        self.matrix, self.tables = None, []
        if layout == "token":
            self.matrix = torch.empty(self.vocab_size, self.row_width, dtype=self.dtype)
        for layer, source, name in zip(layers, sources, names, strict=True):
            offset, width = self.layer_slices[layer]
            if layout == "token":
                dest = self.matrix[:, offset : offset + width]
            else:
                dest = torch.empty(self.vocab_size, width, dtype=self.dtype)
                self.tables.append(dest)
            for start in range(0, self.vocab_size, ROW_BLOCK):
                block = source[start : start + ROW_BLOCK]
                dest[start : start + ROW_BLOCK] = block if name is None else _as_torch(block, name)

    @property
    def host_bytes(self) -> int:
        return self.table_bytes

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        out = self._output(ids.numel())
        if self.layout == "token":
            return torch.index_select(self.matrix, 0, ids, out=out)
        for layer, table in zip(self.layers, self.tables, strict=True):
            offset, width = self.layer_slices[layer]
            out[:, offset : offset + width] = table.index_select(0, ids)
        return out


class MmapProvider(TableProvider):
    """Tables read on demand from memory-mapped safetensors files (the OS page cache is the host tier)."""

    def __init__(self, entries: dict[int, TensorEntry], dtype: torch.dtype | None = None, pin: bool = False) -> None:
        layers = sorted(entries)
        self.arrays = [memmap_entry(entries[i]) for i in layers]
        self.dtype_names = [entries[i].dtype for i in layers]
        stored = SAFETENSORS_DTYPES[self.dtype_names[0]][1] if layers else torch.float32
        vocab = self.arrays[0].shape[0] if layers else 0
        super().__init__(vocab, layers, [a.shape[1] for a in self.arrays], dtype or stored)
        self.pin = pin

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        out = self._output(ids.numel())
        index = ids.numpy()
        for layer, array, name in zip(self.layers, self.arrays, self.dtype_names, strict=True):
            offset, width = self.layer_slices[layer]
            out[:, offset : offset + width] = _as_torch(array[index], name)
        return out


# ----------------------------------------------------------------------------------------------------------
# loading a checkpoint with its tables placed
# ----------------------------------------------------------------------------------------------------------
def device_parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters that are really allocated (meta placeholders excluded; tied weights once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta)


def table_parameter_names(model: StemLM) -> dict[int, str]:
    names = {id(p): n for n, p in model.named_parameters()}
    return {layer: names[id(table.weight)] for layer, table in model.token_tables().items()}


def checkpoint_entries(files: list[Path]) -> dict:
    """Every tensor entry of a checkpoint's safetensors files, by name (headers only, no weight is read)."""
    entries = {}
    for f in files:  # every header first: a truncated file fails here, before any weight is read
        entries.update(read_safetensors_header(f))
    return entries


def checked_tables(directory: Path, entries: dict, model, names: dict[int, str]) -> dict:
    """The entries of the table tensors `names` (layer -> name), each checked against the model's shape."""
    placed = {}
    for layer, name in names.items():
        if name not in entries:
            raise StemlmError(f"checkpoint {directory} has no table tensor {name}")
        expected = tuple(model.get_parameter(name).shape)
        if entries[name].shape != expected:
            raise StemlmError(
                f"checkpoint {directory}: table {name} has shape {list(entries[name].shape)}, "
                f"config.json implies {list(expected)}"
            )
        placed[layer] = entries[name]
    return placed


def _load_backbone(model: StemLM, directory, files, skip: set[str], device: torch.device, dtype) -> None:
    # `skip`: the offloaded tables (and the scales of int8 ones), which stay meta placeholders
    state = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt", device=str(device)) as reader:
                for name in reader.keys():
                    if name not in skip:
                        state[name] = reader.get_tensor(name)
        except (SafetensorError, OSError, ValueError) as exc:
            raise StemlmError(f"weights file {f} is corrupt or truncated ({exc})") from None
    fill_model(model, state, directory, skip=skip, device=device, dtype=dtype)
