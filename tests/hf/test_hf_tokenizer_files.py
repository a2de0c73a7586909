"""The tokenizer files of every model folder stemlm writes (issue 39 point 3): tokenizer_config.json and
special_tokens_map.json beside tokenizer.json (`stemlm.checkpoint.folder.write_tokenizer_files`), naming the
end-of-text token as eos, consistently with config.json and generation_config.json, and read that way by
transformers' `AutoTokenizer`, by `pipeline("text-generation")` in a process without stemlm, and by lm-eval's own
Hugging Face backend (`lm_eval --model hf`) on an exported remote-code folder.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from stemlm.checkpoint.runs import resolve_checkpoint
from stemlm.cli.main import main
from stemlm.data.tokenizer import EOT_TOKEN, default_tokenizer, eot_id
from stemlm.inference.generate import generate
from stemlm.model import build_model
from tests.hf.test_remote_code import NO_STEMLM, make_eos_reachable, tiny

INPUT_NAMES = ["input_ids", "attention_mask"]


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def check_tokenizer_files(folder: Path) -> int:
    """The folder's tokenizer settings agree with its configs and with what `AutoTokenizer` reads; returns eos."""
    settings, special = _json(folder / "tokenizer_config.json"), _json(folder / "special_tokens_map.json")
    assert special == {"eos_token": EOT_TOKEN} and settings["eos_token"] == EOT_TOKEN
    assert settings["model_input_names"] == INPUT_NAMES and not {"bos_token", "pad_token"} & set(settings)
    eos = Tokenizer.from_file(str(folder / "tokenizer.json")).token_to_id(EOT_TOKEN)
    config = _json(folder / "config.json")
    assert settings["model_max_length"] == config["max_position_embeddings"]
    # A stemlm config.json names no ids (stemlm.hf takes eos from the tokenizer); the others name the same ones.
    assert config.get("eos_token_id", eos) == eos and config.get("bos_token_id") is None
    if (folder / "generation_config.json").is_file():
        assert _json(folder / "generation_config.json")["eos_token_id"] == eos
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert (tokenizer.eos_token, tokenizer.eos_token_id, tokenizer.bos_token, tokenizer.pad_token) == (
        EOT_TOKEN, eos, None, None,
    )  # fmt: skip
    assert tokenizer.model_input_names == INPUT_NAMES and list(tokenizer("a b")) == INPUT_NAMES
    return eos


