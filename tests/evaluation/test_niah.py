"""Needle in a haystack: needle placement by position, lengths, exact-match scoring, an oracle that copies
perfectly scoring 100%, heatmap/JSON output, passkey training documents and the CLI's errors."""

from __future__ import annotations

import json
import random
import re

import pytest

from stemlm.cli.main import main
from stemlm.data.tokenizer import default_tokenizer
from stemlm.errors import StemlmError
from stemlm.evaluation.niah import (
    FILLER,
    NEEDLE,
    make_niah_sample,
    passkey_documents,
    plot_niah_heatmap,
    run_niah,
    score,
)

TOK = default_tokenizer()
NEEDLE_RE = re.compile(NEEDLE.replace(".", r"\.").format(key=r"(\w+)", value=r"(\d+)"))


def oracle(prompt: str, max_new_tokens: int) -> str:
    """Reads the queried key from the prompt's last line and copies that needle's number (test stub only)."""
    key = re.search(r"magic number for (\w+) in the text above", prompt).group(1)
    return " " + dict(NEEDLE_RE.findall(prompt))[key] + "."


def _haystack_tokens_before_needle(sample):
    body = sample.prompt.split("\n")[1]
    needle = NEEDLE.format(key=sample.key, value=sample.answer)
    before, after = body.split(needle)
    count = lambda s: len(TOK.encode(s.strip()).ids) if s.strip() else 0  # noqa: E731
    return count(before), count(before) + count(after)


@pytest.mark.parametrize("depth", [0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0])
@pytest.mark.parametrize("length", [128, 512])
def test_needle_is_placed_at_the_requested_depth(length, depth):
    sample = make_niah_sample(TOK, length, depth, rng=random.Random(3))
    before, total = _haystack_tokens_before_needle(sample)
    sentence = max(len(TOK.encode(s).ids) + 1 for s in FILLER)  # the placement granularity
    assert abs(before - depth * total) <= sentence
    assert sample.needle_index == round(depth * sample.sentences)
    if depth == 0.0:
        assert before == 0
    if depth == 1.0:
        assert before == total


@pytest.mark.parametrize("length", [150, 256, 1000])
def test_length_is_filled_to_within_one_sentence(length):
    sample = make_niah_sample(TOK, length, 0.5, needles=3, rng=random.Random(0))
    used = 1 + len(TOK.encode(sample.prompt).ids) + sample.max_new_tokens
    assert used == sample.tokens
    assert length - 2 * max(len(TOK.encode(" " + s).ids) for s in FILLER) < used <= length


def test_multikey_has_distinct_keys_and_one_is_queried():
    sample = make_niah_sample(TOK, 400, 0.3, needles=4, rng=random.Random(7))
    found = NEEDLE_RE.findall(sample.prompt)
    assert len(found) == 4 and len({k for k, _ in found}) == 4
    assert dict(found)[sample.key] == sample.answer
    assert sample.prompt.rstrip().endswith(f"magic number for {sample.key} is")


def test_exact_match_scoring():
    sample = make_niah_sample(TOK, 128, 0.5, digits=5, rng=random.Random(1))
    assert score(sample, f" {sample.answer}.")
    assert score(sample, f"{sample.answer} and 12")
    assert not score(sample, f" {sample.answer}1")
    assert not score(sample, f" {sample.answer[:-1]}")
    assert not score(sample, " unknown")


def test_oracle_scores_100_percent_and_a_guesser_0():
    kwargs = dict(lengths=[128, 300], depths=[0, 0.5, 1], samples=3, needles=3, digits=6)
    result = run_niah(oracle, TOK, **kwargs)
    assert result["accuracy"] == 1.0 and set(result["by_length"].values()) == {1.0}
    assert result["variant"] == "niah_multikey_3"
    assert run_niah(lambda p, n: " 1234567.", TOK, **kwargs)["accuracy"] == 0.0


