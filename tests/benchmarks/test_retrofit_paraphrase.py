"""benchmarks/retrofit_paraphrase.py on a random dense checkpoint: it knows no capital, so `--all-countries` makes
every edit of the twelve countries; the RESULT line counts them, and `scan` prints one line per capital template."""

from __future__ import annotations

import re

from stemlm.data.worlds.facts import TEMPLATES
from tests.benchmarks.harness import result_fields, run_benchmark


def test_every_pair_is_edited_and_counted(dense_checkpoint):
    out = run_benchmark(
        "retrofit_paraphrase.py", "0:embed", "--ckpt", dense_checkpoint, "--threads", "1", "--all-countries"
    )
    edits = re.findall(r"^  0:embed (.+)->(.+): ", out, re.M)
    assert len(edits) == 12 and edits[0] == ("Australia", "China") and edits[-1] == ("Syria", "Australia")
    fields = result_fields(out)
    assert fields["config"] == "0:embed" and fields["pairs"] == "12"
    assert 0 <= int(fields["moved"]) <= 12 and 0 <= int(fields["known"]) <= 12


def test_scan_reports_every_capital_template(dense_checkpoint):
    out = run_benchmark("retrofit_paraphrase.py", "scan", "--ckpt", dense_checkpoint, "--threads", "1")
    templates = [t for split in TEMPLATES["capital"] for t in split]
    counts = re.findall(r"""^(['"])(.+)\1: (\d+):""", out, re.M)
    assert [t for _, t, _ in counts] == templates
    assert all(0 <= int(n) <= 248 for _, _, n in counts)
