"""Loading a checkpoint for inference, the same way for every command: tables, table dtype, compute dtype.

    from stemlm.inference.load import InferenceOptions, load_inference
    with load_inference("runs/tiny", InferenceOptions(tables="mmap", table_dtype="int8", dtype="bf16")) as lm:
        logits = lm.model(ids).logits       # any forward: rows from the offloaded tables, under autocast
        new = generate(lm.model, ids, 20)   # plain generation works on it too

`stemlm generate`, `serve` and `eval ppl|lm|niah` all load through `load_inference` and take the same flags
(`stemlm.cli.common.add_inference_flags`):

- `tables`: resident (on the device), host (host memory) or mmap (read from the checkpoint file); host and
  mmap serve rows through the device row cache (`stemlm.offload`);
- `table_dtype`: fp32, bf16 or int8 rows (`stemlm.offload.compact`; None = as the checkpoint stores them);
- `dtype`: the compute dtype, as autocast (auto: bf16 on a CUDA device that supports it, else fp32); the
  weights stay as loaded;
- `compile` (`stemlm generate` / `server --compile`): the decoding steps through `torch.compile`
  (`compile_decoding`), resident tables only.

The loaded model's projections of one input are fused for decoding (`fusion.fuse_for_decoding`: q/k/v, and gate/up
where the kind has both; one matrix-vector product instead of two or three; on a CPU the copies with at least as
many outputs as inputs, STEM's gate, o_proj and the lm_head among them, kept transposed, which streams them
faster; the parameters and their names stay the checkpoint's, and a forward with grad or after a weight changed
takes the plain path).
Its `forward` is bound once (`bind_forward`) so that every call, from any thread and from code that knows nothing
of offloading (the perplexity scorer, lm-eval, the needle test), runs under the chosen autocast and, with host /
mmap tables, gets the offloaded rows: a forward whose rows were not prefetched fetches them on first use. Callers
that pass their own row providers (the offload engine) keep them.
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from stemlm.choices import COMPUTE_DTYPES
from stemlm.errors import StemlmError
from stemlm.model.fusion import drop_stale_copies, fuse_for_decoding, fusion_groups


@dataclass
class InferenceOptions:
    tables: str = "device"  # a placement of stemlm.runtime.TABLE_PLACEMENTS ("resident" is "device")
    table_dtype: str | None = None
    cache_rows: int | None = None
    cache_fraction: float | None = None
    cache_policy: str = "lfu"
    device: str = "cpu"
    dtype: str = "auto"
    compile: bool = False  # decoding steps through torch.compile (`compile_decoding`); generate / server --compile

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
    model: Any  # a StemLM whose forward is bound (see the module docstring)
    tokenizer: Any
    offloaded: Any  # the OffloadedLM with host / mmap tables, else None
    autocast_dtype: torch.dtype

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


def bind_forward(model, rows=None, amp: torch.dtype = torch.float32) -> None:
    """Make every `model(...)` call run under autocast `amp` and, when `rows` (the offload engine's
    `RowPipeline` or `LookupRows`) is given, receive its row providers for every family the caller does not
    provide itself."""
    from stemlm.offload.lookup_rows import LookupRows

    device_type = next(p for p in model.parameters() if not p.is_meta).device.type
    providers = {} if rows is None else rows.rows() if isinstance(rows, LookupRows) else {"token": rows}

    def forward(self, *args, **kwargs):
        if providers:
            given = {f: p for f, p in (kwargs.get("rows") or {}).items() if p is not None}
            kwargs["rows"] = {**providers, **given}
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=amp == torch.bfloat16):
            return type(self).forward(self, *args, **kwargs)

    # An instance attribute, which nn.Module.__call__ finds before the class method; a bound method (not a
    # closure over `model`), so a copy.deepcopy of the model rebinds it to the copy.
    model.forward = types.MethodType(forward, model)


def compile_decoding(model) -> None:
    """Run the model's decoding steps (one new token a row, with a KV cache) through `torch.compile`; every other
    call (the prefill, scoring) stays eager. Call it on a model whose forward is bound (`bind_forward`), after
    `fuse_for_decoding`: the compiled steps use the fused copies too, whose staleness check (storage pointers, which
    the compiler cannot trace) runs before each step, outside the graph (`drop_stale_copies`); a copy dropped there
    makes the compiled step recompile for the plain projections. The first steps wait for the compile (tens of
    seconds on a CPU), and the cache's growing length makes it compile once more, for a dynamic length;
    docs/results.md has the measured rate."""
    eager = model.forward
    compiled = torch.compile(eager)
    fused = fusion_groups(model)

    def forward(self, input_ids, **kwargs):
        if input_ids.shape[1] == 1 and kwargs.get("past_key_values") is not None:
            drop_stale_copies(fused)
            return compiled(input_ids, **kwargs)
        return eager(input_ids, **kwargs)

    model.forward = types.MethodType(forward, model)


def load_inference(path: str | Path, options: InferenceOptions | None = None, *, need_tokenizer: str | None = None):
    """A CKPT argument loaded for inference with `options` (see the module docstring) as a `Loaded`."""
    from stemlm.checkpoint.runs import load_checkpoint, resolve_checkpoint
    from stemlm.runtime import DEVICE, check_device, table_placement

    opts = options or InferenceOptions()
    device = check_device(opts.device)
    amp = autocast_dtype(opts.dtype, device)
    placement = table_placement(opts.tables)
    if opts.compile and placement != DEVICE:
        raise StemlmError(f"--compile needs --tables device, not {opts.tables}: offloaded rows come from Python code")
    if placement == DEVICE:
        if opts.cache_rows is not None or opts.cache_fraction is not None:
            raise StemlmError("--cache-rows / --cache-fraction need --tables host or --tables mmap")
        model, tokenizer = load_checkpoint(path, device=device, need_tokenizer=need_tokenizer)
        if opts.table_dtype is not None:
            _round_resident(model, resolve_checkpoint(path), opts.table_dtype)
        fuse_for_decoding(model)
        bind_forward(model, None, amp)
        if opts.compile:
            compile_decoding(model)
        return Loaded(model, tokenizer, None, amp)
    from stemlm.inference.offloaded import open_checkpoint

    offloaded, tokenizer = open_checkpoint(
        path,
        placement,
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
    bind_forward(offloaded.model, offloaded.rows, amp)
    return Loaded(offloaded.model, tokenizer, offloaded, amp)


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
