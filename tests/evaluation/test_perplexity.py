"""Sliding-window perplexity: the window schedule, per-token log-probs against independent computations
(a brute-force forward per token, lm-eval's own rolling windows, one full forward), and the aggregates."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from lm_eval.utils import get_rolling_token_windows

from stemlm.errors import StemlmError
from stemlm.evaluation.perplexity import evaluate_perplexity, rolling_windows, token_logprobs

TEXT = "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want."


@pytest.mark.parametrize("n,window,stride", [(1, 4, 4), (10, 4, 4), (10, 4, 1), (37, 8, 3), (7, 16, 5), (64, 8, 8)])
def test_windows_score_each_target_once_with_enough_context(n, window, stride):
    seen = []
    windows = rolling_windows(n, window, stride)
    for w in windows:
        assert 0 < w.end - w.start <= window
        targets = list(range(w.start + 1 + w.skip, w.end + 1))
        for t in targets:
            context = t - w.start  # tokens the prediction of target t sees
            assert context >= min(t, window - stride + 1)
        seen += targets
    assert seen == list(range(1, n + 1))
    assert windows[-1].end == n and windows[-1].end - windows[-1].start == min(window, n)


def test_windows_match_lm_eval_example():
    # lm-eval's documented example: 10 tokens, max length 4 -> inputs [P 0 1 2], [3 4 5 6], [5 6 7 8] (last scores 8, 9)
    seq = ["P", *range(10)]
    got = [(seq[w.start : w.end], seq[w.start + 1 + w.skip : w.end + 1]) for w in rolling_windows(10, 4)]
    assert got == [(["P", 0, 1, 2], [0, 1, 2, 3]), ([3, 4, 5, 6], [4, 5, 6, 7]), ([5, 6, 7, 8], [8, 9])]


def _direct(model, context: list[int], target: int) -> float:
    logits = model(torch.tensor([context])).logits[0, -1].float()
    return float(F.log_softmax(logits, -1)[target])


def test_stride_one_is_max_context_per_token(lm_and_tok):
    model, tok = lm_and_tok
    seq = [0, *tok.encode(TEXT).ids][:30]
    window = 7
    got = token_logprobs(model, seq, window, stride=1, batch_size=3)
    with torch.no_grad():
        want = [_direct(model, seq[max(0, j - window) : j], seq[j]) for j in range(1, len(seq))]
    torch.testing.assert_close(got, torch.tensor(want), rtol=1e-4, atol=1e-4)


def test_stride_equal_window_matches_lm_eval_rolling_windows(lm_and_tok):
    model, tok = lm_and_tok
    ids = tok.encode(TEXT * 3).ids
    window = 16
    got = token_logprobs(model, [0, *ids], window)
    want = []
    with torch.no_grad():
        for inputs, preds in get_rolling_token_windows(ids, prefix_token=0, max_seq_len=window, context_len=1):
            logp = F.log_softmax(model(torch.tensor([inputs])).logits[0].float(), -1)
            rows = logp[len(inputs) - len(preds) :]
            want += rows.gather(-1, torch.tensor(preds)[:, None])[:, 0].tolist()
    torch.testing.assert_close(got, torch.tensor(want), rtol=1e-4, atol=1e-4)


def test_aggregates_against_one_full_forward(lm_and_tok):
    model, tok = lm_and_tok
    texts = [TEXT, "Call me Ishmael. Some years ago, never mind how long precisely.", "é — ü ok"]
    result = evaluate_perplexity(model, tok, texts, window=96)
    nats = tokens = 0
    with torch.no_grad():
        for text in texts:
            seq = torch.tensor([[0, *tok.encode(text).ids]])
            logp = F.log_softmax(model(seq[:, :-1]).logits.float(), -1)
            nats -= float(logp.gather(-1, seq[:, 1:, None]).sum())
            tokens += seq.shape[1] - 1
    nbytes = sum(len(t.encode("utf-8")) for t in texts)
    assert (result.tokens, result.bytes, result.documents) == (tokens, nbytes, 3)
    assert result.nats == pytest.approx(nats, rel=1e-5)
    assert result.loss == pytest.approx(nats / tokens, rel=1e-5)
    assert result.perplexity == pytest.approx(math.exp(nats / tokens), rel=1e-5)
    assert result.bits_per_byte == pytest.approx(nats / (math.log(2) * nbytes), rel=1e-5)


def test_max_tokens_scores_a_prefix_and_its_bytes(lm_and_tok):
    model, tok = lm_and_tok
    text = "naïve café über " * 10
    ids, offsets = tok.encode(text).ids, tok.encode(text).offsets
    result = evaluate_perplexity(model, tok, [text], window=32, stride=16, max_tokens=11)
    assert 11 <= result.tokens <= 13  # extended to the end of a split multi-byte character
    prefix = text[: offsets[result.tokens - 1][1]]
    assert tok.encode(prefix).ids == ids[: result.tokens]
    assert result.bytes == len(prefix.encode("utf-8"))
    full = token_logprobs(model, [0, *ids[: result.tokens]], 32, 16)
    assert result.nats == pytest.approx(-float(full.sum()), rel=1e-5)


def test_errors(lm_and_tok):
    model, tok = lm_and_tok
    with pytest.raises(StemlmError, match="max_position_embeddings"):
        evaluate_perplexity(model, tok, [TEXT], window=97)
    with pytest.raises(StemlmError, match="stride"):
        evaluate_perplexity(model, tok, [TEXT], window=16, stride=17)
    with pytest.raises(StemlmError, match="no text"):
        evaluate_perplexity(model, tok, ["", ""])


def test_cli_ppl(tiny_ckpt, tmp_path, capsys, lm_and_tok):
    from stemlm.cli.main import main

    model, tok = lm_and_tok
    data = tmp_path / "a.txt"
    data.write_text(TEXT * 5)
    assert main(["eval", "ppl", str(tiny_ckpt), "--data", str(data), "--seq-len", "32", "--stride", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    want = evaluate_perplexity(model, tok, [TEXT * 5], window=32, stride=8)
    assert out["loss"] == pytest.approx(want.loss, rel=1e-6) and out["bytes"] == len((TEXT * 5).encode())
    assert main(["eval", "ppl", str(tiny_ckpt), "--data", str(data), "--seq-len", "1000"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("stemlm eval: error: window of 1000 tokens exceeds") and "\n" not in err


def test_progress_bar_counts_every_scored_token_and_changes_nothing(lm_and_tok, tty_stderr):
    model, tok = lm_and_tok
    texts = [TEXT * 4, TEXT]
    quiet = evaluate_perplexity(model, tok, texts, window=16, stride=5, batch_size=2)
    assert tty_stderr.readouterr().err == ""
    shown = evaluate_perplexity(model, tok, texts, window=16, stride=5, batch_size=2, progress=True)
    assert shown == quiet
    last = tty_stderr.readouterr().err.strip().split("\r")[-1]
    assert last.startswith("scoring: 100%|") and f"| {quiet.tokens}/{quiet.tokens} [" in last, last


def test_cli_ppl_progress_goes_to_stderr_unless_no_progress(tiny_ckpt, tmp_path, tty_stderr):
    from stemlm.cli.main import main

    data = tmp_path / "a.txt"
    data.write_text(TEXT * 5)
    argv = ["eval", "ppl", str(tiny_ckpt), "--data", str(data), "--seq-len", "32", "--json"]
    assert main(argv) == 0
    out, err = tty_stderr.readouterr()
    assert "scoring: 100%" in err and json.loads(out)["tokens"] > 0
    assert main([*argv, "--no-progress"]) == 0
    assert tty_stderr.readouterr().err == ""
