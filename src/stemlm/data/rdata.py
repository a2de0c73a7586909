"""A small reader for R's XDR serialization format and R lazy-load databases (`.rdx` index + `.rdb` blocks).

It exists so that `scripts/build_corpus.py` can pull Jane Austen's novels out of the Debian package
`r-cran-janeaustenr` without installing R. Only what plain data objects need is covered: atomic vectors,
lists, pairlists/attributes, symbols, environments, references and the compact/wrapper ALTREP classes;
byte code, external pointers and weak references raise `StemlmError`. The format is described in R's
`src/main/serialize.c` ("R Internals", section 1.8). Usage:

    values = read_lazyload_db("janeaustenr/data/Rdata")   # {"emma": RVector([...lines...]), ...}
"""

from __future__ import annotations

import bz2
import gzip
import lzma
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stemlm.errors import StemlmError

# SEXP type codes and the pseudo-types used only inside serialized streams (serialize.c).
NILSXP, SYMSXP, LISTSXP, CLOSXP, ENVSXP, PROMSXP, LANGSXP = 0, 1, 2, 3, 4, 5, 6
CHARSXP, LGLSXP, INTSXP, REALSXP, CPLXSXP, STRSXP, DOTSXP = 9, 10, 13, 14, 15, 16, 17
VECSXP, EXPRSXP, RAWSXP, S4SXP = 19, 20, 24, 25
ALTREP_SXP, ATTRLISTSXP, ATTRLANGSXP, BASEENV_SXP, EMPTYENV_SXP = 238, 239, 240, 241, 242
PERSISTSXP, PACKAGESXP, NAMESPACESXP, BASENAMESPACE_SXP = 247, 248, 249, 250
MISSINGARG_SXP, UNBOUNDVALUE_SXP, GLOBALENV_SXP, NILVALUE_SXP, REFSXP = 251, 252, 253, 254, 255

VECTOR_TYPES = {LGLSXP: "logical", INTSXP: "integer", REALSXP: "double", CPLXSXP: "complex", STRSXP: "character"}
VECTOR_TYPES |= {VECSXP: "list", EXPRSXP: "expression", RAWSXP: "raw"}
PAIRLIST_TYPES = {LISTSXP: "pairlist", LANGSXP: "call", CLOSXP: "closure", PROMSXP: "promise", DOTSXP: "dots"}
PAIRLIST_TYPES |= {ATTRLISTSXP: "pairlist", ATTRLANGSXP: "call"}
SINGLETONS = {GLOBALENV_SXP: "R_GlobalEnv", BASEENV_SXP: "base", EMPTYENV_SXP: "R_EmptyEnv"}
SINGLETONS |= {BASENAMESPACE_SXP: "namespace:base", MISSINGARG_SXP: "missing", UNBOUNDVALUE_SXP: "unbound"}

NA_INTEGER = -(2**31)
# CHARSXP encoding bits live in the "levels" (gp) field of the flags word.
BYTES_MASK, LATIN1_MASK, UTF8_MASK, ASCII_MASK = 1 << 1, 1 << 2, 1 << 3, 1 << 6


class RVector(list):
    """An R vector or list: the elements (None for NA) plus the R type name and the attributes."""

    def __init__(self, rtype: str, items: list, attributes: dict[str, Any] | None = None) -> None:
        super().__init__(items)
        self.rtype = rtype
        self.attributes = attributes or {}

    def names(self) -> list[str] | None:
        return self.attributes.get("names")

    def as_dict(self) -> dict[str, Any]:
        """A named R list as a dict from name to element."""
        names = self.names()
        if names is None or len(names) != len(self):
            raise StemlmError(f"R {self.rtype} vector has no names, cannot be read as a dict")
        return dict(zip(names, self, strict=True))


class RSymbol(str):
    """An R symbol (a name), kept apart from character strings."""


@dataclass
class RNode:
    """A pairlist-like node (call, closure, promise) that is not a plain tagged list."""

    rtype: str
    tag: Any
    car: Any
    cdr: Any
    attributes: dict[str, Any] = field(default_factory=dict)


@dataclass
class REnvironment:
    """An R environment flattened to its bindings; `enclos` is the parent (or a singleton name)."""

    bindings: dict[str, Any] = field(default_factory=dict)
    enclos: Any = None
    attributes: dict[str, Any] = field(default_factory=dict)


@dataclass
class RPersistent:
    """A reference to an object stored outside the stream (lazy-load `references`), left unresolved."""

    key: list[str]


