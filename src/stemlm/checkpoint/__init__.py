"""The checkpoint layer: the model folder format and everything that reads or writes it.

Modules: `folder` (config.json + safetensors weights, `save_pretrained`, the state readers), `sharded` (the
DCP pieces `stemlm train --nproc N` writes), `table_storage` (compact int8/bf16 rows), `safe_write` (atomic
folders, manifests, SHA-256 sums), `llama` (reading a Hugging Face Llama folder), `runs` (a CKPT argument:
checkpoint folder or run folder, and `load_checkpoint` / `from_pretrained`, the loaders every command uses).
Names load lazily:

    from stemlm.checkpoint import from_pretrained, load_checkpoint, save_pretrained
"""

from stemlm._lazy import lazy_exports

_EXPORTS = {
    "save_pretrained": "stemlm.checkpoint.folder",
    "load_config": "stemlm.checkpoint.folder",
    "read_state": "stemlm.checkpoint.folder",
    "from_pretrained": "stemlm.checkpoint.runs",
    "load_checkpoint": "stemlm.checkpoint.runs",
    "resolve_checkpoint": "stemlm.checkpoint.runs",
    "AtomicFolder": "stemlm.checkpoint.safe_write",
}

__getattr__, __all__ = lazy_exports(__name__, _EXPORTS)
