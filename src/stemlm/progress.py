"""The one rule every progress bar follows: drawn on stderr only when asked for and stderr is a terminal.

`--no-progress` turns a bar off, and so does a stderr that is not a terminal (a log file, a pipe, CI, a test's
capture), where a bar's carriage-return redraws are noise and output compared byte for byte must not change.
A process whose stderr another relays to a terminal (the ranks of `train --nproc N`, through `stemlm.train.parallel.
workers.run_torchrun`) is told so by `RELAYED_TERMINAL` in its environment.
`shown(progress)` is that rule, `bar(...)` a tqdm on stderr that follows it and `write(text)` a line printed
between a bar's redraws: the bars of `train`, `data prepare`,
`eval ppl|lm|niah`, `analyze`, `cache-sim`, `convert` and `experiment` are all drawn through them.
"""

from __future__ import annotations

import os
import sys

RELAYED_TERMINAL = "STEMLM_STDERR_RELAYED_TO_TERMINAL"  # "1": this stderr is a pipe a parent copies to a terminal


def shown(progress: bool = True) -> bool:
    """Whether a bar asked for (`progress`) is drawn: only when stderr is a terminal (or relayed to one)."""
    if os.environ.get(RELAYED_TERMINAL) == "1":
        return bool(progress)
    isatty = getattr(sys.stderr, "isatty", None)  # stderr may be None (pythonw) or a stream without isatty
    return bool(progress) and isatty is not None and isatty()


def write(text: str) -> None:
    """A line on stderr that leaves a drawn bar whole (the bar is cleared, the line printed, the bar redrawn)."""
    from tqdm import tqdm

    tqdm.write(text, file=sys.stderr)


def bar(total=None, *, progress: bool = True, **tqdm_options):
    """A tqdm bar on stderr, disabled unless `shown(progress)`. `total`: the count of steps, or a sized iterable
    to wrap (the bar then advances as it is iterated); `tqdm_options` (desc, unit, ...) go to tqdm."""
    from tqdm import tqdm  # imported here: `import stemlm` stays cheap

    if total is not None and not isinstance(total, int):
        return tqdm(total, file=sys.stderr, disable=not shown(progress), **tqdm_options)
    return tqdm(total=total, file=sys.stderr, disable=not shown(progress), **tqdm_options)