class _Reader:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos, self.refs = data, 0, []
        self.native_encoding = "utf-8"

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise StemlmError(f"truncated R serialization stream (wanted {n} bytes at offset {self.pos})")
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def int(self) -> int:
        return struct.unpack(">i", self.take(4))[0]

    def length(self) -> int:
        n = self.int()
        if n == -1:  # long vector: two more words, upper and lower half
            upper, lower = struct.unpack(">II", self.take(8))
            n = (upper << 32) + lower
        return n

    def header(self) -> None:
        fmt = self.take(2)
        if fmt != b"X\n":
            raise StemlmError(f"unsupported R serialization format {fmt!r}; only XDR ('X\\n') is read")
        version = self.int()
        self.take(8)  # the writer's R version and the minimal R version that can read the stream
        if version == 3:
            self.native_encoding = self.take(self.int()).decode("ascii").lower()
        elif version != 2:
            raise StemlmError(f"unsupported R serialization version {version}")

    def item(self, flags: int | None = None) -> Any:
        flags = self.int() if flags is None else flags
        sexptype, levels = flags & 0xFF, flags >> 12
        has_attr = bool(flags & (1 << 9))
        if sexptype == NILVALUE_SXP:
            return None
        if sexptype in SINGLETONS:
            return SINGLETONS[sexptype]
        if sexptype == REFSXP:
            index = (flags >> 8) or self.int()
            if not 1 <= index <= len(self.refs):
                raise StemlmError(f"R serialization stream refers to unknown object #{index}")
            return self.refs[index - 1]
        if sexptype in (PERSISTSXP, PACKAGESXP, NAMESPACESXP):
            value = RPersistent(self.string_vector())
            self.refs.append(value)
            return value
        if sexptype == SYMSXP:
            value = RSymbol(self.item() or "")
            self.refs.append(value)
            return value
        if sexptype == ENVSXP:
            return self.environment()
        if sexptype in PAIRLIST_TYPES:
            return self.pairlist(flags)
        if sexptype == ALTREP_SXP:
            return self.altrep()
        if sexptype == CHARSXP:
            return self.charsxp(levels)
        if sexptype == S4SXP:
            value = RVector("S4", [])
        elif sexptype in VECTOR_TYPES:
            value = RVector(VECTOR_TYPES[sexptype], self.vector_items(sexptype))
        else:
            raise StemlmError(f"R object type {sexptype} is not supported by this reader")
        if has_attr:
            value.attributes = self.attributes()
        return value

    def vector_items(self, sexptype: int) -> list:
        n = self.length()
        if sexptype in (LGLSXP, INTSXP):
            ints = struct.unpack(f">{n}i", self.take(4 * n))
            if sexptype == LGLSXP:
                return [None if v == NA_INTEGER else bool(v) for v in ints]
            return [None if v == NA_INTEGER else v for v in ints]
        if sexptype == REALSXP:
            return list(struct.unpack(f">{n}d", self.take(8 * n)))
        if sexptype == CPLXSXP:
            parts = struct.unpack(f">{2 * n}d", self.take(16 * n))
            return [complex(parts[i], parts[i + 1]) for i in range(0, 2 * n, 2)]
        if sexptype == RAWSXP:
            return list(self.take(n))
        return [self.item() for _ in range(n)]  # STRSXP, VECSXP, EXPRSXP

    def charsxp(self, levels: int) -> str | bytes | None:
        n = self.int()
        if n == -1:
            return None  # NA_character_
        raw = self.take(n)
        if levels & BYTES_MASK:
            return raw
        encoding = "latin-1" if levels & LATIN1_MASK else "utf-8" if levels & UTF8_MASK else None
        encoding = encoding or ("ascii" if levels & ASCII_MASK else self.native_encoding)
        try:
            return raw.decode(encoding)
        except (UnicodeDecodeError, LookupError):
            return raw.decode("latin-1")  # unflagged strings from a latin-1 locale; latin-1 never fails

    def string_vector(self) -> list[str]:
        if self.int() != 0:
            raise StemlmError("malformed persistent string vector in R serialization stream")
        return [self.item() for _ in range(self.int())]

    def attributes(self) -> dict[str, Any]:
        return _as_attributes(self.item())

    def pairlist(self, flags: int) -> Any:
        # Long pairlists are read iteratively: a LISTSXP cdr continues the same list, anything else ends it.
        entries: list[tuple[str | None, Any]] = []
        while True:
            sexptype = flags & 0xFF
            attributes = self.attributes() if flags & (1 << 9) else {}
            tag = self.item() if flags & (1 << 10) else None
            car = self.item()
            if sexptype not in (LISTSXP, ATTRLISTSXP):
                return RNode(PAIRLIST_TYPES[sexptype], tag, car, self.item(), attributes)
            entries.append((None if tag is None else str(tag), car))
            flags = self.int()
            if flags & 0xFF not in (LISTSXP, ATTRLISTSXP):
                tail = self.item(flags)
                if tail is not None:
                    entries.append((None, tail))
                return entries

    def environment(self) -> REnvironment:
        env = REnvironment()
        self.refs.append(env)  # registered before its contents, which may refer back to it
        self.int()  # locked flag
        env.enclos = self.item()
        frame, hashtab = self.item(), self.item()
        for bucket in [frame] + (list(hashtab) if isinstance(hashtab, list) else []):
            if isinstance(bucket, list):
                env.bindings.update((name, value) for name, value in bucket if name is not None)
        env.attributes = self.attributes()
        return env

    def altrep(self) -> Any:
        info, state, attributes = self.item(), self.item(), self.item()
        class_name = str(info[0][1]) if isinstance(info, list) and info else "?"
        if class_name in ("compact_intseq", "compact_realseq"):
            n, start, step = state[0], state[1], state[2]
            cast = int if class_name == "compact_intseq" else float
            value = RVector("integer" if cast is int else "double", [cast(start + i * step) for i in range(int(n))])
        elif class_name.startswith("wrap_"):
            value = state[0]  # state is list(wrapped vector, metadata)
        else:
            raise StemlmError(f"R ALTREP class {class_name!r} is not supported by this reader")
        if isinstance(value, RVector):
            value.attributes = _as_attributes(attributes) or value.attributes
        return value


