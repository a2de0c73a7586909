"""Run outputs for humans and tools: metrics.jsonl, TensorBoard events, a tqdm bar and the loss-curve PNG.

`RunLogger` writes one JSON object per training step (`"kind": "train"`) and per evaluation (`"kind": "eval"`)
to RUN/metrics.jsonl and the same numbers to TensorBoard (RUN/tensorboard, tags `train/*`, `eval/*`); the
progress bar and the one-line evaluation summaries go to stderr. On resume from step k, records after k
(written by the interrupted run past its last checkpoint) are dropped from metrics.jsonl and purged from
TensorBoard, so both read as one uninterrupted run. `plot_losses` draws RUN/loss.png from metrics.jsonl.
Non-finite numbers are written as null: metrics.jsonl stays strict JSON. Neither file is written through a
symlink (`stemlm.paths.refuse_symlink`).

The bar reads `40%|████      | 80/200 steps [01:02, ETA 01:33, loss 5.1234, 3,150 tok/s]`: the ETA is
tqdm's (wall time per step, evaluations and saves included), the throughput that of the last `SPEED_STEPS`
steps (one step's figure jumps with the machine's load; metrics.jsonl keeps every step's).
"""

from __future__ import annotations

import json
import math
import sys
from collections import deque
from pathlib import Path
from typing import Any

from tqdm import tqdm

from stemlm.errors import StemlmError
from stemlm.paths import refuse_symlink
from stemlm.progress import shown

METRICS_NAME = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
PLOT_NAME = "loss.png"
SPEED_STEPS = 20  # trailing steps whose tokens/s the progress bar shows
BAR_FORMAT = "{l_bar}{bar}| {n_fmt}/{total_fmt} steps [{elapsed}, ETA {remaining}{postfix}]"


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Every record of a metrics.jsonl (an incomplete last line, from a crash mid-write, is ignored)."""
    records = []
    path = Path(path)
    if not path.is_file():
        return records
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


class RunLogger:
    """metrics.jsonl + TensorBoard + tqdm for one run, resumable at `start_step`."""

    def __init__(self, run_dir: Path, start_step: int, total_steps: int, progress: bool = True) -> None:
        self.path = refuse_symlink(run_dir / METRICS_NAME, "run folder entry")  # never rewrite a link's target
        self.progress = shown(progress)  # off on a non-terminal stderr too (stemlm.progress)
        try:
            kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= start_step]
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
            self.file = open(self.path, "a")
        except OSError as exc:
            raise StemlmError(f"could not write {self.path}: {exc.strerror or exc}") from None
        from torch.utils.tensorboard import SummaryWriter  # imported here: tensorboard is slow to import

        self.tb = SummaryWriter(str(run_dir / TENSORBOARD_DIR), purge_step=start_step + 1 if start_step else None)
        self.bar = tqdm(
            total=total_steps,
            initial=start_step,
            file=sys.stderr,
            disable=not self.progress,
            dynamic_ncols=True,
            unit="step",
            bar_format=BAR_FORMAT,
        )
        self.rates: deque[float] = deque(maxlen=SPEED_STEPS)

    def log(self, record: dict[str, Any]) -> None:
        clean = {k: _clean(v) for k, v in record.items()}
        try:
            self.file.write(json.dumps(clean) + "\n")
            self.file.flush()
        except OSError as exc:
            raise StemlmError(f"could not write {self.path}: {exc.strerror or exc}") from None
        kind, step = record["kind"], record["step"]
        for key, value in clean.items():
            if key not in ("kind", "step") and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.tb.add_scalar(f"{kind}/{key}", value, step)

    def advance(self, loss: float, tokens_per_s: float) -> None:
        self.rates.append(tokens_per_s)
        # Every step trains the same number of tokens, so the window's tokens / seconds is the harmonic mean.
        window = len(self.rates) / sum(1 / r for r in self.rates)
        self.bar.set_postfix_str(f"loss {loss:.4f}, {window:,.0f} tok/s", refresh=False)
        self.bar.update(1)

    def message(self, text: str) -> None:
        if self.progress:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def close(self) -> None:
        self.bar.close()
        self.tb.close()
        self.file.close()


SMOOTH_STEPS = 20  # trailing window of the smoothed train curve in loss.png


class QuietLogger:
    """The logger of the ranks other than 0 of a multi-process run: they train silently."""

    def log(self, record: dict[str, Any]) -> None:
        pass

    def advance(self, loss: float, tokens_per_s: float) -> None:
        pass

    def message(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


def smoothed(values, window: int = SMOOTH_STEPS) -> list[float]:
    """Trailing mean over up to `window` values (the first points average what exists so far)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot_losses(metrics_path: str | Path, png_path: str | Path, title: str = "") -> Path | None:
    """Draw train loss per step and held-out loss per evaluation into a PNG; None if there is nothing to draw."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # no pyplot: no global backend state
    from matplotlib.figure import Figure

    records = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in records if r.get("kind") == "train" and r.get("loss") is not None]
    held = [(r["step"], r["heldout_loss"]) for r in records if r.get("kind") == "eval" and r.get("heldout_loss")]
    if not train and not held:
        return None
    fig = Figure(figsize=(7, 4.2), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if train:
        steps, losses = zip(*train, strict=True)
        ax.plot(steps, losses, lw=0.6, alpha=0.35, color="C0", label="train loss (per step)")
        ax.plot(steps, smoothed(losses), lw=1.6, color="C0", label=f"train loss (mean of last {SMOOTH_STEPS} steps)")
    if held:
        ax.plot(*zip(*held, strict=True), "o-", lw=1.5, label="held-out loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    refuse_symlink(png_path, "run folder entry")
    try:
        fig.savefig(str(png_path))
    except OSError as exc:
        raise StemlmError(f"could not write {png_path}: {exc.strerror or exc}") from None
    return Path(png_path)
