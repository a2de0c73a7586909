"""User training data: text files, folders and JSON Lines read into documents, and the train/held-out split.

`--data` arguments may be files (read whole, or one document per line for `.jsonl` with a `text` field)
or folders (searched recursively for *.txt, *.md and *.jsonl, hidden entries skipped, in sorted order).
Every problem a user can fix is one-line `StemlmError` naming the file: a missing path, an empty file or
folder, a FIFO or device, a binary or non-UTF-8 file, a JSON line that is invalid (or nested too deeply,
or holds an integer too long to convert) or lacks `text`, a text with a lone surrogate. `load_corpus` is the
single entry point the trainer and the tokenizer CLI use, so both see the same split. `eval_texts` is what
evaluation reads: the given files whole, else the embedded held-out split.
"""

from __future__ import annotations

from pathlib import Path

from stemlm.data.corpus import (
    DEFAULT_HELDOUT_FRACTION,
    DEFAULT_SEED,
    Document,
    embedded_texts,
    load_embedded_corpus,
    split_documents,
)
from stemlm.data.inputs import decode_text, encodable, parse_json_line
from stemlm.errors import StemlmError

FOLDER_SUFFIXES = (".txt", ".md", ".jsonl")
USER_SOURCE = "user"  # all user documents form one group for split_documents


def _read_text(path: Path) -> str:
    return decode_text(path.read_bytes(), str(path), "UTF-8 text, markdown or jsonl files")


def _read_jsonl(path: Path, name: str) -> list[Document]:
    docs = []
    for lineno, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        record = parse_json_line(line, f"{path} line {lineno}")
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise StemlmError(f"{path} line {lineno}: expected a JSON object with a string 'text' field")
        if record["text"].strip():
            docs.append(Document(f"{name}:{lineno}", USER_SOURCE, encodable(record["text"], f"{path} line {lineno}")))
    return docs


def _read_file(path: Path, name: str) -> list[Document]:
    if path.suffix == ".jsonl":
        return _read_jsonl(path, name)
    text = _read_text(path)
    return [Document(name, USER_SOURCE, text)] if text.strip() else []


def _folder_files(folder: Path) -> list[Path]:
    files = []
    for path in sorted(folder.rglob("*")):
        hidden = any(part.startswith(".") for part in path.relative_to(folder).parts)
        if path.is_file() and path.suffix in FOLDER_SUFFIXES and not hidden:
            files.append(path)
    return files


def read_documents(paths: list[str | Path]) -> list[Document]:
    """Read every file and folder in `paths` into documents named by where they are *inside* the argument (a
    folder's files by their relative path, a file by its name; plus the line for jsonl). The held-out split
    hashes these names, so it must not depend on where the data lives: a copied or moved folder, or the same
    files under another temporary directory, give the same split and the same run."""
    if not paths:
        raise StemlmError("no data paths given")
    docs: list[Document] = []
    for arg in map(Path, paths):
        if arg.is_dir():
            files = _folder_files(arg)
            if not files:
                raise StemlmError(f"folder {arg} has no {', '.join(FOLDER_SUFFIXES)} files")
            found = [doc for path in files for doc in _read_file(path, path.relative_to(arg).as_posix())]
            if not found:
                raise StemlmError(f"folder {arg} contains only empty files")
        elif arg.is_file():
            found = _read_file(arg, arg.name)
            if not found:
                raise StemlmError(f"{arg} is empty")
        elif arg.exists():  # a device or pipe (/dev/zero would be read forever)
            raise StemlmError(f"data path {arg} is not a regular file or folder")
        else:
            raise StemlmError(f"data path not found: {arg}")
        docs.extend(found)
    return docs


def read_texts(paths: list[str | Path]) -> list[str]:
    """The texts of `read_documents(paths)`."""
    return [doc.text for doc in read_documents(paths)]


def eval_texts(paths: list[str | Path] | None) -> tuple[list[str], str]:
    """(texts, what they are) to evaluate on: the files of `paths` whole, else the embedded held-out split."""
    if paths:
        return read_texts(paths), " ".join(map(str, paths))
    return embedded_texts("heldout"), "embedded corpus (held-out split)"


def _tail_split(text: str, heldout_fraction: float) -> tuple[str, str]:
    # Cut at the first line break after the cut point, so no line is split between train and held-out.
    cut = int(len(text) * (1.0 - heldout_fraction))
    newline = text.find("\n", cut)
    if 0 <= newline < len(text) - 1:
        cut = newline + 1
    return text[:cut], text[cut:]


def load_corpus(
    data: list[str | Path] | None = None,
    heldout_fraction: float = DEFAULT_HELDOUT_FRACTION,
    seed: int = DEFAULT_SEED,
) -> tuple[list[str], list[str]]:
    """(train_texts, heldout_texts): the embedded corpus when `data` is None, else the user's files.

    Documents are split whole by `split_documents`; a single user document is split instead by its last
    `heldout_fraction` of characters (at a line break where possible).
    """
    docs = load_embedded_corpus() if data is None else read_documents(data)
    if len(docs) == 1 and heldout_fraction > 0:
        if not 0.0 < heldout_fraction < 1.0:
            raise StemlmError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
        train_text, heldout_text = _tail_split(docs[0].text, heldout_fraction)
        return [train_text], [heldout_text] if heldout_text.strip() else []
    train, heldout = split_documents(docs, heldout_fraction, seed)
    return [d.text for d in train], [d.text for d in heldout]
