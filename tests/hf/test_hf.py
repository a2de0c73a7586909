"""Tests of `stemlm.hf`: Llama parity of dense folders, the Auto classes for every FFN kind, `generate()`, and
loading HF Llama folders. Tiny configs; run with `OMP_NUM_THREADS=1 python -m pytest tests/hf/test_hf.py -q -x`.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, LlamaConfig, LlamaForCausalLM

import stemlm
from stemlm.checkpoint.folder import save_pretrained
from stemlm.checkpoint.runs import from_pretrained
from stemlm.errors import StemlmError
from stemlm.hf import StemlmConfig, StemlmForCausalLM
from stemlm.hf.configuration import model_config_fields
from stemlm.model import build_model
from stemlm.model.config import FFN_KINDS, ModelConfig

VOCAB = 96


def tiny_config(ffn: str = "stem", **overrides) -> ModelConfig:
    base = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        ffn=ffn,
        ffn_layers="all-but-first",
        num_experts=4,
        ple_dim=8,
        rope_theta=500.0,
        rms_norm_eps=1e-4,
    )
    return ModelConfig(**{**base, **overrides})


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int, std: float = 0.15) -> None:
    """Every parameter random (norm weights around 1), so a dropped or misnamed tensor changes the logits."""
    generator = torch.Generator().manual_seed(seed)
    for name, param in model.named_parameters():
        noise = torch.randn(param.shape, generator=generator) * std
        param.copy_(1.0 + noise if name.endswith("norm.weight") else noise)


def random_ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def saved_stemlm(tmp_path, config: ModelConfig, seed: int = 0):
    model = build_model(config, seed=seed)
    randomize_(model, seed)
    save_pretrained(model, tmp_path / "ckpt")
    return model, tmp_path / "ckpt"


# ----------------------------------------------------------------------------------------------------------
# dense stemlm folder -> transformers.LlamaForCausalLM
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tied", [False, True])
def test_dense_folder_loads_unchanged_into_llama(tmp_path, tied):
    model, folder = saved_stemlm(tmp_path, tiny_config("dense", tie_word_embeddings=tied))
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    llama = LlamaForCausalLM.from_pretrained(folder)
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    # The fields that differ from Llama's defaults must have been read, not defaulted.
    assert llama.config.num_key_value_heads == 2 < llama.config.num_attention_heads
    assert llama.config.rms_norm_eps == 1e-4 and llama.config.rope_parameters["rope_theta"] == 500.0
    assert (llama.lm_head.weight is llama.model.embed_tokens.weight) == tied
    ids = random_ids(2, 12)
    torch.testing.assert_close(llama(ids).logits, model(ids).logits, atol=1e-5, rtol=0)


def test_wrapper_loss_matches_llama_loss(tmp_path):
    # HF label convention (labels = input ids, shifted inside, -100 ignored) checked against Llama's own loss.
    _, folder = saved_stemlm(tmp_path, tiny_config("dense"))
    ids = random_ids(2, 10, seed=1)
    labels = ids.clone()
    labels[0, :3] = -100
    llama_loss = LlamaForCausalLM.from_pretrained(folder)(ids, labels=labels).loss
    ours = AutoModelForCausalLM.from_pretrained(folder)(ids, labels=labels)
    torch.testing.assert_close(ours.loss, llama_loss, atol=1e-5, rtol=0)
    assert ours.aux_loss is None


# ----------------------------------------------------------------------------------------------------------
# AutoConfig / AutoModelForCausalLM for every FFN kind
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", FFN_KINDS)
def test_auto_model_matches_stemlm(tmp_path, kind):
    model_config = tiny_config(kind, tie_word_embeddings=kind == "stem")
    _, folder = saved_stemlm(tmp_path, model_config)
    config = AutoConfig.from_pretrained(folder)
    assert isinstance(config, StemlmConfig) and config.to_model_config().to_hf_dict() == model_config.to_hf_dict()
    hf = AutoModelForCausalLM.from_pretrained(folder)
    assert isinstance(hf, StemlmForCausalLM)
    ours = from_pretrained(folder)
    ids = random_ids(2, 11, seed=2)
    reference = ours(ids)
    torch.testing.assert_close(hf(ids).logits, reference.logits, atol=1e-6, rtol=0)
    # HF's loader leaves unsaved buffers as raw memory; they must have been recomputed.
    for (name, buf), (_, ref) in zip(hf.named_buffers(), ours.named_buffers(), strict=True):
        assert torch.equal(buf, ref), name


def test_moe_loss_adds_weighted_aux_loss(tmp_path):
    _, folder = saved_stemlm(tmp_path, tiny_config("moe"))
    hf = AutoModelForCausalLM.from_pretrained(folder, router_aux_loss_coef=0.5)
    ids = random_ids(2, 9, seed=3)
    out = hf(ids, labels=ids)
    reference = from_pretrained(folder)(ids)
    ce = F.cross_entropy(reference.logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
    torch.testing.assert_close(out.aux_loss, reference.aux_loss)
    assert out.aux_loss.item() >= 1.0 - 1e-6  # the Switch loss is 1 at uniform routing, its minimum, so never lower
    torch.testing.assert_close(out.loss, ce + 0.5 * reference.aux_loss, atol=1e-6, rtol=0)


def test_hf_save_pretrained_round_trips_to_stemlm(tmp_path):
    _, folder = saved_stemlm(tmp_path, tiny_config("stem", tie_word_embeddings=True))
    hf = AutoModelForCausalLM.from_pretrained(folder)
    hf.save_pretrained(tmp_path / "hf_saved")
    ids = random_ids(1, 8, seed=4)
    torch.testing.assert_close(from_pretrained(tmp_path / "hf_saved")(ids).logits, hf(ids).logits, atol=0, rtol=0)


def test_config_fields_mirror_model_config():
    hf_fields = {name for name in StemlmConfig.__dataclass_fields__ if name in model_config_fields()}
    assert hf_fields == set(model_config_fields())
    assert StemlmConfig().to_model_config() == ModelConfig()
    config = tiny_config("hash_moe", ffn_layers=[0, 2])
    assert StemlmConfig.from_model_config(config).to_model_config() == config
    with pytest.raises(StemlmError, match="unknown ffn kind"):
        StemlmConfig(ffn="bogus")


def test_stem_layers_is_the_old_name_of_ffn_layers(tmp_path):
    config = StemlmConfig(hidden_size=32, num_attention_heads=2, num_hidden_layers=4, stem_layers="odd")
    assert config.ffn_layers == "odd" and config.to_model_config().special_layers == [1, 3]
    assert "stem_layers" not in config.to_dict()
    with pytest.raises(StemlmError, match="both stem_layers='odd' and ffn_layers='all'"):
        StemlmConfig(num_hidden_layers=4, ffn_layers="all", stem_layers="odd")
    # a config.json written before the rename (stem_layers, resolved_stem_layers) loads with its layers
    d = json.loads(config.to_json_string())
    d["stem_layers"], d["resolved_stem_layers"] = d.pop("ffn_layers"), [1, 3]
    d.pop("resolved_ffn_layers", None)
    (tmp_path / "config.json").write_text(json.dumps(d))
    assert AutoConfig.from_pretrained(tmp_path).to_model_config().special_layers == [1, 3]


def test_fresh_model_follows_stemlm_init():
    config = StemlmConfig(
        vocab_size=1024,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        ffn="stem",
        ffn_layers="all",
    )
    torch.manual_seed(0)
    model = StemlmForCausalLM(config)
    xavier = (2.0 / (1024 + 64)) ** 0.5  # official STEM table init, ~3x the projections' 0.02 here
    assert abs(model.model.layers[1].mlp.stem_embedding.weight.std().item() - xavier) < 0.05 * xavier
    assert abs(model.model.layers[1].mlp.gate_proj.weight.std().item() - 0.02) < 0.05 * 0.02
    assert torch.equal(model.model.norm.weight, torch.ones(32))
    assert torch.equal(model.model.rotary_emb.inv_freq, build_model(config.to_model_config()).model.rotary_emb.inv_freq)


# ----------------------------------------------------------------------------------------------------------
# generate()
# ----------------------------------------------------------------------------------------------------------
def greedy_with_kv_cache(model, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    out = model(ids, use_cache=True)
    tokens = [out.logits[:, -1].argmax(-1)]
    for _ in range(new_tokens - 1):
        out = model(tokens[-1][:, None], past_key_values=out.past_key_values)
        tokens.append(out.logits[:, -1].argmax(-1))
    return torch.cat([ids, torch.stack(tokens, dim=1)], dim=1)


@pytest.mark.parametrize("kind", ["stem", "moe", "hash_moe", "ple", "stem_gate", "dense"])
def test_generate_equals_manual_greedy_loop(tmp_path, kind):
    _, folder = saved_stemlm(tmp_path, tiny_config(kind))
    hf = AutoModelForCausalLM.from_pretrained(folder)
    step_lengths, caches = [], []
    hf.model.embed_tokens.register_forward_pre_hook(lambda module, args: step_lengths.append(args[0].shape[1]))
    hf.register_forward_hook(lambda module, args, out: caches.append(out.cache))
    ids = random_ids(2, 5, seed=5)
    generated = hf.generate(ids, max_new_tokens=8, do_sample=False)
    expected = greedy_with_kv_cache(from_pretrained(folder), ids, 8)
    assert torch.equal(generated, expected)
    assert len(set(generated[:, 5:].flatten().tolist())) > 2  # a varied continuation, so the comparison bites
    # The KV cache was used: one prefill, then one new token per step, with HF's DynamicCache carried along.
    assert step_lengths == [5] + [1] * 7
    assert all(isinstance(c, DynamicCache) for c in caches) and caches[-1].get_seq_length() == 12


def test_generate_with_left_padding_matches_unpadded(tmp_path):
    _, folder = saved_stemlm(tmp_path, tiny_config("stem"))
    hf = AutoModelForCausalLM.from_pretrained(folder)
    long, short = random_ids(1, 6, seed=6), random_ids(1, 3, seed=7)
    batch = torch.cat([long, F.pad(short, (3, 0), value=0)])
    mask = torch.tensor([[1] * 6, [0, 0, 0, 1, 1, 1]])
    out = hf.generate(batch, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(out[0], hf.generate(long, max_new_tokens=6, do_sample=False)[0])
    assert torch.equal(out[1, 6:], hf.generate(short, max_new_tokens=6, do_sample=False)[0, 3:])


def test_static_cache_is_refused(tmp_path):
    _, folder = saved_stemlm(tmp_path, tiny_config("stem"))
    hf = AutoModelForCausalLM.from_pretrained(folder)
    with pytest.raises(StemlmError, match="static"):
        hf.generate(random_ids(1, 4), max_new_tokens=2, do_sample=False, cache_implementation="static")


def test_inputs_embeds_alone_is_refused_where_the_kind_reads_ids(tmp_path):
    _, folder = saved_stemlm(tmp_path, tiny_config("stem"))
    hf = AutoModelForCausalLM.from_pretrained(folder)
    with pytest.raises(StemlmError, match="input_ids"):
        hf(inputs_embeds=torch.zeros(1, 3, 32))


@pytest.mark.parametrize("tied", [False, True])
def test_resize_token_embeddings_grows_the_token_tables_and_round_trips(tmp_path, tied):
    _, folder = saved_stemlm(tmp_path, tiny_config("stem", tie_word_embeddings=tied))
    hf = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = random_ids(2, 6)
    before = hf(ids).logits
    hf.resize_token_embeddings(VOCAB + 8)
    assert hf.config.vocab_size == hf.stem.config.vocab_size == VOCAB + 8
    assert all(t.weight.shape[0] == VOCAB + 8 for t in hf.stem.token_tables().values())
    assert (hf.lm_head.weight is hf.model.embed_tokens.weight) == tied
    after = hf(torch.cat([ids, torch.full((2, 1), VOCAB + 7)], 1)).logits
    torch.testing.assert_close(after[:, :6, :VOCAB], before)  # old tokens: the same rows, the same logits
    hf.save_pretrained(tmp_path / "resized")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "resized").eval()
    torch.testing.assert_close(again(ids).logits, hf(ids).logits, rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------------------
# HF Llama folder -> dense StemLM
# ----------------------------------------------------------------------------------------------------------
def saved_llama(tmp_path, tied: bool) -> tuple[LlamaForCausalLM, object]:
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_theta=700.0,
        rms_norm_eps=1e-4,
        tie_word_embeddings=tied,
    )
    llama = LlamaForCausalLM(config)
    randomize_(llama, seed=8)
    llama.save_pretrained(tmp_path / "llama")
    return llama, tmp_path / "llama"


@pytest.mark.parametrize("tied", [False, True])
def test_load_hf_llama_gives_llama_logits(tmp_path, tied):
    llama, folder = saved_llama(tmp_path, tied)
    model = from_pretrained(folder)
    assert model.config.ffn == "dense" and model.config.rope_theta == 700.0 and model.config.kv_heads == 2
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    ids = random_ids(2, 10, seed=9)
    torch.testing.assert_close(model(ids).logits, llama(ids).logits, atol=1e-5, rtol=0)


def test_load_hf_llama_with_llama3_rope_scaling_gives_llama_logits(tmp_path):
    # Small original context and head_dim 8: the 4 frequencies fall in all three llama3 bands (kept, blended,
    # divided by factor), and positions up to 40 pass the original 16.
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 700.0}  # fmt: skip
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rope_parameters=scaling, rms_norm_eps=1e-4,
    )  # fmt: skip
    llama = LlamaForCausalLM(config)
    randomize_(llama, seed=8)
    llama.save_pretrained(tmp_path / "llama")
    model = from_pretrained(tmp_path / "llama")
    assert model.config.rope_llama3["factor"] == 8.0
    plain = from_pretrained(tmp_path / "llama")
    plain.model.rotary_emb.llama3 = None
    plain.reset_buffers("cpu")
    ids = random_ids(1, 40, seed=9)
    torch.testing.assert_close(model(ids).logits, llama(ids).logits, atol=1e-5, rtol=0)
    assert not torch.allclose(plain(ids).logits, llama(ids).logits, atol=1e-3)


def test_load_hf_llama_refuses_what_it_cannot_represent(tmp_path):
    _, folder = saved_llama(tmp_path, tied=False)
    config_path = folder / "config.json"
    original = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**original, "rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5}}))
    with pytest.raises(StemlmError, match="RoPE scaling of type 'yarn'"):
        from_pretrained(folder)
    config_path.write_text(json.dumps({**original, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}}))
    with pytest.raises(StemlmError, match="rope_llama3 lacks factor"):
        from_pretrained(folder)
    config_path.write_text(json.dumps({**original, "mlp_bias": True}))
    with pytest.raises(StemlmError, match="mlp_bias"):
        from_pretrained(folder)
    config_path.write_text(json.dumps(original))
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    with pytest.raises(StemlmError, match="pickle"):
        from_pretrained(folder)


# ----------------------------------------------------------------------------------------------------------
# registration
# ----------------------------------------------------------------------------------------------------------
def run_python(code: str) -> list[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()


def test_import_stemlm_imports_neither_transformers_nor_torch():
    assert run_python("import sys, stemlm; print('transformers' in sys.modules, 'torch' in sys.modules)") == [
        "False",
        "False",
    ]


@pytest.mark.slow  # a fresh interpreter importing transformers and torch: tens of seconds on a busy CPU
def test_auto_classes_know_stemlm_after_import_stemlm(tmp_path):
    _, folder = saved_stemlm(tmp_path, tiny_config("moe"))
    code = (
        "import sys, stemlm\n"
        "from transformers import AutoModelForCausalLM\n"
        "from transformers.models.auto.configuration_auto import CONFIG_MAPPING\n"
        # the config is registered at once; the model class (transformers' model code) only once it is needed
        "print(CONFIG_MAPPING['stemlm'].__name__, 'transformers.modeling_utils' in sys.modules)\n"
        f"print(type(AutoModelForCausalLM.from_pretrained({str(folder)!r})).__name__)\n"
    )
    assert run_python(code) == ["StemlmConfig", "False", "StemlmForCausalLM"]


def test_register_is_idempotent():
    stemlm.hf.register()
    stemlm.hf.register()
    assert AutoModelForCausalLM._model_mapping[StemlmConfig] is StemlmForCausalLM


# ----------------------------------------------------------------------------------------------------------
# dense stemlm -> a model_type "llama" folder (stemlm convert --to-llama)
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tied", [False, True])
def test_llama_export_loads_silently_with_the_same_logits(tmp_path, tied, capsys):
    import logging
    import warnings

    from stemlm.cli.main import main

    model, folder = saved_stemlm(tmp_path, tiny_config("dense", tie_word_embeddings=tied))
    assert main(["convert", "--to-llama", str(folder), "--out", str(tmp_path / "llama"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model_type"] == "llama"
    assert json.loads((tmp_path / "llama" / "config.json").read_text())["model_type"] == "llama"
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            llama = LlamaForCausalLM.from_pretrained(tmp_path / "llama")
    finally:
        logger.removeHandler(handler)
    assert not [r for r in records if r.levelno >= logging.WARNING], [r.getMessage() for r in records]
    ids = random_ids(2, 12)
    torch.testing.assert_close(llama(ids).logits, model(ids).logits, atol=1e-5, rtol=0)
    assert torch.equal(from_pretrained(tmp_path / "llama")(ids).logits, model(ids).logits)  # and back into stemlm


def test_llama_export_refuses_a_stem_model(tmp_path, capsys):
    from stemlm.cli.main import main

    _, folder = saved_stemlm(tmp_path, tiny_config("stem"))
    assert main(["convert", "--to-llama", str(folder), "--out", str(tmp_path / "llama")]) == 2
    assert "only a dense model exports as Llama" in capsys.readouterr().err
    assert not (tmp_path / "llama").exists()


def test_export_llama_refuses_its_source_before_loading(tmp_path, tiny_config):
    from stemlm.checkpoint.folder import save_pretrained
    from stemlm.convert.llama import export_llama
    from stemlm.errors import StemlmError
    from stemlm.model import build_model

    save_pretrained(build_model(tiny_config("dense"), seed=0), tmp_path / "dense")
    out = export_llama(tmp_path / "dense", tmp_path / "llama")
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    with pytest.raises(StemlmError):
        export_llama(tmp_path / "dense", tmp_path / "dense", force=True)
