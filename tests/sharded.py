"""A sharded checkpoint written in one process, for the tests of its readers (`stemlm export`, `read_state`).

`write_sharded(model, folder, tokenizer)` writes the layout of `stemlm.checkpoint.sharded` with DCP's safetensors
writer and no process group: config.json, tokenizer.json, and the weights split over two "ranks"' files
(dcp/shard-00001-... holds the embedding, the rest goes to file 2), recorded in the folder's manifest.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch.distributed.checkpoint as dcp

from stemlm.checkpoint.folder import model_state_for_saving, write_model_config
from stemlm.checkpoint.safe_write import AtomicFolder
from stemlm.checkpoint.sharded import DCP_DIR, MODEL_PREFIX


def write_sharded(model, folder: Path, tokenizer=None) -> Path:
    pieces = {f"{MODEL_PREFIX}{k}": v for k, v in model_state_for_saving(model).items()}
    mapping = {key: 1 if "embed_tokens" in key else 2 for key in pieces}
    with AtomicFolder(folder, producer="stemlm train", owned=True) as tmp:
        write_model_config(model.config, tmp, tokenizer)
        writer = dcp.HuggingFaceStorageWriter(str(tmp / DCP_DIR), fqn_to_index_mapping=mapping, save_distributed=True)
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(pieces, storage_writer=writer, no_dist=True)
    return folder
