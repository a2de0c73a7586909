"""`write_lm_eval_tokenizer`: the folder lm-eval's API models load with transformers encodes every text as
`stemlm eval lm` conditions it, `<|endoftext|>` first, when lm-eval asks for special tokens (`add_bos_token=True`),
and as the checkpoint's tokenizer does otherwise."""

from __future__ import annotations

import pytest

from stemlm.data.tokenizer import default_tokenizer
from stemlm.errors import StemlmError
from stemlm.serve.lm_eval_tokenizer import write_lm_eval_tokenizer

transformers = pytest.importorskip("transformers")
TEXT = "The capital of France is Paris"


def test_the_folder_prefixes_end_of_text_only_with_special_tokens(stem_ckpt, tmp_path):
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(write_lm_eval_tokenizer(stem_ckpt, tmp_path / "tok")))
    plain, eot = default_tokenizer().encode(TEXT).ids, default_tokenizer().token_to_id("<|endoftext|>")
    assert tokenizer(TEXT, add_special_tokens=True).input_ids == [eot, *plain]
    assert tokenizer(TEXT, add_special_tokens=False).input_ids == plain
    assert tokenizer.bos_token_id == tokenizer.eos_token_id == eot


def test_a_folder_without_a_tokenizer_is_refused(tmp_path):
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text("{}")
    with pytest.raises(StemlmError, match="has no tokenizer.json"):
        write_lm_eval_tokenizer(tmp_path / "ckpt", tmp_path / "tok")


def test_an_existing_folder_it_did_not_write_is_refused_and_kept(stem_ckpt, tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(StemlmError):
        write_lm_eval_tokenizer(stem_ckpt, tmp_path / "mine")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"
    with pytest.raises(StemlmError):  # the checkpoint's own folder: its tokenizer.json must not be replaced
        write_lm_eval_tokenizer(stem_ckpt, stem_ckpt)
    first = write_lm_eval_tokenizer(stem_ckpt, tmp_path / "tok")
    with pytest.raises(StemlmError):
        write_lm_eval_tokenizer(stem_ckpt, first)  # its own earlier output too, without force
    assert write_lm_eval_tokenizer(stem_ckpt, first, force=True) == first
    with pytest.raises(StemlmError):  # force never replaces a folder it did not write
        write_lm_eval_tokenizer(stem_ckpt, tmp_path / "mine", force=True)
