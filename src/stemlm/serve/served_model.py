"""The model behind `stemlm serve`: one loaded checkpoint, its decoding engine on a thread, prompts and edits.

`ServedModel` loads a checkpoint once for everything the server answers, the playground page
(`stemlm.serve.playground`) and the OpenAI-compatible API (`stemlm.serve.openai_app`): every generation is a
`Request` of one continuous-batching engine (`stemlm.inference.batching`) running the decoding engine on one
thread, so requests from the page and from API clients decode in the same batch and share one row cache.

- prompts: an API request's prompt texts (or a chat rendered with the checkpoint's template) encoded, end-of-text
  (and the template's end of turn) as stop ids; one engine request per choice (`requests`: prompts x n);
- the model id API clients send: `name`, by default the checkpoint folder's name, or the run's when loaded
  from a run folder (not its newest step's, `step-000300`);
- edits: a positional edit is that request's prefill rows (`edit_rows`), built on `view()`, a model whose tables
  can be read: the served model, or with `--tables host` the resident view of the host tables
  (`views.resident_view`); the batch keeps the shared row cache;
- analysis and the page's before/after comparison run on `view_model`, the view under the served autocast.

    served = ServedModel.load("runs/tiny", InferenceOptions(tables="host"), slots=16, max_queue=64)
    requests = served.submit(parse_completion(body, served.context))    # one per choice (prompts x n)
    requests[0].done.wait(); served.close()
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from stemlm.errors import StemlmError
from stemlm.inference.batching import STEP_TOKENS, BatchEngine, EngineLoop
from stemlm.inference.inference_model import InferenceModel
from stemlm.inference.requests import Request, new_group
from stemlm.inference.sampling import SamplingParams
from stemlm.model.decoder import StemLM
from stemlm.model.ffn import Rows
from stemlm.serve.editing import EditSpec, build_edit
from stemlm.serve.openai_params import ParsedRequest
from stemlm.serve.views import resident_view

EOT_TOKEN = "<|endoftext|>"


def edit_rows(view: StemLM, tokenizer, ids: list[int], spec: EditSpec) -> Rows | None:
    """The `rows=` mapping that applies `spec` as a positional edit to a prefill of `ids`; `view` is a model whose
    tables can be read (the served model, or the resident view of host tables)."""
    from stemlm.edit.positional import edit_hooks

    return edit_hooks(view, build_edit(view, tokenizer, ids, spec)) or None


class ServedModel:
    def __init__(
        self,
        loaded,
        checkpoint: str | Path,
        *,
        name: str | None = None,
        slots: int = 128,
        step_tokens: int = STEP_TOKENS,
        max_queue: int = 64,
        request_timeout: float = 600.0,
    ) -> None:
        from stemlm.inference.chat import load_chat

        if loaded.tokenizer is None:
            raise StemlmError(f"checkpoint {checkpoint} has no tokenizer.json; the server needs one to read text")
        self.loaded, self.model, self.tokenizer = loaded, loaded.model, loaded.tokenizer
        self.checkpoint = Path(checkpoint).resolve()
        self.name = name or self.checkpoint.name
        self.created = int(time.time())
        self.context = self.model.config.max_position_embeddings
        self.request_timeout = request_timeout
        self.chat = load_chat(self.checkpoint)
        eot = self.tokenizer.token_to_id(EOT_TOKEN)
        self.stop_ids = () if eot is None else (eot,)
        turn = self.tokenizer.token_to_id(self.chat.eos_token) if self.chat and self.chat.eos_token else None
        self.chat_stop_ids = tuple(dict.fromkeys(self.stop_ids + (() if turn is None else (turn,))))
        self._view, self._view_error, self.view_model = self.model.module, None, self.model
        if loaded.offloaded is not None:
            try:
                self._view = resident_view(loaded.offloaded)
                self.view_model = InferenceModel(self._view, amp=loaded.autocast_dtype)
            except StemlmError as exc:
                self._view, self._view_error, self.view_model = None, str(exc), None
        engine = loaded.engine(tokenizer=self.tokenizer)
        self.engine = BatchEngine(engine, slots=slots, max_waiting=max_queue, step_tokens=step_tokens)
        self.loop = EngineLoop(self.engine)

    @classmethod
    def load(cls, ckpt: str | Path, options=None, **settings) -> ServedModel:
        """Load a checkpoint (or a run's newest) with `InferenceOptions`; `settings`: the constructor's keywords."""
        from stemlm.checkpoint.runs import resolve_checkpoint
        from stemlm.inference.load import load_inference

        folder = resolve_checkpoint(ckpt)
        if folder != Path(ckpt) and settings.get("name") is None:
            settings["name"] = Path(ckpt).resolve().name  # a run folder: the run's name, not its newest step's
        loaded = load_inference(folder, options)
        try:
            return cls(loaded, folder, **settings)
        except StemlmError:
            loaded.close()
            raise

    def warm_up(self) -> None:
        """With compiled decoding steps, run each of their graphs once before serving, so no client waits for a
        compile: one row alone, several of one length (no padding mask), several of different lengths (a mask),
        and one row left alone on a longer axis (a mask, one row). Batch size and length are dynamic in each graph
        (`InferenceModel`)."""
        if self.model.compiled_step is None:
            return
        print("stemlm serve: compiling the decoding step (once; --no-compile skips it)", file=sys.stderr, flush=True)
        cases = (
            [([1, 2], 4)],
            [([1, 2], 4), ([3, 4], 4)],
            [([1], 4), ([1, 2, 3], 4), ([4, 5, 6, 7, 8], 4)],
            [([1, 2, 3, 4, 5], 2), ([1], 6)],  # the longer leaves first: the other decodes alone, padded
        )
        for case in cases:
            params = [SamplingParams(max_tokens=new, temperature=0) for _, new in case]
            requests = [self.loop.submit(Request(ids, p)) for (ids, _), p in zip(case, params, strict=True)]
            for request in requests:
                request.done.wait()
                if request.finish_reason == "error":
                    raise StemlmError(f"the compiled decoding step failed ({request.error}); serve with --no-compile")

    def view(self) -> StemLM:
        """The model with readable tables, for editing and analysis (the served model unless tables are offloaded)."""
        if self._view is None:
            raise StemlmError(self._view_error or "no model view for editing")
        return self._view

    def edit_rows(self, ids: list[int], spec: EditSpec) -> Rows | None:
        return edit_rows(self.view(), self.tokenizer, ids, spec)

    def prompt_ids(self, parsed: ParsedRequest, prompt: str | list[int]) -> list[int]:
        """One prompt's token ids: given ids as they are, text encoded, a chat rendered with the template first."""
        if isinstance(prompt, list):
            vocab = self.model.config.vocab_size
            bad = [i for i in prompt if not 0 <= i < vocab]
            if bad:
                raise StemlmError(f"prompt token id {bad[0]} is out of range for vocab_size {vocab}")
            ids = prompt
        else:
            text = prompt
            if parsed.messages is not None:
                if self.chat is None:
                    raise StemlmError(
                        f"checkpoint {self.checkpoint.name} has no chat template (tokenizer_config.json "
                        "chat_template); use /v1/completions"
                    )
                text = self.chat.render_messages(parsed.messages)
            ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if not ids:
            raise StemlmError("the prompt is empty")
        if len(ids) >= self.context:
            raise StemlmError(f"the prompt has {len(ids)} tokens; this model reads at most {self.context - 1}")
        return ids

    def requests(self, parsed: ParsedRequest, on_event: Callable[[int], Callable] | None = None) -> list[Request]:
        """The engine requests of a parsed API body (not yet submitted), one per choice in OpenAI's order
        (prompt-major: choice i * n + j is prompt i's j-th); `on_event(index)` gives choice `index`'s callback.
        Choice j samples with seed + j, so a seeded request's n choices differ (greedy ones are equal), and only
        each prompt's first choice scores the prompt (`prompt_logprobs`): the others would repeat it.
        Raises `StemlmError` for a bad prompt."""
        out, group = [], new_group()  # one fairness group: the choices count together against other requests
        for i, prompt in enumerate(parsed.prompts):
            try:
                ids = self.prompt_ids(parsed, prompt)
            except StemlmError as exc:
                raise StemlmError(f"prompt[{i}]: {exc}" if len(parsed.prompts) > 1 else str(exc)) from None
            for j in range(parsed.n):
                params = parsed.params
                if j:
                    params = replace(params, seed=(params.seed + j) % 2**63, prompt_logprobs=None)
                rows = None if parsed.edit is None else self.edit_rows(ids, parsed.edit)
                callback = None if on_event is None else on_event(len(out))
                out.append(Request(ids, params, on_event=callback, edit_rows=rows, group=group))
        return out

    def submit(self, parsed: ParsedRequest, on_event: Callable[[int], Callable] | None = None) -> list[Request]:
        return [self.loop.submit(request) for request in self.requests(parsed, on_event)]

    def cache_report(self) -> dict | None:
        """Row-cache statistics and memory figures with host / mmap tables (None when resident)."""
        offloaded = self.loaded.offloaded
        return None if offloaded is None else offloaded.report()

    def close(self, cancel: bool = True) -> None:
        """Stop the engine (cancelling what is still in flight unless `cancel` is False), then the loader; once."""
        if self.loop.thread.is_alive():
            self.loop.stop(cancel=cancel)
            self.loaded.close()
