"""Loading a checkpoint for inference, the same way for every command: tables, table dtype, compute dtype.

    from stemlm.inference.load import InferenceOptions, load_inference
    with load_inference("runs/tiny", InferenceOptions(tables="mmap", table_dtype="int8", dtype="bf16")) as lm:
        logits = lm.model(ids).logits       # any forward: rows from the offloaded tables, under autocast
        new = generate(lm.model, ids, 20)   # generation through the decoding engine
        engine = lm.engine()                # the engine itself (prefill chunks with offloaded tables)

`stemlm generate`, `serve` and `eval ppl|lm|niah` all load through `load_inference` and take the same flags
(`stemlm.cli.common.add_inference_flags`):

- `tables`: resident (on the device), host (host memory) or mmap (read from the checkpoint file); host and
  mmap serve rows through the device row cache (`stemlm.offload`);
- `table_dtype`: fp32, bf16 or int8 rows (`stemlm.offload.compact`; None = as the checkpoint stores them);
- `dtype`: the compute dtype, as autocast (auto: bf16 on a CUDA device that supports it, else fp32); the
  weights stay as loaded;
- `compile` (`stemlm generate` / `serve --compile`): the decoding steps through `torch.compile`, resident tables
  only.

The loaded model's projections of one input are fused for decoding (`fusion.fuse_for_decoding`: q/k/v, and gate/up
where the kind has both; one matrix-vector product instead of two or three; on a CPU the copies with at least as
many outputs as inputs, STEM's gate, o_proj and the lm_head among them, kept transposed, which streams them
faster; the parameters and their names stay the checkpoint's, and a forward with grad or after a weight changed
takes the plain path).
`Loaded.model` is the `InferenceModel` wrapper (`stemlm.inference.inference_model`) around it, so that every call,
from any thread and from code that knows nothing of offloading (the perplexity scorer, lm-eval, the needle test),
runs under the chosen autocast and, with host / mmap tables, gets the offloaded rows (a forward whose rows were
not announced fetches them on first use); `Loaded.model.module` is the `StemLM`, whose forward is its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stemlm.choices import COMPUTE_DTYPES
from stemlm.errors import StemlmError
from stemlm.inference.engine import Engine
from stemlm.inference.inference_model import InferenceModel
from stemlm.model.fusion import fuse_for_decoding


@dataclass
class InferenceOptions:
    tables: str = "device"  # a --tables value of an inference placement (stemlm.placement.registry; or "resident")
    table_dtype: str | None = None
    cache_rows: int | None = None
    cache_fraction: float | None = None
    cache_policy: str = "lfu"
    device: str = "cpu"
    dtype: str = "auto"
    compile: bool = False  # decoding steps through torch.compile (`InferenceModel`); generate / serve --compile

    @classmethod
    def from_args(cls, args) -> InferenceOptions:
        """The options of a command line parsed with `add_inference_flags` (and a --device flag)."""
        return cls(
            tables=args.tables,
            table_dtype=args.table_dtype,
            cache_rows=args.cache_rows,
            cache_fraction=args.cache_fraction,
            cache_policy=args.cache_policy,
            device=args.device,
            dtype=args.dtype,
            compile=getattr(args, "compile", False),  # only the commands that offer --compile define it
        )


@dataclass
class Loaded:
    model: InferenceModel  # the StemLM (`.module`) with its autocast, rows and compiled steps
    tokenizer: Any
    offloaded: Any  # the OffloadedLM with host / mmap tables, else None
    autocast_dtype: torch.dtype

    def engine(self, **settings) -> Engine:
        """The decoding engine of this model (`settings`: `Engine`'s keywords, e.g. tokenizer); with offloaded
        tables it prefills in the `OffloadedLM`'s chunks, as `stemlm generate` always has."""
        if self.offloaded is not None:
            return self.offloaded.engine(self.model, **settings)
        return Engine(self.model, **settings)

    def close(self) -> None:
        if self.offloaded is not None:
            self.offloaded.close()

    def __enter__(self) -> Loaded:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def autocast_dtype(name: str, device: torch.device) -> torch.dtype:
    from stemlm.runtime import resolve_dtype

    if name not in COMPUTE_DTYPES:
        raise StemlmError(f"unknown compute dtype {name!r}; choose one of {', '.join(COMPUTE_DTYPES)}")
    return resolve_dtype(name, device)


def load_inference(path: str | Path, options: InferenceOptions | None = None, *, need_tokenizer: str | None = None):
    """A CKPT argument loaded for inference with `options` (see the module docstring) as a `Loaded`."""
    from stemlm.checkpoint.runs import load_checkpoint, resolve_checkpoint
    from stemlm.placement.registry import INFERENCE, choose
    from stemlm.runtime import check_device

    opts = options or InferenceOptions()
    device = check_device(opts.device)
    amp = autocast_dtype(opts.dtype, device)
    placement = choose(opts.tables, INFERENCE)
    if opts.compile and not placement.compiles:
        raise StemlmError(f"--compile needs --tables device, not {opts.tables}: offloaded rows come from Python code")
    if not placement.offloaded:
        if opts.cache_rows is not None or opts.cache_fraction is not None:
            raise StemlmError("--cache-rows / --cache-fraction need --tables host or --tables mmap")
        model, tokenizer = load_checkpoint(path, device=device, need_tokenizer=need_tokenizer)
        if opts.table_dtype is not None:
            _round_resident(model, resolve_checkpoint(path), opts.table_dtype)
        fuse_for_decoding(model)
        return Loaded(InferenceModel(model, amp=amp, compile=opts.compile), tokenizer, None, amp)
    from stemlm.inference.offloaded import open_checkpoint

    offloaded, tokenizer = open_checkpoint(
        path,
        opts.tables,
        cache_rows=opts.cache_rows,
        cache_fraction=opts.cache_fraction,
        policy=opts.cache_policy,
        device=device,
        table_dtype=opts.table_dtype,
    )
    if need_tokenizer and tokenizer is None:
        offloaded.close()
        raise StemlmError(
            f"{path} has no tokenizer.json; {need_tokenizer} needs the tokenizer the model was trained with"
        )
    offloaded.model.eval()
    fuse_for_decoding(offloaded.model)
    return Loaded(offloaded.inference_model(amp), tokenizer, offloaded, amp)


def _round_resident(model, folder: Path, table_dtype: str) -> None:
    from stemlm.checkpoint.table_storage import check_table_dtype, read_storage
    from stemlm.offload.families import round_tables

    check_table_dtype(table_dtype)
    if not hasattr(model, "lookup_tables") or not model.lookup_tables():
        if table_dtype != "fp32":
            raise StemlmError(f"--table-dtype {table_dtype}: checkpoint {folder} has no lookup tables to store so")
        return
    storage = read_storage(folder)
    if table_dtype != (storage["dtype"] if storage else "fp32"):
        round_tables(model, table_dtype)
