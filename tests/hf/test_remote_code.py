"""`stemlm export --remote-code` (`stemlm.hf.remote_code`, `stemlm.convert.llama.standalone_files`): a folder that
transformers loads with `trust_remote_code=True` in a process where `import stemlm` fails, with stemlm's logits,
and whose `generate()` stops on the tokenizer's end-of-text id as stemlm's own `generate` does."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers.dynamic_module_utils import get_imports, get_relative_import_files

from stemlm.checkpoint.folder import save_pretrained
from stemlm.cli.main import main
from stemlm.data.tokenizer import default_tokenizer, eot_id
from stemlm.hf.remote_code import AUTO_MAP, remote_code_files
from stemlm.inference.generate import generate
from stemlm.model import build_model
from stemlm.model.config import ModelConfig
from stemlm.model.decoder import ForwardOptions

# Runs with -I (no PYTHONPATH, no user site) and a finder that refuses stemlm, so the venv's editable install of
# stemlm cannot be reached either: the folder's own files are all there is.
NO_STEMLM = r"""
import importlib.abc, json, sys
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "stemlm" or name.startswith("stemlm."):
            raise ImportError(f"stemlm is not installed here ({name})")
sys.meta_path.insert(0, Refuse())
import torch
from transformers import AutoModelForCausalLM
folder, out = sys.argv[1], sys.argv[2]
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
ids = torch.tensor(json.loads(sys.argv[3]))
prompt = torch.tensor([json.loads(sys.argv[4])])
with torch.no_grad():
    logits = model(ids).logits
generated = model.generate(prompt, max_new_tokens=12, do_sample=False)[0, prompt.shape[1]:].tolist()
assert not any(m == "stemlm" or m.startswith("stemlm.") for m in sys.modules), "stemlm was imported"
torch.save({"logits": logits, "generated": generated, "class": type(model).__module__}, out)
"""


def tiny(ffn: str, **extra) -> ModelConfig:
    return ModelConfig(
        vocab_size=8192, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, ffn=ffn, ffn_layers="all-but-first", engram_dim=16,
        **extra,
    )  # fmt: skip


def make_eos_reachable(model, prompt: list[int]) -> None:
    """Point the lm_head row of the end-of-text id at a hidden state of the greedy run, so generation hits it."""
    eos = eot_id(default_tokenizer())
    tokens = generate(model, prompt, 6, greedy=True)
    with torch.no_grad():
        out = model(torch.tensor([prompt + tokens]), options=ForwardOptions(hidden_states=True))
        h = out.hidden_states[-1][0, len(prompt) + 3]
        model.lm_head.weight[eos] = 50.0 * h / h.norm()


@pytest.mark.parametrize(
    ("ffn", "extra"),
    [("stem", {}), ("engram", {}), ("engram", {"engram_variant": "reference"})],
    ids=["stem", "engram", "engram-reference"],
)
def test_remote_code_folder_loads_and_generates_without_stemlm(tmp_path, ffn, extra):
    model = build_model(tiny(ffn, **extra), seed=3).eval()
    prompt = [5, 17, 300, 42]
    make_eos_reachable(model, prompt)
    save_pretrained(model, tmp_path / "ckpt", default_tokenizer())
    assert main(["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf"), "--remote-code"]) == 0
    folder = tmp_path / "hf"
    config = json.loads((folder / "config.json").read_text())
    eos = eot_id(default_tokenizer())
    assert config["auto_map"] == AUTO_MAP and config["eos_token_id"] == eos
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == eos

    ids = torch.randint(0, 8192, (2, 9), generator=torch.Generator().manual_seed(1))
    env = {"HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    argv = [sys.executable, "-I", "-c", NO_STEMLM, str(folder), str(tmp_path / "out.pt")]
    run = subprocess.run([*argv, json.dumps(ids.tolist()), json.dumps(prompt)], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    result = torch.load(tmp_path / "out.pt")
    assert result["class"].startswith("transformers_modules.")  # the folder's code, not an installed package
    with torch.no_grad():
        expected = model(ids).logits
    torch.testing.assert_close(result["logits"], expected, rtol=1e-5, atol=1e-5)  # another process: its own threads
    ours = generate(model, prompt, 12, greedy=True, eos_id=eos)
    assert result["generated"] == ours and ours[-1] == eos and len(ours) < 12  # both stopped on end-of-text


def test_the_files_are_flat_self_contained_and_complete(tmp_path):
    files = remote_code_files()
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    for name in files:
        assert not {"stemlm"} & set(get_imports(tmp_path / name)), name  # transformers' own import check
    entries = {"modeling_stemlm.py", "heads_stemlm.py"}  # the files auto_map names (the config's needs no others)
    reached = {p.rsplit("/", 1)[-1] for e in entries for p in get_relative_import_files(tmp_path / e)}
    assert reached | entries == set(files)  # transformers copies exactly these


def test_a_dense_model_exports_as_a_plain_llama_folder(tmp_path):
    save_pretrained(build_model(tiny("dense"), seed=0), tmp_path / "ckpt", default_tokenizer())
    assert main(["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf"), "--remote-code"]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "llama" and "auto_map" not in config
    assert config["eos_token_id"] == eot_id(default_tokenizer())
    assert not list((tmp_path / "hf").glob("*.py"))
