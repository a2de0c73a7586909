"""Train-step time of our dense model (plain and fused loss), our STEM model and `transformers.LlamaForCausalLM`.

Our two models are timed through the trainer's real step, `stemlm.train.Trainer.train_step()`: the
deterministic window batch of the embedded corpus, forward with labels, backward, the one global gradient-norm
clip over all parameters, the scheduled learning rates and every optimizer of `build_optimizers` (backbone
AdamW with its decay / no-decay groups; for STEM the table optimizer `--table-optim`, by default
`TrainConfig`'s default). The HF Llama step mirrors it with the same pieces (same groups, `clip_grad_norm_mixed`,
AdamW). All three are built in one process and timed round-robin (each repetition runs every model once, in a
rotating order, after warm-up steps) so that load from other processes hits them alike; medians are reported.
The predicted STEM/dense ratio is the ratio of training FLOPs per token from `stemlm.model.accounting` (matmuls
only, causal attention): it ignores the lookups, the table optimizer and the embedding/norm work.

Beside the steps, in the same rotation and clock: "fused", the dense trainer with the fused lm_head +
cross-entropy (`--fused-chunk` tokens a chunk, `stemlm.model.fused_loss`); "loss", the plain path's
cross-entropy forward + backward alone on [tokens, V] logits (what `loss_over_step` divides by the dense step;
the lm_head's matmuls are not in it); and "gemm", the best plain matmul at the model's shapes
(`stemlm.train.throughput.matmul_peak`, in the same clock), against which `share_of_gemm` sets each model's FLOP
rate. Page faults per step are the process's
minor faults (`getrusage`) across each timed step: a large buffer that the allocator maps and unmaps every step
shows up there (glibc's `malloc` serves blocks above its mmap threshold with fresh mappings). By default the
process keeps freed blocks for reuse as `stemlm train` does (`stemlm.train.allocator`, `--allocator kept`);
`--allocator system` leaves glibc's defaults (run both, alternating processes, to see what the setting buys).

    python benchmarks/train_step.py                                        # tiny shape, fp32, CPU
    python benchmarks/train_step.py --threads 1 --clock cpu --reps 20      # on a shared, busy CPU
    python benchmarks/train_step.py --threads 1 --clock cpu --allocator system   # glibc's own malloc settings
    python benchmarks/train_step.py --table-optim adamw                    # dense AdamW on the tables
    python benchmarks/train_step.py --device cuda --dtype bf16 --reps 30
    python benchmarks/train_step.py --threads 1 --clock cpu --vocab 131072 --reps 3   # where the loss dominates
    python benchmarks/train_step.py --threads 1 --clock cpu --compile                  # and the compiled blocks

The last line is `RESULT stem_over_dense=… ours_over_hf=… predicted_stem_over_dense=… share_of_gemm=…
stem_share_of_gemm=… loss_over_step=… fused_over_plain=… faults_per_step=… fused_faults_per_step=…` (time
ratios, > 1 = slower than the denominator; shares of the matmul peak; minor page faults per dense step, plain
and fused loss). With `--compile`, two more trainers join the rotation, dense with every decoder block through
torch.compile (`stemlm train --compile`, `stemlm.train.compile`), plain and fused loss (compiled during the
warm-up steps), and the line ends with `compiled_over_plain=… compiled_fused_over_plain=…
compiled_share_of_gemm=…`.
"""

from __future__ import annotations

import argparse
import math
import resource
import statistics
import tempfile
import time

import torch

