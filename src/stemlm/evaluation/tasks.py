"""The shipped lm-evaluation-harness tasks: building their data, and finding and checking task files at run time.

Five tasks ship in `assets/lm_eval_tasks/` (a YAML each plus jsonl data in `data/`), built offline from
package assets by `python scripts/build_eval_tasks.py` (deterministic, so a rebuild is byte-identical):

- `stemlm_facts_capital`, `stemlm_facts_language`, `stemlm_facts_currency`: multiple choice over the fact
  world; the prompt is the relation's first training template ("The capital of France is") and the three
  distractors are other countries' objects for the same relation;
- `stemlm_cloze`: last-word prediction (LAMBADA style) on passages of the embedded corpus's held-out split;
- `stemlm_heldout_ppl`: `loglikelihood_rolling` over held-out passages (word / byte perplexity, bits per byte).

All five carry the tag `stemlm`, so `--tasks stemlm` runs them together. lm-eval hands `data_files` to
`datasets.load_dataset`, which resolves relative paths against the working directory; `load_task_configs`
therefore reads each requested YAML itself and makes its relative `data_files` absolute against the YAML's
folder, for the shipped tasks and for any user folder given with `--include-path`. `parse_limit` reads `--limit`.
"""

from __future__ import annotations

import json
import random
import re
from importlib import resources
from pathlib import Path
from typing import Any

from stemlm.errors import StemlmError

TAG = "stemlm"
FACT_RELATIONS = ("capital", "language", "currency")
SHIPPED_TASKS = tuple(f"stemlm_facts_{r}" for r in FACT_RELATIONS) + ("stemlm_cloze", "stemlm_heldout_ppl")
NUM_CHOICES = 4
CLOZE_PASSAGES = 400
CLOZE_WORDS = (30, 250)  # passages (paragraphs) with this many words
PPL_PASSAGES = 100
PPL_CHARS = 2000  # target passage length; cut at the next paragraph break
OUTPUT_TYPES = ("loglikelihood", "loglikelihood_rolling", "multiple_choice", "generate_until")
_LAST_WORD = re.compile(r"^(.*\S) ([A-Za-z][a-z]+)([.!?;:,'\"’”)]*)$", re.DOTALL)

_METRICS = {
    "multiple_choice": [("acc", "mean", True), ("acc_norm", "mean", True)],
    "loglikelihood": [("perplexity", "perplexity", False), ("acc", "mean", True)],
    "loglikelihood_rolling": [
        ("word_perplexity", "weighted_perplexity", False),
        ("byte_perplexity", "weighted_perplexity", False),
        ("bits_per_byte", "bits_per_byte", False),
    ],
}


def parse_limit(text: str) -> int | float:
    """`--limit` of lm-eval: examples per task (an integer), or a fraction of each task below 1."""
    try:
        value = float(text)
    except ValueError:
        raise StemlmError(f"--limit {text!r} is not a number") from None
    if value <= 0:
        raise StemlmError(f"--limit must be positive, got {text}")
    return value if value < 1 else int(value)


def shipped_task_dir() -> Path:
    """The folder of the shipped task YAMLs (inside the installed package)."""
    return Path(str(resources.files("stemlm") / "assets" / "lm_eval_tasks"))


# ---------------------------------------------------------------------------------------------------------
# building the shipped data
# ---------------------------------------------------------------------------------------------------------
def fact_choice_docs(relation: str, seed: int = 0) -> list[dict[str, Any]]:
    """One multiple-choice record per country that has `relation`: query, four choices, gold index."""
    from stemlm.data.worlds.facts import TEMPLATES, load_countries

    rng = random.Random(f"{seed}:{relation}")
    countries = [c for c in load_countries() if c.fact(relation) is not None]
    objects = sorted({c.fact(relation) for c in countries})
    docs = []
    for c in countries:
        answer = c.fact(relation)
        choices = [answer, *rng.sample([o for o in objects if o != answer], NUM_CHOICES - 1)]
        rng.shuffle(choices)
        query = TEMPLATES[relation][0][0].format(s=c.name)
        docs.append(
            {"subject": c.name, "query": query, "choices": [f" {o}" for o in choices], "gold": choices.index(answer)}
        )
    return docs


def _paragraphs(texts: list[str]) -> list[str]:
    return [p.strip() for text in texts for p in re.split(r"\n\s*\n", text) if p.strip()]


