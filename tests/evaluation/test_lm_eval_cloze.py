"""The cloze task type (`output_type: loglikelihood`, `target_delimiter: ""`, acc = the target is the greedy
continuation) scored end to end by lm-eval through `StemlmLM`, against answers known without the adapter.

- `Oracle`: a plain-torch stand-in that knows each document's token sequence (`[<|endoftext|>] + context + target`,
  tokenized here) and puts a high logit on its next token; on "spoiled" documents a wrong token beats the target's
  last token. On the shipped `stemlm_cloze` documents lm-eval must report acc = the unspoiled fraction and the
  perplexity computed here in closed form, with and without context truncation. It raises if the adapter ever
  feeds it a row that is not the expected window of a document (different tokenization, BOS or truncation).
- A real tiny `StemLM` on a task file written here from shipped cloze contexts: half of the targets are the
  model's own two greedy tokens (found by incremental argmax, no adapter), half have the second-best second
  token; acc must be exactly 1/2 and the perplexity must equal a one-sequence plain-torch recomputation.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
import yaml
from torch import nn

from stemlm.data.tokenizer import default_tokenizer, eot_id
from stemlm.evaluation.lm_eval_adapter import StemlmLM, run_lm_eval, summarize_results
from stemlm.evaluation.tasks import shipped_task_dir

from .conftest import small_model

HIGH = 12.0  # the oracle's logit for the token it predicts (every other token: 0)
DOCS = 10


def cloze_docs(n: int) -> list[dict]:
    lines = (shipped_task_dir() / "data" / "stemlm_cloze.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines[:n]]


class Oracle(nn.Module):
    """logits[b, p] = HIGH on the next token of the document whose window row b is; `spoil`: documents whose last
    target token loses to token + 1 (logit HIGH + 1), so their greedy check fails while their target stays likely."""

    def __init__(self, sequences: list[list[int]], vocab: int, window: int, spoil: set[int]) -> None:
        super().__init__()
        self.anchor = nn.Parameter(torch.zeros(()))  # model_device() reads a parameter's device
        self.config = SimpleNamespace(max_position_embeddings=window)
        self.sequences, self.vocab, self.window, self.spoil = sequences, vocab, window, spoil

    def forward(self, input_ids: torch.Tensor):
        logits = torch.zeros(*input_ids.shape, self.vocab)
        for b, row in enumerate(input_ids.tolist()):
            # The window scored for a document: its last `window` inputs (the last token is only a target).
            found = [
                i for i, s in enumerate(self.sequences) if row[: len(s[:-1][-self.window :])] == s[:-1][-self.window :]
            ]
            if len(found) != 1:
                raise AssertionError(f"input row matches {len(found)} documents' windows (expected exactly one)")
            s = self.sequences[found[0]]
            targets = s[1:][-self.window :]
            for p, t in enumerate(targets):
                logits[b, p, t] = HIGH
            if found[0] in self.spoil:
                logits[b, len(targets) - 1, (targets[-1] + 1) % self.vocab] = HIGH + 1
        return SimpleNamespace(logits=logits)


def closed_form_ll(n_targets: int, spoiled: bool, vocab: int) -> float:
    """log p of a target under the oracle: each token HIGH against vocab - 1 zeros (the spoiled last one also
    against HIGH + 1)."""
    plain = HIGH - math.log(math.exp(HIGH) + vocab - 1)
    last = HIGH - math.log(math.exp(HIGH + 1) + math.exp(HIGH) + vocab - 2) if spoiled else plain
    return (n_targets - 1) * plain + last


@pytest.mark.parametrize("window", [64, 1024])  # 64: every context is cut to its rightmost tokens
def test_shipped_cloze_scores_an_oracle_exactly(window):
    tok = default_tokenizer()
    vocab, eot = tok.get_vocab_size(), eot_id(tok)
    docs = cloze_docs(DOCS)
    sequences = []
    for doc in docs:
        assert doc["context"] == doc["context"].rstrip() and doc["target"].startswith(" ")
        sequences.append([eot, *tok.encode(doc["context"]).ids, *tok.encode(doc["target"]).ids])
    for spoil in (set(), {1, 4, 7}):
        oracle = Oracle(sequences, vocab, window, spoil)
        results = summarize_results(
            run_lm_eval(StemlmLM(oracle, tok, max_length=window), ["stemlm_cloze"], limit=DOCS)
        )["stemlm_cloze"]
        assert results["acc"] == pytest.approx(1 - len(spoil) / DOCS, abs=1e-12)
        lls = [closed_form_ll(len(tok.encode(doc["target"]).ids), i in spoil, vocab) for i, doc in enumerate(docs)]
        # rel 1e-4: the adapter's float32 log-softmax sums 8191 terms of e^-12 (~1e-5 off per token); one token
        # scored too many or too few would move the perplexity by ~5e-3.
        assert results["perplexity"] == pytest.approx(math.exp(-sum(lls) / len(lls)), rel=1e-4)


def _logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return F.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


def _round_trips(tok, ids: list[int]) -> bool:
    return tok.encode(tok.decode(ids), add_special_tokens=False).ids == ids


def test_cloze_task_on_a_real_model_matches_a_plain_recomputation(tmp_path):
    model, tok = small_model(max_len=96)
    eot = eot_id(tok)
    rows, expected_acc, lls = [], [], []
    for doc in cloze_docs(60):
        context = doc["context"][-160:].split(" ", 1)[-1].rstrip()  # whole words, no trailing space, fits 96
        prefix = [eot, *tok.encode(context).ids]
        t1 = int(_logits(model, prefix)[-1].argmax())
        second = _logits(model, prefix + [t1])[-1].topk(2).indices.tolist()
        greedy = len(rows) % 2 == 0  # alternate: the model's greedy pair, then a pair whose 2nd token is 2nd-best
        target_ids = [t1, second[0] if greedy else second[1]]
        if not _round_trips(tok, target_ids) or not tok.decode(target_ids).strip():
            continue  # a target must be the text whose tokens are exactly these
        logp = _logits(model, prefix + target_ids)[len(prefix) - 1 : -1]
        lls.append(float(logp.gather(-1, torch.tensor(target_ids)[:, None]).sum()))
        expected_acc.append(float(greedy))
        rows.append({"context": context, "target": tok.decode(target_ids)})
        if len(rows) == 8:
            break
    assert len(rows) == 8 and sum(expected_acc) == 4
    spec = yaml.safe_load((shipped_task_dir() / "stemlm_cloze.yaml").read_text())
    spec.update(task="my_cloze", tag=["mine"], dataset_kwargs={"data_files": {"test": "data.jsonl"}})
    (tmp_path / "my_cloze.yaml").write_text(yaml.safe_dump(spec))
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    results = run_lm_eval(StemlmLM(model, tok, batch_size=3), ["my_cloze"], include_paths=[tmp_path])
    got = summarize_results(results)["my_cloze"]
    assert got["acc"] == pytest.approx(0.5, abs=1e-12)
    assert got["perplexity"] == pytest.approx(math.exp(-sum(lls) / len(lls)), rel=1e-4)
