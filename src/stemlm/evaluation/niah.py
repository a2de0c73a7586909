"""Needle in a haystack (RULER-style `niah_single` and multi-key variants), heatmaps, and passkey training data.

A sample is a haystack of repeated filler sentences ("The grass is green. The sky is blue. ...") with one
or more needles "One of the special magic numbers for {key} is: {number}." and, at the end, a query for
one key whose answer is that key's number. Lengths are in tokens and count everything the model holds:
the `<|endoftext|>` prefix, the prompt and the tokens left for the answer, so a length of at most
`max_position_embeddings` always fits. The queried needle sits at the requested depth: depth 0 before the
first filler sentence, 1 after the last, d in between after round(d · n) of the n sentences; the other
needles (multi-key) go to random sentence boundaries. Scoring is exact match of the first number in the
generated text. `run_niah` runs a grid of lengths × depths with any `answer(prompt, max_new_tokens) -> text`
function (`model_answerer` wraps a model with greedy KV-cache decoding), `plot_niah_heatmap` draws it;
every sample is built before the first answer, so a length too short for the task fails before any decoding
(and before the progress bar, `progress=True`: one step per sample on a terminal's stderr, `stemlm.progress`).

`write_niah` / `render_niah` write and print a grid's result; `positive_ints` / `depth_fractions` read the
lengths and depths as typed. Small models only retrieve after seeing the task in training: `passkey_documents`
produces such documents (prompt + answer) to mix into the training data, e.g. as a jsonl file for `--data`
(`write_passkey_data`):

    stemlm eval niah-data --out niah.jsonl --num 2000 --lengths 128,256     # {"text": ...} per line
    stemlm eval niah runs/tiny --lengths 256,512,1024 --depths 0,0.25,0.5,0.75,1 --samples 4 --out niah/
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from stemlm.errors import StemlmError

FILLER = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.")
NEEDLE = "One of the special magic numbers for {key} is: {value}."
INTRO = "Special magic numbers are hidden in the text below. Remember them."
QUERY = "What is the special magic number for {key} in the text above? The special magic number for {key} is"
KEYS = (
    "apple anchor badger bamboo beacon candle canyon cedar comet copper dolphin ember falcon fern glacier granite "
    "harbor hazel island ivory jasper juniper kettle lantern maple marble meadow nectar orchid otter pebble pepper "
    "quartz quill raven ribbon saffron sparrow thistle timber tulip velvet violet walnut willow yarrow zephyr zinc"
).split()
AnswerFn = Callable[[str, int], str]


@dataclass
class NiahSample:
    prompt: str
    answer: str  # the queried number, digits only
    key: str
    depth: float  # the requested depth of the queried needle
    length: int  # the requested context length in tokens
    tokens: int  # actual tokens: prefix + prompt + answer budget (<= length)
    sentences: int  # filler sentences in the haystack
    needle_index: int  # filler sentences before the queried needle
    max_new_tokens: int


def positive_ints(text: str) -> list[int]:
    """Context lengths or needle counts typed as "256,512,1024"."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise StemlmError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise StemlmError(f"{text!r}: give positive integers, e.g. 256,512,1024")
    return values


def depth_fractions(text: str) -> list[float]:
    """Needle depths typed as "0,0.5,1", each in [0, 1]."""
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise StemlmError(f"{text!r} is not a comma-separated list of numbers") from None
    if not values or not all(0.0 <= v <= 1.0 for v in values):
        raise StemlmError(f"{text!r}: depths are fractions in [0, 1], e.g. 0,0.5,1")
    return values


def answer_budget(digits: int) -> int:
    # A number of d digits is at most d tokens plus a leading space; one spare token for what follows it.
    return digits + 2


def _compose(sentences: int, inserts: dict[int, list[str]], query: str) -> str:
    parts: list[str] = []
    for i in range(sentences + 1):
        parts += inserts.get(i, [])
        if i < sentences:
            parts.append(FILLER[i % len(FILLER)])
    return f"{INTRO}\n{' '.join(parts)}\n{query}"


