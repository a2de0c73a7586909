"""Behaviour fingerprint: what a refactoring must keep bitwise, written down before and compared after.

    .venv/bin/python scripts/fingerprint.py --out before.json              # on the old code
    .venv/bin/python scripts/fingerprint.py --compare before.json          # on the new: lists every difference
    .venv/bin/python scripts/fingerprint.py --only 'stem/*' --out x.json   # a subset (fnmatch on case names)

Each case runs the `stemlm` command line (the surface users script against, so it outlives any internal API) on
one thread, a few steps on a small slice of the embedded corpus, and records:
- train: the per-step losses, the sha256 of every weight and of every optimizer tensor of the final checkpoint;
- decode: the tokens of `stemlm generate`, greedy and seeded sampling, with resident, host and mmap tables;
- edit: the probabilities `stemlm edit` prints before and after a positional row swap.
The matrix: every kind with resident tables (and host tables where the kind has token tables), `--recipe
official`, a resumed run, and `--nproc 2` under DDP and FSDP2 (gloo), with and without host tables. One thread
everywhere: the thread count changes how reductions round, so a comparison is only bitwise at a fixed count.
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STEMLM = [sys.executable, "-m", "stemlm.cli.main"]
SMALL = [
    "--steps",
    "12",
    "--lr",
    "0.006",
    "--batch-size",
    "4",
    "--seq-len",
    "64",
    "--eval-every",
    "0",
    "--eval-batches",
    "1",
    "--sample-tokens",
    "0",
    "--no-progress",
    "--json",
    "--threads",
    "1",
]
PROMPT = "The capital of Spain is"
TOKEN_KINDS = {"stem", "stem_gate", "ple", "stem_ngram", "stem_adapter", "value_embed"}  # checked against the model


def run(cmd: list[str], cwd: Path) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


def tensor_digests(folder: Path) -> dict[str, str]:
    """name -> sha256 of dtype, shape and bytes, for every tensor of every safetensors file under `folder`."""
    from safetensors import safe_open

    digests = {}
    for path in sorted(folder.rglob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in sorted(f.keys()):
                t = f.get_tensor(name).contiguous()
                h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
                h.update(t.view(-1).view(dtype=__import__("torch").uint8).numpy().tobytes() if t.numel() else b"")
                digests[f"{path.relative_to(folder)}:{name}"] = h.hexdigest()[:16]
    return digests


def losses(run_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["loss"] for r in records if "loss" in r and "step" in r]


def train_case(tmp: Path, name: str, data: Path, extra: list[str], resume: bool = False) -> dict:
    out = tmp / name.replace("/", "_")
    run([*STEMLM, "train", "--data", str(data), *SMALL, "--out", str(out), *extra], tmp)
    if resume:  # four more steps from the checkpoint
        run(
            [
                *STEMLM,
                "train",
                "--resume",
                str(out),
                "--steps",
                "16",
                "--no-progress",
                "--json",
                "--threads",
                "1",
                "--sample-tokens",
                "0",
            ],
            tmp,
        )
    exported = tmp / f"{out.name}-export"
    run([*STEMLM, "export", str(out), "--out", str(exported)], tmp)
    latest = json.loads((out / "checkpoints" / "latest.json").read_text())
    ckpt = out / "checkpoints" / Path(latest.get("checkpoint", latest.get("latest", ""))).name
    optimizer = {k: v for k, v in tensor_digests(ckpt).items() if "optimizer" in k}
    # A sharded (--nproc) checkpoint is decoded from its export; a one-process run from the run folder itself.
    decoded = exported if "--nproc" in extra else out
    return {"losses": losses(out), "weights": tensor_digests(exported), "optimizer": optimizer, "_run": str(decoded)}


def decode_case(tmp: Path, run_dir: str, tables: str) -> dict[str, list[int]]:
    """Greedy tokens, and tokens sampled with a seed (a model this short-trained often repeats one token
    greedily; sampling also covers the seeded generator, temperature, top-k and top-p)."""
    found = {}
    for mode, flags in (("greedy", ["--greedy"]), ("sampled", ["--seed", "3", "--temperature", "1.2"])):
        printed = run(
            [
                *STEMLM,
                "generate",
                run_dir,
                PROMPT,
                *flags,
                "--max-new-tokens",
                "12",
                "--ignore-eos",
                "--tables",
                tables,
                "--json",
            ],
            tmp,
        )
        found[mode] = json.loads(printed)["token_ids"]
    return found


def edit_case(tmp: Path, run_dir: str) -> dict:
    return json.loads(
        run([*STEMLM, "edit", run_dir, "--prompt", PROMPT, "--source", "Spain", "--target", "Germany", "--json"], tmp)
    )


def kinds() -> list[str]:
    from stemlm.model.kinds.registry import kind_names

    return list(kind_names())


def cases() -> list[tuple[str, dict]]:
    """(name, spec): spec has the train flags, and which decodes / edits to run on the result."""
    found = []
    for kind in kinds():
        found.append((f"{kind}/resident", {"train": ["--ffn", kind], "decode": ["resident"]}))
    for kind in sorted(TOKEN_KINDS & set(kinds())):
        found.append((f"{kind}/host", {"train": ["--ffn", kind, "--tables", "host"], "decode": ["host", "mmap"]}))
    found += [
        ("stem/official", {"train": ["--recipe", "official"], "decode": []}),
        ("stem/resume", {"train": [], "resume": True, "decode": []}),
        ("stem/edit", {"train": [], "decode": [], "edit": True}),
        ("stem/ddp2", {"train": ["--nproc", "2", "--parallel", "ddp"], "decode": ["host"]}),
        ("stem/fsdp2", {"train": ["--nproc", "2", "--parallel", "fsdp"], "decode": []}),
        ("stem/ddp2-host", {"train": ["--nproc", "2", "--tables", "host"], "decode": []}),
        ("dense/fsdp2", {"train": ["--ffn", "dense", "--nproc", "2", "--parallel", "fsdp"], "decode": []}),
    ]
    return found


def corpus(tmp: Path) -> Path:
    from stemlm.data import load_embedded_corpus

    text = load_embedded_corpus()[0].text[:400_000]
    path = tmp / "corpus.txt"
    path.write_text(text)
    return path


def fingerprint(only: str | None) -> dict:
    results = {}
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        data = corpus(tmp)
        for case, spec in cases():
            if only and not fnmatch.fnmatch(case, only):
                continue
            print(f"fingerprint: {case}", file=sys.stderr, flush=True)
            try:
                result = train_case(tmp, case, data, spec["train"], spec.get("resume", False))
                run_dir = result.pop("_run")
                for tables in spec["decode"]:
                    result[f"decode_{tables}"] = decode_case(tmp, run_dir, tables)
                if spec.get("edit"):
                    result["edit"] = edit_case(tmp, run_dir)
            except Exception as error:  # recorded, so one broken case does not hide the others
                result = {"error": " | ".join(str(error).splitlines()[-3:])[:800]}
            results[case] = result
    return results


def compare(before: dict, after: dict) -> list[str]:
    lines = []
    for case in sorted(set(before) | set(after)):
        if case not in after or case not in before:
            lines.append(f"{case}: only in {'before' if case in before else 'after'}")
            continue
        b, a = before[case], after[case]
        for key in sorted(set(b) | set(a)):
            if b.get(key) == a.get(key):
                continue
            if isinstance(b.get(key), dict) and isinstance(a.get(key), dict):
                changed = sorted(k for k in set(b[key]) | set(a[key]) if b[key].get(k) != a[key].get(k))
                lines.append(f"{case}: {key} differ in {len(changed)} of {len(b[key])}: {changed[:4]}")
            else:
                lines.append(f"{case}: {key}: before {str(b.get(key))[:200]!s} | after {str(a.get(key))[:200]!s}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the fingerprint here (JSON)")
    parser.add_argument("--compare", type=Path, help="a fingerprint written before; print every difference")
    parser.add_argument("--only", help="fnmatch pattern over case names, e.g. 'stem/*'")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    results = fingerprint(args.only)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1, sort_keys=True))
    errors = [case for case, r in results.items() if "error" in r]
    for case in errors:
        print(f"{case}: ERROR {results[case]['error']}")
    if args.compare:
        before = json.loads(args.compare.read_text())
        if args.only:
            before = {k: v for k, v in before.items() if fnmatch.fnmatch(k, args.only)}
        diffs = compare(before, results)
        print("\n".join(diffs) if diffs else f"fingerprint: {len(results)} cases bitwise unchanged")
        return 1 if diffs else 0
    print(f"fingerprint: {len(results)} cases, {len(errors)} errors")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
