"""A stemlm model inside EleutherAI's lm-evaluation-harness: the `StemlmLM` adapter and `run_lm_eval`.

`StemlmLM` subclasses `lm_eval.api.model.LM` directly (rather than wrapping the HF-integrated model in
lm-eval's `HFLM`): it drives the model with its own `tokenizers` tokenizer and KV-cache generation, and its
`loglikelihood_rolling` is literally `stemlm.evaluation.perplexity.token_logprobs`, so lm-eval and
`stemlm eval ppl` share one windowing implementation instead of two that must be kept in agreement.
Every request is conditioned on `<|endoftext|>` first, the separator the trainer puts before each
document, so a context starts the way training documents do (an empty context is just that token).
Contexts longer than the model's window keep their rightmost tokens.

Each request type draws a tqdm bar over its requests on stderr, as lm-eval's own models do, unless lm-eval
passes `disable_tqdm`, the model was made with `progress=False` or stderr is not a terminal (`stemlm.progress`).

The adapter is registered with lm-eval under the name `stemlm` (`model_args="pretrained=CKPT"`).
Importing this module switches `datasets` and the Hub to offline mode: tasks must come from local files.
`evaluate_checkpoint` loads, runs and closes in one call; `render_task_report` is the table `stemlm eval lm` prints.

    from stemlm.evaluation.lm_eval_adapter import StemlmLM, run_lm_eval
    results = run_lm_eval(StemlmLM.from_checkpoint("runs/tiny"), tasks=None, limit=20)   # shipped tasks
"""

from __future__ import annotations

import os

# Before lm_eval (and with it `datasets`) is imported: they read these once, at import time.
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import contextlib  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import subprocess  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from lm_eval.api.model import LM  # noqa: E402
from lm_eval.api.registry import register_model  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from tqdm import tqdm  # noqa: E402

from stemlm.errors import StemlmError  # noqa: E402
from stemlm.evaluation.perplexity import load_eval, model_device, token_logprobs  # noqa: E402
from stemlm.model.decoder import StemLM  # noqa: E402
from stemlm.progress import bar as progress_bar  # noqa: E402

DEFAULT_MAX_GEN_TOKS = 64


