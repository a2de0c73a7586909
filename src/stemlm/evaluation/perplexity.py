"""Held-out perplexity with a sliding window: loss, perplexity and bits per byte of any text.

Each document is scored on its own, conditioned on the `<|endoftext|>` separator the trainer puts between
documents, so its first token is predicted too. A document longer than the window is cut into windows of
at most `window` tokens whose right ends advance by `stride`; each window scores only the tokens no
earlier window scored, so every token is scored exactly once, with at least `window - stride` tokens of
left context (the last window always ends at the document's end with a full window of context). With
`stride == window` this is exactly lm-eval's `loglikelihood_rolling` windowing (the `StemlmLM` adapter
uses these same functions). Bits per byte = total nats / (ln 2 · UTF-8 bytes of the scored text), the
tokenizer-independent number to compare models with different vocabularies.

    from stemlm.evaluation.perplexity import evaluate_perplexity
    result = evaluate_perplexity(model, tokenizer, texts, window=512, stride=256)
    print(result.perplexity, result.bits_per_byte)

`progress=True` draws a tqdm bar over the tokens to score on stderr when it is a terminal (tokens/s and an ETA;
`stemlm.progress`), advanced per batch of windows; every text is tokenized and checked first, so a bad input
fails before the bar appears.

CLI: `stemlm eval ppl CKPT [--data PATH ...] [--seq-len L] [--stride S] [--max-tokens N] [--no-progress] [--json]`.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from stemlm.errors import StemlmError
from stemlm.model.decoder import StemLM


@dataclass(frozen=True)
class Window:
    """One forward over `seq[start:end]` (predicting `seq[start + 1 : end + 1]`); the first `skip`
    predictions were already scored by an earlier window."""

    start: int
    end: int
    skip: int


def rolling_windows(num_targets: int, window: int, stride: int | None = None) -> list[Window]:
    """Windows over a sequence `[prefix] + tokens` with `num_targets` tokens to predict (positions 1..n).

    Right ends are `min(window, n)`, then `+ stride` each time up to n; each window starts `window` tokens
    before its end (or at 0) and scores the targets after the previous end.
    """
    stride = window if stride is None else stride
    if window < 1:
        raise StemlmError(f"window (seq_len) must be a positive number of tokens, got {window}")
    if not 1 <= stride <= window:
        raise StemlmError(f"stride must be between 1 and the window ({window}), got {stride}")
    windows: list[Window] = []
    scored = 0  # targets 1..scored are done
    while scored < num_targets:
        end = min(window if not windows else scored + stride, num_targets)
        start = max(0, end - window)
        windows.append(Window(start, end, scored - start))
        scored = end
    return windows


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def check_window(model: StemLM, window: int) -> None:
    """Refuse a window longer than the model's positions (checked before any scoring starts)."""
    if window > model.config.max_position_embeddings:
        raise StemlmError(
            f"window of {window} tokens exceeds the model's max_position_embeddings="
            f"{model.config.max_position_embeddings}; pass a smaller --seq-len"
        )


@torch.no_grad()
def token_logprobs(
    model: StemLM,
    sequence: Sequence[int],
    window: int,
    stride: int | None = None,
    batch_size: int = 8,
    on_scored: Callable[[int], object] | None = None,
) -> torch.Tensor:
    """Log-probability (float32, nats) of each of `sequence[1:]` given its left context within the window.

    `sequence[0]` is the conditioning prefix (normally `<|endoftext|>`). Windows of equal length are run
    as one batch, so a long document costs `ceil(n / stride)` window forwards in few model calls.
    `on_scored(n)` is called after each batch with the number of tokens it scored (a progress bar's update).
    """
    check_window(model, window)
    seq = torch.as_tensor(list(sequence), dtype=torch.long, device=model_device(model))
    out = torch.full((max(len(seq) - 1, 0),), float("nan"), dtype=torch.float32, device=seq.device)
    by_length: dict[int, list[Window]] = defaultdict(list)
    for w in rolling_windows(len(seq) - 1, window, stride):
        by_length[w.end - w.start].append(w)
    for length, group in by_length.items():
        for i in range(0, len(group), batch_size):
            chunk = group[i : i + batch_size]
            inputs = torch.stack([seq[w.start : w.end] for w in chunk])
            targets = torch.stack([seq[w.start + 1 : w.end + 1] for w in chunk])
            logp = F.log_softmax(model(inputs).logits.float(), dim=-1)
            picked = logp.gather(-1, targets[..., None])[..., 0]
            for row, w in enumerate(chunk):
                out[w.start + w.skip : w.end] = picked[row, w.skip : length]
            if on_scored is not None:
                on_scored(sum(w.end - w.start - w.skip for w in chunk))
    return out


