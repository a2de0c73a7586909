"""`stemlm edit` warns, in one stderr line and without refusing, when tokens of --target or --source never occurred
in the training data its run folder records (the embedded corpus and its fact mix); a bare checkpoint, or a run
on the user's own data, gets no warning. Run: `python -m pytest tests/edit/test_untrained_warning.py -q`."""

from __future__ import annotations

import json

import pytest

from stemlm.checkpoint.folder import save_pretrained
from stemlm.cli.main import main
from stemlm.data.tokenizer import default_tokenizer
from stemlm.model import build_model
from stemlm.model.config import ModelConfig
from stemlm.train import TrainConfig
from tests.bad_input import tree

CONFIG = dict(vocab_size=8192, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2)
PROMPT = ["--prompt", "Country: Spain. Capital:", "--source", "Spain", "--max-new-tokens", "1", "--json"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run folder of the default training config (embedded corpus, fact mix) and a bare checkpoint."""
    root = tmp_path_factory.mktemp("untrained")
    model, tok = build_model(ModelConfig(**CONFIG, max_position_embeddings=64, ffn_layers="1")), default_tokenizer()
    save_pretrained(model, root / "run" / "checkpoints" / "step-000001", tokenizer=tok)
    (root / "run" / "run_config.json").write_text(json.dumps({"train": TrainConfig().to_dict()}))
    save_pretrained(model, root / "bare", tokenizer=tok)
    return root


def test_a_target_token_never_trained_is_one_warning_line(run, capsys):
    before = tree(run)
    # " quar" is one token of the default tokenizer that neither the corpus's train split nor the fact mix holds
    assert main(["edit", str(run / "run"), *PROMPT, "--target", "quar"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["target"] == "quar"
    assert err.splitlines() == [
        f"stemlm edit: warning: --target 'quar' ('Ġquar'): never in the training data of {run / 'run'}, "
        "so those rows are untrained"
    ]
    assert tree(run) == before


@pytest.mark.parametrize(("folder", "target"), [("run", "Germany"), ("bare", "quar")])
def test_no_warning_for_trained_tokens_or_where_the_data_is_not_known(run, capsys, folder, target):
    assert main(["edit", str(run / folder), *PROMPT, "--target", target]) == 0
    assert capsys.readouterr().err == ""


def test_a_run_on_the_users_data_is_not_read_back(run, tmp_path, capsys):
    (run / "run" / "run_config.json").write_text(json.dumps({"train": TrainConfig(data=[str(tmp_path)]).to_dict()}))
    try:
        assert main(["edit", str(run / "run"), *PROMPT, "--target", "quar"]) == 0
    finally:
        (run / "run" / "run_config.json").write_text(json.dumps({"train": TrainConfig().to_dict()}))
    assert capsys.readouterr().err == ""
