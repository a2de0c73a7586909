"""The playground page's operations: generation, the heat map and nearest tokens, edits and saves.

`Playground` answers the page's requests with plain Python values over the one `ServedModel` of the server
(`stemlm.serve.served_model`); the web layer (`stemlm.serve.app`) only parses requests and streams. Thread safety,
since the server answers each request on its own thread:

- generation is a request of the served model's batch engine, which runs every forward on its one thread (with
  `--tables host|mmap` that thread alone touches the row cache and its prefetch pipeline, whatever the requests);
- the served model is only read: positional edits travel as per-call row hooks, and a saved global edit is
  written into a copy whose edited tables are clones (copy-on-save), so no request ever sees another's edit;
  editing and the heat map read the tables through `ServedModel.view` and never touch the row cache;
- saves are serialised (`_save_lock`) so two saves cannot pick the same new folder.

    pg = Playground.load("runs/tiny", save_dir="edited/")
    ids = pg.encode("The capital of Spain is")
    print(pg.edit(ids, EditSpec(source="Spain", target="Germany"), top_k=5, sampling={...}))
"""

from __future__ import annotations

import queue
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path

import torch

from stemlm.analysis.attribution import attribute
from stemlm.analysis.nearest import neighbours
from stemlm.data.worlds.facts import load_countries
from stemlm.edit import PAD_ROWS, STRATEGIES
from stemlm.edit.spans import DEFAULT_PAD, GLOBAL_DEFAULT_PAD
from stemlm.errors import StemlmError
from stemlm.inference.requests import Request
from stemlm.inference.sampling import SamplingParams
from stemlm.model.kinds.registry import key_label
from stemlm.placement.resident import ResidentTables
from stemlm.serve.editing import EditSpec, build_edit, compare, save_global_edit, source_text
from stemlm.serve.served_model import EOT_TOKEN, ServedModel

SAVE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


class Conflict(StemlmError):
    """A request that names something that already exists (HTTP 409)."""


def sampling_params(sampling: dict, stop_ids: tuple[int, ...] = ()) -> SamplingParams:
    """The engine's settings of the page's generation controls (`stemlm.serve.params.sampling`), checked."""
    params = SamplingParams(
        max_tokens=sampling["max_new_tokens"],
        temperature=sampling["temperature"],
        top_p=sampling["top_p"],
        top_k=sampling["top_k"],
        seed=sampling["seed"],
        greedy=sampling["greedy"],
        stop_ids=stop_ids,
    )
    params.check()
    return params


