"""`stemlm convert CKPT --table-dtype bf16|int8 --out DIR`: a copy of a checkpoint with compact lookup tables.

    convert_tables("runs/tiny", "int8", "ckpt/tiny-int8")

Every lookup table of the model (STEM / PLE token tables, n-gram tables, memory values) is stored as bf16 or
row-wise int8 (`stemlm.checkpoint.table_storage`: layout recorded in config.json and in the safetensors metadata); every
other tensor, the tokenizer and the chat files are copied unchanged. Loading: every CKPT command reads it
(`stemlm.checkpoint.folder.read_state` dequantises to fp32); `--tables host|mmap` keep the rows compact (host memory
or the mapped file holds the int8 codes and scales), so the bytes per decoded row stay small. Training
starts from one only with `--init-from` (the tables start as the dequantised rows); a run never resumes
from one (`stemlm.train.trainer`). A checkpoint that is already compact is read dequantised and stored again.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from stemlm.checkpoint.folder import (
    CONFIG_NAME,
    SPECIAL_TOKENS_MAP_NAME,
    TOKENIZER_CONFIG_NAME,
    TOKENIZER_NAME,
    read_json_object,
    read_state,
    write_json,
    write_weights,
)
from stemlm.checkpoint.safe_write import AtomicFolder, check_target
from stemlm.checkpoint.table_storage import STORAGE_KEY, compact_state
from stemlm.errors import StemlmError

PRODUCER = "stemlm convert"  # the same producer as the retrofit: --force may replace either's output
COPIED = (TOKENIZER_NAME, TOKENIZER_CONFIG_NAME, SPECIAL_TOKENS_MAP_NAME, "generation_config.json")


def lookup_table_names(config) -> list[str]:
    """Parameter names of every lookup table (token, n-gram, memory) of a model with `config`."""
    from stemlm.model.decoder import StemLM
    from stemlm.offload.families import table_families

    with torch.device("meta"):
        model = StemLM(config)
    return sorted(name for layers in table_families(model).values() for name in layers.values())


def convert_tables(source: str | Path, table_dtype: str, out: str | Path, *, force: bool = False) -> Path:
    """Write the checkpoint `source` (or a run's newest) to `out` with its lookup tables as `table_dtype`."""
    from stemlm.checkpoint.folder import load_config
    from stemlm.checkpoint.runs import resolve_checkpoint

    folder = resolve_checkpoint(source)
    guard = {"producer": PRODUCER, "force": force, "sources": [Path(source), folder]}
    check_target(out, **guard)
    config = load_config(folder)
    names = lookup_table_names(config)
    if not names:
        raise StemlmError(f"checkpoint {folder} has no lookup tables (ffn={config.ffn}); nothing to store compactly")
    state, record = compact_state(read_state(folder), names, table_dtype)
    raw = read_json_object(folder / CONFIG_NAME)
    raw[STORAGE_KEY] = record
    with AtomicFolder(out, **guard) as tmp:
        write_json(tmp / CONFIG_NAME, raw)
        write_weights(tmp, {k: v.contiguous() for k, v in state.items()}, metadata={"stemlm_table_dtype": table_dtype})
        for name in COPIED:
            if (folder / name).is_file():
                shutil.copyfile(folder / name, tmp / name)
    return Path(out)
