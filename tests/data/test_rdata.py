"""The R serialization reader on hand-built XDR streams and a tiny hand-built lazy-load database."""

import bz2
import gzip
import lzma
import struct
import zlib

import pytest

from stemlm.data.rdata import (
    RSymbol,
    decompress_block,
    read_lazyload_db,
    unserialize,
)
from stemlm.errors import StemlmError

HAS_ATTR, HAS_TAG = 1 << 9, 1 << 10
UTF8, LATIN1, ASCII = 1 << 3, 1 << 2, 1 << 6


def i32(*values: int) -> bytes:
    return struct.pack(f">{len(values)}i", *values)


def header(version: int = 3) -> bytes:
    extra = i32(5) + b"UTF-8" if version == 3 else b""
    return b"X\n" + i32(version, 0x040201, 0x030500) + extra


def charsxp(text: str | None, encoding: int = UTF8, codec: str = "utf-8") -> bytes:
    if text is None:
        return i32(9, -1)
    raw = text.encode(codec)
    return i32(9 | (encoding << 12), len(raw)) + raw


def strsxp(*items: str | None, flags: int = 0) -> bytes:
    return i32(16 | flags, len(items)) + b"".join(charsxp(s) for s in items)


def symbol(name: str) -> bytes:
    return i32(1) + charsxp(name, ASCII)


def names_attr(*names: str) -> bytes:
    # A one-element attribute pairlist: tag = the symbol `names`, value = a character vector, then NULL.
    return i32(2 | HAS_TAG) + symbol("names") + strsxp(*names) + i32(254)


def named_list(items: dict[str, bytes]) -> bytes:
    return i32(19 | HAS_ATTR, len(items)) + b"".join(items.values()) + names_attr(*items)


def test_character_vector_with_na_and_encodings():
    stream = header() + i32(16, 4) + charsxp("plain", ASCII) + charsxp("caf\u00e9") + charsxp(None)
    stream += charsxp("\u00a3", LATIN1, "latin-1")
    value = unserialize(stream)
    assert value.rtype == "character"
    assert list(value) == ["plain", "caf\u00e9", None, "\u00a3"]


def test_integer_double_logical_vectors_version2():
    assert list(unserialize(header(2) + i32(13, 3, 1, -(2**31), 7))) == [1, None, 7]
    assert list(unserialize(header(2) + i32(14, 2) + struct.pack(">2d", 0.5, -2.0))) == [0.5, -2.0]
    assert list(unserialize(header(2) + i32(10, 2, 1, 0))) == [True, False]


def test_named_list_and_symbol_reference():
    inner = named_list({"x": i32(13, 1, 42)})
    # The second `names` symbol is written as a back-reference (REFSXP, index 1 in the flags word).
    outer = i32(19 | HAS_ATTR, 2) + inner + strsxp("a") + i32(2 | HAS_TAG) + i32((1 << 8) | 255)
    outer += strsxp("first", "second") + i32(254)
    value = unserialize(header() + outer)
    assert value.names() == ["first", "second"]
    assert value.as_dict()["first"].as_dict() == {"x": [42]}
    assert list(value.as_dict()["second"]) == ["a"]


def test_symbol_and_null():
    assert unserialize(header() + symbol("emma")) == RSymbol("emma")
    assert unserialize(header() + i32(254)) is None


def test_truncated_and_foreign_streams_raise():
    with pytest.raises(StemlmError, match="truncated"):
        unserialize(header() + i32(16, 3) + charsxp("only one"))
    with pytest.raises(StemlmError, match="XDR"):
        unserialize(b"A\n" + i32(3))


@pytest.mark.parametrize("compression", [1, 2, 3])
def test_lazyload_db_round_trip(tmp_path, compression):
    values = {"emma": header() + strsxp("EMMA", "", "By Jane Austen"), "n": header() + i32(13, 1, 5)}
    blob, offsets = b"", {}
    for name, data in values.items():
        if compression == 1:
            payload = zlib.compress(data)
        elif compression == 2:
            payload = b"2" + bz2.compress(data)
        else:
            payload = b"Z" + lzma.compress(data, format=lzma.FORMAT_RAW, filters=[{"id": lzma.FILTER_LZMA2}])
        block = struct.pack(">I", len(data)) + payload
        offsets[name] = i32(13, 2, len(blob), len(block))
        blob += block
    flag = i32(10, 1, 1) if compression == 1 else i32(13, 1, compression)
    index = header() + named_list({"variables": named_list(offsets), "references": i32(254), "compressed": flag})
    (tmp_path / "Rdata.rdx").write_bytes(gzip.compress(index))
    (tmp_path / "Rdata.rdb").write_bytes(blob)
    db = read_lazyload_db(tmp_path / "Rdata")
    assert list(db["emma"]) == ["EMMA", "", "By Jane Austen"]
    assert list(db["n"]) == [5]


def test_stored_block_and_length_check():
    data = header() + i32(254)
    assert decompress_block(struct.pack(">I", len(data)) + b"0" + data, compression=2) == data
    with pytest.raises(StemlmError, match="header says"):
        decompress_block(struct.pack(">I", len(data) + 1) + zlib.compress(data))


def test_missing_database(tmp_path):
    with pytest.raises(StemlmError, match="not found"):
        read_lazyload_db(tmp_path / "Rdata")
