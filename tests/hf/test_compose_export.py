"""`stemlm export --remote-code` of a model that composes kinds per layer (STEM on the odd layers, value embeddings
and an Engram branch beside them): transformers loads the folder with `trust_remote_code=True` in a process where
`import stemlm` fails, with the side modules' parameters under their own names, and gives stemlm's logits.

    OMP_NUM_THREADS=1 python -m pytest tests/hf/test_compose_export.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from stemlm.checkpoint.folder import save_pretrained
from stemlm.cli.main import main
from stemlm.data.tokenizer import default_tokenizer
from stemlm.model import build_model
from tests.hf.test_remote_code import NO_STEMLM, tiny


def test_remote_code_folder_of_a_composed_model(tmp_path):
    config = tiny("stem").replace(
        num_hidden_layers=4, ffn_layers="odd", value_embed_layers="first:1,last:2", engram_layers="2"
    )
    model = build_model(config, seed=3).eval()
    with torch.no_grad():  # large value rows, so the side modules matter to the logits
        for table in model.token_tables().values():
            table.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    save_pretrained(model, tmp_path / "ckpt", default_tokenizer())
    assert main(["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf"), "--remote-code"]) == 0
    exported = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert exported["value_embed_layers"] == "first:1,last:2" and exported["engram_layers"] == "2"

    ids = torch.randint(0, 8192, (2, 9), generator=torch.Generator().manual_seed(1))
    env = {"HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    argv = [sys.executable, "-I", "-c", NO_STEMLM, str(tmp_path / "hf"), str(tmp_path / "out.pt")]
    run = subprocess.run(
        [*argv, json.dumps(ids.tolist()), json.dumps([5, 17])], env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = torch.load(tmp_path / "out.pt")
    assert result["class"].startswith("transformers_modules.")
    with torch.no_grad():
        expected = model(ids).logits
    torch.testing.assert_close(result["logits"], expected, rtol=1e-5, atol=1e-5)  # another process: its own threads