def test_model_answerer_matches_generate(lm_and_tok):
    from stemlm.evaluation.niah import model_answerer
    from stemlm.inference.generate import generate

    model, tok = lm_and_tok
    sample = make_niah_sample(tok, 96, 0.5, digits=3, rng=random.Random(0))
    got = model_answerer(model, tok)(sample.prompt, sample.max_new_tokens)
    ids = generate(model, [0, *tok.encode(sample.prompt).ids], sample.max_new_tokens, greedy=True, eos_id=0)
    assert got == tok.decode([t for t in ids if t != 0])


def test_too_long_context_and_bad_arguments():
    with pytest.raises(StemlmError, match="exceeds the model's max_position_embeddings=96"):
        run_niah(oracle, TOK, [64, 200], [0.5], max_context=96)
    with pytest.raises(StemlmError, match="too short"):
        make_niah_sample(TOK, 20, 0.5)
    with pytest.raises(StemlmError, match="depth"):
        make_niah_sample(TOK, 200, 1.5)


def test_progress_counts_samples_and_a_short_length_fails_before_any_answer(tty_stderr):
    kwargs = dict(lengths=[128, 200], depths=[0, 1], samples=2, digits=4)
    quiet = run_niah(oracle, TOK, **kwargs, keep_outputs=True)
    assert tty_stderr.readouterr().err == ""
    assert run_niah(oracle, TOK, **kwargs, keep_outputs=True, progress=True) == quiet
    last = tty_stderr.readouterr().err.strip().split("\r")[-1]
    assert last.startswith("niah: 100%") and "| 8/8 [" in last, last
    asked = []
    with pytest.raises(StemlmError, match="too short"):
        run_niah(lambda p, n: asked.append(p) or "", TOK, [128, 20], [0.5], progress=True)
    assert asked == [] and tty_stderr.readouterr().err == ""  # refused while planning: no decoding, no bar


