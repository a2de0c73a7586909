"""`InferenceModel`: a `StemLM` as inference runs it, wrapped from outside (the model's own forward is untouched).

    lm = InferenceModel(model, amp=torch.bfloat16, row_source=offloaded.rows)
    logits = lm(ids).logits          # any forward: under the autocast, with the offloaded rows
    lm.module                        # the StemLM itself; `lm.module(...)` is always `StemLM.forward`

The wrapper holds what differs between a model in training and one being served, so that every caller that
runs a forward (the decoding engine, perplexity, lm-eval, the needle test, the playground's analysis) gets the
same thing from any thread:

- `amp`: the compute dtype, as autocast (the weights stay as loaded);
- `row_source` (`stemlm.inference.rows.RowSource`): the table rows of every forward, under any rows the caller
  gives itself (an edit's); with host / mmap tables a forward whose rows were not announced fetches them on
  first use;
- `compile`: the decoding steps (one new token a row, with a KV cache) through `torch.compile`, every other call (the
  prefill, scoring) eager; resident tables only (offloaded rows come from Python code). The compiled steps use the fused
  projection copies too (`stemlm.model.fusion.fuse_for_decoding`), whose staleness check (storage pointers, which the
  compiler cannot trace) runs before each step, outside the graph (`drop_stale_copies`); a copy dropped there makes the
  compiled step recompile for the plain projections. The first steps wait for the compile (tens of seconds on a CPU),
  and the cache's growing length makes it compile once more, for a dynamic length; docs/results.md has the measured
  rate.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn

from stemlm.inference.rows import ModelTables, RowSource
from stemlm.model.decoder import ModelOutput, StemLM
from stemlm.model.fusion import drop_stale_copies, fusion_groups


class InferenceModel(nn.Module):
    """See the module docstring. An `nn.Module`, so `.eval()`, `.parameters()` and `.to()` reach the model."""

    def __init__(
        self,
        module: StemLM,
        *,
        amp: torch.dtype = torch.float32,
        row_source: RowSource | None = None,
        compile: bool = False,
    ) -> None:
        super().__init__()
        self.module = module
        self.amp = amp
        self.row_source = row_source if row_source is not None else ModelTables()
        self.device = next(p.device for p in module.parameters() if not p.is_meta)
        self.compiled_step = torch.compile(self._forward) if compile else None
        self.fused_groups = fusion_groups(module) if compile else []

    @property
    def config(self):
        return self.module.config

    def autocast(self) -> AbstractContextManager:
        """The autocast every forward runs under (for callers that run the model's parts themselves). fp32 enters
        none, so a caller's own autocast (a training loop sampling under bf16) still holds inside."""
        if self.amp != torch.bfloat16:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    def forward(self, input_ids: torch.Tensor, **kwargs) -> ModelOutput:
        """`StemLM.forward`'s arguments; a decoding step runs compiled when the wrapper compiles."""
        if self.compiled_step is not None and input_ids.shape[1] == 1 and kwargs.get("past_key_values") is not None:
            drop_stale_copies(self.fused_groups)
            _mark_dynamic(input_ids, kwargs)
            return self.compiled_step(input_ids, **kwargs)
        return self._forward(input_ids, **kwargs)

    def _forward(self, input_ids: torch.Tensor, **kwargs) -> ModelOutput:
        providers = self.row_source.providers()
        if providers:  # the caller's own rows (an edit's) go over the source's, family by family
            given = {family: p for family, p in (kwargs.get("rows") or {}).items() if p is not None}
            kwargs["rows"] = {**providers, **given}
        with self.autocast():
            return self.module(input_ids, **kwargs)


def _mark_dynamic(input_ids: torch.Tensor, kwargs: dict) -> None:
    """Batch rows and cache positions vary from step to step (the batch engine's pool grows, rows join and leave):
    marked dynamic, so the compiled step is one graph for them instead of a recompile per new size (a batch of one
    row and the step with or without a padding mask are still graphs of their own)."""
    cache = kwargs["past_key_values"]
    batched = [input_ids, kwargs.get("position_ids")] + list(cache.keys) + list(cache.values)
    for tensor in batched:
        if tensor is not None and tensor.shape[0] > 1:
            torch._dynamo.maybe_mark_dynamic(tensor, 0)
    for tensor in list(cache.keys) + list(cache.values):
        if tensor is not None:
            torch._dynamo.maybe_mark_dynamic(tensor, 2)
    mask = kwargs.get("attention_mask")
    if mask is not None:
        torch._dynamo.maybe_mark_dynamic(mask, 1)
        if mask.shape[0] > 1:
            torch._dynamo.maybe_mark_dynamic(mask, 0)


def as_inference_model(model: StemLM | InferenceModel) -> InferenceModel:
    """`model` itself when wrapped already, else a plain wrapper (fp32, its own tables, eager)."""
    return model if isinstance(model, InferenceModel) else InferenceModel(model)