def load_eval(path: str, options=None):
    """A CKPT argument loaded for evaluation (`stemlm.inference.load.load_inference` with `options`: tables, table
    dtype, compute dtype), as a `Loaded` whose tokenizer is the default one when the checkpoint has none."""
    from stemlm.data.tokenizer import default_tokenizer
    from stemlm.inference.load import load_inference

    loaded = load_inference(path, options)
    if loaded.tokenizer is None:
        tokenizer = default_tokenizer()
        if tokenizer.get_vocab_size() > loaded.model.config.vocab_size:
            loaded.close()
            raise StemlmError(
                f"checkpoint {path} has no tokenizer.json and the default tokenizer does not fit its vocab_size "
                f"{loaded.model.config.vocab_size}; save the tokenizer with the checkpoint"
            )
        loaded.tokenizer = tokenizer
    return loaded


def load_eval_checkpoint(path: str, device: str = "cpu") -> tuple[StemLM, Tokenizer]:
    """Model and tokenizer of a CKPT argument (resident tables, fp32); see `load_eval` for the other options."""
    from stemlm.inference.load import InferenceOptions

    loaded = load_eval(path, InferenceOptions(device=device, dtype="fp32"))
    return loaded.model, loaded.tokenizer


@dataclass
class PerplexityResult:
    loss: float  # mean nats per scored token
    perplexity: float
    bits_per_byte: float
    nats: float
    tokens: int
    bytes: int
    documents: int
    window: int
    stride: int

    def to_dict(self) -> dict:
        return asdict(self)


def _truncate(text: str, ids: list[int], offsets: list[tuple[int, int]], cap: int) -> tuple[str, list[int]]:
    # Cut at a token boundary and keep the text those tokens cover, so bytes match the scored tokens; a cut
    # inside a multi-byte character (byte-level BPE splits some) moves right to the character's end.
    while cap < len(ids) and offsets[cap][0] < offsets[cap - 1][1]:
        cap += 1
    if len(ids) <= cap:
        return text, ids
    return text[: offsets[cap - 1][1]], ids[:cap]


