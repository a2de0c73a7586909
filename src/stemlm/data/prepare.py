"""`prepare`: tokenize a user corpus once, in parallel, into memory-mapped token shards plus a manifest.

    stemlm data prepare corpus/ extra.jsonl web.parquet --tokenizer gpt2 --out shards/ --workers 8

Inputs are files or folders (searched recursively for *.txt, *.md, *.jsonl and *.parquet, hidden entries
skipped, sorted; a file named twice is read once, with a warning): a text or markdown file is one document, a
JSON Lines file one document per line (the `text_field` of each object), a parquet file one document per row
of its `text_field` column (read in record batches with pyarrow); `stemlm.data.inputs` reads them. Each file
is one task for a pool of worker processes (spawned, so tokenizers' own threads are never forked); a worker
streams its file, puts the separator token after every document and appends the ids to its own part file, so
memory stays bounded by one record batch. A worker dies with the process that started it (on Linux the
kernel kills it, `PR_SET_PDEATHSIG`), so a killed `prepare` leaves no worker tokenizing on. A document goes to the
held-out split when the hash of its text falls below `heldout_fraction`: the split depends on the text alone,
never on file order or worker count, and duplicate documents never straddle the split.

The output folder holds `train-NNNNN.<dtype>.bin` / `heldout-NNNNN.<dtype>.bin` shards (raw uint16 ids when
the vocabulary fits, else uint32; consecutive files joined up to `shard_tokens` each), a copy of the tokenizer
and `manifest.json`: format, tokenizer digest and size, separator, dtype, per-shard tokens / documents /
sha256, per-source path / sha256 / bytes / documents, totals. The output is identical for any worker count.
It is built in a temporary sibling folder `.OUT.tmp-PID` (holding a `.stemlm-prepare` marker) and renamed into
place; an existing `out` is never overwritten. A later `prepare` to the same `out` removes the temporary
folders a killed run left (only marked ones whose process is gone). Bad input raises one `StemlmError` naming
the file (and line or row where it has one); so does an `out` that cannot be created or written.
`stemlm.data.stream` reads the result.
`prepare_summary` / `render_prepare_summary` are what `stemlm data prepare` prints.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import sys
import warnings
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from stemlm.data.inputs import documents, find_files
from stemlm.data.tokenizer import EOT_TOKEN, TOKENIZER_FILE, separator_id
from stemlm.errors import StemlmError

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "stemlm-prepared-v1"
SPLITS = ("train", "heldout")
ENCODE_CHUNK = 256  # documents per encode_batch call
HASH_CHUNK = 1 << 20
SHARD_TOKENS = 1 << 28  # input files are joined into shards of about this many tokens (512 MiB as uint16)
TMP_MARKER = ".stemlm-prepare"  # inside a temporary output folder: the pid that writes it
PR_SET_PDEATHSIG = 1  # prctl option (linux/prctl.h): the signal a process gets when its parent dies


@dataclass(frozen=True)
class Task:
    """One input file for one worker: everything it needs, picklable."""

    index: int
    path: str
    separator: str
    text_field: str
    heldout_fraction: float
    dtype: str
    work_dir: str


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def is_heldout(text: str, fraction: float) -> bool:
    """The split of a document, from its text alone (the first 8 bytes of its sha256 as a uniform draw)."""
    if fraction <= 0:
        return False
    draw = int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "little") / 2.0**64
    return draw < fraction


_WORKER: dict[str, Tokenizer] = {}  # the tokenizer of this worker process, parsed once by init_worker


def die_with_parent(parent_pid: int) -> None:
    """Have the kernel SIGKILL this worker when `parent_pid` (the process that spawned it) dies (Linux only)."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect: nobody would read the results
        os._exit(1)


def init_worker(tokenizer_json: str, single_threaded: bool, parent_pid: int | None = None) -> None:
    if parent_pid is not None:
        die_with_parent(parent_pid)
    if single_threaded:  # N worker processes already use the cores: no rayon thread pool in each
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _WORKER["tokenizer"] = Tokenizer.from_str(tokenizer_json)


