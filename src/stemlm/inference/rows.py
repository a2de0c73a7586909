"""Where a forward's table rows come from: the one interface through which row providers plug into inference.

A `RowSource` answers two things for the decoding engine (`stemlm.inference.engine`) and the inference wrapper
(`stemlm.inference.inference_model`): `providers()`, the forward's `rows={family: provider}` mapping
(`StemLM.forward`), and `announce(ids, host, before)`, called with a forward's ids as soon as they are known (a
prefill chunk before the previous chunk runs, a token the moment it is sampled) so the rows can travel while
other work runs; `before` holds each row's ids before these (n-gram keys read them). `drain()` forgets what was
announced and never used (a stream stopped early, a failed forward).

- `ModelTables`: the model's own tables (resident): nothing to provide or announce;
- `stemlm.offload.lookup_rows.LookupRows`: host or memory-mapped tables behind device row caches (token,
  n-gram and memory families), with prefetch;
- a request's edit is a plain `rows=` mapping on the request (`Request.edit_rows`), given to its prefill over
  the source's providers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from stemlm.model.ffn import Rows


class RowSource(Protocol):
    def providers(self) -> Rows: ...

    def announce(self, ids: torch.Tensor, host: torch.Tensor, before: Sequence[Sequence[int]]) -> None: ...

    def drain(self) -> None: ...


class ModelTables:
    """The model reads its own tables: no provider, nothing to announce."""

    def providers(self) -> Rows:
        return {}

    def announce(self, ids: torch.Tensor, host: torch.Tensor, before: Sequence[Sequence[int]]) -> None:
        pass

    def drain(self) -> None:
        pass