def make_niah_sample(
    tokenizer: Tokenizer,
    length: int,
    depth: float,
    *,
    needles: int = 1,
    digits: int = 7,
    rng: random.Random | None = None,
) -> NiahSample:
    """One sample of `length` tokens (as close as whole filler sentences allow) with the queried needle at
    `depth`; `needles` > 1 adds distractor needles with other keys and numbers (multi-key)."""
    if not 0.0 <= depth <= 1.0:
        raise StemlmError(f"needle depth must be in [0, 1], got {depth}")
    if not 1 <= needles <= len(KEYS):
        raise StemlmError(f"needles must be between 1 and {len(KEYS)}, got {needles}")
    if digits < 1:
        raise StemlmError(f"digits must be positive, got {digits}")
    rng = rng or random.Random(0)
    keys = rng.sample(KEYS, needles)
    values = [str(rng.randrange(10 ** (digits - 1), 10**digits)) for _ in keys]
    query = QUERY.format(key=keys[0])
    budget = answer_budget(digits)

    def layout(n: int) -> dict[int, list[str]]:
        inserts: dict[int, list[str]] = {round(depth * n): [NEEDLE.format(key=keys[0], value=values[0])]}
        others = random.Random(f"{keys}:{values}:{n}")  # same n -> same positions, so counting is exact
        for key, value in zip(keys[1:], values[1:], strict=True):
            inserts.setdefault(others.randint(0, n), []).append(NEEDLE.format(key=key, value=value))
        return inserts

    def total(n: int) -> int:
        return 1 + len(tokenizer.encode(_compose(n, layout(n), query), add_special_tokens=False).ids) + budget

    if total(0) > length:
        raise StemlmError(f"context length {length} is too short for the needle task itself ({total(0)} tokens)")
    lo, hi = 0, max(1, length)  # each sentence is at least one token, so `length` sentences never fit
    while lo < hi:  # the largest n with total(n) <= length
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if total(mid) <= length else (lo, mid - 1)
    return NiahSample(
        _compose(lo, layout(lo), query), values[0], keys[0], depth, length, total(lo), lo, round(depth * lo), budget
    )


def extract_number(text: str) -> str | None:
    """The first run of digits in a generated text (None when there is none)."""
    match = re.search(r"\d+", text)
    return match.group(0) if match else None


def score(sample: NiahSample, generated: str) -> bool:
    """Exact match: the first number generated is the queried needle's number, digit for digit."""
    return extract_number(generated) == sample.answer


def model_answerer(model: Any, tokenizer: Tokenizer) -> AnswerFn:
    """Greedy KV-cache decoding of `max_new_tokens` after `<|endoftext|>` + the prompt, decoded to text."""
    from stemlm.data.tokenizer import eot_id
    from stemlm.inference.generate import generate

    eot = eot_id(tokenizer)

    def answer(prompt: str, max_new_tokens: int) -> str:
        ids = [eot, *tokenizer.encode(prompt, add_special_tokens=False).ids]
        new = generate(model, ids, max_new_tokens, greedy=True, eos_id=eot)
        return tokenizer.decode([t for t in new if t != eot])

    return answer


def run_niah(
    answer: AnswerFn,
    tokenizer: Tokenizer,
    lengths: Sequence[int],
    depths: Sequence[float],
    *,
    samples: int = 4,
    needles: int = 1,
    digits: int = 7,
    seed: int = 0,
    max_context: int | None = None,
    keep_outputs: bool = False,
    progress: bool = False,
) -> dict[str, Any]:
    """Accuracy on every (length, depth) cell over `samples` samples each, by length, and overall.

    `max_context` (the model's max_position_embeddings) is checked before anything runs.
    """
    from stemlm.progress import bar as progress_bar

    lengths, depths = [int(n) for n in lengths], [float(d) for d in depths]
    if not lengths or not depths:
        raise StemlmError("give at least one context length and one depth")
    if samples < 1:
        raise StemlmError(f"samples must be positive, got {samples}")
    too_long = [n for n in lengths if max_context is not None and n > max_context]
    if too_long:
        raise StemlmError(
            f"context length {max(too_long)} exceeds the model's max_position_embeddings="
            f"{max_context}; use lengths up to {max_context}"
        )
    planned = []
    for length in lengths:
        for depth in depths:
            rng = random.Random(f"{seed}:{length}:{depth}")
            drawn = [
                make_niah_sample(tokenizer, length, depth, needles=needles, digits=digits, rng=rng)
                for _ in range(samples)
            ]
            planned.append((length, depth, drawn))
    grid: dict[str, dict[str, float]] = {}
    outputs = []
    with progress_bar(len(planned) * samples, progress=progress, desc="niah", unit="sample") as bar:
        for length, depth, drawn in planned:
            hits = 0
            for sample in drawn:
                generated = answer(sample.prompt, sample.max_new_tokens)
                hits += score(sample, generated)
                if keep_outputs:
                    outputs.append({**asdict(sample), "generated": generated, "correct": score(sample, generated)})
                bar.update()
            grid.setdefault(str(length), {})[str(depth)] = hits / samples
    by_length = {n: sum(cells.values()) / len(cells) for n, cells in grid.items()}
    result = {
        "variant": "niah_single" if needles == 1 else f"niah_multikey_{needles}",
        "lengths": lengths,
        "depths": depths,
        "samples": samples,
        "needles": needles,
        "digits": digits,
        "seed": seed,
        "grid": grid,
        "by_length": by_length,
        "accuracy": sum(by_length.values()) / len(by_length),
    }
    if keep_outputs:
        result["outputs"] = outputs
    return result


