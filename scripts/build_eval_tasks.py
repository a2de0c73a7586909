"""Rebuild the shipped lm-evaluation-harness tasks in `src/stemlm/assets/lm_eval_tasks/` (YAMLs + jsonl data).

    python scripts/build_eval_tasks.py            # writes the folder
    python scripts/build_eval_tasks.py --check    # exit 1 if the shipped files differ from a fresh build

Everything comes from package assets (the fact world and the embedded corpus's held-out split) with fixed
seeds, so a rebuild is byte-identical and needs no network. What each task holds is described in
`stemlm.evaluation.tasks`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from stemlm.evaluation.tasks import build_task_files

OUT = Path(__file__).resolve().parents[1] / "src" / "stemlm" / "assets" / "lm_eval_tasks"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT, help=f"output folder (default: {OUT})")
    parser.add_argument("--check", action="store_true", help="compare with the files on disk instead of writing")
    args = parser.parse_args()
    files = build_task_files()
    if args.check:
        stale = [
            name
            for name, text in files.items()
            if not (args.out / name).is_file() or (args.out / name).read_text(encoding="utf-8") != text
        ]
        for name in stale:
            print(f"differs: {args.out / name}", file=sys.stderr)
        return 1 if stale else 0
    for name, text in files.items():
        path = args.out / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    print(f"wrote {len(files)} files to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
