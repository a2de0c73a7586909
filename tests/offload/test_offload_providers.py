"""Table providers and checkpoint loading: the hand-read safetensors header against the safetensors library,
memory-mapped rows, and the errors for missing, truncated or mismatched table files (raised at load time)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load, save_file

from stemlm.checkpoint.folder import save_pretrained
from stemlm.errors import StemlmError
from stemlm.inference.offloaded import OffloadedLM
from stemlm.offload.providers import HostProvider, MmapProvider, memmap_entry, read_safetensors_header
from stemlm.placement.load import load_offloaded_model


def test_header_and_memmap_agree_with_safetensors(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "a": torch.randn(7, 3, generator=gen),
        "b": torch.randn(5, 4, generator=gen).to(torch.bfloat16),
        "c": torch.randn(6, 2, generator=gen).half(),
    }
    path = tmp_path / "t.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    entries = read_safetensors_header(path)
    assert sorted(entries) == ["a", "b", "c"]
    with safe_open(str(path), framework="pt") as reader:
        for name, entry in entries.items():
            assert entry.shape == tuple(reader.get_tensor(name).shape)
    provider = MmapProvider({0: entries["b"]})
    assert provider.dtype == torch.bfloat16
    assert torch.equal(provider.gather(torch.tensor([4, 0, 4])), tensors["b"][[4, 0, 4]])
    upcast = MmapProvider({0: entries["a"], 1: entries["a"]}, dtype=torch.float64)
    assert torch.equal(upcast.gather(torch.tensor([2])), torch.cat([tensors["a"][[2]]] * 2, dim=1).double())
    host = HostProvider({3: entries["c"], 1: tensors["a"][:6]}, layout="layer")
    assert host.layers == (1, 3) and host.layer_slices == {1: (0, 3), 3: (3, 2)}
    assert torch.equal(host.gather(torch.tensor([5, 1])), torch.cat([tensors["a"][[5, 1]], tensors["c"][[5, 1]]], 1))
    assert memmap_entry(entries["a"]).shape == (7, 3)


def test_truncated_and_corrupt_files_are_named(tmp_path):
    path = tmp_path / "t.safetensors"
    save_file({"a": torch.zeros(100, 10)}, str(path))
    data = path.read_bytes()
    path.write_bytes(data[:-40])
    with pytest.raises(StemlmError, match="truncated: tensor a"):
        read_safetensors_header(path)
    path.write_bytes(data[:5])
    with pytest.raises(StemlmError, match="too short"):
        read_safetensors_header(path)
    path.write_bytes(data[:8] + b"{not json" + data[17:])
    with pytest.raises(StemlmError, match="corrupt"):
        read_safetensors_header(path)
    with pytest.raises(StemlmError, match="does not exist"):
        read_safetensors_header(tmp_path / "none.safetensors")


@pytest.fixture
def broken(stem_checkpoint, tmp_path):
    """A private copy of the tiny checkpoint to damage."""
    folder, _ = stem_checkpoint
    copy = tmp_path / "ckpt"
    shutil.copytree(folder, copy)
    return copy


@pytest.mark.parametrize("tables", ["host", "mmap"])
def test_truncated_table_file_fails_at_load(broken, tables):
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1000])
    with pytest.raises(StemlmError, match="model.safetensors is truncated"):
        OffloadedLM.load(broken, tables)


def test_missing_table_file_or_tensor_fails_at_load(broken):
    weights = broken / "model.safetensors"
    data = weights.read_bytes()
    weights.unlink()
    with pytest.raises(StemlmError, match="missing its weights file"):
        OffloadedLM.load(broken, "host")
    state = load(data)
    state.pop("model.layers.2.mlp.stem_embedding.weight")
    save_file(state, str(weights))
    with pytest.raises(StemlmError, match="no table tensor model.layers.2.mlp.stem_embedding.weight"):
        OffloadedLM.load(broken, "mmap")


def test_shape_mismatch_and_bad_arguments(broken, tmp_path, offload_model):
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "intermediate_size": 80}))
    with pytest.raises(StemlmError, match="stem_embedding.weight has shape"):
        load_offloaded_model(broken, "host")
    save_pretrained(offload_model("dense"), tmp_path / "dense")
    with pytest.raises(StemlmError, match="no lookup tables"):
        load_offloaded_model(tmp_path / "dense", "mmap")
    with pytest.raises(StemlmError, match="unknown table placement"):
        load_offloaded_model(tmp_path / "dense", "gpu")


def test_cache_larger_than_vocab_is_clamped_with_warning(stem_checkpoint):
    folder, _ = stem_checkpoint
    with pytest.warns(UserWarning, match="exceeds the vocabulary"):
        lm = OffloadedLM.load(folder, "host", cache_rows=10_000)
    with lm:
        assert lm.cache.capacity == 256 and lm.memory()["cache_rows"] == 256
    with pytest.raises(StemlmError, match="layout"):
        OffloadedLM.load(folder, "host", layout="diagonal")
