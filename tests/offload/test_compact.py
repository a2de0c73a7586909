"""Compact table rows: row-wise int8 and bf16, in memory (`--table-dtype`) and stored (`stemlm convert CKPT
--table-dtype`), served through every placement, checked against computations written here independently.

Run: `python -m pytest tests/offload/test_compact.py -q`.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors import safe_open

from stemlm.checkpoint.folder import save_pretrained
from stemlm.checkpoint.runs import from_pretrained
from stemlm.errors import StemlmError
from stemlm.offload.compact import CompactProvider, dequantize_rows, quantize_rows
from stemlm.offload.providers import HostProvider
from tests.offload.test_offload_cli import _ckpt, run_cli

TABLES = ("model.layers.1.mlp.stem_embedding.weight", "model.layers.2.mlp.stem_embedding.weight")


def test_quantize_rows_error_is_at_most_half_a_step():
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(50, 33, generator=gen) * torch.logspace(-3, 1, 50)[:, None]
    rows[7] = 0.0
    codes, scale = quantize_rows(rows)
    assert codes.dtype == torch.int8 and int(codes.abs().max()) == 127
    assert torch.equal(codes[7], torch.zeros(33, dtype=torch.int8))
    back = dequantize_rows(codes, scale)
    step = rows.abs().amax(dim=1) / 127
    assert ((back - rows).abs() <= step[:, None] / 2 * (1 + 1e-5) + 1e-12).all()
    assert torch.equal(back[7], torch.zeros(33))


def test_compact_provider_serves_each_layer_quantised_separately():
    gen = torch.Generator().manual_seed(1)
    tables = {1: torch.randn(40, 6, generator=gen), 3: 100 * torch.randn(40, 10, generator=gen)}
    base = HostProvider(tables)
    ids = torch.tensor([0, 39, 5, 5, 17])
    int8 = CompactProvider.from_provider(base, "int8")
    got = int8.gather(ids)
    # Independently: each layer's rows quantised on their own, then concatenated in layer order.
    expected = torch.cat([dequantize_rows(*quantize_rows(tables[i][ids])) for i in (1, 3)], dim=1)
    assert torch.equal(got, expected)
    assert int8.stored_row_bytes == 16 + 2 * 4 and base.row_bytes == 16 * 4 and int8.table_bytes == 40 * 24
    bf16 = CompactProvider(tables, "bf16")
    assert torch.equal(bf16.gather(ids), torch.cat([tables[1][ids], tables[3][ids]], dim=1).bfloat16().float())
    assert bf16.stored_row_bytes == 16 * 2


def test_unknown_table_dtype():
    with pytest.raises(StemlmError, match="unknown table dtype 'fp8'"):
        CompactProvider({1: torch.zeros(4, 2)}, "fp8")


def test_host_tables_pin_only_the_staging_buffer(monkeypatch):
    """With CUDA present the provider pins; it must ask for that on the gather's staging buffer only, never on
    a whole table (the CUDA behaviour itself is not tested on this machine: the pin request is what is checked)."""
    requests = []
    real_empty = torch.empty

    def recording_empty(*shape, pin_memory=False, **kwargs):
        requests.append((tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], tuple) else shape, pin_memory))
        return real_empty(*shape, **kwargs)  # no pinning on this CPU-only machine

    monkeypatch.setattr(torch, "empty", recording_empty)
    tables = {1: torch.randn(300, 4), 2: torch.randn(300, 6)}
    for layout in ("token", "layer"):
        requests.clear()
        provider = HostProvider(tables, layout=layout, pin=True)
        assert requests and not any(pin for _, pin in requests)  # the tables: never pinned
        requests.clear()
        rows = provider.gather(torch.tensor([3, 299]))
        assert requests == [((2, 10), True)]  # the staging buffer: pinned
        assert torch.equal(rows, torch.cat([tables[1][[3, 299]], tables[2][[3, 299]]], dim=1))
    requests.clear()
    compact = CompactProvider(tables, "int8", pin=True)
    assert not any(pin for _, pin in requests)
    requests.clear()
    compact.gather(torch.tensor([0]))
    assert requests == [((1, 10), True)]


# ----------------------------------------------------------------------------------------------------------
# stored compactly: stemlm convert CKPT --table-dtype
# ----------------------------------------------------------------------------------------------------------
def _ppl(capsys, folder, *flags) -> dict:
    code, out, err = run_cli(capsys, "eval", "ppl", folder, "--max-tokens", 300, "--seq-len", 64, "--json", *flags)
    assert code == 0, err
    return json.loads(out)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(fp32 folder, int8 folder, bf16 folder, the fp32 model) made by the CLI."""
    from tests.offload.conftest import make_model

    tmp = tmp_path_factory.mktemp("compact")
    model = make_model("stem", seed=4, vocab_size=300)
    from stemlm.data.tokenizer import train_bpe
    from tests.offload.test_offload_cli import TEXT

    tok = train_bpe([TEXT * 3], vocab_size=300, min_frequency=1)
    fp32 = tmp / "fp32"
    save_pretrained(model, fp32, tokenizer=tok)
    from stemlm.cli.main import main

    for dtype in ("int8", "bf16"):
        assert main(["convert", str(fp32), "--table-dtype", dtype, "--out", str(tmp / dtype)]) == 0
    return fp32, tmp / "int8", tmp / "bf16", model