def _as_attributes(pairs: Any) -> dict[str, Any]:
    return dict(pairs) if isinstance(pairs, list) else {}


def unserialize(data: bytes) -> Any:
    """Decode one R object from an uncompressed XDR serialization stream (as written by `serialize()`)."""
    reader = _Reader(data)
    reader.header()
    return reader.item()


def decompress_file(data: bytes) -> bytes:
    """Undo the whole-file compression `saveRDS` may apply (gzip, bzip2, xz, or none), detected by magic."""
    if data[:2] == b"\x1f\x8b":
        return gzip.decompress(data)
    if data[:3] == b"BZh":
        return bz2.decompress(data)
    if data[:6] == b"\xfd7zXZ\x00":
        return lzma.decompress(data)
    return data


def decompress_block(block: bytes, compression: int = 1) -> bytes:
    """Decode one lazy-load `.rdb` block: a 4-byte big-endian uncompressed length, then the payload.

    `compression` is the index's `compressed` entry: 1 (TRUE) means zlib follows directly; 2 (bzip2) and
    3 (xz) put a type byte first, where '0' marks a block R stored uncompressed because it did not shrink.
    """
    expected = struct.unpack(">I", block[:4])[0]
    kind, payload = block[4:5], block[5:]
    if compression == 1:
        out = zlib.decompress(block[4:])
    elif kind == b"0":
        out = payload
    elif kind == b"2":
        out = bz2.decompress(payload)
    elif kind == b"Z":  # a raw LZMA2 stream; preset 9 gives a dictionary at least as large as R's encoder used
        out = lzma.decompress(payload, format=lzma.FORMAT_RAW, filters=[{"id": lzma.FILTER_LZMA2, "preset": 9}])
    else:
        raise StemlmError(f"unknown R lazy-load block type {kind!r} (compression {compression})")
    if len(out) != expected:
        raise StemlmError(f"R lazy-load block decompressed to {len(out)} bytes, header says {expected}")
    return out


def read_lazyload_db(base: str | Path) -> dict[str, Any]:
    """Read every variable of an R lazy-load database given its path without suffix (`.../data/Rdata`)."""
    base = Path(base)
    rdx, rdb = base.with_name(base.name + ".rdx"), base.with_name(base.name + ".rdb")
    for path in (rdx, rdb):
        if not path.is_file():
            raise StemlmError(f"R lazy-load database file not found: {path}")
    index = unserialize(decompress_file(rdx.read_bytes())).as_dict()
    compression = int(index.get("compressed", [1])[0])
    blob = rdb.read_bytes()
    values = {}
    for name, (offset, length) in index["variables"].as_dict().items():
        block = blob[int(offset) : int(offset) + int(length)]
        values[name] = unserialize(decompress_block(block, compression))
    return values
