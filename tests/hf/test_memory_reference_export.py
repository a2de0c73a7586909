"""`stemlm export --remote-code` of `memory_variant="reference"` (the value table shared by the memory layers, the
biases, the uniform inits in the shipped registry): transformers loads the folder with `trust_remote_code=True`
in a process where `import stemlm` fails, with the table under its owner layer's name only, and gives stemlm's
logits.

    OMP_NUM_THREADS=1 python -m pytest tests/hf/test_memory_reference_export.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys

import torch
from safetensors import safe_open

from stemlm.checkpoint.folder import save_pretrained
from stemlm.cli.main import main
from stemlm.data.tokenizer import default_tokenizer
from stemlm.model import build_model
from tests.hf.test_remote_code import NO_STEMLM, tiny


def test_remote_code_folder_of_the_reference_memory(tmp_path):
    config = tiny("memory").replace(
        num_hidden_layers=3, memory_keys=8, memory_topk=4, memory_heads=2, memory_key_dim=16, memory_variant="reference"
    )
    model = build_model(config, seed=3).eval()
    save_pretrained(model, tmp_path / "ckpt", default_tokenizer())
    assert main(["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf"), "--remote-code"]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["memory_variant"] == "reference"
    names = set()
    for path in (tmp_path / "hf").glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as reader:
            names |= {n for n in reader.keys() if "memory_values" in n}
    assert names == {"model.layers.1.mlp.memory_values.weight"}

    ids = torch.randint(0, 8192, (2, 9), generator=torch.Generator().manual_seed(1))
    env = {"HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    argv = [sys.executable, "-I", "-c", NO_STEMLM, str(tmp_path / "hf"), str(tmp_path / "out.pt")]
    run = subprocess.run(
        [*argv, json.dumps(ids.tolist()), json.dumps([5, 17])], env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = torch.load(tmp_path / "out.pt")
    with torch.no_grad():
        expected = model(ids).logits
    torch.testing.assert_close(result["logits"], expected, rtol=1e-5, atol=1e-5)  # another process: its own threads