def test_int8_checkpoint_layout_and_error_bound(checkpoints):
    fp32, int8, _, model = checkpoints
    record = json.loads((int8 / "config.json").read_text())["stemlm_table_storage"]
    assert record["dtype"] == "int8" and record["tensors"] == list(TABLES)
    with safe_open(str(int8 / "model.safetensors"), framework="np") as f:
        assert f.metadata()["stemlm_table_dtype"] == "int8"
        for name in TABLES:
            codes, scale = f.get_tensor(name), f.get_tensor(name + "_scale")
            original = model.get_parameter(name).detach().numpy().astype(np.float64)
            assert codes.dtype == np.int8 and scale.dtype == np.float32 and scale.shape == (original.shape[0],)
            # independently: scale = max|row| / 127, and every element within half a step of the original
            np.testing.assert_allclose(scale, np.abs(original).max(axis=1) / 127, rtol=1e-6)
            error = np.abs(codes.astype(np.float64) * scale[:, None] - original)
            assert (error <= scale[:, None] / 2 * (1 + 1e-5)).all()
            # the loader's fp32 tables are exactly code x scale
            loaded = from_pretrained(int8).get_parameter(name).detach().numpy()
            np.testing.assert_array_equal(loaded, (codes.astype(np.float32) * scale[:, None]).astype(np.float32))
        assert f.get_tensor("model.embed_tokens.weight").dtype == np.float32  # the rest unchanged
    assert (fp32 / "tokenizer.json").read_bytes() == (int8 / "tokenizer.json").read_bytes()
    saved = (fp32 / "model.safetensors").stat().st_size - (int8 / "model.safetensors").stat().st_size
    assert saved == pytest.approx(2 * 300 * 96 * 3 - 2 * 300 * 4, abs=1000)  # 3 of 4 bytes per value, minus scales


def test_bf16_checkpoint_loads_as_rounded_rows(checkpoints):
    _, _, bf16, model = checkpoints
    with safe_open(str(bf16 / "model.safetensors"), framework="pt") as f:
        assert f.get_slice(TABLES[0]).get_dtype() == "BF16"
    loaded = from_pretrained(bf16).get_parameter(TABLES[0])
    assert loaded.dtype == torch.float32 and torch.equal(loaded, model.get_parameter(TABLES[0]).bfloat16().float())


def test_every_placement_of_a_compact_checkpoint_equals_the_in_memory_compact_path(checkpoints, capsys):
    fp32, int8, bf16, _ = checkpoints
    reference, rounded = _ppl(capsys, fp32), {}
    for dtype, folder in (("int8", int8), ("bf16", bf16)):
        in_memory = rounded[dtype] = _ppl(capsys, fp32, "--table-dtype", dtype)  # resident: rows rounded
        assert in_memory["loss"] != reference["loss"] and abs(in_memory["loss"] / reference["loss"] - 1) < 0.01
        for tables in ("resident", "host", "mmap") if dtype == "int8" else ("mmap",):
            stored = _ppl(capsys, folder, "--tables", tables)
            assert stored["loss"] == pytest.approx(in_memory["loss"], rel=1e-6, abs=0), (dtype, tables)
    host_from_fp32 = _ppl(capsys, fp32, "--tables", "host", "--table-dtype", "int8")
    assert host_from_fp32["loss"] == pytest.approx(rounded["int8"]["loss"], rel=1e-6, abs=0)
    mapped = _ppl(capsys, int8, "--tables", "mmap")["tables"]
    assert mapped["placement"] == "mmap" and mapped["table_bytes"] == 300 * (2 * 96 + 2 * 4)  # codes + 2 scales
    host = _ppl(capsys, int8, "--tables", "host", "--table-dtype", "fp32")["tables"]
    assert host["table_bytes"] == 300 * 2 * 96 * 4  # dequantised on load when asked


def test_compact_flags_on_every_command(checkpoints, capsys):
    fp32, int8, _, _ = checkpoints
    common = ["a single man in possession of", "--greedy", "--max-new-tokens", 6, "--json"]
    outs = []
    for folder, flags in ((fp32, ["--tables", "host", "--table-dtype", "int8"]), (int8, ["--tables", "mmap"])):
        code, out, err = run_cli(capsys, "generate", folder, *common, *flags)
        assert code == 0, err
        outs.append(json.loads(out)["token_ids"])
    assert outs[0] == outs[1] and len(outs[0]) == 6
    code, _, err = run_cli(capsys, "generate", fp32, "a man", "--tables", "mmap", "--table-dtype", "int8")
    assert code == 2 and "--tables mmap reads the rows in the format the checkpoint stores (fp32)" in err
    code, _, err = run_cli(capsys, "convert", int8, "--out", fp32.parent / "x")
    assert code == 2 and "needs --table-dtype" in err
    code, _, err = run_cli(capsys, "convert", int8, "--table-dtype", "int8", "--out", fp32)
    assert code == 2 and not (fp32 / "config.json").read_text().count("stemlm_table_storage")


def test_generate_int8_host_tables_reports_compact_bytes(tmp_path, offload_model, capsys):
    folder, _, _ = _ckpt(tmp_path, offload_model)
    common = [folder, "a single man in possession of", "--greedy", "--max-new-tokens", 6, "--json", "--tables", "host"]
    code, out, _ = run_cli(capsys, "generate", *common, "--table-dtype", "int8")
    report = json.loads(out)["tables"]
    assert code == 0 and report["host_table_bytes"] == 300 * (2 * 96 + 2 * 4)


def test_transformers_wrapper_refuses_a_compact_checkpoint(checkpoints):
    from stemlm.hf.modeling import StemlmForCausalLM

    with pytest.raises(StemlmError, match="stores its tables compactly.*stemlm export"):
        StemlmForCausalLM.from_pretrained(checkpoints[1])
