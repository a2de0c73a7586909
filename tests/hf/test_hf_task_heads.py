"""The task heads (`stemlm.hf.heads`) for every kind: what transformers' causal-LM tester (`CausalLMModelTest`, not in
the 5.24 sdist) checks of a causal LM's sequence classification (single-label, multi-label, regression), token
classification and question answering, each loss against a re-computation by hand from the logits; the pooled
token is the last non-pad one; a causal-LM folder loads into a head through the Auto class and a head round-trips
its own folder; a few training steps lower the loss; `resize_token_embeddings` and gradient checkpointing reach the
decoder; a remote-code folder serves the heads without stemlm.
Tiny random models; run with `OMP_NUM_THREADS=1 python -m pytest tests/hf/test_hf_task_heads.py -q`.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForSequenceClassification

from stemlm.checkpoint.folder import save_pretrained
from stemlm.cli.main import main
from stemlm.hf import (
    StemlmConfig,
    StemlmForCausalLM,
    StemlmForQuestionAnswering,
    StemlmForSequenceClassification,
    StemlmForTokenClassification,
)
from stemlm.model import build_model
from stemlm.model.config import FFN_KINDS
from tests.hf.test_hf import VOCAB, randomize_, tiny_config
from tests.hf.test_remote_code import tiny

PAD, LABELS = 0, 3
KIND_FIELDS = dict(value_embed_tables=1, engram_dim=16, memory_keys=8, memory_topk=4)


def config(kind: str, **hf) -> StemlmConfig:
    hf = {"pad_token_id": PAD, "num_labels": LABELS, **hf}
    return StemlmConfig.from_model_config(tiny_config(kind, **KIND_FIELDS), **hf)


def head(cls, kind: str, **hf):
    model = cls(config(kind, **hf))
    randomize_(model, seed=5)
    return model.eval()


def ids(batch: int = 3, length: int = 7, seed: int = 0) -> torch.Tensor:
    """Random ids avoiding the pad id, so every row's last token is its pooled one."""
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("kind", FFN_KINDS)
def test_sequence_classification_losses_are_computed_on_the_last_token(kind):
    model = head(StemlmForSequenceClassification, kind)
    x = ids()
    with torch.no_grad():
        hidden = model.model(x).last_hidden_state
        expected = model.score(hidden[:, -1])
        single = model(x, labels=torch.tensor([0, 2, 1]))
        model.config.problem_type = "multi_label_classification"
        multi_labels = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0], [1.0, 1.0, 0.0]])
        multi = model(x, labels=multi_labels)
        model.config.problem_type = "regression"
        targets = torch.randn(3, LABELS, generator=torch.Generator().manual_seed(1))
        regression = model(x, labels=targets)
    assert single.logits.shape == (3, LABELS)
    torch.testing.assert_close(single.logits, expected)
    torch.testing.assert_close(single.loss, F.cross_entropy(expected, torch.tensor([0, 2, 1])))
    torch.testing.assert_close(multi.loss, F.binary_cross_entropy_with_logits(expected, multi_labels))
    torch.testing.assert_close(regression.loss, F.mse_loss(expected, targets))


@pytest.mark.parametrize("kind", FFN_KINDS)
def test_pooling_takes_the_last_non_pad_token_of_a_right_padded_row(kind):
    model = head(StemlmForSequenceClassification, kind)
    rows = [ids(1, n, seed=n)[0] for n in (7, 4, 5)]
    batch = torch.stack([F.pad(r, (0, 7 - len(r)), value=PAD) for r in rows])
    mask = (batch != PAD).long()
    with torch.no_grad():
        padded = model(batch, attention_mask=mask).logits
        alone = torch.cat([model(r[None]).logits for r in rows])
    torch.testing.assert_close(padded, alone, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(alone[1], alone[2])  # different rows score differently, so the comparison bites


def test_a_batch_without_a_pad_id_is_refused_as_transformers_does():
    model = head(StemlmForSequenceClassification, "stem", pad_token_id=None)
    assert model(ids(1)).logits.shape == (1, LABELS)
    with pytest.raises(ValueError, match="no padding token"):
        model(ids(2))


@pytest.mark.parametrize("kind", FFN_KINDS)
def test_token_classification_and_question_answering_losses(kind):
    x = ids()
    tokens = head(StemlmForTokenClassification, kind)
    labels = torch.randint(0, LABELS, x.shape, generator=torch.Generator().manual_seed(2))
    labels[:, 0] = -100
    qa = head(StemlmForQuestionAnswering, kind)
    start, end = torch.tensor([1, 0, 4]), torch.tensor([3, 6, 4])
    with torch.no_grad():
        out = tokens(x, labels=labels)
        logits = tokens.score(tokens.model(x).last_hidden_state)  # eval: dropout is the identity
        spans = qa(x, start_positions=start, end_positions=end)
        start_logits, end_logits = qa.qa_outputs(qa.model(x).last_hidden_state).unbind(-1)
    assert out.logits.shape == (3, 7, LABELS)
    torch.testing.assert_close(out.logits, logits)
    torch.testing.assert_close(out.loss, F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100))
    torch.testing.assert_close(spans.start_logits, start_logits)
    torch.testing.assert_close(spans.end_logits, end_logits)
    expected = (F.cross_entropy(start_logits, start) + F.cross_entropy(end_logits, end)) / 2
    torch.testing.assert_close(spans.loss, expected)