@register_model("stemlm")
class StemlmLM(LM):
    """lm-eval's three request types on a `StemLM` and its tokenizer (greedy or sampled generation)."""

    def __init__(
        self,
        model: StemLM,
        tokenizer: Tokenizer,
        *,
        batch_size: int = 8,
        max_length: int | None = None,
        max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
        progress: bool = True,
    ) -> None:
        from stemlm.data.tokenizer import eot_id

        super().__init__()
        self.model = model.eval()
        self.tok = tokenizer
        self.eot_token_id = eot_id(tokenizer)
        self.batch_size = int(batch_size)
        self.max_length = int(max_length or model.config.max_position_embeddings)
        if not 2 <= self.max_length <= model.config.max_position_embeddings:
            raise StemlmError(
                f"max_length {self.max_length} must be between 2 and the model's max_position_embeddings="
                f"{model.config.max_position_embeddings}"
            )
        self.max_gen_toks = int(max_gen_toks)
        self.progress = progress  # False: no request bars (`stemlm eval lm --no-progress`)

    # ----- construction from lm-eval's model_args -----
    @classmethod
    def from_checkpoint(
        cls, pretrained: str | Path, *, device: str | None = None, options=None, **kwargs: Any
    ) -> StemlmLM:
        """Load CKPT (a checkpoint or run folder); its tokenizer, or the default one when it has none.
        `options` (`stemlm.inference.load.InferenceOptions`: tables, table dtype, compute dtype) replaces `device`;
        the loaded checkpoint is kept as `.loaded` (close it when done)."""
        from stemlm.inference.load import InferenceOptions

        loaded = load_eval(str(pretrained), options or InferenceOptions(device=device or "cpu", dtype="fp32"))
        lm = cls(loaded.model, loaded.tokenizer, **kwargs)
        lm.loaded = loaded
        return lm

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any], additional_config: dict | None = None) -> StemlmLM:
        args = {**{k: v for k, v in (additional_config or {}).items() if v is not None}, **arg_dict}
        args.pop("max_batch_size", None)
        if "pretrained" not in args:
            raise StemlmError("model_args needs pretrained=CKPT (a stemlm checkpoint or run folder)")
        return cls.from_checkpoint(args.pop("pretrained"), **args)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> StemlmLM:
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    # ----- helpers -----
    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def _score(self, context: list[int], continuation: list[int]) -> tuple[list[int], int]:
        # The forward input (rightmost max_length tokens of context + continuation, minus the last) and
        # the number of continuation tokens it predicts (all of them: they are the last targets).
        if len(continuation) > self.max_length:
            raise StemlmError(f"a continuation of {len(continuation)} tokens does not fit the window {self.max_length}")
        return (context + continuation)[-(self.max_length + 1) : -1], len(continuation)

    # ----- the three request types -----
    @torch.no_grad()
    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(sum of log p(continuation tokens | context), whether greedy decoding would produce them)."""
        items = []
        for i, req in enumerate(requests):
            context, continuation = req.args[0], req.args[1]
            # Trailing spaces of the context go to the continuation (as lm-eval's HFLM does), so "Answer: " +
            # "Paris" is scored as the natural tokens "Answer:" + " Paris", not a lone space token.
            stripped = context.rstrip()
            context, continuation = stripped, context[len(stripped) :] + continuation
            cont = self.encode(continuation)
            inputs, n = self._score([self.eot_token_id, *self.encode(context)], cont)
            items.append((i, inputs, cont, n))
        results: list[tuple[float, bool]] = [(0.0, True)] * len(items)
        items.sort(key=lambda item: -len(item[1]))  # similar lengths share a batch: little padding
        with _bar(len(items), "loglikelihood", disable_tqdm or not self.progress) as bar:
            for start in range(0, len(items), self.batch_size):
                chunk = items[start : start + self.batch_size]
                self._score_batch([item for item in chunk if item[3] > 0], results)
                bar.update(len(chunk))
        return results

    def _score_batch(self, batch: list, results: list[tuple[float, bool]]) -> None:
        """One forward over `batch` (items of equal or falling length); fills their entries of `results`."""
        if not batch:
            return
        device = model_device(self.model)
        width = len(batch[0][1])
        # Right padding needs no attention mask: causal attention never lets a real token see a pad.
        inputs = torch.full((len(batch), width), self.eot_token_id, dtype=torch.long, device=device)
        for row, (_, ids, _, _) in enumerate(batch):
            inputs[row, : len(ids)] = torch.tensor(ids, device=device)
        logits = self.model(inputs).logits
        for row, (i, ids, cont, n) in enumerate(batch):
            # Only the continuation's rows: a [batch, window, vocab] float32 log-softmax would cost 3 GB for
            # 8 x 2048 tokens of a 49k vocabulary.
            rows = F.log_softmax(logits[row, len(ids) - n : len(ids)].float(), dim=-1)
            target = torch.tensor(cont, device=device)
            total = float(rows.gather(-1, target[:, None]).sum())
            results[i] = (total, bool((rows.argmax(-1) == target).all()))

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of each whole text: `token_logprobs` windows of `max_length`, stride = window."""
        out = []
        with _bar(len(requests), "loglikelihood_rolling", disable_tqdm or not self.progress) as bar:
            for req in requests:
                ids = self.encode(req.args[0])
                logp = token_logprobs(self.model, [self.eot_token_id, *ids], self.max_length, None, self.batch_size)
                out.append(float(logp.double().sum()))
                bar.update()
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Generate from each context until one of its `until` strings (cut off), `<|endoftext|>` or
        `max_gen_toks` tokens; greedy unless the task asks for `do_sample` with a temperature > 0."""
        out = []
        with _bar(len(requests), "generate_until", disable_tqdm or not self.progress) as bar:
            for req in requests:
                out.append(self._generate(req.args[0], dict(req.args[1] or {})))
                bar.update()
        return out

    def _generate(self, context: str, kwargs: dict) -> str:
        from stemlm.inference.generate import stream_tokens

        until = kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        max_new = int(kwargs.get("max_gen_toks", self.max_gen_toks))
        if max_new >= self.max_length:
            raise StemlmError(f"max_gen_toks {max_new} leaves no room for a context in the window {self.max_length}")
        prompt = [self.eot_token_id, *self.encode(context)][-(self.max_length - max_new) :]
        temperature = float(kwargs.get("temperature", 0.0) or 0.0)
        greedy = not kwargs.get("do_sample", False) or temperature <= 0
        ids: list[int] = []
        text = ""
        for token in stream_tokens(
            self.model,
            prompt,
            max_new,
            greedy=greedy,
            temperature=temperature or 1.0,
            seed=int(kwargs.get("seed", 0)),
            eos_id=self.eot_token_id,
        ):
            if token == self.eot_token_id:
                break
            ids.append(token)
            text = self.tok.decode(ids)
            if any(stop in text for stop in until):
                break
        cut = min([text.find(s) for s in until if s in text], default=len(text))
        return text[:cut]


def _bar(total: int, desc: str, disable: bool) -> tqdm:
    """The progress bar of one request type (lm-eval's `disable_tqdm` turns it off)."""
    return progress_bar(total, progress=not disable, desc=desc, unit="request")


def run_lm_eval(
    lm: StemlmLM,
    tasks: list[str] | None = None,
    *,
    limit: int | float | None = None,
    include_paths: list[str | Path] | None = None,
    num_fewshot: int | None = None,
    builtin: bool = False,
    seed: int = 0,
    allow_task_code: bool = False,
) -> dict[str, Any]:
    """Run lm-eval's `simple_evaluate` on `tasks` (default: the shipped ones); returns its results dict.

    Task names are resolved and checked by `stemlm.evaluation.tasks.load_task_configs` first, so an
    unknown task, an incomplete task file or an `include_paths` folder others could write (lm-eval runs
    Python from it; `allow_task_code` accepts it) fails with a one-line error before any model call.
    """
    from lm_eval import simple_evaluate

    from stemlm.evaluation.tasks import load_task_configs

    specs, manager = load_task_configs(tasks, include_paths, builtin=builtin, allow_task_code=allow_task_code)
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    try:
        with quiet_git_hash():
            results = simple_evaluate(
                model=lm,
                tasks=specs,
                limit=limit,
                num_fewshot=num_fewshot,
                task_manager=manager,
                bootstrap_iters=0,
                log_samples=True,  # read once for the chance levels below, then dropped
                random_seed=seed,
                numpy_random_seed=seed,
                torch_random_seed=seed,
                fewshot_random_seed=seed,
            )
    except StemlmError:
        raise
    except Exception as exc:  # lm-eval / datasets errors: surface them as one actionable line
        raise StemlmError(f"lm-eval failed: {type(exc).__name__}: {str(exc).strip().splitlines()[0]}") from exc
    samples = results.pop("samples", {}) or {}
    results["chance"] = {task: chance_level(results, task, rows) for task, rows in samples.items()}
    return results


@contextlib.contextmanager
def quiet_git_hash() -> Iterator[None]:
    """lm-eval records the working directory's git commit by running `git describe` with stderr left open, so a
    run outside a git checkout printed git's "fatal: not a git repository" line (and one without git relied on a
    FileNotFoundError being caught). Within this block it asks git with stderr discarded, and falls back to
    lm-eval's own reading of .git files as it does on failure: the same recorded hash, and no stray line."""
    import lm_eval.evaluator as evaluator
    from lm_eval.loggers.utils import get_commit_from_path

    def git_hash() -> str | None:
        try:
            out = subprocess.run(["git", "describe", "--always"], capture_output=True, check=True, timeout=10)
            return out.stdout.decode().strip()
        except (OSError, subprocess.SubprocessError):
            return get_commit_from_path(os.getcwd())

    original = evaluator.get_git_commit_hash
    evaluator.get_git_commit_hash = git_hash
    try:
        yield
    finally:
        evaluator.get_git_commit_hash = original


def chance_level(results: dict[str, Any], task: str, samples: list[dict]) -> float | None:
    """Expected accuracy of uniform guessing: the mean of 1 / (number of choices) over the scored documents of
    a multiple-choice task; None for other task kinds (a greedy-match or perplexity task has no such level)."""
    if results.get("configs", {}).get(task, {}).get("output_type") != "multiple_choice" or not samples:
        return None
    return sum(1.0 / len(row["arguments"]) for row in samples) / len(samples)


BINARY_METRICS = ("acc", "acc_norm", "exact_match")


def task_report(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{task: {"n", "chance", "metrics": {metric: {"value", "stderr"}}}}; the standard error of a 0/1 metric's
    mean is sqrt(p (1 - p) / (n - 1)) (the sample standard deviation over sqrt(n), as lm-eval's `mean_stderr`),
    None for other metrics (lm-eval runs here without bootstrap)."""
    report = {}
    for task, values in summarize_results(results).items():
        n = int(results.get("n-samples", {}).get(task, {}).get("effective", 0))
        metrics = {}
        for metric, value in values.items():
            binary = metric in BINARY_METRICS and n > 1
            stderr = math.sqrt(value * (1 - value) / (n - 1)) if binary else None
            metrics[metric] = {"value": value, "stderr": stderr}
        report[task] = {"n": n, "chance": results.get("chance", {}).get(task), "metrics": metrics}
    return report


def evaluate_checkpoint(
    checkpoint: str | Path,
    options,
    tasks: list[str] | None = None,
    include_paths: list[str | Path] | None = None,
    *,
    batch_size: int = 8,
    max_length: int | None = None,
    progress: bool = True,
    **eval_options: Any,
) -> dict[str, Any]:
    """`run_lm_eval` on CKPT loaded with `options` (`stemlm.inference.load.InferenceOptions`), closed after;
    `eval_options`: limit, num_fewshot, builtin, seed, allow_task_code; `progress`: the request bars."""
    lm_options = {"batch_size": batch_size, "max_length": max_length, "progress": progress}
    lm = StemlmLM.from_checkpoint(checkpoint, options=options, **lm_options)
    with lm.loaded:
        return run_lm_eval(lm, tasks, include_paths=include_paths, **eval_options)


def results_summary(results: dict[str, Any]) -> dict[str, Any]:
    """What `stemlm eval lm --json` prints of lm-eval's results: the metrics, sample counts and task report."""
    return {
        "results": summarize_results(results),
        "n_samples": results.get("n-samples", {}),
        "tasks": task_report(results),
    }


def render_task_report(report: dict[str, dict[str, Any]]) -> str:
    """The table `stemlm eval lm` prints for a `task_report`: a line per task, each metric with its standard error."""
    width = max(len(t) for t in report)
    lines = []
    for task, r in report.items():
        cells = [
            f"{k} {m['value']:.4f}" + (f" ± {m['stderr']:.4f}" if m["stderr"] is not None else "")
            for k, m in r["metrics"].items()
        ]
        chance = "n/a" if r["chance"] is None else f"{r['chance']:.3f}"
        lines.append(f"{task:<{width}}  n {r['n']:>4}  " + "  ".join(cells) + f"  (chance {chance})")
    lines.append("± is one standard error of the mean over the n examples; chance = uniform guessing among the choices")
    return "\n".join(lines)


def summarize_results(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """{task: {metric: value}} from lm-eval's results, dropping stderr entries and the filter suffix."""
    summary = {}
    for task, metrics in results.get("results", {}).items():
        values = {}
        for key, value in metrics.items():
            metric = key.split(",")[0]
            if (
                metric not in ("alias", "sample_len")
                and not metric.endswith("_stderr")
                and isinstance(value, (int, float))
            ):
                values[metric] = float(value)
        summary[task] = values
    return summary
