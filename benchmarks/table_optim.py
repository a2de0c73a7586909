"""Optimizer step time of the row-sparse `lazy_adamw` and `rowwise_adagrad` (the default table optimizer) against
dense `adamw` on one STEM table, at two vocabulary sizes (8k and 64k by default).

All optimizers see the same batch: B x S Zipfian token ids (exponent 1, over the first 8192 ids, so the set
of touched rows is identical at both V). The row-sparse ones get the sparse COO gradient nn.Embedding(sparse=True)
produces (one row per position, duplicates included: coalescing is part of their step); `adamw` gets the dense
V x d_ff gradient. Only `optimizer.step()` is timed, the configurations interleaved round by round so machine
load hits them alike (the cheap row-sparse steps repeated within each round); medians are reported. Targets: a
row-sparse step at 64k within 1.15x of the same at 8k (cost follows the unique ids, not V); dense / row-sparse at
64k >= 5x.

Run: `OMP_NUM_THREADS=1 python benchmarks/table_optim.py [--d-ff 768 --batch 8 --seq 256 --rounds 15]` (~1 min)
Last line: `RESULT lazy_64k_over_8k=... dense_over_lazy_64k=... adagrad_64k_over_8k=... dense_over_adagrad_64k=...`
(named after the default sizes; `--vocabs` changes the sizes, not the names).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from stemlm.placement.table_optim import TABLE_OPTIMIZERS, make_table_optimizer


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
    grad = sparse.to_dense() if name == "adamw" else sparse
    opt = make_table_optimizer(name, [param], lr=1e-3, weight_decay=0.1)
    return param, grad, opt


def time_step(param, grad, opt) -> float:
    param.grad = grad.clone() if grad.layout == torch.sparse_coo else grad  # the step coalesces in place
    start = time.perf_counter()
    opt.step()
    return time.perf_counter() - start


SPARSE = ("lazy_adamw", "rowwise_adagrad")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d-ff", type=int, default=768, help="table width (d_ff)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step")
    parser.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    parser.add_argument("--vocabs", default="8192,65536", help="the small and the large V (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds (after 2 warm-up rounds)")
    parser.add_argument("--lazy-repeats", type=int, default=5, help="row-sparse steps per optimizer and V per round")
    args = parser.parse_args(argv)

    small, large = (int(v) for v in args.vocabs.split(","))
    ids = zipf_ids((args.batch, args.seq), min(8192, small), 1.0, torch.Generator().manual_seed(0))
    unique = ids.unique().numel()
    cases = {(name, v): make_case(name, v, args.d_ff, ids, seed=1) for v in (small, large) for name in TABLE_OPTIMIZERS}
    times: dict[tuple[str, int], list[float]] = {key: [] for key in cases}
    for r in range(args.rounds + 2):
        # One dense step per V, then the cheap row-sparse steps alternated small / large several times: more
        # samples where the noise of a shared machine matters most, and the same cache state for both sizes.
        order = [("adamw", small), ("adamw", large)]
        order += [(name, v) for name in SPARSE for v in (small, large)] * args.lazy_repeats
        for key in order:
            elapsed = time_step(*cases[key])
            if r >= 2:
                times[key].append(elapsed)
    med = {key: statistics.median(t) * 1e3 for key, t in times.items()}
    print(
        f"batch {args.batch}x{args.seq} tokens, {unique} unique ids, d_ff {args.d_ff}, "
        f"threads {torch.get_num_threads()}, median of {args.rounds} dense / {args.rounds * args.lazy_repeats} "
        "row-sparse steps"
    )
    for (name, v), ms in med.items():
        print(f"  {name:>15}  V={v:>6}  {ms:9.2f} ms/step")
    fields = []
    for name, short in zip(SPARSE, ("lazy", "adagrad"), strict=True):
        growth, dense = med[(name, large)] / med[(name, small)], med[("adamw", large)] / med[(name, large)]
        print(
            f"{name}: V={large} / V={small} = {growth:.3f} (target <= 1.15); dense / {name} at V={large} = "
            f"{dense:.1f} (target >= 5)"
        )
        fields += [f"{short}_64k_over_8k={growth:.3f}", f"dense_over_{short}_64k={dense:.2f}"]
    print("RESULT " + " ".join(fields))


if __name__ == "__main__":
    main()