def test_heatmap_png(tmp_path):
    result = run_niah(oracle, TOK, [128, 200], [0, 1], samples=1)
    path = plot_niah_heatmap(result, tmp_path / "h.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_passkey_documents_end_with_the_answer():
    docs = passkey_documents(TOK, 6, [128, 256], needles=(1, 3), digits=4, seed=5)
    assert len(docs) == 6
    for doc in docs:
        prompt, answer = doc.rsplit(" ", 1)
        assert oracle(prompt, 0).strip() == answer
        assert 1 + len(TOK.encode(doc).ids) <= 256


def test_cli_niah_and_errors(tiny_ckpt, tmp_path, tty_stderr):
    out = tmp_path / "niah"
    argv = ["eval", "niah", str(tiny_ckpt), "--lengths", "80,96", "--depths", "0,1", "--samples", "1", "--digits", "3"]
    assert main([*argv, "--out", str(out), "--json"]) == 0
    out_text, err = tty_stderr.readouterr()
    printed = json.loads(out_text)
    assert "niah: 100%" in err  # the bar on stderr; --no-progress below has none
    saved = json.loads((out / "niah.json").read_text())
    assert printed["grid"] == saved["grid"] and set(saved["grid"]) == {"80", "96"}
    assert len(saved["outputs"]) == 4 and (out / "niah_heatmap.png").is_file()
    assert main([*argv, "--out", str(tmp_path / "quiet"), "--json", "--no-progress"]) == 0
    assert tty_stderr.readouterr().err == ""
    assert json.loads((tmp_path / "quiet" / "niah.json").read_text()) == saved
    assert main(["eval", "niah", str(tiny_ckpt), "--lengths", "128", "--out", str(out), "--force"]) == 2
    err = tty_stderr.readouterr().err.strip()
    assert err == (
        "stemlm eval: error: context length 128 exceeds the model's max_position_embeddings=96; use lengths up to 96"
    )


def test_cli_niah_data(tmp_path, capsys):
    path = tmp_path / "train.jsonl"
    assert main(["eval", "niah-data", "--out", str(path), "--num", "3", "--lengths", "128", "--digits", "4"]) == 0
    docs = [json.loads(line)["text"] for line in path.read_text().splitlines()]
    assert len(docs) == 3 and all(oracle(d.rsplit(" ", 1)[0], 0).strip() == d.rsplit(" ", 1)[1] for d in docs)


def test_cli_niah_data_defaults_work(tmp_path, capsys):
    # The defaults (lengths 192,256; needles 1,2,4) must fit: 4 needles do not fit in 128 tokens.
    path = tmp_path / "train.jsonl"
    assert main(["eval", "niah-data", "--out", str(path), "--num", "12"]) == 0
    assert len(path.read_text().splitlines()) == 12
    capsys.readouterr()
    assert main(["eval", "niah-data", "--out", str(path), "--num", "5", "--lengths", "128"]) == 2
    err = capsys.readouterr().err.strip()
    assert "too short" in err and "raise --lengths or lower --needles" in err and len(err.splitlines()) == 1
    assert len(path.read_text().splitlines()) == 12  # nothing overwritten


def test_cli_niah_writes_beside_the_checkpoint_by_default(tiny_ckpt, tmp_path, capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(tiny_ckpt, run / "checkpoints" / "step-000001")  # a run folder's layout
    argv = ["eval", "niah", str(run), "--lengths", "80", "--depths", "0", "--samples", "1", "--digits", "3", "--json"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["out"] == str(run / "eval-niah")
    assert (run / "eval-niah" / "niah.json").is_file() and (run / "eval-niah" / "niah_heatmap.png").is_file()


def test_result_files_and_lines(tmp_path):
    import json

    from stemlm.evaluation.niah import render_niah, write_niah

    grid = {"256": {"0.5": 1.0}, "512": {"0.5": 0.0}}
    result = {"variant": "single", "accuracy": 0.5, "by_length": {"256": 1.0, "512": 0.0}}
    result |= {"lengths": [256, 512], "depths": [0.5], "grid": grid}
    lines = render_niah(result).splitlines()
    assert lines == ["single: accuracy 0.500", "  length    256: 1.000", "  length    512: 0.000"]
    write_niah(result, tmp_path / "out", "title", producer="test", force=False, sources=[])
    assert json.loads((tmp_path / "out" / "niah.json").read_text()) == result
    assert (tmp_path / "out" / "niah_heatmap.png").stat().st_size > 1000


def test_lengths_and_depths_as_typed():
    from stemlm.errors import StemlmError
    from stemlm.evaluation.niah import depth_fractions, positive_ints

    assert positive_ints("256, 512,") == [256, 512] and depth_fractions("0,0.5,1") == [0.0, 0.5, 1.0]
    with pytest.raises(StemlmError, match="positive integers"):
        positive_ints("0")
    with pytest.raises(StemlmError, match="list of integers"):
        positive_ints("a")
    with pytest.raises(StemlmError, match=r"fractions in \[0, 1\]"):
        depth_fractions("2")


def test_passkey_data_file(tmp_path):
    import json

    from stemlm.data.tokenizer import default_tokenizer
    from stemlm.evaluation.niah import write_passkey_data

    path, count = write_passkey_data(default_tokenizer(), tmp_path / "p.jsonl", 3, [192], needles=[1], digits=4, seed=0)
    assert count == 3 and [set(json.loads(line)) for line in path.read_text().splitlines()] == [{"text"}] * 3


def test_niah_of_a_checkpoint(tiny_ckpt):
    from stemlm.evaluation.niah import niah_checkpoint
    from stemlm.inference.load import InferenceOptions

    result = niah_checkpoint(str(tiny_ckpt), InferenceOptions(), [80], [0.5], samples=1, digits=3, progress=False)
    assert len(result["by_length"]) == 1 and len(result["outputs"]) == 1 and 0 <= result["accuracy"] <= 1
    with pytest.raises(StemlmError, match="max_position_embeddings"):
        niah_checkpoint(str(tiny_ckpt), InferenceOptions(), [10**6], [0.5], samples=1, progress=False)