def tokenize_file(task: Task) -> dict[str, Any]:
    """Tokenize one file into `work_dir/<index>.<split>.bin`; returns its source and per-split counts."""
    tok = _WORKER["tokenizer"]
    sep, dtype, path = separator_id(tok, task.separator), np.dtype(task.dtype), Path(task.path)
    encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
    outs = {s: open(Path(task.work_dir) / f"{task.index:05d}.{s}.bin", "wb") for s in SPLITS}
    stats = {s: {"tokens": 0, "documents": 0, "sha": hashlib.sha256()} for s in SPLITS}
    pending: dict[str, list[str]] = {s: [] for s in SPLITS}

    def flush(split: str) -> None:
        for enc in encode(pending[split], add_special_tokens=False):
            data = np.asarray([*enc.ids, sep], dtype=dtype).tobytes()
            outs[split].write(data)
            stats[split]["sha"].update(data)
            stats[split]["tokens"] += len(enc.ids) + 1
        stats[split]["documents"] += len(pending[split])
        pending[split].clear()

    try:
        for text in documents(path, task.text_field):
            split = "heldout" if is_heldout(text, task.heldout_fraction) else "train"
            pending[split].append(text)
            if len(pending[split]) >= ENCODE_CHUNK:
                flush(split)
        for split in SPLITS:
            flush(split)
    finally:
        for f in outs.values():
            f.close()
    return {
        "index": task.index,
        "source": {"path": str(path), "sha256": file_sha256(path), "bytes": path.stat().st_size},
        "splits": {s: {"tokens": v["tokens"], "documents": v["documents"], "sha256": v["sha"].hexdigest()}
                   for s, v in stats.items()},
    }  # fmt: skip


