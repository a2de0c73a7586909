"""The accounting as text (stemlm.model.accounting_report): the table's lines carry the summary's figures, the
preset list sizes every preset, and the meta-device check agrees with the arithmetic."""

from __future__ import annotations

from stemlm.model.accounting import summarize, total_parameters
from stemlm.model.accounting_report import human, preset_rows, render_summary, verify_on_meta
from stemlm.model.presets import get_preset, list_presets


def test_human_prefixes():
    assert (human(6.67e9), human(2.3e9, "B"), human(512), human(1500, "FLOPs")) == (
        "6.67B",
        "2.30 GB",
        "512",
        "1.50 kFLOPs",
    )


def test_table_names_the_model_and_its_totals():
    config = get_preset("tiny")
    summary = {"model": "tiny", **summarize(config, 256)}
    lines = render_summary(config, summary).splitlines()
    assert lines[0].startswith(f"tiny: ffn stem in layers [{','.join(map(str, config.special_layers))}] of 4")
    total = summary["parameters"]["total"]
    assert any(line.split()[:2] == ["total", f"{total:,}"] for line in lines)
    assert "forward FLOPs per token at L=256 (causal attention; 2 x MACs, lookups are free)" in lines


def test_preset_rows_and_meta_count():
    rows = preset_rows()
    assert [r["name"] for r in rows] == list(list_presets())
    tiny = get_preset("tiny")
    assert next(r for r in rows if r["name"] == "tiny")["total"] == total_parameters(tiny) == verify_on_meta(tiny)


def test_preset_table_has_a_row_per_preset():
    from stemlm.model.accounting_report import render_presets

    lines = render_presets(preset_rows()).splitlines()
    assert lines[0].split() == ["preset", "ffn", "layers", "d", "total", "active"]
    assert [line.split()[0] for line in lines[1:]] == list(list_presets())


def test_context_length_defaults_and_limits():
    import pytest

    from stemlm.errors import StemlmError
    from stemlm.model.accounting_report import DEFAULT_SEQ_LEN, context_length

    tiny = get_preset("tiny")
    assert context_length(tiny) == min(DEFAULT_SEQ_LEN, tiny.max_position_embeddings)
    assert context_length(tiny, 16) == 16
    with pytest.raises(StemlmError, match="exceeds max_position_embeddings"):
        context_length(tiny, tiny.max_position_embeddings + 1)
    with pytest.raises(StemlmError, match="positive integer"):
        context_length(tiny, 0)
