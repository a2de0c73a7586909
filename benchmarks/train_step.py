"""Train-step time of our dense model, our STEM model and `transformers.LlamaForCausalLM`, on one shape.

One step = forward with labels + backward + AdamW step (one AdamW over all parameters, foreach, as torch picks;
the STEM tables get dense gradients, like the official code). The three models are built in one process
and timed round-robin (every repetition runs each model once, in a rotating order, after warm-up steps) so
that load from other processes on a shared machine hits all three alike; medians are reported. The predicted
STEM/dense ratio is the ratio of training FLOPs per token from `stemlm.accounting` (matmuls only, causal
attention): it ignores the lookups, the dense table gradients and the larger optimizer state of STEM.

    python benchmarks/train_step.py                                        # tiny-like shape, fp32, CPU
    python benchmarks/train_step.py --threads 1 --clock cpu --reps 20      # on a shared, busy CPU
    python benchmarks/train_step.py --batch 4 --seq 128 --reps 5           # quicker
    python benchmarks/train_step.py --device cuda --reps 30

The last line is `RESULT stem_over_dense=… ours_over_hf=… predicted_stem_over_dense=…` (time ratios, > 1 =
slower than the denominator).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from stemlm.accounting import total_parameters, training_flops_per_token
from stemlm.config import ModelConfig
from stemlm.model import build_model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=256, help="hidden size d (default 256)")
    p.add_argument("--layers", type=int, default=4, help="number of layers (default 4)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4, no GQA)")
    p.add_argument("--ffn-dim", type=int, default=768, help="FFN width d_ff (default 768)")
    p.add_argument("--vocab", type=int, default=8192, help="vocabulary size (default 8192)")
    p.add_argument("--stem-layers", default="1,3", help="STEM layer spec for the STEM model (default 1,3)")
    p.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    p.add_argument("--seq", type=int, default=256, help="tokens per sequence (default 256)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per model first (default 2)")
    p.add_argument("--reps", type=int, default=10, help="timed steps per model, round-robin (default 10)")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads; 0 keeps torch's default")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall: elapsed time; cpu: this process's CPU time, steadier on a shared CPU (use with --threads 1)",
    )
    return p.parse_args(argv)


def hf_llama(config: ModelConfig) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    hf_config = LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.kv_heads,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(hf_config)


def make_step(name: str, model: torch.nn.Module, ids: torch.Tensor, targets: torch.Tensor):
    """A function running one train step and returning its (forward+backward, optimizer) durations."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)

    def step(clock) -> tuple[float, float]:
        start = clock()
        optimizer.zero_grad(set_to_none=True)
        # HF shifts labels inside; ours takes the targets already shifted. Same FLOPs either way.
        loss = model(input_ids=ids, labels=ids).loss if name == "hf" else model(ids, labels=targets).loss
        loss.backward()
        middle = clock()
        optimizer.step()
        return middle - start, clock() - middle

    return step


def clock_for(kind: str, device: torch.device):
    if kind == "cpu":
        return time.process_time  # CPU seconds of this process: blind to time spent descheduled by others
    if device.type == "cuda":
        return lambda: (torch.cuda.synchronize(), time.perf_counter())[1]
    return time.perf_counter


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dense = ModelConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.ffn_dim,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        max_position_embeddings=max(1024, args.seq),
        ffn="dense",
    )
    stem = dense.replace(ffn="stem", stem_layers=args.stem_layers)
    models = {
        "dense": build_model(dense, device=device, seed=0).train(),
        "stem": build_model(stem, device=device, seed=0).train(),
        "hf": hf_llama(dense).to(device).train(),
    }
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen).to(device)
    ids, targets = tokens[:, :-1], tokens[:, 1:]
    steps = {name: make_step(name, model, ids, targets) for name, model in models.items()}
    clock = clock_for(args.clock, device)
    for step in steps.values():
        for _ in range(args.warmup):
            step(clock)
    phases: dict[str, list[tuple[float, float]]] = {name: [] for name in steps}
    names = list(steps)
    for rep in range(args.reps):
        for k in range(len(names)):  # rotate the order so no model always runs right after another
            name = names[(rep + k) % len(names)]
            phases[name].append(steps[name](clock))
    report(args, device, dense, stem, phases)


def report(args, device, dense: ModelConfig, stem: ModelConfig, phases: dict[str, list[tuple[float, float]]]) -> None:
    n_tok = args.batch * args.seq
    flops = {"dense": training_flops_per_token(dense, args.seq), "stem": training_flops_per_token(stem, args.seq)}
    flops["hf"] = flops["dense"]
    params = {"dense": total_parameters(dense), "stem": total_parameters(stem), "hf": total_parameters(dense)}
    print(
        f"shape: d={args.hidden} L={args.layers} d_ff={args.ffn_dim} V={args.vocab} batch={args.batch}x{args.seq} "
        f"fp32 on {device}, threads={torch.get_num_threads()}, STEM layers {stem.special_layers}, "
        f"{args.reps} reps after {args.warmup} warm-up, {args.clock} clock"
    )
    print(
        f"{'model':<6} {'params':>10} {'GFLOP/step':>11} {'median ms':>10} {'fwd+bwd':>8} {'AdamW':>7} "
        f"{'min ms':>8} {'max ms':>8} {'tok/s':>7} {'GFLOP/s':>8}"
    )
    median = {}
    for name, ps in phases.items():
        totals = [a + b for a, b in ps]
        median[name] = statistics.median(totals)
        gflop = flops[name] * n_tok / 1e9
        fwd_bwd, opt = statistics.median(a for a, _ in ps), statistics.median(b for _, b in ps)
        print(
            f"{name:<6} {params[name]:>10,} {gflop:>11.2f} {median[name] * 1e3:>10.1f} {fwd_bwd * 1e3:>8.1f} "
            f"{opt * 1e3:>7.1f} {min(totals) * 1e3:>8.1f} {max(totals) * 1e3:>8.1f} {n_tok / median[name]:>7.0f} "
            f"{gflop / median[name]:>8.1f}"
        )
    stem_over_dense = median["stem"] / median["dense"]
    ours_over_hf = median["dense"] / median["hf"]
    predicted = flops["stem"] / flops["dense"]
    fwd_bwd = {name: statistics.median(a for a, _ in ps) for name, ps in phases.items()}
    print(
        f"STEM/dense time {stem_over_dense:.3f} (forward+backward only {fwd_bwd['stem'] / fwd_bwd['dense']:.3f}; "
        f"FLOPs predict {predicted:.3f}); ours/HF {ours_over_hf:.3f}"
    )
    print(
        f"RESULT stem_over_dense={stem_over_dense:.3f} ours_over_hf={ours_over_hf:.3f} "
        f"predicted_stem_over_dense={predicted:.3f}"
    )


if __name__ == "__main__":
    main()
