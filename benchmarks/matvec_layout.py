"""Matrix-vector products from memory in the two layouts of a weight: the check behind `stored_transposed`.

A decode step multiplies one vector by every weight matrix once, reading each from memory. A weight W [out, in]
can be kept as it is (y = F.linear(x, W): a short dot product per output) or as its transpose [in, out]
(y = x @ W^T: whole rows streamed into the output vector); `stemlm.model.fusion.stored_transposed` keeps the
decoding copies of the matrices with at least as many outputs as inputs transposed, on a CPU. This prints, for each
matrix shape of a decode step of `--preset` (fused q/k/v, o, fused gate/up, STEM's gate alone, down, lm_head),
the bandwidth of both layouts and their ratio, and whether the rule picked the faster one.

Each shape gets enough distinct copies to fill `--mib` MiB (several times a server CPU's last-level cache), so
every product reads its matrix from memory, as a decode step does; both layouts run in turn inside each
repetition (load hits them alike) in the process's CPU clock, medians over `--reps`.

    python benchmarks/matvec_layout.py                       # tiny shapes, one thread
    python benchmarks/matvec_layout.py --preset smollm2-135m --mib 512

Last line: `RESULT rule_holds=… worst_pick=… transposed_over_plain_<out>x<in>=…` (speed ratios, > 1 = the
transposed layout faster; `worst_pick` the smallest speed ratio of the layout the rule picks over the other one,
and `rule_holds` whether that is at least 0.9: no pick clearly slower. A square matrix (o_proj) is kept transposed
since that ran 1.03-1.24x as fast on the two AMD CPUs measured; docs/results.md has the figures).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from stemlm.model.config import ModelConfig
from stemlm.model.fusion import stored_transposed
from stemlm.model.presets import get_preset

NOISE = 0.9  # a pick this close to the other layout's speed counts as a tie (see the RESULT line)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny", help="model preset whose decode shapes are timed (default tiny)")
    p.add_argument("--mib", type=int, default=256, help="MiB of copies per shape and layout (default 256)")
    p.add_argument("--reps", type=int, default=7, help="timed passes per layout (default 7)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    return p.parse_args(argv)


def decode_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """Name -> (out, in) of each distinct matrix a decode step multiplies by (projections fused as at load)."""
    d, f, hd = config.hidden_size, config.intermediate_size, config.head_size
    return {
        "qkv": ((config.num_attention_heads + 2 * config.kv_heads) * hd, d),
        "o": (d, config.num_attention_heads * hd),
        "gate_up": (2 * f, d),
        "stem_gate": (f, d),
        "down": (d, f),
        "lm_head": (config.vocab_size, d),
    }


def time_layouts(out: int, inp: int, mib: int, reps: int) -> tuple[float, float]:
    """Median seconds per product of the [out, in] and the [in, out] layout, each over copies filling `mib`."""
    copies = max(2, mib * 2**20 // (4 * out * inp))
    plain = [torch.randn(out, inp) for _ in range(copies)]
    transposed = [w.t().contiguous() for w in plain]
    x = torch.randn(1, inp)
    runs = {"plain": lambda: [F.linear(x, w) for w in plain], "transposed": lambda: [x @ w for w in transposed]}
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for fn in runs.values():
        fn()  # warm-up
    for _ in range(reps):
        for name, fn in runs.items():
            start = time.process_time()
            fn()
            seconds[name].append((time.process_time() - start) / copies)
    return statistics.median(seconds["plain"]), statistics.median(seconds["transposed"])


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    config = get_preset(args.preset)
    cpu = torch.device("cpu")
    print(f"{args.preset}, fp32, threads={torch.get_num_threads()}, {args.mib} MiB of copies per shape, cpu clock")
    print(f"{'matrix':<10} {'out x in':>12} {'plain GB/s':>11} {'transp. GB/s':>13} {'ratio':>6} {'rule keeps':>11}")
    ratios, picks = {}, []
    for name, (out, inp) in decode_shapes(config).items():
        key = f"{out}x{inp}"
        if key in ratios:
            continue
        plain_s, transposed_s = time_layouts(out, inp, args.mib, args.reps)
        ratio = plain_s / transposed_s
        ratios[key] = ratio
        rule = stored_transposed(out, inp, cpu)
        picks.append(ratio if rule else 1 / ratio)
        gb = 4 * out * inp / 1e9
        print(
            f"{name:<10} {key:>12} {gb / plain_s:>11.1f} {gb / transposed_s:>13.1f} {ratio:>6.2f} "
            f"{'[in, out]' if rule else '[out, in]':>11}"
        )
    print(
        f"RESULT rule_holds={min(picks) >= NOISE} worst_pick={min(picks):.2f} "
        + " ".join(f"transposed_over_plain_{key}={ratio:.2f}" for key, ratio in ratios.items())
    )


if __name__ == "__main__":
    main()
