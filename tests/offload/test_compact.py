"""Compact table rows: row-wise int8 and bf16 storage served through the provider interface and `generate`.

Run: `python -m pytest tests/offload/test_compact.py -q`.
"""

from __future__ import annotations

import json

import pytest
import torch

from stemlm.errors import StemlmError
from stemlm.offload.compact import CompactProvider, dequantize_rows, quantize_rows
from stemlm.offload.providers import HostProvider
from tests.offload.test_offload_cli import _ckpt, run_cli


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
    int8 = CompactProvider(base, "int8")
    got = int8.gather(ids)
    # Independently: each layer's rows quantised on their own, then concatenated in layer order.
    expected = torch.cat([dequantize_rows(*quantize_rows(tables[i][ids])) for i in (1, 3)], dim=1)
    assert torch.equal(got, expected)
    assert int8.stored_row_bytes == 16 + 2 * 4 and base.row_bytes == 16 * 4
    bf16 = CompactProvider(base, "bf16")
    assert torch.equal(bf16.gather(ids), torch.cat([tables[1][ids], tables[3][ids]], dim=1).bfloat16().float())
    assert bf16.stored_row_bytes == 16 * 2


def test_generate_with_int8_host_tables(tmp_path, offload_model, capsys):
    folder, _, _ = _ckpt(tmp_path, offload_model)
    common = [folder, "a single man in possession of", "--greedy", "--max-new-tokens", 6, "--json", "--tables", "host"]
    code, out, _ = run_cli(capsys, "generate", *common, "--table-dtype", "int8")
    assert code == 0 and len(json.loads(out)["token_ids"]) == 6
    code, _, err = run_cli(capsys, "generate", folder, "a man", "--table-dtype", "int8")
    assert code == 2 and "--table-dtype bf16/int8 needs --tables host" in err


def test_unknown_table_dtype():
    with pytest.raises(StemlmError, match="unknown table dtype 'fp8'"):
        CompactProvider(HostProvider({1: torch.zeros(4, 2)}), "fp8")
