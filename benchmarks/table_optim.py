"""Optimizer step time of the row-sparse `lazy_adamw` against dense `adamw` on one STEM table, V = 8k and 64k.

Both optimizers see the same batch: B x S Zipfian token ids (exponent 1, over the first 8192 ids, so the set
of touched rows is identical at both V). `lazy_adamw` gets the sparse COO gradient nn.Embedding(sparse=True)
produces (one row per position, duplicates included: coalescing is part of its step); `adamw` gets the dense
V x d_ff gradient. Only `optimizer.step()` is timed, the configurations interleaved round by round so machine
load hits them alike (the cheap lazy steps repeated within each round); medians are reported. Targets: lazy
at 64k within 1.15x of lazy at 8k (cost follows the unique ids, not V); dense / lazy at 64k >= 5x.

Run: `OMP_NUM_THREADS=1 python benchmarks/table_optim.py [--d-ff 768 --batch 8 --seq 256 --rounds 15]` (~1 min)
Last line: `RESULT lazy_64k_over_8k=... dense_over_lazy_64k=...`
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from stemlm.train.tables.optim import make_table_optimizer


def zipf_ids(shape: tuple[int, ...], vocab: int, exponent: float, generator: torch.Generator) -> torch.Tensor:
    """Token ids with P(id = k) proportional to 1 / (k + 1)^exponent, k < vocab."""
    weights = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64) ** exponent
    flat = torch.multinomial(weights, int(torch.tensor(shape).prod()), replacement=True, generator=generator)
    return flat.reshape(shape)


def make_case(name: str, vocab: int, d_ff: int, ids: torch.Tensor, seed: int):
    gen = torch.Generator().manual_seed(seed)
    param = nn.Parameter(torch.randn(vocab, d_ff, generator=gen) * 0.02)
    rows = torch.randn(ids.numel(), d_ff, generator=gen)
    sparse = torch.sparse_coo_tensor(ids.reshape(1, -1), rows, (vocab, d_ff), check_invariants=False)
    grad = sparse if name == "lazy_adamw" else sparse.to_dense()
    opt = make_table_optimizer(name, [param], lr=1e-3, weight_decay=0.1)
    return param, grad, opt


def time_step(param, grad, opt) -> float:
    param.grad = grad.clone() if grad.layout == torch.sparse_coo else grad  # the step coalesces in place
    start = time.perf_counter()
    opt.step()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d-ff", type=int, default=768, help="table width (d_ff)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds (after 2 warm-up rounds)")
    parser.add_argument("--lazy-repeats", type=int, default=5, help="lazy_adamw steps per V in each round")
    args = parser.parse_args()

    ids = zipf_ids((args.batch, args.seq), 8192, 1.0, torch.Generator().manual_seed(0))
    unique = ids.unique().numel()
    cases = {
        (name, v): make_case(name, v, args.d_ff, ids, seed=1) for v in (8192, 65536) for name in ("lazy_adamw", "adamw")
    }
    times: dict[tuple[str, int], list[float]] = {key: [] for key in cases}
    for r in range(args.rounds + 2):
        # One dense step per V, then the cheap lazy steps alternated 8k / 64k several times: more samples
        # where the noise of a shared machine matters most, and the same cache state for both sizes.
        order = [("adamw", 8192), ("adamw", 65536)] + [("lazy_adamw", v) for v in (8192, 65536)] * args.lazy_repeats
        for key in order:
            elapsed = time_step(*cases[key])
            if r >= 2:
                times[key].append(elapsed)
    med = {key: statistics.median(t) * 1e3 for key, t in times.items()}
    print(
        f"batch {args.batch}x{args.seq} tokens, {unique} unique ids, d_ff {args.d_ff}, "
        f"threads {torch.get_num_threads()}, median of {args.rounds} dense / {args.rounds * args.lazy_repeats} lazy "
        "steps"
    )
    for (name, v), ms in med.items():
        print(f"  {name:>10}  V={v:>6}  {ms:9.2f} ms/step")
    lazy_ratio = med[("lazy_adamw", 65536)] / med[("lazy_adamw", 8192)]
    dense_ratio = med[("adamw", 65536)] / med[("lazy_adamw", 65536)]
    print(
        f"lazy 64k / lazy 8k = {lazy_ratio:.3f} (target <= 1.15); dense / lazy at 64k = {dense_ratio:.1f} (target >= 5)"
    )
    print(f"RESULT lazy_64k_over_8k={lazy_ratio:.3f} dense_over_lazy_64k={dense_ratio:.2f}")


if __name__ == "__main__":
    main()
