"""Time and memory of the fused lm_head + cross-entropy against the plain `lm_head` + `F.cross_entropy` (and the
checkpointed chunks of `--loss-chunk`), at two vocabulary sizes side by side in one process.

Each repetition runs forward + backward of the losses on the same [tokens, hidden] states, head weight and
labels (a tenth ignored), in alternating order, so load from other processes hits them alike; medians are
reported. Memory is measured two ways: the bytes autograd saves for backward (`saved_tensors_hooks`; the plain
path keeps its [tokens, V] logits and log-probs) and the process's peak resident memory above its resident
memory at the start of one forward + backward (Linux `VmHWM`, reset through `/proc/self/clear_refs`), which also
counts the transient [chunk, V] buffers and the plain path's [tokens, V] gradients (freed heap pages are trimmed
first, so that reusing them counts; glibc-internal reuse below its mmap threshold may still go unseen at small
shapes). The default shape is the tiny preset's hidden size at 8 x 256 tokens. Linux only. With `--device cuda`
the "peak" is the CUDA allocator's peak above its start (`max_memory_allocated`), the inputs in `--dtype`.

    python benchmarks/fused_loss.py                           # V = 8192 and 131072, chunk 512
    nice -n 10 python benchmarks/fused_loss.py --threads 1    # on a shared CPU
    python benchmarks/fused_loss.py --device cuda --dtype bf16 --tokens 8192 --hidden 1024

The last line is `RESULT fused_over_plain_time_v8192=… fused_over_plain_peak_bytes_v8192=…
fused_over_plain_saved_bytes_v8192=… fused_over_chunked_time_v8192=… fused_over_chunked_peak_bytes_v8192=…` and
the same at the other vocabularies (ratios, < 1 = the fused loss is faster / smaller).
"""

from __future__ import annotations

import argparse
import ctypes
import math
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from stemlm.model.fused_loss import fused_linear_cross_entropy, release_workspace
from stemlm.model.loss import IGNORE_INDEX, chunked_cross_entropy


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocabs", default="8192,131072", help="comma-separated vocabulary sizes (default %(default)s)")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per step (default %(default)s)")
    p.add_argument("--hidden", type=int, default=256, help="hidden size (default %(default)s, the tiny preset's)")
    p.add_argument("--chunk", type=int, default=512, help="tokens per chunk of the fused loss (default %(default)s)")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions after one warm-up (default %(default)s)")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads; 0 keeps torch's default")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default %(default)s)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="hidden states and head weight")
    return p.parse_args(argv)


def plain_loss(h, w, y, chunk):
    return F.cross_entropy((h @ w.t()).float(), y, ignore_index=IGNORE_INDEX)


def chunked_loss(h, w, y, chunk):
    return chunked_cross_entropy(h, lambda t: t @ w.t(), y, chunk)


def fused_loss(h, w, y, chunk):
    return fused_linear_cross_entropy(h, w, y, chunk)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step(fn, hidden, weight, labels, chunk) -> float:
    h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    _sync(h.device)
    start = time.perf_counter()
    fn(h, w, labels, chunk).backward()
    _sync(h.device)
    return time.perf_counter() - start


def saved_bytes(fn, hidden, weight, labels, chunk) -> int:
    total = 0

    def pack(t):
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(hidden.detach().requires_grad_(), weight.detach().requires_grad_(), labels, chunk)
    return total


def _status_kb(field: str) -> int:
    line = next(s for s in Path("/proc/self/status").read_text().splitlines() if s.startswith(field + ":"))
    return int(line.split()[1])


def peak_rss_bytes(fn, hidden, weight, labels, chunk) -> int:
    """Peak resident memory above the start of one forward + backward (Linux: "5" resets VmHWM to VmRSS); on a
    GPU the CUDA allocator's peak above what it held at the start. The fused loss's reused [chunk, V] workspace
    is freed first, so that its peak counts it."""
    release_workspace()
    if hidden.device.type == "cuda":
        torch.cuda.synchronize(hidden.device)
        torch.cuda.reset_peak_memory_stats(hidden.device)
        base = torch.cuda.memory_allocated(hidden.device)
        step(fn, hidden, weight, labels, chunk)
        return torch.cuda.max_memory_allocated(hidden.device) - base
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap pages back, so reusing them shows up as a rise
    Path("/proc/self/clear_refs").write_text("5")
    base = _status_kb("VmRSS")
    step(fn, hidden, weight, labels, chunk)
    return (_status_kb("VmHWM") - base) * 1024


def ratio(a: float, b: float) -> float:
    return a / b if b else math.nan


def measure(vocab: int, args: argparse.Namespace) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    dtype, device = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype], torch.device(args.device)
    hidden = torch.randn(args.tokens, args.hidden, generator=gen).to(device, dtype)
    weight = (torch.randn(vocab, args.hidden, generator=gen) * args.hidden**-0.5).to(device, dtype)
    labels = torch.randint(0, vocab, (args.tokens,), generator=gen)
    labels[::10] = IGNORE_INDEX
    labels = labels.to(device)
    fns = {"plain": plain_loss, "chunked": chunked_loss, "fused": fused_loss}
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():  # warm-up
        step(fn, hidden, weight, labels, args.chunk)
    for rep in range(args.reps):
        for name in list(fns)[rep % len(fns) :] + list(fns)[: rep % len(fns)]:  # rotating order
            times[name].append(step(fns[name], hidden, weight, labels, args.chunk))
    out = {f"{name}_s": statistics.median(ts) for name, ts in times.items()}
    for name, fn in fns.items():
        out[f"{name}_saved"] = saved_bytes(fn, hidden, weight, labels, args.chunk)
        out[f"{name}_peak"] = peak_rss_bytes(fn, hidden, weight, labels, args.chunk)
    return out


def mib(m: dict[str, float], kind: str) -> str:
    return " / ".join(f"{m[f'{name}_{kind}'] / 2**20:.1f}" for name in ("plain", "chunked", "fused"))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"tokens={args.tokens} hidden={args.hidden} chunk={args.chunk} threads={torch.get_num_threads()} "
        f"{args.dtype} on {args.device}"
    )
    fields = []
    for vocab in (int(v) for v in args.vocabs.split(",")):
        m = measure(vocab, args)
        print(
            f"V={vocab}: time plain / chunked / fused {m['plain_s']:.3f} / {m['chunked_s']:.3f} / {m['fused_s']:.3f} s"
            f" | saved for backward {mib(m, 'saved')} MiB | peak RSS rise {mib(m, 'peak')} MiB"
        )
        fields += [
            f"fused_over_plain_time_v{vocab}={ratio(m['fused_s'], m['plain_s']):.3f}",
            f"fused_over_plain_peak_bytes_v{vocab}={ratio(m['fused_peak'], m['plain_peak']):.3f}",
            f"fused_over_plain_saved_bytes_v{vocab}={ratio(m['fused_saved'], m['plain_saved']):.3f}",
            f"fused_over_chunked_time_v{vocab}={ratio(m['fused_s'], m['chunked_s']):.3f}",
            f"fused_over_chunked_peak_bytes_v{vocab}={ratio(m['fused_peak'], m['chunked_peak']):.3f}",
        ]
    print("RESULT " + " ".join(fields))


if __name__ == "__main__":
    main()