from stemlm.model.accounting import total_parameters, training_flops_per_token
from stemlm.model.config import ModelConfig
from stemlm.model.loss import cross_entropy
from stemlm.placement.table_optim import TABLE_OPTIMIZERS, clip_grad_norm_mixed
from stemlm.train.allocator import keep_freed_blocks
from stemlm.train.config import TrainConfig
from stemlm.train.optim import set_learning_rates
from stemlm.train.throughput import matmul_peak, matmul_shapes
from stemlm.train.trainer import Trainer


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=256, help="hidden size d (default 256)")
    p.add_argument("--layers", type=int, default=4, help="number of layers (default 4)")
    p.add_argument("--heads", type=int, default=4, help="attention heads (default 4, no GQA)")
    p.add_argument("--ffn-dim", type=int, default=768, help="FFN width d_ff (default 768)")
    p.add_argument("--vocab", type=int, default=8192, help="vocabulary size, >= the tokenizer's (default 8192)")
    p.add_argument("--stem-layers", default="1,3", help="STEM layer spec for the STEM model (default 1,3)")
    p.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    p.add_argument("--seq", type=int, default=256, help="tokens per sequence (default 256)")
    p.add_argument("--table-optim", choices=TABLE_OPTIMIZERS, default=None, help="STEM table optimizer")
    p.add_argument("--fused-chunk", type=int, default=512, help="tokens per chunk of the fused model (default 512)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="autocast dtype (default fp32)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per model first (default 2)")
    p.add_argument("--reps", type=int, default=10, help="timed steps per model, round-robin (default 10)")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads; 0 keeps torch's default")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--compile", action="store_true", help="also time dense with compiled decoder blocks")
    p.add_argument(
        "--allocator",
        choices=("kept", "system"),
        default="kept",
        help="kept: freed blocks reused, as stemlm train does (stemlm.train.allocator); system: glibc's defaults",
    )
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


class Timed:
    """Wraps a trainer's `_accumulate_gradients` to record the forward+backward share of each step."""

    def __init__(self, fn, clock) -> None:
        self.fn, self.clock, self.last = fn, clock, 0.0

    def __call__(self, step: int):
        start = self.clock()
        out = self.fn(step)
        self.last = self.clock() - start
        return out


def trainer_step(trainer: Trainer, clock):
    """One real trainer step -> (forward+backward, clip + optimizers + bookkeeping) durations."""
    timed = Timed(trainer._accumulate_gradients, clock)
    trainer._accumulate_gradients = timed  # instance attribute: the step itself is untouched

    def step() -> tuple[float, float]:
        start = clock()
        trainer.train_step()
        total = clock() - start
        return timed.last, total - timed.last

    return step


def hf_step(model: torch.nn.Module, cfg: TrainConfig, batch, device: torch.device, clock):
    """The trainer's step for an HF model: same groups, schedule, clip and AdamW."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay, "peak_lr": cfg.lr},
        {"params": no_decay, "weight_decay": 0.0, "peak_lr": cfg.lr},
    ]
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    ids = batch.to(device)
    amp = cfg.dtype == "bf16"
    state = {"step": 0}

    def step() -> tuple[float, float]:
        start = clock()
        set_learning_rates([opt], state["step"], cfg)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            loss = model(input_ids=ids, labels=ids).loss  # HF shifts labels inside: same FLOPs
        loss_value = loss.item()
        loss.backward()
        middle = clock()
        norm = clip_grad_norm_mixed(list(model.parameters()), cfg.grad_clip).item()
        if math.isfinite(loss_value) and math.isfinite(norm):
            opt.step()
        opt.zero_grad(set_to_none=True)
        state["step"] += 1
        return middle - start, clock() - middle

    return step


def loss_step(model: torch.nn.Module, batch, device: torch.device, amp: bool, clock):
    """The plain path's cross-entropy alone, forward and backward, on fixed [tokens, V] logits as the lm_head gives
    them (the head's matmuls are counted with the GEMMs): log-softmax, the loss and the gradient's zero-fill."""
    ids = batch.to(device).reshape(-1)
    gen = torch.Generator().manual_seed(0)
    dtype = torch.bfloat16 if amp else torch.float32
    logits = torch.randn(ids.numel(), model.config.vocab_size, generator=gen).to(device, dtype)

    def step() -> tuple[float, float]:
        leaf = logits.detach().requires_grad_()
        start = clock()
        cross_entropy(leaf, ids).backward()
        return clock() - start, 0.0

    return step


def gemm_step(config: ModelConfig, tokens: int, device: torch.device, dtype: torch.dtype, clock):
    """The matmul peak at the model's shapes in `clock`, as seconds per (fixed) GFLOP, so it rotates like a step."""
    which = "cpu" if clock is time.process_time else "wall"
    shapes = matmul_shapes(config, tokens)

    def step() -> tuple[float, float]:
        return 1e9 / matmul_peak(shapes, device, dtype)[which], 0.0

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
    allocator = keep_freed_blocks() if args.allocator == "kept" else "system"
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
    stem = dense.replace(ffn="stem", ffn_layers=args.stem_layers)
    total = args.warmup + args.reps + 1
    cfg = TrainConfig(
        steps=total,
        batch_size=args.batch,
        seq_len=args.seq,
        device=args.device,
        dtype=args.dtype,
        eval_every=0,
        fused_loss=False,  # the plain path at every --vocab ("fused" below is the fused one)
    )
    if args.table_optim:
        cfg = cfg.replace(table_optim=args.table_optim)
    clock = clock_for(args.clock, device)
    fused_cfg = cfg.replace(loss_chunk=args.fused_chunk, fused_loss=True)
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {
            name: Trainer(config, train_cfg.replace(out=f"{tmp}/{name}"), progress=False)
            for name, config, train_cfg in (("dense", dense, cfg), ("stem", stem, cfg), ("fused", dense, fused_cfg))
        }
        if args.compile:
            for name, train_cfg in (("compiled", cfg), ("compiled_fused", fused_cfg)):
                trainers[name] = Trainer(dense, train_cfg.replace(out=f"{tmp}/{name}", compile=True), progress=False)
        batch, _ = trainers["dense"].train_data.sample_batch(args.batch, args.seq + 1, seed=0, step=0)
        torch.manual_seed(0)
        hf = hf_llama(dense).to(device).train()
        steps = {name: trainer_step(t, clock) for name, t in trainers.items()}
        steps["hf"] = hf_step(hf, cfg, batch[:, : args.seq], device, clock)
        steps["loss"] = loss_step(trainers["dense"].model, batch[:, 1:], device, cfg.dtype == "bf16", clock)
        steps["gemm"] = gemm_step(dense, args.batch * args.seq, device, trainers["dense"].amp_dtype, clock)
        for step in steps.values():
            for _ in range(args.warmup):
                step()
        phases: dict[str, list[tuple[float, float]]] = {name: [] for name in steps}
        faults: dict[str, list[int]] = {name: [] for name in steps}
        names = list(steps)
        for rep in range(args.reps):
            for k in range(len(names)):  # rotate the order so no model always runs right after another
                name = names[(rep + k) % len(names)]
                before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                phases[name].append(steps[name]())
                faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    gemm = [a for a, _ in phases.pop("gemm")]
    loss = [a for a, _ in phases.pop("loss")]
    gemm_flops, loss_s = 1e9 / statistics.median(gemm), statistics.median(loss)
    report(args, cfg, device, dense, stem, phases, faults, gemm_flops, loss_s, allocator)


def report(args, cfg, device, dense, stem, phases, faults, gemm: float, loss: float, allocator: str) -> None:
    """Print the table and the RESULT line; `gemm` is the matmul peak (FLOP/s) and `loss` the plain loss's
    forward + backward (s), both medians in the benchmark's clock; `allocator` what `keep_freed_blocks` found."""
    n_tok = args.batch * args.seq
    flops = {"dense": training_flops_per_token(dense, args.seq), "stem": training_flops_per_token(stem, args.seq)}
    like_dense = ("hf", "fused", "compiled", "compiled_fused")
    flops |= {name: flops["dense"] for name in like_dense}
    params = {name: total_parameters(dense) for name in ("dense", *like_dense)} | {"stem": total_parameters(stem)}
    width = max(6, *map(len, phases))
    print(
        f"shape: d={args.hidden} L={args.layers} d_ff={args.ffn_dim} V={args.vocab} batch={args.batch}x{args.seq} "
        f"{cfg.dtype} on {device}, threads={torch.get_num_threads()}, STEM layers {stem.special_layers}, "
        f"table optimizer {cfg.table_optim}, clip {cfg.grad_clip}, {args.reps} reps after {args.warmup} warm-up, "
        f"{args.clock} clock; fused: dense with the fused loss, chunk {args.fused_chunk}; malloc: {allocator}"
    )
    print(
        f"{'model':<{width}} {'params':>10} {'GFLOP/step':>11} {'median ms':>10} {'fwd+bwd':>8} {'clip+opt':>8} "
        f"{'min ms':>8} {'max ms':>8} {'tok/s':>7} {'GFLOP/s':>8} {'of gemm':>8} {'faults':>8}"
    )
    median = {}
    for name, ps in phases.items():
        totals = [a + b for a, b in ps]
        median[name] = statistics.median(totals)
        gflop = flops[name] * n_tok / 1e9
        fwd_bwd, opt = statistics.median(a for a, _ in ps), statistics.median(b for _, b in ps)
        print(
            f"{name:<{width}} {params[name]:>10,} {gflop:>11.2f} {median[name] * 1e3:>10.1f} {fwd_bwd * 1e3:>8.1f} "
            f"{opt * 1e3:>8.1f} {min(totals) * 1e3:>8.1f} {max(totals) * 1e3:>8.1f} {n_tok / median[name]:>7.0f} "
            f"{gflop / median[name]:>8.1f} {gflop * 1e9 / median[name] / gemm:>8.0%} "
            f"{statistics.median(faults[name]):>8,.0f}"
        )
    print(
        f"best plain matmul at the model's shapes {gemm / 1e9:.1f} GFLOP/s; plain cross-entropy forward+backward "
        f"{loss * 1e3:.1f} ms = {loss / median['dense']:.0%} of the dense step"
    )
    stem_over_dense = median["stem"] / median["dense"]
    ours_over_hf = median["dense"] / median["hf"]
    predicted = flops["stem"] / flops["dense"]
    fwd_bwd = {name: statistics.median(a for a, _ in ps) for name, ps in phases.items()}
    opt = {name: statistics.median(b for _, b in ps) for name, ps in phases.items()}
    print(
        f"STEM/dense time {stem_over_dense:.3f} = {stem_over_dense / predicted:.3f} x predicted {predicted:.3f}; "
        f"forward+backward {fwd_bwd['stem'] / fwd_bwd['dense']:.3f}, clip+optimizers "
        f"{(opt['stem'] - opt['dense']) * 1e3:+.1f} ms vs dense; ours/HF {ours_over_hf:.3f}"
    )
    share = {name: flops[name] * n_tok / median[name] / gemm for name in ("dense", "stem")}
    print(
        f"RESULT stem_over_dense={stem_over_dense:.3f} ours_over_hf={ours_over_hf:.3f} "
        f"predicted_stem_over_dense={predicted:.3f} share_of_gemm={share['dense']:.3f} "
        f"stem_share_of_gemm={share['stem']:.3f} loss_over_step={loss / median['dense']:.3f} "
        f"fused_over_plain={median['fused'] / median['dense']:.3f} "
        f"faults_per_step={statistics.median(faults['dense']):.0f} "
        f"fused_faults_per_step={statistics.median(faults['fused']):.0f}"
        + (
            f" compiled_over_plain={median['compiled'] / median['dense']:.3f} "
            f"compiled_fused_over_plain={median['compiled_fused'] / median['dense']:.3f} "
            f"compiled_share_of_gemm={flops['dense'] * n_tok / median['compiled'] / gemm:.3f}"
            if "compiled" in median
            else ""
        )
    )


if __name__ == "__main__":
    main()
