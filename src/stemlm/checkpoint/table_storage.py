"""Compact lookup tables: the row formats (fp32, bf16, row-wise int8) and how a checkpoint stores them.

    codes, scale = quantize_rows(rows)                  # rows [N, w] -> int8 [N, w], fp32 [N]
    state, record = compact_state(state, names, "int8")  # what `stemlm convert CKPT --table-dtype int8` writes
    state = expand_state(state, record)                  # what every loader does first: fp32 tables again

int8 is symmetric per row: scale = max|row| / 127, code = round(row / scale) in [-127, 127], and a row reads
back as code x scale, so each element is off by at most scale / 2 (FBGEMM's row-wise 8-bit format keeps a
scale and a bias per row; one scale suffices for the zero-centred STEM rows and keeps 0 exact).

Checkpoint layout of a compact checkpoint (everything else is the ordinary format of `stemlm.checkpoint.folder`):

    config.json          + "stemlm_table_storage": {"dtype": "int8", "tensors": [names...], "scale_suffix":
                           "_scale", "scheme": ...}; the names are the lookup tables (STEM, n-gram, memory)
    model.safetensors    each listed table `NAME` as int8 [V, w] (bf16: BF16 [V, w]) and, for int8, its
                         per-row scales `NAME_scale` as F32 [V]; the file's metadata has
                         "stemlm_table_dtype": "int8"

`read_storage(dir)` returns that record (None for an ordinary checkpoint) after checking it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from stemlm.choices import COMPACT_TABLE_DTYPES, TABLE_DTYPES
from stemlm.errors import StemlmError

STORAGE_KEY = "stemlm_table_storage"
SCALE_SUFFIX = "_scale"
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}
SCHEME = "int8: symmetric per row, value = code * scale, scale (F32, one per row) = max|row| / 127; bf16: cast"


def check_table_dtype(name: str) -> str:
    if name not in TABLE_DTYPES:
        raise StemlmError(f"unknown table dtype {name!r}; choose one of {', '.join(TABLE_DTYPES)}")
    return name


def quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 codes [N, w] and fp32 scales [N] of `rows` [N, w]."""
    rows = rows.float()
    scale = rows.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row: any scale reads back zeros
    codes = torch.round(rows / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes, scale


def dequantize_rows(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (codes.float() * scale[:, None].float()).to(dtype)


def round_rows(rows: torch.Tensor, table_dtype: str) -> torch.Tensor:
    """`rows` as they read back after storing them as `table_dtype`, in the rows' own dtype."""
    if check_table_dtype(table_dtype) == "int8":
        return dequantize_rows(*quantize_rows(rows), rows.dtype)
    return rows.to(TORCH_DTYPES[table_dtype]).to(rows.dtype)


# ----------------------------------------------------------------------------------------------------------
# checkpoint layout
# ----------------------------------------------------------------------------------------------------------
def compact_state(
    state: dict[str, torch.Tensor], names: list[str], table_dtype: str
) -> tuple[dict[str, torch.Tensor], dict]:
    """`state` with the tables `names` stored as `table_dtype` (int8: codes plus `NAME_scale`), and the record
    config.json gets under STORAGE_KEY. Each table is quantised on its own, row by row."""
    check_table_dtype(table_dtype)
    if table_dtype == "fp32":
        raise StemlmError("fp32 is the ordinary checkpoint format; choose --table-dtype bf16 or int8")
    out = dict(state)
    for name in names:
        if name not in state:
            raise StemlmError(f"no table tensor {name} to store compactly")
        table = state[name]
        if table.dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
            raise StemlmError(f"table {name} is already stored as {table.dtype}; convert from an fp32 checkpoint")
        if table_dtype == "bf16":
            out[name] = table.to(torch.bfloat16).contiguous()
        else:
            out[name], out[name + SCALE_SUFFIX] = quantize_rows(table)
    record = {"dtype": table_dtype, "tensors": sorted(names), "scale_suffix": SCALE_SUFFIX, "scheme": SCHEME}
    return out, record


def read_storage(directory: str | Path) -> dict | None:
    """The compact-table record of a checkpoint's config.json, checked; None for an ordinary checkpoint."""
    path = Path(directory) / "config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None  # the config loader names that problem
    record = data.get(STORAGE_KEY) if isinstance(data, dict) else None
    if record is None:
        return None
    ok = (
        isinstance(record, dict)
        and record.get("dtype") in COMPACT_TABLE_DTYPES
        and isinstance(record.get("tensors"), list)
        and all(isinstance(n, str) for n in record["tensors"])
        and record.get("scale_suffix", SCALE_SUFFIX) == SCALE_SUFFIX
    )
    if not ok:
        raise StemlmError(f"{path}: {STORAGE_KEY} is malformed (expected dtype bf16|int8 and a list of tensors)")
    return record


def expand_state(
    state: dict[str, torch.Tensor], record: dict | None, where: str | Path = "checkpoint"
) -> dict[str, torch.Tensor]:
    """`state` with every compact table of `record` back in fp32 (int8: code x scale; the scales removed)."""
    if record is None:
        return state
    out = dict(state)
    for name in record["tensors"]:
        if name not in out:
            raise StemlmError(f"{where}: compact table {name} listed in config.json is missing from the weights")
        if record["dtype"] == "bf16":
            out[name] = out[name].float()
            continue
        scale = out.pop(name + SCALE_SUFFIX, None)
        codes = out[name]
        if scale is None or codes.dtype != torch.int8 or tuple(scale.shape) != (codes.shape[0],):
            raise StemlmError(
                f"{where}: int8 table {name} needs int8 codes [V, w] and F32 scales {name}{SCALE_SUFFIX} [V]"
            )
        out[name] = dequantize_rows(codes, scale)
    return out