class Playground:
    def __init__(self, served: ServedModel, *, save_dir: str | Path | None = None, chat: bool = False) -> None:
        self.served, self.tokenizer, self.checkpoint = served, served.tokenizer, served.checkpoint
        self.model = served.model.module  # the served StemLM (its tables: meta placeholders when offloaded)
        self.offloaded, self.autocast_dtype = served.loaded.offloaded, served.loaded.autocast_dtype
        self.save_dir = Path(save_dir).resolve() if save_dir is not None else None
        if self.save_dir is not None and self.save_dir == self.checkpoint:
            raise StemlmError("--save-dir is the served checkpoint itself; pick a folder for the edited checkpoints")
        self.chat = None
        if chat:  # prompts become user turns of the checkpoint's chat template; generation stops at its end of turn
            from stemlm.inference.chat import require_chat

            self.chat = require_chat(self.checkpoint)
        eos = self.chat.eos_token if self.chat and self.chat.eos_token else EOT_TOKEN
        self.eos_id = self.tokenizer.token_to_id(eos)
        self._save_lock = threading.Lock()

    @classmethod
    def load(
        cls, ckpt: str | Path, options=None, *, save_dir: str | Path | None = None, chat: bool = False, **settings
    ) -> Playground:
        """Load a checkpoint (or a run's newest) with `options` (`stemlm.inference.load.InferenceOptions`: tables
        resident / host / mmap, table dtype, compute dtype; or its fields as keywords, e.g. tables="host",
        cache_rows=16); the other keywords are `ServedModel`'s (name, slots, max_queue, request_timeout)."""
        from stemlm.inference.load import InferenceOptions

        names = {f.name for f in fields(InferenceOptions)}
        load_fields = {k: v for k, v in settings.items() if k in names}
        if options is not None and load_fields:
            raise StemlmError("pass the load options as InferenceOptions or as keywords, not both")
        options = options or InferenceOptions(**load_fields)
        served = ServedModel.load(ckpt, options, **{k: v for k, v in settings.items() if k not in names})
        try:
            return cls(served, save_dir=save_dir, chat=chat)
        except StemlmError:
            served.close()
            raise

    # ----- what the page shows about the model -----
    def info(self) -> dict:
        config = self.model.config
        tables = sorted(self.model.token_tables())
        return {
            "checkpoint": str(self.checkpoint),
            "ffn": config.ffn,
            "num_layers": config.num_hidden_layers,
            "table_layers": tables,
            "vocab_size": config.vocab_size,
            "max_position_embeddings": config.max_position_embeddings,
            "tables": self.offloaded.memory()["placement"] if self.offloaded is not None else ResidentTables.name,
            "autocast_dtype": str(self.autocast_dtype).removeprefix("torch."),
            "editing": self.served._view_error
            or (None if tables else f"this checkpoint has no STEM tables (ffn={config.ffn})"),
            "strategies": list(STRATEGIES),
            "pads": list(PAD_ROWS),
            "default_pad": DEFAULT_PAD,  # positional edits
            "global_default_pad": GLOBAL_DEFAULT_PAD,  # saved global edits
            "can_save": self.save_dir is not None,
            "save_dir": str(self.save_dir) if self.save_dir is not None else None,
            "entities": sorted(c.name for c in load_countries()),  # suggestions for the target box (fact world)
        }

    def encode(self, prompt: str) -> list[int]:
        if self.chat is not None and prompt:
            prompt = self.chat.render(prompt)
        ids = self.tokenizer.encode(prompt, add_special_tokens=False).ids
        if not ids:
            raise StemlmError("the prompt is empty: type some text first")
        limit = self.model.config.max_position_embeddings
        if len(ids) >= limit:
            raise StemlmError(f"the prompt has {len(ids)} tokens; this model reads at most {limit - 1} plus one new")
        return ids

    def tokens(self, ids: list[int]) -> list[dict]:
        return [{"id": i, "text": self.tokenizer.decode([i])} for i in ids]

    def view(self):
        """The model with readable tables, for editing and analysis (the served model unless tables are on host)."""
        return self.served.view()

    # ----- generation -----
    def stream(self, ids: list[int], sampling: dict) -> Iterator[int]:
        """New token ids, as the served model's engine samples them; the request is checked and queued now, so a
        bad one fails before streaming starts. Leaving the iterator early cancels the request."""
        events: queue.SimpleQueue = queue.SimpleQueue()
        request = Request(ids, sampling_params(sampling, (self.eos_id,)), on_event=lambda _r, e: events.put(e))
        self.served.loop.submit(request)
        return self._tokens(request, events)

    def _tokens(self, request: Request, events: queue.SimpleQueue) -> Iterator[int]:
        try:
            while (event := events.get()) is not None:
                if event.token_id >= 0:
                    yield event.token_id
            if request.finish_reason == "error":
                raise StemlmError(request.error)
        finally:
            if not request.done.is_set():
                self.served.loop.cancel(request)  # a client that went away frees its slot at the next step

    def cache_report(self) -> dict | None:
        """Memory figures and row-cache statistics with host tables (None with resident tables)."""
        return self.served.cache_report()

    # ----- the heat map and nearest tokens -----
    def contribution(self, ids: list[int]) -> dict:
        """Per STEM layer and prompt position: FFN output norm and gradient x input for the top next token."""
        result = attribute(self.view(), ids, forward=self.served.view_model)
        layers = sorted(result["layers"], key=int)
        return {
            "tokens": self.tokens(ids),
            "predicted": {"id": result["token_id"], "token": self.tokenizer.decode([result["token_id"]])},
            "logprob": result["logprob"],
            "layers": [int(name) for name in layers],
            "ffn_norm": [result["layers"][name]["ffn_norm"] for name in layers],
            "grad_x_input": [result["layers"][name]["grad_x_input"] for name in layers],
        }

    def nearest(self, token_id: int, k: int) -> dict:
        """The k nearest tokens of `token_id` by row cosine in each STEM table and in the token embedding."""
        model = self.view()
        if not 0 <= token_id < model.config.vocab_size:
            raise StemlmError(f"token id {token_id} is outside the vocabulary of {model.config.vocab_size}")
        named = [(key_label(model.config, i), t.weight) for i, t in sorted(model.token_tables().items())]
        named.append(("embed_tokens", model.model.embed_tokens.weight))
        return {
            "query": {"id": token_id, "token": self.tokenizer.decode([token_id])},
            "tables": [
                {
                    "name": name,
                    "neighbours": [
                        {"id": i, "token": self.tokenizer.decode([i]), "cosine": c}
                        for i, c in neighbours(weight.detach(), token_id, k)
                    ],
                }
                for name, weight in named
            ],
        }

    # ----- editing -----
    def edit(self, ids: list[int], spec: EditSpec, *, top_k: int, sampling: dict) -> dict:
        params = sampling_params(sampling, (self.eos_id,))
        edit = build_edit(self.view(), self.tokenizer, ids, spec)
        start = time.perf_counter()
        result = compare(self.served.view_model, self.tokenizer, ids, edit, top_k=top_k, params=params)
        return {"tokens": self.tokens(ids), **result, "seconds": time.perf_counter() - start}

    def save(self, ids: list[int], spec: EditSpec, name: str, *, allow_shared: bool = False) -> dict:
        """Save the edit as a global one: a new checkpoint `save_dir/name`, never over an existing folder, and
        only with `allow_shared` when other words share its changed tokens (`SharedSubwords` otherwise)."""
        if self.save_dir is None:
            raise StemlmError("saving is off: start the server with --save-dir DIR to save edited checkpoints")
        if not SAVE_NAME.match(name):
            raise StemlmError(f"checkpoint name {name!r}: use letters, digits, '.', '_' or '-' (no slashes)")
        target = self.save_dir / name
        source = source_text(self.tokenizer, ids, spec)
        with self._save_lock:
            if target.exists() or target == self.checkpoint:
                raise Conflict(f"{target} already exists; pick another name (saves never overwrite a folder)")
            with torch.no_grad():
                description = save_global_edit(
                    self.view(), self.tokenizer, source, spec, target, allow_shared=allow_shared
                )
        return {"path": str(target), "edit": description}

    def close(self) -> None:
        self.served.close()