# ----- the whole run (in the main process) -----
def prepare(
    paths: list[str | Path],
    tokenizer: Tokenizer,
    out: str | Path,
    *,
    workers: int = 1,
    separator: str = EOT_TOKEN,
    text_field: str = "text",
    heldout_fraction: float = 0.0,
    shard_tokens: int = SHARD_TOKENS,
    progress: bool = True,
    warn: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Tokenize `paths` into the shard folder `out` (which must not exist); returns the manifest. `warn` gets
    each warning line (an input given twice), else they are Python warnings."""
    out = Path(out)
    if out.exists():
        raise StemlmError(f"{out} already exists; choose another --out or delete it first")
    if workers < 1:
        raise StemlmError(f"workers must be at least 1, got {workers}")
    if not 0.0 <= heldout_fraction < 1.0:
        raise StemlmError(f"heldout fraction must lie in [0, 1), got {heldout_fraction}")
    separator_id(tokenizer, separator)  # fail before any work when the separator is unknown
    files = find_files(paths, warn or (lambda message: warnings.warn(message, stacklevel=3)))
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    dtype = np.dtype(np.uint16 if vocab <= 2**16 else np.uint32)
    tmp = _make_tmp(out)
    try:
        tasks = [
            Task(i, str(p), separator, text_field, heldout_fraction, dtype.name, str(tmp)) for i, p in enumerate(files)
        ]
        results = _run_tasks(tasks, tokenizer.to_str(), workers, progress)
        manifest = _assemble(tmp, results, tokenizer, separator, dtype, shard_tokens)
        (tmp / TMP_MARKER).unlink()  # the finished folder holds only what the manifest describes
        tmp.replace(out)
    except OSError as exc:  # never the raw errno text, which names the temporary folder
        name = Path(exc.filename) if exc.filename else None
        if name is not None and tmp not in name.parents and name != tmp:
            raise StemlmError(f"cannot read {name} ({exc.strerror or exc})") from None
        raise StemlmError(f"cannot write {out} ({exc.strerror or exc})") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return manifest


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        pass
    return True


def remove_stale_tmp(out: Path) -> None:
    """Remove the temporary folders of `out` that killed `prepare` runs left: marked ones whose pid is gone."""
    for path in out.parent.glob(f".{glob.escape(out.name)}.tmp-*"):
        pid = path.name.rsplit("-", 1)[1]
        if path.is_symlink() or not (path / TMP_MARKER).is_file() or not pid.isdigit():
            continue  # not one of ours
        if int(pid) == os.getpid() or not _alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def _make_tmp(out: Path) -> Path:
    """A fresh marked temporary folder beside `out` (the parents of `out` are created)."""
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_tmp(out)
        tmp.mkdir()
        (tmp / TMP_MARKER).write_text(f"{os.getpid()}\n")
    except OSError as exc:
        raise StemlmError(f"cannot create {out} ({exc.strerror or exc})") from None
    return tmp


def _run_tasks(tasks: list[Task], tokenizer_json: str, workers: int, progress: bool) -> list[dict[str, Any]]:
    from stemlm.progress import bar as progress_bar

    bar = progress_bar(len(tasks), progress=progress, unit="file", desc="tokenizing", dynamic_ncols=True)
    results, tokens = [], 0
    try:
        pool = None
        if workers == 1 or len(tasks) == 1:
            init_worker(tokenizer_json, single_threaded=False)
            stream = map(tokenize_file, tasks)
        else:
            pool = ProcessPoolExecutor(
                max_workers=min(workers, len(tasks)),
                mp_context=get_context("spawn"),
                initializer=init_worker,
                initargs=(tokenizer_json, True, os.getpid()),
            )
            stream = pool.map(tokenize_file, tasks)  # results in input order: the output never depends on timing
        for result in stream:
            results.append(result)
            tokens += sum(s["tokens"] for s in result["splits"].values())
            bar.set_postfix(tokens=f"{tokens:,}", refresh=False)
            bar.update()
    finally:
        bar.close()
        if pool is not None:
            pool.shutdown(cancel_futures=True)
    return results


def _merge_parts(
    tmp: Path, split: str, parts: list[tuple[Path, dict]], shard_tokens: int, dtype: np.dtype
) -> list[dict[str, Any]]:
    """Consecutive per-file parts joined into shards of about `shard_tokens` (few memory maps however many
    files); a part that fills a shard alone is renamed, the others are copied once while hashing."""
    groups: list[list[tuple[Path, dict]]] = []
    for part in parts:
        if not groups or sum(info["tokens"] for _, info in groups[-1]) >= shard_tokens:
            groups.append([])
        groups[-1].append(part)
    shards = []
    for k, group in enumerate(groups):
        name = f"{split}-{k:05d}.{dtype.name}.bin"
        if len(group) == 1:
            group[0][0].rename(tmp / name)
            sha = group[0][1]["sha256"]
        else:
            h = hashlib.sha256()
            with open(tmp / name, "wb") as out:
                for part, _ in group:
                    with open(part, "rb") as f:
                        while chunk := f.read(HASH_CHUNK):
                            h.update(chunk)
                            out.write(chunk)
                    part.unlink()
            sha = h.hexdigest()
        tokens, documents = (sum(info[key] for _, info in group) for key in ("tokens", "documents"))
        shards.append({"file": name, "tokens": tokens, "documents": documents, "sha256": sha})
    return shards


def _assemble(
    tmp: Path, results: list[dict], tokenizer: Tokenizer, separator: str, dtype: np.dtype, shard_tokens: int
) -> dict:
    from stemlm.data.tokenizer import tokenizer_digest

    shards: dict[str, list[dict]] = {}
    for split in SPLITS:
        parts = []
        for result in results:
            part, info = tmp / f"{result['index']:05d}.{split}.bin", result["splits"][split]
            if info["tokens"]:
                parts.append((part, info))
            else:
                part.unlink()
        shards[split] = _merge_parts(tmp, split, parts, shard_tokens, dtype)
    if not shards["train"]:
        raise StemlmError("the inputs hold no training documents (every file empty, or all held out)")
    tokenizer.save(str(tmp / TOKENIZER_FILE))
    manifest = {
        "format": MANIFEST_FORMAT,
        "tokenizer": {
            "file": TOKENIZER_FILE,
            "sha256_16": tokenizer_digest(tokenizer),
            "vocab_size": tokenizer.get_vocab_size(),
        },
        "separator": {"token": separator, "id": separator_id(tokenizer, separator)},
        "dtype": dtype.name,
        "splits": {
            s: {
                "tokens": sum(x["tokens"] for x in shards[s]),
                "documents": sum(x["documents"] for x in shards[s]),
                "shards": shards[s],
            }
            for s in SPLITS
        },
        "sources": [{**r["source"], "documents": sum(v["documents"] for v in r["splits"].values())} for r in results],
    }
    with open(tmp / MANIFEST_NAME, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    return manifest


def prepare_summary(manifest: dict[str, Any], out: str, seconds: float) -> dict[str, Any]:
    """What `stemlm data prepare --json` prints for a written folder's manifest."""
    splits = manifest["splits"]
    return {
        "out": out,
        "files": len(manifest["sources"]),
        "train": {k: splits["train"][k] for k in ("documents", "tokens")},
        "heldout": {k: splits["heldout"][k] for k in ("documents", "tokens")},
        "dtype": manifest["dtype"],
        "tokenizer": manifest["tokenizer"],
        "seconds": round(seconds, 2),
    }


def render_prepare_summary(r: dict[str, Any], seconds: float) -> str:
    """The line `stemlm data prepare` prints: files, documents and tokens per split, tokens per second."""
    train, held = r["train"], r["heldout"]
    return (
        f"{r['out']}: {r['files']} files, {train['documents']:,} + {held['documents']:,} documents "
        f"(train + held-out), {train['tokens']:,} + {held['tokens']:,} tokens ({r['dtype']}), "
        f"{(train['tokens'] + held['tokens']) / max(seconds, 1e-9):,.0f} tokens/s"
    )
