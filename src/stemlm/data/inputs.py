"""The input files of `stemlm data prepare` and the documents read from each (in a worker process).

`find_files(paths)` expands folders (recursively, *.txt, *.md, *.jsonl, *.parquet, hidden entries skipped,
sorted) and checks files: a missing path, a FIFO or device (`/dev/zero` would be read forever) and an empty
folder are one-line errors, and a file named twice (or reached through a link or another spelling) is read
once, with one warning line per repeat. `documents(path, field)` yields the documents of one file: a text or
markdown file whole, a JSON Lines file one per line (the `field` string of each object), a parquet file one per
row of its `field` column, in record batches. Every problem is a `StemlmError` naming the file and, where it
has one, the line or row: invalid UTF-8 or NUL bytes, invalid JSON, JSON nested too deeply for the parser, an
integer too long to convert, a lone surrogate (valid JSON, but no tokenizer can encode it), a corrupt parquet
page.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from stemlm.errors import StemlmError
from stemlm.paths import input_file

SUFFIXES = (".txt", ".md", ".jsonl", ".parquet")


def find_files(paths: list[str | Path], warn: Callable[[str], None]) -> list[Path]:
    """Every input file of `paths`, folders expanded in sorted order, each file once (`warn` names repeats)."""
    if not paths:
        raise StemlmError("no data paths given")
    files: list[Path] = []
    for arg in map(Path, paths):
        if arg.is_dir():
            found = [
                p
                for p in sorted(arg.rglob("*"))
                if p.is_file() and p.suffix in SUFFIXES and not any(s.startswith(".") for s in p.relative_to(arg).parts)
            ]
            if not found:
                raise StemlmError(f"folder {arg} has no {', '.join(SUFFIXES)} files")
            files += found
        else:
            files.append(input_file(arg, "data path"))
    seen: dict[tuple[int, int], Path] = {}
    unique = []
    for path in files:
        st = os.stat(path)
        first = seen.setdefault((st.st_dev, st.st_ino), path)
        if first is path:
            unique.append(path)
        else:
            warn(f"{path} is the same file as {first}; it is tokenized once")
    return unique


def decode_text(raw: bytes, where: str, accepted: str = "UTF-8 text, jsonl or parquet files") -> str:
    """`raw` as text, or a one-line error naming `where` for binary (NUL bytes) or non-UTF-8 input."""
    if b"\0" in raw:
        raise StemlmError(f"{where} looks binary (contains NUL bytes); pass {accepted}")
    try:
        return raw.decode("utf-8-sig")  # -sig drops a byte-order mark that some editors write
    except UnicodeDecodeError as exc:
        raise StemlmError(f"{where} is not valid UTF-8 (byte {exc.start}); convert it to UTF-8") from None


def encodable(text: str, where: str) -> str:
    """`text` unless it holds a lone surrogate (which JSON can spell as "\\ud800")."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise StemlmError(f"{where}: the text holds a lone surrogate (character {exc.start}); fix the file") from None
    return text


def _text_docs(path: Path, field: str) -> Iterator[str]:
    text = decode_text(path.read_bytes(), str(path))
    if text.strip():
        yield text


def parse_json_line(line: str, where: str) -> object:
    """One JSON value, or a one-line error naming `where` (a file and line)."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise StemlmError(f"{where}: invalid JSON ({exc.msg})") from None
    except RecursionError:
        raise StemlmError(f"{where}: JSON nested too deeply to read") from None
    except ValueError:  # Python refuses to convert integers of more than 4300 digits
        raise StemlmError(f"{where}: JSON holds an integer too long to read") from None


def _jsonl_docs(path: Path, field: str) -> Iterator[str]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path} line {lineno}"
            line = decode_text(raw, where)
            if not line.strip():
                continue
            record = parse_json_line(line, where)
            if not isinstance(record, dict) or not isinstance(record.get(field), str):
                raise StemlmError(f"{where}: expected a JSON object with a string {field!r} field")
            if record[field].strip():
                yield encodable(record[field], where)


def _parquet_docs(path: Path, field: str) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise StemlmError(f"{path} is not a readable parquet file ({str(exc).splitlines()[0]})") from None
    names = table.schema_arrow.names
    if field not in names:
        raise StemlmError(f"{path}: no column {field!r} (columns: {', '.join(names)}); pass --text-field")
    kind = table.schema_arrow.field(field).type
    if not pa.types.is_string(kind) and not pa.types.is_large_string(kind):
        raise StemlmError(f"{path}: column {field!r} is {kind}, not text")
    row = 0
    for group in range(table.metadata.num_row_groups):  # one row group at a time, so an error can say where
        first = row
        try:
            for batch in table.iter_batches(columns=[field], row_groups=[group]):
                for text in batch.column(0).to_pylist():
                    if text and text.strip():
                        yield encodable(text, f"{path} row {row}")
                    row += 1
        except (pa.ArrowException, OSError) as exc:  # a corrupt page, found when it is read
            message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise StemlmError(f"{path}: row group {group} (from row {first}) is unreadable ({message})") from None


READERS = {".jsonl": _jsonl_docs, ".parquet": _parquet_docs}


def documents(path: Path, field: str) -> Iterator[str]:
    """The documents of one input file, by its suffix (anything else is read as one text document)."""
    return READERS.get(path.suffix, _text_docs)(path, field)
