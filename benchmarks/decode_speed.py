"""Decode tokens/s at the tiny shape: our `generate` against `transformers`' `generate()`, with the memory bound.

Three models with random weights (seed 0): our tiny STEM model and our tiny-dense model decode with
`stemlm.inference.generate.generate`, prepared as `stemlm.inference.load` prepares a loaded checkpoint (q/k/v and
gate/up fused, on a CPU the wide copies kept transposed: `fusion.fuse_for_decoding`), and beside them the same
tiny-dense model without those copies ("unfused", for `fused_over_unfused`); the same tiny-dense weights loaded into
`transformers.LlamaForCausalLM` (a dense stemlm folder is a Llama folder) decode with HF `generate()` (greedy, eos
disabled, dynamic cache). Each repetition runs every model once, in a rotating order, so machine load hits all
alike; a run is a `--prompt` token prefill plus `--new` greedy tokens, and tokens/s counts the new tokens (median
over repetitions). Beside them: the bytes one decode step reads (weights touched + KV cache at the mean context,
fp32, from `stemlm.model.accounting.decode_bytes_per_token`) and the tokens/s that bound allows at the memory read
bandwidth measured in this process, in the same clock as the decoding: a streaming sum over a 256 MiB tensor on the
same threads, timed once per repetition inside the rotation (so load hits it as it hits the models), median over the
repetitions. The clock is this process's CPU time by default (`--clock cpu`: blind to time spent descheduled by the
other processes of a shared machine, so rates and bound move together; with one thread CPU seconds are seconds of
that thread's work) or wall time (`--clock wall`, for a quiet machine or more threads). A third reference, in the
same rotation and clock: the matrix-vector products alone of one dense decode step (every weight matrix the step
multiplies by, each once, in order, on a vector, in the loaded model's layout; "matvec"): `share_of_matvec` is their
time over our dense model's time per token, i.e. how much of a step the matrix kernels take, whatever bandwidth they
reach, and `matvec_share_of_bound` the share of the bound a step made of those products alone would reach: the
ceiling that torch's matrix-vector kernels set on this machine, whatever is done around them.

    python benchmarks/decode_speed.py                      # single thread (the default), CPU clock
    python benchmarks/decode_speed.py --threads 2 --clock wall --new 128 --reps 7
    python benchmarks/decode_speed.py --device cuda --clock wall      # a GPU's work is not in the CPU clock
    python benchmarks/decode_speed.py --compile --reps 9                 # and the compiled decoding steps

Last line: `RESULT ours_over_hf=… fused_over_unfused=… share_of_bound=… share_of_matvec=… matvec_share_of_bound=…
stem_share_of_bound=… hf_share_of_bound=… ours_tok_s=… hf_tok_s=… stem_tok_s=… bound_tok_s=…` (ours = our dense
model; ratio > 1 = ours faster; a share is tokens/s over the bound's), and with `--compile` `compiled_over_fused=…
compiled_over_hf=… compiled_share_of_bound=… serve_share_of_bound=… serve_tok_s=…`: tiny-dense with its decoding
steps through torch.compile (`stemlm.inference.inference_model.InferenceModel`, as `generate --compile` runs them;
compiled before the timing) over the fused eager model and over `transformers`, and its share of the bound; and
"serve": the configuration `stemlm serve` runs by default, the tiny STEM model (`stemlm train`'s preset) with
compiled steps and resident tables, one request decoded by the batch engine (`BatchEngine`, the server's decode
loop: its per-step work beside the forward included), its share of the tiny STEM model's bound.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F

from stemlm.checkpoint.folder import save_pretrained
from stemlm.inference.batching import BatchEngine
from stemlm.inference.generate import generate
from stemlm.inference.inference_model import InferenceModel
from stemlm.inference.requests import Request, SamplingParams
from stemlm.model import build_model
from stemlm.model.accounting import decode_bytes_per_token
from stemlm.model.fusion import fuse_for_decoding, stored_transposed
from stemlm.model.presets import get_preset


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens (default 16)")
    p.add_argument("--new", type=int, default=64, help="new tokens per run (default 64)")
    p.add_argument("--reps", type=int, default=5, help="timed runs per model, round-robin (default 5)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--clock", choices=("cpu", "wall"), default="cpu", help="process CPU time or wall time")
    p.add_argument("--stream-mib", type=int, default=256, help="MiB read by the bandwidth probe (default 256)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--compile", action="store_true", help="also time tiny-dense with compiled decoding steps")
    args = p.parse_args(argv)
    if args.device != "cpu" and args.clock == "cpu":
        p.error("--clock cpu measures this process's CPU time, not a GPU's: use --clock wall with --device cuda")
    return args


def matvec_chain(model) -> list[tuple[torch.Tensor, bool]]:
    """The weight matrices a dense decode step multiplies by, in order, each in the layout the loaded model keeps it
    in (q/k/v and gate/up fused, and transposed where `stemlm.model.fusion.stored_transposed` says): (weight,
    transposed) pairs, a transposed one as [in, out]."""
    weights = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
        weights += [qkv, attn.o_proj.weight, gate_up, mlp.down_proj.weight]
    chain = []
    for w in [*weights, model.lm_head.weight]:  # distinct copies: none cached by the step
        transposed = stored_transposed(*w.shape, w.device)
        chain.append((w.detach().t().contiguous() if transposed else w.detach().clone(), transposed))
    return chain


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import LlamaForCausalLM

    stem_cfg, dense_cfg = get_preset("tiny"), get_preset("tiny-dense")
    device = torch.device(args.device)
    ours = {"stem": build_model(stem_cfg, seed=0).eval(), "dense": build_model(dense_cfg, seed=0).eval()}
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(ours["dense"], tmp)
        hf = LlamaForCausalLM.from_pretrained(tmp, torch_dtype=torch.float32).eval().to(device)
    ours = {name: model.to(device) for name, model in ours.items()}
    ours["unfused"] = build_model(dense_cfg, seed=0).eval().to(device)
    for name in ("stem", "dense"):
        fuse_for_decoding(ours[name])
    if args.compile:
        compiled = build_model(dense_cfg, seed=0).eval().to(device)
        fuse_for_decoding(compiled)
        ours["compiled"] = InferenceModel(compiled, compile=True)
        served = build_model(stem_cfg, seed=0).eval().to(device)
        fuse_for_decoding(served)
        serve_engine = BatchEngine(InferenceModel(served, compile=True), slots=1)
    prompt = torch.randint(0, dense_cfg.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(0))
    prompt = prompt.to(device)

    def run_ours(name):
        return lambda: generate(ours[name], prompt[0].tolist(), args.new, greedy=True)

    def run_hf():
        with torch.no_grad():
            out = hf.generate(
                prompt,
                max_new_tokens=args.new,
                min_new_tokens=args.new,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        return out[0, args.prompt :].tolist()

    stream = torch.ones(args.stream_mib * 2**18, device=device)  # fp32: 4 bytes an element

    def read_stream():
        return stream.sum().item()  # .item() waits for a GPU's reduction

    chain = matvec_chain(ours["dense"])
    vectors = {w.shape[t]: torch.randn(1, w.shape[t], device=device) for w, t in chain}

    def run_matvecs():
        for w, transposed in chain:
            y = vectors[w.shape[0]] @ w if transposed else F.linear(vectors[w.shape[1]], w)
        return y[0, 0].item()  # waits for a GPU's products

    def run_serve():
        request = serve_engine.submit(Request(prompt[0].tolist(), SamplingParams(max_tokens=args.new, temperature=0)))
        serve_engine.run_until_idle()
        return request.output_ids

    runs = {name: run_ours(name) for name in ours}
    if args.compile:
        runs["serve"] = run_serve
    runs |= {"hf": run_hf, "stream": read_stream, "matvec": run_matvecs}
    tokens = {name: fn() for name, fn in runs.items()}  # warm-up, and the outputs to compare
    if args.compile:
        runs["compiled"]()  # the second compile, for a dynamic cache length, is warm-up too
        runs["serve"]()
    times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    for rep in range(args.reps):
        for k in range(len(names)):
            name = names[(rep + k) % len(names)]
            start = clock()
            runs[name]()
            times[name].append(clock() - start)
    seconds = {name: statistics.median(ts) for name, ts in times.items()}
    bandwidth = stream.numel() * 4 / seconds.pop("stream")
    matvec_s = seconds.pop("matvec")
    names = [name for name in names if name in seconds]
    tok_s = {name: args.new / s for name, s in seconds.items()}
    context = args.prompt + args.new // 2
    bytes_tok = {
        n: decode_bytes_per_token(c, context, dtype_bytes=4)["total"]
        for n, c in (("stem", stem_cfg), ("dense", dense_cfg))
    }
    bytes_tok["hf"] = bytes_tok["unfused"] = bytes_tok["compiled"] = bytes_tok["dense"]
    bytes_tok["serve"] = bytes_tok["stem"]
    print(
        f"tiny, fp32 on {device}, threads={torch.get_num_threads()}, prompt {args.prompt} + {args.new} greedy tokens, "
        f"{args.reps} reps, {args.clock} clock; read bandwidth {bandwidth / 1e9:.1f} GB/s (same clock, median)"
    )
    print(f"{'model':<24} {'tok/s':>7} {'MB/token':>9} {'bound tok/s':>12} {'share of bound':>15}")
    labels = {
        "stem": "ours, tiny STEM",
        "dense": "ours, tiny-dense",
        "unfused": "ours, unfused",
        "compiled": "ours, compiled steps",
        "serve": "serve default (STEM)",
        "hf": "transformers, tiny-dense",
    }
    for name in names:
        bound = bandwidth / bytes_tok[name]
        print(
            f"{labels[name]:<24} {tok_s[name]:>7.0f} {bytes_tok[name] / 1e6:>9.1f} {bound:>12.0f} "
            f"{tok_s[name] / bound:>15.0%}"
        )
    matvec_share = bytes_tok["dense"] / matvec_s / bandwidth  # the share of a step made of nothing else: a ceiling
    print(
        f"the matrix-vector products of one dense step alone: {matvec_s * 1e3:.2f} ms "
        f"({sum(w.numel() for w, _ in chain) * 4 / matvec_s / 1e9:.1f} GB/s), {matvec_s * tok_s['dense']:.0%} of our "
        f"dense model's {1e3 / tok_s['dense']:.2f} ms a token; a step of them alone would reach "
        f"{matvec_share:.0%} of the bound"
    )
    same = tokens["dense"] == tokens["hf"] == tokens["unfused"]
    print(f"greedy tokens: ours dense == unfused == transformers: {same}")
    share = {name: tok_s[name] * bytes_tok[name] / bandwidth for name in names}
    compiled = ""
    if args.compile:
        print(f"greedy tokens: ours compiled == ours dense: {tokens['compiled'] == tokens['dense']}")
        print(f"greedy tokens: serve default == ours STEM: {tokens['serve'] == tokens['stem']}")
        compiled = (
            f" compiled_over_fused={tok_s['compiled'] / tok_s['dense']:.3f} "
            f"compiled_over_hf={tok_s['compiled'] / tok_s['hf']:.3f} compiled_share_of_bound={share['compiled']:.3f}"
            f" serve_share_of_bound={share['serve']:.3f} serve_tok_s={tok_s['serve']:.0f}"
        )
    print(
        f"RESULT ours_over_hf={tok_s['dense'] / tok_s['hf']:.3f} "
        f"fused_over_unfused={tok_s['dense'] / tok_s['unfused']:.3f} share_of_bound={share['dense']:.3f} "
        f"share_of_matvec={matvec_s * tok_s['dense']:.3f} matvec_share_of_bound={matvec_share:.3f} "
        f"stem_share_of_bound={share['stem']:.3f} hf_share_of_bound={share['hf']:.3f} ours_tok_s={tok_s['dense']:.0f} "
        f"hf_tok_s={tok_s['hf']:.0f} stem_tok_s={tok_s['stem']:.0f} bound_tok_s={bandwidth / bytes_tok['dense']:.0f}"
        f"{compiled}"
    )


if __name__ == "__main__":
    main()
