"""The model behind `stemlm serve`: loading, generation, the heat map and nearest tokens, edits and saves.

`Playground` owns one loaded checkpoint and answers the page's requests with plain Python values; the web
layer (`stemlm.serve.app`) only parses requests and streams. Thread safety, since the server runs each
request on its own thread:

- the served model is only read: positional edits travel as per-call row hooks, and a saved global edit is
  written into a copy whose edited tables are clones (copy-on-save), so no request ever sees another's edit;
- with `--tables host|mmap` generation goes through the offload engine's row cache and prefetch pipeline, which
  keep state between steps, so one generation runs at a time there (`_generation_lock`); editing and the
  heat map read the host tables through `views.resident_view` and do not touch the cache;
- saves are serialised (`_save_lock`) so two saves cannot pick the same new folder.

    pg = Playground.load("runs/tiny", save_dir="edited/")
    ids = pg.encode("The capital of Spain is")
    print(pg.edit(ids, EditSpec(source="Spain", target="Germany"), top_k=5, sampling={...}))
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from tokenizers import Tokenizer

from stemlm.analysis.attribution import attribute
from stemlm.analysis.nearest import neighbours
from stemlm.data.worlds.facts import load_countries
from stemlm.edit import PAD_ROWS, STRATEGIES
from stemlm.edit.spans import DEFAULT_PAD, GLOBAL_DEFAULT_PAD
from stemlm.errors import StemlmError
from stemlm.inference.generate import check_sampling, stream_tokens
from stemlm.inference.offloaded import OffloadedLM
from stemlm.model.decoder import StemLM
from stemlm.serve.editing import EditSpec, build_edit, compare, save_global_edit, source_text
from stemlm.serve.views import resident_view

EOT_TOKEN = "<|endoftext|>"
SAVE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


class Conflict(StemlmError):
    """A request that names something that already exists (HTTP 409)."""


class Playground:
    def __init__(
        self,
        model: StemLM,
        tokenizer: Tokenizer | None,
        *,
        checkpoint: str | Path,
        offloaded: OffloadedLM | None = None,
        save_dir: str | Path | None = None,
        chat: bool = False,
    ) -> None:
        if tokenizer is None:
            raise StemlmError(f"checkpoint {checkpoint} has no tokenizer.json; the playground needs one to read text")
        self.model, self.tokenizer, self.offloaded = model, tokenizer, offloaded
        self.checkpoint = Path(checkpoint).resolve()
        self.save_dir = Path(save_dir).resolve() if save_dir is not None else None
        if self.save_dir is not None and self.save_dir == self.checkpoint:
            raise StemlmError("--save-dir is the served checkpoint itself; pick a folder for the edited checkpoints")
        self.chat = None
        if chat:  # prompts become user turns of the checkpoint's chat template; generation stops at its end of turn
            from stemlm.inference.chat import require_chat

            self.chat = require_chat(self.checkpoint)
        eos = self.chat.eos_token if self.chat and self.chat.eos_token else EOT_TOKEN
        self.eos_id = tokenizer.token_to_id(eos)
        self.autocast_dtype = torch.float32  # set by `load` (the compute dtype every forward runs under)
        self._generation_lock = threading.Lock()
        self._save_lock = threading.Lock()
        self._view: StemLM | None = None if offloaded is not None else model
        self._view_error: str | None = None
        if offloaded is not None:
            try:
                self._view = resident_view(offloaded)
            except StemlmError as exc:
                self._view_error = str(exc)

    @classmethod
    def load(
        cls, ckpt: str | Path, options=None, *, save_dir: str | Path | None = None, chat: bool = False, **fields
    ) -> Playground:
        """Load a checkpoint (or a run's newest) with `options` (`stemlm.inference.load.InferenceOptions`: tables
        resident / host / mmap, table dtype, compute dtype; or its fields as keywords, e.g. tables="host",
        cache_rows=16); every forward runs under its autocast."""
        from stemlm.checkpoint.runs import resolve_checkpoint
        from stemlm.inference.load import InferenceOptions, load_inference

        folder = resolve_checkpoint(ckpt)
        if options is None:
            options = InferenceOptions(**fields)
        elif fields:
            raise StemlmError("pass the load options as InferenceOptions or as keywords, not both")
        loaded = load_inference(folder, options)
        try:
            pg = cls(
                loaded.model,
                loaded.tokenizer,
                checkpoint=folder,
                offloaded=loaded.offloaded,
                save_dir=save_dir,
                chat=chat,
            )
        except StemlmError:
            loaded.close()
            raise
        pg.autocast_dtype = loaded.autocast_dtype
        if pg._view is not None and pg._view is not pg.model:  # the editing view of host tables: same autocast
            from stemlm.inference.load import bind_forward

            bind_forward(pg._view, None, loaded.autocast_dtype)
        return pg

    # ----- what the page shows about the model -----
    def info(self) -> dict:
        config = self.model.config
        tables = sorted(self.model.stem_tables())
        return {
            "checkpoint": str(self.checkpoint),
            "ffn": config.ffn,
            "num_layers": config.num_hidden_layers,
            "stem_layers": tables,
            "vocab_size": config.vocab_size,
            "max_position_embeddings": config.max_position_embeddings,
            "tables": self.offloaded.memory()["placement"] if self.offloaded is not None else "resident",
            "autocast_dtype": str(self.autocast_dtype).removeprefix("torch."),
            "editing": self._view_error
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

    def view(self) -> StemLM:
        """The model with readable tables, for editing and analysis (the served model unless tables are on host)."""
        if self._view is None:
            raise StemlmError(self._view_error or "no model view for editing")
        return self._view

    # ----- generation -----
    def stream(self, ids: list[int], sampling: dict) -> Iterator[int]:
        """New token ids, lazily; arguments are checked now, so a bad request fails before streaming starts."""
        options = {k: v for k, v in sampling.items() if k != "max_new_tokens"}
        check_sampling(options["temperature"], options["top_k"], options["top_p"])
        return self._stream(ids, sampling["max_new_tokens"], options)

    def _stream(self, ids: list[int], max_new_tokens: int, options: dict) -> Iterator[int]:
        if self.offloaded is None:
            yield from stream_tokens(self.model, ids, max_new_tokens, eos_id=self.eos_id, **options)
            return
        with self._generation_lock:  # taken on first iteration, so an unstarted stream never holds it
            try:
                yield from self.offloaded.stream(ids, max_new_tokens, eos_id=self.eos_id, **options)
            finally:
                # A client that went away mid-stream leaves a prefetched step behind; drop it for the next one.
                self.offloaded.rows.drain()

    def cache_report(self) -> dict | None:
        """Memory figures and row-cache statistics with host tables (None with resident tables)."""
        return None if self.offloaded is None else self.offloaded.report()

    # ----- the heat map and nearest tokens -----
    def contribution(self, ids: list[int]) -> dict:
        """Per STEM layer and prompt position: FFN output norm and gradient x input for the top next token."""
        result = attribute(self.view(), ids)
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
        named = [(f"layer {i}", t.weight) for i, t in sorted(model.stem_tables().items())]
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
        model = self.view()
        check_sampling(sampling["temperature"], sampling["top_k"], sampling["top_p"])
        edit = build_edit(model, self.tokenizer, ids, spec)
        start = time.perf_counter()
        result = compare(model, self.tokenizer, ids, edit, top_k=top_k, sampling=sampling, eos_id=self.eos_id)
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
        if self.offloaded is not None:
            self.offloaded.close()
