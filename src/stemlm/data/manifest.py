"""The manifest of a prepared shard folder (`stemlm data prepare`), read and schema-checked before any shard is.

    manifest = read_manifest("shards/")       # a dict whose every field below has been checked

A manifest is a file a user may edit, copy or truncate, so every field the readers use is checked for its type
and range, and an error names the file and the field ("shards/manifest.json: splits.train.shards[2].tokens
must be a whole number >= 1, got -5"), never a KeyError or TypeError. Checked: `format`; `tokenizer` {file,
sha256_16, vocab_size}; `separator` {token, id}; `dtype` (uint16 or uint32 only: any other dtype would
reinterpret the bytes, and uint16 cannot hold a vocabulary over 65536); `splits` {train, heldout}, each
{tokens, documents, shards: [{file, tokens, documents, sha256}]} with `tokens` the sum of its shards'; shard
and tokenizer files plain names inside the folder; `sources` a list. A folder holding shard files but no
manifest (deleted, or never finished) is refused as such instead of being read as a folder of text
(`refuse_orphan_shards`). The shards' own contents are checked elsewhere: sizes against `tokens` on every
open (`stemlm.data.stream`), hashes by `stemlm data verify` only.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, NoReturn

from stemlm.data.prepare import MANIFEST_FORMAT, MANIFEST_NAME, SPLITS
from stemlm.errors import StemlmError

DTYPES = ("uint16", "uint32")
SHARD_FILE = re.compile(r"(train|heldout)-\d{5}\.(uint16|uint32)\.bin")
SHA256 = re.compile(r"[0-9a-f]{64}")


def is_prepared(path: str | Path) -> bool:
    """Whether `path` is a folder written by `stemlm data prepare` (it holds a manifest)."""
    return (Path(path) / MANIFEST_NAME).is_file()


def refuse_orphan_shards(folder: str | Path) -> None:
    """A one-line error when `folder` holds prepared shard files but no manifest (so it is not text data)."""
    folder = Path(folder)
    if folder.is_dir() and not is_prepared(folder) and any(SHARD_FILE.fullmatch(p.name) for p in folder.iterdir()):
        raise StemlmError(
            f"{folder} holds token shards but no {MANIFEST_NAME} (deleted, or the prepare never finished); "
            "rerun `stemlm data prepare`"
        )


class _Fields:
    """Typed access to one manifest's fields; each error names the file and the dotted field."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, field: str, wanted: str, value: Any) -> NoReturn:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise StemlmError(f"{self.path}: {field} must be {wanted}, got {shown}; rerun `stemlm data prepare`")

    def get(self, obj: dict, key: str, where: str) -> Any:
        if key not in obj:
            raise StemlmError(f"{self.path}: field {where}{key} is missing; rerun `stemlm data prepare`")
        return obj[key]

    def obj(self, obj: dict, key: str, where: str = "") -> dict:
        value = self.get(obj, key, where)
        if not isinstance(value, dict):
            self.fail(where + key, "an object", value)
        return value

    def count(self, obj: dict, key: str, where: str, low: int = 0) -> int:
        value = self.get(obj, key, where)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            self.fail(where + key, f"a whole number >= {low}", value)
        return value

    def text(self, obj: dict, key: str, where: str = "", pattern: re.Pattern | None = None) -> str:
        value = self.get(obj, key, where)
        if not isinstance(value, str) or not value or (pattern is not None and not pattern.fullmatch(value)):
            self.fail(where + key, "a string" if pattern is None else f"a string matching {pattern.pattern}", value)
        return value

    def file_name(self, obj: dict, key: str, where: str = "", pattern: re.Pattern | None = None) -> str:
        value = self.text(obj, key, where, pattern)
        if Path(value).name != value or value in (".", ".."):
            self.fail(where + key, "a file name inside the folder", value)
        return value


def _check_split(f: _Fields, split: dict, where: str) -> None:
    shards = f.get(split, "shards", where)
    if not isinstance(shards, list):
        f.fail(where + "shards", "a list", shards)
    for i, shard in enumerate(shards):
        at = f"{where}shards[{i}]"
        if not isinstance(shard, dict):
            f.fail(at, "an object", shard)
        f.file_name(shard, "file", at + ".", SHARD_FILE)
        f.count(shard, "tokens", at + ".", low=1)
        f.count(shard, "documents", at + ".")
        f.text(shard, "sha256", at + ".", SHA256)
    total = f.count(split, "tokens", where)
    f.count(split, "documents", where)
    if total != sum(s["tokens"] for s in shards):
        f.fail(where + "tokens", f"the sum of its shards' tokens ({sum(s['tokens'] for s in shards)})", total)


def check_manifest(manifest: Any, path: Path) -> dict[str, Any]:
    """`manifest` if every field the readers use is there with its type and range; else a one-line error."""
    f = _Fields(path)
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise StemlmError(f"{path} is not a {MANIFEST_FORMAT} manifest; rerun `stemlm data prepare`")
    tokenizer = f.obj(manifest, "tokenizer")
    f.file_name(tokenizer, "file", "tokenizer.")
    f.text(tokenizer, "sha256_16", "tokenizer.", re.compile(r"[0-9a-f]{16}"))
    vocab = f.count(tokenizer, "vocab_size", "tokenizer.", low=1)
    separator = f.obj(manifest, "separator")
    f.text(separator, "token", "separator.")
    f.count(separator, "id", "separator.")
    dtype = f.get(manifest, "dtype", "")
    if dtype not in DTYPES:
        f.fail("dtype", "uint16 or uint32 (token ids are stored unsigned)", dtype)
    if dtype == "uint16" and vocab > 2**16:
        f.fail("dtype", f"uint32 for a vocabulary of {vocab} tokens", dtype)
    splits = f.obj(manifest, "splits")
    for name in SPLITS:
        _check_split(f, f.obj(splits, name, "splits."), f"splits.{name}.")
    extra = sorted(set(splits) - set(SPLITS))
    if extra:
        f.fail("splits", f"an object of {' and '.join(SPLITS)} only", extra[0])
    if not isinstance(f.get(manifest, "sources", ""), list):
        f.fail("sources", "a list", manifest["sources"])
    return manifest


def read_manifest(folder: str | Path) -> dict[str, Any]:
    """The checked manifest of a prepared folder (`check_manifest`)."""
    folder = Path(folder)
    path = folder / MANIFEST_NAME
    if not folder.is_dir():
        raise StemlmError(f"{folder} is not a folder written by `stemlm data prepare`")
    if not path.is_file():
        refuse_orphan_shards(folder)
        raise StemlmError(f"{folder} is not a folder written by `stemlm data prepare` (no {MANIFEST_NAME})")
    try:
        manifest = json.loads(path.read_bytes().decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError, ValueError) as exc:
        reason = exc.msg if isinstance(exc, json.JSONDecodeError) else type(exc).__name__
        raise StemlmError(f"{path} is not valid JSON ({reason}); rerun `stemlm data prepare`") from None
    except OSError as exc:
        raise StemlmError(f"cannot read {path} ({exc.strerror or exc})") from None
    return check_manifest(manifest, path)