def plot_niah_heatmap(result: dict[str, Any], path: str | Path, title: str = "") -> Path:
    """Depth (rows) × context length (columns) accuracy heatmap as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths, depths = [str(n) for n in result["lengths"]], [str(d) for d in result["depths"]]
    cells = [[result["grid"][n][d] for n in lengths] for d in depths]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.6 + 0.9 * len(lengths)), max(3.0, 1.2 + 0.55 * len(depths))))
    image = ax.imshow(cells, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto")
    for i, row in enumerate(cells):
        for j, value in enumerate(row):
            ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(lengths)), lengths)
    ax.set_yticks(range(len(depths)), depths)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    ax.set_title(title or f"{result['variant']} accuracy")
    fig.colorbar(image, ax=ax, fraction=0.05)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def niah_checkpoint(checkpoint: str, options, lengths, depths, **kw: Any) -> dict[str, Any]:
    """`run_niah` on CKPT loaded with `options` (`stemlm.inference.load.InferenceOptions`), every output kept and
    lengths capped by the model's max_position_embeddings; `kw`: samples, needles, digits, seed, progress."""
    from stemlm.evaluation.perplexity import load_eval

    with load_eval(checkpoint, options) as loaded:
        model, tokenizer = loaded.model, loaded.tokenizer
        answer, limit = model_answerer(model, tokenizer), model.config.max_position_embeddings
        return run_niah(answer, tokenizer, lengths, depths, max_context=limit, keep_outputs=True, **kw)


def write_niah(result: dict[str, Any], out: Path, title: str, **guard) -> None:
    """`out`/niah.json and niah_heatmap.png, written atomically (`guard`: `AtomicFolder`'s refusal rules)."""
    from stemlm.checkpoint.safe_write import AtomicFolder

    with AtomicFolder(out, **guard) as tmp:
        (tmp / "niah.json").write_text(json.dumps(result, indent=2), encoding="utf-8")
        plot_niah_heatmap(result, tmp / "niah_heatmap.png", title=title)


def render_niah(result: dict[str, Any]) -> str:
    """The lines `stemlm eval niah` prints: the overall accuracy, then one per context length."""
    lines = [f"{result['variant']}: accuracy {result['accuracy']:.3f}"]
    lines += [f"  length {length:>6}: {acc:.3f}" for length, acc in result["by_length"].items()]
    return "\n".join(lines)


def passkey_documents(
    tokenizer: Tokenizer,
    num_docs: int,
    lengths: Sequence[int],
    *,
    needles: Sequence[int] = (1, 2, 4),
    digits: int = 7,
    seed: int = 1234,
) -> list[str]:
    """Training documents: a needle sample at a random length and depth followed by its answer.

    The default seed differs from the evaluation seeds; numbers are random, so nothing can be memorised.
    """
    rng = random.Random(seed)
    docs = []
    for _ in range(num_docs):
        sample = make_niah_sample(
            tokenizer,
            rng.choice(list(lengths)),
            rng.random(),
            needles=rng.choice(list(needles)),
            digits=digits,
            rng=rng,
        )
        docs.append(f"{sample.prompt} {sample.answer}.")
    return docs


def write_jsonl(texts: Sequence[str], path: str | Path, *, force: bool = False) -> Path:
    """Write texts as `{"text": ...}` lines (the jsonl form `--data` reads); an existing file only with `force`."""
    from stemlm.checkpoint.safe_write import write_output_file

    return write_output_file(path, "".join(json.dumps({"text": t}) + "\n" for t in texts), force=force)


def write_passkey_data(tokenizer, out, num: int, lengths, *, needles, digits: int, seed: int, force: bool = False):
    """`stemlm eval niah-data`: `num` passkey documents (`passkey_documents`) written as jsonl to `out`;
    (path, documents written)."""
    try:
        docs = passkey_documents(tokenizer, num, lengths, needles=needles, digits=digits, seed=seed)
    except StemlmError as exc:
        raise StemlmError(f"{exc}; raise --lengths or lower --needles / --digits") from None
    return write_jsonl(docs, out, force=force), len(docs)
