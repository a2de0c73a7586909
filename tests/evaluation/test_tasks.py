"""The shipped lm-eval tasks: reproducible from the build script, answers checked against the fact world and
the held-out text, every YAML complete, and task-file checking that names what is missing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from stemlm.data import embedded_texts
from stemlm.data.worlds.facts import country
from stemlm.errors import StemlmError
from stemlm.evaluation.tasks import (
    SHIPPED_TASKS,
    build_task_files,
    check_task_config,
    fact_choice_docs,
    shipped_task_dir,
)


@pytest.fixture(scope="module")
def built():
    return build_task_files()


def test_shipped_files_are_a_fresh_build(built):
    folder = shipped_task_dir()
    shipped = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.suffix in (".yaml", ".jsonl")}
    assert shipped == set(built)
    for name, text in built.items():
        assert (folder / name).read_text(encoding="utf-8") == text, f"{name} is stale: run scripts/build_eval_tasks.py"


@pytest.mark.parametrize("relation", ["capital", "language", "currency"])
def test_fact_choices(relation):
    docs = fact_choice_docs(relation)
    assert len(docs) > 200
    for doc in docs:
        truth = country(doc["subject"]).fact(relation)
        assert doc["choices"][doc["gold"]] == f" {truth}"
        assert len(doc["choices"]) == len(set(doc["choices"])) == 4
        assert doc["subject"] in doc["query"]
    assert len({d["gold"] for d in docs}) == 4  # the answer is not always in the same slot


def test_cloze_targets_are_last_words_of_heldout_paragraphs(built):
    heldout = "\n".join(embedded_texts("heldout"))
    docs = [json.loads(line) for line in built["data/stemlm_cloze.jsonl"].splitlines()]
    assert len(docs) == 400
    for doc in docs[::20]:
        assert doc["target"].startswith(" ") and doc["target"][1:].isalpha()
        assert doc["context"] + doc["target"] in heldout


def test_ppl_passages_come_from_heldout(built):
    heldout = "\n".join(embedded_texts("heldout"))
    docs = [json.loads(line) for line in built["data/stemlm_heldout_ppl.jsonl"].splitlines()]
    assert len(docs) == 100 and all(len(d["text"]) >= 2000 for d in docs)
    assert all(d["text"].split("\n\n")[0] in heldout for d in docs)


@pytest.mark.parametrize("name", SHIPPED_TASKS)
def test_shipped_yaml_is_complete(name):
    path = shipped_task_dir() / f"{name}.yaml"
    cfg = yaml.safe_load(path.read_text())
    cfg["dataset_kwargs"]["data_files"]["test"] = str(path.parent / cfg["dataset_kwargs"]["data_files"]["test"])
    check_task_config(cfg, path)
    assert cfg["task"] == name and "stemlm" in cfg["tag"]


@pytest.mark.parametrize(
    "drop,message",
    [
        ("task", "missing 'task'"),
        ("dataset_path", "missing 'dataset_path'"),
        ("doc_to_text", "missing 'doc_to_text'"),
        ("doc_to_choice", "missing 'doc_to_choice'"),
        ("test_split", "missing 'test_split' or 'validation_split'"),
    ],
)
def test_missing_fields_are_named(drop, message):
    cfg = {
        "task": "t",
        "dataset_path": "json",
        "output_type": "multiple_choice",
        "test_split": "test",
        "doc_to_text": "{{q}}",
        "doc_to_target": "gold",
        "doc_to_choice": "{{c}}",
    }
    check_task_config(cfg, Path("t.yaml"))
    del cfg[drop]
    with pytest.raises(StemlmError, match=f"task file t.yaml: {message}"):
        check_task_config(cfg, Path("t.yaml"))


def test_missing_data_file_is_named(tmp_path):
    cfg = {
        "task": "t",
        "dataset_path": "json",
        "output_type": "loglikelihood",
        "test_split": "test",
        "doc_to_text": "{{q}}",
        "doc_to_target": "{{a}}",
        "dataset_kwargs": {"data_files": [str(tmp_path / "x")]},
    }
    with pytest.raises(StemlmError, match="data file .*x does not exist"):
        check_task_config(cfg, Path("t.yaml"))


def test_tag_and_glob_resolve_to_checked_configs_with_absolute_data_files():
    from stemlm.evaluation.tasks import load_task_configs

    specs, _ = load_task_configs(["stemlm"])
    assert sorted(s["task"] for s in specs) == sorted(SHIPPED_TASKS)
    for spec in specs:
        (file,) = spec["dataset_kwargs"]["data_files"].values()
        assert Path(file).is_absolute() and Path(file).is_file()
    specs, _ = load_task_configs(["stemlm_facts_*"])
    assert sorted(s["task"] for s in specs) == [f"stemlm_facts_{r}" for r in ("capital", "currency", "language")]
    with pytest.raises(StemlmError, match="is not a folder"):
        load_task_configs(None, include_paths=["/no/such/folder"])


def test_limit_is_a_count_or_a_fraction():
    import pytest

    from stemlm.errors import StemlmError
    from stemlm.evaluation.tasks import parse_limit

    assert parse_limit("50") == 50 and isinstance(parse_limit("50"), int) and parse_limit("0.25") == 0.25
    with pytest.raises(StemlmError, match="--limit must be positive"):
        parse_limit("0")
