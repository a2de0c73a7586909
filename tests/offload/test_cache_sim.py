"""The cache simulation of `stemlm cache-sim` as a library (stemlm.offload.cache_sim): the token stream joins
documents with <|endoftext|>, every policy's counts equal the plain reference cache, the static line is the
stream's own top ids, and the report and its files come out of the library without the CLI."""

from __future__ import annotations

import json

from stemlm.data.tokenizer import get_tokenizer
from stemlm.offload.cache_sim import JSON_NAME, PNG_NAME, cache_sim_report, simulate, token_stream, write_cache_sim


def test_stream_joins_documents_with_the_end_of_text_id():
    tok = get_tokenizer("default")
    eot = tok.token_to_id("<|endoftext|>")
    stream = token_stream(tok, ["one two", "three"])
    assert stream == tok.encode("one two").ids + [eot] + tok.encode("three").ids + [eot]


def test_simulate_matches_the_reference_and_the_static_top(reference_sim):
    stream = [1, 2, 1, 3, 1, 2, 4, 5, 1, 2] * 3
    report = simulate(stream, 10, [0.2], ["lfu", "lru"])
    assert report["tokens"] == 30 and report["distinct_tokens"] == 5
    for row in report["results"]:
        expected, _ = reference_sim([[t] for t in stream], row["capacity"], row["policy"])
        assert (row["hits"], row["misses"], row["evictions"]) == (
            expected["hits"],
            expected["misses"],
            expected["evictions"],
        )
    assert report["static_top"] == [{"fraction": 0.2, "capacity": 2, "hit_rate": (12 + 9) / 30}]


def test_report_and_files_without_a_checkpoint(tmp_path):
    data = tmp_path / "a.txt"
    data.write_text("The capital of Spain is Madrid. " * 20)
    report = cache_sim_report(None, "default", [str(data)], [], [0.01, 0.1], ["lfu"], max_tokens=50)
    assert report["tokens"] == 50 and report["tokenizer"] == "default" and "ngram" not in report
    assert report["warm"] == "embedded corpus, train split" and len(report["results"]) == 2
    write_cache_sim(report, tmp_path / "out", producer="test", force=False, sources=[])
    assert json.loads((tmp_path / "out" / JSON_NAME).read_text())["results"] == report["results"]
    assert (tmp_path / "out" / PNG_NAME).stat().st_size > 1000


def test_rendered_table_has_a_row_per_policy_and_size():
    from stemlm.offload.cache_sim import render_hit_rates

    report = {"vocab_size": 10, **simulate([1, 2, 1, 3] * 5, 10, [0.1, 0.2], ["lfu"])}
    lines = render_hit_rates(report).splitlines()
    assert lines[0] == "20 tokens, 3 distinct, vocabulary 10"
    assert lines[2] == f"lfu     {0.1:>9g}{1:>8}{100 * report['results'][0]['hit_rate']:>9.1f}%"
    assert [line.split()[0] for line in lines[2:]] == ["lfu", "lfu", "static", "static"]


def test_sizes_and_policies_as_typed():
    import pytest

    from stemlm.errors import StemlmError
    from stemlm.offload.cache_sim import parse_fractions, parse_policies

    assert parse_fractions("0.01, 0.1,") == [0.01, 0.1] and parse_policies("LFU,lru") == ["lfu", "lru"]
    for bad in ("2", "abc", ""):
        with pytest.raises(StemlmError, match="--fractions"):
            parse_fractions(bad)
    with pytest.raises(StemlmError, match="--policy 'fifo'"):
        parse_policies("fifo")


def test_progress_steps_once_per_replay_and_changes_nothing(tmp_path, tty_stderr):
    data = tmp_path / "a.txt"
    data.write_text("The capital of Spain is Madrid. " * 20)
    args = (None, "default", [str(data)], None, [0.01, 0.1], ["lfu", "lru"], 50)
    quiet = cache_sim_report(*args)
    assert tty_stderr.readouterr().err == ""
    shown = cache_sim_report(*args, progress=True)
    assert {k: v for k, v in shown.items() if k != "seconds"} == {k: v for k, v in quiet.items() if k != "seconds"}
    last = tty_stderr.readouterr().err.strip().split("\r")[-1]
    assert last.startswith("cache-sim: 100%") and "| 4/4 [" in last and "lru 0.1" in last, last


def test_cli_bar_on_a_terminal_unless_no_progress(tmp_path, tty_stderr):
    from stemlm.cli.main import main

    data = tmp_path / "a.txt"
    data.write_text("The capital of Spain is Madrid. " * 20)
    argv = ["cache-sim", "--tokenizer", "default", "--data", str(data), "--fractions", "0.1", "--policy", "lfu"]
    assert main([*argv, "--json"]) == 0
    assert "cache-sim: 100%" in tty_stderr.readouterr().err
    assert main([*argv, "--json", "--no-progress"]) == 0
    assert tty_stderr.readouterr().err.splitlines() == ["cache-sim: replaying 222 tokens (V=8,192) ..."]