def cloze_docs(texts: list[str], count: int = CLOZE_PASSAGES, seed: int = 0) -> list[dict[str, str]]:
    """Last-word records {context, target} from paragraphs of `texts` ending in a word (plus punctuation).

    The target is the final word with its leading space; trailing punctuation is dropped from the passage,
    as LAMBADA does, so the model has to predict the word itself.
    """
    found = []
    for para in _paragraphs(texts):
        if not CLOZE_WORDS[0] <= len(para.split()) <= CLOZE_WORDS[1]:
            continue
        match = _LAST_WORD.match(para)
        if match:
            found.append({"context": match.group(1), "target": " " + match.group(2)})
    if not found:
        raise StemlmError("no paragraph in the held-out text is usable for the cloze task")
    picked = sorted(random.Random(seed).sample(range(len(found)), min(count, len(found))))
    return [found[i] for i in picked]


def passage_docs(texts: list[str], count: int = PPL_PASSAGES, chars: int = PPL_CHARS) -> list[dict[str, str]]:
    """`count` passages of about `chars` characters (whole paragraphs), spread evenly over `texts`."""
    passages, current = [], ""
    for para in _paragraphs(texts):
        current = f"{current}\n\n{para}" if current else para
        if len(current) >= chars:
            passages.append(current)
            current = ""
    if not passages:
        raise StemlmError("the held-out text is too short to cut perplexity passages from")
    step = max(1, len(passages) // count)
    return [{"text": p} for p in passages[::step][:count]]


def _yaml_task(name: str, output_type: str, fields: dict[str, str], description: str) -> str:
    lines = [
        f"# {description}",
        "# Generated by scripts/build_eval_tasks.py; edit that script, not this file.",
        f"task: {name}",
        f"tag: [{TAG}]",
        "dataset_path: json",
        "dataset_kwargs:",
        "  data_files:",
        f"    test: data/{name}.jsonl",
        "test_split: test",
        f"output_type: {output_type}",
    ]
    lines += [f"{key}: {json.dumps(value)}" for key, value in fields.items()]
    lines.append("metric_list:")
    for metric, aggregation, higher in _METRICS[output_type]:
        lines += [
            f"  - metric: {metric}",
            f"    aggregation: {aggregation}",
            f"    higher_is_better: {str(higher).lower()}",
        ]
    lines += ["metadata:", "  version: 1.0"]
    return "\n".join(lines) + "\n"


def build_task_files() -> dict[str, str]:
    """Every shipped file as {relative path: text}: five YAMLs and five jsonl data files."""
    from stemlm.data import embedded_texts

    heldout = embedded_texts("heldout")
    records = {f"stemlm_facts_{r}": fact_choice_docs(r) for r in FACT_RELATIONS}
    records["stemlm_cloze"] = cloze_docs(heldout)
    records["stemlm_heldout_ppl"] = passage_docs(heldout)
    files = {
        f"data/{name}.jsonl": "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in docs)
        for name, docs in records.items()
    }
    choice = {
        "doc_to_text": "{{query}}",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "gold",
        "target_delimiter": "",
    }
    for relation in FACT_RELATIONS:
        files[f"stemlm_facts_{relation}.yaml"] = _yaml_task(
            f"stemlm_facts_{relation}",
            "multiple_choice",
            choice,
            f"Fact world, {relation}: pick the right object among {NUM_CHOICES} (distractors: other countries').",
        )
    files["stemlm_cloze.yaml"] = _yaml_task(
        "stemlm_cloze",
        "loglikelihood",
        {"doc_to_text": "{{context}}", "doc_to_target": "{{target}}", "target_delimiter": ""},
        "Last-word prediction on held-out corpus paragraphs (acc = the word is the greedy continuation).",
    )
    files["stemlm_heldout_ppl.yaml"] = _yaml_task(
        "stemlm_heldout_ppl",
        "loglikelihood_rolling",
        {"doc_to_text": "", "doc_to_target": "{{text}}"},
        "Rolling log-likelihood of held-out corpus passages (perplexities and bits per byte).",
    )
    return files


# ---------------------------------------------------------------------------------------------------------
# task files at run time
# ---------------------------------------------------------------------------------------------------------
def check_task_config(cfg: dict[str, Any], path: Path) -> None:
    """Raise a one-line StemlmError naming the file when a task config lacks what lm-eval needs."""

    def need(cond: bool, what: str) -> None:
        if not cond:
            raise StemlmError(f"task file {path}: {what}")

    need(isinstance(cfg.get("task"), str), "missing 'task' (the task name)")
    need("dataset_path" in cfg or "custom_dataset" in cfg, "missing 'dataset_path' (e.g. 'json' for local jsonl)")
    output_type = cfg.get("output_type", "generate_until")
    need(output_type in OUTPUT_TYPES, f"output_type {output_type!r} is not one of {', '.join(OUTPUT_TYPES)}")
    need(any(k in cfg for k in ("test_split", "validation_split")), "missing 'test_split' or 'validation_split'")
    for key in ("doc_to_text", "doc_to_target") + (("doc_to_choice",) if output_type == "multiple_choice" else ()):
        need(key in cfg, f"missing {key!r} (needed by output_type {output_type})")
    data_files = (cfg.get("dataset_kwargs") or {}).get("data_files")
    for file in _data_file_list(data_files):
        need(Path(file).is_file(), f"data file {file} does not exist")


def _data_file_list(data_files: Any) -> list[str]:
    if data_files is None:
        return []
    if isinstance(data_files, (str, Path)):
        return [str(data_files)]
    if isinstance(data_files, dict):
        return [f for v in data_files.values() for f in _data_file_list(v)]
    return [str(f) for f in data_files]


def _absolute(data_files: Any, base: Path) -> Any:
    if isinstance(data_files, (str, Path)):
        path = Path(data_files).expanduser()
        return str(path if path.is_absolute() else (base / path).resolve())
    if isinstance(data_files, dict):
        return {k: _absolute(v, base) for k, v in data_files.items()}
    return [_absolute(f, base) for f in data_files]


def _expand_tags(manager: Any, names: list[str]) -> list[str]:
    # A tag is expanded here (not by lm-eval) so that its tasks' data_files get made absolute too.
    out: list[str] = []
    for name in names:
        entry = manager.task_index[name]
        out += _expand_tags(manager, sorted(entry.tags)) if entry.kind.name == "TAG" else [name]
    return list(dict.fromkeys(out))


def load_task_configs(
    names: list[str] | None,
    include_paths: list[str | Path] | None = None,
    builtin: bool = False,
    allow_task_code: bool = False,
) -> tuple[list[Any], Any]:
    """(specs, task manager) for `lm_eval.simple_evaluate`: checked config dicts for tasks, names for groups.

    `names` default to the shipped tasks; glob patterns ("stemlm_facts_*") match indexed names. User
    folders in `include_paths` are indexed after the shipped folder (a user task of the same name wins);
    each must pass `task_folders.check_task_folder` (lm-eval runs Python named in it) unless
    `allow_task_code`. `builtin` also indexes lm-eval's own tasks, whose datasets must already be in the
    local cache.
    """
    from lm_eval.tasks import TaskManager
    from lm_eval.tasks._yaml_loader import load_yaml

    from stemlm.evaluation.task_folders import check_task_folder

    folders = [shipped_task_dir()]
    for folder in include_paths or []:
        folders.append(check_task_folder(folder, allow_task_code))
    try:
        manager = TaskManager(include_path=[str(f) for f in folders], include_defaults=builtin)
    except Exception as exc:  # a malformed YAML anywhere in the folders
        raise StemlmError(f"cannot index the task folders: {str(exc).splitlines()[0]}") from exc
    specs: list[Any] = []
    for name in names or list(SHIPPED_TASKS):
        matched = manager.match_tasks([name]) if any(ch in name for ch in "*?[") else [name]
        if not matched or matched[0] not in manager.task_index:
            known = ", ".join(sorted(n for n in manager.all_tasks if not builtin or n.startswith(TAG))[:20])
            raise StemlmError(f"unknown task {name!r}; known tasks include: {known} (add folders with --include-path)")
        for task in _expand_tags(manager, matched):
            entry = manager.task_index[task]
            if entry.yaml_path is None or entry.kind.name != "TASK":
                specs.append(task)  # a group or Python task: lm-eval resolves it (paths as written)
                continue
            path = Path(entry.yaml_path).resolve()
            try:
                cfg = load_yaml(path, resolve_func=True)
            except Exception as exc:
                raise StemlmError(f"task file {path}: {str(exc).splitlines()[0]}") from exc
            kwargs = cfg.get("dataset_kwargs") or {}
            if "data_files" in kwargs:
                cfg["dataset_kwargs"] = {**kwargs, "data_files": _absolute(kwargs["data_files"], path.parent)}
            check_task_config(cfg, path)
            specs.append(cfg)
    return specs, manager
