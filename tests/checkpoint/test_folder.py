"""Tests of the checkpoint format (`stemlm.checkpoint.folder`): exact round trips for every FFN kind (tied, untied,
sharded, single file), tied weights stored once, clear errors for broken folders, and atomic saves."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from stemlm.checkpoint import folder as checkpoint
from stemlm.checkpoint.folder import load_config, read_state, save_pretrained
from stemlm.checkpoint.runs import from_pretrained
from stemlm.errors import StemlmError
from stemlm.model.config import FFN_KINDS


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def _keys(folder):
    keys = set()
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as reader:
            keys |= set(reader.keys())
    return keys


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("ffn", FFN_KINDS)
def test_round_trip_is_exact(tmp_path, tiny_model, ffn, tied, sharded):
    model = tiny_model(ffn, seed=4, tie_word_embeddings=tied)
    folder = save_pretrained(model, tmp_path / "ckpt", max_shard_bytes=60_000 if sharded else 10**9)
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    assert (len(files) > 1) == sharded and (folder / checkpoint.INDEX_NAME).is_file() == sharded
    loaded = from_pretrained(folder)
    assert loaded.config.to_hf_dict() == model.config.to_hf_dict()
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    assert torch.equal(_logits(loaded, ids), _logits(model, ids))
    state = model.state_dict()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, state[name]), name
    assert all(p.requires_grad for p in loaded.parameters())
    assert ("lm_head.weight" in _keys(folder)) != tied
    if tied:
        assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    else:
        assert loaded.lm_head.weight is not loaded.model.embed_tokens.weight


def test_index_lists_every_tensor(tmp_path, tiny_model):
    model = tiny_model("stem")
    folder = save_pretrained(model, tmp_path / "ckpt", max_shard_bytes=60_000)
    index = json.loads((folder / checkpoint.INDEX_NAME).read_text())
    assert set(index["weight_map"]) == set(model.state_dict()) == _keys(folder)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in model.state_dict().values())


def test_load_with_dtype(tmp_path, tiny_model):
    model = tiny_model("moe")
    loaded = from_pretrained(save_pretrained(model, tmp_path / "ckpt"), dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in loaded.parameters())
    assert loaded.model.rotary_emb.inv_freq.dtype == torch.float32
    ids = torch.randint(0, 256, (1, 6))
    assert torch.equal(_logits(loaded, ids), _logits(model.to(torch.bfloat16), ids))


def test_tokenizer_is_saved_and_checked(tmp_path, tiny_model):
    tokenizers = pytest.importorskip("tokenizers")
    small = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"w{i}": i for i in range(10)}, unk_token="w0"))
    folder = save_pretrained(tiny_model("stem"), tmp_path / "ckpt", tokenizer=small)
    assert tokenizers.Tokenizer.from_file(str(folder / checkpoint.TOKENIZER_NAME)).get_vocab_size() == 10
    big = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"w{i}": i for i in range(300)}, unk_token="w0"))
    with pytest.raises(StemlmError, match="tokenizer has 300 tokens but the model's vocab_size is 256"):
        save_pretrained(tiny_model("stem"), tmp_path / "other", tokenizer=big)


@pytest.fixture
def saved(tmp_path, tiny_model):
    return save_pretrained(tiny_model("stem"), tmp_path / "ckpt")


def test_missing_folder_and_files(tmp_path, saved, tiny_model):
    with pytest.raises(StemlmError, match="does not exist"):
        from_pretrained(tmp_path / "nowhere")
    (saved / checkpoint.WEIGHTS_NAME).unlink()
    with pytest.raises(StemlmError, match="missing its weights file model.safetensors"):
        from_pretrained(saved)
    sharded = save_pretrained(tiny_model("stem"), tmp_path / "sharded", max_shard_bytes=60_000)
    shard = sorted(sharded.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(StemlmError, match=f"missing its weights file {shard.name}"):
        from_pretrained(sharded)
    (saved / checkpoint.CONFIG_NAME).unlink()
    with pytest.raises(StemlmError, match="has no config.json"):
        from_pretrained(saved)


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_corrupt_weights(saved, damage):
    path = saved / checkpoint.WEIGHTS_NAME
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x07" * 64)
    with pytest.raises(StemlmError, match="model.safetensors is corrupt or truncated"):
        from_pretrained(saved)


def test_bad_config_json(saved):
    path = saved / checkpoint.CONFIG_NAME
    good = json.loads(path.read_text())
    path.write_text(json.dumps(good | {"model_type": "gpt2"}))
    with pytest.raises(StemlmError, match="model type 'gpt2', not 'stemlm' or 'llama'"):
        from_pretrained(saved)
    path.write_text('{"model_type": "stemlm", ')
    with pytest.raises(StemlmError, match="config.json is not valid JSON"):
        load_config(saved)
    path.write_text("[1, 2]")
    with pytest.raises(StemlmError, match="does not hold a JSON object"):
        load_config(saved)
    path.write_text(json.dumps(good | {"num_key_value_heads": 3}))
    with pytest.raises(StemlmError, match="config.json: invalid config: num_key_value_heads=3 must divide"):
        load_config(saved)


def test_state_not_matching_config(saved):
    path = saved / checkpoint.CONFIG_NAME
    good = json.loads(path.read_text())
    path.write_text(json.dumps(good | {"intermediate_size": 96}))
    with pytest.raises(StemlmError, match=r"tensor model\.layers\.0\.mlp\.\w+_proj\.weight has shape"):
        from_pretrained(saved)
    path.write_text(json.dumps(good | {"ffn": "dense"}))
    with pytest.raises(StemlmError, match="does not match its config.json: missing 2 tensors .*unexpected 2 tensors"):
        from_pretrained(saved)


def _leftovers(folder):
    return sorted(p.name for p in folder.parent.iterdir() if p != folder)


@pytest.mark.parametrize("error", [RuntimeError("simulated crash"), OSError(28, "No space left on device")])
def test_interrupted_save_keeps_previous_checkpoint(saved, tiny_model, monkeypatch, error):
    before = read_state(saved)
    files_before = {p.name: p.read_bytes() for p in saved.iterdir()}

    def dying_save_file(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial header")  # half-written, then the process "dies"
        raise error

    monkeypatch.setattr(checkpoint, "save_file", dying_save_file)
    with pytest.raises(RuntimeError if isinstance(error, RuntimeError) else StemlmError):
        save_pretrained(tiny_model("moe", seed=9), saved, force=True)
    assert {p.name: p.read_bytes() for p in saved.iterdir()} == files_before
    after = read_state(saved)
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert from_pretrained(saved).config.ffn == "stem"
    assert _leftovers(saved) == []  # no temporary or .old folder left behind


def test_save_replaces_existing_checkpoint(saved, tiny_model):
    model = tiny_model("hash_moe", seed=2)
    save_pretrained(model, saved, max_shard_bytes=60_000, force=True)
    assert not (saved / checkpoint.WEIGHTS_NAME).exists()  # the old single file does not linger beside shards
    ids = torch.randint(0, 256, (1, 5))
    assert torch.equal(_logits(from_pretrained(saved), ids), _logits(model, ids))
    assert _leftovers(saved) == []
