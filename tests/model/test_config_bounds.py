"""Every size of a config is bounded before anything is built from it, and a real build is refused when its
weights exceed free memory: a hostile config.json (10**9 layers) is one line from every loader, not an OOM kill.

Bounds: `stemlm.model.config.SIZE_LIMITS` (shared fields), `stemlm.model.kinds.registry.MAX_KIND_SIZE` (the
kinds' integer fields), `stemlm.train.config.SIZE_LIMITS` (a run's sizes); the memory check is
`stemlm.model.memory_check.check_fits`.
"""

from __future__ import annotations

import json

import pytest

from stemlm.checkpoint.folder import save_pretrained
from stemlm.data.tokenizer import default_tokenizer
from stemlm.errors import StemlmError
from stemlm.model import build_model
from stemlm.model.config import SIZE_LIMITS, ModelConfig
from stemlm.model.kinds.registry import MAX_KIND_SIZE
from stemlm.train.config import TrainConfig
from tests.bad_input import refuse
from tests.conftest import make_tiny_config


@pytest.mark.parametrize("name", sorted(SIZE_LIMITS))
def test_each_shared_size_has_an_upper_bound(name):
    with pytest.raises(StemlmError, match=f"{name}={SIZE_LIMITS[name] + 1} exceeds the limit of"):
        ModelConfig(**{name: SIZE_LIMITS[name] + 1})


@pytest.mark.parametrize(
    ("ffn", "field"),
    [
        ("moe", "num_experts"),
        ("moe", "moe_intermediate_size"),
        ("engram", "engram_rows"),
        ("engram", "engram_dim"),
        ("memory", "memory_keys"),
        ("ple", "ple_dim"),
        ("stem_ngram", "stem_ngram_rows"),
    ],
)
def test_kind_sizes_are_bounded_whichever_kind_is_selected(ffn, field):
    for kind in (ffn, "dense"):  # config.json is read whole: a bad field of another kind is still refused
        with pytest.raises(StemlmError, match=f"{field}=1000000000 exceeds the limit of {MAX_KIND_SIZE}"):
            ModelConfig(ffn=kind, **{field: 10**9})


def test_a_huge_layer_count_fails_before_any_layer_list_is_made():
    # 10**9 layers once grew to 11 GB resolving "all-but-first"; now the bound comes first.
    with pytest.raises(StemlmError, match="num_hidden_layers=1000000000 exceeds the limit of 1024"):
        ModelConfig.from_dict({"num_hidden_layers": 10**9, "ffn_layers": "all"})


def test_a_layer_list_longer_than_the_model_is_refused_at_once():
    with pytest.raises(StemlmError, match="layer list has 100000 entries for a model with 4 layers"):
        ModelConfig(ffn_layers=list(range(10**5)))


def test_the_presets_and_the_tiny_config_are_within_the_bounds():
    from stemlm.model.presets import get_preset, list_presets

    assert all(get_preset(name).num_hidden_layers <= SIZE_LIMITS["num_hidden_layers"] for name in list_presets())
    assert make_tiny_config("stem").special_layers == [1, 2]


def test_a_build_that_cannot_fit_in_free_memory_is_refused(monkeypatch):
    from stemlm.model import memory_check

    monkeypatch.setattr(memory_check, "free_bytes", lambda device: 1024)
    config = make_tiny_config("dense")
    with pytest.raises(StemlmError, match=r"the model needs .* GiB for its [\d,]+ parameters .* free on cpu"):
        build_model(config)
    assert build_model(config, device="meta").lm_head.weight.is_meta  # a shape-only build needs no memory


def test_a_within_bounds_config_too_large_for_the_machine_is_one_line():
    config = ModelConfig(vocab_size=SIZE_LIMITS["vocab_size"], hidden_size=SIZE_LIMITS["hidden_size"], ffn="dense")
    with pytest.raises(StemlmError, match="the model needs 2.*GiB"):
        build_model(config)


@pytest.fixture
def hostile_ckpt(tmp_path):
    folder = tmp_path / "ckpt"
    save_pretrained(build_model(make_tiny_config("dense", vocab_size=8192)), folder, tokenizer=default_tokenizer())
    config = json.loads((folder / "config.json").read_text())
    config["num_hidden_layers"] = 10**9
    (folder / "config.json").write_text(json.dumps(config))
    return folder


MESSAGE = "num_hidden_layers=1000000000 exceeds the limit of 1024"


@pytest.mark.parametrize(
    "argv", [["generate", "{ck}", "Hello"], ["generate", "{ck}", "--ids", "1,2"], ["info", "--config", "{ck}"]]
)
def test_every_loader_refuses_a_config_json_with_a_billion_layers(hostile_ckpt, tmp_path, capsys, argv):
    refuse([a.replace("{ck}", str(hostile_ckpt)) for a in argv], MESSAGE, capsys, tmp_path)


def test_the_playground_and_the_api_refuse_it_too(hostile_ckpt):
    from stemlm.serve.playground import Playground
    from stemlm.serve.served_model import ServedModel

    for load in (Playground.load, ServedModel.load):
        with pytest.raises(StemlmError, match=MESSAGE):
            load(hostile_ckpt)


def test_a_hugging_face_llama_config_is_bounded_alike(tmp_path, capsys):
    folder = tmp_path / "llama"
    folder.mkdir()
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 8192, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 10**9, "num_attention_heads": 4}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config))
    refuse(["generate", folder, "Hello"], MESSAGE, capsys, tmp_path)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"steps": 10**10}, "steps=10000000000 exceeds the limit"),
        ({"seq_len": 2**25}, "seq_len=33554432 exceeds the limit"),
        ({"batch_size": 2**21}, "batch_size=2097152 exceeds the limit"),
        ({"grad_accum": 2**21}, "grad_accum=2097152 exceeds the limit"),
        ({"eval_batches": 2**21}, "eval_batches=2097152 exceeds the limit"),
        ({"batch_size": 2**16, "seq_len": 2**16}, "tokens per micro-batch exceeds the limit"),
    ],
)
def test_train_config_sizes_are_bounded(changes, message):
    with pytest.raises(StemlmError, match=message):
        TrainConfig(**changes)