def evaluate_perplexity(
    model: StemLM,
    tokenizer: Tokenizer,
    texts: Sequence[str],
    *,
    window: int | None = None,
    stride: int | None = None,
    prefix_id: int | None = None,
    max_tokens: int | None = None,
    batch_size: int = 8,
    progress: bool = False,
) -> PerplexityResult:
    """Score every text (documents separately) and aggregate nats, tokens and bytes over all of them.

    `window` defaults to the model's max_position_embeddings and `stride` to the window. `max_tokens`
    scores only the first ceil(max_tokens / len(texts)) tokens of each document (a quick estimate that
    still covers every document). `prefix_id` defaults to the tokenizer's `<|endoftext|>`. `progress`:
    a bar over the tokens on stderr.
    """
    from stemlm.data.tokenizer import eot_id
    from stemlm.progress import bar as progress_bar

    # None means "default"; 0 is not a silent default but a mistake.
    for name, value in (("window (--seq-len)", window), ("stride", stride), ("batch_size", batch_size)):
        if value is not None and value < 1:
            raise StemlmError(f"{name} must be a positive integer, got {value}")
    window = model.config.max_position_embeddings if window is None else window
    stride = window if stride is None else stride
    rolling_windows(0, window, stride)  # validate the arguments before any work
    texts = [t for t in texts if t]
    if not texts:
        raise StemlmError("no text to score: the data is empty")
    if max_tokens is not None and max_tokens < 1:
        raise StemlmError(f"max_tokens must be positive, got {max_tokens}")
    prefix = eot_id(tokenizer) if prefix_id is None else prefix_id
    cap = None if max_tokens is None else -(-max_tokens // len(texts))
    check_window(model, window)
    documents = []
    for text, enc in zip(texts, tokenizer.encode_batch(texts, add_special_tokens=False), strict=True):
        ids = enc.ids
        if cap is not None:
            text, ids = _truncate(text, ids, enc.offsets, cap)
        if max(ids, default=0) >= model.config.vocab_size:
            raise StemlmError(
                f"the tokenizer produced id {max(ids)} but the model's vocab_size is {model.config.vocab_size}; "
                "use the checkpoint's own tokenizer"
            )
        documents.append((text, ids))
    was_training = model.training
    model.eval()
    nats, tokens, nbytes = 0.0, 0, 0
    total = sum(len(ids) for _, ids in documents)
    bar = progress_bar(total, progress=progress, desc="scoring", unit="tok", unit_scale=True, dynamic_ncols=True)
    try:
        for text, ids in documents:
            logp = token_logprobs(model, [prefix, *ids], window, stride, batch_size, on_scored=bar.update)
            nats -= float(logp.double().sum())
            tokens += len(ids)
            nbytes += len(text.encode("utf-8"))
    finally:
        bar.close()
        model.train(was_training)
    loss = nats / tokens
    return PerplexityResult(
        loss=loss,
        perplexity=math.exp(loss),
        bits_per_byte=nats / (math.log(2) * nbytes),
        nats=nats,
        tokens=tokens,
        bytes=nbytes,
        documents=len(texts),
        window=window,
        stride=stride,
    )


def perplexity_checkpoint(checkpoint: str, options, data=None, seq_len: int | None = None, **kw) -> dict:
    """`stemlm eval ppl`: `evaluate_perplexity` of CKPT loaded with `options` (`load_eval`) on the files `data`
    (default: the embedded corpus's held-out split), in windows of `seq_len` tokens (default: the window its run
    trained at, else the model's maximum); `kw`: stride, max_tokens, batch_size, progress. The report: the result,
    where the data and the window came from, and the offloaded tables' report when there are any."""
    from stemlm.checkpoint.runs import training_window
    from stemlm.data.sources import eval_texts

    if seq_len is not None and seq_len < 1:
        raise StemlmError(f"--seq-len must be a positive number of tokens, got {seq_len}")
    with load_eval(checkpoint, options) as loaded:
        window = seq_len or training_window(checkpoint)
        window_source = "--seq-len" if seq_len else "the run's training window" if window else "the model maximum"
        texts, source = eval_texts(data)
        result = evaluate_perplexity(loaded.model, loaded.tokenizer, texts, window=window, **kw)
        tables = {"tables": loaded.offloaded.report()} if loaded.offloaded else {}
        return {"checkpoint": checkpoint, "data": source, "window_source": window_source, **result.to_dict(), **tables}


def render_perplexity(report: dict) -> str:
    """The line `stemlm eval ppl` prints for a `perplexity_checkpoint` report."""
    return (
        f"loss {report['loss']:.4f}  perplexity {report['perplexity']:.2f}  bits/byte {report['bits_per_byte']:.4f}  "
        f"({report['tokens']:,} tokens, {report['bytes']:,} bytes, {report['documents']} documents; "
        f"window {report['window']} ({report['window_source']}), stride {report['stride']})"
    )
