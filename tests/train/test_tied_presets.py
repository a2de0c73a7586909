"""The official presets are tied: a shrunk `paper-350m` / `paper-1b` trains (both recipes), and its checkpoint loads
tied, decodes with host-offloaded tables, exports and opens as a Hugging Face model with the same logits.

The shrink keeps what makes the presets different from stemlm's earlier ones (tied embeddings, θ, STEM in an even
layer) at a size the CPU trains in a second. The sharded (`--nproc`) side: tests/train/parallel/test_tied_dist.py.
Run: `OMP_NUM_THREADS=1 python -m pytest tests/train/test_tied_presets.py -q`.
"""

from __future__ import annotations

import pytest
import torch

from stemlm.checkpoint.runs import from_pretrained
from stemlm.cli.main import main
from stemlm.inference.load import InferenceOptions, load_inference
from stemlm.model.config import ModelConfig
from stemlm.model.presets import get_preset
from stemlm.train.recipes import train_config
from stemlm.train.trainer import Trainer
from tests.small_corpus import TOKENIZER_VOCAB
from tests.train.conftest import changed_fields


def shrunk(name: str) -> ModelConfig:
    """Preset `name` at hidden 64 over 4 layers, its STEM layers those below 4, vocabulary fitted to the test BPE."""
    config = get_preset(name)
    return config.replace(
        vocab_size=TOKENIZER_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        ffn_layers=[i for i in config.special_layers if i < 4],
    )


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("name, recipe", [("paper-350m", "official"), ("paper-1b", "stemlm")])
def test_a_tied_preset_trains_loads_offloads_exports_and_opens_in_hf(tmp_path, make_train_config, name, recipe):
    config = shrunk(name)
    assert config.tie_word_embeddings and config.special_layers == [2]
    cfg = train_config({**changed_fields(make_train_config(tmp_path, steps=3, eval_every=0)), "recipe": recipe})
    trainer = Trainer(config, cfg, progress=False)
    embed = trainer.model.model.embed_tokens.weight
    assert trainer.model.lm_head.weight is embed
    start = embed.detach().clone()
    result = trainer.fit()
    assert trainer.model.lm_head.weight is embed and not torch.equal(embed, start)  # one tensor, trained
    ids = torch.randint(0, TOKENIZER_VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    trainer.model.eval()
    reference = _logits(trainer.model, ids)

    loaded = from_pretrained(result["checkpoint"])
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    torch.testing.assert_close(_logits(loaded, ids), reference, atol=0, rtol=0)

    with load_inference(result["checkpoint"], InferenceOptions(tables="host")) as offloaded:
        assert offloaded.offloaded is not None
        torch.testing.assert_close(_logits(offloaded.model, ids), reference, atol=1e-6, rtol=0)

    out = tmp_path / "exported"
    assert main(["export", result["run_dir"], "--out", str(out)]) == 0
    exported = from_pretrained(out)
    assert exported.lm_head.weight is exported.model.embed_tokens.weight
    torch.testing.assert_close(_logits(exported, ids), reference, atol=0, rtol=0)

    from transformers import AutoModelForCausalLM

    import stemlm  # noqa: F401  (registers the Auto classes)

    hf = AutoModelForCausalLM.from_pretrained(out)
    assert hf.get_output_embeddings().weight is hf.get_input_embeddings().weight
    torch.testing.assert_close(_logits(hf, ids), reference, atol=1e-6, rtol=0)
