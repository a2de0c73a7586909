"""`stemlm generate --tables host|mmap` and `stemlm cache-sim`: same tokens as resident tables, memory and
cache figures reported, hit counts equal to the reference simulation on the tokenized text, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stemlm.checkpoint.folder import save_pretrained
from stemlm.cli.main import main
from stemlm.data.tokenizer import train_bpe

TEXT = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want "
    "of a wife. However little known the feelings or views of such a man may be on his first entering a "
    "neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is considered "
    "the rightful property of some one or other of their daughters. "
)


def _ckpt(tmp_path, offload_model):
    tok = train_bpe([TEXT * 3], vocab_size=300, min_frequency=1)
    model = offload_model("stem", seed=4, vocab_size=300)
    folder = tmp_path / "ckpt"
    save_pretrained(model, folder, tokenizer=tok)
    return folder, tok, model


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(map(str, argv)))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_with_host_tables_matches_resident_and_reports(tmp_path, offload_model, capsys):
    folder, _, model = _ckpt(tmp_path, offload_model)
    common = [folder, "a single man in possession of", "--greedy", "--max-new-tokens", 8, "--json"]
    code, out, _ = run_cli(capsys, "generate", *common)
    assert code == 0
    resident = json.loads(out)
    for extra in (["--tables", "host", "--cache-rows", 2], ["--tables", "mmap", "--cache-fraction", 0.5]):
        code, out, _ = run_cli(capsys, "generate", *common, *extra)
        assert code == 0
        result = json.loads(out)
        assert result["token_ids"] == resident["token_ids"]
        tables = result["tables"]
        table_bytes = 2 * 300 * 96 * 4  # two STEM layers, V=300, d_ff=96, fp32
        assert tables["table_bytes"] == table_bytes
        assert tables["device_parameter_bytes"] == sum(p.numel() * 4 for p in model.parameters()) - table_bytes
        assert tables["host_table_bytes" if extra[1] == "host" else "mapped_table_bytes"] == table_bytes
        cache = tables["cache"]
        assert cache["hits"] + cache["misses"] == cache["unique_ids"] > 0
        assert cache["lookups"] == len(result["prompt_ids"]) + len(result["token_ids"]) - 1
    code, _, err = run_cli(capsys, "generate", folder, "a single man", "--max-new-tokens", 3, "--tables", "host")
    assert code == 0
    assert "memory: device parameters" in err and "tables in host memory" in err and "lfu cache:" in err


def test_generate_errors_before_generating(tmp_path, offload_model, capsys):
    folder, _, _ = _ckpt(tmp_path, offload_model)
    code, _, err = run_cli(capsys, "generate", folder, "a man", "--cache-rows", 5)
    assert code == 2 and "need --tables host" in err
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    code, out, err = run_cli(capsys, "generate", folder, "a man", "--tables", "mmap")
    assert code == 2 and out == "" and "model.safetensors is truncated" in err and len(err.splitlines()) == 1


def test_cache_sim_counts_match_reference(tmp_path, offload_model, capsys, reference_sim):
    folder, tok, _ = _ckpt(tmp_path, offload_model)
    data = tmp_path / "data.txt"
    data.write_text(TEXT * 2)
    out_dir = tmp_path / "sim"
    code, out, _ = run_cli(
        capsys,
        "cache-sim",
        folder,
        "--data",
        data,
        "--fractions",
        "0.05,0.2",
        "--policy",
        "lfu,lru",
        "--out",
        out_dir,
        "--json",
    )
    assert code == 0
    report = json.loads(out)
    assert json.loads((out_dir / "cache_sim.json").read_text())["results"] == report["results"]
    assert (out_dir / "cache_sim.png").stat().st_size > 1000
    stream = tok.encode(TEXT * 2).ids + [tok.token_to_id("<|endoftext|>")]
    assert report["tokens"] == len(stream) and report["vocab_size"] == 300
    for row in report["results"]:
        assert row["capacity"] == int(row["fraction"] * 300)
        counts, _ = reference_sim([[t] for t in stream], row["capacity"], row["policy"])
        assert (row["hits"], row["misses"], row["evictions"]) == (counts["hits"], counts["misses"], counts["evictions"])
    for row in report["static_top"]:
        frequencies = sorted((stream.count(t) for t in set(stream)), reverse=True)
        assert row["hit_rate"] == pytest.approx(sum(frequencies[: row["capacity"]]) / len(stream))


def test_cache_sim_warm_start_and_tokenizer_only(tmp_path, offload_model, capsys):
    folder, _, _ = _ckpt(tmp_path, offload_model)
    data = tmp_path / "data.txt"
    data.write_text(TEXT)
    base = ["cache-sim", "--tokenizer", folder, "--data", data, "--fractions", "0.1", "--policy", "lfu", "--json"]
    cold = json.loads(run_cli(capsys, *base)[1])["results"][0]
    warm = json.loads(run_cli(capsys, *base, "--warm", data)[1])["results"][0]
    assert warm["hit_rate"] > cold["hit_rate"]  # warmed on the very text it replays
    code, out, _ = run_cli(capsys, *base[:-1], "--max-tokens", 10)
    assert code == 0 and "lfu" in out and "static" in out
    for bad in (["--fractions", "0.1,2"], ["--policy", "mru"], ["--max-tokens", 0]):
        code, _, err = run_cli(capsys, *base, *bad)
        assert code == 2 and "error" in err


def test_cache_sim_writes_beside_the_checkpoint_by_default(tmp_path, offload_model, capsys):
    folder, _, _ = _ckpt(tmp_path, offload_model)
    data = tmp_path / "data.txt"
    data.write_text(TEXT)
    code, out, _ = run_cli(capsys, "cache-sim", folder, "--data", data, "--fractions", "0.1", "--json")
    assert code == 0 and json.loads(out)["out"] == str(Path(folder) / "cache-sim")
    assert (Path(folder) / "cache-sim" / "cache_sim.json").is_file()
    assert (Path(folder) / "cache-sim" / "cache_sim.png").is_file()
