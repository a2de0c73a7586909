"""User data: files, folders and jsonl into documents, one-line errors, and load_corpus splits."""

import json

import pytest

from stemlm.data.corpus import embedded_texts
from stemlm.data.sources import load_corpus, read_documents, read_texts
from stemlm.errors import StemlmError


def test_files_folders_and_jsonl(tmp_path):
    (tmp_path / "sub" / ".hidden").mkdir(parents=True)
    (tmp_path / "a.txt").write_text("alpha\n")
    (tmp_path / "sub" / "b.md").write_text("# beta\n")
    (tmp_path / "sub" / "c.jsonl").write_text(json.dumps({"text": "gamma"}) + "\n\n" + json.dumps({"text": "delta"}))
    (tmp_path / "sub" / "skip.csv").write_text("x,y\n")
    (tmp_path / "sub" / ".hidden" / "h.txt").write_text("hidden\n")
    docs = read_documents([tmp_path])
    assert [d.text for d in docs] == ["alpha\n", "# beta\n", "gamma", "delta"]
    assert [d.name for d in docs] == ["a.txt", "sub/b.md", "sub/c.jsonl:1", "sub/c.jsonl:3"]  # inside the argument
    assert read_documents([tmp_path / "a.txt"])[0].name == "a.txt"
    assert read_texts([tmp_path / "sub" / "skip.csv"]) == ["x,y\n"]  # explicit files are read whatever the suffix


@pytest.mark.parametrize(
    ("content", "name", "message"),
    [
        (b"", "empty.txt", "is empty"),
        (b"text\x00more", "nul.txt", "binary"),
        (b"caf\xe9", "latin.txt", "not valid UTF-8"),
        (b'{"body": "x"}\n', "notext.jsonl", "line 1: expected a JSON object"),
        (b'{"text": "ok"}\n{broken\n', "broken.jsonl", "line 2: invalid JSON"),
    ],
)
def test_bad_files_raise_one_line_errors(tmp_path, content, name, message):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(StemlmError, match=message) as info:
        read_texts([tmp_path / name])
    assert "\n" not in str(info.value) and name in str(info.value)


def test_missing_and_empty_folders(tmp_path):
    with pytest.raises(StemlmError, match="not found"):
        read_texts([tmp_path / "nope"])
    with pytest.raises(StemlmError, match="has no"):
        read_texts([tmp_path])
    (tmp_path / "blank.txt").write_text("  \n")
    with pytest.raises(StemlmError, match="only empty files"):
        read_texts([tmp_path])


def test_load_corpus_embedded_and_user(tmp_path):
    train, heldout = load_corpus(None)
    assert train == embedded_texts("train") and heldout == embedded_texts("heldout")
    for i in range(10):
        (tmp_path / f"doc{i}.txt").write_text(f"document {i}\n")
    train, heldout = load_corpus([tmp_path], heldout_fraction=0.2, seed=1)
    assert len(heldout) == 2 and len(train) == 8 and set(train).isdisjoint(heldout)
    assert load_corpus([tmp_path], heldout_fraction=0.2, seed=1) == (train, heldout)


def test_single_document_is_split_by_tail(tmp_path):
    text = "".join(f"line {i}\n" for i in range(100))
    (tmp_path / "one.txt").write_text(text)
    (train,), (heldout,) = load_corpus([tmp_path / "one.txt"], heldout_fraction=0.1)
    assert train + heldout == text and train.endswith("\n")
    assert 0.05 < len(heldout) / len(text) < 0.15


def test_the_split_does_not_depend_on_where_the_data_lives(tmp_path):
    # Document names feed the held-out hash: full paths made the split (and every loss) change when the same
    # folder was copied elsewhere, e.g. under another pytest temporary directory.
    texts = [f"document {i}: " + "words " * (i + 3) for i in range(12)]
    splits = []
    for where in ("first/place", "second/other/place"):
        folder = tmp_path / where / "corpus"
        folder.mkdir(parents=True)
        for i, text in enumerate(texts):
            (folder / f"doc{i:02d}.txt").write_text(text)
        splits.append(load_corpus([folder], heldout_fraction=0.25))
    assert splits[0] == splits[1] and len(splits[0][1]) == 3


def test_eval_texts_are_the_files_or_the_heldout_split(tmp_path):
    from stemlm.data.corpus import embedded_texts
    from stemlm.data.sources import eval_texts

    (tmp_path / "a.txt").write_text("one document")
    assert eval_texts([str(tmp_path / "a.txt")]) == (["one document"], str(tmp_path / "a.txt"))
    assert eval_texts(None) == (embedded_texts("heldout"), "embedded corpus (held-out split)")