def test_every_model_folder_carries_its_special_tokens(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("STEMLM_CACHE", str(tmp_path / "cache"))
    run = tmp_path / "run"
    train = ["train", "--out", str(run), "--steps", "2", "--seq-len", "16", "--batch-size", "2", "--eval-batches",
             "1", "--threads", "1", "--no-progress", "--sample-tokens", "0", "--set", "model.ffn=dense",
             "model.hidden_size=32", "model.num_hidden_layers=2", "model.intermediate_size=64",
             "model.num_attention_heads=4", "model.max_position_embeddings=64"]  # fmt: skip
    commands = {
        "export": ["export", str(run), "--out", str(tmp_path / "export")],
        "export-dense-remote-code": ["export", str(run), "--out", str(tmp_path / "export-dense-remote-code"),
                                     "--remote-code"],
        "to-llama": ["convert", "--to-llama", str(run), "--out", str(tmp_path / "to-llama")],
        "retrofit": ["convert", "--from-dense", str(run), "--stem-layers", "all", "--out", str(tmp_path / "retrofit")],
        "export-remote-code": ["export", str(tmp_path / "retrofit"), "--out", str(tmp_path / "export-remote-code"),
                               "--remote-code"],
    }  # fmt: skip
    assert main(train) == 0
    for name, argv in commands.items():
        assert main(argv) == 0, (name, capsys.readouterr().err)
    assert main(["convert", str(tmp_path / "retrofit"), "--table-dtype", "bf16", "--out", str(tmp_path / "bf16")]) == 0
    eos = eot_id(default_tokenizer())
    assert check_tokenizer_files(resolve_checkpoint(run)) == eos  # the training checkpoint
    for name in commands:
        assert check_tokenizer_files(tmp_path / name) == eos, name
    for name in ("tokenizer_config.json", "special_tokens_map.json"):  # copied beside the compact tables
        assert (tmp_path / "bf16" / name).read_bytes() == (tmp_path / "retrofit" / name).read_bytes()
    assert "auto_map" in _json(tmp_path / "export-remote-code" / "config.json")
    assert _json(tmp_path / "to-llama" / "config.json")["model_type"] == "llama"


@pytest.fixture(scope="module")
def remote_code_folder(tmp_path_factory):
    """(model, folder, prompt): a STEM model exported with --remote-code whose greedy run from `prompt` reaches eos."""
    from stemlm.checkpoint.folder import save_pretrained

    root = tmp_path_factory.mktemp("remote")
    tokenizer = default_tokenizer()
    prompt = tokenizer.encode("The capital of France is").ids
    model = build_model(tiny("stem"), seed=5).eval()
    make_eos_reachable(model, prompt)
    save_pretrained(model, root / "ckpt", tokenizer)
    assert main(["export", str(root / "ckpt"), "--out", str(root / "hf"), "--remote-code"]) == 0
    return model, root / "hf", prompt


def run_without_stemlm(code: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """`code` after NO_STEMLM's finder, in an isolated interpreter with stdin closed: a prompt would not wait."""
    env = {"HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "PATH": "/usr/bin:/bin"}  # fmt: skip
    refuse = NO_STEMLM[: NO_STEMLM.index("import torch")]
    argv = [sys.executable, "-I", "-c", refuse + code, *args]
    return subprocess.run(argv, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)


PIPELINE = r"""
import json
from transformers import AutoTokenizer, pipeline
folder, text = sys.argv[1], sys.argv[2]
tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
generator = pipeline("text-generation", model=folder, trust_remote_code=True)
out = generator(text, max_new_tokens=12, do_sample=False, return_tensors=True)[0]["generated_token_ids"]
assert not any(m == "stemlm" or m.startswith("stemlm.") for m in sys.modules), "stemlm was imported"
print(json.dumps({"eos": [tokenizer.eos_token, tokenizer.eos_token_id], "pad": tokenizer.pad_token,
                  "pipeline_eos": generator.tokenizer.eos_token_id, "ids": out}))
"""


def test_tokenizer_and_pipeline_read_the_folder_without_stemlm(remote_code_folder, tmp_path):
    model, folder, prompt = remote_code_folder
    text = default_tokenizer().decode(prompt)
    run = run_without_stemlm(PIPELINE, tmp_path, str(folder), text)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "[y/N]" not in run.stdout + run.stderr  # trust_remote_code given: transformers asks nothing
    result = json.loads(run.stdout.strip().splitlines()[-1])
    eos = eot_id(default_tokenizer())
    assert result["eos"] == [EOT_TOKEN, eos] and result["pipeline_eos"] == eos and result["pad"] is None
    ours = generate(model, prompt, 12, greedy=True, eos_id=eos)
    assert result["ids"] == prompt + ours and ours[-1] == eos and len(ours) < 12  # stopped on end-of-text


LM_EVAL = r"""
from lm_eval.__main__ import cli_evaluate
sys.argv = ["lm_eval", *sys.argv[1:]]
cli_evaluate()
assert not any(m == "stemlm" or m.startswith("stemlm.") for m in sys.modules), "stemlm was imported"
"""

QUESTIONS = [
    ("The capital of France is", ["Paris", "Rome", "Oslo"]),
    ("Two plus two is", ["four", "five", "six"]),
    ("The sky is", ["blue", "green", "red"]),
    ("Water is", ["wet", "dry", "hot"]),
]


def write_task(folder: Path) -> None:
    """A four-question multiple-choice task in lm-eval's format, its data beside it."""
    folder.mkdir()
    rows = [{"query": q, "choices": c, "gold": 0} for q, c in QUESTIONS]
    (folder / "tiny_mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "tiny_mc.yaml").write_text(
        "task: tiny_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {folder / 'tiny_mc.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{query}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "gold"\n'
        "metric_list:\n  - metric: acc\nmetadata:\n  version: 1.0\n"
    )


@torch.no_grad()
def loglikelihood(model, context: str, continuation: str) -> float:
    """log p(continuation | context) from stemlm's model, the continuation's tokens taken as lm-eval takes them."""
    tokenizer = default_tokenizer()
    whole, head = tokenizer.encode(context + continuation).ids, tokenizer.encode(context).ids
    logprobs = model(torch.tensor([whole])).logits[0].log_softmax(-1)
    return sum(logprobs[i - 1, whole[i]].item() for i in range(len(head), len(whole)))


@pytest.mark.slow  # lm-eval, datasets and transformers imported in a fresh interpreter: tens of seconds
def test_lm_eval_hf_backend_scores_an_exported_folder(remote_code_folder, tmp_path):
    model, folder, _ = remote_code_folder
    write_task(tmp_path / "tasks")
    args = ["--model", "hf", "--model_args", f"pretrained={folder},trust_remote_code=True", "--tasks", "tiny_mc",
            "--include_path", str(tmp_path / "tasks"), "--device", "cpu", "--batch_size", "2",
            "--output_path", str(tmp_path / "out"), "--log_samples"]  # fmt: skip
    run = run_without_stemlm(LM_EVAL, tmp_path, *args)
    assert run.returncode == 0, run.stderr[-3000:]
    (results,) = (tmp_path / "out").rglob("results_*.json")
    (samples,) = (tmp_path / "out").rglob("samples_tiny_mc_*.jsonl")
    scored = [json.loads(line) for line in samples.read_text().splitlines()]
    assert len(scored) == len(QUESTIONS)
    correct = 0
    for row in scored:
        context, choices = QUESTIONS[row["doc_id"]]
        ours = [loglikelihood(model, context, " " + choice) for choice in choices]  # lm-eval's " " delimiter
        theirs = [float(resp[0][0]) for resp in row["resps"]]
        assert theirs == pytest.approx(ours, abs=1e-4)
        correct += max(range(len(ours)), key=ours.__getitem__) == 0
    assert _json(results)["results"]["tiny_mc"]["acc,none"] == correct / len(QUESTIONS)