@pytest.mark.parametrize("kind", FFN_KINDS)
def test_a_causal_lm_folder_loads_into_the_head_and_the_head_round_trips(tmp_path, kind):
    lm = StemlmForCausalLM(config(kind))
    randomize_(lm, seed=6)
    lm.save_pretrained(tmp_path / "lm")
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "lm", num_labels=LABELS).eval()
    assert type(model) is StemlmForSequenceClassification and model.config.pad_token_id == PAD
    decoder = dict(lm.model.state_dict())
    assert all(torch.equal(t, decoder[name]) for name, t in model.model.state_dict().items())
    model.save_pretrained(tmp_path / "cls")
    again = AutoModelForSequenceClassification.from_pretrained(tmp_path / "cls").eval()
    with torch.no_grad():
        assert torch.equal(again(ids()).logits, model(ids()).logits)


@pytest.mark.parametrize("kind", FFN_KINDS)
def test_a_few_training_steps_lower_the_loss(kind):
    model = head(StemlmForSequenceClassification, kind).train()
    x, labels = ids(4, 6, seed=3), torch.tensor([0, 1, 2, 1])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(6):
        loss = model(x, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] * 0.9, losses


@pytest.mark.parametrize("kind", FFN_KINDS)
def test_resize_and_gradient_checkpointing_reach_the_decoder(kind):
    model = head(StemlmForSequenceClassification, kind).train()  # no dropout: the two backward passes agree
    model.resize_token_embeddings(VOCAB + 8, mean_resizing=False)
    assert model.model.stem.config.vocab_size == VOCAB + 8  # the kind's own tables and hashes followed
    x = ids()
    x[0, 2] = VOCAB + 5  # a new token
    grads = []
    for checkpointing in (False, True):
        if checkpointing:
            model.gradient_checkpointing_enable()
            assert model.is_activation_checkpointing
        model.zero_grad()
        model(x, labels=torch.tensor([0, 1, 2])).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and "model.embed_tokens.weight" in grads[0]
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, msg=name)


NO_STEMLM = r"""
import importlib.abc, sys
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "stemlm" or name.startswith("stemlm."):
            raise ImportError(f"stemlm is not installed here ({name})")
sys.meta_path.insert(0, Refuse())
import torch
from transformers import AutoModelForQuestionAnswering, AutoModelForSequenceClassification
folder, out = sys.argv[1], sys.argv[2]
cls = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=3, trust_remote_code=True).eval()
qa = AutoModelForQuestionAnswering.from_pretrained(folder, trust_remote_code=True).eval()
torch.save({"cls": cls.state_dict(), "qa": type(qa).__name__, "module": type(cls).__module__}, out)
"""


def test_a_remote_code_folder_serves_the_heads_without_stemlm(tmp_path):
    save_pretrained(build_model(tiny("stem"), seed=3), tmp_path / "ckpt")
    assert main(["export", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf"), "--remote-code"]) == 0
    env = {"HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    argv = [sys.executable, "-I", "-c", NO_STEMLM, str(tmp_path / "hf"), str(tmp_path / "out.pt")]
    run = subprocess.run(argv, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    result = torch.load(tmp_path / "out.pt")
    assert result["module"].startswith("transformers_modules.") and result["qa"] == "StemlmForQuestionAnswering"
    local = AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf", num_labels=3)
    decoder = local.model.state_dict()
    assert all(torch.equal(result["cls"][f"model.{name}"], t) for name, t in decoder.items())
